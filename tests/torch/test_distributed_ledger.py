"""make_private(ledger=...) under torch.distributed (2 gloo processes): the run is one
mechanism, so the ledger is charged once for it, by the group's first rank, against the
closed form of the run (a composition of subsampled Gaussian steps at the global rate
q = W B / N).

(a) A planned run, the same budget handle on both ranks: one reservation and one
    settlement in the ledger; the spend equals one run's epsilon (each rank reserving
    its own copy would charge the composition of two runs).
(b) The ledger given on rank 0 only (None on rank 1): the same single record.
(c) Steps reserved as they run (no plan, ``ledger_chunk=2``, another chunk on rank 1):
    five steps take three chunk reservations, made by rank 0 at the same steps on which
    rank 1 follows it; settled, the spend is five steps' epsilon.
(d) A planned run the budget cannot hold: refused with ``BudgetExceededError`` on both
    ranks before any step (rank 1 does not wait for a reservation that never comes).
(e) The ledger given on rank 1 only: refused on both ranks (its budget would never be
    charged).
"""

from __future__ import annotations

import functools
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import close_gloo, init_gloo, one_worker, run_ranks, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
N = 32
B = 4  # per rank: q = W B / N = 1/4, 4 steps per epoch
SIGMA = 1.0
DELTA = 1e-5
TIMEOUT = 900.0  # run_ranks' default


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(N, 5, generator=g),
                                          torch.randint(0, 2, (N,), generator=g))


def _budget(folder: str, name: str, rank: int, epsilon: float = 50.0):
    """Rank 0 creates the ledger of ``name``; every rank then opens a handle on it."""
    from privlearn.ledger import Ledger

    path = os.path.join(folder, f"{name}.db")
    if rank == 0:
        Ledger(path, create=True).create_budget("toy", epsilon=epsilon, delta=DELTA)
    dist.barrier()
    return Ledger(path).budget("toy")


def _run(handle, steps: int | None = None, **kw) -> dict:
    """make_private with ``handle`` (or None), ``steps`` steps, finish(); what happened."""
    from privlearn.torch import make_private

    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    plan = {} if steps is None else {"steps": steps}
    try:
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         torch.utils.data.DataLoader(_data(), batch_size=B),
                         noise_multiplier=SIGMA, max_grad_norm=1.0, seed=0, ledger=handle,
                         **plan, **kw)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return dict(refused=type(exc).__name__, message=str(exc))
    done = 0
    while done < (steps or 5):
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            done += 1
            if done == (steps or 5):
                break
    p.finish()
    return dict(refused=None, steps=p.accountant.steps, rate=p.sampling_rate,
                epsilon=p.epsilon(DELTA))


def _record(handle) -> dict:
    return dict(kinds=[e.kind for e in handle.history()],
                spent=handle.spent().epsilon_spent)


#: case -> (budget epsilon, rank 0's handle?, rank 1's handle?, make_private keywords)
CASES = {
    "both": (50.0, True, True, {"steps": 4}),
    "first": (50.0, True, False, {"steps": 4}),
    "chunks": (50.0, True, True, {"ledger_chunk": (2, 1000)}),
    "exceeded": (0.5, True, True, {"steps": 40}),
    "second": (50.0, False, True, {"steps": 4}),
}


def _cases(rank: int, out_dir: str, cases: tuple[str, ...]) -> dict:
    res = {}
    for case in cases:
        epsilon, first, second, kw = CASES[case]
        h = _budget(out_dir, case, rank, epsilon)
        kw = {k: v[rank] if isinstance(v, tuple) else v for k, v in kw.items()}
        res[case] = _run(h if (first, second)[rank] else None, **kw)
        dist.barrier()
        res[case]["ledger"] = _record(h)
    return res


def _scenario(rank: int, out_dir: str) -> dict:
    """The essential case alone (the default suite), on ``rank`` of the shared group
    (``_ranks.SHARED``)."""
    return _cases(rank, out_dir, ("both",))


def _worker(rank: int, out_dir: str, cases: tuple[str, ...]) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        torch.save(_cases(rank, out_dir, cases), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


@pytest.fixture(scope="module")
def all_ranks(tmp_path_factory):
    return run_ranks(functools.partial(_worker, cases=tuple(CASES)),
                     tmp_path_factory.mktemp("ledger_all"), WORLD)


def _one_run_epsilon(steps: int) -> float:
    from privlearn.accounting import Gaussian, compose, subsample

    return compose(subsample(Gaussian(SIGMA), rate=WORLD * B / N), steps=steps).epsilon(DELTA)


def test_a_distributed_run_is_recorded_once(ranks):
    _recorded_once(ranks, "both")


@pytest.mark.slow
def test_a_ledger_on_the_first_rank_only_records_the_run_once(all_ranks):
    _recorded_once(all_ranks, "first")


def _recorded_once(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["refused"] is None and r1["refused"] is None, (r0, r1)
    assert r0["rate"] == WORLD * B / N and r0["steps"] == r1["steps"] == 4
    one_run = _one_run_epsilon(4)
    assert r0["epsilon"] == r1["epsilon"] == pytest.approx(one_run, rel=1e-9)
    for rank in range(WORLD):  # both ranks read the same ledger
        led = ranks[rank][case]["ledger"]
        assert led["kinds"] == ["budget", "reserve", "settle"]
        assert led["spent"] == pytest.approx(one_run, rel=1e-9)


@pytest.mark.slow
def test_chunks_reserved_as_the_run_goes_are_recorded_once(all_ranks):
    r0, r1 = all_ranks[0]["chunks"], all_ranks[1]["chunks"]
    assert r0["refused"] is None and r1["refused"] is None, (r0, r1)
    assert r0["steps"] == r1["steps"] == 5
    # rank 0's chunks of 2 steps: 2 + 2 + 1 steps ran in three reservations
    kinds = r0["ledger"]["kinds"]
    assert kinds.count("reserve") == kinds.count("settle") == 3 and len(kinds) == 7
    assert r0["ledger"]["spent"] == pytest.approx(_one_run_epsilon(5), rel=1e-6)


@pytest.mark.slow
def test_a_budget_that_cannot_hold_the_run_refuses_it_on_every_rank(all_ranks):
    for rank in range(WORLD):
        r = all_ranks[rank]["exceeded"]
        assert r["refused"] == "BudgetExceededError", (rank, r)


@pytest.mark.slow
def test_a_ledger_only_on_another_rank_than_the_first_is_refused(all_ranks):
    for rank in range(WORLD):
        r = all_ranks[rank]["second"]
        assert r["refused"] == "ConfigurationError", (rank, r)
        assert "rank 0" in r["message"]
        assert r["ledger"]["kinds"] == ["budget"]
