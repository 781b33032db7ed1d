"""Strategy matrices ``C`` of the matrix-factorization (correlated-noise) mechanisms.

A matrix-factorization mechanism releases ``A x + B z`` with ``A = B C`` for the
workload ``A`` (e.g. prefix sums of gradients: the iterates of SGD), i.e. it adds the
noise ``C^{-1} z`` (``z`` i.i.d. Gaussian) to the gradients: step ``t`` adds row ``t`` of
``C^{-1} z``. Its privacy is that of the Gaussian mechanism releasing ``C x + z``, with the
L2 sensitivity of ``C`` under the participation schema
(:mod:`privlearn.correlated.sensitivity`).

Every strategy here is lower-triangular Toeplitz, described by a few numbers that do not
grow with the number of steps:

* :class:`Identity` -- ``C = I``: DP-SGD (independent noise);
* :class:`BandedToeplitz` -- ``b`` coefficients ``c_0..c_{b-1}``: ``C[i, j] = c_{i-j}`` for
  ``0 <= i - j < b`` (Choquette-Choo et al. 2023; Kalinin & Lampert 2024);
* :class:`BufferedToeplitz` -- a BLT with ``m`` buffers: ``C[i, i] = 1`` and
  ``C[i, j] = sum_k output_scale[k] * buf_decay[k]^(i-j-1)`` for ``i > j`` (Dvijotham et
  al. 2024; McMahan et al. 2024).

Each gives the online recurrence that produces the noise of step ``t`` from the current
Gaussian draw and a fixed number of buffers (:meth:`~ToeplitzStrategy.recurrence`,
:mod:`privlearn.correlated.noise`): memory ``O(b)`` or ``O(m)`` times the parameter size,
never ``O(steps)``.

:class:`DenseStrategy` is the exception: a full lower-triangular ``C`` fixed to its ``n``
steps (the optimal factorizations of [DMRST22] and [CC23],
:func:`~privlearn.correlated.optimize_dense`), whose noise keeps every past draw (``n``
buffers of the parameters' size).

References
----------
.. [CC23] Choquette-Choo, McMahan, Rush & Thakurta (2023), Multi-Epoch Matrix Factorization
       Mechanisms for Private Machine Learning, ICML.
.. [CC23b] Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu (2023), (Amplified)
       Banded Matrix Factorization: A unified approach to private training, NeurIPS,
       Algorithm 9 (the banded recurrence).
.. [DMRST22] Denisov, McMahan, Rush, Smith & Thakurta (2022), Improved Differential
       Privacy for SGD via Optimal Private Linear Operators on Adaptive Streams, NeurIPS.
.. [FHU23] Fichtenberger, Henzinger & Upadhyay (2023), Constant Matters: Fine-grained Error
       Bound on Differentially Private Continual Observation, ICML, Algorithm 1.
.. [KL24] Kalinin & Lampert (2024), Banded Square Root Matrix Factorization for
       Differentially Private Model Training, NeurIPS.
.. [DMPST24] Dvijotham, McMahan, Pillutla, Steinke & Thakurta (2024), Efficient and
       Near-Optimal Noise Generation for Streaming Differential Privacy, FOCS,
       Section 5 (BLTs).
.. [MJPD24] McMahan, Jia, Pillutla, Dvijotham et al. (2024), Hassle-Free Matrix
       Factorization Mechanisms for Private Learning (arXiv:2408.08868), Algorithms 2-3.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular

from privlearn._validation import check_count
from privlearn.correlated import _toeplitz
from privlearn.correlated._dense_fidelity import MAX_RESIDUAL, sensitivity_factor
from privlearn.correlated._limits import MAX_STEPS, check_horizon
from privlearn.errors import (
    AccountingError,
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
)

__all__ = [
    "ToeplitzStrategy",
    "Identity",
    "BandedToeplitz",
    "BufferedToeplitz",
    "BandedRecurrence",
    "BufferedRecurrence",
    "square_root_coefs",
    "check_stable",
    "nonzero_bands",
    "DenseStrategy",
    "DenseRecurrence",
    "MAX_DENSE_STEPS",
]

#: the machine epsilon of float64 (a rounding's relative error is at most half of it)
_EPS = float(np.finfo(float).eps)


#: what to do instead of asking a strategy for more steps than :data:`MAX_STEPS`
_STEPS_HINT = (
    "ask for fewer steps (a Toeplitz strategy's coefficients, inverse and sensitivity "
    "over fewer steps are a prefix of those over more)"
)


def _steps(n: object, size_name: str | None = None, size: int = 1) -> int:
    """``n`` checked as a count of steps within :data:`MAX_STEPS` float64 entries (times
    ``size`` for an array of ``n x size``): a typed refusal, not a bare MemoryError."""
    k = check_count("n", n, minimum=1)
    check_horizon(k, n, size_name, size, size, name="n", hint=_STEPS_HINT)
    return k


def square_root_coefs(n: int) -> np.ndarray:
    """The first ``n`` Toeplitz coefficients of ``A^{1/2}`` for the prefix-sum ``A``:
    ``c_k = binom(2k, k) / 4^k`` (the series of ``(1 - x)^{-1/2}``; [FHU23], Algorithm 1).
    Truncated to ``b`` terms this is the banded square root of [KL24]."""
    n = _steps(n)
    k = np.arange(n, dtype=float)
    ratios = np.where(k == 0, 1.0, (2 * k - 1) / np.maximum(2 * k, 1.0))
    return np.cumprod(ratios)


def _as_coefs(name: str, values: object, *, allow_empty: bool = False) -> tuple[float, ...]:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ParameterTypeError(
            f"{name} must be a sequence of real numbers, got {values!r}; pass e.g. "
            "(1.0, 0.5)") from None
    if arr.ndim != 1 or (arr.size == 0 and not allow_empty):
        raise ParameterValueError(
            f"{name} must be a non-empty 1-D sequence of real numbers, got shape "
            f"{arr.shape}; pass a flat sequence such as (1.0, 0.5)")
    if not np.all(np.isfinite(arr)):
        raise ParameterValueError(
            f"{name} must be finite, got {arr.tolist()!r}; remove the NaN or inf entries")
    return tuple(float(v) for v in arr)


def blt_inverse_coefs(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """First column of ``C^{-1}`` for the BLT with decays ``theta`` and weights ``omega``
    (see :meth:`BufferedToeplitz.inverse_toeplitz_coefs`)."""
    n = _steps(n, "buffers", max(1, np.size(theta)))
    out = np.zeros(n)
    out[0] = 1.0
    m = theta.size
    if n == 1 or m == 0:
        return out
    mat = np.diag(theta) - np.outer(np.ones(m), omega)
    width = max(1, int(math.isqrt(n - 1)))
    rows = np.empty((width, m))
    row = -omega
    with np.errstate(under="ignore"):
        for s in range(width):
            rows[s] = row
            row = row @ mat
        step = np.linalg.matrix_power(mat, width)
        blocks = -(-(n - 1) // width)
        states = np.empty((m, blocks))
        state = np.ones(m)
        for j in range(blocks):
            states[:, j] = state
            state = step @ state
        out[1:] = (rows @ states).T.reshape(-1)[: n - 1]
    return out


def _check_finite(what: str, strategy: object, values: np.ndarray, n: int) -> np.ndarray:
    """``values`` (``what`` of ``strategy`` over ``n`` steps, computed from its ``C^{-1}``)
    if every entry is finite, else :class:`~privlearn.errors.AccountingError`: an
    inverse that overflows is refused, never returned as inf or nan."""
    if not np.all(np.isfinite(values)):
        raise AccountingError(
            f"the {what} of {strategy!r} over {n} steps is not finite (C^{{-1}} overflows: "
            "its entries grow geometrically); use a strategy with a stable inverse, or "
            "fewer steps")
    return values


# -- the online recurrences ----------------------------------------------------------------
@dataclass(frozen=True)
class BandedRecurrence:
    """Noise of step ``t`` for a banded Toeplitz ``C``: row ``t`` of ``C^{-1} z``.

    ``noise_t = (z_t - sum_{j=1}^{b-1} coefs[j] * noise_{t-j}) / coefs[0]`` ([CC23b],
    Algorithm 9), with ``noise_{t-j} = 0`` for ``t - j < 0``. The state is the last
    ``b - 1`` noises; each step costs ``b - 1`` axpy's and one scale.
    """

    coefs: tuple[float, ...]

    @property
    def buffers(self) -> int:
        """Number of parameter-sized buffers the recurrence keeps (``b - 1``)."""
        return len(self.coefs) - 1

    @property
    def spectral_radius(self) -> float:
        """Largest modulus of the roots of ``c_0 x^{b-1} + c_1 x^{b-2} + ... + c_{b-1}``:
        the noise's entries ``(C^{-1})_{t0}`` grow like its ``t``-th power (Schur-Cohn:
        bounded iff every root lies in the closed unit disk)."""
        if len(self.coefs) == 1:
            return 0.0
        return float(np.max(np.abs(np.roots(self.coefs))))


@dataclass(frozen=True)
class BufferedRecurrence:
    """Noise of step ``t`` for a BLT ``C``: row ``t`` of ``C^{-1} z``.

    ``noise_t = z_t - sum_k output_scale[k] * buf_k`` then, for every buffer,
    ``buf_k <- buf_decay[k] * buf_k + noise_t`` (buffers start at 0; [MJPD24],
    Algorithm 3). Each step costs two axpy's per buffer.
    """

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    @property
    def buffers(self) -> int:
        """Number of parameter-sized buffers the recurrence keeps."""
        return len(self.buf_decay)

    @property
    def spectral_radius(self) -> float:
        """Largest modulus of the eigenvalues of ``diag(buf_decay) - 1 output_scale^T``,
        the decays of the BLT ``C^{-1}`` ([DMPST24], Lemma 5.2): the noise's entries
        grow like its ``t``-th power."""
        if not self.buf_decay:
            return 0.0
        mat = np.diag(self.buf_decay) - np.outer(np.ones(self.buffers), self.output_scale)
        return float(np.max(np.abs(np.linalg.eigvals(mat))))


#: spectral radius above which a noise recurrence is refused (``1 +`` the round-off of a
#: root on the unit circle, e.g. ``C^{-1}`` = prefix sums)
STABLE_RADIUS = 1.0 + 1e-6


def check_stable(recurrence: BandedRecurrence | BufferedRecurrence) -> None:
    """Refuse a noise recurrence whose ``C^{-1}`` grows without bound.

    The noise of step ``t`` is row ``t`` of ``C^{-1} z``; when the recurrence's spectral
    radius exceeds 1 its entries grow geometrically and the noise overflows to inf/nan
    within a few hundred steps. Such a ``C`` (a BLT whose inverse has a decay outside
    the unit disk, [DMPST24] Lemma 5.2; a banded ``C`` with a root inside it) is refused
    before any noise is drawn.

    Raises
    ------
    ConfigurationError
        The spectral radius is above 1.
    """
    radius = recurrence.spectral_radius
    if not radius <= STABLE_RADIUS:
        raise ConfigurationError(
            f"the strategy's inverse C^{{-1}} grows without bound (its noise recurrence "
            f"{recurrence!r} has spectral radius {radius:.6g} > 1, so the noise of step t "
            f"grows like {radius:.4g}^t and overflows); use a strategy with a stable "
            "inverse: optimize_banded_toeplitz / optimize_blt, BandedToeplitz.square_root, "
            "or a BLT whose inverse decays lie in [-1, 1]")


def nonzero_bands(strategy: ToeplitzStrategy) -> int | None:
    """The diagonals of ``strategy`` up to its last non-zero one (``strategy.bands`` less
    trailing zero coefficients, which an optimised banded strategy may end with); None
    when it is not banded. What the banded rules of the sensitivity and the amplified
    accounting need: ``C[i, j] = 0`` for ``i - j >=`` it."""
    b = strategy.bands
    if b is None:
        return None
    nz = np.flatnonzero(strategy.toeplitz_coefs(b))
    return int(nz[-1]) + 1 if nz.size else b


# -- strategies ----------------------------------------------------------------------------
class ToeplitzStrategy:
    """Base class: a lower-triangular Toeplitz strategy ``C`` of any size ``n``."""

    __slots__ = ()

    @property
    def bands(self) -> int | None:
        """Number of non-zero diagonals (``C[i, j] = 0`` for ``i - j >= bands``); None
        when ``C`` is not banded."""
        raise NotImplementedError

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        """First column of the ``n x n`` matrix ``C``."""
        raise NotImplementedError

    def coefs_error_bound(self, n: int) -> np.ndarray | None:
        """Entrywise bound on ``|c_j - toeplitz_coefs(n)[j]|``, the floating-point error of
        the computed coefficients; None when they are exact (given, not computed). The
        certified sensitivities add it to ``|c|`` before taking norms."""
        return None

    def inverse_toeplitz_coefs(self, n: int) -> np.ndarray:
        """First column of ``C^{-1}`` (the noise correlations: step ``t`` adds
        ``sum_s r_{t-s} z_s``).

        Raises
        ------
        AccountingError
            An entry overflows (``C^{-1}`` grows geometrically): never inf or nan."""
        n = _steps(n)
        with np.errstate(over="ignore", invalid="ignore"):
            r = _toeplitz.inverse(self.toeplitz_coefs(n), n)
        return _check_finite("inverse", self, r, n)

    def materialize(self, n: int) -> np.ndarray:
        """The dense ``n x n`` matrix ``C`` (for tests and small ``n``: ``n^2`` at most
        ``2**27`` entries)."""
        n = _steps(n)
        if n * n > MAX_STEPS:
            raise ParameterValueError(
                f"n must be in [1, {math.isqrt(MAX_STEPS)}] for the dense n x n matrix "
                f"(n^2 <= 2**27 float64 entries, 1 GiB at the limit), got {n!r}; use "
                "toeplitz_coefs(n), its first column, which defines it")
        return _toeplitz.materialize(self.toeplitz_coefs(n), n)

    def max_column_norm(self, n: int) -> float:
        """Largest column norm of the ``n x n`` ``C`` (that of column 0 for Toeplitz)."""
        n = _steps(n)
        return float(np.linalg.norm(self.toeplitz_coefs(n)))

    def recurrence(self) -> BandedRecurrence | BufferedRecurrence:
        """The coefficients of the online noise recurrence (see the recurrence types)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Identity(ToeplitzStrategy):
    """``C = I``: independent noise at every step (DP-SGD)."""

    @property
    def bands(self) -> int:
        return 1

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        n = _steps(n)
        return _toeplitz.pad([1.0], n)

    def recurrence(self) -> BandedRecurrence:
        return BandedRecurrence((1.0,))


