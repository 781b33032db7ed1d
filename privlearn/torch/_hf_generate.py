"""Generated predictions for :class:`~privlearn.torch.hf.DPTrainer` (``Seq2SeqTrainer``'s
``predict_with_generate``).

With ``Seq2SeqTrainingArguments(predict_with_generate=True)``, ``evaluate`` and
``predict`` return the token ids ``model.generate(...)`` produces for each example (padded
to the generation's maximum length), for metrics such as ROUGE or BLEU on generated text;
``max_length``, ``num_beams`` and other ``generate`` arguments are taken as
``Seq2SeqTrainer`` takes them (the call's, else ``generation_max_length`` and
``generation_num_beams``, else the model's ``generation_config``, which
``Seq2SeqTrainingArguments.generation_config`` replaces when the trainer is built). The
loss of a batch with labels is the one evaluation reports without generation (the mean
of per-example losses).

Generation is evaluation: it runs in eval mode without gradients, so the engine records
nothing, takes no step and spends no budget. Its outputs are statistics of the
evaluation set, which the accounting does not cover (a ``PrivacyLeakWarning`` when that
set holds training examples, as for any evaluation).
"""

from __future__ import annotations

import torch

from privlearn.errors import ParameterValueError

__all__ = ["GenerationPredictions", "use_generation_config"]


def use_generation_config(trainer) -> None:
    """Replace the model's ``generation_config`` by ``args.generation_config`` when set
    (``Seq2SeqTrainer.__init__``'s handling)."""
    given = getattr(trainer.args, "generation_config", None)
    if given is not None:
        from transformers import Seq2SeqTrainer

        trainer.model.generation_config = Seq2SeqTrainer.load_generation_config(given)


def _with_defaults(args, gen_kwargs: dict) -> dict:
    """The call's ``generate`` arguments, with ``generation_max_length`` and
    ``generation_num_beams`` of ``args`` where the call sets none."""
    gen_kwargs = dict(gen_kwargs)
    max_length = getattr(args, "generation_max_length", None)
    if (
        gen_kwargs.get("max_length") is None
        and gen_kwargs.get("max_new_tokens") is None
        and max_length is not None
    ):
        gen_kwargs["max_length"] = max_length
    beams = getattr(args, "generation_num_beams", None)
    if gen_kwargs.get("num_beams") is None and beams is not None:
        gen_kwargs["num_beams"] = beams
    return gen_kwargs


class GenerationPredictions:
    """``evaluate``, ``predict`` and ``prediction_step`` of ``Seq2SeqTrainer`` (taking
    ``generate`` keyword arguments), for DPTrainer (placed after the privacy warnings of
    :class:`~privlearn.torch._hf_eval.EvaluationWarnings` in its bases)."""

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs
    ):
        """``Seq2SeqTrainer.evaluate``: ``gen_kwargs`` (``max_length``, ``num_beams``,
        ...) are passed to ``model.generate`` when ``args.predict_with_generate``."""
        self._gen_kwargs = _with_defaults(self.args, gen_kwargs)
        return super().evaluate(
            eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )

    def predict(
        self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **gen_kwargs
    ):
        """``Seq2SeqTrainer.predict``: the predictions are the generated token ids when
        ``args.predict_with_generate`` (``gen_kwargs`` passed to ``model.generate``)."""
        self._gen_kwargs = _with_defaults(self.args, gen_kwargs)
        return super().predict(
            test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        """``Seq2SeqTrainer.prediction_step``: ``(loss, generated ids, labels)``, the ids
        and labels padded to the generation's maximum length; the Trainer's step without
        ``predict_with_generate`` or when only the loss is wanted."""
        if not getattr(self.args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        from transformers.distributed.fsdp import is_fsdp_managed_module
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        generator = self.accelerator.unwrap_model(self.model)
        if not callable(getattr(generator, "generate", None)):
            generator = getattr(generator, "_orig_mod", generator)  # torch.compile's wrapper
        if not callable(getattr(generator, "generate", None)):
            raise ParameterValueError(
                f"predict_with_generate=True needs a model with a generate method; "
                f"{type(generator).__name__} has none. Set predict_with_generate=False to "
                "evaluate on the model's logits"
            )
        has_labels = "labels" in inputs
        inputs = self._prepare_inputs(inputs)
        if not gen_kwargs:
            gen_kwargs = dict(getattr(self, "_gen_kwargs", {}))
        for k in ("num_beams", "max_length"):
            if k in gen_kwargs and gen_kwargs[k] is None:
                gen_kwargs.pop(k)
        gen_kwargs.setdefault(
            "synced_gpus", is_deepspeed_zero3_enabled() or is_fsdp_managed_module(self.model)
        )
        user = self.privacy.user_column
        generation_inputs = {k: v for k, v in inputs.items() if k != user}
        labels = generation_inputs.get("labels")
        if (
            labels is not None
            and getattr(generation_inputs.get("decoder_input_ids"), "shape", None) == labels.shape
        ):  # built from the labels
            for k in ("decoder_input_ids", "decoder_attention_mask"):
                generation_inputs.pop(k, None)
        with torch.no_grad():
            tokens = generator.generate(**generation_inputs, **gen_kwargs)
        config = generator.generation_config
        if config._from_model_config:  # as Seq2SeqTrainer: not rebuilt at every batch
            config._from_model_config = False
        config.update(**config._get_default_generation_params(), defaults_only=True)
        loss = None
        if has_labels:  # the loss evaluation reports without generation
            loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys)
        if self.args.prediction_loss_only:
            return loss, None, None
        tokens = self._pad_to(generator, tokens, config)
        labels = self._pad_to(generator, inputs["labels"], config) if has_labels else None
        return loss, tokens, labels

    def _pad_to(self, model, tensor: torch.Tensor, config) -> torch.Tensor:
        """``tensor`` right-padded with the pad token (or the end token where the
        tokenizer has no pad) to the generation's ``max_length`` columns (else to
        ``max_new_tokens + 1``), as ``Seq2SeqTrainer`` pads."""
        width = config.max_length
        if tensor.shape[-1] >= width and config.max_new_tokens is not None:
            width = config.max_new_tokens + 1
        if tensor.shape[-1] >= width:
            return tensor
        tok = self.processing_class
        if tok is not None and hasattr(tok, "pad_token_id"):
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        else:
            pad = getattr(model.config, "pad_token_id", None)
        if pad is None:
            raise ParameterValueError(
                "predict_with_generate pads the generated ids and labels to the maximum "
                "length, which needs a pad token: the tokenizer (processing_class) and the "
                "model's config.pad_token_id have none (got None). Set "
                "model.config.pad_token_id, e.g. to the end token's id"
            )
        out = torch.full((tensor.shape[0], width), pad, dtype=tensor.dtype, device=tensor.device)
        out[:, : tensor.shape[-1]] = tensor
        return out
