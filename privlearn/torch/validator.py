"""Checks that a model can be trained with per-example clipping, and fixes what it can.

:func:`validate` lists *every* problem at once; :func:`fix` replaces fixable layers.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["validate", "fix", "UnsupportedModuleError", "check_model"]

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
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            out.append(f"{label}: {_BN_MSG}")
        elif isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            out.append(f"{label}: InstanceNorm with track_running_stats=True mixes examples "
                       "through its running statistics; use track_running_stats=False")
        elif isinstance(m, nn.RNNBase):
            if m.proj_size > 0:
                out.append(f"{label}: LSTM with proj_size > 0 is not supported")
            if m.dropout > 0 and m.num_layers > 1:
                out.append(f"{label}: dropout > 0 between recurrent layers is not supported "
                           "(use nn.Dropout between separate recurrent layers)")
        elif isinstance(m, nn.Embedding) and trainable:
            if m.sparse:
                out.append(f"{label}: sparse=True gradients are not supported")
            if m.max_norm is not None:
                out.append(f"{label}: max_norm renormalises weights in place during forward, "
                           "not supported")
            if m.scale_grad_by_freq:
                out.append(f"{label}: scale_grad_by_freq mixes examples in a batch")
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            out.append(f"{label}: attention dropout > 0 is not supported (its masks cannot be "
                       "reproduced for per-example gradients); set dropout=0 and apply "
                       "nn.Dropout to the layer's output instead")
        elif isinstance(m, nn.EmbeddingBag) and trainable:
            out.append(f"{label}: EmbeddingBag is not supported; use Embedding and a sum/mean")
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
