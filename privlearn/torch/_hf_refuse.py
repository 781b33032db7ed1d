"""What :class:`privlearn.torch.hf.DPTrainer` refuses before the first step, with the
reason and what to do instead (the list in :mod:`privlearn.torch.hf`'s documentation)."""

from __future__ import annotations

from torch.utils.data import IterableDataset

from privlearn.errors import ConfigurationError, ParameterValueError
from privlearn.torch._hf_fsdp import is_fsdp2, refuse_parallelism
from privlearn.torch._hf_optim import refuse_updates_in_backward
from privlearn.torch._hf_release import refuse_encoder_decoder

__all__ = ["refuse_unsupported"]


def refuse_unsupported(trainer, transformers, unwrap, model_tasks) -> None:
    """Refuse the settings of ``trainer`` (a DPTrainer: its TrainingArguments, model,
    collator, training set) that DP-SGD cannot train or account as configured; called
    when it is built and again when each run starts (a script or a hyperparameter
    search's trial may set TrainingArguments in between). ``transformers``: the module;
    ``unwrap``: the model inside compile and peft wrappers; ``model_tasks``: a model
    class's tasks in transformers' auto-model mappings."""
    a = trainer.args
    trainer._refuse_accumulation(is_fsdp2(trainer))
    if a.fp16 and getattr(trainer.accelerator, "scaler", None) is not None:
        raise ConfigurationError(
            "fp16=True with a loss scaler is not supported by DPTrainer: the Trainer's loss "
            "scaler runs through accelerate, which is not wired to the DP optimizer yet. Use "
            "bf16=True or float32, or fp16 with make_private and torch.amp.GradScaler "
            "(the PyTorch guide, section 'Mixed precision')")
    refuse_parallelism(trainer)
    if getattr(a, "ddp_static_graph", False) and a.world_size > 1 and not is_fsdp2(trainer):
        raise ConfigurationError(
            "ddp_static_graph=True is not supported by DPTrainer on several processes: the "
            "engine switches DistributedDataParallel's gradient synchronisation off and "
            "all-reduces the noisy clipped sums itself, but a static-graph DDP still runs "
            "its own all-reduce after the first backward, which fails inside DDP (no "
            "autograd weight gradient exists to reduce). Leave ddp_static_graph unset "
            "(False): DDP's graph options change nothing under DPTrainer")
    refuse_updates_in_backward(a, trainer.optimizer)
    if trainer.model is not None:  # (model_init: the Trainer has built one)
        inner = unwrap(trainer.model)
        refuse_encoder_decoder(inner, trainer.privacy.task, model_tasks(type(inner)))
    if getattr(a, "auto_find_batch_size", False):
        raise ConfigurationError(
            "auto_find_batch_size=True is not supported by DPTrainer: the Trainer halves "
            "the batch size after an out-of-memory error, but the expected Poisson batch "
            "(per_device_train_batch_size) sets the accounted sampling rate, and the DP "
            "loader keeps it. Set per_device_train_batch_size yourself (the physical "
            "chunk), with gradient_accumulation_steps for a larger logical batch")
    strategy = str(getattr(a, "train_sampling_strategy", "random"))
    if getattr(a, "group_by_length", False):  # the name before train_sampling_strategy
        strategy = "group_by_length"
    if strategy != "random":
        raise ConfigurationError(
            f"train_sampling_strategy={strategy!r} is not supported by DPTrainer: its "
            "batches are drawn by the DP sampler (PrivacyArguments.sampling, Poisson by "
            "default), which the accountant describes; batches grouped by length, "
            "rebalanced or in order are not a sampling it can account, and the setting "
            "would be silently replaced. Leave train_sampling_strategy='random' and choose "
            "the sampling with PrivacyArguments(sampling=...)")
    if a.label_smoothing_factor:
        raise ConfigurationError(
            "label_smoothing_factor must be 0 with DPTrainer, got "
            f"{a.label_smoothing_factor!r}: "
            "the Trainer's label smoother averages over every token of the batch, and "
            "DPTrainer's per-example loss has no smoothing. Set label_smoothing_factor=0")
    alpha = getattr(trainer, "neftune_noise_alpha", None)  # the Trainer's copy of the arg
    if alpha is not None or getattr(a, "neftune_noise_alpha", None) is not None:
        raise ConfigurationError(
            f"neftune_noise_alpha={alpha or a.neftune_noise_alpha!r} is not supported by "
            "DPTrainer: "
            "NEFTune scales every example's embedding noise by the batch's padded length, "
            "so the longest example of a batch moves the others' gradients, which "
            "per-example clipping does not bound. Leave neftune_noise_alpha=None")
    if trainer.compute_loss_func is not None:
        raise ConfigurationError(
            "compute_loss_func is not supported by DPTrainer: the loss must be a mean of "
            "per-example losses; pass PrivacyArguments(task=...) instead")
    if isinstance(trainer.train_dataset, IterableDataset) or (
            trainer.train_dataset is not None and not hasattr(trainer.train_dataset, "__len__")):
        raise ParameterValueError(
            "DPTrainer needs a map-style train_dataset (len and indexing) to sample "
            f"it; got {type(trainer.train_dataset).__name__}, "
            + ("an IterableDataset" if isinstance(trainer.train_dataset, IterableDataset)
               else "which has no len()") + ". Pass a torch Dataset or datasets.Dataset")
    flattening = getattr(transformers, "DataCollatorWithFlattening", None)
    if flattening is not None and isinstance(trainer.data_collator, flattening):
        raise ConfigurationError(
            "DataCollatorWithFlattening packs the whole batch into one row, which per-example "
            "clipping would clip as one example (the sensitivity would be the batch's, not "
            "one example's). Use a padding collator (DataCollatorWithPadding, "
            "DataCollatorForLanguageModeling, default_data_collator) with DPTrainer")

