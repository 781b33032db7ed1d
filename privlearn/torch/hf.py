"""Hugging Face ``transformers.Trainer`` with DP-SGD: :class:`DPTrainer`.

The Trainer's loop, logging, evaluation and checkpointing stay; what DP-SGD needs is
swapped in underneath through :func:`privlearn.torch.make_private`:

* **sampling**: the Trainer's shuffled training loader is replaced by the loader
  ``make_private`` returns (Poisson sampling at rate ``q = B k W / N`` by default: the
  expected logical batch is the Trainer's effective batch, ``per_device_train_batch_size``
  ``B`` times ``gradient_accumulation_steps`` ``k`` times the processes ``W``), so the
  accountant describes the batches actually trained on, one step per logical batch;
* **gradient accumulation**: with ``k > 1`` each logical batch is trained in physical
  chunks of at most ``B`` rows (forward and backward per chunk, the clipped sums added,
  the noise added once after the last chunk), so a step's peak memory is a chunk's; the
  Trainer counts one step per logical batch (:mod:`privlearn.torch._hf_accumulate`);
* **clipping and noise**: the Trainer's optimizer is wrapped by the DP optimizer
  (per-example clipping at :attr:`PrivacyArguments.dp_max_grad_norm`, Gaussian noise,
  division by the expected batch size); ``TrainingArguments.max_grad_norm`` (the Trainer's
  clipping of the *averaged* gradient) is not used: per-example clipping replaces it (a
  value other than its default is warned about);
* **loss**: computed per example (:func:`privlearn.torch.per_sequence_cross_entropy` for
  language modelling, the mean over examples for sequence classification), never the
  token-level mean Hugging Face models return with ``labels=``;
* **accounting**: ``epsilon`` is added to every log entry (at ``target_delta``); training
  stops, before the step that would exceed it, at ``max_epsilon`` (by default the
  ``target_epsilon`` the noise was calibrated for);
* **checkpoints**: a checkpoint folder is a release (it is what ``push_to_hub`` uploads),
  so it gets only the public part of the privacy state, ``privlearn_privacy.pt`` (the
  accountant's history, live noise multiplier and clipping bound). What continues the
  run's randomness is secret: the keys of the sampler and of the noise (they replay the
  *next* steps' batches and noise, so with any model released after the checkpoint they
  would reveal an un-noised clipped gradient) and, with correlated noise, the last noises
  themselves; so are the global generators' states (the Trainer's ``rng_state.pth``:
  how far dropout advanced them follows the private batches, :mod:`privlearn.torch._hf_rng`).
  DPTrainer writes that part only under ``private_state_dir`` (outside
  ``output_dir``), one file per checkpoint, found on resume by a random token the
  checkpoint carries (so a renamed or copied folder, e.g. the ``last-checkpoint`` that
  ``push_to_hub`` uploads, resumes; :mod:`privlearn.torch._hf_private`); a run with such
  state and checkpointing but no ``private_state_dir`` is refused when it is built. ``trainer.train(
  resume_from_checkpoint=...)`` restores both parts, so a resumed run reports the same
  epsilon and epoch as an uninterrupted one; a checkpoint without its privacy state,
  whose private part is missing, of another number of processes, or resumed with other
  privacy settings (:mod:`privlearn.torch._hf_resume`) is refused; ``save_model`` (so
  each checkpoint and ``push_to_hub``) writes the public ``privacy_report.json``
  (epsilon, delta, accountant, mechanism: :mod:`privlearn.torch._hf_release`);
* **releases**: every number the trainer logs, returns or writes into a checkpoint is on
  an allow-list (:data:`RELEASED_LOGS`): epsilon, the clipping bound, the learning rate,
  the step and the epoch (all data-independent or accounted), and evaluation metrics
  (statistics of the evaluation set, which this run's accounting does not cover; a
  ``PrivacyLeakWarning`` when the evaluation set holds training examples). The
  un-noised training loss, FLOP and token counts (which depend on private sequence
  lengths) and timings are not released;
* **several runs**: every ``train()`` (a fresh model from ``model_init``, each trial of
  ``hyperparameter_search``) trains privately, and ``epsilon()`` reports the composition
  of all the runs on the training set (``inf`` once a run took a step without noise);
  ``max_epsilon`` caps that total;
* **task**: the per-example loss follows the model's task, read from transformers' auto
  classes (the class, or its nearest transformers base class, under
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and the masked-LM, token- and
  sequence-classification and seq2seq-LM mappings; peft wrappers unwrapped; an
  encoder-decoder's ``decoder_input_ids``, when the batch has none, built from the labels
  as the model builds them). A model in none of them
  (a custom class) with per-token labels, or in two of them, is refused until
  ``PrivacyArguments(task=...)`` names the task;
* **several processes** (``torchrun``/``accelerate launch``, DistributedDataParallel):
  each rank Poisson-samples its own part of the data at the global rate ``W B / N``, the
  noisy clipped sums are all-reduced by the engine (DDP's own averaging is switched off),
  every rank logs the same epsilon, and each checkpoint holds one privacy state per rank
  (``privlearn_privacy.rank<r>.pt``; secret parts under ``private_state_dir``). FSDP2
  (``TrainingArguments(fsdp=True)``): the model is sharded with accelerate's FSDP2 before
  ``make_private`` (on CPU processes too, where accelerate alone would fall back to DDP)
  and checkpoints hold the sharded model and optimizer (``privlearn.torch._hf_fsdp``).

Refused, with the reason, before the first step: ``gradient_accumulation_steps > 1``
under FSDP2 (each process would run its own number of chunks; FSDP2's collectives need
the same), ``fp16`` *with a loss scaler* (on CUDA the Trainer's scaler runs through
accelerate, not yet wired to the DP optimizer: use ``bf16``, or ``make_private`` with
``torch.amp.GradScaler``; on CPU accelerate runs fp16 autocast without a scaler, which
trains as bf16 does: per-example norms and sums in float32), several GPUs in one process
(``nn.DataParallel``), FSDP1, DeepSpeed or tensor parallelism through the Trainer (FSDP2's
own refusals: ``privlearn.torch._hf_fsdp``), ``ddp_static_graph=True`` on several
processes (a static-graph DDP reduces the first backward's weight gradients, which the
engine never produces: it fails inside DDP), an iterable training set (it cannot be
Poisson-sampled), ``train_sampling_strategy`` other than ``"random"`` (length-grouped,
rebalanced or sequential batches: the DP sampler draws the batches),
``label_smoothing_factor`` and ``compute_loss_func`` (the loss must be per example; a
subclass's ``compute_loss`` is checked when training starts:
``privlearn.torch._hf_loss.check_per_example_loss``), ``DataCollatorWithFlattening`` (it
packs the batch into one row, which would be clipped as one example) and rows packing
several sequences (``position_ids`` starting over in a row: at that batch, before its
step), ``auto_find_batch_size`` (the expected Poisson batch
sets the accounted sampling rate; the Trainer would halve it after an out-of-memory error:
lower ``per_device_train_batch_size`` and raise ``gradient_accumulation_steps`` instead),
``neftune_noise_alpha`` (NEFTune's noise scale follows the batch's padded length), LOMO
and layer-wise optimizers (``privlearn.torch._hf_optim.refuse_updates_in_backward``),
encoder-decoder models other than sequence-to-sequence LMs, and T5's trainable relative
attention bias (``privlearn.torch._hf_release.refuse_encoder_decoder``: freeze it).

The Trainer is used through its public API (``get_train_dataloader``,
``create_scheduler``, ``compute_loss``, ``training_step``, ``floating_point_ops``,
``get_total_train_batch_size``, ``save_model``, ``log``, ``train`` and callbacks;
``_prepare_for_training``, which hands accelerate the
torch optimizer: ``privlearn.torch._hf_optim``; under FSDP2 also
``_save_optimizer_and_scheduler``: ``privlearn.torch._hf_fsdp.FSDP2Support``); the
user's ``TrainingArguments`` are not modified (the trainer works on a copy with
``max_grad_norm=0``: per-example clipping replaces the Trainer's, and
``ignore_data_skip=True``: the sampler resumes its own position; while it trains,
``gradient_accumulation_steps=1``: one item of its loader is one logical batch; the
callbacks see the given value).
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
...                                              max_grad_norm=1.0),
...                     private_state_dir="private")   # outside "out": never shared
>>> trainer.train(); trainer.epsilon()

GPT-2 and BERT build position ids of shape ``(1, T)`` broadcast over the batch; the
engine expands such inputs to one row per example itself, so no collator change is needed.
A left-padded batch without ``position_ids`` gets them counted over its attention mask, and
labels at padding (or, causal LM, predicted from padding) are ignored
(``privlearn.torch._hf_collate``): an example's loss is then its own whatever the length of
the batch's longest (:func:`expand_position_ids` is kept for collators that want the ids).
"""

