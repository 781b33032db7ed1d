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
from sklearn.base import OneToOneFeatureMixin, clone
from sklearn.utils import get_tags

from privlearn.errors import BatchDependenceError, ParameterTypeError, ParameterValueError

__all__ = ["probe_width", "public_output_width"]


def _unplannable(name: str, step: Any, why: str) -> ParameterTypeError:
    return ParameterTypeError(
        f"pipeline step {name!r} ({type(step).__name__}) changes the number of features, "
        f"and {why}, so the mechanisms of the private steps after it cannot be planned "
        "before the fit (planned_mechanism, PrivateSearchCV). Use public encoders whose "
        "output is fixed by their parameters: OneHotEncoder(categories=[[...], ...]) with "
        "the category lists of the schema (not learned from the data), a ColumnTransformer "
        "of them with columns given by position or name, steps that need no fitting "
        "(FunctionTransformer), constant imputation, polynomial features or random "
        "projections with an integer n_components; or put the step last")


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


def _shape_only_width(step: Any, n: int) -> int | None:
    """The width of a step whose fit reads the number of columns only (the allow-list of
    :mod:`privlearn.models._public_fits`): a constant imputation and one indicator per
    column keep ``n``; a random projection outputs ``n_components``; polynomial features,
    fitted on one row of zeros (its fit reads the shape only), give their count. None for
    any other step."""
    from sklearn.impute import MissingIndicator, SimpleImputer
    from sklearn.preprocessing import PolynomialFeatures
    from sklearn.random_projection import BaseRandomProjection

    if (type(step) is SimpleImputer and step.strategy == "constant"
            and step.keep_empty_features and not step.add_indicator) or (
            type(step) is MissingIndicator and step.features == "all"):
        return n
    if isinstance(step, BaseRandomProjection) and isinstance(step.n_components,
                                                             numbers.Integral):
        return int(step.n_components)
    if type(step) is PolynomialFeatures:
        return int(clone(step).fit(np.zeros((1, n))).n_output_features_)
    return None


def public_output_width(name: str, step: Any, n: int, names: list[str] | None = None,
                        probe: Any = None) -> int:
    """The number of columns ``step`` outputs for an input of ``n`` columns (named
    ``names`` when ``X`` is a DataFrame), from its parameters and that schema only.

    ``probe(step, n)`` gives the width of a step that needs no fitting (applied to public,
    data-independent rows). Handled: ``"passthrough"``/``None`` and ``"drop"``,
    one-to-one transformers, ``OneHotEncoder`` / ``OrdinalEncoder`` with explicit
    categories, the steps of :func:`_shape_only_width`, ``ColumnTransformer``,
    ``FeatureUnion`` and scikit-learn ``Pipeline`` of these, and steps that need no
    fitting. Anything else raises
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
    shape_only = _shape_only_width(step, n)
    if shape_only is not None:
        return shape_only
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


def probe_width(name: str, step: Any, n_features: int) -> int:
    """The output width of a step that needs no fitting, applied to one row of zeros
    (data-independent); one that mixes rows is refused (:func:`_refuse_row_mixing`)."""
    out = clone(step).fit_transform(np.zeros((1, n_features)))  # a sparse matrix too
    width = out.shape if hasattr(out, "shape") else np.asarray(out).shape
    _refuse_row_mixing(name, step, n_features)
    return int(width[1]) if len(width) == 2 else 1


def frozen_width(name: str, step: Any, n_features: int) -> int:
    """The output width of a step fitted beforehand on public data (a
    ``sklearn.frozen.FrozenEstimator``, whose fit is kept), from its transform of one row
    of zeros; one whose transform mixes rows or changes their number is refused
    (:func:`_refuse_row_mixing`)."""
    width = np.asarray(step.transform(np.zeros((1, n_features)))).shape
    _refuse_row_mixing(name, step, n_features, frozen=True)
    return int(width[1]) if len(width) == 2 else 1


def _refuse_row_mixing(name: str, step: Any, n_features: int, *, frozen: bool = False
                       ) -> None:
    """Refuse a step that needs no fitting but whose output rows are not each a function
    of one input row (e.g. ``FunctionTransformer(lambda X: X - X.mean(0))``) before a
    private step.

    The private steps' sensitivities assume that adding or removing one record changes
    one row of their input; a transform that mixes rows changes every row, and one that
    turns a record into several rows (augmentation, oversampling:
    ``np.vstack([X, X + jitter])``) or selects rows by their position (``X[::2]``) changes
    several, so the accounted noise would not cover the release. Probed on public,
    data-independent rows (uniform on [0, 1), so logarithms and square roots stay
    defined): each row transformed alone must give at most one row, the block as many
    rows as the rows alone together, and (for a deterministic step) the same rows. A step
    the probe cannot run is not refused here (its fit on the data says why it fails).
    ``frozen``: the step keeps a fit made beforehand, and its ``transform`` is probed.
    """
    probe = np.random.default_rng(0).uniform(size=(5, n_features))

    def run(rows: np.ndarray) -> np.ndarray:
        out = step.transform(rows) if frozen else clone(step).fit_transform(rows)
        return np.asarray(out, dtype=float)

    try:
        with np.errstate(all="ignore"):  # a NaN from the probe is compared, not warned
            block, again = run(probe), run(probe)
            alone = [run(probe[i : i + 1]) for i in range(probe.shape[0])]
    except Exception:  # noqa: BLE001 - not probed; the pipeline's own fit reports it
        return
    if block.ndim == 0:
        return  # not a table of rows: nothing to compare
    counts = [a.shape[0] if a.ndim else 1 for a in alone]
    if max(counts) > 1 or block.shape[0] != sum(counts):
        raise BatchDependenceError(
            f"pipeline step {name!r} ({type(step).__name__}) needs no fitting but does not "
            "return each record's row on its own: on 5 public probe rows it returned "
            f"{block.shape[0]} rows, and rows transformed alone gave {counts} (a record "
            "repeated or augmented into several rows, or rows selected by their position "
            "or by the other rows): adding or removing one record would then change "
            "several rows the next private step sees, beyond the sensitivity its noise is "
            "calibrated to. Keep one row per record (average a record's augmentations "
            "into its row), or filter rows by a rule on each row alone")
    if not np.array_equal(block, again, equal_nan=True):
        return  # random (a jitter): the row counts above are all that can be compared
    kept = [a.reshape(a.shape[0], -1) if a.ndim else a.reshape(1, 1) for a in alone]
    rows = block.reshape(block.shape[0], -1)
    if all(a.shape[1] == rows.shape[1] for a in kept) and np.allclose(
            np.concatenate(kept), rows, rtol=1e-9, atol=1e-12, equal_nan=True):
        return
    raise BatchDependenceError(
        f"pipeline step {name!r} ({type(step).__name__}) needs no fitting but transforms "
        "each row using the other rows (a row transformed alone differs from the same row "
        "transformed with others, e.g. centring by the column means): adding or removing "
        "one record would then change every row the next private step sees, beyond the "
        "sensitivity its noise is calibrated to. Use a row-wise transform (each output "
        "row a function of its input row only), or PrivateStandardScaler for centring "
        "and scaling")
