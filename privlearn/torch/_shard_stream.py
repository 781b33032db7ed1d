"""Each shard of a Poisson sample draws from its own stream, whatever seed it was given.

A distributed Poisson sample is the union of the ranks' shards (rank ``r`` considers
the indices ``r, r + W, ...``), and it is a Poisson sample of the dataset only when
the shards' inclusion decisions are independent (Abadi et al. 2016, Sec. 3.1: the
subsampled Gaussian accountant assumes every example is included independently with
probability ``q``). A sampler's draws come from its key chain, which comes from its
seed: ranks built with one seed (``seed=42`` on every rank) would run the same chain
and draw the same Bernoulli pattern over their shards, so that example ``r + kW`` is
in the batch exactly when ``r' + kW`` is -- inclusions perfectly correlated across the
ranks, and the accountant's epsilon optimistic (close to that of groups of ``W``
examples). The seed of each draw is therefore derived from the key chain's seed *and*
the shard (its smallest index, which disjoint shards never share, and which is the
rank for :func:`~privlearn.torch.samplers.rank_partition`'s shards), as NumPy derives
independent child streams from one entropy: ``SeedSequence(seed, spawn_key=(shard,))``
(O'Neill's hashing of the spawn key into the state; NumPy's "Parallel random number
generation"). The chain itself, and so a saved state, is unchanged: a state loaded on
every rank (one rank's checkpoint) still draws independent shards.
"""

from __future__ import annotations

import numpy as np


def shard_seed(seed: int, shard: int | None) -> int:
    """The 63-bit seed of one draw of shard ``shard`` (its smallest index; None: the
    whole dataset, ``seed`` itself) from the key chain's ``seed`` (module docstring)."""
    if shard is None:
        return seed
    state = np.random.SeedSequence(seed, spawn_key=(int(shard),)).generate_state(1, np.uint64)
    return int(state[0]) >> 1
