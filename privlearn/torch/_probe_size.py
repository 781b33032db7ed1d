"""The batch sizes the batch-independence probe has checked whole.

A forward pass can take a path that mixes examples only at some batch sizes (a statistic
over the batch applied when the batch is large enough, ``if x.shape[0] >= 16: x = x -
x.mean(0)``; a normalisation that switches to batch statistics above a size). The probe
(:mod:`privlearn.torch.probe`) saves cost by running on a few examples of the batch, at
which such a path is not taken, so on its own it would pass a model that mixes every
batch the run trains on. Per-example clipping bounds one example's influence only if
every batch the steps use is independent (Abadi et al. 2016, Sec. 3.1: the sensitivity
of the clipped sum), so the probe runs on the whole batch whenever the batch is at least
as large as any it checked whole (the first probe included), and a forward on a batch
larger than any seen so far re-arms it: with Poisson batches a new largest size comes
about ``ln T`` times in ``T`` steps, with fixed-size batches once. Probes re-armed
otherwise (a module's ``training`` flag, new flags) on a batch smaller than one already
checked whole keep running on a few examples.
"""

from __future__ import annotations

import torch

__all__ = ["due", "grouping", "larger_batch", "probed"]


def due(tracker, examples: int) -> bool:
    """Whether the probe of a batch of ``examples`` must run on the whole batch: none
    of at least its size was checked whole yet."""
    return examples >= getattr(tracker, "_probed_whole", 0)


def grouping(tracker) -> bool:
    """Whether the probe replaces every example in turn (layers whose rows are to be
    grouped per example, :mod:`privlearn.torch._flat_rows`). That costs a pass per
    example, so on a batch due whole the probe runs it on the first few examples (each
    group checked there), then the whole batch with its first and last example replaced
    (a path that mixes examples only from some batch size on): about ``m + 6`` passes,
    not one per example of the batch. (FSDP2's plan, which every rank pads to, still
    counts one per example: the part fails on a model that needs the whole batch, and
    then every example of the whole batch is replaced.)"""
    return bool(getattr(tracker, "_flat_candidates", None))


def probed(tracker, examples: int) -> None:
    """Record that a batch of ``examples`` passed the probe on the whole batch."""
    tracker._probed_whole = max(getattr(tracker, "_probed_whole", 0), int(examples))


def larger_batch(tracker, args: tuple, kwargs: dict) -> bool:
    """At a training forward of the model: whether its batch (the leading dimension of
    its first tensor input, as the tracker's batch hint reads it) is larger than any
    seen before, which re-arms the probe. Reads shapes only (no device access)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            b = int(v.shape[0])
            if b > getattr(tracker, "_largest_batch", 0):
                tracker._largest_batch = b
                return True
            return False
    return False
