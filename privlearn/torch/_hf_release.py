"""What :class:`~privlearn.torch.hf.DPTrainer` releases with a model, and what it refuses
before a run: the public privacy report written next to saved weights
(:data:`REPORT_NAME`), the error for a budget already spent, and the refusal of the
encoder-decoder models it cannot train exactly.

The report states the guarantee of the weights it sits next to: epsilon at the
accounted delta (:meth:`DPTrainer.epsilon`, every run of the trainer composed), the
accountant, and the mechanism of each run as the engine recorded it
(:meth:`PrivateTraining._mechanism <privlearn.torch.privacy_engine.PrivateTraining>`,
the settings a checkpoint's privacy state records and a resume compares, and the
accountant's history of the steps actually taken). It holds nothing else derived from
the data: no training set size, no seed or key, no loss.
"""

from __future__ import annotations

import json
import math
import os

from privlearn.errors import (
    ConfigurationError,
    PrivacyBudgetExceededError,
    UnsupportedModuleError,
)

__all__ = ["REPORT_FORMAT", "REPORT_NAME", "ReportOnSave", "privacy_report",
           "refuse_encoder_decoder", "report_segments", "run_description",
           "spent_budget_error",
           "write_privacy_report"]

#: The file :meth:`DPTrainer.save_model` writes next to the weights (so every checkpoint
#: folder and what ``push_to_hub`` uploads have one).
REPORT_NAME = "privacy_report.json"
REPORT_FORMAT = "privlearn.privacy_report/1"
#: Entries of the engine's mechanism record left out of the report: the training set's
#: size (data-dependent; the sampling rate is what the guarantee uses), the process's rank
#: (not a property of the release), and the planned sigma, C and q (replaced by those the
#: steps actually used, from the accountant's history).
_LEFT_OUT = frozenset({"dataset_size", "rank", "noise_multiplier", "max_grad_norm",
                       "sampling_rate"})


def report_segments(segments) -> list[dict]:
    """The accountant's ``segments`` (:class:`~privlearn.torch.accountant.Segment`) as
    the report lists them: consecutive segments with the same noise multiplier and
    sampling rate -- the same privacy cost per step -- run-length merged into one entry
    with their total ``steps``, so a run of adaptive clipping, whose bound changes every
    step (a new segment each), takes one entry per change of the noise or the rate, not
    one per step. ``max_grad_norm`` is the bound of the entry's last step; where its steps
    used different bounds, ``max_grad_norm_range`` is ``[min, max]`` over them. The
    composition the entries describe is that of the segments: each step's privacy
    depends on the noise multiplier (noise std / clipping bound) and the rate only."""
    out: list[dict] = []
    lo = hi = None
    for s in segments:
        if out and (out[-1]["noise_multiplier"], out[-1]["sampling_rate"]) == (
                s.noise_multiplier, s.sampling_rate):
            e = out[-1]
            e["steps"] += s.steps
            e["max_grad_norm"] = s.max_grad_norm
            lo, hi = min(lo, s.max_grad_norm), max(hi, s.max_grad_norm)
        else:
            out.append({"noise_multiplier": s.noise_multiplier,
                        "sampling_rate": s.sampling_rate, "max_grad_norm": s.max_grad_norm,
                        "steps": s.steps})
            lo = hi = s.max_grad_norm
        if lo != hi:
            out[-1]["max_grad_norm_range"] = [lo, hi]
    return out


def run_description(p) -> dict:
    """The public description of one run's mechanism, from its engine ``p`` (a
    :class:`~privlearn.torch.privacy_engine.PrivateTraining`): the steps taken with the
    noise multiplier, sampling rate and clipping bound of the last step (``segments``:
    each run of steps of the same noise multiplier and sampling rate, from the
    accountant's history: :func:`report_segments`), the sampling, its
    neighbouring relation and subsampling scheme, and the engine's other mechanism
    settings (noise kind, clipping, loss reduction, privacy unit, ...)."""
    segments = p.accountant.segments
    last = segments[-1] if segments else None
    mech = p._mechanism()  # what checkpoints record (one source for both)
    out = {
        "steps": p.accountant.steps,
        "noise_multiplier": (p.noise_multiplier if last is None
                             else last.noise_multiplier),
        "sampling_rate": p.sampling_rate if last is None else last.sampling_rate,
        "max_grad_norm": p.max_grad_norm if last is None else last.max_grad_norm,
        "sampling": p.sampling,
        "scheme": p.accountant.scheme,
        "neighbouring": p.neighbouring,
        **{k: v for k, v in mech.items() if k not in _LEFT_OUT and k != "sampling"},
        "segments": report_segments(segments),
    }
    return out


def privacy_report(trainer) -> dict:
    """The public privacy report of what ``trainer`` (a DPTrainer) trained so far.

    ``epsilon`` is :meth:`DPTrainer.epsilon` at ``delta`` (``target_delta``): the
    composition of every run of the trainer on its training set (Abadi et al. 2016,
    Sec. 3.1; the numbers of the certified ``accountant``), a string ``"inf"`` once a run
    took a step without noise. ``mechanism`` describes the latest run
    (:func:`run_description`; ``None`` before any), ``earlier_runs`` the runs composed
    before it (``model_init`` runs, ``hyperparameter_search`` trials). Non-finite
    numbers are written as the strings ``"inf"``/``"nan"`` (strict JSON)."""
    from privlearn import __version__

    p = trainer.privacy_engine
    report = {
        "format": REPORT_FORMAT,
        "privlearn_version": __version__,
        "epsilon": trainer.epsilon(),
        "delta": trainer.privacy.target_delta,
        "accountant": trainer.privacy.accountant if p is None else p.accountant.accountant,
        "mechanism": None if p is None else run_description(p),
        "earlier_runs": list(trainer._earlier_runs),
    }
    return _finite(report)


