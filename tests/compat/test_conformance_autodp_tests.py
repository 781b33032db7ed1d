"""Conformance with autodp 0.2.3.1's own test suite (github.com/yuxiangw/autodp, test/).

The parameters and the relations checked are those of autodp's five unit-test files,
re-stated here (no code copied) and run against ``privlearn.compat.autodp``; where autodp
only checks a loose relation, the facade is also held to the exact value.

* unit_test_approxdp_to_fdp_conversion.py: Gaussian f-DP from the privacy profile equals
  the closed form (autodp: 4 places; here 1e-12).
* unit_test_fdp_to_approxdp_conversion.py: epsilon(delta) of the Gaussian equals the
  analytic Gaussian (autodp: 2 places relative; here 1e-9 relative, including delta 0
  -> inf and delta 1 -> 0).
* unit_test_calibrator.py: calibrated sigma >= 0.99 x the sigma that produced the budget
  (single parameter and with composition coefficients); here also tight (<= 1 + 1e-6).
* unit_test_dp_sgd_poisson_sampling_add_remove.py: RDP of Poisson-subsampled Gaussian
  compositions >= 0.99 x TensorFlow Privacy's values; the reference values are computed
  here with dp_accounting's RDP code (the same algorithm TF Privacy used; a test-only
  peer) on autodp's grid of (order, q, sigma, steps), and the facade must also be >= the
  reference (RDP of the exact subsampled Gaussian is a lower bound on any valid bound).
* unit_test_sampling_pld.py: compares characteristic (phi) functions, which the facade
  does not expose (it composes PLDs); autodp itself cannot run it here (it calls
  ``scipy.integrate.quadrature``, removed in SciPy 1.15). The one-sided amplification it
  exercises is checked on epsilon in test_conformance_edge_cases.py.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.stats import norm

from privlearn.accounting.analytic import gaussian_epsilon
from privlearn.compat.autodp import calibrator_zoo, dp_bank, fdp_bank, mechanism_zoo
from privlearn.compat.autodp.autodp_core import AutodpArgumentWarning
from privlearn.compat.autodp.transformer_zoo import AmplificationBySampling, Composition

SIGMAS_FDP = [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]


# ----------------------------------------------------------------------------------------
# unit_test_approxdp_to_fdp_conversion.py
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma", SIGMAS_FDP)
def test_approxdp_to_fdp(sigma: float) -> None:
    fpr = np.linspace(0, 1, 21)
    with pytest.warns(AutodpArgumentWarning):
        gm2 = mechanism_zoo.GaussianMechanism(sigma, name="GM2", RDP_off=True)
    direct = fdp_bank.fDP_gaussian({"sigma": sigma}, fpr)
    converted = np.array([gm2.get_fDP(f) for f in fpr])
    np.testing.assert_allclose(converted - direct, 0.0, atol=0.5e-4)  # autodp's check
    np.testing.assert_allclose(converted, norm.cdf(norm.ppf(1 - fpr) - 1 / sigma), atol=1e-12)


# ----------------------------------------------------------------------------------------
# unit_test_fdp_to_approxdp_conversion.py
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma", SIGMAS_FDP)
def test_fdp_to_approxdp(sigma: float) -> None:
    deltas = [0, 1e-8, 1e-6, 1e-4, 1e-2, 0.3, 0.5, 1]
    with pytest.warns(AutodpArgumentWarning):
        gm3 = mechanism_zoo.GaussianMechanism(
            sigma, name="GM3", RDP_off=True, approxDP_off=True, fdp_off=False
        )
    direct = np.array([dp_bank.get_eps_ana_gaussian(sigma, d) for d in deltas])
    converted = np.array([gm3.get_approxDP(d) for d in deltas])
    assert math.isinf(direct[0]) and math.isinf(converted[0])
    assert direct[-1] == 0.0 and converted[-1] == 0.0
    rel = (direct[1:-1] - converted[1:-1]) / (direct[1:-1] + 1e-10)
    np.testing.assert_allclose(rel, 0.0, atol=0.5e-2)  # autodp's check
    np.testing.assert_allclose(converted[1:-1], direct[1:-1], rtol=1e-9, atol=1e-15)


def test_fdp_to_approxdp_against_autodp_itself() -> None:
    autodp_dp_bank = pytest.importorskip("autodp.dp_bank")
    for sigma in SIGMAS_FDP:
        for d in [1e-8, 1e-6, 1e-4, 1e-2, 0.3, 0.5]:
            ours = dp_bank.get_eps_ana_gaussian(sigma, d)
            ref = autodp_dp_bank.get_eps_ana_gaussian(sigma, d)
            # certified rounding puts ours at most a hair above autodp's root finder
            assert ours <= ref * (1 + 1e-9) + 1e-12


# ----------------------------------------------------------------------------------------
# unit_test_calibrator.py
# ----------------------------------------------------------------------------------------
SIGMA_LIST = [int(1.6**i) for i in range(int(math.floor(math.log(100, 1.6))) + 1)]
DELTAS = [1e-3, 1e-4, 1e-5, 1e-6]
TOL = 0.01


@pytest.mark.parametrize("delta", DELTAS)
def test_calibrator_single_parameter(delta: float) -> None:
    calibrate = calibrator_zoo.eps_delta_calibrator()
    for sigma in SIGMA_LIST:
        eps = mechanism_zoo.ExactGaussianMechanism(sigma, name="GM").get_approxDP(delta)
        mech = calibrate(mechanism_zoo.ExactGaussianMechanism, eps, delta, [0, 100], name="GM")
        got = mech.params["sigma"]
        assert got >= (1 - TOL) * sigma  # autodp's check
        assert got <= sigma * (1 + 1e-6)  # and tight
        assert mech.get_approxDP(delta) <= eps


@pytest.mark.parametrize("coeff", [1, 10, 100, 1000])
def test_calibrator_multi_parameter(coeff: int) -> None:
    general = calibrator_zoo.generalized_eps_delta_calibrator()
    for sigma in SIGMA_LIST:
        for delta in DELTAS:
            gm = mechanism_zoo.ExactGaussianMechanism(sigma, name="GM")
            eps = Composition()([gm], [coeff]).get_approxDP(delta)
            params = {"sigma": None, "coeff": coeff}
            mech = general(
                mechanism_zoo.ComposedGaussianMechanism, eps, delta, [0, 1000],
                params=params, para_name="sigma", name="GM",
            )
            got = mech.params["sigma"]
            assert got >= (1 - TOL) * sigma  # autodp's check
            assert got <= sigma * (1 + 1e-6)
            assert params["sigma"] == got  # in place, as autodp
            assert gaussian_epsilon(got / math.sqrt(coeff), delta) <= eps * (1 + 1e-12)


# ----------------------------------------------------------------------------------------
# unit_test_dp_sgd_poisson_sampling_add_remove.py
# ----------------------------------------------------------------------------------------
ORDERS = [1.25, 2.0, 2.25, 4.0, 4.5, 10.0, 25.0, 64.0, 128.0]
REL_TOL = 0.01


def _facade_rdp(q: float, sigma: float, steps: int, orders: list[float]) -> np.ndarray:
    sample = AmplificationBySampling(PoissonSampling=True)
    gm = mechanism_zoo.ExactGaussianMechanism(sigma)
    dp_sgd = Composition()([sample(gm, q)], [steps])
    return np.array([dp_sgd.get_RDP(a) for a in orders])


# TensorFlow Privacy's RDP per step on autodp's grid, transcribed from autodp's
# unit_test_dp_sgd_poisson_sampling_add_remove.py (its values for steps in
# {1, 10, 100, 1000, 5000, 10000} are exactly `steps` times these). Orders: ORDERS.
TFP_RDP_PER_STEP = {
    (0.01, 0.1): (
        39.47435359280898, 90.7896596280238, 104.21069366522143, 193.85977308534916,
        219.07906690372957, 494.8831442377909, 1245.2029477229287, 3195.321731874551,
        6395.3585686314445,
    ),
    (0.01, 0.25): (
        0.1103603174246269, 6.790784234628705, 9.710698228804564, 25.859773085349214,
        30.079066903729597, 74.883144237791, 195.20294772292905, 507.3217318745518,
        1019.3585686314451,
    ),
    (0.01, 0.5): (
        0.0018977736416478479, 0.005345502314345245, 0.0083541177519165, 1.8618755130319669,
        3.0791796010526946, 14.883144237791036, 45.202947722929075, 123.32173187455179,
        251.35856863144505,
    ),
    (0.01, 1.0): (
        0.00010539800475567958, 0.00017181342207453428, 0.0001945383384777645,
        0.00036315404891075525, 0.00041492706734509965, 0.03827041889494864, 7.70294772682218,
        27.32173187455178, 59.358568631445074,
    ),
    (0.01, 2.0): (
        1.7710637990830963e-05, 2.8402138324210935e-05, 3.197693198178044e-05,
        5.715580737173236e-05, 6.440025440052329e-05, 0.00014562314921461514,
        0.0003829780935648833, 3.321746408681008, 11.358568631446696,
    ),
    (0.01, 10.0): (
        6.280881026314128e-07, 1.005016203373883e-06, 1.1306714441161602e-06,
        2.0104337956990166e-06, 2.261850947807683e-06, 5.029098115867569e-06,
        1.259163330476561e-05, 3.2361212985515655e-05, 6.514386177732818e-05,
    ),
    (0.05, 0.1): (
        47.52136461284061, 94.008535452892, 107.1076819076028, 196.00569030192798,
        221.14834421971628, 496.67140858493997, 1246.879445548381, 3196.956716420516,
        6396.980679283347,
    ),
    (0.05, 0.25): (
        0.8332213070393273, 10.008580353418688, 12.607682080965713, 28.005690301928013,
        32.1483442197163, 76.67140858494001, 196.87944554838126, 508.9567164205166,
        1020.9806792833471,
    ),
    (0.05, 0.5): (
        0.029632735891697154, 0.12574712688706774, 0.2394299356010559, 4.00584939067033,
        5.148364567706042, 16.671408584940014, 46.879445548381256, 124.95671642051657,
        252.98067928334717,
    ),
    (0.05, 1.0): (
        0.002485316298319207, 0.004286504370418927, 0.004957724285961285, 0.011416268872652872,
        0.01437879709925404, 1.674060563785817, 9.379445549128421, 28.95671642051658,
        60.98067928334716,
    ),
    (0.05, 2.0): (
        0.0004388760120985163, 0.0007098115658748468, 0.0008014493223874764,
        0.0014625632129495554, 0.0016581138661999515, 0.004044112497576389,
        0.07545190786474157, 4.9567192096225, 12.98067928334747,
    ),
    (0.05, 10.0): (
        1.56975532377146e-05, 2.512510207234621e-05, 2.8269123305335597e-05,
        5.029837790076196e-05, 5.659924543164964e-05, 0.00012610908358120653,
        0.0003175729623224624, 0.0008288460377922641, 0.001713513235768133,
    ),
    (0.1, 0.1): (
        50.9870847446919, 95.3948298140119, 108.35534683261069, 196.92988654267458,
        222.03953345186477, 497.44157211889546, 1247.6014738614642, 3197.6608659372755,
        6397.679284315721,
    ),
    (0.1, 0.25): (
        1.804874412576095, 11.394840954932146, 13.855346885245137, 28.929886542674605,
        33.03953345186479, 77.44157211889551, 197.60147386146454, 509.6608659372759,
        1021.6792843157225,
    ),
    (0.1, 0.5): (
        0.09126475987344684, 0.42916959059789994, 0.7688994086444522, 4.929960718132623,
        6.039543080827824, 17.441572118895508, 47.601473861464534, 125.66086593727589,
        253.67928431572255,
    ),
    (0.1, 1.0): (
        0.009408440726353454, 0.017036863236176647, 0.02009616460080257, 0.05867260696008058,
        0.08420910671682878, 2.4428163733756034, 10.101473861818455, 29.66086593727589,
        61.67928431572254,
    ),
    (0.1, 2.0): (
        0.001737654849037913, 0.002836228266263719, 0.0032125121598688307,
        0.006003282964489696, 0.006856283806419175, 0.01862425425819884, 0.7514802200125161,
        5.6608672584152, 13.679284315722684,
    ),
    (0.1, 10.0): (
        6.276771861735142e-05, 0.00010049662088720303, 0.00011308433028369105,
        0.00020135853558812981, 0.00022663139483825034, 0.000506162129856179,
        0.001283133366967998, 0.0034110637562587477, 0.007298431011732186,
    ),
    (0.2, 0.1): (
        54.4528141427903, 96.78112417513178, 109.6030117576186, 197.85408278342118,
        222.93072268401326, 498.2117356528509, 1248.3235021745475, 3198.3650154540346,
        6398.377889348097,
    ),
    (0.2, 0.25): (
        3.4988089172054977, 12.781126875972346, 15.10301177558829, 29.8540827834212,
        33.93072268401329, 78.211735652851, 198.3235021745478, 510.3650154540352,
        1022.3778893480978,
    ),
    (0.2, 0.5): (
        0.2693155798829554, 1.1454723378159812, 1.7160611134797041, 5.85411562333582,
        6.930726961789178, 18.211735652851, 48.32350217454782, 126.3650154540352,
        254.37788934809794,
    ),
    (0.2, 1.0): (
        0.034642316647709226, 0.06647221890559733, 0.08026393760128477, 0.29132308006676827,
        0.429697843698239, 3.212286119795191, 10.82350217470511, 30.365015454035202,
        62.37788934809791,
    ),
    (0.2, 2.0): (
        0.006824777906499827, 0.011296964989239926, 0.012858854549446597, 0.02497156532232035,
        0.028878485101326103, 0.09784245743693407, 1.459148041400704, 6.365016041204642,
        14.377889348097982,
    ),
    (0.2, 10.0): (
        0.0002509008471776042, 0.0004019259003295167, 0.00045234870800072715,
        0.0008064504053491498, 0.0009079912638877577, 0.002035935314438469,
        0.005219181973251608, 0.014331998148967217, 0.03281124876177494,
    ),
}


@pytest.mark.parametrize("q, sigma", sorted(TFP_RDP_PER_STEP))
def test_dp_sgd_poisson_rdp_lower_bound(q: float, sigma: float) -> None:
    tfp = np.array(TFP_RDP_PER_STEP[(q, sigma)])
    for steps in (1, 10, 100, 1000, 5000, 10000):
        ours = _facade_rdp(q, sigma, steps, ORDERS)
        assert np.all(ours >= (1 - REL_TOL) * steps * tfp)  # autodp's check
        assert np.all(np.isfinite(ours))


@pytest.mark.parametrize("q, sigma", sorted(TFP_RDP_PER_STEP))
def test_dp_sgd_poisson_rdp_never_below_exact(q: float, sigma: float) -> None:
    """At integer orders the RDP of the Poisson-subsampled Gaussian is exactly
    ``log(sum_k C(a,k) (1-q)^(a-k) q^k e^{(k^2-k)/(2 sigma^2)}) / (a-1)`` (Mironov, Talwar
    & Zhang 2019, Section 3.3), evaluated here in 50-digit arithmetic; the facade must not
    be below it, and is within 1e-6 of dp_accounting's value (test-only peer)."""
    mp = pytest.importorskip("mpmath")
    rdp_mod = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")
    integer = [a for a in ORDERS if float(a).is_integer()]
    ours = _facade_rdp(q, sigma, 1, integer)
    with mp.workdps(50):
        qq, ss = mp.mpf(q), mp.mpf(sigma)
        for a, got in zip(integer, ours, strict=True):
            n = int(a)
            total = mp.fsum(
                mp.binomial(n, k) * (1 - qq) ** (n - k) * qq**k
                * mp.e ** (mp.mpf(k * k - k) / (2 * ss * ss))
                for k in range(n + 1)
            )
            exact = float(mp.log(total) / (n - 1))
            assert got >= exact * (1 - 1e-14)
    ref = np.asarray(rdp_mod._compute_rdp_poisson_subsampled_gaussian(q, sigma, integer))
    assert np.all(ours <= ref * (1 + 1e-6) + 1e-15)


