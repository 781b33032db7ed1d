"""A step refused on one rank only is refused on every rank (2 gloo processes).

The ranks release one gradient per step together (DDP: one all-reduce of the noisy
sums; FSDP2: an unshard and a reduce-scatter), so a rank whose step is refused before
that collective would leave the others waiting in it for ever (or pair its next step's
sums with their current ones). Each case below refuses a step on rank 1 only, at the
second of its steps; the loop catches the error and goes on, as a loop that skips bad
batches does. Checked on both ranks: the same error type, naming rank 1 and its cause;
nothing released or accounted (the parameters and the step count of the refused step
are those of the step before, on both ranks); the next batch trains on both; and the
ranks end with identical parameters. The whole group is killed after a minute, so a
hang fails the tests instead of holding the run.

(a) DDP: a NaN in rank 1's batch; rank 1's forward run in eval mode (no per-example
    gradient recorded); rank 1 training on twice the batch it drew; a NaN in one
    physical chunk of rank 1's batch (``max_physical_batch_size``: the chunk is refused
    on rank 1 alone, the batch on both ranks at its last chunk);
    rank 1 calling ``step()`` twice for one batch (its next draws then lag one behind
    rank 0's: the next step is refused on both ranks as out of step, not released with
    rank 0's draw 3 beside rank 1's draw 2); rank 1's loop ending after two steps while
    rank 0 calls ``step()`` a third time: once rank 1 has left the group, rank 0's step
    fails within seconds, naming the cause (a rank that stopped stepping but stays in
    the group cannot be told from a slow one). The status exchange of an NCCL run, on a
    gloo group of its own. Rank 0 calling ``load_state_dict`` alone while rank 1 steps:
    both refuse at once (the load joins the step's status exchange), then each loads
    its own rank's state and both step. Rank 0 alone changing its noise multiplier, or
    its clipping bound, or freezing a bias, mid-run: each such step is refused on both
    ranks (each rank's accountant would record its own value while the released sum
    mixes both; the frozen bias leaves rank 0's gradient buffer shorter than rank 1's).
(b) FSDP2: a NaN in rank 1's batch (refused by the batch-independence probe, whose
    passes are collectives, or after the unshard, before the reduce-scatter); rank 1
    calling ``zero_grad()`` between ``backward()`` and ``step()`` (refused before the
    unshard).
(c) FSDP2 with a tied output bias (a head registering its decoder's bias, as Hugging
    Face's LM heads do): noise-free steps equal the naive loop of batch-of-one passes
    over the union of the ranks' batches; the head also using that bias in its own
    forward is refused on both ranks, typed as in one process, nothing released.
(d) Refused at make_private on both ranks, before any step: ranks built with another
    sampling, a model whose parameters are in another order or of another shape on
    rank 1, and a dataset (not a TensorDataset) of another length on rank 1.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import (  # noqa: E402
    close_gloo,
    init_gloo,
    one_worker,
    run_ranks,
    shared_ranks,
    step_and_record,
)
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
TIMEOUT = 240.0  # the DDP cases' limit in the shared group (a hang fails then)
WORLD = 2
N = 40
B = 5  # per rank: q = W B / N = 0.25
C = 0.5
LR = 0.5
BAD = 1  # the iteration at which rank 1 misbehaves

ONE_RANK = {"nan": "NonFiniteInputError", "eval": "TrainingLoopError",
            "other_size": "BatchDependenceError", "fsdp_nan": "NonFiniteInputError",
            "fsdp_discarded": "TrainingLoopError"}
CAUSE = {"nan": "not finite", "eval": "eval mode", "other_size": "saw 2 rows per example",
         "fsdp_nan": "not finite", "fsdp_discarded": "zero_grad() was called after"}
AT_SETUP = ("sampling", "param_order", "param_shape", "dataset_length")
DDP = ("nan", "eval", "other_size", "twice", "chunks")
SHARDED = ("fsdp_nan", "fsdp_discarded")


def _data(n=N) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g),
                                          torch.randint(0, 3, (n,), generator=g))


class _Mlp(nn.Module):
    def __init__(self, hidden=8, swapped=False):
        super().__init__()
        torch.manual_seed(7)
        if swapped:  # the same names and shapes, registered in the other order
            self.fc2 = nn.Linear(hidden, 3)
            self.fc1 = nn.Linear(6, hidden)
        else:
            self.fc1 = nn.Linear(6, hidden)
            self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class _TiedHead(nn.Module):
    """A body and a decoder whose bias the model registers again as its own ``bias``
    (as Hugging Face's masked-LM heads do); ``uses``: its own forward adds it too."""

    def __init__(self, uses=False):
        super().__init__()
        torch.manual_seed(7)
        self.body, self.decoder = nn.Linear(6, 8), nn.Linear(8, 3)
        self.bias = self.decoder.bias
        self.uses = uses

    def forward(self, x):
        y = self.decoder(torch.tanh(self.body(x)))
        return y + self.bias if self.uses else y


class _Items(torch.utils.data.Dataset):
    """A dataset whose items are read one by one (no digest to compare)."""

    def __init__(self, n):
        self.x, self.y = _data(n).tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _flat(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach()
                      .reshape(-1).double().clone() for p in model.parameters()])


