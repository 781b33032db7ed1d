"""Random stopping's privacy: its accounted curve against Papernot & Steinke (2022),
Theorem 2, computed here from the paper's formula and the base runs' closed-form RDP
curves (Gaussian: Mironov 2017, Prop. 7; Laplace: Mironov 2017, Prop. 6); the number of
runs ``K`` against the truncated negative binomial's probability mass function; and
``K`` staying hidden (the theorem's premise) from everything the search releases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats
from sklearn.base import RegressorMixin

from privlearn.accounting import ApproxDP, Gaussian
from privlearn.errors import UnsupportedMechanismError
from privlearn.models import PrivateEstimator, ReleasePlan
from privlearn.models.base import make_rng
from privlearn.models.constraints import LEDGER, RANDOM_STATE, Real
from privlearn.models.model_selection import PrivateSearchCV, _sample_runs
from privlearn.models.preprocessing import PrivatePipeline


class NoisyMeanRegressor(RegressorMixin, PrivateEstimator):
    """Predicts a Gaussian-noised mean of ``y`` clipped to ``[-1, 1]``: one Gaussian
    release of (sum, count) with L2 sensitivity ``sqrt(2)`` and noise
    ``N(0, 2 noise_multiplier^2)``, i.e. ``Gaussian(noise_multiplier)``."""

    _parameter_constraints = {
        "noise_multiplier": Real(0, None, low_open=True),
        "random_state": RANDOM_STATE,
        "ledger": LEDGER,
    }

    def __init__(self, noise_multiplier=1.0, random_state=None, ledger=None):
        self.noise_multiplier = noise_multiplier
        self.random_state = random_state
        self.ledger = ledger

    def _plan(self, params, X, y):
        return ReleasePlan(mechanism=Gaussian(params["noise_multiplier"]), delta=1e-6)

    def _release(self, X, y, plan):
        v = np.clip(np.asarray(y, dtype=float), -1.0, 1.0)
        noisy = np.array([v.sum(), v.size]) + make_rng(self.random_state).normal(
            scale=math.sqrt(2.0) * self.noise_multiplier, size=2)
        return {"mean_": float(noisy[0] / max(noisy[1], 1.0))}

    def fit(self, X, y):
        return self._fit(X, y)

    def predict(self, X):
        return np.full(len(X), self.mean_)


def gaussian_rdp(a, sigma):
    return a / (2.0 * sigma**2)


def laplace_rdp(a, b):
    """Laplace mechanism of scale ``b`` (sensitivity 1), Mironov (2017), Prop. 6."""
    a = np.asarray(a, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.logaddexp(np.log(a / (2 * a - 1)) + (a - 1) / b,
                         np.log((a - 1) / (2 * a - 1)) - a / b) / (a - 1)
    return np.where(a > 1.0, v, 0.0)  # only used at order 1 with weight 1 - 1/1 = 0


def expected_runs(eta, gamma):
    """E[K] for K ~ D_{eta, gamma} (Papernot & Steinke 2022, Section 2), by summing the
    probability mass function (no closed form used)."""
    k = np.arange(1, 200_000)
    logp = k * math.log1p(-gamma) + np.cumsum(np.log((k - 1 + eta) / k)) if eta > 0 else \
        k * math.log1p(-gamma) - np.log(k)
    p = np.exp(logp - logp.max())
    return float((k * p).sum() / p.sum())


def gamma_for(ek, eta):
    return optimize.brentq(lambda g: expected_runs(eta, g) - ek, 1e-4, 1 - 1e-9, xtol=1e-14)


LAM_HAT = np.concatenate([[1.0], 1.0 + np.geomspace(1e-6, 1e5, 20_000)])
LAM = np.concatenate([1.0 + np.geomspace(1e-3, 1.0, 200)[:-1], np.geomspace(2.0, 1e6, 3000)])


def theorem_2(base, eta, gamma, ek):
    """``lambda -> eps'(lambda)``: Theorem 2 minimised over ``lambda_hat`` in
    ``[1, inf)`` (dense grid), then the envelope ``min_{lambda' >= lambda}`` (Renyi
    divergence is non-decreasing in the order). A lower reference for any valid use of
    the theorem."""
    c = np.min((1 + eta) * ((1 - 1 / LAM_HAT) * base(LAM_HAT) + math.log(1 / gamma) / LAM_HAT))
    values = base(LAM) + c + math.log(ek) / (LAM - 1)
    envelope = np.minimum.accumulate(values[::-1])[::-1]
    return (lambda lam: float(np.interp(lam, LAM, envelope))), (
        lambda lam: float(base(np.array([lam]))[0] + c + math.log(ek) / (lam - 1)))


def cks_epsilon(curve_values, delta):
    """Canonne, Kamath & Steinke (2020), Prop. 12, minimised over the dense grid."""
    a = LAM
    return float(np.min(curve_values + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)))


@pytest.mark.parametrize("eta, ek, sigmas, score_eps", [
    (1.0, 5.0, (2.0,), 0.5),        # geometric (Liu & Talwar's stopping rule)
    (0.0, 4.0, (1.0, 3.0), 0.2),    # logarithmic distribution
    (0.5, 10.0, (4.0, 1.5), 1.0),
    (3.0, 20.0, (3.0,), 0.1),
])
def test_random_stopping_is_never_below_theorem_2(eta, ek, sigmas, score_eps):
    X = np.zeros((500, 1))
    y = np.random.default_rng(0).uniform(-1, 1, 500)
    s = PrivateSearchCV(NoisyMeanRegressor(), {"noise_multiplier": list(sigmas)}, eta=eta,
                        expected_runs=ek, score_epsilon=score_eps, loss_bound=4.0,
                        delta=1e-6, random_state=0).fit(X, y)

    # each run: a candidate's Gaussian fit and the Laplace score (scale 1/score_eps);
    # a uniformly random candidate is bounded by the worst one (quasi-convexity)
    def base(a):
        return gaussian_rdp(a, min(sigmas)) + 2 * laplace_rdp(a, 2.0 / score_eps)

    gamma = gamma_for(ek, eta)
    envelope, at = theorem_2(base, eta, gamma, ek)
    for lam in (1.05, 1.5, 2.0, 4.0, 16.0, 64.0, 300.0):
        got = float(s.mechanism_.rdp(lam))
        assert got >= envelope(lam) * (1 - 1e-9), (lam, got, envelope(lam))
        # and not wastefully loose (between the tabulated orders, the next one's value)
        assert got <= at(lam) * (1.02 if lam <= 256 else 1.1) + 1e-9, (lam, got, at(lam))
    reference = cks_epsilon(np.array([envelope(a) for a in LAM]), 1e-6)
    assert s.epsilon_ >= reference * (1 - 1e-9)
    assert s.epsilon_ <= reference * 1.05


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")  # losses above the bound
def test_geometric_stopping_of_pure_dp_runs_is_within_liu_talwar():
    """Nearly pure epsilon-DP runs (the Laplace score releases, and a fit of negligible
    Gaussian cost): Liu & Talwar (2019) show geometric random stopping of epsilon-DP runs
    is 3 epsilon-DP; Theorem 2 with eta = 1 at large orders recovers it, so the accounted
    curve there is about 3 epsilon."""
    X = np.zeros((500, 1))
    y = np.random.default_rng(0).uniform(-1, 1, 500)
    eps = 0.3
    s = PrivateSearchCV(NoisyMeanRegressor(), {"noise_multiplier": [1e4]}, eta=1.0,
                        expected_runs=10.0, score_epsilon=eps, loss_bound=4.0,
                        random_state=0).fit(X, y)
    big = 5e4
    assert 2.9 * eps <= float(s.mechanism_.rdp(big)) <= 3 * eps + 0.01


@pytest.mark.parametrize("eta, gamma", [(0.0, 0.2), (1e-9, 0.1), (0.5, 0.1), (1.0, 0.25),
                                        (3.0, 0.3)])
def test_number_of_runs_follows_the_truncated_negative_binomial(eta, gamma):
    """``P[K = k] proportional to (1 - gamma)^k prod_{l<k} (l + eta) / (l + 1)``,
    ``k >= 1`` (Papernot & Steinke 2022, Definition 1), by a chi-square test."""
    rng = np.random.default_rng(12345)
    n = 20_000
    ks = np.array([_sample_runs(eta, gamma, rng) for _ in range(n)])
    kmax = 40
    k = np.arange(1, 100_000)
    w = (k * math.log1p(-gamma) + np.cumsum(np.log((k - 1 + eta) / k)) if eta > 0
         else k * math.log1p(-gamma) - np.log(k))
    p = np.exp(w - w.max())
    p /= p.sum()
    expected = np.append(p[: kmax - 1], p[kmax - 1:].sum()) * n
    observed = np.append(np.bincount(np.minimum(ks, kmax), minlength=kmax + 1)[1:kmax], 0)
    observed[-1] = n - observed[:-1].sum()
    keep = expected >= 5
    obs, exp = observed[keep], expected[keep]
    if (~keep).any():
        obs, exp = np.append(obs, observed[~keep].sum()), np.append(exp, expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-4


RUNS: list[int] = []


class CountingMean(NoisyMeanRegressor):
    def fit(self, X, y):
        RUNS.append(1)
        return super().fit(X, y)


def _draws_between(before: np.random.Generator, after: np.random.Generator) -> int:
    """How many 64-bit outputs ``before`` must produce to reach ``after``'s state."""
    target = after.bit_generator.state["state"]
    bg = before.bit_generator
    for d in range(20_000):
        if bg.state["state"] == target:
            return d
        bg.random_raw()
    raise AssertionError("not reached")


