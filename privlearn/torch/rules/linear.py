"""Per-example rule for :class:`torch.nn.Linear` (ghost norms or materialised outer
products, chosen by :func:`privlearn.torch.grad_sample.use_ghost`); moved out of
:mod:`privlearn.torch.grad_sample`, which still re-exports its names.
"""

from __future__ import annotations

import torch
from torch import nn

from privlearn.torch.grad_sample import (
    Contribution,
    DenseOuterProduct,
    Materialized,
    OuterProduct,
    Record,
    as_dtype,
    compute_dtype,
    register_rule,
)

__all__ = ['linear_rule', 'linear_like']


@register_rule(nn.Linear, casts_input=True)
def linear_rule(module: nn.Linear, record: Record, params) -> Contribution:
    return linear_like(record.args[0], record.grad(0), module.weight, module.bias, params)


def linear_like(a: torch.Tensor, g: torch.Tensor, weight, bias, params,
                transposed: bool = False) -> Contribution:
    """Contribution of ``y = a W^T + b`` (``transposed``: ``y = a W + b``) applied over
    the last dimension of ``a``, from its input ``a`` and output gradient ``g``."""
    ps = set(params)
    w = weight if weight in ps else None
    bias = bias if bias is not None and bias in ps else None
    if a.dim() == 2 and w is not None:
        return DenseOuterProduct(w, bias, a, g, transposed=transposed)
    b = a.shape[0]
    d, p = a.shape[-1], g.shape[-1]
    g = g.reshape(b, 1, -1, p)
    if w is None:  # frozen weight, trainable bias
        return Materialized([bias], [as_dtype(g, compute_dtype(g)).sum(2).reshape(b, p)])
    # as recorded: the outer product converts them to its working dtype where it uses
    # them (half precision stays so where LOW_PRECISION_MATMUL keeps it)
    return OuterProduct(w, bias, a.reshape(b, 1, -1, d), g, transposed=transposed)
