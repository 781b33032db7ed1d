"""The ranks' Poisson samplers, taken together, are Poisson sampling of the dataset.

Simulated in one process (W samplers with the ranks' seeds, as make_private builds
them): the parts partition the dataset (each example considered exactly once a step, by
one rank); over many steps every example is included at rate q (per-example counts
against Binomial(T, q) by a chi-square statistic), inclusions are independent (the
global batch size has the Binomial(N, q) variance N q (1 - q), which a fixed-size or
duplicated draw would not have) and the ranks draw independently (their batch sizes are
uncorrelated). A wrong scheme fails: every rank sampling the whole dataset doubles the
rate; the same seed on every rank with one shared sample correlates the ranks.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from privlearn.torch.distributed import (  # noqa: E402
    DistributedPoissonBatchSampler,
    rank_partition,
)

T = 400  # steps drawn per case


def _draws(n, q, world, seed):
    samplers = [DistributedPoissonBatchSampler(n, q, r, world, steps=T,
                                               seed=seed + 1_000_003 * r)
                for r in range(world)]
    per_rank = [list(iter(s)) for s in samplers]
    return per_rank


# The checks below are statistical: a correct sampler fails one of them by chance for
# about 1 seed in 10^5 (the chi-square bound alone, chi2(20) beyond 20 + 6 sqrt(40), is
# 1.5e-5). The examples, seeds included, are therefore fixed (derandomize) under every
# profile, so that a run cannot fail by chance.
@settings(max_examples=6, deadline=None, derandomize=True)
@given(n=st.integers(20, 200), world=st.integers(1, 4), q=st.floats(0.05, 0.6),
       seed=st.integers(0, 2**31))
def test_union_of_rank_samples_is_poisson_sampling(n, world, q, seed):
    parts = [set(rank_partition(n, r, world)) for r in range(world)]
    assert sum(len(p) for p in parts) == n and set().union(*parts) == set(range(n))
    per_rank = _draws(n, q, world, seed)
    counts = [0] * n
    sizes, rank_sizes = [], [[] for _ in range(world)]
    for t in range(T):
        batch = []
        for r in range(world):
            b = per_rank[r][t]
            assert set(b) <= parts[r]  # each rank draws from its own part only
            assert len(set(b)) == len(b)
            rank_sizes[r].append(len(b))
            batch += b
        sizes.append(len(batch))
        for i in batch:
            counts[i] += 1
    # every example at rate q: sum_i (c_i - T q)^2 / (T q (1 - q)) ~ chi2(n)
    chi2 = sum((c - T * q) ** 2 for c in counts) / (T * q * (1 - q))
    assert abs(chi2 - n) < 6 * math.sqrt(2 * n)
    # independent inclusions: the global size has mean q n and variance n q (1 - q)
    mean = sum(sizes) / T
    var = sum((s - mean) ** 2 for s in sizes) / (T - 1)
    assert abs(mean - q * n) < 5 * math.sqrt(n * q * (1 - q) / T)
    assert 0.65 < var / (n * q * (1 - q)) < 1.45  # relative s.e. sqrt(2 / T) ~ 0.06
    # the ranks draw independently: their batch sizes are uncorrelated
    if world > 1:
        a, b = rank_sizes[0], rank_sizes[1]
        ma, mb = sum(a) / T, sum(b) / T
        sa = math.sqrt(sum((x - ma) ** 2 for x in a) / T)
        sb = math.sqrt(sum((x - mb) ** 2 for x in b) / T)
        if sa > 0 and sb > 0:
            corr = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / (T * sa * sb)
            assert abs(corr) < 5 / math.sqrt(T)


def test_rank_partition_refuses_bad_ranks():
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank must be"):
            rank_partition(10, rank, world)


def test_rank_sampler_resumes_from_a_rank_poisson_sampler_state():
    from privlearn.torch.data import PoissonBatchSampler

    old = PoissonBatchSampler(50, 0.2, seed=9, indices=range(1, 50, 2))
    new = DistributedPoissonBatchSampler(50, 0.2, 1, 2, seed=123)
    new.load_state_dict(old.state_dict())
    a, b = list(iter(old)), list(iter(new))
    assert a == b and any(a)
    assert set().union(*map(set, a)) <= set(range(1, 50, 2))
