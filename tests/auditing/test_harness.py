"""The one-run harness and the NumPy-estimator canaries."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
from _audit_helpers import recording_release, unit_ball_regression

from privlearn.accounting.fdp import gdp_mu
from privlearn.auditing import AuditResult, one_run_audit


def _gdp_release(mu, seed=0):
    rng = np.random.default_rng(seed)

    def train_and_score(inclusion):
        assert inclusion.dtype == bool
        return rng.normal(size=inclusion.size) + mu * inclusion

    return train_and_score


def test_harness_draws_fair_inclusion_and_bounds_the_ideal_release():
    mu = gdp_mu(4.0, 1e-5)
    res = one_run_audit(_gdp_release(mu), 5000, claimed_epsilon=4.0, delta=1e-5, seed=3)
    assert isinstance(res, AuditResult)
    assert res.n_canaries == 5000 and abs(res.inclusion.mean() - 0.5) < 0.03
    assert 1.0 < res.epsilon_lower_bound <= 4.0 and not res.violation
    assert res.method == "one_run" and res.confidence == 0.95  # valid for any mechanism
    assert res.seed == 3 and res.to_dict()["seed"] == 3
    # a release that is twice as revealing as claimed is caught
    res2 = one_run_audit(_gdp_release(3 * mu), 5000, claimed_epsilon=4.0, delta=1e-5, seed=3)
    assert res2.violation and res2.epsilon_lower_bound > 4.0
    d = res2.to_dict()
    assert {"claimed_epsilon", "epsilon_lower_bound", "method", "canaries",
            "violation"} <= set(d) and d["violation"] is True


def test_result_is_immutable_and_deterministic():
    a = one_run_audit(_gdp_release(1.0, 1), 500, claimed_epsilon=1.0, delta=1e-5, seed=9,
                      method="one_run")
    b = one_run_audit(_gdp_release(1.0, 1), 500, claimed_epsilon=1.0, delta=1e-5, seed=9,
                      method="one_run")
    assert a.epsilon_lower_bound == b.epsilon_lower_bound
    np.testing.assert_array_equal(a.inclusion, b.inclusion)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.violation = True
    with pytest.raises(ValueError):
        a.scores[0] = 1.0


def test_claim_may_be_evaluated_after_training():
    box = {}

    def train_and_score(inclusion):
        box["eps"] = 0.5
        return inclusion * 10.0 + np.random.default_rng(0).random(inclusion.size)

    res = one_run_audit(train_and_score, 400, claimed_epsilon=lambda: box["eps"], delta=1e-5,
                        seed=0, method="one_run")
    assert res.claimed_epsilon == 0.5 and res.violation


@pytest.mark.parametrize("returned,match", [
    (lambda inc: np.zeros(inc.size - 1), "one score per canary"),
    (lambda inc: np.zeros((inc.size, 2)), "one score per canary"),
    (lambda inc: np.full(inc.size, np.nan), "non-finite"),
    (lambda inc: None, "one score per canary"),
])
def test_wrong_scores_are_refused(returned, match):
    with pytest.raises(ValueError, match=match):
        one_run_audit(returned, 10, claimed_epsilon=1.0, delta=1e-5, seed=0)


def test_bad_arguments_are_refused_before_training():
    f, calls = recording_release()
    for kwargs, exc, match in [
        (dict(n_canaries=1), ValueError, "n_canaries must be an integer >= 2, got 1"),
        (dict(n_canaries=-3), ValueError, "n_canaries must be an integer >= 2, got -3"),
        (dict(n_canaries="10"), TypeError, "n_canaries must be an integer"),
        (dict(seed=-1), ValueError, "seed must be None or an integer >= 0, got -1"),
        (dict(seed="abc"), TypeError, "seed must be None or an integer"),
        (dict(delta="1e-5"), TypeError, "delta must be a real number"),
        (dict(n_canaries=2.5), TypeError, "n_canaries must be an integer"),
        (dict(delta=1.0), ValueError, r"delta must be in \[0, 1\)"),
        (dict(delta=-1e-3), ValueError, r"delta must be in \[0, 1\)"),
        (dict(confidence=1.0), ValueError, r"confidence must be in \(0, 1\)"),
        (dict(method="x"), ValueError, "method must be one of"),
        (dict(claimed_epsilon=-1.0), ValueError, "claimed_epsilon"),
    ]:
        args = dict(n_canaries=10, claimed_epsilon=1.0, delta=1e-5)
        args.update(kwargs)
        n = args.pop("n_canaries")
        with pytest.raises(exc, match=match):
            one_run_audit(f, n, **args)
    with pytest.raises(TypeError, match="callable"):
        one_run_audit(None, 10, claimed_epsilon=1.0, delta=1e-5)
    assert not calls


def test_numpy_estimators_pass_their_audit_and_leak_detectably():
    pytest.importorskip("sklearn")
    from privlearn.auditing.models import audit_estimator
    from privlearn.models import DPSGDRegressor, NoisyGDRegressor

    X, y = unit_ball_regression(1000, [0.5, -0.3, 0.2, 0.1])
    for est in (NoisyGDRegressor(epsilon=8.0, delta=1e-5, noise_multiplier=None, n_iter=30),
                DPSGDRegressor(epsilon=8.0, delta=1e-5, n_iter=100, sampling_rate=0.2)):
        res = audit_estimator(est, X, y, 200, seed=1)
        assert res.claimed_epsilon == pytest.approx(8.0, rel=1e-3)
        assert not res.violation
        assert res.auc > 0.6  # the canaries are visible in the coefficients


@pytest.mark.parametrize("method", ["clopper_pearson", "gdp"])
def test_independent_trial_methods_are_refused_for_one_run(method):
    with pytest.raises(ValueError, match="independent trials"):
        one_run_audit(lambda inc: inc.astype(float), 10, claimed_epsilon=1.0, delta=1e-5,
                      method=method)


def test_audit_estimator_covers_ssp_adassp_and_the_classifier():
    pytest.importorskip("sklearn")
    from privlearn.auditing.models import audit_estimator
    from privlearn.models import AdaSSPRegressor, DPSGDClassifier, SSPRegressor

    X, y = unit_ball_regression(600, [0.6, -0.4, 0.2], seed=1)
    yc = (X[:, 0] > 0).astype(int)
    for est, target in ((SSPRegressor(epsilon=4.0, delta=1e-5), y),
                        (AdaSSPRegressor(epsilon=4.0, delta=1e-5), y),
                        (DPSGDClassifier(epsilon=4.0, delta=1e-5, n_iter=100,
                                         sampling_rate=0.2, classes=[0, 1]), yc)):
        res = audit_estimator(est, X, target, 100, seed=2)
        assert res.n_canaries == 100 and res.scores.shape == (100,)
        assert res.claimed_epsilon == pytest.approx(4.0, rel=1e-3)
        assert not res.violation and res.epsilon_lower_bound >= 0
    # three classes are audited as a multinomial fit (tests/auditing/
    # test_multinomial_audit.py); one class is not a classifier's data
    with pytest.raises(ValueError, match="at least two classes, got 1"):
        audit_estimator(DPSGDClassifier(), X, np.zeros(600, dtype=int), 10)


def test_seed_is_drawn_and_recorded_when_none():
    """An audit without a seed can be repeated from the seed it records."""
    a = one_run_audit(_gdp_release(2.0, 5), 300, claimed_epsilon=1.0, delta=1e-5)
    assert isinstance(a.seed, int) and a.seed >= 0
    b = one_run_audit(_gdp_release(2.0, 5), 300, claimed_epsilon=1.0, delta=1e-5, seed=a.seed)
    np.testing.assert_array_equal(a.inclusion, b.inclusion)
    assert a.epsilon_lower_bound == b.epsilon_lower_bound


def _one_sided_audit(canaries, side):
    """A one-run audit whose seed draws every canary in (``side``) or none in."""
    seed = next(s for s in range(10_000)
                if (np.random.default_rng(s).random(canaries) < 0.5).all() == side
                and (np.random.default_rng(s).random(canaries) < 0.5).any() == side)
    with pytest.warns(UserWarning, match="no outcome"):
        return one_run_audit(lambda inc: inc.astype(float), canaries, claimed_epsilon=1.0,
                             delta=1e-5, seed=seed)


@pytest.mark.parametrize("side", [True, False])
def test_every_canary_on_one_side_is_a_valid_outcome(side):
    """With few canaries all may be drawn in (or out): the one-run game still has an
    answer (no error about empty scores after the training ran)."""
    res = _one_sided_audit(3, side)
    assert res.inclusion.all() == side and res.epsilon_lower_bound == 0.0


def test_an_audit_that_cannot_refute_anything_warns_before_training():
    f, calls = recording_release()
    with pytest.warns(UserWarning, match="no outcome") as rec:  # 4 right of 4: p = 1/16
        one_run_audit(f, 4, claimed_epsilon=1.0, delta=1e-5, seed=0)
    assert calls == [0] and rec[0].filename == __file__  # points at the caller
    with pytest.warns(UserWarning, match="smaller delta"):  # the 2 m delta term swamps it
        one_run_audit(f, 10_000, claimed_epsilon=1.0, delta=1e-3, seed=0)


def test_a_claim_no_outcome_can_refute_is_warned_about_before_training():
    # with 200 canaries no outcome of the one-run audit bounds epsilon above ~3.5, so a
    # claim of 6 always passed, silently, even when every canary was recognised
    perfect, calls = recording_release()
    with pytest.warns(UserWarning, match="no outcome of this audit can refute the claim "
                      "epsilon=6") as rec:
        res = one_run_audit(perfect, 200, claimed_epsilon=6.0, delta=1e-5, seed=0)
    assert rec[0].filename == __file__ and len(calls) == 1
    assert 0 < res.epsilon_lower_bound <= 6.0 and not res.violation  # the perfect attack
    # the ceiling the warning states is the bound of that perfect attack
    assert f"by {res.epsilon_lower_bound:.4g} at most" in str(rec[0].message)
    # a claim given as a callable is checked once it is known, after training
    with pytest.warns(UserWarning, match="can refute the claim epsilon=6"):
        one_run_audit(perfect, 200, claimed_epsilon=lambda: 6.0, delta=1e-5, seed=0)
    with warnings.catch_warnings():  # a claim the perfect attack refutes: no warning
        warnings.simplefilter("error")
        assert one_run_audit(perfect, 200, claimed_epsilon=1.0, delta=1e-5, seed=0).violation


@pytest.mark.parametrize("dtype", ["datetime64[D]", "timedelta64[s]"])
def test_datetime_scores_are_a_type_error_not_read_as_floats(dtype):
    # NumPy converts datetimes and durations to floats (days, seconds): they were audited
    with pytest.raises(TypeError, match="array of real numbers"):
        one_run_audit(lambda inc: np.zeros(inc.size).astype(dtype), 10, claimed_epsilon=1.0,
                      delta=1e-5, seed=0)


def test_none_scores_are_a_clear_error():
    with pytest.raises(TypeError, match="returned None"):
        one_run_audit(lambda inc: None, 10, claimed_epsilon=1.0, delta=1e-5, seed=0)


def test_estimator_canary_signs_are_independent_of_inclusion():
    """The canary signs are public to the scorer: drawn from the inclusion's stream they
    would equal the inclusion bits (they once did), and a score could read them."""
    pytest.importorskip("sklearn")
    from privlearn.auditing.models import audit_estimator
    from privlearn.models import NoisyGDRegressor

    X, y = unit_ball_regression(200, [0.5, -0.3, 0.2])
    seen = {}
    import privlearn.auditing.models as models_mod

    orig = models_mod.one_run_audit

    def spy(train_and_score, n, **kw):
        def wrapped(inc):
            s = train_and_score(inc)
            seen["inc"] = inc
            return s
        return orig(wrapped, n, **kw)

    models_mod.one_run_audit = spy
    try:
        est = NoisyGDRegressor(epsilon=1.0, delta=1e-5, noise_multiplier=None, n_iter=5)
        res = audit_estimator(est, X, y, 400, seed=7)
    finally:
        models_mod.one_run_audit = orig
    signs = np.where(np.random.default_rng(np.random.SeedSequence([7, 0x5167])).random(400)
                     < 0.5, -1.0, 1.0)
    agree = np.mean((signs < 0) == seen["inc"])
    assert 0.4 < agree < 0.6  # independent: about half agree (it was exactly 1.0)
    assert res.seed == 7


def test_estimator_audit_refuses_bad_input_before_fitting():
    pytest.importorskip("sklearn")
    from sklearn.linear_model import LinearRegression

    from privlearn.auditing.models import audit_estimator
    from privlearn.models import NoisyGDRegressor

    X, y = np.zeros((10, 2)), np.zeros(10)
    est = NoisyGDRegressor(epsilon=1.0, delta=1e-5, noise_multiplier=None, n_iter=5)
    with pytest.raises(ValueError, match="n_canaries must be an integer >= 2, got -3"):
        audit_estimator(est, X, y, -3)
    with pytest.raises(TypeError, match="n_canaries must be an integer"):
        audit_estimator(est, X, y, 2.5)
    with pytest.raises(ValueError, match="seed must be None or an integer >= 0"):
        audit_estimator(est, X, y, 10, seed=-1)
    with pytest.raises(TypeError, match="not a private linear classifier or regressor"):
        audit_estimator(LinearRegression(), X, y, 10)


def test_a_private_transformer_is_refused_before_it_is_fitted(tmp_path):
    """A private scaler has privacy parameters but no ``coef_``: it was fitted (charging
    its ledger) and only then refused; now it is refused before any fit."""
    from privlearn.auditing.models import audit_estimator
    from privlearn.ledger import Ledger
    from privlearn.models import PrivateStandardScaler

    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=10.0, delta=1e-5)
    est = PrivateStandardScaler(epsilon=1.0, delta=1e-5, feature_range=(0.0, 1.0),
                                ledger=ledger.budget("d"))
    X, y = np.random.default_rng(0).random((40, 2)), np.zeros(40)
    with pytest.raises(TypeError, match="refused before any fit"):
        audit_estimator(est, X, y, 10)
    assert [e.kind for e in ledger.history("d")] == ["budget"]


@pytest.mark.parametrize("side", [True, False])
def test_a_result_with_every_canary_on_one_side_still_reports(side):
    """Every canary drawn in (or none) is a valid outcome: the result's AUC (no ROC) is
    nan, its summary says None and stays valid JSON (they raised on the empty side)."""
    import json

    res = _one_sided_audit(2, side)
    assert math.isnan(res.auc)
    d = res.to_dict()
    assert d["auc"] is None and d["canaries_included"] == (2 if side else 0)
    assert json.loads(json.dumps(d, allow_nan=False)) == d


def test_report_of_a_result_with_every_canary_on_one_side_writes_the_scores(tmp_path):
    import types

    from privlearn.auditing.report import write_report

    seed = next(s for s in range(10_000) if (np.random.default_rng(s).random(2) < 0.5).all())
    with pytest.warns(UserWarning, match="no outcome"):
        res = one_run_audit(lambda inc: inc.astype(float), 2, claimed_epsilon=1.0,
                            delta=1e-5, seed=seed)
    run = types.SimpleNamespace(result=res, bug="none", mechanism=lambda: None)
    (path,) = write_report(run, str(tmp_path))
    assert path.endswith("_scores.csv")
    assert open(path).read().splitlines()[1:] == ["0,1,1.0", "1,1,1.0"]


# -- the Gaussian-curve method on a mechanism known not to be Gaussian -------------------

def _randomized_response(eps, seed=12345):
    """Exact eps-DP randomized response of each canary's inclusion bit."""
    rng = np.random.default_rng(seed)
    p = math.exp(eps) / (1 + math.exp(eps))

    def train_and_score(inclusion):
        keep = rng.random(inclusion.size) < p
        return np.where(keep, inclusion, ~inclusion).astype(float)

    return train_and_score


