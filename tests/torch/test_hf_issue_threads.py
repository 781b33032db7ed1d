"""Scenarios of users' reports on DP fine-tuning of Hugging Face models, rebuilt on
config-initialised tiny models (no downloads) and checked against a ground truth: a
naive loop of batches of one, each example's gradient clipped and summed."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf_trainer import B, _args, _llama, _recording_collate, _TextSet  # noqa: E402

from privlearn.torch import per_sequence_cross_entropy  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402


def _naive_clipped_sum(ref, batch, params, c):
    """The sum over the batch's examples of each one's gradient (a batch of one),
    clipped to norm ``c``."""
    total = [torch.zeros_like(q) for q in params]
    for i in range(batch["input_ids"].shape[0]):
        out = ref(
            input_ids=batch["input_ids"][i : i + 1],
            attention_mask=batch["attention_mask"][i : i + 1],
        )
        loss = per_sequence_cross_entropy(out.logits, batch["labels"][i : i + 1], shift=True)
        g = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in g)).item()
        assert norm > c  # every example clipped: the bound is what is compared
        for t, x in zip(total, g, strict=True):
            t += (c / norm) * x
    return total


def _one_step_is_the_naive_clipped_loop(tmp_path, model, c: float, nonzero: bool = True):
    """One DPTrainer step of ``model`` (sigma = 0, bound ``c``, SGD at learning rate 1)
    equals the step of the naive clipped loop (batch-of-one passes, each gradient clipped
    to ``c``, summed, divided by B) on the batch the trainer drew; ``nonzero``: every
    trainable tensor's clipped sum is non-zero. Returns the trainer."""
    ref = copy.deepcopy(model)
    seen = []
    lr = 1.0
    params = [q for q in model.parameters() if q.requires_grad]
    tr = DPTrainer(
        model=model,
        args=_args(tmp_path, max_steps=1, learning_rate=lr),
        train_dataset=_TextSet(),
        data_collator=_recording_collate(seen),
        optimizers=(torch.optim.SGD(params, lr=lr), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=c, seed=3),
    )
    tr.train()
    mine = [q for q in ref.parameters() if q.requires_grad]
    total = _naive_clipped_sum(ref, seen[-1], mine, c)
    for a, b, t in zip(params, mine, total, strict=True):
        if nonzero:
            assert t.abs().max() > 0
        torch.testing.assert_close(a.detach(), b.detach() - lr * t / B, rtol=1e-4, atol=1e-8)
    return tr


def test_dora_adapters_train_as_the_naive_clipped_loop(tmp_path):
    """microsoft/dp-transformers#30 (peft's LoRA in DP fine-tuning) and
    meta-pytorch/opacus#820 (peft adapters silently mis-updated), with peft's DoRA
    (``LoraConfig(use_dora=True)``): DoRA calls the adapters' ``lora_A``/``lora_B`` a
    second time on an identity matrix to form the weight norm, and the step died inside
    the clipped sum (a RuntimeError: an in-place add into a view of the gradient
    buffer, made without autograd, while the Trainer's ``optimizer.step()`` ran with
    it). sigma = 0, a bound below every example's norm, SGD: the step is the naive
    clipped loop's, the magnitude vectors included."""
    model = peft.get_peft_model(
        _llama(),
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            use_dora=True,
            task_type="CAUSAL_LM",
        ),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for q in model.parameters():
            if q.requires_grad:
                q.add_(torch.randn_like(q) * 0.1)
    assert any("magnitude" in n for n, q in model.named_parameters() if q.requires_grad)
    tr = _one_step_is_the_naive_clipped_loop(tmp_path, model, 1e-3, nonzero=False)
    assert tr.privacy_engine.accountant.steps == 1


