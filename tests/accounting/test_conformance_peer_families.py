"""Unit-test families of the peer accountants, through privlearn's public API.

Transcribed as parameters and expected values from Google dp_accounting
(pld/privacy_loss_mechanism_test.py, rdp/rdp_privacy_accountant_test.py), Microsoft
prv_accountant (tests/test_accountant.py, tests/test_dpsgd.py,
tests/test_privacy_random_variables/) and Opacus (tests/accountants_test.py); the
families already in ``test_conformance_dp_accounting.py`` and ``test_peer_agreement.py``
are not repeated.

privlearn's values are certified bounds: where the peer's value is exact, the check is
``lower <= peer <= upper`` with the upper end within the peer's own tolerance; where the
peer is approximate (an estimate, a central-limit approximation, a search stopped at a
tolerance) the test says so and checks the direction that must hold.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from privlearn.accounting import (
    ApproxDP,
    CertificationError,
    Gaussian,
    Laplace,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    calibrate,
    compose,
    planned_steps,
    subsample,
)
from privlearn.accounting.conversion import delta_from_rdp, epsilon_from_rdp

# dp_accounting's assertAlmostEqual (7 places): |difference| < 5e-8
_PLACES_7 = 5e-8


# ----------------------------------------------------------------------------------------
# dp_accounting pld/privacy_loss_mechanism_test.py: get_delta_for_epsilon
# ----------------------------------------------------------------------------------------
# dp_accounting's adjacency types with sensitivity D: ADD is H(N(0) || (1-q) N(0) +
# q N(D)) -- privlearn's neighbouring="add_only"; REMOVE is H((1-q) N(0) + q N(-D) ||
# N(0)) -- "remove_only"; REPLACE is H((1-q) N(0) + q N(-D) || (1-q) N(0) + q N(D)) --
# privlearn's Poisson replace-one pair with the bound C = D. The noise multiplier is
# standard deviation / D (Laplace: scale / D). Negative epsilons are not part of the
# public API (epsilon >= 0) and are left out.
_ADD, _REM, _REP = "add_only", "remove_only", "replace_one"

_GAUSSIAN_DELTAS = [
    # (standard deviation, sensitivity, sampling probability, adjacency, epsilon, delta)
    (1.0, 1.0, 1.0, _ADD, 1.0, 0.12693674),
    (2.0, 2.0, 1.0, _ADD, 1.0, 0.12693674),
    (1.0, 3.0, 1.0, _ADD, 1.0, 0.78760074),
    (1.0, 1.0, 1.0, _ADD, 2.0, 0.02092364),
    (1.0, 1.0, 0.8, _ADD, 1.0, 0.0231362104090899),
    (1.0, 3.0, 0.7, _ADD, 1.0, 0.1195051215523554),
    (2.0, 6.0, 0.4, _ADD, 1.0, 0.0),
    (1.0, 1.0, 0.3, _ADD, 2.0, 0.0),
    (5.0, 5.0, 0.2, _ADD, 2.0, 0.0),
    (1.0, 1.0, 1.0, _REM, 2.0, 0.02092364),
    (1.0, 1.0, 0.8, _REM, 1.0, 0.0816951786585355),
    (1.0, 3.0, 0.7, _REM, 1.0, 0.5356298793262404),
    (2.0, 6.0, 0.4, _REM, 1.0, 0.2888308005139968),
    (1.0, 1.0, 0.3, _REM, 2.0, 0.0003341102928869332),
    (2.0, 1.0, 0.8, _REP, 1.0, 0.05808665654484252),
    (3.0, 2.0, 0.8, _REP, 1.0, 0.13711260900644096),
    (2.0, 3.0, 0.7, _REP, 1.0, 0.4013057526509164),
    (3.0, 6.0, 0.4, _REP, 1.0, 0.20752885274183325),
    (2.0, 1.0, 0.3, _REP, 2.0, 2.4770380148941894e-09),
]

_LAPLACE_DELTAS = [
    # (scale, sensitivity, sampling probability, adjacency, epsilon, delta)
    (1.0, 1.0, 1.0, _ADD, 1.0, 0.0),
    (2.0, 4.0, 1.0, _ADD, 2.0, 0.0),
    (2.0, 4.0, 1.0, _ADD, 0.5, 0.52763345),
    (1.0, 1.0, 1.0, _ADD, 0.0, 0.39346934),
    (1.0, 1.0, 0.8, _ADD, 1.0, 0.0),
    (2.0, 4.0, 0.8, _ADD, 0.5, 0.3243606497234246),
    (1.0, 1.0, 0.6, _ADD, 0.2, 0.1401134521354217),
    (2.0, 2.0, 0.3, _ADD, 0.0, 0.1180408020862099),
    (5.0, 5.0, 0.2, _ADD, 2.0, 0.0),
    (2.0, 4.0, 1.0, _REM, 0.5, 0.52763345),
    (2.0, 4.0, 0.8, _REM, 0.5, 0.4039564635032081),
    (1.0, 1.0, 0.6, _REM, 0.2, 0.1741992102060086),
    (2.0, 2.0, 0.3, _REM, 0.0, 0.1180408020862099),
    # vectorised cases, sampling probability 0.2
    (1.0, 1.0, 0.2, _ADD, 0.1, 0.01879989609),
    (1.0, 1.0, 0.2, _REM, 0.1, 0.05015600993),
    (1.0, 1.0, 0.2, _REM, 0.2, 0.02391739939),
]


def _described(kind, scale: float, sensitivity: float, q: float, adjacency: str):
    base = kind(scale / sensitivity)
    if adjacency == _REP:
        return subsample(base, q, neighbouring="replace_one")
    return subsample(base, q, neighbouring=adjacency)


@pytest.mark.parametrize("kind, row", [(Gaussian, r) for r in _GAUSSIAN_DELTAS]
                         + [(Laplace, r) for r in _LAPLACE_DELTAS])
def test_delta_for_epsilon_of_additive_mechanisms(kind, row) -> None:
    scale, sensitivity, q, adjacency, eps, expected = row
    b = _described(kind, scale, sensitivity, q, adjacency).delta_bounds(eps)
    # the certified bracket holds dp_accounting's value (given to 8 digits at q = 1) ...
    assert b.lower is not None and b.lower <= expected + _PLACES_7
    assert b.upper >= expected - _PLACES_7
    # ... and is as tight as its tolerance at both ends (the upper end is dp_accounting's
    # pessimistic estimate, the lower its optimistic one)
    assert b.upper - expected < _PLACES_7
    assert expected - b.lower < _PLACES_7


def _check_delta_curve(kind, scale: float, q: float, adjacency: str) -> None:
    # dp_accounting's privacy-loss classes compute delta(epsilon) in closed form (a
    # test-only peer): privlearn's bracket holds it from epsilon 0 to huge epsilons, and
    # its upper end is within 1% of it, or (deltas far below any use) within 100x or
    # under 1e-19 -- the grid's absolute floor, which the RDP fallback lowers where it
    # accounts the pair
    from dp_accounting.pld import privacy_loss_mechanism as plm

    peer_kind = plm.GaussianPrivacyLoss if kind is Gaussian else plm.LaplacePrivacyLoss
    adj = {_ADD: "ADD", _REM: "REMOVE", _REP: "REPLACE"}[adjacency]
    peer = peer_kind(scale, sensitivity=1.0, sampling_prob=q,
                     adjacency_type=plm.AdjacencyType[adj])
    m = _described(kind, scale, 1.0, q, adjacency)
    for eps in (0.0, 0.5, 3.0, 10.0, 30.0):
        exact = float(peer.get_delta_for_epsilon(eps))
        b = m.delta_bounds(eps)
        assert b.lower <= exact * (1 + 1e-9) + 1e-300, (eps, b, exact)
        assert b.upper >= exact * (1 - 1e-9), (eps, b, exact)
        if exact > 1e-10:
            assert b.upper <= exact * 1.01 + _PLACES_7, (eps, b, exact)
        else:
            assert b.upper <= max(100 * exact, 1e-19), (eps, b, exact)


@pytest.mark.parametrize("adjacency", [_ADD, _REM, _REP])
def test_delta_curve_from_zero_to_huge_epsilon(adjacency: str) -> None:
    pytest.importorskip("dp_accounting")
    _check_delta_curve(Gaussian, 1.0, 0.2, adjacency)


@pytest.mark.slow
def test_delta_curve_from_zero_to_huge_epsilon_grid() -> None:
    pytest.importorskip("dp_accounting")
    for kind in (Gaussian, Laplace):
        for scale in (0.5, 1.0, 3.0):
            for q in (0.01, 0.2, 1.0):
                for adjacency in (_ADD, _REM) if kind is Laplace else (_ADD, _REM, _REP):
                    _check_delta_curve(kind, scale, q, adjacency)


def _randomized_response_delta(p: float, k: int, steps: int, eps: float) -> float:
    """delta(eps) of k-ary randomized response composed ``steps`` times, by enumerating
    how many outputs are the truth (+L), the other input's value (-L) or neither (0)."""
    r = (1 - p) / (k - 1)
    loss = math.log(p / r)
    total = 0.0
    for a in range(steps + 1):
        for b in range(steps + 1 - a):
            mass = (math.comb(steps, a) * math.comb(steps - a, b) * p**a * r**b
                    * ((k - 2) * r) ** (steps - a - b))
            total += max(0.0, mass * -math.expm1(eps - (a - b) * loss))
    return total