def _build(case, rank, mesh):
    from torch.distributed.fsdp import fully_shard

    if case.startswith("fsdp") or case.startswith("tied"):
        model = _TiedHead(uses=case == "tied_used") if case.startswith("tied") else _Mlp()
        for sub in (model.body,) if case.startswith("tied") else (model.fc1, model.fc2):
            fully_shard(sub, mesh=mesh)  # a tied head: the decoder stays with the root
        return fully_shard(model, mesh=mesh)
    if case == "param_order":  # (DistributedDataParallel would refuse these itself)
        return _Mlp(swapped=rank == 1)
    if case == "param_shape":
        return _Mlp(hidden=9 if rank == 1 else 8)
    return nn.parallel.DistributedDataParallel(_Mlp())


def _run(case, rank, mesh) -> dict:
    from privlearn.torch import make_private

    model = _build(case, rank, mesh)
    ds = _Items(48 if rank == 1 else N) if case == "dataset_length" else _data()
    kw = dict(sampling="fixed") if case == "sampling" and rank == 1 else {}
    try:
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                         torch.utils.data.DataLoader(ds, batch_size=B),
                         noise_multiplier=0.0, max_grad_norm=C, seed=11, **kw)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return dict(setup=(type(exc).__name__, str(exc)))
    out = dict(setup=None, outcomes=[], params=[_flat(model)], steps=[], batches=[])
    # rank 1 calls step() twice at BAD: rank 0 runs one more batch, so that both make
    # the same number of step() calls
    iterations = 4 if case == "twice" and rank == 0 else 3
    for k, (x, y) in zip(range(iterations), p.data_loader, strict=False):
        bad = rank == 1 and k == BAD
        if bad and case.endswith("nan"):
            x = x.clone()
            x[0, 0] = float("nan")
        if bad and case == "other_size":  # trained on twice the batch it drew
            x, y = torch.cat([x, x]), torch.cat([y, y])
        calls = 2 if bad and case == "twice" else 1
        p.optimizer.zero_grad()
        if bad and case == "eval":
            p.model.eval()
        loss = nn.functional.cross_entropy(p.model(x), y)
        p.model.train()
        loss.backward()
        if bad and case == "fsdp_discarded":
            p.optimizer.zero_grad()
        for _ in range(calls):
            try:
                p.optimizer.step()
                out["outcomes"].append(None)
            except Exception as exc:  # noqa: BLE001 - a loop that skips a bad batch
                out["outcomes"].append((type(exc).__name__, str(exc),
                                        getattr(exc, "refused_ranks", None)))
        out["params"].append(_flat(model))
        out["steps"].append(p.accountant.steps)
    return out


