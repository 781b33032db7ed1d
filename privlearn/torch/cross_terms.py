"""Per-example inner products of two factored gradients of the same parameter
(:func:`cross_term`) and the :class:`CrossTerm` contributions the tracker adds for
parameters shared by several layers; moved out of :mod:`privlearn.torch.grad_sample` and
:mod:`privlearn.torch.tracker`, which still re-export these names.

**Rounding.** The squared norm of a shared parameter's gradient is ``sum_u ||G_u||^2 +
2 sum_{u<v} <G_u, G_v>``; when the layers' gradients nearly cancel, the cross terms are
about ``-||G_u||^2`` and their rounding errors can exceed the exact total, which was then
computed as any value, 0 included (the example entered the clipped sum unclipped). So the
tracker adds every cross term's computed value plus a rigorous bound on its rounding
error, ``c S_u S_v``, where ``S_u`` is the triangle-inequality sum of the factor
(:func:`_scale`: ``sum_t |a_t| |g_t|`` for an outer product, ``sum_t |e_t|`` for
embedding rows, ``||d||`` for a materialised gradient ``d``; ``||G_u|| <= S_u``). With
``gamma_n = n u / (1 - n u)`` (Higham 2002, "Accuracy and Stability of Numerical
Algorithms", Lemma 3.1: an inner product of length ``n`` formed in any order with unit
roundoff ``u`` is within ``gamma_n |x| |y|`` of the exact one), ``c`` is, by form:

* outer x outer: each Gram entry is within ``gamma_a |a_t| |a'_s|`` (resp. ``gamma_g |g_t|
  |g'_s|``; :func:`~privlearn.torch._ghost_norms._entry_gamma`, in blocks of features, the
  inputs' TF32/bfloat16 rounding included), the products and the sums over ``s`` then
  ``t`` add ``gamma_(T1+T2)`` of ``sum |aa gg| <= (1 + gamma_a)(1 + gamma_g) S_1 S_2``:
  ``c = (1 + gamma_a)(1 + gamma_g)(1 + gamma_(T1+T2)) - 1``;
* rows x outer: ``e_t . a_s`` within ``gamma_D |e_t| |a_s|``, the gathered ``g_s[id_t]``
  exact and at most ``|g_s|``: ``c = (1 + gamma_D)(1 + gamma_(T+S)) - 1``;
* rows x rows: the per-token sums are within ``gamma_(T1+T2)`` of the sums of ``|e_t|``
  componentwise, their product, the dot over ``D`` and the sum over tokens add
  ``gamma_(D+T1+T2)`` (Cauchy-Schwarz: ``sum_j |e_tj| |e'_sj| <= |e_t| |e'_s|``):
  ``c = (1 + gamma_(T1+T2))^2 (1 + gamma_(D+T1+T2)) - 1``;
* rows x dense: ``sum_t e_t . d[id_t]`` with ``|d[id_t]| <= ||d||``:
  ``c = gamma_(D+T)``;
* dense x dense: a dot of ``n`` entries in blocks, ``gamma_dot``; an outer factor
  materialised here rounds within ``gamma_T S_u`` entrywise-summed (Cauchy-Schwarz),
  so ``c = (1 + gamma_T1)(1 + gamma_T2)(1 + gamma_dot) - 1`` (``gamma_T = 0`` for a dense
  factor).

The step then adds the parameter's own squared norms and ``2 X`` (``X`` the sum of the
computed cross terms), ``m`` terms with cancellation, within ``gamma_m Q^2``, ``Q = sum_u
S_u``. Since ``2 sum_{u<v} S_u S_v <= Q^2 / 2``, one bound serves every pair:
``CrossTerm = 2 X + (c / 2 + gamma_m + 8 u) Q^2`` (``c`` the largest pair's; ``8 u`` the
rounding of this expression), with ``Q`` computed from norms that are at least ``(1 -
delta)`` of the exact ones (divided out), as ``S_u <= ||a|| ||g||`` for an outer factor
and ``S_u <= sqrt(T) ||e||`` for rows (Cauchy-Schwarz: one norm a tensor). The own
squared norms that are not rounded up (``|g|^2 |a|^2`` of one position, a materialised
gradient's sum of squares: within ``gamma_L`` of their length ``L``) add ``gamma_L
S_u^2`` each; ghost norms are rounded up already, and so is the embedding rule's own
squared norm (:mod:`privlearn.torch._summed_rows`). For an ordinary example ``Q^2`` is
about ``4 T`` times its squared norm, so the over-statement is a relative ``~ 2 c T``
(about 1% for a tied embedding and head at 512 positions in float32, on top of the own
ghost norms'; more under TF32 products). Where a length makes the bound useless (``n u``
near 1) the CrossTerm is the triangle inequality's ``Q^2`` instead.
"""

