"""Writes through ``.data`` to a model's buffers and parameters during a forward pass.

``t.data`` is another tensor on ``t``'s storage with a version counter of its own: a
write through it (``self.stat.data.copy_(x.mean(0))``, ``self.w.data.mul_(...)``, old
code's running averages) moves no version counter of ``t``, and assigning ``t.data = v``
moves none either. The notes :mod:`privlearn.torch._buffer_writes` takes from the
version counters (host integers) would miss such a write after the first step (whose
probe compares values): a statistic of a private batch kept in the model and released
with its ``state_dict``, without noise. No cheaper signal exists: the storage keeps no
version, and its data pointer does not move on an in-place write.

So while a training forward of an attached model runs (:func:`begin` in the
engine's forward pre-hook, :func:`end` in its forward hook, also run when the forward
raises), and while each probe pass runs, ``torch.Tensor.data`` is a property
(:func:`_install`) that keeps every alias it returns of a tensor on the storage of a
watched buffer or parameter (the slot's tensor, a detached alias the engine swapped in, a
view, an alias of an alias); :func:`end` names the slots whose alias's version counter
moved (a write through it or a view of it) or whose tensor had ``.data`` assigned. Host
integers only, no device access. A forward that reads no ``.data`` pays :func:`begin`
and :func:`end` (2 to 8 microseconds: the property set on ``torch.Tensor`` and removed)
and, after them, Python specialising its attribute reads of tensors again (measured at
30 to 40 microseconds a step of a small MLP, about 1% of its 3 ms on one CPU thread; not
measurable in a tiny GPT-2's step of 250 ms); a ``.data`` read while watched costs 1 to
2 microseconds more (the storage's address; the watched slots' addresses are read at the
first one). An operator-level interception (a ``TorchDispatchMode`` over the forward,
matching in-place operations against the slots' storages) costs about 8 microseconds for
every operation of every forward (170 in a tiny GPT-2's), a ``TorchFunctionMode``
(which sees ``.data`` reads) about 1; a fingerprint of every slot's values before and
after the forward costs two reductions per slot and forward and defers the refusal to
the next host read.

Not seen: an alias taken before the forward and written during it (``self.s =
self.stat.data`` in ``__init__``), a write through ``numpy()`` or DLPack. Compiled code
is not watched here (Dynamo reads ``.data`` with torch's own function, not this
property): the AOT-autograd backends of ``torch.compile`` (the default ``inductor``,
``aot_eager``) apply such a write to the slot itself on return, which moves its version
counter, but under ``backend="eager"`` (Dynamo's graph run as traced) it moves none and
is not seen.
"""

from __future__ import annotations

import torch

__all__ = ["begin", "discard", "end"]

_BASE = torch._C.TensorBase.data  # the C attribute the property wraps
_MISSING = object()


class Session:
    """The slots one forward pass watches and the aliases of them ``.data`` returned."""

    __slots__ = ("kind", "owner", "slots", "by_ptr", "by_id", "aliases", "assigned")

    def __init__(self, kind: str, owner: int, slots: list):
        self.kind, self.owner = kind, owner
        self.slots = slots  # [(tag, tensor)]
        self.by_ptr: dict | None = None  # storage address -> [tag], at the first access
        self.by_id: dict | None = None  # id(tensor) -> (tensor, [tag])
        self.aliases: list = []  # [(tags, alias)]
        self.assigned: list = []  # tags of the tensors whose .data was assigned

    def _maps(self) -> None:
        by_ptr: dict = {}
        by_id: dict = {}
        for tag, t in self.slots:
            by_id.setdefault(id(t), (t, []))[1].append(tag)
            ptr = _address(t)
            if ptr:  # an empty storage holds nothing to write
                by_ptr.setdefault(ptr, []).append(tag)
        self.by_ptr, self.by_id = by_ptr, by_id


_active: list[Session] = []
_below = [_MISSING]  # what torch.Tensor held as "data" before the property


def _address(t) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without storage: unmatched
        return 0


def _below_attribute():
    """What the property wraps: torch's C attribute, or what ``torch.Tensor`` held
    before it. Another thread may have read the property just before the last watch
    ended and uninstalled it (``_below[0]`` then back at ``_MISSING``): its read or
    assignment goes to torch's own attribute, never fails."""
    below = _below[0]
    return _BASE if below is None or below is _MISSING else below


def _get(t):
    below = _below_attribute()
    alias = below.__get__(t) if below is _BASE else below.__get__(t, type(t))
    ptr = None
    for s in _active:
        if s.by_ptr is None:
            s._maps()
        if ptr is None:
            ptr = _address(t)
        tags = s.by_ptr.get(ptr) if ptr else None
        if tags:
            s.aliases.append((tags, alias))
    return alias


def _same(t, value) -> bool:
    """Whether assigning ``value`` to ``t.data`` leaves ``t`` as it is (``module.to()``
    of a module already there assigns each parameter's ``.data`` its own value)."""
    if value is t:
        return True
    try:
        return _address(t) == _address(value) != 0 and (
            value.dtype,
            value.shape,
            value.stride(),
            value.storage_offset(),
        ) == (t.dtype, t.shape, t.stride(), t.storage_offset())
    except (AttributeError, RuntimeError):  # not a strided tensor: a new value
        return False


def _set(t, value) -> None:
    for s in [] if _same(t, value) else _active:
        if s.by_id is None:
            s._maps()
        held = s.by_id.get(id(t))
        if held is not None and held[0] is t:
            s.assigned.extend(held[1])
    _below_attribute().__set__(t, value)


_PROPERTY = property(_get, _set, doc=_BASE.__doc__)


def _install() -> None:
    if torch.Tensor.__dict__.get("data") is _PROPERTY:
        return
    _below[0] = torch.Tensor.__dict__.get("data")  # None: the C attribute
    torch.Tensor.data = _PROPERTY


def _uninstall() -> None:
    if torch.Tensor.__dict__.get("data") is not _PROPERTY:
        return
    below, _below[0] = _below[0], _MISSING
    if below is None or below is _MISSING:
        del torch.Tensor.data
    else:
        torch.Tensor.data = below


def begin(kind: str, owner: object, slots: list) -> Session:
    """Watch ``slots`` (``(tag, tensor)``; ``tag``: what :func:`end` returns for the
    slot) for writes through ``.data`` until :func:`end`. A session of the same ``kind``
    and ``owner`` still open (its forward raised before :func:`end`) is dropped."""
    discard(kind, owner)
    session = Session(kind, id(owner), slots)
    _active.append(session)
    _install()
    return session


def end(session: Session | None) -> list:
    """Stop watching (once; later calls return nothing) and return the tags of the slots
    written through ``.data`` since :func:`begin`, in the order of the writes' aliases
    (a tag once)."""
    if session is None or session not in _active:
        return []
    _active.remove(session)
    if not _active:
        _uninstall()
    out = list(session.assigned)
    for tags, alias in session.aliases:
        try:
            moved = alias._version != 0
        except RuntimeError:  # an inference tensor keeps no version counter: assume written
            moved = True
        if moved:
            out.extend(tags)
    session.aliases = []
    return list(dict.fromkeys(out))


def discard(kind: str, owner: object | None = None) -> None:
    """Drop the open sessions of ``kind`` (and ``owner``, when given) unread: a pass
    that raised."""
    for s in [s for s in _active if s.kind == kind and (owner is None or s.owner == id(owner))]:
        _active.remove(s)
    if not _active:
        _uninstall()
