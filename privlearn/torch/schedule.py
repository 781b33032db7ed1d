"""How a run is noised and accounted: :class:`NoisePlan`, the one description the
accountant, the budget cap, calibration, the ledger and the optimizer's noise all read
(DP-SGD is its identity strategy; no other module tests the noise mode). It reads the run's
sampling from the one registry of samplings
(:data:`privlearn.correlated.sampling.SAMPLINGS`, re-exported here), whose entry owns both
the batch draw and the law assumed here.

=================  ==========================  ===========================================
sampling           batch of step ``t``         accounted as
=================  ==========================  ===========================================
``poisson``        every example with          ``t`` compositions of the Poisson-subsampled
                   probability ``q``           Gaussian (DP-SGD); with correlated noise:
                                               refused
``fixed``          ``B`` distinct examples     ``t`` compositions, replace-one
``cyclic_poisson`` Poisson within group        the strategy's matrix mechanism: amplified
                   ``t mod b``                 (Choquette-Choo et al. 2023, Theorem 4) for
                                               DP-SGD and ``bands <= b``, else by its
                                               b-min-separation sensitivity
``balls_in_bins``  bin ``t mod b``             the matrix mechanism of b-min-separation
                                               (certified, without amplification)
``shuffled_epochs``batch ``t mod b`` of one    the matrix mechanism of (k, b)-participation
                   fixed order                 (certified, without amplification) under
                                               **replace-one** only (twice the add/remove
                                               sensitivity); refused on add/remove budgets
=================  ==========================  ===========================================

Every entry but ``fixed`` and ``shuffled_epochs`` is accounted under add/remove.

``q`` is the rate an example is drawn at when it may be; the normaliser of the noisy sum
is the expected batch size. With privacy units of several examples (users) every count
here is of units.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from privlearn._progress import progress
from privlearn.accounting import Gaussian, Mechanism, calibrate, compose, subsample
from privlearn.correlated import Identity, optimize_banded_toeplitz, optimize_blt
from privlearn.correlated.accounting import correlated_mechanism, stated_under
from privlearn.correlated.optimize import PROGRESS_DELAY, _pattern
from privlearn.correlated.sampling import SAMPLINGS, CyclicPoissonSampler, SamplingLaw
from privlearn.correlated.strategies import DenseStrategy, ToeplitzStrategy, nonzero_bands
from privlearn.errors import ConfigurationError, StrategyAdjustedWarning
from privlearn.torch.correlated_noise import CorrelatedNoise

__all__ = ["NoisePlan", "RunAccounting", "SamplingKind", "SAMPLINGS", "choose_strategy",
           "compose_steps", "default_cycle", "dpsgd_step", "independent", "whole_run"]


#: The former name of a registry entry (:class:`privlearn.correlated.sampling.SamplingLaw`,
#: which has the same ``rate``, ``per_epoch``, ``expected_batch``, ``describe`` and
#: ``cycled``); deprecated.
SamplingKind = SamplingLaw

#: the noise of DP-SGD (independent at every step: the identity strategy)
_DPSGD = "dpsgd"
#: the optimised strategies by name, each with the setting that sizes it and its default
_OPTIMISED = {"banded": ("bands", 8), "blt": ("buffers", 4)}


def independent(noise) -> bool:
    """Whether ``noise`` (a :class:`~privlearn.torch.config.Noise`, its string, or a
    strategy) is DP-SGD's independent noise, given by name."""
    return isinstance(noise, str) and noise == _DPSGD


def whole_run(noise, sampling: str) -> bool:
    """Whether a run with this ``noise`` and ``sampling`` is accounted as one
    matrix-factorization mechanism of its planned steps (correlated noise, or a sampler
    that bounds participation) rather than step by step."""
    return not independent(noise) or SAMPLINGS[sampling].describe is not None


def sized_by(noise) -> str | None:
    """The setting (``"bands"``, ``"buffers"``) that sizes the strategy ``noise`` names,
    or None."""
    return _OPTIMISED[noise][0] if isinstance(noise, str) and noise in _OPTIMISED else None


