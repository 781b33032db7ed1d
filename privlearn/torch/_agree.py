"""Ranks that refuse a step together: a refusal on one rank is a refusal on all.

The ranks of a distributed run release one gradient per step: the all-reduce (or, under
FSDP2, the unshard and reduce-scatter) of their noisy clipped sums. A rank whose step
is refused before that collective (its batch holds a NaN, it called ``step()`` without a
new batch, a check of its own state failed) raises, and the others would wait in the
collective for it forever (gloo: until the group's timeout; NCCL: a watchdog abort after
up to 30 minutes). So before each collective of a step every rank joins one small
all-reduce of its status: whether its step was refused, its released steps, the draw
of the loader it trains on, the phase of the run it is in (``load_state_dict`` joins
the same exchange first: a rank loading a state while another steps, each in its own
collective, would wait for the other for ever) and its step's noise multiplier and
clipping bound (changed on one rank only, each rank's accountant would record its own
values while the released sum mixes them), and a code of its gradient buffers' dtypes
and lengths. A rank that refused joins it from its
error; when any rank refused, or the ranks differ in step, draw, phase or mechanism,
every rank raises the same typed error naming the ranks and their causes, before
anything is released, accounted or drawn from the noise.

The status is a CPU tensor of ``8 W`` integers reduced over a CPU-capable group
(the run's own group when its backend is gloo or MPI, else a gloo group of the same
ranks made with the optimizer): reading it back waits for the other ranks, never for an
accelerator, so a steady step gains one small host-side collective and no device read.
Only a refusal gathers the ranks' messages (one ``all_gather_object``).
"""

from __future__ import annotations

import builtins

import torch

from privlearn import errors
from privlearn.errors import TrainingLoopError
from privlearn.torch import _join_guard
from privlearn.torch import _settle as settle

__all__ = ["Agreement", "StepAgreement", "PHASES", "layout_code"]

#: the phases of a run the ranks' status names (each rank's, summed into its own slot)
PHASES = {0: "optimizer.step()", 1: "load_state_dict",  # 2, 3: FSDP2 (_forward_meet)
          2: "a training forward of the model", 3: "a training backward of the model"}


def _cpu_group(process_group):
    """A group of the same ranks as ``process_group`` (None: the world) that reduces CPU
    tensors: itself when its backend does, else a new gloo group (made collectively, by
    every rank of the group, as make_private is called)."""
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(process_group)).lower()
    except Exception:  # noqa: BLE001 - an unknown group: try a gloo one below
        backend = ""
    if "gloo" in backend or backend == "mpi":
        return process_group
    if not dist.is_gloo_available():
        return None
    from torch.distributed.distributed_c10d import _get_default_group

    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    default = _get_default_group()
    made = _CPU_GROUPS.get(ranks)
    if made is None or made[0] is not default:  # one per group and initialisation; every
        group = (dist.new_group(backend="gloo") if process_group is None else  # rank asks
                 dist.new_group(ranks=list(ranks), backend="gloo",           # in one order
                                use_local_synchronization=True))
        made = _CPU_GROUPS[ranks] = (default, group)
    return made[1]


#: the gloo groups made for the status of runs whose own group reduces no CPU tensor
_CPU_GROUPS: dict = {}


