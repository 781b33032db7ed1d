"""Per-layer rules for per-example gradient norms and clipped gradient sums.

A *rule* maps a layer, the inputs it received and the gradient of the loss with respect
to its outputs (recorded by hooks during the user's ordinary ``loss.backward()``) to a
:class:`Contribution`: an object that answers the per-example squared gradient norms of
the layer's parameters and, given per-example weights ``c`` (the clip factors), the
weighted sum ``sum_i c_i grad_i`` for every parameter. No loop over examples is run.

Two representations are used, chosen per layer by cost:

* **ghost** (:class:`OuterProduct` with ``ghost=True``): for a layer whose weight
  gradient is ``sum_t g_t a_t^T`` (Linear on sequences, convolutions after im2col, RNN
  gates), the per-example squared Frobenius norm is
  ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` (Li et al. 2022, "Large Language Models Can Be
  Strong Differentially Private Learners", Sec. 4, "ghost clipping"), and the clipped sum
  is one matmul ``(c * g)^T a`` (Bu et al. 2023, "Differentially Private Optimization on
  Large Model at Small Cost", Sec. 3, book-keeping): no per-example gradient is stored.
  Cost ``B T^2 (d + p)`` for the norm. For ``T == 1`` the norm is ``|a|^2 |g|^2``.
* **materialised**: the per-example gradients ``(B, *param.shape)`` are formed with
  batched matmuls (cost ``B T d p``), their norms and the weighted sum follow.

The choice (:func:`use_ghost`) follows the book-keeping paper's rule: ghost when
``T^2 (d + p) < d p`` or when materialising would exceed a memory budget (per layer, and
one for all the layers of a step: materialised gradients live until the clip factors are
known). The clipped sums of ghost layers are added into the noise buffer in place.

This module holds the contribution types, the rule registry and shared helpers. Registered
rules: ``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding``, ``nn.EmbeddingBag``,
``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d``, ``nn.RMSNorm`` and layers
of other libraries recognised by class name (:mod:`privlearn.torch.rules`, Opacus's DP
layers in :mod:`privlearn.torch.rules.opacus`), ``nn.RNN``/``nn.LSTM``/``nn.GRU`` and their
cells (see :mod:`privlearn.torch.rnn`), ``nn.MultiheadAttention`` (see
:mod:`privlearn.torch.attention`), and a generic :mod:`torch.func` fallback (vmap of a
vjp of ``functional_call``, :mod:`privlearn.torch.fallback`) for any other layer,
multi-input ones included. :func:`register_rule` adds a rule for a new layer type, with
the layout it expects (:class:`LayerRule`: where the batch dimension is, whether broadcast
inputs are expanded); :func:`register_layout` declares the layout a container module gives
the layers inside it.

Rule authors' kit: :func:`compute_dtype`, :func:`as_dtype`, :func:`row_sq_norms`,
:func:`row_scaled`, :func:`segment_sum`, :func:`live_positions`,
:func:`make_differentiable` (see the extending guide).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from privlearn.torch._ghost_norms import finish_parts, ghost_sq, sum_up
from privlearn.torch._ghost_pending import PENDING
from privlearn.torch._row_norms import materialized_rows, outer_rows
from privlearn.torch._rows import (  # noqa: F401  (re-exported)
    _GHOST_DEFER,
    _LOW,
    _LOW_MARGIN,
    _ROWS_FINITE,
    _add_mv,
    _addmv_cols,
    _addmv_rows,
    _addmv_rows_cols,
    _finite,
    _out_dtype_matmul,
    _shaped,
    add_product_,
    addmm32_,
    live_positions,
    low_factors,
    mm32,
    row_scaled,
    row_sq_norms,
    rows_finite,
    segment_sum,
    token_scaled,
    token_scaled_t,
)
from privlearn.torch.rule_registry import (  # noqa: F401  (re-exported)
    INSTRUMENTERS,
    LAYOUTS,
    PREDICATE_LAYOUTS,
    PREDICATE_RULES,
    RULES,
    LayerRule,
    Layout,
    Rule,
    context_layout,
    get_instrumenter,
    get_rule,
    register_instrumenter,
    register_layout,
    register_predicate_layout,
    register_predicate_rule,
    register_rule,
    replaced_forward,
)

__all__ = [
    "Contribution",
    "Materialized",
    "OuterProduct",
    "Compound",
    "Record",
    "register_rule",
    "get_rule",
    "RULES",
    "PREDICATE_RULES",
    "register_predicate_rule",
    "INSTRUMENTERS",
    "register_instrumenter",
    "get_instrumenter",
    "compute_dtype",
    "LAYOUTS",
    "register_layout",
    "PREDICATE_LAYOUTS",
    "register_predicate_layout",
    "context_layout",
    "use_ghost",
    "GHOST_MEMORY_BUDGET_BYTES",
    "STEP_MATERIALISE_BUDGET_BYTES",
    "materialise_budget",
    "LOW_PRECISION_MATMUL",
    "keep_low_precision",
    "mm32",
    "low_factors",
    "as_dtype",
    "row_sq_norms",
    "row_scaled",
    "segment_sum",
    "live_positions",
    "make_differentiable",
]

#: Materialising per-example gradients of one layer above this many bytes switches the
#: layer to ghost norms (no per-example gradient stored).
GHOST_MEMORY_BUDGET_BYTES = 64 * 2**20
#: The per-example gradients materialised in one step, all layers together, stay below
#: this many bytes (they live until the clip factors are known): the layers evaluated once
#: it is spent use ghost norms and the book-keeping matmul instead (Bu et al. 2023, Sec. 3).
#: A per-layer bound alone let a deep model keep every layer's per-example gradients at
#: once (GPT-2 small on 4 x 256 tokens: 1.3 GB, more than its non-private step adds).
STEP_MATERIALISE_BUDGET_BYTES = 64 * 2**20
_BUDGET: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "privlearn_materialise_budget", default=None)


_BUDGET_SHARE: contextvars.ContextVar[float] = contextvars.ContextVar(
    "privlearn_materialise_share", default=1.0)


@contextlib.contextmanager
def materialise_budget(nbytes: int, left: list | None = None, share: float = 1.0):
    """Context in which :func:`use_ghost` materialises per-example gradients for at most
    ``nbytes`` bytes in all (the tracker enters it around one step's rule evaluation).
    ``left``: a one-element list holding what is left of a budget shared with earlier
    evaluations of the same step (the rules evaluated during backward), spent in place
    (``nbytes`` is then ignored). ``share``: one layer materialises at most this share of
    what is left (during backward, where the layers come last first, a large last layer
    would otherwise take the budget of all the others)."""
    token = _BUDGET.set(left if left is not None else [int(nbytes)])
    token_share = _BUDGET_SHARE.set(float(share))
    try:
        yield
    finally:
        _BUDGET_SHARE.reset(token_share)
        _BUDGET.reset(token)


@dataclass
class Record:
    """What one call of a layer left behind: its inputs and the output gradients.

    ``args``/``kwargs`` are the call's arguments (tensors detached); ``grad_outputs`` holds
    one slot per tensor in the flattened output (``None`` until / unless autograd fills
    it); ``out_spec`` is the pytree spec of the output; ``outputs_meta`` the flattened
    outputs' (shape, dtype) for zero-filling gradients of unused outputs.
    """

    args: tuple
    kwargs: dict
    grad_outputs: list
    outputs_meta: list
    out_spec: object = None
    extra: dict | None = None  # tensors exposed by an instrumented forward (attention)
    state: dict | None = None  # parametrizations' buffers as the forward began (_param_state)
    batch_dim: int = 0  # where the recorded tensors carry the examples (rules that do not
    # have the engine move them, e.g. the generic fallback)
    #: the contribution, when the rule was evaluated during backward (``LayerRule.early``;
    #: the recorded tensors are then released) and the number of examples it saw
    early: Contribution | None = None
    examples: int | None = None

    def has_grad(self) -> bool:
        return self.early is not None or any(g is not None for g in self.grad_outputs)

    def grad(self, i: int) -> torch.Tensor:
        g = self.grad_outputs[i]
        if g is None:
            shape, dtype, device = self.outputs_meta[i]
            return torch.zeros(shape, dtype=dtype, device=device)
        return g


class Contribution:
    """Per-example gradient information of one layer call (see module docstring)."""

    params: tuple[nn.Parameter, ...]
    #: Whether :meth:`weighted_sum` and :meth:`accumulate_into` give exactly zero for
    #: every example whose weight is exactly 0, even when that example's recorded rows
    #: hold non-finite values (an overflowing example): the tracker then drops such
    #: examples by their weight alone, on the device, without reading anything back to
    #: the host. Rules that do not declare it (False) have the overflowing examples'
    #: rows cleaned and are evaluated again (one host read a step).
    masks_rows: bool = False

    def sq_norms(self) -> torch.Tensor:  # (B,)
        raise NotImplementedError

    def sq_terms(self) -> list[torch.Tensor]:
        """Per-example vectors ``(B,)`` whose sum is :meth:`sq_norms` (e.g. one a
        parameter): the step sums every layer's terms in one stacked reduction instead of
        adding them layer by layer. Default: ``[self.sq_norms()]``."""
        return [self.sq_norms()]

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        """``sum_i c_i grad_i`` for each parameter, aligned with ``params``."""
        raise NotImplementedError

    def per_sample(self) -> list[torch.Tensor]:
        """Per-example gradients ``(B, *p.shape)`` aligned with ``params``."""
        raise NotImplementedError

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """``outs[j] += sum_i c_i grad_i`` in place, for each parameter ``j``."""
        for o, w in zip(outs, self.weighted_sum(c), strict=True):
            o.add_(_shaped(w, o.shape))

    def mv_rows(self) -> list[torch.Tensor] | None:
        """The per-example gradients as ``(B, n)`` rows aligned with ``params`` when
        :meth:`accumulate_into` is one product of each by the weights, else None."""
        return None

    def param_sq_norms(self) -> list[torch.Tensor]:
        """Per-example squared norms ``(B,)`` of each parameter's gradient, aligned with
        ``params`` (per-layer clipping). Default: from :meth:`per_sample`."""
        return [row_sq_norms(g.reshape(g.shape[0], -1)) for g in self.per_sample()]

    def factor(self, j: int):
        """A factored form of parameter ``j``'s per-example gradients, used for the
        cross terms of shared (tied) parameters without materialising them:

        * ``("outer", a, g)``: ``grad_i = sum_t g[i, t] a[i, t]^T`` (``a`` (B, T, d),
          ``g`` (B, T, p)), the parameter viewed as ``(p, d)``;
        * ``("outer_t", a, g)``: the transpose of that (the parameter is ``(d, p)``);
        * ``("rows", ids, e)``: ``grad_i[v] = sum_{t: ids[i, t] = v} e[i, t]``;
        * ``("dense", G)``: ``G`` of shape ``(B, *param.shape)``.
        """
        return ("dense", self.per_sample()[j])


#: Half-precision operands of the outer-product rules (bf16/fp16 under autocast):
#: ``"auto"`` keeps them as they are on accelerators, where the matmuls that give norms
#: and clipped sums run in that dtype with float32 accumulation and a float32 result
#: (``torch.mm(..., out_dtype=torch.float32)``), and upcasts them to float32 first on the
#: CPU; ``"never"`` always upcasts; ``"always"`` keeps them on every device (the CPU
#: emulates the accumulation in float32: used by the tests). Norms, clip factors and the
#: noisy sum are float32 either way.
LOW_PRECISION_MATMUL = "auto"


def keep_low_precision(*tensors: torch.Tensor) -> bool:
    """Whether an outer-product rule keeps these half-precision operands as they are
    (see :data:`LOW_PRECISION_MATMUL`)."""
    mode = LOW_PRECISION_MATMUL
    ts = [t for t in tensors if t is not None]
    if mode == "never" or not ts or ts[0].dtype not in _LOW or any(
            t.dtype != ts[0].dtype for t in ts):
        return False
    return mode == "always" or (ts[0].device.type == "cuda" and _out_dtype_matmul())


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Dtype in which a rule works: float32 when any operand is half precision (mixed
    precision: norms and clipped sums are accumulated in float32), else the widest
    floating dtype among the operands."""
    dts = [t.dtype for t in tensors if t is not None and t.is_floating_point()]
    if not dts:
        return torch.get_default_dtype()
    if torch.float64 in dts:
        return torch.float64
    if any(d in _LOW for d in dts):
        return torch.float32
    return dts[0]


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, without a copy when it already is.

    Parameters
    ----------
    x : torch.Tensor
        Any tensor.
    dtype : torch.dtype
        Target dtype, usually :func:`compute_dtype` of the rule's operands.

    Returns
    -------
    torch.Tensor
        ``x`` itself when ``x.dtype == dtype``, else ``x.to(dtype)``.
    """
    return x if x.dtype == dtype else x.to(dtype)


class Materialized(Contribution):
    """Per-example gradients held explicitly."""

    masks_rows = True

    def __init__(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]):
        self.params = tuple(params)
        self.grads = list(grads)
        self._sq = None
        self._terms = None

    deferred_rows = materialized_rows  # the step forms the norms of many at once

    def sq_terms(self) -> list[torch.Tensor]:
        """Each parameter's per-example squared norms (not yet added together)."""
        if self._terms is None:
            self._terms = [row_sq_norms(r) for r in self._row_views()]
        return self._terms

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:
            out = None
            for s in self.sq_terms():
                out = s if out is None else out + s
            self._sq = out
        return self._sq

    def mv_rows(self) -> list[torch.Tensor]:
        return self._row_views()

    def _row_views(self) -> list[torch.Tensor]:
        """The ``(B, n)`` views the clipped sum multiplies by the weights and their
        transposes (made once, during backward for a rule evaluated then)."""
        if getattr(self, "_rows", None) is None:
            self._rows = [g if g.dim() == 2 else g.reshape(g.shape[0], -1)
                          for g in self.grads]
            self._cols = [r.t() for r in self._rows]
        return self._rows

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        return [row_scaled(g.reshape(g.shape[0], -1), c).sum(0).view(g.shape[1:])
                for g in self.grads]

    def per_sample(self) -> list[torch.Tensor]:
        return self.grads

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        self._row_views()
        for o, col in zip(outs, self._cols, strict=True):
            _addmv_cols(o, col, c)

    def param_sq_norms(self) -> list[torch.Tensor]:
        return list(self.sq_terms())

    def factor(self, j: int):
        return ("dense", self.grads[j])


class Compound(Contribution):
    """Several contributions over disjoint parameters (e.g. the gates of an LSTM)."""

    def __init__(self, parts: Sequence[Contribution]):
        self.parts = list(parts)
        self.params = tuple(p for part in self.parts for p in part.params)
        self.masks_rows = all(part.masks_rows for part in self.parts)

    def sq_norms(self) -> torch.Tensor:
        out = None
        for part in self.parts:
            s = part.sq_norms()
            out = s if out is None else out + s
        return out

    def sq_terms(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.sq_terms()]

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        return [w for part in self.parts for w in part.weighted_sum(c)]

    def per_sample(self) -> list[torch.Tensor]:
        return [w for part in self.parts for w in part.per_sample()]

    def param_sq_norms(self) -> list[torch.Tensor]:
        return [s for part in self.parts for s in part.param_sq_norms()]

    def _locate(self, j: int):
        for part in self.parts:
            if j < len(part.params):
                return part, j
            j -= len(part.params)
        raise IndexError(j)

    def factor(self, j: int):
        part, k = self._locate(j)
        return part.factor(k)


def use_ghost(batch: int, groups: int, t: int, d: int, p: int, itemsize: int = 4) -> bool:
    """Whether ghost norms beat materialisation for an outer-product layer.

    Ghost adds ``T^2 (d + p)`` work per example and group on top of the weighted matmul;
    materialising adds ``d p`` (the weighted sum over stored per-example gradients) and
    ``B G d p`` memory (Bu et al. 2023, Sec. 3.2, layerwise choice). Materialising stays
    within :data:`GHOST_MEMORY_BUDGET_BYTES` per layer and, inside
    :func:`materialise_budget` (a step), within what is left of the step's budget, which
    a materialising answer consumes.
    """
    if t * t * (d + p) < d * p:
        return True
    need = batch * groups * d * p * itemsize
    if need > GHOST_MEMORY_BUDGET_BYTES:
        return True
    left = _BUDGET.get()
    if left is not None:
        if need > left[0] * _BUDGET_SHARE.get():
            return True
        left[0] -= need
    return False


#: Scaled output gradients formed at once by :meth:`OuterProduct.accumulate_into`.
_CHUNK_BYTES = 32 * 2**20

class OuterProduct(Contribution):
    """Layer whose weight gradient per example is ``sum_t g_t a_t^T`` (per group).

    Parameters
    ----------
    weight : parameter whose gradient, viewed as ``(G * p, d)``, is the outer-product sum
        (with ``transposed=True``: the parameter is ``(d, p)``, its gradient
        ``sum_t a_t g_t^T``, as in transformers' ``Conv1D``; ``G == 1``).
    bias : parameter with per-example gradient ``sum_t g_t`` (shape ``G * p``) or None.
    a : tensor ``(B, G, T, d)``; g : tensor ``(B, G, T, p)``.
    ghost : bool or None (choose by :func:`use_ghost`).
    """

    masks_rows = cleans_rows_in_place = True  # held rows cleaned in place, not grouped

    def __init__(self, weight, bias, a, g, ghost: bool | None = None,
                 transposed: bool = False):
        self.weight, self.bias = weight, bias  # parameters, or anything with a .shape
        self.params = (weight,) if bias is None else (weight, bias)
        self._low = keep_low_precision(a, g)
        dt = a.dtype if self._low else compute_dtype(a, g)
        # kept as recorded (half precision under autocast: half the memory until the
        # step), converted to the working dtype where used, one layer at a time
        live = live_positions(g)
        if live is not None:  # positions with a zero output gradient in every example
            a, g = a.index_select(2, live), g.index_select(2, live)
        self._dtype = dt
        self.a, self.g = a, g
        self.transposed = transposed
        b, G, t, d = a.shape
        p = g.shape[-1]
        self.dims = (b, G, t, d, p)
        if ghost is None:
            ghost = use_ghost(b, G, t, d, p, dt.itemsize)
        self.ghost = ghost
        self._ps = None
        self._sq = None
        self._terms = None
        self._wsq = None
        self._bias_cache = None
        self._bias_t = None
        self._flat2 = None
        if ghost and G == 1 and a.is_contiguous() and g.is_contiguous():
            # the (B T, d) and (B T, p) forms the step's matmul reads, and the transpose
            # of its left side (scaled in that layout where scaled; views, made here)
            a2, g2 = a.view(b * t, d), g.view(b * t, p)
            lt = (a2 if p <= d else None) if transposed else (g2 if p > d else None)
            st = (a2 if p > d else None) if transposed else (g2 if p <= d else None)
            self._flat2 = tuple([a2, g2] + [None if x is None else x.t() for x in (lt, st)])
        if not ghost:
            # per-example weight gradients via batched matmul, laid out as the parameter
            # ((B, G, p, d); transposed: (B, 1, d, p)); the inputs (e.g. conv patches) are
            # released right away to bound peak memory
            if self._low and transposed:
                self._ps = mm32(a.transpose(-1, -2).reshape(b * G, d, t),
                                g.reshape(b * G, t, p)).view(b, G, d, p)
            elif self._low:
                self._ps = mm32(g.transpose(-1, -2).reshape(b * G, p, t),
                                a.reshape(b * G, t, d)).view(b, G, p, d)
            elif transposed:
                self._ps = torch.matmul(as_dtype(a, dt).transpose(-1, -2), as_dtype(g, dt))
            else:
                self._ps = torch.matmul(as_dtype(g, dt).transpose(-1, -2), as_dtype(a, dt))
            self._ps_rows = self._ps.view(b, -1)
            self._ps_cols = self._ps_rows.t()
            if bias is not None:
                self._bias_ps()
            self.a = self.g = None

    def mv_rows(self) -> list[torch.Tensor] | None:
        if self._ps is None:
            return None
        return [self._ps_rows] if self.bias is None else [self._ps_rows, self._bias_ps()]

    @property
    def a(self) -> torch.Tensor | None:
        """The recorded inputs ``(B, G, T, d)`` in the working dtype."""
        return None if self._a is None else as_dtype(self._a, self._dtype)

    @a.setter
    def a(self, value) -> None:
        self._a = value

    @property
    def g(self) -> torch.Tensor | None:
        """The recorded output gradients ``(B, G, T, p)`` in the working dtype."""
        return None if self._g is None else as_dtype(self._g, self._dtype)

    @g.setter
    def g(self, value) -> None:
        self._g = value

    def _bias_ps(self, defer: bool = False) -> torch.Tensor:
        if self._bias_cache is None:  # (defer: with other layers' during backward)
            b, G, t, d, p = self.dims
            x, wide = self.g, (torch.float32 if self._low else None)
            pend = PENDING.get() if defer and G == 1 and t > 1 and x.is_contiguous() else None
            g = None if pend is None else pend.take_sum(x.view(b, t, p), wide)
            if g is None:
                x = x.float() if self._low and t == 1 else x
                g = x.reshape(b, G * p) if t == 1 else x.sum(2, dtype=wide).reshape(b, G * p)
            self._bias_cache = g
        return self._bias_cache

    def _bias_cols(self) -> torch.Tensor:
        """The per-example bias gradients as columns ``(G p, B)``."""
        if self._bias_t is None:
            self._bias_t = self._bias_ps().t()
        return self._bias_t

    deferred_rows = outer_rows  # the bias's norms: with many others at the step

    def sq_terms(self) -> list[torch.Tensor]:
        """The weight's per-example squared norms, then the bias's (not yet added)."""
        if self._terms is None:
            terms = [self._weight_sq()]
            if self.bias is not None:
                terms.append(row_sq_norms(self._bias_ps()))
                self._bias_cols()
            self._terms = terms
        return self._terms

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:
            terms = self.sq_terms()
            self._sq = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        return self._sq

    def param_sq_norms(self) -> list[torch.Tensor]:
        return list(self.sq_terms())

    def _weight_sq(self) -> torch.Tensor:
        if self._wsq is not None:
            return self._wsq
        b, G, t, d, p = self.dims
        if getattr(self, "_gparts", None) is not None:  # formed to be finished in a group
            w = finish_parts([self._gparts])
        elif self._ps is not None:
            w = row_sq_norms(self._ps_rows)
        elif t == 1 and G == 1:  # |a|^2 |g|^2
            w = row_sq_norms(self.g.reshape(b, p)) * row_sq_norms(self.a.reshape(b, d))
        elif t == 1:
            a2 = self.a.float() if self._low else self.a
            g2 = self.g.float() if self._low else self.g
            w = (a2.pow(2).sum(-1) * g2.pow(2).sum(-1)).reshape(b, -1).sum(1)
        else:  # ghost norms, never below the exact ones whatever the rounding
            # (half precision: Gram matrices with float32 accumulation)
            w = ghost_sq(self.a.reshape(b * G, t, d), self.g.reshape(b * G, t, p),
                         mm32 if self._low else torch.bmm)
            w = w if G == 1 else sum_up(w.view(b, G))
        self._wsq = w
        return w

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        b, G, t, d, p = self.dims
        if self._low and self._ps is None:
            return self._weighted_sum_low(c)
        c = c.to(self._ps.dtype if self._ps is not None else self._dtype)
        gc = None
        if self._ps is not None:
            # the norms are known: the per-example gradients (ours) are cleaned in place
            # of the values only an example with weight 0 can hold
            ps = self._ps if _ROWS_FINITE.get() else \
                torch.nan_to_num(self._ps, 0.0, 0.0, 0.0, out=self._ps)
            w = (c @ ps.reshape(b, -1)).view(self.weight.shape)
        else:
            gc = row_scaled(self.g, c)
            a = _finite(self.a)
            if G == 1 and self.transposed:
                w = a.reshape(b * t, d).t().mm(gc.reshape(b * t, p))
            elif G == 1:
                w = gc.reshape(b * t, p).t().mm(a.reshape(b * t, d))
            else:
                w = torch.einsum("bgtp,bgtd->gpd", gc, a).reshape(G * p, d)
        out = [w.reshape(self.weight.shape)]
        if self.bias is not None:  # the per-example sums it norms (see accumulate_into)
            out.append(row_scaled(self._bias_ps(), c).sum(0).view(self.bias.shape))
        return out

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """``outs += sum_i c_i grad_i`` in place: ghost form, one matmul per group of
        examples added straight into the buffer (the scaled output gradients of at most
        :data:`_CHUNK_BYTES` at a time: a language-model head's are vocabulary-wide)."""
        b, G, t, d, p = self.dims
        o = outs[0]
        if self._ps is not None:
            # the per-example gradients (ours, cleaned in place of what only an example
            # of weight 0 can hold), in the parameter's layout: one matrix-vector product
            # (float32 ones into a half-precision buffer: formed in float32, rounded once)
            if not _ROWS_FINITE.get():
                torch.nan_to_num(self._ps, 0.0, 0.0, 0.0, out=self._ps)
            _add_mv(o, self._ps_cols, c)
            if self.bias is not None:
                _addmv_cols(outs[1], self._bias_cols(), c)
            return
        k = max(1, _CHUNK_BYTES // max(1, t * (d + p) * self._dtype.itemsize))
        if self._flat2 is not None and k >= b:
            return self._accumulate_flat(c, outs)
        if self._ps is not None or G != 1 or self._low or o.dtype != self._dtype:
            return super().accumulate_into(c, outs)
        c = c.to(self._dtype)
        shape = (d, p) if self.transposed else (p, d)
        o = o if o.shape == shape else o.view(shape)
        # the bias from the per-example sums over positions its norms are of (the scaled
        # positions summed instead round otherwise: rows built to cancel then added more
        # than the clipping bound)
        if k >= b:  # one chunk: the weights on the narrower side
            self._add_weighted_(o, self.g, self.a, c, p, d)
        else:
            for s in range(0, b, k):
                self._add_weighted_(o, as_dtype(self._g[s:s + k], self._dtype),
                                    as_dtype(self._a[s:s + k], self._dtype), c[s:s + k], p, d)
        if self.bias is not None:
            _addmv_cols(outs[1], self._bias_cols(), c)

    def _accumulate_flat(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """:meth:`accumulate_into` of a ghost layer (one group, one chunk) from the 2-D
        forms made in the hook: the narrower side scaled per example (by factors rounded
        down for half-precision operands, :func:`low_factors`), one matmul added into the
        buffer (``addmm_``; half-precision operands: with float32 accumulation,
        :func:`addmm32_`; a buffer of another dtype: the product added, rounded once).
        Where the rows are cleaned, the clipped sum may take it over and form the
        operands of several layers' products at once (:mod:`privlearn.torch._grouped`)."""
        take = _GHOST_DEFER.get()
        if take is not None and take(self, c, outs):  # grouped with other layers'
            return
        b, G, t, d, p = self.dims
        a2, g2, lt, st = self._flat2
        dt = self._dtype
        c0 = c if self._low else c.to(dt)
        c = low_factors(c, dt) if self._low else c0
        if p > d:  # the inputs are the narrower side
            # in dt (the factors' dtype); scaled as the transpose the matmul reads
            left, right = ((token_scaled_t(st, c, t), _finite(as_dtype(g2, dt)))
                           if self.transposed
                           else (_finite(as_dtype(lt, dt)), token_scaled(a2, c, t)))
        elif self.transposed:
            left, right = _finite(as_dtype(lt, dt)), token_scaled(g2, c, t)
        else:
            left, right = token_scaled_t(st, c, t), _finite(as_dtype(a2, dt))
        add_product_(outs[0], left, right, self._low, dt)
        if self.bias is not None:  # from its per-example rows (held for its norms)
            _addmv_rows_cols(outs[1], self._bias_ps(), self._bias_cols(), c0)

    def _add_weighted_(self, o: torch.Tensor, g: torch.Tensor, a: torch.Tensor,
                       c: torch.Tensor, p: int, d: int) -> torch.Tensor:
        """``o += sum_i c_i g_i^T a_i`` with the weights on the narrower side (one pass over
        the wide one); returns the output gradients' rows as used."""
        if p > d:
            g, a = _finite(g), row_scaled(a, c)
        else:
            g, a = row_scaled(g, c), _finite(a)
        g2, a2 = g.reshape(-1, p), a.reshape(-1, d)
        if self.transposed:
            o.addmm_(a2.t(), g2)
        else:
            o.addmm_(g2.t(), a2)
        return g2

    def _weighted_sum_low(self, c: torch.Tensor) -> list[torch.Tensor]:
        """The clipped sum from half-precision operands: one matmul with float32
        accumulation and result (:func:`mm32`), factors rounded down (:func:`low_factors`)."""
        b, G, t, d, p = self.dims
        gc = row_scaled(self.g, low_factors(c, self._dtype))
        a = _finite(self.a)
        if G == 1:
            g2, a2 = gc.reshape(b * t, p), a.reshape(b * t, d)
            w = mm32(a2.t(), g2) if self.transposed else mm32(g2.t(), a2)
        else:
            w = mm32(gc.permute(1, 3, 0, 2).reshape(G, p, b * t),
                     a.permute(1, 0, 2, 3).reshape(G, b * t, d)).reshape(G * p, d)
        out = [_shaped(w, self.weight.shape)]
        if self.bias is not None:
            out.append(_shaped(g2.sum(0, dtype=torch.float32), self.bias.shape) if G == 1
                       else gc.sum(2, dtype=torch.float32).reshape(b, G * p).sum(0).view(
                           self.bias.shape))
        return out

    def per_sample(self) -> list[torch.Tensor]:
        b, G, t, d, p = self.dims
        if self._ps is not None:  # already in the parameter's layout
            ps = self._ps
        else:
            if self._low:
                ps = mm32(self.g.transpose(-1, -2).reshape(b * G, p, t),
                          self.a.reshape(b * G, t, d)).view(b, G, p, d)
            else:
                ps = torch.matmul(self.g.transpose(-1, -2), self.a)
            if self.transposed:
                ps = ps.reshape(b, p, d).transpose(1, 2)
        out = [ps.reshape(b, *self.weight.shape)]
        if self.bias is not None:
            out.append(self._bias_ps().reshape(b, *self.bias.shape))
        return out

    def factor(self, j: int):
        b, G, t, d, p = self.dims
        if j == 1:
            return ("dense", self._bias_ps().reshape(b, *self.bias.shape))
        if self._ps is not None or G != 1:
            return ("dense", self.per_sample()[0])
        return ("outer_t" if self.transposed else "outer",
                self.a.reshape(b, t, d), self.g.reshape(b, t, p))


class DenseOuterProduct(Contribution):
    """Linear layer on a ``(B, d)`` input: the per-example weight gradient is the rank-one
    ``g_i a_i^T``, so its squared norm is ``|g_i|^2 |a_i|^2`` (plus ``|g_i|^2`` for the
    bias) and no per-example gradient is ever formed (Goodfellow 2015, "Efficient
    Per-Example Gradient Computations"). The clipped sum is one matmul, the one autograd
    would run for the non-private weight gradient. ``transposed``: the parameter is
    ``(d, p)`` (transformers' ``Conv1D``)."""

    masks_rows = True

    def __init__(self, weight, bias, a: torch.Tensor, g: torch.Tensor,
                 transposed: bool = False):
        self.weight, self.bias = weight, bias
        self.params = (weight,) if bias is None else (weight, bias)
        self._low = keep_low_precision(a, g)
        dt = a.dtype if self._low else compute_dtype(a, g)
        self.a, self.g = as_dtype(a, dt), as_dtype(g, dt)
        self.transposed = transposed
        self._sq = None

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:
            ga = row_sq_norms(self.g)
            aa = row_sq_norms(self.a)
            self._sq = ga * (aa + 1.0) if self.bias is not None else ga * aa
        return self._sq

    def param_sq_norms(self) -> list[torch.Tensor]:
        ga = row_sq_norms(self.g)
        return [ga * row_sq_norms(self.a)] if self.bias is None else [ga * row_sq_norms(self.a), ga]

    def _weighted_g(self, c: torch.Tensor) -> torch.Tensor:
        """Output gradients scaled per example, ``c_i g_i``."""
        if self._low:
            return row_scaled(self.g, low_factors(c, self.g.dtype))
        return row_scaled(self.g, c)

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        gc = self._weighted_g(c)
        a = _finite(self.a)
        if self._low:
            w = mm32(a.t(), gc) if self.transposed else mm32(gc.t(), a)
            return [w] if self.bias is None else [w, gc.sum(0, dtype=torch.float32)]
        w = a.t().mm(gc) if self.transposed else gc.t().mm(a)
        if self.bias is None:
            return [w]
        return [w, gc.sum(0)]

    def per_sample(self) -> list[torch.Tensor]:
        a, g = (self.a.float(), self.g.float()) if self._low else (self.a, self.g)
        if self.transposed:
            ps = a.unsqueeze(2) * g.unsqueeze(1)
        else:
            ps = g.unsqueeze(2) * a.unsqueeze(1)
        return [ps] if self.bias is None else [ps, g]

    def factor(self, j: int):
        if j == 1:
            return ("dense", self.g)
        return ("outer_t" if self.transposed else "outer",
                self.a.unsqueeze(1), self.g.unsqueeze(1))

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        if self._low or self.g.dtype.itemsize > outs[0].dtype.itemsize:
            # float32 sums added into the buffer (a half-precision one: rounded once)
            return super().accumulate_into(c, outs)
        gc = self._weighted_g(c)
        a = _finite(self.a)
        if gc.dtype != outs[0].dtype:
            gc, a = gc.to(outs[0].dtype), a.to(outs[0].dtype)
        if self.transposed:
            outs[0].addmm_(a.t(), gc)
        else:
            outs[0].addmm_(gc.t(), a)  # the GEMM adds into the noise in place
        if self.bias is not None:  # same summation as autograd's Linear
            outs[1].add_(gc.sum(0))


# True while rules are evaluated (their internal module calls must not be recorded); a
# ContextVar, so concurrent threads or tasks evaluating rules do not see each other's flag
_IN_RULE: contextvars.ContextVar[bool] = contextvars.ContextVar("privlearn_in_rule",
                                                                default=False)


@contextlib.contextmanager
def rule_evaluation():
    """Context in which hooks do not record (rules may call modules internally)."""
    token = _IN_RULE.set(True)
    try:
        yield
    finally:
        _IN_RULE.reset(token)


def recording_disabled() -> bool:
    return _IN_RULE.get()


class _MakeDifferentiable(torch.autograd.Function):
    """Identity on a tensor that does not require grad, made differentiable via ``dummy``.

    The tensor is returned in place (``mark_dirty``); since it required no grad, autograd
    saved it nowhere, so this is safe, and the gradient reaching it is caught by a hook.
    """

    @staticmethod
    def forward(ctx, dummy, x):
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return None, g


def make_differentiable(x: torch.Tensor, dummy: torch.Tensor) -> torch.Tensor:
    """``x`` itself, made part of the autograd graph through ``dummy``.

    For an instrumenter (:func:`register_instrumenter`) that must catch the gradient of
    an intermediate tensor computed from inputs that require no gradient (e.g. a frozen
    first layer): ``make_differentiable(t, dummy).register_hook(...)`` then sees it.

    Parameters
    ----------
    x : torch.Tensor
        A tensor that does not require grad, returned in place (``mark_dirty``: safe,
        since autograd saved it nowhere).
    dummy : torch.Tensor
        A scalar tensor with ``requires_grad=True``; it receives no gradient.

    Returns
    -------
    torch.Tensor
        ``x``, now requiring grad; the gradient reaching it passes through unchanged.
    """
    return _MakeDifferentiable.apply(dummy, x)


# former private names of the rule-author kit, kept for code that imports them
_as = as_dtype
_rowdot = row_sq_norms
_row_scaled = row_scaled
_segment_sum = segment_sum
_live_positions = live_positions