@pytest.mark.parametrize("p, k, steps", [(0.7, 3, 10), (0.5, 4, 20), (0.9, 2, 7)])
def test_randomized_response_composition_delta(p: float, k: int, steps: int) -> None:
    # dp_accounting's randomized-response PLD tests (pessimistic and optimistic
    # estimates) on composed randomized response, against the enumerated exact value
    m = compose(RandomizedResponse(p, k), steps)
    for eps in (0.0, 0.5, 2.0, 5.0):
        exact = _randomized_response_delta(p, k, steps, eps)
        b = m.delta_bounds(eps)
        assert b.lower <= exact <= b.upper <= exact * (1 + 1e-10)


# dp_accounting's from_privacy_guarantee: the noise for a target (epsilon, delta)
_GAUSSIAN_NOISE = [
    # (sensitivity, sampling probability, adjacency, epsilon, delta, standard deviation)
    (1.0, 1.0, _ADD, 1.0, 0.12693674, 1.0),
    (2.0, 1.0, _REM, 1.0, 0.12693674, 2.0),
    (2.0, 1.0, _REP, 1.0, 0.12693674, 4.0),
    (3.0, 1.0, _ADD, 1.0, 0.78760074, 1.0),
    (5.0, 1.0, _REP, 2.0, 0.02092364, 10.0),
    (1.0, 1.0, _ADD, 16.0, 1.016e-05, 0.344),
    (2.0, 1.0, _REP, 16.0, 1.016e-05, 1.376),
    (1.0, 0.8, _ADD, 1.0, 0.02313621, 1.0),
    (2.0, 0.7, _ADD, 1.0, 0.01080649, 1.5),
    (1.0, 0.1, _REM, 2.0, 2.355e-06, 1.0),
    (5.0, 0.75, _REM, 2.0, 0.00877201, 5.0),
    (1.0, 0.3, _REM, 16, 3.294e-05, 0.3),
    (2.0, 0.2, _REM, 16, 0.02302382, 0.4),
    (5.0, 0.75, _REP, 2.0, 0.09233932, 5.0),
    (1.0, 0.3, _REP, 16, 4.960e-05, 0.3),
    (1.0, 0.1, _REP, 2.0, 3.828e-06, 1.0),
    (2.0, 0.2, _REP, 16, 0.02477823, 0.4),
]


