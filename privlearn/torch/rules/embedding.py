"""Per-example rules for :class:`torch.nn.Embedding` (the per-example gradient is the
output gradient scattered to the looked-up rows, padding row excluded) and
:class:`torch.nn.EmbeddingBag` (one example per bag, modes "sum" and "mean").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from privlearn.torch._summed_rows import rows_sq, spread_alpha, sum_sq_bound, unit_roundoff
from privlearn.torch._summed_rows import segments as _segments
from privlearn.torch.grad_sample import (
    Contribution,
    Layout,
    Record,
    as_dtype,
    compute_dtype,
    register_rule,
    row_scaled,
    row_sq_norms,
    segment_sum,
)

__all__ = ["EmbeddingContribution", "embedding_bag_rule", "embedding_rule"]


class EmbeddingContribution(Contribution):
    """Embedding: per-example gradient rows are sums of output gradients per token id.

    The squared norm is ``sum_v |sum_{t: id_t = v} g_t|^2``, computed by aggregating over
    the distinct (example, token) pairs (``B T D`` work; equals the ghost form
    ``sum_{t,s} [id_t = id_s] g_t . g_s``). The clipped sum is one ``index_add``.
    """

    masks_rows = True

    def __init__(self, weight, ids, g, padding_idx):
        self.params = (weight,)
        self.weight = weight
        b = ids.shape[0]
        # copies expanded (stride-0) views: never written in place; sizes spelled out, as
        # -1 is ambiguous for an empty batch
        ids = ids.reshape(b, math.prod(ids.shape[1:]))
        g = g.reshape(b, ids.shape[1], g.shape[-1])
        g = as_dtype(g, compute_dtype(g))
        if padding_idx is not None:
            g = g * (ids != padding_idx).unsqueeze(-1).to(g.dtype)
        self.b, self.ids, self.g = b, ids, g
        self._sq = None

    def factor(self, j: int):
        return ("rows", self.ids, self.g, self.weight.shape[0])

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:  # asked twice a step (batch-size check, then clipping)
            self._sq = self._compute_sq_norms()
        return self._sq

    def _compute_sq_norms(self) -> torch.Tensor:
        """Never below the exact squared norms: the rows of a token an example repeats
        are summed before squaring, and their sum's rounding is bounded
        (:mod:`privlearn.torch._summed_rows`)."""
        b, ids, g = self.b, self.ids, self.g
        V, D = self.weight.shape
        if b == 0:
            return g.new_zeros(0)
        if ids.shape[1] == 1:
            return g.pow(2).sum((1, 2))
        t = ids.shape[1]
        alpha = spread_alpha(t, D, D + t, t, unit_roundoff(g.dtype))
        if self._shared_ids() and alpha < float("inf"):
            # one id row for every example (position ids, token types): the positions
            # holding equal ids summed first (distinct ids: a copy of g), and their norms
            seg = _segments(ids[0])
            agg = g.new_zeros(b, t, D).index_add_(1, seg, g)
            spread = g.new_zeros(b, t).index_add_(1, seg, torch.linalg.vector_norm(g, dim=2))
            sq = row_sq_norms(agg.reshape(b * t, D)).view(b, t)
            return sum_sq_bound(sq, spread, alpha).sum(1)
        return rows_sq(ids, g, V)

    def _shared_ids(self) -> bool:
        """Whether every example looked up the same ids: an id row broadcast over the
        batch (stride 0), as Hugging Face's default position and token-type ids are."""
        return self.b > 1 and self.ids.stride(0) == 0

    def _weighted_rows(self, c: torch.Tensor) -> torch.Tensor:
        """Output gradients scaled per example, ``c_i g_{i,t}``, one row per token."""
        return row_scaled(self.g, c).reshape(-1, self.weight.shape[1])

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        return [segment_sum(self._weighted_rows(c), self.ids.reshape(-1),
                             self.weight.shape[0])]

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """``outs[0] += sum_i c_i grad_i`` by one ``index_add_`` of the weighted output
        gradients into the (noise) buffer: no ``(V, D)`` temporary (on CPU the zeroing
        and adding of a vocabulary-sized temporary cost more than the scatter itself)."""
        o = outs[0]
        D = self.weight.shape[1]
        if self._shared_ids():  # sum over examples first: T rows to scatter, not B T
            t = self.ids.shape[1]
            rows = row_scaled(self.g.reshape(self.b, t * D), c).sum(0).view(t, D)
            o.view(-1, D).index_add_(0, self.ids[0], rows.to(o.dtype))
            return
        o.view(-1, D).index_add_(0, self.ids.reshape(-1), self._weighted_rows(c).to(o.dtype))

    def per_sample(self) -> list[torch.Tensor]:
        b, ids, g = self.b, self.ids, self.g
        V, D = self.weight.shape
        out = g.new_zeros(b * V, D)
        keys = (torch.arange(b, device=ids.device).unsqueeze(1) * V + ids).reshape(-1)
        out.index_add_(0, keys, g.reshape(-1, D))
        return [out.view(b, V, D)]


@register_rule(nn.Embedding)
def embedding_rule(module: nn.Embedding, record: Record, params) -> Contribution:
    ids = record.args[0]
    return EmbeddingContribution(module.weight, ids, record.grad(0), module.padding_idx)


