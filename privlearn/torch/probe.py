"""The batch-independence probe: per-example clipping is only private if each example's
outputs depend on that example alone, and if the engine reads every layer's examples on
the right dimension. Both are checked, not assumed.

Before the first step, and again at the first step after any change that could make the
model mix examples (the trainable set; any module's ``training`` flag, e.g. a module
computing ``F.batch_norm(..., training=self.training)`` put back in training mode by
``model.eval(); model.train()``; the module tree; forward hooks or pre-hooks added or
removed: :func:`privlearn.torch._tracker_util.mixing_fingerprint`, Python attributes only, read
at every forward; a forward called with a signature not seen before, other keywords or
flags: :func:`privlearn.torch._tracker_util._call_signature`; a module attribute given a
flag's value not seen before, ``model.mix = True``, or a new 0-d tensor argument:
:mod:`privlearn.torch._rearm`), the forward pass that
produced the step is run three more times without gradients (each forward of the batch
on other inputs too, when the step calls the model more than once: a second view, other
keywords), on the first few examples of the batch: once on their own inputs and once
with example ``j`` replaced by another example ``k`` of the batch, for ``j`` the first
and then the last example (an operation accumulating over the batch in either direction
reaches the others from one of them; every input tensor whose leading dimension is the
batch; same random state for all runs, so dropout masks agree; each run starts from the
buffers and, in a model with buffers, the plain attributes as they were before the
step's forward, restored afterwards). For every recorded layer, the rows its inputs and
outputs hold along each dimension of the batch's size are compared between the two runs
(and so are the buffers the runs write, also with every example replaced by one when the
forward wrote any: :mod:`._probe_buffers`; with gradients on, when the step's forward
wrote one none of these passes wrote: :mod:`._probe_grad_buffers`; a buffer the probe
never judged written at a later step re-runs it, one none of its passes writes is
refused: :mod:`._late_writes`):

* the rows that changed are exactly row ``j`` along the dimension the engine uses for
  that layer: the layer is fine;
* they are exactly row ``j`` along *another* dimension: the layer receives the batch
  there (sequence-first activations: ``nn.TransformerEncoderLayer`` with
  ``batch_first=False``, an LSTM's time-major output feeding a Linear). Refused, naming
  the ``batch_dims`` entry that declares it -- a layer whose rows the engine read as
  examples would be clipped per *position*;
* other rows changed: an operation mixes examples (``x - x.mean(0)``, ``F.batch_norm``,
  a batch-wide softmax...), so one example moves every example's gradient and no clipping
  bounds its influence. Refused, naming the first layer where it shows;
* the layer's tensors have no dimension of the batch's size: the batch is packed or
  flattened (``DataCollatorWithFlattening``), refused (the step's check of the number of
  rows per layer says so first);
* no row moved in either run although the layer has as many rows as examples: one more
  pass, on one example fewer, checks that its rows follow the batch; a layer whose input
  has no batch dimension (``emb(torch.arange(T))`` with a batch of exactly ``T``) is
  refused, since each of its rows sums every example's gradient.

The comparison uses per-row fingerprints (the norm and a fixed weighted sum of each row,
accumulated in float32, and an integer digest of the row's bits), so the probe stores a
few numbers per row, not the activations. Rows are compared bit for bit: a per-example
model's other rows do not move at all when one example is replaced (same inputs,
parameters, shapes and kernels). A move within the rounding tolerance of the tensor's
precision is checked by one more pass on the unchanged batch, only then: if that pass is
not bitwise reproducible (nondeterministic kernels) the tolerance judges, as before; if it
is, the move is refused, or, when an integer input changed with the example (a packed
sequence's lengths: the kernels' layout and the rounding of the other rows follow them),
refused beyond an ulp of the largest row's norm (:mod:`._probe_exact`), and then
run again with the integer inputs held, bit for bit (:mod:`._probe_held`). It runs
on the whole batch when the batch is at least as large as, or smaller than, any probed whole
before (the first probe, and a batch larger or smaller than any seen, which re-arms it: a
path that mixes examples only from or below some batch size,
:mod:`privlearn.torch._probe_size`), otherwise on
the first seven examples of the batch (five or three if seven is the size of another
input dimension, the whole batch if the model cannot run on part of it): three forward
passes without gradients (see docs/benchmarks.md); one pass more per example of
the sub-batch when a layer's rows are to be grouped per example (every example is then
replaced in turn, :mod:`privlearn.torch._flat_rows`). What it cannot see: a loss that
mixes examples after the model's output (a contrastive loss over the batch) -- the user
promises that the loss is a sum or mean of per-example terms (docs/trust-model.md).

The same check covers what produced the inputs: :func:`probe_augment` runs the loader's
``augment=`` on the step's batch and on the batch with one example replaced, under the
same random state, and refuses a transform that changes any other row (a batch-level
MixUp/CutMix). Inputs with a NaN or inf are refused first, naming the input and the row
(:class:`~privlearn.errors.NonFiniteInputError`): a NaN row differs from itself and would
otherwise read as mixing.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from privlearn.errors import BatchDependenceError, NonFiniteInputError
from privlearn.torch import (
    _flat_rows,
    _late_writes,
    _probe_exact,
    _probe_grad_buffers,
    _probe_held,
    _probe_note,
    _probe_size,
)
from privlearn.torch._probe_buffers import check_rows_collapsed
from privlearn.torch._probe_buffers import judge as _judge_buffers
from privlearn.torch._row_selection import SelectionTaint
from privlearn.torch.fallback import FALLBACK, argument_views, settled_shared, shared_argument_error
from privlearn.torch.grad_sample import rule_evaluation

__all__ = ["BatchDependenceError", "NonFiniteInputError", "check_finite_inputs",
           "pad_passes", "planned_passes", "probe", "probe_augment"]


_RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3,
         torch.bfloat16: 2e-2}
# how many examples the probe runs on: a prime, since hidden sizes, heads and sequence
# lengths are mostly powers of two and their multiples (a dimension of the batch's size
# is compared row by row too), then the next candidates
_SUB_BATCHES = (7, 5, 3)


def probe(tracker, inputs, examples: int) -> None:
    """Check batch independence and every unit's batch dimension (module docstring).

    Parameters
    ----------
    tracker : GradSampleTracker
    inputs : tuple
        ``(args, kwargs, autocast state)`` of the model's forward in this step.
    examples : int
        Examples in the batch (>= 2).

    Raises
    ------
    BatchDependenceError
        See the module docstring.
    """
    args, kwargs, autocast = inputs
    check_finite_inputs(args, kwargs, examples)
    leaves, spec = tree_flatten((args, kwargs))
    batched = [i for i, t in enumerate(leaves)
               if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == examples]
    if not batched:
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        inner = next(((i, d, tuple(t.shape)) for i, t in enumerate(tensors)
                      for d in range(1, t.dim()) if t.shape[d] == examples), None)
        where = "" if inner is None else (
            f" The batch is on dimension {inner[1]} of input {inner[0]} (shape {inner[2]}): "
            "a sequence-first batch, e.g. from a collate_fn that transposes it. Make the "
            "loader yield batch-first tensors and transpose inside the model's forward "
            "(batch_dims then names the layers that see sequence-first activations).")
        raise BatchDependenceError(
            f"none of the model's inputs has the batch of {examples} examples on its leading "
            f"dimension (shapes: {[tuple(t.shape) for t in tensors]}), so privlearn cannot "
            "check that each example is processed on its own." + where + " Pass the batch "
            "as p.data_loader yields it (one row per example; a packed or flattened batch "
            "would be clipped as one example)")
    m, grouped = _sub_batch(leaves, batched, examples), None
    whole = _probe_size.due(tracker, examples)  # sizes checked whole
    if m < examples and (_probe_size.grouping(tracker) or not whole):  # groupings on m rows
        sub = list(leaves)
        for i in batched:
            sub[i] = leaves[i][:m]
        try:
            if _probe_rows(tracker, sub, batched, spec, autocast, m):  # then, if whole,
                grouped = False  # the whole batch with its first and last example replaced
            if grouped is False and not whole:
                return
        except BatchDependenceError as e:
            if not getattr(e, "unrunnable", False):  # failed on a part: try the whole
                raise
        except Exception:  # noqa: BLE001 - the model needs the whole batch: probe that
            pass
    if _probe_rows(tracker, leaves, batched, spec, autocast, examples, grouped):
        _probe_size.probed(tracker, examples)


def planned_passes(inputs, examples: int, every: bool = False, whole: bool = False) -> int:
    """How many forward passes :func:`probe` will run on these inputs, at most (without
    running any): it depends on the data (a batch whose rows all equal the probed row has
    nothing to compare; a rerun of the batch, or a pass on one example fewer when some
    layer's rows did not move, only when the rows call for it), so under FSDP2, whose
    every forward pass is a collective, the ranks agree on the largest count and
    :func:`pad_passes` makes up the difference. A probe that
    refuses the inputs (non-finite values, no batch dimension) counts as none. ``every``:
    every example is replaced in turn (layers whose rows are grouped per example,
    :mod:`privlearn.torch._flat_rows`); ``whole``: the probe runs on the whole batch
    (:func:`privlearn.torch._probe_size.due`)."""
    args, kwargs, _ = inputs
    leaves, _ = tree_flatten((args, kwargs))
    batched = [i for i, t in enumerate(leaves)
               if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == examples]
    if not batched:
        return 0
    m = _sub_batch(leaves, batched, examples)
    done = 0
    if m < examples and (every or not whole):  # as probe() runs them; then the whole
        sub = list(leaves)  # batch as if every example were replaced (the part may not
        for i in batched:  # run: the model needs the whole batch), an upper bound
            sub[i] = leaves[i][:m]
        n, complete = _planned_rows(sub, batched, m, every)
        if complete and not whole:
            return n
        done = n
    return done + _planned_rows(leaves, batched, examples, every)[0]


def _replaced(examples: int, every: bool):
    """The examples the probe replaces in turn: the first and the last, or (rows
    grouped per example to verify) every one."""
    return range(examples) if every else (0, examples - 1)


def _planned_rows(leaves, batched, examples: int, every: bool = False) -> tuple[int, bool]:
    """``(passes, completed)`` of :func:`_probe_rows` on these rows, at most."""
    n = 0
    for j in _replaced(examples, every):
        perturbed = _probe_held.replace_row(leaves, batched, j)
        if perturbed is None:
            return n, False
        n += 3 if n == 0 else 1  # base, replaced, and a rerun of the base if needed
        n += _probe_held.planned(leaves, perturbed, batched, j)  # integer inputs held
    # and one on a row fewer if a layer's rows did not move; if a buffer was written, two
    return n + 4, True  # with the rows collapsed to the first and the last, one on a row fewer


def pad_passes(tracker, inputs, examples: int, count: int) -> None:
    """``count`` more forward passes of the probe's kind on the step's own inputs (or
    the rank's last training forward's), nothing observed: under FSDP2 every rank must
    run as many passes as the rank whose probe runs the most (:func:`planned_passes`)."""
    args, kwargs, autocast = inputs
    for _ in range(count):
        _observe_run(tracker, args, kwargs, autocast, examples, collect=False)


def _sub_batch(leaves, batched, examples: int) -> int:
    """How many of the batch's examples the probe runs on once a batch at least as large
    was probed whole (:func:`privlearn.torch._probe_size.due`): seven (a mixing
    operation of that batch size shows among a few examples as among all, at a fraction
    of the cost), or five or three if seven is the size of another dimension of the
    inputs, so that no sequence or feature dimension is mistaken for the batch."""
    if examples <= _SUB_BATCHES[0]:
        return examples
    other = {s for t in leaves if isinstance(t, torch.Tensor) for s in t.shape[1:]}
    other |= {t.shape[0] for i, t in enumerate(leaves)
              if isinstance(t, torch.Tensor) and t.dim() and i not in batched}
    for m in _SUB_BATCHES:
        if m not in other:
            return m
    return examples


def _probe_rows(tracker, leaves, batched, spec, autocast, examples: int, every=None) -> bool:
    """Run the two passes on these rows and judge them; False if every example equals
    the first (nothing can tell them apart). ``every`` False: first and last replaced."""
    # the first and the last row: an operation accumulating over the batch either way
    # (a mean over the others, a cumsum, the last row added to all) reaches the others
    base, unmoved, mode, rerun = None, None, "bits", []
    every = _probe_size.grouping(tracker) if every is None else every
    # every run on fresh copies, as the replaced rows are: a kernel's rounding can follow
    # the address (a chunk of a logical batch is a view at an offset of it)
    leaves = [t.clone() if i in batched else t for i, t in enumerate(leaves)]
    tracker._probe_touched = set()  # the buffers these passes write
    for j in _replaced(examples, every):
        perturbed = _probe_held.replace_row(leaves, batched, j)
        if perturbed is None:
            return False
        if base is None:
            base = _observe_run(tracker, *tree_unflatten(leaves, spec), autocast, examples)
        try:
            run = _observe_run(tracker, *tree_unflatten(perturbed, spec), autocast, examples)
        except _probe_held.NOT_REFUSED:  # out of memory: no answer about these inputs
            raise
        except Exception as e:  # noqa: BLE001 - ran on the batch, not on this one
            raise _unrunnable(leaves, batched, e) from e
        if mode != "tolerance":  # until a rerun showed the forward is not reproducible

            def again():
                if not rerun:
                    rerun.append(_observe_run(tracker, *tree_unflatten(leaves, spec),
                                              autocast, examples))
                return rerun[0]

            # integer inputs (lengths, masks, ids) that changed with the example may
            # change the layout the kernels see (a packed sequence's time steps)
            ints = any(not leaves[i].is_floating_point()
                       and not torch.equal(leaves[i][j], perturbed[i][j]) for i in batched)
            mode = _probe_exact.mode(
                lambda m, b=base, r=run, j=j: _judge(tracker, b, r, examples, j, m),
                base, again, ints or _probe_exact.reshaped(base, run))
            if mode == "tight" and ints:  # then with the integer inputs held, bit for bit
                _probe_held.check(tracker, lambda lv: _observe_run(
                    tracker, *tree_unflatten(lv, spec), autocast, examples),
                    lambda r, m, b=base, j=j: _judge(tracker, b, r, examples, j, m),
                    leaves, batched, examples, j, base, again)
        same = _judge(tracker, base, run, examples, j, mode)
        unmoved = same if unmoved is None else unmoved & same
    check_rows_collapsed(tracker, lambda lv, n: _observe_run(  # buffers the data wrote
        tracker, *tree_unflatten(lv, spec), autocast, n), leaves, batched, examples, base)
    _probe_grad_buffers.check(tracker, lambda lv, n: _observe_run(  # written with gradients
        tracker, *tree_unflatten(lv, spec), autocast, n, grad=True), leaves, batched, examples)
    if unmoved:
        _check_rows_follow(tracker, leaves, batched, spec, autocast, examples, base, unmoved)
    return True


def _check_rows_follow(tracker, leaves, batched, spec, autocast, examples: int, base,
                       unmoved: set) -> None:
    """Refuse a layer whose rows on its batch dimension are as many as the examples but
    do not follow them: its input has no batch dimension (``nn.Embedding`` of
    ``torch.arange(T)``, a Linear of a parameter or a constant table) and ``T`` happens to
    equal the batch size. The step's check of the rows per layer refuses it whenever the
    sizes differ, but when they agree its rows were clipped as examples although each is
    the sum over the whole batch, so one example moved all of them. Run only for the calls
    in which no row moved when an example was replaced (``unmoved``: call and view
    positions): one more forward pass, on one example fewer."""
    sub = list(leaves)
    for i in batched:
        sub[i] = leaves[i][:examples - 1]
    try:
        calls, _, _ = _observe_run(tracker, *tree_unflatten(sub, spec), autocast,
                                   examples - 1)
    except Exception:  # noqa: BLE001 - the model cannot run on fewer rows: nothing to see
        return
    if [i for i, _ in calls] != [i for i, _ in base[0]]:
        return  # data-dependent control flow: not comparable call by call
    for c, v in sorted(unmoved):
        pa, pb = base[0][c][1][v], calls[c][1][v]
        if pb["shape"][pa["declared"]] != examples:
            continue
        unit = tracker.units[base[0][c][0]]
        if pa["label"].startswith(("argument", "output ")):
            if settled_shared(unit.module, pa["label"], pa["shape"], pa["declared"]):
                continue  # the rule keeps it whole (privlearn.torch._argument_roles)
            raise shared_argument_error(f"{unit.name or '<model>'} ({type(unit.module).__name__})",
                                        pa["label"], pa["shape"], pa["declared"], examples)
        raise BatchDependenceError(
            f"layer {unit.name or '<model>'} ({type(unit.module).__name__}) does not receive "
            f"the batch: its {pa['label']} has {examples} rows on dimension {pa['declared']} "
            f"with a batch of {examples} examples and with one of {examples - 1} (shape "
            f"{pa['shape']}). Its input has no batch dimension (e.g. an embedding of "
            "torch.arange(T), a layer applied to a parameter or a constant table), so each "
            "row of its gradient sums every example's and cannot be clipped per example. "
            "Give the input a leading batch dimension of 1 (pos[None]: the engine expands "
            "it to one row per example) or move the layer's output into the model's "
            "computation on the batch. No step was taken and nothing was released")


def _unrunnable(leaves, batched, error: Exception) -> BatchDependenceError:
    """The error of a model that runs on the batch but not on the batch with one example's
    rows replaced by another's: the inputs of the batch's size are not one row per
    example (EmbeddingBag's 1-D ids with ``offsets``: its offsets are positions in the
    flattened ids), so the probe cannot check them."""
    shapes = [tuple(leaves[i].shape) for i in batched]
    said = (str(error).strip().splitlines() or [""])[0][:200]
    err = BatchDependenceError(
        "the model runs on this batch but fails on the same batch with one example's rows "
        f"replaced by another's in the inputs of the batch's size (shapes {shapes}): "
        f"{type(error).__name__}: {said}. Those inputs are then not "
        "one row per example (e.g. nn.EmbeddingBag's 1-D ids with offsets, whose rows are "
        "positions in a flattened batch), so privlearn cannot check that each example is "
        "processed on its own. Pass one row per example (nn.EmbeddingBag: 2-D ids padded "
        "with padding_idx), or, if each example is processed on its own, "
        "check_batch_independence=False (the guide 'Trust model: who sees what'). No step "
        "was taken and nothing was released")
    err.unrunnable = True
    return err


class _Collector:
    """Forward hooks recording fingerprints of what each unit saw and produced."""

    def __init__(self, tracker, examples: int):
        self.tracker = tracker
        self.examples = examples
        self.calls: list[tuple[int, list]] = []  # (unit index, fingerprints), in order
        self._weights: dict = {}
        self.taint = None  # the pass's SelectionTaint, while rows may be regrouped

    def hook(self, index: int):
        unit = self.tracker.units[index]

        flat = getattr(self.tracker, "_flat_candidates", None) or {}

        def fn(module, args, kwargs, output):
            if index in flat:  # rows flattened per example: viewed example by example
                selected = self.taint is not None and bool(args) and self.taint.tainted(args[0])
                self.calls.append((index, [dict(self._print(*v[:3]), grouped=v[3],
                                                selected=selected) for v in
                                           _flat_rows.views(args, output, self.examples,
                                                            flat[index])]))
                return None
            views = (unit.rule.observe(module, args, kwargs, output)
                     if unit.rule.observe is not None
                     else _default_views(args, kwargs, output, unit.batch_dim))
            if unit.rule is FALLBACK:  # it splits every argument of the batch's size
                views = [*views, *argument_views(args, kwargs, output, unit.batch_dim)]
            self.calls.append((index, [self._print(*v) for v in views]))
            return None

        return fn

    def _print(self, t: torch.Tensor, declared: int, label: str = "output"):
        """Per-row fingerprints of ``t`` along each dimension of the batch's size."""
        dims = {}
        for d in range(t.dim()):
            if t.shape[d] != self.examples:
                continue
            x = t.movedim(d, 0).reshape(self.examples, -1)
            if not x.is_floating_point():
                dims[d] = ("exact", x.clone())
                continue
            f32 = torch.float32 if x.dtype != torch.float64 else torch.float64
            w = self._weight(x.shape[1], f32, x.device)
            norm = torch.linalg.vector_norm(x, dim=1, dtype=f32)  # also the scale
            # "tight": an ulp of the row's dtype, or a few of the fingerprints' own
            tight = max(torch.finfo(x.dtype).eps, 4 * torch.finfo(f32).eps)
            dims[d] = ("float", torch.stack([norm, x.to(f32) @ w]), norm,
                       _RTOL.get(t.dtype, 1e-5), _probe_exact.digest(x), tight)
        return {"declared": declared, "shape": tuple(t.shape), "dims": dims, "label": label}

    def _weight(self, n: int, dtype, device) -> torch.Tensor:
        key = (n, dtype, device)
        if key not in self._weights:
            idx = torch.arange(n, dtype=torch.float64)
            self._weights[key] = torch.cos(idx * 0.7071067811865476 + 0.3).to(device=device,
                                                                              dtype=dtype)
        return self._weights[key]


def _default_views(args, kwargs, output, dim: int) -> list:
    """The layer's first floating output: a mixing operation before the layer shows in
    it as well as in the input, and the output is what the next layers read."""
    views = []
    flat, _ = tree_flatten(output)
    for o in flat:
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() > dim:
            views.append((o, dim, "output"))
            break
    return views


def _observe_run(tracker, args, kwargs, autocast, examples: int, collect: bool = True,
                 grad: bool = False):
    """One forward pass without gradients, same random state as the other run, from the
    buffers as the tracker kept them before the step's forward (a running maximum that
    forward already moved would otherwise read as constant), restored afterwards; returns
    the units' fingerprints, the output's and the buffers the pass wrote (``collect``
    False: the pass alone, FSDP2's padding, which returns nothing). ``grad``: with
    gradients on, unrecorded, for the buffers alone (:mod:`._probe_grad_buffers`; no
    fingerprints, the output and its graph dropped at once)."""
    model = getattr(tracker.model, "_orig_mod", tracker.model)  # torch.compile's: run eagerly
    tracker.probe_passes = getattr(tracker, "probe_passes", 0) + 1  # FSDP2 pads to the most
    col = _Collector(tracker, examples)
    handles = [u.module.register_forward_hook(col.hook(i), with_kwargs=True)
               for i, u in enumerate(tracker.units)] if collect and not grad else []
    # by slot (an empty one too): a forward may assign a new tensor to a buffer's name as
    # well as update it, or fill an empty slot
    saved = [(f"{p}.{name}" if p else name, type(mod).__name__, mod, name, b,
              None if b is None else b.detach().clone())
             for p, mod in model.named_modules() for name, b in mod._buffers.items()]
    graphs = {id(b) for *_, b, _ in saved if grad and b is not None and b.grad_fn is not None}
    # each run starts from the buffers (and the plain attributes the forward sets) as they
    # were before the step's forward, when the tracker kept them (:mod:`._late_writes`): a
    # buffer that forward already moved to where the probe's rows cannot move it (a
    # running maximum) would read as constant, one it filled once (a flag set) as unwritten
    before, attrs = getattr(tracker, "_probe_buffers", None) or ({}, [])
    start = [before.get((id(mod), name), v) for *_, mod, name, _, v in saved]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    written, held = {}, []
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
            if grad:  # the engine's hooks record nothing, parameters are not swapped
                stack.enter_context(rule_evaluation())
            stack.enter_context(tracker.forward_batch_size(examples))  # broadcast inputs
            if handles and getattr(tracker, "_flat_candidates", None):
                col.taint = stack.enter_context(SelectionTaint())  # rows picked by value
            for dev, dtype in autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
            # the attributes the forward set (a flag or counter gating a buffer's write):
            # a model without buffers keeps them as its passes leave them
            held = _late_writes.restore(attrs if saved else ())
            _late_writes.start_pass(saved, start)
            noted = _probe_grad_buffers.versions(model)  # which buffers the pass writes
            torch.manual_seed(0x5EED)
            try:
                out = model(*args, **kwargs)
            except Exception as e:
                _probe_note.note_forward_error(e)
                raise
            _probe_grad_buffers.note_written(tracker, noted)
            if grad:
                out = None  # its graph freed now
        if not collect:
            return None
        flat, _ = tree_flatten(out)
        outs = [o for o in flat if isinstance(o, torch.Tensor) and o.is_floating_point()]
        root = [col._print(o, 0) for o in outs[:1]]
        for i, ((name, owner, mod, slot, _, _), v) in enumerate(zip(saved, start, strict=True)):
            now = mod._buffers.get(slot)  # the buffers the forward wrote
            if now is not None and (v is None or not (now.shape == v.shape
                                                      and torch.equal(now, v))):
                written[i, name, owner] = now.detach().clone()
    finally:
        for h in handles:
            h.remove()
        _late_writes.restore(held[::-1])
        _late_writes.put_back(saved, graphs if grad else None)
    return col.calls, root, written


def _changed(fa, fb, mode: str = "tolerance") -> set[int] | None:
    """Rows that differ between two fingerprints of one dimension (None: not
    comparable): ``mode`` ``"bits"``: any row whose bits changed (:mod:`._probe_exact`);
    ``"tight"``: by an ulp of the largest row's norm (``tight_scale``); ``"tolerance"``: beyond the
    rounding of a row of its norm."""
    if fa[0] != fb[0]:
        return None
    if fa[0] == "exact":
        a, b = fa[1], fb[1]
        if a.shape != b.shape:
            return None
        return set((a != b).any(1).nonzero().flatten().tolist())
    _, sa, ca, rtol, da, tight = fa
    _, sb, cb, _, db, _ = fb
    if sa.shape != sb.shape:
        return None
    if mode == "bits":
        return set((da != db).any(0).nonzero().flatten().tolist())
    if mode == "tight":
        rows = ((sa - sb).abs() > tight * _probe_exact.tight_scale(ca, cb)).any(0) | (
            da != db).any(0) & (~torch.isfinite(sa) | ~torch.isfinite(sb)).any(0)
        return set(rows.nonzero().flatten().tolist())
    # a row changed when its norm or its weighted sum moved by more than the rounding of a
    # row of that norm: both computations round like a sum of the row's entries, whose
    # error grows like eps * ||row||_2 (a few times that for the weighted sum)
    diff = (sa - sb).abs()
    scale = (ca + cb) * torch.tensor([1.0, 4.0], dtype=ca.dtype, device=ca.device)[:, None]
    bad = ~torch.isfinite(sa) | ~torch.isfinite(sb)
    same = (sa == sb) | (torch.isnan(sa) & torch.isnan(sb))  # a NaN row in both runs
    rows = (diff > rtol * scale).any(0) | (bad.any(0) & ~same.all(0))
    return set(rows.nonzero().flatten().tolist())


def _only_row_moved(pa, pb, j: int) -> bool:
    """Whether, along the output's batch dimension, no row but row ``j`` differs at all
    between the two runs (no tolerance). A dimension of the batch's size that moved
    beyond rounding while the batch dimension did not (4 classes, a batch of 4) then
    carries example ``j``'s change only: its row moved by less than its fingerprint's
    tolerance (bfloat16), the other examples' rows not at all."""
    fa = pa["dims"].get(pa["declared"])
    if fa is None or pa["shape"] != pb["shape"]:
        return False
    fb = pb["dims"][pa["declared"]]
    if fa[0] == "exact":
        return (fa[1] != fb[1]).any(1).nonzero().flatten().tolist() in ([], [j])
    same = ((fa[1] == fb[1]) | (torch.isnan(fa[1]) & torch.isnan(fb[1]))).all(0)
    same &= (fa[4] == fb[4]).all(0)  # and the bits (:mod:`._probe_exact`)
    return set((~same).nonzero().flatten().tolist()) <= {j}


def _verdict(pa, pb, j: int, mode: str = "tolerance"):
    """``("same" | "ok" | ("layout", dim) | "mixed")`` for one observed tensor."""
    if pa["shape"] != pb["shape"]:
        return "same"  # data-dependent shape: nothing to compare
    declared = pa["dims"].get(pa["declared"])
    if declared is not None and _changed(declared, pb["dims"][pa["declared"]],
                                         mode) == set():
        # no example's row moved beyond rounding: a dimension of the same size that did
        # move is a feature dimension carrying example j's change
        return "same"
    confining, any_change = [], False
    for d, fa in pa["dims"].items():
        rows = _changed(fa, pb["dims"][d], mode)
        if rows is None:
            continue
        if rows:
            any_change = True
        if rows == {j}:
            confining.append(d)
    if not any_change:
        return "same"
    if pa["declared"] in confining:
        return "ok"
    if confining:
        return ("layout", confining[0])
    return "mixed"


def _judge(tracker, run_a, run_b, examples: int, j: int, mode: str = "tolerance") -> set:
    """Refuse what the two runs show (module docstring); returns the ``(call, view)``
    positions whose rows on the batch dimension are as many as the examples and none of
    which moved."""
    calls_a, root_a, written_a = run_a
    calls_b, root_b, written_b = run_b
    unmoved = set()
    if [i for i, _ in calls_a] != [i for i, _ in calls_b]:
        # data-dependent control flow: the runs are not comparable layer by layer
        _flat_rows.calls_differ(tracker)
        _judge_buffers(tracker, written_a, written_b, j, mode == "bits")
        return unmoved
    for c, ((index, views_a), (_, views_b)) in enumerate(zip(calls_a, calls_b, strict=True)):
        unit = tracker.units[index]
        label = f"{unit.name or '<model>'} ({type(unit.module).__name__})"
        for k, (pa, pb) in enumerate(zip(views_a, views_b, strict=True)):
            v = _verdict(pa, pb, j, mode)
            if "grouped" in pa:
                _flat_rows.judge(tracker, index, pa, pb, v, j, examples)
                continue
            if v == "same" and len(pa["shape"]) > pa["declared"] \
                    and pa["shape"][pa["declared"]] == examples:
                unmoved.add((c, k))
            where = pa["label"]
            if v == "mixed":
                raise BatchDependenceError(
                    f"examples are mixed: replacing example {j} of the batch changed other "
                    f"examples' values at the {where} of layer {label}. An operation that "
                    "combines examples (batch statistics such as x - x.mean(0), "
                    "F.batch_norm or BatchNorm, a softmax or attention over the batch "
                    "dimension) lets one example move every example's gradient, so "
                    "per-example clipping no longer bounds its influence. Compute such "
                    "statistics per example (GroupNorm, LayerNorm), or if this layer "
                    "receives the batch on a dimension other than "
                    f"{pa['declared']}, declare it with make_private(..., batch_dims="
                    f"{{{unit.name!r}: d}}). No step was taken and nothing was released")
            if isinstance(v, tuple):
                d = v[1]
                raise BatchDependenceError(
                    f"layer {label} receives the batch on dimension {d} (its {where} of shape "
                    f"{pa['shape']} changes only at position {j} of dimension {d} when "
                    f"example {j} changes), but the engine reads it on dimension "
                    f"{pa['declared']}: it would clip the rows of dimension {pa['declared']} "
                    "(e.g. time steps) as if they were examples. Declare the layout: "
                    f"make_private(..., batch_dims={{{unit.name!r}: {d}}}) (or set "
                    "batch_first=True on the layers that produce it). No step was taken "
                    "and nothing was released")
    for pa, pb in zip(root_a, root_b, strict=True):
        dims = pa["dims"]
        if not dims:
            continue
        rows = [r for r in (_changed(fa, pb["dims"][d], mode) for d, fa in dims.items())
                if r is not None]
        if rows and any(r for r in rows) and not any(r == {j} for r in rows) \
                and not _only_row_moved(pa, pb, j):
            raise BatchDependenceError(
                f"examples are mixed after the model's last trainable layer: replacing "
                f"example {j} changed other examples' rows of the model's output (shape "
                f"{pa['shape']}). An operation on the output combines examples (e.g. "
                "subtracting the batch mean), so per-example clipping no longer bounds one "
                "example's influence. No step was taken and nothing was released")
    _judge_buffers(tracker, written_a, written_b, j, mode == "bits")
    return unmoved



# ------------------------------------------------------------------ inputs


def _input_name(path) -> str:
    """``positional argument 0`` or ``input_ids`` (and any nested key) from a pytree path
    into ``(args, kwargs)``."""
    if len(path) < 2:
        return "input"
    head, first, rest = path[0], path[1], keystr(path[2:])
    if getattr(head, "idx", None) == 0:
        return f"positional argument {getattr(first, 'idx', '?')}{rest}"
    return f"{getattr(first, 'key', '?')!s}{rest}"


def nonfinite_rows(args, kwargs, examples: int | None = None, nan_only: bool = False
                   ) -> list[tuple[str, list[int]]]:
    """``[(input name, [rows with a NaN or inf]), ...]`` of the floating tensors among
    the model's inputs (``examples``: only tensors with that many rows; ``nan_only``: an
    infinity is no fault, e.g. an additive attention mask's ``-inf``; one host
    synchronisation per floating input)."""
    found = []
    for path, t in tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1):
            continue
        if examples is not None and t.shape[0] != examples:
            continue
        rows = t.detach().reshape(t.shape[0], -1)
        bad = (rows.isnan() if nan_only else ~torch.isfinite(rows)).any(1)
        rows = bad.nonzero().flatten().tolist()
        if rows:
            found.append((_input_name(path), rows))
    return found


