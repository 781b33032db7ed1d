"""Epsilon lower bounds from canary scores, and the attack's ROC.

Conventions: ``in_scores`` are the scores of canaries that were included in the
training data, ``out_scores`` of canaries that were not; a higher score means "more
likely included". Every bound is a lower confidence bound: if the mechanism really is
``(epsilon, delta)``-DP (for ``"gdp"`` and ``"one_run_fdp"``: if its trade-off curve is
the Gaussian one, see below), the returned value exceeds ``epsilon`` with probability at
most ``1 - confidence`` over the randomness of the audit.

Choosing the threshold (how many top scores to guess on) after looking at the scores
would make any single-threshold bound invalid. Here every method evaluates a grid of
``K`` candidate thresholds fixed *before* looking at the labels (geometrically spaced
counts, ratio 2, so ``K ~ log2(n) + 1``) and tests each at significance
``(1 - confidence) / K`` (Bonferroni): the probability that any of them overstates
epsilon is at most ``1 - confidence``. The reported bound is the largest over the grid.
For the one-run methods the grid first loses every count ``k`` at which even ``k``
correct guesses could not refute ``epsilon = 0`` (a handful of guesses is never
significant; with the ``2 m delta`` term of ``"one_run"``, at 10^5 canaries, counts
below ~900 are not), which raises the level of the tests that remain; this pruning
depends on ``n``, ``delta`` and the confidence only.
The thresholds are *counts*, which is what makes the bounds exact rather than
approximate: for the one-run methods, ``k`` guesses, "in" for the ``ceil(k/2)`` highest
and "out" for the ``floor(k/2)`` lowest of all scores (two-sided guessing, which both
one-run analyses allow: their guesses are in {in, out, abstain}, and the Gaussian curve
is symmetric); for the independent-trial methods, the threshold "the ``c + 1``-th
highest excluded score" and, mirrored, "the ``c + 1``-th lowest included score". The
grids depend on the numbers of included and excluded canaries only, on which the
bounds are conditioned. Ties between scores are broken against the auditor: among
equal scores the excluded canaries rank above the included ones. The scores carry no
canary identity, so any fixed tie-breaking order (a seeded pseudo-random key, say) could
only be attached to the label-sorted positions, which makes it a function of the labels:
constant scores from a mechanism that releases nothing would then give a positive bound
deterministically at some counts. The pessimistic order is valid: at every count it
gets no more guesses right than a tie-breaking by fresh randomness independent of the
labels (a valid attacker), and for the independent-trials tests it counts only the
scores *strictly* beyond the threshold, whose reference rate is stochastically below the
``Beta`` law used (randomised probability integral transform).

Methods
-------
``"one_run"``
    Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run",
    NeurIPS, Theorem 3.1 (the ``(epsilon, delta)`` version with its ``2 m delta`` term):
    in one run with ``m`` canaries each included with probability 1/2, an attacker that
    makes ``k`` guesses (any function of the output) gets at least ``v`` of them right
    with probability at most ``P[Bin(k, e^eps/(1+e^eps)) >= v] + 2 m delta max_i
    P[v - i <= Bin(k, .) < v] / i``. Valid for any ``(epsilon, delta)``-DP mechanism.
``"one_run_fdp"``
    Mahloujifar, Melis & Chaudhuri (2025), "Auditing f-Differential Privacy in One
    Run", ICML: the same guessing game bounded through the trade-off curve ``f`` of the
    hypothesis (their recursive bound on the number of correct guesses), here
    with the Gaussian curve ``G_mu`` through ``(epsilon, delta)``
    (:func:`privlearn.accounting.fdp.gdp_mu`). The result is the largest ``epsilon``
    whose Gaussian curve is refuted: a valid lower bound on ``epsilon(delta)`` for
    mechanisms whose trade-off curve is Gaussian (the Gaussian mechanism and its
    compositions exactly; DP-SGD approximately, by the central limit theorem of Dong,
    Roth & Su 2022); for other mechanisms it bounds the ``mu`` of the tightest GDP
    curve, reported as that curve's ``epsilon(delta)``.
``"clopper_pearson"``
    Independent trials (one score per training run, e.g. a canary that is in or out of
    each run): Jagielski, Ullman & Oprea (2020), "Auditing Differentially Private
    Machine Learning: How Private is Private SGD?", NeurIPS; Nasr, Song, Thakurta,
    Papernot & Carlini (2021), "Adversary Instantiation: Lower Bounds for
    Differentially Private Machine Learning", IEEE S&P. Their audit bounds the false
    positive rate from above and the true positive rate from below by two
    Clopper-Pearson intervals and combines the ends, which spends the error probability
    twice (each interval at half of it) and asks both rates to be extreme at once. Here
    the two are combined in *one exact test*, with the same binomial tails: at the
    threshold ``t`` = the ``(c+1)``-th highest excluded score, the false positive rate
    ``F = P[out > t]`` is distributed as ``Beta(c + 1, n_out - c)`` whatever the score
    distribution (uniform order statistics; David & Nagaraja 2003, "Order Statistics",
    Sec. 2.2), and given ``t`` the number of included scores above it is
    ``Bin(n_in, TPR(t))`` with ``TPR(t) <= e^eps F + delta`` under the claim (the
    ``(epsilon, delta)``-DP inequality for the event ``score > t``). So
    ``P[Bin(n_in, min(1, e^eps F + delta)) >= v]``, averaged over ``F``'s Beta law, is a
    p-value for the claim "``epsilon``": exact, with no nuisance parameter
    (``P[Bin(n, p) >= v] = I_p(v, n - v + 1)`` is increasing in ``p``, so the largest
    ``TPR`` the claim allows is the worst case). The average is a one-dimensional
    integral, bounded from above by an upper Riemann sum over 800 logit-spaced
    probability slices of ``F`` (the integrand is monotone); the quantiles are nudged
    until their CDF is certified at or above each slice's level. By the symmetry of
    ``(epsilon, delta)``-DP, the same test runs on the lower side: threshold = the
    ``(c+1)``-th *lowest included* score, counting the excluded scores below it
    (``TNR(t) <= e^eps FNR(t) + delta``). Valid for any ``(epsilon, delta)``-DP mechanism.
``"gdp"``
    Nasr, Hayes, Steinke, Balle, Tramer, Jagielski, Carlini & Terzis (2023), "Tight
    Auditing of Differentially Private Machine Learning", USENIX Security (the GDP
    audit): the claim is the Gaussian trade-off curve ``G_mu`` (Dong, Roth & Su 2022,
    Definition 2.7) through ``(epsilon, delta)`` (their Corollary 2.13; the upper end of
    the bracketed ``mu``, so rounding never refutes more), which allows
    ``TPR(t) <= Phi(Phi^{-1}(F) + mu)`` at every threshold; the same exact test as
    ``"clopper_pearson"`` with that rate bound. Done validly: the test is one-sided in the
    right direction at each threshold and corrected for the threshold search (never the
    absolute value of a negative ``mu`` estimate, which jax_privacy 2.0's
    ``epsilon_from_gdp`` takes). Same caveat as ``"one_run_fdp"``: a bound on ``epsilon``
    only for mechanisms with Gaussian trade-off curves. **Conservative by design**: at the
    true epsilon of a Gaussian mechanism every one of its tests is exact, so spending the
    whole ``1 - confidence`` makes the realised rate of exceeding the true epsilon sit
    near the nominal one (2-3% measured at 95%), and a short series of audits would show
    more than 5% by chance; ``"gdp"`` spends half of it (its 95% bound is a 97.5% bound,
    about 1.5% realised), which moved its bound by 0.01-0.1 on the benchmark.

The independent-trials tests use the grid ``c`` in ``{0} + counts`` on each side (``2K``
tests in all, each at ``0.9 (1 - confidence) / (2K)``; half that for ``"gdp"``). A grid
index inside a tie of the reference scores counts the tie as if its scores were distinct
(about twice the false positive rate on randomized response), so the remaining tenth is
spread over every index ``c`` of each side, ``0.1 / (2 (c + 1) (1 + log n_ref))`` each,
fixed in advance; the tests evaluated with it are those at the first reference score of
each tied value (the event ``score >= v``), at most 32 per side. The bound is the largest
over a subset of a union-bounded family, hence valid. Only the orientation given is tested
(higher = included); a zero bound whose negated scores would refute ``epsilon = 0`` draws
a ``UserWarning`` (see :func:`epsilon_lower_bound`).
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
from scipy.special import bdtr, betainc, betaincinv, expit, gammaln, ndtr, ndtri, xlog1py, xlogy

from privlearn._validation import check_delta, check_real
from privlearn.accounting.fdp import gdp_mu_interval
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = [
    "METHODS",
    "epsilon_lower_bound",
    "roc_curve",
    "auc",
    "tpr_at_fpr",
]

METHODS = ("one_run", "one_run_fdp", "clopper_pearson", "gdp")
_GRID_RATIO = 2.0
_EPS_TOL = 1e-6
#: Standard deviations below the binomial mean down to which the one-run p-value sums
#: the pmf term by term (the mass further down is bounded as a whole; see
#: _one_run_p_value).
_PMF_WINDOW = 40.0
#: Share of ``1 - confidence`` that ``"gdp"`` spends (see the module docstring): its tests
#: are exact at the true epsilon of a Gaussian mechanism, so at the full share the realised
#: exceedance rate sits near the nominal one (2-3% measured at 95%) and a short series of
#: audits shows more than 5% by chance; at half it stays near 1.5%.
_GDP_ERROR_SHARE = 0.5
#: Share of the independent-trials audits' error budget spread over the thresholds at
#: tied score values (see _threshold_tests); the geometric grid keeps the rest.
_TIE_SHARE = 0.1
#: Most tied-value thresholds evaluated per side (those with the most raw evidence).
_MAX_TIE_TESTS = 32


# ---------------------------------------------------------------------------- input checks
def _scores(name: str, x, *, allow_empty: bool = False) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor (possibly with grad)
        x = x.detach().cpu().numpy()
    if isinstance(x, (str, bytes)):
        raise ParameterTypeError(f"{name} must be an array of real numbers, got {type(x).__name__}")
    try:
        raw = np.asarray(x)
    except ValueError:  # ragged nesting: NumPy's own message names no parameter
        raise ParameterValueError(
            f"{name} must be a flat array of real numbers (one score per canary), got a "
            f"ragged {type(x).__name__} whose rows differ in length; pass one float per "
            "canary") from None
    if raw.dtype.kind == "b":  # the inclusion mask or the guesses, not scores
        raise ParameterTypeError(
            f"{name} must be real-valued attack scores (one float per canary, higher = more "
            f"likely included), got booleans (dtype {raw.dtype}); booleans are usually the "
            "inclusion mask or the attack's guesses, which rank nothing: pass the scores "
            "the guesses were thresholded from (e.g. the loss or the gradient alignment of "
            "each canary), split by the inclusion mask")
    if raw.dtype.kind in "mM":  # NumPy converts datetimes and durations to floats
        raise ParameterTypeError(
            f"{name} must be real numbers, got {raw.dtype} values; pass one float score "
            "per canary (higher = more likely included)")
    if raw.dtype.kind in "c":
        raise ParameterTypeError(f"{name} must be real numbers, got complex values (dtype "
                        f"{raw.dtype}); pass the real scores, e.g. np.real(s) if that is meant")
    if raw.dtype.kind in "USO":
        odd = [v for v in raw.reshape(-1) if v is None or isinstance(v, (str, bytes))]
        if odd:
            raise ParameterTypeError(f"{name} must be an array of real numbers, got "
                            f"{type(odd[0]).__name__} {odd[0]!r} among them; pass one float "
                            "score per canary (np.asarray(s, dtype=float) converts numeric "
                            "strings)")
    try:
        a = np.asarray(raw, dtype=float)
    except (TypeError, ValueError):
        raise ParameterTypeError(f"{name} must be an array of real numbers, got "
                        f"{type(x).__name__} of dtype {raw.dtype}") from None
    a = a.reshape(-1) if a.ndim == 0 else a
    if a.ndim != 1:
        raise ParameterValueError(
            f"{name} must be one-dimensional (one score per canary), got shape "
            f"{a.shape}; flatten it with np.ravel if it holds one score each")
    if a.size == 0 and not allow_empty:
        raise ParameterValueError(f"{name} is empty; the audit needs at least one included and one "
                         "excluded canary (use more canaries)")
    bad = ~np.isfinite(a)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ParameterValueError(f"{name} must be finite, got {float(a[i])} at index {i} "
                         f"({int(bad.sum())} non-finite scores); a scorer that diverged "
                         "cannot be audited")
    return a


def _check_sides(n_in: int, n_out: int, method: str) -> None:
    """One-run audits draw each canary's inclusion at random, so every canary on one side
    is one of the outcomes their guarantee covers (the guessing game of Steinke, Nasr &
    Jagielski 2023, Theorem 3.1, holds whatever the split); the independent-trials
    methods compare the included runs' scores against the excluded runs' and need both."""
    if n_in + n_out == 0:
        raise ParameterValueError("in_scores and out_scores are both empty; the audit needs "
                                  "at least one canary score (use more canaries)")
    if method in ("one_run", "one_run_fdp"):
        return
    for name, n in (("in_scores", n_in), ("out_scores", n_out)):
        if n == 0:
            raise ParameterValueError(
                f"{name} is empty; method={method!r} compares the scores of runs with the "
                "canary against runs without it and needs at least one of each (run more "
                "trials, or use method='one_run' for canaries inserted in one run, where "
                "a side may be empty)")


def _check_delta(delta) -> float:
    return check_delta("delta", delta, hint="use the delta of the claim being audited "
                       "(e.g. 1e-5, below 1/n for n records)")


def _check_confidence(confidence) -> float:
    c = check_real("confidence", confidence, hint="pass a probability such as 0.95")
    if not 0 < c < 1:
        raise ParameterValueError(f"confidence must be in (0, 1), got {c!r} (0.95 is "
                         "usual)")
    return c


def _count_grid(lo: int, hi: int) -> np.ndarray:
    """Integers from ``lo`` to ``hi`` (inclusive, ``lo >= 1``), geometrically spaced with
    ratio 2 (every integer while the spacing is below 1)."""
    if hi < lo:
        return np.zeros(0, dtype=np.int64)
    num = int(math.ceil(math.log(hi / lo) / math.log(_GRID_RATIO))) + 1 if hi > lo else 1
    g = np.unique(np.round(np.geomspace(lo, hi, num)).astype(np.int64))
    return g[(g >= lo) & (g <= hi)]


def _ranked(in_scores: np.ndarray, out_scores: np.ndarray,
            ) -> tuple[np.ndarray, np.ndarray]:
    """Labels (True = included) of all canaries sorted by decreasing score, ties broken
    against the auditor: among equal scores the excluded canaries first (see the module
    docstring; the "in" guesses at the top and the "out" guesses at the bottom then get
    the fewest right a tie allows, and a threshold counts only scores strictly beyond);
    and the scores in that order."""
    s = np.concatenate([in_scores, out_scores])
    lab = np.concatenate([np.ones(in_scores.size, bool), np.zeros(out_scores.size, bool)])
    order = np.lexsort((lab, -s))  # primary key: score (descending), then excluded first
    return lab[order], s[order]


# ---------------------------------------------------------------------------- one run
def _log_binom_pmf(j: np.ndarray, n: int, p: float) -> np.ndarray:
    # xlogy / xlog1py: p = e^eps / (1 + e^eps) rounds to 1 from eps ~ 37 (a claim that
    # large, or the search for the bound), where (n - j) log(1 - p) must be 0 at j = n
    return (gammaln(n + 1) - gammaln(j + 1) - gammaln(n - j + 1)
            + xlogy(j, p) + xlog1py(n - j, -p))


def _binom_sf(v: int, n: int, p: float) -> float:
    """P[Bin(n, p) >= v]."""
    if v <= 0:
        return 1.0
    if v > n:
        return 0.0
    from scipy.special import bdtrc

    return float(bdtrc(v - 1, n, p))


def _one_run_p_value(m: int, k: int, v: int, eps: float, delta: float) -> float:
    """Upper bound on ``P[W >= v]`` for ``k`` guesses on ``m`` canaries of an
    ``(eps, delta)``-DP mechanism (Steinke, Nasr & Jagielski 2023, Theorem 3.1)."""
    p = float(expit(eps))
    beta = _binom_sf(v, k, p)
    if delta == 0 or v == 0:
        return min(beta, 1.0)
    # max over i = 1..v of P[v - i <= Bin < v] / i. Only the pmf from v - 1 down to
    # _PMF_WINDOW standard deviations below the mean is summed term by term (at 10^6
    # guesses the full sum cost 20 ms a call); every larger i is covered by the bound
    # (P[v - iw <= Bin < v] + P[Bin < v - iw]) / (iw + 1), iw the window's last i: never
    # below the full maximum, above it by at most P[Bin < v - iw] / (iw + 1) (a normal
    # tail of 40 sd when k p (1 - p) is large; with p near 1, a Poisson-like tail).
    lo = max(0, int(k * p - _PMF_WINDOW * math.sqrt(k * p * (1.0 - p))) - 1)
    if lo >= v:  # v is far below the mean: P[Bin < v] bounds every term
        alpha = float(bdtr(v - 1, k, p))
    else:
        j = np.arange(v - 1, lo - 1, -1, dtype=float)  # v - i for i = 1..v - lo
        mass = np.cumsum(np.exp(_log_binom_pmf(j, k, p)))  # P[v - i <= Bin < v]
        alpha = float(np.max(mass / np.arange(1, j.size + 1)))
        if lo > 0:
            alpha = max(alpha, (float(mass[-1]) + float(bdtr(lo - 1, k, p))) / (j.size + 1))
    return min(beta + alpha * 2.0 * m * delta, 1.0)


def _one_run_fdp_refutes(m: int, k: int, v: int, eps: float, delta: float,
                         significance: float) -> bool:
    """Whether ``v`` correct out of ``k`` guesses on ``m`` canaries refutes, at
    ``significance``, that the mechanism has the Gaussian trade-off curve ``G_mu`` with
    ``mu = gdp_mu(eps, delta)`` (Mahloujifar, Melis & Chaudhuri 2025, the recursive
    bound on the probability of ``v`` correct guesses, in its capped form).

    The claimed curve is taken with the *upper* end of the bracketed ``mu`` (a less
    private hypothesis), so rounding never makes a refutation easier.
    """
    if delta > 0:
        mu = gdp_mu_interval(eps, delta)[1]
    else:  # an (eps, 0) claim has no Gaussian curve through it: refute nothing
        return False
    r = significance * v / m
    h = significance * (k - v) / m
    for i in range(v - 1, -1, -1):
        # g(r) = G_mu(1 - r) = Phi(Phi^{-1}(r) - mu)
        g = float(ndtr(ndtri(r) - mu)) if 0 < r < 1 else (1.0 if r >= 1 else 0.0)
        h_new = max(h, g)
        if h_new == h:
            break
        r = min(r + (i / (k - i)) * (h_new - h), 1.0)
        h = h_new
    return r + h > k / m


def _one_run_refutes(m: int, k: int, v: int, eps: float, delta: float, alpha: float,
                     use_fdp: bool) -> bool:
    """Whether ``v`` correct out of ``k`` guesses on ``m`` canaries refute the claim
    ``eps`` at level ``alpha``: through the trade-off curve (``use_fdp``,
    :func:`_one_run_fdp_refutes`) or the ``(eps, delta)`` tail (:func:`_one_run_p_value`)."""
    if use_fdp:
        return _one_run_fdp_refutes(m, k, v, eps, delta, alpha)
    return _one_run_p_value(m, k, v, eps, delta) <= alpha


def _largest_refuted(refutes, eps_start: float) -> float:
    """A refuted ``eps >= eps_start`` at the boundary of the refuted region (bisection to
    ``_EPS_TOL``), given that ``refutes(eps_start)`` holds; the returned value is always
    one at which ``refutes`` was observed to hold.

    Validity does not need ``refutes`` to be monotone: an ``(eps, delta)``-DP mechanism
    is ``(eps', delta)``-DP for every ``eps' >= eps`` (and a ``G_mu`` one is ``G_mu'``
    for ``mu' >= mu``), so the tail bounds at every ``eps' >= eps`` bound the same
    probability and their minimum is a valid p-value for the claim ``eps``; refuting
    any ``eps'`` therefore refutes every ``eps <= eps'``. Monotonicity only makes the
    bisection find the largest such ``eps'``.
    """
    lo = eps_start
    hi = max(1.0, 2.0 * lo)
    while refutes(hi):
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            raise ArithmeticError("the epsilon search did not terminate (a refutation at "
                                  "every epsilon); the scores are not a valid audit")
    while hi - lo > _EPS_TOL * max(1.0, lo):
        mid = 0.5 * (lo + hi)
        if refutes(mid):
            lo = mid
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=16)  # the harness asks before training, then bounds
def _useful_guess_counts(m: int, delta: float, significance: float,
                         use_fdp: bool) -> tuple[np.ndarray, float]:
    """The grid of guess counts and the Bonferroni level of each test.

    Starts from :func:`_count_grid` ``(1, m)`` and drops every count ``k`` at which
    even ``k`` correct guesses out of ``k`` cannot refute ``epsilon = 0`` at the
    current level (few guesses cannot be significant; with ``delta > 0`` the
    ``2 m delta`` term of Steinke et al. makes many more useless): such a test can
    never raise the bound, and dropping it raises the level of every other one. The
    grid depends on ``m``, ``delta`` and ``significance`` only, never on the scores or
    the labels, so the Bonferroni correction over it is valid.
    """
    ks = _count_grid(1, m)
    ks.setflags(write=False)  # shared by the cache
    while ks.size:
        alpha = significance / ks.size
        keep = np.array([_one_run_refutes(m, int(k), int(k), 0.0, delta, alpha, use_fdp)
                         for k in ks], dtype=bool)
        if keep.all():
            return ks, alpha
        ks = ks[keep]
        ks.setflags(write=False)
    return ks, significance


def _one_run_bound(labels: np.ndarray, delta: float, significance: float,
                   use_fdp: bool) -> float:
    m = labels.size
    ks, alpha = _useful_guess_counts(m, delta, significance, use_fdp)
    if ks.size == 0:
        return 0.0
    # k guesses: "in" for the ceil(k/2) highest scores, "out" for the floor(k/2) lowest
    top, bottom = ks - ks // 2, ks // 2
    correct = np.r_[0, np.cumsum(labels)][top] + np.r_[0, np.cumsum(~labels[::-1])][bottom]
    # candidates in order of decreasing precision: the best ones settle the search early
    order = np.argsort(-(correct / ks), kind="stable")
    best = 0.0
    for idx in order:
        k, v = int(ks[idx]), int(correct[idx])
        if v == 0:
            continue
        if not use_fdp and alpha < 0.5 and v <= k * expit(best):
            # v <= k p is at most the median of Bin(k, p), p = e^eps/(1+e^eps), so
            # P[Bin(k, p) >= v] >= 1/2 > alpha: this candidate cannot refute ``best``.
            continue
        def refutes(e, k=k, v=v):
            return _one_run_refutes(m, k, v, e, delta, alpha, use_fdp)

        if not refutes(best):
            continue
        best = _largest_refuted(refutes, best)
    return best


def _one_run_refutable(n_in: int, n_out: int, eps: float, delta: float, significance: float,
                       use_fdp: bool) -> bool | None:
    """Whether some outcome of the one-run audit of ``n_in`` included and ``n_out``
    excluded canaries refutes ``eps``: whether the perfect attack (every included canary
    ranked above every excluded one, which gets the most guesses right at every count of
    the grid) does. None when no outcome refutes even ``epsilon = 0`` (the grid is
    empty). Costs one test per count, not the search of :func:`_one_run_bound`."""
    m = n_in + n_out
    ks, alpha = _useful_guess_counts(m, delta, significance, use_fdp)
    if ks.size == 0:
        return None
    correct = np.minimum(ks - ks // 2, n_in) + np.minimum(ks // 2, n_out)
    return any(v > 0 and _one_run_refutes(m, int(k), int(v), eps, delta, alpha, use_fdp)
               for k, v in zip(ks, correct, strict=True))


# ---------------------------------------------------------------------------- independent trials
#: Probability levels of the quadrature over the order-statistic FPR (logit-spaced, so both
#: tails are resolved down to ~1e-17): see :func:`_joint_p_value`.
_QUAD_LEVELS = expit(np.linspace(-38.0, 38.0, 801))
_QUAD_MASS = np.diff(_QUAD_LEVELS)
#: Relative allowance for the rounding of the special functions in a p-value: the
#: p-value is multiplied by ``1 + _PVALUE_SLACK`` (never rounded in the optimistic
#: direction).
_PVALUE_SLACK = 1e-6


@functools.lru_cache(maxsize=256)
def _beta_quantiles_above(a: float, b: float) -> np.ndarray:
    """Quantiles of ``Beta(a, b)`` at :data:`_QUAD_LEVELS`, each nudged up until its CDF
    is at least its level (so every value is at or above the true quantile). Read-only,
    and cached (about 6 kB each): audits of the same numbers of canaries (the methods
    compared on one draw, repeated audits) test the same order statistics."""
    f = betaincinv(a, b, _QUAD_LEVELS)
    # the relative nudge doubles at each round: the inversion's error (relative to the
    # distribution's spread) grows with the counts, and near the upper levels a change of
    # the CDF by one rounding unit of 1 can need a relative move of 1e-7 or more
    step = 1e-12
    for _ in range(80):
        low = betainc(a, b, f) < _QUAD_LEVELS
        if not low.any():
            f.flags.writeable = False
            return f
        f = np.where(low, np.minimum(1.0, f * (1.0 + step) + 1e-300), f)
        f[low & (f >= 1.0)] = 1.0
        step *= 2.0
    raise ArithmeticError(f"the Beta({a}, {b}) quantiles could not be certified; the audit "
                          "cannot be computed for these counts")


class _ThresholdTest:
    """The test at one threshold of the independent-trials audit (see
    :func:`_joint_p_value`): ``c`` *reference* scores above the threshold (it is the
    ``(c+1)``-th highest of ``n_ref``), ``v`` of the ``n_cnt`` *counted* scores above it,
    run at ``level`` times the audit's significance (its share of the error budget)."""

    def __init__(self, c: int, n_ref: int, v: int, n_cnt: int, level: float = 1.0):
        self.c, self.n_ref, self.v, self.n_cnt, self.level = c, n_ref, v, n_cnt, level
        self._f = None

    def p_value(self, rate_bound) -> float:
        if self.v <= 0:
            return 1.0
        if self._f is None:
            self._f = _beta_quantiles_above(self.c + 1.0, float(self.n_ref - self.c))
        return _joint_p_value(self._f, self.v, self.n_cnt, rate_bound)


def _joint_p_value(f_quantiles: np.ndarray, v: int, n_cnt: int, rate_bound) -> float:
    """Upper bound on ``P[Bin(n_cnt, rate_bound(F)) >= v]`` with ``F`` the rate of the
    reference distribution above an order-statistic threshold (quantiles
    ``f_quantiles`` at :data:`_QUAD_LEVELS`).

    ``P[Bin(n, p) >= v] = I_p(v, n - v + 1)`` is increasing in ``p`` and ``rate_bound``
    is increasing in ``F``, so over each probability slice ``[u_{j-1}, u_j]`` of ``F``
    the integrand is at most its value at the slice's upper quantile: the upper Riemann
    sum below bounds the integral from above (the mass beyond the last level counts 1).
    """
    p = np.clip(rate_bound(f_quantiles), 0.0, 1.0)
    h = betainc(float(v), float(n_cnt - v + 1), p)
    total = (_QUAD_LEVELS[0] * h[0] + float(np.dot(_QUAD_MASS, h[1:]))
             + (1.0 - _QUAD_LEVELS[-1]))
    return min(1.0, total * (1.0 + _PVALUE_SLACK))


def _threshold_tests(labels: np.ndarray, ranked_scores: np.ndarray | None = None,
                     ) -> list[_ThresholdTest]:
    """The tests of the independent-trials audit, each with its share of the error budget
    (the shares sum to at most 1). On the *upper* side, the threshold "the ``c+1``-th
    highest excluded score" and the included scores above it (the event ``score > t``);
    on the *lower* side, by symmetry, "the ``c+1``-th lowest included score" and the
    excluded scores below it (the event ``score < t``, bounded by the same DP inequality
    with the neighbours swapped).

    Every index ``c`` of every side carries a share fixed before the labels are seen:
    ``(1 - _TIE_SHARE) / K`` on the geometric grid (``c`` in 0 and the counts; ``K``
    grid tests on both sides together), plus ``_TIE_SHARE / (2 (c + 1) (1 + log n_ref))``
    at every index (a harmonic spread, summing to at most ``_TIE_SHARE``: ``H_n <= 1 +
    log n``). Reporting the largest bound over any *subset* of these tests is valid (a
    union bound over all of them), so which indices are evaluated may depend on the
    data: the grid, and, with ``ranked_scores``, the first reference index of each tied
    value (the threshold that puts the whole tie on the right side; the grid's index
    inside a tie counts its reference rate as if the tie's scores were distinct, which
    on discrete scores overstates the rate about twofold), at most
    ``_MAX_TIE_TESTS`` per side, those with the most raw evidence."""
    sides = []
    for lab, sc in ((labels, ranked_scores),  # upper side
                    (~labels[::-1], None if ranked_scores is None else ranked_scores[::-1])):
        n_cnt = int(lab.sum())
        n_ref = lab.size - n_cnt
        if n_cnt == 0 or n_ref == 0:
            continue
        sides.append((lab, sc, n_cnt, n_ref,
                      np.concatenate([[0], _count_grid(1, n_ref - 1)]).astype(np.int64)))
    if not sides:
        return []
    grid_level = (1.0 - _TIE_SHARE) / sum(s[-1].size for s in sides)
    tests = []
    for lab, sc, n_cnt, n_ref, grid in sides:
        ref_pos = np.flatnonzero(~lab)  # ranks of the reference scores, best first
        above_all = np.cumsum(lab)[ref_pos]  # counted scores ranked above each reference
        levels = {int(c): grid_level for c in grid}
        if sc is not None and _TIE_SHARE > 0:
            ref_sc = sc[ref_pos]
            start = np.r_[True, ref_sc[1:] != ref_sc[:-1]]  # first reference of its value
            values, counts = np.unique(sc, return_counts=True)
            tied = counts[np.searchsorted(values, ref_sc)] > 1
            cand = np.flatnonzero(start & tied & (above_all > 0))
            if cand.size > _MAX_TIE_TESTS:
                evidence = (above_all[cand] / n_cnt) / ((cand + 1.0) / n_ref)
                cand = cand[np.argsort(-evidence, kind="stable")[:_MAX_TIE_TESTS]]
            spread = _TIE_SHARE / (len(sides) * (1.0 + math.log(n_ref)))
            for c in cand:
                levels[int(c)] = levels.get(int(c), 0.0) + spread / (c + 1.0)
        tests += [_ThresholdTest(c, n_ref, int(above_all[c]), n_cnt, lev)
                  for c, lev in levels.items()]
    return tests


def _independent_trials_bound(labels: np.ndarray, significance: float, rate_bound_at,
                              ranked_scores: np.ndarray | None = None) -> float:
    """Largest parameter refuted at one of the tests of :func:`_threshold_tests`, each at
    its share of ``significance`` (a weighted Bonferroni correction), where
    ``rate_bound_at(x)`` is the largest counted-side rate the hypothesis "parameter
    ``x``" allows at reference rate ``F``."""
    tests = _threshold_tests(labels, ranked_scores)
    if not tests:
        return 0.0
    # best raw evidence first: most counted scores above the fewest reference ones
    tests.sort(key=lambda t: -(t.v / t.n_cnt) / ((t.c + 1.0) / t.n_ref))
    best = 0.0
    for t in tests:
        if t.v == 0:
            continue

        def refutes(x, t=t):
            return t.p_value(rate_bound_at(x)) <= significance * t.level

        if not refutes(best):
            continue
        best = _largest_refuted(refutes, best)
    return best


def _clopper_pearson_bound(labels: np.ndarray, delta: float, significance: float,
                           ranked_scores: np.ndarray | None = None) -> float:
    def rate_bound_at(eps):
        factor = math.exp(eps)
        return lambda f: factor * f + delta

    return _independent_trials_bound(labels, significance, rate_bound_at, ranked_scores)


def _gdp_bound(labels: np.ndarray, delta: float, significance: float,
               ranked_scores: np.ndarray | None = None) -> float:
    def rate_bound_at(eps):
        mu = gdp_mu_interval(eps, delta)[1]  # the less private end: never refutes more
        return lambda f: ndtr(ndtri(f) + mu)

    return _independent_trials_bound(labels, significance * _GDP_ERROR_SHARE, rate_bound_at,
                                     ranked_scores)


# ---------------------------------------------------------------------------- public API
def epsilon_lower_bound(in_scores, out_scores, *, delta: float, method: str = "one_run_fdp",
                        confidence: float = 0.95) -> float:
    """Lower confidence bound on epsilon at ``delta`` from canary scores.

    Parameters
    ----------
    in_scores, out_scores : array_like of finite floats
        Scores of the included and of the excluded canaries (higher = more likely
        included): real-valued attack scores, not booleans (the inclusion mask or the
        guesses are refused). For the one-run methods one side may be empty (every
        canary's inclusion is drawn at random, so every canary on one side is an outcome
        the bound covers); ``"clopper_pearson"`` and ``"gdp"`` need both sides.
    delta : float in [0, 1)
        The delta of the privacy claim being audited (``"gdp"`` and ``"one_run_fdp"``
        need ``delta > 0``).
    method : {"one_run_fdp", "one_run", "clopper_pearson", "gdp"}
        See the module docstring: ``"one_run*"`` for canaries inserted in one training
        run (each included independently with probability 1/2), ``"clopper_pearson"``
        and ``"gdp"`` for independent trials (one score per training run). **The
        default, ``"one_run_fdp"``, assumes the mechanism's trade-off curve is
        Gaussian** (the Gaussian mechanism, its compositions, DP-SGD approximately): for
        a mechanism with another curve -- randomized response, Laplace noise, any
        pure-DP mechanism -- its bound can exceed the true epsilon, so an honest
        mechanism is flagged as a violation (exact randomized response at epsilon 1,
        ``delta=1e-5``, 1,000 canaries: the default's bound exceeded 1 in 18 of 20
        draws, ``"one_run"``'s in none). Audit those with ``method="one_run"`` (one run) or
        ``"clopper_pearson"`` (independent trials), valid for every
        ``(epsilon, delta)``-DP mechanism. ``"one_run_fdp"`` and ``"gdp"`` refuse
        ``delta=0``.
    confidence : float in (0, 1)
        Probability that the bound does not exceed the true epsilon.

    Returns
    -------
    float
        The bound (>= 0; 0 when the scores refute nothing). Only the orientation given is
        tested (higher = included); when the bound is 0 and the negated scores would have
        refuted ``epsilon = 0``, a ``UserWarning`` says the scores look reversed (the
        negated bound is not returned: choosing the orientation after looking would spend
        the error budget twice).

    Raises
    ------
    ValueError
        Empty scores (both sides; either side for the independent-trials methods),
        non-finite scores, ``delta`` outside ``[0, 1)``, ``confidence`` outside
        ``(0, 1)``, an unknown method.
    TypeError
        Scores that are not arrays of real numbers (booleans included).

    References
    ----------
    Steinke, Nasr & Jagielski (2023), Theorem 3.1; Mahloujifar, Melis & Chaudhuri
    (2025); Jagielski, Ullman & Oprea (2020); Nasr et al. (2021); Nasr et al. (2023)
    (see the module docstring for the exact statements used).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> lab = rng.random(10_000) < 0.5
    >>> s = rng.normal(size=10_000) + 2.0 * lab
    >>> eps = epsilon_lower_bound(s[lab], s[~lab], delta=1e-5, method="one_run")
    """
    ins = _scores("in_scores", in_scores, allow_empty=True)
    outs = _scores("out_scores", out_scores, allow_empty=True)
    d = _check_delta(delta)
    c = _check_confidence(confidence)
    if not isinstance(method, str):
        raise ParameterTypeError(f"method must be a string, one of {METHODS}, got "
                                 f"{type(method).__name__} {method!r}")
    if method not in METHODS:
        raise ParameterValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_sides(ins.size, outs.size, method)
    if method in ("gdp", "one_run_fdp") and d == 0:
        raise ConfigurationError(f"method={method!r} compares against Gaussian trade-off curves, "
                         "which satisfy no (epsilon, 0) guarantee: give delta in (0, 1), or "
                         "use method='one_run' or 'clopper_pearson' for delta=0")
    if method in ("one_run", "one_run_fdp"):
        _warn_if_unrefutable(ins.size + outs.size, d, c, method, stacklevel=3)
    bound = _bound(ins, outs, d, method, c)
    _warn_if_reversed(ins, outs, d, method, c, bound, stacklevel=3)
    return bound


def _warn_if_reversed(ins: np.ndarray, outs: np.ndarray, delta: float, method: str,
                      confidence: float, bound: float, stacklevel: int = 2) -> bool:
    """Warn (:class:`UserWarning`) and return True when the bound is 0 but the negated
    scores refute ``epsilon = 0`` clearly (at the stricter confidence ``1 - (1 -
    confidence) / 10``, so that scores carrying nothing draw the warning in at most a
    tenth of the audit's error rate): the scores are probably oriented the wrong way
    (losses, where lower means included). The bound returned stays the one of the scores
    as given; the flipped one is *not* valid at ``confidence`` (choosing the orientation
    after seeing both runs two tests on one budget), so the advice is to fix the
    orientation and audit again on fresh canaries or runs."""
    if bound > 0 or ins.size + outs.size == 0:
        return False
    strict = 1.0 - (1.0 - confidence) / 10.0
    flipped = _bound(-ins, -outs, delta, method, strict)
    if not flipped > 0:
        return False
    warnings.warn(
        f"the {method!r} bound is 0, but the same scores negated would give {flipped:.3g} "
        f"(at confidence {strict:g}): "
        "the scores look reversed (the audit reads a HIGHER score as 'more likely "
        "included'; a loss is lower for included canaries, so pass -loss). The negated "
        "bound is not valid at this confidence (picking the orientation after seeing the "
        "results makes two tests of one error budget): fix the orientation and audit again "
        "on fresh canaries or training runs", UserWarning, stacklevel=stacklevel)
    return True


def _warn_if_unrefutable(m: int, delta: float, confidence: float, method: str,
                        stacklevel: int = 2) -> bool:
    """Warn (:class:`UserWarning`) and return True when no outcome of a one-run audit
    with ``m`` canaries can refute ``epsilon = 0`` at ``confidence``: its bound is 0
    whatever the scores, so the audit cannot detect anything."""
    ks, _ = _useful_guess_counts(m, delta, 1.0 - confidence, method == "one_run_fdp")
    if ks.size:
        return False
    if method == "one_run" and 2 * m * delta >= 0.05:
        fix = (f"the 2 m delta term of Steinke et al. ({2 * m * delta:.3g}) swamps every "
               "test: audit a claim with a smaller delta (m * delta well below 0.05), or use "
               "method='one_run_fdp'")
    else:
        fix = ("use more canaries (hundreds at least; the guide 'auditing privacy empirically', "
               "section 'How many canaries buy how much power', has the power table)")
    warnings.warn(f"with {m} canaries at delta={delta} and confidence={confidence}, no "
                  f"outcome of the {method!r} audit can refute epsilon = 0: the bound is 0 "
                  f"whatever the scores; {fix}", UserWarning, stacklevel=stacklevel)
    return True


def _bound(ins: np.ndarray, outs: np.ndarray, d: float, method: str, c: float) -> float:
    """The bound from validated scores (the one-run methods accept an empty side: a run in
    which every canary was included, or none, is a valid outcome of the guessing game)."""
    labels, ranked_scores = _ranked(ins, outs)
    significance = 1.0 - c
    if method == "one_run":
        return _one_run_bound(labels, d, significance, use_fdp=False)
    if method == "one_run_fdp":
        return _one_run_bound(labels, d, significance, use_fdp=True)
    if method == "clopper_pearson":
        return _clopper_pearson_bound(labels, d, significance, ranked_scores)
    return _gdp_bound(labels, d, significance, ranked_scores)


def roc_curve(in_scores, out_scores) -> tuple[np.ndarray, np.ndarray]:
    """Empirical ROC of the attack "in if score >= t" over all thresholds ``t``.

    Returns
    -------
    (fpr, tpr) : numpy arrays, increasing, from (0, 0) to (1, 1); ties between in and
    out scores give a diagonal segment.
    """
    ins = _scores("in_scores", in_scores)
    outs = _scores("out_scores", out_scores)
    s = np.concatenate([ins, outs])
    lab = np.concatenate([np.ones(ins.size), np.zeros(outs.size)])
    order = np.argsort(-s, kind="stable")
    s, lab = s[order], lab[order]
    tp = np.cumsum(lab)
    fp = np.cumsum(1 - lab)
    last = np.r_[s[1:] != s[:-1], True]  # one point per distinct threshold
    tpr = np.r_[0.0, tp[last] / ins.size]
    fpr = np.r_[0.0, fp[last] / outs.size]
    return fpr, tpr


def auc(in_scores, out_scores) -> float:
    """Area under the ROC curve (the probability that an included canary outscores an
    excluded one, ties counted 1/2)."""
    fpr, tpr = roc_curve(in_scores, out_scores)
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


def tpr_at_fpr(in_scores, out_scores, fpr: float) -> float:
    """Largest true positive rate of the attack at false positive rate ``fpr``
    (thresholds randomised between neighbouring points of the ROC, i.e. the ROC
    interpolated linearly)."""
    f = check_real("fpr", fpr, hint="pass a false positive rate in [0, 1] such as 0.01")
    if not 0 <= f <= 1:
        raise ParameterValueError(f"fpr must be in [0, 1], got {fpr!r}")
    x, y = roc_curve(in_scores, out_scores)
    return float(np.interp(f, x, y))