from __future__ import annotations

import math

import torch

from privlearn.torch._ghost_norms import _U32, _U64, _entry_gamma, _gamma, gram_block
from privlearn.torch.grad_sample import (
    Contribution,
    as_dtype,
    compute_dtype,
    segment_sum,
)

__all__ = ["cross_term", "CrossTerm"]

#: entries per block of the dense x dense dot (its sum within gamma_k + gamma_(n/k))
_DOT_BLOCK = 4096


def cross_term(f1, f2) -> torch.Tensor:
    """Per-example ``<G1_i, G2_i>`` of two factored gradients of the same parameter
    (see :meth:`Contribution.factor`), without materialising them where the forms allow:

    * outer x outer: ``sum_{t,s} (g_t . g'_s)(a_t . a'_s)`` (the ghost-norm identity,
      Li et al. 2022, Sec. 4, applied to two different layers' factors);
    * rows x outer: ``sum_t sum_s (e_t . a_s) g_s[id_t]`` (an embedding's rows against a
      linear head tied to it: the ``V x D`` gradient is never formed);
    * rows x rows: aggregated over distinct tokens per example;
    * otherwise the dense per-example gradients.

    The computed value only; :func:`_cross_terms` adds the bound on its rounding error
    (see the module docstring).
    """
    return _cross(f1, f2)[0]


def _u(dt: torch.dtype) -> float:
    return _U64 if dt == torch.float64 else _U32


