"""A ``DistributedDataParallel`` wrapper's own collectives, switched off for a private run.

The engine all-reduces the noisy clipped sums itself, so DDP must not reduce gradients
(``require_backward_grad_sync = False``, as inside ``model.no_sync()``). DDP also
broadcasts the module's buffers from rank 0 (``broadcast_buffers=True``, its default) at
the start of a forward pass when ``require_forward_param_sync`` is set: in the first
forward, and after any forward followed by a synchronised backward. With gradient
synchronisation off, that leaves the first forward's broadcast, and it is a collective
inside a forward some ranks may not run: a rank whose Poisson batch is empty trains on
nothing (DPTrainer skips its forward; a make_private loop may skip it and call
``step()`` alone). Its first forward then comes a step later than the other ranks',
whose broadcast meets its engine all-reduce, and the run hangs (or pairs mismatched
collectives).

:func:`quiet_ddp` does that broadcast at once, where every rank calls it together
(``make_private``; DPTrainer's ``training_step``, which every rank runs for every batch,
an empty one too), then clears ``require_forward_param_sync``: DDP's forwards run no
collective. The buffers are the ones DDP would have broadcast; they stay equal on the
ranks afterwards because those the data changes (BatchNorm's running statistics) are
refused by the engine, and the others change, if at all, the same way on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["is_ddp", "quiet_ddp"]


def is_ddp(model) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` wrapper (recognised by its
    synchronisation flags, as :func:`privlearn.torch.distributed.unwrap_ddp` does)."""
    return hasattr(model, "require_backward_grad_sync") and hasattr(model, "module")


def quiet_ddp(model) -> Callable[[], None] | None:
    """Switch off the gradient reduction and the forward buffer broadcast of the DDP
    wrapper ``model``, broadcasting its buffers now if its next forward would have
    (a collective: every rank calls this at the same point). Returns a function that
    restores both flags, or ``None`` when ``model`` is not a DDP wrapper or both were
    already off (nothing to restore)."""
    if not is_ddp(model):
        return None
    backward = model.require_backward_grad_sync
    forward = getattr(model, "require_forward_param_sync", False)
    if not (backward or forward):
        return None
    if forward:
        will_sync = getattr(model, "will_sync_module_buffers", None)
        if will_sync is not None and will_sync():
            model._sync_buffers()  # the broadcast the first forward would have run
        model.require_forward_param_sync = False
    model.require_backward_grad_sync = False

    def restore() -> None:
        model.require_backward_grad_sync = backward
        if hasattr(model, "require_forward_param_sync"):
            model.require_forward_param_sync = forward

    return restore
