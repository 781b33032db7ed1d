"""Per-example gradients of PyTorch's own ``nn.MultiheadAttention`` (used as it is).

All weights of the layer enter through affine maps of the inputs:
``Q = q W_q^T + b_q``, ``K = k W_k^T + b_k``, ``V = v W_v^T + b_v`` (row blocks of
``in_proj_weight``, or the separate ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ)
and ``out = O W_o^T + b_o`` with ``O`` the concatenated head outputs. Their per-example
gradients are therefore outer-product sums over positions (the Linear rule, ghost or
materialised, see :mod:`privlearn.torch.grad_sample`). The rule recomputes scaled
dot-product attention from the recorded inputs (Vaswani et al. 2017, Eq. 1; PyTorch's
``F.multi_head_attention_forward``) and gets ``dQ, dK, dV`` with one
``torch.autograd.grad`` call seeded by the recorded output gradients. No loop over
examples. ``add_bias_kv`` and ``add_zero_attn`` use the generic ``torch.func``
fallback. Attention dropout (``dropout > 0``, as in ``nn.TransformerEncoderLayer``'s
default) is applied by the instrumented forward itself (:class:`AttentionCapture`), which
catches ``dQ, dK, dV`` and ``O`` as the step's masks made them, so nothing is replayed;
where that forward cannot run (``add_bias_kv``, ``add_zero_attn``, a tracker built with
``instrument_attention=False``) dropout is refused, since its masks cannot be reproduced.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from privlearn.errors import BatchDependenceError, UnsupportedModuleError
from privlearn.torch._compile import skip_dynamo
from privlearn.torch.fallback import fallback_rule
from privlearn.torch.grad_sample import (
    Contribution,
    Layout,
    Materialized,
    OuterProduct,
    Record,
    make_differentiable,
    register_instrumenter,
    register_rule,
    rule_evaluation,
)

__all__ = ["AttentionCapture", "mha_rule"]


class _Shape:
    def __init__(self, *shape):
        self.shape = torch.Size(shape)


class RowBlocks(Contribution):
    """A weight (and bias) made of row blocks, each an outer-product contribution."""

    def __init__(self, weight, bias, blocks: list[OuterProduct]):
        self.params = (weight,) if bias is None else (weight, bias)
        self.bias = bias
        self.blocks = blocks
        self.masks_rows = all(b.masks_rows for b in blocks)
        self._sq = None

    def sq_norms(self):
        if self._sq is None:
            self._sq = sum(b.sq_norms() for b in self.blocks)
        return self._sq

    def weighted_sum(self, c):
        parts = [b.weighted_sum(c) for b in self.blocks]
        out = [torch.cat([p[0] for p in parts], 0)]
        if self.bias is not None:
            out.append(torch.cat([p[1] for p in parts], 0))
        return out

    def per_sample(self):
        parts = [b.per_sample() for b in self.blocks]
        out = [torch.cat([p[0] for p in parts], 1)]
        if self.bias is not None:
            out.append(torch.cat([p[1] for p in parts], 1))
        return out


def _arg(record: Record, i: int, name: str, default=None):
    if len(record.args) > i:
        return record.args[i]
    return record.kwargs.get(name, default)


def _op(a, g, w_shape, with_bias):
    b, t = a.shape[:2]
    return OuterProduct(_Shape(*w_shape), _Shape(w_shape[0]) if with_bias else None,
                        a.reshape(b, 1, t, -1), g.reshape(b, 1, t, -1))


def _mha_batch_dim(module: nn.MultiheadAttention) -> int:
    return 0 if module.batch_first else 1


def _mha_batch_size(module: nn.MultiheadAttention, record: Record) -> int:
    return _arg(record, 0, "query").shape[_mha_batch_dim(module)]


def _mha_dim(name, t, batch_first):
    if not isinstance(t, torch.Tensor):
        return None
    if name in ("query", "key", "value"):
        return 0 if batch_first else 1
    if name == "key_padding_mask":
        return 0
    if name == "attn_mask":
        if t.dim() == 3:
            raise UnsupportedModuleError(
                "MultiheadAttention with a 3-D (per-example) attn_mask is not "
                "supported by per-example clipping; use key_padding_mask")
        return None
    return None


def _mha_record_dims(module: nn.MultiheadAttention, record: Record, batch: int):
    """Batch dimension of the recorded query/key/value (by ``batch_first``), the key
    padding mask (0), the attention mask (shared) and the outputs."""
    names = ["query", "key", "value", "key_padding_mask", "need_weights", "attn_mask"]
    arg_dims = [_mha_dim(names[i] if i < len(names) else "", a, module.batch_first)
                for i, a in enumerate(record.args)]
    kw_dims = {k: _mha_dim(k, v, module.batch_first) for k, v in record.kwargs.items()}
    out_dims = [_mha_batch_dim(module), 0][: len(record.outputs_meta)]  # output, weights
    return arg_dims, kw_dims, out_dims


@register_rule(nn.MultiheadAttention,
               layout=Layout(batch_dim=_mha_batch_dim, own_layout=True,
                             expand_broadcast=False, batch_size=_mha_batch_size,
                             record_dims=_mha_record_dims))
def mha_rule(module: nn.MultiheadAttention, record: Record, params) -> Contribution:
    if module.dropout > 0 and module.training and record.extra is None:
        raise UnsupportedModuleError("MultiheadAttention with dropout > 0 is supported only "
                         "where its forward is instrumented (no add_bias_kv, no "
                         "add_zero_attn): the dropout masks cannot be reproduced")
    if module.bias_k is not None or module.add_zero_attn:
        b = _mha_batch_size(module, record)
        return fallback_rule(module, record, params,
                             dims=(b, *_mha_record_dims(module, record, b)))
    q, k, v = _arg(record, 0, "query"), _arg(record, 1, "key"), _arg(record, 2, "value")
    kpm = _arg(record, 3, "key_padding_mask")
    need_weights = _arg(record, 4, "need_weights", True)
    attn_mask = _arg(record, 5, "attn_mask")
    average = _arg(record, 6, "average_attn_weights", True)
    is_causal = _arg(record, 7, "is_causal", False)
    if q.dim() != 3:
        raise BatchDependenceError("MultiheadAttention received an unbatched input; per-example "
                         "clipping needs a batch dimension")
    if not module.batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    B, L, E = q.shape
    S = k.shape[1]
    H = module.num_heads
    if module._qkv_same_embed_dim:
        wq, wk, wv = module.in_proj_weight.detach().chunk(3)
    else:
        wq, wk, wv = (module.q_proj_weight.detach(), module.k_proj_weight.detach(),
                      module.v_proj_weight.detach())
    if module.in_proj_bias is not None:
        bq, bk, bv = module.in_proj_bias.detach().chunk(3)
    else:
        bq = bk = bv = None
    wo = module.out_proj.weight.detach()

    mask = _additive_mask(q, B, H, L, S, attn_mask, kpm, is_causal)

    g_out = record.grad(0)
    if not module.batch_first:
        g_out = g_out.transpose(0, 1)
    extra = record.extra
    if extra is not None and extra["packed"] is not None:  # self-attention, one projection
        O = extra["O"]
        d = extra["packed"][0]
        d = O.new_zeros(B, L, 3 * E) if d is None else d
        return _assemble(module, params, q, k, v, O, g_out, B, L, E, packed=d)
    if extra is not None:  # captured by the instrumented forward: no recomputation
        O = extra["O"]
        dQ, dK, dV = (O.new_zeros(B, n, E) if d is None else d
                      for d, n in zip(extra["grads"], (L, S, S), strict=True))
    else:
        g_w = None
        if need_weights and len(record.grad_outputs) > 1 and \
                record.grad_outputs[1] is not None:
            g_w = record.grad(1)
        with rule_evaluation(), torch.enable_grad():
            Q = F.linear(q, wq, bq).requires_grad_()
            K = F.linear(k, wk, bk).requires_grad_()
            V = F.linear(v, wv, bv).requires_grad_()
            O, attn = _attend(Q, K, V, H, mask, g_w is not None)
            # d loss / d O through the output projection
            g_O = torch.matmul(g_out, wo)
            targets, seeds = [O], [g_O]
            if g_w is not None:
                targets.append(attn.mean(1) if average else attn)
                seeds.append(g_w)
            dQ, dK, dV = torch.autograd.grad(targets, [Q, K, V], seeds)
        O = O.detach()

    return _assemble(module, params, q, k, v, O, g_out, B, L, E, dQ=dQ, dK=dK, dV=dV)


def _assemble(module, params, q, k, v, O, g_out, B, L, E, dQ=None, dK=None, dV=None,
              packed=None) -> Contribution:
    """Outer-product contributions of the projections from their inputs and the
    gradients of their outputs."""
    ps = set(params)
    parts: list[Contribution] = []
    if packed is not None:  # q is k is v: in_proj is one Linear on q
        w = module.in_proj_weight if module.in_proj_weight in ps else None
        b = module.in_proj_bias
        b = b if b is not None and b in ps else None
        if w is not None:
            parts.append(OuterProduct(w, b, q.reshape(B, 1, L, E), packed.reshape(B, 1, L, -1)))
        elif b is not None:
            parts.append(Materialized([b], [packed.sum(1)]))
        dQ = dK = dV = None
    with_b = module.in_proj_bias is not None and module.in_proj_bias in ps
    if packed is not None:
        pass
    elif module._qkv_same_embed_dim:
        if module.in_proj_weight in ps:
            blocks = [_op(a, g, (E, a.shape[-1]), with_b)
                      for a, g in ((q, dQ), (k, dK), (v, dV))]
            parts.append(RowBlocks(module.in_proj_weight,
                                   module.in_proj_bias if with_b else None, blocks))
        elif with_b:
            parts.append(Materialized([module.in_proj_bias],
                                      [torch.cat([dQ.sum(1), dK.sum(1), dV.sum(1)], 1)]))
    else:
        for w, a, g in ((module.q_proj_weight, q, dQ), (module.k_proj_weight, k, dK),
                        (module.v_proj_weight, v, dV)):
            if w in ps:
                parts.append(_op(a, g, tuple(w.shape), False))
                parts[-1].params = (w,)
                parts[-1].weight = w
        if with_b:
            parts.append(Materialized([module.in_proj_bias],
                                      [torch.cat([dQ.sum(1), dK.sum(1), dV.sum(1)], 1)]))
    ow, ob = module.out_proj.weight, module.out_proj.bias
    ow = ow if ow in ps else None
    ob = ob if ob is not None and ob in ps else None
    if ow is not None:
        op = OuterProduct(ow, ob, O.reshape(B, 1, L, E), g_out.reshape(B, 1, L, -1))
        parts.append(op)
    elif ob is not None:
        parts.append(Materialized([ob], [g_out.sum(1)]))
    from privlearn.torch.grad_sample import Compound

    return Compound(parts)


def _additive_mask(q, B, H, L, S, attn_mask, kpm, is_causal):
    """Float mask ``(B or 1, H or 1, L, S)`` added to the attention scores (None: none),
    with PyTorch's conventions (boolean True = not allowed)."""
    mask = None
    if attn_mask is not None:
        am = attn_mask
        if am.dtype == torch.bool:
            am = torch.zeros_like(am, dtype=q.dtype).masked_fill(am, float("-inf"))
        mask = am.view(B, H, L, S) if am.dim() == 3 else am.view(1, 1, L, S)
    elif is_causal:
        mask = torch.full((L, S), float("-inf"), dtype=q.dtype).triu(1).view(1, 1, L, S)
    if kpm is not None:
        km = kpm
        if km.dtype == torch.bool:
            km = torch.zeros_like(km, dtype=q.dtype).masked_fill(km, float("-inf"))
        km = km.view(B, 1, 1, S)
        mask = km if mask is None else mask + km
    return mask


