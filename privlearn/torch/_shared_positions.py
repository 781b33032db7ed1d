"""Learned positional embeddings whose output is shared by the whole batch (BART's decoder
calls ``embed_positions`` on position ids of shape ``(1, T)`` and adds the ``(1, T, d)``
result to every example's ``(B, T, d)`` embeddings): the gradient autograd hands the
layer would be the sum over the batch, so the engine expands the output over the batch
itself (``output.expand(B, ...)``, a stride-0 view: the sum downstream has the same
values) and the layer's hook sees one row of output gradient per example.

The per-example gradient of the table is then ``J^T g_i``, ``J`` the Jacobian of the
shared output (one forward of the layer on its recorded inputs) and ``g_i`` example
``i``'s row of the output gradient (:func:`shared_positions_rule`). It is exact when the
shared output depends on no example, which the batch-independence probe checks: an
output computed from the batch's contents would move every example's rows downstream.

Only modules whose class subclasses ``nn.Embedding`` and is named
``*LearnedPositionalEmbedding`` (BART, mBART, PLBart, ...) get this rule; when they are
called with per-example positions (BART's encoder: an output of ``B`` rows) the rule is
the generic ``torch.func`` one.
"""

from __future__ import annotations

import torch
from torch import nn

from privlearn.torch.fallback import FALLBACK
from privlearn.torch.grad_sample import Contribution, Materialized, Record, register_predicate_rule
from privlearn.torch.rules.transformers import looks_like_embedding as _looks_like_embedding

__all__ = ["expand_shared", "shared_positions_rule"]


def _is_learned_positions(m: nn.Module) -> bool:
    return (type(m).__name__.endswith("LearnedPositionalEmbedding")
            and _looks_like_embedding(m)
            and set(m._parameters) == {"weight"} and not m._modules)


@register_predicate_rule(_is_learned_positions)
def shared_positions_rule(module: nn.Module, record: Record, params) -> Contribution:
    """Per-example gradients of a positional table whose output the engine expanded over
    the batch (module docstring); the generic rule for a per-example output."""
    if not getattr(record, "shared_output", False):
        return FALLBACK.compute(module, record, params)
    from torch.func import functional_call, vjp, vmap

    names = [n for n, p in module.named_parameters() if p in set(params)]
    pvals = {n: p.detach() for n, p in module.named_parameters() if n in names}

    def f(pv):
        return functional_call(module, pv, record.args, record.kwargs)

    out, back = vjp(f, pvals)
    g = record.grad(0).to(out.dtype)  # (B, *out.shape[1:])
    grads = vmap(lambda gi: back(gi.unsqueeze(0))[0])(g)
    return Materialized([dict(module.named_parameters())[n] for n in names],
                        [grads[n] for n in names])


def expand_shared(tracker, index: int, hook):
    """The recording hook of unit ``index`` wrapped: a call of a learned positional
    embedding (:func:`shared_positions_rule`) whose output has one row while the batch
    has ``B > 1`` is recorded, and returned to its caller, as the output expanded to
    ``B`` rows."""
    unit = tracker.units[index]
    if unit.rule.compute is not shared_positions_rule:
        return hook
    from privlearn.torch.grad_sample import _IN_RULE, make_differentiable

    def wrapped(module, args, kwargs, output):
        b = tracker._batch_hint
        if (b <= 1 or type(output) is not torch.Tensor or output.dim() < 2
                or output.shape[0] != 1 or not module.training or _IN_RULE.get()
                or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1
                or not output.is_floating_point()):
            return hook(module, args, kwargs, output)
        if not output.requires_grad:
            output = make_differentiable(output, tracker._dummy)
        wide = output.expand(b, *output.shape[1:])
        got = hook(module, args, kwargs, wide)
        recs = tracker.records.get(index)
        if recs:
            recs[-1].shared_output = True
        return wide if got is None else got

    return wrapped
