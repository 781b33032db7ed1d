"""FSDP2: the ranks meet at the first training forward, and backward, of each step.

Under FSDP2 every forward and backward pass of the model is a collective of all the
ranks (each layer's parameters are all-gathered). A rank whose Poisson batch is empty,
in a loop that skips the forward and backward of an empty batch (``if len(x): ...``),
calls ``optimizer.step()`` alone: its step's first collective (the ranks' status
exchange, :mod:`privlearn.torch._agree`) meets the other ranks' all-gathers, and the
run waits for ever (gloo) or pairs mismatched collectives.

So before the first training forward of each step (the first since the last status
exchange of a step), every rank joins the status exchange in the phase "a training
forward of the model" (:data:`privlearn.torch._agree.PHASES`), ahead of FSDP2's own
pre-forward hooks (the hook is prepended); and at the first backward through that
forward's outputs, in the phase "a training backward of the model", ahead of FSDP2's
pre-backward hooks (the outputs are replaced by views whose first gradient hook meets: a
loop
may run the forward of an empty batch and skip its backward, ``if len(x):
loss.backward()``). A rank at its step meanwhile joins it in the step's phase: the
phases differ, and every rank raises the same :class:`~privlearn.errors.TrainingLoopError`
(the forwarding ranks from the model's call or ``backward()``, the others from
``step()``), before any all-gather, with nothing released or accounted; on every rank
the batch stays pending until the loader delivers the next, as after a refused step, so
a loop that catches the error goes on with the ranks together. A step whose ranks all
ran a forward and backward (an empty batch too: its clipped sum is zero and its step
adds the noise alone), or none (every rank's batch empty), goes on as before; two small
all-reduces of the status, on the CPU, are added per step. The later forwards and
backwards of a step (a second view, gradient accumulation) are not met: a rank that
runs fewer of them than the others is not seen here. The forwards of the
batch-independence probe (which the step runs on every rank) and those without
gradients, in eval mode or in backward are not training forwards.
"""

from __future__ import annotations

import torch

from privlearn.torch._tracker_util import _eager, _in_backward

__all__ = ["FORWARD", "BACKWARD", "watch"]

#: the phases of the status exchange joined at a step's first training forward, backward
FORWARD, BACKWARD = 2, 3


class _Meetings:
    """The hooks of :func:`watch` and their state: the count of the status exchanges
    that were not meetings (a step's; a meeting that failed, as the other ranks' step
    that failed it) when this rank last met at a forward, and at a backward."""

    def __init__(self, model, optimizer):
        self.agreement, self.optimizer = optimizer._agreement, optimizer
        self.tracker = optimizer.tracker
        self.meetings = 0
        self.met = {FORWARD: -1, BACKWARD: -1}
        self.handles = [
            model.register_forward_pre_hook(_eager(self._pre), prepend=True, with_kwargs=True),
            model.register_forward_hook(_eager(self._post), prepend=True),
        ]

    def _others(self) -> int:
        """The status exchanges joined so far that were not meetings (a step's)."""
        return self.agreement.exchanges - self.meetings

    def _training(self, module) -> bool:
        from privlearn.torch.grad_sample import _IN_RULE

        return not (
            _IN_RULE.get()
            or getattr(self.tracker, "_probing", False)
            or not module.training
            or _in_backward()
            or not torch.is_grad_enabled()
        )

    def _meet(self, phase: int) -> None:
        """Join the ranks' status exchange in ``phase``, once per step and phase."""
        seen = self._others()
        if self.met[phase] == seen:
            return
        what = "the model's forward" if phase == FORWARD else "the model's backward"
        try:
            self.agreement.agree(None, 0, -1, what=what, phase=phase)
        except Exception:
            # as a refused step: the batch stays pending until the loader delivers the next
            # (then the ranks go on together from it), nothing of this batch recorded
            sampler = self.optimizer.sampler
            drawn = sampler.pending() if sampler is not None else None
            if drawn is not None:
                sampler.refused(drawn)
            self.tracker.clear()
            raise  # counted as a step's exchange, as on the ranks whose step() raised it
        self.meetings += 1
        self.met[phase] = seen

    def _pre(self, module, args, kwargs):
        if self._training(module):
            self._meet(FORWARD)
        return None

    def _post(self, module, args, output):
        """The training forward's outputs (those in its tuple, list, NamedTuple or dict too)
        replaced by new views of them whose first gradient hook meets: before any hook of
        FSDP2 runs in the backward (this hook runs before FSDP2's post-forward hook, which
        places its own on the views; those of FSDP2's inner modules sit on the tensors
        viewed, reached later), so a meeting that fails leaves FSDP2 as after a forward
        without backward."""
        if not self._training(module) or self.met[BACKWARD] == self._others():
            return None
        return self._wrap_all(output, 0)

    def _wrap_all(self, output, depth: int):
        """``output`` with its tensors wrapped (:meth:`_wrap`): a tensor; a dict's items
        set in place (a ModelOutput too); a tuple's, a list's or a NamedTuple's in a new
        one of its type, also nested (a few levels); else unchanged."""
        if isinstance(output, torch.Tensor):
            return self._wrap(output)
        if depth > 4:
            return output
        if isinstance(output, dict):
            for k, v in list(output.items()):
                new = self._wrap_all(v, depth + 1)
                if new is not v:
                    output[k] = new
            return output
        if type(output) in (tuple, list):
            return type(output)(self._wrap_all(v, depth + 1) for v in output)
        if isinstance(output, tuple) and hasattr(type(output), "_fields"):  # a NamedTuple
            return type(output)(*(self._wrap_all(v, depth + 1) for v in output))
        return output

    def _wrap(self, v):
        """A new view of ``v`` whose gradient hook, the first placed on it, meets."""
        if not (isinstance(v, torch.Tensor) and v.requires_grad):
            return v
        out = v.view_as(v)
        out.register_hook(self._on_grad)
        return out

    def _on_grad(self, grad):
        if not getattr(self.tracker, "_probing", False):
            self._meet(BACKWARD)
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def watch(model, optimizer) -> _Meetings | None:
    """Make every rank meet at the first training forward and backward of ``model`` in
    each step of ``optimizer`` (module docstring): hooks placed before FSDP2's. Returns
    them (``remove()`` them with the engine), or None in one process."""
    if optimizer._agreement is None:
        return None
    return _Meetings(model, optimizer)
