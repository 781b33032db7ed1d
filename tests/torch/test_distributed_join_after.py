"""Uneven-input joins and skipped steps under make_private (2 gloo processes).

(a) A ``DistributedDataParallel`` wrapper made *after* make_private (as accelerate's
    ``prepare`` does when it comes second), inside ``ddp.join()``, inside torch's own
    ``Join([ddp])`` (what accelerate's ``Accelerator.join_uneven_inputs`` builds), and
    around a module that holds the private model: rank 1 leaves its loop two batches
    early, as a join allows. Refused at the first step on both ranks, typed, nothing
    released or accounted (before, both ranks released two steps, then rank 1's join
    shadowed rank 0's next collectives with its own all-reduces: gloo aborted rank 0's
    process on the size mismatch). A new wrapper without a join then trains on both.
    ``Join(..., enable=False)`` (no shadowing at all) trains.
(b) Rank 1 skipping ``step()`` for one batch (and calling it once more after its loop, so
    both make as many calls): every step from the skip on is refused on both ranks (their
    draws differ), never released with two draws side by side; both ranks end with the
    one step before the skip accounted and the same parameters.
(c) p.data_loader cut again between the ranks (each keeping every other batch, as
    accelerate's ``prepare`` of a loader does): every step refused on both ranks.
(d) DDP's gradient accumulation (a batch's backward inside ``no_sync()``, the next
    batch's outside, one step): refused on both ranks, nothing accounted.
(e) The state of a one-process run at the same sampling rate loaded on both ranks:
    refused on both (its world size and rank are not theirs).
"""

from __future__ import annotations

