"""make_private under torch.distributed (2 gloo processes) given a map-style dataset
(items read one by one, not a TensorDataset) in another order on each rank, as a
``shuffle()`` without a common seed leaves it: refused on both ranks before any step.

Each rank Poisson-samples its part (indices ``rank, rank + W, ...``) of its own copy, so
with the copies in other orders one example can sit in both ranks' parts and be drawn
twice in one step (twice the sensitivity the accountant assumes: an optimistic
epsilon), while another is never drawn. The ranks' dataset digests (the items at three
positions) differ, so make_private refuses, naming the dataset; the same dataset in the
same order on both ranks trains.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
from _ranks import close_gloo, init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [one_worker(__name__), pytest.mark.slow]
WORLD = 2
N = 40


class _Rows(torch.utils.data.Dataset):
    """``N`` examples, in the order of a permutation drawn from ``shuffle`` (None: none)."""

    def __init__(self, shuffle=None):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g)
        self.order = (
            torch.arange(N)
            if shuffle is None
            else torch.randperm(N, generator=torch.Generator().manual_seed(shuffle))
        )

    def __len__(self):
        return N

    def __getitem__(self, i):
        k = int(self.order[i])
        return self.x[k], self.y[k]


def _case(shuffle) -> tuple:
    from privlearn.torch import make_private

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader(_Rows(shuffle), batch_size=5)
    try:
        p = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            seed=3,
        )
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return (type(exc).__name__, str(exc))
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    steps = p.accountant.steps
    p.detach()
    return ("trained", steps)


def _worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        res = {"own_order": _case(shuffle=100 + rank), "one_order": _case(shuffle=7)}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("dataset_order"), WORLD, timeout=180.0)


def test_a_dataset_in_another_order_on_each_rank_is_refused_on_every_rank(ranks):
    """Refused naming the dataset's contents, without printing their digest (an
    unsalted hash of three records, which enumeration inverts when records take few
    values; the message ends up in logs and bug reports)."""
    from privlearn.torch.distributed import dataset_digest

    digests = [dataset_digest(_Rows(shuffle=100 + r)) for r in range(WORLD)]
    for r in ranks:
        kind, said = r["own_order"]
        assert kind == "ConfigurationError", (kind, said)
        assert "dataset contents: rank 0: contents #1, rank 1: contents #2" in said
        assert not any(d in said for d in digests), said
        assert "one order" in said


def test_the_same_order_on_every_rank_trains(ranks):
    assert [r["one_order"] for r in ranks] == [("trained", 1)] * WORLD
