"""The mechanism description of each (strategy, sampler) combination.

:func:`correlated_mechanism` returns a :class:`~privlearn.accounting.Mechanism` that every
certified accountant, :func:`~privlearn.accounting.calibrate`, the ledger and serialisation
take as they are, or -- only when asked for an amplified analysis that nobody can certify
-- a :class:`~privlearn.accounting.montecarlo.BallsInBinsMatrixMechanism` that they refuse
and that only :func:`~privlearn.accounting.montecarlo.estimate_epsilon` evaluates.

=====================================  ====================================================
strategy x sampler                     mechanism
=====================================  ====================================================
any x participation schema (a fixed    ``MatrixMechanism(sigma, sens(C, schema))``: the
order, no sampling)                    Gaussian mechanism of sensitivity ``sens(C)``
banded (``b <= cycle``), or any ``C``  ``compose(subsample(MatrixMechanism(sigma, c), q),
over ``n <= cycle`` steps, x cyclic    ceil(n / b'))``, ``c`` the largest column norm
Poisson (rate ``q``, cycle ``b'``)     ([CC23b] Theorem 4; the ``n x n`` ``C`` has at most
                                       ``n`` bands); ``b' = 1``, ``C = I`` is DP-SGD, with
                                       exactly DP-SGD's epsilon
BLT, or ``bands > cycle``, x cyclic    ``MatrixMechanism(sigma, sens(C, MinSeparation(b',
Poisson, over ``n > cycle`` steps      k)))``: un-amplified (certified; the reduction needs
                                       a banded ``C`` with ``b <= b'``)
any x balls-in-bins                    un-amplified ``MatrixMechanism`` (certified) by
                                       default; ``amplified=True``: a
                                       ``BallsInBinsMatrixMechanism`` (estimate only)
=====================================  ====================================================

References
----------
.. [CC23b] Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu (2023), (Amplified)
       Banded Matrix Factorization: A unified approach to private training, NeurIPS,
       Theorem 4 (cyclic Poisson sampling reduces to ``ceil(n / b)`` Poisson-subsampled
       Gaussian mechanisms for column-normalised ``b``-banded ``C``).
"""

from __future__ import annotations

import math

from privlearn._validation import check_count, check_positive
from privlearn.accounting import Mechanism, Neighbouring, as_replace_one, compose, subsample
from privlearn.accounting.matrix_mechanism import MatrixMechanism
from privlearn.accounting.montecarlo import BallsInBinsMatrixMechanism
from privlearn.correlated._recurrence_fidelity import noise_factor as recurrence_noise_factor
from privlearn.correlated.participation import MinSeparation, Participation
from privlearn.correlated.sampling import BallsInBinsSampler, CyclicPoissonSampler
from privlearn.correlated.sensitivity import sensitivity
from privlearn.correlated.strategies import DenseStrategy, ToeplitzStrategy, nonzero_bands
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = ["correlated_mechanism", "is_amplified", "stated_under"]

#: the unit roundoff of each precision a noise recurrence may run in
_UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53}


def is_amplified(strategy: ToeplitzStrategy, sampler: object, steps: int | None = None) -> bool:
    """Whether :func:`correlated_mechanism` accounts ``sampler``'s amplification for
    ``strategy`` over ``steps`` steps (default the sampler's) with a certified reduction:
    cyclic Poisson with ``bands <= cycle``, the bands being those of the ``steps x steps``
    ``C`` that runs -- at most ``steps``, so any strategy (a BLT too) when ``steps <=
    cycle``, where each record has one step it may take part in."""
    if not isinstance(sampler, CyclicPoissonSampler) or sampler.sampling_rate >= 1.0:
        return False
    n = sampler.steps if steps is None else check_count("steps", steps, minimum=1)
    bands = nonzero_bands(strategy)  # trailing zero coefficients are no bands
    return min(n if bands is None else bands, n) <= sampler.cycle_length


