"""Two-process gloo groups for the distributed tests: each group meets on a rendezvous
file in its test's own folder (a free port found first can be taken by a test running
beside it under xdist before the group binds it), and each rank saves its results as
``rank{r}.pt`` there."""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_gloo(rank: int, world: int, folder: str) -> None:
    """Join the ``world``-process gloo group of the test whose folder is ``folder``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'rendezvous')}",
                            rank=rank, world_size=world)


def close_gloo() -> None:
    """Leave the group together: free what still holds it (DDP reducers, trainers in
    reference cycles) while the interpreter is alive, wait for the other ranks, then
    destroy it. A rank that tears its group down while another still works, or whose gloo
    threads outlive the interpreter's finalisation, aborts (SIGABRT) after its results are
    written. Called in a ``finally``: a rank that is failing does not wait for the others
    (they may wait in another collective); a rank that succeeded waits at most a minute."""
    gc.collect()
    if not dist.is_initialized():
        return
    try:
        if sys.exc_info()[0] is None:
            dist.monitored_barrier(timeout=timedelta(seconds=60))
    finally:
        dist.destroy_process_group()


def run_ranks(worker, folder: Path, world: int) -> list:
    """``worker(rank, folder)`` in ``world`` processes; the results each rank saved."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(worker, args=(str(folder),), nprocs=world, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]