def _perturbed(model, seed=1):
    """``model`` with its trainable parameters moved off their initial values."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for q in model.parameters():
            if q.requires_grad:
                q.add_(torch.randn_like(q) * 0.1)
    return model


def test_prefix_tuning_trains_as_the_naive_clipped_loop(tmp_path):
    """microsoft/dp-transformers#30 (peft methods in DP fine-tuning): peft's prefix
    tuning (a learned key/value prefix in every layer, computed per example) is what the
    refusal of soft prompts points to. sigma = 0, a bound below every example's norm,
    SGD: the step is the naive clipped loop's."""
    model = _perturbed(
        peft.get_peft_model(
            _llama(), peft.PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM")
        )
    )
    _one_step_is_the_naive_clipped_loop(tmp_path, model, 1e-3)


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning"])
def test_soft_prompts_repeated_over_the_batch_are_refused_before_training(tmp_path, kind):
    """microsoft/dp-transformers#30 (peft methods in DP fine-tuning): peft's prompt
    tuning and P-tuning compute the soft prompt for one row and ``repeat`` it over the
    batch, so its gradient is the batch's sum. The first step died with a RuntimeError
    inside peft's forward (the engine's one-row-to-batch widening, repeated again by
    peft); it is now refused with a ConfigurationError naming peft_type and the methods
    that train, before any batch is drawn."""
    from privlearn.errors import ConfigurationError

    cfg = (
        peft.PromptTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM")
        if kind == "prompt_tuning"
        else peft.PromptEncoderConfig(
            num_virtual_tokens=3, encoder_hidden_size=8, task_type="CAUSAL_LM"
        )
    )
    model = peft.get_peft_model(_llama(), cfg)
    seen = []
    with pytest.raises(ConfigurationError, match=r"peft_type='(PROMPT_TUNING|P_TUNING)'.*Prefix"):
        tr = DPTrainer(
            model=model,
            args=_args(tmp_path, max_steps=1),
            train_dataset=_TextSet(),
            data_collator=_recording_collate(seen),
            privacy=PrivacyArguments(noise_multiplier=1.0, seed=3),
        )
        tr.train()
    assert len(seen) <= 2  # at most make_private's collation of example 0: no batch drawn


@pytest.mark.parametrize(("accumulate", "chunk"), [(1, 8), (4, 4)])
def test_noise_of_a_step_is_once_per_logical_batch_at_the_accounted_scale(
    tmp_path, accumulate, chunk
):
    """huggingface/transformers#12920 and meta-pytorch/opacus#143 (Opacus' virtual
    steps under the Trainer's gradient accumulation: noise is to be drawn once per
    logical batch, not per micro-batch). One step of ``optim="sgd"``, lr = 1, a bound so
    small that the clipped mean is negligible next to the noise: the parameters move by
    Gaussian noise of standard deviation sigma * C / (expected logical batch) -- twice
    that if the noise were drawn per micro-batch of four, four times if it were scaled
    by the micro-batch."""
    sigma, c = 4.0, 1e-4
    model = _llama()
    before = [q.detach().clone() for q in model.parameters()]
    tr = DPTrainer(
        model=model,
        args=_args(
            tmp_path,
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            gradient_accumulation_steps=accumulate,
            per_device_train_batch_size=chunk,
        ),
        train_dataset=_TextSet(),
        privacy=PrivacyArguments(noise_multiplier=sigma, max_grad_norm=c, seed=5),
    )
    tr.train()
    moved = torch.cat(
        [(q.detach() - b).flatten() for q, b in zip(model.parameters(), before, strict=True)]
    ).double()
    assert moved.numel() > 5000  # the standard error of the ratio is about 1%
    ratio = moved.std().item() / (sigma * c / (accumulate * chunk))
    assert abs(ratio - 1) < 0.05
    assert tr.privacy_engine.accountant.steps == 1


def _container_adapter(kind):
    """A peft adapter whose trained tensors sit in ``nn.ParameterDict`` entries read by
    the adapter layer's own forward."""
    if kind == "lora_embedding":  # LoRA on the input embedding (new-token recipes)
        cfg = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], task_type="CAUSAL_LM"
        )
    elif kind == "ia3":
        cfg = peft.IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"],
            feedforward_modules=["down_proj"],
            task_type="CAUSAL_LM",
        )
    elif kind == "trainable_tokens":  # a few rows of the embedding trained (new tokens)
        cfg = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj"],
            trainable_token_indices={"embed_tokens": [1, 2, 3]},
            task_type="CAUSAL_LM",
        )
    else:
        cfg = peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return _perturbed(peft.get_peft_model(_llama(), cfg))


@pytest.mark.parametrize("kind", ["lora_embedding", "trainable_tokens", "ia3", "vera"])
def test_adapters_kept_in_parameter_dicts_train_as_the_naive_clipped_loop(tmp_path, kind):
    """microsoft/dp-transformers#30 and awslabs/fast-differential-privacy#28 (peft
    adapters under DP: 'attach the DP engine to the peft model'): LoRA on an embedding,
    trainable token rows, IA3 and VeRA keep their tensors in ``nn.ParameterDict``
    entries that the adapter layer reads in its forward; the first step was refused
    ('used outside their layers'). The adapter layer's unit now holds them: sigma = 0,
    a bound below every example's norm, SGD: the step is the naive clipped loop's."""
    model = _container_adapter(kind)
    _one_step_is_the_naive_clipped_loop(tmp_path, model, 1e-4)
