"""Checks that a model can be trained with per-example clipping, and fixes what it can.

:func:`validate` lists *every* problem at once; :func:`fix` replaces fixable layers.
The checks are registered per module type (:func:`register_validator`) or declared by the
layer's rule (``LayerRule.check``, for layers matched by a predicate), and the fixers per
type (:func:`register_fixer`), so a layer defined outside privlearn gets its own check and
fix by registration alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

from privlearn._type_registry import TypeRegistry
from privlearn.errors import UnsupportedModuleError
from privlearn.torch._aliases import own_parameters

__all__ = ["validate", "fix", "apply_fixers", "UnsupportedModuleError", "check_model",
           "register_validator", "register_fixer", "VALIDATORS", "FIXERS"]

_BN_MSG = ("BatchNorm mixes examples in a batch and is not differentially private; "
           "replace with GroupNorm (privlearn.torch.fix(model) / make_private(fix_model=True) "
           "does it), or keep a pretrained one frozen with its running statistics "
           "(bn.eval() and bn.requires_grad_(False) after model.train())")


#: Layers that draw random numbers in their forward pass: ``type -> active(module)``
#: (whether it does with its current settings). A module whose parameters go through the
#: generic fallback cannot contain one (the fallback re-runs the forward per example).
RANDOM_LAYERS: TypeRegistry[Callable[[nn.Module], bool]] = TypeRegistry("random layers")
RANDOM_LAYERS[nn.modules.dropout._DropoutNd] = lambda m: m.p > 0


def _draws_randomness(m: nn.Module) -> bool:
    active = RANDOM_LAYERS.lookup(m)
    return active is not None and bool(active(m))


def _fallback_with_dropout(m: nn.Module, trainable: bool) -> bool:
    """A module whose own parameters go through the torch.func fallback (or a rule that
    defers to it when dropout is active) and whose forward applies dropout: the
    fallback re-runs the forward per example and cannot reproduce the dropout masks."""
    if not trainable:
        return False
    from privlearn.torch import rules as _rules  # noqa: F401  (registers the rules)
    from privlearn.torch.grad_sample import get_rule

    rule = get_rule(m)
    if rule is not None and rule.scope == "subtree":
        return False
    return any(_draws_randomness(d) for d in m.modules() if d is not m)


#: Per module type, checks ``check(module, trainable) -> list of problems`` (each a
#: sentence saying what is wrong and what to do instead). ``trainable``: the module
#: owns parameters with ``requires_grad``.
Check = Callable[[nn.Module, bool], list[str]]
VALIDATORS: TypeRegistry[list[Check]] = TypeRegistry("validators",
                                                     register_with="register_validator")


def register_validator(*module_types: type) -> Callable[[Check], Check]:
    """Decorator registering ``check(module, trainable) -> list[str]`` for modules of
    ``module_types`` (and subclasses); :func:`validate` reports what it returns."""
    for t in module_types:
        VALIDATORS._check(t)

    def deco(fn: Check) -> Check:
        for t in module_types:
            VALIDATORS.setdefault(t, []).append(fn)
        return fn

    return deco


def _checks_for(m: nn.Module) -> list[Check]:
    """Every check registered for a class of ``m``'s MRO, most derived class first."""
    return [check for checks in VALIDATORS.lookup_all(m) for check in checks]


@register_validator(nn.modules.batchnorm._BatchNorm)
def _batch_norm(m, trainable):
    if not (m.training or trainable) and m.track_running_stats and m.running_mean is not None:
        return []  # frozen with its statistics: a fixed map of each example on its own
    return [_BN_MSG]


@register_validator(nn.modules.instancenorm._InstanceNorm)
def _instance_norm(m, trainable):
    if m.track_running_stats:
        return ["InstanceNorm with track_running_stats=True mixes examples through its "
                "running statistics; use track_running_stats=False"]
    return []


@register_validator(nn.RNNBase)
def _recurrent(m, trainable):
    out = []
    if m.dropout > 0 and m.num_layers > 1:
        out.append("dropout > 0 between recurrent layers is not supported (use nn.Dropout "
                   "between separate recurrent layers)")
    return out


