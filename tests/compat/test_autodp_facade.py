"""Unit and property tests of the autodp facade beyond the seeds' cells."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from _seed_code_warnings import SEED_CODE_WARNINGS
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn.accounting import (
    CalibrationError,
    Gaussian,
    Laplace,
    PureDP,
    RDPMechanism,
    compose,
    subsample,
)
from privlearn.accounting.analytic import (
    effective_noise_multiplier,
    gaussian_epsilon,
    gaussian_epsilon_bounds,
)
from privlearn.compat.autodp import calibrator_zoo, mechanism_zoo, transformer_zoo
from privlearn.compat.autodp.autodp_core import Mechanism, RenyiDPFunction

pytestmark = SEED_CODE_WARNINGS

DELTA = 1e-6


# -- zoo ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sigma", [2.0, np.float64(2.0), np.float32(2.0), np.array(2.0), np.array([[2.0]]), 2]
)
def test_gaussian_accepts_numpy_scalars(sigma) -> None:
    m = mechanism_zoo.GaussianMechanism(sigma)
    assert m.params["sigma"] is sigma
    assert m.privlearn_mechanism == Gaussian(2.0)
    assert m.get_approxDP(DELTA) == gaussian_epsilon(2.0, DELTA)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_sigma_names_parameter(bad: float) -> None:
    with pytest.raises(ValueError, match="sigma"):
        mechanism_zoo.ExactGaussianMechanism(bad)


def test_array_sigma_rejected() -> None:
    with pytest.raises(ValueError, match="sigma must be a scalar"):
        mechanism_zoo.GaussianMechanism(np.array([1.0, 2.0]))


def test_bad_delta_names_parameter() -> None:
    m = mechanism_zoo.GaussianMechanism(1.0)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\], got 1.5"):
        m.get_approxDP(1.5)


def test_laplace_pure_dp_closed_form() -> None:
    """Laplace(b) is exactly (1/b)-DP; 100 compositions at delta = 0 give 100/b (basic
    composition is tight for delta = 0)."""
    m = mechanism_zoo.LaplaceMechanism(b=5.0)
    assert m.get_approxDP(0.0) == pytest.approx(0.2, rel=1e-14)
    assert m.get_approxDP(0.0) >= 0.2
    comp = transformer_zoo.Composition()([m], [100])
    assert comp.get_pureDP() == pytest.approx(20.0, rel=1e-14)
    assert comp.get_approxDP(0.0) == pytest.approx(20.0, rel=1e-12)
    assert comp.get_approxDP(0.0) >= 20.0


def test_randomized_response_and_puredp() -> None:
    p = 0.75
    rr = mechanism_zoo.RandresponseMechanism(p=p)
    assert rr.get_pureDP() == pytest.approx(math.log(p / (1 - p)), rel=1e-14)
    pure = mechanism_zoo.PureDP_Mechanism(eps=1.0)
    assert pure.privlearn_mechanism == PureDP(1.0)
    assert pure.get_approxDP(0.0) == pytest.approx(1.0, rel=1e-14)
    assert pure.get_approxDP(1e-3) <= 1.0 + 1e-12


def test_zcdp_mechanism_rdp() -> None:
    m = mechanism_zoo.zCDP_Mechanism(rho=0.5, xi=0.1)
    assert m.get_RDP(3.0) == pytest.approx(0.1 + 1.5)
    assert m.get_RDP(3.0) >= 0.1 + 1.5  # rounded up, never down


def test_zcdp_mechanism_is_the_zcdp_kind() -> None:
    # the registered kind (its group privacy, storage), not an opaque RDP function
    from privlearn.accounting import ZCDP
    from privlearn.accounting.serialization import mechanism_from_dict, mechanism_to_dict

    m = mechanism_zoo.zCDP_Mechanism(rho=0.5, xi=0.1)
    assert m.privlearn_mechanism == ZCDP(0.5, 0.1)
    stored = mechanism_to_dict(m.privlearn_mechanism)
    assert mechanism_from_dict(stored) == ZCDP(0.5, 0.1)


def test_subsample_gaussian_mechanism_matches_transformers() -> None:
    m = mechanism_zoo.SubsampleGaussianMechanism({"prob": 0.01, "sigma": 2.0, "coeff": 10})
    assert m.privlearn_mechanism == compose(subsample(Gaussian(2.0), 0.01), steps=10)
    assert m.params == {"prob": 0.01, "sigma": 2.0, "coeff": 10}


# -- transformers ---------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    sigmas=st.lists(st.floats(0.3, 50.0), min_size=1, max_size=5),
    coeffs=st.lists(st.floats(0.01, 1000.0), min_size=5, max_size=5),
)
def test_compose_gaussian_real_coefficients(sigmas: list[float], coeffs: list[float]) -> None:
    """ComposeGaussian with real coefficients = one Gaussian of sigma
    (sum c_i / sigma_i^2)^(-1/2) (Dong, Roth & Su 2022, Cor. 3.3)."""
    coeffs = coeffs[: len(sigmas)]
    mechs = [mechanism_zoo.GaussianMechanism(s, name=f"g{i}") for i, s in enumerate(sigmas)]
    out = transformer_zoo.ComposeGaussian()(mechs, coeffs)
    sigma_eff = sum(c / s**2 for s, c in zip(sigmas, coeffs, strict=True)) ** -0.5
    assert isinstance(out, mechanism_zoo.ExactGaussianMechanism)
    # rounded down (conservative) by at most a few ulps
    assert out.privlearn_mechanism.noise_multiplier <= sigma_eff * (1 + 1e-15)
    assert out.privlearn_mechanism.noise_multiplier == pytest.approx(sigma_eff, rel=1e-13)
    # a valid bound: at least the certified lower bound on the exact epsilon at sigma_eff
    # (comparing two certified *upper* bounds would test their floating-point allowances)
    assert out.get_approxDP(DELTA) >= gaussian_epsilon_bounds(sigma_eff, DELTA)[0]
    assert out.params == {f"g{i}:sigma": s for i, s in enumerate(sigmas)}


def test_compose_gaussian_rejects_non_gaussian() -> None:
    with pytest.raises(TypeError, match="only Gaussian"):
        transformer_zoo.ComposeGaussian()([mechanism_zoo.LaplaceMechanism(b=1.0)], [1])


def test_composition_integer_counts_and_names() -> None:
    g = mechanism_zoo.GaussianMechanism(3.0, name="G")
    lap = mechanism_zoo.LaplaceMechanism(b=4.0, name="L")
    out = transformer_zoo.Composition()([g, lap], [2, 3])
    assert out.privlearn_mechanism == compose([Gaussian(3.0), Laplace(4.0)], steps=[2, 3])
    assert out.name == "Compose:{G: 2, L: 3}"
    assert out.params == {"G:sigma": 3.0, "L:b": 4.0}


def test_composition_rounds_up_non_integer_non_gaussian() -> None:
    lap = mechanism_zoo.LaplaceMechanism(b=4.0)
    with pytest.warns(UserWarning, match="rounded up"):
        out = transformer_zoo.Composition()([lap], [2.5])
    assert out.privlearn_mechanism == compose(Laplace(4.0), steps=3)
    assert out.get_pureDP() == pytest.approx(0.75)


def test_composition_real_gaussian_coefficient_is_exact() -> None:
    g = mechanism_zoo.GaussianMechanism(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = transformer_zoo.Composition()([g], [2.25])
    assert effective_noise_multiplier(out.privlearn_mechanism) == pytest.approx(2.0, rel=1e-14)


def test_composition_zero_coefficients_reveal_nothing() -> None:
    g = mechanism_zoo.GaussianMechanism(3.0)
    out = transformer_zoo.Composition()([g], [0])
    assert out.get_approxDP(DELTA) == 0.0
    assert transformer_zoo.ComposeGaussian()([g], [0]).get_approxDP(DELTA) == 0.0


def test_composition_length_mismatch() -> None:
    g = mechanism_zoo.GaussianMechanism(3.0)
    with pytest.raises(ValueError, match="coeff_list must have one entry per mechanism"):
        transformer_zoo.Composition()([g, g], [1])
    with pytest.raises(ValueError, match=r"coeff_list\[0\]"):
        transformer_zoo.Composition()([g], [-1])


def test_amplification_schemes() -> None:
    g = mechanism_zoo.GaussianMechanism(2.0, name="G")
    poisson = transformer_zoo.AmplificationBySampling()(g, 0.1, improved_bound_flag=True)
    assert poisson.privlearn_mechanism == subsample(Gaussian(2.0), 0.1, scheme="poisson")
    assert poisson.name == "PoissonSample:G"
    assert poisson.params == {"sigma": 2.0, "PoissonSample": 0.1}
    fixed = transformer_zoo.AmplificationBySampling(PoissonSampling=False)(g, 0.1)
    assert fixed.privlearn_mechanism == subsample(Gaussian(2.0), 0.1, scheme="fixed")
    assert fixed.neighboring == "replace_one"
    # Poisson sampling of a replace-one mechanism has no add/remove guarantee
    with pytest.raises(ValueError, match="neighboring"):
        transformer_zoo.AmplificationBySampling()(fixed, 0.5)
    assert transformer_zoo.AmplificationBySampling()(g, 0.0).get_approxDP(DELTA) == 0.0
    with pytest.raises(ValueError, match=r"prob must be in \(0, 1\]"):
        transformer_zoo.AmplificationBySampling()(g, 1.5)


def test_subsampling_a_gaussian_composition_uses_equivalent_gaussian() -> None:
    g = [mechanism_zoo.GaussianMechanism(s) for s in (3.0, 4.0)]
    comp = transformer_zoo.Composition()(g, [1, 1])
    sub = transformer_zoo.AmplificationBySampling()(comp, 0.5)
    assert sub.privlearn_mechanism.base.noise_multiplier == pytest.approx(2.4, rel=1e-14)


def test_subsampling_a_mixed_composition_raises() -> None:
    comp = transformer_zoo.Composition()(
        [mechanism_zoo.GaussianMechanism(3.0), mechanism_zoo.LaplaceMechanism(b=1.0)], [1, 1]
    )
    with pytest.raises(NotImplementedError, match="subsample each"):
        transformer_zoo.AmplificationBySampling()(comp, 0.5)


# -- Mechanism: updates and representations -------------------------------------------
def test_user_rdp_function_uses_rdp_accountant() -> None:
    def rdp(alpha: float) -> float:  # RDP of the Gaussian with sigma = 2
        return alpha / (2 * 2.0**2)

    m = Mechanism()
    m.propagate_updates(rdp, type_of_update="RDP")
    assert isinstance(m.privlearn_mechanism, RDPMechanism)
    expected = RDPMechanism(rdp).epsilon(DELTA, "rdp")
    assert m.get_approxDP(DELTA) == pytest.approx(expected, rel=1e-12)
    # an RDP bound converts to a looser epsilon than the exact Gaussian curve
    assert m.get_approxDP(DELTA) >= gaussian_epsilon(2.0, DELTA)


def test_renyi_dp_function_carries_description() -> None:
    g = mechanism_zoo.GaussianMechanism(2.0)
    f = g.RenyiDP
    assert isinstance(f, RenyiDPFunction)
    assert f.mechanism == Gaussian(2.0)
    assert f(4.0) == pytest.approx(4.0 / 8.0, rel=1e-12)  # alpha / (2 sigma^2)
    np.testing.assert_allclose(f(np.array([2.0, 4.0])), [0.25, 0.5], rtol=1e-12)
    m = Mechanism()
    m.propagate_updates(f, "RDP")
    assert m.privlearn_mechanism == Gaussian(2.0)
    assert m.get_approxDP(DELTA) == g.get_approxDP(DELTA)


def test_propagate_pure_and_approx_updates() -> None:
    m = Mechanism()
    assert m.get_approxDP(DELTA) == math.inf
    m.propagate_updates((1.5, 1e-5), "approxDP")
    assert m.get_approxDP(1e-5) == 1.5
    assert m.get_approxDP(1e-6) == math.inf
    m.propagate_updates(lambda d: 3.0, "approxDP_func")
    assert m.get_approxDP(1e-6) == 3.0
    with pytest.raises(NotImplementedError, match="has no privlearn description"):
        transformer_zoo.Composition()([m], [2])
    m.propagate_updates(2.0, "pureDP")
    assert m.privlearn_mechanism == PureDP(2.0)
    assert m.get_approxDP(1e-5) == 1.5
    assert m.get_approxDP(0.0) == pytest.approx(2.0)


@pytest.mark.parametrize("kind", ["fDP", "log_phi", "cdf", "approxRDP", "RDPP"])
def test_unsupported_updates_raise(kind: str) -> None:
    with pytest.raises(NotImplementedError, match="supported: 'RDP'"):
        Mechanism().propagate_updates(lambda x: x, kind)


def test_set_all_representation_keeps_name_and_params() -> None:
    class Mine(Mechanism):
        def __init__(self) -> None:
            Mechanism.__init__(self)
            self.name = "mine"
            self.params = {"a": 1}
            self.set_all_representation(mechanism_zoo.LaplaceMechanism(b=2.0, name="lap"))

    m = Mine()
    assert (m.name, m.params) == ("mine", {"a": 1})
    assert m.privlearn_mechanism == Laplace(2.0)
    with pytest.raises(TypeError, match="set_all_representation"):
        m.set_all_representation(object())  # type: ignore[arg-type]


def test_forced_accountant() -> None:
    g = mechanism_zoo.GaussianMechanism(2.0)
    exact = g.get_approxDP(DELTA)
    g.accountant = "rdp"
    assert g.get_approxDP(DELTA) > exact


def test_approx_delta_roundtrip() -> None:
    g = mechanism_zoo.GaussianMechanism(2.0)
    eps = g.get_approxDP(DELTA)
    assert g.get_approx_delta(eps) <= DELTA
    assert g.get_approx_delta(eps * 0.99) > DELTA


# -- calibrators ---------------------------------------------------------------------
def test_eps_delta_calibrator_unreachable() -> None:
    with pytest.raises(CalibrationError):
        calibrator_zoo.eps_delta_calibrator()(
            lambda s: mechanism_zoo.GaussianMechanism(s), 0.01, DELTA, [0, 10]
        )


def _unreachable_calibration(which: str, peer: bool):
    """A budget no parameter in the bounds meets, with the facade or (``peer``) autodp."""
    if peer:
        from autodp import calibrator_zoo as cz
        from autodp import mechanism_zoo as mz
        from autodp import transformer_zoo as tz
    else:
        cz, mz, tz = calibrator_zoo, mechanism_zoo, transformer_zoo
    if which == "eps_delta":
        return cz.eps_delta_calibrator()(lambda s: mz.GaussianMechanism(s), 0.005, DELTA,
                                         [0, 100])

    def noisy_sgd(params, name=None):
        sub = tz.AmplificationBySampling()(mz.GaussianMechanism(sigma=params["sigma"]),
                                           params["prob"])
        return tz.Composition()([sub], [params["coeff"]])

    return cz.generalized_eps_delta_calibrator()(
        noisy_sgd, 1e-4, DELTA, [0.5, 5], params={"prob": 0.01, "sigma": None, "coeff": 1000},
        para_name="sigma")


@pytest.mark.parametrize("which", ["eps_delta", "generalized"])
def test_calibrator_failure_is_autodps_runtime_error(which: str) -> None:
    """autodp's calibrators raise RuntimeError when no parameter in the bounds meets the
    budget; ported code catching it keeps working, and privlearn's type still matches."""
    with pytest.raises(RuntimeError) as info:
        _unreachable_calibration(which, peer=False)
    assert isinstance(info.value, CalibrationError)
    assert "unreachable" in str(info.value)
    pytest.importorskip("autodp")
    with pytest.raises(RuntimeError):  # the peer's behaviour that ported code relies on
        _unreachable_calibration(which, peer=True)


