"""The batch-independence probe's runs with the integer inputs held (:mod:`privlearn.torch.probe`).

When the replaced example brings other integer inputs (token ids, lengths, masks), the
kernels' layout may follow them (a packed sequence sorted by its lengths: each time step's
product has other rows, and the other examples' rows round differently by an ulp), so
that replacement's moves are believed only beyond an ulp of the row's norm
(:func:`privlearn.torch._probe_exact.mode`, ``"tight"``). A model that mixes examples by
less than that passed (``h + 0.1 * h.flip(0)`` on token ids under bfloat16 autocast moved
the other rows by 0.6% of their norm, the bound there being 1.6%).

So whenever that bound was used, the probe runs the replacement again with every integer
input as it was, and compares the other rows bit for bit (the layout is then the one of
the unchanged batch: same inputs of every integer kind, same shapes, same kernels):

* the floating inputs of example ``j`` replaced by those of another example (when some
  differ), its integer inputs kept;
* the inputs unchanged, and row ``j`` of the first layer output that has one row per
  example (an embedding's, on the batch dimension the engine uses for that layer) replaced
  by another example's row of it: what the model computes from there is then the model's
  computation on another example ``j`` with the same integer inputs, so a mixing operation
  after that layer shows in bits although no floating input exists (token ids only).

Each is judged as the probe's other replacements (:func:`privlearn.torch._probe_exact.mode`:
bit for bit on a reproducible forward, the tolerance where a rerun differs). A run the
model refuses (a shape, type, value, index or assertion error: the combination is not one
it accepts, e.g. a check that the padding past each length is zero) leaves the case
unchecked: the one-ulp rule alone is known to pass a mix below it, so the probe refuses
the model (:class:`~privlearn.errors.BatchDependenceError`, naming
``check_batch_independence=False``) rather than pass it. Running out of memory, an
accelerator's error and an interrupt are no answer of the model's and propagate as they
are. What it cannot see: a mixing operation that moves the other rows by less
than an ulp of their norm *and* acts only on what the integer inputs give before the first
recorded layer (e.g. ``ids.float()`` mixed before any trainable layer).
"""

from __future__ import annotations

import torch

from privlearn.errors import BatchDependenceError
from privlearn.torch import _probe_exact

__all__ = ["NOT_REFUSED", "check", "planned", "replace_row"]

_MAX_SOURCES = 8  # examples tried as the donor of example j's rows
#: what a model raises on inputs it does not accept (shapes, types, values, checks)
_REFUSED = (RuntimeError, TypeError, ValueError, IndexError, AssertionError)
#: no answer of the model's about the inputs it was given: propagate from every probe run
NOT_REFUSED = (MemoryError, *(t for t in (getattr(torch, "OutOfMemoryError", None),
                                          getattr(torch, "AcceleratorError", None))
                              if t is not None))


def _floats_of_donor(leaves, batched, j: int):
    """Copies of the leaves with row ``j`` of every floating batched tensor replaced by
    row ``k`` of it, for the first ``k`` whose floating rows differ from row ``j``; the
    integer tensors unchanged (None when no floating input differs from example ``j``)."""
    floats = [i for i in batched if leaves[i].is_floating_point()]
    return replace_row(leaves, floats, j) if floats else None


def replace_row(leaves, batched, j: int):
    """Copies of the leaves with row ``j`` of every batched tensor replaced by row ``k``
    of the same tensor, for the first ``k`` whose rows differ from row ``j`` somewhere
    (None if no example differs from example ``j``): the probe's replacement of example
    ``j``, and with only the floating tensors given, :func:`_floats_of_donor`'s."""
    n = leaves[batched[0]].shape[0]
    for k in range(min(n, 1 + _MAX_SOURCES)):
        if k == j or all(torch.equal(leaves[i][j], leaves[i][k]) for i in batched):
            continue
        out = list(leaves)
        for i in batched:
            t = leaves[i].clone()
            t[j] = leaves[i][k]
            out[i] = t
        return out
    return None


