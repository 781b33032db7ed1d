"""Per-example rule for :class:`torch.nn.Embedding`: the per-example gradient is the
output gradient scattered to the looked-up rows (padding row excluded).
"""

from __future__ import annotations

import torch
from torch import nn

from privlearn.torch.grad_sample import (
    Contribution,
    Record,
    _as,
    _rowdot,
    _scaled,
    _segment_sum,
    compute_dtype,
    register_rule,
)

__all__ = ['EmbeddingContribution', 'embedding_rule']


class EmbeddingContribution(Contribution):
    """Embedding: per-example gradient rows are sums of output gradients per token id.

    The squared norm is ``sum_v |sum_{t: id_t = v} g_t|^2``, computed by aggregating over
    the distinct (example, token) pairs (``B T D`` work; equals the ghost form
    ``sum_{t,s} [id_t = id_s] g_t . g_s``). The clipped sum is one ``index_add``.
    """

    def __init__(self, weight, ids, g, padding_idx):
        self.params = (weight,)
        self.weight = weight
        b = ids.shape[0]
        ids = ids.reshape(b, -1)  # copies expanded (stride-0) views: never written in place
        g = g.reshape(b, ids.shape[1], -1)
        g = _as(g, compute_dtype(g))
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
        b, ids, g = self.b, self.ids, self.g
        V, D = self.weight.shape
        if b == 0:
            return g.new_zeros(0)
        if ids.shape[1] == 1:
            return g.pow(2).sum((1, 2))
        if self._shared_ids():  # one id row for every example (position ids, token types)
            uniq, inv = torch.unique(ids[0], return_inverse=True)
            if uniq.numel() == ids.shape[1]:  # distinct ids: each row its own
                return _rowdot(g.reshape(b, -1))
            agg = g.new_zeros(b, uniq.numel(), D).index_add_(1, inv, g)
            return _rowdot(agg.reshape(b, -1))
        keys = torch.arange(b, device=ids.device).unsqueeze(1) * V + ids
        uniq, inv = torch.unique(keys.reshape(-1), return_inverse=True)
        # segment sums by the (sort-based) kernel autograd uses for Embedding: several
        # times faster on CPU than index_add_
        agg = _segment_sum(g.reshape(-1, D), inv, uniq.shape[0])
        sq = _rowdot(agg)
        return g.new_zeros(b).index_add_(0, uniq // V, sq)

    def _shared_ids(self) -> bool:
        """Whether every example looked up the same ids: an id row broadcast over the
        batch (stride 0), as Hugging Face's default position and token-type ids are."""
        return self.b > 1 and self.ids.stride(0) == 0

    def _weighted_rows(self, c: torch.Tensor) -> torch.Tensor:
        """Output gradients scaled per example, ``c_i g_{i,t}``, one row per token."""
        return (self.g * c.to(self.g.dtype).view(-1, 1, 1)).reshape(-1, self.weight.shape[1])

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        return [_segment_sum(self._weighted_rows(c), self.ids.reshape(-1),
                             self.weight.shape[0])]

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """``outs[0] += sum_i c_i grad_i`` by one ``index_add_`` of the weighted output
        gradients into the (noise) buffer: no ``(V, D)`` temporary (on CPU the zeroing
        and adding of a vocabulary-sized temporary cost more than the scatter itself)."""
        o = outs[0]
        D = self.weight.shape[1]
        if self._shared_ids():  # sum over examples first: T rows to scatter, not B T
            t = self.ids.shape[1]
            rows = (c.to(self.g.dtype) @ self.g.reshape(self.b, t * D)).view(t, D)
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
    return EmbeddingContribution(module.weight, ids, _scaled(record), module.padding_idx)