def _slow_beyond(rows, keep):
    """The rows, those not in ``keep`` marked slow (the default suite runs ``keep``)."""
    return [r if i in keep else pytest.param(r, marks=pytest.mark.slow)
            for i, r in enumerate(rows)]


@pytest.mark.parametrize("row", _slow_beyond(_GAUSSIAN_NOISE, keep={0, 2, 5, 7, 9, 14}))
def test_gaussian_noise_for_a_target(row) -> None:
    sens, q, adjacency, eps, delta, expected = row

    def mech(s: float):
        return _described(Gaussian, s, 1.0, q, adjacency)

    s = calibrate(mech, epsilon=eps, delta=delta, rtol=1e-7)
    assert s * sens == pytest.approx(expected, abs=5e-4)  # dp_accounting: 3 places
    assert mech(s).epsilon(delta) <= eps


@pytest.mark.parametrize("row", [
    # (sensitivity, sampling probability, adjacency, epsilon, delta, Laplace scale)
    (1.0, 1.0, _ADD, 1.0, 0.0, 1.0),
    (1.0, 1.0, _ADD, 1.0, 0.1, 1.0),
    (2.0, 1.0, _REM, 1.0, 0.01, 2.0),
    (1.0, 1.0, _REM, 3.0, 0.01, 0.33333333),
    (1.0, 0.8, _ADD, 1.0, 0.0, 0.8720521537764049),
    (1.0, 0.5, _REM, 1.0, 0.1, 0.671194938966816),
    (2.0, 0.9, _ADD, 1.0, 0.01, 1.8728716669259162),
    (1.0, 0.7, _REM, 3.0, 0.01, 0.2992554981396725),
])
def test_laplace_noise_for_a_target(row) -> None:
    # dp_accounting's Laplace from_privacy_guarantee ignores delta: the scale is that of
    # pure epsilon-DP, sensitivity / log(1 + (e^eps - 1) / q). privlearn's calibration
    # at delta = 0 is that value; with the delta it uses it, so its scale is not larger
    sens, q, adjacency, eps, delta, expected = row

    def mech(b: float):
        return _described(Laplace, b, 1.0, q, adjacency)

    pure = calibrate(mech, epsilon=eps, delta=0.0, rtol=1e-9)
    assert pure * sens == pytest.approx(expected, rel=1e-7)
    assert mech(pure).epsilon(0.0) <= eps
    if delta > 0:
        b = calibrate(mech, epsilon=eps, delta=delta, rtol=1e-7)
        assert b <= pure
        assert mech(b).epsilon(delta) <= eps


# ----------------------------------------------------------------------------------------
# dp_accounting gaussian_mechanism_test.py: the Gaussian's epsilon and its inverse
# ----------------------------------------------------------------------------------------
_SCALES = [1e-5, 1e-3, 0.1, 1.0, 10.0, 1e3, 1e5]


@pytest.mark.parametrize("delta", [0.0, 1e-10, 1e-5, 0.1, 0.5, 0.9, 1.0])
def test_gaussian_epsilon_over_ten_decades(delta: float) -> None:
    # get_epsilon_gaussian (the exact curve of Balle & Wang 2018, inverted to 1e-15):
    # privlearn's certified bracket holds it and is as tight as 1e-8 relative; delta 0 is
    # inf (no pure guarantee), delta 1 is 0
    pytest.importorskip("dp_accounting")
    from dp_accounting import gaussian_mechanism as peer

    for sigma in _SCALES:
        theirs = peer.get_epsilon_gaussian(sigma, delta)
        b = Gaussian(sigma).epsilon_bounds(delta)
        if math.isinf(theirs) or theirs == 0.0:
            assert b.upper == theirs
            continue
        assert b.lower <= theirs * (1 + 1e-12) and theirs * (1 - 1e-12) <= b.upper
        assert b.upper <= theirs * (1 + 1e-8)


@pytest.mark.parametrize("delta", [1e-10, 1e-5, 0.1, 0.5, 0.9])
def test_gaussian_noise_for_epsilon_over_ten_decades(delta: float) -> None:
    # get_sigma_gaussian: the smallest sigma for (eps, delta); privlearn's calibration is
    # that sigma (never below it: its epsilon is certified at the target), to 1e-7
    pytest.importorskip("dp_accounting")
    from dp_accounting import gaussian_mechanism as peer

    for eps in _SCALES:
        theirs = peer.get_sigma_gaussian(eps, delta, tol=1e-15)
        ours = calibrate(Gaussian, epsilon=eps, delta=delta, rtol=1e-12)
        assert Gaussian(ours).epsilon(delta) <= eps
        assert ours == pytest.approx(theirs, rel=1e-7)