@pytest.mark.parametrize(
    "q, sigma, order", [(0.01, 0.25, 1.25), (0.1, 1.0, 2.25), (0.2, 2.0, 4.5), (0.05, 0.5, 1.25)]
)
def test_dp_sgd_poisson_rdp_fractional_orders_against_quadrature(
    q: float, sigma: float, order: float
) -> None:
    """Exact Renyi divergences of the subsampled Gaussian pair, both directions, by
    60-digit quadrature; the facade's RDP must be at least the larger one."""
    mp = pytest.importorskip("mpmath")
    with mp.workdps(25):
        qq, ss, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(order)

        def dens(x, m):
            return mp.e ** (-((x - m) ** 2) / (2 * ss * ss)) / (ss * mp.sqrt(2 * mp.pi))

        def p(x):
            return (1 - qq) * dens(x, 0) + qq * dens(x, 1)

        pts = [-mp.inf, -4 * ss, 0, 0.5, 1, 1 + 4 * ss, mp.inf]
        d1 = mp.log(mp.quad(lambda x: p(x) ** a * dens(x, 0) ** (1 - a), pts)) / (a - 1)
        d2 = mp.log(mp.quad(lambda x: dens(x, 0) ** a * p(x) ** (1 - a), pts)) / (a - 1)
        exact = float(max(d1, d2))
    ours = _facade_rdp(q, sigma, 1, [order])[0]
    assert ours >= exact * (1 - 1e-12)
    assert ours <= exact * 1.05 + 1e-12  # and close (orders in (1, 2) use the value at 2)


@pytest.mark.parametrize("sigma", [1.0, 10.0])
def test_dp_sgd_poisson_rdp_edge_rates(sigma: float) -> None:
    orders = [2.0, 2.5, 4.0, 4.5, 8.0, 8.5]
    for steps in (1, 1000):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            zero = _facade_rdp(0.0, sigma, steps, orders)
        np.testing.assert_array_equal(zero, 0.0)
        full = _facade_rdp(1.0, sigma, steps, orders)
        exact = steps * np.array(orders) / (2 * sigma**2)
        np.testing.assert_allclose(full, exact, rtol=1e-12)
        assert np.all(full >= exact)