@dataclass(frozen=True)
class BandedToeplitz(ToeplitzStrategy):
    """A ``b``-banded lower-triangular Toeplitz strategy.

    Parameters
    ----------
    coefs : sequence of float
        ``c_0, ..., c_{b-1}`` with ``c_0 > 0``: ``C[i, j] = c_{i-j}`` for
        ``0 <= i - j < b``. The scale is immaterial to privacy and utility (the noise
        multiplier is calibrated to the sensitivity); :meth:`normalized` gives
        ``||c|| = 1`` (single-participation sensitivity 1).

    Examples
    --------
    >>> C = BandedToeplitz.square_root(bands=4)   # banded square root [KL24]
    >>> C.bands
    4
    """

    coefs: tuple[float, ...]

    def __post_init__(self) -> None:
        coefs = _as_coefs("coefs", self.coefs)
        if coefs[0] <= 0.0:
            raise ParameterValueError(
                f"coefs[0] must be > 0 (C must be invertible), got {coefs[0]!r}; pass "
                "coefficients with a positive leading term, e.g. BandedToeplitz((1.0, 0.5))"
            )
        object.__setattr__(self, "coefs", coefs)

    @classmethod
    def square_root(cls, bands: int) -> BandedToeplitz:
        """The banded square root of the prefix-sum workload ([KL24]; [FHU23]
        coefficients truncated to ``bands`` terms), normalised to ``||c|| = 1``."""
        return cls(tuple(square_root_coefs(check_count("bands", bands, minimum=1)))).normalized()

    @property
    def bands(self) -> int:
        return len(self.coefs)

    def normalized(self) -> BandedToeplitz:
        """The same strategy scaled to ``||c|| = 1``."""
        c = np.asarray(self.coefs)
        return BandedToeplitz(tuple(c / np.linalg.norm(c)))

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        n = _steps(n)
        return _toeplitz.pad(self.coefs, n)

    def recurrence(self) -> BandedRecurrence:
        return BandedRecurrence(self.coefs)