def _run_chunks(rank) -> dict:
    """An epoch in physical chunks of at most 2 examples (each rank its own number of
    chunks per batch): rank 1's first chunk with examples from batch 1 on holds a NaN."""
    from privlearn.torch import make_private

    model = nn.parallel.DistributedDataParallel(_Mlp())
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                     torch.utils.data.DataLoader(_data(), batch_size=B),
                     noise_multiplier=0.0, max_grad_norm=C, seed=12,
                     max_physical_batch_size=2)
    out = dict(batches=[], local=[], params=[_flat(model)], steps=[])
    planted = rank != 1
    for x, y in p.data_loader:
        if not planted and len(out["batches"]) >= BAD and len(x):
            x, planted = x.clone(), len(out["batches"])
            x[0, 0] = float("nan")
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        before = p.accountant.steps
        try:
            p.optimizer.step()
        except Exception as exc:  # noqa: BLE001 - a loop that skips a bad chunk
            if getattr(exc, "refused_ranks", None) is None:  # this rank's chunk alone
                out["local"].append((len(out["batches"]), type(exc).__name__))
                continue
            out["batches"].append((type(exc).__name__, str(exc), exc.refused_ranks))
        else:
            if p.accountant.steps == before:  # a chunk before the batch's last
                continue
            out["batches"].append(None)
        out["params"].append(_flat(model))
        out["steps"].append(p.accountant.steps)
    out["planted"] = planted
    return out


def _ended(rank) -> dict:
    """Rank 1's loop ends after 2 steps (and its process leaves the group); rank 0 calls
    step() a third time. Last: the group is gone afterwards."""
    import gc
    import time

    from privlearn.torch import make_private

    model = nn.parallel.DistributedDataParallel(_Mlp())
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                     torch.utils.data.DataLoader(_data(), batch_size=B),
                     noise_multiplier=0.0, max_grad_norm=C, seed=11)
    out = {}
    for k, (x, y) in enumerate(p.data_loader):
        if k == (3 if rank == 0 else 2):
            break
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        start = time.monotonic()
        try:
            p.optimizer.step()
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out = dict(kind=type(exc).__name__, message=str(exc), at=k,
                       seconds=time.monotonic() - start)
    out["steps"] = p.accountant.steps
    if rank == 1:  # its last all-reduce read on both ranks before it leaves
        time.sleep(2.0)
    del p, model
    gc.collect()  # the DDP reducer holds the group
    dist.destroy_process_group()  # close_gloo then finds no group to wait on
    return out


def _load_alone(rank) -> dict:
    """Rank 0 loads a checkpoint alone (``load_state_dict`` behind ``if rank == 0``) while
    rank 1 steps: each would wait in its own collective for ever. Both refuse at once,
    nothing loaded or released; then each loads the state its own rank saved and both
    step together."""
    import io
    import time

    from privlearn.torch import make_private

    def fresh():
        model = nn.parallel.DistributedDataParallel(_Mlp())
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                         torch.utils.data.DataLoader(_data(), batch_size=B),
                         noise_multiplier=1.0, max_grad_norm=C, seed=11)
        return p, iter(p.data_loader)

    def step(p, it):
        x, y = next(it)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()

    p, it = fresh()
    step(p, it)
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    p.detach()
    p, it = fresh()
    before = _flat(p.model.module)
    start = time.monotonic()
    try:
        if rank == 0:
            p.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
        else:
            step(p, it)
        out = dict(refused=None)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        out = dict(refused=type(exc).__name__, message=str(exc))
    out.update(seconds=time.monotonic() - start, steps=[p.accountant.steps],
               unchanged=torch.equal(before, _flat(p.model.module)))
    p.detach()
    p, it = fresh()
    p.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    out["steps"].append(p.accountant.steps)
    step(p, it)
    out["steps"].append(p.accountant.steps)
    return out