class Agreement:
    """The ranks' status exchange of one distributed DP optimizer (module docstring).

    Parameters
    ----------
    process_group : optional
        The run's torch.distributed group (None: the world).
    world_size : int
    """

    def __init__(self, process_group, world_size: int):
        import torch.distributed as dist

        self.world = int(world_size)
        self.rank = dist.get_rank(process_group)
        self.group = _cpu_group(process_group)
        self.exchanges = 0  #: the status exchanges joined so far (_forward_meet reads it)
        #: where the status tensor lives: the CPU, or (no CPU-capable group) the
        #: accelerator of the run's group, whose read then waits for the device
        self.device = torch.device("cpu")
        if self.group is None:
            self.group = process_group
            backend = str(dist.get_backend(process_group))
            if "nccl" in backend and torch.cuda.is_available():
                self.device = torch.device("cuda", torch.cuda.current_device())

    def agree(self, error: BaseException | None, steps: int, draw: int, flag: bool = False,
              what: str = "optimizer.step()", phase: int = 0,
              mechanism: tuple[float, float] | None = None, layout: int = 0) -> bool:
        """Join the ranks' status exchange with this rank's ``error`` (None: its step may
        go on), its released ``steps``, the ``draw`` it trains on (-1: none), a ``flag``,
        the ``phase`` of the run it is in (:data:`PHASES`: 0 a step, 1 a
        ``load_state_dict``), the ``mechanism`` of its step (noise multiplier,
        clipping bound; compared bit for bit) and a code of its gradient buffers'
        ``layout`` (:func:`layout_code`). Returns, when every rank may go on,
        whether any rank raised its flag; otherwise raises on every rank (from ``error``
        here).

        Raises
        ------
        Exception
            Some rank refused: the refusing ranks' error type when they share one of
            privlearn's (or a built-in) types, else :class:`TrainingLoopError`, naming
            every refusing rank and its cause; the ranks at different steps or draws, or
            in different phases (a rank loading a state while another steps, each in its
            own collective, would wait for the other for ever), or with different noise
            multipliers or clipping bounds (one changed on some ranks only), or with
            gradient buffers of different layouts (a parameter frozen, or the model
            cast, on some ranks only: the all-reduce of the buffers would fail or
            abort): :class:`TrainingLoopError` naming each rank's.
        """
        import torch.distributed as dist

        w, r = self.world, self.rank
        self.exchanges += 1
        mine = [0] * (8 * w)
        mine[7 * w + r] = layout
        mine[r], mine[w + r] = int(error is not None), steps
        mine[2 * w + r], mine[3 * w + r], mine[4 * w + r] = draw, int(flag), phase
        if mechanism is not None:  # each float's 64 bits, summed into its own slot
            bits = torch.tensor([float(v) for v in mechanism], dtype=torch.float64)
            mine[5 * w + r], mine[6 * w + r] = bits.view(torch.int64).tolist()
        status = torch.tensor(mine, dtype=torch.int64, device=self.device)
        try:
            settle.all_reduce(status, group=self.group)  # returns once gloo let go of it
        except RuntimeError as exc:  # gloo: a rank that left the group fails it at once
            raise _left(what, steps, exc) from exc
        seen = status.tolist()  # a CPU tensor: waits for the ranks, not for a device
        refused = [k for k in range(w) if seen[k]]
        steps_of, draws_of = seen[w:2 * w], seen[2 * w:3 * w]
        apart = None
        if len(set(seen[4 * w:5 * w])) > 1:
            apart = _apart(what, [PHASES.get(k, str(k)) for k in seen[4 * w:5 * w]])
        elif len(set(zip(seen[5 * w:6 * w], seen[6 * w:7 * w], strict=True))) > 1:
            apart = _mixed(what, seen[5 * w:6 * w], seen[6 * w:7 * w])
        elif len(set(seen[7 * w:])) > 1:
            apart = _reshaped(what)
        if apart is not None:
            if error is not None:
                raise apart from error
            raise apart
        if not refused and len(set(steps_of)) == 1 and len(set(draws_of)) == 1:
            return any(seen[3 * w:4 * w])
        if not refused:
            where = ", ".join(f"rank {k}: {s} steps taken, training draw {d}"
                              for k, (s, d) in enumerate(zip(steps_of, draws_of, strict=True)))
            raise _everywhere(
                f"{what} was refused on every rank: the {w} ranks are not at the same step "
                f"({where}). "
                "Every rank must call step() once per batch of p.data_loader, all together: "
                "a rank that skipped a step (after catching an error raised on it alone, "
                "outside step()) or called it an extra time would add its gradient to "
                "another step of the other ranks. Nothing was released or accounted on any "
                "rank; each rank's batch stays pending until its loader delivers the next")
        mine = None if error is None else (type(error).__name__, str(error))
        gathered: list = [None] * w
        dist.all_gather_object(gathered, mine, group=self.group)
        causes = [(k, gathered[k]) for k in refused if gathered[k] is not None]
        exc = _collective_error(causes, what, w)
        if error is not None:
            raise exc from error
        raise exc


def _everywhere(message: str) -> TrainingLoopError:
    """A refusal every rank raises alike (no rank refused first: ``refused_ranks`` empty)."""
    exc = TrainingLoopError(message)
    exc.refused_ranks = []
    return exc


