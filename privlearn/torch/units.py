"""Privacy units of several rows: a user's examples, or the augmented views of one example.

DP-SGD clips one gradient per privacy unit. When a unit is one row of the batch (one
example) that is the per-example gradient; when it is several rows -- the examples of one
user (user-level DP; McMahan, Ramage, Talwar & Zhang 2018, "Learning Differentially
Private Recurrent Language Models", ICLR; dp-transformers' user-level training), or the
``K`` augmented views of one example (augmentation multiplicity; De, Berrada, Hayes,
Smith & Balle 2022, "Unlocking High-Accuracy Differentially Private Image Classification
through Scale", Sec. 3.1) -- the clipped quantity is the unit's gradient
``G_u = sum_{r in u} w_r g_r`` (``w_r = 1`` for a sum, ``1 / |u|`` for a mean).

:class:`RowUnits` says which rows form which unit; :class:`Grouped` wraps a layer's
contribution so that its squared norms are the units' ``||G_u||^2`` -- computed from the
factored forms of the rows' gradients (an outer-product layer's unit is the same layer on
the unit's rows laid end to end: its ghost norm needs no per-example gradient) -- while its
weighted sums are the rows' with each row weighted by its unit's clip factor times
``w_r``, which is exactly ``sum_u c_u G_u``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from privlearn.torch._ghost_norms import _U32, _U64, _gamma, ghost_sq
from privlearn.torch._summed_rows import dense_sum_sq, rows_sq
from privlearn.torch.cross_terms import _dense, _orient
from privlearn.torch.grad_sample import Contribution, as_dtype, compute_dtype

__all__ = ["RowUnits", "Grouped"]


@dataclass(frozen=True)
class RowUnits:
    """Which rows of a batch form which privacy unit.

    Attributes
    ----------
    unit_of_row : LongTensor (R,)
        The unit of every row, ``0 .. units - 1``.
    position : LongTensor (R,)
        The row's position within its unit.
    weight : Tensor (R,)
        ``w_r``: 1 (sum) or ``1 / |u|`` (mean).
    units : int
    width : int
        Most rows of one unit.
    """

    unit_of_row: torch.Tensor
    position: torch.Tensor
    weight: torch.Tensor
    units: int
    width: int

    @classmethod
    def from_sizes(cls, sizes, reduction: str = "sum", device=None) -> RowUnits:
        """Units of consecutive rows, ``sizes[u]`` rows for unit ``u``."""
        sizes = torch.as_tensor(list(sizes), dtype=torch.long)
        units = int(sizes.numel())
        unit_of_row = torch.repeat_interleave(torch.arange(units), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        position = torch.arange(unit_of_row.numel()) - starts[unit_of_row]
        if reduction == "mean":
            weight = 1.0 / sizes[unit_of_row].to(torch.float64)
        else:
            weight = torch.ones(unit_of_row.numel(), dtype=torch.float64)
        width = int(sizes.max()) if units else 0
        return cls(unit_of_row.to(device), position.to(device), weight.to(device), units,
                   width)

    @classmethod
    def repeated(cls, examples: int, k: int, reduction: str = "mean", device=None) -> RowUnits:
        """``k`` consecutive rows per example (augmentation multiplicity)."""
        return cls.from_sizes([k] * examples, reduction, device)

    @property
    def rows(self) -> int:
        return int(self.unit_of_row.numel())

    def expand(self, c: torch.Tensor) -> torch.Tensor:
        """Per-row weights ``c_{u(r)} w_r`` from per-unit weights ``c``."""
        u = self.unit_of_row.to(c.device)
        return c[u] * self.weight.to(device=c.device, dtype=c.dtype)


def group_factor(f, u: RowUnits):
    """The factored per-unit gradient from a factored per-row one (see
    :meth:`~privlearn.torch.grad_sample.Contribution.factor`): outer-product and row forms
    lay each unit's rows end to end (``(U, width * T, .)``, zero padding), dense forms sum
    them."""
    f = _orient(f)
    kind = f[0]
    if kind == "outer":
        a, g = f[1], f[2]  # (R, T, d), (R, T, p)
        r, t = a.shape[:2]
        g = as_dtype(g, compute_dtype(g))  # weighted in float32 at least
        a = as_dtype(a, g.dtype)
        w = u.weight.to(device=g.device, dtype=g.dtype)
        slot = (u.unit_of_row * u.width + u.position).to(a.device)
        A = a.new_zeros(u.units * u.width, t, a.shape[2]).index_copy_(0, slot, a)
        G = g.new_zeros(u.units * u.width, t, g.shape[2]).index_copy_(
            0, slot, g * w.view(r, 1, 1))
        return ("outer", A.view(u.units, u.width * t, -1), G.view(u.units, u.width * t, -1))
    if kind == "rows":
        ids, e, v = f[1], f[2], f[3]
        r, t = ids.shape
        e = as_dtype(e, compute_dtype(e))
        w = u.weight.to(device=e.device, dtype=e.dtype)
        slot = (u.unit_of_row * u.width + u.position).to(ids.device)
        I = ids.new_zeros(u.units * u.width, t).index_copy_(0, slot, ids)
        E = e.new_zeros(u.units * u.width, t, e.shape[2]).index_copy_(
            0, slot, e * w.view(r, 1, 1))
        return ("rows", I.view(u.units, u.width * t), E.view(u.units, u.width * t, -1), v)
    d = _dense(f)
    w = u.weight.to(device=d.device, dtype=d.dtype).view(-1, *[1] * (d.dim() - 1))
    return ("dense", d.new_zeros(u.units, *d.shape[1:]).index_add_(
        0, u.unit_of_row.to(d.device), d * w))


def unit_sq(f, grouped, u: RowUnits) -> torch.Tensor:
    """Squared norms of the units' gradients ``G_u = sum_{r in u} w_r g_r`` from a
    layer's factored per-row gradient ``f`` and its :func:`group_factor` ``grouped``
    (None for a dense ``f``), never below the exact ones: a unit's rows may cancel, and
    the rounding of the sums that form ``G_u`` is bounded (Higham 2002, Lemma 3.1) as an
    example's own is -- outer products by the ghost norm of the rows laid end to end
    (:func:`~privlearn.torch._ghost_norms.ghost_sq`, the weights' two roundings of each
    ``w_r g_r`` entry added), embedding rows and dense per-row gradients by the bound on
    a sum of rows (:mod:`privlearn.torch._summed_rows`)."""
    kind = "dense" if grouped is None else grouped[0]
    if kind == "outer":
        a, g = grouped[1], grouped[2]
        wide = _U64 if g.dtype == torch.float64 else _U32
        return ghost_sq(as_dtype(a, g.dtype), g, torch.bmm, spread=_gamma(2, wide))
    if kind == "rows":
        return rows_sq(grouped[1], grouped[2], grouped[3])
    d = _dense(_orient(f))
    d = as_dtype(d, compute_dtype(d))
    w = u.weight.to(device=d.device, dtype=d.dtype).view(-1, *[1] * (d.dim() - 1))
    return dense_sum_sq(d * w, u.unit_of_row.to(d.device), u.units, max(u.width, 1))


class Grouped(Contribution):
    """A layer's contribution at the level of privacy units (see the module docstring)."""

    def __init__(self, inner: Contribution, units: RowUnits):
        self.inner = inner
        self.units = units
        self.params = inner.params
        self.masks_rows = inner.masks_rows
        self._sq = None
        self._factors: dict[int, tuple] = {}

    def factor(self, j: int):
        if j not in self._factors:
            self._factors[j] = group_factor(self.inner.factor(j), self.units)
        return self._factors[j]

    def param_sq_norms(self) -> list[torch.Tensor]:
        """The units' squared norms per parameter, never below the exact ones (the rows
        of a unit may cancel: see :func:`unit_sq`)."""
        out = []
        for j in range(len(self.params)):
            f = self.inner.factor(j)
            # a dense form is summed over the unit's rows there (with its norms)
            grouped = self.factor(j) if _orient(f)[0] in ("outer", "rows") else None
            out.append(unit_sq(f, grouped, self.units))
        return out

    def sq_norms(self) -> torch.Tensor:
        if self._sq is None:
            out = None
            for s in self.param_sq_norms():
                out = s if out is None else out + s
            self._sq = out if out is not None else torch.zeros(self.units.units)
        return self._sq

    def weighted_sum(self, c: torch.Tensor) -> list[torch.Tensor]:
        return self.inner.weighted_sum(self.units.expand(c))

    def accumulate_into(self, c: torch.Tensor, outs: list[torch.Tensor]) -> None:
        self.inner.accumulate_into(self.units.expand(c), outs)

    def per_sample(self) -> list[torch.Tensor]:
        out = []
        for j, p in enumerate(self.params):
            f = self.factor(j)
            d = _dense(f)
            out.append(d.reshape(self.units.units, *p.shape))
        return out
