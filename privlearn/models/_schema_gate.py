"""The refusals of an estimator's data that its public schema alone decides, made before
anything is reserved on a ledger (private helper of :mod:`privlearn.models.base`).

A ledger is read by everyone who spends from its budgets, so what it records about a fit
must not depend on the values of the private data. Once a fit has reserved its plan, the
plan is charged in full whatever happens next (:meth:`PrivateEstimator._run
<privlearn.models.base.PrivateEstimator._run>`): a refusal by the data checks after the
reservation (a NaN, a label outside ``classes``, a clipping warning turned into an
error) may depend on one record, and a cancelled entry would tell the ledger's readers
so. The mistakes that the shape and the type of the data decide -- the same for every
data set of that schema -- are refused here instead, before the reservation, so that
they record nothing: ``X`` that is not a table of rows and columns, ``X`` and ``y`` of
different lengths, a sparse ``X`` for an estimator that takes dense data, a sparse ``y``,
a regressor's ``y`` of strings, complex numbers or dates, a classifier's labels of
another type than its declared ``classes`` (text for numbers, or numbers for text). These
checks read shapes, container types and dtypes only, never a value, so refusing here
reveals nothing about the data.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.base import MetaEstimatorMixin, is_classifier, is_regressor
from sklearn.utils import get_tags

from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = ["refuse_bad_schema"]


def _shape(value: Any) -> tuple[int, ...] | None:
    """The shape of ``value`` (its ``shape`` attribute, else that of ``np.asarray``),
    None when it has none (ragged rows: the data checks say why)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return tuple(shape)
    try:
        return tuple(np.asarray(value, dtype=object).shape)
    except (ValueError, TypeError):
        return None


def _sparse_frame(X: Any) -> bool:
    """Whether ``X`` is a pandas DataFrame with a column of ``pandas.SparseDtype`` (its
    schema): scikit-learn's validation turns it into a SciPy sparse matrix (or refuses
    a mix of sparse and dense columns), so it is sparse data."""
    dtypes = getattr(X, "dtypes", None)
    if dtypes is None or not hasattr(X, "columns"):
        return False
    return any(type(dt).__name__ == "SparseDtype" for dt in dtypes)


def _dtype_kinds(value: Any) -> set[str]:
    """The NumPy kinds of the dtypes of ``value`` (an array's, or a DataFrame's / a
    Series' columns'); empty for a list (its values would have to be read)."""
    dtypes = getattr(value, "dtypes", None)
    if dtypes is not None and hasattr(value, "columns"):
        return {str(getattr(dt, "kind", "O")) for dt in dtypes}
    dtype = getattr(value, "dtype", None)
    return {str(getattr(dtype, "kind", "O"))} if dtype is not None else set()


def _refuse_non_real_dtypes(owner: str, name: str, value: Any, *, dates: bool = True) -> None:
    """Refuse complex numbers and (``dates``) dates or durations (``datetime64``,
    ``timedelta64``), which no fit takes whatever their values: by the dtype alone."""
    kinds = _dtype_kinds(value)
    if "c" in kinds:
        raise ParameterValueError(
            f"{owner}: Complex data not supported: {name} has a complex dtype; pass the "
            f"real parts ({name}.real) or the magnitudes (abs({name})) if that is what you "
            "mean (refused before anything was reserved on a ledger)"
        )
    if dates and kinds & {"M", "m"}:
        raise ParameterTypeError(
            f"{owner}: {name} has dates or durations (a datetime64 or timedelta64 "
            "column); convert them to numbers by a public rule first, e.g. days since a "
            "public reference date (refused before anything was reserved on a ledger)"
        )


def _refuse_labels_of_another_type(owner: str, y: Any, classes: Any) -> None:
    """Refuse labels ``y`` (an array or Series: its dtype, never its values) of which no
    value can be one of the declared public ``classes``: text labels for numeric
    classes, or numbers for text classes. Every label would be refused as outside
    ``classes`` once the data is read, whatever the values (a list ``y``, or an object
    array, may hold either, and is checked with the values)."""
    y_kind = getattr(getattr(y, "dtype", None), "kind", None)
    if classes is None or y_kind is None or isinstance(classes, str):
        return
    try:
        c_kind = np.asarray(classes).dtype.kind
    except (TypeError, ValueError):  # not a list of labels: the parameter check says so
        return
    text, numbers = "USV", "biuf"
    if (y_kind in text and c_kind in numbers) or (y_kind in numbers and c_kind in text):
        found = "text" if y_kind in text else "numbers"
        declared = "numbers" if c_kind in numbers else "text"
        raise ParameterValueError(
            f"{owner}: y contains labels not in classes={np.asarray(classes).tolist()!r}: "
            f"y holds {found} (dtype {y.dtype}) and classes holds {declared}, so no label "
            "of y can be one of classes. Pass classes in the type of y (e.g. "
            "classes=['no', 'yes'] for text labels), or map y onto the labels of classes "
            "before fitting (refused before anything was reserved on a ledger)"
        )


