"""Per-example gradients of PyTorch's own ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` (and of
the cells ``nn.RNNCell``, ``nn.LSTMCell``, ``nn.GRUCell``, one call at a time).

The modules are used as they are (no replacement layer). Every weight of a recurrent
layer enters through an affine map per time step,
``gi_t = W_ih x_t + b_ih`` and ``gh_t = W_hh h_{t-1} + b_hh``, so its per-example
gradient is an outer-product sum over time, ``sum_t dgi_t x_t^T`` and
``sum_t dgh_t h_{t-1}^T``: the Linear rule on sequences (ghost norm or materialised,
chosen by cost; see :mod:`privlearn.torch.grad_sample`). The rule recomputes the
recurrence from the recorded inputs with the cell equations of the PyTorch documentation
(one loop over *time*, never over examples). For ``nn.LSTM`` it then backpropagates
through time by hand (:func:`_lstm_contribution`: ``dgi_t = dgh_t``, one gate-gradient
tensor, a third of the activations an autograd graph keeps); for ``nn.GRU`` and ``nn.RNN``
it obtains ``dgi`` and ``dgh`` for all time steps with one ``torch.autograd.grad`` call
seeded by the recorded output gradients.

``PackedSequence`` inputs are padded and the recurrence is masked past each sequence's
length (the state is carried unchanged there, as the packed kernels do), so every
example's gradient is exact whatever its length.

Not supported (the validator says so): ``dropout > 0`` between layers (the training-time
masks cannot be reproduced), unbatched inputs. An LSTM with ``proj_size > 0``
(``h_t = W_hr (o_t tanh c_t)``) takes the autograd path, with ``W_hr``'s per-example
gradient ``sum_t dh_t r_t^T`` from the same call.

The recurrence itself is described by a :class:`Recurrence` (cell type, sizes, layout)
and the weights are read by their ``nn.RNNBase`` names (``weight_ih_l0``,
``bias_hh_l1_reverse``...), so a layer of another library that computes the same
recurrence under the same parameter names (Opacus's ``DPLSTM``, see
:mod:`privlearn.torch.rules.opacus`) reuses :func:`recurrent_contribution`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.overrides import TorchFunctionMode

from privlearn.errors import BatchDependenceError, ParameterValueError, UnsupportedModuleError
from privlearn.torch.grad_sample import (
    Compound,
    DenseOuterProduct,
    Layout,
    Materialized,
    OuterProduct,
    Record,
    as_dtype,
    compute_dtype,
    register_instrumenter,
    register_rule,
    rule_evaluation,
)

__all__ = ["CellStateCapture", "Recurrence", "gru_cell_rule", "lstm_cell_rule",
           "recurrent_contribution", "recurrent_rule_options", "rnn_cell_rule", "rnn_rule"]


@dataclass(frozen=True)
class Recurrence:
    """What the recurrent rules need to know about a layer besides its weights.

    Attributes
    ----------
    mode : {"LSTM", "GRU", "RNN_TANH", "RNN_RELU"}
        The cell, with ``nn.RNNBase.mode``'s names.
    hidden_size, num_layers : int
    bidirectional, batch_first : bool
    """

    mode: str
    hidden_size: int
    num_layers: int
    bidirectional: bool
    batch_first: bool

    def __post_init__(self):
        if self.mode not in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
            raise ParameterValueError(f"mode must be one of 'LSTM', 'GRU', 'RNN_TANH', 'RNN_RELU', "
                             f"got {self.mode!r}")

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @classmethod
    def of(cls, module: nn.RNNBase) -> Recurrence:
        """The recurrence of a PyTorch ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``."""
        return cls(module.mode, module.hidden_size, module.num_layers,
                   bool(module.bidirectional), bool(module.batch_first))


def _cell(mode: str, gi, gh, h):
    """One step of a GRU or plain RNN cell (LSTM: :func:`_lstm_contribution`)."""
    if mode == "GRU":
        ir, iz, inn = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r = torch.sigmoid(ir + hr)
        z = torch.sigmoid(iz + hz)
        n = torch.tanh(inn + r * hn)
        return (1 - z) * n + z * h
    if mode == "RNN_TANH":
        return torch.tanh(gi + gh)
    return torch.relu(gi + gh)


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


def _weights(module: nn.RNNBase, layer: int, direction: int):
    sfx = f"_l{layer}" + ("_reverse" if direction == 1 else "")
    w_ih = getattr(module, "weight_ih" + sfx)
    w_hh = getattr(module, "weight_hh" + sfx)
    b_ih = getattr(module, "bias_ih" + sfx, None)
    b_hh = getattr(module, "bias_hh" + sfx, None)
    return w_ih, w_hh, b_ih, b_hh


def _projection(module: nn.Module, layer: int, direction: int):
    """``weight_hr_l{k}[_reverse]`` of an ``nn.LSTM`` with ``proj_size > 0`` (None
    without a projection)."""
    if not getattr(module, "proj_size", 0):
        return None
    return getattr(module, f"weight_hr_l{layer}" + ("_reverse" if direction == 1 else ""))


def _lstm_contribution(module: nn.Module, spec: Recurrence, x, h0, c0, g_out, g_h, g_c,
                       params) -> Compound:
    """Per-example gradients of an ``nn.LSTM`` by hand-written backpropagation through time.

    The forward pass is recomputed with the cell equations of the PyTorch documentation
    (``i, f, g, o`` gates; ``c_t = f c_{t-1} + i g``; ``h_t = o tanh(c_t)``) keeping, per
    layer and direction, only the gate activations, cell states and hidden states
    (``6 H`` numbers per example and step), and the gradient of the gate pre-activations
    is propagated back in time by the chain rule:
    ``dc_t = dc_{t+1} f_{t+1} + dh_t o_t (1 - tanh^2 c_t)``,
    ``da_i = dc_t g i (1 - i)``, ``da_f = dc_t c_{t-1} f (1 - f)``,
    ``da_g = dc_t i (1 - g^2)``, ``da_o = dh_t tanh(c_t) o (1 - o)``,
    ``dh_{t-1} += da_t W_hh``. Since the pre-activation is ``W_ih x_t + b_ih + W_hh h_{t-1}
    + b_hh``, one gate-gradient tensor ``(B, T, 4H)`` is shared by the input and the
    recurrent weights; a lower layer receives ``sum_direction da W_ih`` as its output
    gradient. Compared with differentiating a recomputed autograd graph this stores about
    a third of the activations and one gradient tensor instead of two.
    """
    T, B = x.shape[:2]
    H, L, D = spec.hidden_size, spec.num_layers, spec.directions
    ps = set(params)
    # mixed precision (autocast: bf16 output gradients, float32 weights and inputs; or a
    # low-precision model) works in float32, as every rule does (compute_dtype)
    dtype = compute_dtype(x, g_out, _weights(module, 0, 0)[0])
    states = []
    with torch.no_grad():
        inp = x.to(dtype)
        for layer in range(L):
            outs = []
            for direction in range(D):
                w_ih, w_hh, b_ih, b_hh = (None if w is None else w.to(dtype)
                                          for w in _weights(module, layer, direction))
                gates = torch.nn.functional.linear(inp, w_ih, b_ih)  # (T, B, 4H)
                if b_hh is not None:
                    gates += b_hh
                cs = gates.new_empty(T, B, H)
                hs = gates.new_empty(T, B, H)
                idx = layer * D + direction
                h, c = h0[idx].to(dtype), c0[idx].to(dtype)
                order = range(T) if direction == 0 else range(T - 1, -1, -1)
                for t in order:
                    a = gates[t]
                    a.addmm_(h, w_hh.t())
                    a[:, : 2 * H].sigmoid_()
                    a[:, 2 * H: 3 * H].tanh_()
                    a[:, 3 * H:].sigmoid_()
                    i, f, g, o = a.split(H, 1)
                    c = torch.addcmul(f * c, i, g, out=cs[t])
                    h = torch.mul(o, torch.tanh(c), out=hs[t])
                outs.append(hs)
                states.append((inp, gates, cs, hs))
            inp = outs[0] if D == 1 else torch.cat(outs, -1)
        del outs, inp

        parts = []
        d_out = g_out  # (T, B, D * H): gradient w.r.t. the output of the current layer
        for layer in range(L - 1, -1, -1):
            d_below = None
            for direction in range(D):
                idx = layer * D + direction
                w_ih, w_hh, b_ih, b_hh = _weights(module, layer, direction)
                inp, gates, cs, hs = states[idx]
                states[idx] = None
                h_init, c_init = h0[idx].to(dtype), c0[idx].to(dtype)
                d_dir = d_out[..., direction * H: (direction + 1) * H]
                dg = gates.new_empty(B, T, 4 * H)  # batch-major gate gradients
                dh = g_h[idx].to(dtype)
                dc = g_c[idx].to(dtype)
                w_back = w_hh.detach().to(dtype)
                forward = direction == 0
                for t in (range(T - 1, -1, -1) if forward else range(T)):
                    i, f, g, o = gates[t].split(H, 1)
                    dh = dh + d_dir[t]
                    tc = torch.tanh(cs[t])
                    dc = dc + dh * o * (1 - tc * tc)
                    if forward:
                        c_prev = cs[t - 1] if t > 0 else c_init
                    else:
                        c_prev = cs[t + 1] if t < T - 1 else c_init
                    da = dg[:, t]
                    da_i, da_f, da_g, da_o = da.split(H, 1)
                    torch.mul(dc * g, i * (1 - i), out=da_i)
                    torch.mul(dc * c_prev, f * (1 - f), out=da_f)
                    torch.mul(dc * i, 1 - g * g, out=da_g)
                    torch.mul(dh * tc, o * (1 - o), out=da_o)
                    dh = torch.mm(da, w_back)
                    dc = dc * f
                del gates, cs
                hp = hs.new_empty(B, T, H)  # h_{t-1} in processing order, batch-major
                if forward:
                    hp[:, 0] = h_init
                    hp[:, 1:] = hs[:-1].transpose(0, 1)
                else:
                    hp[:, -1] = h_init
                    hp[:, :-1] = hs[1:].transpose(0, 1)
                del hs
                if layer > 0:
                    below = torch.matmul(dg, w_ih.detach().to(dtype))  # (B, T, I)
                    d_below = below if d_below is None else d_below.add_(below)
                for w, b, a in ((w_ih, b_ih, inp.transpose(0, 1)), (w_hh, b_hh, hp)):
                    part = _part(w, b, a, dg, ps)
                    if part is not None:
                        parts.append(part)
                del inp, hp
            if layer > 0:
                d_out = d_below.transpose(0, 1)  # (T, B, D * H)
    return Compound(parts)


def _rnn_batch_dim(module: nn.Module) -> int:
    return 0 if module.batch_first else 1


def _rnn_batch_size(module: nn.Module, record: Record) -> int:
    x = record.args[0]
    if isinstance(x, PackedSequence):
        return int(x.batch_sizes[0]) if x.batch_sizes.numel() else 0
    return x.shape[_rnn_batch_dim(module)]


def _record_dims(recurrence_of):
    """``record_dims`` of a recurrent layer whose :class:`Recurrence` is
    ``recurrence_of(module)``: input by ``batch_first`` (a PackedSequence: none, it is
    handled whole), ``hx`` / ``(h0, c0)`` on dimension 1; output likewise, ``h_n[, c_n]``
    on dimension 1."""

    def record_dims(module: nn.Module, record: Record, batch: int):
        packed = isinstance(record.args[0], PackedSequence)
        first = None if packed else _rnn_batch_dim(module)
        arg_dims = [first] + [1] * (len(record.args) - 1)
        kw_dims = {k: 1 for k in record.kwargs}
        n_out = len(record.outputs_meta)
        if packed:  # flattened PackedSequence fields (data, batch_sizes, indices...) then h
            states = 2 if recurrence_of(module).mode == "LSTM" else 1
            out_dims = [None] * (n_out - states) + [1] * states
        else:
            out_dims = [first] + [1] * (n_out - 1)
        return arg_dims, kw_dims, out_dims

    return record_dims


def _rnn_observe(module: nn.Module, args, kwargs, output):
    """Batch-first views of the input and output for the batch-independence probe
    (packed sequences padded)."""
    x = args[0] if args else None
    out = output[0] if isinstance(output, tuple) else output
    views = []
    for t, label in ((x, "input"), (out, "output")):
        if isinstance(t, PackedSequence):
            t, _ = pad_packed_sequence(t, batch_first=True)
            views.append((t, 0, label))
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            views.append((t, _rnn_batch_dim(module), label))
    return views


def recurrent_rule_options(recurrence_of) -> dict:
    """The :class:`~privlearn.torch.LayerRule` options of a recurrent layer
    (own layout by ``batch_first``, batch size from the input or the packed batch sizes,
    batch dimension of every recorded tensor, probe views), for layers whose
    :class:`Recurrence` is ``recurrence_of(module)``."""
    return dict(layout=Layout(batch_dim=_rnn_batch_dim, own_layout=True,
                              expand_broadcast=False, batch_size=_rnn_batch_size,
                              record_dims=_record_dims(recurrence_of)),
                observe=_rnn_observe)


@register_rule(nn.RNN, nn.LSTM, nn.GRU, **recurrent_rule_options(Recurrence.of),
               after_swap=lambda m: m._init_flat_weights())
def rnn_rule(module: nn.RNNBase, record: Record, params):
    if module.dropout > 0 and module.num_layers > 1:
        raise UnsupportedModuleError(
            "recurrent layers with dropout > 0 are not supported by per-example "
            "clipping (the dropout masks cannot be reproduced)")
    return recurrent_contribution(module, Recurrence.of(module), record, params)


# --------------------------------------------------------------------------- cells


def _cell_record_dims(module: nn.Module, record: Record, batch: int):
    """A cell's input, state (a tensor, or an LSTM cell's ``(h, c)``) and outputs all
    carry the examples on dimension 0."""
    return ([0] * len(record.args), {k: 0 for k in record.kwargs},
            [0] * len(record.outputs_meta))


#: The cells' layout: batch-first, every recorded tensor batched on dimension 0.
_CELL_LAYOUT = Layout(batch_dim=0, record_dims=_cell_record_dims)


def _dense_part(w, b, a, g, ps):
    """Contribution of one affine map ``g = a W^T + b`` on ``(B, d)`` rows."""
    w = w if w in ps else None
    b = b if b is not None and b in ps else None
    if w is None and b is None:
        return None
    if w is None:
        return Materialized([b], [g])
    return DenseOuterProduct(w, b, a, g)


def _cell_contribution(module: nn.Module, mode: str, record: Record, params) -> Compound:
    """One call of an ``nn.RNNCell`` / ``nn.GRUCell`` / ``nn.LSTMCell``: its weights enter
    through ``gi = W_ih x + b_ih`` and ``gh = W_hh h + b_hh``, so the per-example
    gradients are the rank-one outer products of ``dgi``, ``dgh`` (one autograd call
    through the cell equations, seeded by the recorded output gradients) with ``x`` and
    ``h``. A cell called once per time step gives one record per call; the engine sums
    them (with exact cross terms for the norms)."""
    x = record.args[0]
    if x.dim() != 2:
        raise BatchDependenceError(f"{type(module).__name__} received an unbatched input of shape "
                         f"{tuple(x.shape)}; per-example clipping needs a batch dimension")
    lstm = mode == "LSTM"
    if lstm and len(record.grad_outputs) > 1 and record.grad_outputs[1] is not None \
            and record.extra is None:
        raise UnsupportedModuleError(
            "nn.LSTMCell's new cell state reaches the loss, and this call was not "
            "instrumented (GradSampleTracker(..., instrument_attention=False), or a "
            "subclass whose forward does not call torch's lstm_cell): on CPU PyTorch "
            "computes the hidden state from the returned cell state, so the gradient "
            "recorded for it may already include the hidden state's and its per-example "
            "gradients cannot be told apart. Keep the instrumentation on (the default), or "
            "use nn.LSTM")
    g_h = record.grad(0)
    g_c = record.grad(1) if lstm else None
    dt = compute_dtype(x, g_h, g_c)
    B, H = x.shape[0], module.hidden_size
    hx = _arg(record, 1, "hx")
    h, c = (hx if hx is not None else (None, None)) if lstm else (hx, None)
    # (a state tuple is recorded as passed: detached here, like every recorded tensor)
    h = x.new_zeros(B, H, dtype=dt) if h is None else as_dtype(h.detach(), dt)
    if lstm:
        c = x.new_zeros(B, H, dtype=dt) if c is None else as_dtype(c.detach(), dt)
    x = as_dtype(x, dt)
    w_ih, w_hh = module.weight_ih, module.weight_hh
    b_ih, b_hh = module.bias_ih, module.bias_hh

    def det(t):
        return None if t is None else as_dtype(t.detach(), dt)

    with rule_evaluation(), torch.enable_grad():
        gi = torch.nn.functional.linear(x, det(w_ih), det(b_ih)).requires_grad_()
        gh = torch.nn.functional.linear(h, det(w_hh), det(b_hh)).requires_grad_()
        if lstm:
            targets = _lstm_cell(gi, gh, c)
            seeds = (as_dtype(g_h, dt), as_dtype(g_c, dt))
        else:
            targets = (_cell(mode, gi, gh, h),)
            seeds = (as_dtype(g_h, dt),)
        dgi, dgh = torch.autograd.grad(targets, (gi, gh), seeds)
    ps = set(params)
    parts = [part for part in (_dense_part(w_ih, b_ih, x, dgi, ps),
                               _dense_part(w_hh, b_hh, h, dgh, ps)) if part is not None]
    return Compound(parts)


_LSTM_CELL = torch._C._VariableFunctions.lstm_cell


class CellStateCapture(TorchFunctionMode):
    """Entered by the tracker around each recorded ``nn.LSTMCell`` call: the new cell state
    the call returns becomes a view of the one PyTorch computed.

    On CPU, ``lstm_cell`` computes the hidden state ``h' = o tanh(c')`` *from* the cell
    state tensor it returns, so a gradient hook on that tensor would receive the
    gradient the loss sends through ``h'`` as well as the gradient from outside the cell
    (on CUDA the fused kernel keeps them apart). Returning a view (no copy) puts the
    hook downstream of ``h'``'s use: the recorded gradient is always the one from
    outside the cell, which is what :func:`_cell_contribution` seeds. Autograd's own
    gradients are unchanged. Nothing is stored on the module.
    """

    def __init__(self, sink) -> None:
        super().__init__()
        self._sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _LSTM_CELL:
            hy, cy = out
            self._sink({"cell_state": "from outside"})
            if cy.requires_grad:  # else h' and c' are made differentiable separately
                cy = cy.view_as(cy)
            return hy, cy
        return out


register_instrumenter(nn.LSTMCell)(CellStateCapture)


@register_rule(nn.LSTMCell, layout=_CELL_LAYOUT)
def lstm_cell_rule(module: nn.LSTMCell, record: Record, params) -> Compound:
    """``nn.LSTMCell`` (see :func:`_cell_contribution`)."""
    return _cell_contribution(module, "LSTM", record, params)


@register_rule(nn.GRUCell, layout=_CELL_LAYOUT)
def gru_cell_rule(module: nn.GRUCell, record: Record, params) -> Compound:
    """``nn.GRUCell`` (see :func:`_cell_contribution`)."""
    return _cell_contribution(module, "GRU", record, params)


@register_rule(nn.RNNCell, layout=_CELL_LAYOUT)
def rnn_cell_rule(module: nn.RNNCell, record: Record, params) -> Compound:
    """``nn.RNNCell`` with ``tanh`` or ``relu`` (see :func:`_cell_contribution`)."""
    mode = {"tanh": "RNN_TANH", "relu": "RNN_RELU"}[module.nonlinearity]
    return _cell_contribution(module, mode, record, params)


def _arg(record: Record, i: int, *names: str):
    if len(record.args) > i:
        return record.args[i]
    for n in names:
        if n in record.kwargs:
            return record.kwargs[n]
    return None


def recurrent_contribution(module: nn.Module, spec: Recurrence, record: Record, params):
    """Per-example contribution of one call of a recurrent layer computing ``spec``'s
    recurrence with the weights ``module.weight_ih_l{k}[_reverse]`` (and ``weight_hh``,
    ``bias_ih``, ``bias_hh``) on ``record.args[0]`` (a tensor in ``spec``'s layout or a
    ``PackedSequence``) from the initial state ``record.args[1]`` (keyword ``hx`` or
    ``state_init``; for an LSTM ``(h0, c0)``, either may be None: zeros)."""
    x = record.args[0]
    hx = _arg(record, 1, "hx", "state_init")
    mode = spec.mode
    n_out = len(record.outputs_meta)
    lengths = None
    if isinstance(x, PackedSequence):
        # padded to (T, B, I) in the caller's batch order; the recurrence is masked past
        # each sequence's length (its state carried unchanged, as the packed kernel does)
        x, lengths = pad_packed_sequence(PackedSequence(x.data.detach(), x.batch_sizes,
                                                        x.sorted_indices, x.unsorted_indices))
        g_data = record.grad(0)
        packed_out = PackedSequence(g_data, record.args[0].batch_sizes,
                                    record.args[0].sorted_indices,
                                    record.args[0].unsorted_indices)
        g_out, _ = pad_packed_sequence(packed_out, total_length=x.shape[0])
    else:
        if x.dim() != 3:
            raise BatchDependenceError(f"{type(module).__name__} received an unbatched input; "
                             "per-example clipping needs a batch dimension")
        if spec.batch_first:
            x = x.transpose(0, 1)  # work time-major: (T, B, I)
        g_out = record.grad(0)
        if spec.batch_first:
            g_out = g_out.transpose(0, 1)
    T, B = x.shape[:2]
    H, L, D = spec.hidden_size, spec.num_layers, spec.directions
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    if mode == "LSTM":
        h0, c0 = hx if hx is not None else (None, None)
    else:
        h0, c0 = hx, None
    if h0 is None:  # the hidden state has the projection's size (proj_size > 0)
        h0 = x.new_zeros(L * D, B, getattr(module, "proj_size", 0) or H, dtype=dtype)
    if mode == "LSTM" and c0 is None:
        c0 = x.new_zeros(L * D, B, H, dtype=dtype)
    # gradients of the loss with respect to (output, h_n[, c_n]); output in (T, B, D*H)
    if mode == "LSTM":
        g_h, g_c = record.grad(n_out - 2), record.grad(n_out - 1)
        if lengths is None and not getattr(module, "proj_size", 0):
            return _lstm_contribution(module, spec, x, h0, c0, g_out, g_h, g_c, params)
    else:
        g_h, g_c = record.grad(n_out - 1), None
    return _autograd_contribution(module, spec, x, h0, c0, g_out, g_h, g_c, params, lengths)


def _lstm_cell(gi, gh, c):
    """One LSTM step (gates ``i, f, g, o``), as in the PyTorch documentation."""
    i, f, g, o = (gi + gh).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _autograd_contribution(module, spec: Recurrence, x, h0, c0, g_out, g_h, g_c, params,
                           lengths=None):
    """Per-example gradients by recomputing the recurrence and one ``torch.autograd.grad``
    call seeded by the recorded output gradients (GRU and plain RNN; every mode for
    packed sequences, where ``lengths`` masks the steps past each sequence's end)."""
    T = x.shape[0]
    L, D = spec.num_layers, spec.directions
    mode = spec.mode
    lstm = mode == "LSTM"
    mask = None
    if lengths is not None:
        mask = (torch.arange(T)[:, None] < lengths[None, :]).to(x.device).unsqueeze(-1)
    saved = []  # per (layer, dir): (inp (T,B,I), hprev (T,B,H), gi tensor, list of gh,
    # and with a projection (LSTM proj_size > 0, h_t = W_hr r_t) the r_t and W_hr r_t)
    with rule_evaluation(), torch.enable_grad():
        inp = x
        h_last, c_last = [], []
        for layer in range(L):
            outs = []
            for direction in range(D):
                w_ih, w_hh, b_ih, b_hh = (None if w is None else w.detach()
                                          for w in _weights(module, layer, direction))
                gi = torch.nn.functional.linear(inp, w_ih, b_ih)  # (T, B, G*H)
                if not gi.requires_grad:
                    gi.requires_grad_()
                idx = layer * D + direction
                h = h0[idx]
                c = c0[idx] if lstm else None
                order = range(T) if direction == 0 else range(T - 1, -1, -1)
                hs = [None] * T
                hprev = [None] * T
                ghs = [None] * T
                w_hr = _projection(module, layer, direction)
                rs, hrs = ([None] * T, [None] * T) if w_hr is not None else (None, None)
                gis = gi.unbind(0)  # one UnbindBackward node (a select per step would
                # allocate a full (T, B, G*H) gradient per time step)
                for t in order:
                    hprev[t] = h
                    gh = torch.nn.functional.linear(h, w_hh, b_hh)
                    if not gh.requires_grad:
                        gh.requires_grad_()
                    ghs[t] = gh
                    if lstm:
                        h_new, c_new = _lstm_cell(gis[t], gh, c)
                        if w_hr is not None:
                            rs[t] = h_new
                            h_new = hrs[t] = torch.nn.functional.linear(h_new, w_hr.detach())
                    else:
                        h_new = _cell(mode, gis[t], gh, h)
                    if mask is None:
                        h, c = h_new, (c_new if lstm else None)
                        hs[t] = h
                    else:
                        m = mask[t]
                        h = torch.where(m, h_new, h)
                        c = torch.where(m, c_new, c) if lstm else None
                        hs[t] = h_new * m  # a packed output has nothing past the end
                outs.append(torch.stack(hs))
                h_last.append(h)
                c_last.append(c)
                saved.append((layer, direction, inp, hprev, gis, ghs, rs, hrs))
            inp = outs[0] if D == 1 else torch.cat(outs, -1)
        seeds = [g_out, g_h]
        targets = [inp, torch.stack(h_last)]
        if lstm:
            seeds.append(g_c)
            targets.append(torch.stack(c_last))
        wrt = []
        for _, _, _, _, gis, ghs, _, hrs in saved:
            wrt.extend(gis)
            wrt.extend(ghs)
            wrt.extend(hrs or ())
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
        layer, direction, inp_l, hprev, gis, ghs, rs, hrs = saved.pop(0)
        dgi = _stack(grads[k: k + T], gis)
        dgh = _stack(grads[k + T: k + 2 * T], ghs)
        grads[k: k + 2 * T] = [None] * (2 * T)  # release the per-step gradients
        del gis, ghs
        k += 2 * T
        if hrs is not None:  # the projection W_hr: inputs r_t, output gradients d(W_hr r_t)
            dhr = _stack(grads[k: k + T], hrs)
            grads[k: k + T] = [None] * T
            k += T
            r = torch.stack([v.detach() for v in rs], dim=1)
            part = _part(_projection(module, layer, direction), None, r.to(dhr.dtype), dhr,
                         ps)
            if part is not None:
                parts.append(part)
            del dhr, r, rs, hrs
        w_ih, w_hh, b_ih, b_hh = _weights(module, layer, direction)
        hp = torch.stack([h.detach() for h in hprev], dim=1)
        del hprev
        for w, b, a, g in ((w_ih, b_ih, inp_l.detach().transpose(0, 1), dgi),
                           (w_hh, b_hh, hp, dgh)):
            part = _part(w, b, a.to(g.dtype), g, ps)
            if part is not None:
                parts.append(part)
        del dgi, dgh, hp
    return Compound(parts)
