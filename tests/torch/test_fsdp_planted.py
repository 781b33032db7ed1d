"""FSDP2 (2 gloo processes) on a dataset whose even-indexed examples (rank 0's part) are
all zeros and whose one odd-indexed example (rank 1's) is huge.

(a) The per-example norm is that of the whole gradient across the shards and layers: at
    q = 1 and sigma = 0 every example is in the batch, only the planted one has a
    gradient, and its clipped contribution to the summed update has norm exactly C (the
    closed form of clipping one gradient larger than C), not sqrt(shards) C or more.
(b) The batch-independence probe runs as many forward passes on every rank (each is an
    all-gather): rank 0's identical rows leave its probe nothing to compare, and the
    step must still complete on both ranks instead of waiting forever.
"""

from __future__ import annotations

import faulthandler

import pytest

torch = pytest.importorskip("torch")
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-fsdp")  # one group runs the modules of _ranks.SHARED["shared-fsdp"]
WORLD = 2
N = 40
C = 0.7
PLANTED = 7  # odd: in rank 1's part
TIMEOUT = 120.0  # a hang fails fast


def _full(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1).clone() for p in model.parameters()])


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's run on ``rank`` of the shared group (``_ranks.SHARED``)."""
    # a rank left waiting in a collective fails the test instead of hanging it
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from privlearn.torch import make_private

        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16, bias=False), nn.Tanh(),
                              nn.Linear(16, 4, bias=False))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        x = torch.zeros(N, 6)
        x[PLANTED] = 1e3 * torch.arange(1.0, 7.0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x),
                                             batch_size=N // WORLD)  # q = 1
        p = make_private(model, opt, loader, noise_multiplier=0.0, max_grad_norm=C, seed=2)
        (xb,) = next(iter(p.data_loader))
        before = _full(model)
        p.optimizer.zero_grad()
        (p.model(xb) ** 2).sum().backward()
        p.optimizer.step()
        contribution = (_full(model) - before) * p.expected_batch_size  # -lr * clipped sum
        return dict(norm=float(contribution.norm()), examples=len(xb), rate=p.sampling_rate)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    return shared_ranks(__name__, tmp_path_factory)


def test_planted_example_contributes_exactly_the_clipping_bound(ranks):
    for r in ranks:
        assert r["rate"] == 1.0 and r["examples"] == N // WORLD
        assert r["norm"] == pytest.approx(C, rel=1e-5)