# ----------------------------------------------------------------------------------------
# dp_accounting rdp/rdp_privacy_accountant_test.py: randomized response, log A, zCDP
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("noise, k, expected", [
    (0.3, 10, [2.6946320226546314, 2.983865364028855, 3.11316970070507, 3.1854244842182466,
               3.1886682560677593, 3.1918471524802814]),
    (0.05, 20, [5.850317703374384, 5.910360162307462, 5.930633082131939, 5.94180620835157,
                5.942307807732949, 5.942799375126701]),
    (0.01, 3, [5.684126770932727, 5.692634596034571, 5.695421239467805, 5.696956976543137,
               5.697025920968522, 5.697093486505405]),
])
def test_randomized_response_rdp_replace_one(noise: float, k: int, expected) -> None:
    # RandomizedResponseDpEvent(noise, k): uniform over k buckets with probability
    # `noise`, else the truth -- truth probability 1 - noise + noise / k; orders 1.5,
    # 2.5, 5, 50, 100 and infinity (the pure epsilon); dp_accounting's rtol 1e-4
    rr = RandomizedResponse(1.0 - noise + noise / k, num_categories=k)
    np.testing.assert_allclose(rr.rdp([1.5, 2.5, 5, 50, 100]), expected[:5], rtol=1e-4)
    assert rr.pure_epsilon == pytest.approx(expected[5], rel=1e-4)


def _log_a_exact(q: float, sigma: float, order: int) -> float:
    """log E_{mu0}[(mu/mu0)^order] of the Poisson-subsampled Gaussian at an integer order:
    the binomial expansion (Mironov, Talwar & Zhang 2019, Section 3.3), in 60 digits."""
    import mpmath as mp

    with mp.workdps(60):
        s2 = 2 * mp.mpf(sigma) ** 2
        a = mp.fsum(mp.binomial(order, j) * (1 - mp.mpf(q)) ** (order - j) * mp.mpf(q) ** j
                    * mp.exp(mp.mpf(j * j - j) / s2) for j in range(order + 1))
        return float(mp.log(a))


@pytest.mark.parametrize("q, sigma, order", [
    (1e-6, 0.1, 256), (1e-6, 1.0, 27), (1e-3, 1.0, 2), (0.01, 10.0, 20), (0.99, 0.1, 256),
])
def test_subsampled_gaussian_rdp_equals_the_multiprecision_value(q, sigma, order) -> None:
    # dp_accounting's test_compute_log_a_equals_mp grid at its integer orders (its
    # tolerance rtol 1e-4, atol 1e-8); the binomial sum is exact there
    pytest.importorskip("mpmath")
    exact = _log_a_exact(q, sigma, order) / (order - 1)
    ours = float(subsample(Gaussian(sigma), q).rdp(order))
    assert ours >= exact * (1 - 1e-12)  # an RDP bound is never below the divergence
    assert ours == pytest.approx(exact, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("q, sigma, order", [
    (1e-7, 0.1, 1.01), (1e-5, 0.1, 256.1), (1e-4, 1.0, 1.5), (0.1, 100.0, 20.5),
    (0.999, 100.0, 256.1),
])
def test_subsampled_gaussian_rdp_fractional_orders_vs_dp_accounting(q, sigma, order) -> None:
    # fractional orders: dp_accounting's series, which its test holds to rtol 1e-4 of a
    # multiprecision integral
    pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import rdp_privacy_accountant as peer

    theirs = peer._compute_log_a(q, sigma, order) / (order - 1)
    ours = float(subsample(Gaussian(sigma), q).rdp(order))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-8)


def test_rdp_composition_forms_agree() -> None:
    # test_rdp_composition: 6 x Gaussian(3.14159) however grouped; heterogeneous sum
    g, g2, alpha = Gaussian(3.14159), Gaussian(1.61803), 2.5
    base = float(g.rdp(alpha))
    assert base == pytest.approx(alpha / (2 * 3.14159**2), rel=1e-12)
    for m in (compose(g, 6), compose([g] * 6), compose([compose(g, 1), compose(g, 2),
                                                         compose(g, 3)])):
        assert float(m.rdp(alpha)) == pytest.approx(6 * base, rel=1e-12)
    assert float(compose([g, g2]).rdp(alpha)) == pytest.approx(
        base + float(g2.rdp(alpha)), rel=1e-12)


def test_zcdp_curves_compose_and_match_the_gaussian() -> None:
    # test_compute_rdp_multi_zcdp / test_zcdp_matches_gaussian: (xi, rho)-zCDP has RDP
    # xi + rho alpha; a Gaussian with sigma is (0, 1 / (2 sigma^2))-zCDP
    xi1, xi2, rho1, rho2 = 3.14159, 1.23456, 2.71828, 6.28319
    m = compose([RDPMechanism(lambda a: xi1 + rho1 * a, name="zcdp1"),
                 RDPMechanism(lambda a: xi2 + rho2 * a, name="zcdp2")])
    assert float(m.rdp(2.0)) == pytest.approx(xi1 + xi2 + 2.0 * (rho1 + rho2), rel=1e-12)
    sigma = 3.14159
    z = RDPMechanism(lambda a: a / (2 * sigma**2), name="zcdp")
    assert float(z.rdp(2.71828)) == pytest.approx(float(Gaussian(sigma).rdp(2.71828)),
                                                  rel=1e-12)
    # the same curve, the same conversion
    assert z.epsilon(1e-5, "rdp") == pytest.approx(Gaussian(sigma).epsilon(1e-5, "rdp"),
                                                   rel=1e-9)