def write_privacy_report(trainer, folder) -> str:
    """Write :func:`privacy_report` as ``folder/privacy_report.json``; returns the path."""
    path = os.path.join(folder, REPORT_NAME)
    text = json.dumps(privacy_report(trainer), indent=2, allow_nan=False)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return path


def _finite(x):
    """``x`` with non-finite floats as strings and tuples as lists (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf", "-inf", "nan"
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


class ReportOnSave:
    """Trainer mixin: :meth:`save_model` writes the privacy report next to the weights."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """``Trainer.save_model``, and next to the weights (on the process that writes
        them, ``TrainingArguments.should_save``: the main process) the public privacy
        report ``privacy_report.json`` (:func:`privacy_report`): epsilon at
        ``target_delta``, the accountant and the mechanism of every run. Checkpoints and
        ``push_to_hub`` save through this method, so each released folder has one."""
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            folder = self.args.output_dir if output_dir is None else output_dir
            os.makedirs(folder, exist_ok=True)
            write_privacy_report(self, folder)


def spent_budget_error(p, epsilon: float) -> PrivacyBudgetExceededError:
    """The error for a ``train()`` whose engine ``p`` has no room left for one step under
    its ``max_epsilon`` (an earlier ``train()`` of the same trainer, or the run of the
    checkpoint it resumes, spent it); raised before the run draws a batch."""
    b = p.budget
    return PrivacyBudgetExceededError(
        f"{b.cap_name} at delta={b.delta:g} is spent: "
        f"{p.accountant.steps} step(s) were already taken (epsilon {epsilon:.4g}: an "
        "earlier train() of this trainer, or the run of the checkpoint resumed), and one "
        "more step "
        f"(noise_multiplier={p.noise_multiplier:.4g}, sampling rate {p.sampling_rate:.4g}) "
        "would exceed it; no batch was drawn. Stop here: the model trained so far is "
        "covered by the epsilon above; training further needs a larger max_epsilon, "
        "planned before the run's first step")


def refuse_encoder_decoder(model, task: str | None, model_tasks: frozenset) -> None:
    """Refuse an encoder-decoder model (``config.is_encoder_decoder``: BART, T5, ...)
    that DPTrainer cannot train exactly, before any step, saying what to do instead.

    Supported: a sequence-to-sequence LM (``task="seq2seq_lm"``, given or read from
    ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``: BART, mBART, Marian, T5, ...), its
    decoder fed with the labels shifted right and each example's loss the mean over its
    own target tokens. Refused: another task (``BartForSequenceClassification``, a
    seq2seq model trained as ``masked_lm``), and a trainable T5-style relative attention
    bias (the ``nn.Embedding`` ``relative_attention_bias``, looked up once on the
    ``(query, key)`` position grid for the whole batch and broadcast over its examples, so
    no per-example gradient of it is ever formed, hence no clipping). With it frozen
    (or LoRA adapters only) the rest of T5 trains with exact per-example gradients."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) is not True:
        return
    name = type(model).__name__
    if task != "seq2seq_lm" and not (task is None and "seq2seq_lm" in model_tasks):
        raise ConfigurationError(
            f"{name} is an encoder-decoder model (config.is_encoder_decoder=True), which "
            "DPTrainer trains only as a sequence-to-sequence LM, task='seq2seq_lm' (BART, "
            "mBART, Marian, T5 ...ForConditionalGeneration: each example's loss the mean "
            f"over its own target tokens); got task={task!r}"
            + ("" if task is not None else f" ({name} is no seq2seq LM of transformers' "
               "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)")
            + ". Use a ...ForConditionalGeneration model with task='seq2seq_lm' (or None); "
            "for classification, an encoder-only model (BERT, RoBERTa, ...) with "
            "task='sequence_classification'")
    biased = sorted(n for n, m in model.named_modules()
                    if getattr(m, "has_relative_attention_bias", False) is True
                    and any(p.requires_grad for p in
                            getattr(getattr(m, "relative_attention_bias", None),
                                    "parameters", tuple)()))
    if biased:
        raise UnsupportedModuleError(
            f"{name} has a trainable relative attention bias ({len(biased)} table(s): "
            f"{', '.join(n + '.relative_attention_bias' for n in biased)}): each is looked "
            "up once on the (query, key) position grid for the whole batch and broadcast "
            "over its examples, so its per-example gradient is never formed and cannot be "
            "clipped. Freeze it before building the trainer (for m in model.modules(): "
            "if hasattr(m, 'relative_attention_bias'): "
            "m.relative_attention_bias.requires_grad_(False)); the rest of the model then "
            "trains with exact per-example gradients. Or train LoRA adapters only (peft), "
            "or use a model with absolute positions (BART, mBART, Marian)")