def correlated_mechanism(
    strategy: ToeplitzStrategy,
    sampler: CyclicPoissonSampler | BallsInBinsSampler | Participation,
    noise_multiplier: float,
    *,
    steps: int | None = None,
    amplified: bool = False,
    noise_precision: str = "float32",
) -> Mechanism:
    """The mechanism description of training with ``strategy`` and ``sampler``.

    Parameters
    ----------
    strategy : ToeplitzStrategy or DenseStrategy
        :class:`~privlearn.correlated.Identity` (DP-SGD), a banded Toeplitz, a BLT, or a
        :class:`~privlearn.correlated.DenseStrategy` of at least ``steps`` steps (its
        sensitivity is that of :func:`~privlearn.correlated.dense_sensitivity` times its
        certified :meth:`~privlearn.correlated.DenseStrategy.noise_factor`, which covers
        the rounding of the ``C^{-1}`` its noise applies; an ill-conditioned one is
        refused with a ParameterValueError). A Toeplitz strategy's sensitivity is times
        the certified factor of its noise recurrence's rounding (float32 or float64:
        about ``1 + 1e-6`` for a banded strategy, ``1 + 5e-4`` for a 4-buffer BLT over
        10,000 steps; exactly 1 for ``Identity``); ``steps`` for which it exceeds 1 %
        are charged with a :class:`~privlearn.errors.NoiseRoundingWarning`, and above
        10 % refused with a ParameterValueError.
    sampler : CyclicPoissonSampler, BallsInBinsSampler or Participation
        The sampler that chooses the batches, or the participation schema of a fixed
        order (then ``steps`` is required).
    noise_multiplier : float > 0
        ``sigma``: the noise of step ``t`` is ``sigma * max_grad_norm * (C^{-1} z)_t``.
    steps : int, optional
        Number of steps (default: the sampler's).
    amplified : bool
        Balls-in-bins only: describe the amplified mechanism, which has no certified
        accounting (estimate it with
        :func:`privlearn.accounting.montecarlo.estimate_epsilon`).
    noise_precision : {"float32", "float64"}
        The lowest precision the Toeplitz strategy's noise recurrence runs in, whose
        rounding the sensitivity's factor covers: ``"float32"`` (default: the PyTorch
        engine's, and it covers float64 too) or ``"float64"`` (NumPy's
        :class:`~privlearn.correlated.noise.CorrelatedNoise`; the PyTorch engine for
        float64 parameters or in secure mode, whose plan passes its state's precision,
        :attr:`privlearn.torch.schedule.NoisePlan.noise_precision`). A dense strategy's
        factor takes float32's in both.

    Examples
    --------
    >>> from privlearn.accounting import calibrate
    >>> from privlearn.correlated import BandedToeplitz
    >>> from privlearn.correlated.accounting import correlated_mechanism
    >>> from privlearn.correlated.sampling import CyclicPoissonSampler
    >>> C = BandedToeplitz.square_root(bands=4)
    >>> sampler = CyclicPoissonSampler(dataset_size=60000, sampling_rate=0.02, steps=1000,
    ...                                cycle_length=4)
    >>> sigma = calibrate(lambda s: correlated_mechanism(C, sampler, s), 2.0, 1e-5)
    """
    if not isinstance(strategy, ToeplitzStrategy | DenseStrategy):
        raise ParameterTypeError(
            f"strategy must be a privlearn.correlated strategy (BandedToeplitz, "
            f"BufferedToeplitz, DenseStrategy, ...), got {strategy!r}; build one with "
            "optimize_banded_toeplitz or BandedToeplitz.square_root")
    sigma = check_positive("noise_multiplier", noise_multiplier)
    u = _UNIT_ROUNDOFF.get(noise_precision) if isinstance(noise_precision, str) else None
    if u is None:
        raise ParameterValueError(
            f"noise_precision must be 'float32' or 'float64', got {noise_precision!r}; "
            "pass the lowest precision the noise recurrence runs in ('float32' when "
            "unsure: it covers both)")
    if isinstance(sampler, Participation):
        if steps is None:
            raise ConfigurationError(
                f"steps is required when sampler is a participation schema ({sampler!r}), "
                "got None; pass steps=<number of steps> (an integer >= 1)")
        n = check_count("steps", steps, minimum=1)
        return MatrixMechanism(sigma, _run_sensitivity(strategy, sampler, n, u))
    if not isinstance(sampler, CyclicPoissonSampler | BallsInBinsSampler):
        raise ParameterTypeError(
            "sampler must be a CyclicPoissonSampler, a BallsInBinsSampler or a Participation "
            f"schema (SingleParticipation, MinSeparation, FixedEpochs), got {sampler!r}")
    n = sampler.steps if steps is None else check_count("steps", steps, minimum=1)
    cycle = sampler.cycle_length
    k = math.ceil(n / cycle)
    if isinstance(sampler, BallsInBinsSampler) and amplified:
        if isinstance(strategy, DenseStrategy):
            raise ParameterTypeError(
                f"amplified=True describes a Toeplitz strategy's balls-in-bins mechanism "
                f"by its coefficients, got {strategy!r}; use a Toeplitz strategy, or "
                "amplified=False (the certified min-separation accounting)")
        return BallsInBinsMatrixMechanism(sigma, tuple(strategy.toeplitz_coefs(n)), n, cycle)
    if is_amplified(strategy, sampler, n):
        column = _run_sensitivity(strategy, MinSeparation(n, 1), n, u)
        return compose(subsample(MatrixMechanism(sigma, column), rate=sampler.sampling_rate), k)
    return MatrixMechanism(sigma, _run_sensitivity(strategy, MinSeparation(cycle, k), n, u))


