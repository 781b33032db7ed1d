"""Private quantiles and clipping bounds by the exponential mechanism (McSherry & Talwar
2007, Theorem 6; Smith 2011): :func:`private_quantile`, :func:`choose_x_bound`,
:func:`choose_y_bound`, re-exported by :mod:`privlearn.models.preprocessing`.

References
----------
.. [1] F. McSherry, K. Talwar (2007), Mechanism Design via Differential Privacy, FOCS
       (exponential mechanism, Theorem 6).
.. [2] A. Smith (2011), Privacy-preserving statistical estimation with optimal
       convergence rates, STOC (private quantiles by the exponential mechanism).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from privlearn import _validation as _v
from privlearn.accounting import Mechanism, PureDP
from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.models.base import _non_finite_error, make_rng, row_norms

__all__ = ["private_quantile", "choose_x_bound", "choose_y_bound"]


def _check_range(lower: object, upper: object) -> tuple[float, float]:
    for name, v in (("lower", lower), ("upper", upper)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ParameterValueError(f"{name} must be a finite real number, got {v!r}")
    if not lower < upper:
        raise ParameterValueError(
            f"the public range must satisfy lower < upper, got ({lower}, {upper})")
    return float(lower), float(upper)


def check_public_ranges(name: str, ranges: np.ndarray, d: int, given: object) -> None:
    """Refuse (:class:`~privlearn.errors.ParameterValueError`, naming ``name`` and the
    value ``given``) public ranges that are not ``(d, 2)`` finite ``lower < upper`` rows,
    or whose half-width squared overflows float64: a variance over such a range is
    ``inf`` (a scaler's ``var_``, and a ``transform`` of all zeros)."""
    if ranges.shape != (d, 2) or not np.all(np.isfinite(ranges)) or not np.all(
            ranges[:, 0] < ranges[:, 1]):
        raise ParameterValueError(
            f"{name} must be (lower, upper) or an array of shape ({d}, 2) with finite "
            f"lower < upper, got {given!r}")
    with np.errstate(over="ignore"):
        half = 0.5 * ranges[:, 1] - 0.5 * ranges[:, 0]
        wide = ~np.isfinite(half * half)
    if np.any(wide):
        raise ParameterValueError(
            f"{name} is too wide for features {np.flatnonzero(wide)[:10].tolist()}: the "
            "variance of a feature spanning it, ((upper - lower) / 2)^2, overflows float64 "
            f"(got {given!r}). Divide those features by a public constant first and give "
            "the range of the rescaled values")


def _em_quantile(
    values: np.ndarray, q: float, epsilon: float, lower: float, upper: float,
    n_candidates: int, rng: np.random.Generator,
) -> float:
    # (1 - t) lower + t upper, not np.linspace: its step (upper - lower) / (n - 1)
    # overflows to inf on a range wider than the largest float (lower=-1e308,
    # upper=1e308), and the grid, so the released quantile, was inf or NaN
    t = np.linspace(0.0, 1.0, n_candidates)
    grid = (1.0 - t) * lower + t * upper
    grid[0], grid[-1] = lower, upper
    v = np.clip(np.sort(values), lower, upper)
    below = np.searchsorted(v, grid, side="right")
    utility = -np.abs(below - q * v.size)
    # the largest utility subtracted before scaling: 0.5 epsilon utility overflows to
    # -inf for every candidate at an epsilon near the largest float, and -inf - (-inf)
    # made every probability NaN; this way the best candidates keep logit 0
    with np.errstate(over="ignore"):
        logits = 0.5 * epsilon * (utility - utility.max())
    p = np.exp(logits)
    p /= p.sum()
    return float(grid[rng.choice(n_candidates, p=p)])


def _finite_numbers(owner: str, name: str, values: Any) -> np.ndarray:
    """``values`` as a float array (reads the data, releases nothing): text or objects
    are a :class:`~privlearn.errors.ParameterTypeError`, a NaN or an infinity a
    :class:`~privlearn.errors.NonFiniteInputError` saying what to do, as the estimators'
    own checks."""
    if hasattr(values, "tocsr"):
        raise ParameterTypeError(
            f"{owner}: {name} must be a dense array, got a sparse matrix; convert it with "
            f"{name}.toarray()")
    try:
        is_complex = np.iscomplexobj(values)  # float() would drop the imaginary parts
        arr = None if is_complex else np.asarray(values, dtype=float)
    except (TypeError, ValueError) as e:
        raise ParameterTypeError(
            f"{owner}: {name} must be numbers, got {type(values).__name__} that cannot be "
            f"converted to float ({e}); encode text columns before choosing bounds") from e
    if arr is None:
        raise ParameterTypeError(
            f"{owner}: {name} must be real numbers, got complex values; pass their real "
            f"parts ({name}.real) or magnitudes (abs({name})) if that is what you mean")
    if not np.all(np.isfinite(arr)):
        raise _non_finite_error(owner, name, arr)
    return arr


def _one_value_per_record(owner: str, name: str, values: Any) -> np.ndarray:
    """``values`` as a 1-D float array of one value per record: a 1-D array, or a single
    column ``(n, 1)``. Any other shape is refused (:class:`~privlearn.errors.
    ParameterValueError`): flattening ``(n, k)`` would let one record move ``k``
    entries, so the count utility would change by ``k``, not 1, and the release would be
    ``k epsilon``-DP, not ``epsilon``-DP (McSherry & Talwar 2007, Theorem 6)."""
    arr = _finite_numbers(owner, name, values)
    if arr.ndim > 1 and not (arr.ndim == 2 and arr.shape[1] == 1):
        raise ParameterValueError(
            f"{owner}: {name} must hold one value per record (a 1-D array, or one column "
            f"of shape (n, 1)), got shape {arr.shape}: flattened, one record would move "
            f"{int(np.prod(arr.shape[1:]))} of the values and the release would not be "
            "epsilon-DP. Pass one column at a time (each call costs epsilon; compose their "
            "mechanisms), or a per-record summary such as the row norms (choose_x_bound)")
    return arr.ravel()


def private_quantile(
    values,
    q: float,
    epsilon: float,
    lower: float,
    upper: float,
    *,
    n_candidates: int = 1024,
    random_state=None,
) -> tuple[float, Mechanism]:
    """The ``q``-quantile of ``values`` by the exponential mechanism, ``(epsilon, 0)``-DP.

    Candidates are ``n_candidates`` points evenly spaced on the *public* range
    ``[lower, upper]``; candidate ``t`` has utility ``-|#{v <= t} - q n|``, which changes
    by at most 1 when a record is added or removed, and is drawn with probability
    proportional to ``exp(epsilon * utility / 2)`` (McSherry & Talwar 2007, Theorem 6;
    Smith 2011).

    Returns
    -------
    (float, Mechanism)
        The released quantile and what ran, ``PureDP(epsilon)``.
    """
    if np.ndim(q) != 0 and not isinstance(q, str):
        raise ParameterTypeError(
            f"q must be one number in [0, 1], got {q!r}: each quantile is its own release "
            "of epsilon; call private_quantile once per quantile and compose their "
            "mechanisms (privlearn.accounting.compose)")
    if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0.0 <= q <= 1.0:
        raise ParameterValueError(f"q must be in [0, 1], got {q!r}")
    eps = _v.check_positive("epsilon", epsilon)
    lower, upper = _check_range(lower, upper)
    if isinstance(n_candidates, bool) or not isinstance(n_candidates, numbers.Integral) or (
        n_candidates < 2
    ):
        raise ParameterValueError(f"n_candidates must be an integer >= 2, got {n_candidates!r}")
    v = _one_value_per_record("private_quantile", "values", values)
    rng = make_rng(random_state)
    return _em_quantile(v, float(q), eps, lower, upper, int(n_candidates), rng), PureDP(eps)


def choose_x_bound(
    X, epsilon: float, max_bound: float, *, quantile: float = 0.95, random_state=None
) -> tuple[float, Mechanism]:
    """A private ``x_bound``: the ``quantile`` of the rows' L2 norms, in ``(0, max_bound]``.

    ``max_bound`` is a public upper limit (e.g. ``sqrt(d)`` times a public per-feature
    bound). ``(epsilon, 0)``-DP; returns ``(x_bound, PureDP(epsilon))``.
    """
    X = _finite_numbers("choose_x_bound", "X", X)
    if X.ndim != 2:
        raise ParameterValueError(f"X must be 2-D, got shape {X.shape}")
    mb = _v.check_positive("max_bound", max_bound)
    b, m = private_quantile(row_norms(X), quantile, epsilon, 0.0, mb,
                            random_state=random_state)
    return max(b, mb / 1024), m


def choose_y_bound(
    y, epsilon: float, max_bound: float, *, quantile: float = 0.95, random_state=None
) -> tuple[float, Mechanism]:
    """A private ``y_bound``: the ``quantile`` of ``|y|``, in ``(0, max_bound]``.
    ``(epsilon, 0)``-DP; returns ``(y_bound, PureDP(epsilon))``."""
    y = _one_value_per_record("choose_y_bound", "y", y)
    mb = _v.check_positive("max_bound", max_bound)
    b, m = private_quantile(np.abs(y), quantile, epsilon, 0.0, mb, random_state=random_state)
    return max(b, mb / 1024), m


def feature_ranges(feature_range: object, d: int) -> np.ndarray:
    """``feature_range`` as a ``(d, 2)`` array of public ``(lower, upper)`` rows (one pair
    for every column when given as ``(lower, upper)``), or a
    :class:`~privlearn.errors.ParameterValueError` that names the shape received or the
    first bad row."""
    try:
        fr = np.asarray(feature_range, dtype=float)
    except (TypeError, ValueError):
        fr = np.full((0,), np.nan)  # refused below, with the expected shape
    if fr.shape == (2,):
        fr = np.tile(fr, (d, 1))
    if fr.shape == (d, 2):
        ok = np.isfinite(fr).all(axis=1) & (fr[:, 0] < fr[:, 1])
        if ok.all():
            check_public_ranges("feature_range", fr, d, feature_range)  # overflow
            return fr
        bad = int(np.flatnonzero(~ok)[0])
        what = f"row {bad} (column {bad} of X) is ({fr[bad, 0]:g}, {fr[bad, 1]:g})"
    else:
        what = f"an array of shape {fr.shape}" if fr.size else "not an array of numbers"
        if isinstance(feature_range, Mapping):
            what = ("a dict is not read by column name; give its rows in the order of X's "
                    "columns, e.g. [ranges[c] for c in X.columns] for a DataFrame X")
    raise ParameterValueError(
        f"feature_range must be (lower, upper) or an array of shape ({d}, 2), one "
        "(lower, upper) row per column of X in its order (after any encoding step), with "
        f"finite lower < upper; {what}: got {feature_range!r}")