import contextlib
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import close_gloo, init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [one_worker(__name__), pytest.mark.slow]
WORLD = 2
N = 40
B = 5  # per rank: q = W B / N = 0.25, 4 batches an epoch


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class _Holder(nn.Module):
    """A module around the private model (its wrapper is then not the model's parent)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
    )


def _flat(model) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1).double().clone() for q in model.parameters()])


def _private():
    from privlearn.torch import make_private

    model = _mlp()
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        torch.utils.data.DataLoader(_data(), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        seed=11,
        agreement_timeout=60,
    )


def _epoch(p, run, rank: int, stop: int | None = None) -> None:
    for k, (x, y) in enumerate(p.data_loader):
        if stop is not None and rank == 1 and k == stop:
            break  # rank 1's inputs end early: what a join is for
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(run(x), y).backward()
        p.optimizer.step()


def _join(case: str, rank: int) -> dict:
    from torch.distributed.algorithms import Join

    p = _private()
    start = _flat(p.model)
    ddp = nn.parallel.DistributedDataParallel(_Holder(p.model) if case == "holder" else p.model)
    ctx = {
        "ddp_join": ddp.join,
        "torch_join": lambda: Join([ddp]),
        "holder": lambda: Join([ddp]),
        "disabled": lambda: Join([ddp], enable=False),
    }[case]()
    out = dict(refused=None)
    try:
        with ctx:
            _epoch(p, ddp, rank, stop=None if case == "disabled" else 2)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        out.update(refused=type(exc).__name__, message=str(exc))
    out.update(steps=p.accountant.steps, moved=float((_flat(p.model) - start).abs().max()))
    if case == "ddp_join":  # a new wrapper, no join: trains
        _epoch(p, nn.parallel.DistributedDataParallel(p.model), rank)
        out.update(after=p.accountant.steps, params=_flat(p.model))
    return out


def _skipped(rank: int) -> dict:
    p = _private()
    outcomes, params = [], []
    calls = 0
    for k, (x, y) in enumerate(p.data_loader):
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        if rank == 1 and k == 1:
            continue  # rank 1 skips this batch's step
        calls += 1
        try:
            p.optimizer.step()
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001
            outcomes.append(type(exc).__name__)
        params.append(_flat(p.model))
    if rank == 1:  # as many step() calls as rank 0: the ranks leave together
        try:
            p.optimizer.step()
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001
            outcomes.append(type(exc).__name__)
        params.append(_flat(p.model))
    return dict(outcomes=outcomes, params=params, steps=p.accountant.steps)


def _resharded(rank: int) -> dict:
    """p.data_loader cut again between the ranks, each keeping every W-th batch (what
    accelerate's ``prepare`` of a loader does): each rank's steps train on another draw
    than the other's."""
    p = _private()
    start, outcomes = _flat(p.model), []
    for k, (x, y) in enumerate(p.data_loader):
        if k % WORLD != rank:
            continue
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        try:
            p.optimizer.step()
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001
            outcomes.append(type(exc).__name__)
    return dict(
        outcomes=outcomes,
        steps=p.accountant.steps,
        moved=float((_flat(p.model) - start).abs().max()),
    )


def _accumulated(rank: int) -> dict:
    """DDP's gradient accumulation: a batch's backward inside ``no_sync()``, the next
    batch's outside it, one step for both."""
    from privlearn.torch import make_private

    ddp = nn.parallel.DistributedDataParallel(_mlp())
    p = make_private(
        ddp,
        torch.optim.SGD(ddp.parameters(), lr=0.5),
        torch.utils.data.DataLoader(_data(), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        seed=11,
    )
    out = dict(refused=None)
    it = iter(p.data_loader)
    try:
        for k in range(2):
            x, y = next(it)
            with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                nn.functional.cross_entropy(ddp(x), y).backward()
        p.optimizer.step()
    except Exception as exc:  # noqa: BLE001
        out.update(refused=type(exc).__name__, message=str(exc))
    out["steps"] = p.accountant.steps
    return out


def _single_resumed(out_dir: str) -> dict:
    """Both ranks load the state of a one-process run at the same sampling rate."""
    p = _private()
    state = torch.load(os.path.join(out_dir, "single.pt"), weights_only=False)
    try:
        p.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001
        return dict(refused=type(exc).__name__, message=str(exc), steps=p.accountant.steps)
    return dict(refused=None, steps=p.accountant.steps)


CASES = ("ddp_join", "torch_join", "holder", "disabled")


def _worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        res = {case: _join(case, rank) for case in CASES}
        res["skipped"] = _skipped(rank)
        res["resharded"] = _resharded(rank)
        res["accumulated"] = _accumulated(rank)
        res["single_resumed"] = _single_resumed(out_dir)
        dist.barrier()
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("join_after")
    from privlearn.torch import make_private

    model = _mlp()  # one process, the global batch: the ranks' sampling rate
    single = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        torch.utils.data.DataLoader(_data(), batch_size=WORLD * B),
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        seed=11,
    )
    x, y = next(iter(single.data_loader))
    nn.functional.cross_entropy(single.model(x), y).backward()
    single.optimizer.step()
    torch.save(single.state_dict(), folder / "single.pt")
    return run_ranks(_worker, folder, WORLD, timeout=240.0)


@pytest.mark.parametrize("case", ["ddp_join", "torch_join", "holder"])
def test_a_join_around_a_wrapper_made_later_is_refused_on_every_rank(ranks, case):
    for rank in range(WORLD):
        r = ranks[rank][case]
        assert r["refused"] == "TrainingLoopError", (rank, r)
        assert "join" in r["message"] and "uneven inputs" in r["message"], r["message"]
        assert r["steps"] == 0 and r["moved"] == 0.0, (rank, r)


def test_a_new_wrapper_without_join_trains_after_the_refusal(ranks):
    r0, r1 = ranks[0]["ddp_join"], ranks[1]["ddp_join"]
    assert r0["after"] == r1["after"] == N // (WORLD * B)
    assert torch.equal(r0["params"], r1["params"])
    assert float((r0["params"] - _flat(_mlp())).abs().max()) > 1e-3


def test_a_disabled_join_trains(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["disabled"]
        assert r["refused"] is None and r["steps"] == N // (WORLD * B), (rank, r)
        assert r["moved"] > 1e-3


def test_a_step_skipped_on_one_rank_is_never_released_out_of_step(ranks):
    r0, r1 = ranks[0]["skipped"], ranks[1]["skipped"]
    calls = N // (WORLD * B)
    assert len(r0["outcomes"]) == len(r1["outcomes"]) == calls
    # the first step released on both; every later one refused on both
    assert r0["outcomes"][0] is None and r1["outcomes"][0] is None
    assert all(o is not None for o in r0["outcomes"][1:] + r1["outcomes"][1:])
    assert r0["steps"] == r1["steps"] == 1
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)


def test_a_private_loader_cut_again_between_the_ranks_releases_nothing(ranks):
    """Each rank keeping every other batch of p.data_loader (accelerate's sharding of a
    prepared loader): the ranks' draws differ at every step, so every step is refused on
    both ranks and nothing is released or accounted."""
    for rank in range(WORLD):
        r = ranks[rank]["resharded"]
        assert r["outcomes"] and all(o == "TrainingLoopError" for o in r["outcomes"]), r
        assert r["steps"] == 0 and r["moved"] == 0.0, r


def test_ddp_no_sync_accumulation_over_two_batches_is_refused_on_every_rank(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["accumulated"]
        assert r["refused"] == "TrainingLoopError" and r["steps"] == 0, (rank, r)
        assert "backward()" in r["message"]


def test_a_one_process_state_resumed_on_two_ranks_is_refused_on_every_rank(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["single_resumed"]
        assert r["refused"] == "ConfigurationError" and r["steps"] == 0, (rank, r)
    assert "world_size" in ranks[0]["single_resumed"]["message"]
