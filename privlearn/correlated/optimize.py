"""Optimised strategies: banded Toeplitz and BLT coefficients for a workload.

Both minimise ``log loss = log(reduce_t ||(A C^{-1})[t, :]||^2) + log sens(C)^2``
(:func:`privlearn.correlated.error.loss`) over the strategy's few coefficients, for a
given number of steps, participation schema and Toeplitz workload, with L-BFGS
(:func:`scipy.optimize.minimize`) on analytic gradients
(:mod:`privlearn.correlated._objective`). The log makes the objective scale-free; the
parametrisations keep every iterate well defined, so there is no singular or overflowing
``C^{-1}`` anywhere:

* banded, ``bands <= min_sep`` (or single participation): ``C``'s coefficients are
  those of a monic polynomial with reflection coefficients ``tanh(u)`` in (-1, 1)
  (Levinson's step-up recursion): every root lies outside the unit disk, so ``C^{-1}`` is
  bounded for every ``n`` (Schur-Cohn). ``C^{-1} a`` and the adjoint are two forward
  substitutions (``O(n b)``); ``d b / d c_j = -S_j C^{-1} b`` (Toeplitz matrices
  commute), so the gradient is one correlation (FFT, ``O(n log n)``);
* banded, ``bands > min_sep``: non-negative, non-increasing coefficients (cumulative
  sums of non-negative increments, bounded L-BFGS), which keep the closed-form
  sensitivity exact ([KL24], Theorem 2) and ``C^{-1}`` bounded (Enestrom-Kakeya);
* BLT: ``C`` and ``C^{-1}`` are both BLTs, with decays that interlace,
  ``1 > theta_1 > hat_1 > theta_2 > ... > hat_m > 0``, and output weights in closed form
  ([DMPST24], Lemma 5.2; the inversion theorem of McMahan & Pillutla (2025)). The
  ``2m + 1`` gaps between these points are a softmax, so every iterate is a valid BLT
  with positive, decreasing Toeplitz coefficients (exact sensitivity under every schema)
  and a stable noise recurrence; ``C`` and ``C^{-1}``'s coefficients are sums of ``m``
  exponentials, evaluated in ``O(n m)`` without a Python loop over ``n``. The BLT
  objective has local optima; several start points are tried (all of them under several
  participations, until two agree otherwise) ([DMPST24], Proposition 4.5 gives one of them).

The sensitivity in the objective is that of the worst pattern -- participations
``min_sep`` apart from step 0 -- exact for ``bands <= min_sep`` and for non-negative,
non-increasing coefficients ([KL24], Theorem 2). The result is deterministic, and its
sensitivity is computed afresh by :func:`privlearn.correlated.sensitivity.sensitivity`
when used, never taken from the optimiser. A numerical failure raises
:class:`StrategyOptimizationError`.

Progress and reuse: an optimisation that lasts more than a second shows a progress bar of
its L-BFGS iterations on standard error when that is a terminal (``show_progress=``:
None, the default, so; True always; False never; :mod:`privlearn._progress`). The result
depends only on public settings (steps, bands or buffers, the participation's separation
and count, the workload, the reduction, the iteration cap), so the strategy of the same
arguments is computed once per process and reused (a small memo of immutable
strategies; ``optimize_banded_toeplitz.cache_clear()`` empties it).

References
----------
.. [CC23b] Choquette-Choo et al. (2023), (Amplified) Banded Matrix Factorization, NeurIPS.
.. [KL24] Kalinin & Lampert (2024), Banded Square Root Matrix Factorization for
       Differentially Private Model Training, NeurIPS, Theorem 2.
.. [DMPST24] Dvijotham, McMahan, Pillutla, Steinke & Thakurta (2024), Efficient and
       Near-Optimal Noise Generation for Streaming Differential Privacy, FOCS
       (arXiv:2404.16706), Lemma 5.2 and Proposition 4.5.
.. [MJPD24] McMahan, Jia, Pillutla, Dvijotham et al. (2024), Hassle-Free Matrix
       Factorization Mechanisms for Private Learning (arXiv:2408.08868), Section 4.
.. [McK24] McKenna (2024), Scaling up the Banded Matrix Factorization Mechanism for
       Differentially Private ML (arXiv:2405.15913): Toeplitz objectives in ``O(n log n)``.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict

import numpy as np
from scipy import optimize, special

from privlearn._progress import check_show_progress, progress
from privlearn._validation import check_choice, check_count
from privlearn.correlated import _toeplitz
from privlearn.correlated._limits import check_horizon
from privlearn.correlated._objective import (
    InterlacedBLT,
    Objective,
    banded_error,
    blt_coefs,
    blt_coefs_adjoint,
    step_down,
    step_up,
    step_up_adjoint,
    weights,
)
from privlearn.correlated.error import (
    REDUCTIONS,
    MomentumPrefixSum,
    PrefixSum,
    Workload,
    _workload,
)
from privlearn.correlated.participation import (
    FixedEpochs,
    MinSeparation,
    Participation,
    SingleParticipation,
)
from privlearn.correlated.strategies import (
    BandedToeplitz,
    BufferedToeplitz,
    blt_inverse_coefs,
    nonzero_bands,
    square_root_coefs,
)
from privlearn.errors import (
    ParameterTypeError,
    ParameterValueError,
    StrategyAdjustedWarning,
    StrategyOptimizationError,
)

__all__ = ["optimize_banded_toeplitz", "optimize_blt", "StrategyAdjustedWarning",
           "StrategyOptimizationError"]


def _pattern(participation: Participation | None, n: int) -> tuple[int, int]:
    """(separation, participations) of the worst pattern of the schema."""
    if participation is None or isinstance(participation, SingleParticipation):
        return n, 1
    if isinstance(participation, MinSeparation):
        return participation.min_sep, participation.participations(n)
    if isinstance(participation, FixedEpochs):
        return participation.steps_per_epoch(n), participation.epochs
    raise ParameterTypeError(
        f"participation must be a privlearn.correlated Participation (SingleParticipation, "
        f"MinSeparation or FixedEpochs), got {participation!r}"
    )


#: seconds an optimisation runs before its automatic progress bar appears
PROGRESS_DELAY = 1.0
#: optimised strategies kept for reuse (each a few numbers)
_MEMO_SIZE = 64


class _Memo:
    """The last :data:`_MEMO_SIZE` optimised strategies by the public settings that
    determine them (the optimisers are deterministic; the strategies are immutable)."""

    def __init__(self, size: int):
        self._size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        if key is None:
            return None
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key, value) -> None:
        if key is None:
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_MEMO = _Memo(_MEMO_SIZE)


def _workload_key(workload: Workload | None):
    """What determines the workload's coefficients, for the memo; None (no reuse) for a
    workload type privlearn does not define (it may be mutable)."""
    if workload is None or type(workload) is PrefixSum:
        return ("prefix_sum",)
    if type(workload) is MomentumPrefixSum:
        return ("momentum_prefix_sum", float(workload.momentum))
    return None


def _memo_key(kind: str, n: int, size: int, pattern: tuple[int, int], workload,
              reduction: str, max_iterations: int):
    wk = _workload_key(workload)
    return None if wk is None else (kind, n, size, pattern, wk, reduction, max_iterations)


def _bar(desc: str, show_progress: bool | None):
    """The progress bar of one optimisation: its L-BFGS iterations (a counter)."""
    return progress(desc=desc, unit="it", enabled=show_progress, delay=PROGRESS_DELAY)


def _memoised(key, desc: str, show_progress: bool | None, optimize):
    """The memo's strategy for ``key``, else ``optimize(bar)`` run under the progress bar
    ``desc`` (:func:`_bar`) and kept for reuse."""
    strategy = _MEMO.get(key)
    if strategy is None:
        with _bar(desc, show_progress) as bar:
            strategy = optimize(bar)
        _MEMO.put(key, strategy)
    return strategy


def _minimize(fun, x0: np.ndarray, bounds, max_iterations: int, bar=None
              ) -> tuple[np.ndarray, float]:
    """L-BFGS from ``x0``; the better of the end point and ``x0`` with its value. Each
    iteration advances ``bar`` (a progress bar) when given."""
    f0 = fun(x0)[0]
    if not math.isfinite(f0):
        raise StrategyOptimizationError(
            "the strategy optimiser's start point has a non-finite loss (a numerical "
            "failure); try fewer steps, bands or buffers"
        )
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        res = optimize.minimize(
            fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
            options={"maxiter": max_iterations, "maxfun": 4 * max_iterations,
                     "ftol": 1e-15, "gtol": 1e-11, "maxcor": 20},
            callback=None if bar is None else (lambda *_: bar.update(1)),
        )
    if math.isfinite(res.fun) and res.fun <= f0:
        return np.asarray(res.x), float(res.fun)
    return x0, f0


def _safe(fun):
    """``fun`` returning ``(inf, 0)`` instead of raising or returning non-finite values, so
    the line search backs off."""

    def wrapped(x: np.ndarray) -> tuple[float, np.ndarray]:
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
                f, g = fun(x)
        except (FloatingPointError, ValueError, ZeroDivisionError, np.linalg.LinAlgError):
            return math.inf, np.zeros_like(x)
        if not (math.isfinite(f) and np.all(np.isfinite(g))):
            return math.inf, np.zeros_like(x)
        return f, g

    return wrapped


def optimize_banded_toeplitz(
    steps: int,
    bands: int,
    participation: Participation | None = None,
    workload: Workload | None = None,
    reduction: str = "mean",
    *,
    max_iterations: int = 500,
    show_progress: bool | None = None,
) -> BandedToeplitz:
    """The ``bands``-banded Toeplitz strategy minimising the loss, normalised to
    ``||c|| = 1``.

    Parameters
    ----------
    steps : int in [1, 2**27]
        Number of steps ``n`` the strategy is optimised for (at most
        :data:`~privlearn.correlated._limits.MAX_STEPS`: a loss evaluation holds float64
        arrays of ``n`` entries, 1 GiB each at the limit).
    bands : int in [1, steps]
    participation : Participation, optional
        The schema of the sampler that will be used (default single participation).
        With ``MinSeparation(b)`` or cyclic sampling, ``bands <= b`` keeps the exact
        banded sensitivity and the amplified accounting.
    workload : Workload, optional
        Default :class:`~privlearn.correlated.error.PrefixSum`.
    reduction : {"mean", "max"}
        Mean or largest per-query squared error.
    max_iterations : int
        L-BFGS iterations.
    show_progress : bool, optional
        A progress bar of the iterations on standard error: None (default) when standard
        error is a terminal and the optimisation lasts over a second, True always, False
        never.

    Returns
    -------
    BandedToeplitz
        Never worse than the banded square root it starts from ([KL24]). Coefficients
        come from reflection coefficients in (-1, 1) (``bands <= min_sep``; every root of
        ``c`` outside the unit disk, so ``C^{-1}`` is bounded) or are non-negative and
        non-increasing (``bands > min_sep``; the closed-form sensitivity stays exact).
        The same arguments in one process give the same object (computed once).

    Warns
    -----
    StrategyAdjustedWarning
        When the optimum leaves bands unused: with several participations at least
        ``min_sep`` steps apart, bands past ``min_sep`` must keep non-negative,
        non-increasing coefficients (the class whose sensitivity is exact, [KL24],
        Theorem 2), and the optimum of that class has measured zero coefficients past
        ``min_sep`` -- the ``bands``-banded result is then the ``min_sep``-banded one,
        padded with zeros. The warning names the bands actually used
        (:func:`~privlearn.correlated.strategies.nonzero_bands`); ask for at most
        ``min_sep`` bands (or a longer separation) to avoid it.

    Raises
    ------
    StrategyOptimizationError
        If no finite loss can be computed (a numerical failure, never a silent result).
    ParameterValueError
        ``steps`` above ``2**27`` or ``bands`` outside ``[1, steps]``.

    Notes
    -----
    ``O(n b)`` per evaluation (two forward substitutions) plus an FFT correlation for the
    gradient; ``n = 10,000`` with 64 bands takes about a second ([McK24] describes the
    same Toeplitz objective in ``O(n log n)``).

    Examples
    --------
    >>> from privlearn.correlated import MinSeparation, loss, optimize_banded_toeplitz
    >>> C = optimize_banded_toeplitz(steps=256, bands=8, participation=MinSeparation(16))
    >>> C.bands, loss(C, 256) < loss(type(C).square_root(8), 256)
    (8, True)
    """
    n = check_count("steps", steps, minimum=1)
    b = check_count("bands", bands, minimum=1)
    max_iterations = check_count("max_iterations", max_iterations, minimum=1)
    check_horizon(n, steps)
    if b > n:
        raise ParameterValueError(
            f"bands must be in [1, steps={n}], got {bands!r}; use at most as many bands "
            "as steps (bands=steps is a full lower-triangular strategy)")
    reduction = check_choice("reduction", reduction, REDUCTIONS)
    show_progress = check_show_progress(show_progress)
    if b == 1:
        return BandedToeplitz((1.0,))
    sep, k = _pattern(participation, n)
    key = _memo_key("banded", n, b, (sep, k), workload, reduction, max_iterations)
    strategy = _memoised(key, f"optimising {b} bands for {n} steps", show_progress,
                         lambda bar: _optimize_banded(n, b, sep, k, workload, reduction,
                                                      max_iterations, bar))
    _warn_unused_bands(strategy, b, sep, k)
    return strategy


def _warn_unused_bands(strategy: BandedToeplitz, b: int, sep: int, k: int) -> None:
    used = nonzero_bands(strategy)
    if used is None or used >= b:
        return
    warnings.warn(
        f"bands={b}: the optimised strategy uses {used} bands; its coefficients past band "
        f"{used} are 0. An example takes part up to {k} times at least {sep} steps apart, "
        f"and bands past that separation keep the sensitivity exact only with "
        "non-negative, non-increasing coefficients (Kalinin & Lampert 2024, Theorem 2), "
        "whose optimum puts zero there: the noise is that of "
        f"{used} bands. Ask for bands <= {sep} (or a longer separation: a larger "
        "cycle_length / fewer steps per epoch) to use more bands",
        StrategyAdjustedWarning, stacklevel=3)


def _optimize_banded(n: int, b: int, sep: int, k: int, workload, reduction: str,
                     max_iterations: int, bar) -> BandedToeplitz:
    obj = Objective(_workload(workload).coefs(n), weights(n, reduction), sep, k)

    def log_loss(c: np.ndarray) -> tuple[float, np.ndarray]:
        err, g_c = banded_error(obj, c)
        s2, g_s = obj.sens_part(c if k == 1 else _toeplitz.pad(c, n))
        return math.log(err) + math.log(s2), g_c + g_s[:b]

    c0 = square_root_coefs(b)
    kk0 = None if k > 1 and b > sep else step_down(c0)
    if kk0 is None:
        # bands > min_sep: c_j = sum_{i >= j} x_i with x >= 0 (non-negative, non-increasing
        # coefficients keep the closed-form sensitivity exact; [KL24], Theorem 2), whose
        # roots lie outside the open unit disk (Enestrom-Kakeya), so C^{-1} stays bounded
        def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
            f, g = log_loss(np.cumsum(x[::-1])[::-1])
            return f, np.cumsum(g)

        x, _ = _minimize(_safe(fun), np.append(-np.diff(c0), c0[-1]), [(0.0, None)] * b,
                         max_iterations, bar)
        c = np.cumsum(x[::-1])[::-1]
    else:
        # reflection coefficients tanh(u) in (-1, 1): every C^{-1} is stable
        def fun(u: np.ndarray) -> tuple[float, np.ndarray]:
            kk = np.tanh(u)
            a, hist = step_up(kk)
            f, g = log_loss(a)
            return f, step_up_adjoint(kk, hist, g) * (1.0 - kk * kk)

        u, _ = _minimize(_safe(fun), np.arctanh(kk0), None, max_iterations, bar)
        c = step_up(np.tanh(u))[0]
    if not (np.all(np.isfinite(c)) and c[0] > 0):
        raise StrategyOptimizationError(f"the optimised coefficients are not finite: {c!r}")
    return BandedToeplitz(tuple(c)).normalized()


def _blt_objective(obj: Objective):
    """``f(z)`` and its gradient for the BLT of the gaps ``softmax(z)``
    (:class:`~privlearn.correlated._objective.InterlacedBLT`)."""
    n = obj.n

    def fun(z: np.ndarray) -> tuple[float, np.ndarray]:
        g = special.softmax(z)
        blt = InterlacedBLT(g)
        c, p_c = blt_coefs(blt.omega, blt.log_point(blt.i_theta), n)
        r, p_r = blt_coefs(blt.hat_omega, blt.log_point(blt.i_hat), n)
        err, g_b = obj.error_part(obj.apply_workload(r))
        s2, g_c = obj.sens_part(c)
        g_om, g_th = blt_coefs_adjoint(g_c, blt.omega, blt.theta, p_c)
        g_ho, g_ha = blt_coefs_adjoint(obj.workload_adjoint(g_b), blt.hat_omega, blt.hat, p_r)
        gg = blt.gaps_grad(g_om, g_th, g_ho, g_ha)
        return math.log(err) + math.log(s2), g * (gg - g @ gg)

    return fun


def _raw_blt_objective(obj: Objective):
    """``f(x)`` and its gradient for the BLT with decays ``1 - expit(s)`` and weights
    ``softmax(v)[:m]`` (``x = (s, v)``, ``len(v) = m + 1``): every BLT with decays in
    (0, 1) and positive weights summing to < 1 -- positive, decreasing coefficients, so the
    sensitivity is exact, and a stable ``C^{-1}`` (``Re C(x) > 0`` on the unit disk) --
    including those whose inverse has negative or complex decays, which the interlaced
    parametrisation leaves out. ``C^{-1}`` by the blocked recurrence
    (:func:`~privlearn.correlated.strategies.blt_inverse_coefs`);
    ``d r / d c = -T(r * r)`` for ``r = C^{-1} e_0``."""
    n = obj.n

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        m = (x.size - 1) // 2
        s, v = x[:m], x[m:]
        one_minus = special.expit(s)
        theta = special.expit(-s)
        log_theta = -np.logaddexp(0.0, s)
        soft = special.softmax(v)
        omega = soft[:m]
        c, p_c = blt_coefs(omega, log_theta, n)
        r = blt_inverse_coefs(theta, omega, n)
        err, g_b = obj.error_part(obj.apply_workload(r))
        g_r = obj.workload_adjoint(g_b)
        s2, g_c = obj.sens_part(c)
        g_c = g_c - _toeplitz.correlate(g_r, _toeplitz.convolve(r, r, n), n)
        g_om, g_th = blt_coefs_adjoint(g_c, omega, theta, p_c)
        g_v = soft * (np.append(g_om, 0.0) - soft[:m] @ g_om)
        return math.log(err) + math.log(s2), np.concatenate([-g_th * one_minus * theta, g_v])

    return fun


def _raw_from_interlaced(blt: InterlacedBLT) -> np.ndarray:
    one_minus = blt.one_minus[blt.i_theta - 1]
    s = np.log(one_minus) - np.log1p(-one_minus)
    slack = 1.0 - float(np.sum(blt.omega))
    return np.concatenate([s, np.log(blt.omega), [math.log(max(slack, 1e-300))]])


def _geometric_start(n: int, m: int, low: float, high: float) -> np.ndarray:
    """Logits of the ``2m`` interlaced decays with ``1 - x`` spread geometrically from
    ``low / n`` to ``high`` (the time scales of the problem)."""
    one_minus = np.geomspace(min(low / n, high / 16), high, 2 * m)
    gaps = np.diff(np.concatenate([[0.0], one_minus, [1.0]]))
    return np.log(gaps)


def _rational_start(m: int) -> np.ndarray:
    """Logits of the decays of the rational approximation of ``sqrt(1 - x)`` (the noise
    ``C^{-1}``) of [DMPST24], Proposition 4.5, with the step ``1.6 pi / sqrt(2 (d + 1))``
    and the shift -1 that jax_privacy uses to initialise its optimiser; ``C``'s decays are
    the eigenvalues of ``diag(hat) - hat_omega 1^T`` ([DMPST24], Lemma 5.2)."""
    d1 = (m + 1) // 2
    h = 1.6 * np.pi / np.sqrt(2 * (d1 + 1))
    ks = np.arange(-d1 + 1, m - d1 + 1) - 1.0
    hat = 1.0 / (1.0 + np.exp(2 * h * ks))
    hat_omega = -(hat**2) * np.exp(3 * h * ks) / np.sum(np.exp(h * ks) * hat)
    theta = np.linalg.eigvals(np.diag(hat) - np.outer(hat_omega, np.ones(m))).real
    points = np.empty(2 * m)
    points[0::2] = np.sort(theta)[::-1]
    points[1::2] = np.sort(hat)[::-1]
    gaps = -np.diff(np.concatenate([[1.0], points, [0.0]]))
    return np.log(np.maximum(gaps, 1e-9))


def _blt_starts(n: int, m: int, sep: int):
    """Start points, in the order tried."""
    yield _geometric_start(n, m, 0.5, 0.7)
    yield _geometric_start(n, m, 0.1, 0.9)
    yield _rational_start(m)
    yield _geometric_start(n, m, 1.0, 0.99)
    yield _geometric_start(n, m, 0.01, 0.5)
    yield _geometric_start(n, m, 1e-3, 0.9)
    if sep < n:  # slowest decay at the time scale of the separation
        yield _geometric_start(n, m, n / sep, 0.9)


def _collapsed(z: np.ndarray) -> bool:
    """Whether the BLT of ``z`` uses fewer buffers than it has -- two of its interlaced
    decays (nearly) coincide, so a buffer's weight vanishes or two buffers merge: a local
    optimum worth escaping by another start."""
    blt = InterlacedBLT(special.softmax(z))
    if blt.m == 0:
        return False
    log_gap = np.log(blt.one_minus)  # log(1 - x_q), q = 1..2m, increasing
    merged = np.min(np.diff(log_gap)) < 1e-3 if log_gap.size > 1 else False
    idle = np.min(blt.omega) < 1e-6 * np.max(blt.omega)
    return bool(merged or idle)


def optimize_blt(
    steps: int,
    buffers: int,
    participation: Participation | None = None,
    workload: Workload | None = None,
    reduction: str = "max",
    *,
    max_iterations: int = 1000,
    show_progress: bool | None = None,
) -> BufferedToeplitz:
    """The BLT strategy with ``buffers`` buffers minimising the loss.

    The decays are kept in (0, 1) and the output weights positive with sum below 1, so
    the Toeplitz coefficients are positive and decreasing: the sensitivity under every
    schema is then the exact closed form ([KL24], Theorem 2), and the noise recurrence
    is stable ([MJPD24], Section 4).

    Parameters
    ----------
    steps : int in [1, 2**27]
    buffers : int >= 1
        With ``steps x buffers <= 2**27`` (a loss evaluation holds a ``steps x buffers``
        float64 array, 1 GiB at the limit).
    participation, workload, reduction
        As :func:`optimize_banded_toeplitz` (default reduction ``"max"``, the usual BLT
        objective).
    max_iterations : int
        L-BFGS iterations per start point.
    show_progress : bool, optional
        As :func:`optimize_banded_toeplitz`: a bar of the iterations (and of the start
        point being tried) on standard error.

    Returns
    -------
    BufferedToeplitz
        The same arguments in one process give the same object (computed once). At most
        ``buffers`` buffers: those the optimum leaves unused are dropped (see Warns).

    Warns
    -----
    StrategyAdjustedWarning
        When the optimum uses fewer buffers than asked: with several participations the
        objective has optima with a weight near 0 (below ``1e-6`` of the largest) or two
        buffers of one decay (which jax_privacy refuses to invert). Those buffers are
        dropped (two of one decay merged) when the loss stays within ``1e-9`` (relative);
        the decays stay in (0, 1) and the weights positive with a smaller or equal sum,
        so the sensitivity stays the exact closed form ([KL24], Theorem 2). The warning
        names the buffers used; ask for at most that many to avoid it.

    Raises
    ------
    StrategyOptimizationError
        If no finite loss can be computed.
    ParameterValueError
        ``steps`` above ``2**27`` or ``steps x buffers`` above ``2**27``.

    Notes
    -----
    The search runs over BLTs whose decays interlace with those of their inverse
    ([DMPST24], Lemma 5.2), from geometric start points and the rational approximation of
    [DMPST24], Proposition 4.5, until two starts agree, then over every BLT with decays in
    (0, 1) and positive weights summing below 1 when the first optimum lies on the boundary
    of its class. Losses cost ``O(n m)`` per evaluation (no loop over ``n``):
    ``optimize_blt(100_000, 4)`` takes about 10 s on a loaded 2-core machine.

    Examples
    --------
    >>> from privlearn.correlated import loss, optimize_blt, Identity
    >>> C = optimize_blt(steps=512, buffers=3)
    >>> C.buffers, loss(C, 512, reduction="max") < 0.2 * loss(Identity(), 512, reduction="max")
    (3, True)
    """
    n = check_count("steps", steps, minimum=1)
    m = check_count("buffers", buffers, minimum=1)
    max_iterations = check_count("max_iterations", max_iterations, minimum=1)
    check_horizon(n, steps, "buffers", m, buffers)
    reduction = check_choice("reduction", reduction, REDUCTIONS)
    show_progress = check_show_progress(show_progress)
    sep, k = _pattern(participation, n)
    key = _memo_key("blt", n, m, (sep, k), workload, reduction, max_iterations)
    strategy = _memoised(key, f"optimising a BLT of {m} buffers for {n} steps",
                         show_progress,
                         lambda bar: _optimize_blt(n, m, sep, k, workload, reduction,
                                                   max_iterations, bar))
    if strategy.buffers < m:
        warnings.warn(
            f"buffers={m}: the optimised BLT uses {strategy.buffers} buffers. The optimum "
            f"found for {n} steps (an example taking part up to {k} times at least {sep} "
            "steps apart) left the others unused (a weight below 1e-6 of the largest) or "
            "merged with another (the same decay), and they are dropped: the loss is the "
            f"same (within 1e-9, relative), and the noise is that of {strategy.buffers} "
            f"buffers. Ask for buffers <= {strategy.buffers} to avoid this warning",
            StrategyAdjustedWarning, stacklevel=2)
    return strategy


def _used_buffers(theta: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The BLT without its idle buffers (a weight below ``1e-6`` of the largest) and with
    buffers of the same decay (``log(1 - theta)`` within ``1e-6``) merged into one (their
    weights summed, at their weighted mean decay). The weights stay positive with the same
    or a smaller sum, the decays in (0, 1): the coefficients stay positive and decreasing,
    the class whose sensitivity is exact ([KL24], Theorem 2)."""
    keep = omega > 1e-6 * np.max(omega)
    theta, omega = list(theta[keep]), list(omega[keep])
    out_t: list[float] = []
    out_w: list[float] = []
    for t, w in sorted(zip(theta, omega, strict=True), reverse=True):
        if out_t and abs(math.log1p(-t) - math.log1p(-out_t[-1])) < 1e-6:
            total = out_w[-1] + w
            out_t[-1] = (out_t[-1] * out_w[-1] + t * w) / total
            out_w[-1] = total
        else:
            out_t.append(t)
            out_w.append(w)
    return np.array(out_t), np.array(out_w)