def _apart(what: str, phases: list) -> TrainingLoopError:
    """The error of ranks in different phases of the run (each rank's ``phases``)."""
    where = ", ".join(f"rank {k}: {p}" for k, p in enumerate(phases))
    if PHASES[2] in phases or PHASES[3] in phases:
        return _everywhere(
            f"{what} was refused on every rank: the ranks are not at the same point of the "
            f"step ({where}). Under FSDP2 (fully_shard) every forward and backward pass is "
            "a collective of all the ranks (its all-gathers), so every rank must run each "
            "batch of p.data_loader through the model, an empty Poisson batch (zero rows) "
            "too: a rank that skips the forward or backward of its empty batch and calls "
            "optimizer.step() alone would meet the other ranks' all-gathers and wait for "
            "ever. Run the forward and backward on every rank whatever its batch size (an "
            "empty batch's clipped sum is zero: its step adds the noise alone). Nothing was "
            "released or accounted on any rank")
    return _everywhere(
        f"{what} was refused on every rank: the ranks are not at the same point of the run "
        f"({where}). A distributed run's ranks load a state together and step together: "
        "call p.load_state_dict (or make_private(resume=...)) on every rank, each with "
        "the state its own rank saved (p.state_dict() on every rank, one file per rank), "
        "before the first step. Nothing was loaded, released or accounted on any rank")


def _mixed(what: str, sigmas: list, bounds: list) -> TrainingLoopError:
    """The error of ranks whose steps have different noise multipliers or clipping bounds
    (each rank's, as the bits of a float64)."""
    def floats(bits):
        return torch.tensor(bits, dtype=torch.int64).view(torch.float64).tolist()

    where = ", ".join(f"rank {k}: noise_multiplier {s!r}, max_grad_norm {c!r}" for k, (s, c)
                      in enumerate(zip(floats(sigmas), floats(bounds), strict=True)))
    return _everywhere(
        f"{what} was refused on every rank: the ranks' steps have different noise "
        f"multipliers or clipping bounds ({where}). Each rank adds its share of the noise "
        "at its own noise multiplier and clips at its own bound, and its accountant records "
        "its own values, while the released sum mixes them: a rank that raised its noise "
        "multiplier, or lowered its bound, alone would report an epsilon the run does not "
        "have. Set p.optimizer.noise_multiplier and p.optimizer.max_grad_norm on every "
        "rank alike (not inside an if rank == 0: block). Nothing was released or accounted "
        "on any rank")


def layout_code(groups, numels) -> int:
    """A 32-bit code of the gradient buffers a step all-reduces: each buffer's dtype and
    length (``groups``: ``(device, dtype, indices)``; ``numels``: each parameter's
    number of elements), the same on every rank of a run whose ranks train the same
    parameters at the same dtypes (devices are left out: each rank has its own)."""
    import zlib

    return zlib.crc32(repr([(str(dt), sum(numels[j] for j in ix))
                            for _, dt, ix in groups]).encode())


def _reshaped(what: str) -> TrainingLoopError:
    """The error of ranks whose gradient buffers differ in dtype or length."""
    return _everywhere(
        f"{what} was refused on every rank: the ranks' trainable parameters differ (their "
        "gradient buffers have other dtypes or lengths): a parameter was frozen or "
        "unfrozen, or the model cast to another dtype, on some ranks only (under an if "
        "rank == 0: block), after make_private. The all-reduce of the noisy sums would "
        "fail or abort the process. Make the same change on every rank. Nothing was "
        "released or accounted on any rank")


def _left(what: str, steps: int, cause: BaseException) -> TrainingLoopError:
    """The error of a status exchange that failed: another rank is gone."""
    return _everywhere(
        f"{what} could not reach the other ranks after {steps} steps ({cause}): a rank left "
        "the process group or failed, e.g. its loop ended while this one called step() "
        "once more. Every rank must call step() as many times as the others, once per "
        "batch of p.data_loader. Nothing of this step was released or accounted here")


