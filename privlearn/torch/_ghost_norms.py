"""Ghost squared norms of outer-product layers that never understate the exact norm.

The weight gradient of one example of an outer-product layer (Linear, Conv via its
patches, transformers' Conv1D) is ``G = sum_t g_t a_t^T`` and its squared norm the ghost
norm ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` (Li, Tramer, Liang & Hashimoto 2022, "Large
Language Models Can Be Strong Differentially Private Learners", Sec. 4). When an example's
per-position terms cancel, the terms of that sum are far larger than the result, and the
rounding of the Gram matrices can make it any value, 0 included: the example then entered
the clipped sum unclipped. So :func:`ghost_sq` returns the computed value plus a rigorous
bound on its rounding error, never below the exact squared norm.

With ``gamma_n = n u / (1 - n u)`` (Higham 2002, "Accuracy and Stability of Numerical
Algorithms", Lemma 3.1 and Sec. 3.1: an inner product of length ``n`` formed in any order
with unit roundoff ``u`` is within ``gamma_n |x| |y|`` of the exact one), each Gram entry is
within ``gamma |a_t| |a_s|`` (resp. ``|g_t| |g_s|``), the products and sums over ``s`` (in
the Gram dtype) and over ``t`` (in float64) add their own ``gamma``, so the computed value
is within ``total * U`` of the exact squared norm, ``U = (sum_t |a_t| |g_t|)^2`` (bounded
from the Gram diagonals; ``U`` itself bounds the exact value, by the triangle inequality,
and caps the result). For an ordinary example ``U`` is about ``T`` times its squared norm,
so the bound over-states it (clips it more, never less) by a relative ``~ total * T``.

To keep ``total`` small the Gram matrices are accumulated over blocks of the feature
dimension (:func:`gram_block`): a block of ``k`` features rounds within ``gamma_k``, and
adding ``m`` blocks within ``gamma_m`` more, where one product of the full length ``n``
would round within ``gamma_n`` (a vocabulary-wide language-model head: ``n = 50,257``, an
over-statement of ~80% at ``T = 256``, against ~3% in blocks of 512). The same float32
products (no wider copy of the records, nothing read back from the device); with TF32 or
bfloat16 float32 products (:func:`input_rounding`) the rounding of the
inputs, ``2^-11`` or ``2^-8`` per factor, is added and cannot be blocked away: about
``4 * 2^-11 * T`` relative under TF32 (~50% of a squared norm at ``T = 256``); the
``"highest"`` precision keeps it out. Float64 records round within ``2^-53``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from privlearn.torch._ghost_pending import PENDING, SHARED_GRAM
from privlearn.torch._rows import mm32

__all__ = ["SHARED_GRAM", "GhostParts", "finish_groups", "finish_parts", "ghost_parts", "ghost_sq",
           "gram_block", "input_rounding", "round_up", "sum_up"]


_U64 = 2.0**-53
_U32 = 2.0**-24
#: unit roundoff of the inputs of a float32 matrix product, by
#: ``torch.get_float32_matmul_precision()`` (TF32: 10 explicit mantissa bits; bfloat16: 7)
_INPUT_ROUNDING = {"highest": 0.0, "high": 2.0**-11, "medium": 2.0**-8}
#: the same by a backend's own ``fp32_precision`` ("none": the generic setting holds)
_BACKEND_ROUNDING = {"ieee": 0.0, "tf32": 2.0**-11, "bf16": 2.0**-8}


def input_rounding(device_type: str) -> float:
    """Unit roundoff of the inputs of a float32 matrix product on ``device_type``: the
    backend's own setting (``torch.backends.cuda.matmul.fp32_precision`` on CUDA,
    ``torch.backends.mkldnn.matmul.fp32_precision`` on the CPU) where it is set, else the
    generic one; bfloat16's ``2^-8`` (the widest) where neither can be read (PyTorch
    refuses to read the generic setting once the legacy and the new settings are mixed)."""
    backend = {"cuda": "cuda", "cpu": "mkldnn"}.get(device_type)
    matmul = getattr(getattr(torch.backends, backend, None), "matmul", None) if backend else None
    own = getattr(matmul, "fp32_precision", "none")
    if own in _BACKEND_ROUNDING:
        return _BACKEND_ROUNDING[own]
    try:
        generic = torch.get_float32_matmul_precision()
    except RuntimeError:
        return 2.0**-8
    return _INPUT_ROUNDING.get(generic, 2.0**-8)


def _gamma(n: int, u: float) -> float:
    """``n u / (1 - n u)`` (infinite when ``n u >= 1``: no bound)."""
    nu = n * u
    return float("inf") if nu >= 1 else nu / (1 - nu)


def _entry_gamma(
    k: int, dtype: torch.dtype, low: bool, blocks: int = 1, device_type: str = "cpu"
) -> float:
    """Relative bound (to ``|x| |y|``) on the error of one Gram entry accumulated over
    ``blocks`` products of length ``k``: each within ``gamma_k``, their sum within
    ``gamma_(blocks - 1)`` more (in the Gram dtype; Cauchy-Schwarz bounds the sum of the blocks'
    ``|x_j| |y_j|`` by ``|x| |y|``)."""
    if dtype == torch.float64:
        return (1 + _gamma(k, _U64)) * (1 + _gamma(blocks - 1, _U64)) - 1
    acc = (1 + _gamma(k, _U32)) * (1 + _gamma(blocks - 1, _U32)) - 1
    if low:  # half-precision operands: products exact in float32, float32 accumulation
        return acc
    return (1 + input_rounding(device_type)) ** 2 * (1 + acc) - 1


def gram_block(t: int, n: int, u: float) -> int:
    """Features per block of a Gram matrix of ``T = t`` positions and ``n`` features at unit
    roundoff ``u``: as many as keep the block's ``gamma`` near ``0.01 / T`` (so its part of
    the over-statement, ``~ gamma T``, near 1%), at least 256, at most ``n``."""
    k = int(0.01 / (max(t, 1) * u))
    return max(1, min(n, max(256, k)))


def _gram(x: torch.Tensor, mm, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x x^T`` per row of ``(N, T, n)`` ``x``, accumulated over blocks of ``k`` features
    (one product where ``k >= n``). Each block's product is formed apart and then added (a
    fused ``baddbmm`` may add the running sum inside the product's own reduction, where
    its rounding is not bounded by the block's length). With ``out`` (``mm`` then
    ``torch.matmul``, ``torch.bmm`` or ``mm32``), the first product is written there."""
    n = x.shape[-1]
    kw = {} if out is None else {"out": out}
    if k >= n:
        return mm(x, x.transpose(1, 2), **kw)
    out = mm(x[..., :k], x[..., :k].transpose(1, 2), **kw)
    for j in range(k, n, k):
        xj = x[..., j : j + k]
        out.add_(mm(xj, xj.transpose(1, 2)))
    return out