def _mixed(rank) -> dict:
    """After one step, rank 0 alone changes its noise multiplier (then, restored, its
    clipping bound), as a schedule run under ``if rank == 0:`` would: each rank's
    accountant would record its own value while the released sum mixes both (rank 0
    reporting sigma 3 over noise of std sqrt((9 + 1) / 2) C). Then rank 0 alone freezes a
    bias (its gradient buffer shorter than rank 1's: the all-reduce would abort). Each
    such step is refused on both ranks, nothing released or accounted; restored, the
    ranks step on."""
    from privlearn.torch import make_private

    model = nn.parallel.DistributedDataParallel(_Mlp())
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                     torch.utils.data.DataLoader(_data(), batch_size=B),
                     noise_multiplier=1.0, max_grad_norm=C, seed=11)
    out = dict(outcomes=[], steps=[], params=[])
    changes = [None, ("noise_multiplier", 3.0), ("max_grad_norm", 5 * C), "freeze", None]
    batches = (batch for _ in range(2) for batch in p.data_loader)  # 4 a epoch
    for change, (x, y) in zip(changes, batches, strict=False):
        if rank == 0:
            p.optimizer.noise_multiplier, p.optimizer.max_grad_norm = 1.0, C
            model.module.fc1.bias.requires_grad_(change != "freeze")
            if isinstance(change, tuple):
                setattr(p.optimizer, *change)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        step_and_record(p, out)
        out["params"].append(_flat(model.module))
    return out


def _side_group(rank) -> dict:
    """The status exchange of a run whose group reduces no CPU tensor (NCCL, here a gloo
    group reported as "nccl"): made on a gloo group of its own, which refuses a step
    refused on rank 1 on both ranks."""
    from unittest import mock

    from privlearn.torch._agree import Agreement

    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        agreement = Agreement(None, WORLD)
    out = dict(own_group=agreement.group is not None and agreement.group is not dist.group.WORLD,
               passed=agreement.agree(None, 3, 5, flag=rank == 1))
    try:
        agreement.agree(ValueError("a bad batch") if rank == 1 else None, 3, 6)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        out["refused"] = (type(exc).__name__, str(exc), exc.refused_ranks)
    return out


def _tied_run(mesh) -> dict:
    """A noise-free FSDP2 run of the tied head: the union of the ranks' batches of each
    step (gathered) and the parameters after it."""
    from torch.distributed.fsdp import fully_shard

    from privlearn.torch import make_private

    model = _TiedHead()
    fully_shard(model.body, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ds = torch.utils.data.TensorDataset(*_data().tensors, torch.arange(N))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                     torch.utils.data.DataLoader(ds, batch_size=B),
                     noise_multiplier=0.0, max_grad_norm=C, seed=11)
    out = dict(batches=[], params=[_flat(model)])
    for _, (x, y, idx) in zip(range(2), p.data_loader, strict=False):
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, idx.tolist())
        out["batches"].append(sorted(i for part in gathered for i in part))
        out["params"].append(_flat(model))
    out["expected"] = p.expected_batch_size
    return out


def _cases(rank: int, cases) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,)) if cases is not DDP else None
    res = {case: _run_chunks(rank) if case == "chunks" else _run(case, rank, mesh)
           for case in cases}
    if cases is not DDP:
        res["tied"] = _tied_run(mesh)
    else:
        res["side_group"] = _side_group(rank)
        res["load_alone"] = _load_alone(rank)
        res["mixed"] = _mixed(rank)
        res["ended"] = _ended(rank)  # last: the group is gone after it
    return res


def _scenario(rank: int, out_dir: str) -> dict:
    """The DDP cases on ``rank`` of the shared group (``_ranks.SHARED``; the last of its
    group: the group is gone after them)."""
    return _cases(rank, DDP)


