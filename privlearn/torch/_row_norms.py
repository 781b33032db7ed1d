"""Held rows' per-example squared norms formed together at the step.

A contribution that holds per-example gradients as ``(B, n)`` rows (a normalisation
layer's weight and bias, a ghost layer's bias, a layer's materialised weight gradients)
once formed each parameter's squared norms by its own ``vector_norm`` and square during
backward: two operations a parameter, for every LayerNorm and every bias of a model. Its
rows are kept until the step anyway (the clipped sum multiplies them by the clip
factors), so the step forms the squared norms of all such rows at once: the rows of up
to :data:`GROUP_BYTES` put side by side (one concatenation), one ``vector_norm`` and one
square per group, whose result is one more term of the step's stacked sum of
per-example terms. The squared norm of an example's concatenated rows is the sum of its
parameters' squared norms (a float32 sum of the same squares, in another order). Rows
larger than the budget keep their own norm (no copy of them).

A contribution opts in by a ``deferred_rows()`` method returning ``(terms, rows)``: the
per-example vectors ``(B,)`` already formed (a ghost weight norm) and the rows whose
squared norms complete its :meth:`~privlearn.torch.grad_sample.Contribution.sq_norms`,
or None where its terms are already formed (they are then used as they are).
"""

from __future__ import annotations

import torch

from privlearn.torch._rows import row_sq_norms

__all__ = ["GROUP_BYTES", "batch_of", "flat_terms", "materialized_rows", "outer_rows", "prepare"]

#: Bytes of rows concatenated at once (a copy alive while their norms are formed).
GROUP_BYTES = 4 * 2**20

_HALF = (torch.float16, torch.bfloat16)


def _parts(c) -> tuple[list, list] | None:
    get = getattr(c, "deferred_rows", None)
    if get is None or type(c).sq_terms.__qualname__ != _OWNERS.get(get.__func__):
        return None  # (a subclass forming its own terms keeps them)
    return get()


def prepare(c) -> None:
    """What a contribution evaluated during backward forms then: its deferred rows'
    views and the terms it forms itself (a ghost norm), else all its terms."""
    if _parts(c) is None:
        c.sq_terms()


def batch_of(c) -> int:
    """The number of rows (examples) of contribution ``c``."""
    parts = _parts(c)
    if parts is None or not (parts[0] or parts[1]):
        terms = c.sq_terms()
        return (terms[0] if terms else c.sq_norms()).shape[0]
    return (parts[0] or parts[1])[0].shape[0]


def flat_terms(contribs) -> list[torch.Tensor]:
    """Per-example vectors ``(B,)`` whose sum is the squared norm over every parameter of
    ``contribs``: each contribution's own terms, then the squared norms of all deferred
    rows, formed by groups (see the module docstring)."""
    terms: list = []
    rows: list = []
    for c in contribs:
        parts = _parts(c)
        if parts is None:
            terms.extend(c.sq_terms())
        else:
            terms.extend(parts[0])
            rows.extend(parts[1])
    return terms + rows_sq(rows)


def rows_sq(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Squared row norms of 2-D ``rows`` summed over the list, as few vectors ``(B,)`` as
    the budget allows (half-precision rows grouped with float32 ones: the concatenation
    is then float32, exact)."""
    out: list = []
    groups: dict = {}
    for r in rows:
        nbytes = r.numel() * r.element_size()
        if nbytes > GROUP_BYTES:
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


def materialized_rows(c) -> tuple[list, list] | None:
    """``Materialized.deferred_rows``: its per-example gradients as ``(B, n)`` rows (the
    views the clipped sum multiplies), None once its terms are formed."""
    return None if c._terms is not None else ([], c._row_views())


def outer_rows(c) -> tuple[list, list] | None:
    """``OuterProduct.deferred_rows``: the weight's squared norms (ghost norms formed
    here, during backward when evaluated then) or its materialised rows, and the bias's
    per-example rows; None once its terms are formed."""
    if c._terms is not None:
        return None
    terms, rows = [], []
    if c._ps is not None and c._wsq is None:
        rows.append(c._ps_rows)
    else:
        terms.append(c._weight_sq())
    if c.bias is not None:
        rows.append(c._bias_ps())
        c._bias_cols()  # (the view a product may read, made during backward with it)
    return terms, rows


#: the ``sq_terms`` each ``deferred_rows`` stands for (by qualified name: a subclass that
#: forms its own terms is not deferred)
_OWNERS = {materialized_rows: "Materialized.sq_terms", outer_rows: "OuterProduct.sq_terms"}
