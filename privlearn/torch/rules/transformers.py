"""Rules for Hugging Face ``transformers`` layers, matched by class name (the library
is never imported here).

* ``Conv1D`` (GPT-2, GPT): ``y = x W + b`` with ``W`` of shape ``(in, out)``, a
  Linear layer with a transposed weight; it reuses the Linear machinery (ghost norms or
  materialised outer products, :func:`privlearn.torch.grad_sample.linear_like`).
* ``FalconLinear``: ``x @ W.T + b``, the Linear rule (an ``nn.Linear`` subclass
  overriding its forward does not inherit the Linear rule otherwise).
* RMSNorm (``torch.nn.RMSNorm`` and ``LlamaRMSNorm``-style modules: class name ending in
  ``RMSNorm``, one ``weight`` vector, an ``eps`` or ``variance_epsilon``): the
  per-example weight gradient is ``sum_t g_t * xhat_t`` with ``xhat`` the normalised
  input, computed in float32 and rounded to the input dtype as those modules do (Zhang &
  Sennrich 2019, "Root Mean Square Layer Normalization").
* ``*ScaledWordEmbedding`` (Gemma, BART, M2M100, ...: an ``nn.Embedding`` whose
  forward multiplies the lookup by ``embed_scale``): the Embedding rule with the output
  gradient times the scale. (Other subclasses of ``nn.Embedding`` that override its
  forward, as the learned positional embeddings of OPT and BART do, do not inherit the
  Embedding rule: :func:`privlearn.torch.rule_registry.get_rule`.)
* ``ViTEmbeddings``: the class token's per-example gradient is the output gradient at
  position 0, the position embedding's the whole output gradient (the patch projection
  is its own Conv2d unit).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from privlearn.torch import _argument_roles
from privlearn.torch._ghost_pending import PENDING
from privlearn.torch.fallback import fallback_rule
from privlearn.torch.grad_sample import (
    Contribution,
    Layout,
    Materialized,
    Record,
    as_dtype,
    compute_dtype,
    register_predicate_rule,
    register_rule,
)
from privlearn.torch.rules.embedding import EmbeddingContribution
from privlearn.torch.rules.linear import linear_like
from privlearn.torch.rules.norm import _summed

__all__ = ["conv1d_transposed_rule", "falcon_linear_rule", "rmsnorm_rule", "scaled_embedding_rule",
           "vit_embeddings_rule", "verified"]

_CHECK_EXAMPLES = 2
#: per module instance, whether its class-name rule was verified ("ok") or the module
#: is handled by the fallback ("fallback"); a side table, nothing is stored on modules
_RULE_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def verified(rule):
    """Wrap a class-name rule: on the first call for a module instance, compare the rule
    with the :mod:`torch.func` fallback on the first examples of the batch; on mismatch
    the module is handled by the fallback from then on (warning)."""

    def wrapped(module: nn.Module, record: Record, params) -> Contribution:
        state = _RULE_STATE.get(module)
        if state == "fallback":
            return fallback_rule(module, record, params)
        if state is None:
            ok = _agrees(rule, module, record, params)
            if ok is None:  # non-finite values decide nothing: checked again next call
                return fallback_rule(module, record, params)
            _RULE_STATE[module] = "ok" if ok else "fallback"
            if not ok:
                warnings.warn(
                    f"{type(module).__name__} does not behave as privlearn's rule for "
                    "modules of that name assumes; its per-example gradients are computed "
                    "by the generic torch.func fallback instead (slower, exact)",
                    RuntimeWarning, stacklevel=2)
                return fallback_rule(module, record, params)
        return rule(module, record, params)

    wrapped.__name__ = rule.__name__
    wrapped.__doc__ = rule.__doc__
    return wrapped


def _agrees(rule, module, record: Record, params) -> bool | None:
    """Whether the rule gives the fallback's per-example gradients on the batch's first
    examples; None when either holds a non-finite value (a NaN difference would compare
    as agreeing, and a wrong rule would then be trusted for the rest of the run)."""
    x = record.args[0]
    k = min(_CHECK_EXAMPLES, x.shape[0])
    if k == 0 or len(record.grad_outputs) != 1:
        return True
    g = record.grad(0)
    small = Record(args=(x[:k], *record.args[1:]), kwargs=dict(record.kwargs),
                   grad_outputs=[g[:k]],
                   outputs_meta=[((k, *g.shape[1:]), g.dtype, g.device)])
    token = PENDING.set(None)  # (read at once: no sum held for the end of backward)
    try:
        mine = rule(module, small, params).per_sample()
    finally:
        PENDING.reset(token)
    with _argument_roles.aside():  # a record of the check's own: no role is settled by it
        ref = fallback_rule(module, small, params).per_sample()
    for a, b in zip(mine, ref, strict=True):
        a, b = a.double(), b.double()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            return None
        scale = b.abs().max().item() + 1e-30
        # a different formula differs at O(1); rounding (float32 inside the module,
        # half-precision inputs) at most at these levels
        tol = 1e-2 if compute_dtype(x, g) != x.dtype else 1e-4
        if a.shape != b.shape or (a - b).abs().max().item() > tol * scale:
            return False
    return True


# --------------------------------------------------------------------------- Conv1D


def _is_conv1d(m: nn.Module) -> bool:
    w = m._parameters.get("weight")
    return (type(m).__name__ == "Conv1D" and w is not None and w.dim() == 2
            and getattr(m, "nf", None) == w.shape[1] and getattr(m, "nx", None) == w.shape[0]
            and set(m._parameters) <= {"weight", "bias"} and not m._modules)


@register_predicate_rule(_is_conv1d, casts_input=True)
@verified
def conv1d_transposed_rule(module: nn.Module, record: Record, params) -> Contribution:
    """transformers' ``Conv1D``: ``addmm(bias, x, W)`` with ``W`` ``(nx, nf)``."""
    return linear_like(record.args[0], record.grad(0), module.weight, module.bias, params,
                       transposed=True)


