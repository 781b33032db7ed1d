"""Per-example inner products of two factored gradients of the same parameter
(:func:`cross_term`, used by the tracker for parameters shared by several layers); moved
out of :mod:`privlearn.torch.grad_sample`, which still re-exports :func:`cross_term`.
"""

from __future__ import annotations

import torch

from privlearn.torch.grad_sample import (
    _as,
    _segment_sum,
    compute_dtype,
)

__all__ = ["cross_term"]


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
        aa = torch.matmul(_as(a1, dt), _as(a2, dt).transpose(1, 2))  # (B, T1, T2)
        gg = torch.matmul(_as(g1, dt), _as(g2, dt).transpose(1, 2))
        return (aa * gg).sum((1, 2))
    if k1 == "outer" and k2 == "rows":
        f1, f2, k1, k2 = f2, f1, k2, k1
    if k1 == "rows" and k2 == "outer":
        ids, e = f1[1], f1[2]  # (B, T), (B, T, D)
        a, g = f2[1], f2[2]  # (B, S, D), (B, S, V)
        dt = compute_dtype(e, a)
        dots = torch.matmul(_as(e, dt), _as(a, dt).transpose(1, 2))  # (B, T, S)
        b, s = g.shape[0], g.shape[1]
        sel = torch.gather(g, 2, ids.unsqueeze(1).expand(b, s, ids.shape[1]))  # (B, S, T)
        return (dots * _as(sel, dt).transpose(1, 2)).sum((1, 2))
    if k1 == "rows" and k2 == "rows":
        ids = torch.cat([f1[1], f2[1]], 1)
        e1, e2 = f1[2], f2[2]
        dt = compute_dtype(e1, e2)
        z1, z2 = torch.zeros_like(_as(e2, dt)), torch.zeros_like(_as(e1, dt))
        x1 = torch.cat([_as(e1, dt), z1], 1)
        x2 = torch.cat([z2, _as(e2, dt)], 1)
        b, t = ids.shape
        keys = (torch.arange(b, device=ids.device).unsqueeze(1) * f1[3] + ids).reshape(-1)
        uniq, inv = torch.unique(keys, return_inverse=True)
        n = uniq.shape[0]
        s1 = _segment_sum(x1.reshape(b * t, -1), inv, n)
        s2 = _segment_sum(x2.reshape(b * t, -1), inv, n)
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
        rows = torch.gather(_as(dense, dt).reshape(b, f1[3], -1), 1,
                            ids.unsqueeze(2).expand(b, t, e.shape[2]))
        return (rows * _as(e, dt)).sum((1, 2))
    d1, d2 = _dense(f1), _dense(f2)
    dt = compute_dtype(d1, d2)
    b = d1.shape[0]
    return (_as(d1, dt).reshape(b, -1) * _as(d2, dt).reshape(b, -1)).sum(1)


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
