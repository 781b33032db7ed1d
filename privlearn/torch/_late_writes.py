"""Buffers a training forward writes at a step where the probe has not judged them.

The batch-independence probe (:mod:`privlearn.torch.probe`) runs at the first step and
again when something re-arms it; it compares the buffers its passes write
(:mod:`privlearn.torch._probe_buffers`). A buffer the training forward writes only at a
later step (past a threshold, ``if self.steps > 100: self.stat.copy_(x.mean(0))``; a cache
first filled, or refreshed, at step 50) was never compared, and one written from the
first training forward alone (a data-dependent initialisation keyed on a Python flag,
``if not self.initialized: self.scale.copy_(...); self.initialized = True``: ActNorm,
LSUV, a quantization observer's calibration) is written by none of the probe's passes,
which ran after the flag was set. Either would keep a statistic of the private batch in
the model, released with its ``state_dict`` without noise.

So the slots (buffers) whose writes the probe has judged are kept per tracker, and every
training forward's writes are noted from the buffers' version counters and objects (host
integers, no device access; :mod:`privlearn.torch._buffer_writes`):

* a forward writing a buffer the probe has not judged re-arms the probe for that step,
  on that forward's inputs, from the buffers and the plain attributes the forward set
  itself (a call counter, a flag) as they were before it: the unjudged buffers' values
  before it are copies kept since the last step (taken once, again only when something
  wrote them between training forwards), those attributes are read before every training
  forward (:func:`privlearn.torch._rearm` lists them);
* each probe pass starts from those buffers (all of them, while the probe is pending at
  the forward: :func:`start_state`) and, in a model with buffer slots, those attributes
  (a model without any keeps its counters as its passes leave them: they gate no
  buffer's write), and puts back what the training forward left after it, so it replays
  the step's forward;
* after the probe (:func:`settle`), the buffers its passes wrote are judged (a buffer
  written from the data was refused by then); a buffer the step's training forwards
  wrote that none of its passes wrote (the write hangs on state it cannot put back: a
  global, a closure, a flag kept elsewhere) is refused, naming it.

Not under FSDP2, whose probe passes are collectives counted beforehand; nor for a batch
too small to probe (fewer than two examples), whose probe waits for the next batch.
"""

from __future__ import annotations

import enum

import torch

from privlearn.errors import BatchDependenceError
from privlearn.torch import _data_writes

__all__ = [
    "after_forward",
    "before_forward",
    "modules",
    "put_back",
    "restore",
    "settle",
    "start_pass",
    "start_state",
    "undo",
    "written",
]

_SCALARS = (bool, int, float, str, enum.Enum, type(None))
_SKIP = frozenset({"training", "_is_full_backward_hook", "_is_hf_initialized"})
_MISSING = object()


def _version(b) -> int | None:
    try:
        return b._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


class _State:
    """Per tracker: the slots judged, copies of the unjudged buffers, what the current
    training forward saw before it ran."""

    def __init__(self):
        self.judged: set = set()  # (module id, name) of slots the probe judged
        self.copies: dict = {}  # (module id, name) -> (buffer, version, clone)
        self.inputs = None
        self.attrs: list = []
        self.internal = (None, 0, [])  # (model, size of _rearm's set, [(dict, name)])
        self.modules = None  # (fingerprint, model, [modules])


def _state(tracker) -> _State:
    state = tracker.__dict__.get("_late_writes")
    if state is None:
        state = tracker._late_writes = _State()
    return state


def start_state(model) -> tuple[dict, list]:
    """The model's buffers (clones; None for an empty slot) and every module's plain
    scalar attributes, before a training forward while the probe is pending: the probe's
    passes start from them."""
    buffers = {
        (id(m), n): None if b is None else b.detach().clone()
        for m in model.modules()
        for n, b in m._buffers.items()
    }
    attrs = [
        (m.__dict__, k, v)
        for m in model.modules()
        for k, v in m.__dict__.items()
        if k not in _SKIP and isinstance(v, _SCALARS)
    ]
    return buffers, attrs