def _attend(Q, K, V, H, mask, need_weights, dropout_p=0.0):
    """Scaled dot-product attention of batch-first projections ``(B, L|S, E)``: returns
    ``O (B, L, E)`` (heads concatenated) and the attention matrix (when asked; after
    dropout with probability ``dropout_p``, as ``F.multi_head_attention_forward``
    returns it)."""
    B, L, E = Q.shape
    S = K.shape[1]
    hd = E // H
    Qh = Q.view(B, L, H, hd).transpose(1, 2)
    Kh = K.view(B, S, H, hd).transpose(1, 2)
    Vh = V.view(B, S, H, hd).transpose(1, 2)
    attn = None
    if not need_weights:  # fused kernel (no attention matrix kept)
        O = F.scaled_dot_product_attention(Qh, Kh, Vh, attn_mask=mask, dropout_p=dropout_p)
    else:
        scores = torch.matmul(Qh, Kh.transpose(-1, -2)) / math.sqrt(hd)
        if mask is not None:
            scores = scores + mask
        attn = torch.softmax(scores, -1)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        O = torch.matmul(attn, Vh)
    return O.transpose(1, 2).reshape(B, L, E), attn


def instrumentable(module: nn.MultiheadAttention) -> bool:
    """Whether :class:`AttentionCapture` reproduces this attention layer (registered
    for ``nn.MultiheadAttention`` and its subclasses)."""
    return module.bias_k is None and not module.add_zero_attn


