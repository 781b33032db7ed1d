"""What a fitted estimator may release, and the shareable label-release object.

The trust model (docs/trust-model.md): the person who calls ``fit`` / ``release`` sees
the private data anyway, so warnings and log messages addressed to them are fine.
Everything that leaves the call -- the fitted object, its attributes, its pickle, the
returned values -- is a *release* and must be covered by the accounted mechanism
(``mechanism_``, ``epsilon_``): each released value is either

* ``public``: a function of the constructor parameters, of public shapes (number of
  features, number of public queries) or of other public values only;
* ``noisy``: post-processing of the noisy output of the accounted mechanism (costs no
  further privacy, Dwork & Roth 2014, Prop. 2.1);
* ``accountant``: the accountant's evaluation of ``mechanism_`` (a function of public
  parameters, hence public).

The one exception is :class:`~privlearn.models.PrivateKNN`'s fitted object, which must
hold the private training set to answer queries (category ``held-private``); it is
never to be shared. What it releases is available separately as a
:class:`LabelRelease` (:meth:`~privlearn.models.PrivateKNN.public_release`).

:data:`RELEASED_ATTRIBUTES` is the single allow-list: tests/models/test_release.py walks
every estimator and release object and fails on any attribute not listed here, and the
table in docs/trust-model.md is generated from it (:func:`attribute_table_markdown`).

References
----------
.. [1] C. Dwork, A. Roth (2014), The algorithmic foundations of differential privacy,
       Prop. 2.1 (post-processing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from privlearn.accounting import Mechanism
from privlearn.errors import DataClippedWarning, ParameterValueError

__all__ = [
    "RELEASED_ATTRIBUTES",
    "CATEGORIES",
    "LabelRelease",
    "DataClippedWarning",
    "attribute_table_markdown",
]

#: The categories of :data:`RELEASED_ATTRIBUTES`, with their meaning.
CATEGORIES = MappingProxyType(
    {
        "public": "a function of constructor parameters and public shapes only",
        "noisy": "post-processing of the accounted mechanism's noisy output",
        "accountant": "the accountant's evaluation of the (public) mechanism description",
        "held-private": "the private data itself: the object must never be shared",
    }
)


_COEF = ("noisy", "post-processing of the noisy release (the model)")
_MECH = ("public", "description of what ran: built from the calibrated, public parameters")
_EPS = ("accountant", "the accountant's certified epsilon for mechanism_ at delta_")
_DELTA = ("public", "the delta parameter")
_NFEAT = ("public", "number of columns of X: public shape")
_FNAMES = ("public", "column names of a DataFrame X: public schema")

_LINEAR_COMMON = {
    "coef_": _COEF,
    "intercept_": ("noisy", "post-processing of the noisy release, plus the public label "
                            "midpoint when y_bound is an interval and fit_intercept=True"),
    "mechanism_": _MECH,
    "epsilon_": _EPS,
    "delta_": _DELTA,
    "n_features_in_": _NFEAT,
    "feature_names_in_": _FNAMES,
}

_SSP = {
    **_LINEAR_COMMON,
    "noise_scale_": ("public", "calibrated from epsilon, delta, budget_split, accountant"),
}

_NOISYGD = {
    **_LINEAR_COMMON,
    "noise_multiplier_": ("public", "the parameter, or calibrated from epsilon, delta, n_iter"),
    "n_iter_": ("public", "the parameter, or calibrated from epsilon, delta, noise_multiplier"),
    "smoothness_": ("noisy", "noisy upper bound on lambda_max(X^T X), a Gaussian release "
                             "composed into mechanism_ (smoothness='private', default); the "
                             "float given; or x_bound^2 n / exact lambda_max with a "
                             "PrivacyLeakWarning ('public' / 'data'); None if unused"),
    "learning_rate_": ("noisy", "the parameter, or computed from smoothness_ and public "
                                "parameters"),
    "path_iterations_": ("public", "iteration counts from n_iter_ and log_every"),
    "coef_path_": ("noisy", "iterates of noisy GD: all covered by the composition"),
    "intercept_path_": ("noisy", "iterates of noisy GD: all covered by the composition"),
    "epsilon_path_": ("accountant", "epsilon after each logged iteration count"),
}

_DPSGD = {
    **_LINEAR_COMMON,
    "intercept_": _COEF,
    "noise_multiplier_": ("public", "the parameter, or calibrated from epsilon, delta, "
                                    "sampling_rate, n_iter"),
    "n_iter_": ("public", "the n_iter parameter"),
    "trajectory_steps_": ("public", "step counts from n_iter and trajectory_points"),
    "epsilon_trajectory_": ("accountant", "epsilon after each listed step count"),
    "coef_path_": ("noisy", "iterates of DP-SGD: all covered by the composition"),
    "intercept_path_": ("noisy", "iterates of DP-SGD: all covered by the composition"),
}

_LABEL = {
    "labels_": ("noisy", "noisy argmax of the last release call"),
    "noisy_votes_": ("noisy", "noisy vote vectors of the last release call"),
    "noise_multiplier_": ("public", "the parameter, or calibrated from epsilon, delta and "
                                    "the number of public queries"),
    "mechanism_": ("public", "composition of every release since the account started"),
    "last_mechanism_": ("public", "the last release call's own mechanism"),
    "epsilon_": ("accountant", "epsilon of mechanism_ (everything released so far)"),
    "last_epsilon_": ("accountant", "epsilon of last_mechanism_ alone"),
    "delta_": _DELTA,
    "n_queries_": ("public", "total number of public queries released so far"),
    "_releases": ("noisy", "the LabelRelease of every call so far (noisy labels and votes)"),
}

#: Every attribute a fitted / released object may carry beyond its constructor
#: parameters, by class name: ``{attribute: (category, reason)}`` (see :data:`CATEGORIES`).
RELEASED_ATTRIBUTES = MappingProxyType(
    {
        "SSPRegressor": MappingProxyType(_SSP),
        "AdaSSPRegressor": MappingProxyType(
            {**_SSP, "ridge_": ("noisy", "computed from the noisy lambda_min release and "
                                         "public parameters")}
        ),
        "NoisyGDRegressor": MappingProxyType(_NOISYGD),
        "DPSGDClassifier": MappingProxyType(
            {**_DPSGD,
             "classes_": ("public", "the classes parameter; when inferred from y a "
                                    "PrivacyLeakWarning is emitted"),
             "coef_": ("noisy", "post-processing of the noisy release (the model): "
                                "(n_features,) for two classes, (K, n_features) for K >= 3"),
             "intercept_": ("noisy", "post-processing of the noisy release (the model): a "
                                     "float for two classes, (K,) for K >= 3"),
             "coef_path_": ("noisy", "iterates of DP-SGD: all covered by the composition "
                                     "((T, K, n_features) for K >= 3)"),
             "intercept_path_": ("noisy", "iterates of DP-SGD: all covered by the composition "
                                          "((T, K) for K >= 3)")}
        ),
        "DPSGDRegressor": MappingProxyType(_DPSGD),
        "PATE": MappingProxyType(
            {**_LABEL, "n_classes_": ("public", "the n_classes argument or the soft votes' "
                                                "last dimension (public output size)")}
        ),
        "PrivateKNN": MappingProxyType(
            {
                **_LABEL,
                "classes_": ("public", "the classes parameter; when inferred from y a "
                                       "PrivacyLeakWarning is emitted"),
                "n_features_in_": _NFEAT,
                "feature_names_in_": _FNAMES,
                "_X": ("held-private", "the private features (needed to answer queries)"),
                "_y": ("held-private", "the private labels (needed to answer queries)"),
                "_sqnorm": ("held-private", "squared norms of the private features"),
            }
        ),
        "PrivateStandardScaler": MappingProxyType(
            {
                "mean_": ("noisy", "clipped mean from the Gaussian moment release"),
                "var_": ("noisy", "clipped variance from the Gaussian moment release, "
                                  "floored (post-processing)"),
                "scale_": ("noisy", "square root of var_"),
                "bounds_": ("noisy", "clipping bounds read off the noisy histogram (or the "
                                     "public feature_range)"),
                "n_samples_seen_": ("noisy", "the noisy count of the moment release"),
                "noise_multiplier_": ("public", "calibrated from epsilon and delta"),
                "mechanism_": _MECH,
                "epsilon_": _EPS,
                "delta_": _DELTA,
                "n_features_in_": _NFEAT,
                "feature_names_in_": _FNAMES,
            }
        ),
        "PublicRangeScaler": MappingProxyType(
            {
                "n_features_in_": _NFEAT,
                "feature_names_in_": _FNAMES,
            }
        ),
        "PrivatePipeline": MappingProxyType(
            {
                "mechanism_": ("public", "composition of the steps' mechanism_"),
                "epsilon_": _EPS,
                "delta_": ("public", "the delta parameter, or the sum of the steps' delta_"),
            }
        ),
        "PrivateSearchCV": MappingProxyType(
            {
                "best_estimator_": ("noisy", "the released run's fitted model (its own "
                                             "attributes are listed under its class)"),
                "best_params_": ("noisy", "the selected candidate: output of the private "
                                          "selection"),
                "best_score_": ("noisy", "the selected run's score (accuracy or minus "
                                         "the MSE) from its noisy clipped loss sum over "
                                         "its noisy row count"),
                "n_fits_": ("public", "composition only: the grid size"),
                "runs_": ("public", "composition only: every candidate, in grid order"),
                "scores_": ("noisy", "composition only: every run's noisy score, all "
                                     "composed into mechanism_"),
                "fit_mechanisms_": ("public", "composition only: each fit's mechanism_"),
                "mechanism_": ("public", "the whole search: composition of every run, or "
                                         "`RepeatAndSelect(run, expected_runs, eta)`, "
                                         "Papernot & Steinke's selection (its "
                                         "(epsilon, delta) conversion on a PLD budget)"),
                "epsilon_": _EPS,
                "delta_": _DELTA,
                "n_features_in_": _NFEAT,
                "feature_names_in_": _FNAMES,
            }
        ),
        "LabelRelease": MappingProxyType(
            {
                "labels": ("noisy", "noisy argmax of every release call, concatenated"),
                "noisy_votes": ("noisy", "the noisy vote vectors, concatenated"),
                "classes": ("public", "the public label set (see the estimator's classes_)"),
                "mechanism": ("public", "composition of the included releases"),
                "epsilon": ("accountant", "epsilon of mechanism at delta"),
                "delta": _DELTA,
                "accountant": ("public", "the accountant parameter"),
            }
        ),
    }
)

def _frozen_array(a) -> np.ndarray:
    out = np.array(a, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class LabelRelease:
    """Everything a label-release object has released, safe to pickle and share.

    Holds only noisy outputs and public values (see :data:`RELEASED_ATTRIBUTES`): the
    noisy labels and vote vectors of every ``release`` call since the account started,
    concatenated in query order, and the composition of their mechanisms with its
    epsilon. Arrays are read-only copies.

    Attributes
    ----------
    labels : ndarray (n_queries,)
    noisy_votes : ndarray (n_queries, n_classes)
    classes : ndarray (n_classes,)
        Column ``j`` of ``noisy_votes`` is the vote for ``classes[j]``.
    mechanism : Mechanism
        Composition of every included release.
    epsilon : float
        Certified epsilon of ``mechanism`` at ``delta`` (by ``accountant``).
    delta : float
    accountant : str
    """

    labels: np.ndarray
    noisy_votes: np.ndarray
    classes: np.ndarray
    mechanism: Mechanism
    epsilon: float
    delta: float
    accountant: str = field(default="pld")

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen_array(self.labels))
        object.__setattr__(self, "noisy_votes", _frozen_array(self.noisy_votes))
        object.__setattr__(self, "classes", _frozen_array(self.classes))
        if self.noisy_votes.ndim != 2 or self.noisy_votes.shape[0] != self.labels.shape[0]:
            raise ParameterValueError(
                f"noisy_votes must have shape (n_queries, n_classes) = "
                f"({self.labels.shape[0]}, ...), got {self.noisy_votes.shape}"
            )

    @property
    def n_queries(self) -> int:
        return int(self.labels.shape[0])


def attribute_table_markdown() -> str:
    """The Markdown table of :data:`RELEASED_ATTRIBUTES` (as in docs/trust-model.md)."""
    lines = [
        "| object | attribute | category | why it may be released |",
        "| --- | --- | --- | --- |",
    ]
    for cls, attrs in RELEASED_ATTRIBUTES.items():
        for name in sorted(attrs):
            cat, why = attrs[name]
            lines.append(f"| `{cls}` | `{name}` | {cat} | {why} |")
    return "\n".join(lines) + "\n"

