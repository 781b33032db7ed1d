"""Ledger of the DP-SGD steps actually taken, evaluated by :mod:`privlearn.accounting`."""

from __future__ import annotations

import math

from privlearn.accounting import Gaussian, compose, subsample

__all__ = ["PrivacyAccountant"]


class PrivacyAccountant:
    """Counts logical optimizer steps and answers ``epsilon(delta)`` for them.

    Each step is the subsampled Gaussian mechanism
    ``subsample(Gaussian(noise_multiplier), rate=sampling_rate, scheme=scheme)``; ``T``
    steps compose adaptively (Abadi et al. 2016, Sec. 3.1; Mironov et al. 2019;
    the numbers come from the certified accountant named by ``accountant``). Changing
    the noise multiplier mid-training starts a new part of the composition.
    """

    def __init__(self, noise_multiplier: float, sampling_rate: float, scheme: str = "poisson",
                 accountant: str = "pld"):
        self.sampling_rate = float(sampling_rate)
        self.scheme = scheme
        self.accountant = accountant
        self.history: list[list] = [[float(noise_multiplier), 0]]

    @property
    def noise_multiplier(self) -> float:
        return self.history[-1][0]

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        if value != self.history[-1][0]:
            self.history.append([float(value), 0])

    @property
    def steps(self) -> int:
        return sum(k for _, k in self.history)

    def step(self, n: int = 1) -> None:
        self.history[-1][1] += n

    def mechanism(self):
        """The composed mechanism describing the steps taken (None before any step)."""
        parts = [(s, k) for s, k in self.history if k > 0]
        if not parts:
            return None
        mechs = [subsample(Gaussian(s), rate=self.sampling_rate, scheme=self.scheme)
                 for s, _ in parts]
        return compose(mechs, steps=[k for _, k in parts])

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """Certified upper bound on epsilon at ``delta`` for the steps taken so far
        (0 before any step; ``inf`` if any step ran without noise)."""
        if self.steps == 0:
            return 0.0
        if any(s == 0 and k > 0 for s, k in self.history):
            return math.inf
        return self.mechanism().epsilon(delta, accountant=accountant or self.accountant)
