"""Layers that torch cannot run on an empty batch, run on one by the engine.

A Poisson batch can be empty; its step is the noise alone, accounted like any other
(Abadi et al. 2016, Algorithm 1, with Poisson sampling as the accountant assumes). The
loop still calls the model on the zero-row batch, which every layer the engine supports
computes, except torch's ``instance_norm`` with a weight (an affine
``nn.InstanceNorm1d/2d/3d``), which raises ``IndexError`` on zero rows. While the engine
is attached, such a layer's ``forward`` is an instance attribute that answers a zero-row
input with ``group_norm`` over one group per channel (the same function, which torch
runs on zero rows) and any other input with the layer's own ``forward``; the engine's
hooks see the same input either way. :data:`ZERO_ROW_FORWARDS` is the registry of these
layer types; :func:`install_zero_row_forwards` returns the handles that put the layers
back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZERO_ROW_FORWARDS", "install_zero_row_forwards"]


def _instance_norm(module: nn.modules.instancenorm._InstanceNorm,
                   x: torch.Tensor) -> torch.Tensor:
    module._check_input_dim(x)
    return F.group_norm(x, x.shape[1], module.weight, module.bias, module.eps)


#: Layer type -> ``forward(module, x)`` for an ``x`` of zero rows (on the batch dimension).
ZERO_ROW_FORWARDS: dict[type, Callable] = {
    nn.modules.instancenorm._InstanceNorm: _instance_norm,
}


class _ZeroRowForward:
    """The ``forward`` of ``module`` while the engine is attached: ``zero_rows`` on a
    batched input of zero rows, the layer's own ``forward`` otherwise. A module-level
    class, so that a model holding it still pickles and deep-copies (the copy's calls
    its own layer)."""

    def __init__(self, module: nn.Module, zero_rows: Callable, previous) -> None:
        self.module, self.zero_rows, self.previous = module, zero_rows, previous

    def __call__(self, x, *args, **kwargs):
        m = self.module
        batched = isinstance(x, torch.Tensor) and x.dim() > getattr(
            m, "_get_no_batch_dim", lambda: 1)()
        if batched and x.shape[0] == 0 and not args and not kwargs:
            return self.zero_rows(m, x)
        if self.previous is not None:
            return self.previous(x, *args, **kwargs)
        return type(m).forward(m, x, *args, **kwargs)


class _Restore:
    """Handle putting back the ``forward`` a module had before (``remove()``)."""

    def __init__(self, module: nn.Module, installed: _ZeroRowForward) -> None:
        self.module, self.installed = module, installed

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self.installed:
            if self.installed.previous is None:
                del self.module.forward
            else:
                self.module.forward = self.installed.previous


def own_forward(module: nn.Module):
    """The ``forward`` set on ``module`` itself (an instance attribute) other than the
    engine's zero-row one (the forward that one replaced, if any), else None."""
    f = module.__dict__.get("forward")
    return f.previous if isinstance(f, _ZeroRowForward) else f


def install_zero_row_forwards(model: nn.Module) -> list[_Restore]:
    """Give each layer of ``model`` of a type in :data:`ZERO_ROW_FORWARDS` its zero-row
    forward; the handles (``remove()``) put the layers back."""
    handles = []
    for module in model.modules():
        zero_rows = next((f for t, f in ZERO_ROW_FORWARDS.items() if isinstance(module, t)),
                         None)
        if zero_rows is None or isinstance(module.__dict__.get("forward"), _ZeroRowForward):
            continue
        installed = _ZeroRowForward(module, zero_rows, module.__dict__.get("forward"))
        module.forward = installed
        handles.append(_Restore(module, installed))
    return handles
