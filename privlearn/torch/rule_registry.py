"""The registry of layer rules: what the engine knows about each kind of layer
(:class:`LayerRule`), registered by type or by predicate, the layouts container modules
give their layers, and the instrumenters of layers whose rules need intermediates of
their forward pass. Moved out of :mod:`privlearn.torch.grad_sample`, which re-exports
every name.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from privlearn._type_registry import TypeRegistry, first_in_mro
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

if TYPE_CHECKING:  # grad_sample imports this module
    from privlearn.torch.grad_sample import Contribution, Record

__all__ = [
    "Layout",
    "LAYOUT_FIELDS",
    "LayerRule",
    "Rule",
    "RULES",
    "register_rule",
    "PREDICATE_RULES",
    "register_predicate_rule",
    "get_rule",
    "LAYOUTS",
    "register_layout",
    "PREDICATE_LAYOUTS",
    "register_predicate_layout",
    "context_layout",
    "INSTRUMENTERS",
    "register_instrumenter",
    "get_instrumenter",
]

Rule = Callable[[nn.Module, "Record", Sequence[nn.Parameter]], "Contribution"]


#: The fields of :class:`Layout`, once accepted by :class:`LayerRule` and
#: :func:`register_rule` one by one (deprecated there: pass ``layout=Layout(...)``).
LAYOUT_FIELDS = ("batch_dim", "own_layout", "moves", "expand_broadcast", "batch_size",
                 "record_dims")


@dataclass(frozen=True)
class Layout:
    """Where a layer's recorded tensors carry the examples, and what the engine may do
    to their layout: the part of a :class:`LayerRule` that the tracker, the probe and the
    generic fallback read. A value object: ``Layout(batch_dim=0, own_layout=True)``.

    Attributes
    ----------
    batch_dim : int, callable or None
        Where the layer's first input and its outputs carry the examples: an int, a
        function of the module (``lambda m: 0 if m.batch_first else 1``: "ask the module"),
        or None: "from the context" -- the user's ``batch_dims`` option for this layer,
        else the layout of the nearest enclosing module registered with
        :func:`register_layout`, else 0.
    own_layout : bool
        The rule reads the recorded tensors in the module's own layout (it handles
        ``batch_first`` itself, e.g. ``nn.MultiheadAttention``, ``nn.LSTM``); the engine
        passes them unchanged, and ``batch_size`` / ``record_dims`` say where the
        examples are.
    moves : bool
        Whether the engine may move the batch dimension to 0 for this rule (False: the
        record keeps the layer's layout and says where the examples are in
        ``Record.batch_dim``; the generic fallback, which re-runs the layer on single
        examples, needs the layout the layer expects).
    expand_broadcast : bool
        An input broadcast over the batch (batch dimension of size 1 while the model's
        batch has ``B > 1``, e.g. Hugging Face's default ``position_ids`` of shape
        ``(1, T)``) is expanded to ``B`` rows before the layer runs, so that its output
        gradient has one row per example. Only for batch-first layers.
    batch_size : callable or None
        ``batch_size(module, record) -> int`` for ``own_layout`` rules (default: the
        size of the first input along ``batch_dim``).
    record_dims : callable or None
        ``record_dims(module, record, batch) -> (arg_dims, kwarg_dims, output_dims)``: the
        batch dimension of every recorded tensor (None: shared by all examples), used to
        drop single examples (overflowing gradients) and by the generic fallback.
        Default: the dimension of size ``batch`` at position 0 (batch-first records).
    """

    batch_dim: int | Callable[[nn.Module], int] | None = None
    own_layout: bool = False
    moves: bool = True
    expand_broadcast: bool = True
    batch_size: Callable[[nn.Module, Record], int] | None = None
    record_dims: Callable | None = None

    def __post_init__(self) -> None:
        if self.own_layout and self.batch_dim is None:
            raise ConfigurationError(
                "own_layout=True needs batch_dim (an int, or a function of the module such "
                "as lambda m: 0 if m.batch_first else 1), got batch_dim=None: declare where "
                "the module carries the examples, or leave own_layout=False")

    def declared_dim(self, module: nn.Module) -> int | None:
        """The batch dimension declared for ``module`` (None: from the context)."""
        d = self.batch_dim
        return d(module) if callable(d) else d


@dataclass(frozen=True, init=False)
class LayerRule:
    """Everything the engine knows about one kind of layer: how to compute its
    contribution (``compute``), how its tensors are laid out (``layout``, a
    :class:`Layout`) and how the engine treats it. Registered with :func:`register_rule`
    (by type) or :func:`register_predicate_rule`; the engine never tests layer types
    itself.

    The layout keywords ``batch_dim``, ``own_layout``, ``moves``, ``expand_broadcast``,
    ``batch_size`` and ``record_dims`` of the constructor (and the attributes of the same
    names) are deprecated: they are ``layout=Layout(...)`` and ``rule.layout.<name>``.

    Attributes
    ----------
    compute : callable
        ``compute(module, record, params) -> Contribution``, linear in the recorded output
        gradients. Unless ``layout.own_layout``, the record it receives is *batch-first*: the
        engine has moved the batch dimension of the first input and of every output (and
        its gradient) to position 0.
    layout : Layout
        Where the recorded tensors carry the examples (default ``Layout()``: batch
        dimension from the context, tensors moved batch-first).
    scope : {"subtree", "direct"}
        "subtree": the rule covers every trainable parameter of the module and its
        children; "direct": only the parameters the module owns itself (its children are
        units of their own).
    after_swap : callable or None
        ``after_swap(module)``, called after the engine replaced the module's parameters
        by detached aliases for a forward pass and after it put them back (e.g.
        ``nn.RNNBase`` rebuilds its flat weight list).
    observe : callable or None
        ``observe(module, args, kwargs, output) -> list[(tensor, dim)]``: batch-first
        views of what the layer received and produced, compared by the batch-independence
        probe (default: the first input and the first floating output, batch dimension
        ``layout.batch_dim``).
    check : callable or None
        ``check(module) -> list[str]``: configurations of the module the rule cannot
        handle, each a sentence saying what to do instead; listed with every other
        problem by :func:`privlearn.torch.validator.validate` before training (for layers
        matched by a predicate, which :func:`~privlearn.torch.validator.register_validator`
        cannot key by type).
    early : bool
        The rule's per-example gradients are smaller than what it reads (a normalisation
        layer's: one row per example against the input and output gradient of every
        position): the tracker evaluates it during backward, as soon as the layer's
        output gradient is known, and releases the recorded tensors then, instead of
        keeping them until ``step()``. The rule must return a
        :class:`~privlearn.torch.grad_sample.Materialized` contribution for a
        single-output layer.
    casts_input : bool
        Under autocast the layer computes from its first input cast to the autocast
        dtype (a matmul layer: ``nn.Linear``): after the first step the engine records
        that cast instead of the float32 input (half the memory; the rule's matmuls then
        run in that dtype with float32 accumulation where
        :data:`~privlearn.torch.grad_sample.LOW_PRECISION_MATMUL` allows). Recorded only
        when the layer's output has the autocast dtype.
    """

    compute: Rule
    layout: Layout
    scope: str
    after_swap: Callable[[nn.Module], None] | None
    observe: Callable | None
    check: Callable[[nn.Module], list[str]] | None
    early: bool
    casts_input: bool

    def __init__(self, compute: Rule, layout: Layout | None = None, *,
                 scope: str = "subtree", after_swap: Callable[[nn.Module], None] | None = None,
                 observe: Callable | None = None,
                 check: Callable[[nn.Module], list[str]] | None = None,
                 early: bool = False, casts_input: bool = False, **layout_fields: Any) -> None:
        unknown = sorted(set(layout_fields) - set(LAYOUT_FIELDS))
        if unknown:
            raise ParameterTypeError(
                f"LayerRule got unknown option(s) {unknown}; the options are layout "
                "(a Layout), scope, after_swap, observe, check, early and casts_input")
        if scope not in ("subtree", "direct"):
            raise ParameterValueError(
                f"scope must be 'subtree' or 'direct', got {scope!r}: 'subtree' when the "
                "rule covers the parameters of the module and its children, 'direct' when "
                "it covers only those the module owns")
        if layout is not None and not isinstance(layout, Layout):
            raise ParameterTypeError(
                f"layout must be a privlearn.torch.Layout, got {layout!r}; e.g. "
                "layout=Layout(batch_dim=0)")
        if layout_fields:  # the deprecated spelling: one keyword per layout field
            layout = Layout(**_flat_layout({**layout_fields, "layout": layout}, "LayerRule"))
        values = dict(compute=compute, layout=Layout() if layout is None else layout,
                      scope=scope, after_swap=after_swap, observe=observe, check=check,
                      early=bool(early), casts_input=bool(casts_input))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __call__(self, module: nn.Module, record: Record, params) -> Contribution:
        return self.compute(module, record, params)

    def declared_dim(self, module: nn.Module) -> int | None:
        """The batch dimension the rule declares for ``module`` (None: from the context);
        ``self.layout.declared_dim(module)``."""
        return self.layout.declared_dim(module)


def _deprecated_layout_attribute(name: str) -> property:
    def get(self: LayerRule) -> Any:
        warnings.warn(f"LayerRule.{name} is deprecated; read rule.layout.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(self.layout, name)

    get.__doc__ = f"Deprecated: ``layout.{name}``."
    return property(get)


for _name in LAYOUT_FIELDS:
    setattr(LayerRule, _name, _deprecated_layout_attribute(_name))
del _name


#: The rules registered by layer type (:func:`register_rule`), and after them by
#: predicate (:func:`register_predicate_rule`, in ``RULES.predicates``).
RULES: TypeRegistry[LayerRule] = TypeRegistry("layer rules", register_with="register_rule")


def _flat_layout(options: dict, where: str) -> dict:
    """Pop the deprecated layout keywords out of ``options`` (warning once for them)."""
    flat = {k: options.pop(k) for k in LAYOUT_FIELDS if k in options}
    if flat:
        if options.get("layout") is not None:
            raise ConfigurationError(
                f"{where} got layout= and the layout keywords {sorted(flat)}; pass only "
                f"layout=Layout({', '.join(f'{k}=...' for k in flat)})")
        warnings.warn(
            f"{where}: the keywords {', '.join(sorted(flat))} are deprecated; pass "
            f"layout=Layout({', '.join(f'{k}=...' for k in flat)}) "
            "(privlearn.torch.Layout)", DeprecationWarning, stacklevel=3)
    return flat


def _as_rule(fn, options: dict, flat: dict) -> LayerRule:
    """``fn`` (a function or a :class:`LayerRule`) as a rule with ``options``; ``flat``:
    layout fields given one by one, applied to ``fn``'s layout."""
    if flat:
        start = fn.layout if isinstance(fn, LayerRule) else Layout()
        options = {**options, "layout": dataclasses.replace(start, **flat)}
    if isinstance(fn, LayerRule):
        return dataclasses.replace(fn, **options) if options else fn
    return LayerRule(fn, **options)


