"""L2 sensitivity of a strategy ``C`` under a participation schema.

``sens(C) = max ||C sum_{i in pi} e_i g_i^T||_F`` over the participation patterns ``pi``
of the schema and contributions ``||g_i|| <= 1`` (clipped gradients). The Gaussian
mechanism releasing ``C x + sigma z`` then has noise multiplier ``sigma / sens(C)``.

Every value returned is a certified upper bound, rounded up for floating-point error,
and says whether it is exact:

* single participation: the largest column norm (exact);
* b-min-separation with a ``b``-banded ``C``, ``b <= min_sep``: columns of two
  participations are orthogonal, so ``sens^2`` is the largest sum of squared column norms
  over the allowed patterns, found by dynamic programming (exact; [CC23b] Theorem 2 and
  Algorithm 3);
* b-min-separation with non-negative, non-increasing Toeplitz coefficients: the worst
  pattern is ``k`` participations exactly ``min_sep`` apart from step 0 (exact; [KL24]
  Theorem 2);
* fixed epochs ((k, b)-participation, the last epoch possibly cut short) with a banded
  ``C`` of at most ``b`` bands: the min-separation rule above (its best pattern, steps
  ``0, b, ..., (k-1) b``, is a fixed-epoch pattern; exact);
* fixed epochs ((k, b)-participation) with ``C >= 0``: ``C^T C >= 0`` entrywise, so equal
  contributions are worst and ``sens^2 = max_j 1^T (C^T C)[pi_j, pi_j] 1`` (exact;
  [CC23] Section 2, [CC23b] Eq. (5));
* otherwise: ``max_pi sum_{i, i' in pi} |(C^T C)_{i i'}|``, bounded above by the
  row-then-column dynamic programme of [CC23b] Algorithm 4 for min-separation (up to
  :data:`MAX_DENSE_STEPS` steps) and by the exact rule above applied to the smallest
  non-negative, non-increasing majorant of ``|c|`` (any number of steps; the projection
  of jax_privacy's ``toeplitz.minsep_sensitivity_squared``): the smaller of the two, a
  certified upper bound, ``exact=False``.

A :class:`~privlearn.correlated.strategies.DenseStrategy` (not Toeplitz) takes the rules
of :func:`dense_sensitivity`: ``sum |C^T C|`` over each pattern (bounded for rounding),
exact when a sign pattern attains it.

References
----------
.. [CC23] Choquette-Choo, McMahan, Rush & Thakurta (2023), Multi-Epoch Matrix Factorization
       Mechanisms for Private Machine Learning, ICML.
.. [CC23b] Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu (2023), (Amplified)
       Banded Matrix Factorization: A unified approach to private training, NeurIPS.
.. [KL24] Kalinin & Lampert (2024), Banded Square Root Matrix Factorization for
       Differentially Private Model Training, NeurIPS (arXiv:2405.13763), Theorem 2.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from privlearn._type_registry import TypeRegistry
from privlearn._validation import check_count
from privlearn.correlated import _toeplitz
from privlearn.correlated._limits import check_horizon
from privlearn.correlated.participation import (
    FixedEpochs,
    MinSeparation,
    Participation,
    SingleParticipation,
)
from privlearn.correlated.strategies import (
    DenseStrategy,
    ToeplitzStrategy,
    _dense_steps,
    nonzero_bands,
)
from privlearn.errors import AccountingError, ParameterTypeError, ParameterValueError

__all__ = [
    "Sensitivity",
    "sensitivity",
    "register_sensitivity",
    "vector_sensitivity",
    "gram_sensitivity_upper_bound",
    "dense_sensitivity",
]

_U = sys.float_info.epsilon
#: largest n for which a dense n x n Gram matrix is formed (upper-bound path)
MAX_DENSE_STEPS = 8192


@dataclass(frozen=True)
class Sensitivity:
    """The L2 sensitivity of a strategy under a participation schema.

    Attributes
    ----------
    value : float
        A certified upper bound (rounded up), equal to the sensitivity up to that rounding
        when ``exact``.
    exact : bool
        Whether ``value`` is the sensitivity itself rather than only an upper bound.
    method : str
        How it was computed (with the reference).
    """

    value: float
    exact: bool
    method: str

    def __float__(self) -> float:
        return float(self.value)


def _certified_sqrt(square: float, terms: int) -> float:
    """``sqrt`` of a sum of ``terms`` non-negative floats, rounded up for the summation's
    relative error (at most ``terms * u``) and the square root's."""
    if not math.isfinite(square):
        raise AccountingError(
            f"sensitivity computation overflowed (sum of squares {square!r}): the strategy's "
            "entries are too large for float64; rescale C (the sensitivity scales with it)")
    # + 2^-1073: ``square * (1 + ...)`` may round down by an absolute amount when subnormal
    s = math.sqrt(square * (1.0 + (2 * terms + 8) * _U) + 2.0**-1073)
    return math.nextafter(math.nextafter(s, math.inf), math.inf)


