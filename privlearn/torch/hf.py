"""Hugging Face ``transformers.Trainer`` with DP-SGD: :class:`DPTrainer`.

The Trainer's loop, logging, evaluation and checkpointing stay; what DP-SGD needs is
swapped in underneath through :func:`privlearn.torch.make_private`:

* **sampling**: the Trainer's shuffled training loader is replaced by the loader
  ``make_private`` returns (Poisson sampling at rate ``per_device_train_batch_size / N``
  by default), so the accountant describes the batches actually trained on;
* **clipping and noise**: the Trainer's optimizer is wrapped by the DP optimizer
  (per-example clipping at :attr:`PrivacyArguments.max_grad_norm`, Gaussian noise,
  division by the expected batch size); ``TrainingArguments.max_grad_norm`` (the Trainer's
  clipping of the *averaged* gradient) is not used: per-example clipping replaces it;
* **loss**: computed per example (:func:`privlearn.torch.per_sequence_cross_entropy` for
  language modelling, the mean over examples for sequence classification), never the
  token-level mean Hugging Face models return with ``labels=``;
* **accounting**: ``epsilon`` is added to every log entry (at ``target_delta``); training
  stops, before the step that would exceed it, at ``max_epsilon`` (by default the
  ``target_epsilon`` the noise was calibrated for);
* **checkpoints**: every checkpoint folder gets ``privlearn_privacy.pt`` (the accountant's
  history, live noise multiplier and clipping bound, random states of the sampler and the
  noise); ``trainer.train(resume_from_checkpoint=...)`` restores it, so a resumed run
  reports the same epsilon as an uninterrupted one. A checkpoint without it is refused.

Refused, with the reason, before the first step: gradient accumulation
(``gradient_accumulation_steps > 1``: the Trainer would clip each micro-batch's examples
together), ``fp16`` *with a loss scaler* (on CUDA the Trainer's scaler runs through
accelerate, not yet wired to the DP optimizer: use ``bf16``, or ``make_private`` with
``torch.amp.GradScaler``; on CPU accelerate runs fp16 autocast without a scaler, which
trains as bf16 does: per-example norms and sums in float32),
several processes or GPUs (not wired yet), an iterable training set (it cannot be
Poisson-sampled), ``label_smoothing_factor`` and ``compute_loss_func`` (the loss must be
per example).

``transformers`` is imported here only; nothing else in privlearn imports it. Install the
extra: ``pip install privlearn[hf]``.

Example
-------
>>> from transformers import TrainingArguments                     # doctest: +SKIP
>>> from privlearn.torch.hf import DPTrainer, PrivacyArguments
>>> trainer = DPTrainer(model=model, args=TrainingArguments("out", max_steps=100,
...                     per_device_train_batch_size=64, learning_rate=1e-3),
...                     train_dataset=train, data_collator=collator,
...                     privacy=PrivacyArguments(target_epsilon=3.0, target_delta=1e-5,
...                                              max_grad_norm=1.0))
>>> trainer.train(); trainer.epsilon()

GPT-2 and BERT build position ids of shape ``(1, T)`` broadcast over the batch; the
engine expands such inputs to one row per example itself, so no collator change is needed
(:func:`expand_position_ids` is kept for collators that want explicit ids, e.g. with left
padding).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, fields

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

try:
    import transformers
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("privlearn.torch.hf needs transformers: pip install "
                      "'privlearn[hf]' (transformers>=4.40, peft>=0.10)") from exc

from privlearn.errors import PrivacyBudgetExceededError, PrivacyLeakWarning
from privlearn.torch.accountant import PrivacyBudgetWarning
from privlearn.torch.losses import per_sequence_cross_entropy
from privlearn.torch.optimizer import DPOptimizer
from privlearn.torch.privacy_engine import PrivateTraining, make_private

__all__ = ["DPTrainer", "PrivacyArguments", "expand_position_ids", "PRIVACY_STATE_NAME"]

PRIVACY_STATE_NAME = "privlearn_privacy.pt"
_TASKS = ("causal_lm", "masked_lm", "token_classification", "sequence_classification")


@dataclass(frozen=True)
class PrivacyArguments:
    """The DP-SGD settings of a :class:`DPTrainer` (passed to
    :func:`privlearn.torch.make_private`; see its documentation).

    Attributes
    ----------
    noise_multiplier : float, optional
        sigma; exactly one of it and ``target_epsilon``.
    target_epsilon : float, optional
        Calibrate sigma for the Trainer's planned steps (``max_steps``, or
        ``num_train_epochs`` times the steps of an epoch) at ``target_delta``.
    target_delta : float
        delta of the reported (and targeted) epsilon.
    max_grad_norm : float
        Per-example clipping bound (the initial one with adaptive clipping).
    max_epsilon : float, optional
        Stop training before the step that would take epsilon past this (default:
        ``target_epsilon``, if given).
    sampling : {"poisson", "fixed"}
    accountant : str
    secure_mode : bool
    seed : int, optional
        Seed of the sampler and the noise (reproducible runs and resumes).
    clipping, target_unclipped_quantile, clipbound_learning_rate, unclipped_num_std
        Adaptive clipping (Andrew et al. 2021), as in ``make_private``.
    log_training_loss : bool
        The Trainer's ``loss`` / ``train_loss`` logs are means over private training
        batches without noise, and they are saved in every checkpoint's
        ``trainer_state.json``: by default they are dropped from the logs (epsilon and the
        clip bound are logged instead). ``True`` keeps them and emits a
        :class:`~privlearn.errors.PrivacyLeakWarning`: they are then not covered by the
        accounted mechanism.
    task : str, optional
        How the per-example loss is computed: ``"causal_lm"`` (shifted per-sequence
        token cross-entropy), ``"masked_lm"`` / ``"token_classification"`` (unshifted),
        ``"sequence_classification"`` (labels of shape ``(B,)``). Default: inferred from
        the labels' shape and the model class (``*ForCausalLM`` -> causal).
    """

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float = 1e-5
    max_grad_norm: float = 1.0
    max_epsilon: float | None = None
    sampling: str = "poisson"
    accountant: str = "pld"
    secure_mode: bool = False
    seed: int | None = None
    clipping: str = "flat"
    target_unclipped_quantile: float | None = None
    clipbound_learning_rate: float = 0.2
    unclipped_num_std: float | None = None
    task: str | None = None
    log_training_loss: bool = False

    def __post_init__(self):
        if self.task is not None and self.task not in _TASKS:
            raise ValueError(f"task must be one of {_TASKS} or None, got {self.task!r}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                "give exactly one of noise_multiplier and target_epsilon, got noise_multiplier"
                f"={self.noise_multiplier!r} and target_epsilon={self.target_epsilon!r}: "
                "target_epsilon calibrates the noise for the planned steps, noise_multiplier "
                "fixes it (then max_epsilon caps the steps)")
        if self.clipping != "adaptive":
            extra = [f"{k}={getattr(self, k)!r}" for k, default in (
                ("target_unclipped_quantile", None), ("unclipped_num_std", None),
                ("clipbound_learning_rate", 0.2)) if getattr(self, k) != default]
            if extra:
                raise ValueError(f"{', '.join(extra)} only apply to clipping='adaptive', got "
                                 f"clipping={self.clipping!r}: set clipping='adaptive' or "
                                 "drop them")


_UNNOISED_LOGS = ("loss", "train_loss", "grad_norm")


def expand_position_ids(collator):
    """Wrap a data collator so that its batches carry ``position_ids`` of shape
    ``(B, T)`` (``0..T-1`` per row; with an ``attention_mask``, counted over its ones, as
    for left padding). Not needed for the engine: it expands the broadcast ``(1, T)`` ids
    GPT-2 and BERT build themselves; useful where explicit per-row positions are wanted
    (left padding)."""

    def collate(features):
        batch = collator(features)
        ids = batch.get("input_ids")
        if ids is not None and "position_ids" not in batch:
            mask = batch.get("attention_mask")
            if mask is not None:
                pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
            else:
                pos = torch.arange(ids.shape[-1]).expand(ids.shape[0], -1)
            batch["position_ids"] = pos.contiguous()
        return batch

    return collate


class _PrivacyCallback(TrainerCallback):
    """Stops training before the step that would exceed ``max_epsilon``."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    @staticmethod
    def _next_step_exceeds(p) -> bool:
        """Whether the accountant's ``max_epsilon`` leaves no room for one more step."""
        if p is None or p.accountant.max_epsilon is None:
            return False
        try:
            p.accountant.check_step()
        except PrivacyBudgetExceededError:
            return True
        return False

    def on_train_begin(self, args, state, control, **kwargs):
        p = self.trainer.privacy_engine
        if p is not None and p.accountant.steps == 0 and self._next_step_exceeds(p):
            raise PrivacyBudgetExceededError(
                f"max_epsilon={p.accountant.max_epsilon:g} at delta={p.accountant.delta:g} "
                f"does not cover even one step (noise_multiplier={p.noise_multiplier:.4g}, "
                f"sampling rate {p.sampling_rate:.4g}); no step was taken. Raise "
                "max_epsilon, or the noise (noise_multiplier, or target_epsilon with the "
                "planned steps)")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        p = self.trainer.privacy_engine
        if not self._next_step_exceeds(p):
            return control
        self.trainer._stopped_at_budget = True
        control.should_training_stop = True
        if state.global_step < state.max_steps:  # not the planned end: say why it stopped
            warnings.warn(
                f"DPTrainer stopped after step {state.global_step} of {state.max_steps}: the "
                f"next step would take epsilon past max_epsilon={p.accountant.max_epsilon:g} "
                f"(epsilon now {self.trainer.epsilon():.4g} at delta="
                f"{self.trainer.privacy.target_delta:g})", PrivacyBudgetWarning,
                stacklevel=2)
        return control


