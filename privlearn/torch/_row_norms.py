"""Per-example squared norms of many layers formed together (fewer operations a step).

A contribution that holds per-example gradients as ``(B, n)`` rows (a normalisation
layer's weight and bias, a ghost layer's bias, a layer's materialised weight gradients)
once formed each parameter's squared norms by its own ``vector_norm`` and square during
backward: two operations a parameter, for every LayerNorm and every bias of a model. Its
rows are kept until the step anyway (the clipped sum multiplies them by the clip
factors), so their squared norms are formed at once: the rows of up to
:data:`GROUP_BYTES` put side by side (one concatenation), one ``vector_norm`` and one
square per group. The squared norm of an example's concatenated rows is the sum of its
parameters' squared norms (a float32 sum of the same squares, in another order). Rows
larger than :data:`SMALL_ROW_BYTES` keep their own norm (no copy of them).

Likewise a ghost layer forms its Gram product during backward (the Gram matrices are
released there) but leaves its last sums, ``(N, T)`` row sums and roots of the diagonal
(:class:`~privlearn.torch._ghost_norms.GhostParts`), to be finished with every other
ghost layer of its shape: one stacked reduction and one ``addcmul`` for all of them
instead of three operations a layer (the same sums a row, the same bound).

Both happen at the end of the backward pass for the contributions evaluated during it
(:func:`settle`, kept by the tracker until the step, which uses it only if it sees the
same contributions in the same state), else at the step (:func:`flat_sq`): the squared
norm over all parameters is then one stacked sum of every per-example term.

A contribution opts in by a ``deferred_rows()`` method returning ``(terms, rows)``: the
per-example vectors ``(B,)`` it formed (or its ``GhostParts``) and the rows whose squared
norms complete its :meth:`~privlearn.torch.grad_sample.Contribution.sq_norms`, or None
where its terms are already formed (they are then used as they are).
"""

from __future__ import annotations

import torch

from privlearn.torch._ghost_norms import GhostParts, finish_groups, finish_parts, ghost_parts
from privlearn.torch._rows import mm32, row_sq_norms

__all__ = [
    "GROUP_BYTES",
    "SMALL_ROW_BYTES",
    "Settled",
    "batch_of",
    "flat_sq",
    "materialized_rows",
    "outer_rows",
    "prepare",
    "settle",
]

#: Bytes of rows concatenated at once (a copy alive while their norms are formed).
GROUP_BYTES = 4 * 2**20
#: Largest rows concatenated (larger ones, e.g. materialised weight gradients, keep their
#: own norm: their two operations cost little next to a copy of them).
SMALL_ROW_BYTES = 2**18

_HALF = (torch.float16, torch.bfloat16)


def _parts(c) -> tuple[list, list] | None:
    get = getattr(c, "deferred_rows", None)
    if get is None or type(c).sq_terms.__qualname__ != _OWNERS.get(get.__func__):
        return None  # (a subclass forming its own terms keeps them)
    return get()


def prepare(c) -> None:
    """What a contribution evaluated during backward forms then: its deferred rows'
    views and the terms it forms itself (a ghost layer's Gram product), else all its
    terms."""
    if _parts(c) is None:
        c.sq_terms()


def batch_of(c) -> int:
    """The number of rows (examples) of contribution ``c``."""
    parts = _parts(c)
    if parts is None or not (parts[0] or parts[1]):
        terms = c.sq_terms()
        return (terms[0] if terms else c.sq_norms()).shape[0]
    x = (parts[0] or parts[1])[0]
    return (x.rows if isinstance(x, GhostParts) else x).shape[0]


def _key(parts) -> tuple:
    """The identity of a contribution's deferred state (to tell it unchanged)."""
    return tuple(id(x) for x in parts[0]) + tuple(id(x) for x in parts[1])


class Settled:
    """Squared-norm blocks of contributions evaluated during backward (:func:`settle`),
    valid for a step that sees each of them with the same deferred state."""

    def __init__(self, contribs: list, keys: list, blocks: list) -> None:
        self.contribs = contribs  # (held: their ids stay theirs)
        self.keys = keys
        self.blocks = blocks

    def covers(self, contribs) -> dict | None:
        """``{id(c): c}`` of the covered contributions if every one is among
        ``contribs`` in its settled state, else None."""
        ids = {id(c) for c in contribs}
        out = {}
        for c, key in zip(self.contribs, self.keys, strict=True):
            parts = _parts(c) if id(c) in ids else None
            if parts is None or _key(parts) != key:
                return None
            out[id(c)] = c
        return out


def settle(contribs) -> Settled | None:
    """The grouped squared norms of ``contribs`` that defer theirs (see the module
    docstring), or None where nothing is grouped."""
    held, keys, rows, ghosts = [], [], [], []
    for c in contribs:
        parts = _parts(c)
        if parts is None:
            continue
        held.append(c)
        keys.append(_key(parts))
        ghosts.extend(x for x in parts[0] if isinstance(x, GhostParts))
        rows.extend(parts[1])
    if len(rows) + len(ghosts) < 2:
        return None
    with torch.no_grad():
        return Settled(held, keys, rows_sq(rows) + ghost_sq_blocks(ghosts))