def test_eps_delta_calibrator_passes_name() -> None:
    m = calibrator_zoo.eps_delta_calibrator()(
        mechanism_zoo.GaussianMechanism, 1.0, DELTA, [0, 100], name="calibrated"
    )
    assert m.name == "calibrated"
    assert m.get_approxDP(DELTA) <= 1.0
    assert m.get_approxDP(DELTA) == pytest.approx(1.0, rel=1e-5)


def test_generalized_calibrator_updates_params_in_place() -> None:
    # autodp sets params[para_name] to the calibrated value
    params = {"sigma": 1.0, "coeff": 100}
    m = calibrator_zoo.generalized_eps_delta_calibrator()(
        mechanism_zoo.ComposedGaussianMechanism,
        2.0,
        DELTA,
        [0, 1000],
        params=params,
        para_name="sigma",
    )
    sigma = m.params["sigma"]
    assert params == {"sigma": sigma, "coeff": 100}
    assert gaussian_epsilon(sigma / 10.0, DELTA) <= 2.0
    assert gaussian_epsilon(sigma * (1 - 1e-5) / 10.0, DELTA) > 2.0


def test_ana_gaussian_calibrator() -> None:
    m = calibrator_zoo.ana_gaussian_calibrator()(mechanism_zoo.ExactGaussianMechanism, 1.0, 1e-5)
    s = m.params["sigma"]
    assert gaussian_epsilon(s, 1e-5) <= 1.0 < gaussian_epsilon(s * (1 - 1e-9), 1e-5)


