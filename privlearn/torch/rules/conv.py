"""Per-example rules for :class:`torch.nn.Conv1d`, :class:`torch.nn.Conv2d` and
:class:`torch.nn.Conv3d`: the convolution is a Linear layer on unfolded patches
(Rochette et al. 2019, "Efficient per-example gradient computations in convolutional
neural networks"), any groups, strides, dilations, paddings and padding modes.
``Conv3d``'s materialised per-example gradients come from PyTorch's convolution backward
vmapped over the examples instead (faster there; the patches serve its ghost norms).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from privlearn.errors import BatchDependenceError
from privlearn.torch import grad_sample
from privlearn.torch.grad_sample import (
    Contribution,
    Layout,
    Materialized,
    OuterProduct,
    Record,
    as_dtype,
    compute_dtype,
    register_rule,
)

__all__ = ['conv1d_rule', 'conv2d_rule', 'conv3d_rule']


def _conv_patches(module, x: torch.Tensor, nd: int) -> torch.Tensor:
    """Patches of the (padded) input as rows: ``(B, G, L, C_in / G * prod(kernel))``, with
    ``L`` the number of output positions of the ``nd``-dimensional convolution.

    Built with ``as_strided`` and one copy (several times faster on CPU than
    ``F.unfold``/im2col for the usual small images); the row layout ``(channel, *kernel)``
    is the layout of the weight ``(C_out, C_in / G, *kernel)``.
    """
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pad = module._reversed_padding_repeated_twice
    if any(pad):
        x = F.pad(x, pad, mode=mode)
    k, s, dl = module.kernel_size, module.stride, module.dilation
    x = x.contiguous()
    b, c = x.shape[:2]
    out = [(n - d * (kk - 1) - 1) // st + 1
           for n, kk, st, d in zip(x.shape[2:], k, s, dl, strict=True)]
    G = module.groups
    sb, sc, *sp = x.stride()
    v = x.as_strided(
        (b, G, *out, c // G, *k),
        (sb, sc * (c // G), *(a * st for a, st in zip(sp, s, strict=True)), sc,
         *(a * d for a, d in zip(sp, dl, strict=True))))
    return v.reshape(b, G, math.prod(out), (c // G) * math.prod(k))


def _conv_rule(module, record: Record, params, nd: int) -> Contribution:
    x = record.args[0]
    g = record.grad(0)
    if x.dim() == nd + 1:  # unbatched input
        raise BatchDependenceError(f"{type(module).__name__} received an unbatched input of shape "
                         f"{tuple(x.shape)}; per-example clipping needs a batch dimension")
    b, G = x.shape[0], module.groups
    p = module.out_channels // G
    ps = set(params)
    w = module.weight if module.weight in ps else None
    bias = module.bias if module.bias is not None and module.bias in ps else None
    dt = compute_dtype(x, g)
    gg = as_dtype(g, dt).reshape(b, G, p, -1).transpose(-1, -2)  # (B, G, L, p)
    if w is None:
        return Materialized([bias], [gg.sum(2).reshape(b, G * p)])
    if nd == 3:
        d = module.weight[0].numel()
        if not grad_sample.use_ghost(b, G, gg.shape[2], d, p, gg.element_size()):
            grads = [_conv_weight_per_example(module, as_dtype(x, dt), as_dtype(g, dt))]
            if bias is not None:
                grads.append(gg.sum(2).reshape(b, G * p))
            return Materialized([w] if bias is None else [w, bias], grads)
    a = _conv_patches(module, as_dtype(x, dt), nd)  # (B, G, L, d)
    return OuterProduct(w, bias, a, gg)


def _conv_weight_per_example(module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients ``(B, *weight.shape)`` by PyTorch's own convolution
    backward, vmapped over the examples (its batching rule runs one grouped convolution;
    for 3-D convolutions several times faster on CPU than unfolding the patches, and it
    stores no patch tensor)."""
    from torch.func import vmap

    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pad = module._reversed_padding_repeated_twice
    if any(pad):  # padded explicitly (padding modes, asymmetric "same"): no padding below
        x = F.pad(x, pad, mode=mode)
    nd = x.dim() - 2
    weight = module.weight.detach().to(x.dtype)

    def one(xi, gi):
        return torch.ops.aten.convolution_backward(
            gi.unsqueeze(0), xi.unsqueeze(0), weight, None, module.stride, [0] * nd,
            module.dilation, False, [0] * nd, module.groups, [False, True, False])[1]

    return vmap(one)(x, g)


@register_rule(nn.Conv1d, layout=Layout(batch_dim=0))
def conv1d_rule(module, record, params):
    return _conv_rule(module, record, params, 1)


@register_rule(nn.Conv2d, layout=Layout(batch_dim=0))
def conv2d_rule(module, record, params):
    return _conv_rule(module, record, params, 2)


@register_rule(nn.Conv3d, layout=Layout(batch_dim=0))
def conv3d_rule(module, record, params):
    return _conv_rule(module, record, params, 3)