_MHA_FORWARD = F.multi_head_attention_forward
_MHA_SIGNATURE = inspect.signature(_MHA_FORWARD)


class AttentionCapture(TorchFunctionMode):
    """Makes the projections ``Q, K, V`` and the head outputs ``O`` of one
    ``nn.MultiheadAttention`` call visible, without touching the module.

    The tracker enters this mode in a forward pre-hook of an instrumentable attention
    layer and leaves it in a forward hook (``always_call=True``, so also when the
    forward raises). While it is active, ``nn.MultiheadAttention.forward`` runs
    unchanged up to its call of ``F.multi_head_attention_forward``, which the mode
    intercepts (PyTorch's ``__torch_function__`` protocol for modes) and computes with
    the same equations written out (:func:`_capture_forward`): tensor hooks catch
    ``dQ, dK, dV`` during the user's backward pass, so the rule needs no recomputation.
    Every other function passes through. What was captured is handed to ``sink`` (a
    side table of the tracker); nothing is stored on the module.
    """

    def __init__(self, sink) -> None:
        super().__init__()
        self._sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _MHA_FORWARD:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments["query"].dim() != 3:  # unbatched: nothing to capture
                return func(*args, **kwargs)
            out, weights, extra = _capture_forward(bound.arguments)
            self._sink(extra)
            return out, weights
        return func(*args, **kwargs)


