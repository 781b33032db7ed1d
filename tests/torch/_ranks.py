"""Two-process gloo groups for the distributed tests: each group meets on a rendezvous
file in its test's own folder (a free port found first can be taken by a test running
beside it under xdist before the group binds it), and each rank saves its results as
``rank{r}.pt`` there. A module's tests share one ``ranks`` fixture (module-scoped) and
form one xdist group (:func:`one_worker`), so its group runs once.

Starting a group (two interpreters importing torch) costs more than most scenarios run:
the modules named together in ``SHARED`` run their scenarios one after the other in one
group (:func:`shared_ranks`), each scenario's results (or its error) read by its own
module's tests."""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def one_worker(module: str):
    """The mark (a module's ``pytestmark``) that hands all the tests of ``module`` to one
    xdist worker as one unit. Without it ``--dist loadgroup`` hands tests out one by one,
    and every worker that receives one of the module's tests runs the module's two-rank
    fixture again: as many gloo groups, and as many chances of a rank dying, as workers."""
    return pytest.mark.xdist_group(f"ranks-{module}")


def step_and_record(p, out: dict) -> None:
    """``p.optimizer.step()`` on this rank, recorded as the distributed tests read it:
    ``out["outcomes"]`` gets None, or the refusal's ``(type name, message)``, and
    ``out["steps"]`` the accountant's steps after it."""
    try:
        p.optimizer.step()
        out["outcomes"].append(None)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        out["outcomes"].append((type(exc).__name__, str(exc)))
    out["steps"].append(p.accountant.steps)


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


def run_ranks(worker, folder: Path, world: int, timeout: float = 900.0) -> list:
    """``worker(rank, folder)`` in ``world`` processes; the results each rank saved. A rank
    that fails fails the test (``mp.spawn``'s join raises and ends the others); ranks still
    running after ``timeout`` seconds (a collective that never completes: gloo's own
    timeout is 30 minutes) are killed and the test fails, naming them, instead of holding
    the run until the CI's time limit."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.start_processes(worker, args=(str(folder),), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                p.kill()
                p.join()
            pytest.fail(f"ranks {alive} of {world} still running after {timeout:.0f} s: killed")
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


# group name -> the modules whose ``_scenario(rank, out_dir)`` run in it, in this order;
# the group's time limit is the sum of the modules' ``TIMEOUT``. The modules mark
# themselves ``one_worker(group)`` so that one xdist worker runs them all, the group once.
SHARED = {
    "shared-ddp": (
        "test_ddp_buffers", "test_ddp_autocast", "test_distributed_settings", "test_ddp",
        "test_distributed_one_rank_refusals", "test_distributed_late_writes",
        "test_distributed_ledger",
        # the environment variables and warning filter test_hf_distributed sets stay; the
        # group is gone after test_distributed_agreement's scenario
        "test_hf_distributed", "test_distributed_agreement",
    ),
    # test_hf_fsdp last: the environment variables and warning filter it sets stay
    "shared-fsdp": ("test_fsdp_planted", "test_fsdp_empty_batch", "test_distributed_misuse",
                    "test_fsdp", "test_fsdp_namedtuple_output", "test_hf_fsdp"),
}
_LAUNCHED: dict = {}  # group -> its ranks' results, or the error that ended its launch


def _shared_worker(rank: int, folder: str) -> None:
    """Join the group and run each scenario named in ``folder``'s ``scenarios.json`` in
    turn; save ``{module: ("ok", result) or ("error", traceback)}``. After a scenario
    fails the ranks may be out of step (one waiting in a collective): the rest are not
    run, and recorded as errors naming the one that failed."""
    with open(os.path.join(folder, "scenarios.json")) as f:
        names, world, limits = json.load(f)
    init_gloo(rank, world, folder)
    results: dict = {}
    try:
        failed = None
        for name in names:
            if failed is not None:
                results[name] = ("error", f"not run: the scenario of {failed} failed first")
                continue
            sub = os.path.join(folder, name)
            os.makedirs(sub, exist_ok=True)
            # each scenario within its module's TIMEOUT: a rank still in it then (a hang,
            # the bug some of them guard) dumps its stack and exits, which ends the group
            faulthandler.dump_traceback_later(limits[name], exit=True)
            try:
                results[name] = ("ok", importlib.import_module(name)._scenario(rank, sub))
            except Exception:  # noqa: BLE001 - reported by that module's tests
                results[name] = ("error", traceback.format_exc())
                failed = name
            finally:
                faulthandler.cancel_dump_traceback_later()
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
        if failed is not None:  # a failing rank does not wait for the others
            raise RuntimeError(f"the scenario of {failed} failed on rank {rank}:\n"
                               f"{results[failed][1]}")
    finally:
        close_gloo()


def shared_ranks(module: str, tmp_path_factory) -> list:
    """The results each rank's ``_scenario`` of ``module`` returned, from the one group
    that runs every scenario of ``module``'s entry in ``SHARED`` (started by the first of
    its modules to ask, in this xdist worker); of those modules, the ones that pytest
    collected in this session (imported), so that a run of one file does not run the
    scenarios of the others. A scenario that failed on a rank fails the tests that read
    it, with that rank's traceback."""
    group, names = next((g, v) for g, v in SHARED.items() if module in v)
    if group not in _LAUNCHED:
        runnable = {}
        for name in names:
            if name not in sys.modules:  # not collected in this session (a run of some files)
                continue
            try:
                runnable[name] = importlib.import_module(name)
            except pytest.skip.Exception:  # its module skips here (an extra not installed)
                continue
        timeout = sum(mod.TIMEOUT for mod in runnable.values())
        folder = tmp_path_factory.mktemp(group)
        with open(folder / "scenarios.json", "w") as f:
            json.dump([list(runnable), 2, {n: m.TIMEOUT for n, m in runnable.items()}], f)
        try:
            _LAUNCHED[group] = run_ranks(_shared_worker, folder, 2, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - kept, and re-raised to each module
            saved = [folder / f"rank{r}.pt" for r in range(2)]
            _LAUNCHED[group] = (
                [torch.load(p, weights_only=False) for p in saved]
                if all(p.exists() for p in saved) else exc
            )
    launched = _LAUNCHED[group]
    if isinstance(launched, BaseException):
        raise launched
    out = []
    for rank, res in enumerate(launched):
        status, value = res[module]
        if status != "ok":
            pytest.fail(f"rank {rank} of the shared group {group}:\n{value}")
        out.append(value)
    return out