def test_autodp_gaussian_and_laplace_agree() -> None:
    """Real autodp (where installed): the exact Gaussian agrees to rounding; our Laplace
    composition is no larger than autodp's RDP value."""
    autodp_zoo = pytest.importorskip("autodp.mechanism_zoo")
    autodp_tz = pytest.importorskip("autodp.transformer_zoo")
    for s in (0.5, 1.0, 4.0):
        theirs = autodp_zoo.ExactGaussianMechanism(s).get_approxDP(1e-5)
        ours = mechanism_zoo.ExactGaussianMechanism(s).get_approxDP(1e-5)
        assert ours == pytest.approx(theirs, rel=1e-9)
    theirs = autodp_tz.Composition()([autodp_zoo.LaplaceMechanism(b=2.0)], [20]).get_approxDP(1e-5)
    ours = transformer_zoo.Composition()([mechanism_zoo.LaplaceMechanism(b=2.0)], [20])
    assert ours.get_approxDP(1e-5) <= theirs * (1 + 1e-9)


def test_from_privlearn_roundtrip() -> None:
    desc = compose(subsample(Laplace(3.0), 0.1), steps=5)
    m = Mechanism.from_privlearn(desc, name="wrapped")
    assert m.privlearn_mechanism == desc and m.name == "wrapped"
    assert m.get_approxDP(DELTA) == desc.epsilon(DELTA, "pld")
    with pytest.raises(TypeError):
        Mechanism.from_privlearn("not a mechanism")  # type: ignore[arg-type]