def test_a_generator_random_state_does_not_reveal_the_number_of_runs():
    """A Generator passed as ``random_state`` stays on the search (``get_params``, the
    pickle): how far it advanced, and how many child streams it spawned, must not depend
    on ``K``."""
    X = np.zeros((200, 1))
    y = np.random.default_rng(0).uniform(-1, 1, 200)
    ks, footprints = set(), set()
    for seed in range(8):
        RUNS.clear()
        g = np.random.default_rng(seed)
        s = PrivateSearchCV(CountingMean(), {"noise_multiplier": [1.0, 2.0]}, eta=1.0,
                            expected_runs=6.0, loss_bound=4.0, random_state=g).fit(X, y)
        assert s.random_state is g
        ks.add(len(RUNS))
        footprints.add((_draws_between(np.random.default_rng(seed), g),
                        g.bit_generator.seed_seq.n_children_spawned))
    assert len(ks) > 1  # K varied ...
    assert len(footprints) == 1  # ... and the released generator does not show it


class ZeroRegressor(NoisyMeanRegressor):
    """Declares a (negligible) Gaussian fit and always predicts 0."""

    def predict(self, X):
        return np.zeros(len(X))


def test_the_released_score_does_not_reveal_the_number_of_rows():
    """The number of rows differs between add/remove neighbours (docs/trust-model.md), so
    a score divided by the exact ``n`` is not covered by the score's epsilon. Labels 0,
    predictions 0: every clipped loss is 0 on one row and on three rows, two datasets at
    distance 2, so every released score obeys ``P_1[E] <= e^{2 score_epsilon} P_3[E]``
    (group privacy). ``E = {score < -2}``; a score ``-Z / n`` with ``Z ~ Laplace(1)``
    gives ``P_1[E] / P_3[E] = e^4``. Many independent scores per fit: every candidate of
    a composition search is one."""
    m = 3000

    def tail(n):
        s = PrivateSearchCV(ZeroRegressor(), {"noise_multiplier": [1e4] * m},
                            method="composition", accountant="rdp", loss_bound=1.0,
                            score_epsilon=1.0, random_state=n).fit(np.zeros((n, 1)),
                                                                    np.zeros(n))
        return int(np.sum(np.asarray(s.scores_) < -2.0))

    k1, k3 = tail(1), tail(3)
    lower_1 = stats.beta.ppf(1e-6, k1, m - k1 + 1) if k1 else 0.0  # Clopper-Pearson
    upper_3 = stats.beta.ppf(1 - 1e-6, k3 + 1, m - k3)
    assert lower_1 <= math.exp(2.0) * upper_3, (k1, k3)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_one_expected_run_costs_at_least_the_run(eta):
    """``expected_runs=1``: ``K = 1``, so the release is one run (a Gaussian fit and the
    two Laplace score releases) and its RDP curve is at least that run's, at every
    order (``log E[K] >= 0`` since ``K >= 1``)."""
    X = np.zeros((100, 1))
    y = np.random.default_rng(0).uniform(-1, 1, 100)
    s = PrivateSearchCV(NoisyMeanRegressor(), {"noise_multiplier": [2.0]}, eta=eta,
                        expected_runs=1.0, score_epsilon=0.5, loss_bound=4.0,
                        random_state=0).fit(X, y)
    for lam in (1.01, 1.1, 1.5, 2.0, 8.0):
        run = gaussian_rdp(lam, 2.0) + 2 * float(laplace_rdp(np.array([lam]), 4.0)[0])
        assert float(s.mechanism_.rdp(lam)) >= run * (1 - 1e-12), lam


