"""The clipping computation of :class:`~privlearn.torch.tracker.GradSampleTracker`:
evaluate the rules on the recorded calls (:meth:`ClippingMixin.contributions`), the
per-example norms over *all* parameters and the clip factors, and the sum of clipped
per-example gradients (:meth:`ClippingMixin.clipped_sum`), with the examples whose norm is
not finite left out or refused.

A mixin: it reads the per-step state the tracker's recording hooks write (``records``,
``units``, ``shared``, ``loss_reduction``, ``loss_scale``, ``_last_inputs``,
``_recompute_unrecorded``) and calls the tracker's ``clear``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from privlearn.errors import BatchDependenceError, TrainingLoopError
from privlearn.torch import grad_sample as _gs
from privlearn.torch._grouped import accumulate_all
from privlearn.torch._row_norms import batch_of
from privlearn.torch._rows import shared_rows
from privlearn.torch._tracker_util import (
    _flat_sq,
    _mismatch_message,
    _nonfinite,
    _per_param_sq,
    _sanitize_record,
    record_batch,
)
from privlearn.torch.cross_terms import _cross_terms
from privlearn.torch.grad_sample import (
    Contribution,
    Record,
    materialise_budget,
    rule_evaluation,
)
from privlearn.torch.units import Grouped, RowUnits

if TYPE_CHECKING:
    from privlearn.torch.tracker import Unit

__all__ = ["ClippingMixin"]


def _flat_reads(c) -> tuple:
    """The recorded 2-D forms that a ghost layer's one-chunk product reads through
    :func:`~privlearn.torch._rows.shared_rows`'s cache (``OuterProduct._accumulate_flat``,
    taken by ``accumulate_into`` under these conditions), one entry a reading, so that a
    shared form is released after its last reader; () for any other contribution."""
    f = getattr(c, "_flat2", None)
    if f is None or getattr(c, "_ps", None) is not None:
        return ()
    b, _, t, d, p = c.dims
    dt = c._dtype
    if max(1, _gs._CHUNK_BYTES // max(1, t * (d + p) * dt.itemsize)) < b \
            or f[0].dtype != dt or f[1].dtype != dt:
        return ()
    return f[:2]


class ClippingMixin:
    """Clipped per-example gradient sums from the records of
    :class:`~privlearn.torch.tracker.GradSampleTracker` (see :meth:`clipped_sum`)."""

    def _scale(self, rec: Record, unit: Unit) -> float:
        if self.loss_reduction == "sum":
            return 1.0
        return float(record_batch(unit, rec))

    def contributions(self, examples: int | None = None, units: RowUnits | None = None
                      ) -> tuple[list[Contribution], int | None, float]:
        """Evaluate the rules on the recorded calls.

        Returns ``(contributions, batch size, scale)``: the contributions are computed
        from the recorded output gradients; the true per-example gradients are ``scale``
        times theirs (``scale`` = realised batch size for a mean loss, 1 for a sum). With
        ``units`` (privacy units of several rows, :mod:`privlearn.torch.units`) every
        contribution is grouped to the units and the batch size is their number.

        Raises
        ------
        ValueError
            The layers saw different numbers of examples, or (``examples`` given) not the
            number of examples the sampler delivered for this batch.
        """
        contribs = []
        batch = None
        scale = None
        per_unit = []
        with rule_evaluation(), materialise_budget(
                0, left=getattr(self, "_budget_left", None)
                or [_gs.STEP_MATERIALISE_BUDGET_BYTES]):
            for i, recs in self.records.items():
                unit = self.units[i]
                recs = [r for r in recs if r.has_grad()]
                if not recs:
                    continue
                cs = []
                for r in recs:
                    n = record_batch(unit, r)
                    if examples is not None and n != examples:
                        self.clear()
                        raise BatchDependenceError(_mismatch_message(unit, n, examples, r))
                    if n == 0:
                        continue  # empty batch: contributes nothing (noise is still added)
                    s = self._scale(r, unit)
                    if scale is None:
                        scale = s
                    c = r.early if r.early is not None else unit.rule(unit.module, r,
                                                                      unit.params)
                    cs.append(c if units is None else Grouped(c, units))
                per_unit.append(cs)
        for cs in per_unit:
            contribs.extend(cs)
        for c in contribs:
            n = batch_of(c)  # (its terms not added together: the step sums them all)
            if batch is None:
                batch = n
            elif n != batch:
                self.clear()
                raise BatchDependenceError(
                    f"layers saw different batch sizes in one step ({batch} and {n}); "
                    "per-example clipping needs every layer to see the same examples")
        if self._recompute_unrecorded is not None:
            name, self._recompute_unrecorded = self._recompute_unrecorded, None
            self.clear()
            raise TrainingLoopError(
                f"layer {name!r} ran during backward() without having been recorded in "
                "the forward pass: reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True) runs the first forward "
                "without autograd, so its layers' gradients cannot be clipped per example. "
                "Use non-reentrant checkpointing: checkpoint(..., use_reentrant=False), or "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}) (the Hugging Face default)")
        if self.shared or any(len(cs) > 1 for cs in per_unit):
            contribs = contribs + _cross_terms(contribs)
        return contribs, batch, (1.0 if scale is None else scale)

    def clipped_sum(self, max_grad_norm: float, multiplier: float = 1.0, out=None,
                    per_param: dict | None = None, loss_scale: float | None = None,
                    examples: int | None = None, units: RowUnits | None = None,
                    refuse_nonfinite: bool = False, checks: bool = True):
        """``multiplier`` times the sum over examples of clipped per-example gradients.

        Returns ``(sums, batch, norms)``: ``sums[id(p)]`` for parameter ``p`` (missing:
        zero, its layers did not run); ``batch`` is the realised batch size and ``norms``
        the per-example gradient norms before clipping. The multiplier and the
        loss-reduction scale are folded into the per-example weights (no extra pass over
        the gradients). With ``out`` (a dict ``id(p) -> tensor`` holding an entry for every
        parameter), the sums are added into those tensors in place (the matmul of a
        Linear layer accumulates straight into it) and ``out`` is returned as ``sums``.
        The clip factor is ``min(1, C / ||g_i||)`` with the norm over all parameters (Abadi
        et al. 2016, "Deep Learning with Differential Privacy", Algorithm 1).

        Per-layer clipping (McMahan et al. 2018, "A General Approach to Adding Differential
        Privacy to Iterative Training Procedures", Sec. 3): with ``per_param`` (a dict
        ``id(p) -> w_p`` with ``sum_p w_p^2 = 1``) parameter ``p``'s per-example gradient
        is clipped to ``C_p = w_p * max_grad_norm`` on its own norm, so one example's
        clipped gradient has norm at most ``sqrt(sum_p C_p^2) = max_grad_norm``, the
        sensitivity the noise is calibrated to. ``norms`` stays the norm over all
        parameters.

        ``loss_scale`` (default :attr:`loss_scale`) is the factor the loss was multiplied
        by before ``backward()``; the recorded gradients are divided by it, so clipping
        acts on the unscaled per-example gradients.

        ``examples`` (the number of examples the sampler delivered for this batch): every
        recorded layer must have seen exactly that many (refused otherwise, see
        :meth:`contributions`). ``units``: clip per privacy unit of several rows
        (:mod:`privlearn.torch.units`); ``norms`` and the clip factors are then per unit.

        **Overflow** (fp16 loss scaling): an example whose per-example squared norm is not
        finite (an inf or NaN in its recorded gradients or inputs makes it so) contributes
        zero to the sum: its rows of the recorded tensors are zeroed (gradients) or
        cleaned of non-finite values (inputs) *before* any reduction over examples, so an
        ``inf * 0`` cannot reach the other examples' contributions, and its clip factor is
        0. Its contribution stays within the clip bound (the sensitivity is unchanged).
        Its entry of ``norms`` is ``inf``; :attr:`last_overflow_count` holds how many
        examples were dropped (0 when none). With ``refuse_nonfinite`` (the DP
        optimizer's steps), only a loss-scaled overflow is dropped: a non-finite input,
        or a non-finite gradient without loss scaling, raises
        :class:`~privlearn.errors.NonFiniteInputError` naming it.

        ``checks``: first run the checks the DP optimizer runs before its sums, so that
        the tracker used on its own refuses what ``make_private``'s steps refuse: a
        parameter that also got a gradient from a use outside its layers (a functional
        ``h @ emb.weight.T``: that part of its gradient is neither per example nor
        clipped, and the sum would leave it out), and, while the batch-independence
        probe is pending (a tracker built with ``check_independence=True``: its first
        clipped sum, and the first after a change that could mix examples), the probe on
        the recorded forward's inputs (a model mixing examples, ``x - x.mean(0)``). The
        DP optimizer runs them itself and passes ``checks=False``.

        Raises
        ------
        BatchDependenceError
            The probe found examples mixed, or the layers saw another number of rows than
            ``examples`` (the records are then cleared).
        TrainingLoopError
            A parameter was also used outside its layers (the records are cleared).
        """
        if checks:
            self.check_outside_uses()
            if getattr(self, "_probe_pending", False):
                self.check_independence(self._probe_rows(examples, units))
        self._units = units
        contribs, batch, scale = self.contributions(examples, units)
        ls = self.loss_scale if loss_scale is None else loss_scale
        if ls != 1.0:
            scale = scale / float(ls)
        sums = {} if out is None else out
        norms = None
        self.last_overflow_count = 0
        # every contribution drops an example by its weight alone (masks_rows): the
        # overflowing examples are masked on the device, nothing is read back
        masked = all(c.masks_rows for c in contribs)
        if contribs and per_param is not None:
            sq, total = _per_param_sq(contribs)
            bad = self._find_nonfinite(total, masked, refuse_nonfinite, scaled=ls != 1.0)
            if bad is not None and not masked:
                contribs = self._drop_examples(bad)
                sq, total = _per_param_sq(contribs)
            norms = self._per_param_clip(contribs, scale, max_grad_norm, multiplier,
                                         per_param, sums, out, sq, total, bad)
            if bad is not None and masked:
                self.last_overflow_count = bad.sum()
        elif contribs:
            sq = _flat_sq(contribs, getattr(self, "_settled", None))
            bad = self._find_nonfinite(sq, masked, refuse_nonfinite, scaled=ls != 1.0)
            if bad is not None and not masked:
                contribs = self._drop_examples(bad)
                sq = _flat_sq(contribs)
            # a squared norm from Gram matrices or cross terms (ghost norms, tied weights)
            # rounds below 0 when the gradient is (nearly) zero: its norm is 0, not NaN,
            # as on the per-layer path (a NaN factor would write NaN into the parameters)
            norms = sq.clamp_min(0).sqrt()
            if scale != 1.0:
                norms = norms * scale
            if max_grad_norm == float("inf"):
                factors = torch.ones_like(norms)
            else:
                factors = (max_grad_norm / norms.clamp_min(1e-30)).clamp_max(1.0)
            weight = scale * multiplier
            if weight != 1.0:
                factors = factors * weight
            if bad is not None:
                factors = factors.masked_fill(bad, 0.0)
                norms = norms.masked_fill(bad, float("inf"))
                if masked:
                    self.last_overflow_count = bad.sum()
            # a recorded tensor that several ghost layers read (one input of the query,
            # key and value projections) cleaned once when the rows are cleaned
            shared = shared_rows(() if bad is None or out is None else
                                 [x for c in contribs for x in _flat_reads(c)])
            with _gs.rows_finite(bad is None), shared:
                if out is not None:  # the small layers' products grouped
                    accumulate_all(contribs, factors, out)
                for c in contribs if out is None else ():
                    for p, w in zip(c.params, c.weighted_sum(factors), strict=True):
                        k = id(p)
                        sums[k] = w if k not in sums else sums[k] + w
        self.clear()
        return sums, (batch or 0), norms

    def _probe_rows(self, examples: int | None, units: RowUnits | None) -> int | None:
        """The rows of the recorded batch the probe checks: ``examples`` when given, else
        the rows of the privacy ``units``, else the rows the first recorded layer saw."""
        if examples is not None:
            return examples
        if units is not None:
            return units.rows
        for i, recs in self.records.items():
            for r in recs:
                if r.has_grad():
                    return record_batch(self.units[i], r)
        return None

    def _find_nonfinite(self, sq: torch.Tensor, masked: bool, refuse: bool, scaled: bool
                        ) -> torch.Tensor | None:
        """The examples whose squared norm ``sq`` is not finite (see :meth:`clipped_sum`).

        With ``refuse`` on the CPU, where reading one flag costs nothing, a non-finite
        example is refused by :meth:`_refuse_nonfinite` (only a loss-scaled overflow is
        left out). On an accelerator the examples are found and masked on the device, so
        that a steady step never waits for the device: a non-finite example there is left
        out (its contribution zero, the sensitivity unchanged) and counted in
        ``last_overflow_count``; the batch-independence probe names a non-finite input
        in the batches it checks."""
        if refuse and sq.device.type == "cpu":
            # squared norms are >= 0: their sum is finite exactly when each one is
            # (unless the sum alone overflows: then the full check below)
            if math.isfinite(sq.sum().item()):
                return None
            bad = ~torch.isfinite(sq)
            if not bool(bad.any()):
                return None
            self._refuse_nonfinite(bad, scaled=scaled)  # raises unless an overflow
            return bad
        return _nonfinite(sq, masked)

    def _refuse_nonfinite(self, bad: torch.Tensor, scaled: bool) -> None:
        """An example whose gradient is not finite: refused, naming it, when its input
        holds a NaN (bad data, not an overflow; without loss scaling an infinity too) or
        when no loss scaling is in use; only a loss-scaled overflow is dropped (see
        :meth:`clipped_sum`).

        Raises
        ------
        NonFiniteInputError
        """
        from privlearn.errors import NonFiniteInputError
        from privlearn.torch.probe import nonfinite_message, nonfinite_rows

        units = getattr(self, "_units", None)
        rows = bad[units.unit_of_row.to(bad.device)] if units is not None else bad
        rows = rows.nonzero().flatten().tolist()
        live = {name: ref() for name, ref in self._last_inputs}
        # under loss scaling an infinity may be meant (an additive mask's -inf): only a
        # NaN input is then the data's fault rather than an overflow
        found = nonfinite_rows((), {k: v for k, v in live.items() if v is not None},
                               nan_only=scaled)
        if found:
            self.clear()
            raise NonFiniteInputError(nonfinite_message(found))
        if not scaled:
            self.clear()
            raise NonFiniteInputError(
                f"the per-example gradient of row(s) {rows[:8]} of the batch is not finite "
                "(NaN or inf) although the model's inputs hold no NaN and no loss scaler "
                "is in use: the loss or a layer produced it from that example (a NaN or "
                "inf label or target, log(0), a division by zero; in float16 without a "
                "scaler, an overflow). A non-finite gradient cannot be clipped, and "
                "leaving the example out silently would train on less than the batch "
                "without saying so. Clean those examples or make the loss finite (for "
                "float16, pass make_private(..., grad_scaler=torch.amp.GradScaler()), whose "
                "overflows are left out with a warning, or train in bfloat16). No step was "
                "taken and nothing was released")

    def _drop_examples(self, bad: torch.Tensor) -> list[Contribution]:
        """Zero the recorded output gradients of the examples flagged in ``bad`` and
        replace non-finite values in their recorded inputs by 0 (out of place: the
        user's tensors are untouched), then evaluate the rules again. Every rule is
        linear in the output gradients, so those examples' contributions are exactly zero
        and no non-finite value is left to meet a zero weight inside a reduction over
        examples (``inf * 0 = nan`` in the clipped sum's matmuls or the Gram matrices).

        Raises
        ------
        RuntimeError
            An example's squared norm is still not finite after this (a layer that is not
            finite at finite inputs): its isolation from the others cannot be guaranteed.
        """
        units = getattr(self, "_units", None)
        self.last_overflow_count = int(bad.sum())
        if units is not None:  # the rows of the units that overflowed
            bad = bad[units.unit_of_row.to(bad.device)]
        idx = bad.nonzero().flatten()
        for i, recs in self.records.items():
            unit = self.units[i]
            for rec in recs:
                if not rec.has_grad():
                    continue
                _sanitize_record(unit, rec, idx, bad.numel())
        contribs, _, _ = self.contributions(units=units)
        sq = _flat_sq(contribs)
        if not bool(torch.isfinite(sq).all()):
            self.clear()
            raise TrainingLoopError(
                "per-example gradient norms are still not finite after the overflowing "
                "examples' gradients were zeroed: a layer produced non-finite values from "
                "finite inputs. Lower the loss scale (GradScaler(init_scale=...)) or train "
                "in bfloat16 or float32")
        return contribs

    @staticmethod
    def _per_param_clip(contribs, scale, max_grad_norm, multiplier, per_param, sums, out,
                        sq, total, bad=None):
        factors = {}
        weight = scale * multiplier
        for k, s in sq.items():
            n = s.clamp_min(0).sqrt() * scale
            bound = per_param[k] * max_grad_norm
            f = torch.ones_like(n) if bound == float("inf") else \
                (bound / n.clamp_min(1e-30)).clamp_max(1.0)
            f = f * weight if weight != 1.0 else f
            factors[k] = f.masked_fill(bad, 0.0) if bad is not None else f
        for c in contribs:
            for j, p in enumerate(c.params):
                w = c.weighted_sum(factors[id(p)])[j]
                k = id(p)
                if out is not None:
                    out[k].add_(w.reshape(out[k].shape).to(out[k].dtype))
                else:
                    sums[k] = w if k not in sums else sums[k] + w
        norms = total.clamp_min(0).sqrt()
        norms = norms * scale if scale != 1.0 else norms
        return norms.masked_fill(bad, float("inf")) if bad is not None else norms