def _sharded_worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        res = _cases(rank, (*SHARDED, "tied_used", *AT_SETUP))
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The DDP cases (a hang fails after four minutes: about 35 s on a loaded machine)."""
    return shared_ranks(__name__, tmp_path_factory)


@pytest.fixture(scope="module")
def sharded_ranks(tmp_path_factory):
    """The FSDP2 cases and those refused at make_private."""
    pytest.importorskip("torch.distributed.fsdp")
    return run_ranks(_sharded_worker, tmp_path_factory.mktemp("agree_sharded"), WORLD,
                     timeout=300.0)


def _refused_on_every_rank(ranks, case):
    for rank in range(WORLD):
        r = ranks[rank][case]
        assert r["setup"] is None, (rank, r["setup"])
        out = r["outcomes"]
        assert [o is None for o in out] == [True, False, True], (rank, out)
        kind, message, refused = out[BAD]
        assert kind == ONE_RANK[case], (rank, message)
        assert refused == [1] and "rank(s) [1]" in message and "rank 1:" in message
        assert CAUSE[case] in message, message
        # nothing released or accounted: the refused step leaves parameters and count
        assert r["steps"] == [1, 1, 2]
        assert torch.equal(r["params"][BAD + 1], r["params"][BAD])
        assert not torch.equal(r["params"][BAD + 2], r["params"][BAD + 1])
    for a, b in zip(ranks[0][case]["params"], ranks[1][case]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [c for c in DDP if c in ONE_RANK])
def test_a_step_refused_on_one_rank_is_refused_on_every_rank(ranks, case):
    _refused_on_every_rank(ranks, case)


def test_a_chunk_refused_on_one_rank_refuses_its_batch_on_every_rank(ranks):
    """max_physical_batch_size: rank 1's chunk with a NaN is refused there (the ranks'
    chunk counts differ, so no rank waits on it); at its batch's last chunk every rank
    refuses the batch together, nothing of it released, and the epoch goes on."""
    r0, r1 = ranks[0]["chunks"], ranks[1]["chunks"]
    bad = r1["planted"]
    assert isinstance(bad, int) and bad >= BAD
    assert len(r0["batches"]) == len(r1["batches"]) >= bad + 2
    for r in (r0, r1):
        for k, outcome in enumerate(r["batches"]):
            if k != bad:
                assert outcome is None, (k, outcome)
                continue
            kind, message, refused = outcome
            assert kind == "NonFiniteInputError" and refused == [1], message
            assert "not finite" in message
            assert torch.equal(r["params"][k + 1], r["params"][k])  # nothing released
        assert r["steps"][-1] == len(r["batches"]) - 1
    # rank 1's batch has more than 2 examples (seed 12: 4): its chunk with the NaN is not
    # its last, and is refused there alone
    assert r0["local"] == [] and r1["local"] == [(bad, "NonFiniteInputError")]
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)


def test_a_step_after_another_rank_left_fails_at_once_with_the_cause(ranks):
    """A rank that stopped stepping cannot be waited out, but once it has left the group
    the extra step fails within seconds, saying why, before anything is released."""
    r0, r1 = ranks[0]["ended"], ranks[1]["ended"]
    assert "kind" not in r1 and r1["steps"] == 2
    assert r0["kind"] == "TrainingLoopError" and r0["at"] == 2, r0
    assert "left the process group" in r0["message"] and r0["seconds"] < 20
    assert r0["steps"] == 2


def test_a_state_loaded_on_one_rank_while_another_steps_is_refused_on_both(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["load_alone"]
        assert r["refused"] == "TrainingLoopError", (rank, r)
        assert "rank 0: load_state_dict" in r["message"], r["message"]
        assert "rank 1: optimizer.step()" in r["message"] and r["seconds"] < 20
        # nothing loaded or released; each rank's own state then loads, and both step
        assert r["unchanged"] and r["steps"] == [0, 1, 2], (rank, r)


def test_a_noise_multiplier_or_bound_changed_on_one_rank_is_refused_on_both(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["mixed"]
        out = r["outcomes"]
        assert out[0] is None and out[4] is None, (rank, out)
        for k, shown in ((1, "rank 0: noise_multiplier 3.0"),
                         (2, f"rank 0: noise_multiplier 1.0, max_grad_norm {5 * C!r}")):
            kind, message = out[k]
            assert kind == "TrainingLoopError" and shown in message, (rank, message)
            assert f"rank 1: noise_multiplier 1.0, max_grad_norm {C!r}" in message
            assert torch.equal(r["params"][k], r["params"][0])  # nothing released
        kind, message = out[3]
        assert kind == "TrainingLoopError" and "frozen or unfrozen" in message, message
        assert torch.equal(r["params"][3], r["params"][0])
        assert r["steps"] == [1, 1, 1, 1, 2], (rank, r["steps"])
    assert torch.equal(ranks[0]["mixed"]["params"][4], ranks[1]["mixed"]["params"][4])


def test_the_status_of_an_nccl_run_is_exchanged_on_a_gloo_group(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["side_group"]
        assert r["own_group"] and r["passed"] is True  # rank 1's flag, seen on both
        kind, message, refused = r["refused"]
        assert kind == "ValueError" and refused == [1] and "a bad batch" in message


@pytest.mark.slow
@pytest.mark.parametrize("case", SHARDED)
def test_an_fsdp_step_refused_on_one_rank_is_refused_on_every_rank(sharded_ranks, case):
    _refused_on_every_rank(sharded_ranks, case)


def test_a_second_step_call_on_one_rank_is_refused_on_every_rank_then_out_of_step(ranks):
    """Rank 1's second step() for one batch pairs with rank 0's next step: both refuse it
    (no new batch on rank 1). Rank 1 then trains its draw 2 while rank 0 trains its
    draw 3: refused on both as out of step, never summed together."""
    for rank in range(WORLD):
        r = ranks[rank]["twice"]
        out = r["outcomes"]
        assert len(out) == 4 and out[0] is None and out[1] is None, (rank, out)
        kind, message, refused = out[2]
        assert kind == "TrainingLoopError" and refused == [1], (rank, message)
        assert "without a new batch" in message
        kind, message, refused = out[3]
        assert kind == "TrainingLoopError" and refused == [], (rank, message)
        assert "not at the same step" in message
        assert "training draw 2" in message and "training draw 3" in message
        assert r["steps"][-1] == 2
    assert torch.equal(ranks[0]["twice"]["params"][-1], ranks[1]["twice"]["params"][-1])


@pytest.mark.slow
def test_fsdp_tied_bias_used_by_its_own_module_is_refused_on_every_rank(sharded_ranks):
    for rank in range(WORLD):
        r = sharded_ranks[rank]["tied_used"]
        assert r["setup"] is None
        for outcome in r["outcomes"]:
            kind, message, _ = outcome
            assert kind == "UnsupportedModuleError", message
            assert "'bias'" in message and "decoder.bias" in message
        assert r["steps"] == [0, 0, 0]
        assert all(torch.equal(q, r["params"][0]) for q in r["params"])


@pytest.mark.slow
def test_fsdp_tied_bias_equals_naive_loop(sharded_ranks):
    r0, r1 = sharded_ranks[0]["tied"], sharded_ranks[1]["tied"]
    assert r0["batches"] == r1["batches"]
    x, y = _data().tensors
    model = _TiedHead()
    params = list(model.parameters())  # the tied bias once
    for k, batch in enumerate(r0["batches"]):
        total = [torch.zeros_like(q) for q in params]
        for i in batch:
            loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
            grads = torch.autograd.grad(loss, params)
            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
            for t, g in zip(total, grads, strict=True):
                t += g * min(1.0, C / norm)
        with torch.no_grad():
            for q, t in zip(params, total, strict=True):
                q -= LR * t / r0["expected"]
        naive = torch.cat([q.detach().reshape(-1).double() for q in params])
        assert float((naive - r0["params"][k]).abs().max()) > 1e-3  # it moved
        torch.testing.assert_close(r0["params"][k + 1], naive, rtol=0, atol=1e-6)
        assert torch.equal(r0["params"][k + 1], r1["params"][k + 1])


@pytest.mark.slow
@pytest.mark.parametrize("case", AT_SETUP)
def test_ranks_built_apart_are_refused_at_make_private_on_every_rank(sharded_ranks, case):
    for rank in range(WORLD):
        kind, message = sharded_ranks[rank][case]["setup"]
        assert kind == "ConfigurationError", message
        assert "rank 1" in message
