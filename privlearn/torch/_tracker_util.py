"""Helpers of :mod:`privlearn.torch.tracker`: per-example squared norms over the
contributions, the batch layout of records, dropping overflowing examples from them, and
the small functions the recording hooks use (moved out of the tracker module, which
re-exports :func:`record_batch`).
"""

from __future__ import annotations

import enum
import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from privlearn.errors import (
    BatchDependenceError,
    ConfigurationError,
    ParameterValueError,
    TrainingLoopError,
)
from privlearn.torch._compile import skip_dynamo
from privlearn.torch._row_norms import flat_sq
from privlearn.torch.cross_terms import CrossTerm
from privlearn.torch.fallback import default_record_dims, nested_tensors_error
from privlearn.torch.grad_sample import (
    DenseOuterProduct,
    Materialized,
    OuterProduct,
    Record,
    make_differentiable,
)

if TYPE_CHECKING:
    from privlearn.torch.tracker import Unit


class _OutputAlias(torch.autograd.Function):
    """Identity returning a tensor that shares ``x``'s storage and version counter but is
    not a view in autograd's sense: its own node, which stays in the graph if the caller
    modifies it in place (a view modified in place has its history rebased, and a hook
    registered on it before never fires)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        return g


def _hookable(output: torch.Tensor, dummy: torch.Tensor, own_node: bool) -> torch.Tensor:
    """A layer's floating-point output ready for a gradient hook: made differentiable
    (through ``dummy``) if it requires no grad, and given a node of its own
    (:class:`_OutputAlias`) if it is a view (InstanceNorm's ``view_as``, a custom layer's
    ``.view``), so that an in-place op after the layer (``relu_``, ``ReLU(inplace=True)``)
    does not drop the hook and, with it, the layer's gradient; with ``own_node``, always
    (an output the layer itself consumes, ``y`` in ``(y, f(y))``: the hook then sees only
    the gradient from outside the layer). The returned tensor is ``output`` when nothing
    was needed; an in-place op on it is checked against saved tensors as on ``output``.
    An output view that requires no grad is detached first (same storage and values):
    one made under no_grad, as a ``torch.compile``d layer's output of the batch's shape
    is (AOTAutograd regenerates output views under no_grad), cannot be made
    differentiable in place."""
    if not output.requires_grad:
        if output._is_view():
            output = output.detach()
        output = make_differentiable(output, dummy)
    elif own_node:
        return _OutputAlias.apply(output)
    return _OutputAlias.apply(output) if output._is_view() else output


def _on_final_grad(t: torch.Tensor, fn) -> None:
    """Call ``fn`` with the gradient of ``t`` that its node receives: after every hook
    registered on ``t`` itself (``t.register_hook(lambda g: 3 * g)``, registered before or
    after this), as autograd applies them before the node runs; a tensor hook of ours
    would see the gradient only as far as the hooks registered before it had changed it.
    The node is the one ``t`` has now (an in-place op on ``t`` later gives it another).
    The hook's frames are never compiled by Dynamo (a ``backward()`` called inside a
    ``torch.compile``d function runs after a graph break, where Dynamo would compile each
    hook as a frame of its own: :mod:`privlearn.torch._compile`)."""
    node = t.grad_fn
    if node is None:  # a leaf: no node to run
        t.register_hook(_grad_of(fn))
        return
    node.register_prehook(_grad_output_of(t.output_nr, fn))


def _grad_of(fn):
    def leaf(grad):
        fn(grad)

    return leaf


def _grad_output_of(i: int, fn):
    def pre(grad_outputs):
        g = grad_outputs[i]
        if g is not None:
            fn(g)

    return pre


def outside_hook(tracker, p):
    """The gradient hook of a clipped parameter ``p``: a gradient reaching ``p`` itself
    comes from a use outside its layers (they run on detached aliases of it), which the
    step refuses (``GradSampleTracker.check_outside_uses``)."""
    def fn(grad):
        tracker.outside_uses.add(id(p))
        return None

    return fn


for _hook in (_grad_of(None), _grad_output_of(0, None), outside_hook(None, None)):
    skip_dynamo(_hook.__code__)  # never compiled by Dynamo (see _on_final_grad)


def _recomputed_outputs(output, dummy: torch.Tensor):
    """A layer's outputs in a forward recomputed during backward (activation
    checkpointing), given the nodes the recording hook gave them in the first forward
    (:func:`_hookable`, without hooks: the gradients are recorded through the first
    forward's outputs), so that the recomputed graph saves the same tensors; None when
    nothing changes."""
    if type(output) is torch.Tensor:
        if not output.is_floating_point():
            return None
        hooked = _hookable(output, dummy, own_node=False)
        return hooked if hooked is not output else None
    flat, spec = tree_flatten(output)
    if not any(isinstance(o, torch.Tensor) and o.is_floating_point() for o in flat):
        return None
    return tree_unflatten([_hookable(o, dummy, own_node=True)
                           if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                           for o in flat], spec)

def _flat_sq(contribs, settled=None) -> torch.Tensor:
    """Per-example squared norms over all parameters (a sum of per-example terms: no
    reduction over examples): every contribution's terms (one a parameter where a rule
    gives them apart) summed by one stacked reduction."""
    return flat_sq(contribs, settled)


def _per_param_sq(contribs):
    """Per-parameter per-example squared norms ``{id(p): (B,)}`` and their total."""
    sq: dict[int, torch.Tensor] = {}
    for c in contribs:
        if isinstance(c, CrossTerm):
            k = id(c.param)
            sq[k] = c.sq_norms() if k not in sq else sq[k] + c.sq_norms()
            continue
        for p, s in zip(c.params, c.param_sq_norms(), strict=True):
            k = id(p)
            sq[k] = s if k not in sq else sq[k] + s
    total = None
    for s in sq.values():
        total = s if total is None else total + s
    return sq, total


def _nonfinite(sq: torch.Tensor | None, masked: bool = False) -> torch.Tensor | None:
    """Boolean mask of the examples whose squared norm is not finite. With ``masked``
    (the contributions drop them by their weight) the mask itself, computed on the
    device; else None when every one is finite (one host synchronisation)."""
    if sq is None:
        return None
    # x * 0 is (+-)0 exactly when x is finite (inf * 0 and NaN * 0 are NaN, and NaN != 0):
    # two operations where ``~isfinite`` dispatches five
    bad = (sq * 0).ne(0)
    if masked:
        return bad
    return bad if bool(bad.any()) else None


def _without_rows(c, idx: torch.Tensor):
    """A contribution evaluated during backward with the examples ``idx`` made to
    contribute exactly zero: the rows of its recorded input and output gradient zeroed
    (outer products kept in ghost form, embedding lookups), else its per-example
    gradients with those rows zeroed."""
    from privlearn.torch.rules.embedding import EmbeddingContribution

    if isinstance(c, OuterProduct) and c._ps is None:
        ix = idx.to(c._g.device)
        return OuterProduct(c.weight, c.bias, c._a.index_fill(0, ix, 0.0),
                            c._g.index_fill(0, ix, 0.0), ghost=True,
                            transposed=c.transposed)
    if isinstance(c, DenseOuterProduct):
        ix = idx.to(c.g.device)
        return DenseOuterProduct(c.weight, c.bias, c.a.index_fill(0, ix, 0.0),
                                 c.g.index_fill(0, ix, 0.0), transposed=c.transposed)
    if isinstance(c, EmbeddingContribution):
        return EmbeddingContribution(c.weight, c.ids, c.g.index_fill(
            0, idx.to(c.g.device), 0.0), None)  # padding rows already zero in c.g
    grads = c.per_sample()
    ix = idx.to(grads[0].device) if grads else idx
    return Materialized(c.params, [g.index_fill(0, ix, 0.0) for g in grads])


def _sanitize_record(unit: Unit, rec: Record, idx: torch.Tensor, batch: int) -> None:
    """In ``rec``, zero the rows ``idx`` (along each tensor's batch dimension) of the
    output gradients and of captured gradients, and replace non-finite values in those
    rows of the floating inputs by 0. Tensors without a batch dimension are left alone
    (they are shared by all examples, e.g. an additive attention mask)."""
    if rec.early is not None:  # evaluated during backward
        rec.early = _without_rows(rec.early, idx)
        return
    arg_dims, kw_dims, out_dims = record_dims(unit, rec, batch)

    def fixer(d, zero):
        return lambda t: fix(t, d, zero)

    def fix(t, d, zero):
        if d is None or not isinstance(t, torch.Tensor) or not t.is_floating_point() \
                or t.dim() <= d or t.shape[d] != batch:
            return t
        ix = idx.to(t.device)
        if zero:
            return t.index_fill(d, ix, 0.0)
        rows = torch.nan_to_num(t.index_select(d, ix), nan=0.0, posinf=0.0, neginf=0.0)
        return t.index_copy(d, ix, rows)

    rec.args = tuple(_map_tensors(a, fixer(d, False))
                     for a, d in zip(rec.args, arg_dims, strict=True))
    rec.kwargs = {k: _map_tensors(v, fixer(kw_dims.get(k), False))
                  for k, v in rec.kwargs.items()}
    rec.grad_outputs = [None if g is None else fix(g, d, True)
                        for g, d in zip(rec.grad_outputs, out_dims, strict=True)]
    extra = rec.extra
    if extra:  # attention capture: gradients and O, batch-first
        extra = dict(extra)
        if extra.get("grads") is not None:
            extra["grads"] = [None if g is None else fix(g, 0, True) for g in extra["grads"]]
        if extra.get("packed") is not None:
            extra["packed"] = [None if g is None else fix(g, 0, True)
                               for g in extra["packed"]]
        if extra.get("O") is not None:
            extra["O"] = fix(extra["O"], 0, False)
        rec.extra = extra


def _map_tensors(x, fn):
    """``fn`` applied to a tensor, or to each tensor of a tuple/list (an LSTM's
    ``(h0, c0)``)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple | list):
        return type(x)(fn(t) if isinstance(t, torch.Tensor) else t for t in x)
    return x


