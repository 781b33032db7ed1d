"""Declarative parameter constraints of the private estimators: every
constructor parameter of every estimator is declared, each declared constraint refuses a
wrong type (ParameterTypeError: a TypeError that is also a ValueError) and a wrong value
(ValueError) with the parameter's name in the message, and nothing is fitted when a
parameter is refused."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from estimators import ESTIMATOR_NAMES
from estimators import ESTIMATORS as ALL_ESTIMATORS

import privlearn.models as M
from privlearn._validation import ParameterTypeError
from privlearn.accounting import Gaussian, compose
from privlearn.models import DPSGDClassifier, NoisyGDRegressor, SSPRegressor
from privlearn.models.base import PrivateEstimator, resolve_noise_multiplier
from privlearn.models.constraints import (
    Boolean,
    Delta,
    Integer,
    Options,
    PublicClasses,
    Real,
    Seed,
    Unchecked,
)

# PrivatePipeline subclasses scikit-learn's Pipeline, whose parameters scikit-learn
# validates with its own declarative constraints.
NOT_DECLARED = {"PrivatePipeline"}
ESTIMATORS = [c for c in ALL_ESTIMATORS if c.__name__ not in NOT_DECLARED]


def test_every_estimator_is_declarative():
    assert {"SSPRegressor", "AdaSSPRegressor", "NoisyGDRegressor", "DPSGDClassifier",
            "DPSGDRegressor", "PATE", "PrivateKNN", "PrivateStandardScaler",
            "PrivateSearchCV", "PrivatePipeline"} <= ESTIMATOR_NAMES
    for cls in ESTIMATORS:
        assert issubclass(cls, PrivateEstimator), cls.__name__


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_every_constructor_parameter_is_declared(cls):
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert set(params) == set(cls._parameter_constraints), cls.__name__


def _bad_values(c):
    """(wrong type, wrong value) examples for a constraint (None where it has none)."""
    if isinstance(c, Real):
        bad_value = None
        if c.low is not None:
            bad_value = c.low - 1.0
        elif c.high is not None:
            bad_value = c.high + 1.0
        else:
            bad_value = math.nan
        return "abc", bad_value
    if isinstance(c, Integer):
        return 2.5, c.minimum - 1
    if isinstance(c, Options):
        return 3, "no-such-option"
    if isinstance(c, Boolean):
        return "yes", None
    if isinstance(c, Delta):
        return "abc", 1.5
    if isinstance(c, Seed):
        return "abc", -1
    if isinstance(c, PublicClasses):
        return 3, [0, math.nan]
    return None, None


def _instance(cls):
    required = {"PrivateSearchCV": dict(estimator=M.SSPRegressor(), param_grid={"epsilon": [1.0]})}
    return cls(**required.get(cls.__name__, {}))


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_each_constraint_refuses_wrong_types_and_values(cls):
    for name, c in cls._parameter_constraints.items():
        if isinstance(c, Unchecked):
            assert c.reason, f"{cls.__name__}.{name}: say where it is checked"
            continue
        wrong_type, wrong_value = _bad_values(c)
        est = _instance(cls)
        if wrong_type is not None:
            est.set_params(**{name: wrong_type}) if hasattr(est, "set_params") \
                else setattr(est, name, wrong_type)
            with pytest.raises(TypeError, match=name) as info:
                est._validate_params()
            assert isinstance(info.value, ParameterTypeError) and isinstance(info.value,
                                                                            ValueError)
        if wrong_value is not None:
            est = _instance(cls)
            setattr(est, name, wrong_value)
            with pytest.raises(ValueError, match=name) as info:
                est._validate_params()
            assert not isinstance(info.value, TypeError)
            assert repr(wrong_value)[:4] in str(info.value)  # the value received


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_defaults_are_valid(cls):
    _instance(cls)._validate_params()


def test_refused_parameter_fits_nothing():
    X, y = np.zeros((8, 2)), np.zeros(8)
    est = M.DPSGDRegressor(n_iter=2.5)
    with pytest.raises(TypeError, match="n_iter"):
        est.fit(X, y)
    assert not hasattr(est, "coef_") and not hasattr(est, "mechanism_")


def test_resolve_noise_multiplier_uses_given_or_calibrates():
    def mech(s):
        return compose(Gaussian(s), 10)

    sigma = resolve_noise_multiplier(None, mech, 1.0, 1e-5)
    assert mech(sigma).epsilon(1e-5) <= 1.0 and mech(sigma * 0.99).epsilon(1e-5) > 1.0
    assert resolve_noise_multiplier(2 * sigma, mech, 1.0, 1e-5) == 2 * sigma
    with pytest.raises(ValueError, match="spends epsilon.*leave noise_multiplier=None"):
        resolve_noise_multiplier(0.5 * sigma, mech, 1.0, 1e-5, describe="over 10 steps")


# --- parameter validation: name, range, value, suggestion ------------------------------

@pytest.mark.parametrize("make", [
    lambda v: SSPRegressor(epsilon=v),
    lambda v: NoisyGDRegressor(n_iter=v, noise_multiplier=None),
    lambda v: DPSGDClassifier(noise=v, classes=[0, 1]),
])
def test_wrong_types_raise_type_error_that_is_also_a_value_error(make):
    X, y = np.zeros((4, 2)), np.array([0.0, 1.0, 0.0, 1.0])
    with pytest.raises(TypeError, match="must be") as info:
        make([1]).fit(X, y)
    assert isinstance(info.value, ValueError)  # as scikit-learn's InvalidParameterError
    assert "[1]" in str(info.value)


def test_error_messages_name_range_value_and_suggest():
    X, y = np.zeros((4, 2)), np.array([0.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"epsilon must be in \(0, inf\).*-1.*typically"):
        SSPRegressor(epsilon=-1).fit(X, y)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\).*2.*e\.g\. 1e-6"):
        SSPRegressor(delta=2).fit(X, y)
    with pytest.raises(ValueError, match="noise must be one of.*'gausian'.*did you mean "
                                         "'gaussian'"):
        DPSGDClassifier(noise="gausian", classes=[0, 1]).fit(X, y)
    with pytest.raises(ValueError, match="smoothness must be one of.*'privat'.*did you mean"):
        NoisyGDRegressor(smoothness="privat").fit(X, y)
    with pytest.raises(ValueError, match=r"sampling_rate must be in \(0, 1\].*1.5.*Poisson"):
        DPSGDClassifier(sampling_rate=1.5, classes=[0, 1]).fit(X, y)


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_infinite_epsilon_is_refused_with_the_non_private_alternative(cls):
    """epsilon=inf (diffprivlib: a non-private fit) is refused before anything runs, and
    the message says where the non-private baseline is."""
    if "epsilon" not in cls._parameter_constraints:
        pytest.skip(f"{cls.__name__} has no epsilon of its own")
    with pytest.raises(ValueError, match=r"got inf.*non-private.*scikit-learn") as info:
        cls._parameter_constraints["epsilon"]("epsilon", math.inf)
    assert isinstance(info.value, M.base.ParameterValueError)
    if cls is SSPRegressor:
        X, y = np.zeros((4, 2)), np.array([0.0, 1.0, 0.0, 1.0])
        with pytest.raises(ValueError, match="non-private"):
            SSPRegressor(epsilon=math.inf).fit(X, y)


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_an_unknown_set_params_name_is_typed_and_sets_nothing(cls):
    """``set_params(warm_start=True)``, as for a scikit-learn estimator: a
    ParameterValueError (still a ValueError) naming it and saying why there is no warm
    start, and the valid names before it in the call are not set either (scikit-learn's
    set_params raised a plain ValueError after setting them)."""
    from privlearn.errors import ParameterValueError

    est = _instance(cls)
    before = est.get_params(deep=False)
    first = "delta"
    with pytest.raises(ParameterValueError, match=r"'warm_start'.*no warm start"):
        est.set_params(**{first: 0.5e-6, "warm_start": True})
    assert est.get_params(deep=False)[first] == before[first]
