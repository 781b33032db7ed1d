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
"""

from __future__ import annotations

__all__ = ["RunAccountant"]

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
