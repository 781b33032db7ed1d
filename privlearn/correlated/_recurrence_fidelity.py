"""How far the noise of a Toeplitz strategy's recurrence is from ``C^{-1} z``, as a
certified factor on the sensitivity.

The noise of a banded or BLT strategy is not ``C^{-1} z`` but what its recurrence
(:class:`~privlearn.correlated.strategies.BandedRecurrence`,
:class:`~privlearn.correlated.strategies.BufferedRecurrence`) computes in floating point:
float64 in NumPy (:mod:`privlearn.correlated.noise`) and in the PyTorch engine's secure
mode or for float64 parameters, float32 otherwise (the state is never kept in a lower
precision). A recurrence is a forward substitution, which is backward stable
componentwise (Higham, Accuracy and Stability of Numerical Algorithms, 2002, Lemma 3.1
and Theorem 8.5): the computed noise ``x`` of ``n`` steps solves ``(C + E) x = z``
exactly, with ``|E| <= T(e)`` entrywise for the lower-triangular Toeplitz ``T(e)`` of
:func:`backward_error_coefs`. The release ``X + x`` is then ``(C + E)^{-1} ((C + E) X +
z)``: the Gaussian mechanism of the strategy ``C + E``, post-processed, and for every
contribution ``G`` of a participation pattern ``||(C + E) G||_F <= ||C G||_F + ||T(e)
|G| ||_F``, so ``sens(C + E) <= sens(C) + sens(T(e)) = (1 + rho) sens(C)``.

``E`` depends on the rounding, hence on the draws: the bound holds for every ``E`` the
arithmetic can produce, and the accounting takes the largest. It covers the rounding of
the recurrence's constants to the state's precision (a float32 decay ``theta`` is a
different decay: ``theta^j`` is off by up to ``j`` units) and of every operation, in
any order of summation (BLAS, GPU reductions, fused multiply-adds), at the unit roundoff
of float32 by default, which also covers float64 (``correlated_mechanism(...,
noise_precision="float64")`` takes float64's, for noise known to run in it). Per step
the error of a ``b``-banded recurrence is ``gamma_{2b+4} |c_j|`` on the coefficient of
lag ``j``; a BLT's buffers are rounded once per step, and the coefficient of lag ``j``
carries ``3 j + 2 m + 4`` roundings (``m`` buffers):
``e_j = gamma_{3j+2m+4} sum_k |omega_k| |theta_k|^(j-1)``.

Unlike a computed inverse (:mod:`privlearn.correlated._dense_fidelity`), this does not
grow with the condition number of ``C``: an ill-conditioned ``C`` runs a strategy of
nearly its sensitivity, but its noise can be far from ``C^{-1} z`` (measured: the
float32 noise of ``(1 - 0.99 x)^4`` is 5 times the noise's standard deviation off after
500 steps, and that of ``(1 - 0.99 x)^6`` overflows), which the spectral radius of the
float32 recurrence refuses (:func:`check_single_precision`). Measured for the optimised
strategies (100 to 10,000 steps), the noise is within ``4e-7`` (BLT) and ``2e-6``
(64 bands) of the standard deviation of ``C^{-1} z`` in float32, and ``1e-14`` in float64;
``rho`` is about ``4e-4`` for a 4-buffer BLT over 10,000 steps (the decays' rounding
compounds over the lags), ``3e-3`` over ``10^5`` and ``3e-2`` over ``10^6`` (charged,
with a warning above 1 %; refused above :data:`MAX_RECURRENCE_RESIDUAL`, 10 %).
"""

from __future__ import annotations

import math
import sys
import warnings
from functools import lru_cache

import numpy as np

from privlearn.correlated import _toeplitz
from privlearn.correlated._dense_fidelity import MAX_RESIDUAL, factor_from_residual
from privlearn.correlated.participation import Participation
from privlearn.correlated.sensitivity import sensitivity
from privlearn.correlated.strategies import (
    STABLE_RADIUS,
    BandedRecurrence,
    BandedToeplitz,
    BufferedRecurrence,
    ToeplitzStrategy,
)
from privlearn.errors import (
    ConfigurationError,
    NoiseRoundingWarning,
    ParameterTypeError,
    ParameterValueError,
)

__all__ = [
    "MAX_RECURRENCE_RESIDUAL",
    "SINGLE_UNIT_ROUNDOFF",
    "WARN_RESIDUAL",
    "backward_error_coefs",
    "check_single_precision",
    "noise_factor",
]

_EPS = sys.float_info.epsilon

#: the unit roundoff of float32 (``2^-24``), the lowest precision a recurrence runs in
SINGLE_UNIT_ROUNDOFF = 2.0**-24

#: above this certified ``rho`` the charge is said (a NoiseRoundingWarning): the dense
#: strategies' limit, :data:`~privlearn.correlated._dense_fidelity.MAX_RESIDUAL`
WARN_RESIDUAL = MAX_RESIDUAL

