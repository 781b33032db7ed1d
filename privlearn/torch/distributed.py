"""Distributed helpers (``torch.distributed``; gloo on CPU, NCCL on GPUs).

Usage: initialise the process group, build the model (optionally wrapped in
``DistributedDataParallel``), an optimizer and an ordinary ``DataLoader`` whose
``batch_size`` is the *per-rank* batch size, and call
:func:`privlearn.torch.make_private` on every rank (same arguments, same initial
weights: when a plain module's parameters or buffers, or an FSDP2 model's buffers,
differ between the ranks, make_private gives every rank the first rank's, with a
warning, as DDP does when it wraps a model). The
engine then

* samples each rank's shard (indices ``rank, rank + W, ...``) with Poisson rate
  ``q = W * batch_size / len(dataset)``: every example of the dataset is included
  independently with probability ``q``, so the global batch is exactly the
  single-process Poisson sample and is accounted as such (with ``sampling="fixed"``, all
  ranks draw the same global sample of ``W * batch_size`` indices from a shared seed and
  each keeps every W-th of it: one uniform fixed-size sample, accounted as such);
* clips per example on each rank, adds ``N(0, (sigma C)^2 / W)`` per rank and all-reduces
  the sums, so the global noise is ``N(0, (sigma C)^2)`` as in the single-process
  mechanism, normalised by the global expected batch size ``q N``;
* gives every rank the same gradient, so the replicas stay identical.

Wrapping in DDP is optional (the engine does its own all-reduce); with DDP,
``make_private`` switches DDP's gradient synchronisation off for the run
(``require_backward_grad_sync = False``, as inside ``model.no_sync()``; restored by
``detach()``), so there is one all-reduce per step, of the noisy clipped sums, and no
autograd weight gradients at all. DDP's broadcast of the buffers from rank 0 in the first
forward is done by ``make_private`` itself, on every rank, and then switched off
(``require_forward_param_sync = False``): a rank whose Poisson batch is empty may skip
its forward and call ``step()`` alone without leaving the other ranks' broadcast waiting
(:mod:`privlearn.torch._ddp_quiet`). A DDP wrapper built around the model after
``make_private`` (``DistributedDataParallel(p.model)``) leaves the model's buffers out
of its broadcasts: ``make_private`` names them in the attribute DDP reads what to leave
alone from.
"""

from __future__ import annotations

import contextlib

import torch

from privlearn.errors import ConfigurationError, RanksNotArrivedError
from privlearn.torch import _settle as settle
from privlearn.torch._arrival import wait_for_ranks
from privlearn.torch._dataset_digest import dataset_digest

# the rank-partitioned Poisson sampler lives with the other samplers; its names stay
# importable from here
from privlearn.torch.samplers import DistributedPoissonBatchSampler, rank_partition

__all__ = ["world_info", "all_reduce_sum", "unwrap", "rank_partition",
           "DistributedPoissonBatchSampler", "check_same_on_ranks", "check_ddp_wrapper",
           "dataset_digest", "first_rank_decides", "ledger_on_first_rank",
           "refuse_on_every_rank", "parameters_digest", "sync_replicas",
           "optimizer_settings", "Unshown", "refusal_timeout", "refused_together"]


def unwrap(model):
    """The module inside a ``DistributedDataParallel`` wrapper (recognised by its
    ``require_backward_grad_sync`` flag and ``module``), else ``model`` itself."""
    if hasattr(model, "require_backward_grad_sync") and hasattr(model, "module"):
        return model.module
    return model


def check_ddp_wrapper(model) -> None:
    """Refuse a ``DistributedDataParallel`` wrapper the engine cannot switch off.

    make_private turns DDP's gradient synchronisation off for the run (as
    ``model.no_sync()`` does) and all-reduces the noisy clipped sums itself. DDP built
    with ``static_graph=True`` still enqueues its delayed all-reduce of the first
    backward pass whatever the synchronisation flag says, and that all-reduce expects
    autograd gradients of the weights, which the engine never produces: the first
    ``backward()`` would fail inside DDP's reducer (an internal assertion) on every rank.

    Raises
    ------
    ConfigurationError
        ``model`` is a DDP wrapper with ``static_graph=True``.
    """
    if hasattr(model, "require_backward_grad_sync") and getattr(model, "static_graph",
                                                                 False):
        raise ConfigurationError(
            "model is a DistributedDataParallel wrapper built with static_graph=True: "
            "make_private switches DDP's gradient synchronisation off and all-reduces the "
            "noisy clipped gradient sums itself, but a static-graph DDP still runs its own "
            "all-reduce after the first backward(), which fails inside DDP (no autograd "
            "weight gradient exists to reduce). Wrap the model without static_graph "
            "(DistributedDataParallel(module)), or pass the module unwrapped: DDP's graph "
            "options change nothing under make_private. Nothing was changed")


