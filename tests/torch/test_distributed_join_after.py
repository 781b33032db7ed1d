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
"""

from __future__ import annotations

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


CASES = ("ddp_join", "torch_join", "holder", "disabled")


def _worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        res = {case: _join(case, rank) for case in CASES}
        res["skipped"] = _skipped(rank)
        dist.barrier()
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("join_after"), WORLD, timeout=240.0)


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
