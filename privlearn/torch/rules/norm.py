"""Per-example rules for :class:`torch.nn.LayerNorm`, :class:`torch.nn.GroupNorm` and
``nn.InstanceNorm1d/2d/3d``: the weight's per-example gradient is ``sum g * xhat``
(``xhat`` the input normalised with its own statistics), the bias's ``sum g``.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn

from privlearn.errors import BatchDependenceError
from privlearn.torch._ghost_pending import PENDING
from privlearn.torch.grad_sample import (
    Contribution,
    Layout,
    Materialized,
    Record,
    as_dtype,
    compute_dtype,
    live_positions,
    register_rule,
)

__all__ = ['layernorm_rule', 'groupnorm_rule', 'instancenorm_rule']


def _affine_norm_rule(module, record, params, xhat, g, reduce_dims, held=None):
    """``held``: the weight's rows already held by the pending sums (``xhat`` unused)."""
    ps = set(params)
    out_p, out_g = [], []
    if module.weight is not None and module.weight in ps:
        out_p.append(module.weight)
        if held is not None:
            out_g.append(held)
        else:
            out_g.append(_summed(g * xhat, reduce_dims) if reduce_dims else g * xhat)
    if module.bias is not None and module.bias in ps:
        out_p.append(module.bias)
        out_g.append(_summed(g, reduce_dims) if reduce_dims else g)
    return Materialized(out_p, out_g)


def _summed(x, reduce_dims):
    """``x.sum(reduce_dims)``; during backward (the tracker's
    :class:`~privlearn.torch._ghost_pending.PendingProducts` in force), a ``(B, T, n)``
    ``x`` summed over positions with the other layers' of its shape (one stacked sum for
    all the LayerNorms of a transformer: the same sums, read once the pass ends)."""
    pending = PENDING.get()
    if pending is not None and reduce_dims == (1,) and x.dim() == 3 and x.is_contiguous():
        held = pending.take_sum(x)
        if held is not None:
            return held
    return x.sum(reduce_dims)


@register_rule(nn.LayerNorm, early=True)
def layernorm_rule(module: nn.LayerNorm, record: Record, params) -> Contribution:
    x, g = record.args[0], record.grad(0)
    dt = compute_dtype(x, g)
    x, g = as_dtype(x, dt), as_dtype(g, dt)
    k = len(module.normalized_shape)
    if x.dim() == k + 2 and g.shape == x.shape:  # (B, T, *shape): drop dead positions
        live = live_positions(g.reshape(g.shape[0], 1, g.shape[1], -1))
        if live is not None:
            x, g = x.index_select(1, live), g.index_select(1, live)
    reduce_dims = tuple(range(1, x.dim() - k))
    pending = PENDING.get()
    if (pending is not None and reduce_dims == (1,) and module.weight is not None
            and any(q is module.weight for q in params)):
        # during backward: the normalisation, product and sum over positions formed with
        # the other LayerNorms' of this shape (one each for all of them)
        shape, eps = tuple(module.normalized_shape), module.eps
        held = pending.take_norm_sum(
            x, g, functools.partial(F.layer_norm, normalized_shape=shape, eps=eps),
            ("layer_norm", shape, eps))
        if held is not None:
            return _affine_norm_rule(module, record, params, None, g, reduce_dims, held)
    xhat = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    return _affine_norm_rule(module, record, params, xhat, g, reduce_dims)


@register_rule(nn.GroupNorm, layout=Layout(batch_dim=0), early=True)
def groupnorm_rule(module: nn.GroupNorm, record: Record, params) -> Contribution:
    x, g = record.args[0], record.grad(0)
    dt = compute_dtype(x, g)
    x, g = as_dtype(x, dt), as_dtype(g, dt)
    xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
    reduce_dims = tuple(range(2, x.dim()))
    return _affine_norm_rule(module, record, params, xhat, g, reduce_dims)


@register_rule(nn.modules.instancenorm._InstanceNorm, layout=Layout(batch_dim=0),
               early=True)
def instancenorm_rule(module: nn.modules.instancenorm._InstanceNorm, record: Record,
                      params) -> Contribution:
    """InstanceNorm (affine): each example and channel is normalised with its own
    statistics (in training, with or without running statistics, which the validator
    refuses), then scaled per channel: ``grad_w[c] = sum_s g[c, s] xhat[c, s]``."""
    x, g = record.args[0], record.grad(0)
    if x.dim() == module._get_no_batch_dim():
        raise BatchDependenceError(f"{type(module).__name__} received an unbatched input of shape "
                         f"{tuple(x.shape)}; per-example clipping needs a batch dimension")
    dt = compute_dtype(x, g)
    x, g = as_dtype(x, dt), as_dtype(g, dt)
    xhat = F.instance_norm(x, use_input_stats=True, eps=module.eps)
    reduce_dims = tuple(range(2, x.dim()))
    return _affine_norm_rule(module, record, params, xhat, g, reduce_dims)
