"""Layers that see each example's rows flattened into rows of their own (OPT's decoder
layers run their feed-forward block on ``hidden_states.reshape(-1, d)``; Swin's attention
on windows ``(B * windows, window tokens, C)``): the rows are regrouped into examples,
``(B * k, ...)`` viewed as ``(B, k, ...)``, only once the grouping is *verified*, never
guessed from the row count.

At the first step (and whenever the probe is re-armed) a unit whose records hold ``k * B``
rows for a batch of ``B`` examples (``k > 1`` whole) and whose rule treats rows one by one
(``nn.Linear``, transformers' ``Conv1D``, ``nn.Embedding``, ``nn.LayerNorm``) is a
*candidate*. The batch-independence probe (:mod:`privlearn.torch.probe`) then replaces
every example ``j`` of its sub-batch of ``m`` examples in turn (not only the first and the
last) and views the candidate's input and output as ``(m, rows / m, ...)``: each
replacement must move rows of group ``j`` only, the row count must be ``k`` per example
in every pass (rows that follow the batch), the same layers must run in every pass, and
each candidate must move at all. Rows in another order (``x.transpose(0, 1).reshape(-1,
d)``: position-major), several views of a batch concatenated (``torch.cat([x1, x2])``)
or tokens dispatched to experts (Mixtral's router: a data-dependent number of rows per
expert) fail one of these and are refused before anything is released. So are rows
picked by the data before the layer (``hidden[attention_mask.bool()]``, ``nonzero``:
:mod:`privlearn.torch._row_selection`): their count per example follows the batch's
values, not its shapes, so a batch whose examples all have ``k`` of them verifies
nothing about a later batch of the same shapes and as many rows in all.

Once verified, each call of such a unit hands its rules the ``(B, k, ...)`` view of its
input and output gradient (a reshape, no copy, no host read; :func:`group_rows`). The
verified shapes of the model's inputs (less the batch's size) are remembered: a forward
on inputs of other shapes (another sequence length) re-arms the probe (:func:`rearm`),
so every grouping in use has been checked at its shapes.
"""

from __future__ import annotations

import torch

from privlearn.errors import BatchDependenceError
from privlearn.torch._tracker_util import _mismatch_message, record_batch

__all__ = ["adopt", "candidates", "check_inputs", "group_rows", "rearm"]


def _groupable(unit) -> bool:
    """Whether the unit's rule treats the rows of its input one by one (the per-example
    gradient of a group of rows is the sum over them)."""
    from privlearn.torch.rules.embedding import embedding_rule
    from privlearn.torch.rules.linear import linear_rule
    from privlearn.torch.rules.norm import layernorm_rule
    from privlearn.torch.rules.transformers import conv1d_transposed_rule

    return (unit.rule.compute in (linear_rule, conv1d_transposed_rule, embedding_rule,
                                  layernorm_rule)
            and unit.normalised and unit.batch_dim == 0)


