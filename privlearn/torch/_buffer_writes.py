"""Buffers written after the model's training forward, before ``optimizer.step()``.

The batch-independence probe (:mod:`privlearn.torch.probe`) compares the buffers the
forward pass writes (:mod:`privlearn.torch._probe_buffers`); its passes run the forward
alone, without gradients. A buffer written in the backward pass (a gradient hook keeping
a running maximum of the gradients, ``h.register_hook(lambda g: self.gmax.copy_(...))``)
or by the loop between ``backward()`` and ``step()`` is a function of the training
examples that none of its passes sees: it would be kept in the model and released with
its ``state_dict``, without noise (per-example clipping bounds the noisy update, not a
buffer). So the version counter (and the object) of every buffer is noted at the end of
each training forward of the model and compared at the step, before anything is
released: a buffer written since is refused, naming it. Reading the counters touches no
device memory. A write in the backward of an earlier batch of a gradient-accumulation
step (before the last forward) is not seen here.
"""

from __future__ import annotations

import torch

from privlearn.errors import BatchDependenceError
from privlearn.torch._tracker_util import _eager, _in_backward

__all__ = ["check", "watch"]


def _version(b: torch.Tensor) -> int | None:
    try:
        return b._version
    except RuntimeError:  # an inference tensor keeps no version counter: not compared
        return None


def _snapshot(model) -> list:
    return [
        (prefix, mod, name, b, _version(b))
        for prefix, mod in model.named_modules()
        for name, b in mod._buffers.items()
        if b is not None
    ]


def watch(model, tracker) -> torch.utils.hooks.RemovableHandle:
    """Note the buffers' versions at the end of each training forward of ``model`` (not
    the probe's passes, which run without gradients, nor a recomputation in the backward)
    for :func:`check`. Returns the hook's handle (``remove()`` it with the engine)."""

    def post(module, args, output):
        if module.training and torch.is_grad_enabled() and not _in_backward():
            tracker._buffer_versions = _snapshot(module)
        return None

    return model.register_forward_hook(_eager(post))


def check(tracker) -> None:
    """Refuse a buffer written since the last training forward of the model (module
    docstring); the note is used once.

    Raises
    ------
    BatchDependenceError
        Naming the buffer and its module.
    """
    seen = getattr(tracker, "_buffer_versions", None)
    tracker._buffer_versions = None
    if not getattr(tracker, "_probe_enabled", True):  # check_batch_independence=False
        return
    for prefix, mod, name, b, version in seen or ():
        now = mod._buffers.get(name)
        if now is b and (version is None or _version(b) == version):
            continue
        qualified = f"{prefix}.{name}" if prefix else name
        raise BatchDependenceError(
            f"buffer {qualified!r} of a {type(mod).__name__} was written after the model's "
            "training forward, before optimizer.step(): in the backward pass (a gradient "
            "hook, a tensor hook keeping a statistic of the gradients) or by the loop "
            "between backward() and step(). The batch-independence probe checks only the "
            "buffers the forward writes; one written from the gradients or the data "
            "outside it is a function of the training examples without noise, kept in the "
            "model and released with its state_dict (per-example clipping does not cover "
            "it). Do not write buffers in the backward pass; update a data-independent "
            "buffer before the forward or after step() (one the backward recomputes from "
            "the weights alone, under activation checkpointing: check_batch_independence="
            "False promises it holds nothing of the data). No step was taken and nothing was "
            "released"
        )
