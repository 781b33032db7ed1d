"""scikit-learn API conformance of the private estimators (check_estimator suite)."""

from sklearn.utils.estimator_checks import parametrize_with_checks

from privlearn.models import (
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    SSPRegressor,
)

_NOISY_FIT = (
    "requires R^2 > 0.5 on ~200 unbounded, standardised samples: a private estimator's "
    "noise is calibrated to the worst case over the bounded domain, so at epsilon=1 with "
    "n=200 the released coefficients are noise-dominated (utility is tested on real data "
    "in test_linear.py instead)"
)

ESTIMATORS = [
    SSPRegressor(random_state=0),
    AdaSSPRegressor(random_state=0),
    NoisyGDRegressor(noise_multiplier=50.0, random_state=0),
    DPSGDClassifier(n_iter=50, random_state=0),
    DPSGDRegressor(n_iter=50, random_state=0),
]


def _expected_failed_checks(est):
    if isinstance(est, SSPRegressor | NoisyGDRegressor):
        return {"check_regressors_train": _NOISY_FIT}
    return {}


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed_checks)
def test_sklearn_compatible(estimator, check):
    check(estimator)
