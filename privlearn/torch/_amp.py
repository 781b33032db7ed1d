"""Mixed precision of the DP optimizer: fp16 dynamic loss scaling by a
``torch.amp.GradScaler`` driving :meth:`DPOptimizer.step <privlearn.torch.optimizer.
DPOptimizer.step>` (the scale the recorded gradients are divided by, the scaler told
whether the *noisy* gradient is finite) and the examples whose loss-scaled gradient
overflowed (left out of the clipped sum, counted and reported). See the module docstring
of :mod:`privlearn.torch.optimizer` for the mechanism.

A mixin of :class:`~privlearn.torch.optimizer.DPOptimizer`: it reads the optimizer's
``tracker``, ``grad_scaler`` and ``_device()`` and keeps the per-step state
``_dynamic_scale``, ``_overflowed``, ``_last_overflow`` and ``_warned_unscale``.
"""

from __future__ import annotations

import warnings

import torch

from privlearn.errors import GradientOverflowWarning, TrainingLoopError

__all__ = ["LossScaling"]


class LossScaling:
    """GradScaler-driven steps and overflow reporting of the DP optimizer."""

    #: ``torch.amp.GradScaler.step`` calls :meth:`step` directly and hands it the scale
    #: (``grad_scale``): the DP step unscales per-example gradients before clipping and
    #: decides on skipping from the noisy gradient (see the module docstring)
    _step_supports_amp_scaling = True

    def _loss_scale(self) -> float:
        """Factor the recorded gradients carry: the static ``tracker.loss_scale`` times
        the scale of a ``GradScaler`` driving this step."""
        return float(self.tracker.loss_scale) * self._dynamic_scale

    def _amp_scaler(self):
        """The ``GradScaler`` driving this step (``scaler.step(optimizer)`` set
        ``grad_scale`` and ``found_inf`` on this object), or None; sets the scale the
        recorded gradients are divided by. The scaler's own ``found_inf`` (from ``p.grad``
        before the step, which the DP step has not made yet) is ignored."""
        scaler = self.grad_scaler
        if "found_inf" not in vars(self):
            enabled = getattr(scaler, "is_enabled", None)
            if scaler is not None and (enabled is None or enabled()):
                raise TrainingLoopError(
                    "p.optimizer.step() was called directly, but make_private was given "
                    "grad_scaler=GradScaler: the per-example gradients of "
                    "scaler.scale(loss).backward() carry the scaler's scale, which only "
                    "scaler.step(p.optimizer) hands to the DP step to divide out before "
                    "clipping (stepped directly, every example would be clipped at "
                    "max_grad_norm / scale and the scale would never adapt). Call "
                    "scaler.step(p.optimizer) then scaler.update(), or set "
                    "p.optimizer.grad_scaler = None to train without loss scaling. Nothing "
                    "was changed or charged")
            return None
        if scaler is None:
            raise TrainingLoopError(
                "optimizer.step() is driven by a torch.amp.GradScaler that the DP optimizer "
                "was not given: it must tell the scaler whether the noisy gradient is finite "
                "(its own check reads p.grad before the DP step makes it). Pass "
                "make_private(..., grad_scaler=scaler), or set p.optimizer.grad_scaler = "
                "scaler before the first scaler.step(p.optimizer)")
        grad_scale = vars(self).get("grad_scale")
        if grad_scale is None:  # the user called scaler.unscale_(optimizer) before step
            if not self._warned_unscale:
                self._warned_unscale = True
                warnings.warn(
                    "scaler.unscale_(optimizer) before scaler.step(optimizer) has nothing to "
                    "unscale: the DP optimizer forms p.grad in its step, from per-example "
                    "gradients that it divides by the scaler's scale and clips to "
                    "max_grad_norm itself. Gradient clipping or inspection between "
                    "backward() and step() acts on no gradient; drop the unscale_ call and "
                    "set the bound with max_grad_norm (the step unscales as usual)",
                    UserWarning, stacklevel=4)
            grad_scale = scaler.get_scale()
        self._dynamic_scale = float(grad_scale)  # one host synchronisation a step
        return scaler

    def _noisy_grad_nonfinite(self, scaler) -> torch.Tensor:
        """1.0 where the noisy gradient (in ``p.grad``) has a non-finite entry, else 0.0:
        a function of the released gradient only, on the parameters' device."""
        dev = self._device()
        flags = [(~torch.isfinite(p.grad)).any().to(dev) for p in self.tracker.params
                 if p.grad is not None]
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=dev)
        return torch.stack(flags).any().to(torch.float32)

    def _report_found_inf(self, scaler, found_inf) -> None:
        """Make ``found_inf`` (None: finite) what ``scaler.update()`` sees for this
        optimizer (replacing the check GradScaler made on ``p.grad`` before the step).

        GradScaler has no public way to be told this: its per-optimizer state is written
        (present in every supported PyTorch, tested); a PyTorch that keeps it differently
        is refused with a clear error rather than left unable to back off."""
        dev = self._device()
        if found_inf is None:
            found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        states = getattr(scaler, "_per_optimizer_states", None)
        state = states.get(id(self)) if isinstance(states, dict) else None
        if not isinstance(state, dict) or "found_inf_per_device" not in state:
            raise TrainingLoopError(
                "this PyTorch's GradScaler does not keep its per-optimizer inf checks where "
                "privlearn reports the noisy gradient's; train in bfloat16 or with a static "
                "loss scale (p.optimizer.tracker.loss_scale) instead of a GradScaler")
        state["found_inf_per_device"] = {dev: found_inf}

    @property
    def last_overflow_count(self) -> int:
        n = self._last_overflow
        return int(n) if isinstance(n, torch.Tensor) else n

    def _warn_overflow(self, read: bool = True) -> None:
        """Tell the person running the loop how many examples overflowed in this step
        (``read``: the step already waits for the device, a GradScaler's; otherwise the
        count stays on the device, see :attr:`last_overflow_count`)."""
        n, self._overflowed = self._overflowed, 0
        self._last_overflow = n
        if isinstance(n, torch.Tensor):
            if not read:
                return
            n = self._last_overflow = int(n)
        if n:
            warnings.warn(
                f"{n} example(s) of this batch had a non-finite (overflowing) loss-scaled "
                "gradient and were left out of the clipped sum (they contribute zero; the "
                "step is taken and the loss scale is not lowered, so that no decision "
                "depends on one example). Lower GradScaler(init_scale=...) or its "
                "growth_factor, use a static loss scale (tracker.loss_scale), or train in "
                "bfloat16 to avoid it", GradientOverflowWarning, stacklevel=3)