#: entries of magnitude in this range are split exactly into halves whose products
#: neither overflow nor underflow (:func:`_sum_of_squares`)
_SPLIT_RANGE = (2.0**-450, 2.0**450)


def _sum_of_squares(x: np.ndarray) -> Fraction:
    """An upper bound, as a fraction, on ``sum x_i^2`` that equals it to within
    ``2^-52`` of the rounding residual: exact for a sum of squares that is itself a float
    (a unit vector gives 1).

    Each ``x_i`` is split exactly into two 26-bit halves (Veltkamp), so ``x_i^2 = h^2 +
    2 h l + l^2`` with every product exact; :func:`math.fsum` rounds the exact sum of
    those terms correctly (``T``), and the rounded residual ``r = fsum(terms - T)``
    bounds what ``T`` missed. ``O(n)`` in floats, not ``O(n)`` big rationals. Entries
    outside :data:`_SPLIT_RANGE` are summed as exact fractions."""
    a = np.abs(x)
    inside = (a >= _SPLIT_RANGE[0]) & (a <= _SPLIT_RANGE[1])
    rest = a[~inside].tolist()
    total = sum((Fraction(y) ** 2 for y in rest), Fraction(0))
    a = a[inside]
    if a.size:
        big = a * 134217729.0  # 2^27 + 1
        hi = big - (big - a)
        lo = a - hi
        terms = np.concatenate([hi * hi, 2.0 * hi * lo, lo * lo]).tolist()
        t = math.fsum(terms)
        terms.append(-t)
        r = math.fsum(terms)
        total += Fraction(t) + Fraction(r) + abs(Fraction(r)) * Fraction(1, 2**52)
    return total


def _certified_norm(v: np.ndarray, relative_error: float = 0.0) -> float:
    """``||v||`` rounded up, exactly: the sum of squares in rational arithmetic (exact for
    float entries), times ``(1 + relative_error)^2`` for the error made computing ``v``
    itself, then the smallest float whose square is at least that. Exactly ``1.0`` for
    a unit vector such as the identity's column."""
    nz = np.asarray(v, dtype=float)
    nz = nz[nz != 0.0]
    if not np.all(np.isfinite(nz)):
        raise AccountingError("sensitivity computation overflowed: a column is not finite")
    total = _sum_of_squares(nz)
    if relative_error:
        total *= (1 + Fraction(relative_error)) ** 2
    if total == 0:
        return 0.0
    # sqrt(total) = sqrt(total * 4^e) / 2^e with total * 4^e a normal float: a sum of
    # squares that underflows (entries below 1e-154) starts the search below at its root,
    # not at 0 (whence nextafter would take ~2^62 steps), and one that overflows is refused
    e = (total.denominator.bit_length() - total.numerator.bit_length()) // 2
    scaled = total * Fraction(4) ** e
    try:
        root = math.ldexp(math.sqrt(float(scaled)), -e)
    except OverflowError:
        root = math.inf
    if not math.isfinite(root):
        raise AccountingError(
            "sensitivity computation overflowed: a column norm exceeds float64; rescale C "
            "(the sensitivity scales with it)")
    root = math.nextafter(root, 0.0)  # ldexp may round up or down: search from below
    while Fraction(root) ** 2 < total:
        root = math.nextafter(root, math.inf)
    return root


def _finite_array(name: str, value: object, ndims: tuple[int, ...], what: str) -> np.ndarray:
    """``value`` as a float array of one of ``ndims`` dimensions with finite entries
    (``what`` says what to pass instead)."""
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ParameterTypeError(
            f"{name} must be a real {' or '.join(f'{d}-D' for d in ndims)} array, got "
            f"{type(value).__name__}; pass a NumPy array of floats") from None
    if arr.ndim not in ndims or arr.size == 0:
        raise ParameterValueError(
            f"{name} must be a non-empty {' or '.join(f'{d}-D' for d in ndims)} array, got "
            f"shape {arr.shape}; pass {what}")
    if not np.isfinite(arr).all():
        raise ParameterValueError(
            f"{name} must have finite entries, got {int((~np.isfinite(arr)).sum())} "
            "NaN or infinite; check the strategy for overflow")
    return arr


