"""Collectives that return only once the gloo worker thread has let go of their tensors.

A gloo collective runs on one of its process group's worker threads. The thread marks
the collective complete (``wait()`` returns, and the caller goes on) *before* it drops
its own references to the collective's tensors. A tensor made in Python (every tensor
privlearn passes) is tied to its Python object: PyTorch keeps that object alive while
C++ holds a second reference, and when the count falls from two to one, the thread
that drops the reference releases the Python object, which takes the GIL. If the
caller meanwhile frees the group's last reference (``destroy_process_group()`` and
then the DDP wrapper, whose reducer holds the group), ``ProcessGroupGloo``'s destructor
joins its worker threads while the caller holds the GIL, and the worker waits for the
GIL for ever: the run prints its result and hangs at exit. The step's last all-reduce
(the noisy sums) comes a millisecond or two before a training loop's teardown, so on a
busy machine the multi-GPU tutorial hung so in about one run in six.

Each collective here holds one more C++ reference to its tensors (a TorchScript list of
them) while it runs and after it returns, until the worker has dropped its own: the
worker's decrements then never reach one, so it never needs the GIL, and the caller's
thread, which holds the GIL, releases the Python objects when it drops the list. The
wait is for a thread that needs nothing from the caller (microseconds; bounded all the
same). The work also drops the thread-local state it captured, which may hold Python
objects (torch stashes one there during ``backward()``), before the tensors: the wait,
which yields the GIL once it lasts, sees that drop done too.

Only gloo groups are settled: NCCL's watchdog keeps a collective's tensors until the
device has run it, and waiting for that would add a device synchronisation per step.
"""

from __future__ import annotations

import time

import torch

__all__ = ["all_reduce", "broadcast", "reduce_scatter", "settled"]

#: seconds to wait at most for a worker thread to drop a collective's tensors; a hold not
#: released by then (or whose collective failed) is kept in :data:`_LATE`, and dropped by a
#: later collective once the worker let go: it stays safe to free the group meanwhile
PATIENCE = 5.0

#: holds kept past their collective (its worker had not let go in time, or it failed)
_LATE: list = []


def _is_gloo(group) -> bool:
    import torch.distributed as dist

    try:
        return "gloo" in str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):  # an unknown group: its collective says so
        return False


class settled:
    """Context manager around one collective on ``tensors`` (the very tensor objects the
    collective is given) over ``group``: on a gloo group, an extra C++ reference to each
    is held from before the collective until the worker thread has dropped its own
    (module docstring). Elsewhere, or without TorchScript lists, it does nothing."""

    def __init__(self, tensors, group=None):
        self.tensors = list(tensors)
        self.group = group
        self.hold = None
        self.counts: list[int] = []

    def __enter__(self) -> settled:
        script_list = getattr(torch._C, "ScriptList", None)
        if script_list is None or not self.tensors or not _is_gloo(self.group):
            return self
        if not all(hasattr(t, "_use_count") for t in self.tensors):
            return self
        self.hold = script_list(self.tensors)
        self.counts = [t._use_count() for t in self.tensors]
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.hold is None:
            return
        _drop_late()
        hold, self.hold = self.hold, None
        late = (hold, self.tensors, self.counts)
        if kind is not None:  # a failed collective may be left running: do not wait for it
            _LATE.append(late)
            return
        deadline = time.monotonic() + PATIENCE
        spins, pause = 0, 1e-5
        while not _free(self.tensors, self.counts):
            if time.monotonic() > deadline:
                _LATE.append(late)
                return
            spins += 1
            if spins > 200:  # the worker was descheduled: yield the CPU to it (it needs
                time.sleep(pause)  # no GIL, so spinning with it held blocks nothing)
                pause = min(2 * pause, 1e-3)
        # here, holding the GIL, this thread drops the last C++ references (``hold``)


def _free(tensors, counts) -> bool:
    """Whether nothing but the caller's own references (and the hold) is left."""
    return all(t._use_count() <= c for t, c in zip(tensors, counts, strict=True))


def _drop_late() -> None:
    _LATE[:] = [late for late in _LATE if not _free(late[1], late[2])]


def all_reduce(tensor: torch.Tensor, group=None, op=None) -> None:
    """``torch.distributed.all_reduce`` of ``tensor`` over ``group`` (``op``: the sum when
    None), returning once gloo's worker let go of it (module docstring)."""
    import torch.distributed as dist

    with settled([tensor], group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """``torch.distributed.broadcast`` of ``tensor`` from global rank ``src``, settled."""
    import torch.distributed as dist

    with settled([tensor], group):
        dist.broadcast(tensor, src=src, group=group)


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, group=None) -> None:
    """The sum over ``group`` of the flat tensors ``flat``, each rank receiving its
    ``output``-sized part (``reduce_scatter_tensor``), settled."""
    import torch.distributed as dist

    call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with settled([output, flat], group):
        call(output, flat, group=group)
