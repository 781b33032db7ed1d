"""What :class:`~privlearn.torch.hf.DPTrainer` releases with a model, and what it refuses
before a run: the public privacy report written next to saved weights, the error for a
budget already spent, and the refusal of encoder-decoder models."""

from __future__ import annotations

from privlearn.errors import ConfigurationError, PrivacyBudgetExceededError

__all__ = ["refuse_encoder_decoder", "spent_budget_error"]


def spent_budget_error(p, epsilon: float) -> PrivacyBudgetExceededError:
    """The error for a ``train()`` whose engine ``p`` has no room left for one step under
    its ``max_epsilon`` (an earlier ``train()`` of the same trainer spent it); raised
    before the run draws a batch."""
    b = p.budget
    return PrivacyBudgetExceededError(
        f"max_epsilon={b.max_epsilon:g} at delta={b.delta:g} is spent: this trainer already "
        f"took {p.accountant.steps} step(s) (epsilon {epsilon:.4g}), and one more step "
        f"(noise_multiplier={p.noise_multiplier:.4g}, sampling rate {p.sampling_rate:.4g}) "
        "would exceed it; no batch was drawn. Release the model trained so far (its epsilon "
        "is the one above), or, if a larger budget is acceptable, train in a new DPTrainer "
        "with a larger max_epsilon and count both runs' epsilon yourself")


def refuse_encoder_decoder(model) -> None:
    """Refuse an encoder-decoder model (``config.is_encoder_decoder``: T5, BART,
    ``EncoderDecoderModel``, ...), before any step, saying what to use instead.

    Its decoder is fed from the labels (``decoder_input_ids``, the labels shifted right),
    which DPTrainer's per-example loss takes out of the batch; and these models compute
    tensors once for the whole batch that the engine cannot split per example (T5's
    relative attention bias embedding sees the ``(length, length)`` position grid, not
    one row per example, and BART's learned positions fail to reshape), so no per-example
    gradient, hence no clipping, exists for them."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) is not True:
        return
    raise ConfigurationError(
        f"{type(model).__name__} is an encoder-decoder model (config.is_encoder_decoder="
        "True: T5, BART, ...), which DPTrainer does not support: no task of "
        "PrivacyArguments(task=...) feeds its decoder (the decoder_input_ids built from the "
        "labels), and parts of it are computed once for the whole batch (T5's relative "
        "attention bias, BART's learned positions), so per-example gradients, hence "
        "per-example clipping, do not exist for them. For sequence-to-sequence training use "
        "a decoder-only model (GPT-2, Llama, ...) with PrivacyArguments(task='causal_lm'), "
        "source and target concatenated into one sequence and the source's labels set to "
        "-100; for classification, an encoder-only model (BERT, RoBERTa, ...) with "
        "task='sequence_classification'")
