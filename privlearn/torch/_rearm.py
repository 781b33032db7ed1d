"""What else re-arms the batch-independence probe (:mod:`privlearn.torch.probe`) at a
training forward, besides the trainable set and the module tree, flags and hooks
(:func:`~privlearn.torch._tracker_util.mixing_fingerprint`) and the call's signature
(:func:`~privlearn.torch._tracker_util.new_call`):

* **Module attributes.** A forward that reads a plain attribute (``if self.mix: h = h +
  h.flip(0)``) switches its path when the user sets it after some steps
  (``model.mix = True``). The plain scalar attributes of every module (values of type
  bool, int, float, str, an Enum member, or None in the module's ``__dict__``; not
  ``training``, which the mixing fingerprint holds, nor torch's and Hugging Face's
  bookkeeping flags) are compared at every training forward; a combination of values the
  probe has not run on re-runs it on that step. Their names are listed once per module
  tree (again when a module's attribute count changes), so a forward reads only their
  values, by one ``itemgetter`` per module, and compares them with the last ones (no
  device access; about 50 microseconds before and 50 after a forward of GPT-2, 164
  modules and 377 such attributes, on a busy CPU, where ``mixing_fingerprint`` takes
  about 500). An attribute a forward sets itself (a call counter, a cache's length; the
  probe's own passes run the forward too) is the model's state, not a switch: it is
  watched no longer once a forward in training mode changed it. A number set between
  forwards is told apart for its first :data:`ATTRIBUTE_NUMBERS` values; past them (a
  schedule written at every step) it counts by its type only, with a warning. What an
  eval-mode forward sets itself counts as set between forwards. Not seen: a forward
  reading an attribute it also sets itself (``if self.calls > 100``), an attribute that
  held another object (a tensor, a function) and is given a flag's value later without
  the module's attribute count changing, and state kept outside modules (a global, a
  closure).
* **0-d tensor arguments** (``model(x, mix=torch.tensor(True))``, top-level positional or
  keyword arguments). On the CPU their value is read (no device wait) and counts as the
  Python value in the call's signature (bools always told apart, numbers as
  :func:`~privlearn.torch._tracker_util.new_call` tells them). On an accelerator reading
  the value would wait for the device at every step, so it is not read: a 0-d tensor
  argument that is another tensor object than at the last forward, or the same one
  modified in place since (its version counter), re-runs the probe, for the first
  :data:`~privlearn.torch._tracker_util.NUMERIC_CALLS` such changes; past them (a new
  tensor made at every step) a warning says the probe no longer re-runs for them: pass a
  flag that selects a code path as a Python bool or str.
"""

from __future__ import annotations

import enum
import operator
import warnings
import weakref
from itertools import chain

import torch

from privlearn.torch._probe_size import new_batch_size
from privlearn.torch._tracker_util import NUMERIC_CALLS, _eager, new_call

__all__ = ["ATTRIBUTE_NUMBERS", "changed"]

#: distinct values of one numeric module attribute that are told apart; past this many
#: (a counter) its changes count by the value's type only
ATTRIBUTE_NUMBERS = 4
#: attributes torch keeps for itself (``training``: in the mixing fingerprint)
_SKIP = frozenset({"training", "_is_full_backward_hook", "_is_hf_initialized"})
_FLAG_TYPES = (bool, int, float, str, enum.Enum, type(None))


def _getter(keys: list):
    """A function of a module's ``__dict__`` returning the values of ``keys`` as a tuple."""
    if len(keys) == 1:
        key = keys[0]
        return lambda d: (d[key],)
    return operator.itemgetter(*keys)


