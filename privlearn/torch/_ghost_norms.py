"""Ghost squared norms of outer-product layers that never understate the exact norm.

The weight gradient of one example of an outer-product layer (Linear, Conv via its
patches, transformers' Conv1D) is ``G = sum_t g_t a_t^T`` and its squared norm the ghost
norm ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` (Li, Tramer, Liang & Hashimoto 2022, "Large
Language Models Can Be Strong Differentially Private Learners", Sec. 4). When an example's
per-position terms cancel, the terms of that sum are far larger than the result, and the
rounding of the Gram matrices can make it any value, 0 included: the example then entered
the clipped sum unclipped. So :func:`ghost_sq` forms the Gram matrices

* in float64 on the CPU (where widening costs only time; float64 layers as they are), and
* in the working precision elsewhere (nothing read back from the device, no wider copy),

and adds a rigorous bound on the rounding error. With ``gamma_n = n u / (1 - n u)``
(Higham 2002, "Accuracy and Stability of Numerical Algorithms", Lemma 3.1 and Sec. 3.1:
an inner product of length ``n`` formed in any order with unit roundoff ``u`` is within
``gamma_n |x| |y|`` of the exact one), each Gram entry is within ``gamma_d |a_t| |a_s|``
(resp. ``gamma_p |g_t| |g_s|``; with TF32 or bfloat16 float32 products, see
``torch.get_float32_matmul_precision()``, the rounding of the inputs is added), the
products and the sums over ``s`` (in the Gram dtype) and over ``t`` (in float64) add
their own ``gamma``, so the computed value is within ``total * U`` of the exact squared
norm, ``U = (sum_t |a_t| |g_t|)^2`` (bounded from the Gram diagonals). The result is the
computed value plus ``total * U``, at most ``U`` (which bounds the exact value too):
never below the exact squared norm. In float64 ``total`` is about ``(d + p + T) 2^-53``;
in float32 (``"highest"`` precision) about ``(d + p + T + 1) 2^-24``, which over-states the
squared norms of ordinary examples (``U`` about ``T`` times the squared norm) by a
relative ``~ (d + p + T) T 2^-24`` (clipping them that much more, never less).
"""

from __future__ import annotations

import torch

__all__ = ["ghost_sq", "round_up"]

_U64 = 2.0**-53
_U32 = 2.0**-24
#: unit roundoff of the inputs of a float32 matrix product, by
#: ``torch.get_float32_matmul_precision()`` (TF32: 10 explicit mantissa bits; bfloat16: 7)
_INPUT_ROUNDING = {"highest": 0.0, "high": 2.0**-11, "medium": 2.0**-8}


def _gamma(n: int, u: float) -> float:
    """``n u / (1 - n u)`` (infinite when ``n u >= 1``: no bound)."""
    nu = n * u
    return float("inf") if nu >= 1 else nu / (1 - nu)


def _entry_gamma(n: int, dtype: torch.dtype, low: bool) -> float:
    """Relative bound (to ``|x| |y|``) on the error of one Gram entry of length ``n``."""
    if dtype == torch.float64:
        return _gamma(n, _U64)
    if low:  # half-precision operands: products exact in float32, float32 accumulation
        return _gamma(n, _U32)
    u_in = _INPUT_ROUNDING.get(torch.get_float32_matmul_precision(), 2.0**-8)
    return (1 + u_in) ** 2 * (1 + _gamma(n, _U32)) - 1


def ghost_sq(
    a: torch.Tensor, g: torch.Tensor, mm=torch.matmul, widen: bool | None = None
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
    widen : bool or None
        Form the Gram matrices in float64 (default: on the CPU).

    Returns
    -------
    tensor ``(N,)``
        Float64: the sum of the Gram products plus the bound on its rounding error (see
        the module docstring).
    """
    n, t, d = a.shape
    p = g.shape[-1]
    low = a.dtype in (torch.float16, torch.bfloat16)
    if widen is None:
        widen = a.device.type == "cpu"
    if widen and a.dtype != torch.float64:
        a, g, mm, low = a.double(), g.double(), torch.matmul, False
    ga = _entry_gamma(d, a.dtype, low)
    gp = _entry_gamma(p, g.dtype, low)
    if ga >= 0.5 or gp >= 0.5:  # no useful bound in this precision: float64
        return ghost_sq(a.double(), g.double(), widen=True)
    aa = mm(a, a.transpose(1, 2))  # (N, T, T)
    gg = mm(g, g.transpose(1, 2))
    u_w = _U64 if aa.dtype == torch.float64 else _U32
    # |a_t|^2 <= diag / (1 - gamma_d): the diagonals bound the row norms from above
    # (copies: the products below are formed in place)
    da = aa.diagonal(dim1=1, dim2=2).double().clamp_min(0)
    dg = gg.diagonal(dim1=1, dim2=2).double().clamp_min(0)
    u = (da * dg).sqrt().sum(1).square() * ((1 + _gamma(t + 4, _U64)) / ((1 - ga) * (1 - gp)))
    # products and the sums over s in the Gram dtype (in place: no other T x T buffer),
    # the sum over t in float64
    sq = aa.mul_(gg).sum(2).double().sum(1)
    sums = (1 + u_w) * (1 + _gamma(t, u_w)) * (1 + _gamma(t, _U64)) - 1
    total = ga + gp + ga * gp + sums * (1 + ga) * (1 + gp)
    bound = (sq + total * u) * (1 + 4 * _U64)
    return torch.minimum(bound, u)  # the exact value is at most (sum_t |a_t||g_t|)^2


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative float64 ``x`` in ``dtype``, rounded so as never to decrease."""
    if dtype == torch.float64:
        return x
    y = x.to(dtype)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
