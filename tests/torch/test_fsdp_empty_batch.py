"""FSDP2 (``fully_shard``) with an empty Poisson batch on one rank: 2 CPU processes (gloo).

Every forward and backward pass of an FSDP2 model all-gathers the layers' parameters, a
collective of all the ranks. Rank 1's first batch is made empty here (a seed found for
it, the sizes checked) while rank 0's is not:

* a loop that skips the forward and backward of an empty batch (``if len(x): ...``), or
  its backward only, and calls ``step()`` alone on rank 1 used to pair rank 1's step with
  rank 0's all-gathers: the run hung (the ranks are ended after ``TIMEOUT`` seconds
  and the test fails). Now both ranks raise the same
  ``TrainingLoopError`` (rank 0 from the model's forward or from ``backward()``, rank 1
  from ``step()``) naming the cause, nothing is accounted, and the loop that catches it
  goes on with the ranks together;
* a loop that runs every batch through the model, the empty one too, trains: with the
  noise off each step's parameters equal a naive loop of batch-of-one gradients,
  clipped and summed over the union of the ranks' batches and divided by the expected
  global batch ``q N`` (rank 1's empty batch contributes nothing).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-fsdp")  # one group runs the modules of _ranks.SHARED["shared-fsdp"]
WORLD = 2
N = 8
PER_RANK = 1  # q = 2 / 8: each rank's part (4 examples) is empty with probability 0.32
STEPS = 3
C = 0.5
LR = 0.5
TIMEOUT = 120.0  # a hang fails fast (imports take a few seconds a rank)


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g), torch.arange(N)
    )


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))


def _private(seed, mesh=None):
    from privlearn.torch import make_private

    model = _mlp()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        torch.utils.data.DataLoader(_data(), batch_size=PER_RANK),
        noise_multiplier=0.0,
        max_grad_norm=C,
        seed=seed,
    )


def _seed_with_empty_first_batch_on_rank_1():
    """The first seed whose first Poisson batch is empty on rank 1 and not on rank 0."""
    for seed in range(100):
        size = len(next(iter(_private(seed).data_loader.batch_sampler)))
        sizes = [None] * WORLD
        dist.all_gather_object(sizes, size)
        if sizes[0] > 0 and sizes[1] == 0:
            return seed
    raise AssertionError("no seed in range(100) gives rank 1 an empty first batch")


def _flat(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat(
        [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).clone()
            for p in model.parameters()
        ]
    )


def _run(seed, mesh, skip: str | None) -> dict:
    """``STEPS`` steps, the forward and backward of an empty batch skipped (``skip="both"``),
    its backward only (``"backward"``) or neither (None); each step's outcome (None, or
    where the error was raised, its type and message), the accountant's steps, the global
    batch and the parameters after it."""
    p = _private(seed, mesh)
    out = dict(
        sizes=[], outcomes=[], steps=[], batches=[], params=[], expected=p.expected_batch_size
    )
    it = iter(p.data_loader)
    for _ in range(STEPS):
        x, y, idx = next(it)
        out["sizes"].append(len(x))
        where = "forward"
        try:
            p.optimizer.zero_grad()
            if len(x) or skip != "both":
                loss = nn.functional.cross_entropy(p.model(x), y, reduction="sum")
                where = "backward"
                if len(x) or skip != "backward":
                    loss.backward()
            where = "step"
            p.optimizer.step()
            out["outcomes"].append(None)
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out["outcomes"].append((where, type(exc).__name__, str(exc)))
        out["steps"].append(p.accountant.steps)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, idx.tolist())
        out["batches"].append(sorted(i for part in gathered for i in part))
        out["params"].append(_flat(p.model))
    return out


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's runs on ``rank`` of the shared group (``_ranks.SHARED``)."""
    warnings.simplefilter("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    seed = _seed_with_empty_first_batch_on_rank_1()
    return {
        "skip": _run(seed, mesh, "both"),
        "skip_backward": _run(seed, mesh, "backward"),
        "forward": _run(seed, mesh, None),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    return shared_ranks(__name__, tmp_path_factory)


@pytest.mark.parametrize("run, skipped", [("skip", "forward"), ("skip_backward", "backward")])
def test_skipped_passes_on_an_empty_batch_are_refused_on_every_rank(ranks, run, skipped):
    r0, r1 = ranks[0][run], ranks[1][run]
    assert r0["sizes"][0] > 0 and r1["sizes"][0] == 0  # the case under test did happen
    (w0, t0, m0), (w1, t1, m1) = r0["outcomes"][0], r1["outcomes"][0]
    assert (w0, w1) == (skipped, "step")  # rank 0 in its forward (backward), rank 1 in step()
    assert t0 == t1 == "TrainingLoopError"
    for msg in (m0, m1):
        assert f"rank 0: a training {skipped} of the model, rank 1: optimizer.step()" in msg
        assert "empty Poisson batch" in msg and "Nothing was released" in msg
    assert r0["steps"][0] == r1["steps"][0] == 0  # nothing accounted
    # the loop goes on with the ranks together: the same outcomes, one parameter vector
    assert [o is None for o in r0["outcomes"]] == [o is None for o in r1["outcomes"]]
    for a, b in zip(r0["params"], r1["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert r0["steps"] == r1["steps"]


def _naive(batches, expected) -> list:
    """Noise-free DP-SGD by the definition: each example's gradient (a batch of one)
    clipped to ``C``, summed, divided by the expected batch; the parameters after each
    batch."""
    model, (x, y, _) = _mlp(), _data().tensors
    params = list(model.parameters())
    out = []
    for b in batches:
        total = [torch.zeros_like(q) for q in params]
        for i in b:
            grads = torch.autograd.grad(
                nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum"),
                params,
            )
            norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
            scale = min(1.0, C / float(norm))
            for t, g in zip(total, grads, strict=True):
                t.add_(g * scale)
        with torch.no_grad():
            for q, t in zip(params, total, strict=True):
                q -= LR * t / expected
        out.append(torch.cat([q.detach().reshape(-1).clone() for q in params]))
    return out


def test_empty_batch_run_through_the_model_trains_as_the_naive_loop(ranks):
    r0, r1 = ranks[0]["forward"], ranks[1]["forward"]
    assert r0["sizes"][0] > 0 and r1["sizes"][0] == 0
    assert r0["outcomes"] == r1["outcomes"] == [None] * STEPS
    assert r0["steps"] == r1["steps"] == list(range(1, STEPS + 1))
    assert r0["batches"] == r1["batches"]
    assert r0["expected"] == pytest.approx(WORLD * PER_RANK)
    naive = _naive(r0["batches"], r0["expected"])
    start = torch.cat([q.detach().reshape(-1) for q in _mlp().parameters()])
    assert not torch.equal(r0["params"][0], start)  # rank 0's example moved them
    for k in range(STEPS):
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        torch.testing.assert_close(r0["params"][k], naive[k], rtol=1e-5, atol=1e-6)
