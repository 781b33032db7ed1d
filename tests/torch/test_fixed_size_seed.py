"""A distributed fixed-size sampler draws one global sample from one generator shared by
the ranks: built by hand with ``seed=None`` each rank would seed from its own OS entropy,
the ranks' batches would overlap and one example could be in a global batch twice (twice
the sensitivity accounted). It is refused at construction; one process, a shared seed and
the sampler make_private builds (its shared seed) keep working."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch.samplers import FixedSizeBatchSampler, dp_batch_sampler  # noqa: E402

N, B, WORLD = 40, 4, 2


@pytest.mark.parametrize("rank", range(WORLD))
def test_seed_none_on_a_distributed_rank_is_refused_naming_seed(rank):
    with pytest.raises(ConfigurationError) as err:
        FixedSizeBatchSampler(N, B, rank=rank, world_size=WORLD)
    assert isinstance(err.value, ValueError)
    msg = str(err.value)
    assert "seed" in msg and f"world_size={WORLD}" in msg and "seed=None" in msg
    assert "same integer seed" in msg and "make_private" in msg


def test_secure_distributed_is_still_refused_as_secure():
    with pytest.raises(ConfigurationError, match="secure=True with world_size=2"):
        FixedSizeBatchSampler(N, B, rank=0, world_size=WORLD, secure=True)


def test_one_process_without_a_seed_still_draws():
    s = FixedSizeBatchSampler(N, B, steps=3)
    assert [len(b) for b in s] == [B] * 3


def _disjoint(ranks: list) -> None:
    for batches in zip(*(list(s) for s in ranks), strict=True):
        union = [i for b in batches for i in b]
        assert all(len(b) == B for b in batches) and len(set(union)) == WORLD * B


def test_one_shared_seed_draws_disjoint_rank_batches():
    _disjoint(
        [
            FixedSizeBatchSampler(N, B, steps=20, seed=5, rank=r, world_size=WORLD)
            for r in range(WORLD)
        ]
    )


def test_the_sampler_make_private_builds_uses_its_shared_seed():
    """make_private passes each rank its own derived seed (for the noise) and one shared
    seed for the fixed-size sampler (its own seed=, or one broadcast from rank 0)."""
    ranks = [
        dp_batch_sampler(
            "fixed",
            N,
            sampling_rate=WORLD * B / N,
            batch_size=B,
            steps=20,
            seed=None if r == 0 else 1_000_003 * r,
            rank=r,
            world_size=WORLD,
            shared_seed=123,
        )
        for r in range(WORLD)
    ]
    assert all(s.seed == 123 for s in ranks)
    _disjoint(ranks)
    with pytest.raises(ConfigurationError, match="seed must be an integer"):
        dp_batch_sampler(
            "fixed",
            N,
            sampling_rate=WORLD * B / N,
            batch_size=B,
            steps=20,
            seed=3,
            rank=0,
            world_size=WORLD,
            shared_seed=None,
        )
