"""Checks of the DP optimizer before a step releases anything: every parameter the
wrapped optimizer will update is one the engine clips and noises; a batch with examples
has per-example gradients to release (else the cause is named); each physical batch's
clipped per-example gradients are added to the open logical batch once, for the batch
they were recorded from; ``add_noise()`` releases a batch's added gradients, not noise
alone.

A mixin of :class:`~privlearn.torch.optimizer.DPOptimizer`: it reads the optimizer's
``tracker``, ``original_optimizer``, ``sampler``, the open buffers ``_out``/``_carry``,
the chunk announced by the loader (``_chunk_size``, ``_chunk_serial``) and keeps
``_grads_discarded``, ``_open_batch`` and ``_open_chunks``.
"""

from __future__ import annotations

from privlearn.errors import TrainingLoopError
from privlearn.torch import _buffer_writes
from privlearn.torch._rehook import refuse_new_unheld

__all__ = ["StepChecks"]


class StepChecks:
    """The DP optimizer's checks of what a step is about to update and add."""

    def _check_held(self) -> None:
        """When the trained parameters change (checked with the layout): the wrapped
        optimizer must hold some of them. A model whose parameters were all replaced after
        make_private (``fully_shard`` applied to it then, a layer swapped for a new one,
        ``load_state_dict(..., assign=True)``) leaves the optimizer over the old tensors:
        every step would be released and accounted while nothing updated the model. With
        some held, a parameter new since make_private (a layer replaced) must be held
        too (:func:`~privlearn.torch._rehook.refuse_new_unheld`)."""
        params = self.tracker.params
        held = {id(q) for g in self.original_optimizer.param_groups for q in g["params"]}
        if not params or any(id(q) in held for q in params):
            try:  # some held: a new parameter (a layer replaced) must be held too
                refuse_new_unheld(self.tracker, held)
            except TrainingLoopError:
                self._layout_version = None  # checked again at the next step
                raise
            return
        names = {id(v): n for n, v in self.tracker.model.named_parameters()}
        shown = [names.get(id(q), tuple(q.shape)) for q in params]
        self.tracker.clear()
        self._layout_version = None  # checked again at the next step
        raise TrainingLoopError(
            "optimizer.step() refused: the wrapped optimizer holds none of the model's "
            f"{len(params)} trainable parameters ({shown[:4]}{', ...' if len(shown) > 4 else ''}"
            "): they were replaced after make_private (fully_shard or "
            "DistributedDataParallel's module swapped, a layer replaced, load_state_dict "
            "with assign=True), so the step would be accounted while the optimizer updated "
            "the old tensors only. Apply fully_shard (and any change that replaces "
            "parameters) before building the optimizer and calling make_private. Nothing "
            "was released and no step was taken")

    def _check_update_set(self) -> None:
        """The one gate for updates: every parameter the wrapped optimizer will update
        this step (each one holding a gradient) must be one the engine clips and noises.
        A parameter outside the model, or one whose gradient autograd computed outside
        the engine, is refused before anything is released."""
        noised = self.tracker.param_ids
        names = None
        for i, group in enumerate(self.original_optimizer.param_groups):
            for q in group["params"]:
                g = q.grad  # zeros (a frozen one's, zeroed in place) release nothing
                if g is None or id(q) in noised or not q.requires_grad and not (
                        g.to_local() if hasattr(g, "to_local") else g).any():
                    continue
                if names is None:
                    names = {id(v): n for n, v in self.tracker.model.named_parameters()}
                name = names.get(id(q))
                what = (f"parameter {name!r} of the model" if name is not None else
                        f"a tensor of shape {tuple(q.shape)} in param group {i} that is not a "
                        "parameter of the model")
                hint = ("it was not trainable when the engine last saw the model; run a "
                        "forward pass of p.model after unfreezing it (the engine then "
                        "clips it) before step()" if name is not None and q.requires_grad
                        else "it is frozen but holds a gradient set before: clear it "
                        "(p.optimizer.zero_grad(), or .grad = None)" if name is not None else
                        "make it a parameter of a module the model's forward uses (the "
                        "engine then clips it per example), or freeze it "
                        "(requires_grad_(False)) or remove it from the optimizer")
                raise TrainingLoopError(
                    f"optimizer.step() refused: {what} holds a gradient the DP engine did not "
                    "clip and noise, and the wrapped optimizer would update it from its raw "
                    f"gradient; {hint}. Nothing was released and no step was taken")

    def _check_independence(self, examples: int | None) -> None:
        """The tracker's batch-independence probe, then the parameters the step's
        training forward wrote in place (:mod:`privlearn.torch._buffer_writes`). A
        refusal by either (or by the rows checked before the probe) puts the buffers the
        step wrote back and blanks a parameter it wrote (``undo_refused``)."""
        tracker = self.tracker
        start = getattr(tracker, "_probe_buffers", None)  # taken before the probe clears it
        try:
            tracker.check_independence(examples)
            _buffer_writes.check_parameters(tracker)
        except BaseException:
            _buffer_writes.undo_refused(tracker, start)
            raise

    def _require_recorded(self, examples: int | None) -> None:
        """A batch with examples whose step finds no per-example gradient would release
        noise alone and charge a step for it: refused, with the likely cause."""
        if getattr(self, "_detached", False):  # p.detach() removed the hooks
            raise TrainingLoopError(
                "p.optimizer.step() after p.detach(): detaching removed the engine's hooks "
                "and gave the model back, so p.optimizer records no per-example gradient and "
                "can take no more DP step (the model now trains without privacy, on the "
                "optimizer given to make_private). To go on training privately, call "
                "make_private again and q.compose_after(p.accountant.mechanism()) on the new "
                "run q before its first step, so that its epsilon counts this run's steps. "
                "Nothing was changed or charged")
        _buffer_writes.check(self.tracker)  # a buffer written in the backward pass
        discarded, self._grads_discarded = self._grads_discarded, False
        if examples is None or examples == 0 or self.tracker.has_gradients():
            return
        drawn = self.sampler.pending() if self.sampler is not None else None
        chunk = self._chunk_serial if self._chunk_size is not None else None
        if (drawn is not None and self._open_batch is drawn and chunk in self._open_chunks
                and (self._out is not None or self._carry)):
            raise TrainingLoopError(
                f"this step's batch has {examples} examples whose per-example gradients "
                "clip_and_accumulate() already added to the step: step() clips and "
                "accumulates by itself, so it finds none left. Release them with "
                "add_noise() (then update the parameters from p.grad yourself), or call "
                "step() alone after backward(). Nothing was changed or charged")
        if discarded:
            raise TrainingLoopError(
                f"this step's batch has {examples} examples but its per-example gradients "
                "are gone: optimizer.zero_grad() was called after loss.backward() and "
                "before optimizer.step(), and discarded the per-example gradients that "
                "backward() recorded. Call zero_grad() before the forward pass or after "
                "step() (zero_grad(); loss = ...; loss.backward(); step()). Nothing was "
                "changed or charged; the next batch of p.data_loader can be trained on as "
                "usual")
        if self.tracker.outside_uses and self.tracker.unrecorded_forward != "eval":
            # the parameters were reached only outside their layers (a model whose
            # parameters are all used functionally, e.g. from an nn.ParameterList): say so
            self.tracker.check_outside_uses()
        if self.tracker.unrecorded_forward == "eval":
            # an eval-mode forward ran the layers on the parameters themselves: autograd's
            # raw gradient of the batch is in their .grad; dropped, never released
            tracker = self.tracker
            for p in tracker.params:
                p.grad = None if id(p) in tracker.outside_uses else p.grad
            tracker.outside_uses = set()
            cause = ("the model was in eval mode (model.eval()) during the forward pass, "
                     "and the engine records per-example gradients only in training mode: "
                     "call p.model.train() after evaluating (to train without dropout, set "
                     "the dropout probabilities to 0)")
        else:
            cause = ("the forward pass ran under torch.no_grad() or inference_mode, on "
                     "another model than p.model, or backward() was not called on a loss "
                     "of p.model's output before step() (torch.autograd.grad(loss, "
                     "model.parameters()) and loss.backward(inputs=[...parameters]) "
                     "compute none: the layers run on detached aliases of the parameters; "
                     "call loss.backward() without inputs, and freeze what should not "
                     "train with requires_grad_(False))")
        raise TrainingLoopError(
            f"this step's batch has {examples} examples but no per-example gradient was "
            f"recorded: {cause}. The step would add noise alone and still be charged; "
            "nothing was changed or charged")

    def _check_accumulation(self, rows: bool) -> tuple:
        """Before this physical step adds rows (``rows``) to, or releases, the open
        logical batch: sums left open for an earlier batch that no step released (its
        step was refused after :meth:`clip_and_accumulate`) are dropped, never added to
        this one's; the rows of a batch (or physical chunk) already added are refused.
        Returns ``(batch, chunk)``: the delivered batch this step trains on and its
        physical chunk (None: the whole batch, no chunking)."""
        drawn = self.sampler.pending() if self.sampler is not None else None
        chunk = self._chunk_serial if self._chunk_size is not None else None
        open_ = self._out is not None or bool(self._carry)
        if not open_ or drawn is None:
            self._open_chunks = set()
            return drawn, chunk
        if self._open_batch is not drawn:
            self._begin_logical_batch(
                "the clipped sums clip_and_accumulate() added for an earlier batch, whose "
                "step was refused, were discarded (nothing of them was released): a step "
                "releases the batch it trains on alone")
            self._open_chunks = set()
        elif rows and chunk in self._open_chunks and self.tracker.has_gradients():
            part = "this physical chunk of the batch" if chunk is not None else "this batch"
            raise TrainingLoopError(
                f"the clipped per-example gradients of {part} were already added to the "
                "step by clip_and_accumulate(): adding those of another backward pass over "
                "the same examples would count each example twice (moving the update by "
                "up to twice max_grad_norm) in one accounted step. Call backward() once per "
                "batch, and clip_and_accumulate() at most once before add_noise(), or only "
                "step(), which clips and accumulates by itself. Nothing was changed")
        return drawn, chunk

    def _check_noise_only(self, drawn) -> None:
        """Before :meth:`add_noise` releases the open sums of ``drawn`` (the batch it
        takes): per-example gradients recorded and not added would stay behind for the
        next step (which, without a backward pass of its own, would release them as its
        batch's), and a batch with examples of which nothing was added would be charged
        for noise alone; both are refused (``drawn`` stays pending, replaced by the
        next batch the loader delivers)."""
        pending = self.tracker.has_gradients()
        empty = (drawn is not None and drawn.size > 0 and self._out is None
                 and not self._carry)
        if not (pending or empty):
            return
        if drawn is not None:
            self.sampler.refused(drawn)
        cause = ("backward() recorded per-example gradients that clip_and_accumulate() has "
                 "not added: released, the step would be noise alone and they would stay "
                 "behind for the next step" if pending else
                 f"the batch has {drawn.size} examples and nothing of it was added by "
                 "clip_and_accumulate(): the step would add noise alone and still be "
                 "charged")
        raise TrainingLoopError(
            f"add_noise() refused: {cause}. Call clip_and_accumulate() after backward() "
            "and before add_noise(), or step(), which does both. Nothing was released")