@register_validator(nn.Embedding, nn.EmbeddingBag)
def _embedding(m, trainable):
    out = []
    if m.max_norm is not None:
        # frozen too: the rows the batches look up are rescaled in the released weight
        # (and only those), which tells which ids the training data holds, without noise
        out.append(f"max_norm={m.max_norm} renormalises, in place during the forward pass, "
                   "the rows of the weight that the batch looks up, so the weight (frozen "
                   "or not) records which ids the training data holds, without noise; set "
                   "max_norm=None (renormalise the weight once before training, e.g. "
                   "torch.renorm on its rows, if that is what the model needs)")
    if not trainable:
        return out
    if m.sparse:
        out.append("sparse=True gradients are not supported (the clipped sum and its "
                   "noise are dense); set sparse=False")
    if m.scale_grad_by_freq:
        out.append("scale_grad_by_freq mixes examples in a batch (each id's gradient is "
                   "divided by its count over the whole batch); set "
                   "scale_grad_by_freq=False")
    return out


@register_validator(nn.MultiheadAttention)
def _attention(m, trainable):
    if m.dropout > 0 and (m.bias_k is not None or m.add_zero_attn):
        return ["attention dropout > 0 with add_bias_kv or add_zero_attn is not supported "
                "(its masks cannot be reproduced for per-example gradients); set dropout=0 "
                "and apply nn.Dropout to the layer's output instead"]
    return []


def _problems(model: nn.Module) -> list[str]:
    out = []
    script = []  # TorchScript modules: their insides are compiled code, not checked here
    for name, m in model.named_modules():
        label = f"{name or '<model>'} ({type(m).__name__})"
        if any(name.startswith(f"{s}.") or not s for s in script):
            continue
        if _is_torchscript(m):
            script.append(name)
            out.extend(f"{label}: {msg}" for msg in _torchscript(m))
            continue
        trainable = any(p.requires_grad for p in m.parameters(recurse=False))
        # (a tensor a submodule registers too is that submodule's: privlearn.torch._aliases)
        if _fallback_with_dropout(m, trainable and bool(own_parameters(m))):
            out.append(f"{label}: owns trainable parameters and applies dropout inside its "
                       "forward; their per-example gradients need the forward re-run per "
                       "example, which cannot reproduce the dropout masks. Set that dropout "
                       "to 0 (e.g. ViTConfig(hidden_dropout_prob=0.0) for ViT embeddings) or "
                       "freeze these parameters")
        for check in _checks_for(m):
            out.extend(f"{label}: {msg}" for msg in check(m, trainable))
        out.extend(f"{label}: {msg}" for msg in _rule_problems(m, trainable))
        out.extend(f"{label}: {msg}" for msg in _position_tables(m))
        out.extend(f"{label}: {msg}" for msg in _spec_augment(m))
        lazy = [n for n, q in m.named_parameters(recurse=False)
                if isinstance(q, nn.parameter.UninitializedParameter)]
        if lazy:
            out.append(f"{label}: parameter(s) {lazy} are not initialised yet (a lazy "
                       "module): run one forward pass on a batch (model(x), a dry run) "
                       "before building the optimizer and calling make_private")
        legacy = _hook_reparametrization(m)
        if legacy and trainable:
            out.append(f"{label}: torch.nn.utils.{legacy} (the deprecated form, a forward "
                       "pre-hook) computes the weight outside the layer's forward, so its "
                       "gradient cannot be clipped per example; use "
                       f"torch.nn.utils.parametrizations.{legacy} instead (supported)")
        out.extend(f"{label}: {msg}" for msg in _pruned(m))
    return out


def _is_torchscript(m: nn.Module) -> bool:
    """A module made by ``torch.jit.script``/``trace``/``load`` (duck-typed: it holds its
    compiled C++ module and graph)."""
    return hasattr(m, "_c") and hasattr(m, "graph")


def _torchscript(m: nn.Module) -> list[str]:
    """A TorchScript module: its forward is compiled code that runs on its own parameter
    slots, so the engine can neither hook its layers nor run them on the aliases whose
    gradients it clips per example (nor, frozen, read its layers as eager ones)."""
    return ["a TorchScript module (torch.jit.script, torch.jit.trace or torch.jit.load): "
            "its compiled forward cannot be hooked, so the gradients of its parameters "
            "cannot be clipped per example. Pass the eager nn.Module (before scripting or "
            "tracing it); a frozen one used as a fixed feature extractor can instead run "
            "outside p.model, on each batch before the forward (h = backbone(x) under "
            "torch.no_grad(), then p.model(h))"]


