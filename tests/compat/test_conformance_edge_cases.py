"""Edge cases of the autodp facade: the three exceptions, exact values where a
closed form exists, and autodp arguments honoured or warned about (never silently
dropped). Expected values are closed forms (see tests/accounting/test_closed_form.py for
their brute-force checks) or autodp 0.2.3.1's own outputs where autodp is exact."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.compat.autodp import calibrator_zoo, mechanism_zoo, transformer_zoo
from privlearn.compat.autodp.autodp_core import AutodpArgumentWarning, Mechanism


# ----------------------------------------------------------------------------------------
# 1. the three exceptions
# ----------------------------------------------------------------------------------------
class _ComplexMechanism(Mechanism):
    """autodp's example_calibrator.py pattern: no call to Mechanism.__init__."""

    def __init__(self, params, name="A_Good_Name"):
        self.name = name
        self.params = params
        gm1 = mechanism_zoo.ExactGaussianMechanism(params["sigma1"], name="GM1")
        gm2 = mechanism_zoo.ExactGaussianMechanism(params["sigma2"], name="GM2")
        svt = mechanism_zoo.PureDP_Mechanism(eps=params["eps"], name="SVT")
        mech = transformer_zoo.Composition()([gm1, gm2, svt], params["coeffs"])
        self.set_all_representation(mech)


def test_subclass_without_init_can_set_all_representation() -> None:
    m = _ComplexMechanism({"sigma1": 5.0, "sigma2": 8.0, "eps": 0.5, "coeffs": [3, 5, 1]})
    direct = compose([Gaussian(5.0)] * 3 + [Gaussian(8.0)] * 5 + [_pure(0.5)])
    assert m.get_approxDP(1e-6) == pytest.approx(direct.epsilon(1e-6), rel=1e-12)
    assert m.name == "A_Good_Name" and m.accountant is None and m.neighboring == "add_remove"
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = m.nonexistent


def test_calibrate_subclass_without_init() -> None:
    # autodp's example_calibrator.py, case 5: tune the SVT epsilon to a 2.5 budget
    params = {"sigma1": 5.0, "sigma2": 8.0, "coeffs": [3, 5, 1], "eps": None}
    bob = calibrator_zoo.generalized_eps_delta_calibrator()(
        _ComplexMechanism, 2.5, 1e-6, [0, 50], params=params, para_name="eps", name="Bob"
    )
    assert bob.get_approxDP(1e-6) <= 2.5
    assert bob.get_approxDP(1e-6) == pytest.approx(2.5, rel=1e-5)
    assert params["eps"] == bob.params["eps"]  # updated in place, as autodp


def _pure(eps: float):
    from privlearn.accounting import PureDP

    return PureDP(eps)


@pytest.mark.parametrize(
    "mech",
    [
        mechanism_zoo.GaussianMechanism(1.0),
        mechanism_zoo.LaplaceMechanism(b=0.5),
        mechanism_zoo.PureDP_Mechanism(2.0),
        mechanism_zoo.RandresponseMechanism(p=0.8),
        mechanism_zoo.SubsampleGaussianMechanism({"prob": 0.1, "sigma": 1.0, "coeff": 10}),
        mechanism_zoo.zCDP_Mechanism(rho=0.5),
    ],
)
def test_delta_one_gives_zero(mech) -> None:
    assert mech.approxDP(1.0) == 0.0
    assert mech.get_approxDP(np.float64(1.0)) == 0.0
    # autodp's loops over 10.0 ** -np.linspace(0, ...) start at delta = 1
    eps = [mech.get_approxDP(d) for d in 10.0 ** -np.linspace(0, 8, 5)]
    assert eps[0] == 0.0 and all(a <= b for a, b in zip(eps, eps[1:], strict=False))