def _pattern_counts(min_sep: object, max_participations: object) -> tuple[int, int]:
    """``min_sep`` and ``max_participations`` checked as integers >= 1 (as
    :class:`~privlearn.correlated.participation.MinSeparation` requires)."""
    return (check_count("min_sep", min_sep, minimum=1,
                        hint="steps between two participations, at least 1 (consecutive)"),
            check_count("max_participations", max_participations, minimum=1,
                        hint="participations of one record, at least 1"))


def vector_sensitivity(x: np.ndarray, min_sep: int, max_participations: int) -> float:
    """``max_pi sum_{i in pi} x_i`` over index sets ``pi`` of at most
    ``max_participations`` indices pairwise at least ``min_sep`` apart ([CC23b],
    Algorithm 3, VecSens). ``x`` may be a 2-D array: one maximum per row (vectorised).

    Raises
    ------
    ParameterValueError
        If ``x`` is not a finite 1-D or 2-D array, or ``min_sep`` or
        ``max_participations`` is not an integer >= 1.
    """
    x = _finite_array("x", x, (1, 2), "one value per step (2-D: one row of them per maximum)")
    return _vector_sensitivity(x, *_pattern_counts(min_sep, max_participations))


def _vector_sensitivity(x: np.ndarray, min_sep: int, max_participations: int) -> float:
    """:func:`vector_sensitivity` on arguments already checked."""
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    rows, n = x.shape
    if max_participations >= -(-n // min_sep) and max_participations * rows > 1024 + rows:
        # the count bound is vacuous (no pattern has more): one backward pass,
        # g[i] = max(g[i + 1], x[i] + g[i + min_sep]), O(n) steps over the rows at once
        # instead of max_participations passes over all of x (when those cost more than
        # the n steps' overhead); the same sums in the same order, so the same value
        g = np.zeros((n + min_sep + 1, rows))
        xt = np.ascontiguousarray(x.T)
        for i in range(n - 1, -1, -1):
            np.maximum(g[i + 1], xt[i] + g[i + min_sep], out=g[i])
        return float(g[0, 0]) if squeeze else g[0].copy()
    f = np.zeros((rows, n + min_sep))
    for _ in range(max_participations):
        # f[i] = x[i] + best with one fewer participation from i + min_sep on, then the
        # running maximum from the right (skip i)
        f[:, :n] = x + f[:, min_sep : min_sep + n]
        f = np.maximum.accumulate(f[:, ::-1], axis=1)[:, ::-1]
    out = np.maximum(f[:, 0], 0.0)
    return float(out[0]) if squeeze else out


def gram_sensitivity_upper_bound(
    c_matrix: np.ndarray, min_sep: int, max_participations: int
) -> float:
    """Certified upper bound on the min-separation sensitivity of any ``C`` ([CC23b],
    Algorithm 4): ``X = |C^T C|``, the best pattern of each row, then of the row maxima.

    The bound drops the requirement that rows and columns use the same pattern, so it is
    valid for every ``C``; it is exact for ``b``-banded ``C`` with ``b <= min_sep``.

    Raises
    ------
    ParameterValueError
        If ``c_matrix`` is not a finite 2-D array, or ``min_sep`` or
        ``max_participations`` is not an integer >= 1.
    """
    c_matrix = _finite_array("c_matrix", c_matrix, (2,), "the strategy matrix (rows x steps)")
    min_sep, max_participations = _pattern_counts(min_sep, max_participations)
    return _abs_gram_bound(np.abs(c_matrix.T @ c_matrix), min_sep, max_participations)


def _abs_gram_bound(x: np.ndarray, min_sep: int, max_participations: int) -> float:
    """[CC23b] Algorithm 4 on ``x = |C^T C|``: the best pattern of each row, then of the
    row maxima, rounded up."""
    n = x.shape[1]
    # x is symmetric: its transpose is the column-major layout the dynamic programme reads
    rows = _vector_sensitivity(x.T, min_sep, max_participations)
    total = _vector_sensitivity(rows, min_sep, max_participations)
    return _certified_sqrt(total, n * n + n)


def _toeplitz_abs_gram(c: np.ndarray, n: int) -> np.ndarray:
    """``|C^T C|`` for the lower-triangular Toeplitz ``C = T(c)`` in ``O(n^2)`` (no
    ``O(n^3)`` product): ``(C^T C)_{ij} = sum_{s <= n-1-max(i,j)} c_s c_{s+|i-j|}``, the
    running sums of the lagged products ``P[d, t] = sum_{s <= t} c_s c_{s+d}``."""
    c = _toeplitz.pad(c, n)
    lagged = np.lib.stride_tricks.sliding_window_view(np.concatenate([c, np.zeros(n)]), n)
    p = np.multiply(lagged[:n], c)  # p[d, s] = c_{s+d} c_s
    np.cumsum(p, axis=1, out=p)
    np.abs(p, out=p)
    x = np.empty((n, n))
    flat = x.reshape(-1)
    for d in range(n):  # diagonal d: x[i, i+d] = x[i+d, i] = p[d, n-1-d-i]
        run = p[d, n - 1 - d :: -1]
        flat[d : (n - d) * n : n + 1] = run
        flat[d * n : n * n : n + 1] = run
    return x


_RULES: TypeRegistry[Callable[[ToeplitzStrategy, Participation, int], Sensitivity]] = (
    TypeRegistry("sensitivity rules"))


def register_sensitivity(
    cls: type, rule: Callable[[ToeplitzStrategy, Participation, int], Sensitivity]
) -> None:
    """Register how the sensitivity is computed for a participation schema class."""
    if not (isinstance(cls, type) and issubclass(cls, Participation)):
        raise ParameterTypeError(
            f"register_sensitivity: cls must be a Participation subclass, got {cls!r}; "
            "pass the class itself (e.g. MinSeparation), not an instance")
    _RULES[cls] = rule


def sensitivity(
    strategy: ToeplitzStrategy, participation: Participation, steps: int
) -> Sensitivity:
    """L2 sensitivity of ``strategy`` (an ``steps x steps`` matrix) under ``participation``.

    Parameters
    ----------
    strategy : ToeplitzStrategy or DenseStrategy
        A :class:`~privlearn.correlated.strategies.DenseStrategy` takes the rules of
        :func:`dense_sensitivity` (the three schemas below only).
    participation : Participation
        :class:`~privlearn.correlated.participation.SingleParticipation`,
        :class:`~privlearn.correlated.participation.MinSeparation` or
        :class:`~privlearn.correlated.participation.FixedEpochs`.
    steps : int
        Number of steps ``n``: any for a banded strategy whose rule needs only its
        bands, else at most ``2**27`` (:data:`~privlearn.correlated._limits.MAX_STEPS`,
        the coefficients are an array of ``n`` entries; refused with
        ``ParameterValueError`` past it).

    Returns
    -------
    Sensitivity
        A certified upper bound, exact where the module docstring says so.

    Examples
    --------
    >>> from privlearn.correlated import BandedToeplitz, MinSeparation, sensitivity
    >>> C = BandedToeplitz.square_root(bands=4)
    >>> s = sensitivity(C, MinSeparation(min_sep=4), steps=16)    # 4 participations
    >>> round(s.value, 6), s.exact
    (2.0, True)
    """
    if isinstance(strategy, DenseStrategy):
        return dense_sensitivity(strategy, participation, steps)
    if not isinstance(strategy, ToeplitzStrategy):
        raise ParameterTypeError(
            f"strategy must be a privlearn.correlated strategy (BandedToeplitz, "
            f"BufferedToeplitz, DenseStrategy, ...), got {strategy!r}")
    steps = check_count("steps", steps, minimum=1)
    rule = _RULES.lookup(participation)
    if rule is not None:
        return rule(strategy, participation, steps)
    raise ParameterTypeError(
        f"participation must be one of {', '.join(c.__name__ for c in _RULES)}, got "
        f"{participation!r}; register a rule for a new schema with register_sensitivity")


#: what to do instead of asking for the sensitivity of a long horizon
_HORIZON_HINT = (
    "a strategy that is not banded needs its n coefficients; use a banded strategy "
    "(its sensitivity needs only its bands, for any number of steps) or fewer steps"
)


def _coefs(strategy: ToeplitzStrategy, n: int) -> np.ndarray:
    """``strategy.toeplitz_coefs(n)``, ``n`` refused past
    :data:`~privlearn.correlated._limits.MAX_STEPS` with a typed error naming ``steps``
    (the parameter of :func:`sensitivity`), never a bare ``MemoryError``."""
    check_horizon(n, n, hint=_HORIZON_HINT)
    return strategy.toeplitz_coefs(n)


def _leading_coefs(strategy: ToeplitzStrategy, n: int) -> np.ndarray:
    """The first column of the ``n x n`` ``C`` up to its last possibly non-zero entry:
    ``min(n, bands)`` entries for a banded ``C`` (the rest are zero, whatever ``n``)."""
    b = nonzero_bands(strategy)
    return _coefs(strategy, n if b is None else min(n, b))


def _upper(strategy: ToeplitzStrategy, c: np.ndarray) -> np.ndarray:
    """``c`` (the computed coefficients) made an entrywise upper bound on the magnitudes
    of the true ones: ``|c|`` plus the strategy's bound on their rounding error
    (:meth:`~privlearn.correlated.strategies.ToeplitzStrategy.coefs_error_bound`), so the
    norms below bound the sensitivity of ``C`` itself, not of its rounded coefficients."""
    err = strategy.coefs_error_bound(c.size)
    return c if err is None else np.abs(c) + err


def _single(strategy: ToeplitzStrategy, participation: Participation, n: int) -> Sensitivity:
    c = _upper(strategy, _leading_coefs(strategy, n))
    return Sensitivity(
        _certified_norm(c), True, "largest column norm (single participation)"
    )


def _nonneg_nonincreasing(c: np.ndarray) -> bool:
    return bool(np.all(c >= 0.0) and np.all(c[1:] <= c[:-1]))


def _window_sums(a: np.ndarray, k: int) -> np.ndarray:
    """``out[r] = sum_{r' = max(0, r - k + 1)}^{r} a[r']`` (rows of a non-negative 2-D
    ``a``) in ``O(a.size)`` whatever ``k``: within blocks of ``k`` rows, each window is a
    suffix of one block plus a prefix of the next (van Herk 1992; Gil & Werman 1993), a
    sum of at most ``2k`` non-negative terms (relative error at most ``2k u``), with no
    subtraction."""
    rows = a.shape[0]
    if k >= rows:
        return np.cumsum(a, axis=0)
    blocks = -(-rows // k)
    padded = np.zeros((blocks * k, *a.shape[1:]))
    padded[:rows] = a
    tiles = padded.reshape(blocks, k, *a.shape[1:])
    prefix = np.cumsum(tiles, axis=1).reshape(padded.shape)[:rows]
    suffix = np.cumsum(tiles[:, ::-1], axis=1)[:, ::-1].reshape(padded.shape)
    out = prefix.copy()
    r = np.arange(rows)
    start = r - k + 1
    split = (start > 0) & (start % k != 0)  # the window starts inside the previous block
    out[split] += suffix[start[split]]
    return out


def _spaced_sum(c: np.ndarray, n: int, sep: int, k: int) -> np.ndarray:
    """``sum_{m < k} shift(c, m * sep)`` truncated to ``n``: ``C u`` for the pattern
    ``0, sep, ..., (k-1) sep``. Entry ``t = r sep + j`` is the sum of ``c[r' sep + j]``
    over the last ``k`` rows ``r' <= r`` of ``c`` cut into rows of ``sep``: ``O(n)``
    (:func:`_window_sums`), each entry a sum of at most ``2k`` non-negative terms for
    ``c >= 0``."""
    rows = -(-n // sep)
    a = _toeplitz.pad(c, rows * sep).reshape(rows, sep)
    return _window_sums(a, k).reshape(-1)[:n]


def _majorant_bound(strategy: ToeplitzStrategy, n: int, sep: int, k: int) -> float:
    """Upper bound on the sensitivity of any Toeplitz ``C = T(c)`` under ``k``
    participations at least ``sep`` apart, in ``O(n)``.

    ``M = T(m)`` with ``m_j = max_{i >= j} |c_i|`` (the smallest non-negative,
    non-increasing majorant of ``|c|``) has ``|C| <= M`` entrywise, so for every pattern
    ``pi`` and unit contributions ``sum_{i, i' in pi} (C^T C)_{i i'} <g_i, g_i'> <=
    sum_{i, i' in pi} (M^T M)_{i i'} = ||M 1_pi||^2``, at most ``M``'s exact sensitivity:
    ``k`` participations ``sep`` apart from step 0 ([KL24], Theorem 2). Fixed-epoch
    patterns are min-separation patterns of ``epochs`` participations, so it bounds
    those too."""
    c = np.abs(_upper(strategy, _leading_coefs(strategy, n)))
    majorant = np.maximum.accumulate(c[::-1])[::-1]
    return _certified_norm(_spaced_sum(majorant, n, sep, k), 4 * k * _U)


def _dense_upper_bound(strategy: ToeplitzStrategy, n: int, sep: int, k: int) -> Sensitivity:
    """The general rule: the majorant bound (any ``n``) and, for ``n <=``
    :data:`MAX_DENSE_STEPS`, [CC23b] Algorithm 4 on ``|C^T C|``; the smaller of the two
    (both certified upper bounds)."""
    majorant = Sensitivity(
        _majorant_bound(strategy, n, sep, k),
        False,
        f"upper bound: non-increasing majorant of |c|, {k} participations {sep} apart "
        "([KL24] Thm. 2)",
    )
    if n > MAX_DENSE_STEPS:
        return majorant
    value = _abs_gram_bound(_toeplitz_abs_gram(strategy.toeplitz_coefs(n), n), sep, k)
    if majorant.value < value:
        return majorant
    return Sensitivity(
        value, False, "upper bound: row-then-column dynamic programme on |C^T C| ([CC23b] Alg. 4)"
    )


def _min_sep(strategy: ToeplitzStrategy, participation: Participation, n: int) -> Sensitivity:
    assert isinstance(participation, MinSeparation)
    sep, k = participation.min_sep, participation.participations(n)
    if k == 1:
        return _single(strategy, participation, n)
    b = nonzero_bands(strategy)
    if b is not None and b <= sep:
        # columns of two participations are orthogonal; the squared column norms
        # ||C[:, i]||^2 = sum_{j < min(b, n-i)} c_j^2 do not increase with i, and the
        # m-th step of any pattern is >= m * sep: the best pattern is steps 0, sep, ...,
        # (k-1) sep ([CC23b] Algorithm 3 on such a vector). Its columns are whole (norm^2
        # cum[-1]) while n - m * sep >= len(c), then truncated: O(b), whatever n
        c = _leading_coefs(strategy, n)
        cum = np.cumsum(c * c)
        whole = min(k, (n - c.size) // sep + 1)
        cut = [float(cum[n - m * sep - 1]) for m in range(whole, k)]
        total = math.fsum([whole * float(cum[-1]), *cut])
        return Sensitivity(
            _certified_sqrt(total, 2 * c.size + 4), True,
            f"{b}-banded with min_sep={sep}: best pattern of column norms ([CC23b] Thm. 2)",
        )
    c = _coefs(strategy, n)
    if _nonneg_nonincreasing(c):
        w = _spaced_sum(_upper(strategy, c), n, sep, k)
        return Sensitivity(
            _certified_norm(w, 4 * k * _U), True,
            f"non-negative non-increasing Toeplitz: {k} participations {sep} apart ([KL24] Thm. 2)",
        )
    return _dense_upper_bound(strategy, n, sep, k)


def _fixed_epochs(strategy: ToeplitzStrategy, participation: Participation, n: int) -> Sensitivity:
    assert isinstance(participation, FixedEpochs)
    per_epoch = participation.steps_per_epoch(n)
    k = participation.epochs
    if k == 1:
        return _single(strategy, participation, n)
    b = nonzero_bands(strategy)
    if b is not None and b <= per_epoch:
        # the patterns j, j + per_epoch, ... are min-separation patterns of k
        # participations, and the best of those (steps 0, per_epoch, ...) is one of
        # them: the exact banded rule, whatever the signs of C and whatever n
        value = _min_sep(strategy, MinSeparation(per_epoch, k), n).value
        return Sensitivity(
            value, True,
            f"{b}-banded, {k} epochs of {per_epoch} steps: column norms of steps 0, "
            f"{per_epoch}, ... ([CC23b] Thm. 2)",
        )
    c = _coefs(strategy, n)
    if np.all(c >= 0.0):
        # C >= 0: equal contributions are worst, and the pattern starting at step 0 has
        # the largest ||C u|| (the others are truncations of it)
        w = _spaced_sum(_upper(strategy, c), n, per_epoch, k)
        return Sensitivity(
            _certified_norm(w, 4 * k * _U), True,
            f"C >= 0 entrywise, {k} epochs of {per_epoch} steps ([CC23] Sec. 2)",
        )
    if n > MAX_DENSE_STEPS:
        # the fixed-epoch patterns are min-separation patterns of k participations
        return _dense_upper_bound(strategy, n, per_epoch, k)
    x = np.zeros((k * per_epoch, k * per_epoch))  # a last epoch cut short: the steps
    x[:n, :n] = _toeplitz_abs_gram(c, n)  # past n take no part (zero rows and columns)
    idx = np.arange(k * per_epoch).reshape(k, per_epoch)  # column j: j, j + b, ...
    sums = x[idx[:, None, :], idx[None, :, :]].sum(axis=(0, 1))
    return Sensitivity(
        _certified_sqrt(float(sums.max()), k * k), False,
        "upper bound: largest sum of |C^T C| over the epoch patterns ([CC23b] Eq. (5))",
    )


register_sensitivity(SingleParticipation, _single)
register_sensitivity(MinSeparation, _min_sep)
register_sensitivity(FixedEpochs, _fixed_epochs)


# -- dense (non-Toeplitz) strategies -------------------------------------------------------
#: relative gap between the certified bound and a value attained by a pattern below which
#: a dense strategy's sensitivity is reported ``exact`` (the bound is returned either way)
_DENSE_EXACT_RTOL = 1e-9
#: 4 x 2^-1075: the absolute error a product in the subnormal range may make, with margin
_ETA = 2.0**-1073


def _dense_gram(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``X = C^T C`` as computed and ``E >= |C^T C|`` entrywise: ``|X| + gamma |C|^T |C|``
    with ``gamma = (n + 2) u / (1 - (n + 2) u)``, which bounds the rounding of a dot
    product of ``n`` terms (Higham, Accuracy and Stability of Numerical Algorithms,
    2002, Eq. (3.5)) with a margin for forming the bound itself."""
    n = c.shape[0]
    x = c.T @ c
    a = np.abs(c)
    gamma = (n + 2) * _U / (1.0 - (n + 2) * _U)
    # + an absolute term for underflow: a product below the normal range rounds with an
    # absolute error up to 2^-1075 (Higham 2002, Sec. 2.1), not a relative one, so a C
    # of entries near 1e-160 would otherwise get a sum of |C^T C| of 0
    e = np.abs(x) + (2.0 * gamma) * (a.T @ a) + (n + 2) * _ETA
    return x, e


def _attained(x: np.ndarray, patterns: list[np.ndarray]) -> float:
    """The largest ``u^T X u = ||C u||^2`` over ``u`` = signs on one of ``patterns`` (a
    lower bound on ``sens^2``, up to the rounding of ``X``): all ones, and the signs of the
    pattern's first row of ``X`` (both attain ``sum |X|`` over the pattern when ``X``'s
    signs there allow it). ``O(k^2)`` per pattern of ``k`` steps."""
    best = 0.0
    for idx in patterns:
        sub = x[np.ix_(idx, idx)]
        first = np.sign(sub[0])
        first[first == 0.0] = 1.0
        best = max(best, float(sub.sum()), float(first @ sub @ first))
    return best


def dense_sensitivity(
    strategy: DenseStrategy, participation: Participation, steps: int | None = None
) -> Sensitivity:
    """L2 sensitivity of a :class:`~privlearn.correlated.strategies.DenseStrategy` (its
    leading ``steps x steps`` block: a run of ``steps`` steps) under ``participation``.

    With ``X = C^T C`` and unit contributions, ``||C sum_{i in pi} e_i g_i^T||_F^2 =
    sum_{i, i' in pi} X_{i i'} <g_i, g_i'> <= sum_{i, i' in pi} |X_{i i'}|``, attained
    when the signs of ``X`` on ``pi`` are those of ``s s^T`` for a sign vector ``s``
    (``g_i = s_i g``). Every value is a certified upper bound: ``X`` is bounded entrywise
    for its rounding (:func:`_dense_gram`) and the square root is rounded up.

    * single participation: the largest column norm (exact);
    * fixed epochs ((k, b)-participation, [CC23] Section 2): a record contributes at
      ``j, j + b, ...`` for one ``j``, so ``sens^2 <= max_j sum |X|`` over that pattern
      (every subset of it is covered, ``|X| >= 0``). ``exact`` when a sign pattern
      attains it to within ``1e-9`` (relative): e.g. ``X >= 0``, or ``X[i, i'] = 0`` for
      ``i != i'`` of one pattern, the structure :func:`~privlearn.correlated.optimize_dense`
      keeps ([CC23], Section 4);
    * b-min-separation: [CC23b] Algorithm 4 on the bound of ``|X|`` (valid for every
      ``C``), and, when ``X`` vanishes on pairs at least ``min_sep`` apart, the best
      pattern of its diagonal plus the ``k (k - 1)`` largest of those entries' bounds;
      the smaller. ``exact`` when a pattern attains it to within ``1e-9`` (relative).

    Parameters
    ----------
    strategy : DenseStrategy
    participation : Participation
        :class:`~privlearn.correlated.participation.SingleParticipation`,
        :class:`~privlearn.correlated.participation.MinSeparation` or
        :class:`~privlearn.correlated.participation.FixedEpochs`.
    steps : int, optional
        Steps run, at most ``strategy.steps`` (default: all of them).

    Raises
    ------
    ParameterTypeError
        Another participation schema: no bound is known for a dense ``C`` under it.
    ParameterValueError
        ``steps`` outside ``[1, strategy.steps]``.

    Examples
    --------
    >>> import numpy as np
    >>> from privlearn.correlated import DenseStrategy, FixedEpochs, dense_sensitivity
    >>> C = DenseStrategy(np.eye(4))
    >>> s = dense_sensitivity(C, FixedEpochs(2))
    >>> round(s.value, 9), s.exact
    (1.414213562, True)
    """
    if not isinstance(strategy, DenseStrategy):
        raise ParameterTypeError(
            f"strategy must be a DenseStrategy, got {strategy!r}; use sensitivity() for "
            "a Toeplitz strategy")
    if steps is not None:
        steps = _dense_steps(strategy, steps)
    c = strategy.materialize(steps)
    n = c.shape[0]
    if isinstance(participation, SingleParticipation) or (
            isinstance(participation, Participation)
            and type(participation) in (MinSeparation, FixedEpochs)
            and participation.participations(n) == 1):
        norms = np.einsum("ij,ij->j", c, c)
        top = np.flatnonzero(norms >= norms.max() * (1.0 - 1e-6))
        value = max(_certified_norm(c[:, j]) for j in top)
        return Sensitivity(value, True, "largest column norm (single participation)")
    if type(participation) is FixedEpochs:
        per = participation.steps_per_epoch(n)
        k = participation.epochs
        x, e = _dense_gram(c)
        patterns = [np.arange(j, n, per) for j in range(min(per, n))]
        bound = max(math.fsum(e[np.ix_(p, p)].ravel().tolist()) for p in patterns)
        value = _certified_sqrt(bound, k * k)
        exact = _attained(x, patterns) >= bound * (1.0 - _DENSE_EXACT_RTOL)
        return Sensitivity(
            value, exact,
            f"largest sum of |C^T C| over the {k}-epoch patterns of {per} steps "
            "([CC23] Sec. 2)")
    if type(participation) is MinSeparation:
        sep, k = participation.min_sep, participation.participations(n)
        x, e = _dense_gram(c)
        total = _vector_sensitivity(_vector_sensitivity(e.T, sep, k), sep, k)
        method = "row-then-column dynamic programme on |C^T C| ([CC23b] Alg. 4)"
        i, j = np.indices(x.shape)
        far = np.abs(i - j) >= sep
        if far.any():
            off = np.sort(e[far])[::-1][: k * (k - 1)]
            diag_total = _vector_sensitivity(np.diag(e).copy(), sep, k) + math.fsum(
                off.tolist())
        else:
            diag_total = _vector_sensitivity(np.diag(e).copy(), sep, k)
        if diag_total < total:
            total = diag_total
            method = (f"best pattern of the column norms: C^T C vanishes {sep} or more "
                      "steps apart ([CC23b] Thm. 2)")
        value = _certified_sqrt(total, n * n + n)
        best = _best_pattern(np.diag(x).copy(), sep, k)
        exact = _attained(x, [best]) >= total * (1.0 - _DENSE_EXACT_RTOL)
        return Sensitivity(value, exact, method if exact else f"upper bound: {method}")
    raise ParameterTypeError(
        f"participation must be SingleParticipation, MinSeparation or FixedEpochs for a "
        f"DenseStrategy, got {participation!r}: no sensitivity bound is known for a "
        "dense strategy under it; use one of those schemas")


def _best_pattern(x: np.ndarray, sep: int, k: int) -> np.ndarray:
    """Indices of a pattern of at most ``k`` indices pairwise ``sep`` apart maximising
    ``sum x`` over it (``x >= 0``; the argmax of [CC23b] Algorithm 3): ``g[m, i]``, the
    best sum over ``[i, n)`` with at most ``m`` indices, is a suffix maximum (``O(k n)``
    in NumPy), then the pattern is read back from step 0."""
    n = x.size
    g = np.zeros((k + 1, n + sep + 1))
    for m in range(1, k + 1):
        g[m, :n] = np.maximum.accumulate((x + g[m - 1, sep : sep + n])[::-1])[::-1]
    out: list[int] = []
    i, m = 0, k
    while m > 0 and i < n:
        vals = x[i:] + g[m - 1, i + sep : n + sep]
        j = i + int(np.argmax(vals))
        out.append(j)
        i, m = j + sep, m - 1
    return np.array(out)
