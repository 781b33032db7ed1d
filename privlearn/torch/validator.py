"""Checks that a model can be trained with per-example clipping, and fixes what it can.

:func:`validate` lists *every* problem at once; :func:`fix` replaces fixable layers.
The checks are registered per module type (:func:`register_validator`), so a layer
defined outside privlearn gets its own check by registration alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

__all__ = ["validate", "fix", "UnsupportedModuleError", "check_model", "register_validator",
           "VALIDATORS"]

_BN_MSG = ("BatchNorm mixes examples in a batch and is not differentially private; "
           "replace with GroupNorm (validate(..., fix=True) / make_private(fix_model=True) "
           "does it)")


class UnsupportedModuleError(ValueError):
    """The model has layers that per-example clipping cannot handle (all listed)."""


def _fallback_with_dropout(m: nn.Module, trainable: bool) -> bool:
    """A module whose own parameters go through the torch.func fallback (or a rule that
    defers to it when dropout is active) and whose forward applies dropout: the
    fallback re-runs the forward per example and cannot reproduce the dropout masks."""
    if not trainable:
        return False
    from privlearn.torch import rules as _rules  # noqa: F401  (registers the rules)
    from privlearn.torch.grad_sample import get_rule

    rule = get_rule(m)
    if rule is not None and not getattr(rule, "direct_only", False):
        return False
    return any(isinstance(d, nn.modules.dropout._DropoutNd) and d.p > 0
               for d in m.modules() if d is not m)


#: Per module type, checks ``check(module, trainable) -> list of problems`` (each a
#: sentence saying what is wrong and what to do instead). ``trainable``: the module
#: owns parameters with ``requires_grad``.
Check = Callable[[nn.Module, bool], list[str]]
VALIDATORS: dict[type, list[Check]] = {}


def register_validator(*module_types: type) -> Callable[[Check], Check]:
    """Decorator registering ``check(module, trainable) -> list[str]`` for modules of
    ``module_types`` (and subclasses); :func:`validate` reports what it returns."""

    def deco(fn: Check) -> Check:
        for t in module_types:
            VALIDATORS.setdefault(t, []).append(fn)
        return fn

    return deco


def _checks_for(m: nn.Module) -> list[Check]:
    out: list[Check] = []
    for t in type(m).__mro__:
        out.extend(VALIDATORS.get(t, ()))
    return out


@register_validator(nn.modules.batchnorm._BatchNorm)
def _batch_norm(m, trainable):
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
    if m.proj_size > 0:
        out.append("LSTM with proj_size > 0 is not supported")
    if m.dropout > 0 and m.num_layers > 1:
        out.append("dropout > 0 between recurrent layers is not supported (use nn.Dropout "
                   "between separate recurrent layers)")
    return out


@register_validator(nn.Embedding)
def _embedding(m, trainable):
    if not trainable:
        return []
    out = []
    if m.sparse:
        out.append("sparse=True gradients are not supported")
    if m.max_norm is not None:
        out.append("max_norm renormalises weights in place during forward, not supported")
    if m.scale_grad_by_freq:
        out.append("scale_grad_by_freq mixes examples in a batch")
    return out


@register_validator(nn.MultiheadAttention)
def _attention(m, trainable):
    if m.dropout > 0:
        return ["attention dropout > 0 is not supported (its masks cannot be reproduced "
                "for per-example gradients); set dropout=0 and apply nn.Dropout to the "
                "layer's output instead"]
    return []


@register_validator(nn.EmbeddingBag)
def _embedding_bag(m, trainable):
    if trainable:
        return ["EmbeddingBag is not supported; use Embedding and a sum/mean"]
    return []


def _problems(model: nn.Module) -> list[str]:
    out = []
    for name, m in model.named_modules():
        label = f"{name or '<model>'} ({type(m).__name__})"
        trainable = any(p.requires_grad for p in m.parameters(recurse=False))
        if _fallback_with_dropout(m, trainable):
            out.append(f"{label}: owns trainable parameters and applies dropout inside its "
                       "forward; their per-example gradients need the forward re-run per "
                       "example, which cannot reproduce the dropout masks. Set that dropout "
                       "to 0 (e.g. ViTConfig(hidden_dropout_prob=0.0) for ViT embeddings) or "
                       "freeze these parameters")
        for check in _checks_for(m):
            out.extend(f"{label}: {msg}" for msg in check(m, trainable))
    return out


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


def _group_norm_for(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    c = bn.num_features
    return nn.GroupNorm(math.gcd(32, c), c, eps=bn.eps, affine=bn.affine)


def fix(model: nn.Module) -> nn.Module:
    """Replace fixable layers in place and return the model: every BatchNorm becomes a
    GroupNorm with ``gcd(32, C)`` groups (Wu & He 2018 use 32 groups); InstanceNorm
    stops tracking running statistics. Unfixable problems remain (see :func:`validate`)."""
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return _group_norm_for(model)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            new = _group_norm_for(child)
            tensors = list(child.parameters()) + list(child.buffers())
            if tensors:
                new.to(tensors[0].device)
            setattr(model, name, new)
        elif isinstance(child, nn.modules.instancenorm._InstanceNorm) and \
                child.track_running_stats:
            child.track_running_stats = False
            child.running_mean = None
            child.running_var = None
        else:
            fix(child)
    return model
