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
``T^2 (d + p) < d p`` or when materialising would exceed a memory budget.

Registered rules: ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``, ``nn.Embedding``,
``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RNN``/``nn.LSTM``/``nn.GRU`` (see
:mod:`privlearn.torch.rnn`), ``nn.MultiheadAttention`` (see
:mod:`privlearn.torch.attention`), and a generic :mod:`torch.func` fallback (vmap of a
vjp of ``functional_call``) for any other layer, multi-input ones included.
:func:`register_rule` adds a rule for a new layer type.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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
    "compute_dtype",
    "cross_term",
    "linear_like",
    "fallback_rule",
    "use_ghost",
    "GHOST_MEMORY_BUDGET_BYTES",
]

#: Materialising per-example gradients of one layer above this many bytes switches the
#: layer to ghost norms (no per-example gradient stored).
GHOST_MEMORY_BUDGET_BYTES = 64 * 2**20


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
    scale: float = 1.0  # loss-reduction factor, set by the tracker
    extra: dict | None = None  # tensors exposed by an instrumented forward (attention)

    def has_grad(self) -> bool:
        return any(g is not None for g in self.grad_outputs)

    def grad(self, i: int) -> torch.Tensor:
        g = self.grad_outputs[i]
        if g is None:
            shape, dtype, device = self.outputs_meta[i]
            return torch.zeros(shape, dtype=dtype, device=device)
        return g


class Contribution:
    """Per-example gradient information of one layer call (see module docstring)."""

    params: tuple[nn.Parameter, ...]

    def sq_norms(self) -> torch.Tensor:  # (B,)
        raise NotImplementedError

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        """``sum_i c_i grad_i`` for each parameter, aligned with ``params``."""
        raise NotImplementedError

    def per_sample(self) -> list[torch.Tensor]:
        """Per-example gradients ``(B, *p.shape)`` aligned with ``params``."""
        raise NotImplementedError

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """``outs[j] += sum_i c_i grad_i`` in place, for each parameter ``j``."""
        for o, w in zip(outs, self.weighted_sum(c), strict=True):
            o.add_(w.reshape(o.shape).to(o.dtype))

    def param_sq_norms(self) -> list[torch.Tensor]:
        """Per-example squared norms ``(B,)`` of each parameter's gradient, aligned with
        ``params`` (per-layer clipping). Default: from :meth:`per_sample`."""
        return [_rowdot(g.reshape(g.shape[0], -1)) for g in self.per_sample()]

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


def _rowdot(x: torch.Tensor) -> torch.Tensor:
    """Squared norm of each row of a 2-D tensor (``vector_norm`` then square: one fused
    reduction, several times faster on CPU than a batched dot product)."""
    return torch.linalg.vector_norm(x, dim=1).square()


_LOW = (torch.float16, torch.bfloat16)


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


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


class Materialized(Contribution):
    """Per-example gradients held explicitly."""

    def __init__(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]):
        self.params = tuple(params)
        self.grads = list(grads)
        self._sq = None

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:
            out = None
            for g in self.grads:
                s = _rowdot(g.reshape(g.shape[0], -1))
                out = s if out is None else out + s
            self._sq = out
        return self._sq

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        return [(c.to(g.dtype) @ g.reshape(g.shape[0], -1)).view(g.shape[1:]) for g in self.grads]

    def per_sample(self) -> list[torch.Tensor]:
        return self.grads

    def param_sq_norms(self) -> list[torch.Tensor]:
        return [_rowdot(g.reshape(g.shape[0], -1)) for g in self.grads]

    def factor(self, j: int):
        return ("dense", self.grads[j])