from __future__ import annotations

import copy
import functools
import glob
import math
import os
import time
import warnings

import torch
from torch.utils.data import DataLoader

try:
    import transformers
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("privlearn.torch.hf needs transformers: pip install "
                      "'privlearn[hf]' (transformers>=5.17,<6, peft>=0.21)") from exc

from privlearn._type_registry import first_in_mro
from privlearn._validation import check_delta, check_positive, check_unit_ids
from privlearn.errors import (
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyBudgetExceededError,
    PrivacyLeakWarning,
)
from privlearn.torch._ddp_quiet import quiet_ddp
from privlearn.torch._hf_accumulate import LogicalBatches, logical_loader
from privlearn.torch._hf_args import (  # noqa: F401
    _TASKS,
    _TRAINER_FIELDS,
    PrivacyArguments,
    check_batch_size,
    warn_unused_clipping,
)
from privlearn.torch._hf_collate import (
    batch_rows,
    column_of,
    decoder_inputs,
    expand_position_ids,
    own_labels,
    own_target_labels,
    positions_of_left_padding,
    refuse_packed_rows,
)
from privlearn.torch._hf_eval import EvaluationWarnings
from privlearn.torch._hf_fsdp import FSDP2Support, is_fsdp2, shard_model, stand_in_pass
from privlearn.torch._hf_generate import GenerationPredictions, use_generation_config
from privlearn.torch._hf_loss import (
    check_per_example_loss,
    sequence_classification_loss,
    warn_own_compute_loss,
)
from privlearn.torch._hf_optim import OptimizerHandoff
from privlearn.torch._hf_private import (
    PRIVATE_FORMAT,
    check_private_state_dir,
    find_private_state,
    join_users,
    new_token,
    private_state_path,
    remove,
    save_private,
    secret_parts,
    split_users,
)
from privlearn.torch._hf_refuse import refuse_unsupported
from privlearn.torch._hf_release import ReportOnSave, run_description, spent_budget_error
from privlearn.torch._hf_resume import (
    check_checkpoint_state,
    check_resumed_settings,
    check_secret_state,
    recorded_settings,
)
from privlearn.torch._hf_rng import RngStatesKeptPrivate, load_state_file
from privlearn.torch.accountant import PrivacyBudgetWarning
from privlearn.torch.config import _OTHER_SETTINGS, DPConfig
from privlearn.torch.distributed import ledger_on_first_rank, refused_together
from privlearn.torch.losses import per_sequence_cross_entropy
from privlearn.torch.optimizer import DPOptimizer
from privlearn.torch.privacy_engine import PrivateTraining, epoch_steps, make_private
from privlearn.torch.schedule import whole_run