def refuse_bad_schema(estimator: Any, X: Any, y: Any = None) -> None:
    """Refuse, before the ledger reservation, data whose schema no fit can accept.

    Parameters
    ----------
    estimator : PrivateEstimator
        Its scikit-learn tags say which inputs it takes (``input_tags.sparse``,
        ``input_tags.three_d_array``); a regressor needs a numeric ``y``.
    X, y
        The data as given to ``fit`` (``y`` may be None). Only shapes, the sparse
        container and, for an array ``y``, its dtype are read.

    Raises
    ------
    ParameterValueError
        ``X`` is not 2-D (3-D where the tags allow it), has no row or no column, or its
        number of rows differs from ``y``'s; ``y`` has several columns (one target);
        ``X`` or ``y`` holds complex numbers; a classifier's ``y`` holds text for
        numeric ``classes`` or numbers for text ones.
    ParameterTypeError
        A sparse ``X`` for an estimator that takes dense data; a sparse ``y``; a
        regressor's ``y`` of strings.
    """
    from scipy import sparse

    owner = type(estimator).__name__
    name = getattr(estimator, "_data_name", "X")  # what the public method calls X
    tags = get_tags(estimator)
    if (sparse.issparse(X) or _sparse_frame(X)) and not tags.input_tags.sparse:
        dense = "toarray()" if sparse.issparse(X) else "sparse.to_dense()"
        raise ParameterTypeError(
            f"{owner}: Sparse data was passed for {name}, but dense data is required; "
            f"convert it with {name}.{dense} (refused before anything was reserved on a "
            "ledger)"
        )
    shape = _shape(X)
    if shape is None:
        return
    dims = (2, 3) if tags.input_tags.three_d_array else (2,)
    if len(shape) not in dims:
        raise ParameterValueError(
            f"{owner}: Expected 2D array, got {len(shape)}D array instead (shape "
            f"{shape}): {name} must be (n_samples, n_features); reshape a single feature "
            f"with {name}.reshape(-1, 1) (refused before anything was reserved on a "
            "ledger)"
        )
    if shape[0] < 1 or shape[1] < 1:
        what = "sample" if shape[0] < 1 else "feature"
        raise ParameterValueError(
            f"{owner}: Found array with 0 {what}(s) (shape={shape}) while a minimum of 1 "
            f"is required: {name} needs at least one {'row' if what == 'sample' else 'column'}"
            " (refused before anything was reserved on a ledger)"
        )
    if not isinstance(estimator, MetaEstimatorMixin):  # a search hands X to its runs
        _refuse_non_real_dtypes(owner, name, X)
    if y is None or not (
        tags.target_tags.required or is_regressor(estimator) or is_classifier(estimator)
    ):
        return  # a transformer ignores y (scikit-learn's convention)
    if sparse.issparse(y):
        raise ParameterTypeError(
            f"{owner}: Sparse data was passed for y, but dense data is required; convert "
            "it with y.toarray().ravel() (refused before anything was reserved on a "
            "ledger)"
        )
    y_shape = _shape(y)
    if (
        y_shape is not None
        and not tags.target_tags.multi_output
        and (len(y_shape) > 2 or (len(y_shape) == 2 and y_shape[1] != 1))
    ):
        raise ParameterValueError(
            f"{owner}: y should be a 1d array, got an array of shape {y_shape} instead: "
            f"{owner} fits one target, y of shape (n_samples,) (refused before anything "
            "was reserved on a ledger)"
        )
    if y_shape is not None and len(y_shape) >= 1 and y_shape[0] != shape[0]:
        raise ParameterValueError(
            f"{owner}: Found input variables with inconsistent numbers of samples: "
            f"[{shape[0]}, {y_shape[0]}]; X and y need one row per record (refused before "
            "anything was reserved on a ledger)"
        )
    if not isinstance(estimator, MetaEstimatorMixin):  # a search's runs check theirs
        # a classifier's labels may be dates (class names), never complex numbers
        _refuse_non_real_dtypes(owner, "y", y, dates=is_regressor(estimator))
        if is_classifier(estimator):
            _refuse_labels_of_another_type(owner, y, getattr(estimator, "classes", None))
    kind = getattr(getattr(y, "dtype", None), "kind", None)
    if is_regressor(estimator) and kind is not None and kind in "USV":
        raise ParameterTypeError(
            f"{owner}: y must be numeric (the target of a regressor), got an array of dtype "
            f"{y.dtype}; convert it with y.astype(float) if the strings are numbers, or use "
            "a classifier for class labels (refused before anything was reserved on a "
            "ledger)"
        )
