"""Whether a public pipeline step outputs a sparse matrix, without reading any data
(private helper of :class:`~privlearn.models.PrivatePipeline`).

The private estimators take dense data only. A public encoding step whose parameters make
it output a sparse matrix -- scikit-learn's default ``OneHotEncoder(sparse_output=True)``,
a ``ColumnTransformer`` of it whose output density is below its ``sparse_threshold`` --
hands the next private step data it refuses whatever the values. That is decided by the
step's parameters and the input's schema, as its output width is
(:mod:`privlearn.models._public_width`), so the pipeline refuses it before any budget is
reserved, not once the private step's own checks run (after the reservation, which is
then charged in full).

The public steps allowed to learn on the private data
(:mod:`privlearn.models._public_fits`) have an output format their parameters fix: a
``ColumnTransformer`` holding a sparse one-hot encoding has one with exactly one
non-zero entry per row and encoded column (``drop=None``, ``handle_unknown="error"``), so
its density is known from the widths. Any step whose format this module cannot tell gives
None, and the pipeline's fit says what happens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import sparse
from sklearn.base import clone
from sklearn.utils import get_tags

__all__ = ["input_is_sparse", "output_is_sparse", "public_output_sparse", "refuse_sparse_input"]


def _probe_sparse(step: Any, n: int, sparse_in: bool) -> bool | None:
    """A step that needs no fitting, applied to one public row of zeros."""
    row = sparse.csr_matrix((1, n)) if sparse_in else np.zeros((1, n))
    try:
        return bool(sparse.issparse(clone(step).fit_transform(row)))
    except Exception:  # noqa: BLE001 - not probed; the pipeline's own fit reports it
        return None


def _width(name: str, step: Any, n: int, names: list[str] | None) -> int | None:
    """The step's planned output width (:func:`~privlearn.models._public_width.
    public_output_width`), None when it cannot be planned (the pipeline's planning says
    why)."""
    from privlearn.errors import BatchDependenceError, ParameterTypeError, ParameterValueError
    from privlearn.models._public_width import probe_width, public_output_width

    try:
        return public_output_width(name, step, n, names, probe_width)
    except (ParameterTypeError, ParameterValueError, BatchDependenceError):
        return None


def _column_transformer_sparse(
    name: str, ct: Any, n: int, names: list[str] | None, sparse_in: bool
) -> bool | None:
    """scikit-learn's rule: sparse when a block is sparse and the output density (the
    non-zero entries of the sparse blocks and every entry of the dense ones, over all
    entries) is below ``sparse_threshold``."""
    from sklearn.preprocessing import OneHotEncoder

    from privlearn.models._public_width import _column_indices

    blocks, used = [], set()
    for sub, trans, cols in ct.transformers:
        idx = _column_indices(name, ct, cols, n, names)
        used.update(idx)
        if idx and not (isinstance(trans, str) and trans == "drop"):
            blocks.append((f"{name}__{sub}", trans, idx))
    rest = [i for i in range(n) if i not in used]
    if rest and not (isinstance(ct.remainder, str) and ct.remainder == "drop"):
        blocks.append((f"{name}__remainder", ct.remainder, rest))
    nnz = total = 0
    any_sparse = False
    for sub, trans, idx in blocks:
        sub_names = [names[i] for i in idx] if names else None
        is_sparse = public_output_sparse(sub, trans, len(idx), sub_names, sparse_in)
        width = _width(sub, trans, len(idx), sub_names)
        if is_sparse is None or width is None:
            return None
        if is_sparse:
            any_sparse = True
            one_hot = (
                isinstance(trans, OneHotEncoder)
                and trans.drop is None
                and trans.handle_unknown == "error"
            )
            if not one_hot:
                return None  # its number of non-zero entries is not known
            nnz += len(idx)  # one non-zero per row and encoded column
        else:
            nnz += width
        total += width
    if not any_sparse:
        return False
    return total > 0 and nnz / total < ct.sparse_threshold


def public_output_sparse(
    name: str, step: Any, n: int, names: list[str] | None, sparse_in: bool
) -> bool | None:
    """Whether ``step`` outputs a sparse matrix for an input of ``n`` columns (named
    ``names``; sparse when ``sparse_in``), from its parameters and that schema only;
    None when not known."""
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import MissingIndicator, SimpleImputer
    from sklearn.pipeline import FeatureUnion, Pipeline
    from sklearn.preprocessing import (
        OneHotEncoder,
        OrdinalEncoder,
        PolynomialFeatures,
        SplineTransformer,
    )
    from sklearn.random_projection import GaussianRandomProjection, SparseRandomProjection

    if step is None or (isinstance(step, str) and step == "passthrough"):
        return sparse_in
    if isinstance(step, str):  # "drop"
        return False
    if isinstance(step, OneHotEncoder | SplineTransformer):
        return bool(step.sparse_output)
    if isinstance(step, OrdinalEncoder | GaussianRandomProjection):
        return False
    if isinstance(step, MissingIndicator):
        return sparse_in if isinstance(step.sparse, str) else bool(step.sparse)
    if isinstance(step, SimpleImputer | PolynomialFeatures):
        return sparse_in
    if isinstance(step, SparseRandomProjection):
        return sparse_in and not step.dense_output
    if isinstance(step, ColumnTransformer):
        if not step.sparse_threshold > 0:
            return False
        return _column_transformer_sparse(name, step, n, names, sparse_in)
    if isinstance(step, FeatureUnion):
        parts = [
            public_output_sparse(f"{name}__{sub}", t, n, names, sparse_in)
            for sub, t in step.transformer_list
            if not (isinstance(t, str) and t == "drop")
        ]
        return True if any(p is True for p in parts) else (None if None in parts else False)
    if isinstance(step, Pipeline):
        for sub, t in step.steps:
            sparse_in = public_output_sparse(f"{name}__{sub}", t, n, names, sparse_in)
            width = _width(f"{name}__{sub}", t, n, names)
            if sparse_in is None or width is None:
                return None
            n, names = width, None
        return sparse_in
    if not get_tags(step).requires_fit:
        return _probe_sparse(step, n, sparse_in)
    return None


def input_is_sparse(X: Any) -> bool:
    """Whether the data given to a pipeline is sparse by its type: a SciPy sparse matrix
    or a DataFrame of ``pandas.SparseDtype`` columns."""
    from privlearn.models._schema_gate import _sparse_frame

    return bool(sparse.issparse(X) or _sparse_frame(X))


def output_is_sparse(
    name: str, step: Any, n: int, names: list[str] | None, sparse_in: bool | None, *, private: bool
) -> bool | None:
    """Whether what pipeline step ``step`` hands on is sparse, for an input of ``n``
    columns that is sparse when ``sparse_in`` (None: not known): a ``private`` step's
    output is dense; a frozen step's is not known; a public step's from its parameters
    (:func:`public_output_sparse`)."""
    from sklearn.frozen import FrozenEstimator

    if private:
        return False
    if sparse_in is None or isinstance(step, FrozenEstimator):
        return None
    return public_output_sparse(name, step, n, names, sparse_in)


def refuse_sparse_input(
    owner: str, name: str, step: Any, sparse_in: bool | None, previous: tuple[str, Any] | None
) -> None:
    """Refuse (:class:`~privlearn.errors.ParameterTypeError`), before anything is
    reserved, a private pipeline step that takes dense data when its input is sparse by
    the schema: ``X`` itself, or the output of the public step ``previous`` by its
    parameters. The step's own check would refuse it whatever the values, once
    charged."""
    from privlearn.errors import ParameterTypeError

    if not sparse_in or get_tags(step).input_tags.sparse:
        return
    if previous is None:
        source, remedy = "X is sparse", "convert it with X.toarray()"
    else:
        source = (
            f"step {previous[0]!r} ({type(previous[1]).__name__}) outputs a sparse "
            "matrix by its parameters"
        )
        remedy = (
            "pass sparse_output=False to its OneHotEncoder, or sparse_threshold=0 to "
            "its ColumnTransformer"
        )
    raise ParameterTypeError(
        f"{owner}: pipeline step {name!r} ({type(step).__name__}) takes dense data, but "
        f"{source}; {remedy} (refused before anything was reserved on a ledger)"
    )