def nonfinite_message(found, examples_per_row: int = 1) -> str:
    """The refusal of a batch with non-finite inputs (``found`` from
    :func:`nonfinite_rows`)."""
    parts = []
    for name, rows in found:
        ex = sorted({r // examples_per_row for r in rows})
        where = (f"rows {rows[:8]}" if examples_per_row == 1 else
                 f"rows {rows[:8]} (example(s) {ex[:8]} of the batch)")
        parts.append(f"the model's input {name} is not finite (NaN or inf) at {where}")
    return ("; ".join(parts) + ". A non-finite input makes that example's gradient "
            "non-finite: it cannot be clipped, and dropping it silently would train on "
            "less than the batch without saying so. Clean or drop those examples in the "
            "dataset before make_private (e.g. torch.nan_to_num, or filter the rows). No "
            "step was taken and nothing was released")


def check_finite_inputs(args, kwargs, examples: int | None = None) -> None:
    """Refuse a batch whose floating inputs hold a NaN (naming input and row; an
    infinity can be meant, as in an additive mask, and is judged by the gradient it
    leads to, see :meth:`~privlearn.torch.tracker.GradSampleTracker.clipped_sum`).

    Raises
    ------
    NonFiniteInputError
    """
    found = nonfinite_rows(args, kwargs, examples, nan_only=True)
    if found:
        raise NonFiniteInputError(nonfinite_message(found))


# ------------------------------------------------------------------ augment


class _ReplayedRandomness:
    """The global random states (torch on the CPU and the given CUDA devices, NumPy's
    global generator, Python's ``random``): :meth:`replay` puts back the state saved on
    entry (or the one :meth:`seed` made) before each run, so every run draws the same
    numbers; on exit the caller's states are put back, so their streams continue as if
    nothing ran."""

    def __init__(self, devices):
        self.devices = list(devices)

    def _save(self):
        return (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices],
                np.random.get_state(), random.getstate())

    def _load(self, state) -> None:
        cpu, cuda, nps, py = state
        torch.set_rng_state(cpu)
        for d, st in zip(self.devices, cuda, strict=True):
            torch.cuda.set_rng_state(st, d)
        np.random.set_state(nps)
        random.setstate(py)

    def __enter__(self):
        self.original = self.point = self._save()
        return self

    def seed(self, seed: int) -> None:
        """Replay from a state seeded with ``seed`` from now on."""
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.point = self._save()

    def replay(self) -> None:
        self._load(self.point)

    def __exit__(self, *exc):
        self._load(self.original)
        return False


#: random states the augment probe replays, after the caller's own: a transform that
#: mixes examples only on some draws (``if torch.rand(()) < p``) shows on one of them
_AUGMENT_SEEDS = (0x5EED, 0xA11CE)


def probe_augment(augment, batch) -> None:
    """Check that ``augment`` (a function of one batch returning one augmented view of
    it, :class:`~privlearn.torch.data.AugmentedLoader`) treats each example on its own:
    it runs on the batch and on the batch with example ``j`` replaced by another example
    (``j`` the first, then the last), under the same random state (torch, NumPy and
    Python's global generators, restored afterwards), and every other row of every
    per-example tensor of its output (labels too) must be unchanged. A batch-level
    MixUp/CutMix (``lam * x + (1 - lam) * x.roll(1, 0)``) fails: one example moves its
    neighbour's input, label and so gradient, and per-example clipping no longer bounds
    its influence. The batch is copied for every run (an in-place ``augment`` leaves it
    alone).

    Raises
    ------
    BatchDependenceError
        ``augment`` mixes examples, or its output cannot be replayed under the same
        random state (it draws from a generator of its own), so nothing can be checked.
    """
    leaves, spec = tree_flatten(batch)
    batched = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not batched:
        return
    n = leaves[batched[0]].shape[0]
    if n < 2 or any(leaves[i].shape[0] != n for i in batched):
        return  # AugmentedLoader refuses a batch without one leading dimension
    paths = [keystr(p) or "batch" for p, _ in tree_flatten_with_path(batch)[0]]
    # every initialised CUDA device: augment may move a CPU batch there and draw on it
    devices = (list(range(torch.cuda.device_count())) if torch.cuda.is_initialized()
               else [])

    def run(lv):
        copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in lv]
        out, _ = tree_flatten(augment(tree_unflatten(copies, spec)))
        return out

    with _ReplayedRandomness(devices) as rng:
        rng.replay()
        base = run(leaves)
        if len(base) != len(leaves):
            return  # AugmentedLoader refuses a changed structure
        rng.replay()
        again = run(leaves)
        replayable = _moved_rows(base, again, batched, n, skip=None) is None
        # bit for bit when the rerun is (a per-example transform's other rows do not move
        # at all; a tolerance of the dtype's precision passed a small mix), else the
        # tolerance (nondeterministic kernels on an accelerator)
        exact = replayable and all(_probe_exact.bitwise_equal(base[i], again[i])
                                   for i in batched if isinstance(base[i], torch.Tensor)
                                   and isinstance(again[i], torch.Tensor))
        for seed in (None, *_AUGMENT_SEEDS) if replayable else (None,):
            if seed is not None:
                rng.seed(seed)
                rng.replay()
                base = run(leaves)
            _augment_rows(run, rng, leaves, batched, paths, base, n, replayable, exact)


