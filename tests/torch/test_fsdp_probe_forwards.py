"""Under FSDP2 (2 gloo processes) the batch-independence probe checks every forward of a
step, as in one process and under DDP: not only the step's first forward.

(a) A model called twice in one step, whose second call (another keyword) subtracts the
    batch mean of its hidden rows (one example moves every example's gradient): the
    step is refused with ``BatchDependenceError`` on both ranks, nothing released or
    accounted, and no rank is left waiting in a collective (the ranks' forward passes
    of the probe, each an all-gather, are as many on both).
(b) The same two calls without the mixing: the steps complete on both ranks, which end
    with the same parameters.
(c) Rank 1 alone calls the model with the mixing keyword from the second step on (a
    signature not seen before re-arms the probe there, after rank 0's forward, which
    then recorded nothing to probe): rank 1 probes its batch while rank 0 pads with
    passes on its forward's inputs, and the step is refused by the probe on both ranks;
    no step with the mixing path is released (before, the first was).
(d) Poisson batches of about two examples per rank and a model that mixes them: no
    step at which some rank's batch holds two examples or more is released, also when
    the other rank's holds fewer (before, the probe waited for a step at which every
    rank had two, and the steps before it trained on the mixing model); the steps at
    which no rank has two (nothing to mix) train.
(e) A model whose probe runs one pass more on rank 0 than on rank 1 (rank 0's examples
    share one tag, so replacing one leaves the tag layer's rows as they were and the
    probe checks, on one example fewer, that those rows follow the batch; a forward that
    is not bitwise reproducible makes both ranks rerun the batch too): every rank runs
    as many passes, and both train (before, rank 0's extra pass waited for ever).
"""

from __future__ import annotations

import faulthandler
import os

import pytest

torch = pytest.importorskip("torch")
from _ranks import close_gloo, init_gloo, one_worker, run_ranks, step_and_record  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [one_worker(__name__), pytest.mark.slow]
WORLD = 2
N = 40
B = 6  # per rank


class _TwoCalls(nn.Module):
    """``view=2`` centres the hidden rows over the batch when ``mixes``."""

    def __init__(self, mixes: bool):
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 3)
        self.mixes = mixes

    def forward(self, x, view=1):
        h = torch.tanh(self.fc1(x))
        if view == 2 and self.mixes:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


class _Tagged(nn.Module):
    """Features and a one-column tag, each through its own layer; every forward adds a
    tiny offset of its own (a forward that is not bitwise reproducible, as with
    nondeterministic kernels: the probe reruns the batch once and compares within the
    dtype's rounding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc, self.tag, self.head = nn.Linear(5, 8), nn.Linear(1, 8), nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        return self.head(torch.tanh(self.fc(x) + self.tag(t)) + 1e-7 * self.calls)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1).clone() for p in model.parameters()])


def _case(kind: str, mesh, rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from privlearn.torch import make_private

    model = _Tagged() if kind == "tagged" else _TwoCalls(mixes=kind != "clean")
    for layer in (*list(model.children()), model):
        fully_shard(layer, mesh=mesh)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 5, generator=g)
    ds = torch.utils.data.TensorDataset(
        x, torch.randint(0, 3, (N,), generator=g), torch.randn(N, 1, generator=g)
    )
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        torch.utils.data.DataLoader(ds, batch_size=2 if kind == "poisson" else B),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        seed=3,
        sampling="poisson" if kind == "poisson" else "fixed",
    )
    before = _flat(model)
    out = dict(outcomes=[], steps=[])
    out["rows"] = []
    steps = {"late": 3, "poisson": 10}.get(kind, 2)
    for k, (x, y, t) in zip(range(steps), p.data_loader, strict=False):
        out["rows"].append(len(x))
        p.optimizer.zero_grad()
        ce = nn.functional.cross_entropy
        if kind == "tagged":  # rank 0's examples share one tag
            ce(p.model(x, torch.ones_like(t) if rank == 0 else t), y).backward()
        elif kind == "poisson":  # a mixing forward on batches of 0, 1, 2, ... examples
            ce(p.model(x, view=2), y, reduction="sum").backward()
        elif kind == "late":  # rank 1 alone takes the mixing path, from the second step on
            ce(p.model(x, view=2 if rank == 1 and k >= 1 else 1), y).backward()
        else:
            (ce(p.model(x), y) + ce(p.model(x, view=2), y)).backward()
        step_and_record(p, out)
    out["moved"] = bool((_flat(model) - before).abs().max() > 0)
    out["params"] = _flat(model)
    p.detach()
    return out


def _worker(rank: int, out_dir: str) -> None:
    # a rank left waiting in a collective fails the test instead of hanging it
    faulthandler.dump_traceback_later(90, exit=True)
    init_gloo(rank, WORLD, out_dir)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        kinds = ("mixing", "clean", "tagged", "late", "poisson")
        res = {kind: _case(kind, mesh, rank) for kind in kinds}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("fsdp_probe_forwards"), WORLD, timeout=240.0)


def test_a_second_forward_that_mixes_examples_is_refused_on_every_rank(ranks):
    for r in ranks:
        res = r["mixing"]
        for outcome in res["outcomes"]:  # every step refused, by the probe, typed
            assert outcome is not None and outcome[0] == "BatchDependenceError", outcome
        assert res["steps"] == [0, 0] and not res["moved"]


def test_two_clean_forwards_train_on_every_rank(ranks):
    for r in ranks:
        assert r["clean"]["outcomes"] == [None, None] and r["clean"]["steps"] == [1, 2]
        assert r["clean"]["moved"]
    assert torch.equal(ranks[0]["clean"]["params"], ranks[1]["clean"]["params"])


def test_a_probe_pass_run_on_one_rank_only_leaves_no_rank_waiting(ranks):
    for r in ranks:
        assert r["tagged"]["outcomes"] == [None, None] and r["tagged"]["steps"] == [1, 2]
    assert torch.equal(ranks[0]["tagged"]["params"], ranks[1]["tagged"]["params"])


def test_a_mixing_path_taken_on_one_rank_only_is_never_released(ranks):
    for r in ranks:
        res = r["late"]
        assert res["outcomes"][0] is None, res["outcomes"]
        for outcome in res["outcomes"][1:]:
            assert outcome is not None and outcome[0] == "BatchDependenceError", outcome
        assert res["steps"] == [1, 1, 1]


def test_a_rank_with_too_few_examples_to_probe_does_not_let_the_others_release(ranks):
    rows = [r["poisson"]["rows"] for r in ranks]
    assert rows[0] == rows[1] or len(rows[0]) == len(rows[1])
    lopsided = [k for k, (a, b) in enumerate(zip(*rows, strict=True)) if min(a, b) < 2 <= max(a, b)]
    assert lopsided, rows  # the case this test is about occurs
    for r in ranks:
        res = r["poisson"]
        taken = 0
        for k, outcome in enumerate(res["outcomes"]):
            if max(rows[0][k], rows[1][k]) >= 2:
                assert outcome is not None and outcome[0] == "BatchDependenceError", (k, outcome)
            else:
                assert outcome is None, (k, outcome)
                taken += 1
            assert res["steps"][k] == taken
