"""scikit-learn API conformance of every private estimator (the check_estimator suite).

Every public class of :mod:`privlearn.models` that is fitted or released runs the whole
suite. The estimators are seeded (``random_state=0``, the user's choice, so checks that
compare two fits -- idempotence, subset invariance -- see the same noise); checks that
cannot hold for a differentially private estimator are declared below with a one-line
reason each, and run in strict mode: an expected failure that starts passing fails the
suite, so no declaration outlives its reason.
"""

import pytest
from estimators import assert_covers
from sklearn.utils.estimator_checks import check_estimator, parametrize_with_checks

from privlearn.models import (
    PATE,
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    PrivateKNN,
    PrivatePipeline,
    PrivateSearchCV,
    PrivateStandardScaler,
    SSPRegressor,
)

# The checks fit on random, unbounded data without classes=: the estimators warn their
# caller that rows were clipped and that the label set was read from the data, as they
# should; not the subject here (tests/models/test_linear.py and test_dpsgd.py test them).
pytestmark = [
    pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning"),
    pytest.mark.filterwarnings("ignore:.*classes=None infers:privlearn.errors.PrivacyLeakWarning"),
    # the checks seed every step alike (set_random_state): the pipeline says so
    pytest.mark.filterwarnings("ignore:.*share random_state:privlearn.errors.PrivacyLeakWarning"),
    pytest.mark.filterwarnings("ignore:Skipping check:sklearn.exceptions.SkipTestWarning"),
]

_PATE_NO_FIT = (
    "PATE has no fit: it is not trained on (X, y) but releases labels from the teachers' "
    "votes passed to release() (tested in test_label_release.py)"
)

#: The checks that call ``fit``: PATE runs every other check of the suite.
_PATE_FIT_CHECKS = (
    "check_complex_data", "check_dict_unchanged", "check_dont_overwrite_parameters",
    "check_dtype_object", "check_estimator_sparse_array", "check_estimator_sparse_matrix",
    "check_estimator_sparse_tag", "check_estimators_dtypes",
    "check_estimators_empty_data_messages", "check_estimators_fit_returns_self",
    "check_estimators_nan_inf", "check_estimators_overwrite_params",
    "check_estimators_pickle", "check_f_contiguous_array_estimator", "check_fit1d",
    "check_fit2d_1feature", "check_fit2d_1sample", "check_fit2d_predict1d",
    "check_fit_check_is_fitted", "check_fit_idempotent",
    "check_methods_sample_order_invariance", "check_methods_subset_invariance",
    "check_n_features_in", "check_n_features_in_after_fitting",
    "check_pipeline_consistency", "check_positive_only_tag_during_fit",
    "check_readonly_memmap_input",
)

_PIPELINE_IN_PLACE = (
    "a Pipeline fits the step estimators it was given in place, as scikit-learn's own "
    "Pipeline does (the steps are its parameters)"
)


def _scaler():
    return PrivateStandardScaler(feature_range=(-100, 100), random_state=0)


ESTIMATORS = [
    SSPRegressor(random_state=0),
    AdaSSPRegressor(random_state=0),
    NoisyGDRegressor(noise_multiplier=50.0, random_state=0),
    DPSGDClassifier(n_iter=50, random_state=0),
    DPSGDRegressor(n_iter=50, random_state=0),
    # pure DP: L1 clipping and Laplace noise, whose fit scores poorly on the check's data
    DPSGDRegressor(n_iter=50, noise="laplace", delta=0.0, random_state=0),
    _scaler(),
    PrivateKNN(random_state=0),
    PrivateSearchCV(SSPRegressor(), {"epsilon": [1.0, 2.0]}, loss_bound=10.0, random_state=0),
    # a search takes its searched estimator's type: the classifier checks run on it too
    PrivateSearchCV(DPSGDClassifier(n_iter=50), {"epsilon": [1.0, 2.0]}, random_state=0),
    PrivatePipeline([("scale", _scaler()), ("ssp", SSPRegressor(random_state=0))]),
]


def _expected_failed_checks(est):
    # The private regressors (linear, DP-SGD) carry scikit-learn's ``poor_score`` tag
    # (their noise is calibrated to the worst case over the public bounds, so
    # check_regressors_train's R^2 > 0.5 on 200 unbounded rows is not asked of them);
    # every other assertion of
    # that check runs: no expected failure hides it.
    if isinstance(est, PrivatePipeline):
        return {"check_estimators_overwrite_params": _PIPELINE_IN_PLACE,
                "check_dont_overwrite_parameters": _PIPELINE_IN_PLACE}
    return {}


def test_every_estimator_is_checked():
    assert_covers({type(e).__name__ for e in ESTIMATORS} | {"PATE"}, "the check_estimator suite")


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed_checks,
                         xfail_strict=True)
