"""How far the noise privlearn adds for a dense ``C`` is from ``C^{-1} z``, as a certified
factor on the sensitivity.

The noise of a :class:`~privlearn.correlated.strategies.DenseStrategy` is ``A z`` with
``A`` the computed ``C^{-1}`` (float64; rounded to float32 when the PyTorch engine runs its
noise in float32), not the exact inverse. The run then releases ``X + A z = A (A^{-1} X +
z)``: the Gaussian mechanism of the strategy ``C' = A^{-1}``, post-processed. With the
residual ``R = C A - I``, ``C' = (I + R)^{-1} C``, so for every contribution ``D``,
``||C' D||_F <= ||C D||_F / (1 - ||R||_2)`` when ``||R||_2 < 1``: the sensitivity of
what runs is at most ``sens(C) / (1 - ||R||_2)`` (Higham, Accuracy and Stability of
Numerical Algorithms, 2002, Sec. 14.1, for residual bounds of a computed inverse). A
leading, trailing or any principal block of a lower-triangular ``C A`` is the product of
the blocks, so the same bound holds for a run of fewer steps.

The noise of step ``t`` is then computed as an inner product of row ``t`` of ``A`` with
the draws so far, whose rounding (Higham 2002, Eq. (3.4)) makes it that of ``A + D``,
``|D| <= gamma_{n+1} |A|``: the residual charged is ``||R||_2 + gamma_{n+1} || |C| |A|
||_2`` (:func:`sensitivity_factor`), in float32 the larger part for long runs (about
``n 2^-24 || |C| |A| ||_2``).

For a well-conditioned ``C`` (every optimised one) ``||R||_2`` is about ``1e-16`` in float64
and ``1e-6`` in float32; for an ill-conditioned one the computed inverse can be the
inverse of a very different matrix (measured: a ``C`` of sensitivity 3 whose float32
noise is that of a strategy of sensitivity ``10^8``), which is refused.
"""

from __future__ import annotations

import math
import sys

import numpy as np

__all__ = [
    "MAX_RESIDUAL",
    "factor_from_residual",
    "product_bound",
    "residual_bound",
    "sensitivity_factor",
]

_U = sys.float_info.epsilon

#: largest certified ``||C A - I||_2`` accepted: the sensitivity of what runs is then at
#: most ``1 / (1 - MAX_RESIDUAL)``, about 1 %, above that of ``C`` (and accounted so)
MAX_RESIDUAL = 1e-2


def residual_bound(c: np.ndarray, a: np.ndarray) -> float:
    """Certified upper bound on ``||C A - I||_2`` for float64 matrices ``c`` and ``a``
    (``n x n``): ``||fl(C A - I)||_F`` plus the rounding of the product, ``gamma_{n+1}
    ||C||_F ||A||_F`` (Higham 2002, Eq. (3.13); ``|| |C| |A| ||_F <= ||C||_F ||A||_F``),
    with a margin for the norms' own rounding. ``inf`` when anything overflows."""
    n = c.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        r = c @ a
        r[np.diag_indices(n)] -= 1.0
        computed = float(np.linalg.norm(r))
        gamma = (n + 2) * _U / (1.0 - (n + 2) * _U)
        product = gamma * float(np.linalg.norm(c)) * float(np.linalg.norm(a))
    if not (math.isfinite(computed) and math.isfinite(product)):
        return math.inf
    margin = 1.0 + (2 * n * n + 16) * _U  # the Frobenius norms' and the sum's rounding
    return math.nextafter((computed * (1.0 + 2 * _U) + product) * margin, math.inf)


def product_bound(c: np.ndarray, a: np.ndarray) -> float:
    """Certified upper bound on ``|| |C| |A| ||_2`` for float64 ``c`` and ``a``:
    ``sqrt(||P||_1 ||P||_inf)`` (Higham 2002, Eq. (6.21)) for the non-negative ``P =
    |C| |A|``, whose largest column and row sums are formed as ``(1^T |C|) |A|`` and
    ``|C| (|A| 1)`` (``O(n^2)``; each sum of non-negative terms within ``gamma_n`` of the
    exact one, Higham 2002, Eq. (3.4)), with a margin for the square root's rounding.
    ``inf`` when anything overflows."""
    n = c.shape[0]
    ones = np.ones(n)
    with np.errstate(over="ignore", invalid="ignore"):
        ac, aa = np.abs(c), np.abs(a)
        rows = float((ac @ (aa @ ones)).max())
        cols = float(((ones @ ac) @ aa).max())
        norm = math.sqrt(rows * cols)
    if not math.isfinite(norm):
        return math.inf
    gamma = (n + 2) * _U / (1.0 - (n + 2) * _U)  # each of the two stages of each sum
    return math.nextafter(norm / (1.0 - gamma) ** 2 * (1.0 + 8 * _U), math.inf)


def _gamma(k: int, u: float) -> float:
    """``k u / (1 - k u)`` rounded up (Higham 2002, Lemma 3.1; inf when ``k u >= 1``)."""
    return math.inf if k * u >= 1.0 else math.nextafter(k * u / (1.0 - k * u), math.inf)


def sensitivity_factor(c: np.ndarray, inverse: np.ndarray) -> tuple[float, float]:
    """``(factor, residual)``: the largest certified residual of the noise ``inverse``
    (float64) applies, in float64 or rounded to float32 (the PyTorch engine's), and
    ``factor >= 1``, an upper bound on ``1 / (1 - residual)`` (inf when ``residual >=
    1``).

    The noise of step ``t`` is the inner product of row ``t`` of the applied inverse
    ``A`` (float64, or float32) with the ``t + 1`` draws so far, computed in float32 or
    float64 and scaled by the noise's standard deviation: within ``gamma_{n+1} |A| |z|``
    of ``A z`` in any order of summation (Higham 2002, Eq. (3.4); float32's ``gamma``,
    which covers float64's), so it is ``(A + D) z`` with ``|D| <= gamma_{n+1} |A|``,
    whose residual is at most ``||C A - I||_2 + gamma_{n+1} || |C| |A| ||_2``: the
    larger residual of the two ``A`` plus float32's inner-product part."""
    n = c.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        single = inverse.astype(np.float32).astype(np.float64)
    # |inverse| <= |single| / (1 - 2^-24); float32's gamma covers float64 arithmetic,
    # and either applied inverse (a coefficient may reach the arithmetic unrounded)
    u32 = 2.0**-24
    products = product_bound(c, single) / (1.0 - u32)
    rho = max(residual_bound(c, inverse), residual_bound(c, single))
    rho = math.nextafter((rho + _gamma(n + 1, u32) * products) * (1.0 + 4 * _U), math.inf)
    return factor_from_residual(rho), rho


def factor_from_residual(rho: float) -> float:
    """An upper bound ``>= 1`` on ``1 / (1 - rho)`` (inf when ``rho >= 1``): the factor
    on the sensitivity for a certified relative deviation ``rho`` of the strategy that
    runs from ``C`` -- of the dense noise (this module's docstring) and of the Toeplitz
    recurrences (:mod:`privlearn.correlated._recurrence_fidelity`, where the deviation is
    additive, ``sens <= (1 + rho) sens(C) <= sens(C) / (1 - rho)``)."""
    if not rho < 1.0:
        return math.inf
    factor = (1.0 / (1.0 - rho)) * (1.0 + 4 * _U)
    return math.nextafter(factor, math.inf)