def test_rdp_conversion_on_the_peers_order_grids() -> None:
    # the conversion (Canonne, Kamath & Steinke 2020, Prop. 12; Balle et al. 2020,
    # Thm 21) order by order, on dp_accounting's test_compute_epsilon_delta_pure_dp and
    # test_compute_epsilon_delta_gaussian and on Opacus's default order grid (7 places)
    orders = np.arange(2.0, 33.0)
    rdp = np.full(orders.shape, 1.1)
    eps = epsilon_from_rdp(orders, rdp, 1e-5)
    assert eps.min() == pytest.approx(1.32783806176, abs=_PLACES_7)
    assert orders[eps.argmin()] == 32
    assert delta_from_rdp(orders, rdp, 1.32783806176).min() == pytest.approx(1e-5, abs=_PLACES_7)

    orders = np.arange(1001, 100_000) * 1e-3  # sigma chosen for exactly (1, 1e-6)-DP
    rdp = np.asarray(Gaussian(4.530877117).rdp(orders))
    assert epsilon_from_rdp(orders, rdp, 1e-6).min() == pytest.approx(1.0, abs=_PLACES_7)
    assert delta_from_rdp(orders, rdp, 1.0).min() == pytest.approx(1e-6, abs=_PLACES_7)

    opacus_orders = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
    m = compose(subsample(Gaussian(1.5), 0.04), int(90 / 0.04))
    on_grid = epsilon_from_rdp(opacus_orders, np.asarray(m.rdp(opacus_orders)), 1e-5).min()
    assert on_grid == pytest.approx(7.32911117143, abs=_PLACES_7)  # Opacus's RDPAccountant
    assert m.epsilon(1e-5, "rdp") <= on_grid  # every order, refined: never looser


