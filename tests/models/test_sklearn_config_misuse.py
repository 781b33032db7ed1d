"""scikit-learn settings and conventions that users of the private estimators carry
over from scikit-learn: a global configuration set for speed, a release compared with
the same release on a neighbouring data set (one record removed)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import sklearn

from privlearn.errors import NonFiniteInputError, ParameterTypeError
from privlearn.models import DPSGDClassifier, PrivateKNN, PrivateStandardScaler, SSPRegressor

RNG = np.random.default_rng(5)
X = RNG.uniform(-0.5, 0.5, size=(40, 3))
Y = X @ np.array([1.0, -2.0, 0.5])


@pytest.mark.parametrize(
    "make, y",
    [
        (lambda: PrivateStandardScaler(feature_range=(-1, 1), random_state=0), None),
        (lambda: SSPRegressor(random_state=0), Y),
        (lambda: DPSGDClassifier(n_iter=3, classes=[0, 1], random_state=0), Y > 0),
    ],
    ids=["scaler", "ssp", "dpsgd"],
)
def test_assume_finite_does_not_let_a_nan_record_into_the_release(make, y):
    """sklearn.set_config(assume_finite=True) skips scikit-learn's finiteness check, and
    the private fits relied on it: the scaler released mean_ NaN on the data set with
    one NaN record and a number on its neighbour without it (the two are told apart
    with certainty), and the linear models failed inside the release. The check is the
    library's own, whatever the configuration."""
    bad = X.copy()
    bad[0, 0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        neighbour = make().fit(X[1:], None if y is None else y[1:])
        with sklearn.config_context(assume_finite=True):
            with pytest.raises(NonFiniteInputError, match="Input X contains NaN"):
                make().fit(bad, y)
    # the neighbour's release is finite: a NaN output would single the record out
    released = neighbour.mean_ if y is None else neighbour.coef_
    assert np.all(np.isfinite(released))


@pytest.mark.parametrize(
    "make, keyword, instead",
    [
        (lambda **kw: SSPRegressor(**kw), "bounds_X", "x_bound"),
        (lambda **kw: PrivateStandardScaler(**kw), "bounds", "feature_range"),
        (lambda **kw: DPSGDClassifier(**kw), "data_norm", "max_grad_norm"),
        (lambda **kw: DPSGDClassifier(**kw), "class_weight", "private label counts"),
        (lambda **kw: SSPRegressor(**kw), "warm_start", "new release from scratch"),
    ],
)
def test_a_keyword_of_diffprivlib_or_scikit_learn_is_refused_saying_what_instead(
    make, keyword, instead
):
    """diffprivlib's bounds (bounds, bounds_X, data_norm) and scikit-learn's
    class_weight / warm_start were Python's bare "unexpected keyword argument": the
    refusal names the parameter that takes the public bound, or why the option would
    release what nothing accounts."""
    with pytest.raises(ParameterTypeError, match=rf"takes no {keyword}=.*{instead}"):
        make(**{keyword: "balanced"})


def test_the_refusal_keeps_the_signature_and_a_subclass_s_own_keywords():
    """scikit-learn reads the constructor's signature (get_params, clone); a subclass of
    the user's that does take one of the keywords keeps it."""
    from sklearn.base import clone

    est = clone(SSPRegressor(epsilon=2.0, x_bound=3.0))
    assert (est.epsilon, est.x_bound) == (2.0, 3.0)
    assert "bounds_X" not in est.get_params()

    class Weighted(SSPRegressor):
        def __init__(self, epsilon=1.0, class_weight=None):
            super().__init__(epsilon=epsilon)
            self.class_weight = class_weight

    assert Weighted(class_weight="balanced").get_params()["class_weight"] == "balanced"
    with pytest.raises(ParameterTypeError, match="takes no warm_start="):
        Weighted(warm_start=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DPSGDClassifier(n_iter=2, random_state=0),
        lambda: PrivateKNN(),
    ],
    ids=["dpsgd", "knn"],
)
def test_the_inferred_classes_warning_says_np_unique_is_the_same_release(make):
    """The usual way to silence the warning of classes=None is classes=np.unique(y):
    the same release, which nothing can tell from a public list. The warning says so
    where the person fitting reads it."""
    from privlearn.errors import PrivacyLeakWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=Warning)
        warnings.simplefilter("always", category=PrivacyLeakWarning)
        with pytest.warns(PrivacyLeakWarning, match=r"classes=np\.unique\(y\) is the same"):
            make().fit(X, (Y > 0).astype(int))
