"""Per-example gradients of PyTorch's own ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``.

The modules are used as they are (no replacement layer). Every weight of a recurrent
layer enters through an affine map per time step,
``gi_t = W_ih x_t + b_ih`` and ``gh_t = W_hh h_{t-1} + b_hh``, so its per-example
gradient is an outer-product sum over time, ``sum_t dgi_t x_t^T`` and
``sum_t dgh_t h_{t-1}^T``: the Linear rule on sequences (ghost norm or materialised,
chosen by cost; see :mod:`privlearn.torch.grad_sample`). The rule recomputes the
recurrence from the recorded inputs with the cell equations of the PyTorch documentation
(one loop over *time*, never over examples) and obtains ``dgi`` and ``dgh`` for all time
steps with one ``torch.autograd.grad`` call seeded by the recorded output gradients.

Not supported (the validator says so): ``dropout > 0`` between layers (the training-time
masks cannot be reproduced), ``proj_size > 0``, ``PackedSequence`` inputs, unbatched
inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from privlearn.torch.grad_sample import (
    Compound,
    Materialized,
    OuterProduct,
    Record,
    _scaled,
    register_rule,
    rule_evaluation,
)

__all__ = ["rnn_rule"]


def _cell(mode: str, gi, gh, h, c):
    """One step of the cell: returns (h', c')."""
    if mode == "LSTM":
        gates = gi + gh
        i, f, g, o = gates.chunk(4, -1)
        i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
        c = f * c + i * g
        return o * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, inn = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r = torch.sigmoid(ir + hr)
        z = torch.sigmoid(iz + hz)
        n = torch.tanh(inn + r * hn)
        return (1 - z) * n + z * h, None
    if mode == "RNN_TANH":
        return torch.tanh(gi + gh), None
    return torch.relu(gi + gh), None


def _part(w, b, a, g, ps) -> OuterProduct | Materialized | None:
    """Contribution of one affine map with input ``a (B,T,d)`` and grad ``g (B,T,p)``."""
    w = w if w in ps else None
    b = b if b is not None and b in ps else None
    if w is None and b is None:
        return None
    if w is None:
        return Materialized([b], [g.sum(1)])
    bsz, t = a.shape[:2]
    return OuterProduct(w, b, a.reshape(bsz, 1, t, -1), g.reshape(bsz, 1, t, -1))


@register_rule(nn.RNN, nn.LSTM, nn.GRU)
def rnn_rule(module: nn.RNNBase, record: Record, params):
    if module.proj_size > 0:
        raise ValueError("LSTM with proj_size > 0 is not supported by per-example clipping")
    if module.dropout > 0 and module.num_layers > 1:
        raise ValueError("recurrent layers with dropout > 0 are not supported by per-example "
                         "clipping (the dropout masks cannot be reproduced)")
    x = record.args[0]
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{type(module).__name__}: PackedSequence inputs are not supported "
                         "by per-example clipping; pad the batch instead")
    if x.dim() != 3:
        raise ValueError(f"{type(module).__name__} received an unbatched input; "
                         "per-example clipping needs a batch dimension")
    hx = record.args[1] if len(record.args) > 1 else record.kwargs.get("hx")
    mode = module.mode
    if module.batch_first:
        x = x.transpose(0, 1)  # work time-major: (T, B, I)
    T, B = x.shape[:2]
    H, L = module.hidden_size, module.num_layers
    D = 2 if module.bidirectional else 1
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    if hx is None:
        h0 = x.new_zeros(L * D, B, H, dtype=dtype)
        c0 = h0 if mode == "LSTM" else None
    elif mode == "LSTM":
        h0, c0 = hx
    else:
        h0, c0 = hx, None

    # gradients of the loss with respect to (output, h_n[, c_n]); output in (T, B, D*H)
    g_out = _scaled(record, 0)
    if module.batch_first:
        g_out = g_out.transpose(0, 1)
    g_h = _scaled(record, 1)
    g_c = _scaled(record, 2) if mode == "LSTM" else None

    seeds, targets = [], []
    saved = []  # per (layer, dir): (inp (T,B,I), hprev (T,B,H), gi tensor, list of gh)
    with rule_evaluation(), torch.enable_grad():
        inp = x
        h_last, c_last = [], []
        for layer in range(L):
            outs = []
            for direction in range(D):
                sfx = f"_l{layer}" + ("_reverse" if direction == 1 else "")
                w_ih = getattr(module, "weight_ih" + sfx).detach()
                w_hh = getattr(module, "weight_hh" + sfx).detach()
                b_ih = getattr(module, "bias_ih" + sfx, None)
                b_hh = getattr(module, "bias_hh" + sfx, None)
                b_ih = None if b_ih is None else b_ih.detach()
                b_hh = None if b_hh is None else b_hh.detach()
                gi = torch.nn.functional.linear(inp, w_ih, b_ih)  # (T, B, G*H)
                if not gi.requires_grad:
                    gi.requires_grad_()
                idx = layer * D + direction
                h, c = h0[idx], (c0[idx] if c0 is not None else None)
                order = range(T) if direction == 0 else range(T - 1, -1, -1)
                hs = [None] * T
                hprev = [None] * T
                ghs = [None] * T
                gis = gi.unbind(0)  # one UnbindBackward node (a select per step would
                # allocate a full (T, B, G*H) gradient per time step)
                for t in order:
                    hprev[t] = h
                    gh = torch.nn.functional.linear(h, w_hh, b_hh)
                    if not gh.requires_grad:
                        gh.requires_grad_()
                    ghs[t] = gh
                    h, c = _cell(mode, gis[t], gh, h, c)
                    hs[t] = h
                outs.append(torch.stack(hs))
                h_last.append(h)
                c_last.append(c)
                saved.append((layer, direction, inp, hprev, gis, ghs))
            inp = outs[0] if D == 1 else torch.cat(outs, -1)
        seeds = [g_out, g_h]
        targets = [inp, torch.stack(h_last)]
        if mode == "LSTM":
            seeds.append(g_c)
            targets.append(torch.stack(c_last))
        wrt = []
        for _, _, _, _, gis, ghs in saved:
            wrt.extend(gis)
            wrt.extend(ghs)
        grads = list(torch.autograd.grad(targets, wrt, seeds, allow_unused=True))
        del targets, seeds, wrt

    ps = set(params)
    parts = []
    k = 0

    def _stack(ds, like):
        # batch-major (B, T, .) directly: no transposed copy later
        return torch.stack([torch.zeros_like(x) if d is None else d
                            for d, x in zip(ds, like, strict=True)], dim=1)

    while saved:
        layer, direction, inp_l, hprev, gis, ghs = saved.pop(0)
        dgi = _stack(grads[k: k + T], gis)
        dgh = _stack(grads[k + T: k + 2 * T], ghs)
        grads[k: k + 2 * T] = [None] * (2 * T)  # release the per-step gradients
        del gis, ghs
        k += 2 * T
        sfx = f"_l{layer}" + ("_reverse" if direction == 1 else "")
        hp = torch.stack([h.detach() for h in hprev], dim=1)
        del hprev
        for w_name, b_name, a, g in (
            ("weight_ih", "bias_ih", inp_l.detach().transpose(0, 1), dgi),
            ("weight_hh", "bias_hh", hp, dgh),
        ):
            part = _part(getattr(module, w_name + sfx), getattr(module, b_name + sfx, None),
                         a.to(g.dtype), g, ps)
            if part is not None:
                parts.append(part)
        del dgi, dgh, hp
    return Compound(parts)