def _mm_blocks(x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """``x y^T`` per row of ``(B, T1, n)`` ``x`` and ``(B, T2, n)`` ``y``, accumulated over
    blocks of ``k`` features (one product where ``k >= n``)."""
    n = x.shape[-1]
    if k >= n:
        return torch.matmul(x, y.transpose(1, 2))
    out = torch.matmul(x[..., :k], y[..., :k].transpose(1, 2))
    for j in range(k, n, k):
        out.add_(torch.matmul(x[..., j : j + k], y[..., j : j + k].transpose(1, 2)))
    return out


def _cross(f1, f2) -> tuple[torch.Tensor, float]:
    """The computed ``<G1_i, G2_i>`` and ``c``: its rounding error is at most
    ``c S_1 S_2`` (module docstring)."""
    f1, f2 = _orient(f1), _orient(f2)
    k1, k2 = f1[0], f2[0]
    if k1 == "outer" and k2 == "outer":
        a1, g1 = f1[1], f1[2]
        a2, g2 = f2[1], f2[2]
        dt = compute_dtype(a1, a2, g1, g2)
        u, dev = _u(dt), a1.device.type
        t1, t2, d, p = a1.shape[1], a2.shape[1], a1.shape[2], g1.shape[2]
        ka, kg = gram_block(max(t1, t2), d, u), gram_block(max(t1, t2), p, u)
        aa = _mm_blocks(as_dtype(a1, dt), as_dtype(a2, dt), ka)  # (B, T1, T2)
        gg = _mm_blocks(as_dtype(g1, dt), as_dtype(g2, dt), kg)
        ga = _entry_gamma(ka, dt, False, -(-d // ka), dev)
        gp = _entry_gamma(kg, dt, False, -(-p // kg), dev)
        c = (1 + ga) * (1 + gp) * (1 + _gamma(t1 + t2, u)) - 1
        return aa.mul_(gg).sum(2).sum(1), c
    if k1 == "outer" and k2 == "rows":
        f1, f2, k1, k2 = f2, f1, k2, k1
    if k1 == "rows" and k2 == "outer":
        ids, e = f1[1], f1[2]  # (B, T), (B, T, D)
        a, g = f2[1], f2[2]  # (B, S, D), (B, S, V)
        dt = compute_dtype(e, a, g)
        dots = torch.matmul(as_dtype(e, dt), as_dtype(a, dt).transpose(1, 2))  # (B, T, S)
        b, s = g.shape[0], g.shape[1]
        sel = torch.gather(g, 2, ids.unsqueeze(1).expand(b, s, ids.shape[1]))  # (B, S, T)
        u, t = _u(dt), ids.shape[1]
        c = (1 + _entry_gamma(e.shape[2], dt, False, 1, e.device.type)) * (
            1 + _gamma(t + s, u)) - 1
        return (dots * as_dtype(sel, dt).transpose(1, 2)).sum(2).sum(1), c
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
        u = _u(dt)
        c = (1 + _gamma(t, u)) ** 2 * (1 + _gamma(e1.shape[2] + t, u)) - 1
        return torch.zeros(b, dtype=dt, device=ids.device).index_add_(0, owner,
                                                                       (s1 * s2).sum(1)), c
    if k2 == "rows":
        f1, f2, k1, k2 = f2, f1, k2, k1
    if k1 == "rows":  # rows x dense: gather the dense rows at the token ids
        ids, e = f1[1], f1[2]
        dense = f2[1]
        dt = compute_dtype(e, dense)
        b, t = ids.shape
        rows = torch.gather(as_dtype(dense, dt).reshape(b, f1[3], -1), 1,
                            ids.unsqueeze(2).expand(b, t, e.shape[2]))
        c = _gamma(e.shape[2] + t, _u(dt))
        return (rows * as_dtype(e, dt)).sum(2).sum(1), c
    dt = compute_dtype(*_tensors(f1), *_tensors(f2))
    d1, d2 = _dense(f1, dt), _dense(f2, dt)
    b = d1.shape[0]
    prod = d1.reshape(b, -1) * d2.reshape(b, -1)
    n, u = prod.shape[1], _u(dt)
    if n > _DOT_BLOCK:  # two stages (zeros padded in are exact)
        m = -(-n // _DOT_BLOCK)
        prod = torch.nn.functional.pad(prod, (0, m * _DOT_BLOCK - n)).view(b, m, _DOT_BLOCK)
        out, dot = prod.sum(2).sum(1), _gamma(_DOT_BLOCK + m, u)
    else:
        out, dot = prod.sum(1), _gamma(n, u)
    c = (1 + _materialise_gamma(f1, dt)) * (1 + _materialise_gamma(f2, dt)) * (1 + dot) - 1
    return out, c


def _tensors(f) -> list[torch.Tensor]:
    return [x for x in f[1:] if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _materialise_gamma(f, dt: torch.dtype) -> float:
    """Entrywise error of :func:`_dense` of an outer factor, relative to
    ``sum_t |g_t| |a_t|`` (a product of length ``T``); 0 for a dense one."""
    if f[0] != "outer":
        return 0.0
    return _entry_gamma(f[1].shape[1], dt, False, 1, f[1].device.type)


def _numel(x: torch.Tensor) -> int:
    """Entries per example (from the shape: indexing a row would dispatch)."""
    return math.prod(x.shape[1:])


def _scale(f, dt: torch.dtype):
    """``(x, y, k, delta)`` with ``S_i <= k x_i y_i / (1 - delta)`` (``y`` None: 1; ``S``
    of the module docstring, ``||G_i|| <= S_i``), ``x`` and ``y`` in ``dt``: an outer
    factor's ``sum_t |a_t| |g_t| <= ||a|| ||g||`` and embedding rows' ``sum_t |e_t| <=
    sqrt(T) ||e||`` (Cauchy-Schwarz), one norm per tensor; the computed norms are at least
    ``(1 - delta)`` times the exact ones (sums of squares, square roots)."""
    f = _orient(f)
    u = _u(dt)
    if f[0] == "outer":
        a, g = f[1], f[2]
        na = torch.linalg.vector_norm(a, dim=(1, 2), dtype=dt)
        ng = torch.linalg.vector_norm(g, dim=(1, 2), dtype=dt)
        return na, ng, 1.0, _gamma(_numel(a) + _numel(g) + 2, u)
    if f[0] == "rows":
        e = f[2]
        s = torch.linalg.vector_norm(e, dim=(1, 2), dtype=dt)
        return s, None, float(e.shape[1]) ** 0.5, _gamma(_numel(e) + 1, u)
    d = f[1]
    s = torch.linalg.vector_norm(d, dim=tuple(range(1, d.dim())), dtype=dt)
    return s, None, 1.0, _gamma(_numel(d) + 1, u)


def _own_gamma(f, u: float) -> float:
    """Bound, relative to ``S^2``, on how far below the exact own squared norm the step's
    value from this factor's contribution may be, where ``S`` is tight: ``|g|^2 |a|^2``
    of one position and a materialised gradient's sum of squares, within ``gamma`` of
    their lengths; 0 for an outer factor over several positions (a ghost norm, rounded
    up) and for embedding rows over several positions (their rule's own squared norm,
    rounded up too)."""
    f = _orient(f)
    if f[0] == "outer":
        t = f[1].shape[1]
        return 0.0 if t > 1 else _gamma(f[1].shape[2] + f[2].shape[2] + 2, u)
    if f[0] == "rows":  # one position: a plain sum of squares
        return 0.0 if f[1].shape[1] > 1 else _gamma(f[2].shape[2] + 1, u)
    return _gamma(_numel(f[1]) + 1, u)


def _orient(f):
    if f[0] == "outer_t":  # (sum_t g a^T)^T = sum_t a g^T
        return ("outer", f[2], f[1])
    return f


def _dense(f, dt: torch.dtype | None = None) -> torch.Tensor:
    kind = f[0]
    if kind == "dense":
        return f[1] if dt is None else as_dtype(f[1], dt)
    if kind == "outer":
        a, g = (f[1], f[2]) if dt is None else (as_dtype(f[1], dt), as_dtype(f[2], dt))
        return torch.matmul(g.transpose(1, 2), a)  # (B, p, d)
    ids, e, v = f[1], f[2], f[3]
    if dt is not None:
        e = as_dtype(e, dt)
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
    """:class:`CrossTerm` for every parameter that several contributions cover: twice
    the sum of its cross terms, each plus the bound on its rounding error, plus the bound
    on the rounding of the step's sum of this parameter's terms (module docstring), so
    that with the own squared norms it is never below the exact squared norm."""
    where: dict[int, list] = {}
    for c in contribs:
        for j, p in enumerate(c.params):
            where.setdefault(id(p), []).append((c, j, p))
    out = []
    for occ in where.values():
        if len(occ) < 2:
            continue
        factors = [c.factor(j) for c, j, _ in occ]
        dt = compute_dtype(*[x for f in factors for x in _tensors(f)])
        w = _u(dt) if all(x.dtype == torch.float64 for f in factors
                          for x in _tensors(f)) else _U32
        # a single-norm scale first: q is then formed in one operation a factor
        own_scales = [_scale(f, dt) for f in factors]
        scales = sorted(own_scales, key=lambda sc: sc[1] is not None)
        # 2 sum_{k<m} c S_k S_m <= c Q^2 / 2 with Q = sum_k S_k (Q^2 = sum_k S_k^2 +
        # 2 sum_{k<m} S_k S_m): one bound per parameter, 2 X + (c / 2 + slack) Q^2
        total, cmax = None, 0.0
        for k in range(len(factors)):
            for m in range(k + 1, len(factors)):
                x, c = _cross(factors[k], factors[m])
                cmax = max(cmax, c)
                total = x if total is None else total + x
        terms = len(factors) * (len(factors) + 1) // 2 + 2
        # the norms', and q's own roundings (a product and K - 1 sums of non-negatives)
        delta = max(sc[3] for sc in scales) + _gamma(2 * len(factors), w)
        x0, y0, k0, _ = scales[0]
        q = x0 if y0 is None else x0 * y0  # k0 q >= (1 - delta) Q
        for x, y, k, _ in scales[1:]:
            q = torch.add(q, x, alpha=k / k0) if y is None else torch.addcmul(
                q, x, y, value=k / k0)
        v = (cmax / 2 + _gamma(terms, w) + 8 * w) * k0**2 / (1 - delta) ** 2
        owns = [_own_gamma(f, w) for f in factors]
        trivial = k0**2 * (1 + 4 * w) / (1 - delta) ** 2
        if not (v < trivial and max(owns) < 0.25):  # no useful bound (lengths ~ 1 / u):
            # the triangle inequality's Q^2, which the non-negative own terms only raise
            out.append(CrossTerm(occ[0][2], torch.mul(q, q).mul_(trivial)))
            continue
        sq = torch.addcmul(total, q, q, value=v / 2).mul_(2.0)
        for own, (x, y, k, _) in zip(owns, own_scales, strict=True):
            if own > 0:  # own squared norms not rounded up: their own S^2
                s = x if y is None else x * y
                sq = torch.addcmul(sq, s, s, value=(own + 4 * w) * k**2 / (1 - delta) ** 2)
        out.append(CrossTerm(occ[0][2], sq))
    return out
