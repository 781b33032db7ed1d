"""The buffers of a parametrized layer's parametrizations as its training forward began,
kept for the generic rule's recomputation of that call.

``torch.nn.utils.parametrizations.spectral_norm`` runs a power iteration in training
mode: each forward first updates its buffers ``_u`` and ``_v`` in place, then divides the
weight by the spectral norm estimated from them. A parametrized layer's per-example
gradients come from the generic rule (:mod:`privlearn.torch.fallback`), which calls the
layer again after ``backward()``, when those buffers have already moved on: that call
ran one more power iteration, so it differentiated another weight than the one the
forward used (the clipped sum then differed from the batch-of-one loop's by about 1e-4
of its norm at the first step), and it left the module's buffers one iteration ahead of
an ordinary training run at every step. With the buffers as the forward found them
(copies, taken by a forward pre-hook of each such layer), the recomputation runs the
same iteration the forward ran, computes the same weight, and leaves the module's own
buffers as the forward left them.

Only training forwards with gradients that the engine records keep a copy (not the
batch-independence probe's passes, which run without gradients, nor a recomputation
during ``backward()``); a copy is a few vectors per parametrized layer.
"""

from __future__ import annotations

import torch

from privlearn.torch._tracker_util import _eager, _in_backward
from privlearn.torch.grad_sample import _IN_RULE

__all__ = ["install"]


def _buffer_names(module) -> list[str]:
    """The floating buffers of ``module.parametrizations`` (torch's parametrization
    container, duck typed), by their names relative to ``module``."""
    plist = getattr(module, "parametrizations", None)
    named = getattr(plist, "named_buffers", None)
    if named is None:
        return []
    return [f"parametrizations.{n}" for n, b in named() if b.is_floating_point()]


def _recorded(module) -> bool:
    """Whether the engine records this call of ``module`` (its record hook's conditions)."""
    return module.training and torch.is_grad_enabled() and not _IN_RULE.get() and not _in_backward()


def install(tracker, fallback_rule) -> list:
    """Pre- and post-forward hooks on every unit of ``tracker`` whose rule is
    ``fallback_rule`` and whose module has parametrizations with buffers: the pre-hook
    copies the buffers, the post-hook (after the engine's record hook, which runs first)
    gives the copy to the call's record as ``Record.state``. Returns the handles."""
    handles = []
    for index, unit in enumerate(tracker.units):
        if unit.rule is not fallback_rule:
            continue
        names = _buffer_names(unit.module)
        if not names:
            continue
        pending: list[dict] = []

        def pre(module, args, names=names, pending=pending):
            if _recorded(module):
                buffers = dict(module.named_buffers())
                pending.append({n: buffers[n].detach().clone() for n in names})

        def post(module, args, output, index=index, pending=pending):
            if _recorded(module) and pending:
                state = pending.pop()
                records = tracker.records.get(index)
                if records:
                    records[-1].state = state

        handles.append(unit.module.register_forward_pre_hook(_eager(pre)))
        handles.append(unit.module.register_forward_hook(_eager(post)))
    return handles
