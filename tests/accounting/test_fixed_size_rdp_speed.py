"""The fast paths of fixed-size (sampling without replacement) accounting.

* The forward differences ``D_k`` of the Gaussian's moments (Wang, Balle &
  Kasiviswanathan 2019, Theorem 27) evaluated in floating point where that is certified:
  against 300-digit mpmath sums (a certified upper bound, tight) and never above the
  decimal evaluation they replace, at every order, on a grid of noise multipliers.
"""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import _rdp_wor_gaussian as wor


def _decimal_only(sigma: float) -> list[float]:
    """Every ``D_k`` bound from the decimal evaluation alone (the code before the fast
    path)."""
    import decimal

    n = wor.MAX_IMPROVED_ORDER
    out = [math.inf] * (n + 1)
    wor._decimal_differences(
        decimal.Decimal(2.0 * sigma * sigma),
        n * (n - 1) / (2.0 * sigma * sigma),
        list(range(2, n + 1)),
        out,
    )
    return out


@pytest.mark.parametrize("sigma", [0.05, 0.15, 0.5, 1.3, 2.0, 5.0])
def test_float_differences_never_above_decimal(sigma: float) -> None:
    got = wor.gaussian_log_forward_differences(sigma)
    ref = _decimal_only(sigma)
    for k in range(2, wor.MAX_IMPROVED_ORDER + 1):
        assert got[k] <= ref[k], (sigma, k, got[k], ref[k])


def test_float_path_answers_small_noise_without_decimals() -> None:
    # at a noise multiplier of 0.5 (1 at replace-one sensitivity) nothing cancels: every
    # order is certified in floating point (the decimal evaluation took 0.13 s)
    out = [math.inf] * (wor.MAX_IMPROVED_ORDER + 1)
    pending = wor._float_differences(2.0 * 0.5 * 0.5, wor.MAX_IMPROVED_ORDER, out)
    assert pending == []
    assert all(math.isfinite(x) for x in out[2:])


@pytest.mark.parametrize(
    "sigma, orders", [(0.15, (2, 3, 40, 258)), (0.5, (2, 7, 129, 258)), (2.0, (10, 64, 257))]
)
def test_float_differences_against_mpmath(sigma: float, orders: tuple) -> None:
    mpmath = pytest.importorskip("mpmath")
    out = [math.inf] * (wor.MAX_IMPROVED_ORDER + 1)
    wor._float_differences(2.0 * sigma * sigma, wor.MAX_IMPROVED_ORDER, out)
    with mpmath.workdps(300):
        s2 = 2 * mpmath.mpf(sigma) ** 2
        for k in orders:
            assert math.isfinite(out[k]), k  # answered in floating point
            d = mpmath.fsum(
                (-1) ** (k - i) * mpmath.binomial(k, i) * mpmath.exp(mpmath.mpf(i * (i - 1)) / s2)
                for i in range(k + 1)
            )
            exact = float(mpmath.log(d))
            assert exact <= out[k] <= exact + 1e-12 * max(1.0, abs(exact)), (k, exact, out[k])