def looks_like_embedding(m: nn.Module) -> bool:
    """``m`` has ``nn.Embedding``'s interface (a class recognised by name is checked by
    its attributes, not its type: the rules are chosen by the registries)."""
    return all(hasattr(m, a) for a in ("num_embeddings", "embedding_dim", "padding_idx",
                                       "max_norm", "scale_grad_by_freq", "sparse"))


def _is_falcon_linear(m: nn.Module) -> bool:
    return (type(m).__name__ == "FalconLinear" and not m._modules
            and all(hasattr(m, a) for a in ("in_features", "out_features"))
            and set(m._parameters) <= {"weight", "bias"})


@register_predicate_rule(_is_falcon_linear, casts_input=True)
@verified
def falcon_linear_rule(module: nn.Module, record: Record, params) -> Contribution:
    """Falcon's ``FalconLinear``: ``x @ W.T (+ b)``, ``nn.Linear``'s map written out."""
    return linear_like(record.args[0], record.grad(0), module.weight, module.bias, params)


# --------------------------------------------------------------------------- RMSNorm


def _is_hf_rmsnorm(m: nn.Module) -> bool:
    w = m._parameters.get("weight")
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    # (torch.nn.RMSNorm matches its registered type first: predicates come after types)
    return (type(m).__name__.endswith("RMSNorm")
            and w is not None and w.dim() == 1 and set(m._parameters) == {"weight"}
            and isinstance(eps, float) and not m._modules)


def _rms_contribution(x, g, weight, params, norm, norm_key) -> Contribution:
    """The weight's rows ``g * norm(x)`` (``norm(x)`` in the working dtype, each row of
    ``x`` normalised alone; ``norm_key`` identifies it), summed over positions; during
    backward the normalisation, product and sum formed with the other RMSNorms' of their
    shape (one operation each for all of them)."""
    if not any(q is weight for q in params):
        return Materialized([], [])
    dt = compute_dtype(x, g)
    k = weight.dim()
    reduce_dims = tuple(range(1, x.dim() - k))
    pending = PENDING.get()
    if pending is not None and reduce_dims == (1,):
        held = pending.take_norm_sum(x, as_dtype(g, dt), norm, norm_key)
        if held is not None:
            return Materialized([weight], [held])
    gx = as_dtype(g, dt) * norm(x)
    return Materialized([weight], [_summed(gx, reduce_dims) if reduce_dims else gx])


def _torch_rms(x, shape, eps, dt):
    return F.rms_norm(as_dtype(x, dt), shape, None, eps)


def _hf_rms(x, eps, dt):
    # as the module does, whatever the input dtype
    return as_dtype(_rms_normalised(x.to(torch.float32), eps).to(x.dtype), dt)


