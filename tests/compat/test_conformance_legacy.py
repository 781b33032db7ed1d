"""autodp's legacy ``privacy_calibrator`` and ``utils`` on the facade:
every calibrated noise level meets its target with privlearn's certified accountants
and is never larger than autodp's (autodp converts RDP; privlearn uses exact curves),
except where autodp's own answer misses its target (its analytic-Gaussian bisection
stops at |delta(s) - delta| <= 1e-12, on either side)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting import Gaussian, Laplace, RandomizedResponse, compose, subsample
from privlearn.compat.autodp import privacy_calibrator as pc
from privlearn.compat.autodp import rdp_bank, utils

pytest.importorskip("autodp")
import autodp.rdp_acct  # noqa: E402,F401  (autodp's privacy_calibrator imports circularly)
from autodp import privacy_calibrator as a_pc  # noqa: E402
from autodp import rdp_bank as a_rdp_bank  # noqa: E402
from autodp import utils as a_utils  # noqa: E402


@pytest.mark.parametrize("eps,delta,k,prob", [(1.0, 1e-6, 1, 1.0), (1.0, 1e-6, 100, 0.01),
                                              (0.5, 1e-5, 10, 1.0), (2.0, 1e-8, 1000, 0.001)])
def test_gaussian_mech(eps, delta, k, prob):
    s = pc.gaussian_mech(eps, delta, k=k, prob=prob)["sigma"]
    assert s <= a_pc.gaussian_mech(eps, delta, k=k, prob=prob)["sigma"]
    base = Gaussian(s) if prob >= 1 else subsample(Gaussian(s), prob)
    assert compose(base, steps=k).epsilon(delta) <= eps


@pytest.mark.parametrize("eps,delta,k", [(1.0, 1e-6, 10), (1.0, 0.0, 16), (0.3, 1e-5, 100)])
def test_laplace_mech(eps, delta, k):
    b = pc.laplace_mech(eps, delta, k=k)["b"]
    assert b <= a_pc.laplace_mech(eps, delta, k=k)["b"] * (1 + 1e-12)
    assert compose(Laplace(b), steps=k).epsilon(delta) <= eps * (1 + 1e-12)


@pytest.mark.parametrize("eps,delta,k", [(1.0, 1e-6, 10), (1.0, 0.0, 5)])
def test_randresponse_mech(eps, delta, k):
    p = pc.randresponse_mech(eps, delta, k=k)["p"]
    assert p >= float(a_pc.randresponse_mech(eps, delta, k=k)["p"]) * (1 - 1e-12)
    assert compose(RandomizedResponse(p), steps=k).epsilon(delta) <= eps * (1 + 1e-12)


def test_analytic_and_classical_gaussian():
    s = pc.ana_gaussian_mech(1.0, 1e-6)["sigma"]
    assert Gaussian(s).epsilon(1e-6) <= 1.0  # certified
    assert s == pytest.approx(a_pc.ana_gaussian_mech(1.0, 1e-6)["sigma"], rel=1e-5)
    assert pc.classical_gaussian_mech(0.5, 1e-6)["sigma"] == pytest.approx(
        float(a_pc.classical_gaussian_mech(0.5, 1e-6)["sigma"]), rel=1e-15)
    with pytest.raises(ValueError, match="0 < eps <= 1"):
        pc.classical_gaussian_mech(2.0, 1e-6)


def test_rdp_mech_calibrates_in_place_and_is_tighter():
    params: dict = {}
    out = pc.RDP_mech(rdp_bank.RDP_gaussian, 1.0, 1e-6, "sigma", params, k=5)
    assert out is params and params["sigma"] <= a_pc.RDP_mech(
        a_rdp_bank.RDP_gaussian, 1.0, 1e-6, "sigma", {}, k=5)["sigma"]
    assert compose(Gaussian(params["sigma"]), 5).epsilon(1e-6, "rdp") <= 1.0 * (1 + 1e-9)
    q = pc.subsampled_RDP_mech_get_prob(rdp_bank.RDP_gaussian, 1.0, 1e-6, {"sigma": 2.0},
                                        k=100)
    assert compose(subsample(Gaussian(2.0), q), 100).epsilon(1e-6, "rdp") <= 1.0 + 1e-9


def test_subsampling_helpers_and_utils():
    assert pc.subsample_epsdelta(1.0, 1e-6, 0.1) == pytest.approx(
        tuple(float(x) for x in a_pc.subsample_epsdelta(1.0, 1e-6, 0.1)))
    e0, d0 = pc.subsample_epsdelta_inverse(0.5, 1e-6, 0.1)
    assert pc.subsample_epsdelta(e0, d0, 0.1) == pytest.approx((0.5, 1e-6))
    q = pc.subsample_epsdelta_get_prob(0.5, 1e-6, 2.0, 1e-5)
    assert pc.subsample_epsdelta(2.0, 1e-5, q)[0] <= 0.5 + 1e-12
    x, y = np.array([-1.0, 3.0]), np.array([2.0, -5.0])
    np.testing.assert_allclose(utils.stable_logsumexp_two(x, y),
                               a_utils.stable_logsumexp_two(x, y))
    ours, ref = utils.stable_log_diff_exp(1.0, 2.0), a_utils.stable_log_diff_exp(1.0, 2.0)
    assert ours[0] == ref[0] and ours[1] == pytest.approx(float(ref[1]))
    assert utils.stable_logsumexp([1.0, 2.0, 3.0]) == pytest.approx(
        float(a_utils.stable_logsumexp(np.array([1.0, 2.0, 3.0]))))
    assert float(utils.logcomb(10, 3)) == pytest.approx(math.log(120))
    with pytest.raises(AttributeError, match="not provided"):
        _ = utils.no_such_helper