def _optimize_blt(n: int, m: int, sep: int, k: int, workload, reduction: str,
                  max_iterations: int, bar) -> BufferedToeplitz:
    obj = Objective(_workload(workload).coefs(n), weights(n, reduction), sep, k)
    fun = _safe(_blt_objective(obj))
    # multi-start. Single participation: stop once another start confirms the best optimum
    # and it uses all its buffers. Several participations: the objective has distinct local
    # optima that different starts reach (a decay at 1, or at the separation's time
    # scale), so every start is run.
    best_z, best_f, values = None, math.inf, []
    starts = list(_blt_starts(n, m, sep))
    for i, z0 in enumerate(starts):
        bar.set_postfix_str(f"start point {i + 1} of at most {len(starts)}", refresh=False)
        try:
            z, f = _minimize(fun, z0, None, max_iterations, bar)
        except StrategyOptimizationError:  # this start's loss is not finite: next one
            continue
        values.append(f)
        if f < best_f:
            best_z, best_f = z, f
        confirmed = sum(v <= best_f + 1e-6 for v in values) >= 2
        if k == 1 and confirmed and not _collapsed(best_z):
            break
    if best_z is None or not math.isfinite(best_f):
        raise StrategyOptimizationError(
            f"no finite loss found for a BLT with {m} buffers at steps={n}"
        )
    blt = InterlacedBLT(special.softmax(best_z))
    # polish over every BLT with positive, decreasing coefficients: needed only when the
    # interlaced optimum lies on the boundary of its class (a stationary point inside it
    # is one of the wider class, the two having the same dimension)
    raw = _safe(_raw_blt_objective(obj))
    x = _raw_from_interlaced(blt)
    if float(np.linalg.norm(raw(x)[1])) > 1e-6:
        bar.set_postfix_str("polishing", refresh=False)
        x, _ = _minimize(raw, x, None, max_iterations, bar)
    theta = special.expit(-x[:m])
    omega = special.softmax(x[m:])[:m]
    if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(omega))):
        raise StrategyOptimizationError(f"the optimised BLT is not finite: {theta}, {omega}")
    full = BufferedToeplitz(tuple(theta), tuple(omega))
    if theta.size < 2 or np.any(theta >= 1.0):
        return full
    used = BufferedToeplitz(*map(tuple, _used_buffers(theta, omega)))
    if used.buffers < full.buffers and _loss(obj, used, n) <= _loss(obj, full, n) + 1e-9:
        return used  # the same loss (the log of it, within 1e-9) with fewer buffers
    return full


def _loss(obj: Objective, strategy: BufferedToeplitz, n: int) -> float:
    """The log of the loss of ``strategy`` (the objective the optimisers minimise)."""
    err, _ = obj.error_part(obj.apply_workload(strategy.inverse_toeplitz_coefs(n)))
    s2, _ = obj.sens_part(strategy.toeplitz_coefs(n))
    return math.log(err) + math.log(s2)


#: empties the memo of optimised strategies (both optimisers share it)
optimize_banded_toeplitz.cache_clear = _MEMO.clear  # type: ignore[attr-defined]
optimize_blt.cache_clear = _MEMO.clear  # type: ignore[attr-defined]
