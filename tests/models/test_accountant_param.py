"""An accountant parameter that is not a name nor an Accountant is refused naming it.

SSP, AdaSSP and NoisyGD cache their calibration by its arguments: ``accountant=["pld"]``
(a list, as a grid value written one level too deep) reached the cache as a bare
``TypeError`` ("unhashable type: 'list'"); the other estimators refused it typed. And
``DPSGDClassifier(trajectory_accountant=...)``'s refusal said ``accountant``.
"""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.ledger import Ledger
from privlearn.models import (
    AdaSSPRegressor,
    DPSGDClassifier,
    NoisyGDRegressor,
    PrivateStandardScaler,
    SSPRegressor,
)

RNG = np.random.default_rng(0)
X = RNG.uniform(-1.0, 1.0, size=(80, 2)) / 2.0
Y = X @ [0.3, -0.2]

MAKERS = {
    "SSPRegressor": (SSPRegressor, "accountant", Y),
    "AdaSSPRegressor": (AdaSSPRegressor, "accountant", Y),
    "NoisyGDRegressor": (NoisyGDRegressor, "accountant", Y),
    "DPSGDClassifier": (
        lambda **kw: DPSGDClassifier(n_iter=3, classes=[0, 1], **kw),
        "trajectory_accountant",
        (Y > 0).astype(int),
    ),
    "PrivateStandardScaler": (
        lambda **kw: PrivateStandardScaler(feature_range=(-1, 1), **kw),
        "accountant",
        None,
    ),
}


@pytest.mark.parametrize("value", [["pld"], {"pld": 1}, 3])
@pytest.mark.parametrize("name", list(MAKERS))
def test_an_accountant_that_is_not_one_is_refused_naming_the_parameter(name, value, tmp_path):
    make, param, y = MAKERS[name]
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-4)
    est = make(**{param: value}, ledger=led.budget("d"))
    with pytest.raises(ParameterTypeError, match=rf"^{param} must be a name"):
        est.fit(X, y)
    assert led.spent("d").entries == 0


@pytest.mark.parametrize("name", list(MAKERS))
def test_an_unknown_accountant_name_is_refused_naming_the_parameter(name):
    make, param, y = MAKERS[name]
    with pytest.raises(ParameterValueError, match=rf"^{param} must be one of"):
        make(**{param: "nope"}).fit(X, y)