def optimizer_settings(optimizer) -> tuple:
    """The optimizer's type and its param groups' hyperparameters (``lr``, momentum,
    weight decay, betas, ...), to compare between ranks.

    Each rank applies the one all-reduced noisy gradient with its own optimizer, so ranks
    given another learning rate (one computed from the rank, or from a per-rank batch
    size) would train apart, each replica (or each FSDP2 shard) a different model, without
    any error. Values that print the same on every rank are kept: numbers, strings,
    booleans, ``None``, tuples and lists of them, and a one-element tensor as its number
    (its device may differ between ranks); others (callables, objects) are left out.
    """
    def plain(v):
        if torch.is_tensor(v):
            return float(v) if v.numel() == 1 else None
        if isinstance(v, tuple | list):
            kept = [plain(x) for x in v]
            return None if any(k is None and x is not None for k, x in zip(kept, v,
                                                                          strict=True)) else kept
        return v if v is None or isinstance(v, bool | int | float | str) else None

    return (type(optimizer).__name__,
            [{k: plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups])


def _replicated(model, parameters: bool = True) -> list:
    """``(name, tensor)`` of what every replica must hold alike, as DDP makes it when it
    wraps a model: the parameters (unless not ``parameters``: FSDP2's shards differ by
    design) and the buffers, distributed tensors left out."""
    dt = None
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor as dt
    named = list(model.named_parameters()) if parameters else []
    named += [(f"buffer {n}", b) for n, b in model.named_buffers()]
    return [(n, t) for n, t in named if dt is None or not isinstance(t, dt)]


def parameters_digest(model, rows: int = 1024, parameters: bool = True) -> str:
    """A short digest of the values of ``model``'s parameters (unless not
    ``parameters``) and buffers, to compare between ranks: each one's name, shape and
    dtype, at most ``rows`` evenly spaced values of it (bit for bit) and the float64 sum
    of all of them."""
    import hashlib

    h = hashlib.sha256()
    sums = []
    for name, p in _replicated(model, parameters):
        h.update(repr((name, tuple(p.shape), str(p.dtype))).encode())
        if p.device.type == "meta" or p.numel() == 0:
            continue
        flat = p.detach().reshape(-1)
        part = flat[::max(1, flat.numel() // rows)][:rows].cpu().contiguous()
        h.update(part.view(torch.uint8).numpy().tobytes())
        sums.append(torch.sum(flat, dtype=torch.float64).reshape(1).cpu())
    if sums:
        h.update(torch.cat(sums).numpy().tobytes())
    return h.hexdigest()[:16]


def sync_replicas(model, process_group=None, warn_as: str | None = None,
                  parameters: bool = True) -> bool:
    """Give every rank the first rank's parameter and buffer values when they differ
    between ranks (as ``DistributedDataParallel`` does when it wraps a model); returns
    whether they differed (every rank gets the same answer). ``parameters=False``: the
    buffers only (FSDP2, whose parameters are each rank's shard of one tensor).

    Replicated training needs the same weights on every rank: each rank computes its
    examples' gradients at its own weights and applies the one all-reduced update to
    them, so ranks that start apart would train apart, every rank's model a different
    one; buffers that differ (a fixed random projection drawn without a common seed)
    make each rank's examples' gradients those of another model. DDP copies rank 0's
    parameters and buffers when it wraps the model; a plain module given to make_private
    has nothing that does, nor has FSDP2 for its buffers. The ranks compare a digest of
    them (:func:`parameters_digest`: one small gather) and broadcast only when it
    differs. The names, shapes and dtypes must already agree (make_private's
    :func:`check_same_on_ranks`). ``warn_as``: the caller's name, for a ``UserWarning``
    on every rank when the values differed (None: no warning).
    """
    import torch.distributed as dist

    _, world = world_info(process_group)
    if world == 1:
        return False
    gathered: list = [None] * world
    dist.all_gather_object(gathered, parameters_digest(model, parameters=parameters),
                           group=process_group)
    if len(set(gathered)) == 1:
        return False
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    with torch.no_grad():
        for _, p in _replicated(model, parameters):
            t = p.detach()
            buf = t if t.is_contiguous() else t.contiguous()
            settle.broadcast(buf, src=src, group=process_group)
            if buf is not t:
                t.copy_(buf)
    if warn_as is not None:
        import warnings

        warnings.warn(
            f"the model's weights (parameters or buffers) differed between the ranks: "
            f"{warn_as} copied the first rank's to every rank (as DistributedDataParallel "
            "does when it wraps a model), since each rank applies the one all-reduced "
            "update to its own weights and computes its examples' gradients with its own "
            "buffers: replicas that start apart would train apart. Build the model after "
            "the same torch.manual_seed on every rank, or wrap it in "
            "DistributedDataParallel", UserWarning, stacklevel=3)
    return True


def world_info(process_group=None) -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when torch.distributed is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def all_reduce_sum(tensors: list[torch.Tensor], process_group=None) -> list[torch.Tensor]:
    """Sum ``tensors`` over ranks with one flat all-reduce."""
    if not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    settle.all_reduce(flat, group=process_group)
    out, k = [], 0
    for t in tensors:
        out.append(flat[k:k + t.numel()].view_as(t))
        k += t.numel()
    return out


class Unshown:
    """A value :func:`check_same_on_ranks` compares (by ``repr``) but does not print when
    it differs: a digest of the dataset's examples (:func:`dataset_digest`, an unsalted
    hash of a few records, which enumeration inverts when the records take few values;
    an error message ends up in logs and bug reports). The ranks' values are named by
    the order in which they first occur instead (``contents #1``, ``contents #2``)."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _shown(key: str, gathered: list, hidden: set) -> str:
    """Every rank's value of ``key`` for the message (one of ``hidden``: by its order of
    first occurrence, see :class:`Unshown`)."""
    values = [g.get(key, "<absent>") for g in gathered]
    if key in hidden:
        first = list(dict.fromkeys(values))
        values = [f"contents #{first.index(v) + 1}" for v in values]
    return f"{key}: " + ", ".join(f"rank {r}: {str(v)[:80]}" for r, v in enumerate(values))


def check_same_on_ranks(values: dict[str, object], process_group=None,
                        timeout: float | None = None, error: BaseException | None = None,
                        what: str = "make_private", given_to: str | None = None) -> None:
    """Refuse, on every rank, a run whose ranks disagree on any of ``values``.

    The accountant of each rank describes one global mechanism (one noise multiplier,
    clipping bound, sampling rate and dataset size; one sampling seed from which every
    rank's streams are derived). Ranks given different settings would each account
    their own values while the all-reduced update mixes them (a rank adding less noise,
    or clipping to a larger bound, than its accountant's peers assume), so the ranks'
    values are gathered once, before any step, and any difference is a
    :class:`~privlearn.errors.ConfigurationError` raised on all ranks alike (no rank
    is left waiting in a collective).

    Parameters
    ----------
    values : dict
        Setting name -> value; compared by ``repr`` (so any printable value works).
    process_group : optional
        The torch.distributed group (default: the world).
    timeout : float, optional
        Seconds to wait for every rank to arrive first (gloo's monitored barrier; None:
        no bounded wait), :func:`privlearn.torch._arrival.wait_for_ranks`.
    error : exception, optional
        This rank's refusal of the run before it could gather its ``values`` (a bad
        setting, a loader or model it refuses): joined in place of them, so that the
        other ranks raise at once, naming this rank and its cause, instead of waiting
        ``timeout`` seconds for it (or, past the wait, finding their group unusable);
        this rank raises ``error``. Every rank's own refusal is raised when several
        refused.
    what, given_to : str, optional
        What the ranks start (the messages' name for it) and where ``agreement_timeout``
        is set, as :func:`privlearn.torch._arrival.wait_for_ranks` takes them.

    Raises
    ------
    ConfigurationError
        Some setting differs between ranks; the message names each one with every
        rank's value. Some other rank refused the run (``error`` there): the refusing
        ranks' error type when they share one of privlearn's, naming each and its cause.
    RanksNotArrivedError
        Some rank did not arrive within ``timeout`` (with ``error``: ``error`` itself).
    """
    import torch.distributed as dist

    _, world = world_info(process_group)
    if world == 1:
        if error is not None:
            raise error
        return
    if timeout is not None:
        try:
            wait_for_ranks(process_group, timeout, what=what, given_to=given_to)
        except RanksNotArrivedError:
            if error is not None:  # this rank's own cause first (the wait's as context)
                raise error  # noqa: B904 - the wait's failure stays the context
            raise
    mine = ({_REFUSED: (type(error).__name__, str(error))} if error is not None
            else {k: repr(v) for k, v in values.items()})
    gathered: list = [None] * world
    try:
        dist.all_gather_object(gathered, mine, group=process_group)
    except Exception:
        if error is not None:  # the group failed too: this rank's own cause first
            raise error  # noqa: B904 - the group's failure stays the context
        raise
    refused = [(r, g[_REFUSED]) for r, g in enumerate(gathered) if _REFUSED in g]
    if error is not None:
        raise error
    if refused:
        raise _refused_elsewhere(refused, world, what)
    keys = list(mine)
    for other in gathered:
        keys += [k for k in other if k not in keys]
    differ = [k for k in keys if len({g.get(k, "<absent>") for g in gathered}) > 1]
    if differ:
        hidden = {k for k, v in values.items() if isinstance(v, Unshown)}
        shown = "; ".join(_shown(k, gathered, hidden) for k in differ[:6])
        raise ConfigurationError(
            f"make_private was called with different settings on the {world} ranks "
            f"({shown}{f'; and {len(differ) - 6} more' if len(differ) > 6 else ''}). "
            "Every rank's accountant describes one global mechanism, so the privacy "
            "settings (noise_multiplier or target_epsilon, max_grad_norm, sampling, seed, "
            "epochs/steps, target_delta, ...), the loader's batch_size, the dataset (its "
            "examples in one order: shuffle it, if at all, with one seed on every rank), "
            "the model's parameters and buffers (names, shapes, dtypes: build the model "
            "the same way on every rank) and the optimizer's hyperparameters (lr, "
            "momentum, ...: each rank applies the update with its own) must be the same "
            "on every rank (make_private "
            "derives each rank's sampling and noise streams from the one seed). No step "
            "was taken and nothing was released")


#: the key a rank that refused the run joins :func:`check_same_on_ranks` with
_REFUSED = "\x00refused on this rank"


def _refused_elsewhere(refused: list, world: int, what: str = "make_private") -> Exception:
    """The error of a rank whose checks passed while other ranks refused the run
    (``refused``: ``(rank, (type name, message))``): their type when they share one of
    privlearn's errors (a :class:`~privlearn.errors.ConfigurationError` otherwise)."""
    from privlearn import errors

    names = {name for _, (name, _) in refused}
    found = getattr(errors, next(iter(names)), None) if len(names) == 1 else None
    cls = found if isinstance(found, type) and issubclass(found, Exception) else None
    message = (
        f"{what} was refused on rank(s) {[r for r, _ in refused]} of {world}, so it "
        "is refused on every rank (the ranks run one mechanism together; a rank going on "
        "alone would wait for the refusing one in the run's first collective): "
        + "; ".join(f"rank {r}: {name}: {msg[:600]}" for r, (name, msg) in refused)
        + f". Fix that rank's arguments (every rank calls {what} with the same "
        "settings, a loader of the whole dataset and the same model). No step was taken "
        "and nothing was released")
    try:
        return (cls or ConfigurationError)(message)
    except Exception:  # noqa: BLE001 - a type that needs more than a message
        return ConfigurationError(message)


@contextlib.contextmanager
def refused_together(what: str, timeout: float, given_to: str | None = None,
                     process_group=None):
    """The block's checks, refused on every rank when they refuse on any: past the block,
    the ranks wait at most ``timeout`` seconds for each other and exchange whether each
    passed (:func:`check_same_on_ranks` with its ``error``), so a rank whose block raised
    does not leave the others waiting for it in their next collective. One process: the
    block as it is."""
    _, world = world_info(process_group)
    try:
        yield
    except Exception as exc:
        if world > 1:
            check_same_on_ranks({}, process_group, timeout, error=exc, what=what,
                                given_to=given_to)
        raise
    if world > 1:
        check_same_on_ranks({}, process_group, timeout, what=what, given_to=given_to)


def refusal_timeout(cfg, config=None, settings: dict | None = None) -> float:
    """The seconds a rank that refused make_private waits for the other ranks to hear it
    (:func:`check_same_on_ranks`' ``error``): ``cfg.agreement_timeout``, or, when the
    settings themselves were refused (``cfg`` None), the one given in ``config`` or
    ``settings`` if it is a positive number, else the default."""
    import math
    import numbers

    from privlearn.torch.config import DPConfig

    if cfg is not None:
        return float(cfg.agreement_timeout)
    given = getattr(config, "agreement_timeout", (settings or {}).get("agreement_timeout"))
    if (isinstance(given, numbers.Real) and not isinstance(given, bool)
            and 0 < given < math.inf):
        return float(given)
    return float(DPConfig.agreement_timeout)


def first_rank_decides(fn, process_group=None):
    """``fn()`` run on the group's first rank only, its result (or the exception it
    raised) handed to every rank: the other ranks return the same value or raise the
    same error, so that a decision only one process can take (a privacy ledger's
    reservation, written once for the whole run) is followed by all ranks alike and no
    rank is left waiting in a collective. ``fn``'s result must be picklable; an error
    that cannot be pickled reaches the other ranks as a ``RuntimeError`` naming it.
    One process (no group, or a group of one): ``fn()`` itself."""
    import pickle

    import torch.distributed as dist

    rank, world = world_info(process_group)
    if world == 1:
        return fn()
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    box: list = [None]
    if rank == 0:
        try:
            box[0] = (True, fn())
        except Exception as exc:
            try:
                pickle.dumps(exc)
                shipped = exc
            except Exception:  # noqa: BLE001 - any pickling failure: its name and text
                shipped = RuntimeError(f"{type(exc).__name__} on the first rank: {exc}")
            dist.broadcast_object_list([(False, shipped)], src=src, group=process_group)
            raise
    dist.broadcast_object_list(box, src=src, group=process_group)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def ledger_on_first_rank(ledger, process_group=None) -> bool:
    """Whether the group's first rank was given a privacy ledger (every rank gets the
    same answer); one process: whether ``ledger`` is given.

    A distributed run is one mechanism, recorded once, by the group's first rank: the
    other ranks may pass the same budget handle or ``None``. A run whose first rank has
    no ledger while another rank has one is refused on every rank (that rank's budget
    would never be charged).

    Raises
    ------
    ConfigurationError
        A rank other than the first was given a ledger and the first was not.
    """
    import torch.distributed as dist

    _, world = world_info(process_group)
    if world == 1:
        return ledger is not None
    given: list = [None] * world
    dist.all_gather_object(given, ledger is not None, group=process_group)
    if not given[0] and any(given):
        raise ConfigurationError(
            f"a privacy ledger was given to make_private on rank(s) "
            f"{[r for r, g in enumerate(given) if g]} of {world} but not on rank 0: a "
            "distributed run is one mechanism, recorded once by the group's first rank, "
            "so its budget would never be charged. Pass ledger= on rank 0 (and, if you "
            "like, the same handle on the other ranks, which do not write). No step was "
            "taken and nothing was recorded")
    return bool(given[0])


def refuse_on_every_rank(error: BaseException | None, what: str, process_group=None) -> None:
    """Raise on every rank when any rank of the group has an ``error`` (``None``: this
    rank's checks passed): each rank raises its own error, a rank whose checks passed a
    :class:`~privlearn.errors.ConfigurationError` naming the ranks that refused and
    their reasons, so that no rank goes on alone to wait in the next collective. One
    process: raises ``error`` if there is one.

    Parameters
    ----------
    error : exception or None
        This rank's refusal.
    what : str
        What was refused, for the message (``"load_state_dict"``).
    process_group : optional
        The torch.distributed group (default: the world).
    """
    import torch.distributed as dist

    _, world = world_info(process_group)
    if world > 1:
        mine = None if error is None else f"{type(error).__name__}: {error}"
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine, group=process_group)
        refused = [(r, m) for r, m in enumerate(gathered) if m is not None]
        if refused and error is None:
            raise ConfigurationError(
                f"{what} was refused on rank(s) {[r for r, _ in refused]} of {world}, so "
                "it is refused on every rank (the ranks continue one run together): "
                + "; ".join(f"rank {r}: {m[:600]}" for r, m in refused))
    if error is not None:
        raise error