@dataclass(frozen=True)
class BufferedToeplitz(ToeplitzStrategy):
    """A buffered linear Toeplitz (BLT) strategy with ``m`` buffers ([DMPST24]).

    ``C[i, i] = 1`` and ``C[i, j] = sum_k output_scale[k] * buf_decay[k]^(i-j-1)`` for
    ``i > j``. The noise ``C^{-1} z`` is produced with ``m`` buffers
    (:class:`BufferedRecurrence`), whatever the number of steps.

    Parameters
    ----------
    buf_decay : sequence of float in [-1, 1]
        The decays ``theta_k`` (a decay of modulus above 1 would make ``C`` grow without
        bound). Optimised BLTs have decays in (0, 1); a negative decay is allowed as in
        jax_privacy (the sensitivity then takes the general rule).
    output_scale : sequence of float
        The output weights ``omega_k`` (same length).

    Examples
    --------
    >>> C = BufferedToeplitz(buf_decay=(0.9, 0.5), output_scale=(0.2, 0.1))
    >>> C.toeplitz_coefs(4).round(4).tolist()
    [1.0, 0.3, 0.23, 0.187]
    """

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    def __post_init__(self) -> None:
        theta = _as_coefs("buf_decay", self.buf_decay, allow_empty=True)
        omega = _as_coefs("output_scale", self.output_scale, allow_empty=True)
        if len(theta) != len(omega):
            raise ConfigurationError(
                f"buf_decay and output_scale must have the same length, got {len(theta)} "
                f"and {len(omega)}; pass one output_scale per buffer")
        bad = [t for t in theta if not -1.0 <= t <= 1.0]
        if bad:
            raise ParameterValueError(
                f"buf_decay must be in [-1, 1], got {bad!r}; a decay of modulus above 1 "
                "makes the strategy's entries grow without bound"
            )
        order = sorted(range(len(theta)), key=lambda k: -theta[k])  # canonical order
        object.__setattr__(self, "buf_decay", tuple(theta[k] for k in order))
        object.__setattr__(self, "output_scale", tuple(omega[k] for k in order))

    @property
    def bands(self) -> None:
        return None

    @property
    def buffers(self) -> int:
        return len(self.buf_decay)

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        n = _steps(n, "buffers", max(1, self.buffers))  # an n x buffers array of powers
        out = np.zeros(n)
        out[0] = 1.0
        if n > 1 and self.buf_decay:
            theta = np.asarray(self.buf_decay)
            omega = np.asarray(self.output_scale)
            powers = np.arange(n - 1, dtype=float)[:, None]
            with np.errstate(under="ignore"):
                out[1:] = (omega * theta**powers).sum(axis=1)
        return out

    def coefs_error_bound(self, n: int) -> np.ndarray | None:
        """``(m + 4) u sum_k |omega_k| |theta_k|^(j-1)`` plus ``m 2^-1000`` (``u`` the
        machine epsilon) for ``j >= 1``: the power (within one ulp), the product and the
        sum of ``m`` terms in :meth:`toeplitz_coefs` each round by at most ``u/2`` of the
        magnitudes involved, so ``(m + 2) u / 2`` of ``sum_k |omega_k theta_k^(j-1)|``
        bounds the error; the margin covers the rounding of this bound and of adding it,
        and the absolute term an underflowed power. ``c_0 = 1`` is exact."""
        n = _steps(n, "buffers", max(1, self.buffers))
        out = np.zeros(n)
        m = len(self.buf_decay)
        if n > 1 and m:
            theta = np.abs(np.asarray(self.buf_decay))
            omega = np.abs(np.asarray(self.output_scale))
            powers = np.arange(n - 1, dtype=float)[:, None]
            with np.errstate(under="ignore"):
                mags = (omega * theta**powers).sum(axis=1)
            out[1:] = (m + 4) * _EPS * mags + m * 2.0**-1000
        return out

    def inverse_toeplitz_coefs(self, n: int) -> np.ndarray:
        """First column of ``C^{-1}``: the recurrence run on ``e_0``, in blocks.

        After step 0 the buffers hold ``1``; then ``buf <- M buf`` with
        ``M = diag(theta) - 1 omega^T`` and ``r_t = -omega^T M^(t-1) 1`` ([MJPD24],
        Algorithm 3). With ``L ~ sqrt(n)``, the rows ``-omega^T M^s`` (``s < L``) and the
        states ``M^(jL) 1`` are tabulated by ``O(sqrt(n))`` small products, and each block
        of ``r`` is one matrix product: ``O(n m)`` without a Python loop over ``n``, for
        any decays and weights (no eigendecomposition)."""
        n = _steps(n, "buffers", max(1, self.buffers))
        with np.errstate(over="ignore", invalid="ignore"):
            r = blt_inverse_coefs(np.asarray(self.buf_decay), np.asarray(self.output_scale), n)
        return _check_finite("inverse", self, r, n)

    def recurrence(self) -> BufferedRecurrence:
        return BufferedRecurrence(self.buf_decay, self.output_scale)

    def limit_max_column_norm(self) -> float:
        """``lim_n max_column_norm(n)`` in closed form: ``sqrt(1 + sum_{j,k} omega_j
        omega_k / (1 - theta_j theta_k))`` ([DMPST24], Lemma 5.3); inf if a decay is 1."""
        theta = np.asarray(self.buf_decay)
        omega = np.asarray(self.output_scale)
        tt = np.outer(theta, theta)
        if np.any(tt >= 1.0):
            return math.inf
        return float(math.sqrt(1.0 + np.sum(np.outer(omega, omega) / (1.0 - tt))))


