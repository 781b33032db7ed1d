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
here. At every training forward (not under FSDP2), the buffers it writes (version counter
moved, or object replaced, or an empty slot filled) are noted too: a buffer written only
with gradients on (``if torch.is_grad_enabled(): self.mx.copy_(...)``) is one the probe's
passes without gradients do not see, and the probe compares it again in passes with
gradients (:mod:`privlearn.torch._probe_grad_buffers`); a buffer the probe has not judged,
written at a later step (past a threshold, a cache filled late) or by the first forward
alone (a data-dependent initialisation), re-arms the probe or is refused
(:mod:`privlearn.torch._late_writes`). The modules are listed once per module tree (the
tracker's fingerprint of it), so a forward reads only the version counters: no device
access. A write through ``.data`` (``self.stat.data.copy_(...)``, ``self.w.data.mul_(...)``,
``self.stat.data = ...``) moves no version counter: the training forward's are noted by
:mod:`privlearn.torch._data_writes` and count as the slot's writes (not after the
forward: in the backward pass or the loop before the step, such a write is not seen).
A call of the model inside its own training forward (a teacher pass through itself under
``no_grad``) is covered by the outer call's notes: its hooks leave them alone.
"""

from __future__ import annotations

import sys

import torch

from privlearn.errors import BatchDependenceError
from privlearn.torch import _data_writes, _late_writes
from privlearn.torch._tracker_util import _autocast_state, _eager, _in_backward
from privlearn.torch.grad_sample import recording_disabled

__all__ = ["check", "check_parameters", "undo_refused", "watch"]


def _version(b: torch.Tensor) -> int | None:
    try:
        return b._version
    except RuntimeError:  # an inference tensor keeps no version counter: not compared
        return None


def _slots(modules) -> list:
    """``(key, module, name, buffer or None, version)`` of every buffer slot of
    ``modules`` (an empty one too: a forward may fill it)."""
    return [
        ((id(mod), name), mod, name, b, None if b is None else _version(b))
        for mod in modules
        for name, b in mod._buffers.items()
    ]


def _qualified(model, module, name: str) -> str:
    """``name`` of ``module`` qualified from ``model`` (for a message)."""
    prefix = next((p for p, m in model.named_modules() if m is module), "")
    return f"{prefix}.{name}" if prefix else name


class _Hooks:
    """The hooks of :func:`watch`; ``remove()`` removes them all and ends a watch of
    writes through ``.data`` still open (``ended``: the callable that does)."""

    def __init__(self, handles, ended=None):
        self.handles = handles
        self.ended = ended

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if self.ended is not None:
            self.ended()


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _call_frame():
    """The frame of the nearest ``Module._call_impl`` on this thread's stack: the call of
    the module whose hook runs (None where it cannot be told, e.g. a frame Dynamo
    rewrote)."""
    f = sys._getframe(2)
    while f is not None and f.f_code is not _CALL_IMPL:
        f = f.f_back
    return f


def _on_stack(frame) -> bool:
    """Whether ``frame`` is still running on this thread (a caller of this function)."""
    f = sys._getframe(1)
    while f is not None and f is not frame:
        f = f.f_back
    return f is not None


def _training(module) -> bool:
    # not the probe's passes with gradients on (run as a rule's evaluation, unrecorded)
    return (module.training and torch.is_grad_enabled() and not _in_backward()
            and not recording_disabled())


def watch(model, tracker, parameters: bool = True) -> _Hooks:
    """Note the buffers' versions at the end of each training forward of ``model`` (not
    the probe's passes, which run without gradients, nor a recomputation in the backward)
    for :func:`check`; with ``parameters`` (not under FSDP2, whose forward all-gathers
    into them and whose probe passes are collectives counted beforehand), also the
    parameters the training forward writes in place (module docstring) and the buffers it
    writes, for :mod:`privlearn.torch._probe_grad_buffers` and
    :mod:`privlearn.torch._late_writes`. Returns the hooks (``remove()`` them with the
    engine)."""
    before: list = []
    buffers: list = []
    took = [False]  # the pre-hook listed the slots (an empty list too)
    session = [None]  # the forward's watch of writes through .data
    # the frame of the training forward's call whose notes are open: a call of the model
    # inside its own forward (a teacher pass through itself under no_grad) is covered by
    # them, and its hooks leave them alone (they cleared them: the outer forward's writes
    # went unnoticed); a frame no longer running (a forward stopped by a
    # KeyboardInterrupt, which runs no always_call hook) is no outer call
    outer = [None]
    late = parameters and getattr(tracker, "_probe_enabled", True)

    def nested() -> bool:
        # called by the hooks below (a frame of their own: _call_frame skips it too)
        return (outer[0] is not None and _call_frame() is not outer[0]
                and _on_stack(outer[0]))

    def stop_watching():
        # the forward's watch of writes through .data, ended; also (at detach) one left
        # open by a forward that a KeyboardInterrupt stopped (a BaseException: torch runs
        # no always_call hook for it), which would otherwise keep torch.Tensor.data a
        # property recording every alias of the model's storages after the engine is gone
        _data_writes.end(session[0])
        session[0] = None

    def pre(module, args, kwargs):
        if nested():
            return None  # inside the model's own forward: the outer call's notes cover it
        outer[0] = None
        stop_watching()  # left open by an interrupted forward
        before.clear()
        buffers.clear()
        took[0] = False
        if not (parameters and _training(module)):
            return None
        outer[0] = _call_frame()  # a training forward's notes: open until its end
        modules = _late_writes.modules(tracker, module)
        buffers.extend(_slots(modules))
        took[0] = True
        if late and not getattr(tracker, "_probe_pending", False):
            _late_writes.before_forward(tracker, module, buffers, args, kwargs,
                                        _autocast_state())
        before.extend((mod, name, p, _version(p)) for mod in modules
                      for name, p in mod._parameters.items() if p is not None)
        if late:  # writes through .data move no version counter (:mod:`._data_writes`)
            session[0] = _data_writes.begin(
                "forward", module, [(key, b) for key, _, _, b, _ in buffers if b is not None]
                + [(i, p) for i, (_, _, p, _) in enumerate(before)])
        return None

    def post(module, args, output):
        if nested():
            return None
        dot = set(_data_writes.end(session[0]))  # buffer keys, indices in `before`
        session[0] = None
        if _training(module):
            now = _slots(_late_writes.modules(tracker, module))
            tracker._buffer_versions = (module, now)
            wrote = _late_writes.written(buffers, now) if took[0] else set()
            wrote |= {t for t in dot if type(t) is tuple}
            if wrote:
                tracker._forward_writes = getattr(tracker, "_forward_writes", None) or set()
                tracker._forward_writes |= wrote
            if late and took[0]:
                _late_writes.after_forward(tracker, buffers, wrote)
            for i, (mod, name, p, version) in enumerate(before):
                if version is not None and _version(p) != version or i in dot:
                    tracker._parameter_written = (_qualified(module, mod, name), p)
                    break
        before.clear()
        buffers.clear()
        took[0] = False
        return None

    def failed(module, args, output):  # run after post, and when the forward raised
        if nested():
            return None
        outer[0] = None
        stop_watching()

    return _Hooks(
        [model.register_forward_pre_hook(_eager(pre), with_kwargs=True),
         model.register_forward_hook(_eager(post)),
         model.register_forward_hook(_eager(failed), always_call=True)], stop_watching)


def check(tracker) -> None:
    """Refuse a buffer written since the last training forward of the model (module
    docstring); the note is used once. The buffers so written are filled with NaN (zeros
    for integers) before the refusal, so that a ``state_dict`` saved after catching it
    does not hold what the write kept (:func:`_blank`).

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
    model, seen = seen or (None, ())
    late = [(mod, name, mod._buffers.get(name)) for _, mod, name, b, version in seen
            if b is not None and (mod._buffers.get(name) is not b
                                  or version is not None and _version(b) != version)]
    for mod, name, now in late[:1]:
        _blank(now for _, _, now in late)  # no copy from before the write is kept
        qualified = _qualified(model, mod, name)
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


