"""Squared norms of sums of rows that never understate the exact ones.

An embedding's per-example gradient puts ``x_v = sum_{t: id_t = v} e_t`` on row ``v``, a
privacy unit's gradient is ``sum_r w_r g_r`` over its rows: sums formed in the working
precision before they are squared. When the terms of a sum cancel, its computed value
``s_v`` can be far below ``x_v`` (0 included), while the clipped sum adds the terms one by
one, scaled: the example (unit) then entered the released sum with a clip factor for a
norm it does not have, more than the bound.

Bound (Higham 2002, "Accuracy and Stability of Numerical Algorithms", Lemma 3.1 and
Sec. 4.2): each term of a sum of ``m`` terms, formed in any order, passes through at most
``m - 1`` additions, and its weight ``w`` (rounded to the working dtype, then multiplied)
through two roundings more, so ``|s_v - x_v| <= g E_v`` componentwise-summed, with
``g = gamma_(m+1)``, ``gamma_n = n u / (1 - n u)``, and ``E_v = sum_t |w_t e_t|`` (the
sum of the terms' Euclidean norms bounds the Euclidean norm of their componentwise
absolute sum). Hence ``|x_v| <= |s_v| + g E_v`` and, as ``|s_v| <= (1 + g) E_v``,

    ``|x_v|^2 <= |s_v|^2 + (2 g (1 + g) + g^2) E_v^2``.

:func:`sum_sq_bound` returns the computed ``|s_v|^2`` plus ``alpha`` times the computed
``E_v^2``, with ``alpha`` (:func:`spread_alpha`) covering that term, the rounding of the
computed ``|s_v|^2`` and ``E_v`` (sums of non-negative terms, a square root) and of the
bound's own operations: never below ``|x_v|^2``. A row summed alone (a token used
once) has ``E_v = |s_v|``: the bound over-states its square by a relative ``~ 2 (m + 1)
u`` (``~ 3 10^-5`` at ``m = 256`` in float32); ``k`` rows that do not cancel, by about
``k`` times that; rows that cancel are clipped as if as large as ``E_v``, never less.
"""

from __future__ import annotations

import torch

from privlearn.torch._ghost_norms import _U32, _U64, _gamma, round_up
from privlearn.torch._rows import row_sq_norms, segment_sum

