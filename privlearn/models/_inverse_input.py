"""The input of a scaler's ``inverse_transform``, checked with typed errors (private
helper of :class:`~privlearn.models.PrivateStandardScaler` and
:class:`~privlearn.models.PublicRangeScaler`).

``inverse_transform`` reads data in the transformed space, so its column names are not
the fit's and scikit-learn's ``validate_data`` (which checks them) does not apply; its
number of columns is checked, and a NaN or an infinity is the same
:class:`~privlearn.errors.NonFiniteInputError` that ``transform`` raises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.utils.validation import check_array

from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.models.base import _non_finite, _non_finite_error

__all__ = ["check_inverse_input"]


def check_inverse_input(estimator: Any, X: Any, n_features: int | None) -> np.ndarray:
    """``X`` as a 2-D float64 array of ``n_features`` columns (any number when None).

    Raises
    ------
    NonFiniteInputError
        ``X`` holds a NaN or an infinity.
    ParameterTypeError
        ``X`` is sparse, or not an array.
    ParameterValueError
        ``X`` is not 2-D, is empty, holds text, or has another number of columns.
    """
    owner = f"{type(estimator).__name__}.inverse_transform"
    try:
        X = check_array(X, dtype=np.float64, input_name="X")
    except (TypeError, ValueError) as e:
        if _non_finite(X):
            raise _non_finite_error(owner, "X", X) from e
        typed = ParameterTypeError if isinstance(e, TypeError) else ParameterValueError
        raise typed(f"{owner}: {e}") from e
    if n_features is not None and X.shape[1] != n_features:
        raise ParameterValueError(
            f"{owner}: X has {X.shape[1]} features, but the scaler was fitted on "
            f"{n_features}; pass an array of shape (n_samples, {n_features})"
        )
    return X