@register_rule(nn.RMSNorm, early=True)
def torch_rmsnorm_rule(module: nn.RMSNorm, record: Record, params) -> Contribution:
    """``torch.nn.RMSNorm``: ``grad_w = sum_t g_t * x_t / rms(x_t)``."""
    x, g = record.args[0], record.grad(0)
    dt, shape = compute_dtype(x, g), tuple(module.normalized_shape)
    norm = functools.partial(_torch_rms, shape=shape, eps=module.eps, dt=dt)
    return _rms_contribution(x, g, module.weight, params, norm,
                             ("rms_norm", shape, module.eps, dt))


@register_predicate_rule(_is_hf_rmsnorm, early=True)
@verified
def rmsnorm_rule(module: nn.Module, record: Record, params) -> Contribution:
    """Llama-style RMSNorm: ``w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``."""
    x, g = record.args[0], record.grad(0)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    dt = compute_dtype(x, g)
    norm = functools.partial(_hf_rms, eps=eps, dt=dt)
    return _rms_contribution(x, g, module.weight, params, norm, ("hf_rms_norm", eps, dt))


#: one fused kernel forming ``x * rsqrt(mean(x^2) + eps)`` over the last dimension where
#: this torch has it (on the CPU and CUDA), instead of five operations
_FUSED_RMS = getattr(torch.ops.aten, "_fused_rms_norm", None)


def _rms_normalised(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """``xf * rsqrt(mean(xf^2, -1) + eps)`` of float32 ``xf`` (the same values up to the
    order of the mean's float32 sum): one fused operation where torch has it for the
    device, else the module's own five."""
    if _FUSED_RMS is not None and type(xf) is torch.Tensor \
            and xf.device.type in ("cpu", "cuda"):
        try:
            return _FUSED_RMS(xf, [xf.shape[-1]], None, eps)[0]
        except NotImplementedError:  # no kernel for this device in this build
            pass
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


# --------------------------------------------------------------------------- embeddings


def _embed_scale(m: nn.Module) -> float | None:
    """The ``embed_scale`` a scaled word embedding multiplies its lookup by (a float, or a
    0-d buffer taken in the weight's dtype as the module does), else None."""
    s = getattr(m, "embed_scale", None)
    if isinstance(s, torch.Tensor) and s.dim() == 0 and s.is_floating_point():
        return float(s.to(m.weight.dtype))
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else None


def _is_scaled_embedding(m: nn.Module) -> bool:
    return (looks_like_embedding(m) and type(m).__name__.endswith("ScaledWordEmbedding")
            and set(m._parameters) == {"weight"} and not m._modules
            and _embed_scale(m) is not None)


@register_predicate_rule(_is_scaled_embedding)
@verified
def scaled_embedding_rule(module: nn.Module, record: Record, params) -> Contribution:
    """``embedding(ids) * embed_scale``: the Embedding contribution of ``scale * g``."""
    g = record.grad(0)
    g = as_dtype(g, compute_dtype(g)) * _embed_scale(module)
    return EmbeddingContribution(module.weight, record.args[0], g, module.padding_idx)


# --------------------------------------------------------------------------- ViT


def _is_vit_embeddings(m: nn.Module) -> bool:
    return (type(m).__name__ == "ViTEmbeddings" and "cls_token" in m._parameters
            and "position_embeddings" in m._parameters
            and set(m._parameters) <= {"cls_token", "position_embeddings", "mask_token"}
            and hasattr(m, "patch_embeddings") and hasattr(m, "dropout"))


@register_predicate_rule(_is_vit_embeddings, layout=Layout(batch_dim=0), scope="direct")
def vit_embeddings_rule(module: nn.Module, record: Record, params) -> Contribution:
    """``ViTEmbeddings``: ``dropout(cat(cls, patches) + pos)``; the patch projection is a
    unit of its own, so this rule covers the two (three) parameters the module owns."""
    drop = getattr(module.dropout, "p", 0.0)
    special = (record.kwargs.get("bool_masked_pos") is not None
               or record.kwargs.get("interpolate_pos_encoding")
               or len(record.args) > 1)
    if special or (drop > 0 and module.dropout.training):
        return fallback_rule(module, record, params)
    g = record.grad(0)
    g = as_dtype(g, compute_dtype(g))
    b = g.shape[0]
    out_p, out_g = [], []
    for q in params:
        if q is module.cls_token:
            out_p.append(q)
            out_g.append(g[:, :1, :].reshape(b, *q.shape))
        elif q is module.position_embeddings:
            out_p.append(q)
            out_g.append(g.reshape(b, *q.shape))
        else:  # mask_token: only used with bool_masked_pos (handled above)
            out_p.append(q)
            out_g.append(g.new_zeros(b, *q.shape))
    return Materialized(out_p, out_g)

