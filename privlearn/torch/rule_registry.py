"""The registry of layer rules: what the engine knows about each kind of layer
(:class:`LayerRule`), registered by type or by predicate, the layouts container modules
give their layers, and the instrumenters of layers whose rules need intermediates of
their forward pass. Moved out of :mod:`privlearn.torch.grad_sample`, which re-exports
every name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from privlearn.errors import ConfigurationError, ParameterValueError

if TYPE_CHECKING:  # grad_sample imports this module
    from privlearn.torch.grad_sample import Contribution, Record

__all__ = [
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


@dataclass(frozen=True)
class LayerRule:
    """Everything the engine knows about one kind of layer: how to compute its
    contribution and how its tensors are laid out. Registered with :func:`register_rule`
    (by type) or :func:`register_predicate_rule`; the engine never tests layer types
    itself.

    Attributes
    ----------
    compute : callable
        ``compute(module, record, params) -> Contribution``, linear in the recorded output
        gradients. Unless ``own_layout``, the record it receives is *batch-first*: the
        engine has moved the batch dimension of the first input and of every output (and
        its gradient) to position 0.
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
    scope : {"subtree", "direct"}
        "subtree": the rule covers every trainable parameter of the module and its
        children; "direct": only the parameters the module owns itself (its children are
        units of their own).
    after_swap : callable or None
        ``after_swap(module)``, called after the engine replaced the module's parameters
        by detached aliases for a forward pass and after it put them back (e.g.
        ``nn.RNNBase`` rebuilds its flat weight list).
    batch_size : callable or None
        ``batch_size(module, record) -> int`` for ``own_layout`` rules (default: the
        size of the first input along ``batch_dim``).
    record_dims : callable or None
        ``record_dims(module, record, batch) -> (arg_dims, kwarg_dims, output_dims)``: the
        batch dimension of every recorded tensor (None: shared by all examples), used to
        drop single examples (overflowing gradients) and by the generic fallback.
        Default: the dimension of size ``batch`` at position 0 (batch-first records).
    observe : callable or None
        ``observe(module, args, kwargs, output) -> list[(tensor, dim)]``: batch-first
        views of what the layer received and produced, compared by the batch-independence
        probe (default: the first input and the first floating output, batch dimension
        ``batch_dim``).
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
    batch_dim: int | Callable[[nn.Module], int] | None = None
    own_layout: bool = False
    moves: bool = True
    expand_broadcast: bool = True
    scope: str = "subtree"
    after_swap: Callable[[nn.Module], None] | None = None
    batch_size: Callable[[nn.Module, Record], int] | None = None
    record_dims: Callable | None = None
    observe: Callable | None = None
    check: Callable[[nn.Module], list[str]] | None = None
    early: bool = False
    casts_input: bool = False

    def __post_init__(self):
        if self.scope not in ("subtree", "direct"):
            raise ParameterValueError(
                f"scope must be 'subtree' or 'direct', got {self.scope!r}: 'subtree' when "
                "the rule covers the parameters of the module and its children, 'direct' "
                "when it covers only those the module owns")
        if self.own_layout and self.batch_dim is None:
            raise ConfigurationError(
                "own_layout=True needs batch_dim (an int, or a function of the module such "
                "as lambda m: 0 if m.batch_first else 1), got batch_dim=None: declare where "
                "the module carries the examples, or leave own_layout=False")

    def __call__(self, module: nn.Module, record: Record, params) -> Contribution:
        return self.compute(module, record, params)

    def declared_dim(self, module: nn.Module) -> int | None:
        """The batch dimension the rule declares for ``module`` (None: from the context)."""
        d = self.batch_dim
        return d(module) if callable(d) else d


RULES: dict[type, LayerRule] = {}


def _as_rule(fn, options: dict) -> LayerRule:
    if isinstance(fn, LayerRule):
        return LayerRule(**{**{f: getattr(fn, f) for f in fn.__dataclass_fields__},
                            **options}) if options else fn
    return LayerRule(fn, **options)


def register_rule(*layer_types: type, **options) -> Callable[[Rule], Rule]:
    """Decorator registering ``rule(module, record, params) -> Contribution`` for
    ``layer_types`` (and their subclasses).

    ``params`` are the module's trainable parameters (recursive, unless
    ``scope="direct"``), in ``named_parameters`` order; the contribution must cover exactly
    these. The rule must be linear in the recorded output gradients (the tracker applies
    the loss-reduction factor to its results). Keyword options are the fields of
    :class:`LayerRule` (``batch_dim``, ``own_layout``, ``expand_broadcast``, ``scope``,
    ``after_swap``, ``batch_size``, ``record_dims``, ``observe``, ``check``, ``early``,
    ``casts_input``).
    Returns the function unchanged.
    """

    def deco(fn: Rule) -> Rule:
        entry = _as_rule(fn, options)
        for t in layer_types:
            RULES[t] = entry
        return fn

    return deco