def _run_sensitivity(strategy: ToeplitzStrategy | DenseStrategy, participation: Participation,
                     n: int, unit_roundoff: float = 2.0**-24) -> float:
    """The sensitivity of the noise that runs: that of ``C`` times a certified factor
    for the floating point of its noise, rounded up: for a dense ``C`` its
    :meth:`~privlearn.correlated.DenseStrategy.noise_factor` (its noise is the computed
    inverse's, that of a strategy within that factor of ``C``), for a Toeplitz ``C``
    that of its recurrence (:func:`~privlearn.correlated._recurrence_fidelity.noise_factor`:
    the float32 or float64 recurrence's noise is that of a strategy ``C + E`` with
    ``sens(C + E) <= sens(C) (1 + rho)``); exactly 1 for ``C = I``."""
    value = sensitivity(strategy, participation, n).value
    if isinstance(strategy, DenseStrategy):
        factor = strategy.noise_factor()
    else:
        factor = recurrence_noise_factor(strategy, participation, n, value, unit_roundoff)
    return value if factor == 1.0 else math.nextafter(value * factor, math.inf)


def stated_under(mechanism: Mechanism, relation: Neighbouring) -> Mechanism:
    """``mechanism`` (an add/remove description) stated under ``relation``: itself for
    add/remove; for replace-one, :func:`~privlearn.accounting.as_replace_one`, which
    states every part under replace-one (a part that is not subsampled as ``subsample(m,
    1.0, scheme="fixed", neighbouring="replace_one")``, which the accountants evaluate at
    twice the add/remove sensitivity: a replaced record's contribution moves by up to
    ``2 C``), so that every accountant, calibration and the ledger read the relation the
    sampling holds under (:func:`privlearn.accounting.registry.stated_relations`)."""
    relation = Neighbouring(relation)
    if relation is Neighbouring.ADD_REMOVE:
        return mechanism
    if relation is not Neighbouring.REPLACE_ONE:
        raise ParameterValueError(
            f"relation must be add_remove or replace_one, got {relation.value!r}; "
            "state the mechanism under one of these neighbouring relations")
    return as_replace_one(mechanism)