def _augment_rows(run, rng, leaves, batched, paths, base, n: int, replayable: bool,
                  exact: bool = False) -> None:
    """One random state of :func:`probe_augment`: example ``j`` replaced, ``j`` the
    first and the last example (``exact``: other rows compared bit for bit)."""
    for j in (0, n - 1):
        perturbed = _probe_held.replace_row(leaves, batched, j)
        if perturbed is None:
            return
        rng.replay()
        if replayable:
            moved = _moved_rows(base, run(perturbed), batched, n, skip=j, exact=exact)
        else:  # state of its own: one call on the batch followed by the perturbed one
            both = [torch.cat([t, perturbed[i]]) if i in batched else t
                    for i, t in enumerate(leaves)]
            try:
                out = run(both)
            except Exception:  # noqa: BLE001 - it needs the batch as it is
                out = None
            moved = (None if out is not None and _moved_rows(
                [o[:n] if i in batched else o for i, o in enumerate(out)],
                [o[n:] if i in batched else o for i, o in enumerate(out)],
                batched, n, skip=j) is None else (batched[0], []))
            if moved is not None:
                raise BatchDependenceError(
                    "augment could not be checked: it gave different outputs for the "
                    "same batch under the same torch, NumPy and Python random state (it "
                    "draws from a generator or keeps a state of its own: a "
                    "torch.Generator, np.random.default_rng, a call counter), and it "
                    "does not give an example the same view when the batch holds it "
                    "twice. privlearn then cannot tell whether it treats each example "
                    "on its own or mixes examples (a batch-level MixUp/CutMix). Draw "
                    "its randomness from the global generators (torch.rand..., "
                    "np.random...., random....) and apply per-example transforms, or "
                    "pass check_batch_independence=False and promise it (the documentation "
                    "page 'Trust model: who sees what'). No step was taken and nothing was "
                    "released")
        if moved:
            where, rows = moved
            raise BatchDependenceError(
                f"augment mixes examples: replacing example {j} of the batch changed "
                f"other examples' rows {rows[:8]} of its output {paths[where]} (a "
                "batch-level MixUp or CutMix, lam * x + (1 - lam) * x.roll(1, 0), does "
                "this: one example then moves another example's input, label and "
                "gradient, and per-example clipping no longer bounds its influence). "
                "Apply per-example transforms in augment (each output row a function of "
                "its own input row and the random state), or mix only within an "
                "example's own views (e.g. MixUp between two augmentations of the same "
                "image). No step was taken and nothing was released")


def _moved_rows(a_leaves, b_leaves, batched, n: int, skip: int | None,
                exact: bool = False):
    """``(leaf index, rows)`` of the first per-example output tensor whose rows other
    than ``skip`` differ between two runs (``exact``: in any bit), or None."""
    for i in batched:
        a, b = a_leaves[i], b_leaves[i]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        if a.shape != b.shape or a.dim() == 0 or a.shape[0] != n:
            if skip is None or a.shape != b.shape:
                return i, list(range(n))
            continue
        x, y = a.detach().reshape(n, -1), b.detach().reshape(n, -1)
        if exact and x.is_floating_point():
            same = (_probe_exact.digest(x) == _probe_exact.digest(y)).all(0)
        elif x.is_floating_point() or x.is_complex():
            rtol = _RTOL.get(x.dtype, 1e-5)
            scale = float(torch.nan_to_num(x.abs(), posinf=0.0).amax()) if x.numel() else 0.0
            same = torch.isclose(x, y, rtol=rtol, atol=rtol * scale, equal_nan=True).all(1)
        else:
            same = (x == y).all(1)
        rows = [r for r in (~same).nonzero().flatten().tolist() if r != skip]
        if rows:
            return i, rows
    return None
