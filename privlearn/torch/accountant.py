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

__all__ = ["PrivacyAccountant", "PrivacyBudgetWarning", "Segment"]

_STATE_FORMAT = "privlearn.torch.accountant/1"


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
        self._count_down()

    def step(self, n: int = 1) -> None:
        """Record ``n`` steps with the parameters of the last step (or the initial ones)."""
        for _ in range(int(n)):
            self.record_step(*self._current)

    def mechanism(self):
        """The composed mechanism describing the steps taken (None before any step)."""
        return self._compose([(s, q, k) for s, q, _, k in self._segments])

    def _compose(self, parts):
        parts = [(s, q, k) for s, q, k in parts if k > 0]
        if not parts:
            return None
        mechs = [subsample(Gaussian(s), rate=q, scheme=self.scheme) for s, q, _ in parts]
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
        if cfg != self._current:
            self._current = cfg
            self._room = {"max": None, "plan": None}
        self.check_step()

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
