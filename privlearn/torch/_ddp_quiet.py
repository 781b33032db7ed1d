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

A wrapper made *after* make_private (``DistributedDataParallel(p.model)``, or
accelerate's ``prepare`` in a loop of the user's) is not known to the engine, and with
its gradient synchronisation on it broadcasts the buffers at *every* forward: a rank that
skips the forward of its empty batch hangs the run at that step. No forward pre-hook of
the model can stop it (the broadcast runs in the wrapper's ``_pre_forward``, before the
model is called). :func:`ignore_buffers_later` names the model's buffers in the
attribute that ``DistributedDataParallel``'s constructor reads the parameters and
buffers to leave alone from (``_ddp_params_and_buffers_to_ignore``, which its
``_set_params_and_buffers_to_ignore_for_model`` sets): such a wrapper then syncs no
buffer, neither when built nor in its forwards, as one given to make_private after
:func:`quiet_ddp`. The buffers are equal on the ranks already: make_private compares
them and gives every rank rank 0's (:func:`privlearn.torch.distributed.sync_replicas`).
A wrapper built around a larger module than the model make_private was given reads that
module's attribute, not the model's, and still broadcasts at every forward: its loop
must run the forward of every batch, an empty one too.

:func:`refuse_join` refuses the wrapper's ``join()`` (``torch.distributed.algorithms.Join``,
for uneven inputs) for the run: a rank that joins early stops sampling its part of the
dataset, so the global batch is no longer the Poisson sample the accountant assumes, and
its shadow collectives (one-element all-reduces) meet the engine's all-reduces on the other
ranks: gloo aborts the process on the size mismatch, NCCL may hang. A wrapper made after
make_private is not known here: its join is refused at the step
(:mod:`privlearn.torch._join_guard`).
"""

from __future__ import annotations

from collections.abc import Callable

from privlearn.errors import ConfigurationError

__all__ = ["is_ddp", "quiet_ddp", "refuse_join", "ignore_buffers_later"]

#: the module attribute ``DistributedDataParallel``'s constructor reads the names (as
#: ``named_parameters`` and ``named_buffers`` give them) of what it leaves alone from
_IGNORED = "_ddp_params_and_buffers_to_ignore"


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


def refuse_join(model) -> Callable[[], None] | None:
    """Make the DDP wrapper ``model``'s ``join()`` and ``join_hook()`` (what
    ``torch.distributed.algorithms.Join`` calls when it is built) raise a
    :class:`~privlearn.errors.ConfigurationError` on every rank, before any collective
    (module docstring). Returns a function that restores them, or ``None`` when
    ``model`` is not a DDP wrapper."""
    if not is_ddp(model) or not hasattr(model, "join_hook"):
        return None

    def join_hook(*args, **kwargs):
        raise ConfigurationError(
            "DistributedDataParallel.join() (torch.distributed.algorithms.Join, for uneven "
            "inputs) cannot run under make_private: a rank that joins early stops sampling "
            "its part of the dataset, so the global batch would not be the Poisson sample "
            "that is accounted, and its shadow collectives would meet the engine's "
            "all-reduce of the noisy sums on the other ranks (a size mismatch that aborts "
            "the process, or a hang). p.data_loader gives every rank the same number of "
            "batches per epoch: iterate it whole on every rank, for the same number of "
            "epochs or steps, without join(). Nothing was changed")

    def join(*args, **kwargs):
        join_hook()

    model.join_hook, model.join = join_hook, join  # instance attributes over the methods

    def restore() -> None:
        for name in ("join_hook", "join"):
            model.__dict__.pop(name, None)

    return restore


def ignore_buffers_later(module) -> Callable[[], None] | None:
    """Name ``module``'s buffers (with any names already there) in the attribute from
    which a ``DistributedDataParallel`` wrapper built around ``module`` later reads what
    to leave alone: it then broadcasts no buffer, neither when built nor at its forwards
    (module docstring). Returns a function that puts the attribute back as it was, or
    ``None`` when ``module`` has no buffer (nothing to broadcast)."""
    names = [name for name, _ in module.named_buffers()]
    if not names:
        return None
    missing = object()
    before = module.__dict__.get(_IGNORED, missing)
    given = [] if before is missing else list(before)
    setattr(module, _IGNORED, given + [n for n in names if n not in given])

    def restore() -> None:
        if before is missing:
            module.__dict__.pop(_IGNORED, None)
        else:
            setattr(module, _IGNORED, before)

    return restore