@pytest.mark.parametrize("eps0", [37.5, 40.0, 60.0, 100.0])
def test_pure_dp_large_epsilon(eps0: float) -> None:
    m = mechanism_zoo.PureDP_Mechanism(eps0)
    exact = eps0 + math.log1p(-1e-6 * (1 + math.exp(-eps0)))
    assert m.get_approxDP(1e-6) == pytest.approx(exact, rel=1e-12)
    c = transformer_zoo.Composition()([m, mechanism_zoo.GaussianMechanism(1.0)], [2, 1])
    assert 2 * eps0 < c.get_approxDP(1e-6) < 2 * eps0 + 5.0


def test_calibrate_pure_dp_over_0_100() -> None:
    m = calibrator_zoo.eps_delta_calibrator()(mechanism_zoo.PureDP_Mechanism, 1.0, 1e-6, [0, 100])
    assert m.get_approxDP(1e-6) <= 1.0
    # exact: eps0 + log(1 - delta (1 + e^-eps0)) = 1
    assert m.params["eps"] == pytest.approx(1.0000013, rel=1e-6)


# ----------------------------------------------------------------------------------------
# 2. exact values
# ----------------------------------------------------------------------------------------
def test_pure_dp_eight_fold_is_optimal_composition() -> None:
    c = transformer_zoo.Composition()([mechanism_zoo.PureDP_Mechanism(0.3)], [8])
    exact = 2.3999156576487  # KOV 2015 Thm 3.3 (autodp reports 2.3999156576487093)
    assert c.get_approxDP(1e-6) == pytest.approx(exact, rel=1e-9)
    assert c.get_approxDP(1e-6) >= exact * (1 - 1e-13)


@pytest.mark.parametrize(
    "mech, exact",
    [
        (mechanism_zoo.RandresponseMechanism(p=0.75), math.log(3) + math.log1p(-1e-6 / 0.75)),
        (mechanism_zoo.LaplaceMechanism(b=1.0), 1.0 + 2 * math.log1p(-1e-6)),
        (mechanism_zoo.PureDP_Mechanism(1.0), 1.0 + math.log1p(-1e-6 * (1 + math.exp(-1)))),
    ],
)
def test_rr_laplace_exact(mech, exact: float) -> None:
    got = mech.get_approxDP(1e-6)
    assert got >= exact * (1 - 1e-14)
    assert got == pytest.approx(exact, rel=1e-9)


# ----------------------------------------------------------------------------------------
# 3. arguments honoured or warned about
# ----------------------------------------------------------------------------------------
def test_one_sided_pld_amplification_honoured() -> None:
    # autodp's afa_subsample.py setting: sigma 2, q 0.02, 200 steps, delta 1e-5
    gm = mechanism_zoo.ExactGaussianMechanism(2.0)
    vals = {}
    for nb in ("add_only", "remove_only"):
        s = transformer_zoo.AmplificationBySampling_pld(PoissonSampling=True, neighboring=nb)(
            gm, 0.02
        )
        assert s.neighboring == nb
        vals[nb] = transformer_zoo.ComposeAFA()([s], [200]).approxDP(1e-5)
    both = transformer_zoo.Composition()(
        [transformer_zoo.AmplificationBySampling()(gm, 0.02)], [200]
    ).approxDP(1e-5)
    assert vals["add_only"] == pytest.approx(0.49196, abs=2e-5)
    assert both == pytest.approx(0.57325, abs=2e-5)
    # add/remove is the worse of the two one-sided relations
    assert both == pytest.approx(max(vals.values()), rel=1e-6)
    assert vals["add_only"] < both


def test_one_sided_rejects_bad_combinations() -> None:
    with pytest.raises(ValueError, match="neighboring must be 'add_only' or 'remove_only'"):
        transformer_zoo.AmplificationBySampling_pld(neighboring="add_remove")
    with pytest.raises(ValueError, match="PoissonSampling must be True"):
        transformer_zoo.AmplificationBySampling_pld(PoissonSampling=False)
    add = transformer_zoo.AmplificationBySampling_pld(neighboring="add_only")
    rem = transformer_zoo.AmplificationBySampling_pld(neighboring="remove_only")
    s = add(mechanism_zoo.ExactGaussianMechanism(1.0), 0.1)
    with pytest.raises(ValueError, match="incompatible"):
        rem(s, 0.5)
    with pytest.raises(ValueError, match="requires scheme='poisson'"):
        subsample(Gaussian(1.0), 0.1, scheme="fixed", neighbouring="add_only")


