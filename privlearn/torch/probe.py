"""The batch-independence probe: per-example clipping is only private if each example's
outputs depend on that example alone, and if the engine reads every layer's examples on
the right dimension. Both are checked, not assumed.

Before the first step (and again after the trainable parameters change), the forward pass
that produced the step is run three more times without gradients, on the first few
examples of the batch: once on their own inputs and
once with example ``j`` replaced by another example ``k`` of the batch, for ``j`` the first
and then the last example (an operation accumulating over the batch in either direction
reaches the others from one of them; every input tensor whose leading dimension is the
batch; same random state for all runs, so dropout masks agree; buffers restored
afterwards). For every recorded layer, the rows its inputs and
outputs hold along each dimension of the batch's size are compared between the two runs:

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
  rows per layer says so first).

The comparison uses per-row fingerprints (the sum, the squared norm and a fixed weighted
sum of each row, accumulated in float32) with a tolerance of the tensor's precision, so
the probe stores a few numbers per row, not the activations. It runs on the first
seven examples of the batch (a mixing operation shows among a few examples as among
all; five or three if seven is the size of another input dimension, the whole batch if
the model cannot run on part of it), so its cost is three forward passes over seven
examples without gradients, once (see docs/benchmarks.md). What it cannot see: a loss that
mixes examples after the model's output (a contrastive loss over the batch) -- the user
promises that the loss is a sum or mean of per-example terms (docs/trust-model.md).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from privlearn.errors import BatchDependenceError

__all__ = ["BatchDependenceError", "probe"]


_RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3,
         torch.bfloat16: 2e-2}
_MAX_SOURCES = 8  # examples tried as the replacement of example j
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
    leaves, spec = tree_flatten((args, kwargs))
    batched = [i for i, t in enumerate(leaves)
               if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == examples]
    if not batched:
        raise BatchDependenceError(
            f"none of the model's inputs has the batch of {examples} examples on its leading "
            "dimension (shapes: "
            f"{[tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]}), so privlearn "
            "cannot check that each example is processed on its own. Pass the batch as "
            "p.data_loader yields it (one row per example; a packed or flattened batch "
            "would be clipped as one example)")
    m = _sub_batch(leaves, batched, examples)
    if m < examples:
        sub = list(leaves)
        for i in batched:
            sub[i] = leaves[i][:m]
        try:
            if _probe_rows(tracker, sub, batched, spec, autocast, m):
                return
        except BatchDependenceError:
            raise
        except Exception:  # noqa: BLE001 - the model needs the whole batch: probe that
            pass
    _probe_rows(tracker, leaves, batched, spec, autocast, examples)


def _sub_batch(leaves, batched, examples: int) -> int:
    """How many of the batch's examples the probe runs on: seven (a mixing operation
    shows among a few examples as among all, at a fraction of the cost), or five or
    three if seven is the size of another dimension of the inputs, so that no sequence
    or feature dimension is mistaken for the batch."""
    if examples <= _SUB_BATCHES[0]:
        return examples
    other = {s for t in leaves if isinstance(t, torch.Tensor) for s in t.shape[1:]}
    other |= {t.shape[0] for i, t in enumerate(leaves)
              if isinstance(t, torch.Tensor) and t.dim() and i not in batched}
    for m in _SUB_BATCHES:
        if m not in other:
            return m
    return examples


def _probe_rows(tracker, leaves, batched, spec, autocast, examples: int) -> bool:
    """Run the two passes on these rows and judge them; False if every example equals
    the first (nothing can tell them apart)."""
    # the first and the last row: an operation accumulating over the batch in either
    # direction (a mean over the others, a cumulative sum, the last row added to all)
    # reaches the other rows from one of them
    base = None
    for j in (0, examples - 1):
        perturbed = _replace_row(leaves, batched, j)
        if perturbed is None:
            return False
        if base is None:
            base = _observe_run(tracker, *tree_unflatten(leaves, spec), autocast, examples)
        run = _observe_run(tracker, *tree_unflatten(perturbed, spec), autocast, examples)
        _judge(tracker, base, run, examples, j)
    return True


def _replace_row(leaves, batched, j):
    """Copies of the leaves with row ``j`` of every batched tensor replaced by row ``k``
    of the same tensor, for the first ``k`` whose rows differ from row ``j`` somewhere
    (None if no example differs from example ``j``)."""
    n = leaves[batched[0]].shape[0]
    for k in range(min(n, 1 + _MAX_SOURCES)):
        if k == j:
            continue
        if all(torch.equal(leaves[i][j], leaves[i][k]) for i in batched):
            continue
        out = list(leaves)
        for i in batched:
            t = leaves[i].clone()
            t[j] = leaves[i][k]
            out[i] = t
        return out
    return None


class _Collector:
    """Forward hooks recording fingerprints of what each unit saw and produced."""

    def __init__(self, tracker, examples: int):
        self.tracker = tracker
        self.examples = examples
        self.calls: list[tuple[int, list]] = []  # (unit index, fingerprints), in order
        self._weights: dict = {}

    def hook(self, index: int):
        unit = self.tracker.units[index]

        def fn(module, args, kwargs, output):
            views = (unit.rule.observe(module, args, kwargs, output)
                     if unit.rule.observe is not None
                     else _default_views(args, kwargs, output, unit.batch_dim))
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
            w = self._weight(x.shape[1], x.dtype, x.device)
            f32 = torch.float32 if x.dtype != torch.float64 else torch.float64
            norm = torch.linalg.vector_norm(x, dim=1, dtype=f32)  # also the scale
            dims[d] = ("float", torch.stack([norm, (x @ w).to(f32)]), norm,
                       _RTOL.get(t.dtype, 1e-5))
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


def _observe_run(tracker, args, kwargs, autocast, examples: int):
    """One forward pass without gradients, same random state as the other run, model
    buffers restored afterwards; returns the units' fingerprints and the output's."""
    model = tracker.model
    col = _Collector(tracker, examples)
    handles = [u.module.register_forward_hook(col.hook(i), with_kwargs=True)
               for i, u in enumerate(tracker.units)]
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    hint, tracker._batch_hint = tracker._batch_hint, examples  # broadcast inputs' rows
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(torch.no_grad())
            for dev, dtype in autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
            torch.manual_seed(0x5EED)
            out = model(*args, **kwargs)
        flat, _ = tree_flatten(out)
        outs = [o for o in flat if isinstance(o, torch.Tensor) and o.is_floating_point()]
        root = [col._print(o, 0) for o in outs[:1]]
    finally:
        tracker._batch_hint = hint
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
    return col.calls, root


def _changed(fa, fb) -> set[int] | None:
    """Rows that differ between two fingerprints of one dimension (None: not
    comparable)."""
    if fa[0] != fb[0]:
        return None
    if fa[0] == "exact":
        a, b = fa[1], fb[1]
        if a.shape != b.shape:
            return None
        return set((a != b).any(1).nonzero().flatten().tolist())
    _, sa, ca, rtol = fa
    _, sb, cb, _ = fb
    if sa.shape != sb.shape:
        return None
    # a row changed when its norm or its weighted sum moved by more than the rounding of a
    # row of that norm: both computations round like a sum of the row's entries, whose
    # error grows like eps * ||row||_2 (a few times that for the weighted sum)
    diff = (sa - sb).abs()
    scale = (ca + cb) * torch.tensor([1.0, 4.0], dtype=ca.dtype, device=ca.device)[:, None]
    bad = ~torch.isfinite(sa) | ~torch.isfinite(sb)
    rows = (diff > rtol * scale).any(0) | (bad.any(0) & ~(sa == sb).all(0))
    return set(rows.nonzero().flatten().tolist())


def _verdict(pa, pb, j: int):
    """``("same" | "ok" | ("layout", dim) | "mixed")`` for one observed tensor."""
    if pa["shape"] != pb["shape"]:
        return "same"  # data-dependent shape: nothing to compare
    declared = pa["dims"].get(pa["declared"])
    if declared is not None and _changed(declared, pb["dims"][pa["declared"]]) == set():
        # no example's row moved beyond rounding: a dimension of the same size that did
        # move is a feature dimension carrying example j's change
        return "same"
    confining, any_change = [], False
    for d, fa in pa["dims"].items():
        rows = _changed(fa, pb["dims"][d])
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


def _judge(tracker, run_a, run_b, examples: int, j: int) -> None:
    calls_a, root_a = run_a
    calls_b, root_b = run_b
    if [i for i, _ in calls_a] != [i for i, _ in calls_b]:
        return  # data-dependent control flow: the runs are not comparable layer by layer
    for (index, views_a), (_, views_b) in zip(calls_a, calls_b, strict=True):
        unit = tracker.units[index]
        label = f"{unit.name or '<model>'} ({type(unit.module).__name__})"
        for pa, pb in zip(views_a, views_b, strict=True):
            v = _verdict(pa, pb, j)
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
        rows = [r for r in (_changed(fa, pb["dims"][d]) for d, fa in dims.items())
                if r is not None]
        if rows and any(r for r in rows) and not any(r == {j} for r in rows):
            raise BatchDependenceError(
                f"examples are mixed after the model's last trainable layer: replacing "
                f"example {j} changed other examples' rows of the model's output (shape "
                f"{pa['shape']}). An operation on the output combines examples (e.g. "
                "subtracting the batch mean), so per-example clipping no longer bounds one "
                "example's influence. No step was taken and nothing was released")