#: Rules matched by a predicate on the module (layers of libraries privlearn does not
#: import, recognised by class name and attributes), tried after :data:`RULES`.
PREDICATE_RULES: list[tuple[Callable[[nn.Module], bool], LayerRule]] = []


def register_predicate_rule(predicate: Callable[[nn.Module], bool],
                            **options) -> Callable[[Rule], Rule]:
    """Decorator registering a rule (with :class:`LayerRule` options) for every module for
    which ``predicate`` holds."""

    def deco(fn: Rule) -> Rule:
        PREDICATE_RULES.append((predicate, _as_rule(fn, options)))
        return fn

    return deco


def get_rule(module: nn.Module) -> LayerRule | None:
    """The rule registered for ``type(module)`` (exact type first, then MRO), else the
    first predicate rule that matches."""
    for t in type(module).__mro__:
        if t in RULES:
            return RULES[t]
    for pred, rule in PREDICATE_RULES:
        if pred(module):
            return rule
    return None


#: Layouts of container modules: ``fn(module) -> int``, the batch dimension of the
#: tensors its descendant layers receive (for rules that take their dimension "from the
#: context"), e.g. ``nn.TransformerEncoderLayer`` with ``batch_first=False`` -> 1.
LAYOUTS: dict[type, Callable[[nn.Module], int]] = {}


def register_layout(*module_types: type) -> Callable:
    """Decorator registering ``fn(module) -> int``: the batch dimension of the tensors
    that the layers inside a module of ``module_types`` receive."""

    def deco(fn: Callable[[nn.Module], int]) -> Callable[[nn.Module], int]:
        for t in module_types:
            LAYOUTS[t] = fn
        return fn

    return deco


#: Layouts of container modules matched by a predicate (modules of libraries privlearn
#: does not import, recognised by class name and attributes), tried after :data:`LAYOUTS`.
PREDICATE_LAYOUTS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], int]]] = []


def register_predicate_layout(predicate: Callable[[nn.Module], bool]) -> Callable:
    """Decorator registering ``fn(module) -> int`` (as :func:`register_layout`) for every
    module for which ``predicate`` holds."""

    def deco(fn: Callable[[nn.Module], int]) -> Callable[[nn.Module], int]:
        PREDICATE_LAYOUTS.append((predicate, fn))
        return fn

    return deco


def context_layout(module: nn.Module) -> int | None:
    """The layout ``module`` declares for the layers inside it (registered with
    :func:`register_layout` or :func:`register_predicate_layout`), else None. (An
    arbitrary ``batch_first`` attribute of a user's module is not read: it may describe
    its own inputs, not its children's.)"""
    for t in type(module).__mro__:
        if t in LAYOUTS:
            return int(LAYOUTS[t](module))
    for pred, fn in PREDICATE_LAYOUTS:
        if pred(module):
            return int(fn(module))
    return None


#: Instrumenters: per module type, a factory ``mode(sink)`` of a
#: :class:`torch.overrides.TorchFunctionMode` that the tracker enters for each forward call
#: of such a module (forward pre-hook) and leaves after it (forward hook, also on error).
#: While active, the mode may intercept functions the module calls to capture
#: intermediates its rule needs (e.g. the attention projections) and hands them to
#: ``sink``; the tracker stores them in ``Record.extra`` of that call. Nothing is stored
#: on the module.
INSTRUMENTERS: dict[type, tuple[Callable[[nn.Module], bool], Callable]] = {}


def register_instrumenter(module_type: type, *,
                          applies: Callable[[nn.Module], bool] | None = None
                          ) -> Callable[[Callable], Callable]:
    """Decorator registering ``mode_factory(sink) -> TorchFunctionMode`` for modules of
    ``module_type`` (and subclasses) for which ``applies(module)`` holds."""

    def deco(factory: Callable) -> Callable:
        INSTRUMENTERS[module_type] = (applies or (lambda m: True), factory)
        return factory

    return deco


def get_instrumenter(module: nn.Module) -> Callable | None:
    """The mode factory registered for ``module`` (MRO order), or None."""
    for t in type(module).__mro__:
        entry = INSTRUMENTERS.get(t)
        if entry is not None:
            return entry[1] if entry[0](module) else None
    return None