#: largest ``rho`` charged; above it the strategy is refused. Not a condition of the bound
#: (valid for every ``rho``: charging more is conservative) but of its use: a 10 % dearer
#: epsilon for float32 buffers, where float64 ones cost next to nothing, is a mistake to
#: stop, not to charge silently
MAX_RECURRENCE_RESIDUAL = 0.1

#: ``(strategy, precision)`` already warned about (NoiseRoundingWarning, once each)
_WARNED: set = set()


def _gamma(k: np.ndarray | float, u: float) -> np.ndarray:
    """Upper bound on ``|prod_{i <= k} (1 + d_i)^(+-1) - 1|`` for ``|d_i| <= u``:
    ``(1 - u)^(-k) - 1`` (Higham 2002, Lemma 3.1, without its ``k u < 1``), with a margin
    for the rounding of ``expm1`` and ``log1p``."""
    k = np.asarray(k, dtype=float)
    return np.expm1(-k * math.log1p(-u)) * (1.0 + 64 * _EPS)


def backward_error_coefs(
    strategy: ToeplitzStrategy, n: int, unit_roundoff: float = SINGLE_UNIT_ROUNDOFF
) -> np.ndarray | None:
    """``e`` (``e >= 0``; ``min(n, bands)`` entries for a banded strategy, whose lags
    past its bands are exact zeros, else ``n``): the noise the recurrence of ``strategy``
    computes over ``n`` steps at ``unit_roundoff`` solves ``(C + E) x = z`` exactly with
    ``|E| <= T(e)`` entrywise (module docstring); None when the recurrence is exact
    (``C = I``: the draw is the noise)."""
    try:
        rec = strategy.recurrence()
    except NotImplementedError:
        rec = None  # refused below, with what to do
    if isinstance(rec, BandedRecurrence):
        c = np.abs(np.asarray(rec.coefs[:n], dtype=float))
        if c.size == 1 and rec.coefs[0] == 1.0:
            return None
        return c * (_gamma(2 * len(rec.coefs) + 4, unit_roundoff) * (1.0 + 4 * _EPS))
    if not isinstance(rec, BufferedRecurrence):
        raise ParameterTypeError(
            f"strategy must have a banded or BLT noise recurrence (whose rounding the "
            f"accounting bounds), got {strategy!r} with recurrence {rec!r}; implement "
            "recurrence() returning a BandedRecurrence or BufferedRecurrence, or use "
            "BandedToeplitz, BufferedToeplitz or DenseStrategy"
        )
    m = rec.buffers
    if m == 0:
        return None
    out = np.zeros(n)
    out[0] = _gamma(2 * m + 4, unit_roundoff)
    if n > 1 and m:
        theta = np.abs(np.asarray(rec.buf_decay))
        omega = np.abs(np.asarray(rec.output_scale))
        lag = np.arange(1, n, dtype=float)[:, None]
        with np.errstate(under="ignore"):
            mags = (omega * theta ** (lag - 1.0)).sum(axis=1)
        # the power, the product and the sum of m terms round by (m + 2) eps / 2 of the
        # magnitudes, the product with gamma by eps; m 2^-1000 covers an underflow
        out[1:] = _gamma(3 * lag[:, 0] + 2 * m + 4, unit_roundoff) * (
            mags * (1.0 + (m + 8) * _EPS) + m * 2.0**-1000
        )
    return out


class _Majorant(ToeplitzStrategy):
    """The Toeplitz strategy of given non-negative coefficients (no recurrence: only
    its sensitivity is taken)."""

    __slots__ = ("_c",)

    def __init__(self, c: np.ndarray) -> None:
        self._c = c

    @property
    def bands(self) -> None:
        return None

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        return _toeplitz.pad(self._c, n)

    def __repr__(self) -> str:
        return f"_Majorant({self._c.size} coefficients)"


def _envelope(strategy: ToeplitzStrategy, e: np.ndarray) -> ToeplitzStrategy:
    """The strategy of the smallest non-increasing majorant of ``e`` (its sensitivity
    takes the exact rules of a non-negative, non-increasing ``C`` and bounds that of
    ``T(e)``): banded as ``strategy`` is, so that its sensitivity needs only its bands."""
    env = np.maximum.accumulate(e[::-1])[::-1]
    if strategy.bands is not None:
        return BandedToeplitz(tuple(env.tolist()))
    return _Majorant(env)


@lru_cache(maxsize=64)
def _residual(
    strategy: ToeplitzStrategy, participation: Participation, n: int, base: float, u: float
) -> float:
    e = backward_error_coefs(strategy, n, u)
    if e is None:
        return 0.0
    extra = sensitivity(_envelope(strategy, e), participation, n).value
    return math.nextafter(extra / base, math.inf)


def _hashes(*keys: object) -> bool:
    """Whether every key hashes (a frozen dataclass holding a list is ``Hashable`` to
    ``isinstance`` but its hash raises ``TypeError``)."""
    try:
        hash(keys)
    except TypeError:
        return False
    return True


