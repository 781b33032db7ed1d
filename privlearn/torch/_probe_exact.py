"""Bit-exact row comparison for the batch-independence probe (:mod:`privlearn.torch.probe`).

A model that processes each example on its own computes every other example's rows from
the same inputs, the same parameters and the same shapes when one example is replaced, so
on a device whose kernels are deterministic those rows come out *bitwise* identical:
nothing about them has a reason to round differently. A tolerance of the tensor's
precision (about 4% of a row's norm in bfloat16) let real mixing through: ``h + 0.1 *
h.flip(0)`` or a softmax over the batch under bfloat16 autocast moved the other rows by
about 7% of their weighted sum and passed. So the probe first compares rows by an integer
digest of their bits (:func:`digest`): any other row whose bits changed is a move.

Such a move smaller than the tolerance is only believed once the forward pass is shown to
be reproducible: the probe runs the unchanged batch once more and every row of every
layer, the output and the buffers must come out bitwise as in the first run
(:func:`reproducible`). A device that runs nondeterministic kernels (atomic additions in
``index_add_``/``scatter_add_``, some cuDNN algorithms, split-K matrix products) fails that
check, and the probe then falls back to the tolerance for this model, as before. What a
GPU run must check: that the engine's model zoo under fp32, fp16 and bf16 autocast gives
bitwise identical other rows there too (no false refusals), and that the planted mixing
models are refused there. A valid per-example model refused on rounding alone can be
trained with ``check_batch_independence=False`` (the user then promises independence).
"""

from __future__ import annotations

import torch

__all__ = ["bitwise_equal", "digest", "reproducible"]

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict = {}


def _weights(n: int, device) -> torch.Tensor:
    """Odd int64 multipliers, one per entry of a row (a fixed pseudo-random sequence)."""
    key = (n, device)
    if key not in _WEIGHTS:
        idx = torch.arange(n, dtype=torch.int64)
        _WEIGHTS[key] = ((idx * 2654435761 + 97) % 1000003) * 2 + 1
    return _WEIGHTS[key].to(device)


def digest(x: torch.Tensor) -> torch.Tensor:
    """``(2, rows)`` int64 digests of the bits of each row of a 2-D floating tensor: the
    sum of the entries' bit patterns and a weighted sum of them (exact integer arithmetic,
    so equal rows give equal digests on any device and in any order of summation; two rows
    whose bits differ give different digests except by coincidence of two 64-bit sums).

    Parameters
    ----------
    x : torch.Tensor
        ``(rows, entries)``, any floating dtype.

    Returns
    -------
    torch.Tensor
        int64, shape ``(2, rows)``.
    """
    bits = x.view(_INT[x.element_size()]).to(torch.int64)
    w = _weights(x.shape[1], x.device)
    return torch.stack([bits.sum(1), (bits * w).sum(1)])


def _same_prints(pa: dict, pb: dict) -> bool:
    if pa["shape"] != pb["shape"] or pa["dims"].keys() != pb["dims"].keys():
        return False
    for d, fa in pa["dims"].items():
        fb = pb["dims"][d]
        a, b = (fa[1], fb[1]) if fa[0] == "exact" else (fa[4], fb[4])
        if a.shape != b.shape or not torch.equal(a, b):
            return False
    return True


def reproducible(run_a, run_b) -> bool:
    """Whether two probe runs on the same inputs (``(calls, root, written)`` of
    :func:`privlearn.torch.probe._observe_run`) saw bitwise the same rows everywhere: the
    same layers called, every fingerprinted row's digest, the output's and every buffer
    the forward wrote. One host read per compared tensor; the probe runs once."""
    calls_a, root_a, written_a = run_a
    calls_b, root_b, written_b = run_b
    if [i for i, _ in calls_a] != [i for i, _ in calls_b] or len(root_a) != len(root_b):
        return False
    for (_, views_a), (_, views_b) in zip(calls_a, calls_b, strict=True):
        if len(views_a) != len(views_b):
            return False
        if not all(_same_prints(pa, pb) for pa, pb in zip(views_a, views_b, strict=True)):
            return False
    if not all(_same_prints(pa, pb) for pa, pb in zip(root_a, root_b, strict=True)):
        return False
    if written_a.keys() != written_b.keys():
        return False
    return all(bitwise_equal(written_a[i], written_b[i]) for i in written_a)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (NaNs with the same payload are equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        a, b = (t.reshape(1, -1).view(_INT[t.element_size()]) for t in (a, b))
    return torch.equal(a, b)
