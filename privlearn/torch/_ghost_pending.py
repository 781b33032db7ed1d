"""The last per-layer reductions of ghost norms, formed for many layers at once.

During backward a ghost layer (:func:`~privlearn.torch._ghost_norms.ghost_parts`) forms
the product of its two Gram matrices ``(N, T, T)`` and then two reductions of it: the
row sums over ``s`` and the square roots of its diagonal, ``(N, T)`` each (two operations
a layer; :func:`~privlearn.torch._ghost_norms.finish_parts` then finishes the layers of
one shape together). While a :class:`PendingProducts` is in force (:data:`PENDING`, set by
the tracker around the rules it evaluates during backward), the products of layers of one
``(N, T)``, dtype, device and two-stage split are written side by side into one buffer of
at most :data:`PENDING_BYTES` (:data:`MAX_LAYERS` layers) instead, and their row sums and
roots are formed by one reduction and one square root for all of them when the buffer is
full or the backward pass ends (:meth:`PendingProducts.flush`). Where the output
gradients' Gram matrix can be written into the buffer (:meth:`PendingProducts.take_gram`:
``torch.matmul``, ``torch.bmm`` or ``mm32``), it is formed there and multiplied by the
inputs' for the whole group by one ``_foreach_mul_`` when it flushes (the inputs' Gram
matrices held until then: at most as many bytes again as the buffer, fewer where layers
share one). Likewise the sums over positions
of the output gradients of layers of one shape (their biases' per-example gradients,
:meth:`PendingProducts.take_sum`): one stacked copy and one sum instead of a sum a layer.

The same products (one rounding each, written where the layer's own buffer would have
held them) and the same sums of each row (``T`` terms, or the two stages the bound
assumes), so the rounding bound of the module docstring of ``_ghost_norms`` holds as it
is. Each layer's :class:`~privlearn.torch._ghost_norms.GhostParts` holds views of the
results, filled with NaN until its group is flushed: a norm read too early is
non-finite (its example dropped), never a wrong finite value.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["MAX_LAYERS", "PENDING", "PENDING_BYTES", "SHARED_GRAM", "PendingProducts", "batched"]

#: Bytes of Gram products held side by side before their reductions (a buffer alive
#: during backward; layers whose product alone is larger keep their own reductions).
PENDING_BYTES = 4 * 2**20
#: Most layers one buffer holds.
MAX_LAYERS = 64


class _Group:
    """A buffer of the Gram products of up to ``cap`` layers of one shape, and of their
    row sums and roots (NaN until :meth:`flush`)."""

    def __init__(self, like: torch.Tensor, k: int, cap: int) -> None:
        n, t, _ = like.shape
        self.prods: torch.Tensor | None = like.new_empty((cap, n, t, t))
        self.out = torch.full((2, cap, n, t), float("nan"), dtype=like.dtype, device=like.device)
        self.k, self.cap, self.used = k, cap, 0
        # each layer's slices, made at once (one operation each, not one a layer)
        rows, roots = self.out.unbind(0)
        self._slots = list(zip(self.prods.unbind(0), rows.unbind(0), roots.unbind(0), strict=True))
        # (slot, input Gram) of the layers whose output gradients' Gram matrix is in its
        # slot: multiplied together when flushed
        self._waiting: tuple[list, list] = ([], [])

    def add(self, aa: torch.Tensor, gg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prod, rows, roots = self._slots[self.used]
        torch.mul(aa, gg, out=prod)
        self.used += 1
        return rows, roots

    def add_gram(self, aa: torch.Tensor, form) -> tuple[torch.Tensor, torch.Tensor]:
        prod, rows, roots = self._slots[self.used]
        form(prod)
        self._waiting[0].append(prod)
        self._waiting[1].append(aa)
        self.used += 1
        return rows, roots

    def flush(self) -> None:
        """The row sums (two stages of ``k`` and ``T / k`` terms where ``k > 1``) and the
        roots of the diagonals of the products held, into the layers' views."""
        n, p = self.used, self.prods
        self.prods = self._slots = None
        if p is None or n == 0:
            return
        prods, grams = self._waiting
        self._waiting = ([], [])
        if prods:  # gg * aa, the same single rounding as aa * gg: one operation for all
            torch._foreach_mul_(prods, grams)
        p = p[:n]
        if self.k == 1:
            torch.sum(p, -1, out=self.out[0, :n])
        else:
            t = p.shape[-1]
            torch.sum(p.view(*p.shape[:-1], t // self.k, self.k).sum(-1), -1, out=self.out[0, :n])
        torch.sqrt(p.diagonal(dim1=-2, dim2=-1), out=self.out[1, :n])


class _Sums:
    """Output gradients ``(N, T, p)`` of up to ``cap`` layers whose sums over positions
    (a bias's per-example gradients) are formed by one stacked sum (NaN until
    :meth:`flush`)."""

    def __init__(self, g: torch.Tensor, dtype: torch.dtype | None, cap: int) -> None:
        n, _, p = g.shape
        self.out = torch.full((cap, n, p), float("nan"), dtype=dtype or g.dtype, device=g.device)
        self.dtype, self.cap = dtype, cap
        self.held: list = []
        self._views = self.out.unbind(0)

    @property
    def used(self) -> int:
        return len(self.held)

    def add(self, g: torch.Tensor) -> torch.Tensor:
        self.held.append(g)
        return self._views[len(self.held) - 1]

    def flush(self) -> None:
        held, self.held, self._views = self.held, [], None
        if held:
            torch.sum(torch.stack(held), 2, dtype=self.dtype, out=self.out[: len(held)])


class _NormSums:
    """Inputs and output gradients ``(N, T, p)`` of up to ``cap`` normalisation layers of
    one shape whose weights' per-example gradients ``sum_t g_t * norm(x)_t`` are formed
    at once (NaN until :meth:`flush`): one stacked normalisation, one product and one sum
    instead of a normalisation and a product a layer (the same values: each row
    normalised alone, the same products, the same sums)."""

    def __init__(self, g: torch.Tensor, norm, cap: int) -> None:
        n, _, p = g.shape
        self.out = torch.full((cap, n, p), float("nan"), dtype=g.dtype, device=g.device)
        self.norm, self.cap = norm, cap
        self.xs: list = []
        self.gs: list = []
        self._views = self.out.unbind(0)

    @property
    def used(self) -> int:
        return len(self.xs)

    def add(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        self.xs.append(x)
        self.gs.append(g)
        return self._views[len(self.xs) - 1]

    def flush(self) -> None:
        xs, gs, self.xs, self.gs, self._views = self.xs, self.gs, [], [], None
        if xs:
            prod = self.norm(torch.stack(xs))
            prod.mul_(torch.stack(gs))
            torch.sum(prod, 2, out=self.out[: len(xs)])


def _place(aa: torch.Tensor, k: int) -> tuple[tuple, int] | None:
    """The group key of an ``(N, T, T)`` product and how many such products its buffer
    holds, or None where fewer than two fit (not held)."""
    n, t, _ = aa.shape
    cap = min(MAX_LAYERS, PENDING_BYTES // max(1, n * t * t * aa.element_size()))
    return None if cap < 2 else ((aa.device, aa.dtype, n, t, k), cap)


class PendingProducts:
    """Ghost layers' Gram products whose reductions wait for their group (see the module
    docstring)."""

    def __init__(self) -> None:
        self._groups: dict = {}

    def take(
        self, aa: torch.Tensor, gg: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hold ``aa * gg`` (``(N, T, T)`` each, one dtype and device) with the products
        of its shape: returns views that will hold its row sums and roots ``(N, T)``
        once flushed, or None where it is not held (too large, a tensor subclass: the
        caller reduces it itself)."""
        if (
            type(aa) is not torch.Tensor
            or type(gg) is not torch.Tensor
            or aa.shape != gg.shape
            or aa.dtype != gg.dtype
        ):
            return None
        if (place := _place(aa, k)) is None:
            return None
        key, cap = place
        return self._hold(key, lambda: _Group(aa, k, cap), lambda grp: grp.add(aa, gg))

    def take_gram(self, aa: torch.Tensor, k: int, form) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`take` of ``aa * gg`` where ``form(out)`` writes ``gg`` into ``out`` (a
        contiguous ``(N, T, T)`` of ``aa``'s dtype and device): ``gg`` formed in the
        group's buffer, multiplied by ``aa`` (held until then) with the other layers' of
        the group by one operation when it flushes. None where it is not held."""
        if type(aa) is not torch.Tensor or aa.dim() != 3:
            return None
        if (place := _place(aa, k)) is None:
            return None
        key, cap = place
        return self._hold(key, lambda: _Group(aa, k, cap), lambda grp: grp.add_gram(aa, form))

    def take_sum(self, g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Hold the output gradients ``(N, T, p)`` ``g`` with others of their shape: returns
        the view ``(N, p)`` that will hold ``g.sum(1, dtype=dtype)`` once flushed (the
        layers' sums by one stacked sum: a copy of at most :data:`PENDING_BYTES`), or None
        where it is not held."""
        if type(g) is not torch.Tensor or g.dim() != 3:
            return None
        cap = min(MAX_LAYERS, PENDING_BYTES // max(1, g.numel() * g.element_size()))
        if cap < 2:
            return None
        key = ("sum", g.device, g.dtype, dtype, tuple(g.shape))
        return self._hold(key, lambda: _Sums(g, dtype, cap), lambda grp: grp.add(g))

    def take_norm_sum(
        self, x: torch.Tensor, g: torch.Tensor, norm, norm_key
    ) -> torch.Tensor | None:
        """Hold a normalisation layer's input ``x`` and output gradient ``g`` (``(N, T,
        p)``) with others of their shape and ``norm_key``: returns the view
        ``(N, p)`` that will hold ``(g * norm(x)).sum(1)`` once flushed (``norm`` a fresh
        tensor of ``x``'s shape in ``g``'s dtype from each row of ``x`` alone; identified
        by the hashable ``norm_key``), or None where it is not held."""
        if (type(x) is not torch.Tensor or type(g) is not torch.Tensor or x.dim() != 3
                or g.shape != x.shape or g.device != x.device):
            return None
        size = max(x.element_size(), g.element_size())
        cap = min(MAX_LAYERS, PENDING_BYTES // max(1, x.numel() * size))
        if cap < 2:
            return None
        key = ("norm", norm_key, x.device, x.dtype, g.dtype, tuple(x.shape))
        return self._hold(key, lambda: _NormSums(g, norm, cap), lambda grp: grp.add(x, g))

    def _hold(self, key, make, add):
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = make()
        out = add(group)
        if group.used == group.cap:
            group.flush()
            del self._groups[key]
        return out

    def flush(self) -> None:
        """Form the row sums and roots of every product held, the sums of every output
        gradient held."""
        groups, self._groups = self._groups, {}
        for g in groups.values():
            g.flush()


#: the :class:`PendingProducts` in force (None: each layer reduces its own product)
PENDING: contextvars.ContextVar[PendingProducts | None] = contextvars.ContextVar(
    "privlearn_pending_products", default=None
)

#: A one-entry store of the last input Gram matrix formed (``[key, inputs, gram]``, empty
#: when none), set by whoever forms the ghost norms of consecutive layers (the tracker,
#: during backward): layers that read the same input tensor (a transformer's query, key
#: and value projections; a gated MLP's gate and up projections) share one Gram matrix
#: ``a a^T`` instead of forming it once each. The same matrix bit for bit: the key is the
#: input's memory, layout, dtype and version counter (the inputs are held with it, so
#: their memory is not reused while it is kept), and the product and block length.
SHARED_GRAM: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "privlearn_shared_gram", default=None
)


@contextlib.contextmanager
def batched(pending: PendingProducts, gram_slot: list):
    """:data:`PENDING` and :data:`SHARED_GRAM` in force (the tracker's, around the rules
    it evaluates during backward)."""
    token, held = SHARED_GRAM.set(gram_slot), PENDING.set(pending)
    try:
        yield
    finally:
        SHARED_GRAM.reset(token)
        PENDING.reset(held)
