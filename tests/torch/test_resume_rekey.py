"""A run without a seed that resumes from a checkpoint draws fresh noise keys.

Two runs resumed from one checkpoint (a rollback: the same state loaded twice) must not
add the same noise at a step, or the difference of their models would cancel it and
reveal un-noised clipped gradient sums. Without a seed each resume's noise is independent
of the other's and has the same law (i.i.d. ``N(0, (sigma C)^2)``); with correlated noise
the recurrence continues from the noises really added before the checkpoint, so the
draws behind the resumed noise, ``z = C w``, are fresh i.i.d. standard normals. With a
seed the noise is replayed bit for bit (a seed is for reproducible experiments).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402
from privlearn.torch._rekey import fresh_noise_keys  # noqa: E402

D, K = 40, 50  # 2050 parameters: each step's noise is 2050 draws


class _Zero(nn.Module):
    """A model whose loss has zero gradient: p.grad is the noise alone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, K)

    def forward(self, x):
        return self.lin(x) * 0.0


def _run(steps, seed, state=None, **kw):
    """The noise (rows: steps, in units of ``sigma C``) of ``steps`` steps of a run at
    learning rate 0, resumed from ``state`` if given, and the run."""
    torch.manual_seed(0)
    x = torch.randn(24, D, generator=torch.Generator().manual_seed(0))
    model = _Zero()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, torch.zeros(24, dtype=torch.long)), batch_size=6),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        epochs=2,
        seed=seed,
        sampling="shuffled_epochs",
        resume=state,
        **kw,
    )
    out = []
    while len(out) < steps:
        for xb, yb in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(xb), yb).backward()
            p.optimizer.step()
            out.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).clone())
            if len(out) == steps:
                break
    return torch.stack(out).double().numpy() * p.expected_batch_size, p


def _checkpoint(steps, seed, **kw):
    noise, p = _run(steps, seed, **kw)
    return noise, copy.deepcopy(p.state_dict())


def _corr(a, b):
    return float(np.corrcoef(a.reshape(-1), b.reshape(-1))[0, 1])


def test_two_resumes_without_a_seed_add_independent_noise_of_the_same_law():
    _, state = _checkpoint(3, None)
    a, pa = _run(2, None, state)
    b, pb = _run(2, None, state)
    assert pa.accountant.steps == pb.accountant.steps == 5
    # the accounting is the uninterrupted run's (of another seed: epsilon is the law's)
    _, full = _run(5, 1)
    assert pa.epsilon(1e-5) == pb.epsilon(1e-5) == full.epsilon(1e-5)
    assert not np.any(a == b)  # a replayed noise would be equal at every coordinate
    assert abs(_corr(a, b)) < 0.08  # 4100 draws: the correlation's sd is 0.016
    for w in (a, b):  # N(0, 1) in units of sigma C: 4100 draws, sd's sd 1.1 %
        assert abs(w.std() - 1.0) < 0.06 and abs(w.mean()) < 0.06


def test_two_resumes_with_a_seed_replay_the_uninterrupted_noise():
    full, _ = _run(5, 7)
    _, state = _checkpoint(3, 7)
    a, _ = _run(2, 7, state)
    b, _ = _run(2, 7, state)
    np.testing.assert_array_equal(a, full[3:])
    np.testing.assert_array_equal(b, full[3:])


def test_a_correlated_resume_without_a_seed_continues_the_real_past_noise():
    """``w = C^{-1} z``: the resumed run's ``z`` (``C`` applied to the checkpoint's noises
    and the resumed ones) are fresh standard normals. Had the resume lost the past
    noises, both resumes' ``z`` would hold the same left-over past terms (correlated)."""
    kw = {"noise": "banded", "bands": 3}
    past, state = _checkpoint(3, None, **kw)
    a, p = _run(2, None, state, **kw)
    b, _ = _run(2, None, state, **kw)
    assert not np.any(a == b)
    C = p.plan.run.strategy.materialize(5)
    assert np.count_nonzero(C[3:, 1:3])  # the resumed steps' noise weighs past draws
    za, zb = ((C @ np.concatenate([past, w]))[3:] for w in (a, b))
    assert abs(_corr(za, zb)) < 0.08
    for z in (za, zb):
        assert abs(z.std() - 1.0) < 0.06 and abs(z.mean()) < 0.06


def test_fresh_noise_keys_changes_only_the_key_of_a_default_mode_state():
    state = {
        "format": "f",
        "secure_mode": False,
        "seed": 5,
        "generators": {"cpu": torch.zeros(3, dtype=torch.uint8)},
    }
    one, two = fresh_noise_keys(state), fresh_noise_keys(state)
    assert one["seed"] != two["seed"] and one["seed"] != 5
    assert 0 <= one["seed"] < 2**63 and one["generators"] == {}
    assert {k: v for k, v in one.items() if k not in ("seed", "generators")} == {
        "format": "f",
        "secure_mode": False,
    }
    assert state["seed"] == 5 and "cpu" in state["generators"]  # not changed in place
    secure = {"format": "f", "secure_mode": True, "replayable": False}
    for other in (secure, {"seed": "x"}, None):  # left for load_state_dict to refuse
        assert fresh_noise_keys(other) is other