def _pruned(m: nn.Module) -> list[str]:
    """``torch.nn.utils.prune`` on a trainable tensor of ``m``: its forward pre-hook
    recomputes ``name = name_orig * name_mask`` before each forward, outside the layer,
    so the gradient of ``name_orig`` reaches it through that product, not through the
    layer (refused here, before anything, rather than at the first step as a parameter
    used outside its layer)."""
    from torch.nn.utils.prune import BasePruningMethod

    out = []
    for hook in m._forward_pre_hooks.values():
        name = getattr(hook, "_tensor_name", None)
        orig = getattr(m, f"{name}_orig", None) if isinstance(hook, BasePruningMethod) else None
        if isinstance(orig, nn.Parameter) and orig.requires_grad:
            out.append(
                f"torch.nn.utils.prune masks {name!r} with a forward pre-hook that computes "
                f"{name} = {name}_orig * {name}_mask outside the layer's forward, so the "
                f"gradient of {name}_orig cannot be clipped per example. Keep the mask as a "
                "parametrization instead (supported): prune.remove(module, "
                f"{name!r}) to drop the hook, then torch.nn.utils.parametrize."
                f"register_parametrization(module, {name!r}, M) with an nn.Module M whose "
                "forward(w) returns w * mask (pruned entries stay zero); or freeze "
                f"{name}_orig (requires_grad_(False))")
    return out


def _trainable(m) -> bool:
    return isinstance(m, nn.Module) and any(p.requires_grad for p in m.parameters())


def _position_tables(m: nn.Module) -> list[str]:
    """Hugging Face attention layers that run a trainable layer on a relative-position
    table once for the whole batch and broadcast (or repeat) the result over the
    examples: the gradient of that use is summed over the batch before any hook sees
    it, so no per-example gradient exists (recognised by class attributes; the library
    is not imported)."""
    bias = getattr(m, "relative_attention_bias", None)
    if getattr(m, "has_relative_attention_bias", False) is True and _trainable(bias):
        return ["its relative attention bias (T5-style: the nn.Embedding "
                "relative_attention_bias) is looked up on the (query, key) position grid once "
                "for the whole batch and broadcast over the examples, so its per-example "
                "gradient is never formed. Freeze it (relative_attention_bias."
                "requires_grad_(False), or train LoRA adapters only: the rest of the model "
                "is supported), or train a decoder-only model (GPT-2, Llama, ...) on source "
                "and target concatenated"]
    if getattr(m, "relative_attention", False) is True and hasattr(m, "pos_att_type"):
        shared = ("query_proj", "key_proj") if getattr(m, "share_att_key", False) else (
            "pos_key_proj", "pos_query_proj")
        used = [n for n in shared if _trainable(getattr(m, n, None))]
        if used:
            return [f"its disentangled relative attention (DeBERTa) runs {' and '.join(used)} "
                    "on the relative-position embedding table once for the whole batch and "
                    "repeats the result per example, so the per-example gradients of "
                    f"{' and '.join(used)} cannot be separated. Use relative_attention=False "
                    "in the config, or an encoder with absolute positions (BERT, RoBERTa, "
                    "ELECTRA); freezing these projections also works"]
    return []


def _spec_augment(m: nn.Module) -> list[str]:
    """A Hugging Face speech model (Wav2Vec2, HuBERT, WavLM, ...: it owns
    ``masked_spec_embed``) whose forward applies SpecAugment in training: the time and
    feature masks are drawn from NumPy's global generator for the whole batch inside the
    model's forward, which neither the batch-independence probe nor a per-example
    recomputation can replay."""
    cfg = getattr(m, "config", None)
    if not hasattr(m, "masked_spec_embed") or cfg is None \
            or getattr(cfg, "apply_spec_augment", True) is False:
        return []
    probs = {k: getattr(cfg, k, 0.0) or 0.0 for k in ("mask_time_prob", "mask_feature_prob")}
    on = {k: v for k, v in probs.items() if v > 0}
    if not on:
        return []
    return [f"SpecAugment is on ({', '.join(f'{k}={v}' for k, v in on.items())}): its masks "
            "are drawn from NumPy's global generator inside the model's forward, for the "
            "whole batch, which per-example gradients cannot replay. Set "
            "config.apply_spec_augment=False (or mask_time_prob=0.0 and "
            "mask_feature_prob=0.0) before make_private, and augment each example in the "
            "data pipeline instead"]


def _hook_reparametrization(m: nn.Module) -> str | None:
    """``"weight_norm"`` / ``"spectral_norm"`` when ``m`` carries the deprecated
    hook-based reparametrization of that name, else None."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for hook in m._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            return "weight_norm"
        if isinstance(hook, SpectralNorm):
            return "spectral_norm"
    return None


def _rule_problems(m: nn.Module, trainable: bool) -> list[str]:
    """What the rule that handles ``m`` declares it cannot handle (``LayerRule.check``)."""
    from privlearn.torch import rules as _rules  # noqa: F401  (registers the rules)
    from privlearn.torch.grad_sample import get_rule

    rule = get_rule(m)
    if rule is None or rule.check is None:
        return []
    if not trainable and not any(p.requires_grad for p in m.parameters()):
        return []
    return list(rule.check(m))


def validate(model: nn.Module) -> list[str]:
    """Descriptions of every layer of ``model`` that per-example clipping cannot handle
    (empty list: the model is supported)."""
    return _problems(model)


def check_model(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModuleError` listing every unsupported layer."""
    problems = _problems(model)
    if problems:
        raise UnsupportedModuleError(
            f"{len(problems)} unsupported layer(s) for DP training:\n  - "
            + "\n  - ".join(problems))