# -- dense (non-Toeplitz) strategies -------------------------------------------------------
#: largest number of steps of a :class:`DenseStrategy` (its ``n x n`` float64 matrix is
#: 128 MiB at the limit, and its sensitivity and error hold a few such matrices)
MAX_DENSE_STEPS = 4096


def _read_only(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=float, copy=True)
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class DenseRecurrence:
    """Noise of step ``t`` for a dense ``C``: row ``t`` of ``C^{-1} z``,
    ``noise_t = sum_{s <= t} (C^{-1})[t, s] z_s``.

    Unlike the Toeplitz recurrences, the state is every past draw: ``steps`` buffers of
    the parameters' size (``steps - 1`` past draws and the current one), and the
    generator refuses a step past ``steps`` (the strategy is defined for those only).
    """

    inverse: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "inverse", _read_only(self.inverse))

    @property
    def steps(self) -> int:
        """The number of steps the noise is defined for."""
        return int(self.inverse.shape[0])

    @property
    def buffers(self) -> int:
        """Number of parameter-sized buffers the generator keeps (every draw: ``steps``)."""
        return self.steps

    def __repr__(self) -> str:
        # names the matrix (a saved noise state continues only under the same C^{-1})
        digest = hashlib.sha256(self.inverse.tobytes()).hexdigest()[:16]
        return f"DenseRecurrence(steps={self.steps}, sha256={digest})"


