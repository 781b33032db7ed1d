"""make_private under torch.distributed (2 gloo processes), each rank's loader given a
:class:`DistributedPoissonBatchSampler` built by hand with the same ``seed=42`` (which
make_private keeps): the ranks' inclusion decisions are independent. Ground truth,
naive: the indicators of example ``2k`` (rank 0's) and ``2k + 1`` (rank 1's) agree with
probability ``q^2 + (1 - q)^2`` at each step, so over ``T`` steps and ``m`` pairs the
agreement count is Binomial(T m, that), checked within 5 standard deviations (the seed
is fixed); one stream on both ranks would agree on every pair."""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")
from _ranks import close_gloo, init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker(__name__)
WORLD = 2
N = 80
Q = 0.25
T = 200  # draws per rank


def _worker(rank: int, out_dir: str) -> None:
    from privlearn.torch import make_private
    from privlearn.torch.samplers import DistributedPoissonBatchSampler

    init_gloo(rank, WORLD, out_dir)
    try:
        g = torch.Generator().manual_seed(0)  # one dataset on both ranks
        ds = torch.utils.data.TensorDataset(
            torch.randn(N, 3, generator=g), torch.randint(0, 2, (N,), generator=g)
        )
        sampler = DistributedPoissonBatchSampler(N, Q, rank, WORLD, seed=42)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0)
        bs = p.data_loader.batch_sampler
        draws: list = []
        while len(draws) < T:
            draws += list(iter(bs))  # the rebuilt sampler's draws, pass after pass
        p.detach()
        torch.save({"seed": bs.seed, "draws": draws[:T]}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.mark.slow
def test_ranks_given_one_seed_by_hand_include_examples_independently(tmp_path):
    ranks = run_ranks(_worker, tmp_path, WORLD)
    assert [r["seed"] for r in ranks] == [42, 42]  # the hand-built seed was kept
    m = N // WORLD
    agree = 0
    for b0, b1 in zip(ranks[0]["draws"], ranks[1]["draws"], strict=True):
        assert all(i % 2 == 0 for i in b0) and all(i % 2 == 1 for i in b1)
        in0, in1 = {i // 2 for i in b0}, {i // 2 for i in b1}
        agree += sum((k in in0) == (k in in1) for k in range(m))
    p, trials = Q * Q + (1 - Q) * (1 - Q), T * m
    patterns = [[sorted(i // 2 for i in b) for b in r["draws"]] for r in ranks]
    assert patterns[0] != patterns[1]  # not one Bernoulli pattern on both ranks
    bound = 5 * math.sqrt(trials * p * (1 - p))
    assert abs(agree - trials * p) < bound, (agree / trials, p)
