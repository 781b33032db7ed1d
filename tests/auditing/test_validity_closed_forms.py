"""Validity of the epsilon lower bounds against mechanisms whose privacy curve is known in
closed form (not through privlearn's accountants): a lower bound at confidence ``c`` may
exceed the true ``epsilon(delta)`` with probability at most ``1 - c``.

* Randomized response at ``e0`` (pure ``e0``-DP; ``epsilon(delta) = log((p - delta) /
  (1 - p))``, ``p = e^e0 / (1 + e^e0)``): every canary's score is its inclusion bit,
  flipped with probability ``1 - p``. The bound depends on the four counts (included or
  not, score 0 or 1) only, so the exceedance probability is an exact multinomial sum.
* Laplace noise of scale ``1 / e0`` on the inclusion bit (``epsilon(delta) = e0 + 2 log(1 -
  delta)``): its tails have likelihood ratio exactly ``e^e0``, which makes the top guesses
  of the one-run game as accurate as the claim allows (the tightest case measured).
* The Gaussian mechanism ``N(mu * inclusion, 1)`` (``mu``-GDP; ``epsilon(delta)`` from
  Balle & Wang 2018, Theorem 8, solved here with brentq): for a handful of canaries the
  bound is a function of the labels in rank order, whose law is sampled (vectorised).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import optimize, stats

from privlearn.auditing import epsilon_lower_bound
from privlearn.auditing.bounds import _bound


def _rr_epsilon(e0: float, delta: float) -> float:
    p = 1.0 / (1.0 + math.exp(-e0))
    return math.log((p - delta) / (1.0 - p)) if p - delta > 1.0 - p else 0.0


def _laplace_epsilon(e0: float, delta: float) -> float:
    return max(0.0, e0 + 2.0 * math.log1p(-delta))


def _gaussian_epsilon(mu: float, delta: float) -> float:
    # Balle & Wang (2018), Theorem 8: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)
    def gap(e):
        return (stats.norm.cdf(-e / mu + mu / 2)
                - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta)

    return 0.0 if gap(0.0) <= 0 else optimize.brentq(gap, 0.0, 200.0, xtol=1e-12)


def _bound_of(ins, outs, delta, method, confidence) -> float:
    """The public function's bound (a one-run draw with every canary on one side is an
    outcome it accepts, as one_run_audit does); the harness's bound must be the same."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no outcome can refute": tiny m is the point
        public = epsilon_lower_bound(ins, outs, delta=delta, method=method,
                                     confidence=confidence)
    assert public == _bound(ins, outs, delta, method, confidence)
    return public


def _allowed(trials: int, rate: float) -> int:
    """Most exceedances in ``trials`` of a method whose exceedance rate is ``rate``, but
    for a 0.1% binomial tail."""
    return int(stats.binom.isf(0.001, trials, rate))


def test_closed_forms_used_here():
    # the reference curves themselves, against their definitions: RR's and Laplace's
    # delta at the epsilon given back, and Balle-Wang at mu=1 (eps 0 gives 2 Phi(1/2) - 1)
    p = 1 / (1 + math.exp(-2.0))
    e = _rr_epsilon(2.0, 0.01)
    assert p - math.exp(e) * (1 - p) == pytest.approx(0.01)
    assert 1 - math.exp((_laplace_epsilon(2.0, 0.1) - 2.0) / 2) == pytest.approx(0.1)
    assert _gaussian_epsilon(1.0, 2 * stats.norm.cdf(0.5) - 1) == pytest.approx(0, abs=1e-9)
    assert _gaussian_epsilon(1.0, 1e-5) == pytest.approx(4.3773, abs=1e-3)


@pytest.mark.parametrize("m", [2, 3, 6, 10])
@pytest.mark.parametrize("delta", [0.0, 1e-3, 0.05])
def test_one_run_exact_exceedance_on_randomized_response(m, delta):
    # exact: sum over the multinomial counts (in & 1, in & 0, out & 1, out & 0) of the
    # probability of the counts where the bound exceeds RR's epsilon(delta). Ties are
    # the whole score distribution here (two values). Measured: at most 0.32 alpha.
    comps = np.array([(a, b, c, m - a - b - c) for a in range(m + 1)
                      for b in range(m + 1 - a) for c in range(m + 1 - a - b)])
    for confidence in (0.5, 0.9):
        bounds = np.array([_bound_of(np.r_[np.ones(a), np.zeros(b)],
                                     np.r_[np.ones(c), np.zeros(d)], delta, "one_run",
                                     confidence) for a, b, c, d in comps])
        for e0 in (0.25, 1.0, 3.0):
            p = 1 / (1 + math.exp(-e0))
            prob = stats.multinomial.pmf(comps, m, [p / 2, (1 - p) / 2, (1 - p) / 2, p / 2])
            rate = prob[bounds > _rr_epsilon(e0, delta)].sum()
            assert rate <= 1 - confidence, (m, delta, confidence, e0, rate)


@pytest.mark.parametrize("m,trials", [
    (1_000, 100), pytest.param(10_000, 40, marks=pytest.mark.slow)])
def test_one_run_on_laplace_noise(m, trials):
    # the tails of Laplace noise have likelihood ratio exactly e^e0: the top guesses are
    # right with probability e^e0 / (1 + e^e0), the largest the claim allows (measured:
    # 20% of bounds above the truth at 50% confidence, 4.5% at 90%)
    rng = np.random.default_rng(m)
    e0 = 2.0
    for delta, confidence in ((0.0, 0.5), (1e-6, 0.5), (1e-3, 0.9)):
        truth = _laplace_epsilon(e0, delta)
        over = 0
        for _ in range(trials):
            lab = rng.random(m) < 0.5
            s = lab + rng.laplace(scale=1 / e0, size=m)
            over += _bound_of(s[lab], s[~lab], delta, "one_run", confidence) > truth
        assert over <= _allowed(trials, 1 - confidence), (delta, confidence, over)


