"""The parameters' views of the DP optimizer's flat gradient buffers, kept from step to step.

``p.grad`` of every trained parameter is a view of one flat buffer per device and dtype
(:meth:`~privlearn.torch.optimizer.DPOptimizer._open_buffers`). Making those views anew
each step dispatches one ``split`` and, per parameter, a ``view`` to its shape and (in the
clipped sum's matrix-vector products) a ``view`` back to one dimension: a kernel launch
each on an accelerator, most of the operations of a private step on models of many small
parameters. A buffer that nobody but the optimizer references is refilled in place; its
views are then kept too, as long as nobody else holds any of them either (a view someone
kept from an earlier step is never written into: a fresh buffer is taken instead).
"""

from __future__ import annotations

import sys

import torch


def storage_uses(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (None if this torch cannot tell)."""
    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, TypeError):
        return None


_ALONE = storage_uses(torch.empty(1))


def sole_owner(t: torch.Tensor, views: int = 0) -> bool:
    """Whether no tensor but ``t`` itself (and ``views`` further tensors the caller
    holds) references ``t``'s storage, so that writing into it in place cannot change
    anything anyone else holds (False when unknown)."""
    n = storage_uses(t)
    return n is not None and _ALONE is not None and n <= _ALONE + views


class BufferViews:
    """One flat buffer's views: ``entries[id(shaped)] = (shaped, flat)`` for each of its
    parameters, ``shaped`` the parameter's view (``p.grad``), ``flat`` its
    one-dimensional piece (None when ``shaped`` is that piece: a 1-D parameter). Each
    view is held here once (the reference counts :meth:`unshared` relies on)."""

    __slots__ = ("buffer", "entries", "tensors", "__weakref__")

    def __init__(self, buffer: torch.Tensor, params, numels) -> None:
        self.buffer = buffer
        entries = {}
        for q, v in zip(params, buffer.split(list(numels)), strict=True):
            if v.shape == q.shape:
                entries[id(v)] = (v, None)
            else:
                s = v.view(q.shape)
                entries[id(s)] = (s, v)
        self.entries = entries
        self.tensors = sum(1 if f is None else 2 for _, f in entries.values())

    def shaped(self) -> list[torch.Tensor]:
        """The parameters' views, in the order of the parameters."""
        return [s for s, _ in self.entries.values()]

    def unshared(self, params, grads: bool = True) -> bool:
        """Whether the buffer and every view of it are referenced by this object alone
        (and, with ``grads``, a view by its parameter's ``.grad``): no tensor of another
        view, nor another reference to one of these views, exists. Unknown counts as
        shared. Without ``grads``, a view a ``.grad`` holds counts as shared: a batch
        left open in the buffer would show there (``zero_grad(set_to_none=False)``
        keeps the last step's views) and be wiped by the next ``zero_grad``."""
        if not sole_owner(self.buffer, self.tensors):
            return False
        for q, (s, f) in zip(params, self.entries.values(), strict=True):
            g = q.grad is s  # the parameter's own reference to its view
            if g and not grads:
                return False
            if _refs(s, f) > _BASE[g] or f is not None and _refs(f, s) > _BASE[False]:
                return False
            try:
                if s._use_count() != 1 + g or f is not None and f._use_count() != 1:
                    return False
            except (AttributeError, RuntimeError):
                return False
        return True


def _refs(t: torch.Tensor, _other) -> int:
    """References to ``t`` seen from a call that passes it (the same form for every
    tensor checked, so that :data:`_BASE` calibrates it)."""
    return sys.getrefcount(t)


def _calibrate() -> tuple[int, int]:
    """The reference counts :meth:`BufferViews.unshared` sees for a view nobody else
    holds (the same calls on views made here): without and with its parameter's
    ``.grad`` referring to it."""
    q1, q2 = torch.empty(2), torch.empty(1, 2)
    b = BufferViews(torch.empty(4), (q1, q2), (2, 2))
    ((s1, f1), (s2, f2)) = b.entries.values()
    free = max(_refs(s1, f1), _refs(s2, f2), _refs(f2, s2))
    q2.grad = s2
    held = _refs(s2, f2)
    q2.grad = None
    return free, held


_BASE = _calibrate()
