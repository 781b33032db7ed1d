"""Gradient accumulation in :class:`privlearn.torch.hf.DPTrainer`:
``TrainingArguments(gradient_accumulation_steps=k)`` as DP-SGD's logical batch, trained
in physical chunks (no transformers import here).

Hugging Face users reach a large batch with gradient accumulation: the effective batch
is ``per_device_train_batch_size * gradient_accumulation_steps * world_size``. DP-SGD
(Abadi et al. 2016, Algorithm 1) samples, clips, noises and accounts one batch per
step, so in a DPTrainer that effective batch is the *logical* batch:

* the DP sampler draws one logical batch per step, of expected size ``B k`` on each of
  the ``W`` processes (Poisson sampling at ``q = B k W / N``, or the configured
  sampling), and the accountant records one step per logical batch at that rate; a
  run's planned steps (``max_steps``, or ``num_train_epochs`` passes over the private
  loader: :func:`~privlearn.torch.privacy_engine.epoch_steps` with the logical batch)
  are logical steps;
* the logical batch is trained in physical chunks of at most ``B`` rows (whole privacy
  units in each: :meth:`~privlearn.torch.data.VirtualBatchLoader.split`), so the peak
  memory of a step is that of a chunk; the DP optimizer adds each chunk's clipped
  per-example sum, then adds the noise once, updates the parameters and accounts the
  step after the last chunk, exactly as ``make_private(..., max_physical_batch_size=B)``
  does: the update equals one step on the whole logical batch.

The Trainer's own accumulation cannot do this: it steps after counting ``k`` batches of
its loader, each drawn alone, while the number of chunks of a Poisson batch varies from
step to step. So the Trainer is given one item per logical batch: its own copy of the
TrainingArguments says ``gradient_accumulation_steps=1`` while it trains (the given value
is back after ``train()``, and is what checkpoints' ``training_args.bin``,
:meth:`LogicalBatches.get_total_train_batch_size` and the callbacks see: logging
integrations record ``args.to_dict()`` or ``args.to_json_string()`` in
``on_train_begin``), and ``training_step`` runs
the forward and backward passes of the chunks itself, calling the DP optimizer's
``step()`` (which only accumulates) after every chunk but the last; the Trainer's
optimizer step after the last adds the noise. The learning-rate scheduler, the global
step, logging, evaluation and checkpoints therefore count logical steps, and the loss
``training_step`` returns is the mean over the logical batch's examples (each chunk's
mean weighted by its rows).

Refused: ``gradient_accumulation_steps > 1`` with FSDP2 (each process would run its own
number of forward and backward passes per step, and FSDP2's collectives need the same
number on every process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from privlearn._validation import check_count
from privlearn.errors import ConfigurationError
from privlearn.torch._hf_collate import batch_rows
from privlearn.torch.data import VirtualBatchLoader

__all__ = ["LogicalBatches", "logical_loader"]


def logical_loader(loader):
    """The loader of logical batches inside ``loader`` (the private loader of a run, a
    :class:`~privlearn.torch.data.VirtualBatchLoader` when it is chunked)."""
    return loader.loader if isinstance(loader, VirtualBatchLoader) else loader


class LogicalBatches:
    """The Trainer methods :class:`~privlearn.torch.hf.DPTrainer` overrides for
    ``gradient_accumulation_steps`` (module docstring); a mixin placed before
    ``transformers.Trainer``."""

    #: the given gradient_accumulation_steps, while the trainer's arguments say 1 (None:
    #: they hold the given value)
    _accumulation: int | None = None

    @property
    def gradient_accumulation_steps(self) -> int:
        """``TrainingArguments.gradient_accumulation_steps`` as given: the logical batch of
        a process is ``per_device_train_batch_size`` times this (expected size), trained
        in chunks of at most ``per_device_train_batch_size`` rows."""
        if self._accumulation is not None:
            return self._accumulation
        return check_count(
            "gradient_accumulation_steps", self.args.gradient_accumulation_steps, minimum=1,
            hint="the chunks of per_device_train_batch_size rows of one logical batch, e.g. 4")

    def logical_batch_size(self) -> int:
        """The expected logical batch of one process, ``per_device_train_batch_size *
        gradient_accumulation_steps`` (times the processes: the sampled, accounted batch)."""
        return self.args.per_device_train_batch_size * self.gradient_accumulation_steps

    def get_total_train_batch_size(self, args) -> int:
        """The Trainer's effective batch, ``B * gradient_accumulation_steps * W``: the
        expected logical batch of all processes."""
        total = super().get_total_train_batch_size(args)
        return total // args.gradient_accumulation_steps * self.gradient_accumulation_steps

    def _take_accumulation(self) -> int:
        """Keep the given ``gradient_accumulation_steps`` and set the trainer's own copy
        of the arguments to 1 (the Trainer then steps once per item of the private loader:
        one logical batch) until :meth:`_give_back_accumulation`."""
        k = self.gradient_accumulation_steps
        self._accumulation = k
        self.args.gradient_accumulation_steps = 1
        return k

    def _give_back_accumulation(self) -> None:
        """The trainer's arguments say the given ``gradient_accumulation_steps`` again."""
        if self._accumulation is not None:
            self.args.gradient_accumulation_steps = self._accumulation
            self._accumulation = None

    @contextlib.contextmanager
    def _as_given(self):
        """The trainer's arguments with the given ``gradient_accumulation_steps`` (what a
        checkpoint's ``training_args.bin`` records)."""
        k, self._accumulation = self._accumulation, None
        before = self.args.gradient_accumulation_steps
        if k is not None:
            self.args.gradient_accumulation_steps = k
        try:
            yield
        finally:
            self.args.gradient_accumulation_steps = before
            self._accumulation = k

    def _callbacks_see_given(self) -> None:
        """Call the callbacks with the arguments as given: for the time of each event the
        trainer's arguments say the given ``gradient_accumulation_steps`` (what TensorBoard,
        W&B, MLflow, Comet... record of them), and 1 again for the training loop."""
        call = self.callback_handler.call_event

        def call_event(event, args, state, control, **kwargs):
            if args is not self.args:
                return call(event, args, state, control, **kwargs)
            with self._as_given():
                return call(event, args, state, control, **kwargs)

        self.callback_handler.call_event = call_event

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        with self._as_given():
            return super().save_model(output_dir, _internal_call)

    def _refuse_accumulation(self, fsdp2: bool) -> None:
        """Refuse, before anything runs, what gradient accumulation cannot do exactly."""
        k = self.gradient_accumulation_steps
        if k > 1 and fsdp2:
            raise ConfigurationError(
                f"gradient_accumulation_steps={k} is not supported by DPTrainer under FSDP2: "
                "each process trains its logical batch (of a random size) in its own number "
                "of physical chunks, and FSDP2 runs collectives in every forward and backward "
                "pass, which need the same number of passes on every process. Use "
                "gradient_accumulation_steps=1 with a per_device_train_batch_size of "
                f"{self.args.per_device_train_batch_size * k} (the same logical batch), more "
                "processes, or DistributedDataParallel (no fsdp), which supports it")

    def _chunked_step(self, model, inputs, num_items_in_batch, train_rows):
        """``training_step`` on a logical batch: ``train_rows(model, chunk, n)`` (forward
        and backward) on each physical chunk, the DP optimizer's ``step()`` after every
        chunk but the last (it adds the chunk's clipped sum; the Trainer's step after the
        last adds the noise and updates); the mean loss over the batch's examples."""
        virtual = self.privacy_engine.data_loader
        dp = self.privacy_engine.optimizer
        if isinstance(inputs, Mapping):  # a BatchEncoding too: its tensors are split
            inputs = dict(inputs)
        total, rows = None, 0
        for chunk, final in virtual.split(inputs):
            n = batch_rows(chunk) or 0
            loss = train_rows(model, chunk, num_items_in_batch)
            if n:
                part = loss.detach().float() * n
                total = part if total is None else total + part
                rows += n
            if not final:
                dp.step()  # accumulates the chunk's clipped sum: no noise, no update
                dp.zero_grad()
        if total is None:
            return torch.zeros((), device=self.args.device)
        return total / rows

