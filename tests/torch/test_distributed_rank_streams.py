"""make_private under torch.distributed (2 gloo processes) with DP samplers built by hand
on each rank and given as the loader's ``batch_sampler``.

* A :class:`DistributedPoissonBatchSampler` with the same ``seed=42`` on both ranks
  (which make_private keeps): the ranks' inclusion decisions are independent. Ground
  truth, naive: the indicators of example ``2k`` (rank 0's) and ``2k + 1`` (rank 1's)
  agree with probability ``q^2 + (1 - q)^2`` at each step, so over ``T`` steps and ``m``
  pairs the agreement count is Binomial(T m, that), checked within 5 standard
  deviations (the seed is fixed); one stream on both ranks would agree on every pair.
* A :class:`FixedSizeBatchSampler` with a seed of its own on each rank (the opposite
  misuse: its ranks must share one stream): make_private rebuilds it with one seed, so
  the ranks' batches stay disjoint, of ``B`` examples each.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
from _ranks import close_gloo, init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [one_worker(__name__), pytest.mark.slow]
WORLD = 2
N = 80
Q = 0.25
B = 10  # fixed-size: per rank
T = 200  # draws per rank


def _draws(rank: int, sampler) -> tuple[object, list]:
    from privlearn.torch import make_private

    g = torch.Generator().manual_seed(0)  # one dataset on both ranks
    ds = torch.utils.data.TensorDataset(
        torch.randn(N, 3, generator=g), torch.randint(0, 2, (N,), generator=g)
    )
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fixed-size sampler's seed is not kept)
        p = make_private(
            model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, sampling=sampler.law.name
        )
    bs = p.data_loader.batch_sampler
    draws: list = []
    while len(draws) < T:
        draws += list(iter(bs))  # the rebuilt sampler's draws, pass after pass
    p.detach()
    return bs.seed, draws[:T]


def _worker(rank: int, out_dir: str) -> None:
    from privlearn.torch.samplers import DistributedPoissonBatchSampler, FixedSizeBatchSampler

    init_gloo(rank, WORLD, out_dir)
    try:
        out = {
            "poisson": _draws(rank, DistributedPoissonBatchSampler(N, Q, rank, WORLD, seed=42)),
            "fixed": _draws(
                rank, FixedSizeBatchSampler(N, B, seed=100 + rank, rank=rank, world_size=WORLD)
            ),
        }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("rank_streams"), WORLD)


def test_ranks_given_one_seed_by_hand_include_examples_independently(ranks):
    (seed0, draws0), (seed1, draws1) = (r["poisson"] for r in ranks)
    assert seed0 == seed1 == 42  # the hand-built seed was kept
    m = N // WORLD
    agree = 0
    for b0, b1 in zip(draws0, draws1, strict=True):
        assert all(i % 2 == 0 for i in b0) and all(i % 2 == 1 for i in b1)
        in0, in1 = {i // 2 for i in b0}, {i // 2 for i in b1}
        agree += sum((k in in0) == (k in in1) for k in range(m))
    patterns = [[sorted(i // 2 for i in b) for b in d] for d in (draws0, draws1)]
    assert patterns[0] != patterns[1]  # not one Bernoulli pattern on both ranks
    p, trials = Q * Q + (1 - Q) * (1 - Q), T * m
    bound = 5 * math.sqrt(trials * p * (1 - p))
    assert abs(agree - trials * p) < bound, (agree / trials, p)


def test_fixed_size_ranks_given_their_own_seeds_draw_disjoint_batches(ranks):
    (_, draws0), (_, draws1) = (r["fixed"] for r in ranks)
    for b0, b1 in zip(draws0, draws1, strict=True):
        assert len(b0) == len(b1) == B and not set(b0) & set(b1)