def cycle_bands(noise, bands: int | None, steps: int | None = None) -> int | None:
    """The bands a default cycle must hold: those of ``noise="banded"`` (default 8; at
    most ``steps`` when the steps are given, as the strategy has at most one band per
    step, :func:`choose_strategy`) or of a banded strategy given (its ``bands``: a cycle
    of them is what amplifies it), else None."""
    if sized_by(noise) == "bands":
        held = bands or _OPTIMISED["banded"][1]
    elif not isinstance(noise, str) and getattr(noise, "bands", None) is not None:
        held = int(noise.bands)
    else:
        return None
    return held if steps is None else min(held, steps)


def default_cycle(noise, law: SamplingLaw, n: int, b: float, held: int | None) -> int:
    """The cycle length of a run that gives none: :meth:`SamplingLaw.cycle_for`, except
    for correlated noise that no sampling amplifies (a BLT, any strategy without bands:
    ``held`` None) under a sampling whose own default is not an epoch (cyclic Poisson,
    whose default is 1 group, every example eligible at every step). There the cycle is
    an epoch's batches, ``max(1, floor(n / b))`` groups (at most ``n / b``, so that the
    rate ``b c / n`` stays at most 1): each example takes part about once per epoch, at
    least a cycle apart, the min-separation participation the strategy is optimised and
    accounted for (Choquette-Choo et al. 2023a, Sec. 2, ``b`` = steps per epoch; McMahan
    et al. 2024). With one group the strategy is optimised for participation in every
    step (it comes out close to the identity) and is accounted without amplification,
    at a far larger epsilon than DP-SGD's at the same noise multiplier."""
    if held is None and not independent(noise) and law.default_cycle is not None:
        return max(1, int(n // b))
    return law.cycle_for(n, b, held)


def dpsgd_step(noise_multiplier: float, sampling_rate: float, scheme: str = "poisson"):
    """The mechanism of one DP-SGD step: ``subsample(Gaussian(noise_multiplier),
    rate=sampling_rate, scheme=scheme)`` (Abadi et al. 2016, Sec. 3.1) -- the one place the
    engine, its accountant and its ledger records describe a step."""
    return subsample(Gaussian(noise_multiplier), rate=sampling_rate, scheme=scheme)


def choose_strategy(noise, planned: int, participation, bands: int | None,
                    buffers: int | None, amplifying_cycle: int | None = None, *,
                    show_progress: bool | None = None, stacklevel: int = 2
                    ) -> ToeplitzStrategy | DenseStrategy:
    """The strategy of ``noise``: the identity (DP-SGD), an optimised banded Toeplitz or
    BLT for ``planned`` steps under ``participation``, or the strategy given.

    A banded strategy has ``bands`` bands (default 8, or ``amplifying_cycle`` when
    shorter: the cycle of a sampling that amplifies a strategy of at most that many
    bands, cyclic Poisson; Choquette-Choo et al. 2023, Theorem 4), at most ``planned``
    (one band per step), and no more than the optimum uses: past the participation's
    separation the optimum over the strategies whose sensitivity is exact (non-negative,
    non-increasing coefficients; Kalinin & Lampert 2024, Theorem 2) leaves the bands at
    zero: the strategy of the bands used is run (the same optimum; its noise keeps fewer
    buffers). A BLT has
    ``buffers`` buffers (default 4), at most ``planned - 1``: over ``n`` steps ``C`` has
    ``n - 1`` coefficients below its diagonal, and a sum of any number of positive
    exponentials there is one of at most ``n - 1`` of them (Caratheodory's theorem on
    the cone they span), so more buffers cannot lower the error. A setting given and so
    reduced gets a :class:`~privlearn.errors.StrategyAdjustedWarning` saying what is
    used and why; a default is reduced silently. ``show_progress``: the optimiser's
    progress bar (:func:`privlearn.correlated.optimize_banded_toeplitz`)."""
    if not isinstance(noise, str):
        return noise
    if independent(noise):
        return Identity()
    if sized_by(noise) == "bands":
        if bands is None:  # 8, or the cycle that amplifies the strategy when shorter
            b = _OPTIMISED["banded"][1]
            if amplifying_cycle is not None:
                b = min(b, amplifying_cycle)
        else:
            b = bands
        if b > planned and bands is not None:
            _adjusted(f"bands={bands} is more than the {planned} planned steps: a banded "
                      f"strategy has at most one band per step, so {planned} are used "
                      f"(pass bands <= {planned})", stacklevel)
        b = min(b, planned)
        with warnings.catch_warnings():  # said below in the settings' words
            warnings.simplefilter("ignore", StrategyAdjustedWarning)
            strategy = optimize_banded_toeplitz(planned, b, participation,
                                                show_progress=show_progress)
        used = nonzero_bands(strategy)
        if used < b:
            # the strategy of ``used`` bands: the same optimum, and the same object as
            # asking for them (its optimiser is not restricted to non-negative bands)
            strategy = optimize_banded_toeplitz(planned, used, participation,
                                                show_progress=show_progress)
            if bands is not None:
                sep, k = _pattern(participation, planned)
                _adjusted(
                    f"bands={bands}: {used} bands are used. An example takes part up to "
                    f"{k} times, at least {sep} steps apart (the sampling's cycle), and "
                    f"bands past {sep} keep the sensitivity exact only with non-negative, "
                    "non-increasing coefficients (Kalinin & Lampert 2024, Theorem 2), "
                    f"whose optimum here is 0 past band {used}: the noise, its memory and "
                    f"its accounting are those of {used} bands. Pass bands <= {sep}, or "
                    f"cycle_length >= {b} (a longer separation) to use more", stacklevel)
        return strategy
    m = buffers or _OPTIMISED["blt"][1]
    cap = max(1, planned - 1)
    if m > cap and buffers is not None:
        _adjusted(f"buffers={buffers} is more than a BLT over {planned} planned steps can "
                  f"use: C has {planned - 1} coefficients below its diagonal, and a sum of "
                  f"positive exponentials there is one of at most {cap} of them "
                  f"(Caratheodory), so {cap} buffer{'s' if cap > 1 else ''} are used "
                  f"(pass buffers <= {cap})", stacklevel)
    m = min(m, cap)
    with warnings.catch_warnings():  # said below in the settings' words
        warnings.simplefilter("ignore", StrategyAdjustedWarning)
        strategy = optimize_blt(planned, m, participation, show_progress=show_progress)
    if strategy.buffers < m and buffers is not None:
        sep, k = _pattern(participation, planned)
        _adjusted(
            f"buffers={buffers}: {strategy.buffers} buffers are used. An example takes part "
            f"up to {k} times, at least {sep} steps apart (the sampling's cycle), and the "
            "optimised BLT leaves the others unused (a weight of ~0, or the decay of another "
            "buffer): they are dropped with the loss unchanged, and the noise, its memory and "
            f"its accounting are those of {strategy.buffers} buffers. Pass "
            f"buffers <= {strategy.buffers}", stacklevel)
    return strategy


def _adjusted(message: str, stacklevel: int) -> None:
    warnings.warn(message, StrategyAdjustedWarning, stacklevel=stacklevel + 1)


def compose_steps(segments: Iterable, scheme: str, prior: Mechanism | None = None):
    """The composition of DP-SGD steps (Abadi et al. 2016, Sec. 3.1): each segment
    (``noise_multiplier``, ``sampling_rate``, ``steps``) is ``steps`` compositions of
    :func:`dpsgd_step`, runs of the same mechanism merged (the
    clipping bound does not matter), after ``prior``; None when there is nothing."""
    parts: list[list] = []
    for seg in segments:
        if seg.steps <= 0:
            continue
        if parts and parts[-1][:2] == [seg.noise_multiplier, seg.sampling_rate]:
            parts[-1][2] += seg.steps
        else:
            parts.append([seg.noise_multiplier, seg.sampling_rate, seg.steps])
    mechs = [dpsgd_step(s, q, scheme) for s, q, _ in parts]
    counts = [k for _, _, k in parts]
    if prior is not None:
        mechs, counts = [prior, *mechs], [1, *counts]
    if not mechs:
        return None
    return compose(mechs, steps=counts)


@dataclass(frozen=True)
class NoisePlan:
    """How a run is noised and accounted: the sampling's participation law (its registry
    entry), the strategy ``C`` of the noise (:class:`~privlearn.correlated.Identity` for
    DP-SGD), the mechanism of the steps at a noise multiplier (sigma stays with the
    run's plan and the accountant's segments, where a DP-SGD schedule may change it), and
    the per-step noise transform. Step by step (DP-SGD with Poisson or fixed-size
    sampling: compositions of the subsampled Gaussian) or one matrix-factorization
    mechanism of the steps taken
    (:func:`privlearn.correlated.accounting.correlated_mechanism`; Choquette-Choo et al.
    2023).

    Attributes
    ----------
    sampling : str
    units : int
        Examples (or users) the sampler draws from.
    sampling_rate : float
    cycle : int
    strategy : ToeplitzStrategy or DenseStrategy
        ``Identity()`` for DP-SGD (None given is read as it).
    noise_precision : {"float32", "float64"}
        The lowest precision of the correlated noise's state: what its accounting
        charges for the rounding of the noise
        (:func:`~privlearn.correlated.accounting.correlated_mechanism`'s
        ``noise_precision``) and what :meth:`noise_transform`'s state never goes below
        (:mod:`privlearn.torch._noise_precision`). float64 in secure mode or for float64
        trained parameters.
    """

    sampling: str
    units: int
    sampling_rate: float
    cycle: int
    strategy: ToeplitzStrategy | DenseStrategy | None = None
    noise_precision: str = "float32"

    def __post_init__(self):
        if self.strategy is None:
            object.__setattr__(self, "strategy", Identity())

    @classmethod
    def build(cls, noise, sampling: str, units: int, sampling_rate: float, cycle: int,
              planned: int | None, bands: int | None = None,
              buffers: int | None = None, *, show_progress: bool | None = None,
              stacklevel: int = 2, noise_precision: str = "float32") -> NoisePlan:
        """The plan of a run: its strategy optimised for ``planned`` steps under the
        sampling's participation when ``noise`` names one (Choquette-Choo et al. 2023,
        banded MF; McMahan et al. 2024, BLT), the identity for DP-SGD.

        Parameters
        ----------
        noise : Noise, str, ToeplitzStrategy or DenseStrategy
            ``"dpsgd"``, ``"banded"``, ``"blt"`` or a strategy (kept as given).
        sampling : str
            A key of :data:`SAMPLINGS`.
        units, sampling_rate, cycle :
            The sampler's units, rate and cycle length.
        planned : int or None
            Planned steps (needed unless the run is accounted step by step).
        bands, buffers : int or None
            The size of ``"banded"`` (default 8, at most ``planned``) or ``"blt"``
            (default 4); reduced to what the strategy can use, with a
            :class:`~privlearn.errors.StrategyAdjustedWarning` when given
            (:func:`choose_strategy`).
        show_progress : bool or None
            The strategy optimiser's progress bar on standard error (None: on a
            terminal, when it lasts over a second).
        stacklevel : int
            Where the warnings point, counted from the caller of ``build``.
        noise_precision : {"float32", "float64"}
            The lowest precision of the noise state (:attr:`noise_precision`).

        Returns
        -------
        NoisePlan
        """
        strategy = None
        if whole_run(noise, sampling):
            desc = SAMPLINGS[sampling].describe(units, sampling_rate, planned, cycle)
            schema = getattr(desc, "participation", desc)
            amplifying = cycle if isinstance(desc, CyclicPoissonSampler) else None
            strategy = choose_strategy(noise, planned, schema, bands, buffers, amplifying,
                                       show_progress=show_progress,
                                       stacklevel=stacklevel + 1)
            if isinstance(strategy, DenseStrategy) and (
                    planned is None or planned > strategy.steps):
                raise ConfigurationError(
                    f"noise={strategy!r} is defined for {strategy.steps} steps, but the run "
                    f"plans {'no fixed number of' if planned is None else planned} steps; "
                    f"plan at most {strategy.steps} steps (steps= or epochs=), or optimise "
                    "a dense strategy for the planned steps (optimize_dense(steps, ...))")
        return cls(sampling, units, sampling_rate, cycle, strategy, noise_precision)

    @property
    def law(self) -> SamplingLaw:
        """The registry entry of the run's sampling."""
        return SAMPLINGS[self.sampling]

    @property
    def max_steps(self) -> int | None:
        """The most steps the strategy defines (a
        :class:`~privlearn.correlated.DenseStrategy`'s ``n``); None: any number."""
        return self.strategy.steps if isinstance(self.strategy, DenseStrategy) else None

    @property
    def stepwise(self) -> bool:
        """Whether the steps are accounted one by one (DP-SGD under a sampling with no
        participation schema) rather than as one mechanism of the planned run."""
        return self.law.describe is None

    @property
    def correlates(self) -> bool:
        """Whether the noise is correlated across steps (``C`` is not the identity)."""
        rec = self.strategy.recurrence()
        return bool(rec.buffers or getattr(rec, "coefs", None) != (1.0,))

    def mechanism(self, noise_multiplier: float, steps: int) -> Mechanism:
        """The mechanism of ``steps`` steps at ``noise_multiplier`` (sigma: the noise of
        step ``t`` is ``sigma C (C^{-1} z)_t``)."""
        law = self.law
        if self.stepwise:
            return compose(dpsgd_step(noise_multiplier, self.sampling_rate, law.scheme),
                           steps=steps)
        desc = law.describe(self.units, self.sampling_rate, steps, self.cycle)
        mech = correlated_mechanism(self.strategy, desc, noise_multiplier, steps=steps,
                                    noise_precision=self.noise_precision)
        return stated_under(mech, law.relation)

    def calibrate(self, epsilon: float, delta: float, accountant: str, steps: int, *,
                  show_progress: bool | None = None) -> float:
        """The noise multiplier at which ``steps`` steps spend ``epsilon`` at ``delta``
        (:func:`privlearn.accounting.calibrate` of :meth:`mechanism`). Each evaluation
        advances a progress bar on standard error (``show_progress``: None, shown on a
        terminal once it lasts over a second; True always; False never): thousands of
        steps take seconds."""
        with progress(desc=f"calibrating the noise for {steps} steps", unit=" evaluations",
                      enabled=show_progress, delay=PROGRESS_DELAY) as bar:
            def mechanism(sigma: float) -> Mechanism:
                bar.update(1)
                return self.mechanism(sigma, steps)

            return calibrate(mechanism, epsilon, delta, accountant=accountant)

    def composed(self, segments: Iterable, prior: Mechanism | None = None):
        """The mechanism of the steps taken (the accountant's segments, after ``prior``):
        their composition step by step, or the one mechanism of all of them (one noise
        multiplier; a change is refused, never approximated); None when there is
        nothing."""
        segs = [g for g in segments if g.steps > 0]
        if self.stepwise:
            return compose_steps(segs, self.law.scheme, prior)
        if not segs:
            return prior
        sigmas = {g.noise_multiplier for g in segs}
        if len(sigmas) > 1:  # refused by the optimizer; never approximated
            raise ConfigurationError("a correlated-noise run has one noise multiplier")
        mech = self.mechanism(sigmas.pop(), sum(g.steps for g in segs))
        return mech if prior is None else compose([prior, mech])

    def noise_transform(self):
        """The per-step noise transform: a fresh
        :class:`~privlearn.torch.correlated_noise.CorrelatedNoise` of the strategy's
        recurrence when ``C`` is not the identity, else None (the draw is the noise); its
        state never below :attr:`noise_precision`, the accounted one."""
        if not self.correlates:
            return None
        return CorrelatedNoise(self.strategy.recurrence(), self.noise_precision)


#: The former name of :class:`NoisePlan`.
RunAccounting = NoisePlan
