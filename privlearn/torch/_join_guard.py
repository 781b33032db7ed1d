"""Uneven-input joins around a private model's forward, refused at the step.

``torch.distributed.algorithms.Join`` (``DistributedDataParallel.join()``, and
accelerate's ``Accelerator.join_uneven_inputs``, which builds one) lets a rank whose
loop ends early shadow the other ranks' collectives: its loop is over, and it answers
their all-reduces with zeros. Under make_private the global batch is then no longer the
Poisson (or fixed-size) sample of the whole dataset that is accounted: the joined rank
samples no more of its part, and its zeros meet the other ranks' status exchange and
all-reduce of the noisy sums (gloo aborts the process on the size mismatch; a backend
that pairs them mixes the joined rank's zeros into the others' collectives).

A DDP wrapper given to make_private has its ``join()`` refused when it is entered
(:func:`privlearn.torch._ddp_quiet.refuse_join`). A wrapper made *after* make_private
(``DistributedDataParallel(p.model)``; accelerate's ``prepare`` after make_private) is
not known to the engine. :func:`watch` puts a forward pre-hook on the model that
looks, at each training forward of a distributed run, up the calling frames for a module
call whose module is joinable (it has ``_join_config``, as
``torch.distributed.algorithms.Joinable`` sets it) with its join enabled: a ``Join``
context configured it. The next step's status exchange (:mod:`privlearn.torch._agree`)
then refuses the step on every rank, before anything is released or accounted
(:func:`refusal`).

Not seen: a join whose wrapper does not call the model from a Python frame (a compiled
wrapper); a rank whose loop ends before its first forward in the join (its shadowing
then meets the others' first collectives: gloo fails the step, nothing released).
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.distributed as dist

from privlearn.errors import TrainingLoopError
from privlearn.torch._tracker_util import _eager, _in_backward

__all__ = ["watch", "refusal", "FRAMES"]

#: calling frames looked at, from the model's pre-hook up (the wrapper's call is a few
#: frames above: its ``forward``, ``_run_ddp_forward``, the modules between)
FRAMES = 24

#: the frame of a module's call (``nn.Module.__call__``), whose ``self`` is that module:
#: the only frames whose locals are read
_CALL = "_call_impl"

#: model -> the type name of the joinable wrapper seen with its join enabled
_JOINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _joined_caller(model) -> object | None:
    """The joinable module (one with an enabled ``_join_config``) whose call, within the
    :data:`FRAMES` frames above, is calling ``model``, or None."""
    frame = sys._getframe(2)
    for _ in range(FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name == _CALL:
            obj = frame.f_locals.get("self")
            config = getattr(obj, "_join_config", None) if obj is not model else None
            if getattr(config, "enable", False) is True:
                return obj
        frame = frame.f_back
    return None


def watch(model, tracker) -> torch.utils.hooks.RemovableHandle:
    """Note, at each training forward of ``model``, whether a wrapper with an enabled
    join calls it (module docstring); not at the forwards of ``tracker``'s
    batch-independence probe, which the step runs itself. Returns the hook's handle
    (``remove()`` it with the engine)."""

    def pre(module, args):
        if (
            not module.training
            or not torch.is_grad_enabled()
            or _in_backward()
            or getattr(tracker, "_probing", False)
        ):
            return None
        if not (dist.is_available() and dist.is_initialized()):
            return None  # a join needs a process group
        wrapper = _joined_caller(module)
        if wrapper is not None:
            _JOINED[module] = type(wrapper).__name__
        else:  # a forward outside any join (a new wrapper, or none): the next step may go
            _JOINED.pop(module, None)
        return None

    return model.register_forward_pre_hook(_eager(pre))


def refusal(model) -> TrainingLoopError | None:
    """The refusal of a step of ``model`` whose last training forward ran under an
    enabled join (None: it did not). The same wrapper stays refused after the ``with``
    block: torch leaves its join configuration enabled."""
    name = _JOINED.get(model)
    if name is None:
        return None
    return TrainingLoopError(
        f"optimizer.step() refused: the model's forward ran inside a join for uneven "
        f"inputs (torch.distributed.algorithms.Join, {name}.join(), or accelerate's "
        "Accelerator.join_uneven_inputs) around a wrapper made after make_private. A rank "
        "that joins early stops sampling its part of the dataset and answers the other "
        "ranks' all-reduces with zeros, so the steps would not be the Poisson sample of "
        "the whole dataset that is accounted (or the ranks' collectives would not match). "
        "p.data_loader gives every rank the same number of batches per epoch: iterate it "
        "whole on every rank, for the same number of epochs or steps, without a join, "
        "and wrap the model in a new DistributedDataParallel (torch leaves this one's join "
        "enabled; the model as make_private returned it can also be trained unwrapped: "
        "the engine all-reduces the noisy sums itself). Nothing was released or accounted"
    )
