"""Per-example inner products of two factored gradients of the same parameter
(:func:`cross_term`) and the :class:`CrossTerm` contributions the tracker adds for
parameters shared by several layers; moved out of :mod:`privlearn.torch.grad_sample` and
:mod:`privlearn.torch.tracker`, which still re-export these names.
"""

from __future__ import annotations

import torch

from privlearn.torch.grad_sample import (
    Contribution,
    as_dtype,
    compute_dtype,
    segment_sum,
)

__all__ = ["cross_term", "CrossTerm"]


def cross_term(f1, f2) -> torch.Tensor:
    """Per-example ``<G1_i, G2_i>`` of two factored gradients of the same parameter
    (see :meth:`Contribution.factor`), without materialising them where the forms allow:

    * outer x outer: ``sum_{t,s} (g_t . g'_s)(a_t . a'_s)`` (the ghost-norm identity,
      Li et al. 2022, Sec. 4, applied to two different layers' factors);
    * rows x outer: ``sum_t sum_s (e_t . a_s) g_s[id_t]`` (an embedding's rows against a
      linear head tied to it: the ``V x D`` gradient is never formed);
    * rows x rows: aggregated over distinct tokens per example;
    * otherwise the dense per-example gradients.
    """
    f1, f2 = _orient(f1), _orient(f2)
    k1, k2 = f1[0], f2[0]
    if k1 == "outer" and k2 == "outer":
        a1, g1 = f1[1], f1[2]
        a2, g2 = f2[1], f2[2]
        dt = compute_dtype(a1, a2)
        aa = torch.matmul(as_dtype(a1, dt), as_dtype(a2, dt).transpose(1, 2))  # (B, T1, T2)
        gg = torch.matmul(as_dtype(g1, dt), as_dtype(g2, dt).transpose(1, 2))
        return (aa * gg).sum((1, 2))
    if k1 == "outer" and k2 == "rows":
        f1, f2, k1, k2 = f2, f1, k2, k1
    if k1 == "rows" and k2 == "outer":
        ids, e = f1[1], f1[2]  # (B, T), (B, T, D)
        a, g = f2[1], f2[2]  # (B, S, D), (B, S, V)
        dt = compute_dtype(e, a)
        dots = torch.matmul(as_dtype(e, dt), as_dtype(a, dt).transpose(1, 2))  # (B, T, S)
        b, s = g.shape[0], g.shape[1]
        sel = torch.gather(g, 2, ids.unsqueeze(1).expand(b, s, ids.shape[1]))  # (B, S, T)
        return (dots * as_dtype(sel, dt).transpose(1, 2)).sum((1, 2))
    if k1 == "rows" and k2 == "rows":
        ids = torch.cat([f1[1], f2[1]], 1)
        e1, e2 = f1[2], f2[2]
        dt = compute_dtype(e1, e2)
        z1, z2 = torch.zeros_like(as_dtype(e2, dt)), torch.zeros_like(as_dtype(e1, dt))
        x1 = torch.cat([as_dtype(e1, dt), z1], 1)
        x2 = torch.cat([z2, as_dtype(e2, dt)], 1)
        b, t = ids.shape
        keys = (torch.arange(b, device=ids.device).unsqueeze(1) * f1[3] + ids).reshape(-1)
        uniq, inv = torch.unique(keys, return_inverse=True)
        n = uniq.shape[0]
        s1 = segment_sum(x1.reshape(b * t, -1), inv, n)
        s2 = segment_sum(x2.reshape(b * t, -1), inv, n)
        owner = torch.zeros(n, dtype=torch.long, device=ids.device).index_copy_(
            0, inv, torch.arange(b, device=ids.device).repeat_interleave(t))
        return torch.zeros(b, dtype=dt, device=ids.device).index_add_(0, owner,
                                                                       (s1 * s2).sum(1))
    if k2 == "rows":
        f1, f2, k1, k2 = f2, f1, k2, k1
    if k1 == "rows":  # rows x dense: gather the dense rows at the token ids
        ids, e = f1[1], f1[2]
        dense = _dense(f2)
        dt = compute_dtype(e, dense)
        b, t = ids.shape
        rows = torch.gather(as_dtype(dense, dt).reshape(b, f1[3], -1), 1,
                            ids.unsqueeze(2).expand(b, t, e.shape[2]))
        return (rows * as_dtype(e, dt)).sum((1, 2))
    d1, d2 = _dense(f1), _dense(f2)
    dt = compute_dtype(d1, d2)
    b = d1.shape[0]
    return (as_dtype(d1, dt).reshape(b, -1) * as_dtype(d2, dt).reshape(b, -1)).sum(1)


def _orient(f):
    if f[0] == "outer_t":  # (sum_t g a^T)^T = sum_t a g^T
        return ("outer", f[2], f[1])
    return f


def _dense(f) -> torch.Tensor:
    kind = f[0]
    if kind == "dense":
        return f[1]
    if kind == "outer":
        return torch.matmul(f[2].transpose(1, 2), f[1])  # (B, p, d)
    ids, e, v = f[1], f[2], f[3]
    b, t = ids.shape
    out = e.new_zeros(b * v, e.shape[2])
    keys = (torch.arange(b, device=ids.device).unsqueeze(1) * v + ids).reshape(-1)
    return out.index_add_(0, keys, e.reshape(b * t, -1)).view(b, v, -1)


# --------------------------------------------------------------------------- registry


class CrossTerm(Contribution):
    """Twice the per-example inner products between contributions to the same
    parameter (tied weights, a layer called several times): with them the squared norm
    of the summed gradient ``||sum_k G_k||^2 = sum_k ||G_k||^2 + 2 sum_{k<l} <G_k, G_l>``
    is exact while every contribution keeps its own (ghost) form. It carries no
    gradient of its own (the weighted sums of the contributions add up)."""

    params = ()
    masks_rows = True

    def __init__(self, param, sq: torch.Tensor):
        self.param = param
        self._sq = sq

    def sq_norms(self) -> torch.Tensor:
        return self._sq

    def weighted_sum(self, c):
        return []

    def per_sample(self):
        return []

    def param_sq_norms(self):
        return []


def _cross_terms(contribs: list[Contribution]) -> list[Contribution]:
    """:class:`CrossTerm` for every parameter that several contributions cover."""
    where: dict[int, list] = {}
    for c in contribs:
        for j, p in enumerate(c.params):
            where.setdefault(id(p), []).append((c, j, p))
    out = []
    for occ in where.values():
        if len(occ) < 2:
            continue
        factors = [c.factor(j) for c, j, _ in occ]
        total = None
        for k in range(len(factors)):
            for m in range(k + 1, len(factors)):
                x = cross_term(factors[k], factors[m])
                total = x if total is None else total + x
        out.append(CrossTerm(occ[0][2], 2.0 * total))
    return out
