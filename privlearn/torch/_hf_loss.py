"""The sequence-classification loss of :class:`privlearn.torch.hf.DPTrainer`: Hugging
Face's losses of ``*ForSequenceClassification`` models, as means over examples (no
transformers import)."""

from __future__ import annotations

import warnings

import torch
from torch.nn import functional as F

from privlearn.errors import ParameterValueError

__all__ = ["sequence_classification_loss", "warn_own_compute_loss"]


def sequence_classification_loss(model, logits: torch.Tensor,
                                 labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's sequence-classification losses, as means over examples."""
    cfg = getattr(model, "config", None)
    problem = getattr(cfg, "problem_type", None)
    num_labels = getattr(cfg, "num_labels", logits.shape[-1])
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        # one row of targets per example, shaped as its outputs: mse_loss would broadcast
        # labels of shape (B, 1) against outputs (B,) into (B, B), each example's loss
        # then holding every other example's label (its gradient no longer its own)
        out = logits.float().reshape(logits.shape[0], -1)
        if labels.dim() == 0 or labels.shape[0] != out.shape[0] or \
                labels.numel() != out.numel():
            raise ParameterValueError(
                f"regression labels must hold {out.shape[1]} target(s) per example, shape "
                f"({out.shape[0]},{' ' + str(out.shape[1]) if out.shape[1] > 1 else ''}) "
                f"(num_labels={num_labels}), got shape {tuple(labels.shape)} for "
                f"logits of shape {tuple(logits.shape)}. Fix the collator or num_labels")
        return F.mse_loss(out, labels.to(torch.float32).reshape(out.shape))
    if problem == "single_label_classification":
        return F.cross_entropy(logits.float().view(-1, num_labels), labels.view(-1))
    # multi-label: mean over examples and labels (a fixed divisor per example)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.to(torch.float32))


def warn_own_compute_loss(trainer_cls: type, base: type) -> None:
    """Warn when a subclass of ``base`` (:class:`~privlearn.torch.hf.DPTrainer`)
    overrides ``compute_loss``: what it returns is not checked, and DP-SGD's sensitivity
    holds only for a mean over examples of per-example losses."""
    if trainer_cls.compute_loss is base.compute_loss:
        return
    warnings.warn(
        f"{trainer_cls.__name__}.compute_loss overrides DPTrainer's: it must return the mean "
        "over the batch's examples of per-example losses (one value per example, each from "
        "that example alone, e.g. privlearn.torch.per_sequence_cross_entropy). A token-level "
        "mean over the whole batch (F.cross_entropy over its flattened tokens) weighs each "
        "example by its share of the batch's tokens, so removing one example rescales the "
        "others' gradients, which per-example clipping does not bound; DPTrainer cannot "
        "check this. Prefer PrivacyArguments(task=...)", UserWarning, stacklevel=3)
