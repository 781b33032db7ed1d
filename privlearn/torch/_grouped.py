"""The clipped sum of many small layers added into the gradient buffers at once.

A layer whose per-example gradients are held (``Contribution.mv_rows``) adds
``sum_i c_i g_i`` to its buffer by one matrix-vector product per parameter. Into a
buffer narrower than the gradients (a bfloat16 buffer, float32 per-example gradients)
that product is formed in the gradients' dtype and then added (rounded once): two
operations per parameter, for every LayerNorm of a model. Here the rows of all such
parameters (up to :data:`GROUP_BYTES` of them) are put side by side and multiplied by the
weights in one product, whose pieces are then added to the buffers (one addition for
the parameters adjacent in a flat buffer, in its order): the same terms
summed in the same order into each entry, the same single rounding into the buffer, with
a few operations (one concatenation, one product, one split) instead of one product per
parameter. The same grouping serves float32 buffers while a dropped example's rows are
cleaned (one cleaning of the concatenation instead of one cleaned copy a parameter).
Parameters with more than one contribution in the sum (tied weights) keep
their own order of additions and are left to ``Contribution.accumulate_into``.

Ghost layers (``OuterProduct`` in ghost form, one chunk) whose recorded rows are cleaned
(an example may be dropped by its weight on the device, so each layer copies both sides
of its product: the narrower one scaled and cleaned, the other cleaned) are grouped too:
the rows of up to :data:`GROUP_BYTES` of them, each recorded tensor once however many
layers read it, are put side by side in one copy, scaled in one multiplication (the
sides the layers scale), cleaned in one pass and split into the operands of each
layer's product (views, in the layouts the products read): three operations a layer
(scale, clean, copy) become seven for the group, each layer keeping its one product.
The products and their operands are those of the layers alone (the same values); the
biases are weighed from their per-example rows (held for their norms) with the other
small rows, as a layer alone weighs them.
"""

from __future__ import annotations

import collections

import torch

from privlearn.torch._rows import (
    _DEFER,
    _GHOST_DEFER,
    _ROWS_FINITE,
    _add_mv,
    _addmv_rows_cols,
    _finite,
    _flat,
    _key,
    _PerVector,
    _token_factors,
    add_product_,
    low_factors,
    read_elsewhere,
)

#: Bytes of per-example gradients concatenated at once (a copy alive during the product).
GROUP_BYTES = 4 * 2**20

#: Fewest parameters worth concatenating (three operations replace one per parameter).
_MIN_GROUP = 4

#: Fewest ghost products worth grouping (seven operations replace three a product).
_MIN_PRODUCTS = 3

#: the clip factors in a layer's working dtype, once per factor vector and dtype
_IN_DTYPE = _PerVector()