def _gram_key(a: torch.Tensor, mm, k: int) -> tuple | None:
    """What identifies the Gram matrix of ``a`` (see :data:`SHARED_GRAM`), None for a
    tensor whose memory cannot be told (a tensor subclass, no storage)."""
    if type(a) is not torch.Tensor or a.is_meta:
        return None
    try:
        return (a.data_ptr(), a.device, a.dtype, tuple(a.shape), a.stride(), a._version, mm, k)
    except RuntimeError:  # pragma: no cover - a tensor without accessible storage
        return None


class GhostParts(NamedTuple):
    """A ghost squared norm before its last sums (:func:`ghost_parts`): the per-position
    row sums of the Gram product (the first of two stages for long rows), the square
    roots of its diagonal, the two-stage split ``k`` and the bound's factor ``alpha``;
    :func:`finish_parts` forms the norms of many such layers (of one shape) at once."""

    rows: torch.Tensor  # (N, T)
    roots: torch.Tensor  # (N, T)
    k: int
    alpha: float


def ghost_sq(
    a: torch.Tensor, g: torch.Tensor, mm=torch.matmul, widen: bool = False, spread: float = 0.0
) -> torch.Tensor:
    """Squared Frobenius norms of ``sum_t g_t a_t^T`` per row, never below the exact ones.

    Parameters
    ----------
    a : tensor ``(N, T, d)``
        Inputs (working dtype, or half precision with ``mm`` accumulating in float32).
    g : tensor ``(N, T, p)``
        Output gradients, same dtype as ``a``.
    mm : callable
        The batched matrix product of the working precision (``torch.matmul``, or
        :func:`~privlearn.torch._rows.mm32` for half-precision operands).
    widen : bool
        Form the Gram matrices in float64 (a wider copy of the records; the tightest
        bound, at the cost of float64 products).
    spread : float
        Relative rounding already in the entries of ``g`` (a weight multiplied into them,
        as a privacy unit's ``w_r g_r``): the exact gradient is then within ``e sum_t |a_t|
        |g_t|``, ``e = spread / (1 - spread)``, of the one formed from ``g``, and ``(2 e +
        e^2) U`` is added (``U`` of the module docstring).

    Returns
    -------
    tensor ``(N,)``
        In the Gram dtype (float32 for half-precision operands): the sum of the Gram
        products plus the bound on its rounding error (see the module docstring).
    """
    parts = ghost_parts(a, g, mm, widen, spread)
    return parts if isinstance(parts, torch.Tensor) else finish_parts([parts])