class NaNOnOutlierRegressor(NoisyMeanRegressor):
    """Predicts NaN on rows with ``X[:, 0] > 0`` (a model that fails on some inputs)."""

    def predict(self, X):
        return np.where(np.asarray(X)[:, 0] > 0, np.nan, 0.0)


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")  # the point
def test_a_non_finite_prediction_is_clipped_like_any_loss():
    """A NaN loss on one row would make the noisy score NaN whatever the noise: whether
    the data holds such a row would be released exactly. The clipped loss of every row is
    in ``[0, loss_bound]``, NaN included (counted as ``loss_bound``)."""
    X = np.zeros((300, 1))
    X[0, 0] = 1.0  # the one row the model fails on
    y = np.zeros(300)
    s = PrivateSearchCV(NaNOnOutlierRegressor(), {"noise_multiplier": [1.0, 2.0]},
                        method="composition", loss_bound=4.0, random_state=0).fit(X, y)
    assert np.all(np.isfinite(s.scores_)) and math.isfinite(s.best_score_)


class ApproxDPRegressor(NoisyMeanRegressor):
    """Declares an (epsilon, delta) guarantee only (no RDP curve)."""

    def _plan(self, params, X, y):
        return ReleasePlan(mechanism=ApproxDP(1.0, 1e-7), delta=1e-6)


