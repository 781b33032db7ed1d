"""The values printed in autodp's tutorial notebooks, through ``privlearn.compat.autodp``.

autodp (github.com/yuxiangw/autodp) stores its notebooks with their outputs:
tutorials/tutorial_new_api.ipynb and tutorials/tutorial_calibrator.ipynb print the
epsilons, names and parameters below. Each cell is re-stated here with the facade's
imports (same arguments, same calls). autodp's epsilons are RDP-based upper bounds, so
the facade's certified epsilon must not exceed them (beyond 1e-9 relative) and must not
go below the exact value where one is known: Gaussian compositions (the analytic
Gaussian of Balle & Wang 2018, Theorem 8, solved here with SciPy) and pure DP (the
privacy profile of randomized response, Kairouz, Oh & Viswanath 2015).
test_conformance_autodp_examples.py runs the other tutorials against autodp itself.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from privlearn.compat.autodp import calibrator_zoo, mechanism_zoo, transformer_zoo
from privlearn.compat.autodp.autodp_core import Mechanism

REL = 1e-9


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the facade's notes on autodp-only flags
        yield


def _gaussian_exact(mu_inv_sigma: float, delta: float) -> float:
    """Exact epsilon at ``delta`` of a Gaussian of sensitivity 1 and std ``sigma``
    (argument: 1 / sigma = mu)."""
    mu = mu_inv_sigma

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(gap, 0.0, 100.0, xtol=1e-15, rtol=1e-15)


def _pure_exact(eps: float, delta: float) -> float:
    # randomized response's profile: delta(e') = (e^eps - e^e') / (1 + e^eps)
    return math.log(math.exp(eps) - delta * (1 + math.exp(eps)))


def _between(value: float, exact: float | None, autodp_value: float) -> None:
    assert isinstance(value, float)
    assert value <= autodp_value * (1 + REL)
    if exact is not None:
        assert value >= exact * (1 - 1e-12)


def test_new_api_composition_of_gaussians_and_svt() -> None:
    # tutorial_new_api.ipynb, cells 2-3: ExactGaussianMechanism(5) x 3,
    # ExactGaussianMechanism(8) x 5 and PureDP_Mechanism(eps=0.1) x 1
    gm1 = mechanism_zoo.ExactGaussianMechanism(5.0, name="GM1")
    gm2 = mechanism_zoo.ExactGaussianMechanism(8.0, name="GM2")
    svt = mechanism_zoo.PureDP_Mechanism(eps=0.1, name="SVT")
    composed = transformer_zoo.Composition()([gm1, gm2, svt], [3, 5, 1])
    assert composed.name == "Compose:{GM1: 3, GM2: 5, SVT: 1}"
    assert composed.params == {"GM1:sigma": 5.0, "GM2:sigma": 8.0, "SVT:eps": 0.1}
    mu = math.sqrt(3 / 25 + 5 / 64)  # the Gaussian part alone: a floor
    for delta, stated in ((1e-6, 2.18001192542518), (1e-4, 1.689983703842748)):
        eps = composed.get_approxDP(delta)
        _between(eps, _gaussian_exact(mu, delta), stated)
        assert eps <= _gaussian_exact(mu, delta) + 0.1  # the pure part adds at most 0.1


def test_new_api_compose_gaussian_and_generic_composition() -> None:
    # cell 6: GaussianMechanism(5) x 3 and (8) x 5, by Composition (autodp: RDP) and by
    # ComposeGaussian (autodp: exact); both are exact here
    gm1 = mechanism_zoo.GaussianMechanism(5.0, name="GM1")
    gm2 = mechanism_zoo.GaussianMechanism(8.0, name="GM2")
    generic = transformer_zoo.Composition()([gm1, gm2], [3, 5])
    gaussian = transformer_zoo.ComposeGaussian()([gm1, gm2], [3, 5])
    assert gaussian.name == "Compose:{GM1: 3, GM2: 5}"
    assert gaussian.params == {"GM1:sigma": 5.0, "GM2:sigma": 8.0}
    mu = math.sqrt(3 / 25 + 5 / 64)
    for delta, stated_generic, stated_gaussian in (
        (1e-6, 2.1309868424169824, 1.984273919801572),
        (1e-4, 1.6484258167240666, 1.4867384204500813),
    ):
        exact = _gaussian_exact(mu, delta)
        assert stated_gaussian == pytest.approx(exact, rel=1e-11)  # autodp's exact value
        _between(generic.get_approxDP(delta), exact, stated_generic)
        assert gaussian.get_approxDP(delta) == pytest.approx(exact, rel=1e-11)


def test_new_api_rdp_to_dp_conversions_of_one_gaussian() -> None:
    # cells 9 and 11: GaussianMechanism(1) with autodp's conversion flags, and the
    # Laplace-like PureDP_Mechanism(sqrt 2), at delta 1e-5
    flags = [
        dict(approxDP_off=True, use_basic_RDP_to_approxDP_conversion=True),
        dict(approxDP_off=True),
        dict(approxDP_off=True, use_fDP_based_RDP_to_approxDP_conversion=True),
        dict(RDP_off=True),
        dict(RDP_off=True, approxDP_off=True, fdp_off=False),
    ]
    stated = [
        5.298525912188081,
        4.728386984943314,
        4.7283856417872805,
        4.377178095681228,
        4.377178095762625,
    ]
    exact = _gaussian_exact(1.0, 1e-5)
    for kw, value in zip(flags, stated, strict=True):
        gm = mechanism_zoo.GaussianMechanism(1.0, name="GM", **kw)
        _between(gm.approxDP(1e-5), exact, value)
    laplace = mechanism_zoo.PureDP_Mechanism(math.sqrt(2), name="Laplace")
    _between(laplace.approxDP(1e-5), _pure_exact(math.sqrt(2), 1e-5), 1.4142111312027956)


def test_new_api_poisson_sampled_composition() -> None:
    # cells 14-16: the same three mechanisms 30, 50 and 10 times, then each Poisson
    # sampled with probability 0.1 (improved_bound_flag or not)
    gm1 = mechanism_zoo.ExactGaussianMechanism(5.0, name="GM1")
    gm2 = mechanism_zoo.ExactGaussianMechanism(8.0, name="GM2")
    svt = mechanism_zoo.PureDP_Mechanism(eps=0.1, name="SVT")
    poisson = transformer_zoo.AmplificationBySampling(PoissonSampling=True)
    compose = transformer_zoo.Composition()
    coeffs = [30, 50, 10]
    plain = compose([gm1, gm2, svt], coeffs)
    mu = math.sqrt(30 / 25 + 50 / 64)
    for delta, stated in ((1e-6, 7.942374861004205), (1e-4, 6.457460671942038)):
        _between(plain.get_approxDP(delta), _gaussian_exact(mu, delta), stated)
    for flag in (False, True):
        sampled = compose(
            [poisson(m, 0.1, improved_bound_flag=flag) for m in (gm1, gm2, svt)], coeffs
        )
        assert sampled.name == (
            "Compose:{PoissonSample:GM1: 30, PoissonSample:GM2: 50, PoissonSample:SVT: 10}"
        )
        assert sampled.params["PoissonSample:GM1:PoissonSample"] == 0.1
        for delta, stated in ((1e-6, 0.8616498207977252), (1e-4, 0.645403895438424)):
            eps = sampled.get_approxDP(delta)
            _between(eps, None, stated)
            assert eps < plain.get_approxDP(delta)


def test_new_api_calibrator() -> None:
    # cell 18: eps_delta_calibrator to (1.5, 1e-6) over [0, 100]; autodp: GM1 sigma
    # 2.904058395116711 (epsilon 1.4999997486), Laplace eps 1.500001569629506
    calibrate = calibrator_zoo.eps_delta_calibrator()
    gm = calibrate(mechanism_zoo.ExactGaussianMechanism, 1.5, 1e-6, [0, 100], name="GM1")
    assert gm.name == "GM1" and set(gm.params) == {"sigma"}
    assert _gaussian_exact(1 / gm.params["sigma"], 1e-6) <= 1.5
    assert gm.params["sigma"] <= 2.904058395116711 * (1 + 1e-6)
    assert _gaussian_exact(1 / (gm.params["sigma"] * (1 - 1e-6)), 1e-6) > 1.5 - 1e-5
    lap = calibrate(mechanism_zoo.PureDP_Mechanism, 1.5, 1e-6, [0, 100], name="Laplace")
    assert lap.name == "Laplace" and set(lap.params) == {"eps"}
    assert _pure_exact(lap.params["eps"], 1e-6) <= 1.5
    assert lap.params["eps"] >= 1.5  # a pure epsilon just above the target meets it at 1e-6


def test_new_api_noisy_gd_and_noisy_sgd() -> None:
    # cell 20: NoisyGD_mech, a GaussianMechanism subclass of sigma (sum sigma_i^-2)^-1/2
    class NoisyGDMech(mechanism_zoo.GaussianMechanism):
        def __init__(self, sigma_list, name="NoisyGD"):
            mechanism_zoo.GaussianMechanism.__init__(
                self, sigma=np.sqrt(1 / np.sum(1 / sigma_list**2)), name=name
            )
            self.params = {"sigma_list": sigma_list}

    sigmas = np.array([5.0, 3.0, 4.0])
    mu = math.sqrt(float(np.sum(1 / sigmas**2)))
    eps = NoisyGDMech(sigmas).get_approxDP(delta=1e-6)
    _between(eps, _gaussian_exact(mu, 1e-6), 2.0677358464697515)

    # cells 21-22 and 24: the Poisson-subsampled Gaussian (q 0.01, sigma 5) 1000 times,
    # by Composition and as a Mechanism subclass fed its RenyiDP (autodp: both
    # 0.27105623043762284)
    sub = transformer_zoo.AmplificationBySampling()
    sg = sub(mechanism_zoo.GaussianMechanism(sigma=5.0), 0.01, improved_bound_flag=True)
    v1 = transformer_zoo.Composition()([sg], [1000])

    class NoisySGDMech(Mechanism):
        def __init__(self, prob, sigma, niter, name="NoisySGD"):
            Mechanism.__init__(self)
            self.name = name
            self.params = {"prob": prob, "sigma": sigma, "niter": niter}
            s = transformer_zoo.AmplificationBySampling()(
                mechanism_zoo.GaussianMechanism(sigma=sigma), 0.01, improved_bound_flag=True
            )
            mech = transformer_zoo.Composition()([s], [niter])
            self.propagate_updates(mech.RenyiDP, type_of_update="RDP")

    v2 = NoisySGDMech(prob=0.01, sigma=5.0, niter=1000)
    _between(v1.get_approxDP(1e-6), None, 0.27105623043762284)
    _between(v2.get_approxDP(1e-6), None, 0.27105623043762284)
    # v2 keeps only the RDP curve: never tighter than the composition itself
    assert v2.get_approxDP(1e-6) >= v1.get_approxDP(1e-6) * (1 - 1e-9)


def test_calibrator_tutorial() -> None:
    # tutorial_calibrator.ipynb, cell 2: (0.1, 1e-6); autodp: GM sigma 36.30468875626822
    # (its epsilon 0.10000000492561108: above the target), Ana_GM 36.304691899114694
    gm = calibrator_zoo.eps_delta_calibrator()(
        mechanism_zoo.ExactGaussianMechanism, 0.1, 1e-6, [0, 100], name="GM"
    )
    ana = calibrator_zoo.ana_gaussian_calibrator()(
        mechanism_zoo.ExactGaussianMechanism, 0.1, 1e-6, name="Ana_GM"
    )
    for mech, stated in ((gm, 36.30468875626822), (ana, 36.304691899114694)):
        sigma = mech.params["sigma"]
        assert mech.get_approxDP(1e-6) <= 0.1
        assert _gaussian_exact(1 / sigma, 1e-6) <= 0.1 * (1 + 1e-12)
        assert sigma == pytest.approx(stated, rel=1e-6)
