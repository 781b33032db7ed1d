"""audit_estimator on a multinomial (K >= 3 classes) DPSGDClassifier: canaries with a
label drawn from the public classes, scored by their class's coefficient against the
mean of their column. An honest fit stays below its accounted epsilon; a fit with a
planted bug (noise scaled down, clipping off) that the accountant does not see is
caught: the lower bound exceeds the epsilon it claims."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("sklearn")

from privlearn.auditing.models import audit_estimator  # noqa: E402
from privlearn.models import DPSGDClassifier  # noqa: E402

CLASSES = [0, 1, 2]


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    return X, np.argmax(X @ rng.normal(size=(3, len(CLASSES))), axis=1)


def _estimator() -> DPSGDClassifier:
    return DPSGDClassifier(
        epsilon=1.0, delta=1e-5, n_iter=20, sampling_rate=1.0, learning_rate=0.1, classes=CLASSES
    )


def _audit(data, seed: int, inject_bug: str = "none"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # canary_norm 30: the canary's gradient is clipped to max_grad_norm = 1 when the
        # clipping works, and is 30 times larger without it
        return audit_estimator(_estimator(), *data, 200, seed=seed, canary_norm=30.0,
                               inject_bug=inject_bug)


def test_an_honest_multinomial_fit_stays_below_its_accounted_epsilon(data):
    for seed in range(3):
        res = _audit(data, seed)
        assert res.scores.shape == (200,) and res.n_canaries == 200
        assert res.claimed_epsilon == pytest.approx(1.0, rel=1e-3)  # the accountant's
        assert 0.0 <= res.epsilon_lower_bound <= res.claimed_epsilon
        assert not res.violation


@pytest.mark.parametrize("bug", ["noise-x0.1", "no-clipping"])
def test_a_planted_bug_in_the_multinomial_fit_is_caught(data, bug):
    # planted in the fit's instance (privlearn.auditing._planted_models); the accountant
    # still reports the intended epsilon
    for seed in range(2):
        res = _audit(data, seed, bug)
        assert res.claimed_epsilon == pytest.approx(1.0, rel=1e-3)
        assert res.epsilon_lower_bound > res.claimed_epsilon and res.violation


def test_the_canary_labels_cover_the_public_classes_and_drive_the_score(data, monkeypatch):
    """Every public class labels some canaries, also one absent from y; and the score
    follows the canary's own class: with the noise off, an included canary's class
    coefficient exceeds its column's mean, an excluded canary's column stays zero."""
    X, y = data
    y = np.where(y == 2, 0, y)  # class 2 only public
    seen = {}
    fit = DPSGDClassifier.fit

    def spy(self, Xa, ya):
        seen["labels"] = np.asarray(ya)[X.shape[0] :]
        return fit(self, Xa, ya)

    monkeypatch.setattr(DPSGDClassifier, "fit", spy)
    res = _audit((X, y), 0, "no-noise")
    assert set(seen["labels"].tolist()) == set(CLASSES)
    assert np.all(res.scores[res.inclusion] > 0)
    np.testing.assert_allclose(res.scores[~res.inclusion], 0.0, atol=1e-12)
