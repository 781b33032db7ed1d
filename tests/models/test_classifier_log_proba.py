"""DPSGDClassifier's probabilities as scikit-learn's LogisticRegression gives them:
``predict_log_proba`` exists, equals the logarithm of ``predict_proba`` where that is
representable and stays finite where it is not; a probability near 1 keeps its small
complement."""

from __future__ import annotations

import math

import numpy as np

from privlearn.models import DPSGDClassifier


def _fitted():
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(200, 3))
    y = (X[:, 0] > 0).astype(int)
    return DPSGDClassifier(epsilon=1.0, delta=1e-5, n_iter=50, random_state=0, classes=[0, 1]).fit(
        X, y
    ), X


def test_log_proba_is_the_log_of_proba_and_matches_the_logistic_closed_form():
    clf, X = _fitted()
    s = clf.decision_function(X)
    logp = clf.predict_log_proba(X)
    np.testing.assert_allclose(np.exp(logp), clf.predict_proba(X), rtol=1e-12)
    # closed form of the logistic model: log p1 = -log(1 + e^-s), log p0 = -log(1 + e^s)
    np.testing.assert_allclose(logp[:, 1], -np.logaddexp(0.0, -s), rtol=1e-12)
    np.testing.assert_allclose(logp[:, 0], -np.logaddexp(0.0, s), rtol=1e-12)


def test_extreme_scores_keep_finite_log_probabilities_and_small_complements():
    clf, X = _fitted()
    clf.coef_ = np.array([4000.0, 0.0, 0.0])  # scores of about +-4000 on X
    clf.intercept_ = 0.0
    x = np.array([[-0.2, 0.0, 0.0], [0.01, 0.0, 0.0]])
    logp = clf.predict_log_proba(x)
    assert np.isfinite(logp).all()
    np.testing.assert_allclose(logp[0, 1], -800.0, rtol=1e-12)
    p = clf.predict_proba(x)
    # closed form 1 / (1 + e^40) (scikit-learn's LogisticRegression returns 1 - p = 0)
    np.testing.assert_allclose(p[1, 0], 1.0 / (1.0 + math.exp(40.0)), rtol=1e-12)
    assert p[1, 0] > 0.0
