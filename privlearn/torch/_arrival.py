"""Ranks that do not reach ``make_private``: a bounded wait, then a typed error.

``make_private`` on a distributed run starts with collectives of every rank (the check
that the ranks were given the same settings). A rank that never calls it (it skipped it,
or failed or stopped before it) would leave the others waiting in the first of them until
the process group's own timeout (30 minutes under gloo). So on a group whose backend is
gloo, every rank first joins ``torch.distributed.monitored_barrier`` with the run's
``agreement_timeout``: when some rank has not arrived within it, the waiting ranks raise
:class:`~privlearn.errors.RanksNotArrivedError`, the first rank of the group naming the
ranks that did not arrive (the others, which wait for the first rank's answer, say so),
before anything is released. One barrier per ``make_private``, none per step. A
barrier that timed out closes the group's connections: the group cannot be used after
it (destroy it and start again).

NCCL has no monitored barrier: there the wait is bounded by the group's own timeout (the
NCCL watchdog), as before.
"""

from __future__ import annotations

import re
from datetime import timedelta

from privlearn.errors import RanksNotArrivedError

__all__ = ["wait_for_ranks"]


def wait_for_ranks(process_group, timeout: float, what: str = "make_private",
                   given_to: str | None = None) -> bool:
    """Wait at most ``timeout`` seconds for every rank of ``process_group`` (None: the
    world) to reach this point of ``what``. Returns whether the wait was checked (False:
    a backend without a monitored barrier, such as NCCL, or one rank). ``given_to``:
    where the caller sets ``agreement_timeout``, for the message (default ``what``).

    Raises
    ------
    RanksNotArrivedError
        Some rank did not arrive within ``timeout`` (on the first rank: naming them), or
        the first rank did not confirm that all did (on the others).
    """
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    try:
        backend = str(dist.get_backend(process_group)).lower()
    except (RuntimeError, ValueError):  # an unknown group: its first collective says so
        return False
    if world == 1 or "gloo" not in backend:
        return False
    rank = dist.get_rank(process_group)
    try:
        dist.monitored_barrier(
            group=process_group, timeout=timedelta(seconds=timeout), wait_all_ranks=True
        )
    except RuntimeError as exc:
        said = str(exc)
        late = _late_ranks(said) if rank == 0 else []
        who = (
            f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} of {world} did not"
            if late
            else f"some rank of {world} did not (rank 0 names them in its error; rank 0 "
            "itself may not have)"
        )
        raise RanksNotArrivedError(
            f"{what} waited agreement_timeout={timeout:g} s on rank {rank} and {who} "
            f"reach {what}: every rank of a distributed run must call {what} (with the "
            "same arguments). Check that no rank skipped it, or failed or stopped before "
            "it (see that rank's own error), and that no rank is still busy (loading "
            f"data, compiling): if so, pass a larger agreement_timeout to {given_to or what}. "
            "Nothing was released; the process group cannot be used after this wait "
            "(destroy it and start again) (backend: "
            f"{said.strip()[:300]})"
        ) from exc
    return True


def _late_ranks(message: str) -> list[int]:
    """The ranks gloo's monitored barrier names as not having arrived ("Ranks 1, 2
    failed to pass monitoredBarrier")."""
    found = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", message)
    return [int(k) for k in re.findall(r"\d+", found.group(1))] if found else []
