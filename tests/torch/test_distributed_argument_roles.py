"""The generic rule's refusal of a layer argument whose role cannot be told (a layer
without a rule, its shared-versus-per-example roles kept from step to step) on one rank
only, under DDP with 2 gloo processes: raised on every rank at once, typed, naming the
refusing rank and its cause, with nothing accounted on any rank; the group still usable.

Each rank has its own Poisson batch, so a shared table whose row count equals the batch's
size at a step the batch-independence probe does not check can happen on one rank alone:
the other ranks, whose batch differs, settle the table as shared and go on to the step's
collectives.

(a) A layer without a rule first called at a later step, with the same table on both
    ranks, of as many rows as rank 0's batch then: rank 0's batch there is one the probe
    does not check, so its generic rule refuses the layer's tensors of the batch's size;
    rank 1's batch is its largest yet, checked by the probe, and its step would go on.
(b) A per-example argument that, on rank 0 only, stops having the batch's rows.
(c) The same with rank 0 stepping in physical chunks: its refusal at a chunk is kept
    until its logical batch's last chunk, then raised on every rank.
(d) (a) and (b) with the model sharded by FSDP2 instead of wrapped in DDP.

The refusal is raised inside ``optimizer.step()`` (the generic rule is evaluated there),
which joins the ranks' status exchange with it before any collective of the step. With
that routing taken out, both ranks here wait in collectives until the test's timeout.
(The single-process refusals themselves: ``test_argument_roles.py``.)
"""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
from _ranks import close_gloo, init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [one_worker(__name__), pytest.mark.slow]  # two processes: ~15 s
WORLD = 2
N = 64
B = 8  # per rank: q = W B / N = 0.25
TIMEOUT = 30.0  # agreement_timeout: a refusal must come well before it
SEED = 5  # the ranks' Poisson batch sizes: rank 0 [8, 10, 8, 7], rank 1 [9, 5, 10, 5]
LATE = 2  # the step (0-based) at which the table's layer is first used: rank 0's batch (8)
# is within the sizes the probe checked (not checked), rank 1's (10) is its largest yet
# (checked on the whole batch)
ROWS = 8  # the shared table's rows: rank 0's batch size at that step


class _Rows(nn.Module):
    """A layer no rule covers: its input plus a projection of ``ctx``, one row per
    example (its first rows, as many as the input's)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x, ctx):
        return x + (ctx @ self.weight)[: x.shape[0]]


class _Table(nn.Module):
    """A layer no rule covers: its input plus the mean of a projection of ``table``, a
    tensor shared by every example."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x, table):
        return x + (table @ self.weight).mean(0)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 4)
        self.mix = _Rows()
        self.late = _Table()
        self.out = nn.Linear(4, 3)

    def forward(self, x, ctx):
        h = self.mix(torch.tanh(self.inp(x)), ctx)
        if _TABLE:  # state kept outside the modules: no re-run of the probe
            h = self.late(h, _TABLE[0])
        return self.out(h)


#: the table of the layer first used at a later step (set by the training loop)
_TABLE: list = []


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
    )


