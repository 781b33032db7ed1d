"""Differentially private scikit-learn estimators (NumPy only; never imports torch).

Each estimator takes ``epsilon`` and ``delta``, calibrates its own noise through
:mod:`privlearn.accounting` at ``fit`` time and exposes ``mechanism_`` (what ran) and
``epsilon_`` (the certified epsilon spent at ``delta_``).
"""

from privlearn.models.dpsgd import DPSGDClassifier, DPSGDRegressor
from privlearn.models.label_release import PATE, PrivateKNN
from privlearn.models.linear import AdaSSPRegressor, NoisyGDRegressor, SSPRegressor

__all__ = [
    "SSPRegressor",
    "AdaSSPRegressor",
    "NoisyGDRegressor",
    "DPSGDClassifier",
    "DPSGDRegressor",
    "PATE",
    "PrivateKNN",
]