def _bags(module: nn.EmbeddingBag, record: Record):
    """``(ids (B, L), weights (B, L))`` of the bags of one call: each bag's ids padded to
    the longest bag, with the factor each id's embedding enters the bag's output with
    (``per_sample_weights`` for mode "sum", ``1 / bag size`` for "mean", 0 for padding
    and for ``padding_idx``)."""
    x = record.args[0]
    offsets = record.args[1] if len(record.args) > 1 else record.kwargs.get("offsets")
    psw = record.args[2] if len(record.args) > 2 else record.kwargs.get("per_sample_weights")
    if x.dim() == 2:
        ids = x
        w = (psw if psw is not None else torch.ones(ids.shape, dtype=torch.float64,
                                                     device=ids.device))
        live = torch.ones_like(ids, dtype=torch.bool)
    else:
        ends = offsets[1:] if module.include_last_offset else torch.cat(
            [offsets[1:], offsets.new_tensor([x.numel()])])
        starts = offsets[:-1] if module.include_last_offset else offsets
        sizes = ends - starts
        b = starts.numel()
        width = int(sizes.max()) if b else 0
        pos = torch.arange(width, device=x.device)
        live = pos[None, :] < sizes[:, None]
        idx = (starts[:, None] + pos[None, :]).clamp_max(max(x.numel() - 1, 0))
        ids = torch.where(live, x[idx] if x.numel() else idx, torch.zeros_like(idx))
        w = torch.ones(ids.shape, dtype=torch.float64, device=x.device) if psw is None \
            else torch.where(live, psw[idx], torch.zeros((), dtype=psw.dtype,
                                                          device=psw.device))
    if module.padding_idx is not None:
        live = live & (ids != module.padding_idx)
    w = w * live
    if module.mode == "mean":
        count = live.sum(1, keepdim=True).clamp_min(1)
        w = w / count
    return ids, w


def _bag_batch(module: nn.EmbeddingBag, record: Record) -> int:
    x = record.args[0]
    if x.dim() == 2:
        return x.shape[0]
    offsets = record.args[1] if len(record.args) > 1 else record.kwargs.get("offsets")
    return offsets.numel() - (1 if module.include_last_offset else 0)


def _bag_record_dims(module: nn.EmbeddingBag, record: Record, batch: int):
    two_d = record.args[0].dim() == 2
    arg_dims = [0 if two_d else None, None, 0 if two_d else None][: len(record.args)]
    kw_dims = {k: (0 if two_d and k == "per_sample_weights" else None) for k in record.kwargs}
    return arg_dims, kw_dims, [0]


def _bag_observe(module, args, kwargs, output):
    return [(output, 0, "output")]


@register_rule(nn.EmbeddingBag,
               layout=Layout(batch_dim=0, own_layout=True, expand_broadcast=False,
                             batch_size=_bag_batch, record_dims=_bag_record_dims),
               observe=_bag_observe)
def embedding_bag_rule(module: nn.EmbeddingBag, record: Record, params) -> Contribution:
    """``nn.EmbeddingBag`` with mode "sum" (with or without ``per_sample_weights``) or
    "mean": bag ``b``'s output is ``sum_t c_t E[id_t]``, so its per-example gradient
    puts ``c_t g_b`` on row ``id_t`` -- the Embedding contribution of the bag's ids with
    output gradients ``c_t g_b`` (2-D input or 1-D input with offsets, one example per
    bag). Mode "max": feature ``d`` of the bag's output is ``E[id_t, d]`` at the bag's
    first maximum ``t`` in that feature (as torch's kernel picks it), so ``g_{b,d}`` goes
    there alone (nothing from an empty bag, whose output is 0)."""
    ids, w = _bags(module, record)
    g = record.grad(0)  # (B, D)
    dt = compute_dtype(g)
    if module.mode == "max":
        rows = _max_rows(module.weight, ids, w != 0, as_dtype(g, dt))
    else:
        rows = as_dtype(w, dt).unsqueeze(-1) * as_dtype(g, dt).unsqueeze(1)  # (B, L, D)
    return EmbeddingContribution(module.weight, ids, rows, None)


def _max_rows(weight: torch.Tensor, ids: torch.Tensor, live: torch.Tensor,
              g: torch.Tensor) -> torch.Tensor:
    """Output gradient rows ``(B, L, D)`` of max-pooled bags: ``g[b, d]`` at the position
    of bag ``b``'s first maximum in feature ``d`` among its ``live`` ids, 0 elsewhere."""
    vals = weight.detach()[ids].masked_fill(~live.unsqueeze(-1), float("-inf"))
    if vals.shape[1] == 0:  # every bag empty: no gradient
        return vals.new_zeros(vals.shape, dtype=g.dtype)
    at = vals.argmax(1, keepdim=True)  # (B, 1, D): the first maximum, as torch's kernel
    hit = torch.zeros(vals.shape, dtype=torch.bool, device=vals.device).scatter_(1, at, True)
    return (hit & live.unsqueeze(-1)).to(g.dtype) * g.unsqueeze(1)
