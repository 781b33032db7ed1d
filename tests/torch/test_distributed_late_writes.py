"""A buffer the probe has not judged, written by a later training forward on one rank
only (2 gloo processes; :mod:`privlearn.torch._late_writes`).

The write hangs on the local batch (``x.sum() > threshold``, the threshold a plain
attribute that rank 1 holds out of reach): rank 0 writes the batch mean into ``stat`` at
its third step, rank 1 never does. Rank 0 alone re-runs the probe (its passes run the
unwrapped module: no collective) and refuses; rank 1 goes on into the step's exchange.

* from the batch, under DDP: both ranks raise the probe's typed error at step 3, well
  before the exchange's timeout, nothing accounted on either after step 2, and after
  the error rank 0's ``state_dict`` no longer holds the batch mean (its ``stat`` is back
  at the value before the step);
* from the weights (data-independent), under DDP: rank 0 re-probes alone, passes, and
  both ranks train every step to the same parameters;
* under FSDP2 (late writes not watched, as the trust model says: rank 0's write trains
  unseen): the run does not hang, and both ranks end it at the same step.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("torch.distributed.fsdp")  # its fsdp case

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
N = 40
B = 4  # per rank, fixed size: 5 steps an epoch
STEPS = 5
LATE = 3  # the step whose forward writes on rank 0
AGREEMENT_TIMEOUT = 30.0
TIMEOUT = 90.0  # the scenario's limit in the shared group: a hang fails fast


class _OneRankStat(nn.Module):
    """Writes ``stat`` from its ``LATE``-th training forward on, when the batch's sum
    passes ``threshold`` (from the batch, or from the weights: ``data``)."""

    def __init__(self, threshold: float, data: bool):
        super().__init__()
        torch.manual_seed(5)
        self.lin = nn.Linear(4, 3)
        self.register_buffer("stat", torch.zeros(4))
        self.calls = 0
        self.threshold = threshold
        self.data = data

    def forward(self, x):
        self.calls += 1
        if self.calls >= LATE and float(x.sum()) > self.threshold:
            with torch.no_grad():
                self.stat.copy_(x.mean(0) if self.data else self.lin.weight.sum(0))
        return self.lin(x)


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)
    )


def _run(case: str, rank: int, mesh) -> dict:
    from privlearn.torch import make_private
    from privlearn.torch import probe as probe_mod

    model = _OneRankStat(-1e9 if rank == 0 else 1e9, data=case != "weights")
    if case == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.lin, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        torch.utils.data.DataLoader(_data(), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        seed=4,
        sampling="fixed",
        agreement_timeout=AGREEMENT_TIMEOUT,
    )
    inner = getattr(model, "module", model)
    out = dict(refused=None, steps=[], batch_means=[], probes=0)
    real = probe_mod.probe

    def counted(*args):
        out["probes"] += 1
        return real(*args)

    probe_mod.probe = counted
    start = time.monotonic()
    try:
        for x, y in p.data_loader:
            out["batch_means"].append(x.mean(0))
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            out["steps"].append(p.accountant.steps)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        out.update(refused=type(exc).__name__, message=str(exc))
    finally:
        probe_mod.probe = real
    out["seconds"] = time.monotonic() - start
    out["accounted"] = p.accountant.steps
    out["state"] = {k: v.detach().clone() for k, v in inner.state_dict().items() if k == "stat"}
    if case != "fsdp":
        out["params"] = torch.cat([q.detach().reshape(-1).clone() for q in inner.parameters()])
    return out


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's run on ``rank`` of the shared group (``_ranks.SHARED``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    return {case: _run(case, rank, mesh) for case in ("batch", "weights", "fsdp")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def test_a_late_write_on_one_rank_is_refused_on_every_rank_at_its_step(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["batch"]
        assert r["refused"] == "BatchDependenceError", (rank, r)
        assert "stat" in r["message"], (rank, r["message"])
        assert r["steps"] == [1, 2] and r["accounted"] == LATE - 1, (rank, r)
        assert r["seconds"] < AGREEMENT_TIMEOUT / 3, (rank, r["seconds"])


def test_the_refused_write_is_undone_before_the_state_dict_is_read(ranks):
    """After catching the refusal, rank 0's ``stat`` no longer holds its step-3 batch
    mean (the statistic the refused write kept): it is the value before the step."""
    r = ranks[0]["batch"]
    mean = r["batch_means"][LATE - 1]
    assert not torch.allclose(r["state"]["stat"], mean)
    assert torch.equal(r["state"]["stat"], torch.zeros(4))


def test_a_data_independent_late_write_on_one_rank_trains_on_every_rank(ranks):
    runs = [ranks[rank]["weights"] for rank in range(WORLD)]
    for rank, r in enumerate(runs):
        assert r["refused"] is None and r["steps"] == list(range(1, STEPS + 1)), (rank, r)
    # rank 0 probed again, alone, at its late write; rank 1 at its first step only
    assert [runs[0]["probes"], runs[1]["probes"]] == [2, 1], runs
    assert torch.equal(runs[0]["params"], runs[1]["params"])


def test_under_fsdp2_a_late_write_on_one_rank_does_not_hang(ranks):
    """Late writes are not watched under FSDP2 (the trust model's "Not seen"): the run
    ends on both ranks, together."""
    runs = [ranks[rank]["fsdp"] for rank in range(WORLD)]
    assert runs[0]["refused"] == runs[1]["refused"], runs
    assert runs[0]["accounted"] == runs[1]["accounted"], runs