def register_rule(*layer_types: type, **options) -> Callable[[Rule], Rule]:
    """Decorator registering ``rule(module, record, params) -> Contribution`` for
    ``layer_types`` (and their subclasses that do not override the forward computation:
    :func:`get_rule`).

    ``params`` are the module's trainable parameters (recursive, unless
    ``scope="direct"``), in ``named_parameters`` order; the contribution must cover exactly
    these. The rule must be linear in the recorded output gradients (the tracker applies
    the loss-reduction factor to its results). Keyword options are those of
    :class:`LayerRule`: ``layout`` (a :class:`Layout`: ``batch_dim``, ``own_layout``,
    ``expand_broadcast``, ``batch_size``, ``record_dims``, ...), ``scope``,
    ``after_swap``, ``observe``, ``check``, ``early``, ``casts_input``. The layout fields
    given one by one (``register_rule(nn.GRUCell, batch_dim=0)``) are deprecated.
    Returns the function unchanged.
    """
    for t in layer_types:
        RULES._check(t)
    flat = _flat_layout(options, "register_rule")

    def deco(fn: Rule) -> Rule:
        RULES.register(*layer_types, value=_as_rule(fn, options, flat))
        return fn

    return deco


#: Rules matched by a predicate on the module (layers of libraries privlearn does not
#: import, recognised by class name and attributes), tried after the types of
#: :data:`RULES` (whose ``predicates`` list this is).
PREDICATE_RULES: list[tuple[Callable[[nn.Module], bool], LayerRule]] = RULES.predicates


