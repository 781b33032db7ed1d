"""Typed errors for keywords that users of scikit-learn or of the other private estimators
naturally pass to a meta-estimator that does not take them.

Every private estimator takes ``epsilon=`` and ``ledger=``, so a :class:`PrivatePipeline`
is naturally given them too; ``GridSearchCV`` takes ``cv=`` and ``scoring=``, so
:class:`PrivateSearchCV` is. Python's bare ``TypeError`` ("unexpected keyword argument")
does not say where they go or what to do instead. The decorator keeps ``__init__``'s
signature (``functools.wraps``), which scikit-learn's ``get_params`` reads.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

from privlearn.errors import ParameterTypeError

PIPELINE_KEYWORDS = {
    "ledger": (
        "each private step spends on its own ledger: pass the budget to every private "
        "step (PrivateStandardScaler(..., ledger=budget), AdaSSPRegressor(..., "
        "ledger=budget)); the pipeline then refuses, before its first step reads the "
        "data, a fit whose steps together would exceed the budget"
    ),
    "epsilon": (
        "each private step takes its own epsilon and the pipeline's epsilon_ after fit "
        "is their composition (at most their sum): split your target between the "
        "steps (e.g. 0.25 to the scaler, 0.75 to the model), or choose the split "
        "privately with PrivateSearchCV"
    ),
}

_NO_FOLDS = (
    "the private search does not cross-validate: each run is scored once, with noise, on "
    "the training rows (minus the mean squared error for a regressor, accuracy for a "
    "classifier; score_epsilon and loss_bound set the noise, and the cost is accounted), "
    "or on public validation data passed as fit(X, y, X_val=..., y_val=...); evaluate "
    "the released model on held-out rows with search.score"
)
SEARCH_KEYWORDS = {
    "cv": _NO_FOLDS,
    "scoring": _NO_FOLDS,
    "n_jobs": (
        "the private search fits its runs one after another in this process; to shorten "
        "it, lower expected_runs (random stopping) or search a smaller grid, and "
        "verbose=1 shows its progress"
    ),
    "refit": (
        "the released model is the best run as the search fitted it (best_estimator_), "
        "never refitted: a refit on the private data would be another release, charged "
        "again; the search's epsilon_ covers best_estimator_"
    ),
}


def refuse_keywords(where: Mapping[str, str]) -> Callable[[Callable], Callable]:
    """Wrap an ``__init__`` so that each keyword of ``where`` raises a
    :class:`~privlearn.errors.ParameterTypeError` naming it, the value received and
    ``where[keyword]`` (what to do instead); any other keyword reaches ``__init__``
    unchanged."""

    def decorate(init: Callable) -> Callable:
        @functools.wraps(init)
        def checked(self, *args, **kwargs):
            for name, instead in where.items():
                if name in kwargs:
                    raise ParameterTypeError(
                        f"{type(self).__name__} takes no {name}= "
                        f"(got {name}={kwargs[name]!r}); {instead}"
                    )
            return init(self, *args, **kwargs)

        return checked

    return decorate


def _bounds_instead(accepted: frozenset[str]) -> str:
    """What to pass instead of diffprivlib's bounds to a class whose constructor takes
    ``accepted``."""
    public = (", known from the schema or the domain, never read off the data (such a "
              "bound publishes the extreme records)")
    if "x_bound" in accepted:
        return ("pass x_bound (a public bound on each row's L2 norm) and y_bound (a public "
                "bound on the labels)" + public)
    if "feature_range" in accepted:
        return "pass feature_range (the public (lower, upper) range of the features)" + public
    if "max_grad_norm" in accepted:
        return ("this estimator clips each record's gradient to max_grad_norm, so it needs "
                "no bound on the data")
    if "estimator" in accepted:
        return "pass the bounds to the estimator it fits"
    return "this estimator needs no bound on the data"


def foreign_keywords(accepted: frozenset[str]) -> dict[str, str]:
    """The keywords that users of scikit-learn and diffprivlib pass to a private
    estimator whose constructor takes ``accepted`` and does not take them, each with why
    it is not taken and what to do instead (for :func:`refuse_keywords`)."""
    bounds = f"diffprivlib's name for its public bounds; {_bounds_instead(accepted)}"
    where = {
        "bounds": bounds,
        "bounds_X": bounds,
        "bounds_y": bounds,
        "data_norm": bounds,
        "class_weight": (
            "a class weight multiplies one record's contribution beyond the sensitivity "
            "the noise is calibrated to, and class_weight='balanced' is computed from the "
            "private label counts, a release nothing accounts: fit unweighted"
        ),
        "sample_weight": (
            "the private fits take no weights (fit refuses sample_weight too): the noise "
            "is calibrated to each record counting once"
        ),
        "warm_start": (
            "each fit is a new release from scratch: training on from a released model is "
            "a further release that its mechanism_ would not cover; fit once, with the "
            "whole number of iterations"
        ),
    }
    return {name: why for name, why in where.items() if name not in accepted}


def refuse_foreign_keywords(init: Callable) -> Callable:
    """``init`` (a private estimator's ``__init__``) wrapped by :func:`refuse_keywords`
    for the :func:`foreign_keywords` of its own signature; unwrapped when it takes any
    keyword (``**kwargs``)."""
    parameters = inspect.signature(init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return init
    return refuse_keywords(foreign_keywords(frozenset(parameters)))(init)
