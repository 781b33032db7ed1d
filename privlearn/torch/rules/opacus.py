"""Rules for Opacus's DP layers used as ordinary modules, matched by class, module path
and attributes (Opacus is never imported here).

* ``DPRNN`` / ``DPGRU`` / ``DPLSTM`` (``opacus.layers.dp_rnn``): PyTorch's recurrences
  written cell by cell with ``nn.Linear`` submodules (``RNNLinear``), whose weights the
  layer registers a second time under ``nn.RNNBase``'s names (``weight_ih_l0``...,
  Opacus's ``RenameParamsMixin``). Handled whole, by the rule of ``nn.LSTM`` & co.
  (:func:`privlearn.torch.rnn.recurrent_contribution`, which reads the weights by those
  names): the cells' ``nn.Linear`` layers cannot be clipped one by one, since on a
  ``PackedSequence`` each step's call sees only the sequences still running (in
  length-sorted order), and the aliased weights would be counted twice. The module
  computes the same outputs and final states as ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``
  with the same weights (checked for every layout, direction, depth and packing in
  ``tests/torch/test_layer_families.py``). Refused (validator and rule): ``dropout > 0``,
  which Opacus applies to the hidden state at every time step of every layer, inside
  the recurrence (its masks cannot be reproduced); cells other than Opacus's own three.
* ``SequenceBias`` (``opacus.layers.dp_multihead_attention``): appends a learned vector
  as one more sequence position (``add_bias_kv``), so its per-example gradient is the
  output gradient at the last position. Batch dimension from its ``batch_first``.
* ``DPMultiheadAttention``: its projections (``nn.Linear``) receive the query, key and
  value in the layer's own layout, so the layer declares ``batch_first`` as the layout of
  its children (:func:`~privlearn.torch.grad_sample.register_predicate_layout`); its
  ``SequenceBias`` children always work sequence-first and say so themselves.

A module is matched only when it is Opacus's class itself (or a subclass that keeps its
``forward``): a look-alike of the same name elsewhere goes to the generic rule.
"""

from __future__ import annotations

from torch import nn

from privlearn._type_registry import first_in_mro
from privlearn.errors import BatchDependenceError, UnsupportedModuleError
from privlearn.torch.grad_sample import (
    Contribution,
    Layout,
    Materialized,
    Record,
    as_dtype,
    compute_dtype,
    register_predicate_layout,
    register_predicate_rule,
)
from privlearn.torch.rnn import Recurrence, recurrent_contribution, recurrent_rule_options

__all__ = ["dp_rnn_rule", "opacus_recurrence", "sequence_bias_rule"]


def _opacus_base(m: nn.Module, name: str) -> type | None:
    """Opacus's class ``name`` if ``type(m)`` is it or a subclass that keeps its
    ``forward``, else None."""
    cls = first_in_mro(m, lambda c: c.__name__ == name and c.__module__.startswith("opacus."))
    return cls if cls is not None and type(m).forward is cls.forward else None


# --------------------------------------------------------------------------- DPLSTM & co.

#: Opacus's cell classes and the ``nn.RNNBase`` mode each computes (a ``DPRNNCell``'s
#: mode follows its nonlinearity).
_CELL_MODES = {"DPLSTMCell": "LSTM", "DPGRUCell": "GRU", "DPRNNCell": "RNN"}


def _cell_mode(cell: nn.Module) -> str | None:
    cls = type(cell)
    mode = _CELL_MODES.get(cls.__name__)
    if mode is None or not cls.__module__.startswith("opacus."):
        return None
    if mode == "RNN":
        nonlinearity = getattr(cell, "nonlinearity", None)
        return {"tanh": "RNN_TANH", "relu": "RNN_RELU"}.get(nonlinearity)
    return mode


def _is_dp_rnn(m: nn.Module) -> bool:
    """Opacus's ``DPRNNBase`` family (any cell type; see :func:`opacus_recurrence`)."""
    return _opacus_base(m, "DPRNNBase") is not None and hasattr(m, "cells")