def test_random_stopping_over_runs_without_an_rdp_curve_is_refused_before_any_fit():
    RUNS.clear()

    class Counting(ApproxDPRegressor):
        def fit(self, X, y):
            RUNS.append(1)
            return super().fit(X, y)

    X, y = np.zeros((50, 1)), np.zeros(50)
    with pytest.raises(UnsupportedMechanismError, match="method='composition'"):
        PrivateSearchCV(Counting(), {"noise_multiplier": [1.0]}, loss_bound=1.0).fit(X, y)
    assert RUNS == []
    s = PrivateSearchCV(Counting(), {"noise_multiplier": [1.0]}, method="composition",
                        loss_bound=1.0).fit(X, y)
    assert math.isfinite(s.epsilon_)


def test_estimators_in_the_grid_are_not_fitted_in_place():
    """A grid over steps holds estimator objects, and ``param_grid`` stays on the search
    (``get_params``, the pickle): each run must fit a copy, or the grid would carry the
    models of the runs that were not selected (and reveal ``K``)."""
    X = np.zeros((200, 1))
    y = np.random.default_rng(0).uniform(-1, 1, 200)
    models = [NoisyMeanRegressor(noise_multiplier=1.0), NoisyMeanRegressor(noise_multiplier=3.0)]
    pipe = PrivatePipeline([("scale", "passthrough"), ("model", NoisyMeanRegressor())])
    for method in ("random_stopping", "composition"):
        runs = {"expected_runs": 5.0} if method == "random_stopping" else {}
        s = PrivateSearchCV(pipe, {"model": models}, method=method, loss_bound=4.0,
                            random_state=0, **runs).fit(X, y)
        for m in s.param_grid["model"]:
            assert not hasattr(m, "mean_") and not hasattr(m, "mechanism_")
        assert all(s.best_estimator_.named_steps["model"] is not m for m in models)
        assert s.best_estimator_.named_steps["model"].mechanism_ in {
            Gaussian(1.0), Gaussian(3.0)}


def test_a_grid_setting_an_estimator_and_its_parameter_plans_each_candidate():
    """``{"model": [est], "model__noise_multiplier": [1, 3]}`` (the scikit-learn way to
    search a replaced step's parameter): each candidate is the step set to a copy of
    ``est`` with its own value. Planning must not write the value into the grid's shared
    object, which would leave every candidate's plan with the last value (the runs then
    refused as not running their planned mechanism) and the grid changed."""
    X = np.zeros((200, 1))
    y = np.random.default_rng(0).uniform(-1, 1, 200)
    model = NoisyMeanRegressor(noise_multiplier=2.0)
    pipe = PrivatePipeline([("scale", "passthrough"), ("model", NoisyMeanRegressor())])
    grid = {"model": [model], "model__noise_multiplier": [1.0, 3.0]}
    s = PrivateSearchCV(pipe, grid, method="composition", loss_bound=4.0,
                        random_state=0).fit(X, y)
    assert [m.epsilon(1e-5) for m in s.fit_mechanisms_] == pytest.approx(
        [Gaussian(1.0).epsilon(1e-5), Gaussian(3.0).epsilon(1e-5)])
    assert model.noise_multiplier == 2.0           # the grid's object is left as given


def test_the_score_noise_has_the_accounted_scale():
    """Zero losses on ``n`` rows: a run's score is ``-Z / (n + Z')`` with ``Z`` the
    clipped-loss sum's Laplace noise, accounted as ``Laplace(2 / score_epsilon)`` of a
    sensitivity-``loss_bound`` sum (scale ``2 loss_bound / score_epsilon``); the released
    negative scores times ``n`` are ``Z | Z > 0`` (up to ``Z' / n``), exponential with
    that mean."""
    n, m, lb, eps = 20_000, 600, 3.0, 1.5
    s = PrivateSearchCV(ZeroRegressor(), {"noise_multiplier": [1e4] * m},
                        method="composition", accountant="rdp", loss_bound=lb,
                        score_epsilon=eps, random_state=3).fit(np.zeros((n, 1)), np.zeros(n))
    z = -np.asarray(s.scores_)[np.asarray(s.scores_) < 0] * n
    scale = 2 * lb / eps
    assert abs(z.mean() - scale) < 4 * scale / math.sqrt(z.size)