def flat_sq(contribs, settled: Settled | None = None) -> torch.Tensor | None:
    """Per-example squared norms ``(B,)`` over every parameter of ``contribs``: each
    contribution's own terms, the squared norms of all deferred rows and ghost parts
    formed by groups (those of ``settled`` where it covers them), in one stacked sum."""
    covered = settled.covers(contribs) if settled is not None else None
    terms, rows, ghosts = [], [], []
    for c in contribs:
        parts = _parts(c)
        if parts is None:
            terms.extend(c.sq_terms())
            continue
        own = [x for x in parts[0] if not isinstance(x, GhostParts)]
        terms.extend(own)
        if covered is not None and id(c) in covered:
            continue
        ghosts.extend(x for x in parts[0] if isinstance(x, GhostParts))
        rows.extend(parts[1])
    blocks = (
        (settled.blocks if covered is not None else []) + rows_sq(rows) + ghost_sq_blocks(ghosts)
    )
    return _sum_all(terms, blocks)


def _sum_all(terms: list, blocks: list) -> torch.Tensor | None:
    """The sum of per-example vectors ``terms`` ``(B,)`` and of the rows of ``blocks``
    (``(B,)`` or ``(L, B)``): one stacked reduction where they share a dtype, device and
    ``B``, else added one by one."""
    vecs = [*terms, *(b for b in blocks if b.dim() == 1)]
    mats = [b for b in blocks if b.dim() == 2]
    if not mats and len(vecs) <= 1:
        return vecs[0] if vecs else None
    x0 = vecs[0] if vecs else mats[0]
    n = x0.shape[-1]
    if all(
        x.dtype == x0.dtype and x.device == x0.device and x.shape[-1] == n for x in (*vecs, *mats)
    ):
        if not mats:
            return torch.stack(vecs).sum(0)
        if not vecs and len(mats) == 1:
            return mats[0].sum(0)
        return torch.cat(([torch.stack(vecs)] if vecs else []) + mats).sum(0)
    out = None
    for x in [*vecs, *(r for m in mats for r in m)]:
        out = x if out is None else out + x
    return out


def rows_sq(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Squared row norms of 2-D ``rows`` summed over the list, as few vectors ``(B,)`` as
    the budget allows (half-precision rows grouped with float32 ones: the concatenation
    is then float32, exact)."""
    out: list = []
    groups: dict = {}
    for r in rows:
        nbytes = r.numel() * r.element_size()
        if nbytes > SMALL_ROW_BYTES:
            out.append(row_sq_norms(r))
            continue
        wide = torch.float32 if r.dtype in _HALF else r.dtype
        key = (r.device, r.shape[0], wide)
        g = groups.get(key)
        if g is None or g[0] + nbytes > GROUP_BYTES:
            if g is not None:
                out.append(_group_sq(g[1]))
            g = groups[key] = [0, []]
        g[0] += nbytes
        g[1].append(r)
    out.extend(_group_sq(g[1]) for g in groups.values())
    return out


def _group_sq(rows: list[torch.Tensor]) -> torch.Tensor:
    return row_sq_norms(rows[0] if len(rows) == 1 else torch.cat(rows, 1))


def ghost_sq_blocks(ghosts: list[GhostParts]) -> list[torch.Tensor]:
    """The ghost squared norms of ``ghosts``, finished by groups of one shape and bound
    (:func:`~privlearn.torch._ghost_norms.finish_parts`; the groups of one ``(N, T)``
    summed together, :func:`~privlearn.torch._ghost_norms.finish_groups`): ``(N,)`` or
    ``(L, N)`` each."""
    groups: dict = {}
    for x in ghosts:
        r = x.rows
        groups.setdefault((r.device, r.dtype, tuple(r.shape), x.k), {}).setdefault(
            x.alpha, []).append(x)
    out = []
    for by_alpha in groups.values():  # the shapes of one (N, T): one stacked sum
        if len(by_alpha) == 1:
            out.append(finish_parts(next(iter(by_alpha.values()))))
        else:
            out.extend(finish_groups(list(by_alpha.values())))
    return out


def materialized_rows(c) -> tuple[list, list] | None:
    """``Materialized.deferred_rows``: its per-example gradients as ``(B, n)`` rows (the
    views the clipped sum multiplies), None once its terms are formed."""
    return None if c._terms is not None else ([], c._row_views())


def outer_rows(c) -> tuple[list, list] | None:
    """``OuterProduct.deferred_rows``: the weight's ghost parts (its Gram product formed
    here, during backward when evaluated then), its squared norms formed otherwise, or
    its materialised rows; and the bias's per-example rows. None once its terms are
    formed."""
    if c._terms is not None:
        return None
    terms, rows = [], []
    b, G, t, d, p = c.dims
    if c._wsq is not None:
        terms.append(c._wsq)
    elif c._ps is not None:
        rows.append(c._ps_rows)
    elif G == 1 and t > 1:
        x = getattr(c, "_gparts", None)
        if x is None:
            x = ghost_parts(
                c.a.reshape(b, t, d),
                c.g.reshape(b, t, p),
                mm32 if c._low else torch.bmm,
                defer=True,  # (the tracker flushes at the end of backward)
            )
            if isinstance(x, torch.Tensor):  # formed in float64 (no useful bound)
                c._wsq = x
            else:
                c._gparts = x
        terms.append(x)
    else:
        terms.append(c._weight_sq())
    if c.bias is not None:
        rows.append(c._bias_ps(defer=True))  # (flushed with the products)
        c._bias_cols()  # (the view a product may read, made during backward with it)
    return terms, rows


#: the ``sq_terms`` each ``deferred_rows`` stands for (by qualified name: a subclass that
#: forms its own terms is not deferred)
_OWNERS = {materialized_rows: "Materialized.sq_terms", outer_rows: "OuterProduct.sq_terms"}