def _blank(buffers) -> None:
    """Fill the buffers a refused step wrote after its forward with NaN (zeros for an
    integer or bool one): no value from before the write is kept (a copy of every buffer
    at every step would cost memory), and one that no one mistakes for a trained
    statistic is released by a ``state_dict`` saved after the refusal, not the statistic
    of the gradients the write kept."""
    with torch.no_grad():
        for b in buffers:
            if b is not None:
                b.detach().fill_(float("nan") if b.is_floating_point() or b.is_complex() else 0)


def check_parameters(tracker) -> None:
    """Refuse a parameter the step's training forward wrote in place (module docstring),
    after the probe (whose refusal of a layer initialised from its batch says more), as
    :func:`check` took the note at the step's start. The parameter is filled with NaN
    before the refusal (:func:`_blank_parameter`).

    Raises
    ------
    BatchDependenceError
        Naming the parameter.
    """
    note = getattr(tracker, "_parameter_step", None)
    if note is None or not getattr(tracker, "_probe_enabled", True):
        tracker._parameter_step = None
        return
    written = note[0]
    _blank_parameter(tracker)
    raise BatchDependenceError(
        f"parameter {written!r} was written in place during the model's training "
        "forward (a statistic of the batch kept in a frozen nn.Parameter by an in-place "
        "operation on it, e.g. p.copy_(...)). The batch-independence probe checks the "
        "buffers the forward writes, not the parameters: one written from the data is "
        "a function of the training examples without noise, released with the "
        "state_dict (per-example clipping bounds the noisy update only). Keep such a "
        "statistic in a registered buffer (register_buffer), where the probe checks "
        "it, or write the parameter outside the forward (after step()). No step was "
        "taken and nothing was released; the parameter is filled with NaN (its value "
        "before the forward is not kept)"
    )


def _blank_parameter(tracker) -> None:
    """Fill the parameter the step's training forward wrote in place (the note
    :func:`check` took) with NaN (zeros for an integer one) and drop the note: no copy of
    the parameters from before the forward is kept (one at every forward would double
    their memory), so a ``state_dict`` saved after the refusal holds a value no one
    mistakes for a trained one, not the statistic of the batch the write kept. A
    trainable parameter so written is blanked too: its pre-step value is not held."""
    note = getattr(tracker, "_parameter_step", None)
    tracker._parameter_step = None
    if note is not None:
        _blank([note[1]])


def undo_refused(tracker, start) -> None:
    """After the step's batch-independence checks refused it (the probe, the rows it
    could not group, or :func:`check_parameters`): put the buffers the step's training
    forwards wrote back at their values before the step (:func:`privlearn.torch.
    _late_writes.undo`; ``start``: the tracker's ``_probe_buffers`` before the probe, or
    None) and blank a parameter the forward wrote in place (:func:`_blank_parameter`), so
    that a ``state_dict`` saved after catching the refusal keeps no statistic of the
    refused batch."""
    _late_writes.undo(tracker, start)
    _blank_parameter(tracker)