def planned(leaves, perturbed, batched, j: int) -> int:
    """Upper bound of the passes :func:`check` runs for the replacement of example ``j``
    (``perturbed``: the leaves with it replaced): none unless an integer input changed."""
    if perturbed is None or all(
        leaves[i].is_floating_point() or torch.equal(leaves[i][j], perturbed[i][j]) for i in batched
    ):
        return 0
    return 1 + (_floats_of_donor(leaves, batched, j) is not None)


class _RowSwap:
    """Forward hooks on the units: the first output that has one row per example on its
    unit's batch dimension, and a row other than ``j`` that differs from row ``j``, gets
    row ``j`` replaced by that row (once per run)."""

    def __init__(self, tracker, examples: int, j: int):
        self.tracker, self.examples, self.j, self.done = tracker, examples, j, False

    def hook(self, unit):
        d = unit.batch_dim
        flat = getattr(self.tracker, "_flat_candidates", None) or {}
        skip = any(self.tracker.units[i] is unit for i in flat)

        def fn(module, args, output):
            if (
                self.done
                or skip
                or type(output) is not torch.Tensor
                or not output.is_floating_point()
                or output.dim() <= d
                or output.shape[d] != self.examples
            ):
                return None
            rows = output.movedim(d, 0)
            k = next(
                (
                    k
                    for k in range(min(self.examples, 1 + _MAX_SOURCES))
                    if k != self.j and not torch.equal(rows[k], rows[self.j])
                ),
                None,
            )
            if k is None:
                return None
            self.done = True
            out = output.clone()
            out.movedim(d, 0)[self.j] = rows[k]
            return out

        return fn


def check(tracker, observe, judge, leaves, batched, examples: int, j: int, base, again) -> None:
    """Run the replacement of example ``j`` with the integer inputs held (module
    docstring) and judge each run against ``base`` (the unchanged batch's run;
    ``again()``: its rerun). ``observe(leaves)`` runs the probe's pass on these leaves,
    ``judge(run, mode)`` is the probe's judgement of ``base`` against ``run``.

    Raises
    ------
    BatchDependenceError
        Another example's rows moved, or the model refuses a run with the integer inputs
        held (module docstring).
    """

    def judged(run) -> None:
        _probe_exact.mode(
            lambda m: judge(run, m),
            base,
            again,
            _probe_exact.reshaped(base, run),
        )

    donor = _floats_of_donor(leaves, batched, j)
    if donor is not None:
        judged(_run(observe, donor, j, "its floating inputs replaced by another example's"))
    swap = _RowSwap(tracker, examples, j)
    handles = [u.module.register_forward_hook(swap.hook(u), prepend=True) for u in tracker.units]
    try:
        run = _run(observe, leaves, j, "its row of the first layer output replaced by another "
                   "example's")
    finally:
        for h in handles:
            h.remove()
    if swap.done:
        judged(run)


def _run(observe, leaves, j: int, what: str):
    """``observe(leaves)``; a model's refusal of these inputs (:data:`_REFUSED`) refused in
    turn, naming the escape hatch (module docstring); out of memory and the like raised."""
    try:
        return observe(leaves)
    except NOT_REFUSED:
        raise
    except _REFUSED as e:
        if type(e).__module__.startswith("privlearn"):  # the probe's own verdict or refusal
            raise
        said = (str(e).strip().splitlines() or [""])[0][:200]
        err = BatchDependenceError(
            f"the model runs on this batch and on it with example {j} replaced, but fails on "
            f"the batch with example {j}'s integer inputs (lengths, ids, masks) kept and "
            f"{what}: {type(e).__name__}: {said}. privlearn needs that run to check that "
            "each example is processed on its own beyond what the integer inputs change in "
            "the kernels' layout (a mix of examples below an ulp of a row's norm would "
            "otherwise pass). Make the model accept that combination, or, if each example is "
            "processed on its own, pass check_batch_independence=False (the guide 'Trust "
            "model: who sees what'). No step was taken and nothing was released")
        err.unrunnable = True  # on a part of the batch: the probe tries the whole batch
        raise err from e
