"""The run's accountant, fixed when the run is built (``p.accountant`` and
``p.optimizer.accountant``).

Every step records itself in the accountant the DP optimizer holds, and ``p.epsilon``
reads the one the run holds: both are the same object, made by ``make_private``. An
assignment of another accountant to either (``p.accountant = PrivacyAccountant()``, to
read the run with another method, or ``p.optimizer.accountant = ...``) would split them:
the epsilon reported would leave out the steps recorded in the other one, or the steps
taken from then on. The slot is therefore set once and read-only afterwards; the
accounting method is chosen by ``make_private(..., accountant="rdp")`` or per query,
``p.accountant.epsilon(delta, accountant="rdp")``.

The run's noise source and correlated noise (``p.optimizer.noise``,
``p.optimizer.correlated``) are :class:`RunPart` slots: once the run has steps, another
object in their place (one built and loaded with a saved state) would draw again the
noise of steps already released, as their refused ``load_state_dict`` would
(:func:`~privlearn.torch._state_checks.refuse_rewind`).
"""

from __future__ import annotations

from privlearn.errors import ConfigurationError

__all__ = ["RunAccountant", "RunPart"]

_SLOT = "_run_accountant"


class RunAccountant:
    """Data descriptor of the ``accountant`` attribute: set once (when the run is
    built), then read-only."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[_SLOT]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value) -> None:
        held = obj.__dict__.get(_SLOT)
        if held is not None and value is not held:
            raise AttributeError(
                f"{self.name} cannot be replaced: it is the accountant in which every step of "
                "this run is recorded (p.accountant and p.optimizer.accountant are one "
                "object), so another one would report an epsilon that leaves out steps the "
                "run took. To read the run with another accounting method, pass it per "
                "query, p.accountant.epsilon(delta, accountant='rdp'), or to make_private "
                "(accountant='rdp'); to continue a run, use p.load_state_dict(state). "
                "Nothing was changed"
            )
        obj.__dict__[_SLOT] = value

    def __delete__(self, obj) -> None:
        raise AttributeError(f"{self.name} cannot be deleted: it records every step of the run")


class RunPart:
    """Data descriptor of a part of the run that draws its noise (``noise``,
    ``correlated``): replaced freely before the run's first step (the new part then
    guards itself as the old one did, ``_run_history``), refused once the run has steps."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_run_part_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.slot]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value) -> None:
        held = obj.__dict__.get(self.slot)
        history = getattr(held, "_run_history", None)
        if value is not held and history is not None:
            if history.steps:
                raise ConfigurationError(
                    f"p.optimizer.{self.name} cannot be replaced once the run has taken "
                    f"steps (it has {history.steps}): another one (built and loaded with a "
                    "saved state, or seeded anew) would draw again the noise of steps "
                    "already released (one noise added to two gradients gives their "
                    "un-noised difference), accounted as fresh draws. To resume, load the "
                    "whole state into a freshly made run, p.load_state_dict(state), right "
                    "after make_private. Nothing was changed"
                )
            if value is not None:
                value._run_history = history
        obj.__dict__[self.slot] = value
