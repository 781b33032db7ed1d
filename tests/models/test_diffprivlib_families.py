"""diffprivlib's own test suite (IBM/differential-privacy-library, ``tests/``), ported
onto privlearn's public API where privlearn has the capability.

diffprivlib checks each mechanism's noise against its closed form
(``tests/mechanisms/test_Gaussian*.py``, ``test_Laplace.py``: the sample variance of many
draws), its quantile tool at a large epsilon against NumPy (``tests/tools/
test_quantile.py``: ``test_large_epsilon``, ``test_clipped_output``), and its
``BudgetAccountant`` totals (``tests/test_BudgetAccountant.py``). Here:

* every estimator's noise, isolated on data whose exact statistic is known, has the
  standard deviation that the closed form of its calibrated mechanism gives, and the
  calibration meets the target on the safe side by the analytic Gaussian curve
  (Balle & Wang 2018, Theorem 8), computed here with SciPy, not by privlearn;
* the exponential-mechanism quantile draws its candidates with the probabilities of
  McSherry & Talwar (2007), counted naively here;
* pure-DP releases composed on privlearn's ledger total what diffprivlib's
  ``BudgetAccountant`` totals (basic composition is tight for pure DP).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
import warnings

import numpy as np
import pytest
from scipy.stats import chi2, norm

from privlearn.models import (
    PATE,
    DPSGDClassifier,
    NoisyGDRegressor,
    PrivateKNN,
    PrivateStandardScaler,
    SSPRegressor,
)
from privlearn.models.preprocessing import private_quantile

EPS, DELTA = 1.0, 1e-6


def _diffprivlib_accountant():
    """diffprivlib's BudgetAccountant, loaded without its package ``__init__`` (which
    imports its models, broken on scikit-learn >= 1.8); the accountant needs NumPy only."""
    try:
        return importlib.import_module("diffprivlib.accountant").BudgetAccountant
    except ImportError:
        pass
    spec = importlib.util.find_spec("diffprivlib")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("diffprivlib is not installed (pip install privlearn[peers])")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "diffprivlib"}
    for k in saved:
        del sys.modules[k]
    pkg = types.ModuleType("diffprivlib")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["diffprivlib"] = pkg
    try:
        return importlib.import_module("diffprivlib.accountant").BudgetAccountant
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == "diffprivlib"]:
            del sys.modules[k]
        sys.modules.update(saved)


def _gaussian_delta(mu: float, eps: float) -> float:
    """delta(eps) of the Gaussian mechanism with sensitivity / std = mu (Balle & Wang
    2018, Theorem 8)."""
    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))


def _assert_calibrated(mu_of, s: float) -> None:
    """``s`` meets (EPS, DELTA) and 0.1% less noise would not: the smallest scale."""
    assert _gaussian_delta(mu_of(s), EPS) <= DELTA
    assert _gaussian_delta(mu_of(0.999 * s), EPS) > DELTA


def _assert_std(samples: np.ndarray, expected: float) -> None:
    """The sample standard deviation is ``expected`` within 4 standard errors (the
    standard error of a normal sample's std is about std / sqrt(2 n))."""
    n = samples.size
    assert abs(samples.std() / expected - 1.0) < 4.0 / math.sqrt(2 * n)


def test_ssp_noise_on_x_t_y_is_the_calibrated_gaussian():
    """SSP releases X^T y + x_bound Y sigma_2 N(0, I) with sigma_2 = 3 s (the notebook's
    split (2, 3)); with one feature equal to x_bound on n rows and y = 0, coef =
    noise / (n x_bound^2 + noise on X^T X), i.e. Y sigma_2 z / (n x_bound) up to 1e-3."""
    n, xb, Y = 20000, 2.0, 3.0
    X, y = np.full((n, 1), xb), np.zeros(n)
    est = SSPRegressor(
        epsilon=EPS,
        delta=DELTA,
        x_bound=xb,
        y_bound=Y,
        fit_intercept=False,
        project_psd=False,
        random_state=0,
    )
    coef, _ = est.sample_coefficients(X, y, 4000)
    s = est.calibrated_noise_scale()
    _assert_calibrated(lambda t: math.hypot(1 / (2 * t), 1 / (3 * t)), s)
    _assert_std(coef.ravel(), Y * 3 * s / (n * xb))
    # an interval y_bound without an intercept: the sensitivity uses max(|lo|, |hi|)
    est.set_params(y_bound=(-1.0, 5.0))
    coef, _ = est.sample_coefficients(X, y, 4000)
    _assert_std(coef.ravel(), 5.0 * 3 * s / (n * xb))


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_dpsgd_one_step_noise_is_the_clipped_sum_s_calibrated_noise(noise):
    """On rows of zeros every clipped gradient is 0: one full-batch step from 0 is
    theta = -lr (sigma C z) / n, z standard normal (or Laplace of scale 1, std sqrt 2)."""
    n, d, C, lr = 10, 3000, 0.7, 0.3
    y = np.r_[np.zeros(5), np.ones(5)]
    delta = DELTA if noise == "gaussian" else 0.0
    clf = DPSGDClassifier(
        epsilon=EPS,
        delta=delta,
        noise=noise,
        n_iter=1,
        learning_rate=lr,
        max_grad_norm=C,
        fit_intercept=False,
        l2_regularization=0.0,
        classes=[0, 1],
        random_state=1,
    ).fit(np.zeros((n, d)), y)
    s = clf.noise_multiplier_
    if noise == "gaussian":
        _assert_calibrated(lambda t: 1 / t, s)
        _assert_std(clf.coef_, lr * C * s / n)
    else:
        assert s == pytest.approx(1 / EPS, rel=1e-5) and s >= 1 / EPS  # Laplace: b = 1 / eps
        # Laplace's sample std converges more slowly (kurtosis 6): 5 standard errors
        assert abs(clf.coef_.std() / (math.sqrt(2) * lr * C * s / n) - 1) < 5 * math.sqrt(
            7 / (4 * d)
        )


def test_noisygd_one_step_noise_is_x_bound_y_bound_sigma():
    """From theta_0 = 0 on rows of zeros, GS_0 = x_bound Y and theta_1 = -lr GS_0 sigma z."""
    n, d, xb, Y, lr = 10, 3000, 1.5, 2.0, 0.1
    est = NoisyGDRegressor(
        epsilon=EPS,
        delta=DELTA,
        x_bound=xb,
        y_bound=Y,
        fit_intercept=False,
        n_iter=1,
        noise_multiplier=None,
        learning_rate=lr,
        random_state=0,
    ).fit(np.zeros((n, d)), np.ones(n))
    s = est.noise_multiplier_
    _assert_calibrated(lambda t: 1 / t, s)
    _assert_std(est.coef_, lr * xb * Y * s)


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_pate_vote_noise_is_sqrt2_sigma_or_2b(noise):
    """One teacher moves the histogram by sqrt(2) (L2) / 2 (L1): the noise's std is
    sqrt(2) sigma (Gaussian) or sqrt(2) 2 b (Laplace of scale 2 b)."""
    m = 3000
    teachers = np.zeros((20, m), dtype=int)
    pate = PATE(
        epsilon=5.0, delta=DELTA if noise == "gaussian" else 0.0, noise=noise, random_state=0
    )
    pate.release(teachers, n_classes=2)
    err = (pate.noisy_votes_ - np.array([20.0, 0.0])).ravel()
    s = pate.noise_multiplier_
    if noise == "gaussian":
        _assert_std(err, math.sqrt(2) * s)
    else:
        assert s >= m / 5.0 and s == pytest.approx(m / 5.0, rel=1e-5)  # m queries, pure
        assert abs(err.std() / (2 * math.sqrt(2) * s) - 1) < 5 * math.sqrt(7 / (4 * err.size))


def test_knn_vote_noise_at_full_sampling_is_sqrt2_sigma():
    rng = np.random.default_rng(0)
    knn = PrivateKNN(
        n_neighbors=10, sampling_rate=1.0, epsilon=5.0, delta=DELTA, classes=[0, 1], random_state=0
    )
    knn.fit(rng.normal(size=(100, 2)), np.zeros(100, dtype=int))
    knn.release(rng.normal(size=(3000, 2)))
    err = (knn.noisy_votes_ - np.array([10.0, 0.0])).ravel()  # every neighbour votes 0
    _assert_std(err, math.sqrt(2) * knn.noise_multiplier_)


def test_scaler_mean_noise_with_public_bounds_is_the_moment_release_s():
    """Public bounds [1, 5] (c = 3, r = 2) and every value 3: u = 0, so mean_ - 3 =
    r (noise / N) with the moment release's noise of std s sqrt(2 d + 1), N the noisy
    count (the same noise's last coordinate)."""
    n, d = 20_000, 300
    sc = PrivateStandardScaler(
        epsilon=EPS, delta=DELTA, feature_range=(1.0, 5.0), quantile=None, random_state=0
    ).fit(np.full((n, d), 3.0))
    s = sc.noise_multiplier_
    _assert_calibrated(lambda t: 1 / t, s)
    assert abs(sc.n_samples_seen_ - n) < 6 * s * math.sqrt(2 * d + 1)
    _assert_std(sc.mean_ - 3.0, 2.0 * s * math.sqrt(2 * d + 1) / sc.n_samples_seen_)


def test_private_quantile_draws_candidates_with_the_exponential_mechanism_s_law():
    """Candidate t is drawn with probability proportional to exp(eps u(t) / 2), u(t) =
    -|#{v <= t} - q n| (McSherry & Talwar 2007, Theorem 6): a chi-square test of 6000
    draws against the law computed naively."""
    values = np.array([0.5, 1.5, 1.7, 2.2, 3.9, 3.95])
    q, eps, lo, hi, k = 0.5, 1.0, 0.0, 4.0, 5
    grid = np.linspace(lo, hi, k)
    u = np.array([-abs(sum(v <= t for v in values) - q * len(values)) for t in grid])
    p = np.exp(eps * u / 2)
    p /= p.sum()
    rng = np.random.default_rng(5)
    draws = [
        private_quantile(values, q, eps, lo, hi, n_candidates=k, random_state=rng)[0]
        for _ in range(6000)
    ]
    counts = np.array([np.sum(np.isclose(draws, t)) for t in grid])
    assert counts.sum() == 6000
    stat = float(np.sum((counts - 6000 * p) ** 2 / (6000 * p)))
    assert stat < chi2.ppf(0.999, k - 1)


@pytest.mark.parametrize("q", [0.1, 0.5, 0.9])
def test_private_quantile_at_a_large_epsilon_is_numpy_s_to_the_grid(q):
    """diffprivlib's test_large_epsilon: at epsilon = 1e5 the release is a candidate of
    the largest utility, -|#{v <= t} - q n| (counted naively), so NumPy's quantile lies
    between the order statistics around it; always inside the public range
    (test_clipped_output); and its mechanism, PureDP(1e5), is accounted (its
    randomized-response pair underflowed above epsilon 745 and was refused)."""
    values = np.random.default_rng(1).uniform(0.0, 10.0, 1000)
    got, mech = private_quantile(values, q, 1e5, 0.0, 10.0, random_state=0)
    grid = np.linspace(0.0, 10.0, 1024)
    utility = -np.abs((values[:, None] <= grid).sum(0) - q * values.size)
    assert -abs(np.sum(values <= got) - q * values.size) == utility.max()
    v = np.sort(values)
    k = int(q * values.size)
    assert v[k - 2] <= got <= v[k + 1] and v[k - 2] <= np.quantile(values, q) <= v[k + 1]
    assert mech.epsilon(0.0) == 1e5 and mech.epsilon(1e-6) <= 1e5
    # every value above the range counts at its upper end: for q > 1/2 that end is the
    # one candidate of the largest utility (for q = 1/2 every candidate ties)
    clipped, _ = private_quantile(values + 100.0, 0.9, 1e5, 0.0, 10.0, random_state=0)
    assert clipped == 10.0


def test_pure_releases_on_the_ledger_total_what_diffprivlib_s_accountant_totals(tmp_path):
    """Several private quantiles (each PureDP(eps_i)) spent on one ledger budget: the
    total at delta = 0 is the sum of the epsilons, as diffprivlib's BudgetAccountant
    (tests/test_BudgetAccountant.py) totals sequential pure-DP spends."""
    from privlearn.ledger import Ledger

    values = np.random.default_rng(2).uniform(0.0, 1.0, 100)
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=5.0, delta=0.0)
    BudgetAccountant = _diffprivlib_accountant()
    acc = BudgetAccountant()
    for i, e in enumerate([0.1, 0.25, 0.5, 1.0]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, mech = private_quantile(values, 0.5, e, 0.0, 1.0, random_state=i)
        led.spend("d", mech, label=f"quantile {i}")
        acc.spend(e, 0.0)
    assert led.spent("d").epsilon_spent == pytest.approx(acc.total()[0], rel=1e-9)
    assert led.spent("d").epsilon_spent >= acc.total()[0] * (1 - 1e-12)
