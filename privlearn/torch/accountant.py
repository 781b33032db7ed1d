"""Ledger of the DP-SGD steps actually taken, evaluated by :mod:`privlearn.accounting`.

The accountant is told, at every logical step, the noise multiplier, the sampling rate
and the clipping bound that the step *used* (:meth:`PrivacyAccountant.record_step`,
called by :class:`~privlearn.torch.DPOptimizer` with its live values). Consecutive steps
with the same values form one *segment*; the history is the list of segments, and the
mechanism is their composition. Nothing can change the noise without the accountant
seeing it: a noise schedule (``p.optimizer.noise_multiplier = 0.5`` between steps) simply
starts a new segment.

Budgets: ``max_epsilon`` (a hard cap: the step that would take epsilon at ``delta`` past
it raises :class:`~privlearn.errors.PrivacyBudgetExceededError` *before* it runs) and
``planned_epsilon`` (a soft one: a :class:`PrivacyBudgetWarning` is emitted once, after
the first step that goes past it). Both are checked without evaluating epsilon at every
step: when the step configuration changes, the accountant finds (by bisection over the
number of steps, epsilon being monotone in it) how many more steps of that configuration
stay within each cap, and counts down.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.errors import PrivacyBudgetExceededError

__all__ = ["PrivacyAccountant", "PrivacyBudgetWarning", "Segment", "LedgerLink"]

_STATE_FORMAT = "privlearn.torch.accountant/1"


def dpsgd_step(noise_multiplier: float, sampling_rate: float, scheme: str = "poisson"):
    """The mechanism of one DP-SGD step: ``subsample(Gaussian(noise_multiplier),
    rate=sampling_rate, scheme=scheme)`` (Abadi et al. 2016, Sec. 3.1) -- the one place the
    engine, its accountant and its ledger records describe a step."""
    return subsample(Gaussian(noise_multiplier), rate=sampling_rate, scheme=scheme)


class PrivacyBudgetWarning(UserWarning):
    """Training went past the epsilon it was planned (calibrated) for."""


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


class PrivacyAccountant:
    """Records logical optimizer steps and answers ``epsilon(delta)`` for them.

    Each step is the subsampled Gaussian mechanism
    ``subsample(Gaussian(noise_multiplier), rate=sampling_rate, scheme=scheme)``; ``T``
    steps compose adaptively (Abadi et al. 2016, Sec. 3.1; Mironov et al. 2019; the
    numbers come from the certified accountant named by ``accountant``).

    Parameters
    ----------
    noise_multiplier : float
        sigma of the first step (the steps themselves record what they used).
    sampling_rate : float
        q of the first step.
    scheme : {"poisson", "fixed"}
        Subsampling scheme of every step.
    accountant : str
        Name of an accountant of :mod:`privlearn.accounting`.
    max_grad_norm : float
        Clipping bound of the first step (recorded in the history).
    """

    def __init__(self, noise_multiplier: float, sampling_rate: float, scheme: str = "poisson",
                 accountant: str = "pld", max_grad_norm: float = 1.0):
        self.sampling_rate = float(sampling_rate)
        self.scheme = scheme
        self.accountant = accountant
        self._current = (float(noise_multiplier), float(sampling_rate), float(max_grad_norm))
        self._segments: list[list] = []  # [sigma, q, C, steps]
        self._owner = None  # the DPOptimizer whose live values the steps record
        # budgets (see module docstring)
        self.delta: float | None = None
        self.max_epsilon: float | None = None
        self.planned_epsilon: float | None = None
        self._warned = False
        self._room: dict[str, int | None] = {"max": None, "plan": None}
        self._hint = 64  # first guess of the number of steps within a cap (the plan)
        self.ledger_link: LedgerLink | None = None

    # ------------------------------------------------------------------ history
    @property
    def segments(self) -> tuple[Segment, ...]:
        """The history: one :class:`Segment` per run of identical steps."""
        return tuple(Segment(s, q, c, k) for s, q, c, k in self._segments)

    @property
    def history(self) -> list[tuple[float, int]]:
        """``[(noise_multiplier, steps), ...]`` per segment (older form of
        :attr:`segments`)."""
        return [(s, k) for s, _, _, k in self._segments]

    @property
    def noise_multiplier(self) -> float:
        """sigma of the last step taken (of the first step before any)."""
        return self._segments[-1][0] if self._segments else self._current[0]

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        warnings.warn("setting accountant.noise_multiplier is deprecated: set "
                      "p.optimizer.noise_multiplier (the noise the steps add); the "
                      "accountant records what each step used", DeprecationWarning,
                      stacklevel=2)
        if self._owner is None:
            raise AttributeError("this accountant records the noise of the steps it is told "
                                 "about; change the optimizer's noise_multiplier instead")
        self._owner.noise_multiplier = value

    @property
    def steps(self) -> int:
        """Number of logical steps recorded."""
        return sum(seg[3] for seg in self._segments)

    def record_step(self, noise_multiplier: float, sampling_rate: float,
                    max_grad_norm: float) -> None:
        """Record one step that used these parameters (checks the budget first).

        Raises
        ------
        PrivacyBudgetExceededError
            The step would take epsilon at ``delta`` past ``max_epsilon``; nothing is
            recorded (the caller must not run the step).
        """
        self.check_step_with(noise_multiplier, sampling_rate, max_grad_norm)
        cfg = self._current
        if self._segments and tuple(self._segments[-1][:3]) == cfg:
            self._segments[-1][3] += 1
        else:
            self._segments.append([*cfg, 1])
        if self.ledger_link is not None:
            self.ledger_link.used(cfg[0], cfg[1])
        self._count_down()

    def step(self, n: int = 1) -> None:
        """Record ``n`` steps with the parameters of the last step (or the initial ones)."""
        for _ in range(int(n)):
            self.record_step(*self._current)

    def mechanism(self):
        """The composed mechanism describing the steps taken (None before any step)."""
        return self._compose([(s, q, k) for s, q, _, k in self._segments])

    def _compose(self, parts):
        merged: list[list] = []
        for s, q, k in parts:
            if k <= 0:
                continue
            if merged and merged[-1][0] == s and merged[-1][1] == q:
                merged[-1][2] += k  # same mechanism (the clipping bound does not matter)
            else:
                merged.append([s, q, k])
        parts = merged
        if not parts:
            return None
        mechs = [dpsgd_step(s, q, self.scheme) for s, q, _ in parts]
        return compose(mechs, steps=[k for _, _, k in parts])

    def _epsilon_of(self, parts, delta: float, accountant: str | None = None) -> float:
        parts = [p for p in parts if p[2] > 0]
        if not parts:
            return 0.0
        if any(s == 0 for s, _, _ in parts):
            return math.inf
        return self._compose(parts).epsilon(delta, accountant=accountant or self.accountant)

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """Certified upper bound on epsilon at ``delta`` for the steps taken so far
        (0 before any step; ``inf`` if any step ran without noise)."""
        return self._epsilon_of([(s, q, k) for s, q, _, k in self._segments], delta,
                                accountant)

    # ------------------------------------------------------------------ budgets
    def set_budget(self, *, delta: float, max_epsilon: float | None = None,
                   planned_epsilon: float | None = None, planned_steps: int | None = None
                   ) -> None:
        """Set the hard cap ``max_epsilon`` and the soft ``planned_epsilon`` at ``delta``
        (``planned_steps``, if known, speeds up the search for the room left)."""
        self.delta = float(delta)
        if planned_steps:
            self._hint = max(2, int(planned_steps))
        self.max_epsilon = None if max_epsilon is None else float(max_epsilon)
        self.planned_epsilon = None if planned_epsilon is None else float(planned_epsilon)
        self._room = {"max": None, "plan": None}

    def _room_for(self, cap: float) -> int:
        """Largest ``k >= 0`` such that the history plus ``k`` steps of the current
        configuration stays within ``cap`` at ``self.delta`` (bisection; epsilon is
        non-decreasing in the number of steps)."""
        s, q, _ = self._current
        past = [(a, b, k) for a, b, _, k in self._segments]

        def eps_with(k: int) -> float:
            return self._epsilon_of(past + [(s, q, k)], self.delta)

        return _largest_within(eps_with, cap, start=max(1, self._hint - self.steps))

    def check_step_with(self, noise_multiplier: float, sampling_rate: float,
                        max_grad_norm: float) -> None:
        """:meth:`check_step` for a step with these parameters (which become current)."""
        cfg = (float(noise_multiplier), float(sampling_rate), float(max_grad_norm))
        if cfg[:2] != self._current[:2]:  # a new mechanism: the room left changes
            self._room = {"max": None, "plan": None}
        self._current = cfg
        self.check_step()
        if self.ledger_link is not None:
            self.ledger_link.ensure(cfg[0], cfg[1])

    def check_step(self) -> None:
        """Raise :class:`PrivacyBudgetExceededError` if one more step of the current
        configuration would exceed ``max_epsilon``."""
        if self.max_epsilon is None:
            return
        if self._room["max"] is None:
            self._room["max"] = self._room_for(self.max_epsilon)
        if self._room["max"] < 1:
            spent = self.epsilon(self.delta)
            raise PrivacyBudgetExceededError(
                f"the next step would exceed max_epsilon={self.max_epsilon:g} at "
                f"delta={self.delta:g} (spent so far: {spent:.6g} after {self.steps} "
                "steps); the step was not taken. Stop training here, or plan a larger "
                "budget (or more noise) before training")

    def _count_down(self) -> None:
        if self._room["max"] is not None:
            self._room["max"] -= 1
        if self.planned_epsilon is None or self._warned:
            return
        if self._room["plan"] is None:
            # room counted *after* this step: k more steps from here stay within plan
            self._room["plan"] = self._room_for(self.planned_epsilon)
        else:
            self._room["plan"] -= 1
        if self._room["plan"] < 0:
            self._warned = True
            warnings.warn(
                f"training went past its planned epsilon {self.planned_epsilon:g} at "
                f"delta={self.delta:g}: {self.steps} steps now spend "
                f"{self.epsilon(self.delta):.6g}. Pass max_epsilon to make_private to stop "
                "at a hard cap", PrivacyBudgetWarning, stacklevel=4)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The history and budget state (plain Python types)."""
        return {"format": _STATE_FORMAT, "scheme": self.scheme, "accountant": self.accountant,
                "segments": [list(seg) for seg in self._segments],
                "current": list(self._current), "warned": self._warned}

    def load_state_dict(self, state: dict) -> None:
        """Restore a history saved by :meth:`state_dict` (same scheme and accountant)."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError("state is not a privlearn accountant state (format "
                             f"{_STATE_FORMAT!r}); pass what state_dict() returned")
        for key in ("scheme", "accountant"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the saved accountant used {key}={state[key]!r}, this one "
                                 f"{getattr(self, key)!r}; rebuild with the same settings")
        self._segments = [[float(s), float(q), float(c), int(k)]
                          for s, q, c, k in state["segments"]]
        self._current = tuple(float(v) for v in state["current"])
        self._warned = bool(state["warned"])
        self._room = {"max": None, "plan": None}


class LedgerLink:
    """Records a training run's steps in a persistent privacy ledger as it proceeds.

    Steps are *reserved* ahead in chunks (:meth:`privlearn.ledger.Ledger.reserve`): the
    first chunk (the planned run, or ``chunk`` steps without a plan) when the link is
    made, before any data is touched, and a new one whenever the next step is not covered
    (more steps than planned, or a changed noise multiplier). A reserved chunk counts in
    full until :meth:`settle` records how many of its steps ran, so a process killed at
    step ``k`` leaves at least ``k`` steps in the ledger. A chunk the budget cannot hold
    is retried at half the size down to one step; a single step it cannot hold raises
    :class:`~privlearn.errors.BudgetExceededError` before the step runs.

    Parameters
    ----------
    handle
        A budget handle, ``Ledger(path).budget(dataset)`` (anything with
        ``reserve(mechanism, *, label)`` returning an object with ``settle(mechanism)``).
    scheme : str
        Subsampling scheme of the steps.
    chunk : int
        Steps reserved at a time beyond the plan.
    label : str
    """

    def __init__(self, handle, *, scheme: str, chunk: int, label: str):
        if not callable(getattr(handle, "reserve", None)):
            raise TypeError("ledger must be a budget handle, e.g. "
                            f"Ledger(path).budget('dataset'), got {handle!r}")
        self.handle = handle
        self.scheme = scheme
        self.chunk = max(1, int(chunk))
        self.label = label
        self._open: list[list] = []  # [reservation, sigma, q, reserved, used]

    def _mech(self, sigma: float, q: float, k: int):
        return compose(dpsgd_step(sigma, q, self.scheme), steps=k)

    def reserve(self, sigma: float, q: float, steps: int) -> None:
        """Reserve ``steps`` steps (fewer, down to one, if the budget cannot hold them)."""
        n = max(1, int(steps))
        while True:
            try:
                r = self.handle.reserve(self._mech(sigma, q, n), label=self.label)
                break
            except PrivacyBudgetExceededError:
                if n == 1:
                    raise
                n = max(1, n // 2)
        self._open.append([r, sigma, q, n, 0])

    def ensure(self, sigma: float, q: float) -> None:
        """Make sure the next step of this configuration is covered by a reservation."""
        if self._open:
            _, s, r, n, k = self._open[-1]
            if (s, r) == (sigma, q) and k < n:
                return
        self.reserve(sigma, q, self.chunk)

    def used(self, sigma: float, q: float) -> None:
        """One step of this configuration ran (it was covered by :meth:`ensure`)."""
        self._open[-1][4] += 1

    def settle(self) -> None:
        """Record how many steps of each open reservation ran (idempotent)."""
        while self._open:
            r, s, q, _, k = self._open.pop(0)
            r.settle(self._mech(s, q, k) if k else compose([]))


def _largest_within(f: Callable[[int], float], cap: float, start: int = 64) -> int:
    """Largest ``k >= 0`` with ``f(k) <= cap`` for non-decreasing ``f``; ``-1`` when even
    ``f(0) > cap``, ``2**40`` for "unbounded". ``start`` is a guess of the answer (the
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
                return 2**40
    else:
        lo, hi = 0, start
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid) <= cap:
            lo = mid
        else:
            hi = mid
    return lo