def register_predicate_rule(predicate: Callable[[nn.Module], bool],
                            **options) -> Callable[[Rule], Rule]:
    """Decorator registering a rule (with :class:`LayerRule` options) for every module for
    which ``predicate`` holds."""
    flat = _flat_layout(options, "register_predicate_rule")

    def deco(fn: Rule) -> Rule:
        RULES.register_predicate(predicate, _as_rule(fn, options, flat))
        return fn

    return deco


def get_rule(module: nn.Module) -> LayerRule | None:
    """The rule registered for ``type(module)`` (exact type first, then MRO), else the
    first predicate rule that matches.

    A rule registered for a base class is not inherited by a subclass that overrides the
    base's forward computation (:func:`overridden_forward`: Hugging Face's
    ``GemmaTextScaledWordEmbedding`` scales the lookup, ``OPTLearnedPositionalEmbedding``
    looks up positions computed from the attention mask, ``ConvNextLayerNorm`` permutes
    channels first): the base's per-example formula describes the base's forward only.
    Such a module gets the first predicate rule that matches it, else none (the generic
    :mod:`torch.func` fallback, exact for any computation), unless a rule is registered
    for its own class or a class between it and the base that overrides nothing. A module
    whose ``forward`` is replaced on the instance (:func:`replaced_forward`) gets none."""
    owner = RULES.owner(module)
    if replaced_forward(module):  # module.forward = ...: no formula describes it
        if owner is not None or any(pred(module) for pred, _ in RULES.predicates):
            _note_replaced(type(module))
        return None
    if owner is not None and not overridden_forward(type(module), owner):
        return RULES._table[owner]
    for predicate, value in RULES.predicates:
        if predicate(module):
            return value
    if owner is not None and any(p is not None and p.requires_grad
                                 for p in module._parameters.values()):
        _note_overridden(type(module), owner)
    return None