#: Per module type, ``fixer(module) -> replacement module or None`` (None: nothing to
#: fix). A fixer never mutates the module it is given: :func:`apply_fixers` swaps the
#: replacement in and can put the original back. Opacus's ``register_module_fixer`` is
#: the model.
Fixer = Callable[[nn.Module], "nn.Module | None"]
FIXERS: TypeRegistry[Fixer] = TypeRegistry("fixers", register_with="register_fixer")


def register_fixer(*module_types: type) -> Callable[[Fixer], Fixer]:
    """Decorator registering ``fixer(module) -> replacement or None`` for modules of
    ``module_types`` (and subclasses), applied by :func:`fix` /
    ``make_private(fix_model=True)``."""

    for t in module_types:
        FIXERS._check(t)

    def deco(fn: Fixer) -> Fixer:
        FIXERS.register(*module_types, value=fn)
        return fn

    return deco


def _fixer_for(m: nn.Module) -> Fixer | None:
    return FIXERS.lookup(m)


@register_fixer(nn.modules.batchnorm._BatchNorm)
def _batch_norm_to_group_norm(bn) -> nn.GroupNorm:
    """GroupNorm with ``gcd(32, C)`` groups (Wu & He 2018 use 32 groups), *sharing* the
    BatchNorm's affine parameters: an optimizer built over the model before the fix holds
    them, so they train. None (nothing to fix) for a BatchNorm frozen with its running
    statistics, which the validator accepts."""
    if not _batch_norm(bn, any(q.requires_grad for q in bn.parameters(recurse=False))):
        return None
    _check_initialised(bn)
    c = bn.num_features
    new = nn.GroupNorm(math.gcd(32, c), c, eps=bn.eps, affine=False)
    if bn.affine:
        new.affine = True
        new.weight, new.bias = bn.weight, bn.bias
    return new


@register_fixer(nn.modules.instancenorm._InstanceNorm)
def _instance_norm_without_running_stats(m):
    """The same InstanceNorm without running statistics (which mix examples), sharing
    its affine parameters."""
    if not m.track_running_stats:
        return None
    _check_initialised(m)
    new = type(m)(m.num_features, eps=m.eps, momentum=m.momentum, affine=False,
                  track_running_stats=False)
    if m.affine:
        new.affine = True
        new.weight, new.bias = m.weight, m.bias
    return new


def _check_initialised(m: nn.Module) -> None:
    """Refuse to replace a lazy module whose parameters are not initialised yet (its
    number of features is unknown until its first forward pass)."""
    from torch.nn.modules.lazy import LazyModuleMixin

    if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
        raise UnsupportedModuleError(
            f"{type(m).__name__} is not initialised yet (its number of features is set by "
            "its first forward pass), so it cannot be replaced by its DP equivalent: run "
            "one forward pass of the model on an example batch before fix() / "
            "make_private(fix_model=True), or give the layer its num_features")


def apply_fixers(model: nn.Module) -> Callable[[], None]:
    """Replace every module that has a registered fixer (in place, children of
    ``model``); returns a function that puts the originals back (if a fixer refuses,
    the modules already replaced are put back before the error propagates)."""
    done: list[tuple[nn.Module, str, nn.Module]] = []

    def undo() -> None:
        while done:
            parent, name, child = done.pop()
            setattr(parent, name, child)

    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                fixer = _fixer_for(child)
                new = fixer(child) if fixer is not None else None
                if new is not None:
                    setattr(parent, name, new)
                    done.append((parent, name, child))
    except BaseException:
        undo()
        raise
    return undo


def fix(model: nn.Module) -> nn.Module:
    """Replace fixable layers in place and return the model (a module that is itself
    fixable is returned replaced): every BatchNorm becomes a GroupNorm sharing its affine
    parameters; InstanceNorm stops tracking running statistics. Unfixable problems remain
    (see :func:`validate`); fixers are registered with :func:`register_fixer`."""
    fixer = _fixer_for(model)
    new = fixer(model) if fixer is not None else None
    if new is not None:
        return new
    apply_fixers(model)
    return model