__all__ = ["dense_sum_sq", "rows_sq", "segments", "spread_alpha", "sum_sq_bound", "unit_roundoff"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of ``dtype`` (float64: ``2^-53``, else float32's ``2^-24``: the
    rules form their sums in float32 at least)."""
    return _U64 if dtype == torch.float64 else _U32


def spread_alpha(m: int, sq_len: int, spread_len: int, post: int, u: float) -> float:
    """``alpha`` of :func:`sum_sq_bound` (module docstring).

    Parameters
    ----------
    m : int
        Most terms in one sum (rows of one token of an example, rows of one unit).
    sq_len : int
        Length of the sum of squares that gives the computed ``|s_v|^2`` (the computed
        value is at least ``(1 - gamma_(sq_len + 3))`` of the exact one: the squares, the
        sum, a square root and its square).
    spread_len : int
        Length of the computation of ``E_v`` (the terms' norms, their sum, and any
        norm over ``E`` taken afterwards): the computed value is at least ``(1 -
        gamma_(spread_len + 4))`` times the exact one (the two more for the weights'
        roundings of the terms).
    post : int
        Terms of a sum of the bounds formed afterwards (the segments of one example),
        at least ``(1 - gamma_post)`` of the exact sum; 0 if none.
    u : float
        Unit roundoff of the working dtype.

    Returns
    -------
    float
        Infinite where a length makes the bound useless (``n u`` near 1).
    """
    g = _gamma(m + 1, u)
    a = 2 * g * (1 + g) + g * g
    gl = _gamma(sq_len + 3, u)
    delta = _gamma(spread_len + 4, u)
    # the bound's sum over segments and the addcmul's three roundings
    k = (1 - _gamma(post, u)) * (1 - u) ** 3
    if not (g < 0.25 and gl < 0.25 and delta < 0.25 and k > 0.5):
        return float("inf")
    alpha = (a + (1 - k * (1 - gl)) * (1 + g) ** 2) / (k * (1 - delta) ** 2)
    return alpha * (1 + 4 * u)  # alpha itself rounded to the working dtype


def sum_sq_bound(sq: torch.Tensor, spread: torch.Tensor, alpha: float) -> torch.Tensor:
    """``sq + alpha spread^2`` in one operation: the computed squared norm of a sum of
    rows raised by the bound on its rounding (module docstring; ``alpha`` finite: where
    it is not, the callers form the sums in float64)."""
    return torch.addcmul(sq, spread, spread, value=alpha)


def segments(keys: torch.Tensor) -> torch.Tensor:
    """Segment index of each entry of the 1-D ``keys``: equal keys share one, numbered
    from 0 in sorted order (what ``torch.unique(return_inverse=True)`` returns as the
    inverse), computed with fixed-size operations only, so nothing is read back from the
    device (the number of distinct keys is never needed: ``len(keys)`` bounds it)."""
    if keys.numel() == 0:
        return keys
    sorted_keys, order = torch.sort(keys)
    # the count of key changes before each sorted entry (the cumulative sum of a bool
    # is int64), 0 put in front for the first
    seg = torch.nn.functional.pad(torch.cumsum(sorted_keys[1:] != sorted_keys[:-1], 0), (1, 0))
    return torch.empty_like(seg).scatter_(0, order, seg)


def rows_sq(ids: torch.Tensor, e: torch.Tensor, v: int) -> torch.Tensor:
    """Squared norms of ``grad_i[k] = sum_{t: ids[i, t] = k} e[i, t]`` per row ``i`` of
    ``(B, T)`` ``ids`` and ``(B, T, D)`` ``e`` (float32 or float64), never below the
    exact ones (module docstring): the sums per distinct ``(example, id)`` by the
    (sort-based) kernel autograd uses for Embedding, several times faster on CPU than
    ``index_add_``, over ``B T`` segments at most (a static bound: the unused ones stay
    zero); the sums of the rows' norms by the same kernel."""
    b, t = ids.shape
    d = e.shape[-1]
    alpha = spread_alpha(t, d, d + t, t, unit_roundoff(e.dtype))
    if alpha == float("inf"):  # lengths ~ 1 / u: float64, rounded up
        return round_up(rows_sq(ids, e.double(), v), e.dtype)
    n = ids.numel()
    # (B, T) keys example * v + id, distinct per (example, id) (0 <= id < v)
    keys = torch.arange(0, b * v, max(v, 1), device=ids.device).unsqueeze(1) + ids
    seg = segments(keys.reshape(-1))
    flat = e.reshape(n, d)
    sq = row_sq_norms(segment_sum(flat, seg, n))
    spread = segment_sum(torch.linalg.vector_norm(flat, dim=1, keepdim=True), seg, n)
    bound = sum_sq_bound(sq, spread.view(n), alpha)
    example = keys.reshape(-1) // max(v, 1)  # the example of each entry
    owner = torch.zeros_like(seg).scatter_(0, seg, example)  # example of each segment
    return e.new_zeros(b).index_add_(0, owner, bound)


def dense_sum_sq(d: torch.Tensor, index: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Squared norms of ``s_k = sum_{r: index_r = k} d_r`` for ``k < n``, ``d`` of shape
    ``(R, ...)`` (float32 or float64) with at most ``m`` rows per ``k``, never below the
    exact ones (module docstring)."""
    rows = d.reshape(d.shape[0], -1)
    L = rows.shape[1]
    alpha = spread_alpha(m, L, L + m, 0, unit_roundoff(d.dtype))
    if alpha == float("inf"):
        return round_up(dense_sum_sq(d.double(), index, n, m), d.dtype)
    s = rows.new_zeros(n, L).index_add_(0, index, rows)
    spread = rows.new_zeros(n).index_add_(0, index, torch.linalg.vector_norm(rows, dim=1))
    return sum_sq_bound(row_sq_norms(s), spread, alpha)
