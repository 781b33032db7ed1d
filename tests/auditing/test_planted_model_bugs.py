"""audit_estimator(..., inject_bug=BUG): a known privacy bug planted in the NumPy
estimators' fits (privlearn.auditing._planted_models) while their epsilon_ stays that of
the intended configuration. An honest audit stays below the claim; each planted bug is
caught (the lower bound exceeds the claim) at the fixed seed below, with margin (checked
at seeds 0, 1 and 2 while writing these tests; the smallest bound over them is at least
0.3 above the claim)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _audit_helpers import unit_ball_regression

pytest.importorskip("sklearn")

from privlearn.auditing._planted_models import MODEL_BUGS, planted_model_bug  # noqa: E402
from privlearn.auditing.models import audit_estimator  # noqa: E402
from privlearn.errors import (  # noqa: E402
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
)
from privlearn.models import (  # noqa: E402
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    SSPRegressor,
)

SEED = 1
X, Y = unit_ball_regression(100, [0.5, -0.3, 0.2])
Y_BINARY = (X @ np.array([1.0, -1.0, 0.5]) > 0).astype(int)
Y_THREE = np.argmax(X @ np.random.default_rng(1).normal(size=(3, 3)), axis=1)

# full-batch DP-SGD: every canary is in every step (the Poisson sampling is rate-x10's)
_SGD = dict(
    epsilon=1.0, delta=1e-5, n_iter=20, sampling_rate=1.0, learning_rate=0.5, trajectory_points=1
)
# Poisson-sampled DP-SGD at a given noise: one accounting of the subsampled run
_SAMPLED = dict(
    epsilon=10.0,
    delta=1e-5,
    n_iter=50,
    sampling_rate=0.1,
    learning_rate=0.5,
    trajectory_points=1,
    noise_multiplier=2.0,
)

ESTIMATORS = {
    "ssp": (lambda: SSPRegressor(epsilon=1.0, delta=1e-5), Y),
    "adassp": (lambda: AdaSSPRegressor(epsilon=1.0, delta=1e-5), Y),
    "noisygd": (
        lambda: NoisyGDRegressor(epsilon=1.0, delta=1e-5, noise_multiplier=None, n_iter=20),
        Y,
    ),
    "dpsgd-binary": (lambda: DPSGDClassifier(classes=[0, 1], **_SGD), Y_BINARY),
    "dpsgd-multinomial": (lambda: DPSGDClassifier(classes=[0, 1, 2], **_SGD), Y_THREE),
    "dpsgd-regressor": (lambda: DPSGDRegressor(**_SGD), Y),
}
SAMPLED = {
    "dpsgd-binary": (lambda: DPSGDClassifier(classes=[0, 1], **_SAMPLED), Y_BINARY),
    "dpsgd-multinomial": (lambda: DPSGDClassifier(classes=[0, 1, 2], **_SAMPLED), Y_THREE),
    "dpsgd-regressor": (lambda: DPSGDRegressor(**_SAMPLED), Y),
}


def _audit(make, y, n_canaries: int, bug: str, seed: int = SEED):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clipped canaries, a small audit's warnings
        return audit_estimator(make(), X, y, n_canaries, seed=seed, inject_bug=bug)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_an_honest_audit_stays_below_the_claim_and_no_noise_is_caught(name):
    make, y = ESTIMATORS[name]
    honest = _audit(make, y, 200, "none")
    assert 0.0 <= honest.epsilon_lower_bound <= honest.claimed_epsilon
    assert not honest.violation
    planted = _audit(make, y, 200, "no-noise")
    # the accountant still reports the intended fit's epsilon
    assert planted.claimed_epsilon == pytest.approx(honest.claimed_epsilon, rel=1e-9)
    assert planted.epsilon_lower_bound > 2.5 * planted.claimed_epsilon
    assert planted.violation


# 1,000 canaries: the noise shrunk tenfold or the clipping off leaves a weaker signal than
# no noise at all; the audit needs the canaries' number to show it
CAUGHT = [
    (name, bug)
    for name in ("noisygd", "dpsgd-binary", "dpsgd-multinomial", "dpsgd-regressor")
    for bug in ("noise-x0.1", "no-clipping")
]


@pytest.mark.parametrize(("name", "bug"), CAUGHT)
def test_a_planted_bug_is_caught(name, bug):
    make, y = ESTIMATORS[name]
    res = _audit(make, y, 1000, bug)
    assert res.claimed_epsilon == pytest.approx(1.0, rel=1e-3)
    assert res.epsilon_lower_bound > res.claimed_epsilon + 0.3
    assert res.violation


@pytest.mark.parametrize("name", list(SAMPLED))
def test_a_tenfold_sampling_rate_is_caught(name):
    make, y = SAMPLED[name]
    honest = _audit(make, y, 1000, "none")
    assert honest.epsilon_lower_bound <= honest.claimed_epsilon
    res = _audit(make, y, 1000, "rate-x10")
    assert res.claimed_epsilon == pytest.approx(honest.claimed_epsilon, rel=1e-9)
    assert res.epsilon_lower_bound > res.claimed_epsilon + 0.3 and res.violation


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["noise-x0.1", "no-clipping"])
def test_adassp_planted_bugs_are_caught(bug):
    # AdaSSP's eigenvalue floor keeps the canaries' columns apart: 1,000 canaries (a
    # 1,004 x 1,004 eigendecomposition per fit) show both bugs
    make, y = ESTIMATORS["adassp"]
    for seed in range(3):
        res = _audit(make, y, 1000, bug, seed=seed)
        assert res.epsilon_lower_bound > res.claimed_epsilon and res.violation


def test_the_noise_bugs_scale_every_noise_draw_of_the_fit():
    """One full-batch step of DPSGDRegressor is linear in its noise: the model of
    ``noise-x0.1`` is the noiseless model plus a tenth of the honest model's noise (the
    same draws, scaled); the fit's epsilon_ and its parameters are the intended ones."""

    def fit(bug):
        est = DPSGDRegressor(
            epsilon=1.0,
            delta=1e-5,
            n_iter=1,
            learning_rate=0.5,
            random_state=3,
            trajectory_points=1,
        )
        with planted_model_bug(bug, est):
            est.fit(X, Y)
        assert est.get_params()["random_state"] == 3  # restored
        assert "_check_data" not in vars(est)
        return est

    honest, tenth, none = fit("none"), fit("noise-x0.1"), fit("no-noise")
    assert tenth.epsilon_ == none.epsilon_ == honest.epsilon_
    np.testing.assert_allclose(
        tenth.coef_ - none.coef_, 0.1 * (honest.coef_ - none.coef_), rtol=1e-9, atol=1e-15
    )
    assert np.all(honest.coef_ != none.coef_)