def _gaussian_warnings(record):
    return [w for w in record if "not Gaussian" in str(w.message)]


@pytest.mark.parametrize("when", ["before", "after"])
def test_one_run_fdp_on_a_mechanism_known_not_gaussian_warns_once(when):
    """Randomized response keeps its (1, 0)-DP claim, yet the Gaussian-curve method
    reports a violation; told the mechanism, the harness warns once, recommending
    method='one_run', which does not flag it."""
    from privlearn.accounting import RandomizedResponse, compose

    mech = compose(RandomizedResponse(math.e / (1 + math.e)), steps=1)  # epsilon 1
    given = mech if when == "before" else (lambda: mech)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        res = one_run_audit(_randomized_response(1.0), 2000, claimed_epsilon=1.0,
                            delta=1e-5, seed=0, method="one_run_fdp", mechanism=given)
    (w,) = _gaussian_warnings(record)
    assert w.category is UserWarning and "method='one_run'" in str(w.message)
    assert "RandomizedResponse" in str(w.message) and w.filename == __file__
    assert res.violation  # the false flag the warning is about
    honest = one_run_audit(_randomized_response(1.0), 2000, claimed_epsilon=1.0,
                           delta=1e-5, seed=0, method="one_run", mechanism=given)
    assert not honest.violation


