"""A data collator wrapper for :class:`~privlearn.torch.hf.DPTrainer` (re-exported by
:mod:`privlearn.torch.hf`)."""

from __future__ import annotations

import torch

__all__ = ["expand_position_ids"]


def expand_position_ids(collator):
    """Wrap a data collator so that its batches carry ``position_ids`` of shape
    ``(B, T)`` (``0..T-1`` per row; with an ``attention_mask``, counted over its ones, as
    for left padding). Not needed for the engine: it expands the broadcast ``(1, T)`` ids
    GPT-2 and BERT build themselves; useful where explicit per-row positions are wanted
    (left padding)."""

    def collate(features):
        batch = collator(features)
        ids = batch.get("input_ids")
        if ids is not None and "position_ids" not in batch:
            mask = batch.get("attention_mask")
            if mask is not None:
                pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
            else:
                pos = torch.arange(ids.shape[-1]).expand(ids.shape[0], -1)
            batch["position_ids"] = pos.contiguous()
        return batch

    return collate
