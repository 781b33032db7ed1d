"""FSDP2: the ranks meet at the first training forward of each step.

Under FSDP2 every forward and backward pass of the model is a collective of all the
ranks (each layer's parameters are all-gathered). A rank whose Poisson batch is empty,
in a loop that skips the forward and backward of an empty batch (``if len(x): ...``),
calls ``optimizer.step()`` alone: its step's first collective (the ranks' status
exchange, :mod:`privlearn.torch._agree`) meets the other ranks' all-gathers, and the
run waits for ever (gloo) or pairs mismatched collectives.

So before the first training forward of each step (the first since the last status
exchange), every rank joins the status exchange in the phase "a training forward of the
model" (:data:`privlearn.torch._agree.PHASES`), ahead of FSDP2's own pre-forward hooks
(the hook is prepended). A rank at its step meanwhile joins it in the step's phase: the
phases differ, and every rank raises the same :class:`~privlearn.errors.TrainingLoopError`
(the forwarding ranks from the model's call, the others from ``step()``), before any
all-gather, with nothing released or accounted; on every rank the batch stays pending
until the loader delivers the next, as after a refused step, so a loop that catches the
error goes on with the ranks together. A step whose ranks all ran a forward
(an empty batch too: its clipped sum is zero and its step adds the noise alone), or none
(every rank's batch empty), goes on as before; one small all-reduce of the status, on
the CPU, is added per step. The later forwards of a step (a second view, gradient
accumulation) are not met: a rank that runs fewer of them than the others is not seen
here. The forwards of the batch-independence probe (which the step runs on every rank)
and those without gradients, in eval mode or in backward are not training forwards.
"""

from __future__ import annotations

import torch

from privlearn.torch._tracker_util import _eager, _in_backward

__all__ = ["FORWARD", "watch"]

#: the phase of the status exchange joined at a step's first training forward
FORWARD = 2


def watch(model, optimizer) -> torch.utils.hooks.RemovableHandle | None:
    """Make every rank meet at the first training forward of ``model`` in each step of
    ``optimizer`` (module docstring): a forward pre-hook placed before FSDP2's. Returns
    its handle (``remove()`` it with the engine), or None in one process."""
    agreement = optimizer._agreement
    if agreement is None:
        return None
    tracker = optimizer.tracker
    met = [-1]  # the exchange count after the last meeting

    def pre(module, args, kwargs):
        from privlearn.torch.grad_sample import _IN_RULE

        if (
            _IN_RULE.get()
            or getattr(tracker, "_probing", False)
            or not module.training
            or _in_backward()
            or not torch.is_grad_enabled()
            or agreement.exchanges == met[0]
        ):
            return None
        try:
            agreement.agree(None, 0, -1, what="the model's forward", phase=FORWARD)
        except Exception:
            # as a refused step: the batch stays pending until the loader delivers the next
            # (then the ranks go on together from it), nothing of this forward recorded
            drawn = optimizer.sampler.pending() if optimizer.sampler is not None else None
            if drawn is not None:
                optimizer.sampler.refused(drawn)
            tracker.clear()
            raise
        met[0] = agreement.exchanges
        return None

    return model.register_forward_pre_hook(_eager(pre), prepend=True, with_kwargs=True)