class Compound(Contribution):
    """Several contributions over disjoint parameters (e.g. the gates of an LSTM)."""

    def __init__(self, parts: Sequence[Contribution]):
        self.parts = list(parts)
        self.params = tuple(p for part in self.parts for p in part.params)

    def sq_norms(self) -> torch.Tensor:
        out = None
        for part in self.parts:
            s = part.sq_norms()
            out = s if out is None else out + s
        return out

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
    ``B G d p`` memory (Bu et al. 2023, Sec. 3.2, layerwise choice).
    """
    if t * t * (d + p) < d * p:
        return True
    return batch * groups * d * p * itemsize > GHOST_MEMORY_BUDGET_BYTES


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

    def __init__(self, weight, bias, a, g, ghost: bool | None = None,
                 transposed: bool = False):
        self.weight, self.bias = weight, bias  # parameters, or anything with a .shape
        self.params = (weight,) if bias is None else (weight, bias)
        dt = compute_dtype(a, g)
        a, g = _as(a, dt), _as(g, dt)
        self.a, self.g = a, g
        self._dtype = dt
        self.transposed = transposed
        b, G, t, d = a.shape
        p = g.shape[-1]
        self.dims = (b, G, t, d, p)
        if ghost is None:
            ghost = use_ghost(b, G, t, d, p, a.element_size())
        self.ghost = ghost
        self._ps = None
        self._sq = None
        self._wsq = None
        self._bias_cache = None
        if not ghost:
            # (B, G, p, d) per-example weight gradients via batched matmul; the inputs
            # (e.g. conv patches) are released right away to bound peak memory
            self._ps = torch.matmul(g.transpose(-1, -2), a)
            if bias is not None:
                self._bias_ps()
            self.a = self.g = None

    def _bias_ps(self) -> torch.Tensor:
        if self._bias_cache is None:
            b, G, t, d, p = self.dims
            g = self.g.reshape(b, G * p) if t == 1 else self.g.sum(2).reshape(b, G * p)
            self._bias_cache = g
        return self._bias_cache

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:
            w = self._weight_sq()
            self._sq = w + _rowdot(self._bias_ps()) if self.bias is not None else w
        return self._sq

    def param_sq_norms(self) -> list[torch.Tensor]:
        out = [self._weight_sq()]
        if self.bias is not None:
            out.append(_rowdot(self._bias_ps()))
        return out

    def _weight_sq(self) -> torch.Tensor:
        if self._wsq is not None:
            return self._wsq
        b, G, t, d, p = self.dims
        if self._ps is not None:
            w = _rowdot(self._ps.reshape(b, -1))
        elif t == 1 and G == 1:  # |a|^2 |g|^2
            w = _rowdot(self.g.reshape(b, p)) * _rowdot(self.a.reshape(b, d))
        elif t == 1:
            w = (self.a.pow(2).sum(-1) * self.g.pow(2).sum(-1)).reshape(b, -1).sum(1)
        else:
            aa = torch.matmul(self.a, self.a.transpose(-1, -2))  # (B, G, T, T)
            gg = torch.matmul(self.g, self.g.transpose(-1, -2))
            w = (aa * gg).reshape(b, -1).sum(1)
        self._wsq = w
        return w

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        b, G, t, d, p = self.dims
        c = c.to(self._dtype)
        gc = None
        if self._ps is not None:
            w = (c @ self._ps.reshape(b, -1)).view(G * p, d)
            if self.transposed:
                w = w.t()
        else:
            gc = self.g * c.view(b, 1, 1, 1)
            if G == 1 and self.transposed:
                w = self.a.reshape(b * t, d).t().mm(gc.reshape(b * t, p))
            elif G == 1:
                w = gc.reshape(b * t, p).t().mm(self.a.reshape(b * t, d))
            else:
                w = torch.einsum("bgtp,bgtd->gpd", gc, self.a).reshape(G * p, d)
        out = [w.reshape(self.weight.shape)]
        if self.bias is not None:
            if gc is not None and G == 1:  # same summation order as autograd's Linear
                out.append(gc.reshape(b * t, p).sum(0).view(self.bias.shape))
            else:
                out.append((c @ self._bias_ps()).view(self.bias.shape))
        return out

    def per_sample(self) -> list[torch.Tensor]:
        b, G, t, d, p = self.dims
        ps = self._ps if self._ps is not None else torch.matmul(self.g.transpose(-1, -2), self.a)
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

    def __init__(self, weight, bias, a: torch.Tensor, g: torch.Tensor,
                 transposed: bool = False):
        self.weight, self.bias = weight, bias
        self.params = (weight,) if bias is None else (weight, bias)
        dt = compute_dtype(a, g)
        self.a, self.g = _as(a, dt), _as(g, dt)
        self.transposed = transposed
        self._sq = None

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:
            ga = _rowdot(self.g)
            aa = _rowdot(self.a)
            self._sq = ga * (aa + 1.0) if self.bias is not None else ga * aa
        return self._sq

    def param_sq_norms(self) -> list[torch.Tensor]:
        ga = _rowdot(self.g)
        return [ga * _rowdot(self.a)] if self.bias is None else [ga * _rowdot(self.a), ga]

    def _weighted_g(self, c: torch.Tensor) -> torch.Tensor:
        """Output gradients scaled per example, ``c_i g_i``."""
        if c.dtype != self.g.dtype:
            c = c.to(self.g.dtype)
        return self.g * c.unsqueeze(1)

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        gc = self._weighted_g(c)
        w = self.a.t().mm(gc) if self.transposed else gc.t().mm(self.a)
        if self.bias is None:
            return [w]
        return [w, gc.sum(0)]

    def per_sample(self) -> list[torch.Tensor]:
        if self.transposed:
            ps = self.a.unsqueeze(2) * self.g.unsqueeze(1)
        else:
            ps = self.g.unsqueeze(2) * self.a.unsqueeze(1)
        return [ps] if self.bias is None else [ps, self.g]

    def factor(self, j: int):
        if j == 1:
            return ("dense", self.g)
        return ("outer_t" if self.transposed else "outer",
                self.a.unsqueeze(1), self.g.unsqueeze(1))

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        gc = self._weighted_g(c)
        a = self.a
        if gc.dtype != outs[0].dtype:
            gc, a = gc.to(outs[0].dtype), a.to(outs[0].dtype)
        if self.transposed:
            outs[0].addmm_(a.t(), gc)
        else:
            outs[0].addmm_(gc.t(), a)  # the GEMM adds into the noise in place
        if self.bias is not None:
            outs[1].add_(gc.sum(0))


def cross_term(f1, f2) -> torch.Tensor:
    """Per-example ``<G1_i, G2_i>`` of two factored gradients of the same parameter
    (see :meth:`Contribution.factor`), without materialising them where the forms allow:

    * outer x outer: ``sum_{t,s} (g_t . g'_s)(a_t . a'_s)`` (the ghost-norm identity,
      Li et al. 2022, Sec. 4, applied to two different layers' factors);
    * rows x outer: ``sum_t sum_s (e_t . a_s) g_s[id_t]`` (an embedding's rows against a
      linear head tied to it: the ``V x D`` gradient is never formed);
    * rows x rows: aggregated over distinct tokens per example;
    * otherwise the dense per-example gradients.
    """
    f1, f2 = _orient(f1), _orient(f2)
    k1, k2 = f1[0], f2[0]
    if k1 == "outer" and k2 == "outer":
        a1, g1 = f1[1], f1[2]
        a2, g2 = f2[1], f2[2]
        dt = compute_dtype(a1, a2)
        aa = torch.matmul(_as(a1, dt), _as(a2, dt).transpose(1, 2))  # (B, T1, T2)
        gg = torch.matmul(_as(g1, dt), _as(g2, dt).transpose(1, 2))
        return (aa * gg).sum((1, 2))
    if k1 == "outer" and k2 == "rows":
        f1, f2, k1, k2 = f2, f1, k2, k1
    if k1 == "rows" and k2 == "outer":
        ids, e = f1[1], f1[2]  # (B, T), (B, T, D)
        a, g = f2[1], f2[2]  # (B, S, D), (B, S, V)
        dt = compute_dtype(e, a)
        dots = torch.matmul(_as(e, dt), _as(a, dt).transpose(1, 2))  # (B, T, S)
        b, s = g.shape[0], g.shape[1]
        sel = torch.gather(g, 2, ids.unsqueeze(1).expand(b, s, ids.shape[1]))  # (B, S, T)
        return (dots * _as(sel, dt).transpose(1, 2)).sum((1, 2))
    if k1 == "rows" and k2 == "rows":
        ids = torch.cat([f1[1], f2[1]], 1)
        e1, e2 = f1[2], f2[2]
        dt = compute_dtype(e1, e2)
        z1, z2 = torch.zeros_like(_as(e2, dt)), torch.zeros_like(_as(e1, dt))
        x1 = torch.cat([_as(e1, dt), z1], 1)
        x2 = torch.cat([z2, _as(e2, dt)], 1)
        b, t = ids.shape
        keys = (torch.arange(b, device=ids.device).unsqueeze(1) * f1[3] + ids).reshape(-1)
        uniq, inv = torch.unique(keys, return_inverse=True)
        n = uniq.shape[0]
        s1 = _segment_sum(x1.reshape(b * t, -1), inv, n)
        s2 = _segment_sum(x2.reshape(b * t, -1), inv, n)
        owner = torch.zeros(n, dtype=torch.long, device=ids.device).index_copy_(
            0, inv, torch.arange(b, device=ids.device).repeat_interleave(t))
        return torch.zeros(b, dtype=dt, device=ids.device).index_add_(0, owner,
                                                                       (s1 * s2).sum(1))
    if k2 == "rows":
        f1, f2, k1, k2 = f2, f1, k2, k1
    if k1 == "rows":  # rows x dense: gather the dense rows at the token ids
        ids, e = f1[1], f1[2]
        dense = _dense(f2)
        dt = compute_dtype(e, dense)
        b, t = ids.shape
        rows = torch.gather(_as(dense, dt).reshape(b, f1[3], -1), 1,
                            ids.unsqueeze(2).expand(b, t, e.shape[2]))
        return (rows * _as(e, dt)).sum((1, 2))
    d1, d2 = _dense(f1), _dense(f2)
    dt = compute_dtype(d1, d2)
    b = d1.shape[0]
    return (_as(d1, dt).reshape(b, -1) * _as(d2, dt).reshape(b, -1)).sum(1)


def _orient(f):
    if f[0] == "outer_t":  # (sum_t g a^T)^T = sum_t a g^T
        return ("outer", f[2], f[1])
    return f


def _dense(f) -> torch.Tensor:
    kind = f[0]
    if kind == "dense":
        return f[1]
    if kind == "outer":
        return torch.matmul(f[2].transpose(1, 2), f[1])  # (B, p, d)
    ids, e, v = f[1], f[2], f[3]
    b, t = ids.shape
    out = e.new_zeros(b * v, e.shape[2])
    keys = (torch.arange(b, device=ids.device).unsqueeze(1) * v + ids).reshape(-1)
    return out.index_add_(0, keys, e.reshape(b * t, -1)).view(b, v, -1)


# --------------------------------------------------------------------------- registry

Rule = Callable[[nn.Module, Record, Sequence[nn.Parameter]], Contribution]
RULES: dict[type, Rule] = {}


def register_rule(*layer_types: type) -> Callable[[Rule], Rule]:
    """Decorator registering ``rule(module, record, params) -> Contribution``.

    ``params`` are the module's trainable parameters (recursive), in
    ``named_parameters`` order; the contribution must cover exactly these. The rule must
    be linear in the recorded output gradients (the tracker applies the loss-reduction
    factor to its results).
    """

    def deco(fn: Rule) -> Rule:
        for t in layer_types:
            RULES[t] = fn
        return fn

    return deco


#: Rules matched by a predicate on the module (layers of libraries privlearn does not
#: import, recognised by class name and attributes), tried after :data:`RULES`.
PREDICATE_RULES: list[tuple[Callable[[nn.Module], bool], Rule]] = []


def register_predicate_rule(predicate: Callable[[nn.Module], bool]) -> Callable[[Rule], Rule]:
    """Decorator registering a rule for every module for which ``predicate`` holds."""

    def deco(fn: Rule) -> Rule:
        PREDICATE_RULES.append((predicate, fn))
        return fn

    return deco


def get_rule(module: nn.Module) -> Rule | None:
    """The rule registered for ``type(module)`` (exact type first, then MRO), else the
    first predicate rule that matches."""
    for t in type(module).__mro__:
        if t in RULES:
            return RULES[t]
    for pred, fn in PREDICATE_RULES:
        if pred(module):
            return fn
    return None


def _scaled(record: Record, i: int = 0) -> torch.Tensor:
    """Output gradient ``i`` as recorded. Rules are linear in it: the tracker applies the
    loss-reduction factor to the norms and sums afterwards (one multiply per step, not
    per layer)."""
    return record.grad(i)


@register_rule(nn.Linear)
def linear_rule(module: nn.Linear, record: Record, params) -> Contribution:
    return linear_like(record.args[0], _scaled(record), module.weight, module.bias, params)


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
    dt = compute_dtype(a, g)
    g = _as(g, dt).reshape(b, 1, -1, p)
    if w is None:  # frozen weight, trainable bias
        return Materialized([bias], [g.sum(2).reshape(b, p)])
    return OuterProduct(w, bias, _as(a, dt).reshape(b, 1, -1, d), g, transposed=transposed)


def _conv_patches(module, x: torch.Tensor, nd: int) -> torch.Tensor:
    """Patches of the (padded) input as rows: ``(B, G, L, C_in / G * prod(kernel))``.

    Built with ``as_strided`` and one copy (several times faster on CPU than
    ``F.unfold``/im2col for the usual small images).
    """
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pad = module._reversed_padding_repeated_twice
    if any(pad):
        x = F.pad(x, pad, mode=mode)
    if nd == 1:
        x = x.unsqueeze(2)
        k, s, dl = (1, module.kernel_size[0]), (1, module.stride[0]), (1, module.dilation[0])
    else:
        k, s, dl = module.kernel_size, module.stride, module.dilation
    x = x.contiguous()
    b, c, h, w = x.shape
    ho = (h - dl[0] * (k[0] - 1) - 1) // s[0] + 1
    wo = (w - dl[1] * (k[1] - 1) - 1) // s[1] + 1
    G = module.groups
    sb, sc, sh, sw = x.stride()
    v = x.as_strided((b, G, ho, wo, c // G, k[0], k[1]),
                     (sb, sc * (c // G), sh * s[0], sw * s[1], sc, sh * dl[0], sw * dl[1]))
    return v.reshape(b, G, ho * wo, (c // G) * k[0] * k[1])


def _conv_rule(module, record: Record, params, nd: int) -> Contribution:
    x = record.args[0]
    g = _scaled(record)
    if x.dim() == nd + 1:  # unbatched input
        raise ValueError(f"{type(module).__name__} received an unbatched input of shape "
                         f"{tuple(x.shape)}; per-example clipping needs a batch dimension")
    b, G = x.shape[0], module.groups
    p = module.out_channels // G
    ps = set(params)
    w = module.weight if module.weight in ps else None
    bias = module.bias if module.bias is not None and module.bias in ps else None
    dt = compute_dtype(x, g)
    gg = _as(g, dt).reshape(b, G, p, -1).transpose(-1, -2)  # (B, G, L, p)
    if w is None:
        return Materialized([bias], [gg.sum(2).reshape(b, G * p)])
    a = _conv_patches(module, _as(x, dt), nd)  # (B, G, L, d)
    return OuterProduct(w, bias, a, gg)


@register_rule(nn.Conv1d)
def conv1d_rule(module, record, params):
    return _conv_rule(module, record, params, 1)


@register_rule(nn.Conv2d)
def conv2d_rule(module, record, params):
    return _conv_rule(module, record, params, 2)


class EmbeddingContribution(Contribution):
    """Embedding: per-example gradient rows are sums of output gradients per token id.

    The squared norm is ``sum_v |sum_{t: id_t = v} g_t|^2``, computed by aggregating over
    the distinct (example, token) pairs (``B T D`` work; equals the ghost form
    ``sum_{t,s} [id_t = id_s] g_t . g_s``). The clipped sum is one ``index_add``.
    """

    def __init__(self, weight, ids, g, padding_idx):
        self.params = (weight,)
        self.weight = weight
        b = ids.shape[0]
        ids = ids.reshape(b, -1)  # copies expanded (stride-0) views: never written in place
        g = g.reshape(b, ids.shape[1], -1)
        g = _as(g, compute_dtype(g))
        if padding_idx is not None:
            g = g * (ids != padding_idx).unsqueeze(-1).to(g.dtype)
        self.b, self.ids, self.g = b, ids, g

    def factor(self, j: int):
        return ("rows", self.ids, self.g, self.weight.shape[0])

    def sq_norms(self) -> torch.Tensor:
        b, ids, g = self.b, self.ids, self.g
        V, D = self.weight.shape
        if b == 0:
            return g.new_zeros(0)
        if ids.shape[1] == 1:
            return g.pow(2).sum((1, 2))
        keys = torch.arange(b, device=ids.device).unsqueeze(1) * V + ids
        uniq, inv = torch.unique(keys.reshape(-1), return_inverse=True)
        # segment sums by the (sort-based) kernel autograd uses for Embedding: several
        # times faster on CPU than index_add_
        agg = _segment_sum(g.reshape(-1, D), inv, uniq.shape[0])
        sq = _rowdot(agg)
        return g.new_zeros(b).index_add_(0, uniq // V, sq)

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        D = self.weight.shape[1]
        gc = (self.g * c.to(self.g.dtype).view(-1, 1, 1)).reshape(-1, D)
        return [_segment_sum(gc, self.ids.reshape(-1), self.weight.shape[0])]

    def per_sample(self) -> list[torch.Tensor]:
        b, ids, g = self.b, self.ids, self.g
        V, D = self.weight.shape
        out = g.new_zeros(b * V, D)
        keys = (torch.arange(b, device=ids.device).unsqueeze(1) * V + ids).reshape(-1)
        out.index_add_(0, keys, g.reshape(-1, D))
        return [out.view(b, V, D)]


def _segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """``out[j] = sum_{i: index_i = j} values_i`` for ``j < n``."""
    return torch.ops.aten.embedding_dense_backward(values, index, n, -1, False)


@register_rule(nn.Embedding)
def embedding_rule(module: nn.Embedding, record: Record, params) -> Contribution:
    ids = record.args[0]
    return EmbeddingContribution(module.weight, ids, _scaled(record), module.padding_idx)


def _affine_norm_rule(module, record, params, xhat, g, reduce_dims):
    ps = set(params)
    out_p, out_g = [], []
    if module.weight is not None and module.weight in ps:
        out_p.append(module.weight)
        out_g.append((g * xhat).sum(reduce_dims) if reduce_dims else g * xhat)
    if module.bias is not None and module.bias in ps:
        out_p.append(module.bias)
        out_g.append(g.sum(reduce_dims) if reduce_dims else g)
    return Materialized(out_p, out_g)


@register_rule(nn.LayerNorm)
def layernorm_rule(module: nn.LayerNorm, record: Record, params) -> Contribution:
    x, g = record.args[0], _scaled(record)
    dt = compute_dtype(x, g)
    x, g = _as(x, dt), _as(g, dt)
    xhat = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    k = len(module.normalized_shape)
    reduce_dims = tuple(range(1, x.dim() - k))
    return _affine_norm_rule(module, record, params, xhat, g, reduce_dims)


@register_rule(nn.GroupNorm)
def groupnorm_rule(module: nn.GroupNorm, record: Record, params) -> Contribution:
    x, g = record.args[0], _scaled(record)
    dt = compute_dtype(x, g)
    x, g = _as(x, dt), _as(g, dt)
    xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
    reduce_dims = tuple(range(2, x.dim()))
    return _affine_norm_rule(module, record, params, xhat, g, reduce_dims)


# --------------------------------------------------------------------------- fallback


def _batch_dims(module: nn.Module, record: Record, batch: int):
    """Batch dimension of every tensor argument and output (None: not batched)."""
    batch_first = getattr(module, "batch_first", True)
    if isinstance(module, nn.MultiheadAttention):
        names = ["query", "key", "value"]
        arg_dims = []
        for i, a in enumerate(record.args):
            arg_dims.append(_mha_dim(names[i] if i < 3 else "", a, batch_first))
        kw_dims = {k: _mha_dim(k, v, batch_first) for k, v in record.kwargs.items()}
        out_dims = [0 if batch_first else 1, 0]  # attn output, attn weights (B, L, S)
        out_dims = out_dims[: len(record.outputs_meta)]
        return arg_dims, kw_dims, out_dims

    def dim(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None
        return 0 if t.shape[0] == batch else None

    arg_dims = [dim(a) for a in record.args]
    kw_dims = {k: dim(v) for k, v in record.kwargs.items()}
    out_dims = [0 if (len(s) > 0 and s[0] == batch) else None for s, _, _ in record.outputs_meta]
    return arg_dims, kw_dims, out_dims


def _mha_dim(name, t, batch_first):
    if not isinstance(t, torch.Tensor):
        return None
    if name in ("query", "key", "value"):
        return 0 if batch_first else 1
    if name == "key_padding_mask":
        return 0
    if name == "attn_mask":
        if t.dim() == 3:
            raise ValueError("MultiheadAttention with a 3-D (per-example) attn_mask is not "
                             "supported by per-example clipping; use key_padding_mask")
        return None
    return None


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


def fallback_rule(module: nn.Module, record: Record, params) -> Contribution:
    """Generic rule: per-example gradients by ``vmap`` of a ``vjp`` of ``functional_call``.

    Each example is passed through the layer on its own (batch of one, inside ``vmap``, so
    no Python loop runs) and the vector-Jacobian product with that example's output
    gradient gives its parameter gradient. Correct for any layer that treats examples
    independently; all positional and keyword tensor inputs are handled.
    """
    from torch.func import functional_call, vjp, vmap
    from torch.utils._pytree import tree_flatten

    names = [n for n, p in module.named_parameters() if p in set(params)]
    pvals = {n: p.detach() for n, p in module.named_parameters() if p in set(params)}
    outputs_n = len(record.outputs_meta)
    b = _record_batch(module, record)
    arg_dims, kw_dims, out_dims = _batch_dims(module, record, b)
    if all(d is None for d in out_dims):
        raise ValueError(f"cannot find the batch dimension of the outputs of {module!r}")
    gouts = [_scaled(record, i) for i in range(outputs_n)]
    args, kwargs = record.args, record.kwargs
    floats = [t for t in (*args, *kwargs.values(), *gouts)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if any(t.dtype in _LOW for t in floats):  # mixed precision: redo the layer in float32
        dt = compute_dtype(*floats, *pvals.values())

        def up(t):
            return _as(t, dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        args = tuple(up(t) for t in args)
        kwargs = {k: up(v) for k, v in kwargs.items()}
        gouts = [up(t) for t in gouts]
        pvals = {k: up(v) for k, v in pvals.items()}
    kw_keys = list(kwargs)
    kw_vals = [kwargs[k] for k in kw_keys]
    kw_in = [kw_dims[k] for k in kw_keys]
    n_args = len(args)

    def per_example(pv, *flat):
        a_i = list(flat[:n_args])
        k_i = list(flat[n_args: n_args + len(kw_keys)])
        g_i = list(flat[n_args + len(kw_keys):])
        a_i = [x.unsqueeze(d) if d is not None else x for x, d in zip(a_i, arg_dims, strict=True)]
        k_i = [x.unsqueeze(d) if d is not None else x for x, d in zip(k_i, kw_in, strict=True)]
        g_i = [x.unsqueeze(d) if d is not None else x for x, d in zip(g_i, out_dims, strict=True)]

        def f(p):
            out = functional_call(module, p, tuple(a_i), dict(zip(kw_keys, k_i, strict=True)))
            flat_out, _ = tree_flatten(out)
            return tuple(o for o in flat_out if isinstance(o, torch.Tensor))

        outs, fn = vjp(f, pv)
        g_use = tuple(
            gi if gi is not None and o.is_floating_point() else torch.zeros_like(o)
            for o, gi in zip(outs, g_i, strict=True)
        )
        return fn(g_use)[0]

    in_dims = (None, *arg_dims, *kw_in, *out_dims)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the math attention kernel has vmap batching rules (the fused CPU kernels do not)
    dev = next(iter(pvals.values())).device.type if pvals else "cpu"
    with rule_evaluation(), torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]), \
            torch.autocast(dev, enabled=False):
        grads = vmap(per_example, in_dims=in_dims)(pvals, *args, *kw_vals, *gouts)
    by_name = dict(zip(names, [grads[n] for n in names], strict=True))
    return Materialized([p for n, p in module.named_parameters() if n in by_name],
                        [by_name[n] for n, p in module.named_parameters() if n in by_name])


def _record_batch(module: nn.Module, record: Record) -> int:
    x = record.args[0] if record.args else next(iter(record.kwargs.values()))
    if isinstance(module, nn.MultiheadAttention | nn.RNNBase) and not getattr(
        module, "batch_first", False
    ):
        return x.shape[1]
    return x.shape[0]


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