__all__ = ["DPTrainer", "PrivacyArguments", "expand_position_ids", "PRIVACY_STATE_NAME",
           "RELEASED_LOGS"]

PRIVACY_STATE_NAME = "privlearn_privacy.pt"
#: The auto-model mapping of transformers that names the model classes of each task.
_TASK_MAPPINGS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
}
#: Further mappings of those tasks: speech-to-text models (Whisper) are seq2seq LMs too.
_MORE_MAPPINGS = (("seq2seq_lm", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),)


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


class _PrivacyCallback(TrainerCallback):
    """Stops training before the step that would exceed ``max_epsilon``; keeps the
    reported epoch the sampler's; writes the privacy state of each checkpoint."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        p = self.trainer.privacy_engine
        if p is not None and self.trainer._unbounded and p.budget.max_epsilon is not None:
            raise PrivacyBudgetExceededError(
                f"{p.budget.cap_name}: an earlier run of this trainer took "
                "steps without noise (noise_multiplier=0), so the epsilon of its runs is "
                "already infinite; no step was taken. Build a new DPTrainer")
        if p is not None and p.accountant.steps > 0 and _exhausted(p):
            raise spent_budget_error(p, self.trainer.epsilon(p.budget.delta))  # no batch drawn
        if p is not None and p.accountant.steps == 0 and _exhausted(p):
            raise PrivacyBudgetExceededError(
                f"{p.budget.cap_name} at delta={p.budget.delta:g} "
                f"does not cover even one step (noise_multiplier={p.noise_multiplier:.4g}, "
                f"sampling rate {p.sampling_rate:.4g}"
                + (", after the earlier runs of this trainer" if p.accountant.prior else "")
                + "); no step was taken. Raise max_epsilon, or the noise "
                "(noise_multiplier, or target_epsilon with the planned steps)")
        if p is not None and type(self.trainer).compute_loss is not DPTrainer.compute_loss:
            check_per_example_loss(self.trainer, self.trainer.model_wrapped)  # no batch drawn
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._step_ended = time.time()  # a checkpoint of this step is written after it
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
                f"next step would take epsilon past {p.budget.cap_name} "
                f"(epsilon now {self.trainer.epsilon():.4g} at delta="
                f"{self.trainer.privacy.target_delta:g})", PrivacyBudgetWarning,
                stacklevel=2)
        return control

    def on_save(self, args, state, control, **kwargs):
        p = self.trainer.privacy_engine
        if p is not None and p.plan.world_size > 1:  # every rank saves its own state
            import torch.distributed as dist

            dist.barrier()  # after the main process wrote the checkpoint folder
        elif p is None or not args.should_save:
            return control
        folder = checkpoint_folder(args.output_dir, state.global_step,
                                   getattr(self, "_step_ended", 0.0))
        if folder is not None:
            self.trainer._save_privacy_state(folder)
        self.trainer._prune_private_states()  # of checkpoints rotated out (save_total_limit)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._prune_private_states()  # the last rotation (load_best_model_at_end)
        return control


def checkpoint_folder(output_dir, step: int, since: float) -> str | None:
    """The checkpoint folder the Trainer wrote for ``step`` after time ``since``:
    ``output_dir/checkpoint-<step>``, or ``output_dir/<run>/checkpoint-<step>`` in a
    hyperparameter search, whichever has a ``trainer_state.json`` written since then (a
    folder of the same name left by an earlier run never gets this run's state); None if
    there is none."""
    prefix = transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
    name = f"{prefix}-{step}"
    found = []
    for folder in [os.path.join(output_dir, name),
                   *glob.glob(os.path.join(glob.escape(str(output_dir)), "*", name))]:
        state = os.path.join(folder, transformers.trainer.TRAINER_STATE_NAME)
        if os.path.isfile(state) and os.path.getmtime(state) >= since - 1.0:
            found.append((os.path.getmtime(state), folder))
    return max(found)[1] if found else None


def _exhausted(p: PrivateTraining) -> bool:
    """Whether the budget leaves no room for one more step."""
    return p.budget.max_epsilon is not None and p.budget.exhausted(p.noise_multiplier,
                                                                   p.sampling_rate)


class DPTrainer(LogicalBatches, ReportOnSave, EvaluationWarnings, GenerationPredictions,
                RngStatesKeptPrivate, FSDP2Support, OptimizerHandoff, Trainer):
    """``transformers.Trainer`` training with DP-SGD (see the module documentation).

    Parameters
    ----------
    *args, **kwargs
        As for ``transformers.Trainer``.
    privacy : PrivacyArguments
        The DP-SGD settings.
    private_state_dir : str or os.PathLike, optional
        Where the secret part of each checkpoint's privacy state is written, one file per
        checkpoint (``checkpoint-<step>.<token>.pt``, the token also recorded in the
        checkpoint's ``privlearn_privacy.pt``; created with owner-only permissions). That
        part continues the run's randomness: the keys of the sampler and of the noise
        (unless ``secure_mode``, which has none), and with correlated noise
        (``noise="banded"`` or ``"blt"``) the last noises. Anyone holding it and a model
        released after its checkpoint can subtract the noise of the steps in between,
        i.e. read an un-noised clipped gradient, so keep this folder as private as the
        training data and never publish it. It must lie outside ``output_dir`` (the
        checkpoint folders and what ``push_to_hub`` uploads: releases). Resuming from a
        checkpoint needs the same folder. Files of checkpoints that the Trainer deletes
        (``save_total_limit``) are deleted with them. Required when checkpoints are
        saved (``save_strategy`` other than ``"no"``) and the run has such state; with
        ``save_strategy="no"`` nothing is written.
    ledger : BudgetHandle, optional
        A budget of a persistent privacy ledger (``Ledger(path).budget(dataset)``), spent
        as ``make_private(..., ledger=...)`` spends it: each :meth:`train` reserves its
        planned run (``max_steps``, or the epochs' steps) before the first batch (refused
        with :class:`~privlearn.errors.BudgetExceededError`, before any step, when the
        budget cannot hold it) and settles it to the steps that ran when it ends. A run
        resumed from a checkpoint with a ``noise_multiplier`` (not a ``target_epsilon``,
        which plans the whole run) reserves its steps as they run. On several processes
        the run is recorded once, by the first (pass the budget there; on the other
        processes the same budget or ``None``).

    Attributes
    ----------
    gradient_accumulation_steps : int
        ``TrainingArguments.gradient_accumulation_steps`` as given: physical chunks of at
        most ``per_device_train_batch_size`` rows per logical batch (its expected size
        ``per_device_train_batch_size * gradient_accumulation_steps`` per process, the
        sampled and accounted batch: :mod:`privlearn.torch._hf_accumulate`).
    privacy_engine : PrivateTraining or None
        What ``make_private`` returned for the current run (set when training starts).
        Its ``epsilon()`` includes the earlier runs of this trainer, except that a run
        without noise (``noise_multiplier=0``) makes the trainer's :meth:`epsilon`
        infinite from then on.
    """

    def __init__(self, *args, privacy: PrivacyArguments | None = None,
                 private_state_dir: str | os.PathLike | None = None, ledger=None, **kwargs):
        other = [_OTHER_SETTINGS[k] for k in ("privacy_args", "author_mapping") if k in kwargs]
        if not isinstance(privacy, PrivacyArguments) or other:
            got = f"privacy must be a PrivacyArguments, got {type(privacy).__name__}"
            if not other:  # say what to pass
                got += (": pass the DP-SGD settings, e.g. DPTrainer(..., privacy=PrivacyArguments("
                        "target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0))")
            raise ParameterTypeError("; ".join([got, *other]))
        a = kwargs.get("args", args[1] if len(args) > 1 else None)
        if a is not None:  # the Trainer works on a copy: the user's arguments stay as given
            warn_unused_clipping(a, privacy)
            a = _private_copy(a)
            if "args" in kwargs:
                kwargs["args"] = a
            else:
                args = (args[0], a, *args[2:])
        super().__init__(*args, **kwargs)
        self.args = _private_copy(self.args) if a is None else self.args
        self._callbacks_see_given()  # they log gradient_accumulation_steps as given
        self.privacy = privacy
        self.ledger = ledger  # checked by make_private, before any step
        self.privacy_engine: PrivateTraining | None = None
        self._spent = None  # the composed mechanism of the finished runs with noise
        self._unbounded = False  # a finished run took a step without noise
        self._earlier_runs: list[dict] = []  # their public descriptions (privacy report)
        self._resume_state: dict | None = None
        self._private_files: dict[str, str] = {}  # private state file -> its checkpoint
        self._stopped_at_budget = False
        if privacy.log_training_loss:
            warnings.warn("log_training_loss=True: the training loss is logged (and saved in "
                          "checkpoints) without noise; it is not covered by the accounted "
                          "mechanism", PrivacyLeakWarning, stacklevel=2)
        self._refuse_unsupported()
        use_generation_config(self)  # Seq2SeqTrainingArguments.generation_config
        warn_own_compute_loss(type(self), DPTrainer)
        self.private_state_dir = check_private_state_dir(private_state_dir, self.args, privacy)
        self.add_callback(_PrivacyCallback(self))

    def _refuse_unsupported(self) -> None:
        refuse_unsupported(self, transformers, _unwrap, _model_tasks)

    # ------------------------------------------------------------------ wiring
    def _planned_steps(self, settings: dict, n: int, world: int) -> int:
        """``max_steps``, or ``num_train_epochs`` passes over the private loader: the
        steps of its epoch as the sampling has them (``cycle_length`` batches of a cycled
        sampling, not ``N / B``), rounded up as the Trainer rounds its ``max_steps``."""
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        epochs = check_positive(  # the planned length: named in the Trainer's terms
            "num_train_epochs", self.args.num_train_epochs,
            hint="the run's length, which target_epsilon (or the sampling) is planned for: "
            "e.g. 3, or set max_steps > 0")
        per = epoch_steps(DPConfig(**{**settings, "steps": 1}), n,
                          self.logical_batch_size(), world)  # logical steps
        return int(epochs) * per if float(epochs).is_integer() else math.ceil(epochs * per)

    def get_train_dataloader(self) -> DataLoader:
        """The DP sampler's loader of logical batches (:func:`make_private` over the
        Trainer's own dataset and collator, with its optimizer; expected batch
        ``per_device_train_batch_size * gradient_accumulation_steps`` per process, trained
        in chunks of ``per_device_train_batch_size``: :mod:`privlearn.torch._hf_accumulate`).
        A new run (the Trainer built a new model or optimizer, e.g. ``model_init``) gets a
        new engine; the privacy cost of the earlier runs is kept and composed."""
        p = self.privacy_engine
        if p is not None and p.model is self.model and self.optimizer is p.optimizer:
            self._take_accumulation()
            return logical_loader(p.data_loader)
        # again for each run: hyperparameter_search's trials (and a script) set
        # TrainingArguments after the trainer was built
        with self._together():  # every process here, in time; refused on one: on all
            self._refuse_unsupported()
            warn_unused_clipping(self.args, self.privacy)  # set since (a trial): not used
            _private_settings(self.args, stacklevel=4)
            check_batch_size(self.args, self.privacy, len(self.train_dataset),
                             max(1, self.args.world_size), self.gradient_accumulation_steps)
        k = self._take_accumulation()  # the Trainer steps once per logical batch
        if p is not None:  # a new run of this trainer on the same data
            self._settle_run(p)
            self.privacy_engine = None
        base = super().get_train_dataloader()  # the Trainer's dataset and collator
        loader = DataLoader(base.dataset, batch_size=self.logical_batch_size(),
                            collate_fn=base.collate_fn, drop_last=self.args.dataloader_drop_last,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        if is_fsdp2(self):  # the engine and the optimizer see the sharded parameters
            shard_model(self)
        if self.optimizer is None:
            self.create_optimizer()
        if isinstance(self.optimizer, DPOptimizer):
            raise ConfigurationError("the optimizer is already a DPOptimizer of another run; "
                                     "pass the plain torch optimizer")
        pa = self.privacy
        kw = pa.engine_settings()
        if k > 1:  # the logical batch in chunks of the per-device batch (its users' rows)
            kw["max_physical_batch_size"] = self.args.per_device_train_batch_size * (
                1 if pa.user_column is None else pa.max_examples_per_user)
        if pa.user_column is not None:
            # the one rule for unit ids, the column named (make_private checks it again)
            kw["users"] = check_unit_ids(f"user_column={pa.user_column!r}",
                                         column_of(self.train_dataset, pa.user_column))
        if (pa.target_epsilon is not None or whole_run(pa.noise, pa.sampling)
                or (ledger_on_first_rank(self.ledger) and self._resume_state is None)):
            # planned: a ledger (on the first process) reserves a fresh run whole (a
            # resumed one as it runs)
            n = len(base.dataset) if pa.user_column is None else len(set(kw["users"]))
            world = max(1, self.args.world_size)  # q = W B / N, as make_private plans it
            kw["steps"] = self._planned_steps(kw, n, world)
        self.model.train()
        # a resume is loaded by make_private (detached if refused), whose ledger then
        # recognises the checkpoint's reservation instead of reserving the plan again
        resume = None if self._resume_state is None else self._privacy_state(
            self._resume_state)
        try:
            p = make_private(self.model, self.optimizer, loader, ledger=self.ledger,
                             resume=resume, **kw)
        except ConfigurationError as exc:  # the model is left as it was given
            if resume is None:
                raise
            raise ConfigurationError(
                f"resume_from_checkpoint: {exc}. With DPTrainer: keep the "
                "PrivacyArguments, the training set and, where they set the noise or "
                "the sampling rate, the TrainingArguments (per_device_train_batch_size; "
                "max_steps or num_train_epochs with target_epsilon) of the run that "
                "wrote the checkpoint") from exc
        if self._spent is not None:  # (a plan's cap and epsilon move after the earlier runs)
            p.compose_after(self._spent)
        if resume is not None:  # the report's runs before the resumed one
            self._earlier_runs = list(self._resume_state.get("earlier_runs", []))
        self.privacy_engine = p
        self.optimizer = p.optimizer
        return logical_loader(p.data_loader)

    def floating_point_ops(self, inputs) -> int:
        """0: the Trainer's FLOP count depends on the private batch's sequence lengths
        and is saved in every checkpoint (``total_flos``), so it is not computed."""
        return 0

    def _settle_run(self, p: PrivateTraining) -> None:
        """Keep the privacy cost of a finished run (its mechanism includes the earlier
        runs, its prior) and detach its engine."""
        if p.accountant.steps:
            self._earlier_runs.append(run_description(p))
        if any(s.noise_multiplier == 0 and s.steps > 0 for s in p.accountant.segments):
            self._unbounded = True  # no mechanism describes it: epsilon is infinite
        else:
            spent = p.accountant.mechanism()
            if spent is not None:
                self._spent = spent
        p.detach()

    # ------------------------------------------------------------------ loss
    def _task(self, model, labels: torch.Tensor) -> str:
        """The task of the per-example loss: ``PrivacyArguments.task``, else the model's
        (:func:`_model_tasks`), else sequence classification for labels one per
        example; refused otherwise."""
        if self.privacy.task is not None:
            return self.privacy.task
        inner = _unwrap(self.accelerator.unwrap_model(model))
        tasks = _model_tasks(type(inner))
        if "seq2seq_lm" in tasks and getattr(inner.config, "is_encoder_decoder", False):
            tasks = frozenset({"seq2seq_lm"})  # (BART is a masked LM too: of its decoder)
        per_example = labels.dim() == 1 or labels.is_floating_point()
        if len(tasks) == 1:
            (task,) = tasks
            if task != "sequence_classification" and labels.dim() < 2:
                raise ParameterValueError(
                    f"{type(inner).__name__} is a {task} model (transformers' "
                    f"{_TASK_MAPPINGS[task]}), but the labels have shape {tuple(labels.shape)}, "
                    f"one per example; {task} needs one label per token, shape (batch, length). "
                    f"Fix the collator, or pass PrivacyArguments(task=...) (one of {_TASKS})")
            return task
        if not tasks and per_example:
            return "sequence_classification"  # one target per example: no other reading
        found = (f"is in several of transformers' task mappings ({', '.join(sorted(tasks))})"
                 if tasks else "is not a transformers model class of a known task "
                 "(causal LM, masked LM, token or sequence classification, seq2seq LM)")
        raise ParameterValueError(
            f"DPTrainer cannot tell how to compute the per-example loss: the model class "
            f"{type(inner).__name__} {found}, and its labels (shape {tuple(labels.shape)}) are "
            "per token. Pass PrivacyArguments(task=...): 'causal_lm' (next-token prediction, "
            "the labels shifted), 'masked_lm' or 'token_classification' (one label per "
            "position, not shifted), 'sequence_classification', or 'seq2seq_lm' (an "
            "encoder-decoder's target tokens)")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Mean over examples of per-example losses (never the token-level mean)."""
        inputs = positions_of_left_padding(_unwrap(self.accelerator.unwrap_model(model)),
                                           dict(inputs))  # an example's own positions
        if self.privacy.user_column is not None:
            inputs.pop(self.privacy.user_column, None)  # who, not what: not a model input
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ParameterValueError("DPTrainer needs labels in each batch to compute per-example "
                             "losses (the model's own loss would average over tokens)")
        if getattr(model, "require_backward_grad_sync", False):
            # DistributedDataParallel (wrapped by the Trainer after make_private): the
            # engine all-reduces the noisy clipped sums itself, DDP must not reduce
            model.require_backward_grad_sync = False
        task = self._task(model, labels)
        if task == "seq2seq_lm":  # the decoder's inputs, as the model builds them from labels
            inner = _unwrap(self.accelerator.unwrap_model(model))
            inputs = decoder_inputs(inner, inputs, labels)
            labels = own_target_labels(inner, labels, inputs)  # and without padding's terms
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if task == "causal_lm":  # (own_labels: no term that exists only next to a longer one)
            loss = per_sequence_cross_entropy(logits, own_labels(labels, inputs, True), shift=True)
        elif task == "seq2seq_lm":
            loss = per_sequence_cross_entropy(logits, labels)
        elif task in ("masked_lm", "token_classification"):
            loss = per_sequence_cross_entropy(logits, own_labels(labels, inputs, False))
        else:
            loss = sequence_classification_loss(model, logits, labels)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The forward and backward passes of one logical batch, in physical chunks of at
        most ``per_device_train_batch_size`` rows when ``gradient_accumulation_steps > 1``
        (:mod:`privlearn.torch._hf_accumulate`; the loss returned is the mean over its
        examples). An empty Poisson batch trains on nothing (the step still adds its
        noise; under FSDP2 the rank runs the collectives of a pass on a stand-in example,
        discarded)."""
        refuse_packed_rows(inputs)  # several records in a row: not the accounted unit
        quiet_ddp(model)  # on every rank, an empty batch's too: DDP's forwards run no collective
        p = self.privacy_engine
        if p is not None and logical_loader(p.data_loader) is not p.data_loader:
            return self._chunked_step(model, inputs, num_items_in_batch, self._train_rows)
        return self._train_rows(model, inputs, num_items_in_batch)

    def _train_rows(self, model, inputs, num_items_in_batch=None):
        if batch_rows(inputs) == 0:
            if "labels" in inputs:  # an undecidable task is refused here as well, not
                self._task(model, inputs["labels"])  # after a noise step: whatever the draw
            if is_fsdp2(self):
                stand_in_pass(self, model)
            return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def _together(self):
        """:func:`~privlearn.torch.distributed.refused_together` for this trainer."""
        return refused_together("DPTrainer.train", self.privacy.agreement_timeout,
                                "PrivacyArguments")

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``. What it returns is filtered like the logs: the returned
        ``TrainOutput.training_loss`` is NaN and ``metrics`` holds only released keys
        (:data:`RELEASED_LOGS`, with ``epsilon``), unless ``log_training_loss``. Resuming
        from a checkpoint restores the privacy state saved in it (refused without one, and
        in a trainer that already trained: the checkpoint's history is its run's only)."""
        with self._together():  # a checkpoint missing on one process: refused on all
            if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
                resume_from_checkpoint = transformers.trainer_utils.get_last_checkpoint(
                    self.args.output_dir)
                if resume_from_checkpoint is None:  # as the Trainer: no silent fresh start
                    raise ParameterValueError(
                        f"resume_from_checkpoint=True: no checkpoint in output_dir="
                        f"{self.args.output_dir!r}; a fresh run would report the epsilon of "
                        "its own steps only. Name the checkpoint folder, or train() without it")
            self._refuse_unsupported()  # before the Trainer hooks anything (NEFTune) on it
            if resume_from_checkpoint is not None:  # refused before anything runs
                self._refuse_resume_after_training(resume_from_checkpoint)
                self._resume_state = self._read_privacy_state(resume_from_checkpoint)
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)
        except Exception as exc:  # may depend on the data: the reservation in full
            link = getattr(self.privacy_engine, "ledger_link", None)
            if link is not None:
                link.refused(exc)
            raise
        finally:
            self._resume_state = None
            self._give_back_accumulation()  # the arguments as given again
            if self.privacy_engine is not None:
                self.privacy_engine.finish()  # the ledger's reservation: the steps that ran
        if self.privacy_engine is None:
            return out
        keep = self.privacy.log_training_loss
        metrics = {k: v for k, v in out.metrics.items() if _released(k, keep)}
        metrics["epsilon"] = self.epsilon()
        return type(out)(out.global_step, out.training_loss if keep else float("nan"), metrics)

    # ------------------------------------------------------------------ accounting
    def epsilon(self, delta: float | None = None) -> float:
        """epsilon at ``delta`` (default ``target_delta``) of all the steps this trainer
        took (every run)."""
        d = self.privacy.target_delta if delta is None else check_delta(
            "delta", delta, allow_one=True)
        if self._unbounded:
            return math.inf  # an earlier run took steps without noise
        if self.privacy_engine is not None:
            return self.privacy_engine.epsilon(d)
        return 0.0 if self._spent is None else self._spent.epsilon(d)

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
    def _save_privacy_state(self, folder: str) -> None:
        """Write the public part of the run's state into the checkpoint ``folder`` and
        the secret part (:func:`~privlearn.torch._hf_private.secret_parts`) under
        ``private_state_dir``; without one, the secret part is not written at all (the
        checkpoint then cannot be resumed)."""
        p = self.privacy_engine
        state = p.state_dict()
        state.pop("model")  # the model and the optimizer are the Trainer's own files
        state.pop("optimizer")
        if self.privacy.user_column is not None:  # the grouping is no release
            state = split_users(state)
        secret = {k: state.pop(k) for k in secret_parts(self.privacy)}
        if "sampler" in state:  # released (secure_mode): not its digest of the dataset
            state["sampler"].pop("dataset", None)
        rng = self.__dict__.pop("_checkpoint_rng", None)
        for path, ckpt in list(self._private_files.items()):
            if os.path.abspath(ckpt) == os.path.abspath(folder):  # being rewritten
                remove(path)
                del self._private_files[path]
        state["private_state"] = None
        state["privacy_arguments"] = recorded_settings(self.privacy)  # compared on resume
        # the runs composed before this one (the accountant's prior): public, as in the
        # report, so a resumed run's report still lists what its epsilon composes
        state["earlier_runs"] = list(self._earlier_runs)
        if secret:
            token = new_token()  # binds the two parts; reveals nothing
            kept = self.private_state_dir is not None
            state["private_state"] = {"token": token, "parts": sorted(secret), "kept": kept}
            if kept:
                path = private_state_path(self.private_state_dir, folder, token)
                save_private({"format": PRIVATE_FORMAT, "token": token, "rng": rng,
                              "steps": p.accountant.steps, **secret}, path)
                self._private_files[path] = folder
        torch.save(state, os.path.join(folder, _state_name()))

    def _refuse_resume_after_training(self, checkpoint) -> None:
        """A checkpoint's privacy state holds the history of its own run only: loading it
        into a trainer that already took steps (an earlier ``train()``, a trial of
        ``hyperparameter_search``) would replace this trainer's history with the
        checkpoint's, and restore keys whose noise an earlier run may already have added
        to other updates; refused before anything runs."""
        p = self.privacy_engine
        taken = 0 if p is None else p.accountant.steps
        if self._spent is None and not self._unbounded and taken == 0:
            return
        raise ConfigurationError(
            f"resume_from_checkpoint={checkpoint!r}: this DPTrainer already trained (epsilon "
            f"{self.epsilon():.4g} at delta={self.privacy.target_delta:g}), and the "
            "checkpoint's privacy state describes its own run only: resuming would drop "
            "the cost of this trainer's other steps from epsilon and replay the noise of "
            "steps it may have already taken on other updates (e.g. each trial of "
            "hyperparameter_search resuming the same checkpoint). Resume in a new DPTrainer "
            "(in practice a new process), or train() without resume_from_checkpoint")

    def _prune_private_states(self) -> None:
        """Delete the private state files this trainer wrote for checkpoints that no
        longer exist."""
        for path, ckpt in list(self._private_files.items()):
            if not os.path.isdir(ckpt):
                remove(path)
                del self._private_files[path]

    def _read_privacy_state(self, checkpoint: str) -> dict:
        """The whole state of ``checkpoint`` (its public part, and the secret part from
        ``private_state_dir``); refused, saying why, when a part is missing."""
        state = check_checkpoint_state(checkpoint, load_state_file(
            _privacy_state_path(checkpoint)))
        check_resumed_settings(checkpoint, state.pop("privacy_arguments", None), self.privacy)
        info = state.pop("private_state", None)
        if info is None:
            return state
        parts = ", ".join(info["parts"])
        why = ("resuming needs it: the run continues from it (the correlated noise from its "
               "last noises, the sampler and the noise from their keys), and restarting "
               "them mid-run would run a different mechanism than the one accounted")
        if not info["kept"]:
            raise ConfigurationError(
                f"checkpoint {checkpoint!r} was saved without a private_state_dir, so the secret "
                f"part of its privacy state ({parts}) was not kept; {why}. Start a new run, and "
                "give DPTrainer(private_state_dir=...) to make resumable checkpoints")
        if self.private_state_dir is None:
            raise ConfigurationError(
                f"checkpoint {checkpoint!r} keeps the secret part of its privacy state ({parts}) "
                f"in a private folder; {why}. Pass DPTrainer(private_state_dir=...) naming the "
                "folder it was written to")
        path = find_private_state(self.private_state_dir, checkpoint, info["token"])
        if path is None:  # looked up by the token: a renamed or copied folder resumes
            raise ConfigurationError(
                f"the secret part of checkpoint {checkpoint!r}'s privacy state ({parts}) "
                f"is not in private_state_dir={self.private_state_dir!r} (no file "
                f"*.{info['token']}.pt); {why}. Pass the private_state_dir the checkpoint "
                "was written with")
        secret = check_secret_state(path, checkpoint, load_state_file(path),
                                    info, PRIVATE_FORMAT)
        state.update({k: secret[k] for k in info["parts"]}, rng=secret.get("rng"))
        return state

    def _privacy_state(self, state: dict) -> dict:
        """The saved privacy state as make_private(resume=) loads it."""
        state = dict(join_users(state))
        state.pop("rng", None)  # the global generators': restored by _load_rng_state
        state.pop("earlier_runs", None)  # the report's (this trainer had none)
        # the model and the optimizer are the Trainer's (loaded from the same checkpoint)
        state["model"] = self.model.state_dict()
        state["optimizer"] = self.optimizer.state_dict()
        return state


