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
device memory. Likewise a parameter written in place during the training forward (a
statistic kept in a frozen ``nn.Parameter``, ``self.stat.copy_(x.amax(0))``): the
probe's passes do not compare parameters, so its version counter is noted before each
training forward and compared after it, and such a write is refused at the step (not
under FSDP2, whose forward all-gathers into the parameters). A write in the backward of
an earlier batch of a gradient-accumulation step (before the last forward) is not seen
here. While the probe is pending (not under FSDP2), the buffers each training forward
writes (version counter moved, or object replaced) are noted too: a buffer written only
with gradients on (``if torch.is_grad_enabled(): self.mx.copy_(...)``) is one the probe's
passes without gradients do not see, and the probe compares it again in passes with
gradients (:mod:`privlearn.torch._probe_grad_buffers`).
"""

from __future__ import annotations

import torch

from privlearn.errors import BatchDependenceError
from privlearn.torch._tracker_util import _eager, _in_backward
from privlearn.torch.grad_sample import recording_disabled

__all__ = ["check", "check_parameters", "watch"]


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


class _Hooks:
    """The hooks of :func:`watch`; ``remove()`` removes them all."""

    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _training(module) -> bool:
    # not the probe's passes with gradients on (run as a rule's evaluation, unrecorded)
    return (module.training and torch.is_grad_enabled() and not _in_backward()
            and not recording_disabled())


def watch(model, tracker, parameters: bool = True) -> _Hooks:
    """Note the buffers' versions at the end of each training forward of ``model`` (not
    the probe's passes, which run without gradients, nor a recomputation in the backward)
    for :func:`check`; with ``parameters`` (not under FSDP2, whose forward all-gathers
    into them), also the parameters the training forward writes in place (module
    docstring); and, while the probe is pending (not under FSDP2: its probe passes are
    collectives counted beforehand), the buffers the training forward writes, for
    :mod:`privlearn.torch._probe_grad_buffers`. Returns the hooks (``remove()`` them with
    the engine)."""
    before: list = []
    buffers: list = []

    def pre(module, args):
        before.clear()
        buffers.clear()
        if parameters and _training(module) and getattr(tracker, "_probe_pending", False):
            buffers.extend(_snapshot(module))
        if parameters and _training(module):
            before.extend(
                (f"{prefix}.{name}" if prefix else name, p, _version(p))
                for prefix, mod in module.named_modules()
                for name, p in mod._parameters.items()
                if p is not None
            )
        return None

    def post(module, args, output):
        if _training(module):
            tracker._buffer_versions = _snapshot(module)
            wrote = {(id(mod), name) for _, mod, name, b, version in buffers
                     if mod._buffers.get(name) is not b
                     or version is not None and _version(b) != version}
            if wrote:
                tracker._forward_writes = getattr(tracker, "_forward_writes", None) or set()
                tracker._forward_writes |= wrote
            for name, p, version in before:
                if version is not None and _version(p) != version:
                    tracker._parameter_written = name
                    break
        before.clear()
        buffers.clear()
        return None

    return _Hooks(
        [model.register_forward_pre_hook(_eager(pre)), model.register_forward_hook(_eager(post))]
    )


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
    # the parameters' note, for check_parameters after this step's probe (a note left by
    # a step the probe refused is replaced here)
    tracker._parameter_step = getattr(tracker, "_parameter_written", None)
    tracker._parameter_written = None
    # the buffers this step's training forwards wrote, for the probe after this check
    tracker._forward_writes_step = getattr(tracker, "_forward_writes", None) or set()
    tracker._forward_writes = None
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


def check_parameters(tracker) -> None:
    """Refuse a parameter the step's training forward wrote in place (module docstring),
    after the probe (whose refusal of a layer initialised from its batch says more), as
    :func:`check` took the note at the step's start.

    Raises
    ------
    BatchDependenceError
        Naming the parameter.
    """
    written = getattr(tracker, "_parameter_step", None)
    tracker._parameter_step = None
    if written is not None and getattr(tracker, "_probe_enabled", True):
        raise BatchDependenceError(
            f"parameter {written!r} was written in place during the model's training "
            "forward (a statistic of the batch kept in a frozen nn.Parameter, a value "
            "copied into a parameter's .data). The batch-independence probe checks the "
            "buffers the forward writes, not the parameters: one written from the data is "
            "a function of the training examples without noise, released with the "
            "state_dict (per-example clipping bounds the noisy update only). Keep such a "
            "statistic in a registered buffer (register_buffer), where the probe checks "
            "it, or write the parameter outside the forward (after step()). No step was "
            "taken and nothing was released"
        )