def accumulate_all(contribs, c: torch.Tensor, out: dict) -> None:
    """``out[id(p)] += sum_i c_i grad_i`` for every parameter of ``contribs`` (see the
    module docstring), in place."""
    uses = collections.Counter(id(p) for k in contribs for p in k.params)
    sole = {id(out[k]) for k, n in uses.items() if n == 1}
    groups: dict = {}

    def take(o: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> bool:
        """Add ``o += r.T @ w`` to a group (True) unless it is left to the caller (the
        weights ``w``: ``c``, or what a wrapping rule made of them, e.g. per row)."""
        nbytes = r.numel() * r.dtype.itemsize
        if id(o) not in sole or not _narrower(o, r) or nbytes > GROUP_BYTES:
            return False
        key = (r.device, r.dtype, id(w))
        g = groups.get(key)
        if g is None or g[0] + nbytes > GROUP_BYTES:
            if g is not None:
                _add_group(g[1], g[2])
            g = groups[key] = [0, [], w]
        g[0] += nbytes
        g[1].append((o, r))
        return True

    products: dict = {}

    def take_product(k, c: torch.Tensor, outs: list) -> bool:
        """Add a ghost layer's one-chunk product to a group (True) unless its rows are
        known finite (nothing copied to share), a buffer is not its alone, or its rows
        alone exceed the budget."""
        if _ROWS_FINITE.get() or not all(id(o) in sole for o in outs):
            return False
        b, _, t, d, p = k.dims
        a2, g2 = k._flat2[:2]
        dt = k._dtype
        w = low_factors(c, dt) if k._low else _IN_DTYPE.get(c, dt, lambda: c.to(dt))
        srcs = [(a2, p > d), (g2, p <= d)]
        nbytes = b * t * (d + p) * dt.itemsize
        if nbytes > GROUP_BYTES:
            return False
        key = (a2.device, dt, k._low, b, t, id(w))
        g = products.get(key)
        if g is None or g.nbytes + nbytes > GROUP_BYTES:
            if g is not None:
                g.flush()
            g = products[key] = _Products(w, t)
        g.add(k, c, outs, srcs, nbytes)
        return True

    token = _DEFER.set(take)
    ghost_token = _GHOST_DEFER.set(take_product)
    try:
        for k in contribs:
            outs = [out[id(p)] for p in k.params]
            get = getattr(k, "mv_rows", None)
            rows = get() if get is not None and all(id(o) in sole for o in outs) else None
            own = getattr(k, "cleans_rows_in_place", False)
            if rows is None or not all(_narrower(o, r, own)
                                       for o, r in zip(outs, rows, strict=True)):
                k.accumulate_into(c, outs)  # its products may still join a group (take)
                continue
            for o, r in zip(outs, rows, strict=True):
                if not take(o, r, c):
                    _add_one(o, r, c)
        _GHOST_DEFER.set(None)
        for g in products.values():  # their biases may still join a group (take)
            g.flush()
    finally:
        _GHOST_DEFER.reset(ghost_token)
        _DEFER.reset(token)
    for g in groups.values():
        _add_group(g[1], g[2])


def _narrower(o: torch.Tensor, rows: torch.Tensor, own: bool = False) -> bool:
    """Whether the product is formed in the rows' dtype and then added to ``o``, or the
    rows are cleaned by a copy first (not :data:`_ROWS_FINITE`, and not rows that their
    layer owns and cleans in place (``own``): one copy a parameter, where the group
    cleans its concatenation in place, once)."""
    return rows.dim() == 2 and (rows.dtype.itemsize > o.dtype.itemsize
                                or not (own or _ROWS_FINITE.get()))


def _add_one(o: torch.Tensor, rows: torch.Tensor, c: torch.Tensor) -> None:
    _add_mv(o, _finite(rows.t()), c)


def _add_group(members: list, c: torch.Tensor) -> None:
    """The members' products in one matrix-vector product, each piece added to its
    buffer (see the module docstring)."""
    if len(members) < _MIN_GROUP:
        for o, r in members:
            _add_one(o, r, c)
        return
    members = sorted(members, key=_place)
    rows = torch.cat([r for _, r in members], 1)  # (B, sum n): columns as each one's
    if not _ROWS_FINITE.get():
        rows.nan_to_num_(0.0, 0.0, 0.0)
    w = c if c.dtype == rows.dtype else c.to(rows.dtype)
    sums = torch.mv(rows.t(), w)
    spread = _spans(members, sums)
    if spread is not None:  # the pieces of one flat buffer
        base, index = spread
        if base.dtype == sums.dtype:
            base.index_add_(0, index, sums)  # each entry once: base[i] + piece[j], as add_
        else:  # a half-precision buffer: base[i] + piece[j] in float32, rounded once
            # (as add_ of the float32 piece), written back in place
            base.index_copy_(0, index, sums.add(base.index_select(0, index)).to(base.dtype))
        return
    runs = _runs(members)
    pieces = [sums] if len(runs) == 1 else sums.split([n for _, n in runs])
    for (target, _), piece in zip(runs, pieces, strict=True):
        target.add_(piece)


#: Fewest runs of adjacent pieces added by one ``index_add_`` instead of one addition each
_MIN_SPANS = 3
#: ... into a half-precision buffer (four operations: the entries read, added in float32,
#: rounded, written back)
_MIN_HALF_SPANS = 5

#: positions in a flat buffer of the runs of pieces of a group, by (device, runs): the
#: same parameters meet in the same group every step, so the index is made once
_SPAN_INDEX: dict = {}


def _spans(members: list, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(buffer, positions)`` when every member (sorted by :func:`_place`) is a
    contiguous view of one flat buffer of the dtype and device of ``sums`` and their
    pieces form at least :data:`_MIN_SPANS` runs: ``sums[j]`` is then added to
    ``buffer[positions[j]]`` by one ``index_add_`` (every position once: the same single
    rounding as one addition a run), else None. A half-precision buffer of float32 sums
    takes at least :data:`_MIN_HALF_SPANS` runs."""
    base = members[0][0]._base
    # plain tensors only (a tensor subclass, e.g. a sharded one, keeps its own additions)
    if type(base) is not torch.Tensor or type(sums) is not torch.Tensor \
            or base.dim() != 1 or base.device != sums.device:
        return None
    half = base.dtype in (torch.float16, torch.bfloat16) and sums.dtype == torch.float32
    if base.dtype != sums.dtype and not half:
        return None
    runs: list = []
    for o, r in members:
        if o._base is not base or not o.is_contiguous() or o.numel() != r.shape[1]:
            return None
        off = o.storage_offset() - base.storage_offset()
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1][1] += o.numel()
        else:
            runs.append([off, o.numel()])
    if len(runs) < (_MIN_HALF_SPANS if half else _MIN_SPANS):
        return None
    key = (base.device, tuple((off, n) for off, n in runs))
    index = _SPAN_INDEX.get(key)
    if index is None:
        if len(_SPAN_INDEX) >= 64:  # layouts of earlier models: not kept for ever
            _SPAN_INDEX.clear()
        index = _SPAN_INDEX[key] = torch.cat(
            [torch.arange(off, off + n, device=base.device) for off, n in runs])
    return base, index


def _place(member) -> tuple:
    """``(buffer, offset)`` of a member's buffer view within the flat buffer it views
    (its own identity when it views none)."""
    o = member[0]
    base = o._base
    if base is None or base.dim() != 1 or not o.is_contiguous():
        return (id(o), 0)
    return (id(base), o.storage_offset() - base.storage_offset())


def _runs(members: list) -> list[tuple[torch.Tensor, int]]:
    """The members (sorted by :func:`_place`) as runs of adjacent pieces of one flat
    buffer: ``(piece of the buffer, elements)``, one addition each."""
    runs = []
    start = None  # (buffer, offset, count, first view) of the open run
    for o, r in members:
        key, off = _place((o, r))
        n = r.shape[1]
        if start is not None and start[0] == key and start[1] + start[2] == off:
            start[2] += n
            continue
        if start is not None:
            runs.append(_piece(*start))
        start = [key, off, n, o]
    runs.append(_piece(*start))
    return runs


def _piece(key, off: int, n: int, o: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The run's piece of the flat buffer (the first view's own flat form when it is
    the only one)."""
    if o.numel() == n:
        return _flat(o), n
    return o._base[off:off + n], n


class _Products:
    """Ghost layers' one-chunk products weighed by the factors ``w`` (the layers' own
    form of them) over ``t`` positions, formed together by :meth:`flush` (see the module
    docstring)."""

    def __init__(self, w: torch.Tensor, t: int) -> None:
        self.w, self.t = w, t
        self.members: list = []  # (contribution, factors given, buffers, source indices)
        self.srcs: dict = {}  # (key of a recorded tensor, scaled) -> index
        self.tensors: list = []  # (tensor, scaled), in order of index
        self.nbytes = 0

    def add(self, k, c: torch.Tensor, outs: list, srcs, nbytes: int) -> None:
        ix = []
        for x, scaled in srcs:
            key = (_key(x), scaled)
            i = self.srcs.get(key)
            if i is None:
                i = self.srcs[key] = len(self.tensors)
                self.tensors.append((x, scaled))
            else:
                nbytes -= x.numel() * k._dtype.itemsize
            ix.append(i)
        self.nbytes += nbytes
        self.members.append((k, c, outs, ix))

    def flush(self) -> None:
        members, self.members = self.members, []
        if len(members) < _MIN_PRODUCTS:
            token = _GHOST_DEFER.set(None)
            try:
                for k, c, outs, _ in members:
                    k._accumulate_flat(c, outs)  # alone, as without grouping
            finally:
                _GHOST_DEFER.reset(token)
            return
        k0 = members[0][0]
        dt, low = k0._dtype, k0._low
        # the cleaned sides first, then the scaled ones: one multiplication scales them
        order = sorted(range(len(self.tensors)), key=lambda i: self.tensors[i][1])
        at = {i: j for j, i in enumerate(order)}
        rows = torch.cat([self.tensors[i][0] for i in order], 1)  # (B T, sum of widths)
        if rows.dtype != dt:
            rows = rows.to(dt)
        n_clean = sum(self.tensors[i][0].shape[1] for i in order
                      if not self.tensors[i][1])
        if n_clean < rows.shape[1]:
            rows[:, n_clean:].mul_(_token_factors(self.w, self.t))
        rows.nan_to_num_(0.0, 0.0, 0.0)
        widths = [self.tensors[i][0].shape[1] for i in order]
        cols = rows.split(widths, 1)  # (B T, n) each: a right side
        lefts = rows.t().split(widths, 0)  # (n, B T) each: a left side
        for k, c, outs, (ia, ig) in members:
            read_elsewhere(*k._flat2[:2])
            il, ir = (ia, ig) if k.transposed else (ig, ia)
            left, right = lefts[at[il]], cols[at[ir]]
            add_product_(outs[0], left, right, low, dt)
            if k.bias is None:
                continue
            # the bias from its per-example rows (held for its norms; grouped with the
            # other small rows' products)
            c0 = c if low else _IN_DTYPE.get(c, dt, lambda c=c: c.to(dt))
            _addmv_rows_cols(outs[1], k._bias_ps(), k._bias_cols(), c0)
