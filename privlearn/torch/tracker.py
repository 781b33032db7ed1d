"""Hooks that record layer inputs and output gradients, and the clipping computation.

:class:`GradSampleTracker` attaches one forward hook per *unit* (a layer with a
registered rule, or any other module owning trainable parameters directly, handled by
the :mod:`torch.func` fallback). During the user's ordinary forward pass the hook stores
the layer's inputs; a tensor hook on each output stores the gradient autograd computes
for it during ``loss.backward()``. :meth:`GradSampleTracker.clipped_sum` then evaluates
the rules, the per-example norms over *all* parameters and the clip factors, and returns
the sum of clipped per-example gradients.

Autograd's own parameter gradients are not needed (the clipped sum replaces them), so by
default each layer runs its forward on detached aliases of the parameters it owns (the
non-private weight-gradient matmul is then never computed; ``requires_grad`` and the
module's parameters are unchanged outside the forward) and the layer outputs are made
differentiable through a zero-cost autograd node where needed. Under
``DistributedDataParallel`` this holds too: ``make_private`` switches DDP's gradient
synchronisation off (the engine all-reduces the noisy sums itself).

Hugging Face models run unchanged: a pre-hook on the model notes the batch size of each
forward, and a batch-first layer called on an input broadcast over the batch (leading
dimension 1, e.g. default ``position_ids``) gets it expanded to one row per example.

Layouts: each unit has a batch dimension (:func:`discover_units`: the user's
``batch_dims``, the rule's declaration, the enclosing module's layout); records of
sequence-first layers are stored batch-first (a view with the batch moved to dimension
0), so rules see one layout. On the first step the batch-independence probe
(:mod:`privlearn.torch.probe`) checks those dimensions and that no operation mixes
examples, and again after a change that could mix them (``mixing_fingerprint``).
When the set of trainable parameters changes (a layer unfrozen or frozen after
``make_private``), the units are discovered again at the next forward pass. Forwards
recomputed during backward (non-reentrant activation checkpointing) are not recorded.
Parameters shared by several layers or calls (tied embeddings) get exact norms from the
cross terms of their factored gradients (:func:`privlearn.torch.grad_sample.cross_term`)
without materialising any per-example gradient.

The clipping computation (:meth:`GradSampleTracker.clipped_sum`) lives in
:class:`privlearn.torch.clipping.ClippingMixin`, which reads the per-step state these
hooks record; cross terms live in :mod:`privlearn.torch.cross_terms`.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten, tree_unflatten

from privlearn.errors import ParameterValueError, TrainingLoopError
from privlearn.torch import _flat_rows, _model_refusals, _param_state, _rearm, _shared_positions
from privlearn.torch import _late_writes as _late
from privlearn.torch import grad_sample as _gs
from privlearn.torch import rules as _rules  # noqa: F401  (registers every built-in rule)
from privlearn.torch._aliases import guard_alias_slots, own_parameters, refuse_alias_uses
from privlearn.torch._attached import _ATTACHED, check_not_attached
from privlearn.torch._compile import eager_callback, hookless_forward_hint
from privlearn.torch._ghost_pending import PendingProducts, batched
from privlearn.torch._held_parameters import held_parameters
from privlearn.torch._rehook import retire, run_new_pre_hooks, snapshot
from privlearn.torch._row_norms import prepare, settle
from privlearn.torch._tracker_util import (  # noqa: F401  (record_batch re-exported)
    _autocast_input,
    _autocast_state,
    _distinct_calls,
    _eager,
    _flat_sq,
    _hookable,
    _in_backward,
    _map_tensors,
    _meta,
    _mismatch_message,
    _nonfinite,
    _on_final_grad,
    _param_slots,
    _per_param_sq,
    _recomputed_outputs,
    _resolve_dim,
    _restore,
    _sanitize_record,
    _to_front,
    _trainable_signature,
    mixing_fingerprint,
    outside_hook,
    record_batch,
    record_dims,
)
from privlearn.torch._zero_rows import install_zero_row_forwards
from privlearn.torch.clipping import ClippingMixin
from privlearn.torch.cross_terms import _cross_terms  # noqa: F401  (re-exported)
from privlearn.torch.fallback import FALLBACK
from privlearn.torch.grad_sample import (
    _IN_RULE,
    DenseOuterProduct,
    LayerRule,
    Materialized,
    OuterProduct,
    Record,
    context_layout,
    get_instrumenter,
    get_rule,
    rule_evaluation,
)

__all__ = ["GradSampleTracker", "Unit", "discover_units", "record_batch"]

#: contributions kept when a rule is evaluated during backward (:meth:`
#: GradSampleTracker._evaluate_early`; anything else is evaluated again at the step):
#: per-example gradients, outer products and embedding lookups
_EARLY_TYPES = (Materialized, OuterProduct, DenseOuterProduct,
                _rules.embedding.EmbeddingContribution)
#: during backward one layer materialises its per-example gradients within at most this
#: share of the step's budget left (:func:`~privlearn.torch.grad_sample.
#: materialise_budget`)
_EARLY_SHARE = 0.25
#: rules whose contribution holds everything it needs (the layer's own input and output
#: gradient, no recomputation of the layer): evaluated during backward
_SELF_CONTAINED_RULES = (_rules.linear.linear_rule,
                         _rules.transformers.conv1d_transposed_rule,
                         _rules.embedding.embedding_rule)


@dataclass
class Unit:
    """One recorded layer: a module with a rule (or the generic fallback) and the
    trainable parameters the rule covers. ``batch_dim`` is where the module's first input
    and outputs carry the examples (resolved once, see :func:`discover_units`)."""

    name: str
    module: nn.Module
    params: tuple  # trainable parameters handled by this unit
    rule: LayerRule
    batch_dim: int = 0

    @property
    def normalised(self) -> bool:
        """Whether the records of this unit are stored batch-first (the engine moved the
        batch dimension to 0; every rule but the layout-aware ones and those that need the
        layer's own layout)."""
        return not self.rule.layout.own_layout and self.rule.layout.moves


def discover_units(model: nn.Module, batch_dims: dict[str, int] | None = None) -> list[Unit]:
    """Units of ``model``: registered layer types (with all their parameters, or only
    their own with ``scope="direct"``) and, for any other module, its directly owned
    trainable parameters (the generic fallback rule).

    The batch dimension of each unit is, in order: the user's ``batch_dims[name]`` (for
    layers whose rule takes it from the context); the rule's own declaration (e.g.
    ``nn.LSTM``: its ``batch_first``); the layout of the nearest enclosing module
    registered with :func:`~privlearn.torch.grad_sample.register_layout` (e.g.
    ``nn.TransformerEncoderLayer``); else 0.

    Raises
    ------
    ValueError
        ``batch_dims`` names a module that is not a unit, gives a dimension that is not 0
        or 1, or contradicts a layer's own ``batch_first``.
    """
    batch_dims = dict(batch_dims or {})
    units: list[Unit] = []
    covered: set[str] = set()
    layouts: dict[str, int | None] = {}  # module name -> layout it gives its descendants
    for name, mod in model.named_modules():
        parent = name.rpartition(".")[0] if name else None
        inherited = layouts.get(parent) if parent is not None else None
        own = context_layout(mod)
        layouts[name] = own if own is not None else inherited
        if any(name == c or name.startswith(c + ".") for c in covered if c != ""):
            continue
        if "" in covered:
            break
        rule = get_rule(mod)
        if parametrize.is_parametrized(mod):
            # a parametrized tensor (weight_norm, spectral_norm, ...) is computed from
            # the originals under ``mod.parametrizations``: a layer's rule would give the
            # gradient of the computed tensor, so the torch.func fallback differentiates
            # the layer's call with respect to the originals themselves
            rule = FALLBACK
            covered.add(f"{name}.parametrizations" if name else "parametrizations")
            params = (*own_parameters(mod),
                      *(p for p in mod.parametrizations.parameters() if p.requires_grad))
        elif rule is not None and rule.scope == "subtree":
            covered.add(name)
            params = tuple(p for p in mod.parameters() if p.requires_grad)
        else:  # (less a tensor a submodule registers too: its unit covers it, _aliases)
            params = held_parameters(mod, name, covered) if rule is None else own_parameters(mod)
        if not params:
            continue
        rule = rule if rule is not None else FALLBACK
        units.append(Unit(name, mod, params, rule,
                          _resolve_dim(name, mod, rule, batch_dims, inherited)))
    unknown = sorted(set(batch_dims) - {u.name for u in units})
    if unknown:
        raise ParameterValueError(
            f"batch_dims names {unknown}, which are not trainable layers of the model; give "
            "the qualified names of the layers (model.named_modules()) whose inputs carry "
            f"the batch on another dimension, e.g. {[u.name for u in units][:3]}")
    return units


class GradSampleTracker(ClippingMixin):
    """Records what the rules need and computes clipped per-example gradient sums.

    Parameters
    ----------
    model : nn.Module
        The model (unwrapped from DDP).
    loss_reduction : {"mean", "sum"}
        How the user's loss reduces over the batch. With ``"mean"`` the recorded output
        gradients are multiplied by the realised batch size of the forward pass, so the
        rules see true per-example gradients.
    skip_param_grads : bool
        Run each layer's forward on detached aliases of its handled parameters (see the
        module docstring); ``requires_grad`` is never changed.
    instrument_attention : bool
        Capture the projections of each ``nn.MultiheadAttention`` call during forward
        (a function mode entered by a forward pre-hook, see
        :class:`privlearn.torch.attention.AttentionCapture`; the module itself is not
        modified), so that their gradients are caught during ``backward()`` instead of
        recomputed.
    batch_dims : dict, optional
        ``{layer name: 0 or 1}`` for layers whose inputs carry the batch on dimension 1
        although nothing in the model says so (see :func:`discover_units`).
    check_independence : bool
        Run the batch-independence probe (:mod:`privlearn.torch.probe`) on the first step
        and after any change that could mix examples (the trainable set, a module's
        ``training`` flag, the module tree, forward hooks: ``mixing_fingerprint``; call
        signatures, module attributes, 0-d tensor arguments: :mod:`._rearm`), with the
        checks in :attr:`input_checks` (the loader's ``augment``). A tracker
        used on its own runs it at the start of :meth:`clipped_sum` (a model mixing
        examples raises :class:`~privlearn.errors.BatchDependenceError` there); False
        only for a model whose examples are known to stay apart.

    Attributes
    ----------
    version : int
        Incremented whenever the units are discovered again (parameters unfrozen or
        frozen after construction).

    Raises
    ------
    UnsupportedModuleError
        The model holds layers per-example clipping cannot handle (every one listed, as
        by :func:`privlearn.torch.validator.check_model`): BatchNorm in training, an
        Embedding with ``scale_grad_by_freq``, ``max_norm`` or ``sparse``, ...
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean",
                 skip_param_grads: bool = True, instrument_attention: bool = True,
                 batch_dims: dict[str, int] | None = None, check_independence: bool = True):
        self.model = model
        self.loss_reduction = loss_reduction
        self.batch_dims = dict(batch_dims or {})
        self.records: dict[int, list[Record]] = {}
        self._backward_passes = 0  # backward passes completed since the last clear()
        self._in_backward = False
        self._handles, self._flat, self._flat_shapes = [], {}, set()  # (_flat_rows)
        self._dummy = torch.zeros((), requires_grad=True)
        self._skip_param_grads = skip_param_grads
        self._instrument_attention = instrument_attention
        #: factor the loss was multiplied by before ``backward()`` (a static fp16 loss
        #: scale): recorded gradients are divided by it before clipping
        self.loss_scale = 1.0
        #: examples dropped from the last clipped sum because their gradient overflowed
        #: (an int, or a tensor on the device: see :attr:`last_overflow_count`)
        self._overflow = 0
        self._batch_hint = 0  # batch size of the model's current forward (root input)
        self._recompute_unrecorded: str | None = None
        self._captured: dict[int, dict] = {}
        self._capturing: dict[int, list] = {}
        self._swapped: list = []
        self._swap_stack: dict[int, list] = {}  # per unit: what each open call swapped
        self.version = 0
        self._probe_enabled = bool(check_independence)
        self._probe_pending = self._probe_enabled
        self._probe_inputs = None  # (args, kwargs, autocast state) of the step's forward
        self._probe_buffers = None  # the model's buffers before that forward
        self._probe_later: list = []  # (inputs, buffers) of later forwards (the first may be stray)
        self._probe_others: list = []  # those of the batch the probe runs on too
        #: what is left of the step's budget of materialised per-example gradients
        #: (:data:`~privlearn.torch.grad_sample.STEP_MATERIALISE_BUDGET_BYTES`), shared by
        #: the rules evaluated during backward and those evaluated at the step
        self._budget_left = [_gs.STEP_MATERIALISE_BUDGET_BYTES]
        self._not_early: set[int] = set()  # units whose rule gave another contribution
        #: during backward, the last input Gram matrix (shared by the layers of one input,
        #: ``_ghost_norms.SHARED_GRAM``) and the Gram products reduced by groups
        #: (``_ghost_pending``); the last autocast copy of an input (shared likewise)
        self._gram_slot, self._pending, self._cast_slot = [], PendingProducts(), []
        #: the model's tree, training flags and hooks at the last forward
        #: (``mixing_fingerprint``): a change re-arms the probe
        self._mixing_shape: tuple | None = None
        self._calls: set = set()  # the forwards' signatures seen (_call_signature)
        #: checks of the step's inputs run with the probe (the loader's ``augment``)
        self.input_checks: list = []
        self._last_inputs: list = []  # (name, weak reference) of the last forward's inputs
        self._probing = False
        #: why the model's last forward with gradients enabled was not recorded ("eval":
        #: the model was in eval mode), for the message of a step with nothing recorded
        self.unrecorded_forward: str | None = None
        #: ids of clipped parameters that received a gradient outside their layers
        self.outside_uses: set[int] = set()
        self.alias_uses: dict[int, str] = {}  # id -> name, used by a module registering it again
        check_not_attached(model)
        from privlearn.torch.validator import check_model

        # the layers per-example clipping cannot handle (BatchNorm, an Embedding with
        # scale_grad_by_freq, ...) refused here, as make_private and a rediscovery do:
        # their rules would give wrong per-example gradients, or fail untyped at the step
        check_model(model)
        self._root_handle = model.register_forward_pre_hook(_eager(self._root_pre_hook),
                                                            with_kwargs=True)
        try:
            self._install()
        except BaseException:  # the model is left as it was: no hook of a tracker not made
            self._uninstall()
            self._root_handle.remove()
            raise
        self.born = snapshot(model)  # the parameters at make_private (_rehook)
        me = weakref.ref(self)
        for module in model.modules():
            _ATTACHED[module] = me

    @property
    def last_overflow_count(self) -> int:
        """Examples dropped from the last clipped sum because their gradient overflowed
        (0 when none). Kept on the device by the step; reading it reads it back."""
        n = self._overflow
        return int(n) if isinstance(n, torch.Tensor) else n

    @last_overflow_count.setter
    def last_overflow_count(self, value) -> None:
        self._overflow = value

    # ------------------------------------------------------------------ units and hooks
    def _install(self) -> None:
        """Discover the units and attach their hooks."""
        self.units = discover_units(self.model, self.batch_dims)
        self._flat.clear()  # unit indices change: groupings are verified again
        self._signature = self._trainable_signature()
        seen: dict[int, int] = {}
        for u in self.units:
            for p in u.params:
                seen[id(p)] = seen.get(id(p), 0) + 1
        self.shared = {k for k, v in seen.items() if v > 1}
        self.params = []
        ids: set[int] = set()
        for u in self.units:
            for p in u.params:
                if id(p) not in ids:
                    ids.add(id(p))
                    self.params.append(p)
        #: ids of the parameters the engine clips and noises (the one update set)
        self.param_ids = frozenset(ids)
        for i, u in enumerate(self.units):
            if u.rule.layout.expand_broadcast and u.normalised and u.batch_dim == 0:
                h = u.module.register_forward_pre_hook(_eager(self._expand_pre_hook),
                                                       with_kwargs=True)
                self._handles.append(h)
            # first: the output forward returned, before user hooks that change it
            h = u.module.register_forward_hook(_eager(self._make_hook(i)), with_kwargs=True,
                                               prepend=True)
            self._handles.append(h)
        # attention layers whose projections are captured during forward: a side table
        # of what each call captured (keyed by module identity, emptied by the record
        # hook of the same call) and the capture modes currently entered
        if self._instrument_attention:
            for u in self.units:
                if get_instrumenter(u.module) is not None:
                    self._handles.append(u.module.register_forward_pre_hook(
                        _eager(self._capture_enter), with_kwargs=True))
                    self._handles.append(u.module.register_forward_hook(
                        _eager(self._capture_exit), prepend=True, always_call=True))
        # layers torch cannot run on a zero-row (empty Poisson) batch
        self._handles.extend(install_zero_row_forwards(self.model))
        if self._skip_param_grads:
            for u in self.units:
                slots = _param_slots(u.module, u.params)
                if not slots:
                    continue
                self._swapped.append((u, slots))
                self._handles.append(u.module.register_forward_pre_hook(
                    _eager(self._make_detach_hook(u, slots))))
                self._handles.append(u.module.register_forward_hook(
                    _eager(self._make_restore_hook(u, slots)), always_call=True))
            # inside its layers a parameter is replaced by a detached alias, so autograd
            # reaches the parameter itself only through a use outside them (a functional
            # F.linear(h, emb.weight)): that gradient is not per example
            watched = {id(p): p for u, _ in self._swapped for p in u.params}
            for p in watched.values():
                self._handles.append(p.register_hook(self._make_outside_hook(p)))
        self._handles.extend(guard_alias_slots(self))  # a tensor registered a second time
        self._handles.extend((*_rearm.install(self), *_param_state.install(self, FALLBACK)))

    def _trainable_signature(self) -> tuple:
        """Fingerprint of the trainable set, compared at every forward (a subclass for
        sharded models fingerprints names: FSDP2 swaps the parameter objects)."""
        return _trainable_signature(self.model)

    def _make_outside_hook(self, param):
        return outside_hook(self, param)

    def check_outside_uses(self) -> None:
        """Refuse a step in which a clipped parameter also received a gradient from a use
        outside its layers (see :meth:`_install`): that part of its gradient is neither
        per example nor clipped."""
        if not self.outside_uses:
            return
        refuse_alias_uses(self)
        hint = hookless_forward_hint(self)  # before clear(): a model compiled before make_private
        names = {id(v): n for n, v in self.model.named_parameters()}
        used = sorted(names.get(k, "?") for k in self.outside_uses)
        evaluating = sorted({u.name or "<model>" for u in self.units if not u.module.training
                             and any(id(p) in self.outside_uses for p in u.params)})
        for p in self.params:  # the raw gradient autograd left there: dropped, not released
            p.grad = None if id(p) in self.outside_uses else p.grad
        self.outside_uses = set()
        self.clear()
        if evaluating:
            raise TrainingLoopError(
                f"layer(s) {evaluating} ran in eval mode inside a model in training mode: "
                "the engine records per-example gradients only in training mode, so their "
                f"parameters {used} got a gradient that is neither per example nor "
                "clipped. Keep trainable layers in training mode (to switch dropout off, "
                "set its probability to 0). No step was taken and nothing was released")
        raise TrainingLoopError(
            f"parameter(s) {used} are used outside their layers as well (a functional call "
            "such as F.linear(h, self.emb.weight) or x @ self.lin.weight in forward, or a "
            "layer called as layer.forward(x), which skips its hooks: call layer(x)): the "
            "engine computes per-example gradients layer by layer, so the gradient of that "
            "use is neither per example nor clipped. Route every use through a module: "
            "e.g. a tied output head as an nn.Linear whose weight is the embedding's "
            "(head.weight = emb.weight; the engine clips the tied sum), or a layer rule "
            "for a custom module (privlearn.torch.register_rule). A penalty on the "
            "parameters added to the loss (an L2 term such as 1e-4 * sum(p.pow(2).sum() "
            "for p in model.parameters())) is such a use too: give the optimizer "
            "weight_decay instead (applied after the DP step, to the parameters, not the "
            "data). No step was taken and nothing was released" + hint)

    def _uninstall(self) -> None:
        retire(self._handles)  # a call running now may still hold them (_rehook)
        for h in self._handles:
            h.remove()
        self._handles = []
        for stack in self._capturing.values():
            while stack:
                stack.pop().__exit__(None, None, None)
        self._capturing = {}
        self._captured = {}
        for u, slots in self._swapped:  # a parameter assigned since is the user's
            _restore(u, slots, keep_assigned=True)
        self._swapped = []
        self._swap_stack = {}

    def _rediscover(self) -> None:
        """The set of trainable parameters changed (unfreezing, freezing): discover the
        units again, check the new layers, and probe batch independence again."""
        if self.records:
            self.clear()
            raise TrainingLoopError(
                "the model's trainable parameters changed between a forward pass and "
                "optimizer.step(); change requires_grad only between steps (after step(), "
                "before the next forward)")
        from privlearn.torch.validator import check_model

        self._uninstall()
        try:
            check_model(self.model)
        finally:
            self._install()
        self.version += 1
        self._probe_pending = self._probe_enabled

    # ------------------------------------------------------------------ attention capture
    def _capture_enter(self, module, args, kwargs):
        """Enter the registered instrumenter's mode (:func:`~privlearn.torch.grad_sample.
        register_instrumenter`, e.g. :class:`~privlearn.torch.attention.AttentionCapture`)
        for this call (training, gradients on, not a rule's own evaluation); in a
        checkpoint recomputation too, so that the recomputed forward saves the tensors
        the first one saved, but what it captures is dropped."""
        if _IN_RULE.get() or not module.training or not torch.is_grad_enabled():
            return None
        key, recomputed = id(module), _in_backward()

        def sink(extra, key=key):
            if not recomputed:
                self._captured[key] = extra

        mode = get_instrumenter(module)(sink)
        mode.__enter__()
        self._capturing.setdefault(key, []).append(mode)
        return None

    def _capture_exit(self, module, args, output):
        """Leave the capture mode entered for this call (also when forward raised)."""
        stack = self._capturing.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)
        return None

    # ------------------------------------------------------------------ recording
    def _root_pre_hook(self, module, args, kwargs):
        """At the model's forward: follow changes of the trainable parameters, remember
        the batch size (the leading dimension of its first tensor input: ``input_ids``,
        ``pixel_values``, ...) and, while the batch-independence probe is pending, the
        inputs of the step's first forward."""
        if (_IN_RULE.get() or self._probing or not module.training or _in_backward()
                or not torch.is_grad_enabled()):
            if (not module.training and torch.is_grad_enabled() and not self._probing
                    and not _IN_RULE.get() and not _in_backward()):
                self.unrecorded_forward = _model_refusals.eval_forward(self)  # hooks refused
            return None
        self.unrecorded_forward = None
        _model_refusals.refuse_hooks(self, "a training forward (registered after make_private)")
        rehooked = self._trainable_signature() != self._signature
        if rehooked:
            _model_refusals.refuse_substituted_parameters(self.model)  # functional_call
            self._rediscover()
        shape = mixing_fingerprint(self.model)
        if shape != self._mixing_shape:  # first forward, or a change that can mix examples
            self._mixing_shape = shape
            self._probe_pending = self._probe_enabled
            if any(u.rule is not FALLBACK and _gs.replaced_forward(u.module) for u in self.units):
                self._rediscover()  # a layer's forward replaced since: its rule no longer holds
        if self._probe_enabled and _rearm.changed(self, args, kwargs):  # other flags, attri-
            self._probe_pending = True  # butes, 0-d tensors, a larger batch: a path that may mix
        _flat_rows.rearm(self, args, kwargs)  # inputs of shapes a grouping was not checked at
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                self._batch_hint = v.shape[0]
                break
        # the inputs, by name, held weakly: a non-finite gradient is traced back to them
        self._last_inputs = [
            *((f"positional argument {i}", weakref.ref(v)) for i, v in enumerate(args)
              if isinstance(v, torch.Tensor)),
            *((k, weakref.ref(v)) for k, v in kwargs.items() if isinstance(v, torch.Tensor))]
        if self._probe_pending and (self._probe_inputs is None or len(self._probe_later) < 8):
            seen = (args, dict(kwargs), _autocast_state())
            # the buffers and plain attributes before this forward: the probe's passes start
            # from them (a running maximum this forward moved still follows the batch)
            buffers = _late.start_state(self.model)
            if self._probe_inputs is None:
                self._probe_inputs, self._probe_buffers, self._probe_later = seen, buffers, []
            else:
                self._probe_later.append((seen, buffers))
        # hooks placed on this module by the rediscovery: not in this call's snapshot
        return run_new_pre_hooks(module, self._handles, args, kwargs) if rehooked else None

    def _step_inputs(self, examples: int | None):
        """The inputs the probe runs on: those of the first forward since the last step
        whose batched inputs hold the step's ``examples`` rows (an earlier forward with
        gradients may be a stray one, a shape check on a few examples before training,
        that no backward used), else the first forward's. The later forwards of the batch
        on other inputs (a second view, other keywords) are kept in ``_probe_others``:
        the probe runs on each, since a path only they take may mix examples."""
        first, later, self._probe_later = self._probe_inputs, self._probe_later, []
        self._probe_others = []
        if first is None:
            return None
        batch = [(s, b) for s, b in ((first, self._probe_buffers), *later)
                 if any(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == examples
                        for t in tree_flatten((s[0], s[1]))[0])]
        if not batch:
            return first
        self._probe_buffers = batch[0][1]
        self._probe_others = _distinct_calls(batch)[1:]
        return batch[0][0]

    @contextlib.contextmanager
    def forward_batch_size(self, examples: int):
        """Within the block, a batch-first layer called on an input broadcast over the
        batch gets it expanded to ``examples`` rows (see :meth:`_expand_pre_hook`), for
        forwards the tracker does not record (the batch-independence probe's)."""
        hint, self._batch_hint = self._batch_hint, examples
        try:
            yield
        finally:
            self._batch_hint = hint

    def _expand_pre_hook(self, module, args, kwargs):
        """A batch-first unit called on an input broadcast over the batch (leading
        dimension 1 while the model's batch has B > 1, e.g. Hugging Face's default
        ``position_ids`` of shape ``(1, T)``) gets that input expanded to B rows (a
        stride-0 view): its output, and so its recorded output gradient, then has one row
        per example, and the downstream broadcast gives the same values. Without it the
        layer's gradient would be the sum over the batch, which cannot be clipped per
        example. Only units whose rule allows it and whose batch dimension is 0 (a
        sequence-first layer's leading dimension is time); the batch-independence probe
        checks that dimension."""
        b = self._batch_hint
        if b <= 1 or _IN_RULE.get() or not module.training:
            return None
        if args:
            x = args[0]
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
                return (x.expand(b, *x.shape[1:]), *args[1:]), kwargs
            return None
        if kwargs:
            k, x = next(iter(kwargs.items()))
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
                kwargs = dict(kwargs)
                kwargs[k] = x.expand(b, *x.shape[1:])
                return args, kwargs
        return None

    def _make_detach_hook(self, unit: Unit, slots):
        """During the unit's forward its parameters are replaced by detached aliases
        (same storage), so autograd never computes their non-private gradient (the
        weight-gradient matmul of every layer) while ``requires_grad`` stays as the
        user set it (``print_trainable_parameters``, optimizers and checkpoints see the
        usual flags). The post-hook (also run when the forward raises) puts them back."""
        after = unit.rule.after_swap
        swapped = self._swap_stack.setdefault(id(unit), [])

        def pre(module, args):
            if _IN_RULE.get() or not module.training or not torch.is_grad_enabled():
                swapped.append(())
                return None
            # the alias is of the tensor the slot holds now: the parameter itself, or the
            # unsharded copy FSDP2's pre-forward hook (which runs first) put there
            done = []
            for owner, name, _ in slots:
                cur = owner._parameters.get(name)
                if cur is not None:  # (functional_call's own tensors refused)
                    alias = _model_refusals.alias_of_slot(cur, name, swapped)
                    owner._parameters[name] = alias
                    done.append((owner, name, cur, alias))
            swapped.append(tuple(done))
            if after is not None:
                after(unit.module)
            return None

        return pre

    def _make_restore_hook(self, unit: Unit, slots):
        swapped = self._swap_stack.setdefault(id(unit), [])

        def post(module, args, output):
            done = swapped.pop() if swapped else None
            if done is None:
                _restore(unit, slots)
                return None
            changed = False
            for owner, name, cur, alias in done:  # unless FSDP2 resharded in between
                if owner._parameters.get(name) is alias:
                    owner._parameters[name] = cur
                    changed = True
            if changed and unit.rule.after_swap is not None:
                unit.rule.after_swap(unit.module)
            return None

        return post

    def _make_hook(self, index: int):
        dummy = self._dummy
        grad_hook = self._grad_hook
        is_grad_enabled = torch.is_grad_enabled
        Tensor = torch.Tensor
        unit = self.units[index]
        move = unit.batch_dim if unit.normalised and unit.batch_dim != 0 else None
        early = unit if unit.rule.early or unit.rule.compute in _SELF_CONTAINED_RULES else None
        casts_input = unit.rule.casts_input

        def hook(module, args, kwargs, output):
            if _IN_RULE.get() or not module.training or not is_grad_enabled():
                return None
            if _in_backward():
                # a forward recomputed during backward (activation checkpointing): the
                # gradients flow through the first forward's outputs, recorded then;
                # the outputs are given the nodes of the first forward so that the
                # recomputed graph saves the same tensors
                if not self.records.get(index):
                    self._recompute_unrecorded = unit.name
                return _recomputed_outputs(output, dummy)
            x0 = args[0] if args else None
            args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
            if move is not None and args and isinstance(args[0], Tensor):
                args = (_to_front(args[0], move), *args[1:])
            if casts_input and args and not self._probe_pending:
                args = _autocast_input(args, output, x0 if move is None else None,
                                       self._cast_slot)
            rec = Record(
                args=args,
                kwargs={k: (v.detach() if isinstance(v, Tensor) else v)
                        for k, v in kwargs.items()} if kwargs else {},
                grad_outputs=[],
                outputs_meta=[],
            )
            rec.extra = self._captured.pop(id(module), None)
            if not unit.normalised:
                rec.batch_dim = unit.batch_dim
            records = self.records
            if index in records:
                records[index].append(rec)
            else:
                records[index] = [rec]
            if type(output) is Tensor:  # fast path: one output tensor
                rec.outputs_meta.append(_meta(output, move))
                rec.grad_outputs.append(None)
                if not output.is_floating_point():
                    return None
                hooked = _hookable(output, dummy, own_node=False)
                _on_final_grad(hooked, grad_hook(rec, 0, move, early))
                return hooked if hooked is not output else None
            flat, spec = tree_flatten(output)
            rec.out_spec = spec
            changed = False
            new_flat = []
            for o in flat:
                if isinstance(o, Tensor):
                    j = len(rec.outputs_meta)
                    rec.outputs_meta.append(_meta(o, move))
                    rec.grad_outputs.append(None)
                    if o.is_floating_point():
                        # own node: the hook sees only the gradient from outside the
                        # layer (an output the layer itself consumed, e.g. y in
                        # (y, f(y)), would otherwise bring f's share in twice)
                        o = _hookable(o, dummy, own_node=True)
                        changed = True
                        _on_final_grad(o, grad_hook(rec, j, move))
                new_flat.append(o)
            return tree_unflatten(new_flat, spec) if changed else None

        return _shared_positions.expand_shared(self, index,
                                               _flat_rows.group_rows(self, index, hook))

    def _grad_hook(self, rec: Record, j: int, move: int | None = None,
                   early: Unit | None = None):
        tracker = self

        def fn(g):
            if not tracker._in_backward:
                tracker._begin_backward()
            if move is not None:
                g = _to_front(g, move)
            prev = rec.grad_outputs[j]
            rec.grad_outputs[j] = g if prev is None else prev + g
            if early is not None and prev is None and not tracker._probe_pending:
                tracker._evaluate_early(early, rec)
        return fn

    def _evaluate_early(self, unit: Unit, rec: Record) -> None:
        """Evaluate the rule of a single-output layer as soon as its output gradient is
        known, during backward, with its per-example squared norms (so that the step
        only weighs and adds; on an accelerator, fewer launches at the step):

        * a rule declared ``early`` (:class:`~privlearn.torch.grad_sample.LayerRule`), a
          normalisation layer's: its per-example gradients are one row per example, its
          records one row per position, released now instead of at ``step()``;
        * an outer-product layer (``nn.Linear``, transformers' ``Conv1D``): ghost norms
          from the recorded input and output gradient (kept for the clipped sum), or the
          per-example gradients materialised within the step's budget (the records
          released); an ``nn.Embedding``: the norms from its ids and output gradient.

        (After the first step only: the batch-independence probe and the checks of the
        first step read the records.)"""
        if id(unit) in self._not_early or (
                unit.rule.compute is _rules.transformers.conv1d_transposed_rule
                and _rules.transformers._RULE_STATE.get(unit.module) != "ok"):
            return  # (a class-name rule is checked against the fallback at the step)
        examples = record_batch(unit, rec)
        if examples == 0:
            return  # an empty Poisson batch: nothing to clip (the step sees no rows)
        with torch.no_grad(), rule_evaluation(), batched(self._pending, self._gram_slot), \
                _gs.materialise_budget(0, left=self._budget_left, share=_EARLY_SHARE):
            c = unit.rule(unit.module, rec, unit.params)
            if not isinstance(c, _EARLY_TYPES):
                if not unit.rule.early:
                    self._not_early.add(id(unit))  # not tried again
                return  # kept as recorded: evaluated at the step as usual
            prepare(c)  # cached: the step sums them (and forms the rows' norms)
        rec.early, rec.examples = c, examples
        rec.args, rec.kwargs = (), {}
        rec.grad_outputs = [None] * len(rec.grad_outputs)

    def _begin_backward(self) -> None:
        """First recorded gradient of a backward pass: refuse a second backward pass
        before the step (gradient accumulation), which would add example i of one
        micro-batch to example i of the other and clip the pair as one example."""
        if self._backward_passes >= 1:
            self.records = {}
            self._backward_passes = 0
            raise TrainingLoopError(
                "a second backward() before optimizer.step(): gradient accumulation over "
                "micro-batches is not supported this way (the engine would clip example i "
                "of each micro-batch together, so one example could move the update by "
                "more than max_grad_norm). Use make_private(..., max_physical_batch_size=k) "
                "to split large batches into chunks of k examples (call backward() and "
                "step() once per chunk; the noise is added once per logical batch), and "
                "call optimizer.step() after every backward(). Several losses of one "
                "batch (a GAN discriminator's real and fake terms): add them and call "
                "backward() once. A gradient penalty (torch.autograd.grad through the "
                "model, then backward()) is such a second pass: not supported. An earlier "
                "pass through the model for another purpose (a GAN generator's loss "
                "backpropagated through this discriminator, torch.autograd.grad of the "
                "inputs for adversarial examples): call p.optimizer.zero_grad() after it, "
                "before this step's forward pass (model.zero_grad() leaves the engine's "
                "records)")
        self._in_backward = True
        self._budget_left = [_gs.STEP_MATERIALISE_BUDGET_BYTES]
        self._settled = None
        self._gram_slot.clear()
        self._pending.flush()
        torch.autograd.Variable._execution_engine.queue_callback(eager_callback(self._end_backward))

    def _end_backward(self) -> None:
        self._in_backward = False
        self._gram_slot.clear()
        self._pending.flush()  # (before the groups' norms below)
        self._backward_passes += 1
        # the norms of the layers evaluated during backward formed by groups (the step
        # uses them where it sees the same contributions)
        self._settled = settle([r.early for recs in self.records.values() for r in recs
                                if r.early is not None])

    def has_gradients(self) -> bool:
        """Whether a backward pass reached a recorded layer since the last clear."""
        return any(r.has_grad() for recs in self.records.values() for r in recs)

    def clear_gradients(self) -> None:
        """What ``optimizer.zero_grad()`` clears: the records whose backward pass has run
        and the count of backward passes. The records of a forward pass whose backward is
        still to come stay (with the probe's inputs), so the common loop order ``out =
        model(x); optimizer.zero_grad(); loss.backward(); optimizer.step()`` trains on the
        batch as ``zero_grad(); out = model(x); ...`` does."""
        pending = {i: [r for r in recs if not r.has_grad()]
                   for i, recs in self.records.items()}
        self.records = {i: recs for i, recs in pending.items() if recs}
        self.outside_uses, self._settled = set(), None
        self._backward_passes = 0
        self._in_backward = False
        if not self.records:
            self._captured = {}
            self._probe_inputs = self._probe_buffers = None
            self._probe_later, self._probe_others = [], []

    def clear(self) -> None:
        self.outside_uses, self._settled = set(), None
        self._gram_slot.clear()
        self._pending.flush()
        self.records = {}
        self._captured = {}
        self._backward_passes = 0
        self._in_backward = False
        self._probe_inputs = self._probe_buffers = None
        self._probe_later, self._probe_others = [], []

    def detach(self) -> None:
        """Remove the hooks and put the handled parameters back."""
        self._uninstall()
        self._root_handle.remove()
        self.clear()
        for module, ref in list(_ATTACHED.items()):
            if ref() is self:
                del _ATTACHED[module]

    # ------------------------------------------------------------------ probe
    def check_independence(self, examples: int | None) -> None:
        """Before the first step (and after a change that re-armed it), probe that each
        example's outputs depend on that example alone and that every layer's batch
        dimension is the one the engine uses (:func:`privlearn.torch.probe.probe`). Needs a
        batch of at least two examples: until one comes, nothing can mix examples.

        Raises
        ------
        BatchDependenceError
            Examples are mixed, or a layer carries the batch on another dimension.
        """
        if not self._probe_pending:
            return
        # rows each layer saw first (clearest message; flattened per example); buffers to undo
        flat, start = _flat_rows.candidates(self, examples), self._probe_buffers
        inputs, self._probe_inputs = self._step_inputs(examples), None
        others, self._probe_others = self._probe_others, []
        if inputs is None or not self.records or examples is None or examples < 2:
            return _flat_rows.adopt(self, flat, examples, inputs, verified=False)
        from privlearn.torch.probe import probe

        self._probing = True
        try:
            _flat_rows.check_inputs(self, flat, examples, inputs)  # rows the probe can group
            for check in self.input_checks:  # what made the inputs (augment) first
                check()
            probe(self, inputs, examples)
            for seen, buffers in others:  # the batch's other forwards (_step_inputs)
                self._probe_buffers = buffers
                probe(self, seen, examples)
            _late.settle(self)  # buffers the step wrote that no pass wrote: refused
        except BaseException:
            _late.undo(self, start)  # the refused forward's writes leave the model
            self.clear()
            raise
        finally:
            self._probing = False
            self._probe_buffers = self._probe_writes = None
        _flat_rows.adopt(self, flat, examples, inputs, verified=True)
        self._probe_pending = False

