"""Ranks' Poisson samplers built by hand with one seed draw independent shards.

A distributed Poisson sample is a Poisson sample of the dataset only when the ranks'
inclusion decisions are independent. Ground truth, naive: example ``r + kW`` (rank
``r``'s k-th) and example ``r' + kW`` (rank ``r'``'s) are each included with probability
``q``, independently, so their indicators agree with probability ``q^2 + (1 - q)^2``;
over ``T`` steps and ``m`` pairs the agreement count is Binomial(T m, that), checked
within 5 standard deviations (a correct sampler fails about 1 run in 10^6; the seeds are
fixed). Ranks running one stream agree on every pair (rate 1). Checked for W = 2..4
ranks given one seed, given make_private's per-rank seeds, and given one rank's saved
state (a checkpoint of rank 0 loaded on every rank).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

pytest.importorskip("torch")
from privlearn.torch.samplers import (  # noqa: E402
    DistributedPoissonBatchSampler,
    PoissonBatchSampler,
)

T = 300  # steps drawn per case


def _indicators(samplers, n: int, steps: int) -> np.ndarray:
    """``(steps, n)`` inclusion indicators of the union of the samplers' batches."""
    out = np.zeros((steps, n), dtype=bool)
    t = 0
    its = [iter(s) for s in samplers]
    while t < steps:
        try:
            batches = [next(it) for it in its]
        except StopIteration:  # an epoch ended on every rank: the next pass
            its = [iter(s) for s in samplers]
            continue
        for b in batches:
            assert not out[t, b].any()  # the ranks' batches are disjoint
            out[t, b] = True
        t += 1
    return out


def _check_independent(ind: np.ndarray, world: int, q: float) -> None:
    steps, n = ind.shape
    m = n // world  # the pairs (r + kW, r' + kW), k < m, exist on every rank
    p = q * q + (1 - q) * (1 - q)
    pats = [ind[:, r : m * world : world] for r in range(world)]  # (steps, m) per rank
    for r, s in itertools.combinations(range(world), 2):
        assert not np.array_equal(pats[r], pats[s]), (r, s)
        agree = int((pats[r] == pats[s]).sum())
        trials = steps * m
        bound = 5 * math.sqrt(trials * p * (1 - p))
        assert abs(agree - trials * p) < bound, f"ranks {r}, {s}: {agree / trials} vs {p}"
    # every example at rate q (the union is not thinned or doubled)
    rate = ind.mean()
    assert abs(rate - q) < 5 * math.sqrt(q * (1 - q) / ind.size)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("q", [0.1, 0.5])
@pytest.mark.parametrize("seeds", ["one", "make_private"])
def test_ranks_given_one_seed_include_examples_independently(world, q, seeds):
    n = 40 * world + 1  # rank 0's part one longer than the others
    seed = 42
    samplers = [
        DistributedPoissonBatchSampler(
            n, q, r, world, steps=T, seed=seed if seeds == "one" else seed + 1_000_003 * r
        )
        for r in range(world)
    ]
    _check_independent(_indicators(samplers, n, T), world, q)


def test_one_ranks_state_loaded_on_every_rank_still_draws_independent_ranks():
    world, n, q = 3, 120, 0.3
    saved = DistributedPoissonBatchSampler(n, q, 0, world, steps=T, seed=7).state_dict()
    samplers = []
    for r in range(world):
        s = DistributedPoissonBatchSampler(n, q, r, world, steps=T, seed=1000 + r)
        s.load_state_dict(saved)
        samplers.append(s)
    _check_independent(_indicators(samplers, n, T), world, q)


def test_shards_given_by_indices_with_one_seed_are_independent():
    world, n, q = 2, 100, 0.4
    halves = [range(0, 50), range(50, 100)]  # contiguous shards, one seed
    samplers = [PoissonBatchSampler(n, q, steps=T, seed=5, indices=h) for h in halves]
    ind = _indicators(samplers, n, T)
    # pair example k of the first half with example 50 + k of the second
    _check_independent(np.stack([ind[:, :50], ind[:, 50:]], axis=2).reshape(T, n), world, q)


def test_the_whole_dataset_sampler_draws_as_before():
    """The stream of an unsharded sampler (one process) is its key chain's, unchanged:
    its first draw is the law's draw from the chain's first seed."""
    import hashlib

    from privlearn.correlated.sampling import poisson_subset

    key = hashlib.sha256(
        b"privlearn.sampler.seed" + (11).to_bytes(16, "little", signed=True)
    ).digest()
    first = poisson_subset(
        60, 0.3, np.random.default_rng(int.from_bytes(key[:8], "little") >> 1)
    ).tolist()
    assert next(iter(PoissonBatchSampler(60, 0.3, seed=11))) == first
    assert next(iter(DistributedPoissonBatchSampler(60, 0.3, 0, 1, seed=11))) == first


def test_a_rank_resumed_from_its_state_continues_its_batches():
    import torch

    from privlearn.torch.data import make_dp_loader

    ds = torch.utils.data.TensorDataset(torch.arange(90))

    def loader():
        return make_dp_loader(
            torch.utils.data.DataLoader(ds, batch_size=10),
            sampling="poisson",
            sampling_rate=0.3,
            batch_size=10,
            steps=8,
            seed=42,
            rank=1,
            world_size=3,
        )

    run, resumed = loader(), loader()
    batches = []
    for (x,) in run:
        run.batch_sampler.consume(run.batch_sampler.take())
        batches.append(x.tolist())
        if len(batches) == 2:
            state = run.batch_sampler.state_dict()
    resumed.batch_sampler.load_state_dict(state)
    assert [x.tolist() for (x,) in resumed] == batches[2:]
    assert all(i % 3 == 1 for b in batches for i in b) and len(batches) > 2