def _rank_pattern_law(mu: float, m: int, draws: int, rng) -> np.ndarray:
    """Probabilities (sampled) of the 2^m label sequences in decreasing score order of the
    one-run game on N(mu * inclusion, 1) scores; pattern bit i = label of rank i."""
    lab = rng.random((draws, m)) < 0.5
    s = rng.normal(size=(draws, m)) + mu * lab
    ranked = np.take_along_axis(lab, np.argsort(-s, axis=1), axis=1)
    return np.bincount(ranked @ (1 << np.arange(m)), minlength=2 ** m) / draws


@pytest.mark.parametrize("method", ["one_run", "one_run_fdp"])
def test_one_run_exceedance_on_the_gaussian_mechanism_with_few_canaries(method):
    # one_run_fdp's hypothesis is the Gaussian curve: a few canaries are where its
    # recursive bound claims the most from the least (8.1 from 4 canaries at 50%).
    # Measured: at most 0.68 alpha (mu 0.1, 4 canaries, 50%)
    m, draws = 4, 200_000
    rng = np.random.default_rng(17)
    patterns = [np.array([(c >> i) & 1 for i in range(m)], bool) for c in range(2 ** m)]
    rank = -np.arange(m, dtype=float)  # scores that reproduce the pattern's order
    for mu in (0.1, 0.5, 1.5):
        law = _rank_pattern_law(mu, m, draws, rng)
        for delta in (1e-6, 0.05):
            truth = _gaussian_epsilon(mu, delta)
            for confidence in (0.5, 0.8):
                bounds = np.array([_bound_of(rank[p], rank[~p], delta, method, confidence)
                                   for p in patterns])
                rate = law[bounds > truth].sum()
                alpha = 1 - confidence
                assert rate <= alpha + 4 * math.sqrt(alpha * (1 - alpha) / draws), (
                    mu, delta, confidence, rate)


def test_a_perfect_attack_reaches_the_closed_form_of_steinke_et_al():
    # Steinke, Nasr & Jagielski (2023), Theorem 3.1 at delta = 0 with every one of r
    # guesses right: P[Bin(r, e^eps/(1+e^eps)) >= r] = (e^eps/(1+e^eps))^r, so one test at
    # level beta refutes exactly eps < logit(beta^(1/r)). The bound of m perfectly
    # separated canaries tests r = m at a Bonferroni level between beta / (log2(m) + 2)
    # (the most counts it can test) and beta (one): it must lie between the two values.
    def logit_root(level, r):
        q = level ** (1.0 / r)
        return math.log(q / (1 - q))

    for m in (10, 100, 1_000, 100_000):
        s = np.r_[np.ones(m // 2), np.zeros(m - m // 2)]
        for confidence in (0.5, 0.95):
            beta = 1 - confidence
            b = epsilon_lower_bound(s[: m // 2], s[m // 2:], delta=0.0, method="one_run",
                                    confidence=confidence)
            lo = logit_root(beta / (math.log2(m) + 2), m)
            hi = logit_root(beta, m)
            assert lo - 1e-5 <= b <= hi + 1e-9, (m, confidence, lo, b, hi)
    # the table of this closed form at 95%: 100 canaries certify at most 3.49, 1,000 at
    # most 5.81 (with Bonferroni over the counts, a little less)
    assert logit_root(0.05, 100) == pytest.approx(3.49, abs=0.01)
    assert logit_root(0.05, 1000) == pytest.approx(5.81, abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("method,mu,delta", [("gdp", 1.0, 1e-5), ("gdp", 3.0, 0.2),
                                             ("clopper_pearson", 1.0, 1e-5)])
def test_independent_trials_on_the_gaussian_mechanism(method, mu, delta):
    # independent trials: each score from its own run of N(mu * inclusion, 1); truth from
    # Balle & Wang. Measured: 8% of gdp bounds above it at 50% confidence (its 50% bound
    # is a 75% bound, see the module docstring)
    rng = np.random.default_rng(int(mu * 10))
    truth = _gaussian_epsilon(mu, delta)
    trials, confidence = 120, 0.5
    over = 0
    for _ in range(trials):
        lab = rng.random(200) < 0.5
        s = rng.normal(size=200) + mu * lab
        over += epsilon_lower_bound(s[lab], s[~lab], delta=delta, method=method,
                                    confidence=confidence) > truth
    assert over <= _allowed(trials, 1 - confidence)


@pytest.mark.slow
def test_clopper_pearson_exact_exceedance_on_randomized_response():
    # the independent-trials test on tied (two-valued) scores, exactly as above
    m = 8
    comps = np.array([(a, b, c, m - a - b - c) for a in range(m + 1)
                      for b in range(m + 1 - a) for c in range(m + 1 - a - b)])
    for confidence in (0.5, 0.9):
        bounds = np.array([0.0 if a + b == 0 or c + d == 0 else _bound_of(
            np.r_[np.ones(a), np.zeros(b)], np.r_[np.ones(c), np.zeros(d)], 0.0,
            "clopper_pearson", confidence) for a, b, c, d in comps])
        for e0 in (0.25, 1.0, 3.0):
            p = 1 / (1 + math.exp(-e0))
            prob = stats.multinomial.pmf(comps, m, [p / 2, (1 - p) / 2, (1 - p) / 2, p / 2])
            assert prob[bounds > e0].sum() <= 1 - confidence
