"""f-DP on the autodp facade: ``get_fDP`` / ``fDP`` / ``plot_fDP``.

Ground truth: closed-form trade-off functions (Dong, Roth & Su 2022): Gaussian
``G_mu(a) = Phi(Phi^-1(1 - a) - mu)`` (Def. 2.7), pure DP
``max(0, 1 - e^eps a, e^-eps (1 - a))`` (Prop. 2.5; Kairouz, Oh & Viswanath 2015) and
Laplace (their Appendix, the Neyman-Pearson test between Lap(0, b) and Lap(1, b)).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from privlearn.compat.autodp import mechanism_zoo, transformer_zoo

FPR = np.linspace(0.0, 1.0, 21)


def _gaussian_tradeoff(mu: float, a: np.ndarray) -> np.ndarray:
    return norm.cdf(norm.ppf(1.0 - a) - mu)


def _pure_tradeoff(eps: float, a: np.ndarray) -> np.ndarray:
    return np.maximum(0.0, np.maximum(1.0 - math.exp(eps) * a, math.exp(-eps) * (1.0 - a)))


def _laplace_tradeoff(mu: float, a: np.ndarray) -> np.ndarray:
    e = math.exp(-mu)
    small = 1.0 - a / e
    mid = e / (4.0 * np.maximum(a, 1e-300))
    large = e * (1.0 - a)
    return np.where(a < e / 2, small, np.where(a <= 0.5, mid, large))


@pytest.mark.parametrize("sigma", [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0])
def test_gaussian_fdp_is_closed_form(sigma: float) -> None:
    # autodp's unit_test_approxdp_to_fdp_conversion.py (it checks 4 decimal places)
    gm = mechanism_zoo.GaussianMechanism(sigma, name="GM2")
    got = np.array([gm.get_fDP(f) for f in FPR])
    np.testing.assert_allclose(got, _gaussian_tradeoff(1.0 / sigma, FPR), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gm.fDP(FPR), got, rtol=0, atol=0)  # vectorised


def test_composed_gaussian_fdp_is_closed_form() -> None:
    gm1 = mechanism_zoo.ExactGaussianMechanism(5.0)
    gm2 = mechanism_zoo.ExactGaussianMechanism(8.0)
    c = transformer_zoo.Composition()([gm1, gm2], [3, 5])
    mu = math.sqrt(3 / 25 + 5 / 64)
    fpr, fnr = c.plot_fDP()
    assert fpr.shape == (101,) and fnr.shape == (101,)
    np.testing.assert_allclose(fnr, _gaussian_tradeoff(mu, fpr), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("eps", [0.1, 0.3, 1.0, 3.0])
def test_pure_dp_fdp(eps: float) -> None:
    m = mechanism_zoo.PureDP_Mechanism(eps)
    a = np.linspace(0, 1, 401)
    got = m.fDP(a)
    exact = _pure_tradeoff(eps, a)
    assert np.all(got <= exact + 1e-12)  # never above the true curve
    np.testing.assert_allclose(got, exact, atol=1e-9)


def test_composed_pure_dp_fdp_valid_and_tight() -> None:
    # k-fold pure DP: the exact curve is the trade-off of the composed finite PLD;
    # every (eps, delta(eps)) pair of the exact profile bounds it, so the envelope from
    # the exact profile on a much finer grid is the reference
    from privlearn.accounting import PureDP, compose

    c = transformer_zoo.Composition()([mechanism_zoo.PureDP_Mechanism(0.3)], [8])
    a = np.linspace(0, 1, 201)
    got = c.fDP(a)
    m = compose(PureDP(0.3), steps=8)
    grid = np.linspace(0, 2.4, 4001)
    deltas = np.array([m.delta(float(e)) for e in grid])
    ref = np.maximum(
        0.0,
        np.max(
            np.maximum(
                (1 - deltas)[None, :] - np.exp(grid)[None, :] * a[:, None],
                ((1 - deltas)[None, :] - a[:, None]) * np.exp(-grid)[None, :],
            ),
            axis=1,
        ),
    )
    assert np.all(got <= ref + 1e-12)
    assert np.max(ref - got) < 5e-3


@pytest.mark.parametrize("b", [0.5, 1.0, 2.0])
def test_laplace_fdp_is_valid_lower_envelope(b: float) -> None:
    m = mechanism_zoo.LaplaceMechanism(b=b)
    a = np.linspace(0, 1, 401)
    got = m.fDP(a)
    exact = _laplace_tradeoff(1.0 / b, a)
    assert np.all(got <= exact + 1e-12)
    assert np.max(exact - got) < 2e-3


def test_subsampled_gaussian_fdp_properties() -> None:
    s = transformer_zoo.AmplificationBySampling()(mechanism_zoo.GaussianMechanism(1.0), 0.01)
    c = transformer_zoo.Composition()([s], [1000])
    fpr, fnr = c.plot_fDP(length=51)
    assert fnr[0] == pytest.approx(1.0, abs=1e-9) and fnr[-1] == 0.0
    assert np.all(np.diff(fnr) <= 1e-12)  # non-increasing
    assert np.all(fnr <= 1 - fpr + 1e-12)  # a trade-off function is below 1 - a
    # validity: the curve implied by each certified (eps, delta) point is below it
    for d in (1e-5, 1e-3):
        e = c.approxDP(d)
        implied = np.maximum(0, np.maximum(1 - d - math.exp(e) * fpr, (1 - d - fpr) / math.exp(e)))
        assert np.all(fnr >= implied - 1e-12)


def test_no_privacy_loss_and_bad_fpr() -> None:
    m = transformer_zoo.Composition()([mechanism_zoo.GaussianMechanism(1.0)], [0])
    np.testing.assert_allclose(m.fDP(FPR), 1 - FPR)
    with pytest.raises(ValueError, match="fpr must be in"):
        mechanism_zoo.GaussianMechanism(1.0).get_fDP(1.5)


def test_rdp_only_mechanism_fdp() -> None:
    z = mechanism_zoo.zCDP_Mechanism(rho=0.5)
    f = z.fDP(FPR)
    assert np.all(f <= 1 - FPR + 1e-12) and f[0] == pytest.approx(1.0, abs=1e-6)
    # rho-zCDP implies (rho + 2 sqrt(rho log(1/delta)), delta)-DP; the curve respects it
    # (our profile is at least as tight)
    e = 0.5 + 2 * math.sqrt(0.5 * math.log(1e4))
    implied = np.maximum(0, 1 - 1e-4 - math.exp(e) * FPR)
    assert np.all(f >= implied - 1e-12)