def restore(attrs: list) -> list:
    """Set the attributes of ``attrs`` (``(module __dict__, name, value)``) that hold
    another value now (those the training forward set: a counter, a flag) and return
    what they held (the same form), for the probe's pass to put back afterwards."""
    held = []
    for d, k, v in attrs:
        now = d.get(k, _MISSING)
        if now is v or type(now) is type(v) and isinstance(now, _SCALARS) and now == v:
            continue
        held.append((d, k, now))
        if v is _MISSING:
            d.pop(k, None)
        else:
            d[k] = v
    return held


def start_pass(saved: list, start: list) -> None:
    """Before a probe pass: put each slot of ``saved`` (``(..., module, name, buffer,
    copy)``) at its value in ``start`` (None: empty)."""
    for (*_, mod, name, b, _), v in zip(saved, start, strict=True):
        if v is None:
            mod._buffers[name] = None
        elif b is not None and v.shape == b.shape and v.dtype == b.dtype:
            b.copy_(v)
        else:  # a buffer the forward sized (an observer's, empty before)
            mod._buffers[name] = v.clone()


def put_back(saved: list, graphs: set | None) -> None:
    """After a probe pass: each slot of ``saved`` holds its buffer again, with the value
    copied before the pass; ``graphs`` (a pass with gradients): the buffers that held a
    graph before it, any other one written from a tensor with a graph is detached. A
    pass that raised leaves its watch of writes through ``.data`` open: dropped here
    (:mod:`privlearn.torch._data_writes`)."""
    _data_writes.discard("probe")
    with torch.no_grad():
        for *_, mod, name, b, v in saved:
            mod._buffers[name] = b
            if b is None:
                continue
            b.copy_(v)
            if graphs is not None and b.grad_fn is not None and id(b) not in graphs:
                b.detach_()  # a write from a tensor with a graph would keep it


def undo(tracker, start) -> None:
    """After the probe refused the step: put the buffers the step's training forwards
    wrote back at their values before the step (``start``: the tracker's
    ``_probe_buffers`` as the step's first forward left it, ``({(module id, name): value
    or None}, attrs)``), so that a user who catches the refusal and saves the model's
    ``state_dict`` does not release the statistic the refused forward kept. A slot the
    probe judged (data-independent: a counter) and holds no value of is left as it is;
    one it has not judged, written with no value kept from before the step, is filled
    with NaN (zeros for an integer or bool buffer): a value no one mistakes for a trained
    statistic, where keeping the batch's would release it (the copies
    :func:`before_forward` takes make this a last resort)."""
    before = start[0] if start else {}
    steps = getattr(tracker, "_forward_writes_step", None) or set()
    wrote = steps - _state(tracker).judged | set(before)
    if not wrote:
        return
    model = getattr(tracker.model, "_orig_mod", tracker.model)
    with torch.no_grad():
        for mod in model.modules():
            for name, b in list(mod._buffers.items()):
                key = (id(mod), name)
                if key not in wrote:
                    continue
                v = before.get(key, _MISSING)
                if v is None:  # empty before the step (or registered by its forward)
                    mod._buffers[name] = None
                elif v is _MISSING:
                    if b is not None:
                        b.fill_(float("nan") if b.is_floating_point() or b.is_complex() else 0)
                elif b is not None and b.shape == v.shape and b.dtype == v.dtype:
                    b.copy_(v)
                else:  # the forward replaced or resized it
                    mod._buffers[name] = v.clone()


def _internal(tracker, model) -> list:
    """``(module __dict__, name)`` of the attributes a training forward sets itself, as
    :mod:`privlearn.torch._rearm` found them (listed again when that set grows)."""
    rearm = tracker.__dict__.get("_rearm_state")
    found = rearm[0].internal if rearm is not None else ()
    state = _state(tracker)
    if state.internal[0] is not model or state.internal[1] != len(found):
        dicts = {id(m): m.__dict__ for m in model.modules()}
        slots = [(dicts[i], k) for i, k in found if i in dicts]
        state.internal = (model, len(found), slots)
    return state.internal[2]


