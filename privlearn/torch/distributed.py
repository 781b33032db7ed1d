"""Distributed helpers (``torch.distributed``; gloo on CPU, NCCL on GPUs).

Usage: initialise the process group, build the model (optionally wrapped in
``DistributedDataParallel``), an optimizer and an ordinary ``DataLoader`` whose
``batch_size`` is the *per-rank* batch size, and call
:func:`privlearn.torch.make_private` on every rank (same arguments, same initial
weights). The engine then

* samples each rank's shard (indices ``rank, rank + W, ...``) with Poisson rate
  ``q = W * batch_size / len(dataset)``: every example of the dataset is included
  independently with probability ``q``, so the global batch is exactly the
  single-process Poisson sample and is accounted as such (with ``sampling="fixed"``, all
  ranks draw the same global sample of ``W * batch_size`` indices from a shared seed and
  each keeps every W-th of it: one uniform fixed-size sample, accounted as such);
* clips per example on each rank, adds ``N(0, (sigma C)^2 / W)`` per rank and all-reduces
  the sums, so the global noise is ``N(0, (sigma C)^2)`` as in the single-process
  mechanism, normalised by the global expected batch size ``q N``;
* gives every rank the same gradient, so the replicas stay identical.

Wrapping in DDP is optional (the engine does its own all-reduce); with DDP,
``make_private`` switches DDP's gradient synchronisation off for the run
(``require_backward_grad_sync = False``, as inside ``model.no_sync()``; restored by
``detach()``), so there is one all-reduce per step, of the noisy clipped sums, and no
autograd weight gradients at all.
"""

from __future__ import annotations

import torch

from privlearn.torch.data import PoissonBatchSampler

__all__ = ["world_info", "all_reduce_sum", "unwrap", "rank_partition",
           "DistributedPoissonBatchSampler"]


def unwrap(model):
    """The module inside a ``DistributedDataParallel`` wrapper (recognised by its
    ``require_backward_grad_sync`` flag and ``module``), else ``model`` itself."""
    if hasattr(model, "require_backward_grad_sync") and hasattr(model, "module"):
        return model.module
    return model


def world_info(process_group=None) -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when torch.distributed is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def all_reduce_sum(tensors: list[torch.Tensor], process_group=None) -> list[torch.Tensor]:
    """Sum ``tensors`` over ranks with one flat all-reduce."""
    import torch.distributed as dist

    if not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
    out, k = [], 0
    for t in tensors:
        out.append(flat[k:k + t.numel()].view_as(t))
        k += t.numel()
    return out


def rank_partition(num_samples: int, rank: int, world_size: int) -> range:
    """The examples rank ``rank`` of ``world_size`` considers: ``rank, rank + W, ...``.
    The ranks' parts are disjoint and cover ``range(num_samples)``."""
    if not (isinstance(world_size, int) and world_size >= 1
            and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, world_size) and world_size an int "
                         f">= 1, got rank={rank!r}, world_size={world_size!r}")
    return range(rank, int(num_samples), world_size)


class DistributedPoissonBatchSampler(PoissonBatchSampler):
    """Rank ``rank``'s part of a Poisson sample of the whole dataset at rate ``q``.

    Each rank considers only its own part of the indices (``rank, rank + world_size,
    ...``) and
    includes each of them independently with probability ``q`` (its own key chain: the
    ranks' draws are independent). Every example is considered exactly once per step, by
    one rank, so the union of the ranks' batches includes every example of the dataset
    independently with probability ``q``: it *is* a Poisson sample of the dataset at rate
    ``q`` (Abadi et al. 2016, Sec. 3.1, the sampling the subsampled Gaussian accountant
    assumes), with expected size ``q N``. Same interface and state as
    :class:`~privlearn.torch.data.PoissonBatchSampler`.

    Parameters
    ----------
    num_samples : int
        Size of the whole dataset.
    sample_rate : float in (0, 1]
        q, the global rate (``world_size * batch_size / num_samples`` in
        :func:`~privlearn.torch.make_private`).
    rank, world_size : int
    steps, seed, secure
        As for :class:`~privlearn.torch.data.PoissonBatchSampler`; ``seed`` must differ
        between ranks (``make_private`` derives it from its ``seed`` and the rank).
    """

    def __init__(self, num_samples: int, sample_rate: float, rank: int, world_size: int,
                 steps: int | None = None, seed: int | None = None, secure: bool = False):
        part = rank_partition(num_samples, rank, world_size)
        self.rank, self.world_size = rank, world_size
        super().__init__(num_samples, sample_rate, steps=steps, seed=seed,
                         indices=None if world_size == 1 else part, secure=secure)

    def load_state_dict(self, state: dict) -> None:
        """As :meth:`PoissonBatchSampler.load_state_dict`; also accepts the state of a
        rank's ``PoissonBatchSampler`` over the same part (the same sampler, saved by
        earlier versions)."""
        if isinstance(state, dict) and state.get("kind") == "PoissonBatchSampler":
            state = {**state, "kind": type(self).__name__}
        super().load_state_dict(state)
