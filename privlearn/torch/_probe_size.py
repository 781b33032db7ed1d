"""The batch sizes the batch-independence probe has checked whole.

A forward pass can take a path that mixes examples only at some batch sizes (a statistic
over the batch applied when the batch is large enough, ``if x.shape[0] >= 16: x = x -
x.mean(0)``, or only when it is small, ``if x.shape[0] < 4: h = h - h.mean(0)``; a
normalisation that switches to batch statistics above a size). The probe
(:mod:`privlearn.torch.probe`) saves cost by running on a few examples of the batch, at
which such a path is not taken, so on its own it would pass a model that mixes every
batch the run trains on. Per-example clipping bounds one example's influence only if
every batch the steps use is independent (Abadi et al. 2016, Sec. 3.1: the sensitivity
of the clipped sum), so the probe runs on the whole batch whenever the batch is at least
as large as any it checked whole, or smaller than any it checked whole (the first probe
included), and a forward on a batch larger than any seen so far, or smaller than any of
at least two examples seen so far, re-arms it. With Poisson batches a new largest size
comes about ``ln T`` times in ``T`` steps and a new smallest about as often (a record of
``T`` draws: ``1/2 + ... + 1/T`` expected after the first, fewer with ties; measured on
200 steps of expected size 64, six seeds: 2 to 5 of each, 7 to 11 steps probed in all),
with fixed-size batches once (and once more for a smaller last batch). A batch of one
example, or none, cannot mix examples and re-arms nothing. Probes re-armed otherwise (a
module's ``training`` flag, new flags) on a batch between the smallest and the largest
checked whole keep running on a few examples.

The batch of a forward is that of its first argument that has one: a tensor's leading
dimension (as the tracker's batch hint reads it), or a packed sequence's examples (a
``PackedSequence``: the length of ``sorted_indices``, else ``batch_sizes[0]``, as the
recurrent layers' rules read it; torch keeps ``batch_sizes`` on the CPU whatever the
device of the data, so reading it waits for no device).
"""

from __future__ import annotations

import torch

from privlearn.torch import _argument_roles

__all__ = ["batch_of", "due", "grouping", "new_batch_size", "probed"]


def due(tracker, examples: int) -> bool:
    """Whether the probe of a batch of ``examples`` must run on the whole batch: none
    of at least its size, or none of at most its size, was checked whole yet."""
    return examples >= getattr(tracker, "_probed_whole", 0) or examples < getattr(
        tracker, "_probed_smallest", float("inf"))


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
    """Record that a batch of ``examples`` passed the probe on the whole batch (and
    mark the step's records so: :mod:`privlearn.torch._argument_roles`)."""
    _argument_roles.mark_probed(tracker)
    tracker._probed_whole = max(getattr(tracker, "_probed_whole", 0), int(examples))
    tracker._probed_smallest = min(getattr(tracker, "_probed_smallest", float("inf")),
                                   int(examples))


def batch_of(value) -> int | None:
    """The batch size of one forward argument (module docstring), or None when it holds
    none: a tensor's leading dimension; a packed sequence's example count (the length of
    its ``sorted_indices``, else ``batch_sizes[0]``, read only where it is a CPU tensor,
    as torch keeps it). Reads shapes only, never a device's memory."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() >= 1 else None
    sizes = getattr(value, "batch_sizes", None)  # a PackedSequence, by duck typing
    if not isinstance(sizes, torch.Tensor) or not isinstance(getattr(value, "data", None),
                                                             torch.Tensor):
        return None
    order = getattr(value, "sorted_indices", None)
    if isinstance(order, torch.Tensor) and order.dim() == 1:
        return int(order.shape[0])
    if sizes.device.type != "cpu" or sizes.dim() != 1:
        return None  # not as torch makes it: not read
    return int(sizes[0]) if sizes.numel() else 0


def new_batch_size(tracker, args: tuple, kwargs: dict) -> bool:
    """At a training forward of the model: whether its batch (:func:`batch_of` its first
    argument that has one) is larger than any seen before, or smaller than any of at
    least two examples seen before, which re-arms the probe (module docstring)."""
    b = next((n for n in map(batch_of, (*args, *kwargs.values())) if n is not None), None)
    if b is None:
        return False
    larger = b > getattr(tracker, "_largest_batch", 0)
    if larger:
        tracker._largest_batch = b
    smallest = getattr(tracker, "_smallest_batch", None)
    smaller = b >= 2 and (smallest is None or b < smallest)
    if smaller:
        tracker._smallest_batch = b
    return larger or (smaller and smallest is not None)