def record_dims(unit: Unit, rec: Record, batch: int):
    """Batch dimension of each recorded argument, keyword argument and (flattened)
    output of one call (None: not batched): the rule's ``record_dims`` for layout-aware
    rules, else the batch-first default."""
    fn = unit.rule.layout.record_dims or default_record_dims
    arg_dims, kw_dims, out_dims = fn(unit.module, rec, batch)
    out_dims = list(out_dims) + [None] * (len(rec.outputs_meta) - len(out_dims))
    return list(arg_dims), kw_dims, out_dims


def record_batch(unit: Unit, rec: Record) -> int:
    """Number of examples in one recorded call of ``unit``."""
    if rec.examples is not None:
        return rec.examples
    if unit.rule.layout.batch_size is not None:
        return int(unit.rule.layout.batch_size(unit.module, rec))
    x = next((t for t in (*rec.args, *rec.kwargs.values()) if isinstance(t, torch.Tensor)),
             None)
    if x is None and any(isinstance(t, torch.Tensor)
                         for t in tree_flatten((rec.args, rec.kwargs))[0]):
        raise nested_tensors_error(f"{unit.name!r} ({type(unit.module).__name__})")
    if x is None:
        raise BatchDependenceError(
            f"layer {unit.name!r} ({type(unit.module).__name__}) owns trainable parameters "
            "but was called without any tensor input, so its output is the same for every "
            "example (a table computed from sizes alone, e.g. BEiT's relative position "
            "bias) and broadcast over the batch afterwards: its gradient is summed over "
            "the batch before any hook sees it, so it has no per-example gradient. Freeze "
            "its parameters (requires_grad_(False)), or use a model whose position "
            "parameters enter per example (ViT, DeiT, DINOv2). No step was taken and "
            "nothing was accounted")
    d = 0 if unit.normalised else unit.batch_dim
    return x.shape[d]


