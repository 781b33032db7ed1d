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
"""

from __future__ import annotations

import collections

import torch

from privlearn.torch._rows import _DEFER, _ROWS_FINITE, _add_mv, _finite, _flat

#: Bytes of per-example gradients concatenated at once (a copy alive during the product).
GROUP_BYTES = 4 * 2**20

#: Fewest parameters worth concatenating (three operations replace one per parameter).
_MIN_GROUP = 4


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

    token = _DEFER.set(take)
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
    finally:
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
    runs = _runs(members)
    sums = torch.mv(rows.t(), w)
    pieces = [sums] if len(runs) == 1 else sums.split([n for _, n in runs])
    for (target, _), piece in zip(runs, pieces, strict=True):
        target.add_(piece)


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