def test_no_gaussian_warning_for_gaussian_mechanisms_or_one_run():
    from privlearn.accounting import Gaussian, Laplace, compose, subsample

    dpsgd = compose([Gaussian(3.0), compose(subsample(Gaussian(1.0), 0.01), steps=100)])
    cases = [(dpsgd, "one_run_fdp"), (None, "one_run_fdp"), (Laplace(1.0), "one_run")]
    for mech, method in cases:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            one_run_audit(_gdp_release(1.0), 500, claimed_epsilon=4.0, delta=1e-5, seed=0,
                          method=method, mechanism=mech)
        assert not _gaussian_warnings(record), (mech, method)
    with pytest.raises(TypeError, match="mechanism"):
        one_run_audit(_gdp_release(1.0), 500, claimed_epsilon=4.0, delta=1e-5,
                      method="one_run_fdp", mechanism="laplace")


def test_audit_estimator_warns_for_laplace_dpsgd_with_one_run_fdp():
    pytest.importorskip("sklearn")
    from privlearn.auditing.models import audit_estimator
    from privlearn.models import DPSGDRegressor

    X, y = unit_ball_regression(300, [0.5, -0.3, 0.2])
    est = DPSGDRegressor(epsilon=4.0, delta=1e-5, n_iter=20, sampling_rate=0.2,
                         noise="laplace")
    with pytest.warns(UserWarning, match="Laplace.*method='one_run'"):
        audit_estimator(est, X, y, 100, seed=1, method="one_run_fdp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        audit_estimator(est, X, y, 100, seed=1)  # the default, one_run: no such warning
    assert not _gaussian_warnings(record)


@pytest.mark.parametrize("claim", [True, "2.0", b"2"])
def test_a_claim_that_is_not_a_number_is_refused_before_training(claim):
    # float() read True as the claim 1.0 and "2.0" as 2.0
    calls = []
    with pytest.raises(TypeError, match="claimed_epsilon must be a real number"):
        one_run_audit(lambda inc: calls.append(1) or inc.astype(float), 100,
                      claimed_epsilon=claim, delta=1e-5, seed=0)
    assert not calls
    with pytest.raises(TypeError, match=r"claimed_epsilon\(\) must be a real number"):
        one_run_audit(lambda inc: inc.astype(float), 100, claimed_epsilon=lambda: claim,
                      delta=1e-5, seed=0)


@pytest.mark.parametrize("method", ["one_run", "one_run_fdp"])
@pytest.mark.parametrize("claim", [37.0, 40.0, 500.0])
def test_a_claim_too_large_for_any_outcome_is_warned_about_not_a_crash(method, claim):
    # e^eps / (1 + e^eps) rounds to 1 from eps ~ 37: log(1 - p) was a math domain
    # error in the check, before training, whether a perfect attack could refute it
    with pytest.warns(UserWarning, match="no outcome of this audit can refute"):
        res = one_run_audit(lambda inc: inc.astype(float), 1000, claimed_epsilon=claim,
                            delta=1e-5, seed=0, method=method)
    assert 0 < res.epsilon_lower_bound < claim and not res.violation
