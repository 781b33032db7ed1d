"""The audits' memory: the gradient canaries' scores are built as the run goes (the
scores of every step's canary coordinates, the same numbers), not from a trajectory of
``steps x n_canaries`` numbers kept to the end."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import privlearn.auditing.torch as audit_torch  # noqa: E402
import privlearn.torch as pl_torch  # noqa: E402
from privlearn.auditing.torch import (  # noqa: E402
    DiracCanaries,
    audit_dpsgd,
    audit_training,
    final_scores,
    trajectory_scores,
)


def _recording(monkeypatch):
    """Every canary coordinate vector the audit reads, and the engine it trained with."""
    seen = {"snaps": [], "p": None}
    coordinates, make_private = DiracCanaries.coordinates, pl_torch.make_private

    def record(self):
        out = coordinates(self)
        seen["snaps"].append(out.copy())
        return out

    def keep(*args, **kwargs):
        seen["p"] = make_private(*args, **kwargs)
        return seen["p"]

    monkeypatch.setattr(DiracCanaries, "coordinates", record)
    monkeypatch.setattr(pl_torch, "make_private", keep)
    return seen


def _batch_scores(seen, how, learning_rate, max_grad_norm):
    """The scores from the whole trajectory at once (the published formulas)."""
    p, snaps = seen["p"], np.stack(seen["snaps"])
    common = dict(learning_rate=learning_rate, max_grad_norm=max_grad_norm,
                  expected_batch_size=p.expected_batch_size)
    if how == "final":
        return final_scores(snaps[0], snaps[-1], **common)
    return trajectory_scores(snaps, noise_multiplier=p.noise_multiplier,
                             sampling_rate=p.sampling_rate, **common)


@pytest.mark.parametrize("how", ["trajectory", "final"])
def test_dpsgd_audit_scores_are_those_of_the_whole_trajectory(how, monkeypatch):
    seen = _recording(monkeypatch)
    r = audit_dpsgd(epsilon=2.0, delta=1e-5, n_canaries=50, steps=12, score=how, seed=3,
                    learning_rate=0.3, max_grad_norm=1.5, show_progress=False)
    assert len(seen["snaps"]) == 13  # the start and each step
    np.testing.assert_array_equal(r.result.scores, _batch_scores(seen, how, 0.3, 1.5))


@pytest.mark.parametrize("how", ["trajectory", "final"])
def test_gradient_canary_audit_scores_are_those_of_the_whole_trajectory(how, monkeypatch):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    seen = _recording(monkeypatch)
    r = audit_training((X, y), make_model=lambda: nn.Linear(5, 2),
                       make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.4), batch_size=20,
                       epochs=2, private={"noise_multiplier": 0.8, "max_grad_norm": 1.0},
                       canaries="gradient", n_canaries=40, score=how, claimed_epsilon=1.0,
                       seed=1, show_progress=False)
    assert len(seen["snaps"]) > 2
    np.testing.assert_array_equal(r.scores, _batch_scores(seen, how, 0.4, 1.0))


@pytest.mark.parametrize("how", ["trajectory", pytest.param("final", marks=pytest.mark.slow)])
def test_dpsgd_audit_memory_does_not_grow_with_the_steps(how, monkeypatch):
    """Measured from after the noise calibration (whose grids are the accountant's) to
    the end: every step's coordinates, kept, were 8 x (steps + 1) x n_canaries bytes and
    a few times that while scoring (about 9 times for the trajectory score)."""
    m, steps = 1000, 1000
    kw = dict(epsilon=2.0, delta=1e-5, n_canaries=m, steps=steps, score=how, seed=5,
              show_progress=False)
    audit_dpsgd(**kw)  # warm: the claim's accounting is cached, not measured
    calibrate = audit_torch._calibrated_sigma

    def then_reset(*args):
        sigma = calibrate(*args)
        tracemalloc.reset_peak()
        return sigma

    monkeypatch.setattr(audit_torch, "_calibrated_sigma", then_reset)
    tracemalloc.start()
    try:
        audit_dpsgd(**kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    trajectory = 8 * (steps + 1) * m
    assert peak < trajectory / 3, (peak, trajectory)


def _no_work(*args, **kwargs):
    raise AssertionError("calibrated, trained or fitted before the memory was checked")


def test_an_estimator_audit_too_large_for_memory_is_refused_before_any_work(monkeypatch):
    """One feature column per canary: 10**7 canaries on 100 rows is a dense matrix of
    5 x 10**6 by 10**7 float64 (400 TB), refused at once, not allocated."""
    import time

    import privlearn.auditing.models as audit_models
    from privlearn.auditing.models import audit_estimator
    from privlearn.errors import ParameterValueError
    from privlearn.models import SSPRegressor

    monkeypatch.setattr(audit_models, "one_run_audit", _no_work)
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(100, 3))
    start = time.perf_counter()
    with pytest.raises(ParameterValueError) as err:
        audit_estimator(SSPRegressor(epsilon=1.0, delta=1e-5), X, X[:, 0], 10**7, seed=0)
    assert time.perf_counter() - start < 1.0
    msg = str(err.value)
    needed = 8 * (100 + 5 * 10**6) * (3 + 10**7)
    assert "n_canaries=10,000,000" in msg and f"{needed:,} bytes" in msg
    assert "fewer canaries" in msg


def test_a_dpsgd_audit_too_large_for_memory_is_refused_before_any_work(monkeypatch):
    """From the API and from the shell (status 2, one line naming --canaries), against
    the memory available (here set to 100 MB: 10**7 canaries need more than 800 MB)."""
    from click.testing import CliRunner

    import privlearn.auditing.harness as harness
    from privlearn.cli import cli
    from privlearn.errors import ParameterValueError

    monkeypatch.setattr(harness, "_available_memory", lambda: 10**8)
    monkeypatch.setattr(audit_torch, "_calibrated_sigma", _no_work)
    monkeypatch.setattr(audit_torch, "one_run_audit", _no_work)
    with pytest.raises(ParameterValueError, match=r"n_canaries=10,000,000 \(--canaries.*"
                       r"needs at least [\d,]+ bytes .*100,000,000 bytes .* are available"):
        audit_dpsgd(epsilon=1.0, delta=1e-5, n_canaries=10**7, steps=10_000)
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "1", "--delta", "1e-5",
                                 "--canaries", str(10**7), "--steps", "10000"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and "--canaries" in r.stderr
    assert "fewer canaries" in r.stderr and r.stderr.count("\n") == 1