def opacus_recurrence(m: nn.Module) -> Recurrence | None:
    """The :class:`~privlearn.torch.rnn.Recurrence` an Opacus ``DPRNN`` / ``DPGRU`` /
    ``DPLSTM`` computes, or None when its cells are not Opacus's own (unchanged) three
    or its weights are not all registered under ``nn.RNNBase``'s names."""
    modes = {_cell_mode(c) for c in m.cells}
    if len(modes) != 1 or None in modes or getattr(m, "proj_size", 0):
        return None
    spec = Recurrence(modes.pop(), int(m.hidden_size), int(m.num_layers),
                      bool(m.bidirectional), bool(m.batch_first))
    names = {n for n, _ in m.named_parameters(recurse=False)}
    for layer in range(spec.num_layers):
        for sfx in ("", "_reverse")[: spec.directions]:
            if {f"weight_ih_l{layer}{sfx}", f"weight_hh_l{layer}{sfx}"} - names:
                return None
    return spec


def _recurrence(m: nn.Module) -> Recurrence:
    spec = opacus_recurrence(m)
    if spec is None:
        raise UnsupportedModuleError(
            f"{type(m).__name__} has cells other than Opacus's DPRNNCell, DPGRUCell and "
            "DPLSTMCell (or renamed weights), whose per-example gradients privlearn "
            "cannot compute: use torch.nn.LSTM / GRU / RNN or Opacus's own layer types")
    return spec


def _dp_rnn_check(m: nn.Module) -> list[str]:
    out = []
    if opacus_recurrence(m) is None:
        out.append("cells other than Opacus's DPRNNCell, DPGRUCell and DPLSTMCell are not "
                   "supported; use torch.nn.LSTM / GRU / RNN (privlearn clips them "
                   "directly) or Opacus's own layer types")
    if getattr(m, "dropout", 0) > 0:
        out.append("dropout > 0 is not supported: Opacus applies it to the hidden state at "
                   "every time step of every layer, inside the recurrence, and those masks "
                   "cannot be reproduced for per-example gradients. Set dropout=0 (and put "
                   "nn.Dropout between separate recurrent layers), or use torch.nn.LSTM")
    return out


@register_predicate_rule(_is_dp_rnn, **recurrent_rule_options(_recurrence),
                         check=_dp_rnn_check)
def dp_rnn_rule(module: nn.Module, record: Record, params) -> Contribution:
    """Opacus's ``DPRNN`` / ``DPGRU`` / ``DPLSTM``: the recurrence of ``nn.RNN`` /
    ``nn.GRU`` / ``nn.LSTM`` (module docstring), on tensors or a ``PackedSequence``,
    with an optional initial state (``state_init``)."""
    spec = _recurrence(module)
    if module.dropout > 0 and module.training:
        raise UnsupportedModuleError(
            f"{type(module).__name__} with dropout > 0 is not supported by "
            "per-example clipping (Opacus applies it inside the recurrence; "
            "its masks cannot be reproduced); set dropout=0")
    return recurrent_contribution(module, spec, record, params)


# --------------------------------------------------------------------------- SequenceBias


def _is_sequence_bias(m: nn.Module) -> bool:
    b = m._parameters.get("bias")
    return (_opacus_base(m, "SequenceBias") is not None and b is not None and b.dim() == 1
            and set(m._parameters) == {"bias"} and not m._modules
            and isinstance(getattr(m, "batch_first", None), bool))


@register_predicate_rule(_is_sequence_bias,
                         layout=Layout(batch_dim=lambda m: 0 if m.batch_first else 1))
def sequence_bias_rule(module: nn.Module, record: Record, params) -> Contribution:
    """``SequenceBias``: ``cat([x, bias repeated], sequence dimension)``; the bias's
    per-example gradient is the output gradient at the appended (last) position."""
    g = record.grad(0)  # batch-first: (B, T + 1, E)
    if g.dim() != 3:
        raise BatchDependenceError(f"SequenceBias received an input of {g.dim()} dimensions; "
                         "per-example clipping needs a batch of sequences (3 dimensions)")
    g = as_dtype(g, compute_dtype(g))
    return Materialized([module.bias], [g[:, -1, :]])


# --------------------------------------------------------------------------- attention


def _is_dp_attention(m: nn.Module) -> bool:
    return (_opacus_base(m, "DPMultiheadAttention") is not None
            and isinstance(getattr(m, "batch_first", None), bool))


register_predicate_layout(_is_dp_attention)(lambda m: 0 if m.batch_first else 1)