@pytest.mark.parametrize("sigma, q", [(1.0, 0.01), (2.0, 0.1), (0.8, 0.05)])
def test_wor_subsampling_of_a_replace_one_gaussian_is_autodps_mechanism(sigma, q):
    # autodp's GaussianMechanism(sigma) with neighboring="replace_one" has Renyi curve
    # alpha / (2 sigma^2) between replace-one neighbours: unit replace-one sensitivity.
    # Sampling without replacement then attains ((1-q) N(0, s^2) + q N(1, s^2),
    # N(0, s^2)) (the record +1/2 against its replacement -1/2, every other record
    # -1/2): the facade's epsilon covers it and is autodp's own (its RDP bound, or the
    # tighter PLD), not that of twice the sensitivity
    from scipy.stats import norm

    autodp_zoo = pytest.importorskip("autodp.mechanism_zoo")
    autodp_tz = pytest.importorskip("autodp.transformer_zoo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = mechanism_zoo.GaussianMechanism(sigma), autodp_zoo.GaussianMechanism(sigma)
        ours.neighboring = theirs.neighboring = "replace_one"
        ours = transformer_zoo.AmplificationBySampling(PoissonSampling=False)(ours, q)
        theirs = autodp_tz.AmplificationBySampling(PoissonSampling=False)(
            theirs, q, improved_bound_flag=True)
        eps, ref = ours.get_approxDP(1e-5), theirs.get_approxDP(1e-5)
    x = 0.5 + sigma**2 * math.log((math.exp(eps) - 1 + q) / q)  # where the loss is eps
    attained = ((1 - q) * norm.sf(x / sigma) + q * norm.sf((x - 1) / sigma)
                - math.exp(eps) * norm.sf(x / sigma))
    assert attained <= 1e-5 * (1 + 1e-9)
    assert eps <= ref * (1 + 1e-6)
