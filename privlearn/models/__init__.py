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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Where each public name is defined. The estimators subclass scikit-learn's
#: ``BaseEstimator``, whose import takes most of a second: the submodules are imported
#: when a name is first used, so that code needing only the release kernels
#: (``privlearn.models._ssp``, ``privlearn.models._gd``: the linear-regression
#: experiment) does not pay for it.
_HOMES = {
    "PrivateEstimator": "base",
    "ReleasePlan": "base",
    "SSPRegressor": "linear",
    "AdaSSPRegressor": "linear",
    "NoisyGDRegressor": "linear",
    "DPSGDClassifier": "dpsgd",
    "DPSGDRegressor": "dpsgd",
    "PATE": "label_release",
    "PrivateKNN": "label_release",
    "LabelRelease": "_release",
    "DataClippedWarning": "_release",
    "PrivateStandardScaler": "preprocessing",
    "PublicRangeScaler": "_public_scaler",
    "PrivatePipeline": "preprocessing",
    "PrivateSearchCV": "model_selection",
}

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
    "PublicRangeScaler",
    "PrivatePipeline",
    "PrivateSearchCV",
]

if TYPE_CHECKING:
    from privlearn.models._public_scaler import PublicRangeScaler
    from privlearn.models._release import DataClippedWarning, LabelRelease
    from privlearn.models.base import PrivateEstimator, ReleasePlan
    from privlearn.models.dpsgd import DPSGDClassifier, DPSGDRegressor
    from privlearn.models.label_release import PATE, PrivateKNN
    from privlearn.models.linear import AdaSSPRegressor, NoisyGDRegressor, SSPRegressor
    from privlearn.models.model_selection import PrivateSearchCV
    from privlearn.models.preprocessing import PrivatePipeline, PrivateStandardScaler


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
