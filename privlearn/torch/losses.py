"""Losses whose batch reduction is a mean over *examples*, as DP-SGD needs.

Per-example clipping bounds the influence of one example only if the loss is a sum (or a
mean with a fixed divisor) of per-example terms, each depending on one example alone.
A token-level cross-entropy averaged over all tokens of the batch (what Hugging Face
models compute when called with ``labels=``, and ``F.cross_entropy(logits.view(-1, V),
labels.view(-1))``) divides by the batch's total token count: example ``i``'s gradient is
scaled by ``B n_i / sum_j n_j``, which depends on the other examples, so adding or
removing one example rescales every other one and the sensitivity argument of DP-SGD
(Abadi et al. 2016, Sec. 3.1) fails.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from privlearn.errors import ParameterValueError

__all__ = ["per_sequence_cross_entropy"]


def per_sequence_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *,
                               shift: bool = False, ignore_index: int = -100,
                               reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy averaged within each sequence, then reduced over sequences.

    Parameters
    ----------
    logits : Tensor of shape (B, T, V)
    labels : LongTensor of shape (B, T)
        Target token ids; positions equal to ``ignore_index`` (padding, prompt tokens)
        are left out of their sequence's mean.
    shift : bool
        Causal language modelling: position ``t`` predicts label ``t + 1`` (what Hugging
        Face's ``*ForCausalLM`` do with ``labels=``). False for token classification and
        masked LM.
    ignore_index : int
    reduction : {"mean", "sum", "none"}
        Over sequences: ``"mean"`` divides the sum of per-sequence losses by ``B``
        (pair it with ``make_private(loss_reduction="mean")``), ``"sum"`` with
        ``loss_reduction="sum"``; ``"none"`` returns the ``B`` per-sequence losses. A
        sequence with no target token contributes 0.

    Returns
    -------
    Tensor
        Scalar (or shape ``(B,)`` for ``"none"``).
    """
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.shape:
        raise ParameterValueError(
            f"logits must be (B, T, V) and labels (B, T) with the same B and T, "
            f"got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ParameterValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if shift:
        logits, labels = logits[:, :-1, :], labels[:, 1:]
    b, t, v = logits.shape
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the softmax in float32 under mixed precision
    tok = F.cross_entropy(logits.reshape(b * t, v), labels.reshape(b * t),
                          ignore_index=ignore_index, reduction="none").view(b, t)
    counts = (labels != ignore_index).sum(dim=1)
    per_seq = tok.sum(dim=1) / counts.clamp_min(1).to(tok.dtype)
    if reduction == "none":
        return per_seq
    total = per_seq.sum()
    return total / b if reduction == "mean" and b > 0 else total