def before_forward(tracker, model, snap: list, args, kwargs, autocast) -> None:
    """At a training forward while no probe is pending: refresh the copies of the
    unjudged buffers a write since changed (``snap``: ``(key, module, name, buffer,
    version)`` of every slot now), hold the inputs and the attributes the forward sets
    itself, for :func:`after_forward`."""
    state = _state(tracker)
    for key, _, _, b, version in snap:
        if b is None or key in state.judged:
            continue
        c = state.copies.get(key)
        if c is None or c[0] is not b or c[1] != version:
            state.copies[key] = (b, version, b.detach().clone())
    state.inputs = (args, dict(kwargs), autocast)
    state.attrs = [
        (d, k, v)
        for d, k in _internal(tracker, model)
        if isinstance(v := d.get(k, _MISSING), _SCALARS) or v is _MISSING
    ]


def modules(tracker, model) -> list:
    """The modules of ``model``, listed again when the tracker's fingerprint of the
    module tree (:func:`privlearn.torch._tracker_util.mixing_fingerprint`, taken at every
    training forward) is another object: walking the tree costs more than reading the
    version counters."""
    shape = getattr(tracker, "_mixing_shape", None)
    state = _state(tracker)
    held = state.modules
    if shape is None or held is None or held[0] is not shape or held[1] is not model:
        held = state.modules = (shape, model, list(model.modules()))
    return held[2]


def written(before: list, after: list) -> set:
    """The slots written between two lists of ``(key, module, name, buffer, version)``:
    version counter moved, or another object (or one where there was none)."""
    was = {key: (b, version) for key, _, _, b, version in before}
    return {
        key
        for key, _, _, b, version in after
        if b is not None
        and (
            key not in was or was[key][0] is not b or version is not None and was[key][1] != version
        )
    }


def after_forward(tracker, snap: list, wrote: set) -> None:
    """After a training forward whose pre-hook ran :func:`before_forward`: when it wrote
    a slot the probe has not judged, arm the probe for this step, on this forward's
    inputs and from the state before it (module docstring)."""
    state = _state(tracker)
    inputs, state.inputs = state.inputs, None
    late = wrote - state.judged
    if not late or inputs is None or tracker._probe_pending:
        return
    buffers = {}
    for key, _, _, b, version in snap:
        if key not in late:
            continue
        c = state.copies.get(key)
        if b is None:
            buffers[key] = None
        elif c is not None and c[0] is b and c[1] == version:
            buffers[key] = c[2]
    seen = {key for key, *_ in snap}
    buffers.update((key, None) for key in late - seen)  # slots the forward registered
    tracker._probe_pending = True
    tracker._probe_inputs, tracker._probe_later = inputs, []
    tracker._probe_buffers = (buffers, state.attrs)


def settle(tracker) -> None:
    """After the probe ran (and passed): the buffers its passes wrote are judged; a
    buffer the step's training forwards wrote that none of them wrote is refused
    (module docstring).

    Raises
    ------
    BatchDependenceError
        Naming the buffer and its module.
    """
    state = _state(tracker)
    wrote = getattr(tracker, "_probe_writes", None) or set()
    state.judged |= wrote
    for key in wrote:
        state.copies.pop(key, None)
    unexplained = (getattr(tracker, "_forward_writes_step", None) or set()) - state.judged
    if not unexplained or not tracker._probe_enabled:
        return
    model = getattr(tracker.model, "_orig_mod", tracker.model)
    name, owner = next(
        (
            (f"{p}.{n}" if p else n, type(m).__name__)
            for p, m in model.named_modules()
            for n in m._buffers
            if (id(m), n) in unexplained
        ),
        ("?", "module"),
    )
    raise BatchDependenceError(
        f"buffer {name!r} of a {owner} was written by the model's training forward in "
        "this step, but by none of the batch-independence probe's passes, which ran that "
        "forward again on the same batch from the buffers and module attributes it started "
        "from: the write hangs on state the probe cannot put back (a flag kept outside the "
        "module's buffers and plain attributes, a global, a closure), so privlearn cannot "
        "tell whether the buffer holds a statistic of the batch, which would be released "
        "with the state_dict without noise. A data-dependent initialisation run by the "
        "first training forward (ActNorm, LSUV, a quantization observer's calibration) is "
        "such a write, and releases that private batch's statistic: run it before "
        "make_private, in a forward pass in training mode on public data (its flag is then "
        "set and training no longer writes the buffer). Build a cache that holds no data "
        "(from shapes or weights) before make_private, or keep its flag in a registered "
        "buffer or a plain attribute of its module. No step was taken and nothing was "
        "released"
    )