def ghost_parts(
    a: torch.Tensor,
    g: torch.Tensor,
    mm=torch.matmul,
    widen: bool = False,
    spread: float = 0.0,
    defer: bool = False,
) -> GhostParts | torch.Tensor:
    """:func:`ghost_sq` up to its last sums (its arguments): :class:`GhostParts`, or the
    norms themselves where no useful bound holds in the working precision (formed in
    float64 then). With ``defer``, while a
    :class:`~privlearn.torch._ghost_pending.PendingProducts` is in force, the parts' rows
    and roots are formed with other layers' when it flushes (not to be read before)."""
    n, t, d = a.shape
    p = g.shape[-1]
    low = a.dtype in (torch.float16, torch.bfloat16)
    if widen and a.dtype != torch.float64:
        a, g, mm, low = a.double(), g.double(), torch.bmm, False
    u = _U64 if a.dtype == torch.float64 else _U32
    ka, kg = gram_block(t, d, u), gram_block(t, p, u)
    dev = a.device.type
    ga = _entry_gamma(ka, a.dtype, low, -(-d // ka), dev)
    gp = _entry_gamma(kg, g.dtype, low, -(-p // kg), dev)
    if ga >= 0.25 or gp >= 0.25 or (2 * t + 8) * u >= 0.25:  # no useful bound here:
        # float64, rounded up into the Gram dtype
        return round_up(
            ghost_sq(a.double(), g.double(), widen=True, spread=spread),
            torch.float32 if low else a.dtype,
        )
    slot = SHARED_GRAM.get()
    key = _gram_key(a, mm, ka) if slot is not None else None
    if key is not None and slot and slot[0] == key:
        aa = slot[2]  # the same input's Gram matrix, formed for a layer before
    else:
        aa = _gram(a, mm, ka)  # (N, T, T), float32 for half-precision operands
        if key is not None:
            slot[:] = [key, a, aa]
        elif slot:
            slot.clear()
    k = _split(t)
    pending = PENDING.get() if defer else None
    if pending is not None and (
        (mm in (torch.matmul, torch.bmm) and g.dtype == aa.dtype)
        or (mm is mm32 and aa.dtype == torch.float32)
    ):
        # the output gradients' Gram matrix formed in the group's buffer, multiplied by
        # the input's with the other layers' (one multiplication for the group)
        held = pending.take_gram(aa, k, lambda out: _gram(g, mm, kg, out))
    else:
        held = None
    gg = _gram(g, mm, kg) if held is None else None
    w = _U64 if aa.dtype == torch.float64 else _U32  # the Gram dtype's roundoff
    # cap = root^2 = (sum_t sqrt(diag_a diag_g))^2 in the Gram dtype (within gamma_(2T+4) of its
    # value on the computed diagonals, whose entries are at least (1 - gamma) |a_t|^2,
    # resp. |g_t|^2): cap * f >= (sum_t |a_t| |g_t|)^2, which is at least the exact
    # squared norm (triangle inequality)
    f = 1.0 / ((1 - _gamma(2 * t + 4, w)) * (1 - ga) * (1 - gp))
    # the products and the sums over s, then over t, in the Gram dtype (in place: no
    # other T x T buffer; a long row summed in two stages of about sqrt(T) each), within
    # `sums` of sum |aa . gg| <= (1 + ga)(1 + gp) cap
    if held is None and pending is not None:
        held = pending.take(aa, gg, k)
    if held is not None:  # the same products and reductions, with other layers'
        rows, roots = held
    else:
        # (the product formed in the output gradients' Gram where the input's is kept
        # for other layers: the same products, multiplication commutes)
        prod = gg.mul_(aa) if key is not None else aa.mul_(gg)
        rows = _sum_last(prod, k)
        # the diagonal of the products is diag_a * diag_g (the same single rounding):
        # the root's terms from it (no product of the diagonals)
        roots = prod.diagonal(dim1=1, dim2=2).sqrt()
    stage = (1 + _gamma(k, w)) * (1 + _gamma(t // k, w))
    sums = ((1 + w) * stage * stage - 1) * (1 + ga) * (1 + gp)
    # sq + alpha cap, cap = root^2, in one operation: its scaling and addition round
    # within 4 w cap f (|sq| and the term are at most ~cap f; the square's rounding is in f)
    e = spread / (1 - spread)
    alpha = (ga + gp + ga * gp + sums + 4 * w + (2 * e + e * e) * (1 + 4 * w)) * f
    return GhostParts(rows, roots, k, alpha)


def finish_parts(parts: list[GhostParts]) -> torch.Tensor:
    """The ghost squared norms of layers of one shape (the same ``k`` and ``alpha``; the
    same dtype, device and ``(N, T)``): ``(N,)`` for one, ``(L, N)`` for ``L`` of them,
    their rows and roots summed by one stacked reduction and the bound added by one
    ``addcmul`` (the same sums a row as one layer alone; the root of a long row in two
    stages, within the one sum's ``gamma_T`` the bound allows)."""
    p0 = parts[0]
    if len(parts) == 1:
        sq, root = _sum_last(p0.rows, p0.k), p0.roots.sum(-1)
        return torch.addcmul(sq, root, root, value=p0.alpha)
    n = len(parts)
    s = _sum_last(torch.stack([p.rows for p in parts] + [p.roots for p in parts]), p0.k)
    return torch.addcmul(s[:n], s[n:], s[n:], value=p0.alpha)


def finish_groups(groups: list[list[GhostParts]]) -> list[torch.Tensor]:
    """:func:`finish_parts` of several groups whose parts share ``k``, dtype, device and
    ``(N, T)`` (their ``alpha`` differing: layers of other widths), their rows and roots
    summed by one stacked reduction for all of them and each group's bound added by its
    own ``addcmul``: ``(N,)`` for a group of one, ``(L, N)`` for ``L`` (the same sums a row
    as :func:`finish_parts` of two or more)."""
    parts = [p for g in groups for p in g]
    n = len(parts)
    s = _sum_last(torch.stack([p.rows for p in parts] + [p.roots for p in parts]), parts[0].k)
    out, i = [], 0
    for g in groups:
        j = i + len(g)
        sq, root = (s[i], s[n + i]) if len(g) == 1 else (s[i:j], s[n + i : n + j])
        out.append(torch.addcmul(sq, root, root, value=g[0].alpha))
        i = j
    return out


def _split(t: int) -> int:
    """A divisor ``k`` of ``t`` between ``sqrt(t) / 2`` and ``sqrt(t)`` to sum a row of
    ``t`` in two stages (``k`` then ``t / k`` terms: each sum within ``gamma_k`` and
    ``gamma_(t/k)``, where one sum of ``t`` terms is within ``gamma_t``); 1 (one sum) for
    rows of at most 128 or without such a divisor."""
    if t <= 128:
        return 1
    for k in range(math.isqrt(t), 1, -1):
        if 4 * k * k < t:
            break
        if t % k == 0:
            return k
    return 1


def _sum_last(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sum over the last dimension, in two stages of ``k`` and ``n / k`` terms (one where
    ``k == 1``)."""
    if k == 1:
        return x.sum(-1)
    return x.view(*x.shape[:-1], x.shape[-1] // k, k).sum(-1).sum(-1)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative float64 ``x`` in ``dtype``, rounded so as never to decrease."""
    if dtype == torch.float64:
        return x
    y = x.to(dtype)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def sum_up(x: torch.Tensor) -> torch.Tensor:
    """Row sums of non-negative ``(N, G)`` ``x``, never below the exact ones: the sum of
    ``G`` non-negative terms in ``x``'s dtype is within ``gamma_(G-1)`` of the exact one,
    the scaling within one more rounding."""
    u = _U64 if x.dtype == torch.float64 else _U32 if x.dtype == torch.float32 else 2.0**-8
    return x.sum(1).mul_(1.0 / (1.0 - _gamma(x.shape[1] + 1, u)))