@dataclass(frozen=True, eq=False)
class DenseStrategy:
    """A full lower-triangular strategy ``C`` for a fixed number of steps ``n``.

    Not Toeplitz: every entry ``C[i, j]`` (``j <= i``) is free, as in the optimal
    factorizations of Denisov et al. (2022) (single participation) and Choquette-Choo et
    al. (2023) (fixed epochs), which :func:`~privlearn.correlated.optimize_dense`
    computes. The cost is that the strategy is fixed to its ``n`` steps (running fewer
    uses its leading block; more are refused) and the online noise keeps every past
    draw (:class:`DenseRecurrence`: ``n`` buffers of the parameters' size, against
    ``bands - 1`` or ``buffers`` for the Toeplitz strategies).

    Parameters
    ----------
    matrix : array of shape (n, n)
        Lower-triangular with a positive diagonal and finite entries (the entries above
        the diagonal must be exactly zero), ``1 <= n <=`` :data:`MAX_DENSE_STEPS`. The
        array is copied and kept read-only.

    Examples
    --------
    >>> C = DenseStrategy([[1.0, 0.0], [0.5, 1.0]])
    >>> C.steps, C.inverse().tolist()
    (2, [[1.0, 0.0], [-0.5, 1.0]])
    """

    matrix: np.ndarray

    def __post_init__(self) -> None:
        try:
            c = np.array(self.matrix, dtype=float, copy=True)
        except (TypeError, ValueError):
            raise ParameterTypeError(
                f"matrix must be a real 2-D array, got {type(self.matrix).__name__}; pass "
                "a NumPy array of floats") from None
        if c.ndim != 2 or c.shape[0] != c.shape[1] or c.size == 0:
            raise ParameterValueError(
                f"matrix must be a non-empty square 2-D array, got shape {c.shape}; pass "
                "the n x n lower-triangular strategy matrix")
        n = c.shape[0]
        if n > MAX_DENSE_STEPS:
            raise ParameterValueError(
                f"matrix must have at most {MAX_DENSE_STEPS} rows (an n x n float64 "
                f"matrix, 128 MiB at the limit), got {n}; use a Toeplitz strategy "
                "(optimize_banded_toeplitz, optimize_blt) for longer runs")
        if not np.all(np.isfinite(c)):
            raise ParameterValueError(
                f"matrix must have finite entries, got {int((~np.isfinite(c)).sum())} NaN "
                "or infinite; check the strategy for overflow")
        upper = np.triu(c, 1)
        if np.any(upper != 0.0):
            raise ParameterValueError(
                f"matrix must be lower-triangular (a strategy's step t uses the gradients "
                f"of steps <= t), got {int(np.count_nonzero(upper))} non-zero entries above "
                "the diagonal; pass np.tril(matrix) if they are round-off")
        diag = np.diag(c)
        if not np.all(diag > 0.0):
            raise ParameterValueError(
                f"matrix must have a positive diagonal (C must be invertible), got "
                f"min(diag) = {float(diag.min())!r}; flip the sign of the rows with a "
                "negative diagonal entry (the sensitivity and error do not change)")
        # -0.0 stored as 0.0: equal matrices have the same bytes, so the same hash and
        # the same sha256 in the repr (which a checkpoint's mechanism check compares)
        object.__setattr__(self, "matrix", _read_only(c + 0.0))

    @property
    def steps(self) -> int:
        """The number of steps ``n`` the strategy is defined for."""
        return int(self.matrix.shape[0])

    @property
    def bands(self) -> None:
        """None: a dense strategy is not treated as banded."""
        return None

    def _n(self, n: object) -> int:
        return self.steps if n is None else _dense_steps(self, n, "n")

    def materialize(self, n: int | None = None) -> np.ndarray:
        """The ``n x n`` matrix ``C`` (default all ``steps``; for ``n < steps`` its
        leading block, the strategy of a run stopped after ``n`` steps), a writable copy."""
        k = self._n(n)
        return np.array(self.matrix[:k, :k])

    def inverse(self, n: int | None = None) -> np.ndarray:
        """``C^{-1}`` (``n x n``, lower-triangular; that of the leading block for
        ``n < steps``): row ``t`` holds the weights of the draws in the noise of step ``t``.

        Raises
        ------
        AccountingError
            An entry overflows: never inf or nan."""
        k = self._n(n)
        with np.errstate(over="ignore", invalid="ignore"):
            inv = solve_triangular(self.matrix[:k, :k], np.eye(k), lower=True)
        return _check_finite("inverse", self, np.tril(inv), k)

    def inverse_row(self, t: int) -> np.ndarray:
        """Row ``t`` of ``C^{-1}`` (length ``t + 1``): the weights of draws ``0..t`` in the
        noise of step ``t``."""
        t = check_count("t", t, minimum=0)
        k = self._n(t + 1)
        e = np.zeros(k)
        e[-1] = 1.0
        with np.errstate(over="ignore", invalid="ignore"):  # C^T y = e_t: O(t^2)
            row = solve_triangular(self.matrix[:k, :k], e, lower=True, trans="T")
        return _check_finite("inverse", self, row, k)

    def max_column_norm(self, n: int | None = None) -> float:
        """Largest column norm of the ``n x n`` leading block of ``C``."""
        k = self._n(n)
        return float(np.max(np.linalg.norm(self.matrix[:k, :k], axis=0)))

    def noise_factor(self) -> float:
        """Certified factor ``>= 1`` on the sensitivity of ``C`` that covers the noise
        actually added: ``A z`` with ``A`` the computed ``C^{-1}`` (float64, or rounded to
        float32 by the PyTorch engine) is the noise of the strategy ``A^{-1}``, whose
        sensitivity is at most ``sens(C) / (1 - ||C A - I||_2)``, and the inner products
        that apply it (in float32 or float64) round it further, within ``gamma_{n+1}
        || |C| |A| ||_2`` more (:mod:`privlearn.correlated._dense_fidelity`). About
        ``1 + 1e-4`` for a well-conditioned ``C`` of 200 steps (``1 + 2e-3`` at 4096);
        computed once (``O(n^3)``).

        Raises
        ------
        ParameterValueError
            ``C`` is too ill-conditioned for its inverse to be applied faithfully (the
            certified residual exceeds ``1e-2``): its noise would be that of a strategy
            of another sensitivity.
        AccountingError
            ``C^{-1}`` overflows."""
        cached = self.__dict__.get("_noise_factor")
        if cached is None:
            cached = sensitivity_factor(self.matrix, self.inverse())
            object.__setattr__(self, "_noise_factor", cached)
        factor, rho = cached
        if not rho <= MAX_RESIDUAL:
            cond = float(np.linalg.norm(self.matrix, 1)) * float(
                np.linalg.norm(self.inverse(), 1))
            raise ParameterValueError(
                f"matrix of {self!r} is too ill-conditioned (or badly scaled) to run: its "
                f"computed inverse A "
                f"has a certified residual ||C A - I||_2 <= {rho:.3g} (float64, or float32 "
                f"as the PyTorch engine applies it; at most {MAX_RESIDUAL} is accepted; "
                f"condition number about {cond:.3g}), so the noise A z would be that of "
                "a strategy A^{-1} of another sensitivity than C's; use a well-conditioned "
                "C (optimize_dense), scale C so that its entries are near 1, or use a "
                "Toeplitz strategy")
        return factor

    def recurrence(self) -> DenseRecurrence:
        """The online noise: rows of ``C^{-1}`` applied to every past draw
        (:class:`DenseRecurrence`).

        Raises
        ------
        ParameterValueError
            ``C`` is too ill-conditioned for its inverse to be applied faithfully
            (:meth:`noise_factor`)."""
        self.noise_factor()
        return DenseRecurrence(self.inverse())

    def __reduce__(self) -> tuple:
        # a pickle or deep copy is rebuilt by the constructor: validated, read-only, and
        # without the cached noise factor (of the matrix it was computed for)
        return (DenseStrategy, (np.array(self.matrix),))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DenseStrategy):
            return NotImplemented
        return self.matrix.shape == other.matrix.shape and bool(
            np.array_equal(self.matrix, other.matrix))

    def __hash__(self) -> int:
        return hash((self.matrix.shape, self.matrix.tobytes()))

    def __repr__(self) -> str:
        # names the matrix: a checkpoint's mechanism matches only the same C
        digest = hashlib.sha256(self.matrix.tobytes()).hexdigest()[:16]
        return f"DenseStrategy(steps={self.steps}, sha256={digest})"


def _dense_steps(strategy: DenseStrategy, steps: object, name: str = "steps") -> int:
    """``steps`` (the parameter ``name``) as an int in ``[1, strategy.steps]``: a dense
    strategy is fixed to its steps, so a run, an error or a matrix of more steps is
    refused."""
    n = check_count(name, steps, minimum=1)
    if n > strategy.steps:
        raise ParameterValueError(
            f"{name} must be in [1, {strategy.steps}] for {strategy!r} (a dense strategy "
            f"is fixed to its steps), got {steps!r}; optimise one for {n} steps "
            f"(optimize_dense({n}, ...))")
    return n