# ----------------------------------------------------------------------------------------
# prv_accountant tests/test_accountant.py and tests/test_privacy_random_variables/
# ----------------------------------------------------------------------------------------
def _gaussian_delta(eps: float, mu: float) -> float:
    return float(stats.norm.cdf(-eps / mu + mu / 2)
                 - np.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


@pytest.mark.parametrize("compositions", [9_999, 10_000])
def test_prv_homogeneous_gaussian_brackets_the_exact_delta(compositions: int) -> None:
    # sigma 100 composed ~1e4 times is a Gaussian with mu = sqrt(T) / 100; eps = 0 adds
    # the total variation 2 Phi(mu / 2) - 1, eps = 100 the far tail (delta 0 in floats)
    m = compose(Gaussian(100.0), compositions)
    mu = math.sqrt(compositions) / 100.0
    for eps in (0.0, 0.1, 1.0, 10.0, 100.0):
        exact = _gaussian_delta(eps, mu) if eps > 0 else math.erf(mu / (2 * math.sqrt(2)))
        b = m.delta_bounds(eps)
        assert b.lower <= exact * (1 + 1e-12) + 1e-300
        assert exact * (1 - 1e-12) <= b.upper <= exact * (1 + 1e-9) + 1e-300


def test_prv_heterogeneous_gaussian_brackets_the_exact_delta() -> None:
    m = compose([Gaussian(10.0), Gaussian(5.0)], steps=[50, 50])
    exact = _gaussian_delta(4.0, math.sqrt(50 / 10**2 + 50 / 5**2))
    b = m.delta_bounds(4.0)
    assert b.lower <= exact <= b.upper <= exact * (1 + 1e-9)


def test_prv_readme_heterogeneous_composition() -> None:
    # tests/test_readme.py: PoissonSubsampledGaussian(0.8, 5e-3) x 100, Gaussian(8) x 200
    # and LaplaceMechanism(mu=0.1) (Laplace scale 10) x 100 at delta 1e-6. prv_accountant
    # 0.2.0's (lower, estimate, upper) with eps_error 0.01: (11.138969719566626,
    # 11.149011362138985, 11.15905300870603); privlearn's certified bracket lies inside
    # its bracket, under 1e-3 wide and within 1e-3 of its estimate
    m = compose([subsample(Gaussian(0.8), 5e-3), Gaussian(8.0), Laplace(10.0)],
                steps=[100, 200, 100])
    b = m.epsilon_bounds(1e-6)
    assert 11.138969719566626 <= b.lower <= b.upper <= 11.15905300870603
    assert b.upper - b.lower <= 1e-3
    assert abs(b.upper - 11.149011362138985) <= 1e-3


@pytest.mark.parametrize("steps", [10_000, 100_000])
@pytest.mark.parametrize("delta", [1e-5, 1e-6])
def test_prv_laplace_obeys_advanced_composition(steps: int, delta: float) -> None:
    # LaplaceMechanism(mu = 0.01): prv_accountant checks eps < mu T sqrt(2 log(1/delta))
    # + eps_error; the advanced composition theorem (Dwork, Rothblum & Vadhan 2010,
    # Theorem III.3; Dwork & Roth 2014, Theorem 3.20 with delta' = delta) is far tighter
    mu = 0.01
    eps = compose(Laplace(1 / mu), steps).epsilon(delta)
    advanced = mu * math.sqrt(2 * steps * math.log(1 / delta)) + steps * mu * math.expm1(mu)
    assert eps < advanced < mu * steps * math.sqrt(2 * math.log(1 / delta)) + 0.1
    # ... and, exactly (eps, 0)-DP per step, never below the Gaussian limit of the
    # composed loss (mean T mu^2 / 2-ish): a loose sanity floor
    assert eps > 0.5 * mu * math.sqrt(2 * steps * math.log(1 / delta))


@pytest.mark.parametrize("steps", [100, 10_000, 100_000])
@pytest.mark.parametrize("delta_1", [1e-7, 1e-8])
def test_prv_approximate_dp_with_zero_epsilon(steps: int, delta_1: float) -> None:
    # ApproximateDPMechanism(0, delta_1) composed T times: delta(0) = 1 - (1 - delta_1)^T
    # exactly (prv_accountant checks its estimate to rel 1e-6; privlearn's certified upper
    # end carries the grid's rounding, < 1e-4 relative here). An earlier version
    # certified 0.81 at T = 1e4 and 0.995 at T = 100 (exact: ~1e-3, ~1e-5): the
    # Chernoff exponents that bound the FFT window's tails were too small for losses
    # that live on a few grid steps.
    exact = -math.expm1(steps * math.log1p(-delta_1))
    b = compose(ApproxDP(0.0, delta_1), steps).delta_bounds(0.0)
    assert b.lower <= exact <= b.upper <= exact * (1 + 1e-4)
    # all of it is mass at infinity, which the lower end counts (it was 0)
    assert b.lower >= exact * (1 - 1e-9)


@pytest.mark.parametrize("steps", [10_000, 100_000])
@pytest.mark.parametrize("delta_1", [1e-7, 1e-8])
def test_prv_approximate_dp_obeys_strong_composition(steps: int, delta_1: float) -> None:
    # (0.01, delta_1)-DP composed T times is (eps', T delta_1 + delta')-DP with eps' the
    # strong composition bound of Kairouz, Oh & Viswanath (2015), Theorem 3.4
    # (prv_accountant checks its lower estimate; privlearn's certified upper end)
    eps0 = 0.01
    m = compose(ApproxDP(eps0, delta_1), steps)
    for delta_prime in (1e-5, 1e-6):
        strong = (eps0 * math.sqrt(2 * steps * math.log(1 / delta_prime))
                  + steps * eps0 * math.expm1(eps0) / (math.exp(eps0) + 1))
        assert m.epsilon(steps * delta_1 + delta_prime) < strong


def test_prv_refuses_a_tiny_delta_privlearn_certifies_it() -> None:
    # test_throw_error_small_delta: prv_accountant refuses delta 1.13e-18 for q 0.00038,
    # sigma 4, 1000 steps (its delta_error would have to be below it). privlearn's PLD
    # (tilted composition) certifies a bracket there, within 0.1% and below the RDP bound
    m = compose(subsample(Gaussian(4.0), 0.00038), 1000)
    b = m.epsilon_bounds(1.13e-18)
    assert b.accountant == "pld" and 0 < b.lower <= b.upper <= 1.001 * b.lower
    assert b.upper <= m.epsilon(1.13e-18, "rdp")


# ----------------------------------------------------------------------------------------
# prv_accountant tests/test_dpsgd.py: find_noise_multiplier
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("q, steps, eps, delta, prv_sigma", [
    # prv_sigma: find_noise_multiplier's answer (prv_accountant 0.2.0); its accountant
    # is an estimate with eps_error 0.01 -- privlearn's certified sigma may be smaller,
    # never meaningfully larger
    pytest.param(2e-3, 10_000, 4.0, 1e-7, 0.6764091552751089, marks=pytest.mark.slow),
    (0.26058631921824105, 18_800, 4.0, 0.00011448277499759097, 34.492140032720805),
])
def test_prv_find_noise_multiplier(q, steps, eps, delta, prv_sigma) -> None:
    def mech(s: float):
        return compose(subsample(Gaussian(s), q), steps)

    sigma = calibrate(mech, epsilon=eps, delta=delta, rtol=1e-3)
    assert 0 < sigma <= prv_sigma * (1 + 1e-3)
    assert mech(sigma).epsilon(delta) <= eps  # certified at the target
    assert mech(sigma * (1 - 5e-3)).epsilon(delta) > eps  # and not needlessly large


# ----------------------------------------------------------------------------------------
# Opacus tests/accountants_test.py
# ----------------------------------------------------------------------------------------
_Q, _T, _DELTA = 0.04, int(90 / 0.04), 1e-5


# opacus/tests/prv_accountant.py: PRVAccountant().get_epsilon(1e-6) for (sigma, q, steps),
# to 4 places. Opacus reports the upper end of the PRV accountant (Gopi, Lee & Wutschitz
# 2021) with eps_error = 0.01: an upper bound up to eps_error above its estimate, which is
# itself within eps_error of the truth. privlearn's certified upper bound (within 0.1% of
# its lower one) is at or below it, by at most 2 eps_error -- 0.001 to 0.011 on this grid
_OPACUS_PRV = [
    (0.8, 0.001, 100, 0.270403364058018680360362395731),
    (1.5, 0.001, 100, 0.0393694193095203287535710501288),
    (2.0, 0.001, 100, 0.0291045369484074882560076247273),
    (3.0, 0.001, 100, 0.0215200934390882663016508757892),
    (0.8, 0.05, 100, 6.74105193941409996938318727189),
    (1.5, 0.05, 100, 1.95385313568420015961635272106),
    (2.0, 0.05, 100, 1.28363737962406521120328761754),
    (3.0, 0.05, 100, 0.767933789666825572517439013609),
    (0.8, 0.2, 100, 24.3336641779225644199868838768),
    (1.5, 0.2, 100, 8.49897785912163072907787864096),
    (2.0, 0.2, 100, 5.67205560882372950004537415225),
    (3.0, 0.2, 100, 3.38122051022184422208738396876),
    (0.8, 0.001, 1000, 0.477771266184522591657923840103),
    (1.5, 0.001, 1000, 0.0998206602308474855167474970585),
    (2.0, 0.001, 1000, 0.0712187825381152272985474382949),
    (3.0, 0.001, 1000, 0.0476159308713589302097801692071),
    (0.8, 0.05, 1000, 19.5258428053837356230815203162),
    (1.5, 0.05, 1000, 6.20996924657726712126759593957),
    (2.0, 0.05, 1000, 4.17279986668931890392286732094),
    (3.0, 0.05, 1000, 2.52757432605973830774814814504),
    (0.8, 0.001, 20000, 1.29600925757016161021795142005),
    (1.5, 0.001, 20000, 0.437005108654860807693154356457),
    (2.0, 0.001, 20000, 0.305837939762453436820521801565),
    (3.0, 0.001, 20000, 0.194031030686054706269061398416),
    (1.5, 0.05, 20000, 38.3066179140872336006395926233),
    (2.0, 0.05, 20000, 24.4217185703225858617315680021),
    (3.0, 0.05, 20000, 13.9611146992367061159256991232),
    (0.8, 0.001, 50000, 2.03451480771586634688219419331),
    (1.5, 0.001, 50000, 0.704218384555810095193351116905),
    (2.0, 0.001, 50000, 0.491354910211401318953505779064),
    (3.0, 0.001, 50000, 0.309694161156544023327796821832),
    (1.5, 0.05, 50000, 73.1901767238329625797632616013),
    (2.0, 0.05, 50000, 45.2369958613306906158868514467),
    (3.0, 0.05, 50000, 24.9420056431444763234139827546),
]
_OPACUS_PRV_DEFAULT = [r for r in _OPACUS_PRV if r[2] == 1000 and r[1] == 0.05] + [
    r for r in _OPACUS_PRV if r[2] == 50_000 and r[0] == 1.5]


def _check_opacus_prv(sigma: float, q: float, steps: int, expected: float) -> None:
    b = compose(subsample(Gaussian(sigma), q), steps).epsilon_bounds(1e-6)
    assert b.lower <= b.upper <= expected + 5e-5
    assert expected - b.upper <= 0.02


@pytest.mark.parametrize("sigma, q, steps, expected", _OPACUS_PRV_DEFAULT)
def test_opacus_prv_values(sigma: float, q: float, steps: int, expected: float) -> None:
    _check_opacus_prv(sigma, q, steps, expected)


@pytest.mark.slow
def test_opacus_prv_values_grid() -> None:
    for row in _OPACUS_PRV:
        _check_opacus_prv(*row)


def test_opacus_rdp_and_prv_accountant_values() -> None:
    m = compose(subsample(Gaussian(1.5), _Q), _T)
    # RDPAccountant: 7.32911117143 from Opacus's order grid and conversion; ours uses
    # every order and the Balle et al. (2020) conversion, so it is not above that
    rdp = m.epsilon(_DELTA, "rdp")
    b = m.epsilon_bounds(_DELTA)
    assert b.upper <= rdp <= 7.32911117143 + 1e-7
    # PRVAccountant: 6.777395712150674, an estimate within its eps_error 0.01 of the
    # truth; privlearn's certified bracket is within that distance of it
    assert b.lower <= b.upper <= b.lower * (1 + 1e-3)
    assert abs(b.upper - 6.777395712150674) <= 0.01
    assert abs(b.lower - 6.777395712150674) <= 0.01


@pytest.mark.parametrize("accountant, steps, opacus_sigma", [
    # get_noise_multiplier(target_epsilon=8, target_delta=1e-5, sample_rate=0.04, ...);
    # Opacus stops its search once epsilon is within epsilon_tolerance 0.01 below the
    # target, so its sigma is up to that much larger than needed
    ("rdp", int(90 / 0.04), 1.416),
    pytest.param("rdp", 2000, 1.3562, marks=pytest.mark.slow),
    ("pld", int(90 / 0.04), 1.34765625),  # Opacus's accountant="prv"
    pytest.param("pld", 2000, 1.2915, marks=pytest.mark.slow),
])
def test_opacus_get_noise_multiplier(accountant: str, steps: int, opacus_sigma: float) -> None:
    def mech(s: float):
        return compose(subsample(Gaussian(s), _Q), steps)

    sigma = calibrate(mech, epsilon=8.0, delta=_DELTA, accountant=accountant, rtol=1e-5)
    assert sigma <= opacus_sigma + 5e-5  # Opacus's places=4
    assert mech(sigma).epsilon(_DELTA, accountant) <= 8.0
    # within Opacus's epsilon tolerance of the target at Opacus's own sigma
    assert mech(opacus_sigma).epsilon(_DELTA, accountant) >= 8.0 - 0.02


def test_opacus_gdp_noise_multiplier_is_optimistic() -> None:
    # get_noise_multiplier(..., accountant="gdp") = 1.3232421875 for epsilon 8: the GDP
    # accountant is the central-limit approximation (Bu, Dong, Long & Su 2020), not a
    # bound; at that sigma the certified epsilon exceeds 8 (its lower end included)
    m = compose(subsample(Gaussian(1.3232421875), _Q), _T)
    assert m.epsilon_bounds(_DELTA).lower > 8.0


@pytest.mark.parametrize("epsilon, epochs, q, delta", [
    (1.0, 10, 1e-2, 1e-5), (3.3, 100, 1e-3, 1e-4),
])
def test_opacus_get_noise_multiplier_never_overshoots(epsilon, epochs, q, delta) -> None:
    # test_get_noise_multiplier_overshoot (a hypothesis grid there; two of its points
    # here, a grid in the slow test below): the RDP epsilon at the returned sigma is
    # below the target
    steps = int(epochs / q)

    def mech(s: float):
        return compose(subsample(Gaussian(s), q), steps)

    sigma = calibrate(mech, epsilon=epsilon, delta=delta, accountant="rdp", rtol=1e-4)
    assert mech(sigma).epsilon(delta, "rdp") <= epsilon
    assert mech(sigma * (1 - 1e-3)).epsilon(delta, "rdp") > epsilon


@pytest.mark.slow
@pytest.mark.parametrize("q", [1e-4, 1e-3, 1e-2, 1e-1])
@pytest.mark.parametrize("delta", [1e-4, 1e-6])
def test_opacus_get_noise_multiplier_never_overshoots_grid(q: float, delta: float) -> None:
    for epsilon, epochs in ((1.0, 10), (8.0, 50), (10.0, 100)):
        test_opacus_get_noise_multiplier_never_overshoots(epsilon, epochs, q, delta)


@pytest.mark.slow
def test_opacus_make_private_with_epsilon() -> None:
    # privacy_engine_test.test_make_private_with_epsilon: 512 records, batches of 64
    # (q = 1/8), 2 epochs, target (2, 1e-5): the epsilon spent is the target to 2 places
    steps = planned_steps(64 / 512, epochs=2)
    assert steps == 16

    def mech(s: float):
        return compose(subsample(Gaussian(s), 64 / 512), steps)

    for accountant in ("rdp", "pld"):
        sigma = calibrate(mech, epsilon=2.0, delta=1e-5, accountant=accountant)
        assert 2.0 - 0.005 < mech(sigma).epsilon(1e-5, accountant) <= 2.0


# ----------------------------------------------------------------------------------------
# dp_accounting pld/pld_privacy_accountant_test.py: generic (epsilon, delta) events
# ----------------------------------------------------------------------------------------
def test_pure_dp_events_compose_to_the_sum() -> None:
    # test_epsilon_basic / test_exponential_mechanism_basic: (1, 0) and (2, 0) compose to
    # (3, 0); the delta at 3 is 0 up to the rounding of the pure epsilon
    m = compose([PureDP(1.0), PureDP(2.0)])
    assert m.epsilon(0.0) == 3.0
    assert 0.0 <= m.delta(3.0) <= 1e-13
    assert m.delta(3.0 * (1 + 1e-12)) == 0.0


def test_approximate_dp_events_compose() -> None:
    # test_epsilon_delta_basic: (1, 0.1) and (2, 0.2) give delta(3) = 1 - 0.9 x 0.8 = 0.28
    # and epsilon(0.28) = 3. The delta 0.28 is mass at infinity, which a certified
    # epsilon needs a little more than (ApproxDP's docstring): at 0.28 it is refused,
    # just above it the certified epsilon is 3 to within 1e-4
    m = compose([ApproxDP(1.0, 0.1), ApproxDP(2.0, 0.2)])
    b = m.delta_bounds(3.0)
    # (the lower end counts the mass at infinity, 0.28: it was 2.2e-4)
    assert 0.28 * (1 - 1e-9) <= b.lower <= 0.28 <= b.upper <= 0.28 * (1 + 1e-4)
    # subsampled: the remove direction's mass at infinity is q delta a step
    sub = compose(subsample(ApproxDP(1.0, 1e-3), 0.1), 50)
    floor = -math.expm1(50 * math.log1p(-1e-4))
    for eps in (0.0, 1.0, 10.0):
        assert floor * (1 - 1e-9) <= sub.delta_bounds(eps).lower
    with pytest.raises(CertificationError):
        m.epsilon(0.28)
    assert 3.0 - 1e-6 <= m.epsilon(0.28 * (1 + 1e-6)) <= 3.0 + 1e-4


# ----------------------------------------------------------------------------------------
# dp_accounting mechanism_calibration_test.py: number of steps and sampling probability
# ----------------------------------------------------------------------------------------
def test_calibrated_steps_are_the_largest_feasible() -> None:
    # discrete calibration (discrete=True there; integer=True here): 1202 steps of a
    # Poisson-subsampled Gaussian (q 0.01, sigma 1) fit (2, 1e-5) -- dp_accounting's
    # calibrate_dp_mechanism with its PLD accountant answers the same (slow test below)
    def mech(t: float):
        return compose(subsample(Gaussian(1.0), 0.01), int(t))

    steps = calibrate(mech, epsilon=2.0, delta=1e-5, integer=True, bounds=(1, 100_000))
    assert isinstance(steps, int)
    assert mech(steps).epsilon(1e-5) <= 2.0 < mech(steps + 1).epsilon_bounds(1e-5).lower


@pytest.mark.slow
def test_calibration_agrees_with_dp_accounting() -> None:
    pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event
    from dp_accounting import mechanism_calibration as mc
    from dp_accounting.pld import PLDAccountant

    def event(q: float, t: int):
        return dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(1.0)), t)

    peer_steps = mc.calibrate_dp_mechanism(
        PLDAccountant, lambda t: event(0.01, t), 2.0, 1e-5,
        mc.ExplicitBracketInterval(1, 100_000), discrete=True)
    ours = calibrate(lambda t: compose(subsample(Gaussian(1.0), 0.01), int(t)),
                     epsilon=2.0, delta=1e-5, integer=True, bounds=(1, 100_000))
    assert abs(ours - peer_steps) <= 1  # the peer's PLD is not certified: one step apart
    peer_q = mc.calibrate_dp_mechanism(
        PLDAccountant, lambda q: event(q, 1000), 2.0, 1e-5,
        mc.ExplicitBracketInterval(1e-6, 1.0), tol=1e-7)
    ours_q = calibrate(lambda q: compose(subsample(Gaussian(1.0), q), 1000),
                       epsilon=2.0, delta=1e-5, bounds=(1e-6, 1.0))
    # certified: not above the peer's estimate beyond its tolerance, and close to it
    assert ours_q <= peer_q + 1e-7
    assert ours_q == pytest.approx(peer_q, rel=1e-4)
