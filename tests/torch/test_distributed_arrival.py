"""make_private under torch.distributed (3 gloo processes) when a rank never calls it.

(a) Normal path: every rank calls make_private and gets its run (the bounded wait
    changes nothing when all ranks arrive).
(b) Rank 2 skips make_private (it sleeps past the timeout instead): ranks 0 and 1, which
    wait for it, raise ``RanksNotArrivedError`` within seconds, rank 0 naming rank 2,
    instead of waiting for gloo's own 30-minute timeout. Before the bounded wait they
    waited in make_private's first collective until rank 2 left the group (then a bare
    gloo RuntimeError, "Connection closed by peer") or gloo's timeout (a group still
    waiting is killed by the test's time limit, ``run_ranks(timeout=...)``).
"""

from __future__ import annotations

import gc
import os
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker(__name__)
WORLD = 3
TIMEOUT = 4.0  # seconds make_private waits for the ranks in (b)
SKIPS = 2  # the rank that does not call make_private in (b)


def _make_private(**timeout):
    from privlearn.torch import make_private

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(12, 3), torch.randint(0, 2, (12,)))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    return make_private(
        model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, seed=1, **timeout
    )


def _worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    results: dict = {}
    try:
        results["normal"] = type(_make_private()).__name__
        if rank == SKIPS:
            # busy elsewhere: never calls make_private, and stays in the group until the
            # ranks waiting for it have saved what they raised (at most a minute: after
            # that, leaving ends the wait of a rank that never stops waiting on its own)
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline and not all(
                    os.path.exists(os.path.join(out_dir, f"rank{r}.pt"))
                    for r in range(WORLD) if r != SKIPS):
                time.sleep(0.1)
            results["skipped"] = None
        else:
            start = time.monotonic()
            try:
                _make_private(agreement_timeout=TIMEOUT)
                results["skipped"] = ("no error", "", time.monotonic() - start)
            except Exception as exc:  # noqa: BLE001 - the type is what the test checks
                results["skipped"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:  # a monitored barrier that timed out closes the group's pairs: no
        gc.collect()  # closing barrier (close_gloo's), the group is destroyed as it is
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    # the old code waited in make_private's first collective for 30 minutes: killed here
    return run_ranks(_worker, tmp_path_factory.mktemp("arrival"), WORLD, timeout=120.0)


def test_every_rank_that_calls_make_private_gets_its_run(ranks):
    assert [r["normal"] for r in ranks] == ["PrivateTraining"] * WORLD


def test_ranks_waiting_for_a_rank_that_skipped_make_private_raise_in_time(ranks):
    from privlearn.errors import RanksNotArrivedError, TrainingLoopError

    assert issubclass(RanksNotArrivedError, TrainingLoopError)
    assert issubclass(RanksNotArrivedError, TimeoutError)
    for rank in range(WORLD):
        if rank == SKIPS:
            continue
        kind, said, waited = ranks[rank]["skipped"]
        assert kind == "RanksNotArrivedError", (rank, kind, said)
        assert waited < TIMEOUT + 30, waited  # bounded by the timeout, not gloo's 30 min
        assert f"agreement_timeout={TIMEOUT:g} s on rank {rank}" in said
        assert "every rank of a distributed run must call make_private" in said
    assert f"rank {SKIPS} of {WORLD} did not reach make_private" in ranks[0]["skipped"][1]
