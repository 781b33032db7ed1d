"""Which tensor arguments and outputs of a layer without a rule follow the examples, kept
from step to step, so that the generic rule (:func:`privlearn.torch.fallback.fallback_rule`)
never reads it from a coincidence of sizes.

By shape alone the generic rule splits every tensor whose batch dimension has the batch's
size as one row per example (:func:`~privlearn.torch.fallback.default_record_dims`). A
table shared by every example (a lookup table passed to the layer's forward, a trained
table it returns) whose row count equals the batch size would then be split, each
example's gradient computed from one row of it: the clipped gradients are not the
examples' (the accounted sensitivity no longer holds) and the table's own parameters get
a gradient that is not clipped per example. The batch-independence probe refuses such a
table at the steps it checks on the whole batch (the first, and a batch larger or smaller
than any before), but a Poisson batch of a size in between, or a fixed-size run's smaller
last batch, can equal the table's row count at a step it does not check.

So the role of each tensor (per layer; keyed by argument position or keyword, or output
position, and number of dimensions) is settled once and kept:

* *shared* once its batch dimension had another size than the batch's (two rows or more):
  it stays shared whatever its size later, a batch of its row count included;
* *per example* once it had the batch's size (two examples or more) at a step the probe
  checked on the whole batch (the probe refuses a shared tensor of that size), or at any
  step when the probe is switched off (``check_batch_independence=False``: the user
  promises) or has not run whole yet (per-example gradients asked of the tracker
  directly); later a size other than the batch's is refused (one row broadcast to every
  example stays allowed, as before);
* a tensor with the batch's size that was never settled, at a step the probe did not
  check whole after it had checked one (a layer first called then, or called with a new
  argument), is refused: its role cannot be told from its shape.

A tensor of one row, or a batch of one example, settles nothing (one row is as much a
broadcast table, ``table[None]``, as one example). Only shapes are read: no host
synchronisation, a dictionary look-up per argument per step.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from privlearn.errors import BatchDependenceError
from privlearn.torch._attached import _ATTACHED

__all__ = ["aside", "mark_probed", "settle", "settled_shared"]

_SHARED, _BATCHED = "shared", "per example"
_FIX = (
    "Register a shared table on the layer itself (a buffer or a constant attribute, "
    "not an argument), pass it with a leading dimension of 1 (table[None]), pass "
    "per-example tensors with one row per example at every call, or register a rule "
    "for the layer (privlearn.torch.register_rule)"
)


#: set while the generic rule runs on a record made for a check (a class-name rule's
#: comparison on the batch's first examples): its shapes are not the step's
_ASIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("argument_roles_aside", default=False)


@contextlib.contextmanager
def aside():
    """Within the block, the generic rule settles no role and applies none (a record
    built for a check, whose tensors are cut to a few examples while the others keep
    the batch's rows, would settle those as shared)."""
    token = _ASIDE.set(True)
    try:
        yield
    finally:
        _ASIDE.reset(token)


def mark_probed(tracker) -> None:
    """Mark the step's records as checked by the probe on the whole batch (called when
    such a probe passed): the tensors of the batch's size they hold follow the examples."""
    for recs in getattr(tracker, "records", {}).values():
        for rec in recs:
            rec.probed_whole = True


def _tracker(module: nn.Module):
    ref = _ATTACHED.get(module)
    return ref() if ref is not None else None


def settle(
    module: nn.Module, record, batch: int, arg_dims: list, kw_dims: dict, out_dims: list
) -> tuple[list, dict, list]:
    """The batch dimensions of :func:`~privlearn.torch.fallback.default_record_dims`
    made consistent with the roles kept for ``module`` (module docstring); unchanged for
    a module no tracker holds (the rule called on its own) and within :func:`aside`.

    Raises
    ------
    BatchDependenceError
        A tensor that followed the examples no longer has the batch's size, or one of
        the batch's size was never settled at a step the probe checked.
    """
    tracker = None if _ASIDE.get() else _tracker(module)
    if tracker is None:
        return arg_dims, kw_dims, out_dims
    roles = tracker.__dict__.setdefault("_argument_roles", {}).setdefault(module, {})
    d = record.batch_dim
    # the probe checked this call's tensors on the whole batch, or it is off, or it
    # never ran whole on this tracker (per-example gradients asked of the tracker
    # directly, no step): the shapes are taken as they are, as before
    checked = (
        getattr(record, "probed_whole", False)
        or not getattr(tracker, "_probe_enabled", True)
        or not getattr(tracker, "_probed_whole", 0)
    )
    layer = type(module).__name__

    def one(label: str, shape, dim):
        if shape is None or len(shape) <= d:
            return dim
        key, rows = (label, len(shape)), shape[d]
        role = roles.get(key)
        if role == _SHARED:
            return None
        if role == _BATCHED:
            if rows == batch:
                return d
            if rows == 1:
                return None  # one row broadcast to every example, as before
            raise BatchDependenceError(
                f"layer {layer} has no per-example rule and its {label} (shape "
                f"{tuple(shape)}) had one row per example at an earlier step but has "
                f"{rows} rows on dimension {d} with this batch of {batch} examples: its "
                "rows no longer follow the examples, and the generic per-example rule "
                "cannot tell which row is whose. " + _FIX + ". No step was taken and "
                "nothing was released"
            )
        if rows != batch:
            if rows >= 2:
                roles[key] = _SHARED
            return dim
        if batch < 2:
            return dim
        if not checked:
            raise BatchDependenceError(
                f"layer {layer} has no per-example rule and its {label} (shape "
                f"{tuple(shape)}) has {rows} rows on dimension {d}, as many as the batch "
                "has examples, at its first call in a step that the batch-independence "
                "probe did not check on the whole batch (the layer, or this argument, "
                "was not used at the steps it checked): it may be a tensor shared by "
                "every example whose size only matches the batch's, which the generic "
                "per-example rule would split as one row per example. Call the layer "
                "the same way from the first step on, or: " + _FIX + ". No step was "
                "taken and nothing was released"
            )
        roles[key] = _BATCHED
        return dim

    def shape_of(t):
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None

    arg_dims = [
        one(f"argument {i}", shape_of(a), dim)
        for i, (a, dim) in enumerate(zip(record.args, arg_dims, strict=True))
    ]
    kw_dims = {k: one(f"argument {k!r}", shape_of(v), kw_dims[k]) for k, v in record.kwargs.items()}
    # outputs counted among the floating ones, as the probe labels them (argument_views)
    floating = [m[1].is_floating_point for m in record.outputs_meta]
    out_dims = [
        one(f"output {sum(floating[:i])}", s, dim) if floating[i] else dim
        for i, ((s, _, _), dim) in enumerate(zip(record.outputs_meta, out_dims, strict=True))
    ]
    return arg_dims, kw_dims, out_dims


def settled_shared(module: nn.Module, label: str, shape, dim: int) -> bool:
    """Whether the tensor ``label`` (``"argument 1"``, ``"output 1"``: the probe's
    labels, :func:`~privlearn.torch.fallback.argument_views`) of ``shape`` of a layer
    without a rule was settled as shared by every example at an earlier step (its rows
    on ``dim`` differed from the batch's size): the generic rule keeps it whole whatever
    its size, so the probe need not refuse it when its rows equal the batch's."""
    tracker = _tracker(module)
    roles = {} if tracker is None else getattr(tracker, "_argument_roles", {}).get(module, {})
    return len(shape) > dim and roles.get((label, len(shape))) == _SHARED