class DPTrainer(Trainer):
    """``transformers.Trainer`` training with DP-SGD (see the module documentation).

    Parameters
    ----------
    *args, **kwargs
        As for ``transformers.Trainer``.
    privacy : PrivacyArguments
        The DP-SGD settings.

    Attributes
    ----------
    privacy_engine : PrivateTraining or None
        What ``make_private`` returned (set when training starts).
    """

    def __init__(self, *args, privacy: PrivacyArguments, **kwargs):
        if not isinstance(privacy, PrivacyArguments):
            raise TypeError(f"privacy must be a PrivacyArguments, got "
                            f"{type(privacy).__name__}")
        super().__init__(*args, **kwargs)
        self.privacy = privacy
        self.privacy_engine: PrivateTraining | None = None
        self._stopped_at_budget = False
        if privacy.log_training_loss:
            warnings.warn("log_training_loss=True: the training loss is logged (and saved in "
                          "checkpoints) without noise; it is not covered by the accounted "
                          "mechanism", PrivacyLeakWarning, stacklevel=2)
        a = self.args
        if a.gradient_accumulation_steps != 1:
            raise ValueError(
                "gradient_accumulation_steps must be 1 with DPTrainer, got "
                f"{a.gradient_accumulation_steps}: accumulating micro-batches before one "
                "step would clip example i of each micro-batch together. Use a larger "
                "per_device_train_batch_size (the Poisson batch) instead")
        if a.fp16 and getattr(self.accelerator, "scaler", None) is not None:
            raise ValueError("fp16=True with a loss scaler is not supported by DPTrainer: the "
                             "Trainer's loss "
                             "scaler runs through accelerate, which is not wired to the DP "
                             "optimizer yet. Use bf16=True or float32, or fp16 with "
                             "make_private and torch.amp.GradScaler (docs/torch-training.md, "
                             "'Mixed precision')")
        if a.world_size > 1 or a.n_gpu > 1:
            raise ValueError(f"DPTrainer runs in one process on one device, got world_size="
                             f"{a.world_size}, n_gpu={a.n_gpu}; for several GPUs use "
                             "make_private with DistributedDataParallel directly")
        if a.label_smoothing_factor:
            raise ValueError("label_smoothing_factor must be 0 with DPTrainer (the loss is "
                             "computed per example by DPTrainer)")
        if self.compute_loss_func is not None:
            raise ValueError("compute_loss_func is not supported by DPTrainer: the loss must "
                             "be a mean of per-example losses; pass "
                             "PrivacyArguments(task=...) instead")
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError("DPTrainer needs a map-style train_dataset (len and indexing) "
                             "to Poisson-sample it; got an IterableDataset")
        # the privacy state restores the sampler's position itself; the Trainer must not
        # draw (and skip) batches to fast-forward on resume
        a.ignore_data_skip = True
        self.add_callback(_PrivacyCallback(self))

    # ------------------------------------------------------------------ wiring
    def _planned_steps(self, n: int) -> int:
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        per_epoch = max(1, round(n / self._train_batch_size))
        return max(1, math.ceil(self.args.num_train_epochs * per_epoch))

    def get_train_dataloader(self) -> DataLoader:
        """The Poisson-sampling loader of :func:`make_private` (made on first use, with
        the Trainer's optimizer, which it wraps)."""
        if self.privacy_engine is not None:
            return self.privacy_engine.data_loader
        if self.train_dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset")
        dataset = self.train_dataset
        collator = self.data_collator
        datasets = sys.modules.get("datasets")  # a datasets.Dataset implies it is imported
        is_hf_dataset = datasets is not None and isinstance(dataset, datasets.Dataset)
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator,
                                                               description="training")
        loader = DataLoader(dataset, batch_size=self._train_batch_size, collate_fn=collator,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        if self.optimizer is None:
            self.create_optimizer()
        if isinstance(self.optimizer, DPOptimizer):
            raise ValueError("the optimizer is already a DPOptimizer; pass the plain one")
        pa = self.privacy
        kw = {f.name: getattr(pa, f.name) for f in fields(pa)
              if f.name not in ("task", "max_epsilon", "target_epsilon", "noise_multiplier",
                                "log_training_loss")}
        max_eps = pa.max_epsilon if pa.max_epsilon is not None else pa.target_epsilon
        if pa.clipping != "adaptive":  # defaults only (PrivacyArguments checked that)
            for k in ("target_unclipped_quantile", "unclipped_num_std",
                      "clipbound_learning_rate"):
                kw.pop(k)
        if pa.target_epsilon is not None:
            kw.update(target_epsilon=pa.target_epsilon, steps=self._planned_steps(len(dataset)))
        else:
            kw.update(noise_multiplier=pa.noise_multiplier)
        self.model.train()
        self.privacy_engine = make_private(self.model, self.optimizer, loader,
                                           max_epsilon=max_eps, **kw)
        self.optimizer = self.privacy_engine.optimizer
        return self.privacy_engine.data_loader

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The learning-rate scheduler drives the wrapped torch optimizer."""
        if optimizer is None and isinstance(self.optimizer, DPOptimizer):
            optimizer = self.optimizer.original_optimizer
        return super().create_scheduler(num_training_steps, optimizer=optimizer)

    def _clip_grad_norm(self, model):
        return None  # per-example clipping happens inside the DP step

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # p.grad is set by the DP step; no pre-step norm to report

    # ------------------------------------------------------------------ loss
    def _task(self, model, labels: torch.Tensor) -> str:
        if self.privacy.task is not None:
            return self.privacy.task
        if labels.dim() == 1:
            return "sequence_classification"
        inner = self.accelerator.unwrap_model(model)
        base = getattr(getattr(inner, "base_model", None), "model", None)  # peft
        names = {type(inner).__name__, type(base).__name__ if base is not None else ""}
        if any(n.endswith("ForCausalLM") for n in names):
            return "causal_lm"
        if labels.is_floating_point():
            return "sequence_classification"  # multi-label or regression targets
        return "token_classification"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Mean over examples of per-example losses (never the token-level mean)."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("DPTrainer needs labels in each batch to compute per-example "
                             "losses (the model's own loss would average over tokens)")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        task = self._task(model, labels)
        if task == "causal_lm":
            loss = per_sequence_cross_entropy(logits, labels, shift=True)
        elif task in ("masked_lm", "token_classification"):
            loss = per_sequence_cross_entropy(logits, labels, shift=False)
        else:
            loss = _sequence_classification_loss(model, logits, labels)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """An empty Poisson batch trains on nothing (the step still adds its noise)."""
        if _batch_size(inputs) == 0:
            return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def train(self, *args, **kwargs):
        """``Trainer.train``; unless ``log_training_loss``, the returned
        ``TrainOutput.training_loss`` is NaN and ``metrics`` has no ``train_loss``: the mean
        training loss is a statistic of the private batches without noise, so it does not
        leave the call (what it returns is a release, covered by the accountant only if
        noised)."""
        out = super().train(*args, **kwargs)
        if self.privacy.log_training_loss or self.privacy_engine is None:
            return out
        if hasattr(self, "_total_loss_scalar"):
            self._total_loss_scalar = 0.0
        metrics = {k: v for k, v in out.metrics.items() if k not in _UNNOISED_LOGS}
        return type(out)(out.global_step, float("nan"), metrics)

    # ------------------------------------------------------------------ accounting
    def epsilon(self, delta: float | None = None) -> float:
        """epsilon at ``delta`` (default ``target_delta``) of the steps taken so far."""
        if self.privacy_engine is None:
            return 0.0
        return self.privacy_engine.epsilon(self.privacy.target_delta if delta is None
                                           else delta)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.privacy_engine is not None:
            if not self.privacy.log_training_loss:
                for key in _UNNOISED_LOGS:  # un-noised training statistics
                    logs.pop(key, None)
            logs["epsilon"] = self.epsilon()
            logs["dp_max_grad_norm"] = self.privacy_engine.max_grad_norm
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.privacy_engine is None or not self.args.should_save:
            return
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-"
                              f"{self.state.global_step}")
        state = self.privacy_engine.state_dict()
        # model and optimizer are in the Trainer's own files of this checkpoint
        state.pop("model")
        state.pop("optimizer")
        torch.save(state, os.path.join(folder, PRIVACY_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"checkpoint {checkpoint!r} has no {PRIVACY_STATE_NAME}: it was not written "
                "by DPTrainer, and resuming from it would lose the privacy cost of the steps "
                "already taken. Resume from a DPTrainer checkpoint, or start a new run")
        state = torch.load(path, weights_only=False)
        p = self.privacy_engine
        state["model"] = p.model.state_dict()  # loaded by the Trainer from this checkpoint
        state["optimizer"] = p.optimizer.original_optimizer.state_dict()
        p.load_state_dict(state)


def _batch_size(inputs) -> int | None:
    for v in (inputs.values() if isinstance(inputs, dict) else ()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    return None


def _sequence_classification_loss(model, logits: torch.Tensor,
                                  labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's sequence-classification losses, as means over examples."""
    cfg = getattr(model, "config", None)
    problem = getattr(cfg, "problem_type", None)
    num_labels = getattr(cfg, "num_labels", logits.shape[-1])
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        out = logits.squeeze(-1) if num_labels == 1 else logits
        return F.mse_loss(out.float(), labels.to(torch.float32))
    if problem == "single_label_classification":
        return F.cross_entropy(logits.float().view(-1, num_labels), labels.view(-1))
    # multi-label: mean over examples and labels (a fixed divisor per example)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.to(torch.float32))
