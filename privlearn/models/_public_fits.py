"""Which public steps a :class:`~privlearn.models.PrivatePipeline` may fit on the private
data: one allow-list, the single owner of that privacy rule.

``PrivatePipeline.fit`` fits every step on the data it is given, the steps listed in
``public_steps`` included, and their fitted attributes are released with the pipeline
un-noised. Listing a step there is therefore allowed only when what its fit learns is a
function of its parameters and the public schema of the data (the number of columns,
their names and dtypes), never of the values: a ``StandardScaler`` would release the
exact column means, a ``PCA`` the exact principal directions, a ``TargetEncoder`` each
category's mean label. Since a fit can learn from the data in ways no probe sees, the
rule is an allow-list, checked recursively through containers, and everything else is
refused (:class:`~privlearn.errors.ConfigurationError`) with what the step would learn
and what to use instead:

* a step whose scikit-learn tags say ``requires_fit=False`` (stateless:
  ``FunctionTransformer``, ``Normalizer``, ``Binarizer``, ...);
* a ``sklearn.frozen.FrozenEstimator`` (it keeps a fit made elsewhere, on public data);
* the entries of :data:`PUBLIC_FITS`, an exact class with the parameter conditions
  under which its fit reads the schema only (a subclass may learn more: not listed);
* ``ColumnTransformer``, ``Pipeline`` and ``FeatureUnion`` whose parts are all allowed,
  with columns selected by position, name, mask or ``make_column_selector`` (names and
  dtypes; any other callable selector is applied to the private data), and, for a
  ``ColumnTransformer``, an output format that its parameters fix (see
  :func:`_data_dependent_sparsity`).

A step fitted on public data is wrapped in ``FrozenEstimator``; a statistic of the
private data comes from a private step (``PrivateStandardScaler`` and its
``feature_range``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sklearn.base import OneToOneFeatureMixin
from sklearn.compose import ColumnTransformer, make_column_selector
from sklearn.frozen import FrozenEstimator
from sklearn.impute import MissingIndicator, SimpleImputer
from sklearn.pipeline import FeatureUnion, Pipeline
from sklearn.preprocessing import (
    OneHotEncoder,
    OrdinalEncoder,
    PolynomialFeatures,
    SplineTransformer,
)
from sklearn.random_projection import GaussianRandomProjection, SparseRandomProjection
from sklearn.utils import get_tags

from privlearn.errors import ConfigurationError

__all__ = ["PUBLIC_FITS", "PublicFit", "public_fit_refusal", "refuse_learning_public_fit"]


@dataclass(frozen=True)
class PublicFit:
    """One allowed class: ``learns(step)`` says what its fit would learn from the values
    under the step's parameters (None: nothing, its fit reads the schema only);
    ``parts(name, step)`` yields the ``(name, estimator)`` parts a container fits, each
    checked in turn; ``reads`` says what its fit does read."""

    cls: type
    reads: str
    learns: Callable[[Any], str | None] = lambda step: None
    parts: Callable[[str, Any], Iterator[tuple[str, Any]]] = lambda name, step: iter(())


def _categories(step: Any) -> str | None:
    """An encoder learns nothing from the values only with the category lists given and
    no grouping of infrequent categories (learned from their counts)."""
    if isinstance(step.categories, str):
        return (
            f"has categories={step.categories!r}: it learns its categories (its "
            "fitted categories_, and the columns it outputs) from the values that "
            "occur in the data. Pass the public category lists, one per column, from "
            f"the schema or a data dictionary: {type(step).__name__}(categories=[[...], "
            "...])"
        )
    for attr in ("min_frequency", "max_categories"):
        if getattr(step, attr, None) is not None:
            return (
                f"has {attr}={getattr(step, attr)!r}: which categories are grouped "
                "as infrequent is learned from their counts in the data. Leave "
                f"{attr}=None"
            )
    return None


def _imputation(step: Any) -> str | None:
    if step.strategy != "constant":
        return (
            f"has strategy={step.strategy!r}: its statistics_ are the exact "
            f"{step.strategy} values of the private columns. Pass strategy='constant' "
            "with a public fill_value and keep_empty_features=True"
        )
    if not step.keep_empty_features:
        return (
            "has keep_empty_features=False: it drops every column without an observed "
            "value in the private data (its statistics_ hold NaN there, and it outputs "
            "one column fewer), so one record, the only value of a column, decides its "
            "fit and the width the next step sees. Pass keep_empty_features=True (the "
            "fill_value then fills such a column too)"
        )
    if step.add_indicator:
        return (
            "has add_indicator=True: its indicator learns which columns hold a "
            "missing value (features_, and so its number of output columns). Add "
            "MissingIndicator(features='all') beside it instead (one indicator per "
            "column)"
        )
    return None


def _indicator(step: Any) -> str | None:
    if step.features != "all":
        return (
            f"has features={step.features!r}: it learns which columns hold a missing "
            "value in the private data (features_, and so its number of output "
            "columns). Pass features='all' (one indicator per column)"
        )
    return None


def _projection(step: Any) -> str | None:
    if isinstance(step.n_components, str):
        return (
            f"has n_components={step.n_components!r}: its number of components is "
            "computed from the number of rows (Johnson-Lindenstrauss), which changes "
            "by one between neighbouring data sets. Pass an integer n_components"
        )
    return None


def _knots(step: Any) -> str | None:
    if isinstance(step.knots, str):
        return (
            f"has knots={step.knots!r}: it places its knots at the "
            f"{'quantiles' if step.knots == 'quantile' else 'minimum and maximum'} of "
            "each private column (the fitted bsplines_). Pass the public knot "
            "positions: knots=<array of shape (n_knots, n_features)>"
        )
    return None


def _columns(step: Any) -> str | None:
    for sub, _trans, cols in step.transformers:
        # make_column_selector reads the column names and dtypes only (the schema)
        if callable(cols) and type(cols) is not make_column_selector:
            return (
                f"selects the columns of {sub!r} with a callable, which it applies to "
                "the private data. Give the columns by position, name or boolean "
                "mask"
            )
    return _data_dependent_sparsity(step)


def _data_dependent_sparsity(ct: Any) -> str | None:
    """A fitted ``ColumnTransformer`` with a sparse block returns a sparse matrix (and
    records ``sparse_output_ = True``) when the density of its output, the non-zero
    entries of its sparse blocks over all entries, is below ``sparse_threshold``. A
    ``OneHotEncoder`` with ``sparse_output=True`` has one non-zero per row and column
    only with ``drop=None`` and ``handle_unknown="error"``; otherwise a record in the
    dropped category or with an unknown value has none, so the density counts private
    values and one record can move it across the threshold: ``sparse_output_`` and the
    type of matrix the next step gets then differ between neighbouring data sets. With
    ``sparse_threshold > 0`` every transformer it holds must therefore have a fixed
    output format: dense (``OrdinalEncoder``, one-to-one transformers,
    ``OneHotEncoder(sparse_output=False)``) or that one-hot encoding."""
    if not ct.sparse_threshold > 0:
        return None
    for key, est in ct.get_params(deep=True).items():
        if isinstance(est, type) or not hasattr(est, "fit"):
            continue  # a parameter value, "drop" or "passthrough"
        if isinstance(est, ColumnTransformer | FeatureUnion | Pipeline):
            continue  # a container: its transformers are among the items
        if isinstance(est, OneHotEncoder):
            if not est.sparse_output or (est.drop is None and est.handle_unknown == "error"):
                continue
            what = (
                "OneHotEncoder, sparse_output=True, "
                + (
                    f"drop={est.drop!r}"
                    if est.drop is not None
                    else f"handle_unknown={est.handle_unknown!r}"
                )
                + "), whose number of non-zero entries depends on the values (rows in "
                "the dropped category or with an unknown value have none"
            )
        elif isinstance(est, OrdinalEncoder | OneToOneFeatureMixin):
            continue  # dense output for the dense X a pipeline is given
        else:
            what = (
                f"{type(est).__name__}), which may return a sparse matrix whose number "
                "of non-zero entries depends on the values"
            )
        return (
            f"has sparse_threshold={ct.sparse_threshold!r} and holds {key} ({what}): "
            "whether it returns a sparse or a dense matrix, and its fitted "
            "sparse_output_, would follow the private data. Pass sparse_threshold=0 "
            "(always dense); or use OneHotEncoder(sparse_output=False), or drop=None "
            "with handle_unknown='error'"
        )
    return None


def _column_parts(name: str, step: Any) -> Iterator[tuple[str, Any]]:
    for sub, trans, _cols in step.transformers:
        yield f"{name}__{sub}", trans
    yield f"{name}__remainder", step.remainder


#: The allowed classes (exact types) and the conditions under which their fit learns
#: nothing from the values. Anything else that needs fitting is refused.
PUBLIC_FITS: tuple[PublicFit, ...] = (
    PublicFit(
        OneHotEncoder,
        "its categories from its parameter, its input width from the schema",
        _categories,
    ),
    PublicFit(OrdinalEncoder, "its categories from its parameter", _categories),
    PublicFit(
        SimpleImputer, "the constant fill_value (statistics_) and the input dtype", _imputation
    ),
    PublicFit(MissingIndicator, "one indicator per column (features='all')", _indicator),
    PublicFit(PolynomialFeatures, "the number of input columns only (powers_)"),
    PublicFit(SplineTransformer, "the knots given (bsplines_)", _knots),
    PublicFit(
        GaussianRandomProjection,
        "a random matrix of the number of input columns and n_components",
        _projection,
    ),
    PublicFit(
        SparseRandomProjection,
        "a random matrix of the number of input columns and n_components",
        _projection,
    ),
    PublicFit(
        ColumnTransformer,
        "its parts' fits, on columns chosen from the schema",
        _columns,
        _column_parts,
    ),
    PublicFit(
        Pipeline,
        "its steps' fits",
        parts=lambda name, step: ((f"{name}__{sub}", est) for sub, est in step.steps),
    ),
    PublicFit(
        FeatureUnion,
        "its parts' fits",
        parts=lambda name, step: ((f"{name}__{sub}", est) for sub, est in step.transformer_list),
    ),
)

_BY_CLASS = {entry.cls: entry for entry in PUBLIC_FITS}

#: What a commonly listed, refused step would learn, and its private counterpart.
_LEARNS = {
    "StandardScaler": "the exact mean and variance of every column (mean_, var_)",
    "MinMaxScaler": "the exact minimum and maximum of every column (data_min_, data_max_)",
    "MaxAbsScaler": "the exact largest absolute value of every column (max_abs_)",
    "RobustScaler": "the exact median and quantiles of every column (center_, scale_)",
    "QuantileTransformer": "the exact quantiles of every column (quantiles_)",
    "PowerTransformer": "the transformation fitted to every column (lambdas_)",
    "KBinsDiscretizer": "bin edges from the values of every column (bin_edges_)",
    "PCA": "the exact principal directions and variances of the data (components_, "
    "mean_, explained_variance_)",
    "TruncatedSVD": "the exact singular vectors of the data (components_)",
    "TargetEncoder": "each category's mean label, from the private labels y "
    "(encodings_, target_mean_)",
    "KNNImputer": "the rows it is fitted on, to impute from (_fit_X)",
    "KMeans": "cluster centres computed from the rows (cluster_centers_)",
}


def _refusal(where: str, step: Any, why: str, instead: str = "") -> ConfigurationError:
    return ConfigurationError(
        f"public step {where!r} ({type(step).__name__}) is fitted by the PrivatePipeline on "
        f"the private data it is given, and {why}; its fitted attributes would be "
        "released with the pipeline un-noised, and listing it in public_steps does not "
        f"make them public (nothing was fitted).{instead} A step fitted on public data is "
        f"kept as it is when wrapped: sklearn.frozen.FrozenEstimator("
        f"{type(step).__name__}(...).fit(X_public))"
    )


def _unlisted(where: str, step: Any) -> ConfigurationError:
    kind = type(step).__name__
    learns = _LEARNS.get(kind)
    why = (
        f"it would learn {learns}"
        if learns is not None
        else "its fit is not known to learn nothing from the values (the public steps a "
        "pipeline may fit are listed in privlearn.models._public_fits: encoders with "
        "the category lists given, constant imputation, polynomial features, random "
        "projections, stateless transformers and containers of them)"
    )
    instead = ""
    if kind in ("StandardScaler", "MinMaxScaler", "MaxAbsScaler", "RobustScaler"):
        instead = (
            " Use its private counterpart instead: a PrivateStandardScaler step (not in "
            "public_steps) with feature_range=(lower, upper) per column from public "
            "knowledge."
        )
    if kind in ("MinMaxScaler", "MaxAbsScaler"):
        instead += (
            " Or, to scale by the public ranges alone, a PublicRangeScaler(bounds=(lower, "
            "upper)) step: its fit reads the number of columns only, and it costs nothing."
        )
    return _refusal(where, step, why, instead)


def public_fit_refusal(name: str, step: Any) -> ConfigurationError | None:
    """The refusal of a public step that the pipeline fits (``name`` is in
    ``public_steps``), or None when its fit provably learns nothing from the values of
    the data (the allow-list of this module, through containers): the error names the
    step (``outer__inner`` inside a container), what it would learn from the private
    data, and what to do instead."""
    if step is None or isinstance(step, str) or isinstance(step, FrozenEstimator):
        return None  # "passthrough", "drop"; a fit kept from elsewhere
    entry = _BY_CLASS.get(type(step))
    if entry is None:
        return None if not get_tags(step).requires_fit else _unlisted(name, step)
    why = entry.learns(step)
    if why is not None:
        return _refusal(name, step, why)
    for where, part in entry.parts(name, step):
        refusal = public_fit_refusal(where, part)
        if refusal is not None:
            return refusal
    return None


def refuse_learning_public_fit(name: str, step: Any) -> None:
    """Raise :func:`public_fit_refusal`'s :class:`~privlearn.errors.ConfigurationError`,
    if any."""
    refusal = public_fit_refusal(name, step)
    if refusal is not None:
        raise refusal
