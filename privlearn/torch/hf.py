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
  history, live noise multiplier and clipping bound, the keys of the sampler and the
  noise: one-way, they reveal no past batch or noise); ``trainer.train(
  resume_from_checkpoint=...)`` restores it, so a resumed run reports the same epsilon and
  epoch as an uninterrupted one. A checkpoint without it is refused;
* **releases**: every number the trainer logs, returns or writes into a checkpoint is on
  an allow-list (:data:`RELEASED_LOGS`): epsilon, the clipping bound, the learning rate,
  the step and the epoch (all data-independent or accounted), and evaluation metrics
  (statistics of the evaluation set, which this run's accounting does not cover). The
  un-noised training loss, FLOP and token counts (which depend on private sequence
  lengths) and timings are not released;
* **several runs**: every ``train()`` (a fresh model from ``model_init``, each trial of
  ``hyperparameter_search``) trains privately, and ``epsilon()`` reports the composition
  of all the runs on the training set; ``max_epsilon`` caps that total.

Refused, with the reason, before the first step: gradient accumulation
(``gradient_accumulation_steps > 1``: the Trainer would clip each micro-batch's examples
together), ``fp16`` *with a loss scaler* (on CUDA the Trainer's scaler runs through
accelerate, not yet wired to the DP optimizer: use ``bf16``, or ``make_private`` with
``torch.amp.GradScaler``; on CPU accelerate runs fp16 autocast without a scaler, which
trains as bf16 does: per-example norms and sums in float32),
several processes or GPUs (not wired yet), an iterable training set (it cannot be
Poisson-sampled), ``label_smoothing_factor`` and ``compute_loss_func`` (the loss must be
per example), ``DataCollatorWithFlattening`` (it packs the batch into one row, which
would be clipped as one example).

The Trainer is used through its public API only (``get_train_dataloader``,
``create_scheduler``, ``compute_loss``, ``training_step``, ``floating_point_ops``,
``log``, ``train`` and callbacks); the user's ``TrainingArguments`` are not modified
(the trainer works on a copy with ``max_grad_norm=0``: per-example clipping replaces the
Trainer's, and ``ignore_data_skip=True``: the sampler resumes its own position).
Tested with transformers 5.17 and 5.24 (the oldest 5.x it is measured on and the latest
5.x), the range of the ``hf`` extra: ``transformers>=5.17,<6``.

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

import copy
import os
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
                      "'privlearn[hf]' (transformers>=5.17,<6, peft>=0.21)") from exc

from privlearn.accounting import compose, planned_steps
from privlearn.errors import PrivacyBudgetExceededError, PrivacyLeakWarning
from privlearn.torch.accountant import PrivacyBudgetWarning
from privlearn.torch.config import DPConfig
from privlearn.torch.losses import per_sequence_cross_entropy
from privlearn.torch.optimizer import DPOptimizer
from privlearn.torch.privacy_engine import PrivateTraining, make_private

__all__ = ["DPTrainer", "PrivacyArguments", "expand_position_ids", "PRIVACY_STATE_NAME",
           "RELEASED_LOGS"]

PRIVACY_STATE_NAME = "privlearn_privacy.pt"
_TASKS = ("causal_lm", "masked_lm", "token_classification", "sequence_classification")


@dataclass(frozen=True)
class PrivacyArguments:
    """The DP-SGD settings of a :class:`DPTrainer` (validated by
    :class:`~privlearn.torch.config.DPConfig`, which documents them; passed to
    :func:`privlearn.torch.make_private`).

    Attributes
    ----------
    noise_multiplier, target_epsilon, target_delta, max_grad_norm, sampling, accountant,
    secure_mode, seed, clipping, target_unclipped_quantile, clipbound_learning_rate,
    unclipped_num_std, batch_dims, check_batch_independence, noise, bands, buffers,
    cycle_length, max_examples_per_user, user_reduction
        As in :class:`~privlearn.torch.config.DPConfig`; ``target_epsilon`` (and correlated
        noise, and the participation-bounding samplers) use the Trainer's planned steps
        (``max_steps``, or ``num_train_epochs`` times the steps of an epoch).
    user_column : str, optional
        The training set's column (key of each example) holding the user of each example:
        privacy is then per user (``make_private(users=...)``); the column is not passed
        to the model.
    max_epsilon : float, optional
        Stop training before the step that would take epsilon (of all this trainer's
        runs) past this; default ``target_epsilon``, if given.
    log_training_loss : bool
        The Trainer's ``loss`` / ``train_loss`` logs are means over private training
        batches without noise, and they are saved in every checkpoint's
        ``trainer_state.json``: by default they are not released. ``True`` keeps them
        and emits a :class:`~privlearn.errors.PrivacyLeakWarning`: they are then not
        covered by the accounted mechanism.
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
    batch_dims: dict | None = None
    check_batch_independence: bool = True
    noise: str = "dpsgd"
    bands: int | None = None
    buffers: int | None = None
    cycle_length: int | None = None
    user_column: str | None = None
    max_examples_per_user: int = 1
    user_reduction: str = "mean"
    task: str | None = None
    log_training_loss: bool = False

    def __post_init__(self):
        if self.task is not None and self.task not in _TASKS:
            raise ValueError(f"task must be one of {_TASKS} or None, got {self.task!r}")
        if self.clipping == "adaptive" and self.target_unclipped_quantile is None:
            return  # refused with the other settings when training starts
        # one validation for every setting: DPConfig's (the planned length comes later)
        users = None if self.user_column is None else [0]
        DPConfig(**self.engine_settings(steps=1, users=users))

    def engine_settings(self, **extra) -> dict:
        """The :func:`~privlearn.torch.make_private` settings (``max_epsilon`` defaults to
        ``target_epsilon``)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)
              if f.name not in ("task", "log_training_loss", "user_column")}
        if kw["max_epsilon"] is None:
            kw["max_epsilon"] = self.target_epsilon
        kw.update(extra)
        return kw


