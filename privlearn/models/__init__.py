"""Differentially private scikit-learn estimators (NumPy only; never imports torch).

Each estimator takes ``epsilon`` and ``delta``, calibrates its own noise through
:mod:`privlearn.accounting` at ``fit`` time and exposes ``mechanism_`` (what ran) and
``epsilon_`` (the certified epsilon spent at ``delta_``). They share one public base,
:class:`PrivateEstimator`, which owns the pipeline validate -> plan
(:class:`ReleasePlan`) -> reserve on the ledger -> release -> settle.

Trust model (docs/trust-model.md): everything that leaves ``fit`` / ``release`` -- the
fitted object, its parameters, its attributes, its pickle, returned values -- is a
release covered by ``mechanism_``; :data:`~privlearn.models._release.RELEASED_ATTRIBUTES`
lists every attribute and why it may be released, and nothing released carries a seed
or generator state that would regenerate the noise (unless the user fixed
``random_state``). The exception is a fitted :class:`PrivateKNN`, which holds the
private data; share its :meth:`PrivateKNN.public_release` instead.
"""

from privlearn.models._release import DataClippedWarning, LabelRelease
from privlearn.models.base import PrivateEstimator, ReleasePlan
from privlearn.models.dpsgd import DPSGDClassifier, DPSGDRegressor
from privlearn.models.label_release import PATE, PrivateKNN
from privlearn.models.linear import AdaSSPRegressor, NoisyGDRegressor, SSPRegressor
from privlearn.models.model_selection import PrivateSearchCV
from privlearn.models.preprocessing import PrivatePipeline, PrivateStandardScaler

__all__ = [
    "PrivateEstimator",
    "ReleasePlan",
    "SSPRegressor",
    "AdaSSPRegressor",
    "NoisyGDRegressor",
    "DPSGDClassifier",
    "DPSGDRegressor",
    "PATE",
    "PrivateKNN",
    "LabelRelease",
    "DataClippedWarning",
    "PrivateStandardScaler",
    "PrivatePipeline",
    "PrivateSearchCV",
]
