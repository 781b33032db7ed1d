"""The fast paths of fixed-size (sampling without replacement) accounting.

* The forward differences ``D_k`` of the Gaussian's moments (Wang, Balle &
  Kasiviswanathan 2019, Theorem 27) evaluated in floating point where that is certified:
  against 300-digit mpmath sums (a certified upper bound, tight) and never above the
  decimal evaluation they replace, at every order, on a grid of noise multipliers.
* The PLD accountant's RDP cap for fixed-size sampling: skipped only where the PLD
  bracket is closed to 1e-10 (the RDP bound, at least the true value, is then checked
  not to be below the PLD upper end by more than that), memoised per query, and still
  applied where it helps (subsampled pure DP, against the Renyi bound by enumeration in
  ``test_extreme_grid``).
"""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import Gaussian, PureDP, compose, get_accountant, subsample
from privlearn.accounting import _pld_rdp_cap as cap
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


@pytest.mark.parametrize("sigma", [0.3, 1.0, 5.0])
@pytest.mark.parametrize("q", [1e-5, 0.01, 0.5])
@pytest.mark.parametrize("delta", [1e-5, 1e-12])
def test_one_fixed_size_step_skips_the_cap_only_where_it_cannot_help(
    monkeypatch, sigma: float, q: float, delta: float
) -> None:
    m = subsample(Gaussian(sigma), rate=q, scheme="fixed")
    rdp = get_accountant("rdp").epsilon(m, delta).upper  # at least the true epsilon
    calls = []
    real = cap._rdp_upper_compute
    monkeypatch.setattr(
        cap, "_rdp_upper_compute", lambda *a: calls.append(a) or real(*a), raising=True
    )
    cap.clear_cache()
    b = get_accountant("pld").epsilon(m, delta)
    assert calls == []  # the one-step bracket is closed: the RDP accountant is not run
    assert b.accountant == "pld" and b.upper - b.lower <= cap._TIGHT * b.upper
    # what the skipped cap could have given: never below the upper end by more than that
    assert b.upper <= rdp * (1.0 + cap._TIGHT)
    assert b.lower <= rdp


def test_fixed_size_composition_is_capped_and_memoised(monkeypatch) -> None:
    # subsampled pure DP: the RDP bound is the tighter one after many steps (so the cap
    # runs); the same question again reads the memoised RDP bound
    m = compose(subsample(PureDP(1.0), rate=0.01, scheme="fixed"), steps=100)
    calls = []
    real = cap._rdp_upper_compute
    monkeypatch.setattr(cap, "_rdp_upper_compute", lambda *a: calls.append(a) or real(*a))
    cap.clear_cache()
    first = get_accountant("pld").epsilon(m, 1e-5)
    second = get_accountant("pld").epsilon(m, 1e-5)
    assert len(calls) == 1
    assert first == second and first.accountant == "rdp"
    assert first.upper == get_accountant("rdp").epsilon(m, 1e-5).upper


@pytest.mark.parametrize("sigma, q", [(0.6, 0.01), (4.0, 0.5)])
def test_fixed_size_rdp_curve_against_dp_accounting(sigma: float, q: float) -> None:
    # the same bound (Wang, Balle & Kasiviswanathan 2019, Theorem 27), dp_accounting's in
    # floating point without a rounding bound: ours at most its certified rounding above
    # it at orders 2 to 256 (their noise multiplier is per replace-one
    # sensitivity: sigma / 2)
    np = pytest.importorskip("numpy")
    rdp_mod = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")
    orders = np.array([2.0, 3.0, 5.0, 8.0, 13.0, 34.0, 89.0, 233.0, 256.0])
    ref = np.array(
        [rdp_mod._compute_rdp_sample_wor_gaussian_scalar(q, sigma / 2, a) for a in orders]
    )
    got = subsample(Gaussian(sigma), q, scheme="fixed").rdp(orders)
    assert np.all(got <= ref * (1.0 + 1e-8))
    assert np.all(got >= ref * (1.0 - 1e-8))


def test_fixed_size_directions_share_one_upper_composition(monkeypatch) -> None:
    # both directions of fixed-size sampling compose the same symmetrised upper pair: it
    # is composed once per grid, and the answer is the one of composing it twice
    from privlearn.accounting import _pld_fft
    from privlearn.accounting import pld as pld_mod

    uppers = []
    real = _pld_fft.compose_fft

    def counting(*args, **kwargs):
        uppers.append(kwargs.get("upper"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_pld_fft, "compose_fft", counting)
    m = compose(subsample(Gaussian(1.0), rate=0.01, scheme="fixed"), steps=50)
    shared = pld_mod.PLDAccountant().epsilon(m, 1e-5)
    n_shared = uppers.count(True)

    def unshared():
        def compose_upper(pmfs, h, a, b, lam_a, lam_b, accurate):
            return _pld_fft.compose_fft(pmfs, h, a, b, lam_a, lam_b, upper=True, accurate=accurate)

        return compose_upper

    monkeypatch.setattr(pld_mod.dsc, "shared_uppers", unshared)
    uppers.clear()
    separate = pld_mod.PLDAccountant().epsilon(m, 1e-5)
    assert separate == shared
    assert 0 < n_shared and 2 * n_shared == uppers.count(True)


def test_a_zero_dimensional_array_query_is_capped_as_its_float() -> None:
    # the memo's key holds the query: a value that cannot be hashed (a 0-d array, as
    # np.asarray gives) is answered uncached, the same as its float, capped alike
    np = pytest.importorskip("numpy")
    m = compose(subsample(PureDP(1.0), rate=0.01, scheme="fixed"), steps=100)
    cap.clear_cache()
    got = get_accountant("pld").epsilon(m, np.asarray(1e-5))
    assert got == get_accountant("pld").epsilon(m, 1e-5)
    assert got.upper == get_accountant("rdp").epsilon(m, 1e-5).upper