#: Keys of the logs, returned metrics and checkpoint states a DPTrainer releases (plus
#: evaluation metrics, ``eval_*``/``test_*``/``predict_*``): each is data-independent or
#: covered by the accounting.
RELEASED_LOGS = frozenset({"epsilon", "dp_max_grad_norm", "dp_noise_multiplier",
                           "learning_rate", "epoch", "step"})
_EVAL_PREFIXES = ("eval_", "test_", "predict_")
_UNNOISED_LOGS = ("loss", "train_loss", "grad_norm")


def _released(key: str, log_training_loss: bool) -> bool:
    return (key in RELEASED_LOGS or key.startswith(_EVAL_PREFIXES)
            or (log_training_loss and key in _UNNOISED_LOGS))


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
    """Stops training before the step that would exceed ``max_epsilon``; keeps the
    reported epoch the sampler's; writes the privacy state into each checkpoint."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        p = self.trainer.privacy_engine
        if p is not None and p.accountant.steps == 0 and _exhausted(p):
            raise PrivacyBudgetExceededError(
                f"max_epsilon={p.budget.max_epsilon:g} at delta={p.budget.delta:g} "
                f"does not cover even one step (noise_multiplier={p.noise_multiplier:.4g}, "
                f"sampling rate {p.sampling_rate:.4g}"
                + (", after the earlier runs of this trainer" if p.accountant.prior else "")
                + "); no step was taken. Raise max_epsilon, or the noise "
                "(noise_multiplier, or target_epsilon with the planned steps)")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        p = self.trainer.privacy_engine
        if p is not None:  # the epoch of the steps taken (a resumed run continues it)
            state.epoch = p.accountant.steps / p.plan.steps_per_epoch
        if p is None or not _exhausted(p):
            return control
        self.trainer._stopped_at_budget = True
        control.should_training_stop = True
        if state.global_step < state.max_steps:  # not the planned end: say why it stopped
            warnings.warn(
                f"DPTrainer stopped after step {state.global_step} of {state.max_steps}: the "
                f"next step would take epsilon past max_epsilon={p.budget.max_epsilon:g} "
                f"(epsilon now {self.trainer.epsilon():.4g} at delta="
                f"{self.trainer.privacy.target_delta:g})", PrivacyBudgetWarning,
                stacklevel=2)
        return control

    def on_save(self, args, state, control, **kwargs):
        p = self.trainer.privacy_engine
        if p is None or not args.should_save:
            return control
        prefix = transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
        folder = os.path.join(args.output_dir, f"{prefix}-{state.global_step}")
        if os.path.isdir(folder):
            state_ = p.state_dict()
            # model and optimizer are in the Trainer's own files of this checkpoint
            state_.pop("model")
            state_.pop("optimizer")
            torch.save(state_, os.path.join(folder, PRIVACY_STATE_NAME))
        return control


def _exhausted(p: PrivateTraining) -> bool:
    """Whether the budget leaves no room for one more step."""
    return p.budget.max_epsilon is not None and p.budget.exhausted(p.noise_multiplier,
                                                                   p.sampling_rate)


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
        What ``make_private`` returned for the current run (set when training starts).
    """

    def __init__(self, *args, privacy: PrivacyArguments, **kwargs):
        if not isinstance(privacy, PrivacyArguments):
            raise TypeError(f"privacy must be a PrivacyArguments, got "
                            f"{type(privacy).__name__}")
        a = kwargs.get("args", args[1] if len(args) > 1 else None)
        if a is not None:  # the Trainer works on a copy: the user's arguments stay as given
            a = _private_copy(a)
            if "args" in kwargs:
                kwargs["args"] = a
            else:
                args = (args[0], a, *args[2:])
        super().__init__(*args, **kwargs)
        self.args = _private_copy(self.args) if a is None else self.args
        self.privacy = privacy
        self.privacy_engine: PrivateTraining | None = None
        self._earlier_runs: list = []  # mechanisms of the finished runs
        self._resume_from: str | None = None
        self._stopped_at_budget = False
        if privacy.log_training_loss:
            warnings.warn("log_training_loss=True: the training loss is logged (and saved in "
                          "checkpoints) without noise; it is not covered by the accounted "
                          "mechanism", PrivacyLeakWarning, stacklevel=2)
        self._refuse_unsupported()
        self.add_callback(_PrivacyCallback(self))

    def _refuse_unsupported(self) -> None:
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
                             "make_private and torch.amp.GradScaler (docs/guides/pytorch.md, "
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
        flattening = getattr(transformers, "DataCollatorWithFlattening", None)
        if flattening is not None and isinstance(self.data_collator, flattening):
            raise ValueError(
                "DataCollatorWithFlattening packs the whole batch into one row, which "
                "per-example clipping would clip as one example (the sensitivity would be "
                "the batch's, not one example's). Use a padding collator "
                "(DataCollatorWithPadding, DataCollatorForLanguageModeling, "
                "default_data_collator) with DPTrainer")

    # ------------------------------------------------------------------ wiring
    def _planned_steps(self, q: float) -> int:
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        return planned_steps(q, self.args.num_train_epochs)

    def get_train_dataloader(self) -> DataLoader:
        """The DP sampler's loader (:func:`make_private` over the Trainer's own dataset
        and collator, with its optimizer). A new run (the Trainer built a new model or
        optimizer, e.g. ``model_init``) gets a new engine; the privacy cost of the earlier
        runs is kept and composed."""
        p = self.privacy_engine
        if p is not None and p.model is self.model and self.optimizer is p.optimizer:
            return p.data_loader
        if p is not None:  # a new run of this trainer on the same data
            self._earlier_runs.append(p.accountant.mechanism())
            p.detach()
            self.privacy_engine = None
        base = super().get_train_dataloader()  # the Trainer's dataset and collator
        loader = DataLoader(base.dataset, batch_size=self.args.per_device_train_batch_size,
                            collate_fn=base.collate_fn,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        if self.optimizer is None:
            self.create_optimizer()
        if isinstance(self.optimizer, DPOptimizer):
            raise ValueError("the optimizer is already a DPOptimizer of another run; pass the "
                             "plain torch optimizer")
        pa = self.privacy
        kw = pa.engine_settings()
        if pa.user_column is not None:
            kw["users"] = _column(self.train_dataset, pa.user_column)
        if pa.target_epsilon is not None or pa.noise != "dpsgd" or pa.sampling not in (
                "poisson", "fixed"):
            n = len(base.dataset) if pa.user_column is None else len(set(kw["users"]))
            kw["steps"] = self._planned_steps(self.args.per_device_train_batch_size / n)
        self.model.train()
        p = make_private(self.model, self.optimizer, loader, **kw)
        prior = [m for m in self._earlier_runs if m is not None]
        if prior:
            p.accountant.prior = compose(prior)
        if self._resume_from is not None:
            self._load_privacy_state(p, self._resume_from)
        self.privacy_engine = p
        self.optimizer = p.optimizer
        return p.data_loader

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The learning-rate scheduler drives the wrapped torch optimizer."""
        if optimizer is None and isinstance(self.optimizer, DPOptimizer):
            optimizer = self.optimizer.original_optimizer
        return super().create_scheduler(num_training_steps, optimizer=optimizer)

    def floating_point_ops(self, inputs) -> int:
        """0: the Trainer's FLOP count depends on the private batch's sequence lengths
        and is saved in every checkpoint (``total_flos``), so it is not computed."""
        return 0

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
        if self.privacy.user_column is not None:
            inputs.pop(self.privacy.user_column, None)  # who, not what: not a model input
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

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``. What it returns is filtered like the logs: the returned
        ``TrainOutput.training_loss`` is NaN and ``metrics`` holds only released keys
        (:data:`RELEASED_LOGS`, with ``epsilon``), unless ``log_training_loss``. Resuming
        from a checkpoint restores the privacy state saved in it (refused without one)."""
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = transformers.trainer_utils.get_last_checkpoint(
                self.args.output_dir)
        self._resume_from = resume_from_checkpoint
        if resume_from_checkpoint is not None:
            _privacy_state_path(resume_from_checkpoint)  # refused before anything runs
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._resume_from = None
        if self.privacy_engine is None:
            return out
        keep = self.privacy.log_training_loss
        metrics = {k: v for k, v in out.metrics.items() if _released(k, keep)}
        metrics["epsilon"] = self.epsilon()
        return type(out)(out.global_step, out.training_loss if keep else float("nan"),
                         metrics)

    # ------------------------------------------------------------------ accounting
    def epsilon(self, delta: float | None = None) -> float:
        """epsilon at ``delta`` (default ``target_delta``) of all the steps this trainer
        took (every run)."""
        d = self.privacy.target_delta if delta is None else delta
        if self.privacy_engine is not None:
            return self.privacy_engine.epsilon(d)
        prior = [m for m in self._earlier_runs if m is not None]
        return compose(prior).epsilon(d) if prior else 0.0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log only released keys (:data:`RELEASED_LOGS` and evaluation metrics), with
        epsilon and the clipping bound added."""
        if self.privacy_engine is not None:
            keep = self.privacy.log_training_loss
            logs = {k: v for k, v in logs.items() if _released(k, keep)}
            logs["epsilon"] = self.epsilon()
            logs["dp_max_grad_norm"] = self.privacy_engine.max_grad_norm
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def _load_privacy_state(self, p: PrivateTraining, checkpoint: str) -> None:
        state = torch.load(_privacy_state_path(checkpoint), weights_only=False)
        # the model and the optimizer are the Trainer's (loaded from the same checkpoint)
        state["model"] = p.model.state_dict()
        state["optimizer"] = p.optimizer.original_optimizer.state_dict()
        p.load_state_dict(state)


def _private_copy(args):
    """A copy of the user's TrainingArguments with what DP-SGD needs: no clipping of the
    averaged gradient (per-example clipping replaces it), no batch skipping on resume (the
    sampler resumes its own position), no token counting (private sequence lengths)."""
    a = copy.copy(args)
    a.max_grad_norm = 0.0
    a.ignore_data_skip = True
    if getattr(a, "include_num_input_tokens_seen", "no") not in ("no", False, None):
        warnings.warn("include_num_input_tokens_seen is ignored by DPTrainer: the number of "
                      "tokens trained on depends on private sequence lengths and would be "
                      "released un-noised", PrivacyLeakWarning, stacklevel=3)
        a.include_num_input_tokens_seen = "no"
    return a


def _column(dataset, name: str) -> list:
    """The values of column ``name`` of every example (a Hugging Face ``datasets.Dataset``
    column, or the key of each example of a map-style dataset)."""
    try:
        values = dataset[name]  # datasets.Dataset: the whole column
        if len(values) == len(dataset):
            return list(values)
    except (KeyError, TypeError, IndexError, ValueError):
        pass
    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, dict) or name not in item:
            raise ValueError(f"user_column={name!r}: example {i} of the training set has no "
                             f"such key (keys: {sorted(item) if isinstance(item, dict) else '?'}"
                             ")")
        v = item[name]
        out.append(v.item() if isinstance(v, torch.Tensor) else v)
    return out


def _privacy_state_path(checkpoint: str) -> str:
    path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"checkpoint {checkpoint!r} has no {PRIVACY_STATE_NAME}: it was not written "
            "by DPTrainer, and resuming from it would lose the privacy cost of the steps "
            "already taken. Resume from a DPTrainer checkpoint, or start a new run")
    return path


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