class _Attributes:
    """The plain scalar attributes of a model's modules (module docstring). A snapshot is
    ``(values, layout)``: a tuple of values per module that has any (``layout``:
    ``[(getter, __dict__, module id, names)]``, the same list object while the names
    stay)."""

    def __init__(self):
        self.shape = self.last = self.before = self.current = None
        self.checked = self.warned = False
        self.dicts: list = []
        self.lens: list = []
        self.layout: list = []
        self.getters: list = []
        self.owners: list = []
        self.internal: set = set()  # (module id, name) that the forward itself sets
        self.seen: set = set()  # combinations of values the probe ran on
        # (self.current: the combination of the last training forward)
        self.numbers: dict = {}  # (module id, name) -> numeric values seen
        self.coarse: set = set()  # (module id, name) counted by type only

    def _list(self, model, shape) -> None:
        self.shape, self.dicts, self.layout = shape, [], []
        for m in model.modules():
            d = m.__dict__
            keys = [
                k
                for k, v in d.items()
                if k not in _SKIP and isinstance(v, _FLAG_TYPES) and (id(m), k) not in self.internal
            ]
            self.dicts.append(d)
            if keys:
                self.layout.append((_getter(keys), d, id(m), keys))
        self.lens = list(map(len, self.dicts))
        self.getters = [g for g, *_ in self.layout]
        self.owners = [d for _, d, *_ in self.layout]

    def snapshot(self, model, shape) -> tuple:
        """``(values, layout)`` now: the values a tuple per module (listed again when the
        module tree or a module's attribute count changed)."""
        if shape is not self.shape or list(map(len, self.dicts)) != self.lens:
            self._list(model, shape)
        try:
            return list(map(operator.call, self.getters, self.owners)), self.layout
        except KeyError:  # one attribute deleted and another set: list them again
            self._list(model, shape)
            return list(map(operator.call, self.getters, self.owners)), self.layout

    @staticmethod
    def _same(a, b) -> bool:
        if a[1] is not b[1]:
            return False
        try:  # an unchanged value is the same object (no comparison runs); a value that
            return a[0] == b[0]  # is no flag any more (a tensor) may refuse to compare
        except Exception:  # noqa: BLE001 - then it changed
            return False

    def _slots(self, snap) -> dict:
        """``{(module id, name): value}`` of the flags among a snapshot's values (one that
        is no flag any more is left out, and the attributes are listed again)."""
        out = {}
        for (_, _, i, keys), vs in zip(snap[1], snap[0], strict=True):
            for k, v in zip(keys, vs, strict=True):
                if isinstance(v, _FLAG_TYPES):
                    out[i, k] = v
                else:
                    self.shape = None
        return out

    def changed(self, model, shape, probed: bool) -> bool:
        """At a training forward: whether the attributes hold a combination of values the
        probe has not run on. ``shape``: the tracker's mixing fingerprint (a new object
        when the module tree changed); ``probed``: no probe is pending, so the
        combination of the last forward was probed (only then is it taken as seen: one
        left pending, then replaced before the probe ran, was not)."""
        if probed and self.current is not None:
            self.seen.add(self.current)
        now = self.snapshot(model, shape)
        self.before, self.checked = now, True
        last, self.last = self.last, now
        if last is not None and self._same(now, last):
            return False
        self.current = tuple(
            (s, self._canonical(s, v))
            for s, v in self._slots(now).items()
            if s not in self.internal
        )
        return self.current not in self.seen

    def forward_pre(self, model, shape) -> None:
        """At any forward of the model: what the attributes hold before it runs."""
        if self.checked:  # (the check of this forward took it)
            self.checked = False
        else:
            self.before = self.snapshot(model, shape)

    def forward_post(self, model, shape) -> None:
        """After a forward: the attributes it changed itself (a call counter, a cache's
        size) are state the model keeps, not a switch; they are watched no longer."""
        before, self.before, self.checked = self.before, None, False
        if before is None:
            return
        now = self.snapshot(model, shape)
        if self._same(now, before):
            return
        a, b = self._slots(before), self._slots(now)
        moved = {
            s
            for s in a.keys() | b.keys()
            if s not in a or s not in b or type(a[s]) is not type(b[s]) or a[s] != b[s]
        }
        if moved:
            self.internal |= moved
            self.seen = {tuple(e for e in key if e[0] not in moved) for key in self.seen}
            if self.current is not None:
                self.current = tuple(e for e in self.current if e[0] not in moved)
            self.shape = None  # listed again, without them

    def _canonical(self, slot, v):
        if not isinstance(v, int | float) or isinstance(v, bool | enum.Enum):
            return v  # bool, str, None, Enum members: told apart
        if slot in self.coarse:
            return type(v)
        seen = self.numbers.setdefault(slot, set())
        if v in seen or len(seen) < ATTRIBUTE_NUMBERS:
            seen.add(v)
            return v
        self.coarse.add(slot)
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"the module attribute {slot[1]!r} has been set to more than "
                f"{ATTRIBUTE_NUMBERS} numeric values between forwards since make_private: "
                "its later values no longer re-run the batch-independence probe; a flag "
                "that selects a code path in forward should be a bool, str or Enum",
                RuntimeWarning,
                stacklevel=6,
            )
        return type(v)