def _run(case: str, rank: int) -> dict:
    """An epoch of a DDP-wrapped model (``_fsdp``: sharded with FSDP2) with layers
    without a rule, whose arguments go wrong on rank 0 only (``case``; ``_chunked``:
    rank 0 steps in physical chunks of 3 rows). Returns this rank's batch sizes, the
    error each refused step raised on it (type, message, seconds, refusing ranks), its
    own error of a refused chunk, and its accounted steps."""
    from privlearn.torch import make_private

    torch.manual_seed(7)
    if case.endswith("_fsdp"):  # sharded with FSDP2 instead of DDP's replicas
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _Net()
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in (model.inp, model.mix, model.late, model.out, model):
            fully_shard(layer, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(_Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=B)
    kw = {"max_physical_batch_size": 3} if case.endswith("_chunked") and rank == 0 else {}
    p = make_private(
        model,
        opt,
        loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=SEED,
        agreement_timeout=TIMEOUT,
        **kw,
    )
    out: dict = dict(sizes=[], refused=[], own=[], steps=None)
    for x, y in p.data_loader:
        b, step = len(x), p.accountant.steps
        out["sizes"].append(b)
        ctx = torch.randn(b, 4)  # one row per example
        _TABLE.clear()
        if case.startswith("late_table") and step >= LATE:  # the same table on both ranks
            _TABLE.append(torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(3)))
        if case.startswith("unfollowing") and step == LATE and rank == 0:
            ctx = torch.randn(b + 1, 4)  # stops following the examples on rank 0
        start = time.monotonic()
        try:
            p.optimizer.zero_grad()
            if b:
                nn.functional.cross_entropy(p.model(x, ctx), y).backward()
            p.optimizer.step()
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            seen = (type(exc).__name__, str(exc), time.monotonic() - start)
            if not hasattr(exc, "refused_ranks"):  # a chunk's: raised on every rank at
                out["own"].append(seen)  # the logical batch's last chunk
                continue
            out["refused"].append(seen + (list(exc.refused_ranks),))
            break
    out["steps"] = p.accountant.steps
    _TABLE.clear()
    p.detach()
    return out


CASES = (
    "late_table",
    "unfollowing",
    "unfollowing_chunked",
    "late_table_fsdp",
    "unfollowing_fsdp",
    "base",
)


def _worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        results = {case: _run(case, rank) for case in CASES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    # a rank left waiting in a collective would hold the group until gloo's own timeout
    # (30 minutes): bounded here
    return run_ranks(_worker, tmp_path_factory.mktemp("roles"), WORLD, timeout=120.0)


UNCHECKED = "at its first call in a step that the batch-independence probe did not check"
UNFOLLOWING = "its rows no longer follow the examples"
CAUSE = {
    "late_table": UNCHECKED,
    "unfollowing": UNFOLLOWING,
    "unfollowing_chunked": UNFOLLOWING,
    "late_table_fsdp": UNCHECKED,
    "unfollowing_fsdp": UNFOLLOWING,
}


@pytest.mark.parametrize("case", sorted(CAUSE))
def test_a_role_refused_on_one_rank_is_raised_on_every_rank_at_once(ranks, case):
    # the batches are as arranged: rank 0's at the step is not one the probe checks
    # whole (within the sizes before it), rank 1's is (its largest yet)
    sizes = [ranks[r]["base"]["sizes"] for r in range(WORLD)]
    assert min(sizes[0][:LATE]) <= sizes[0][LATE] < max(sizes[0][:LATE]), sizes
    assert sizes[1][LATE] > max(sizes[1][:LATE]), sizes
    assert sizes[0][LATE] == ROWS != sizes[1][LATE], sizes
    for r in range(WORLD):
        got = ranks[r][case]
        assert len(got["refused"]) == 1, (r, got)
        kind, message, seconds, refused = got["refused"][0]
        # typed, naming the refusing rank and its cause, well before the timeout
        assert kind == "BatchDependenceError", (r, message)
        assert refused == [0] and "rank(s) [0] of 2" in message, (r, message)
        assert CAUSE[case] in message, (r, message)
        assert seconds < TIMEOUT / 3, (r, seconds)
        # nothing of the refused step accounted on any rank: the steps before it only
        assert got["steps"] == LATE, (r, got["steps"])
    # rank 1 refused nothing of its own; rank 0 only at a chunk (kept until its logical
    # batch's last chunk)
    assert ranks[1][case]["own"] == [], ranks[1][case]["own"]
    own = ranks[0][case]["own"]
    if case.endswith("_chunked"):
        assert own and own[0][0] == "BatchDependenceError" and CAUSE[case] in own[0][1], own
    else:
        assert own == [], own


def test_the_group_still_trains_after_the_refusals(ranks):
    for r in range(WORLD):
        base = ranks[r]["base"]
        assert base["refused"] == [] and base["own"] == [], base
        assert base["steps"] == len(base["sizes"]), base