def _private_copy(args):
    """A copy of the user's TrainingArguments with what DP-SGD needs
    (:func:`_private_settings`)."""
    return _private_settings(copy.copy(args), stacklevel=4)


def _private_settings(a, stacklevel: int = 2):
    """Set on the trainer's TrainingArguments ``a`` (its own copy) what DP-SGD needs: no
    clipping of the averaged gradient (per-example clipping replaces it), no batch
    skipping on resume (the sampler resumes its own position), no token counting (private
    sequence lengths); again at each run (hyperparameter_search's trials set them)."""
    a.max_grad_norm = 0.0
    a.ignore_data_skip = True
    if getattr(a, "include_num_input_tokens_seen", "no") not in ("no", False, None):
        warnings.warn("include_num_input_tokens_seen is ignored by DPTrainer: the number of "
                      "tokens trained on depends on private sequence lengths and would be "
                      "released un-noised", PrivacyLeakWarning, stacklevel=stacklevel)
        a.include_num_input_tokens_seen = "no"
    return a


def _unwrap(model):
    """The transformers model inside ``torch.compile``'s wrapper (``_orig_mod``:
    ``TrainingArguments(torch_compile=True)``) and peft wrappers (``get_base_model``)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        if inner is None or inner is model:
            return model
        model = inner


@functools.cache
def _tasks_by_class_name() -> dict[str, frozenset[str]]:
    """transformers class name -> the tasks of :data:`_TASK_MAPPINGS` listing it."""
    from transformers.models.auto import modeling_auto

    out: dict[str, set[str]] = {}
    for task, mapping in (*_TASK_MAPPINGS.items(), *_MORE_MAPPINGS):
        for names in getattr(modeling_auto, mapping).values():
            for name in (names,) if isinstance(names, str) else names:
                out.setdefault(name, set()).add(task)
    return {k: frozenset(v) for k, v in out.items()}


def _model_tasks(cls: type) -> frozenset[str]:
    """The tasks of the nearest transformers class in ``cls``'s MRO listed in an
    auto-model mapping (empty for a class with none: a custom model)."""
    table = _tasks_by_class_name()
    c = first_in_mro(cls, lambda c: c.__module__.startswith("transformers.")
                     and c.__name__ in table)
    return frozenset() if c is None else table[c.__name__]


def _state_name() -> str:
    """``privlearn_privacy.pt``; ``privlearn_privacy.rank<r>.pt`` for rank ``r`` of a
    multi-process run (each rank's sampler and noise have their own keys)."""
    from privlearn.torch.distributed import world_info

    rank, world = world_info()
    if world == 1:
        return PRIVACY_STATE_NAME
    stem, ext = os.path.splitext(PRIVACY_STATE_NAME)
    return f"{stem}.rank{rank}{ext}"


def _privacy_state_path(checkpoint: str) -> str:
    """The privacy state file of this process in ``checkpoint``; refused when there is
    none, or when it was saved by another number of processes."""
    from privlearn.torch.distributed import world_info

    path = os.path.join(checkpoint, _state_name())
    stem, ext = os.path.splitext(PRIVACY_STATE_NAME)
    ranks = glob.glob(os.path.join(glob.escape(str(checkpoint)), f"{stem}.rank*{ext}"))
    saved = len(ranks) or int(os.path.isfile(os.path.join(checkpoint, PRIVACY_STATE_NAME)))
    world = world_info()[1]
    if saved and saved != world:  # one state per process of the run that saved (every
        raise ConfigurationError(  # rank sees them all: refused on every rank alike)
            f"checkpoint {checkpoint!r} was written by a run of {saved} process(es) (its "
            f"privacy states: {saved} file(s) {stem}*{ext}), and this run has "
            f"{world}: each process continues its own sampler and noise, so the "
            "number of processes must stay the same. Resume with as many processes as the "
            "run that wrote it (torchrun --nproc_per_node), or start a new run")
    if not os.path.isfile(path):
        raise ParameterValueError(
            f"checkpoint {checkpoint!r} has no {_state_name()}: it was not written "
            "by DPTrainer, and resuming from it would lose the privacy cost of the steps "
            "already taken. Resume from a DPTrainer checkpoint, or start a new run")
    return path
