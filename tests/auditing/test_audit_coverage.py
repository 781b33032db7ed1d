"""Coverage and power of the audits, measured against closed forms and naive code.

* Coverage: on mechanisms whose ``epsilon(delta)`` is known in closed form (Laplace noise
  on the inclusion bit, ``epsilon(delta) = e0 + 2 log(1 - delta)``; the Gaussian mechanism,
  Balle & Wang 2018, Theorem 8), a bound at confidence ``c`` may exceed the true epsilon in
  at most a ``1 - c`` fraction of repeated audits (checked with a binomial allowance), and
  should not be far below it where the audit can be tight.
* The independent-trials bound never exceeds the plug-in estimate of Kairouz, Oh &
  Viswanath (2015), ``max(log((1 - delta - FNR) / FPR), log((1 - delta - FPR) / FNR))``,
  at the empirical rates of any threshold (a confidence bound sits below its estimate).
* Power: noise reused at every DP-SGD step is caught by ``score="increments"``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import optimize, stats

from privlearn.auditing import epsilon_lower_bound
from privlearn.errors import ConfigurationError

CONFIDENCE = 0.95


def _gaussian_epsilon(mu: float, delta: float) -> float:
    # Balle & Wang (2018), Theorem 8: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)
    def gap(e):
        return (
            stats.norm.cdf(-e / mu + mu / 2)
            - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)
            - delta
        )

    return optimize.brentq(gap, 0.0, 200.0, xtol=1e-12)


def _allowed(trials: int, rate: float) -> int:
    """Exceedances a method of exceedance rate ``rate`` stays under with probability 0.999."""
    return int(stats.binom.ppf(0.999, trials, rate))


def _bound(ins, outs, delta, method) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return epsilon_lower_bound(ins, outs, delta=delta, method=method, confidence=CONFIDENCE)


def _one_run_draw(rng, m: int, score):
    lab = rng.random(m) < 0.5
    s = score(lab)
    return s[lab], s[~lab]


@pytest.mark.parametrize("e0, delta", [(1.0, 0.0), (1.0, 1e-5), (0.5, 0.0)])
def test_one_run_coverage_on_laplace_noise(e0, delta):
    """200 one-run audits of Laplace noise (scale 1/e0) on the inclusion bit, the case in
    which the top guesses are as accurate as the claim allows: measured 3.5% (e0 = 1) and
    4.5% (e0 = 0.5) above the truth at 95%, mean bound 0.84 e0 and 0.82 e0."""
    rng = np.random.default_rng(11)
    m, trials = (2000, 200) if e0 == 1.0 else (5000, 200)
    truth = e0 + 2.0 * math.log1p(-delta)
    b = np.array(
        [
            _bound(
                *_one_run_draw(
                    rng, m, lambda lab: lab + rng.laplace(scale=1.0 / e0, size=lab.size)
                ),
                delta,
                "one_run",
            )
            for _ in range(trials)
        ]
    )
    assert (b > truth).sum() <= _allowed(trials, 1.0 - CONFIDENCE), (b > truth).sum()
    assert b.mean() > 0.7 * truth  # tight: the audit is not vacuous here


def _kairouz_plug_in(ins, outs, delta) -> float:
    """The largest closed-form epsilon over every threshold ``score > t`` and ``score < t``
    at the empirical rates (naive: one threshold per distinct score)."""
    best = 0.0
    for t in np.unique(np.concatenate([ins, outs, [-np.inf]])):
        for tpr, fpr in (
            (np.mean(ins > t), np.mean(outs > t)),
            (np.mean(outs < t), np.mean(ins < t)),
        ):
            fnr = 1.0 - tpr
            for num, den in ((1.0 - delta - fnr, fpr), (1.0 - delta - fpr, fnr)):
                if num > 0:
                    best = max(best, math.inf if den == 0 else math.log(num / den))
    return best


@pytest.mark.parametrize("levels", [2, 4])
def test_independent_trials_bound_is_below_the_plug_in_estimates(levels):
    """Discrete scores (a rate of 0 at a threshold makes the estimates infinite, which
    continuous scores give at their extreme thresholds): randomized response's bits, and
    a Gaussian score rounded to four levels."""
    rng = np.random.default_rng(5)
    finite = {"clopper_pearson": 0, "gdp": 0}
    for _ in range(20):
        n_in, n_out = rng.integers(20, 300, size=2)
        lab = np.r_[np.ones(n_in, bool), np.zeros(n_out, bool)]
        if levels == 2:
            p = 1.0 / (1.0 + math.exp(-rng.uniform(0.0, 4.0)))
            s = (rng.random(lab.size) < np.where(lab, p, 1.0 - p)).astype(float)
        else:
            s = np.clip(np.round(rng.uniform(0.0, 2.0) * lab + rng.normal(size=lab.size)), -1, 2)
        ins, outs = s[lab], s[~lab]
        delta = float(rng.choice([0.0, 1e-5, 1e-2]))
        plug_in = _kairouz_plug_in(ins, outs, delta)
        finite["clopper_pearson"] += bool(np.isfinite(plug_in))
        assert _bound(ins, outs, delta, "clopper_pearson") <= plug_in + 1e-9
        if delta > 0:  # the GDP estimate Phi^-1(TNR) - Phi^-1(FNR) at the empirical rates
            t = np.unique(s)
            tnr = np.r_[np.mean(outs[:, None] <= t, 0), np.mean(outs[:, None] < t, 0)]
            fnr = np.r_[np.mean(ins[:, None] <= t, 0), np.mean(ins[:, None] < t, 0)]
            with np.errstate(invalid="ignore"):  # inf - inf: a threshold beyond every score
                mu_hat = np.nanmax(stats.norm.ppf(tnr) - stats.norm.ppf(fnr))
            if np.isfinite(mu_hat):
                finite["gdp"] += 1
                plug_in = _gaussian_epsilon(mu_hat, delta) if mu_hat > 0 else 0.0
                assert _bound(ins, outs, delta, "gdp") <= plug_in + 1e-6
    assert min(finite.values()) >= 5, finite  # the comparisons did run


@pytest.mark.slow
def test_independent_trials_coverage():
    """200 audits each: Laplace noise (delta = 0, ``"clopper_pearson"``) and the Gaussian
    mechanism (mu = 1, delta = 1e-2, ``"gdp"``, which spends half of ``1 - confidence``):
    measured 2 and 4 of 200 above the truth."""
    rng = np.random.default_rng(3)
    n, trials = 300, 200
    cp = np.array(
        [
            _bound(1.0 + rng.laplace(size=n), rng.laplace(size=n), 0.0, "clopper_pearson")
            for _ in range(trials)
        ]
    )
    assert (cp > 1.0).sum() <= _allowed(trials, 1.0 - CONFIDENCE)
    truth = _gaussian_epsilon(1.0, 1e-2)
    g = np.array(
        [_bound(1.0 + rng.normal(size=n), rng.normal(size=n), 1e-2, "gdp") for _ in range(trials)]
    )
    assert (g > truth).sum() <= _allowed(trials, (1.0 - CONFIDENCE) / 2)
    assert g.mean() > 0.6 * truth


@pytest.mark.slow
def test_one_run_fdp_coverage_on_the_gaussian_mechanism():
    rng = np.random.default_rng(4)
    truth = _gaussian_epsilon(0.5, 1e-5)
    b = np.array(
        [
            _bound(
                *_one_run_draw(rng, 1000, lambda lab: 0.5 * lab + rng.normal(size=lab.size)),
                1e-5,
                "one_run_fdp",
            )
            for _ in range(200)
        ]
    )
    assert (b > truth).sum() <= _allowed(200, 1.0 - CONFIDENCE)


# ---------------------------------------------------------------------------- planted bugs
def test_increment_scores_match_the_naive_sum_and_the_running_scores():
    pytest.importorskip("torch")
    from privlearn.auditing.torch import _RunningScores, increment_scores

    rng = np.random.default_rng(0)
    snaps = rng.normal(size=(9, 7))
    common = dict(learning_rate=0.3, max_grad_norm=1.5, expected_batch_size=20.0)
    scale = 20.0 / (0.3 * 1.5)
    naive = np.zeros(7)
    for t in range(2, 9):
        x_now = -(snaps[t] - snaps[t - 1]) * scale
        x_before = -(snaps[t - 1] - snaps[t - 2]) * scale
        naive += (x_now - x_before) ** 2
    np.testing.assert_allclose(increment_scores(snaps, **common), naive, rtol=1e-12)
    run = _RunningScores(snaps[0], "increments", noise_multiplier=1.0, sampling_rate=0.1, **common)
    for row in snaps[1:]:
        run.update(row)
    np.testing.assert_array_equal(run.scores(), increment_scores(snaps, **common))


def test_noise_reused_is_caught_by_increments_and_missed_by_the_likelihood_ratio():
    """The same noise draw at every step keeps each step's law, so the per-step likelihood
    ratio sees nothing (measured bound 0 at seeds 0-2); its cancellation in the changes of
    the movements separates the canaries (4.1-4.5 against the claim 2 at seeds 0-2)."""
    pytest.importorskip("torch")
    from privlearn.auditing.torch import audit_dpsgd

    kw = dict(epsilon=2.0, delta=1e-5, n_canaries=1000, bug="noise-reused", seed=1)
    caught = audit_dpsgd(score="increments", **kw).result
    assert caught.violation and caught.epsilon_lower_bound > 1.5 * 2.0
    missed = audit_dpsgd(score="trajectory", **kw).result
    assert not missed.violation
    honest = audit_dpsgd(
        epsilon=2.0, delta=1e-5, n_canaries=1000, seed=1, score="increments"
    ).result
    assert not honest.violation


def test_noise_reused_draws_the_same_noise_each_step_and_is_undone():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.auditing._planted import planted_bug
    from privlearn.torch import make_private

    model = torch.nn.Linear(3, 1)
    ds = TensorDataset(torch.randn(100, 3), torch.randn(100, 1))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=10),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    src = p.optimizer.noise

    def two_steps():
        out = []
        for _ in range(2):
            out.append(src.fill_normal_(torch.empty(5), 1.0).clone())
            src.advance()
        return out

    with planted_bug("noise-reused", p):
        a, b = two_steps()
        assert torch.equal(a, b)
    assert "advance" not in vars(src)
    a, b = two_steps()
    assert not torch.equal(a, b)


def test_audit_training_takes_the_increments_score(monkeypatch):
    torch = pytest.importorskip("torch")
    from privlearn.auditing.torch import DiracCanaries, audit_training, increment_scores

    snaps = []
    coordinates = DiracCanaries.coordinates

    def record(self):
        out = coordinates(self)
        snaps.append(out.copy())
        return out

    monkeypatch.setattr(DiracCanaries, "coordinates", record)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    common = dict(
        make_model=lambda: torch.nn.Linear(5, 2),
        batch_size=20,
        epochs=1,
        private={"noise_multiplier": 0.8, "max_grad_norm": 1.0},
        canaries="gradient",
        n_canaries=40,
        score="increments",
        claimed_epsilon=1.0,
        seed=1,
        show_progress=False,
    )
    r = audit_training((X, y), make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.4), **common)
    assert len(snaps) > 3
    expected_batch = 20.0  # q N of the run: batch_size records a step
    np.testing.assert_allclose(
        r.scores,
        increment_scores(
            np.array(snaps),
            learning_rate=0.4,
            max_grad_norm=1.0,
            expected_batch_size=expected_batch,
        ),
        rtol=1e-9,
    )
    with pytest.raises(ConfigurationError, match="score='increments' reads the per-step"):
        audit_training(
            (X, y),
            make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.4, momentum=0.9),
            **common,
        )