def test_subsample_gaussian_mechanism_neighboring() -> None:
    p = {"prob": 0.02, "sigma": 2.0, "coeff": 200}
    add = mechanism_zoo.SubsampleGaussianMechanism(p, phi_off=False, neighboring="add_only")
    rem = mechanism_zoo.SubsampleGaussianMechanism(p, phi_off=False, neighboring="remove_only")
    std = mechanism_zoo.SubsampleGaussianMechanism(p)  # autodp: RDP route, add/remove
    assert add.approxDP(1e-5) == pytest.approx(0.49196, abs=2e-5)
    assert std.approxDP(1e-5) == pytest.approx(max(add.approxDP(1e-5), rem.approxDP(1e-5)))
    with pytest.warns(AutodpArgumentWarning, match="neighboring='add_only' has no effect"):
        mechanism_zoo.SubsampleGaussianMechanism(p, neighboring="add_only")
    with pytest.raises(ValueError, match="neighboring must be"):
        mechanism_zoo.SubsampleGaussianMechanism(p, neighboring="both")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"RDP_off": True},
        {"approxDP_off": True},
        {"approxDP_off": True, "use_basic_RDP_to_approxDP_conversion": True},
        {"approxDP_off": True, "use_fDP_based_RDP_to_approxDP_conversion": True},
        {"phi_off": False},
    ],
)
def test_gaussian_switches_warn(kwargs) -> None:
    with pytest.warns(AutodpArgumentWarning, match="has no effect") as rec:
        m = mechanism_zoo.GaussianMechanism(2.0, **kwargs)
    for k in kwargs:
        assert k in str(rec[0].message)
    assert "exact privacy curve" in str(rec[0].message)
    # and the value is still the exact one
    assert m.get_approxDP(1e-3) == pytest.approx(Gaussian(2.0).epsilon(1e-3), rel=1e-12)


def test_defaults_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = mechanism_zoo.GaussianMechanism(2.0, fdp_off=False)  # honoured: f-DP available
        mechanism_zoo.LaplaceMechanism(b=1.0)
        mechanism_zoo.RandresponseMechanism(p=0.7)
        mechanism_zoo.SubsampleGaussianMechanism({"prob": 0.1, "sigma": 1.0, "coeff": 3})
        s = transformer_zoo.AmplificationBySampling()(g, 0.1)
        transformer_zoo.Composition()([s], [3])
        g.propagate_updates(g.RenyiDP, "RDP")


def test_improved_bound_flag_and_compose_switches_warn() -> None:
    g = mechanism_zoo.GaussianMechanism(2.0)
    with pytest.warns(AutodpArgumentWarning, match="improved_bound_flag=True has no effect"):
        s = transformer_zoo.AmplificationBySampling()(g, 0.1, improved_bound_flag=True)
    with pytest.warns(AutodpArgumentWarning, match="improved_bound_flag=False has no effect"):
        transformer_zoo.AmplificationBySampling()(g, 0.1, improved_bound_flag=False)
    with pytest.warns(AutodpArgumentWarning, match="BBGHS_conversion=False"):
        transformer_zoo.Composition()([s], [3], BBGHS_conversion=False)
    with pytest.warns(AutodpArgumentWarning, match="fDP_based_conversion=True"):
        g.propagate_updates(g.RenyiDP, "RDP", fDP_based_conversion=True)
    for kw in ({"RDP_off": True}, {"phi_off": False}):
        with pytest.warns(AutodpArgumentWarning, match="has no effect"):
            mechanism_zoo.LaplaceMechanism(b=1.0, **kw)
        with pytest.warns(AutodpArgumentWarning, match="has no effect"):
            mechanism_zoo.RandresponseMechanism(p=0.7, **kw)
