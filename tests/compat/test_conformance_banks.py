"""autodp's ``rdp_bank`` / ``dp_bank`` / ``fdp_bank`` / ``rdp_acct`` and the added
``mechanism_zoo`` classes on the facade: closed forms, and no looser than autodp (test-only
peer) where autodp's value is a valid bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from privlearn.accounting import Gaussian, Laplace, PureDP, RandomizedResponse, compose, subsample
from privlearn.compat.autodp import dp_bank, fdp_bank, mechanism_zoo, rdp_acct, rdp_bank
from privlearn.errors import UnsupportedMechanismError

ORDERS = [1.0, 1.5, 2.0, 10.0, 64.5, math.inf]


def test_rdp_bank_closed_forms() -> None:
    a = np.array([1.5, 2.0, 10.0, 64.5])
    np.testing.assert_allclose(rdp_bank.RDP_gaussian({"sigma": 2.0}, a), a / 8, rtol=1e-12)
    assert rdp_bank.RDP_gaussian({"sigma": 2.0}, 1.0) == 0.125
    # Laplace (Mironov 2017, Table II)
    b = 1.5
    lap = np.log(a / (2 * a - 1) * np.exp((a - 1) / b) + (a - 1) / (2 * a - 1) * np.exp(-a / b)) / (
        a - 1
    )
    np.testing.assert_allclose(rdp_bank.RDP_laplace({"b": b}, a), lap, rtol=1e-12)
    assert rdp_bank.RDP_laplace({"b": b}, math.inf) == 1 / b
    # randomized response and pure DP
    p = 0.7
    rr = np.log(p**a * (1 - p) ** (1 - a) + (1 - p) ** a * p ** (1 - a)) / (a - 1)
    np.testing.assert_allclose(rdp_bank.RDP_randresponse({"p": p}, a), rr, rtol=1e-12)
    np.testing.assert_allclose(rdp_bank.RDP_randresponse({"p": 1 - p}, a), rr, rtol=1e-12)
    e = 1.0
    pe = math.exp(e) / (1 + math.exp(e))
    pure = np.log(pe**a * (1 - pe) ** (1 - a) + (1 - pe) ** a * pe ** (1 - a)) / (a - 1)
    np.testing.assert_allclose(rdp_bank.RDP_pureDP({"eps": e}, a), pure, rtol=1e-12)
    np.testing.assert_allclose(rdp_bank.RDP_zCDP({"rho": 0.3, "xi": 0.1}, a), 0.1 + 0.3 * a)
    assert rdp_bank.RDP_truncatedCDP({"rho": 0.3, "w": 5}, 10.0) == math.inf
    with pytest.raises(ValueError, match=r"alpha must be in \[1, inf\]"):
        rdp_bank.RDP_gaussian({"sigma": 1.0}, 0.5)
    with pytest.raises(AttributeError, match="not provided by privlearn's autodp facade"):
        _ = rdp_bank.RDP_no_such_mechanism


@pytest.mark.parametrize(
    "name, params",
    [
        ("RDP_gaussian", {"sigma": 2.0}),
        ("RDP_laplace", {"b": 1.5}),
        ("RDP_randresponse", {"p": 0.7}),
        ("RDP_pureDP", {"eps": 1.0}),
    ],
)
def test_rdp_bank_matches_autodp(name: str, params: dict) -> None:
    ref_bank = pytest.importorskip("autodp.rdp_bank")
    for a in ORDERS:
        ours, ref = getattr(rdp_bank, name)(params, a), getattr(ref_bank, name)(params, a)
        assert ours == pytest.approx(ref, rel=1e-12)
        assert ours >= ref * (1 - 1e-15)  # certified rounding: never below


def test_rdp_subsampled_pure_dp_is_valid() -> None:
    # the exact RDP of the Poisson-subsampled randomized-response pair (both directions)
    # at integer orders is a lower bound on any valid bound
    e, q = 1.0, 0.05
    pe = math.exp(e) / (1 + math.exp(e))
    P, Q = np.array([pe, 1 - pe]), np.array([1 - pe, pe])
    mix = (1 - q) * Q + q * P
    for a in (2, 3, 10, 50):
        d1 = math.log(np.sum(mix**a * Q ** (1 - a))) / (a - 1)
        d2 = math.log(np.sum(Q**a * mix ** (1 - a))) / (a - 1)
        assert rdp_bank.RDP_subsampled_pureDP({"eps": e, "prob": q}, a) >= max(d1, d2)


def test_dp_bank_exact_values() -> None:
    assert dp_bank.get_eps_ana_gaussian(1.0, 0) == math.inf
    assert dp_bank.get_eps_ana_gaussian(1.0, 1) == 0.0
    assert dp_bank.get_eps_ana_gaussian(2.0, 1e-5) == Gaussian(2.0).epsilon(1e-5)
    assert dp_bank.get_eps_gaussian(2.0, 1e-5) == Gaussian(2.0).epsilon(1e-5)
    assert dp_bank.get_eps_laplace(1.0, 1e-6) == pytest.approx(1 + 2 * math.log1p(-1e-6))
    assert dp_bank.get_eps_randresp(0.3, 1e-6) == RandomizedResponse(0.7).epsilon(1e-6)
    lg = dp_bank.get_logdelta_ana_gaussian(1.0, 1.0)
    exact = math.log(norm.cdf(-0.5) - math.e * norm.cdf(-1.5))
    assert lg == pytest.approx(exact, rel=1e-12) and lg >= exact
    assert dp_bank.get_eps_rdp(lambda a: a / 8, 1e-5) == pytest.approx(
        compose(Gaussian(2.0)).epsilon(1e-5, "rdp"), rel=1e-9
    )


def test_dp_bank_no_looser_than_autodp() -> None:
    ref = pytest.importorskip("autodp.dp_bank")
    for d in (1e-8, 1e-6, 1e-3, 0.3):
        assert dp_bank.get_eps_ana_gaussian(1.0, d) <= ref.get_eps_ana_gaussian(1.0, d) * (1 + 1e-9)
        assert dp_bank.get_eps_laplace(1.0, d) <= ref.get_eps_laplace(1.0, d) * (1 + 1e-9)
        assert dp_bank.get_eps_randresp(0.7, d) <= ref.get_eps_randresp(0.7, d) * (1 + 1e-9)
        assert dp_bank.get_eps_rdp(lambda a: a / 8, d) <= ref.get_eps_rdp(lambda a: a / 8, d)


def test_fdp_bank() -> None:
    fpr = np.linspace(0, 1, 11)
    np.testing.assert_allclose(
        fdp_bank.fDP_gaussian({"sigma": 1.3}, fpr),
        norm.cdf(norm.ppf(1 - fpr) - 1 / 1.3),
        atol=1e-15,
    )
    e, d = 0.5, 0.01
    exp = np.maximum(0, np.maximum(1 - d - np.exp(e) * fpr, np.exp(-e) * (1 - d - fpr)))
    np.testing.assert_allclose(fdp_bank.fDP_approx_DP({"eps": e, "delta": d}, fpr), exp)
    params = {"eps": e}
    fdp_bank.fDP_pure_DP(params, fpr)
    assert params == {"eps": e}  # not modified
    # derivative and logs of the Gaussian trade-off, against finite differences
    x = np.array([1e-6, 0.01, 0.3, 0.7])
    h = 1e-5 * x
    fd = (
        fdp_bank.fDP_gaussian({"sigma": 1.3}, x + h) - fdp_bank.fDP_gaussian({"sigma": 1.3}, x - h)
    ) / (2 * h)
    np.testing.assert_allclose(fdp_bank.fdp_grad_gaussian({"sigma": 1.3}, x), fd, rtol=1e-4)
    g, g2 = fdp_bank.log_neg_fdp_grad_gaussian({"sigma": 1.3}, np.log(x))
    np.testing.assert_allclose(np.exp(g), -fd, rtol=1e-4)
    np.testing.assert_allclose(
        np.exp(fdp_bank.log_one_minus_fdp_gaussian({"sigma": 1.3}, np.log(x))),
        1 - fdp_bank.fDP_gaussian({"sigma": 1.3}, x),
        rtol=1e-12,
    )


def test_ana_rdp_acct() -> None:
    f = lambda a: rdp_bank.RDP_gaussian({"sigma": 5.0}, a)  # noqa: E731
    acct = rdp_acct.anaRDPacct()
    assert acct.get_eps(1e-6) == 0.0
    acct.compose_poisson_subsampled_mechanisms(f, 0.01, coeff=1000)
    # an opaque RDP function is subsampled with the general bound: valid, never below
    # the Gaussian-specific (exact) RDP of the same mechanism
    m = compose(subsample(Gaussian(5.0), 0.01), steps=1000)
    assert acct.get_eps(1e-6) >= m.epsilon(1e-6, "rdp") * (1 - 1e-12)
    np.testing.assert_array_less(m.rdp([2.0, 8.0]) * (1 - 1e-9), acct.get_rdp([2.0, 8.0]))
    acct2 = rdp_acct.anaRDPacct()
    acct2.compose_mechanism(f, coeff=2.5)  # real coefficients scale the RDP
    assert acct2.get_eps(1e-6) == pytest.approx(
        Gaussian(5.0 / math.sqrt(2.5)).epsilon(1e-6, "rdp"), rel=1e-6
    )
    # a curve of the whole dataset (add/remove) with one of a subsample drawn without
    # replacement (replace-one): their total holds under neither relation, and an opaque
    # RDP curve has no replace-one reading, so it is refused
    with pytest.warns(UserWarning, match="rounded up"):
        acct2.compose_subsampled_mechanism(f, 0.1, coeff=2.5)
    with pytest.raises(UnsupportedMechanismError, match="no replace-one reading"):
        acct2.get_delta(1.0)
    acct3 = rdp_acct.anaRDPacct()
    with pytest.warns(UserWarning, match="rounded up"):
        acct3.compose_subsampled_mechanism(f, 0.1, coeff=2.5)
    assert math.isfinite(acct3.get_delta(1.0))


def test_new_zoo_classes() -> None:
    assert mechanism_zoo.NoisyGD_Mechanism(np.array([5.0, 3.0, 4.0])).get_approxDP(1e-6) == (
        pytest.approx(
            compose([Gaussian(5.0), Gaussian(3.0), Gaussian(4.0)]).epsilon(1e-6), rel=1e-12
        )
    )
    sgd = mechanism_zoo.NoisySGD_Mechanism(0.01, 1.0, 1000)
    assert sgd.get_approxDP(1e-6) == pytest.approx(
        compose(subsample(Gaussian(1.0), 0.01), steps=1000).epsilon(1e-6), rel=1e-12
    )
    wor = mechanism_zoo.NoisySGD_Mechanism(0.01, 1.0, 1000, PoissonSampling=False)
    assert wor.neighboring == "replace_one" and wor.get_approxDP(1e-6) > sgd.get_approxDP(1e-6)
    em = mechanism_zoo.ExponentialMechanism(1.0)
    assert em.get_approxDP(1e-6) == pytest.approx(PureDP(1.0).epsilon(1e-6), rel=1e-12)
    assert em.get_approxDP(0) == 1.0
    many = mechanism_zoo.ExponentialMechanism(0.05)
    from privlearn.compat.autodp.transformer_zoo import Composition

    c = Composition()([many], [2000])
    # the zCDP route (eps^2/8 per step) beats exact pure-DP composition here
    zcdp = 2000 * 0.05**2 / 8
    assert c.get_approxDP(1e-6) <= zcdp + 2 * math.sqrt(zcdp * math.log(1e6))
    dgm = mechanism_zoo.DiscreteGaussianMechanism(2.0)
    assert dgm.get_approxDP(1e-6) == pytest.approx(Gaussian(2.0).epsilon(1e-6, "rdp"), rel=1e-6)
    assert Laplace(1.0).epsilon(0) == 1.0
    with pytest.raises(AttributeError, match="not provided by privlearn's autodp facade"):
        _ = mechanism_zoo.NoSuchMechanism