def replaced_forward(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` is replaced on the instance (``module.forward =
    f``, a wrapper such as accelerate's hooks or a monkeypatched LoRA): what it computes
    is then whatever ``f`` does, which no layer's per-example formula describes. The
    engine's own zero-row forward (:mod:`privlearn.torch._zero_rows`) calls the one it
    replaced and does not count."""
    from privlearn.torch._zero_rows import own_forward

    return own_forward(module) is not None


def _note_replaced(cls: type) -> None:
    if ("instance", cls) in _NOTED:
        return
    _NOTED.add(("instance", cls))
    warnings.warn(
        f"a {cls.__qualname__}'s forward is replaced on the instance (module.forward = "
        "...), so privlearn's rule for its class does not describe it; its per-example "
        "gradients are computed by the generic torch.func rule instead (exact, slower)",
        RuntimeWarning, stacklevel=4)


#: the methods of a layer whose override changes what it computes
_FORWARD_METHODS = ("forward", "_conv_forward")
_NOTED: set = set()


def overridden_forward(cls: type, owner: type) -> str | None:
    """The qualified name of the first method of ``_FORWARD_METHODS`` that a class of
    ``cls``'s MRO before ``owner`` (a base of ``cls`` with a registered rule) defines
    itself, else None: that subclass computes something else than ``owner``."""
    c = first_in_mro(cls, lambda k: k is owner or any(n in vars(k) for n in _FORWARD_METHODS))
    if c is None or c is owner:
        return None
    name = next(n for n in _FORWARD_METHODS if n in vars(c))
    return f"{c.__qualname__}.{name}"


def _note_overridden(cls: type, owner: type) -> None:
    if cls in _NOTED:
        return
    _NOTED.add(cls)
    warnings.warn(
        f"{cls.__qualname__} subclasses {owner.__qualname__} and overrides "
        f"{overridden_forward(cls, owner)}, so privlearn's rule for {owner.__qualname__} "
        "does not describe it; its per-example gradients are computed by the generic "
        "torch.func rule instead (exact, slower). Register a rule for "
        f"{cls.__qualname__} (privlearn.torch.register_rule) for a faster one",
        RuntimeWarning, stacklevel=3)


#: Layouts of container modules: ``fn(module) -> int``, the batch dimension of the
#: tensors its descendant layers receive (for rules that take their dimension "from the
#: context"), e.g. ``nn.TransformerEncoderLayer`` with ``batch_first=False`` -> 1; after
#: the types, by predicate (``LAYOUTS.predicates``).
LAYOUTS: TypeRegistry[Callable[[nn.Module], int]] = TypeRegistry(
    "container layouts", register_with="register_layout")


def register_layout(*module_types: type) -> Callable:
    """Decorator registering ``fn(module) -> int``: the batch dimension of the tensors
    that the layers inside a module of ``module_types`` receive."""
    for t in module_types:
        LAYOUTS._check(t)

    def deco(fn: Callable[[nn.Module], int]) -> Callable[[nn.Module], int]:
        LAYOUTS.register(*module_types, value=fn)
        return fn

    return deco


#: Layouts of container modules matched by a predicate (modules of libraries privlearn
#: does not import, recognised by class name and attributes), tried after the types of
#: :data:`LAYOUTS` (whose ``predicates`` list this is).
PREDICATE_LAYOUTS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], int]]] = (
    LAYOUTS.predicates)


def register_predicate_layout(predicate: Callable[[nn.Module], bool]) -> Callable:
    """Decorator registering ``fn(module) -> int`` (as :func:`register_layout`) for every
    module for which ``predicate`` holds."""

    def deco(fn: Callable[[nn.Module], int]) -> Callable[[nn.Module], int]:
        LAYOUTS.register_predicate(predicate, fn)
        return fn

    return deco


def context_layout(module: nn.Module) -> int | None:
    """The layout ``module`` declares for the layers inside it (registered with
    :func:`register_layout` or :func:`register_predicate_layout`), else None. (An
    arbitrary ``batch_first`` attribute of a user's module is not read: it may describe
    its own inputs, not its children's.)"""
    fn = LAYOUTS.lookup(module)
    return None if fn is None else int(fn(module))


#: Instrumenters: per module type, a factory ``mode(sink)`` of a
#: :class:`torch.overrides.TorchFunctionMode` that the tracker enters for each forward call
#: of such a module (forward pre-hook) and leaves after it (forward hook, also on error).
#: While active, the mode may intercept functions the module calls to capture
#: intermediates its rule needs (e.g. the attention projections) and hands them to
#: ``sink``; the tracker stores them in ``Record.extra`` of that call. Nothing is stored
#: on the module. Entries are ``(applies(module) -> bool, factory)``.
INSTRUMENTERS: TypeRegistry[tuple[Callable[[nn.Module], bool], Callable]] = TypeRegistry(
    "instrumenters", register_with="register_instrumenter")


def register_instrumenter(module_type: type, *,
                          applies: Callable[[nn.Module], bool] | None = None
                          ) -> Callable[[Callable], Callable]:
    """Decorator registering ``mode_factory(sink) -> TorchFunctionMode`` for modules of
    ``module_type`` (and subclasses) for which ``applies(module)`` holds."""
    INSTRUMENTERS._check(module_type)

    def deco(factory: Callable) -> Callable:
        INSTRUMENTERS.register(module_type, value=(applies or (lambda m: True), factory))
        return factory

    return deco


def get_instrumenter(module: nn.Module) -> Callable | None:
    """The mode factory registered for ``module`` (MRO order), or None."""
    entry = INSTRUMENTERS.lookup(module)
    if entry is None:
        return None
    applies, factory = entry
    return factory if applies(module) else None
