"""The optimizers of :class:`privlearn.torch.hf.DPTrainer`: what accelerate, the
learning-rate scheduler and the training steps each get.

The DP optimizer is a ``torch.optim.Optimizer`` (:mod:`privlearn.torch._optimizer_api`),
and ``Accelerator.prepare`` wraps every ``torch.optim.Optimizer`` it is handed in an
``AcceleratedOptimizer`` (and, under FSDP2, points its parameter groups at the sharded
parameters). The Trainer's ``_prepare_for_training`` hands it ``self.optimizer`` and keeps
what comes back as the optimizer it steps. :class:`OptimizerHandoff` keeps the three
apart:

* ``Accelerator.prepare`` (and whatever else ``_prepare_for_training`` does with the
  optimizer: loading its state on resume) gets the torch optimizer the DP optimizer
  wraps, exactly what it gets in a Trainer without DP: the same parameters and state;
* the training steps (``trainer.optimizer``, the callbacks' ``optimizer``) go through the
  DP optimizer, restored after ``_prepare_for_training`` (``trainer.optimizer is
  trainer.privacy_engine.optimizer`` for the whole run: a later ``train()`` recognises its
  run by it);
* the learning-rate scheduler is built on the torch optimizer the DP optimizer wraps
  (never on accelerate's wrapper, whose ``step()`` does not run: the scheduler would warn
  that it stepped first); the DP step calls that optimizer's ``step()``, and both share
  the parameter groups whose ``lr`` the scheduler sets.
"""

from __future__ import annotations

import contextlib

from privlearn.errors import ConfigurationError

__all__ = ["OptimizerHandoff", "refuse_updates_in_backward", "torch_optimizer"]

#: ``TrainingArguments.optim`` values whose optimizer updates the parameters inside
#: ``backward()``, from the batch's un-noised gradient, before any DP step: LOMO and AdaLomo
#: (accelerate's ``lomo_backward`` runs their ``fused_backward``) and the layer-wise GaLore
#: and APOLLO optimizers (a ``post_accumulate_grad`` hook on every parameter steps a
#: per-parameter optimizer; the Trainer's optimizer is then a no-op stand-in).
_UPDATES_IN_BACKWARD = ("lomo", "adalomo")


class OptimizerHandoff:
    """The Trainer methods :class:`~privlearn.torch.hf.DPTrainer` overrides to keep the
    DP optimizer out of ``Accelerator.prepare`` (module docstring); a mixin placed before
    ``transformers.Trainer``."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if not hasattr(super(), "_prepare_for_training"):
            raise ConfigurationError(
                "DPTrainer needs Trainer._prepare_for_training (transformers 5.17 to 5.24 "
                "have it) to keep the DP optimizer out of accelerate's optimizer wrapper; "
                "use transformers>=5.17,<6")

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        with torch_optimizer(self) as dp:
            out = super()._prepare_for_training(max_steps, train_dataloader,
                                                resume_from_checkpoint)
            if dp is not None:
                self._accelerated_optimizer = self.optimizer  # as accelerate prepared it
        if dp is not None:
            self.callback_handler.optimizer = dp
        return out

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The learning-rate scheduler drives the torch optimizer the DP optimizer wraps."""
        p = getattr(self, "privacy_engine", None)
        if optimizer is None and p is not None:
            opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's, unwrapped
            if opt is p.optimizer or opt is p.optimizer.original_optimizer:
                optimizer = p.optimizer.original_optimizer
        return super().create_scheduler(num_training_steps, optimizer=optimizer)


@contextlib.contextmanager
def torch_optimizer(trainer, active: bool = True):
    """Make the torch optimizer the DP optimizer wraps the Trainer's for the duration
    (accelerate's wrapper of it once ``Accelerator.prepare`` made one), its ``step()``
    allowed (torch.distributed.checkpoint creates a missing state with a zero learning
    rate and zero gradients); yields the DP optimizer, restored after. Nothing changes
    (yields None) when the Trainer's optimizer is no DP optimizer, or not ``active``."""
    dp = trainer.optimizer
    if not active or not hasattr(dp, "original_optimizer"):
        yield None
        return
    prepared = getattr(trainer, "_accelerated_optimizer", None)  # this run's, if prepared
    trainer.optimizer = (prepared if getattr(prepared, "optimizer", None)
                         is dp.original_optimizer else dp.original_optimizer)
    dp._stepping_original = True  # the guard against stepping it directly: off meanwhile
    try:
        yield dp
    finally:
        dp._stepping_original = False
        trainer.optimizer = dp


def refuse_updates_in_backward(args, optimizer) -> None:
    """Refuse, before the Trainer builds the optimizer (and hooks it into the model), an
    optimizer that updates the parameters during ``backward()`` (:data:`_UPDATES_IN_BACKWARD`,
    ``optim="*_layerwise"``, or such an optimizer passed in ``optimizers=``): those updates
    use the un-noised, unclipped gradient of the private batch, which no accounting covers."""
    name = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "")))
    cls = type(optimizer) if optimizer is not None else None
    given = cls is not None and (cls.__name__ == "LayerWiseDummyOptimizer"
                                 or cls.__module__.split(".")[0] == "lomo_optim")
    if name not in _UPDATES_IN_BACKWARD and not name.endswith("_layerwise") and not given:
        return
    what = f"optimizers=({cls.__name__}, ...)" if given else f"optim={name!r}"
    raise ConfigurationError(
        f"{what} is not supported by DPTrainer: it updates the parameters inside backward() "
        "(LOMO and AdaLomo fuse the update into the backward pass; the layer-wise GaLore and "
        "APOLLO optimizers step each parameter from a gradient hook), from the batch's "
        "un-noised, unclipped gradient, before the DP optimizer clips and noises it: those "
        "updates would not be private. Use an optimizer that steps once per batch "
        "(optim='adamw_torch', 'sgd', 'adafactor', 'galore_adamw' without '_layerwise', ...)")