def candidates(tracker, examples: int | None, peek: bool = False) -> dict[int, set[int]]:
    """``{unit index: {rows per example}}`` of the step's records that hold a whole
    multiple ``k > 1`` of the ``examples`` rows (see the module docstring); a record with
    any other count is refused (:func:`~privlearn.torch._tracker_util._mismatch_message`;
    ``peek``: the candidates only, nothing refused nor kept).

    Raises
    ------
    BatchDependenceError
    """
    flat: dict[int, set[int]] = {}
    if not peek:
        tracker._flat_candidates, tracker._flat_moved = flat, set()
    if examples is None:
        return flat
    for i, recs in tracker.records.items():
        unit = tracker.units[i]
        for r in recs:
            n = record_batch(unit, r)
            if not r.has_grad() or n == examples:
                continue
            if examples > 0 and n > examples and n % examples == 0 and _groupable(unit) \
                    and _regroupable(r, n) and tracker._probe_enabled:
                flat.setdefault(i, set()).add(n // examples)
                continue
            if peek:
                continue
            tracker.clear()
            raise BatchDependenceError(_mismatch_message(unit, n, examples, r))
    return flat


def _regroupable(rec, n: int) -> bool:
    x = rec.args[0] if rec.args else None
    return (rec.early is None and isinstance(x, torch.Tensor) and x.dim() >= 1
            and len(rec.outputs_meta) == 1 and len(rec.outputs_meta[0][0]) >= 1
            and rec.outputs_meta[0][0][0] == n)


def _regroup(rec, b: int) -> None:
    """The record's input and output gradient viewed as ``(b, rows / b, ...)``."""
    x = rec.args[0]
    rec.args = (x.reshape(b, -1, *x.shape[1:]), *rec.args[1:])
    shape, dtype, device = rec.outputs_meta[0]
    rec.outputs_meta[0] = ((b, shape[0] // b, *shape[1:]), dtype, device)
    g = rec.grad_outputs[0]
    if g is not None:
        rec.grad_outputs[0] = g.reshape(b, -1, *g.shape[1:])


def check_inputs(tracker, flat: dict, examples: int, inputs) -> None:
    """Before the probe: candidates are refused (as rows that are not the examples) when
    no input of the model's forward has the batch's ``examples`` rows on its leading
    dimension (the batch itself was enlarged before the model: views concatenated), so
    the probe has no example to replace.

    Raises
    ------
    BatchDependenceError
    """
    if not flat or any(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == examples
                       for t in (*inputs[0], *inputs[1].values())):
        return
    i = next(iter(flat))
    unit = tracker.units[i]
    r = next(r for r in tracker.records[i] if r.has_grad())
    n = record_batch(unit, r)
    tracker.clear()
    raise BatchDependenceError(_mismatch_message(unit, n, examples, r))


def _shapes(args, kwargs) -> tuple:
    """The shapes of the model's tensor inputs less their leading (batch) dimension: the
    probe verifies a grouping on a sub-batch of its own, whatever the batch's size (a
    Poisson batch's size changes every step), so only the other sizes re-arm it."""
    return tuple(tuple(v.shape[1:]) for v in (*args, *kwargs.values())
                 if isinstance(v, torch.Tensor))


def adopt(tracker, flat: dict, examples: int | None, inputs, verified: bool) -> None:
    """After the probe: regroup the step's records of the candidate units (``flat``) and
    use the grouping from now on (``verified``: the probe checked it on ``inputs``). A
    batch of one example needs no check (its rows are all its own) if the model's input
    has that one row (:func:`check_inputs`: rows concatenated before the model, a second
    view or rows of another batch, are not its own); otherwise an unverified grouping is
    refused.

    Raises
    ------
    BatchDependenceError
    """
    if not flat:
        return
    if examples == 1 and inputs is not None:
        check_inputs(tracker, flat, examples, inputs)
    missed = [i for i in flat if i not in tracker._flat_moved]
    if (not verified or missed) and examples != 1:
        i = missed[0] if missed else next(iter(flat))
        unit = tracker.units[i]
        tracker.clear()
        raise BatchDependenceError(_unverified(unit, flat[i], verified))
    for i in flat:
        for r in tracker.records.get(i, ()):
            if r.has_grad() and record_batch(tracker.units[i], r) != examples:
                _regroup(r, examples)
    if examples == 1:
        return
    tracker._flat.update(flat)
    shapes = _shapes(inputs[0], inputs[1])
    tracker._flat_shapes.add(shapes)
    verified_ks = tracker.__dict__.setdefault("_flat_ks", {})
    for i, ks in flat.items():
        verified_ks.setdefault((shapes, id(tracker.units[i].module)), set()).update(ks)


def _unverified(unit, ks, probed: bool) -> str:
    why = ("its rows never moved when an example of the batch was replaced, so their "
           "grouping into examples could not be checked" if probed else
           "the batch-independence probe could not run on this step (no recorded "
           "forward of this batch, or every example the same), so the grouping of its "
           "rows into examples could not be checked")
    return (f"layer {unit.name!r} ({type(unit.module).__name__}) saw {sorted(ks)} rows per "
            f"example, flattened into rows of their own: {why}. No step was taken and "
            "nothing was released; train on a batch of distinct examples fed as "
            "p.data_loader yields it")


def rearm(tracker, args, kwargs) -> None:
    """At the model's forward: inputs of shapes the grouping was not verified at re-arm
    the probe (nothing to do while no unit's rows are grouped); the shapes are kept for
    :func:`group_rows`."""
    if not tracker._flat:
        return
    tracker._flat_now = _shapes(args, kwargs)
    if not tracker._probe_pending and tracker._flat_now not in tracker._flat_shapes:
        tracker._probe_pending = tracker._probe_enabled


def group_rows(tracker, index: int, hook):
    """The recording hook of unit ``index`` wrapped: once the unit's grouping is verified
    (and the probe not pending), a call on ``B * k`` rows is recorded as ``(B, k, ...)``
    (the hook sees, and registers its gradient hook on, that view of the output; the
    layer's caller gets it back in the layer's shape). Only for a ``k`` the probe verified
    at the shapes of this forward's inputs: other rows (a path taken by the data, ``h[mask]``
    on a batch with padding where the verified batch took ``h.reshape(-1, d)``) are recorded
    as they are, which the step refuses (rows that are not the examples)."""
    flat = tracker._flat
    verified = tracker.__dict__.setdefault("_flat_ks", {})  # (shapes, module id): ks

    def wrapped(module, args, kwargs, output):
        b = tracker._batch_hint
        if index not in flat or tracker._probe_pending or b < 1 or not args \
                or not module.training or not torch.is_grad_enabled() \
                or type(output) is not torch.Tensor or not isinstance(args[0], torch.Tensor):
            return hook(module, args, kwargs, output)
        n = output.shape[0] if output.dim() else 0
        ks = verified.get((getattr(tracker, "_flat_now", None), id(module)), ())
        if n == b or n % b or args[0].dim() < 1 or args[0].shape[0] != n or n // b not in ks:
            return hook(module, args, kwargs, output)
        x = args[0]
        view = output.reshape(b, n // b, *output.shape[1:])
        got = hook(module, (x.reshape(b, n // b, *x.shape[1:]), *args[1:]), kwargs, view)
        return (view if got is None else got).reshape(output.shape)

    return wrapped


# ------------------------------------------------------------------ probe side


def views(args, output, examples: int, ks: set[int]) -> list:
    """What the probe fingerprints of a candidate's call on a sub-batch of ``examples``:
    its first input and its output viewed as ``(examples, rows / examples, ...)``, or
    (rows that are not ``k`` per example) the raw tensors, marked so."""
    out = []
    for t, label in ((args[0] if args else None, "input"), (output, "output")):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            continue
        n = t.shape[0]
        if n % examples == 0 and n // examples in ks:
            out.append((t.reshape(examples, n // examples, *t.shape[1:]), 0, label, True))
        else:
            out.append((t, 0, label, False))
    return out


def judge(tracker, unit_index: int, pa, pb, verdict, j: int, examples: int) -> None:
    """Refuse what the probe's two runs show of a candidate's view (module docstring);
    note the candidate as moved when replacing example ``j`` moved its group ``j``
    only."""
    unit = tracker.units[unit_index]
    ks = tracker._flat_candidates[unit_index]
    if pa.get("selected") or pb.get("selected"):
        raise BatchDependenceError(_ungrouped(
            unit, ks, "its input's rows were picked by the data (a boolean mask such as "
            "hidden[attention_mask.bool()], torch.nonzero, masked_select, unique or "
            "repeat_interleave before it): how many rows each example has, and so where "
            "one example's rows end, follows the values of the batch, not its shapes, and "
            "a later batch with as many rows in all could split them otherwise. Keep the "
            "padded (B, T, ...) layout and mask the padding's outputs or loss instead"))
    if not pa["grouped"] or not pb["grouped"] or pa["shape"] != pb["shape"]:
        raise BatchDependenceError(_ungrouped(
            unit, ks, f"its {pa['label']} has {pa['shape'][0]} rows with a batch of "
            f"{examples} examples (shape {pa['shape']}), and {pb['shape'][0]} "
            f"when example {j} was replaced: its rows do not follow the examples"))
    if verdict == "ok":
        tracker._flat_moved.add(unit_index)
    elif verdict != "same":
        raise BatchDependenceError(_ungrouped(
            unit, ks, f"replacing example {j} of the batch changed rows of its "
            f"{pa['label']} outside the {pa['shape'][1]} rows of example {j} (viewed as "
            f"{pa['shape']}, example by example)"))


def calls_differ(tracker) -> None:
    """Refuse candidates when the probe's runs called other layers (data-dependent
    control flow: their rows cannot be compared)."""
    if tracker._flat_candidates:
        i = next(iter(tracker._flat_candidates))
        raise BatchDependenceError(_ungrouped(
            tracker.units[i], tracker._flat_candidates[i],
            "replacing an example changed which layers ran (tokens routed by the data)"))


def _ungrouped(unit, ks, why: str) -> str:
    k = sorted(ks)
    return (
        f"layer {unit.name!r} ({type(unit.module).__name__}) saw {k[0]} rows per example "
        f"(each example's tokens or windows flattened into rows of their own), but they are "
        f"not grouped example by example: {why}. Each row would be clipped with the wrong "
        "example, so one example could move the update by more than max_grad_norm. Rows "
        "are regrouped only when each example's rows are contiguous, in the batch's order "
        "(x.reshape(-1, d) of a batch-first tensor: OPT's decoder layers, Swin's windows); "
        "not rows in another order (x.transpose(0, 1).reshape(-1, d)), several views of "
        "a batch concatenated into one (average or sum the views per example before the "
        "loss), nor tokens dispatched to experts by a router (mixture-of-experts models "
        "such as Mixtral: use a dense model, e.g. Mistral, Llama, Qwen2). No step was "
        "taken and nothing was released")