def noise_factor(
    strategy: ToeplitzStrategy,
    participation: Participation,
    n: int,
    base: float,
    unit_roundoff: float = SINGLE_UNIT_ROUNDOFF,
) -> float:
    """Certified factor ``>= 1`` on ``base``, the sensitivity of ``strategy`` under
    ``participation`` over ``n`` steps, that covers the noise its recurrence computes
    (module docstring): ``1 / (1 - rho) >= 1 + rho``, ``rho = sens(T(e)) / base``, by
    :func:`~privlearn.correlated._dense_fidelity.factor_from_residual`; exactly 1 for
    ``C = I``.

    The bound holds for every ``rho`` (``sens(C + E) <= (1 + rho) sens(C)`` needs no
    small ``rho``), so a larger ``rho`` is charged, not refused: above
    :data:`WARN_RESIDUAL` (1 %) with a :class:`~privlearn.errors.NoiseRoundingWarning`
    (once per strategy and precision), up to :data:`MAX_RECURRENCE_RESIDUAL` (10 %).

    Raises
    ------
    ParameterValueError
        ``rho`` exceeds :data:`MAX_RECURRENCE_RESIDUAL`: the rounding of ``n`` steps at
        ``unit_roundoff`` would cost over 10 % more sensitivity than ``C``'s, where the
        noise in float64 costs next to nothing."""
    if _hashes(strategy, participation):
        rho = _residual(strategy, participation, n, base, unit_roundoff)
    else:  # a schema registered by a user may not hash: not cached
        rho = _residual.__wrapped__(strategy, participation, n, base, unit_roundoff)
    if rho == 0.0:
        return 1.0
    precision = "float32" if unit_roundoff >= SINGLE_UNIT_ROUNDOFF else "float64"
    todo = (
        "run the noise in float64 (the PyTorch engine: secure_mode=True, or float64 "
        "parameters, model.double(); NumPy's CorrelatedNoise always does, accounted with "
        "noise_precision='float64'), use fewer steps per strategy (steps=, epochs=), "
        "fewer buffers (buffers=) or bands, or a banded strategy (noise='banded', "
        "optimize_banded_toeplitz)"
    )
    if not rho <= MAX_RECURRENCE_RESIDUAL:
        raise ParameterValueError(
            f"steps={n} is too many for the {precision} noise recurrence of {strategy!r}: "
            f"its rounding errors (certified relative sensitivity bound {rho:.3g}, at "
            f"most {MAX_RECURRENCE_RESIDUAL} accepted; a BLT's decays are rounded once per "
            f"step, so the bound grows with the steps) would be charged a factor "
            f"{factor_from_residual(rho):.3g} on the sensitivity; {todo}"
        )
    factor = factor_from_residual(rho)
    if rho > WARN_RESIDUAL and (strategy, precision) not in _WARNED:
        _WARNED.add((strategy, precision))
        warnings.warn(
            f"the {precision} noise recurrence of {strategy!r} over {n} steps is charged "
            f"a factor {factor:.4g} on its sensitivity for its rounding (certified bound "
            f"{rho:.3g}, above {WARN_RESIDUAL}; a BLT's decays are rounded once per step, "
            "so the bound grows with the steps): epsilon grows by about as much. To charge "
            f"less, {todo}",
            NoiseRoundingWarning,
            stacklevel=4,
        )
    return factor


def check_single_precision(recurrence: BandedRecurrence | BufferedRecurrence) -> None:
    """Refuse running ``recurrence`` in float32 when its constants rounded to float32
    make a recurrence whose ``C^{-1}`` grows (spectral radius above 1, as
    :func:`~privlearn.correlated.strategies.check_stable` for the float64 one): such a
    ``C`` (a root of multiplicity ``k`` at distance ``d < 2^-24 / k`` of the unit circle,
    roughly) is too ill-conditioned for float32 noise, which would grow without bound.

    Raises
    ------
    ConfigurationError
        The float32 recurrence is unstable."""
    if isinstance(recurrence, BandedRecurrence):
        single = BandedRecurrence(tuple(np.float32(recurrence.coefs).astype(float).tolist()))
    else:
        single = BufferedRecurrence(
            tuple(np.float32(recurrence.buf_decay).astype(float).tolist()),
            tuple(np.float32(recurrence.output_scale).astype(float).tolist()),
        )
    radius = single.spectral_radius
    if not radius <= STABLE_RADIUS:
        raise ConfigurationError(
            f"the noise recurrence {recurrence!r} is too ill-conditioned for float32: "
            f"with its coefficients rounded to float32 its spectral radius is "
            f"{radius:.6g} > 1, so the float32 noise grows like {radius:.4g}^t instead of "
            "being C^{-1} z; run the noise state in float64 (secure_mode=True, or float64 "
            "parameters), or use a better-conditioned strategy (optimize_banded_toeplitz, "
            "optimize_blt, BandedToeplitz.square_root, fewer bands)"
        )
