"""The number of columns a public pipeline step outputs, without reading any data.

A private step's planned mechanism may depend on the number of features it is given (a
:class:`~privlearn.models.PrivateStandardScaler` adds noise to each column). Before a
:class:`~privlearn.models.PrivatePipeline` is fitted, the width of what a public encoding
step hands on must come from the step's parameters and the input's schema (its number of
columns and, for a DataFrame, their names) only: here from the category lists given to an
encoder, the columns given to a ``ColumnTransformer``, and so on. A step whose width would
be learned from the data (``OneHotEncoder(categories="auto")`` learns its categories from
the values that occur -- itself a release) is refused with what to pass instead.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
from sklearn.base import OneToOneFeatureMixin
from sklearn.utils import get_tags

from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = ["public_output_width", "refuse_data_dependent_fits", "refuse_learned_categories"]


def _unplannable(name: str, step: Any, why: str) -> ParameterTypeError:
    return ParameterTypeError(
        f"pipeline step {name!r} ({type(step).__name__}) changes the number of features, "
        f"and {why}, so the mechanisms of the private steps after it cannot be planned "
        "before the fit (planned_mechanism, PrivateSearchCV). Use public encoders whose "
        "output is fixed by their parameters: OneHotEncoder(categories=[[...], ...]) with "
        "the category lists of the schema (not learned from the data), a ColumnTransformer "
        "of them with columns given by position or name, steps that need no fitting "
        "(FunctionTransformer), or one-to-one transformers; or put the step last")


def _explicit_categories(name: str, step: Any, n: int | None) -> list:
    cats = step.categories
    if isinstance(cats, str):
        raise ParameterValueError(
            f"pipeline step {name!r} ({type(step).__name__}) has categories={cats!r}: it "
            "learns its categories from the values that occur in the data it is fitted on, "
            "so what it outputs and its fitted categories_ (released un-noised) depend on "
            "the private data, and its cost cannot be planned. Pass the public category "
            "lists, one per column, from the schema or a data dictionary: "
            f"{type(step).__name__}(categories=[[...], ...]) with "
            + (f"{n} list(s)" if n is not None else "one list per column"))
    cats = list(cats)
    bad = [i for i, c in enumerate(cats) if isinstance(c, str) or np.ndim(c) != 1]
    if bad:
        raise ParameterValueError(
            f"pipeline step {name!r} ({type(step).__name__}) has categories with entry "
            f"{bad[0]} = {cats[bad[0]]!r}: each entry must be the list of the public "
            "categories of one input column, e.g. categories=[['a', 'b'], [0, 1, 2]]; "
            "give every column its list (from the schema, not from the data)")
    if n is not None and len(cats) != n:
        raise ParameterValueError(
            f"pipeline step {name!r} ({type(step).__name__}) is given {len(cats)} category "
            f"list(s) for {n} input column(s); pass one list per column")
    for attr in ("min_frequency", "max_categories"):
        if getattr(step, attr, None) is not None:
            raise ParameterValueError(
                f"pipeline step {name!r} ({type(step).__name__}) has {attr}="
                f"{getattr(step, attr)!r}: which categories are grouped as infrequent is "
                f"learned from their counts in the data, so its output cannot be planned "
                f"(and reveals those counts). Leave {attr}=None")
    return cats


def _one_hot_width(name: str, step: Any, n: int) -> int:
    cats = _explicit_categories(name, step, n)
    sizes = [len(c) for c in cats]
    drop = step.drop
    if drop is None:
        return sum(sizes)
    if isinstance(drop, str) and drop == "first":
        return sum(s - 1 for s in sizes)
    if isinstance(drop, str) and drop == "if_binary":
        return sum(s - 1 if s == 2 else s for s in sizes)
    drops = list(drop)
    if len(drops) != n:
        raise ParameterValueError(
            f"pipeline step {name!r} (OneHotEncoder) has drop with {len(drops)} entries for "
            f"{n} input column(s)")
    return sum(s - (d is not None) for s, d in zip(sizes, drops, strict=True))


def _column_indices(name: str, ct: Any, cols: Any, n: int,
                    names: list[str] | None) -> list[int]:
    """The positions that a ``ColumnTransformer`` column specification selects, from the
    schema only (a callable selector would be applied to the data: refused)."""
    if callable(cols):
        raise _unplannable(name, ct, "a callable column selector (e.g. make_column_selector) "
                           "chooses its columns from the data it is given")
    if isinstance(cols, slice):
        if cols.start is None or isinstance(cols.start, numbers.Integral):
            return list(range(n))[cols]
        if names is None:
            raise _unplannable(name, ct, "it selects columns by name but X has no column "
                               "names (pass a DataFrame, or give positions)")
        lo, hi = names.index(cols.start), names.index(cols.stop) + 1
        return list(range(lo, hi))
    seq = [cols] if isinstance(cols, str | numbers.Integral) else list(np.asarray(cols).ravel())
    if not seq:
        return []
    if all(isinstance(c, bool | np.bool_) for c in seq):
        if len(seq) != n:
            raise ParameterValueError(
                f"pipeline step {name!r} (ColumnTransformer): a boolean column mask of "
                f"length {len(seq)} for {n} columns")
        return [i for i, keep in enumerate(seq) if keep]
    out = []
    for c in seq:
        if isinstance(c, numbers.Integral):
            out.append(int(c) % n if -n <= int(c) < n else int(c))
        elif isinstance(c, str):
            if names is None or c not in names:
                raise _unplannable(name, ct, f"it selects the column {c!r} by name, which "
                                   "X's column names do not hold")
            out.append(names.index(c))
        else:
            raise _unplannable(name, ct, f"its column specification {cols!r} is not "
                               "positions, names or a boolean mask")
    if any(not 0 <= i < n for i in out):
        raise ParameterValueError(
            f"pipeline step {name!r} (ColumnTransformer) selects column positions {cols!r} "
            f"out of range for X with {n} columns")
    return out


def public_output_width(name: str, step: Any, n: int, names: list[str] | None = None,
                        probe: Any = None) -> int:
    """The number of columns ``step`` outputs for an input of ``n`` columns (named
    ``names`` when ``X`` is a DataFrame), from its parameters and that schema only.

    ``probe(step, n)`` gives the width of a step that needs no fitting (applied to public,
    data-independent rows). Handled: ``"passthrough"``/``None`` and ``"drop"``,
    one-to-one transformers, ``OneHotEncoder`` / ``OrdinalEncoder`` with explicit
    categories, ``ColumnTransformer``, ``FeatureUnion`` and scikit-learn ``Pipeline`` of
    these, and steps that need no fitting. Anything else raises
    :class:`~privlearn.errors.ParameterTypeError` (its width would come from its fit on
    the data); ``categories="auto"`` raises :class:`~privlearn.errors.ParameterValueError`
    saying to pass the category lists.
    """
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import FeatureUnion, Pipeline
    from sklearn.preprocessing import OneHotEncoder, OrdinalEncoder

    if step is None or (isinstance(step, str) and step == "passthrough"):
        return n
    if isinstance(step, str) and step == "drop":
        return 0
    if isinstance(step, OneHotEncoder):
        return _one_hot_width(name, step, n)
    if isinstance(step, OrdinalEncoder):
        _explicit_categories(name, step, n)
        return n
    if isinstance(step, OneToOneFeatureMixin):
        return n
    if isinstance(step, ColumnTransformer):
        used: set[int] = set()
        width = 0
        for sub, trans, cols in step.transformers:
            idx = _column_indices(name, step, cols, n, names)
            used.update(idx)
            if not idx:  # scikit-learn skips a transformer given no column
                continue
            width += public_output_width(f"{name}__{sub}", trans, len(idx),
                                         [names[i] for i in idx] if names else None, probe)
        rest = [i for i in range(n) if i not in used]
        width += public_output_width(f"{name}__remainder", step.remainder, len(rest),
                                     [names[i] for i in rest] if names else None, probe)
        return width
    if isinstance(step, FeatureUnion):
        return sum(public_output_width(f"{name}__{sub}", t, n, names, probe)
                   for sub, t in step.transformer_list if not (isinstance(t, str)
                                                                and t == "drop"))
    if isinstance(step, Pipeline):
        for sub, t in step.steps:
            n = public_output_width(f"{name}__{sub}", t, n, names, probe)
            names = None
        return n
    if not get_tags(step).requires_fit and probe is not None:
        return probe(name, step, n)
    raise _unplannable(name, step, "its output width would be learned from the data it is "
                       "fitted on")


def refuse_learned_categories(name: str, step: Any) -> None:
    """Refuse (:class:`~privlearn.errors.ParameterValueError`) a public step that a
    pipeline fits on the data it is given and that holds an encoder learning its
    categories there (``OneHotEncoder`` / ``OrdinalEncoder`` with ``categories="auto"``,
    or grouping infrequent categories by ``min_frequency`` / ``max_categories``): its
    fitted ``categories_`` (and the columns it outputs) list the values that occur in
    the private data, a release that no mechanism covers and ``public_steps`` cannot
    make public."""
    from sklearn.preprocessing import OneHotEncoder, OrdinalEncoder

    found = [(name, step)]
    if hasattr(step, "get_params") and not isinstance(step, type):
        found += [(f"{name}__{k}", v) for k, v in step.get_params(deep=True).items()]
    for where, est in found:
        if isinstance(est, OneHotEncoder | OrdinalEncoder):
            _explicit_categories(where, est, None)


def refuse_data_dependent_fits(name: str, step: Any) -> None:
    """Refuse (:class:`~privlearn.errors.ParameterValueError`) a public step that a
    pipeline fits on the data it is given when what it learns there follows the private
    values: an encoder learning its categories (:func:`refuse_learned_categories`), or a
    ``ColumnTransformer`` whose choice between sparse and dense output would (see
    :func:`_refuse_data_dependent_sparsity`)."""
    refuse_learned_categories(name, step)
    _refuse_learned_imputation(name, step)
    _refuse_data_dependent_sparsity(name, step)


def _refuse_learned_imputation(name: str, step: Any) -> None:
    """An imputer that the pipeline fits learns from the private values: a
    ``SimpleImputer`` with a ``strategy`` other than ``"constant"`` its exact column
    means, medians or most frequent values (``statistics_``); a ``MissingIndicator``
    (or ``SimpleImputer(add_indicator=True)``) with ``features="missing-only"`` which
    columns hold a missing value (``features_``, and so the number of columns it
    outputs); a ``KNNImputer`` keeps the rows themselves. Refused with what to pass."""
    from sklearn.impute import KNNImputer, MissingIndicator, SimpleImputer

    found = [(name, step)]
    if hasattr(step, "get_params") and not isinstance(step, type):
        found += [(f"{name}__{k}", v) for k, v in step.get_params(deep=True).items()]
    for where, est in found:
        why = None
        if isinstance(est, KNNImputer):
            why = ("keeps the rows it is fitted on to impute from (the private data, in "
                   "the released pipeline). Impute with SimpleImputer(strategy='constant', "
                   "fill_value=<a public value>) instead")
        elif isinstance(est, SimpleImputer) and est.strategy != "constant":
            why = (f"has strategy={est.strategy!r}: its statistics_ are the exact "
                   f"{est.strategy} values of the private columns. Pass "
                   "strategy='constant' with a public fill_value")
        elif (isinstance(est, MissingIndicator) and est.features == "missing-only") or (
                isinstance(est, SimpleImputer) and est.add_indicator):
            why = ("learns which columns hold a missing value in the private data (its "
                   "indicator's features_, and so its number of output columns). Pass "
                   "MissingIndicator(features='all') (one indicator per column), or "
                   "add_indicator=False")
        if why is not None:
            raise ParameterValueError(
                f"pipeline step {where!r} ({type(est).__name__}) is fitted by the pipeline "
                f"on the data it is given and {why}; listing it in public_steps does not "
                "make what it learns public")


def _refuse_data_dependent_sparsity(name: str, step: Any) -> None:
    """A fitted ``ColumnTransformer`` with a sparse block returns a sparse matrix (and
    records ``sparse_output_ = True``) when the density of its output, the non-zero
    entries of its sparse blocks over all entries, is below ``sparse_threshold``. A
    ``OneHotEncoder`` with ``sparse_output=True`` has one non-zero per row and column
    only with ``drop=None`` and ``handle_unknown="error"``; otherwise a record in the
    dropped category or with an unknown value has none, so the density counts private
    values and one record can move it across the threshold: ``sparse_output_`` (in the
    released pipeline) and the type of matrix the next step gets (a private step refusing
    a sparse one) then differ between neighbouring data sets, a release that no
    mechanism covers. With ``sparse_threshold > 0`` every transformer it holds must
    therefore have a fixed output format: dense (``OrdinalEncoder``, one-to-one
    transformers, ``OneHotEncoder(sparse_output=False)``) or that one-hot encoding; any
    other (a ``FunctionTransformer``, whose function may return a sparse matrix of the
    values) is refused too."""
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import FeatureUnion, Pipeline
    from sklearn.preprocessing import OneHotEncoder, OrdinalEncoder

    found = [(name, step)]
    if hasattr(step, "get_params") and not isinstance(step, type):
        found += [(f"{name}__{k}", v) for k, v in step.get_params(deep=True).items()]
    for where, ct in found:
        if not isinstance(ct, ColumnTransformer) or not ct.sparse_threshold > 0:
            continue
        for key, est in ct.get_params(deep=True).items():
            if isinstance(est, type) or not hasattr(est, "fit"):
                continue  # a parameter value, "drop" or "passthrough"
            if isinstance(est, ColumnTransformer | FeatureUnion | Pipeline):
                continue  # a container: its transformers are among the items
            if isinstance(est, OneHotEncoder):
                if not est.sparse_output or (est.drop is None
                                             and est.handle_unknown == "error"):
                    continue
                what = ("OneHotEncoder, sparse_output=True, "
                        + (f"drop={est.drop!r}" if est.drop is not None
                           else f"handle_unknown={est.handle_unknown!r}")
                        + "), whose number of non-zero entries depends on the values "
                        "(rows in the dropped category or with an unknown value have none")
            elif isinstance(est, OrdinalEncoder | OneToOneFeatureMixin):
                continue  # dense output for the dense X a pipeline is given
            else:
                what = (f"{type(est).__name__}), which may return a sparse matrix whose "
                        "number of non-zero entries depends on the values")
            raise ParameterValueError(
                f"pipeline step {where!r} (ColumnTransformer) has sparse_threshold="
                f"{ct.sparse_threshold!r} and holds {where}__{key} ({what}): whether the "
                "step returns a sparse or a dense matrix, and its fitted sparse_output_, "
                "would follow the private data. Pass sparse_threshold=0 (always dense); "
                "or use OneHotEncoder(sparse_output=False), or drop=None with "
                "handle_unknown='error'")
