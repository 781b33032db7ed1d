"""Rows selected by the data: which tensors of a probe pass descend from an operation
whose output's number of rows depends on the values of its input (a boolean mask,
``torch.nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` by a tensor of
counts).

A layer that sees each example's rows flattened into rows of its own is regrouped into
examples, ``(B * k, ...)`` viewed as ``(B, k, ...)``, once the batch-independence probe
has verified the grouping at the model's input shapes (:mod:`privlearn.torch._flat_rows`).
That is sound when the rows are a reshape of a batch-first tensor (OPT's
``hidden.reshape(-1, d)``): their layout is then fixed by the shapes. Rows picked by a
mask (``hidden[attention_mask.bool()]``, the unpadded tokens) are not: on a batch whose
examples all have ``k`` live tokens the probe sees ``k`` rows per example wherever it
replaces an example, and a later batch of the same shapes with ``3 + 5`` live tokens
instead of ``4 + 4`` has as many rows, which the regrouping would cut at the wrong
places (one example's rows clipped with another's). :class:`SelectionTaint` marks, during
a probe pass, every tensor computed from such a selection, so that the probe refuses to
regroup the rows of a layer whose input is one.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SelectionTaint"]

_aten = torch.ops.aten

#: operations whose output's size follows the values of their input
_SELECTING = frozenset(
    getattr(_aten, name, None)
    for name in (
        "nonzero",
        "masked_select",
        "argwhere",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "repeat_interleave",
    )
)
_SELECTING_PACKETS = frozenset(p for p in _SELECTING if p is not None)


def _selects(func, args) -> bool:
    """Whether ``func`` (an aten overload) called on ``args`` selects rows by value."""
    packet = getattr(func, "overloadpacket", None)
    if packet in _SELECTING_PACKETS:  # repeat_interleave: by a tensor of counts only
        return getattr(func, "_overloadname", "") != "self_int"
    if packet is _aten.index:  # x[mask]; writing through a mask (x[mask] = v) keeps the rows
        indices = args[1] if len(args) > 1 else ()
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in indices or ()
        )
    return False


#: writes into a tensor whose layout they keep (``h[mask] = v``, ``masked_scatter``): the
#: written tensor's rows stay where its shapes put them, whatever ``v`` was computed from
_WRITES = frozenset(
    p
    for p in (
        getattr(_aten, name, None)
        for name in (
            "index_put",
            "index_put_",
            "_index_put_impl_",
            "masked_scatter",
            "masked_scatter_",
        )
    )
    if p is not None
)


class SelectionTaint(TorchDispatchMode):
    """During a forward pass: the tensors computed from a selection by value (module
    docstring), the selection's own output and everything computed from it (an
    operation with such an input), except a tensor a selection's rows were written into
    in place of its own (:data:`_WRITES`: its layout is its shapes')."""

    def __init__(self) -> None:
        super().__init__()
        self._tainted: dict[int, weakref.ref] = {}

    def tainted(self, t) -> bool:
        """Whether tensor ``t`` was computed from a selection by value in this pass."""
        ref = self._tainted.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._tainted[id(t)] = weakref.ref(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "overloadpacket", None) in _WRITES:
            if args and self.tainted(args[0]):
                self._mark(out)  # the rows of a selection, written into
            return out
        inputs = tree_flatten((args, kwargs))[0]
        if _selects(func, args) or any(
            self.tainted(t) for t in inputs if isinstance(t, torch.Tensor)
        ):
            self._mark(out)  # (an in-place operation returns the tensor it wrote)
        return out