def test_sklearn_compatible(estimator, check):
    check(estimator)


_NOT_THE_PUBLIC_PAIR = (
    "the check fits labels outside the public classes=[0, 1] (a third class, or the "
    "labels 'one' and 'two'): refused, as labels outside the public pair must be"
)

#: The estimators with a public label set (classes=): the suite's label checks run on
#: the pair given, not on labels read from y.
WITH_PUBLIC_CLASSES = [DPSGDClassifier(n_iter=50, classes=[0, 1], random_state=0),
                       PrivateKNN(classes=[0, 1], random_state=0)]

#: PrivateKNN has no predict, so scikit-learn does not see a classifier (no binary-only
#: tag to declare) and fits every check's labels 0, 1, 2: each check that fits is refused
#: there, with the public pair's message.
_KNN_FITS = (
    "check_fit_score_takes_y", "check_estimators_overwrite_params",
    "check_dont_overwrite_parameters", "check_estimators_fit_returns_self",
    "check_readonly_memmap_input", "check_n_features_in_after_fitting",
    "check_positive_only_tag_during_fit", "check_estimators_dtypes", "check_dtype_object",
    "check_f_contiguous_array_estimator", "check_methods_sample_order_invariance",
    "check_methods_subset_invariance", "check_fit2d_1feature", "check_dict_unchanged",
    "check_fit2d_predict1d",
)


def _expected_failed_with_public_classes(est):
    if isinstance(est, PrivateKNN):
        return dict.fromkeys(_KNN_FITS, _NOT_THE_PUBLIC_PAIR)
    return {
        "check_estimators_dtypes": _NOT_THE_PUBLIC_PAIR,
        "check_classifier_data_not_an_array": _NOT_THE_PUBLIC_PAIR,
        "check_fit2d_1feature": _NOT_THE_PUBLIC_PAIR,
        "check_classifiers_classes": _NOT_THE_PUBLIC_PAIR,
    }


@parametrize_with_checks(WITH_PUBLIC_CLASSES,
                         expected_failed_checks=_expected_failed_with_public_classes,
                         xfail_strict=True)
def test_sklearn_compatible_with_public_classes(estimator, check):
    """A continuous target or a third class is refused with scikit-learn's own messages
    ("Unknown label type", "Only binary classification is supported") when classes= is
    given, as it is without (DPSGDClassifier). PrivateKNN refuses the checks' third
    label; every other check passes with its public pair."""
    check(estimator)


def test_pate_passes_every_check_that_does_not_fit():
    """PATE runs the same suite through ``check_estimator`` (one test: its expected
    failures fail at once, on the missing ``fit``); strict as above."""
    results = check_estimator(PATE(random_state=0), on_fail=None,
                              expected_failed_checks=dict.fromkeys(_PATE_FIT_CHECKS,
                                                                   _PATE_NO_FIT))
    status = {}
    for r in results:
        status.setdefault(r["check_name"], set()).add(r["status"])
    assert not [n for n, st in status.items() if "failed" in st]
    assert {n for n, st in status.items() if st == {"xfail"}} == set(_PATE_FIT_CHECKS)
    assert len([n for n, st in status.items() if "passed" in st]) >= 10


def test_the_declared_scikit_learn_floor_has_every_api_the_estimators_use():
    """pyproject.toml accepted scikit-learn 1.3, but the estimators import APIs added in
    1.6 (``import privlearn.models`` failed on 1.5 with an ImportError): the declared
    floor must be at least the version each API used says it was added in (its
    ``versionadded`` in scikit-learn's own docstring)."""
    import re
    import tomllib
    from pathlib import Path

    from sklearn.pipeline import Pipeline
    from sklearn.utils import get_tags
    from sklearn.utils.multiclass import type_of_target
    from sklearn.utils.validation import validate_data

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (req,) = [r for r in meta["project"]["dependencies"] if r.startswith("scikit-learn")]
    floor = tuple(int(p) for p in re.search(r">=\s*([\d.]+)", req)[1].split("."))
    used = {"validate_data": (validate_data.__doc__, r""),
            "get_tags": (get_tags.__doc__, r""),
            "Pipeline(transform_input=)": (Pipeline.__doc__, r"transform_input\b.*?"),
            "type_of_target(raise_unknown=)": (type_of_target.__doc__, r"raise_unknown\b.*?")}
    for api, (doc, lead) in used.items():
        m = re.search(lead + r"versionadded:: ([\d.]+)", doc, re.S)
        assert m, api
        added = tuple(int(p) for p in m[1].split("."))
        assert floor >= added, f"{req} but {api} was added in scikit-learn {m[1]}"
