"""A correlated-noise run's epsilon covers the participation its loader actually produces.

For each cycled sampling and noise, the run's batches are recorded, and the ground truth
is computed from them alone, without privlearn's sensitivity rules: for every record its
steps in the batches drawn (and, under add/remove, every step pattern a new record could
have, one per bin or group), the largest ``||C u||`` over those patterns for the strategy
the noise was drawn with (``C`` dense, ``u`` the pattern's indicator: ``C >= 0`` here, so
equal contributions are the worst and this is the exact sensitivity of the observed run).
The run's epsilon must be at least the Gaussian mechanism's at that sensitivity (twice it
under replace-one, where a replaced record's contribution moves by up to ``2 C``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.accounting import Gaussian  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

N = 60
DELTA = 1e-5


def _indexed(n=N, d=4):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, torch.zeros(n, dtype=torch.long))


def _run(sampling, noise, extra, epochs, batch_size):
    model = nn.Linear(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a strategy adjusted to its cycle, or DP-SGD better
        p = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(_indexed(), batch_size=batch_size),
            noise_multiplier=1.5,
            epochs=epochs,
            sampling=sampling,
            noise=noise,
            seed=2,
            **extra,
        )
    steps = epochs * p.plan.steps_per_epoch
    batches = []
    while len(batches) < steps:
        for x, y in p.data_loader:
            batches.append(x[:, 0].long().numpy())
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if len(batches) == steps:
                break
    return p, batches


def _observed_patterns(batches, cycle, add_remove):
    """Each record's steps in ``batches``, and under add/remove the steps a new record
    would have in each bin or group (all of its group's steps: the most it can take)."""
    steps = len(batches)
    pats = {}
    for t, b in enumerate(batches):
        for i in b:
            pats.setdefault(int(i), []).append(t)
    out = list(pats.values())
    if add_remove:
        out += [list(range(j, steps, cycle)) for j in range(cycle)]
    return out


@pytest.mark.parametrize(
    "sampling,extra",
    [
        ("balls_in_bins", {}),
        ("shuffled_epochs", {}),
        # every member of the step's group (rate 1: nothing to amplify)
        ("cyclic_poisson", {"cycle_length": 5, "batch_size": 12}),
    ],
)
@pytest.mark.parametrize("noise,size", [("banded", {"bands": 10}), ("blt", {"buffers": 2})])
def test_epsilon_covers_the_participation_of_the_batches_drawn(sampling, extra, noise, size):
    extra = dict(extra)
    batch_size = extra.pop("batch_size", 6)
    p, batches = _run(sampling, noise, {**extra, **size}, epochs=3, batch_size=batch_size)
    assert p.sampling_rate == 1.0 or sampling != "cyclic_poisson"
    strategy = p.plan.run.strategy
    steps = len(batches)
    C = strategy.materialize(steps)
    assert np.all(C >= 0)  # equal contributions are the worst: the truth is ||C u||
    add_remove = p.plan.run.law.add_remove
    cycle = p.plan.run.cycle
    sens = max(
        float(np.linalg.norm(C[:, pat].sum(axis=1)))
        for pat in _observed_patterns(batches, cycle, add_remove)
    )
    if not add_remove:
        sens *= 2.0  # replace-one: one record's contribution moves by up to 2 C
    truth = Gaussian(1.5 / sens).epsilon(DELTA)
    assert p.epsilon(DELTA) >= truth * (1 - 1e-9)
    # the noise the optimizer draws is that strategy's: its recurrence is C's
    rec = p.optimizer.correlated.recurrence
    assert rec == strategy.recurrence()
