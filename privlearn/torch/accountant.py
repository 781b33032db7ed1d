"""The DP-SGD steps actually taken, and the objects the optimizer calls once per step.

* :class:`PrivacyAccountant`: the history. At every logical step the optimizer records
  the noise multiplier, the sampling rate and the clipping bound that the step *used*
  (:meth:`PrivacyAccountant.record_step`). Consecutive steps with the same values form
  one :class:`Segment`; the mechanism is their composition. Nothing can change the noise
  without the accountant seeing it: a noise schedule (``p.optimizer.noise_multiplier =
  0.5`` between steps) simply starts a new segment.
* :class:`BudgetCap`: ``max_epsilon`` (a hard cap, checked before the step) and
  ``planned_epsilon`` (a warning once past it).
* :class:`LedgerLink`: the run's reservations in a persistent privacy ledger.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

from privlearn import _validation as _v
from privlearn._opacus_names import missing_method
from privlearn._renamed import renamed_keywords
from privlearn.accounting import Sampling, compose, get_accountant
from privlearn.accounting.serialization import dumps, loads
from privlearn.correlated._fingerprint import strategy_fingerprint
from privlearn.errors import (
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyBudgetExceededError,
    PrivacyBudgetWarning,
    TrainingLoopError,
)
from privlearn.ledger import check_privacy_unit
from privlearn.torch._state_checks import entry, state_mapping
from privlearn.torch.schedule import compose_steps, dpsgd_step

__all__ = ["BudgetCap", "LedgerLink", "PrivacyAccountant", "PrivacyBudgetWarning", "Segment",
           "dpsgd_step"]

_STATE_FORMAT = "privlearn.torch.accountant/2"


@dataclass(frozen=True)
class Segment:
    """``steps`` consecutive DP-SGD steps that used the same parameters.

    Each step is ``subsample(Gaussian(noise_multiplier), rate=sampling_rate,
    scheme=scheme)``; ``max_grad_norm`` is recorded for the history (the privacy of a step
    depends only on the ratio noise std / clipping bound, i.e. on ``noise_multiplier``).
    """

    noise_multiplier: float
    sampling_rate: float
    max_grad_norm: float
    steps: int


#: Methods (and ``history``) of Opacus's ``PrivacyEngine`` and accountants that a user
#: coming from Opacus calls on what ``make_private`` returns (``p``) or on ``p.accountant``,
#: and what to use
#: (an AttributeError that says so, instead of Python's bare one).
OPACUS_METHODS = {
    "get_epsilon": "p.epsilon(delta), or p.accountant.epsilon(delta)",
    "get_privacy_spent": "p.epsilon(delta) (delta is the one you choose)",
    "make_private_with_epsilon": "make_private(model, optimizer, data_loader, "
                                 "target_epsilon=..., target_delta=..., epochs=...)",
    "save_checkpoint": "torch.save(p.state_dict(), path)",
    "load_checkpoint": "p.load_state_dict(torch.load(path, weights_only=True))",
    "history": "p.accountant.segments (runs of identical steps: noise_multiplier, "
               "sampling_rate, max_grad_norm, steps)",
    "get_optimizer_hook_fn": "nothing: p.optimizer records every step it takes in "
                             "p.accountant itself",
    "step": "p.accountant.record_step(noise_multiplier=..., sampling_rate=..., "
            "max_grad_norm=...) on an accountant of your own (p.optimizer records every "
            "step of p's itself)",
}


def opacus_method_error(owner: str, name: str) -> AttributeError:
    """The AttributeError for ``owner.name``: with :data:`OPACUS_METHODS`'s counterpart
    when ``name`` is a method of Opacus's, else Python's own wording."""
    return missing_method(owner, name, OPACUS_METHODS,
                          "a name of Opacus's PrivacyEngine or accountants")


def _checked_step(noise_multiplier, sampling_rate, max_grad_norm) -> tuple[float, ...]:
    """The values of one recorded step, checked: a step that no sampler or optimizer can
    have taken is refused before it enters (and corrupts) the history."""
    sigma = _v.check_nonnegative(
        "noise_multiplier", noise_multiplier,
        hint="the noise std divided by max_grad_norm that the step used (0: no noise)")
    q = _v.check_rate("sampling_rate", sampling_rate,
                      hint="the probability that an example is in the step's batch")
    c = _v.check_positive("max_grad_norm", max_grad_norm, allow_inf=True,
                          hint="the clipping bound the step used, e.g. 1.0")
    if math.isinf(c) and sigma > 0:
        raise ParameterValueError(
            f"max_grad_norm=inf (no clipping) with noise_multiplier={sigma!r}: an unclipped "
            "step has unbounded sensitivity, so its noise gives no privacy; record it with "
            "noise_multiplier=0 (epsilon is then inf) or with the finite bound it used")
    return sigma, q, c


class PrivacyAccountant:
    """The history of the DP-SGD steps actually taken, and its epsilon.

    Each step is the subsampled Gaussian mechanism :func:`dpsgd_step` with the noise
    multiplier and sampling rate it used; ``T`` steps compose adaptively (Abadi et al. 2016,
    Sec. 3.1; Mironov et al. 2019; the numbers come from the certified accountant named by
    ``accountant``). The history is a tuple of :class:`Segment` values (runs of identical
    steps); the only way to extend it is :meth:`record_step`, called by the optimizer
    with the values the step used. Budgets are a separate object (:class:`BudgetCap`), and
    so is the persistent ledger (:class:`LedgerLink`).

    Parameters
    ----------
    scheme : {"poisson", "fixed"}
        Subsampling scheme of every step (the sampler's).
    accountant : str
        Name of an accountant of :mod:`privlearn.accounting`.

    Attributes
    ----------
    prior : Mechanism or None
        What earlier runs on the same data released (e.g. the earlier ``train()`` calls
        of a Hugging Face trainer); composed with this run's steps in every epsilon and
        budget. Settable before the first step only.
    """

    def __init__(self, scheme: str = "poisson", accountant: str = "pld", run=None):
        #: a :class:`privlearn.torch.schedule.NoisePlan` that is not step by step (a
        #: matrix-factorization mechanism of all the steps taken), or None
        self.run = None if run is None or run.stepwise else run
        # checked here, so that a bad name fails before any step is recorded, not when
        # an epsilon of the recorded steps is first asked for (a run that is not step
        # by step names its sampling's registry entry, which its plan accounts)
        if self.run is None:
            scheme = _v.check_enum("scheme", scheme, Sampling).value
        self.scheme = scheme
        get_accountant(accountant)
        self.accountant = accountant
        #: the history, extended in place (adaptive clipping changes the bound, hence the
        #: segment, at every step: a tuple rebuilt per step made a run quadratic)
        self._segments: list[Segment] = []
        self._steps = 0
        self._prior = None

    @property
    def prior(self):
        return self._prior

    @prior.setter
    def prior(self, mechanism) -> None:
        if self._segments:
            raise TrainingLoopError(
                f"the prior of a run must be set before its first step, and this history "
                f"has {self.steps}; to compose earlier runs with a resumed one, call "
                "p.compose_after(prior) before p.load_state_dict(state) (in place of "
                "make_private(..., resume=state)): the history loaded keeps that prior")
        self._prior = mechanism

    # ------------------------------------------------------------------ history
    @property
    def segments(self) -> tuple[Segment, ...]:
        """The history: one :class:`Segment` per run of identical steps."""
        return tuple(self._segments)

    @property
    def steps(self) -> int:
        """Number of logical steps recorded."""
        return self._steps

    def __len__(self) -> int:
        """The number of logical steps recorded (:attr:`steps`), as ``len()`` of an
        Opacus accountant is documented to be; the number of runs of identical steps is
        ``len(accountant.segments)``."""
        return self._steps

    @property
    def noise_multiplier(self) -> float | None:
        """sigma of the last step taken (None before any; read-only: the optimizer's
        ``noise_multiplier`` is what the next step uses)."""
        return self._segments[-1].noise_multiplier if self._segments else None

    @property
    def sampling_rate(self) -> float | None:
        """q of the last step taken (None before any; read-only)."""
        return self._segments[-1].sampling_rate if self._segments else None

    def record_step(self, noise_multiplier: float, sampling_rate: float,
                    max_grad_norm: float) -> None:
        """Record one step that used these parameters.

        Raises
        ------
        ParameterValueError or ParameterTypeError
            A value no step can have used (a negative or non-finite noise multiplier, a
            sampling rate outside (0, 1], a clipping bound that is not positive, an
            infinite bound with noise); nothing is recorded.
        """
        cfg = _checked_step(noise_multiplier, sampling_rate, max_grad_norm)
        segs = self._segments
        if segs and (segs[-1].noise_multiplier, segs[-1].sampling_rate,
                     segs[-1].max_grad_norm) == cfg:
            segs[-1] = replace(segs[-1], steps=segs[-1].steps + 1)
        else:
            segs.append(Segment(*cfg, 1))
        self._steps += 1

    def __getattr__(self, name: str):  # only for missing attributes: Opacus's names
        raise opacus_method_error("PrivacyAccountant", name)

    def mechanism(self, extra: Segment | None = None):
        """The composed mechanism describing the steps taken (and ``extra`` steps after
        them); None when there are none."""
        segs = (*self._segments, *(() if extra is None else (extra,)))
        if self.run is not None:
            return self.run.composed(segs, self._prior)
        return compose_steps(segs, self.scheme, self._prior)

    def epsilon(self, delta: float, accountant: str | None = None,
                extra: Segment | None = None) -> float:
        """Certified upper bound on epsilon at ``delta`` for the steps taken so far (and
        ``extra`` steps after them): 0 before any step, ``inf`` if any step ran without
        noise. A ``delta`` outside [0, 1] is refused whatever the history (it once
        answered 0 before the first step and ``inf`` after a step without noise)."""
        delta = _v.check_delta("delta", delta, allow_one=True)
        segs = [*self._segments, *(() if extra is None else (extra,))]
        if not any(seg.steps > 0 for seg in segs) and self._prior is None:
            return 0.0
        if any(seg.noise_multiplier == 0 and seg.steps > 0 for seg in segs):
            return math.inf
        return self.mechanism(extra).epsilon(delta, accountant=accountant or self.accountant)

    # ------------------------------------------------------------------ state
    def state_dict(self, destination: dict | None = None) -> dict:
        """The history (plain Python types, a new copy at every call).

        ``destination``, as in Opacus's accountants and PyTorch's modules: a dict that
        receives the entries (its other keys are kept) and is returned; a new dict when
        None.
        """
        if destination is not None and not isinstance(destination, dict):
            raise ParameterTypeError(
                f"destination must be a dict (or None for a new one), got "
                f"{type(destination).__name__}")
        out = {} if destination is None else destination
        out.update({"format": _STATE_FORMAT, "scheme": self.scheme,
                    "accountant": self.accountant,
                    "segments": [[s.noise_multiplier, s.sampling_rate, s.max_grad_norm,
                                  s.steps] for s in self._segments],
                    "prior": None if self._prior is None else dumps(self._prior)})
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore a history saved by :meth:`state_dict` (same scheme and accountant)
        into this accountant, which must not have recorded a step yet.

        Raises
        ------
        ConfigurationError
            This accountant already recorded steps (replacing its history would drop
            them from every later epsilon), the state was saved with another scheme
            or accountant, or both it and this accountant have a :attr:`prior`, not the
            same (one would be left out of every later epsilon; a prior of this one's
            and none saved: it is kept, composed with the saved history).
        ParameterValueError or ParameterTypeError
            The state is not one :meth:`state_dict` writes (a missing entry, an entry of
            the wrong type, a segment of no steps, a fractional or negative count, a
            NaN or another value no step can have used). Nothing is changed when this
            raises.
        """
        segments, prior = self._read_state(state)
        # a prior set before the load (p.compose_after) and none saved: the earlier runs
        # still came before this history, so they stay composed with it
        self._segments, self._prior = list(segments), self._prior if prior is None else prior
        self._steps = sum(seg.steps for seg in segments)

    def _read_state(self, state: dict) -> tuple[tuple[Segment, ...], object]:
        """:meth:`load_state_dict`'s reading and refusals, before anything is changed:
        the saved segments and prior."""
        what = "the accountant's state"
        state_mapping(state, what, _ACCOUNTANT_HINT)
        if state.get("format") != _STATE_FORMAT:
            raise ParameterValueError(
                f"state is not a privlearn accountant state (format {_STATE_FORMAT!r}, got "
                f"{state.get('format')!r}); {_ACCOUNTANT_HINT}")
        if self._segments:
            raise ConfigurationError(
                f"load_state_dict needs an accountant with no steps, but this one has "
                f"recorded {self.steps}: replacing its history would drop them from every "
                "later epsilon. Load the saved state into a new PrivacyAccountant")
        for key in ("scheme", "accountant"):
            saved = entry(state, key, what, _ACCOUNTANT_HINT, str)
            if saved != getattr(self, key):
                raise ConfigurationError(
                    f"the saved accountant used {key}={saved!r}, this one "
                    f"{getattr(self, key)!r}; rebuild with the same settings")
        segments = []
        for i, seg in enumerate(entry(state, "segments", what, _ACCOUNTANT_HINT,
                                      (list, tuple))):
            name = f"{what}['segments'][{i}]"
            if not isinstance(seg, list | tuple) or len(seg) != 4:
                raise ParameterTypeError(
                    f"{name} must be a list [noise_multiplier, sampling_rate, "
                    f"max_grad_norm, steps], got {seg!r}; {_ACCOUNTANT_HINT}")
            try:
                values = _checked_step(*seg[:3])
            except (ParameterTypeError, ParameterValueError) as exc:
                raise type(exc)(f"{name}: {exc}; {_ACCOUNTANT_HINT}") from None
            segments.append(Segment(*values, _v.check_count(
                f"{name} steps", seg[3], minimum=1, integral_floats=False,
                hint="a saved segment has at least one step; " + _ACCOUNTANT_HINT)))
        prior = entry(state, "prior", what, _ACCOUNTANT_HINT, optional=True)
        try:
            prior = None if prior is None else loads(prior)
        except (ParameterTypeError, ParameterValueError) as exc:
            raise type(exc)(f"{what}['prior']: {exc}; {_ACCOUNTANT_HINT}") from None
        if (prior is not None and self._prior is not None
                and dumps(prior) != dumps(self._prior)):
            raise ConfigurationError(
                "the saved accountant was composed after earlier runs (its prior) and "
                "this one after other earlier runs (a prior set before the load, e.g. by "
                "p.compose_after): loading would keep one of them out of every later "
                "epsilon. Load the state into an accountant without a prior (its own is "
                "restored with it), or compose the two priors into one first")
        return tuple(segments), prior


#: What a refused accountant state should have been.
_ACCOUNTANT_HINT = ("pass the dict returned by PrivacyAccountant.state_dict() (or the "
                    "'accountant' entry of PrivateTraining.state_dict()) of the same run")


class BudgetCap:
    """The budgets of one run, checked once per step against an accountant's history.

    ``max_epsilon`` is a hard cap: :meth:`check` raises
    :class:`~privlearn.errors.PrivacyBudgetExceededError` *before* the step that would take
    epsilon at ``delta`` past it. ``planned_epsilon`` is a soft one: :meth:`after_step`
    emits one :class:`PrivacyBudgetWarning` after the first step past it. Neither
    evaluates epsilon at every step: when the step configuration changes, the room left
    (how many more steps of that configuration stay within each cap) is found by
    bisection over the number of steps, epsilon being non-decreasing in it, and counted
    down.

    Parameters
    ----------
    accountant : PrivacyAccountant
    delta : float
    max_epsilon, planned_epsilon : float, optional
    planned_steps : int, optional
        A guess of the room (speeds up the first search).
    beyond : str, optional
        What the refusal tells the user to do to go further, when the steps ran as
        planned (a refused step without noise, or a budget spent early by a lowered
        noise multiplier, is told its own cause).
    planned_noise_multiplier : float, optional
        The noise multiplier the run was planned with.
    capped_at_plan : bool
        Whether ``max_epsilon`` is the smaller of the ``max_epsilon`` the user gave
        (``given_max_epsilon``, None: none) and the plan's epsilon (a run accounted as one
        mechanism cannot go past its plan): messages then name which number the cap is
        (:attr:`cap_name`).
    given_max_epsilon : float, optional
    """

    def __init__(self, accountant: PrivacyAccountant, *, delta: float,
                 max_epsilon: float | None = None, planned_epsilon: float | None = None,
                 planned_steps: int | None = None, beyond: str | None = None,
                 planned_noise_multiplier: float | None = None,
                 capped_at_plan: bool = False, given_max_epsilon: float | None = None):
        self.accountant = accountant
        self.capped_at_plan = capped_at_plan
        self.given_max_epsilon = (None if given_max_epsilon is None
                                  or math.isinf(given_max_epsilon)
                                  else float(given_max_epsilon))
        self.planned_steps = planned_steps
        self.planned_noise_multiplier = planned_noise_multiplier
        self.delta = float(delta)
        self.max_epsilon = (None if max_epsilon is None or math.isinf(max_epsilon)
                            else float(max_epsilon))
        self.beyond = beyond or ("stop training here, or plan a larger budget (or more "
                                 "noise) before training")
        # an infinite plan (a run without noise) is never gone past
        self.planned_epsilon = (None if planned_epsilon is None or math.isinf(planned_epsilon)
                                else float(planned_epsilon))
        self._hint = max(2, int(planned_steps)) if planned_steps else 64
        self._room = _Room()
        self._config: tuple[float, float] | None = None
        self._warned = False

    @property
    def cap_name(self) -> str:
        """The cap in words for a message: ``max_epsilon=<value>`` when it is the value
        the user gave, else the plan's epsilon, naming the ``max_epsilon`` given (if
        any) apart from it."""
        cap, given = self.max_epsilon, self.given_max_epsilon
        if cap is None or not self.capped_at_plan or (given is not None and cap >= given):
            return f"max_epsilon={cap:g}"
        return (f"the planned epsilon {cap:g} (a run accounted as one matrix-factorization "
                "mechanism is capped at its plan; "
                + ("no max_epsilon was given" if given is None else
                   f"max_epsilon={given:g} is larger") + ")")

    def rebase(self, *, max_epsilon: float | None, planned_epsilon: float | None) -> None:
        """New caps for a run whose history changed before its first step (a prior
        composed in: :meth:`PrivateTraining.compose_after
        <privlearn.torch.privacy_engine.PrivateTraining.compose_after>`); the room left
        is computed again at the next check."""
        self.max_epsilon = (None if max_epsilon is None or math.isinf(max_epsilon)
                            else float(max_epsilon))
        self.planned_epsilon = (None if planned_epsilon is None
                                or math.isinf(planned_epsilon) else float(planned_epsilon))
        self._room = _Room()
        self._config = None

    def _room_for(self, cap: float, sigma: float, q: float) -> int:
        """Largest ``k >= 0`` such that the history plus ``k`` steps of ``(sigma, q)``
        stays within ``cap`` at ``delta``."""
        acct = self.accountant
        # a strategy fixed to its steps (a dense one) defines no step past them: no room
        limit = getattr(acct.run, "max_steps", None)

        def eps_with(k: int) -> float:
            if limit is not None and acct.steps + k > limit:
                return math.inf
            return acct.epsilon(self.delta, extra=Segment(sigma, q, 0.0, k))

        return _largest_within(eps_with, cap, start=max(1, self._hint - acct.steps))

    def check(self, noise_multiplier: float, sampling_rate: float) -> None:
        """Raise :class:`PrivacyBudgetExceededError` if one more step with these values
        would exceed ``max_epsilon`` (nothing is changed then)."""
        cfg = (float(noise_multiplier), float(sampling_rate))
        if cfg != self._config:  # a new mechanism: the room left changes
            self._room = _Room()
            self._config = cfg
        if self.max_epsilon is None:
            return
        if self._room.cap is None:
            self._room = replace(self._room, cap=self._room_for(self.max_epsilon, *cfg))
        if self._room.cap < 1:
            acct = self.accountant
            raise PrivacyBudgetExceededError(
                f"the next step would exceed {self.cap_name} at "
                f"delta={self.delta:g} (spent so far: {acct.epsilon(self.delta):.6g} after "
                f"{acct.steps} steps); the step was not taken: {self._cause(*cfg)}")

    def _cause(self, sigma: float, q: float) -> str:
        """Why the budget cannot hold the next step, and what to do: a step without
        noise, a noise multiplier lowered below the plan's, else :attr:`beyond`."""
        if sigma == 0:
            return ("this step has noise_multiplier=0: a step without noise has an infinite "
                    "epsilon, which no finite max_epsilon holds, however few steps were "
                    "taken. Set p.optimizer.noise_multiplier back to a positive value, or "
                    "stop training here")
        planned = self.planned_noise_multiplier
        used = {s.noise_multiplier for s in self.accountant.segments} | {sigma}
        lowered = sorted(v for v in used if planned is not None and v < planned)
        if lowered:
            steps = (f"{self.accountant.steps} of the planned {self.planned_steps} steps"
                     if self.planned_steps else f"{self.accountant.steps} steps")
            return (f"steps at noise_multiplier {', '.join(f'{v:g}' for v in lowered)}, "
                    f"below the run's {planned:g} (p.optimizer.noise_multiplier was lowered "
                    f"during the run), spend the budget faster: it is used up after {steps}. "
                    f"Set p.optimizer.noise_multiplier back to {planned:g} or more, or stop "
                    "training here")
        return self.beyond

    def exhausted(self, noise_multiplier: float, sampling_rate: float) -> bool:
        """Whether :meth:`check` would refuse the next step."""
        try:
            self.check(noise_multiplier, sampling_rate)
        except PrivacyBudgetExceededError:
            return True
        return False

    def after_step(self) -> None:
        """Count the step just recorded down from the room left; warn once past the plan."""
        if self._room.cap is not None:
            self._room = replace(self._room, cap=self._room.cap - 1)
        if self.planned_epsilon is None or self._warned or self._config is None:
            return
        if self._room.plan is None:
            # room counted *after* this step: k more steps from here stay within plan
            self._room = replace(self._room, plan=self._room_for(self.planned_epsilon,
                                                                 *self._config))
        else:
            self._room = replace(self._room, plan=self._room.plan - 1)
        if self._room.plan < 0:
            self._warned = True
            acct = self.accountant
            warnings.warn(
                f"training went past its planned epsilon {self.planned_epsilon:g} at "
                f"delta={self.delta:g}: {acct.steps} steps now spend "
                f"{acct.epsilon(self.delta):.6g}. Pass max_epsilon to make_private to stop "
                "at a hard cap", PrivacyBudgetWarning, stacklevel=4)

    def state_dict(self) -> dict:
        return {"warned": self._warned}

    @staticmethod
    def read_state(state: dict) -> bool:
        """The ``warned`` flag of a state :meth:`state_dict` wrote (False when absent),
        refused unless the state is a dict and the flag a bool."""
        hint = "pass the 'budget' entry of PrivateTraining.state_dict() of the same run"
        state_mapping(state, "the budget's state", hint)
        return bool(entry(state, "warned", "the budget's state", hint, bool, optional=True))

    def load_state_dict(self, state: dict) -> None:
        warned = self.read_state(state)
        self._warned = warned
        self._room = _Room()
        self._config = None


class LedgerLink:
    """Records a training run's steps in a persistent privacy ledger as it proceeds.

    Steps are *reserved* ahead in chunks (:meth:`privlearn.ledger.Ledger.reserve`): the
    first chunk (the planned run, or ``chunk`` steps without a plan) when the link is
    made, before any data is touched, and a new one whenever the next step is not covered
    (more steps than planned, or a changed noise multiplier). A reserved chunk counts in
    full until :meth:`settle` records how many of its steps ran, so a process killed at
    step ``k`` leaves at least ``k`` steps in the ledger. A planned run the budget cannot
    hold whole is refused (:class:`~privlearn.errors.BudgetExceededError`) before it
    starts; any other chunk the budget cannot hold is retried at half the size down to one
    step, and a single step it cannot hold raises ``BudgetExceededError`` before the step
    runs.

    Parameters
    ----------
    handle
        A budget handle, ``Ledger(path).budget(dataset)`` (anything with
        ``reserve(mechanism, *, label)`` returning an object with ``settle(mechanism)``;
        for a run accounted as one mechanism, also ``metadata=``: its noise strategy).
    scheme : str
        Subsampling scheme of the steps.
    chunk : int
        Steps reserved at a time beyond the plan.
    label : str
    process_group : optional
        A distributed run's torch.distributed group: the run is one mechanism, so only
        the group's first rank writes to the ledger (its ``handle``; the other ranks'
        is not used and may be ``None``) and every other rank follows its decisions
        (:func:`~privlearn.torch.distributed.first_rank_decides`): the steps each
        reservation covers, or the error that refused it, raised on all ranks alike.
        ``None`` (default): one process, which writes (``torch.distributed.group.WORLD``
        for the default group of a distributed run).
    """

    def __init__(self, handle, *, scheme: str, chunk: int, label: str, run=None,
                 privacy_unit: str = "example", process_group=None):
        from privlearn.torch.distributed import world_info

        rank, world = (0, 1) if process_group is None else world_info(process_group)
        #: whether this process writes to the ledger (the only one, or a group's first)
        self.writes = rank == 0
        self._group = process_group if world > 1 else None

        def check() -> None:
            if not callable(getattr(handle, "reserve", None)):
                raise ParameterTypeError("ledger must be a budget handle, e.g. "
                                         f"Ledger(path).budget('dataset'), got {handle!r}")
            wanted = "user" if privacy_unit == "user" else "record"
            check_privacy_unit(
                handle, wanted, spender=f"this run (privacy unit {privacy_unit!r})",
                remedy=f"Use Ledger(path).budget(dataset, privacy_unit={wanted!r})"
                + ("" if wanted == "user" else ", or pass users= (and "
                   "max_examples_per_user=) to make_private for a per-user guarantee")
                + ".")

        self._decided(check)
        self.handle = handle if self.writes else None
        self.scheme = scheme
        self.chunk = max(1, int(chunk))
        self.label = label
        #: a run accounted as one mechanism (correlated noise): reserved whole, once
        self.run = run
        self._open: list[_Reservation] = []  # the reservations not settled yet
        self._refused = False  # a step was refused after a reservation (see refused)
        #: the ledger reservations (seq, hash) of the planned run, in a checkpoint's
        #: privacy state so that a resume recognises them; its planned steps; and the
        #: steps of the checkpoint a resume took them over from (None: a fresh run)
        self.lineage: list[tuple[int, str]] = []
        self.plan_steps: int | None = None
        self.resumed: int | None = None

    def _decided(self, fn):
        """``fn()`` here (one process), or on the group's first rank and followed by the
        others (:func:`~privlearn.torch.distributed.first_rank_decides`)."""
        if self._group is None:
            return fn()
        from privlearn.torch.distributed import first_rank_decides

        return first_rank_decides(fn, self._group)

    def _mech(self, sigma: float, q: float, k: int):
        if self.run is not None:
            return self.run.mechanism(sigma, k)
        return compose(dpsgd_step(sigma, q, self.scheme), steps=k)

    def _metadata(self, steps: int) -> dict:
        """The keywords of a reservation of ``steps`` steps beyond its mechanism: a run
        accounted as one mechanism names its noise strategy (the entry's metadata
        ``noise_strategy``: strategies of one sensitivity give the same mechanism, and
        the entry says which ran); none for DP-SGD steps (the mechanism says it all)."""
        if self.run is None:
            return {}
        return {"metadata": {"noise_strategy": strategy_fingerprint(self.run.strategy, steps)}}

    @renamed_keywords("LedgerLink.reserve", sigma="noise_multiplier", q="sampling_rate")
    def reserve(self, noise_multiplier: float, sampling_rate: float, steps: int, *,
                whole: bool = False) -> None:
        """Reserve ``steps`` steps (fewer, down to one, if the budget cannot hold them;
        ``whole``: all of them or :class:`~privlearn.errors.BudgetExceededError`, for a
        planned run, refused before it starts rather than stopped part-way). ``sigma=``
        and ``q=``, the former keywords (here and in the methods below), are deprecated."""
        sigma, q = noise_multiplier, sampling_rate
        made = []

        def reserve() -> int:  # on the writing rank: the steps reserved
            n = max(1, int(steps))
            while True:
                try:
                    made.append(self.handle.reserve(self._mech(sigma, q, n),
                                                    label=self.label, **self._metadata(n)))
                    return n
                except PrivacyBudgetExceededError:
                    if n == 1 or whole:
                        raise
                    n = max(1, n // 2)

        n = self._decided(reserve)
        self._open.append(_Reservation(made[0] if made else None, sigma, q, n))
        entry = getattr(made[0], "entry", None) if made else None
        if whole and entry is not None:  # a planned run: what a checkpoint names
            self.lineage, self.plan_steps = [(entry.seq, entry.hash)], n

    @renamed_keywords("LedgerLink.covered", sigma="noise_multiplier", q="sampling_rate")
    def covered(self, noise_multiplier: float, sampling_rate: float) -> bool:
        """Whether the next step of this configuration is covered by an open reservation
        (every rank of a group gets the same answer: their reservations are the first
        rank's)."""
        sigma, q = noise_multiplier, sampling_rate
        if not self._open:
            return False
        last = self._open[-1]
        return (last.sigma, last.q) == (sigma, q) and last.used < last.reserved

    @renamed_keywords("LedgerLink.ensure", sigma="noise_multiplier", q="sampling_rate")
    def ensure(self, noise_multiplier: float, sampling_rate: float) -> None:
        """Make sure the next step of this configuration is covered by a reservation."""
        sigma, q = noise_multiplier, sampling_rate
        if self.covered(sigma, q):
            return
        if self.run is not None and self._open:
            # the run's mechanism is not a composition of chunks: no step past the plan,
            # and none at another configuration than the one its reservation describes
            last = self._open[-1]
            if last.used < last.reserved:
                raise PrivacyBudgetExceededError(
                    "a run accounted as one matrix-factorization mechanism reserved its "
                    f"planned {last.reserved} steps in the ledger at noise_multiplier="
                    f"{last.sigma:g} (sampling_rate {last.q:g}), and {last.used} of them "
                    f"ran; the next step would run at noise_multiplier={sigma:g} "
                    f"(sampling_rate {q:g}), which that reservation does not describe (the "
                    "run is one mechanism of one noise multiplier). The step was not "
                    f"taken: set p.optimizer.noise_multiplier back to {last.sigma!r}, or "
                    "plan another run with make_private at the noise multiplier wanted")
            raise PrivacyBudgetExceededError(
                "a run accounted as one matrix-factorization mechanism reserved its planned "
                f"{last.reserved} steps in the ledger, and they are all taken; plan a "
                "longer run")
        self.reserve(sigma, q, self.chunk)

    @renamed_keywords("LedgerLink.used", sigma="noise_multiplier", q="sampling_rate")
    def used(self, noise_multiplier: float, sampling_rate: float) -> None:
        """One step of this configuration ran (it was covered by :meth:`ensure`)."""
        last = self._open[-1]
        self._open[-1] = replace(last, used=last.used + 1)

    def refused(self, exc: BaseException) -> None:
        """A step was refused by ``exc`` after the run's reservation was made, by a check
        that may depend on the data's values (a non-finite input or per-example gradient,
        the batch-independence probe, the user's loss): :meth:`settle` then charges every
        open reservation at its plan, in full. Settled at the steps that ran, the entry
        would show the ledger's readers whether (and when) a record failed the check;
        the plan covers every step that ran (charging more is safe, less is not). Running
        out of budget (:class:`PrivacyBudgetExceededError`) depends on the budget alone
        and settles at the steps that ran."""
        if not isinstance(exc, PrivacyBudgetExceededError):
            self._refused = True

    def settle(self) -> None:
        """Record how many steps of each open reservation ran (idempotent); after
        :meth:`refused`, each open reservation at its plan.

        A run accounted as one matrix-factorization mechanism and stopped early (early
        stopping, an interrupted loop) settles at its plan: its first ``k`` steps are a
        prefix of the planned mechanism's outputs (post-processing of it, so the plan
        covers them), but not a sub-composition the ledger can check, as
        ``run.mechanism(sigma, k)`` has another sensitivity."""
        refused, self._refused = self._refused, False
        while self._open:
            o = self._open.pop(0)
            if o.reservation is None:  # a rank that follows the writing one
                continue
            if refused or (self.run is not None and 0 < o.used < o.reserved):
                o.reservation.settle(None)  # the plan
            else:
                n = max(0, o.used - o.replayed)  # (a resumed run's replayed steps)
                o.reservation.settle(self._mech(o.sigma, o.q, n) if n else compose([]))


@dataclass(frozen=True, slots=True)
class _Room:
    """Steps left for the current configuration (None: not computed yet): within the
    hard cap ``max_epsilon`` (``cap``) and, counted after the last step, within the
    planned epsilon (``plan``)."""

    cap: int | None = None
    plan: int | None = None


@dataclass(frozen=True, slots=True)
class _Reservation:
    """A chunk of steps reserved in the ledger and not settled yet: the ledger's
    reservation (``None`` on a distributed rank that does not write), the configuration
    it covers, how many steps it reserved and how many of them ran; ``replayed``: of a
    resumed run, the steps at its start that the ledger already counts (they replay the
    interrupted run's batches and noise), negative for steps of the checkpoint's history
    it does not count yet."""

    reservation: object
    sigma: float
    q: float
    reserved: int
    used: int = 0
    replayed: int = 0


def _largest_within(f: Callable[[int], float], cap: float, start: int = 64) -> int:
    """Largest ``k >= 0`` with ``f(k) <= cap`` for non-decreasing ``f``; ``-1`` when even
    ``f(0) > cap``; past ``2**40`` steps the last one checked (at least ``2**39``:
    "unbounded", yet within ``cap``). ``start`` is a guess of the answer (the
    planned number of steps): when it is right, three evaluations settle it."""
    if f(0) > cap:
        return -1
    start = max(1, int(start))
    if f(start) <= cap:
        if f(start + 1) > cap:
            return start
        lo, hi = start + 1, 2 * (start + 1)
        while f(hi) <= cap:
            lo, hi = hi, hi * 2
            if hi > 2**40:
                return lo  # checked within cap (2**40 itself was never evaluated)
    else:
        lo, hi = 0, start
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid) <= cap:
            lo = mid
        else:
            hi = mid
    return lo