def test_no_clipping_keeps_the_noise_and_restores_the_bound():
    """DP-SGD's no-clipping raises the clipping bound and scales the noise draws back:
    with no gradient above the bound, the fit equals the honest one; the estimator's
    max_grad_norm is the given one after the block."""

    def fit(bug):
        est = DPSGDRegressor(
            epsilon=1.0,
            delta=1e-5,
            n_iter=3,
            max_grad_norm=10.0,
            random_state=3,
            trajectory_points=1,
        )
        with planted_model_bug(bug, est):
            est.fit(X, Y)
        assert est.max_grad_norm == 10.0
        return est

    np.testing.assert_allclose(fit("no-clipping").coef_, fit("none").coef_, rtol=1e-9)


def test_the_linear_regressors_no_clipping_keeps_rows_above_x_bound():
    """SSP without noise solves the least-squares problem of the data it is given:
    planted no-clipping, the rows of norm 2 (x_bound 1) are kept, so the fit recovers
    the coefficients of the unclipped rows; honest, it fits the clipped ones."""
    rng = np.random.default_rng(0)
    Xw = 2.0 * rng.normal(size=(50, 2)) / np.sqrt(2.0)
    yw = np.clip(Xw @ np.array([0.3, -0.2]), -1.0, 1.0)

    def fit(bugs):
        est = SSPRegressor(epsilon=1.0, delta=1e-5, fit_intercept=False, random_state=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with planted_model_bug(bugs[0], est), planted_model_bug(bugs[1], est):
                est.fit(Xw, yw)
        return est.coef_

    exact = np.linalg.lstsq(Xw, yw, rcond=None)[0]
    np.testing.assert_allclose(fit(("no-clipping", "no-noise")), exact, rtol=1e-9)
    assert not np.allclose(fit(("none", "no-noise")), exact, rtol=1e-3)


@pytest.mark.parametrize(
    ("estimator", "bug", "error"),
    [
        (SSPRegressor(), "bogus", ParameterValueError),
        (SSPRegressor(), "noise-reused", ParameterValueError),
        (SSPRegressor(), "rate-x10", ConfigurationError),
        (DPSGDRegressor(sampling_rate=1.0), "rate-x10", ConfigurationError),
    ],
)
def test_a_bug_the_estimator_cannot_have_is_refused_before_any_fit(
    estimator, bug, error, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("fitted")

    monkeypatch.setattr(type(estimator), "fit", never)
    with pytest.raises(error, match="inject_bug"):
        audit_estimator(estimator, X, Y, 10, seed=0, inject_bug=bug)


def test_an_estimator_without_seams_is_refused():
    from sklearn.base import BaseEstimator, RegressorMixin

    class Foreign(RegressorMixin, BaseEstimator):
        def __init__(self, delta=1e-5):
            self.delta = delta

    with pytest.raises(ParameterTypeError, match="no bug can be planted in Foreign"):
        audit_estimator(Foreign(), X, Y, 10, seed=0, inject_bug="no-noise")
    assert MODEL_BUGS[0] == "none"


def test_an_interval_label_bound_gives_the_canaries_its_two_ends(monkeypatch):
    """A regressor with y_bound=(lo, hi) gets canaries labelled hi (sign +1) and lo
    (sign -1); a float() of the pair failed the audit with a TypeError."""
    seen = {}
    fit = SSPRegressor.fit

    def spy(self, Xa, ya):
        seen["labels"] = np.asarray(ya)[X.shape[0] :]
        return fit(self, Xa, ya)

    monkeypatch.setattr(SSPRegressor, "fit", spy)
    yi = np.clip(Y + 1.0, 0.0, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = audit_estimator(
            SSPRegressor(epsilon=1.0, delta=1e-5, y_bound=(0.0, 2.0)), X, yi, 200, seed=0
        )
    assert set(seen["labels"].tolist()) == {0.0, 2.0}
    assert res.epsilon_lower_bound <= res.claimed_epsilon


def test_no_clipping_canaries_default_to_ten_times_the_bound(monkeypatch):
    """Canaries within the bound need no clipping, so a missing clipping could not show:
    under no-clipping the canaries' norm defaults to 10 times the bound (max_grad_norm
    here), and to the bound itself otherwise."""
    norms = []
    fit = DPSGDRegressor.fit

    def spy(self, Xa, ya):
        canaries = np.asarray(Xa)[X.shape[0] :]
        norms.append(np.unique(np.round(np.linalg.norm(canaries, axis=1), 12)).tolist())
        return fit(self, Xa, ya)

    monkeypatch.setattr(DPSGDRegressor, "fit", spy)
    for bug in ("none", "no-clipping"):
        _audit(lambda: DPSGDRegressor(max_grad_norm=2.0, n_iter=2), Y, 20, bug)
    assert norms == [[2.0], [20.0]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_honest_audits_stay_below_the_claim_over_seeds(name):
    make, y = ESTIMATORS[name]
    for seed in range(5):
        res = _audit(make, y, 1000, "none", seed=seed)
        assert res.epsilon_lower_bound <= res.claimed_epsilon and not res.violation
