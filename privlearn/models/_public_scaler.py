"""Scaling by public bounds: :class:`PublicRangeScaler`, exported by
:mod:`privlearn.models`.

scikit-learn's ``MinMaxScaler`` learns each feature's minimum and maximum from the data
(``data_min_``, ``data_max_``) and releases them exactly; a
:class:`~privlearn.models.PrivatePipeline` refuses it. When the range of every feature
is known without looking at the data (a sensor's range, a questionnaire's scale, a
data dictionary), this scaler maps it to ``feature_range`` from those declared bounds
alone: its fit reads the schema of ``X`` (the number of columns, their names) and
nothing else, so it costs no privacy budget, and a ``PrivatePipeline`` accepts it as a
free step (scikit-learn tag ``requires_fit=False``, as ``Normalizer``): it adds nothing
to ``mechanism_`` and nothing is charged on a ledger for it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from sklearn.base import BaseEstimator, OneToOneFeatureMixin, TransformerMixin

from privlearn import _validation as _v
from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.models._inverse_input import check_inverse_input
from privlearn.models._schema_gate import refuse_bad_schema
from privlearn.models.base import validate_input, warn_outside_ranges

__all__ = ["PublicRangeScaler"]

_BOUNDS_HINT = (
    "e.g. bounds=(0, 100) for every feature, or bounds=([0, -1], [100, 1]) "
    "for two features, from public knowledge (never from the data)"
)


def _length(value: object) -> int | None:
    """``len(value)``, None for a value without one (a number, a 0-d array)."""
    try:
        return len(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _feature_range(value: object) -> tuple[float, float]:
    """``feature_range`` as two finite floats ``lo < hi`` (a typed error otherwise)."""
    if isinstance(value, str | Mapping) or _length(value) != 2:
        raise ParameterValueError(
            f"feature_range must be a pair (min, max) with min < max, got {value!r}; "
            "e.g. feature_range=(0, 1) or (-1, 1)"
        )
    lo, hi = (
        _v.check_real("feature_range", v, hint="pass two numbers, e.g. (0, 1)") for v in value
    )
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi and np.isfinite(hi - lo)):
        raise ParameterValueError(
            f"feature_range must be a pair (min, max) of finite numbers with min < max "
            f"(and max - min finite), got {value!r}; e.g. feature_range=(0, 1)"
        )
    return lo, hi


def public_bounds(bounds: object, d: int) -> np.ndarray:
    """``bounds = (lower, upper)`` as a ``(d, 2)`` array of finite ``lower < upper`` rows;
    ``lower`` and ``upper`` are each a number (every feature) or an array of ``d``.

    Raises
    ------
    ParameterTypeError
        ``lower`` or ``upper`` is not numbers.
    ParameterValueError
        ``bounds`` is missing or not a pair, ``lower`` / ``upper`` has the wrong length,
        holds a NaN or an infinity, ``lower >= upper`` for a feature, or
        ``upper - lower`` overflows float64.
    """
    if bounds is None:
        raise ParameterValueError(
            "bounds is required: the public (lower, upper) range of the features, known "
            f"without looking at the data (a range read off the data would leak); {_BOUNDS_HINT}"
        )
    if isinstance(bounds, str | Mapping) or _length(bounds) != 2:
        raise ParameterValueError(
            f"bounds must be a pair (lower, upper), each a number or an array of one value "
            f"per feature (in the order of X's columns), got {bounds!r}; {_BOUNDS_HINT}"
        )
    sides = []
    for side, value in zip(("lower", "upper"), bounds, strict=True):
        try:
            arr = np.asarray(value, dtype=float)
        except (TypeError, ValueError) as e:
            raise ParameterTypeError(
                f"bounds: {side} must be a number or an array of numbers, got {value!r}; "
                f"{_BOUNDS_HINT}"
            ) from e
        if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != d):
            raise ParameterValueError(
                f"bounds: {side} must be a number or an array of {d} values (one per "
                f"feature of X), got an array of shape {arr.shape}: {value!r}"
            )
        if not np.all(np.isfinite(arr)):
            raise ParameterValueError(
                f"bounds: {side} must be finite, got {value!r}; a NaN or an infinite bound "
                "cannot be mapped onto feature_range. Give the public finite range of "
                "each feature"
            )
        sides.append(np.broadcast_to(arr, (d,)))
    ranges = np.stack(sides, axis=1)
    bad = np.flatnonzero(~(ranges[:, 0] < ranges[:, 1]))
    if bad.size:
        j = int(bad[0])
        raise ParameterValueError(
            f"bounds must satisfy lower < upper for every feature; feature {j} has "
            f"({ranges[j, 0]:g}, {ranges[j, 1]:g}) (features {bad[:10].tolist()} fail), "
            f"got {bounds!r}"
        )
    with np.errstate(over="ignore"):
        wide = np.flatnonzero(~np.isfinite(ranges[:, 1] - ranges[:, 0]))
    if wide.size:
        raise ParameterValueError(
            f"bounds are too wide for features {wide[:10].tolist()}: upper - lower "
            f"overflows float64 (got {bounds!r}). Divide those features by a public "
            "constant first and give the range of the rescaled values"
        )
    return ranges


class PublicRangeScaler(OneToOneFeatureMixin, TransformerMixin, BaseEstimator):
    """Scale each feature from its declared public range ``bounds`` to ``feature_range``,
    clipping values outside ``bounds``: ``MinMaxScaler`` without learning from the data.

    ``transform`` maps ``x`` to ``min + (clip(x, lower, upper) - lower) (max - min) /
    (upper - lower)`` (``feature_range = (min, max)``): scikit-learn's ``MinMaxScaler``
    fitted on the two corners ``lower`` and ``upper``. ``fit`` reads the schema of ``X``
    only (``n_features_in_``, and ``feature_names_in_`` for a DataFrame) and refuses a
    NaN or an infinity; it learns nothing from the values, so it costs no privacy budget
    and has no ``mechanism_``. In a :class:`~privlearn.models.PrivatePipeline` it is a
    free step (it needs no ``public_steps`` entry), accounted as nothing and charged
    nothing on a ledger.

    Parameters
    ----------
    bounds : (lower, upper)
        The public range of the features, known without looking at the data:
        ``lower`` and ``upper`` are each a number (every feature) or an array of one
        value per column of ``X``, with ``lower < upper``. Required. Values outside it
        are clipped to it (a ``DataClippedWarning`` to the caller says how many).
    feature_range : (min, max), default (0, 1)
        The range the bounds are mapped to (as ``MinMaxScaler``'s; not
        ``PrivateStandardScaler``'s ``feature_range``, which is the input range).

    Attributes
    ----------
    n_features_in_ : int
    feature_names_in_ : ndarray of str
        Only when ``X`` is a DataFrame with string column names.

    Examples
    --------
    >>> import numpy as np
    >>> sc = PublicRangeScaler(bounds=(0, 200)).fit(np.zeros((1, 2)))
    >>> sc.transform([[50.0, 200.0]]).tolist()
    [[0.25, 1.0]]
    """

    def __init__(self, bounds=None, feature_range=(0, 1)):
        self.bounds = bounds
        self.feature_range = feature_range

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = False  # transform needs the parameters only
        return tags

    def _check_public_schema(self, n_features: int) -> np.ndarray:
        """The ``(n_features, 2)`` bounds and a checked ``feature_range``, from the
        parameters and the number of features only (a typed error otherwise): called by
        ``PrivatePipeline`` while planning, before anything is reserved."""
        _feature_range(self.feature_range)
        return public_bounds(self.bounds, n_features)

    def fit(self, X, y=None):
        """Record the schema of ``X`` (``n_features_in_``, ``feature_names_in_``) and
        check the parameters against it; nothing is learned from the values. ``X`` of
        complex numbers, dates or durations is refused as by the private estimators (and
        by a :class:`~privlearn.models.PrivatePipeline` holding this step, before
        anything is reserved)."""
        refuse_bad_schema(self, X)
        X = validate_input(self, X, reset=True, dtype=np.float64)
        self._check_public_schema(X.shape[1])
        return self

    def _scale(self, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[float, float]]:
        """``(bounds, scale, offset, feature_range)``: ``x -> x scale + offset``, as
        ``MinMaxScaler``'s ``scale_`` and ``min_`` for the data range ``bounds``."""
        ranges = self._check_public_schema(d)
        lo, hi = _feature_range(self.feature_range)
        scale = (hi - lo) / (ranges[:, 1] - ranges[:, 0])
        return ranges, scale, lo - ranges[:, 0] * scale, (lo, hi)

    def transform(self, X):
        """Clip ``X`` to ``bounds`` and map it linearly to ``feature_range`` (a
        :class:`~privlearn.errors.DataClippedWarning` to the caller counts the clipped
        values; nothing is stored)."""
        X = validate_input(self, X, reset=False, dtype=np.float64)
        ranges, scale, offset, out_range = self._scale(X.shape[1])
        warn_outside_ranges(type(self).__name__, X, ranges, "bounds", "them", stacklevel=2)
        # as MinMaxScaler(clip=True): map, then clip to feature_range (the same as
        # clipping to bounds first: the map is increasing), so the two agree bit for bit
        return np.clip(X * scale + offset, *out_range)

    def inverse_transform(self, X):
        """Map ``X`` from ``feature_range`` back to ``bounds`` (clipped values stay at
        the bound). ``X`` is in the transformed space: its column names are not checked,
        its number of columns is."""
        X = check_inverse_input(self, X, getattr(self, "n_features_in_", None))
        d = X.shape[1]
        _ranges, scale, offset, _out = self._scale(d)
        return (X - offset) / scale
