"""The probe's check of the buffers a training forward pass writes.

A buffer the forward pass writes from the batch (a running mean, a quantization
observer's running minimum and maximum, a per-feature running maximum) is a function of
the training examples kept in the model, and released with its ``state_dict``, with no
noise: per-example clipping bounds the gradient's sensitivity, not the buffer's. The
probe (:mod:`privlearn.torch.probe`) compares the buffers each of its passes writes
(:func:`judge`).

Replacing one example (the first, or the last) by another of the batch moves a running
extreme only when the replaced example held it: with a per-tensor observer over a batch
of ``B`` examples, a chance of about ``2 / B``, so the replacement passes alone let most
runs train with the batch's extremes in the observer's buffers. When the step's forward
wrote any buffer, :func:`check_rows_collapsed` runs two more passes: the batch with every
example replaced by its first, then by its last (a chain of replacements of one example
each). A buffer that is no function of the examples (a step counter, a power-iteration
vector computed from the weights) comes out the same in all three passes; one written
from the data comes out as the statistic of one repeated example, which differs from the
batch's unless that example alone held every extreme of it in both passes.

Under add/remove neighbours (Poisson sampling) the batch size is private as well: a
buffer that counts the examples (``n += x.shape[0]``, a running mean's count) releases
how often each example was drawn, and replacing examples keeps it. There, one more pass
runs on the batch less its last example (tracker attribute ``batch_size_private``, set by
``make_private``); under replace-one neighbours (fixed-size batches) the batch size is
public and such a count is no release.
"""

from __future__ import annotations

import torch

from privlearn.errors import BatchDependenceError
from privlearn.torch import _probe_exact, _probe_held

__all__ = ["check_rows_collapsed", "judge", "slots"]

_RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def slots(model) -> list[tuple[str, str]]:
    """``(qualified name, owner class)`` of the model's buffers, in the order the probe's
    passes save them (module by module, each module's own buffers)."""
    return [
        (f"{prefix}.{name}" if prefix else name, type(mod).__name__)
        for prefix, mod in model.named_modules()
        for name, b in mod._buffers.items()
        if b is not None
    ]


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Whether two writes of one buffer agree: bit for bit (``exact``), else within the
    rounding of the buffer's precision (floating), else equal."""
    if a.shape != b.shape:
        return False
    if exact:
        return _probe_exact.bitwise_equal(a, b)
    if a.is_floating_point() or a.is_complex():
        rtol = _RTOL.get(a.dtype, 1e-5)
        scale = float(torch.nan_to_num(a.abs(), posinf=0.0).amax()) if a.numel() else 0
        return torch.allclose(a, b, rtol=rtol, atol=rtol * scale, equal_nan=True)
    return torch.equal(a, b)


def judge(
    tracker, written_a: dict, written_b: dict, j: int, exact: bool = False, how: str | None = None
) -> None:
    """Refuse a buffer the forward pass writes from the batch's data: it came out
    differently between two passes (``written_*``: ``(slot index, qualified name, owner
    class)`` -> the value the pass wrote), the second with example ``j`` replaced
    (``how``: the change, said in the message). It would be a function of the training
    examples kept in the model (and in its ``state_dict``) without noise.

    Raises
    ------
    BatchDependenceError
        Naming the buffer and its module.
    """
    for key in sorted(set(written_a) | set(written_b)):
        a, b = written_a.get(key), written_b.get(key)
        if a is not None and b is not None and _same(a, b, exact):
            continue
        _, name, owner = key
        change = how or f"example {j} of the batch was replaced"
        raise BatchDependenceError(
            f"buffer {name!r} of a {owner} is written from the batch during the forward "
            f"pass: it came out differently when {change} (a running mean, a running "
            "minimum or maximum, or a count of what the batches hold, updated in training "
            "mode). Such a buffer is a function of the training examples without noise, "
            "kept in the model and released with its state_dict; per-example clipping "
            "does not cover it. Do not update it from the data during training (freeze it, "
            "put its module in eval mode, or compute the statistic per example without "
            "storing it: GroupNorm/LayerNorm instead of running statistics, "
            "track_running_stats=False). A data-dependent initialisation the first "
            "training forward runs (ActNorm, LSUV, a quantization observer's calibration) "
            "releases that private batch's statistic the same way: run it before "
            "make_private, in a forward pass in training mode on public data. No step was "
            "taken and nothing was released"
        )


def check_rows_collapsed(tracker, observe, leaves, batched, examples: int, base) -> None:
    """When the step's forward wrote a buffer (``base``: the probe's pass on the batch,
    whose third item holds what it wrote), run ``observe`` (one probe pass on given
    leaves and number of examples, returning the same triple) on the batch with every
    example replaced by the first, then by the last, and (batch size private) on the
    batch less its last example; refuse a buffer written differently (module
    docstring). A model that cannot run on such a batch shows nothing here."""
    if not base[2] or examples < 2:
        return
    if getattr(tracker, "batch_size_private", False):
        fewer = [t[: examples - 1] if i in batched else t for i, t in enumerate(leaves)]
        try:
            run = observe(fewer, examples - 1)
        except _probe_held.NOT_REFUSED:
            raise
        except Exception:  # noqa: BLE001 - the model needs all its rows: nothing to see
            run = None
        if run is not None:
            judge(
                tracker,
                base[2],
                run[2],
                examples - 1,
                how=f"the batch's last example (example {examples - 1}) was removed, which "
                "under Poisson sampling (add/remove neighbours) changes the batch size, "
                "private as well",
            )
    for j in (0, examples - 1):
        same = list(leaves)
        for i in batched:
            t = leaves[i]
            same[i] = t[j : j + 1].expand_as(t).clone()
        if all(torch.equal(same[i], leaves[i]) for i in batched):
            continue  # every example already equals this one: nothing to compare
        try:
            run = observe(same, examples)
        except _probe_held.NOT_REFUSED:  # out of memory: no answer about these inputs
            raise
        except Exception:  # noqa: BLE001 - the model needs distinct rows: nothing to see
            continue
        judge(
            tracker,
            base[2],
            run[2],
            j,
            how=f"every example of the batch was replaced by example {j}",
        )