def _on_cpu(t: torch.Tensor) -> bool:
    """Whether reading ``t`` waits for no device (a plain tensor in CPU memory)."""
    return type(t) is torch.Tensor and t.device.type == "cpu"


def _cpu_value(t: torch.Tensor):
    """The Python value of a 0-d tensor on the CPU (no device wait); ``t`` itself for a
    tensor elsewhere, which is not read."""
    if not _on_cpu(t):
        return t
    return t.item()


def _read_flags(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each 0-d tensor on the CPU replaced by its value."""
    if not any(isinstance(v, torch.Tensor) and v.dim() == 0 for v in chain(args, kwargs.values())):
        return args, kwargs
    return (
        tuple(_cpu_value(a) if isinstance(a, torch.Tensor) and a.dim() == 0 else a for a in args),
        {
            k: _cpu_value(v) if isinstance(v, torch.Tensor) and v.dim() == 0 else v
            for k, v in kwargs.items()
        },
    )


class _DeviceFlags:
    """0-d tensor arguments not on the CPU, by identity and version (module docstring)."""

    def __init__(self):
        self.held: dict = {}  # position or name -> (weak reference, version)
        self.changes = 0

    def changed(self, args: tuple, kwargs: dict) -> bool:
        new = False
        for slot, v in chain(enumerate(args), kwargs.items()):
            if not isinstance(v, torch.Tensor) or v.dim() or _on_cpu(v):
                continue
            was = self.held.get(slot)
            if was is not None and was[0]() is v and was[1] == v._version:
                continue
            self.held[slot] = (weakref.ref(v), v._version)
            self.changes += 1
            if self.changes <= NUMERIC_CALLS:
                new = True
            elif self.changes == NUMERIC_CALLS + 1:
                warnings.warn(
                    f"the model's forward has been called with {NUMERIC_CALLS} new 0-d "
                    f"tensor arguments on {v.device} ({slot!r}; their values are not read, "
                    "which would wait for the device): later ones no longer re-run the "
                    "batch-independence probe; pass a flag that selects a code path as a "
                    "Python bool or str",
                    RuntimeWarning,
                    stacklevel=5,
                )
        return new


def _state(tracker) -> tuple:
    state = tracker.__dict__.get("_rearm_state")
    if state is None:
        state = tracker._rearm_state = (_Attributes(), _DeviceFlags())
    return state


def install(tracker) -> list:
    """The root module's hooks that tell the attributes a forward sets itself from those
    set between forwards (:meth:`_Attributes.forward_post`); their handles. Forwards in
    eval mode (validation, ``generate``) are left alone: what they set themselves counts as
    set between forwards."""
    if not tracker._probe_enabled:
        return []
    attributes = _state(tracker)[0]

    def pre(module, args):
        if module.training:
            attributes.forward_pre(tracker.model, tracker._mixing_shape)

    def post(module, args, output):
        if module.training:
            attributes.forward_post(tracker.model, tracker._mixing_shape)

    model = tracker.model
    return [
        model.register_forward_pre_hook(_eager(pre)),
        model.register_forward_hook(_eager(post), always_call=True),
    ]


def changed(tracker, args: tuple, kwargs: dict) -> bool:
    """Whether this training forward may take a path the batch-independence probe has not
    checked: a new call signature (0-d CPU tensors by value), new module attribute values,
    a new 0-d tensor argument on an accelerator (module docstring), a batch larger or
    smaller than any seen (:mod:`privlearn.torch._probe_size`). State is kept on the
    tracker; every check runs (no short cut), so each records what it saw."""
    attributes, device = _state(tracker)
    calls = new_call(tracker._calls, *_read_flags(args, kwargs))
    moved = attributes.changed(tracker.model, tracker._mixing_shape, not tracker._probe_pending)
    return calls | moved | device.changed(args, kwargs) | new_batch_size(
        tracker, args, kwargs)