def _to_front(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` with dimension ``d`` moved to the front (a view)."""
    return t.movedim(d, 0) if t.dim() > d else t


def _meta(o: torch.Tensor, move: int | None):
    shape = tuple(o.shape)
    if move is not None and len(shape) > move:
        shape = (shape[move], *shape[:move], *shape[move + 1:])
    return (shape, o.dtype, o.device)


def _autocast_input(args: tuple, output, source=None, slot: list | None = None) -> tuple:
    """``args`` with the first (float32) input cast to the autocast dtype, when autocast
    is on for its device and the layer's output has that dtype (the layer computed from
    that cast: see ``LayerRule.casts_input``); else unchanged.

    With ``source`` (the layer's own input tensor, before ``args`` detached it) and
    ``slot`` (a list kept by the caller), the copy is shared with the layer called last
    on the same tensor, unchanged since (its version counter), as a transformer's query,
    key and value projections read one input: one cast instead of one a layer (the same
    values). The slot holds both weakly: the copy lives as long as a record holds it."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 \
            or not isinstance(output, torch.Tensor):
        return args
    dev = x.device.type
    try:
        if not torch.is_autocast_enabled(dev) or output.dtype != torch.get_autocast_dtype(dev):
            return args
    except (RuntimeError, TypeError, AttributeError):  # pragma: no cover - old torch
        return args
    if slot is None or type(source) is not torch.Tensor:
        return (x.to(output.dtype), *args[1:])
    if slot and slot[0]() is source and slot[1] == source._version \
            and slot[2] == output.dtype:
        y = slot[3]()
        if y is not None:
            return (y, *args[1:])
    y = x.to(output.dtype)
    slot[:] = [weakref.ref(source), source._version, output.dtype, weakref.ref(y)]
    return (y, *args[1:])


def _trainable_signature(model: nn.Module) -> tuple:
    """The ids of the model's parameters that require gradients, each with the id of the
    module holding it (a cheap fingerprint of the trainable set and of the layers that
    hold it, compared at every forward: a layer replaced after make_private by a new
    module holding the same parameters, as a conversion such as
    ``torch.ao.quantization.prepare_qat`` does, is hooked in its place)."""
    return tuple((id(m), id(p)) for m in model.modules() for p in m._parameters.values()
                 if p is not None and p.requires_grad)


#: distinct signatures whose numbers (int, float, Enum values) are told apart; past
#: this many (a forward taking ``step=i``), numbers count by their type only
NUMERIC_CALLS = 16


def _call_signature(args: tuple, kwargs: dict, numbers: bool = True) -> tuple:
    """What selects a forward's code path besides its tensors: its positional arguments
    and keyword names, with the flags among their values (booleans, None, strings and,
    with ``numbers``, ints, floats and Enum members: ``mode=1``) and the type of any
    other value (a tensor flag is not read: that would wait for the device). A forward
    of a signature not seen before re-arms the batch-independence probe
    (``model(x, centre=True)`` or ``model(x, mode=1)`` first called after some steps)."""
    kinds = (bool, str, int, float, enum.Enum) if numbers else (bool, str)

    def flag(v):
        return v if v is None or isinstance(v, kinds) else type(v)

    return (tuple(flag(a) for a in args),
            tuple(sorted((k, flag(v)) for k, v in kwargs.items())))


def new_call(calls: set, args: tuple, kwargs: dict) -> bool:
    """Whether a forward's signature (:func:`_call_signature`) is new to ``calls`` (then
    added): the probe re-runs on it. Numbers are told apart for the first
    :data:`NUMERIC_CALLS` signatures; past them a new number counts once by its type (a
    warning says the probe no longer re-runs for new numeric values)."""
    exact = _call_signature(args, kwargs)
    if exact in calls:
        return False
    if len(calls) < NUMERIC_CALLS:
        calls.add(exact)
        return True
    coarse = _call_signature(args, kwargs, numbers=False)
    if coarse in calls:
        return False
    calls.add(coarse)
    if exact != coarse:
        warnings.warn(
            f"the model's forward has been called with {NUMERIC_CALLS} distinct "
            "signatures (numeric arguments such as a step counter): later numeric values "
            "no longer re-run the batch-independence probe; pass a flag that selects a "
            "code path as a bool or str", RuntimeWarning, stacklevel=4)
    return True


def _distinct_calls(calls: list) -> list:
    """The ``((args, kwargs, autocast), buffers)`` of forward calls less those whose
    inputs repeat an earlier call's (the same tensor objects, the same other values by
    identity, the same autocast state): the probe's verdict on them is the one it gave."""
    out, keys = [], []
    for call in calls:
        (args, kwargs, autocast), _ = call
        leaves, spec = tree_flatten((args, kwargs))
        key = (spec, autocast, [id(v) for v in leaves])
        if key not in keys:
            keys.append(key)
            out.append(call)
    return out


def _autocast_state() -> tuple:
    """Autocast settings in force (the probe re-runs the forward under the same)."""
    out = []
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                out.append((dev, torch.get_autocast_dtype(dev)))
        except (RuntimeError, TypeError, AttributeError):  # pragma: no cover - old torch
            pass
    return tuple(out)


def _mismatch_message(unit: Unit, seen: int, examples: int, rec: Record | None = None) -> str:
    """Why a layer that saw ``seen`` rows of a batch of ``examples`` examples cannot be
    clipped per example."""
    why = _mismatch_reason(unit, seen, examples, rec)
    if examples == 0:
        return why
    return why + (" If the layer's input has no batch dimension at all (an embedding of "
                  "torch.arange(T), a layer applied to a parameter or a constant table), "
                  "give it a leading one of size 1 (pos[None]): the engine expands it to "
                  "one row per example.")


def _mismatch_reason(unit: Unit, seen: int, examples: int, rec: Record | None = None) -> str:
    base = (f"layer {unit.name!r} ({type(unit.module).__name__}) saw {seen} rows on its "
            f"batch dimension {unit.batch_dim}, but p.data_loader delivered {examples} "
            "examples for this step: per-example clipping needs one row per example. ")
    if examples == 0:
        return base + (
            "The forward pass ran on rows that are not the (empty) batch's: a collate "
            "function whose empty batch is not empty, or inputs taken from elsewhere. "
            "Feed the model what p.data_loader yields (or skip the forward and backward "
            "of an empty batch, still calling p.optimizer.step()).")
    x = rec.args[0] if rec is not None and rec.args else None
    if isinstance(x, torch.Tensor) and x.dim() > 1:
        other = [d for d in range(1, x.dim()) if x.shape[d] == examples]
        if other:
            return base + (
                f"Its input (shape {tuple(x.shape)}) has the batch's size on dimension "
                f"{other[0]}: if the layer receives sequence-first activations (e.g. an "
                "LSTM with batch_first=False feeding it), declare it: "
                f"make_private(..., batch_dims={{{unit.name!r}: {other[0]}}}).")
    elsewhere = ("the forward ran on other inputs than this step's batch of "
                 "p.data_loader (a slice such as x[:k], a batch of another loader, or "
                 "inputs kept from an earlier step): feed the model exactly what "
                 "p.data_loader yields, one optimizer step per batch")
    packed = ("the batch was packed or flattened into fewer rows (e.g. Hugging Face's "
              "DataCollatorWithFlattening puts the whole batch in one row, which would "
              "clip it as one example): use a collator that pads, one row per example")
    if seen < examples:
        causes = [elsewhere, "the model drops rows on the way (boolean masking or "
                  "filtering of examples): keep every example's row and mask its loss "
                  "instead", packed]
        if seen == 1:  # the whole batch in one row: packing is the likeliest
            causes.insert(0, causes.pop())
        return base + (f"Fewer rows ({seen}) than examples ({examples}); likely causes: "
                       + "; or ".join(causes) + ".")
    if seen % examples == 0 and seen > examples:
        return base + (
            f"It saw {seen // examples} rows per example (e.g. several augmented views "
            "concatenated into one batch): each row would be clipped as an example of its "
            "own, so one example could move the update by several times max_grad_norm. "
            "Average or sum the views per example before the loss, or feed them through "
            "separate forward passes of the same batch. Or the model flattens each "
            "example's tokens into rows of their own before this layer: such rows are "
            "regrouped into examples only in nn.Linear, Conv1D, nn.Embedding and "
            "nn.LayerNorm layers, once the batch-independence probe has verified that "
            "each example's rows are contiguous in the batch's order (OPT's decoder "
            "layers); not otherwise (mixture-of-experts routers such as Mixtral's "
            "dispatch tokens to experts); use a model whose layers "
            "keep the batch dimension (GPT-2, Llama, Mistral, Qwen2, OPT; ViT, DeiT or "
            "ConvNeXt for images). Or " + elsewhere + ".")
    return base + (
        f"More rows ({seen}) than examples ({examples}); likely causes: " + elsewhere
        + "; or the layer receives the batch on another dimension (sequence-first "
        "activations, e.g. an LSTM with batch_first=False feeding it): declare it, "
        f"make_private(..., batch_dims={{{unit.name!r}: 1}}).")


#: What to do instead of pickling a model (or an optimizer, or a run) with the engine's
#: hooks on it.
NOT_PICKLABLE = (
    "the privacy engine is attached to this model: its hooks (per-example gradients, "
    "clipping) cannot be pickled, so torch.save(model) / pickle.dumps of the model, of "
    "p.optimizer or of p fails while it is. Save a checkpoint instead: torch.save("
    "p.state_dict(), path) (model, optimizer and privacy state; p.load_state_dict after "
    "make_private with the same arguments), or model.state_dict(); or call p.detach() "
    "first (it removes the hooks and returns the model), then save the model")


class _Hook:
    """A module hook of the engine run eagerly under ``torch.compile`` (a graph break
    around it): recording inputs, registering tensor hooks and swapping parameters are
    Python side effects that must happen on the real tensors of each call.

    Outside compilation the hook is called directly: the ``torch.compiler.disable``
    wrapper costs a few microseconds a call, about 1% of a small BERT's private step
    with ~90 hook calls a forward. Dynamo folds ``is_compiling()`` to True while it
    traces, so the traced path always meets the disabled function and breaks the graph
    there. Its ``__call__``'s frames are never compiled themselves
    (:mod:`privlearn.torch._compile`: otherwise Dynamo recompiles them for every hook
    called after a graph break). Pickling one (``torch.save(model)`` while attached)
    raises a :class:`~privlearn.errors.TrainingLoopError` saying what to save instead,
    not pickle's bare error about a local function."""

    __slots__ = ("fn", "disabled", "__wrapped__")

    def __init__(self, fn):
        self.fn = self.__wrapped__ = fn
        self.disabled = torch.compiler.disable(fn, recursive=True)

    def __call__(self, *args, **kwargs):
        if _is_compiling():
            return self.disabled(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        raise TrainingLoopError(NOT_PICKLABLE)

    def __copy__(self):  # copied as the function it replaces was: the same hook
        return self

    def __deepcopy__(self, memo):  # a deep copy of the model is not the engine's: see below
        return _CopiedHook()

    def __repr__(self) -> str:
        return f"<privlearn hook {getattr(self.fn, '__qualname__', self.fn)!r}>"


class _CopiedHook:
    """What a deep copy of an attached model (``copy.deepcopy(p.model)``: an EMA or
    reference model, ``torch.optim.swa_utils.AveragedModel``) holds in place of each
    engine hook: nothing. The copy's layers are not the engine's; the hook of the
    original, bound to the original's layers, recorded the copy's calls as calls of the
    original's layers (their gradients were added to the original's parameters, and the
    copy could not be made private itself) and swapped the original's parameters. The
    copy is a plain model: it trains, pickles and can be made private as any module."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return None

    def __repr__(self) -> str:
        return "<privlearn hook of the model this one was copied from: inactive>"


_eager = _Hook
_is_compiling = torch.compiler.is_compiling
skip_dynamo(_Hook.__call__.__code__)


def _restore(unit: Unit, slots, keep_assigned: bool = False) -> None:
    """Put the parameters of ``slots`` back in their modules. ``keep_assigned``: leave a
    slot that holds another ``nn.Parameter`` (one the user assigned since the slots were
    taken, ``layer.weight = nn.Parameter(...)``) as it is; only an alias is replaced."""
    changed = False
    for owner, name, p in slots:
        cur = owner._parameters.get(name)
        if keep_assigned and isinstance(cur, nn.Parameter):
            continue
        if cur is not p:
            owner._parameters[name] = p
            changed = True
    if changed and unit.rule.after_swap is not None:
        unit.rule.after_swap(unit.module)


def _param_slots(module: nn.Module, params) -> list:
    """``(owner module, attribute name, parameter)`` of each handled parameter of a unit
    (parameters behind a parametrization or shared with no plain slot are skipped: their
    non-private gradient is then computed by autograd and discarded)."""
    ids = {id(p) for p in params}
    out = []
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None and id(p) in ids:
                out.append((mod, name, p))
    return out


def _in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def _resolve_dim(name, module, rule, batch_dims, inherited) -> int:
    declared = rule.declared_dim(module)
    if name in batch_dims:
        d = batch_dims[name]
        if d not in (0, 1) or isinstance(d, bool):
            raise ParameterValueError(f"batch_dims[{name!r}] must be 0 (batch-first) or 1 "
                             f"(sequence-first), got {d!r}")
        if declared is not None and d != declared:
            raise ConfigurationError(
                f"batch_dims[{name!r}]={d} contradicts the layer itself ({type(module).__name__} "
                f"declares the batch on dimension {declared}, e.g. from its batch_first "
                "flag); drop the entry or change the layer's flag")
        return d
    if declared is not None:
        return int(declared)
    return 0 if inherited is None else int(inherited)


def mixing_fingerprint(model: nn.Module) -> tuple:
    """What can switch on an operation that mixes examples without changing the trainable
    set, read from Python attributes only (no device access): every module of the tree
    and its class (a ``__class__`` swapped for one whose ``forward`` mixes), its
    ``training`` flag (``F.batch_norm(..., training=self.training)``), its forward
    hooks and pre-hooks (handle ids), an instance-level ``forward`` override, and the
    global module hooks. Compared at every forward; a change re-arms the probe."""
    out = [(id(m), type(m), m.training, tuple(m._forward_hooks),
            tuple(m._forward_pre_hooks), id(m.__dict__.get("forward")))
           for m in model.modules()]
    g = nn.modules.module
    out.append((tuple(g._global_forward_hooks), tuple(g._global_forward_pre_hooks)))
    return tuple(out)