def _capture_forward(a: dict):
    """``F.multi_head_attention_forward`` (sequence-first inputs ``(L, B, E)``) for an
    instrumentable layer (no ``bias_k``, no ``add_zero_attn``), with the projections'
    gradients and ``O`` captured (after attention dropout in training, drawn here).
    Returns ``(output, weights, extra)``."""
    query, key, value = a["query"], a["key"], a["value"]
    self_attention = query is key and key is value and not a["use_separate_proj_weight"]
    q, k, v = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    B, L, E = q.shape
    S = k.shape[1]
    H = a["num_heads"]
    in_w, in_b = a["in_proj_weight"], a["in_proj_bias"]
    if a["use_separate_proj_weight"]:
        wq, wk, wv = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
    else:
        wq, wk, wv = in_w.chunk(3)
    if in_b is not None:
        bq, bk, bv = in_b.chunk(3)
    else:
        bq = bk = bv = None
    extra = {"grads": [None, None, None], "O": None, "packed": None}
    if self_attention:
        # self-attention: one packed projection, as PyTorch does
        t = F.linear(q, in_w, in_b)
        if not t.requires_grad:
            t = make_differentiable(t, _DUMMY)
        slot = [None]
        t.register_hook(_store(slot, 0))
        extra["packed"] = slot
        proj = list(t.chunk(3, -1))
    else:
        proj = []
        for j, (x, w, b) in enumerate(((q, wq, bq), (k, wk, bk), (v, wv, bv))):
            t = F.linear(x, w, b)
            if not t.requires_grad:
                t = make_differentiable(t, _DUMMY)
            t.register_hook(_store(extra["grads"], j))
            proj.append(t)
    mask = _additive_mask(q, B, H, L, S, a["attn_mask"], a["key_padding_mask"],
                          a["is_causal"])
    need_weights = a["need_weights"]
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    O, attn = _attend(proj[0], proj[1], proj[2], H, mask, need_weights, dropout_p)
    extra["O"] = O.detach()
    out = F.linear(O, a["out_proj_weight"], a["out_proj_bias"]).transpose(0, 1)
    weights = None
    if need_weights:
        weights = attn.mean(1) if a["average_attn_weights"] else attn
    return out, weights, extra


_DUMMY = torch.zeros((), requires_grad=True)


def _store(slots, j):
    def fn(g):
        slots[j] = g if slots[j] is None else slots[j] + g
    return fn


skip_dynamo(_store(None, 0).__code__)  # run eagerly in a backward() under torch.compile


register_instrumenter(nn.MultiheadAttention, applies=instrumentable)(AttentionCapture)
