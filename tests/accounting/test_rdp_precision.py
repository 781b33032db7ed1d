"""Relative precision of the Renyi-DP sums at small divergences (tiny sampling rates, large
noise, large orders): never below the exact value, and within 1e-9 of it and of the peers.

The exact references are the closed-form integer-order sums evaluated in 60-digit decimal
arithmetic (Mironov, Talwar & Zhang 2019, Section 3.3).
"""

from __future__ import annotations

import decimal
import math

import numpy as np
import pytest

from privlearn.accounting import Gaussian, Laplace, PureDP, RandomizedResponse, subsample
from privlearn.accounting._rdp_math import _log_binom


def _exact_sampled_gaussian_rdp(q: float, sigma: float, n: int) -> float:
    """``log(A_n) / (n - 1)`` with ``A_n - 1 = sum_{k>=2} C(n,k) q^k (1-q)^(n-k)
    (e^{(k^2-k)/(2 sigma^2)} - 1)`` in 60-digit decimal arithmetic (the inputs are exact
    floats)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        dq, two_s2 = decimal.Decimal(q), decimal.Decimal(2.0 * sigma * sigma)
        one = decimal.Decimal(1)
        excess = decimal.Decimal(0)
        for k in range(2, n + 1):
            grow = (decimal.Decimal(k * k - k) / two_s2).exp() - one
            excess += math.comb(n, k) * dq**k * (one - dq) ** (n - k) * grow
        return float((one + excess).ln() / (n - 1))


@pytest.mark.parametrize(
    "n", [2, 3, 31, 32, 33, 64, 255, 256, 1024, 4096]
    + [pytest.param(n, marks=pytest.mark.slow) for n in (65536, 131072)])
def test_log_binom_accurate_at_every_size(n):
    k = np.unique(np.r_[np.arange(min(n, 40) + 1), n - np.arange(min(n, 40) + 1),
                        np.linspace(0, n, 41).round()])
    got = _log_binom(np.full(k.shape, float(n)), k)
    ref = np.array([math.log(math.comb(n, int(j))) for j in k.tolist()])
    tol = 4 * np.finfo(float).eps * (np.abs(ref) + math.log1p(n) + 1.0)
    assert np.all(np.abs(got - ref) <= tol)


@pytest.mark.parametrize(
    "q,sigma,orders",
    [
        (1e-7, 100.0, [2, 8, 256]),   # divergence ~1e-16: was rounded to 0 at order 256
        (1e-5, 10.0, [2, 63, 256]),   # was below the exact value at order 256
        (1e-3, 2.0, [2, 5, 32]),
        (0.1, 0.5, [2, 16, 64]),
    ],
)
def test_sampled_gaussian_integer_orders_exact_and_never_below(q, sigma, orders):
    got = subsample(Gaussian(sigma), q).rdp([float(a) for a in orders])
    ref = np.array([_exact_sampled_gaussian_rdp(q, sigma, n) for n in orders])
    assert np.all(got >= ref)
    np.testing.assert_allclose(got, ref, rtol=1e-11)


def test_sampled_gaussian_large_order_not_below_exact():
    # order 1024: the (now) exact log-binomials keep the sum at or above the truth
    got = subsample(Gaussian(10.0), 1e-5).rdp(1024.0)
    ref = _exact_sampled_gaussian_rdp(1e-5, 10.0, 1024)
    assert ref <= got <= ref * (1 + 1e-11)


@pytest.mark.parametrize("sigma", [0.8, 2.0, 10.0])
@pytest.mark.parametrize("q", [1e-3, 1e-2, 0.1])
def test_sampled_gaussian_integer_orders_match_peers(q, sigma):
    orp = pytest.importorskip("opacus.accountants.analysis.rdp")
    orders = [float(a) for a in range(2, 64)] + [128.0, 256.0]
    ours = subsample(Gaussian(sigma), q).rdp(orders)
    np.testing.assert_allclose(ours, orp.compute_rdp(q=q, noise_multiplier=sigma, steps=1,
                                                     orders=orders), rtol=1e-9)
    dpa = pytest.importorskip("dp_accounting")
    acc = dpa.rdp.RdpAccountant(orders)
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)))
    np.testing.assert_allclose(ours, np.array(acc._rdp), rtol=1e-9)


def test_subsampled_laplace_small_rate_keeps_relative_precision():
    # Zhu & Wang's bound summed as its excess over 1: at q = 1e-6 the order-2 value is
    # C(2,2) q^2 (e^{eps(2)} - 1) to first order, not 1e-15 of rounding noise
    b = 1.0
    eps2 = math.log(2 / 3 * math.exp(1 / b) + 1 / 3 * math.exp(-2 / b))  # Mironov Prop. 6
    q = 1e-6
    exact = math.log1p(q * q * math.expm1(eps2))
    got = subsample(Laplace(b), q).rdp(2.0)
    assert exact <= got <= exact * (1 + 1e-9)


def _mp_fractional_rdp(q: float, sigma: float, alpha: float) -> float:
    """The fractional-order series of Mironov, Talwar & Zhang (2019), Section 3.3, in
    60-digit arithmetic (the alternating tail beyond ``alpha + 400`` terms is far below
    the digits compared)."""
    mp = pytest.importorskip("mpmath")
    with mp.workdps(60):
        q_, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
        z0 = s**2 * mp.log(1 / q_ - 1) + mp.mpf(1) / 2
        total = mp.mpf(0)
        for i in range(int(alpha) + 400):
            j = a - i
            s0 = q_**i * (1 - q_) ** j * mp.exp((i * i - i) / (2 * s * s)) * mp.ncdf((z0 - i) / s)
            s1 = q_**j * (1 - q_) ** i * mp.exp((j * j - j) / (2 * s * s)) * mp.ncdf((j - z0) / s)
            total += mp.binomial(a, i) * (s0 + s1)
        return float(mp.log(total) / (a - 1))


@pytest.mark.parametrize("q,sigma,alpha", [(1e-3, 10.0, 255.5), (0.05, 10.0, 50.5),
                                           (0.05, 3.0, 50.5)])
def test_sampled_gaussian_fractional_orders_never_below(q, sigma, alpha):
    # large fractional orders: log Gamma(alpha + 1) ~ 1e3, whose rounding the series'
    # error bound now covers (it was 1.5e-10 below the value at alpha = 255.5)
    ref = _mp_fractional_rdp(q, sigma, alpha)
    got = subsample(Gaussian(sigma), q).rdp(alpha)
    assert ref <= got <= ref * (1 + 1e-9)


_LAPLACE_ORDERS = [1 + 1e-9, 1 + 1e-6, 1.1, 1.5, 2.0, 10.0, 1e3, 1e6, 1e10]


@pytest.mark.parametrize("eps", [1e-4, 0.01, 1.0, 100.0])
def test_laplace_rdp_exact_to_full_precision(eps):
    # Mironov (2017), Prop. 6, in 50-digit arithmetic: the first-order terms cancel, so
    # the divergence (~ alpha eps^2 / 2 for small eps or alpha near 1) was computed
    # with absolute, not relative, error (530% high at alpha = 1 + 1e-6, eps = 1e-4)
    mp = pytest.importorskip("mpmath")
    with mp.workdps(50):
        e = mp.mpf(eps)
        ref = np.array([float(mp.log(a / (2 * a - 1) * mp.exp((a - 1) * e)
                                     + (a - 1) / (2 * a - 1) * mp.exp(-a * e)) / (a - 1))
                        for a in map(mp.mpf, _LAPLACE_ORDERS)])
    got = Laplace(1 / eps).rdp(_LAPLACE_ORDERS)
    assert np.all(got >= ref)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


@pytest.mark.parametrize("eps", [1e-3, 0.1, 10.0])
def test_laplace_rdp_matches_dp_accounting(eps):
    dpa = pytest.importorskip("dp_accounting")
    acc = dpa.rdp.RdpAccountant(_LAPLACE_ORDERS)
    acc.compose(dpa.LaplaceDpEvent(1 / eps))
    np.testing.assert_allclose(Laplace(1 / eps).rdp(_LAPLACE_ORDERS), acc._rdp, rtol=1e-9)


def _mp_rr_divergence(mp, p, r, rest, alpha):
    return mp.log(p**alpha * r ** (1 - alpha) + r**alpha * p ** (1 - alpha) + rest) / (alpha - 1)


@pytest.mark.parametrize("p,k", [(0.5001, 2), (0.75, 2), (0.34, 3), (0.2000001, 5), (0.9, 10)])
def test_randomized_response_rdp_exact_and_never_below(p, k):
    mp = pytest.importorskip("mpmath")
    with mp.workdps(60):
        mp_p = mp.mpf(p)
        r = (1 - mp_p) / (k - 1)
        ref = np.array([float(_mp_rr_divergence(mp, mp_p, r, (k - 2) * r, mp.mpf(a)))
                        for a in _LAPLACE_ORDERS])
    got = RandomizedResponse(p, k).rdp(_LAPLACE_ORDERS)
    assert np.all(got >= ref)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


@pytest.mark.parametrize("eps", [1e-6, 1e-3, 1.0])
def test_pure_dp_rdp_never_below_randomized_response(eps):
    # the RDP of PureDP (also the cap of every subsampled pure-DP bound) is that of binary
    # randomized response: it came out 0 at eps = 1e-6 for orders near 1, and below the
    # exact divergence at order 1e6 (the products a log p were rounded without margin)
    mp = pytest.importorskip("mpmath")
    with mp.workdps(60):
        e = mp.mpf(eps)
        p = 1 / (1 + mp.exp(-e))
        ref = np.array([float(_mp_rr_divergence(mp, p, 1 - p, 0, mp.mpf(a)))
                        for a in _LAPLACE_ORDERS])
    got = PureDP(eps).rdp(_LAPLACE_ORDERS)
    assert np.all(got >= ref)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def test_gaussian_rdp_below_float_range_is_silent_inf():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Gaussian(1e-300).rdp(2.0) == math.inf


# ----------------------------------------------------------------------------------------
# fractional orders at small rates: relative precision

#: Opacus's default orders (mostly fractional)
_OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)]


def _mp_series_excess(mp, q, sigma, alpha):
    """``A_alpha - 1`` from the fractional series of Mironov, Talwar & Zhang (2019),
    Section 3.3, in the current mpmath precision, summed until the first omitted term
    (which bounds the alternating tail once ``i > alpha + 1``) is below 1e-25 of the
    excess; None if that takes more than 20000 terms."""
    q_, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
    z0 = s**2 * mp.log(1 / q_ - 1) + mp.mpf(1) / 2
    total = mp.mpf(-1)
    for i in range(20000):
        j = a - i
        s0 = q_**i * (1 - q_) ** j * mp.exp((i * i - i) / (2 * s * s)) * mp.ncdf((z0 - i) / s)
        s1 = q_**j * (1 - q_) ** i * mp.exp((j * j - j) / (2 * s * s)) * mp.ncdf((j - z0) / s)
        term = mp.binomial(a, i) * (s0 + s1)
        if i > alpha + 1 and abs(term) < mp.mpf(10) ** -25 * abs(total):
            return total
        total += term
    return None


def _mp_integral_excess(mp, q, sigma, alpha):
    """``A_alpha - 1 = E[(1 + q (L(X) - 1))^alpha - 1]``, ``X ~ N(0, sigma^2)``, ``L(x) =
    e^{(2x - 1) / (2 sigma^2)}`` (Mironov, Talwar & Zhang 2019, Section 3), by mpmath's
    quadrature in the current precision: independent of the series."""
    q_, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
    z0 = s**2 * mp.log(1 / q_ - 1) + mp.mpf(1) / 2

    def f(x):
        u = q_ * mp.expm1((2 * x - 1) / (2 * s * s))
        return mp.npdf(x, 0, s) * mp.expm1(a * mp.log1p(u))

    pts = {mp.mpf(0), mp.mpf(1) / 2, z0, a}
    for c in (mp.mpf(0), a, z0):
        pts.update(c + k * s for k in (-8, -4, -2, 2, 4, 8))
    return mp.quad(f, [-mp.inf, *sorted(pts), mp.inf])


def _rdp_from_excess(mp, excess, alpha):
    return float(mp.log1p(excess) / (mp.mpf(alpha) - 1))


@pytest.mark.parametrize("q,sigma,alpha", [
    (1e-7, 2.0, 5.5),    # was 28% above the exact value
    (1e-5, 10.0, 1.5),   # 2.6% above
    (1e-3, 2.0, 5.5),    # 2.9e-9 above
    (0.01, 10.0, 1.7),   # 1.9e-9 above
])
def test_sampled_gaussian_fractional_orders_relatively_exact(q, sigma, alpha):
    # the fractional series summed as A - 1: relative, not absolute, precision at small
    # rates (the value at q = 1e-7 is ~1e-14, below the absolute error of summing A)
    mp = pytest.importorskip("mpmath")
    with mp.workdps(40):
        excess = _mp_series_excess(mp, q, sigma, alpha)
        assert excess is not None
        ref = _rdp_from_excess(mp, excess, alpha)
    got = subsample(Gaussian(sigma), q).rdp(alpha)
    assert ref <= got <= ref * (1 + 1e-10)


_FRAC_GRID_ORDERS = [1.1, 1.5, 2.5, 3.7, 7.5, 15.5, 31.5, 63.5]


@pytest.mark.slow
@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 10.0])
@pytest.mark.parametrize("q", [1e-7, 1e-5, 1e-3, 0.01, 0.1, 0.45])
def test_sampled_gaussian_fractional_orders_exact_on_grid(q, sigma):
    # against the defining integral in 30-digit quadrature (independent of the series),
    # and, where their absolute-precision sums are themselves within 1e-10 of it, Opacus
    # and dp_accounting
    mp = pytest.importorskip("mpmath")
    orp = pytest.importorskip("opacus.accountants.analysis.rdp")
    dpa = pytest.importorskip("dp_accounting")
    with mp.workdps(30):
        ref = np.array([_rdp_from_excess(mp, _mp_integral_excess(mp, q, sigma, a), a)
                        for a in _FRAC_GRID_ORDERS])
    got = subsample(Gaussian(sigma), q).rdp(_FRAC_GRID_ORDERS)
    assert np.all(got >= ref)
    np.testing.assert_allclose(got, ref, rtol=1e-10)
    acc = dpa.rdp.RdpAccountant(_FRAC_GRID_ORDERS)
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)))
    for peer in (orp.compute_rdp(q=q, noise_multiplier=sigma, steps=1,
                                 orders=_FRAC_GRID_ORDERS), np.array(acc._rdp)):
        accurate = np.abs(peer - ref) <= 1e-10 * ref
        np.testing.assert_allclose(got[accurate], peer[accurate], rtol=1e-9)


@pytest.mark.parametrize("sigma", [2.0, 5.0])
def test_sampled_gaussian_fractional_orders_match_opacus(sigma):
    # q = 1e-3, Opacus's orders from 4 on: there Opacus's absolute-precision sum is
    # relatively accurate to ~1e-10 (below, its error reaches 4e-8), and ours must agree
    # to 1e-9 (it was up to 8e-8 above)
    orp = pytest.importorskip("opacus.accountants.analysis.rdp")
    q, orders = 1e-3, [a for a in _OPACUS_ORDERS if a >= 4.0]
    ours = subsample(Gaussian(sigma), q).rdp(orders)
    peer = orp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders)
    np.testing.assert_allclose(ours, peer, rtol=1e-9)


@pytest.mark.parametrize("q,sigma,steps,delta", [
    (1e-5, 0.6, 10**7, 1e-8),
    (1e-3, 1.0, 10**5, 1e-5),
    pytest.param(1e-7, 0.8, 10**9, 1e-9, marks=pytest.mark.slow),
    pytest.param(1e-4, 0.8, 10**6, 1e-6, marks=pytest.mark.slow),
    pytest.param(0.01, 1.1, 10**4, 1e-5, marks=pytest.mark.slow),
])
def test_composed_epsilon_matches_opacus_and_exact(q, sigma, steps, delta):
    # epsilon over Opacus's orders (Balle et al. 2020, Thm 21, as Opacus's
    # get_privacy_spent): within 1e-6 of Opacus's RDPAccountant, never below it by more
    # than its own rounding; at the optimal order, at or above the epsilon of the exact
    # RDP and within 1e-9 of it; the public epsilon (refined over real orders) is no larger
    mp = pytest.importorskip("mpmath")
    opacus_accountants = pytest.importorskip("opacus.accountants")
    from privlearn.accounting import compose
    from privlearn.accounting.conversion import epsilon_from_rdp

    acc = opacus_accountants.RDPAccountant()
    acc.history = [(sigma, q, steps)]
    peer = acc.get_epsilon(delta)
    mech = compose(subsample(Gaussian(sigma), q), steps=steps)
    orders = np.array(_OPACUS_ORDERS)
    per_order = epsilon_from_rdp(orders, mech.rdp(_OPACUS_ORDERS), delta)
    ours = float(np.min(per_order))
    assert ours >= peer * (1 - 1e-7)
    assert ours == pytest.approx(peer, rel=1e-6)
    best = float(orders[np.argmin(per_order)])
    with mp.workdps(40):
        if best == round(best):
            ref_rdp = _exact_sampled_gaussian_rdp(q, sigma, int(best))
        else:
            ref_rdp = _rdp_from_excess(mp, _mp_series_excess(mp, q, sigma, best), best)
    ref = float(epsilon_from_rdp(np.array([best]), np.array([steps * ref_rdp]), delta)[0])
    assert ref <= ours <= ref * (1 + 1e-9)
    assert float(mech.epsilon(delta, accountant="rdp")) <= ours * (1 + 1e-12)