def _collective_error(causes: list, what: str, world: int) -> BaseException:
    """The one error every rank raises for ``causes`` (``(rank, (type name, message))``)."""
    names = {name for _, (name, _) in causes}
    cls = TrainingLoopError
    if len(names) == 1:
        name = next(iter(names))
        found = getattr(errors, name, None) or getattr(builtins, name, None)
        if isinstance(found, type) and issubclass(found, Exception):
            cls = found
    ranks = [k for k, _ in causes]
    shown = "; ".join(f"rank {k}: {name}: {msg[:800]}" for k, (name, msg) in causes)
    message = (
        f"{what} was refused on rank(s) {ranks} of {world}, so it is refused on every rank "
        "(the ranks release one all-reduced gradient together; a rank going on alone would "
        f"wait for the refusing one forever). {shown}. No rank released, drew noise for or "
        "accounted this step; each rank's batch stays pending until its loader delivers "
        "the next, so the ranks go on together from the next batch")
    try:
        exc = cls(message)
    except Exception:  # noqa: BLE001 - a type that needs more than a message
        exc = TrainingLoopError(message)
    exc.refused_ranks = ranks
    return exc


class StepAgreement:
    """The DP optimizer's side of the agreement (a mixin of
    :class:`~privlearn.torch.optimizer.DPOptimizer`): it reads ``world_size``,
    ``process_group``, ``accountant``, ``sampler``, ``noise_multiplier``,
    ``max_grad_norm``, ``_groups`` and ``_numels`` and keeps ``_agreement``."""

    def _init_agreement(self) -> None:
        self._agreement = (Agreement(self.process_group, self.world_size)
                           if self.world_size > 1 else None)

    def _status(self) -> tuple[int, int]:
        drawn = self.sampler.pending() if self.sampler is not None else None
        return self.accountant.steps, -1 if drawn is None else drawn.index

    def _agree(self, flag: bool = False) -> bool:
        """Before a collective of the step: go on only if every rank goes on; returns
        whether any rank raised ``flag`` (one process: ``flag``)."""
        if self._agreement is None:
            return flag
        joined = _join_guard.refusal(self.tracker.model)  # refused on every rank at once
        return self._agreement.agree(joined, *self._status(), flag=flag,
                                     mechanism=(self.noise_multiplier, self.max_grad_norm),
                                     layout=layout_code(self._groups, self._numels))

    def _agree_on_load(self, error: BaseException | None, saved: int | None = None) -> None:
        """``load_state_dict``'s exchange: every rank loads (a rank stepping meanwhile is
        refused with this one, not left waiting in its own collective), then any rank's
        refusal of its state (``error``) is raised on every rank, and so are states
        saved after different numbers of steps (``saved``: this rank's, None when its
        state has none): each rank would go on from its own step, and every later step
        would be refused as out of step."""
        from privlearn.torch.distributed import refuse_on_every_rank

        if self._agreement is not None:
            import torch.distributed as dist

            self._agreement.agree(None, 0, -1, what="load_state_dict", phase=1)
            counts: list = [None] * self.world_size
            dist.all_gather_object(counts, saved, group=self._agreement.group)
            # only counts: a malformed one (unhashable, say) is its own rank's refusal,
            # raised on every rank below, not a TypeError here that leaves that rank waiting
            if error is None and len({c for c in counts if type(c) is int}) > 1:
                error = errors.ConfigurationError(
                    "load_state_dict was refused on every rank: the ranks' states were "
                    "saved after different numbers of steps ("
                    + ", ".join(f"rank {k}: {c}" for k, c in enumerate(counts))
                    + "), so each rank would go on from its own step while the ranks "
                    "release one gradient per step together. Load on every rank the state "
                    "it saved at the same step (save them all right after the same "
                    "optimizer step). Nothing was loaded on any rank")
        refuse_on_every_rank(error, "load_state_dict", self.process_group)

    def _refuse_together(self, error: BaseException) -> None:
        """``error`` refused this rank's step before its collective: raise it on every
        rank (the agreement's error; returns only in one process, or when ``error`` came
        from the agreement itself, for the caller to re-raise)."""
        if self._agreement is None or hasattr(error, "refused_ranks"):
            return
        import torch.distributed as dist

        if not isinstance(error, Exception) or isinstance(  # an interrupt; a collective's
                error, getattr(dist, "DistError", ())):   # own failure: as they are
            return
        self._agreement.agree(error, *self._status(),
                              mechanism=(self.noise_multiplier, self.max_grad_norm),
                              layout=layout_code(self._groups, self._numels))
