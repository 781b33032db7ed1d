"""FSDP2 with an empty Poisson batch on one rank, a model returning a ``NamedTuple``:
2 CPU processes (gloo).

The ranks meet at each step's first training backward through a view of the model's
outputs (:mod:`privlearn.torch._forward_meet`). The outputs were replaced inside a
tensor, a dict, a plain tuple or list only, so those of a model returning a
``NamedTuple`` (or a tuple nesting them) were not: a loop that runs the forward of rank
1's empty batch but skips its backward paired rank 1's ``step()`` with rank 0's backward
all-gathers, and the run hung (the group is killed after ``TIMEOUT`` seconds and the test
fails). Now both ranks raise the same ``TrainingLoopError``, nothing accounted.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("torch.distributed.fsdp")

pytestmark = one_worker("shared-fsdp")  # one group runs the modules of _ranks.SHARED["shared-fsdp"]
WORLD = 2
N = 8
TIMEOUT = 90.0  # a hang fails fast


class _Out(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return (_Out(self.b(h), h),)  # a tuple nesting a NamedTuple


def _private(seed, mesh=None):
    from privlearn.torch import make_private

    torch.manual_seed(7)
    model = _Net()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a, mesh=mesh)
        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(3)
    ds = torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
    )
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        torch.utils.data.DataLoader(ds, batch_size=1),
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        seed=seed,
    )


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's run on ``rank`` of the shared group (``_ranks.SHARED``)."""
    from torch.distributed.device_mesh import init_device_mesh

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = init_device_mesh("cpu", (WORLD,))
        for seed in range(100):  # rank 1's first batch empty, rank 0's not
            size = len(next(iter(_private(seed).data_loader.batch_sampler)))
            sizes = [None] * WORLD
            dist.all_gather_object(sizes, size)
            if sizes[0] > 0 and sizes[1] == 0:
                break
        p = _private(seed, mesh)
        x, y = next(iter(p.data_loader))
        where, outcome = "forward", None
        try:
            (out,) = p.model(x)
            loss = nn.functional.cross_entropy(out.logits, y, reduction="sum")
            where = "backward"
            if len(x):  # the backward of an empty batch skipped
                loss.backward()
            where = "step"
            p.optimizer.step()
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            outcome = (where, type(exc).__name__, str(exc))
    return {"size": len(x), "outcome": outcome, "steps": p.accountant.steps}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def test_a_skipped_backward_of_a_namedtuple_output_is_refused_on_every_rank(ranks):
    r0, r1 = ranks
    assert r0["size"] > 0 and r1["size"] == 0
    (w0, t0, m0), (w1, t1, m1) = r0["outcome"], r1["outcome"]
    assert (w0, w1) == ("backward", "step")
    assert t0 == t1 == "TrainingLoopError"
    for msg in (m0, m1):
        assert "rank 0: a training backward of the model, rank 1: optimizer.step()" in msg
    assert r0["steps"] == r1["steps"] == 0
