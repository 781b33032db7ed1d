"""make_private over a process subgroup (3 gloo processes).

The run's ranks are the group's: rank ``r`` of the group samples the part ``r, r + W,
...`` of the dataset, the noise and the status exchange are the group's, and the group's
first rank is the one whose weights the replicas start from. Ground truth: the same
noise-free epoch run by the subgroup of global ranks {0, 1} and then by that of {1, 2}
(whose first rank is global rank 1, and whose second starts from other weights) gives the
same batches (sizes, group rank by group rank), the same sampling rate and the same
parameters: nothing depends on the global ranks. The rank outside the group takes no part.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import close_gloo, init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [one_worker(__name__), pytest.mark.slow]
WORLD = 3
N = 40
B = 5  # per group rank: q = 2 B / N = 0.25


def _mlp(seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
    )


def _epoch(group, members: list[int], rank: int) -> dict | None:
    from privlearn.torch import make_private

    if rank not in members:
        return None
    model = _mlp(99 if rank == members[-1] else 7)  # the last member's own weights
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        torch.utils.data.DataLoader(_data(), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        seed=11,
        process_group=group,
    )
    sizes = []
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        sizes.append(len(x))
    flat = torch.cat([q.detach().reshape(-1).double() for q in model.parameters()])
    return dict(sizes=sizes, rate=p.sampling_rate, steps=p.accountant.steps, params=flat)


def _worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        res = {}
        for members in ([0, 1], [1, 2]):
            group = dist.new_group(members)  # made by every rank, in one order
            res[tuple(members)] = _epoch(group, members, rank)
            dist.barrier()
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("subgroup"), WORLD, timeout=240.0)


def test_a_subgroup_run_depends_on_the_group_ranks_only(ranks):
    first = [ranks[0][(0, 1)], ranks[1][(0, 1)]]
    second = [ranks[1][(1, 2)], ranks[2][(1, 2)]]
    assert ranks[2][(0, 1)] is None and ranks[0][(1, 2)] is None
    steps = N // (2 * B)
    for a, b in zip(first, second, strict=True):  # group rank by group rank
        assert a["sizes"] == b["sizes"] and len(a["sizes"]) == steps
        assert a["rate"] == b["rate"] == pytest.approx(2 * B / N)
        assert a["steps"] == b["steps"] == steps
        torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
    # the replicas agree, and trained (the last member started from its own weights)
    torch.testing.assert_close(second[0]["params"], second[1]["params"], rtol=0, atol=0)
    start = torch.cat([q.detach().reshape(-1).double() for q in _mlp().parameters()])
    assert float((first[0]["params"] - start).abs().max()) > 1e-3
