"""DPTrainer (privlearn.torch.hf): a Hugging Face Trainer trained with DP-SGD.

Small config-initialised Llama models (no weights can be downloaded here). Checks: the
update equals the per-example-mean gradient of the batch trained on, the reported epsilon
is the accountant's for the steps taken, resume from a checkpoint gives the same epsilon
and the same parameters, training stops at the budget, bad set-ups are refused."""

from __future__ import annotations

import copy
import math
import os
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import PrivacyBudgetExceededError  # noqa: E402
from privlearn.torch import per_sequence_cross_entropy  # noqa: E402
from privlearn.torch.accountant import PrivacyBudgetWarning  # noqa: E402
from privlearn.torch.hf import (  # noqa: E402
    PRIVACY_STATE_NAME,
    DPTrainer,
    PrivacyArguments,
    expand_position_ids,
)

V, T, N, B = 48, 10, 64, 8


class _TextSet(torch.utils.data.Dataset):
    """Token sequences with right padding (labels -100 on padding)."""

    def __init__(self, n=N, classify=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, V, (n, T), generator=g)
        lengths = torch.randint(4, T + 1, (n,), generator=g)
        self.mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.cls = torch.randint(0, 3, (n,), generator=g)
        self.classify = classify

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        labels = self.cls[i] if self.classify else self.ids[i].masked_fill(self.mask[i] == 0,
                                                                           -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def _recording_collate(seen: list):
    """Hugging Face's default collator, keeping a copy of every batch it makes in
    ``seen`` (the batches the Trainer's private loader drew, for a naive replay)."""
    def collate(feats):
        batch = transformers.default_data_collator(feats)
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch
    return collate


def _llama(classify=False, seed=0, dropout=0.0):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   pad_token_id=0, num_labels=3, attention_dropout=dropout)
    torch.manual_seed(seed)
    cls = (transformers.LlamaForSequenceClassification if classify
           else transformers.LlamaForCausalLM)
    return cls(cfg).float()


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=B, max_steps=4,
                learning_rate=0.05, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, lr_scheduler_type="constant", disable_tqdm=True,
                dataloader_pin_memory=False)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _eps(sigma, steps, q=B / N, delta=1e-5):
    return compose(subsample(Gaussian(sigma), rate=q), steps=steps).epsilon(delta)


def test_empty_batches_of_a_batch_encoding_collator_train_on_nothing(tmp_path):
    """A collator returning a ``BatchEncoding`` (as DataCollatorWithPadding does): an
    empty Poisson batch was example 0's batch of one, and the step then failed (a
    ZeroDivisionError). Empty batches now have zero rows and take the noise-only step."""

    class Counting(DPTrainer):
        sizes: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.sizes.append(inputs["labels"].shape[0])
            return super().training_step(model, inputs, num_items_in_batch)

    def collate(rows):
        return transformers.BatchEncoding({k: torch.stack([r[k] for r in rows])
                                           for k in rows[0]})

    trainer = Counting(model=_llama(classify=True),
                       args=_args(tmp_path, per_device_train_batch_size=1, max_steps=12),
                       train_dataset=_TextSet(n=8, classify=True), data_collator=collate,
                       privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0,
                                                seed=0))
    trainer.train()
    assert 0 in trainer.sizes and len(trainer.sizes) == 12
    assert trainer.privacy_engine.accountant.steps == 12


def test_a_second_trainer_on_a_model_the_first_still_holds(tmp_path):
    """Two DPTrainers over one model (a notebook cell re-run): the second's first step
    died with a KeyError (two engines on one model). It is refused before training,
    naming the way out, which trains."""
    from privlearn.errors import ConfigurationError

    model = _llama(classify=True)

    def trainer():
        return DPTrainer(model=model, args=_args(tmp_path, max_steps=2),
                         train_dataset=_TextSet(n=32, classify=True),
                         privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0,
                                                  seed=0))

    first = trainer()
    first.train()
    second = trainer()
    with pytest.raises(ConfigurationError, match=r"trainer\.privacy_engine\.detach\(\)"):
        second.train()
    first.privacy_engine.detach()
    second.train()
    assert second.privacy_engine.accountant.steps == 2


def test_a_compute_loss_of_ones_own_is_warned_about(tmp_path):
    """A subclass's compute_loss is not checked: a token-level mean over the batch (each
    example weighted by its share of the batch's tokens) trained silently. Building such
    a trainer warns, saying what the loss must be; DPTrainer's own does not."""

    class TokenMean(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            logits = model(**inputs).logits[:, :-1]
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1))

    kw = dict(args=_args(tmp_path), train_dataset=_TextSet(),
              privacy=PrivacyArguments(noise_multiplier=1.0))
    with pytest.warns(UserWarning, match=r"TokenMean\.compute_loss overrides.*token-level"):
        TokenMean(model=_llama(), **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DPTrainer(model=_llama(), **kw)
    assert not [w for w in caught if "compute_loss" in str(w.message)]


def test_update_is_clipped_per_example_mean(tmp_path):
    """sigma = 0, no clipping, SGD: one step equals lr / (q N) times the sum of the
    per-sequence losses' gradients over the Poisson batch it drew (causal LM loss,
    padding excluded) -- the Trainer's loss is per example and its loader is the
    DP one."""
    model = _llama()
    ref = copy.deepcopy(model)
    seen = []

    collate = _recording_collate(seen)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tr = DPTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=_TextSet(),
                   data_collator=collate, optimizers=(opt, None),
                   privacy=PrivacyArguments(noise_multiplier=0.0,
                                            max_grad_norm=float("inf"), seed=3))
    tr.train()
    # make_private collates example 0 once and twice (the check that the examples are on
    # dimension 0), then the loader collates the one step's batch
    assert [b["input_ids"].shape[0] for b in seen[:-1]] == [1, 2]
    batch = seen[-1]
    assert batch["input_ids"].shape[0] > 0
    out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    per_sequence_cross_entropy(out.logits, batch["labels"], shift=True,
                               reduction="sum").backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        expect = b.detach() - 0.05 * b.grad / B
        torch.testing.assert_close(a.detach(), expect, rtol=1e-4, atol=1e-6, msg=name)
    assert tr.privacy_engine.accountant.steps == 1


def _lora_classifier():
    """LoRA on the attention of a frozen sequence classifier whose head is trained whole
    (peft's modules_to_save: a trainable copy of ``score``), the adapters' B moved off 0."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(classify=True), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        task_type="SEQ_CLS"))
    with torch.no_grad():
        for n, q in model.named_parameters():
            if "lora_B" in n:
                q.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("case", ["gradient_checkpointing", "lora_modules_to_save"])
def test_one_step_equals_the_naive_clipped_loop(tmp_path, case):
    """sigma = 0, a clipping bound below every example's norm, SGD: one step moves the
    trainable parameters by lr / (q N) times the sum of the per-example gradients, each
    computed alone (batch of one) and clipped -- with TrainingArguments'
    gradient_checkpointing (recomputed forwards) and with a peft LoRA model whose head is
    a modules_to_save copy (both trainable, the base frozen)."""
    classify = case == "lora_modules_to_save"
    model = _lora_classifier() if classify else _llama()
    ref = copy.deepcopy(model)
    seen = []

    collate = _recording_collate(seen)

    c, lr = 1e-3, 1.0
    params = [q for q in model.parameters() if q.requires_grad]
    tr = DPTrainer(model=model, args=_args(tmp_path, max_steps=1, learning_rate=lr,
                                           gradient_checkpointing=not classify),
                   train_dataset=_TextSet(classify=classify), data_collator=collate,
                   optimizers=(torch.optim.SGD(params, lr=lr), None),
                   privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=c, seed=3))
    tr.train()
    batch = seen[-1]
    mine = [q for q in ref.parameters() if q.requires_grad]
    total = [torch.zeros_like(q) for q in mine]
    for i in range(batch["input_ids"].shape[0]):
        out = ref(input_ids=batch["input_ids"][i:i + 1],
                  attention_mask=batch["attention_mask"][i:i + 1])
        labels = batch["labels"][i:i + 1]
        loss = (torch.nn.functional.cross_entropy(out.logits, labels) if classify
                else per_sequence_cross_entropy(out.logits, labels, shift=True))
        g = torch.autograd.grad(loss, mine)
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in g)).item()
        assert norm > c  # every example clipped: the bound is what is compared
        for t, x in zip(total, g, strict=True):
            t += (c / norm) * x
    assert batch["input_ids"].shape[0] > 0
    for a, b, t in zip(params, mine, total, strict=True):
        torch.testing.assert_close(a.detach(), b.detach() - lr * t / B, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_give_each_example_its_own_loss(tmp_path, side):
    """GPT-2 (absolute positions) with a collator padding to the batch's longest. Left
    padding: the model numbered the positions of the padded batch, and the first token was
    predicted from the padding, so an example's gradient followed the longest *other*
    example's length. Right padding with ``labels`` copied from the padded ``input_ids``:
    the padding's tokens were predicted, as many as the longest example made. sigma = 0,
    no clipping, SGD: the step now equals the one computed from each example alone,
    unpadded (a loop of batches of one)."""
    from hf_models import build

    model = build("gpt2", dtype=torch.float32)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 90, (int(n),), generator=g)
            for n in torch.randint(2, 9, (16,), generator=g)]
    seen = []

    def pad_to_longest(feats):
        width = max([len(f["input_ids"]) for f in feats], default=1)
        pad = [width - len(f["input_ids"]) for f in feats]
        batch = {"input_ids": torch.zeros(len(feats), width, dtype=torch.long),
                 "attention_mask": torch.zeros(len(feats), width, dtype=torch.long),
                 "labels": torch.full((len(feats), width), -100)}
        for i, (f, k) in enumerate(zip(feats, pad, strict=True)):
            at = slice(k, None) if side == "left" else slice(0, width - k)
            batch["input_ids"][i, at] = batch["labels"][i, at] = f["input_ids"]
            batch["attention_mask"][i, at] = 1
        if side == "right":  # the padding's ids (0) as labels too
            batch["labels"] = batch["input_ids"].clone()
        seen.append([f["input_ids"] for f in feats])
        return batch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = DPTrainer(model=model, args=_args(tmp_path, max_steps=1, per_device_train_batch_size=4),
                   train_dataset=[{"input_ids": r} for r in rows], data_collator=pad_to_longest,
                   optimizers=(opt, None),
                   privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=float("inf"),
                                            seed=1))
    tr.train()
    lengths = {len(r) for r in seen[-1]}
    assert len(lengths) > 1  # the step's batch was padded
    for r in seen[-1]:  # each example alone, no padding
        per_sequence_cross_entropy(ref(input_ids=r[None]).logits, r[None], shift=True,
                                   reduction="sum").backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach() - 0.1 * b.grad / 4, rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_epsilon_logged_is_accountants_and_resume_keeps_it(tmp_path):
    """Four steps with checkpoints at 2 and 4; each logged epsilon is the composition of
    the steps taken so far; a run resumed from checkpoint 2 ends with the same epsilon,
    the same accountant history and the same parameters as the uninterrupted one (with
    dropout: the DP loader must not draw from torch's global RNG, which the Trainer
    restores from the checkpoint)."""
    sigma = 1.0
    pa = PrivacyArguments(noise_multiplier=sigma, max_grad_norm=0.5, seed=11)
    args = _args(tmp_path / "out", save_strategy="steps", save_steps=2)
    private = tmp_path / "private"
    a = DPTrainer(model=_llama(dropout=0.3), args=args, train_dataset=_TextSet(), privacy=pa,
                  private_state_dir=private)
    a.train()
    logged = [(h["step"], h["epsilon"]) for h in a.state.log_history
              if "epsilon" in h and "learning_rate" in h]
    assert [s for s, _ in logged] == [1, 2, 3, 4]
    for step, eps in logged:
        assert eps == pytest.approx(_eps(sigma, step), rel=1e-9)
    assert a.epsilon() == pytest.approx(_eps(sigma, 4), rel=1e-9)
    assert a.privacy_engine.accountant.steps == 4
    ckpt = os.path.join(tmp_path, "out", "checkpoint-2")
    assert os.path.isfile(os.path.join(ckpt, PRIVACY_STATE_NAME))

    b = DPTrainer(model=_llama(seed=99, dropout=0.3), args=args, train_dataset=_TextSet(),
                  privacy=pa, private_state_dir=private)
    b.train(resume_from_checkpoint=ckpt)
    assert b.privacy_engine.accountant.steps == 4
    assert b.privacy_engine.accountant.segments == a.privacy_engine.accountant.segments
    assert b.epsilon() == a.epsilon()
    resumed = [(h["step"], h["epsilon"]) for h in b.state.log_history
               if "epsilon" in h and "learning_rate" in h]
    assert resumed[-2:] == logged[-2:]
    for (name, u), v in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0, msg=name)


def test_stops_at_max_epsilon_and_calibrates(tmp_path):
    cap = (_eps(1.0, 2) + _eps(1.0, 3)) / 2  # room for exactly 2 steps
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=5, logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, max_epsilon=cap, seed=0))
    with pytest.warns(PrivacyBudgetWarning, match="stopped after step 2 of 5"):
        tr.train()
    assert tr.privacy_engine.accountant.steps == 2
    assert tr.state.global_step == 2
    assert tr.epsilon() <= cap
    # target_epsilon: sigma calibrated for max_steps; the plan is spent, not exceeded
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=3, logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(target_epsilon=4.0, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyBudgetWarning)  # the planned end: no warning
        tr.train()
    assert tr.privacy_engine.accountant.steps == 3
    assert 3.9 < tr.epsilon() <= 4.0
    # a cap below one step's epsilon: a clear error before any step
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=5), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, max_epsilon=1e-3, seed=0))
    with pytest.raises(PrivacyBudgetExceededError, match="does not cover even one step"):
        tr.train()
    assert tr.state.global_step == 0 and tr.privacy_engine.accountant.steps == 0


def test_sequence_classification_with_adaptive_clipping(tmp_path):
    """Labels of shape (B,); adaptive clipping moves the bound; epsilon is sigma's."""
    tr = DPTrainer(model=_llama(classify=True), args=_args(tmp_path, max_steps=3),
                   train_dataset=_TextSet(classify=True),
                   privacy=PrivacyArguments(noise_multiplier=0.2, max_grad_norm=1e-3,
                                            clipping="adaptive",
                                            target_unclipped_quantile=0.5, seed=0))
    tr.train()
    p = tr.privacy_engine
    assert p.accountant.steps == 3
    assert p.max_grad_norm > 1e-3  # everything was clipped: the bound grew
    assert tr.epsilon() == pytest.approx(_eps(0.2, 3), rel=1e-9)
    assert "dp_max_grad_norm" in tr.state.log_history[0]


def test_refused_setups(tmp_path):
    ds = _TextSet()
    pa = PrivacyArguments(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an integer >= 1"):
        DPTrainer(model=_llama(), args=_args(tmp_path, gradient_accumulation_steps=0),
                  train_dataset=ds, privacy=pa)
    with pytest.raises(TypeError, match="PrivacyArguments"):
        DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=ds,
                  privacy={"noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="task must be one of"):
        PrivacyArguments(noise_multiplier=1.0, task="summarise")
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        PrivacyArguments(noise_multiplier=1.0, target_epsilon=3.0)
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        PrivacyArguments()
    with pytest.raises(ValueError, match="only apply to clipping='adaptive'"):
        PrivacyArguments(noise_multiplier=1.0, target_unclipped_quantile=0.5)
    # adaptive without a target quantile: refused when training starts, before a step
    tr = DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=ds,
                   privacy=PrivacyArguments(noise_multiplier=1.0, clipping="adaptive"))
    with pytest.raises(ValueError, match="target_unclipped_quantile"):
        tr.train()
    assert tr.state.global_step == 0
    # a checkpoint without privacy state cannot be resumed
    plain = transformers.Trainer(model=_llama(), args=_args(tmp_path / "plain", max_steps=1,
                                                            save_strategy="steps",
                                                            save_steps=1),
                                 train_dataset=ds)
    plain.train()
    tr = DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=ds, privacy=pa)
    with pytest.raises(ValueError, match=PRIVACY_STATE_NAME):
        tr.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))


def test_expand_position_ids():
    batch = expand_position_ids(transformers.default_data_collator)(
        [_TextSet()[i] for i in range(3)])
    pos = batch["position_ids"]
    assert pos.shape == batch["input_ids"].shape
    assert torch.equal(pos[0, :4], torch.arange(4))


def test_left_padding_positions_and_the_model_that_cannot_take_them():
    """Right-padded batches are left as they are; a left-padded one gets positions
    counted over its mask (each example's tokens at 0..n-1), and is refused for a model
    whose forward takes no position_ids (its positions would follow the longest row)."""
    from privlearn.errors import ParameterValueError
    from privlearn.torch._hf_collate import positions_of_left_padding

    class NoPositions(torch.nn.Module):  # T5 and BART: **kwargs, no position ids
        def forward(self, input_ids, attention_mask=None, **kwargs):
            return input_ids

    right = {"input_ids": torch.ones(2, 4, dtype=torch.long),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    assert positions_of_left_padding(NoPositions(), right) is right
    left = {**right, "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])}
    got = positions_of_left_padding(_llama(), left)["position_ids"]
    assert torch.equal(got[1, 2:], torch.arange(2)) and torch.equal(got[0], torch.arange(4))
    with pytest.raises(ParameterValueError, match="left-padded.*NoPositions.*padding_side"):
        positions_of_left_padding(NoPositions(), left)


def test_labels_at_padding_are_ignored_with_the_mask_of_their_sequence():
    """Labels at padding, and (shifted) predicted from padding, become -100; an
    encoder-decoder's labels follow the decoder's mask, never the encoder's."""
    from privlearn.torch._hf_collate import own_labels

    labels = torch.arange(1, 9).reshape(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]])
    assert own_labels(labels, {"attention_mask": mask}, False).tolist() == \
        [[1, 2, 3, 4], [-100, 6, 7, -100]]
    assert own_labels(labels, {"attention_mask": mask}, True).tolist() == \
        [[1, 2, 3, 4], [-100, -100, 7, -100]]
    seq2seq = {"attention_mask": mask, "decoder_input_ids": labels}
    assert own_labels(labels, seq2seq, True) is labels
    seq2seq["decoder_attention_mask"] = torch.ones(2, 4, dtype=torch.long)
    assert own_labels(labels, seq2seq, True).tolist() == labels.tolist()


def test_lora_adapters_train_and_save(tmp_path):
    """peft LoRA through DPTrainer: only the adapters move, epsilon is the accountant's,
    and the adapters save in peft's format."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        task_type="CAUSAL_LM"))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    tr = DPTrainer(model=model, args=_args(tmp_path, max_steps=2, logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.train()
    moved = {k for k, v in model.named_parameters() if not torch.equal(v, before[k])}
    assert moved and all("lora_" in k for k in moved)
    assert tr.epsilon() == pytest.approx(_eps(1.0, 2), rel=1e-9)
    tr.save_model(str(tmp_path / "adapter"))
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")


def test_training_loss_is_not_logged_or_saved_unless_opted_in(tmp_path):
    """The Trainer's loss logs are un-noised means over private batches, and they land in
    every checkpoint's trainer_state.json: dropped by default; opting in warns."""
    from privlearn.errors import PrivacyLeakWarning

    pa = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5, secure_mode=True)
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=2, save_strategy="steps",
                                              save_steps=2),
                   train_dataset=_TextSet(), privacy=pa)  # secure mode: no keys to keep
    out = tr.train()
    assert math.isnan(out.training_loss) and "train_loss" not in out.metrics  # returned too
    assert tr.state.log_history and all("epsilon" in h for h in tr.state.log_history)
    assert not any(k in h for h in tr.state.log_history
                   for k in ("loss", "train_loss", "grad_norm"))
    saved = Path(tmp_path, "checkpoint-2", "trainer_state.json").read_text()
    assert '"loss"' not in saved and '"train_loss"' not in saved
    with pytest.warns(PrivacyLeakWarning, match="log_training_loss"):
        DPTrainer(model=_llama(), args=_args(tmp_path / "b"), train_dataset=_TextSet(),
                  privacy=PrivacyArguments(noise_multiplier=1.0, log_training_loss=True))


def test_fp16_on_cpu_trains_and_accounts(tmp_path):
    # on CPU accelerate runs fp16 autocast without a loss scaler: the engine accumulates
    # norms and sums in float32 (as for bf16); the reported epsilon is the accountant's
    model = _llama()
    before = [p.detach().clone() for p in model.parameters()]
    tr = DPTrainer(model=model, args=_args(tmp_path, fp16=True), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0))
    assert getattr(tr.accelerator, "scaler", None) is None
    tr.train()
    assert tr.state.global_step == 4
    assert tr.epsilon() == pytest.approx(_eps(1.0, 4), rel=1e-9)
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_fp16_with_a_loss_scaler_is_refused(tmp_path):
    # on CUDA accelerate drives a GradScaler that is not wired to the DP optimizer yet
    class _ScaledTrainer(DPTrainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self.accelerator.scaler = torch.amp.GradScaler("cpu")

    with pytest.raises(ValueError, match="fp16=True with a loss scaler"):
        _ScaledTrainer(model=_llama(), args=_args(tmp_path, fp16=True),
                       train_dataset=_TextSet(),
                       privacy=PrivacyArguments(noise_multiplier=1.0))


# ------------------------------------------------------------------ releases


def _numbers(obj, path=""):
    """Every (key path, number) in a nested structure of dicts and lists."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield path, obj


def test_every_number_written_is_on_the_allow_list(tmp_path):
    """total_flos (always) and num_input_tokens_seen (opt-in) were written un-noised into
    trainer_state.json and the logs; both depend on private sequence lengths (one long
    record among short ones was detected with near certainty). Every number the trainer
    logs, returns or saves is now released or data-independent."""
    import json

    from privlearn.errors import PrivacyLeakWarning
    from privlearn.torch.hf import RELEASED_LOGS

    seen_logs = []

    class Spy(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen_logs.append(dict(logs))

    with pytest.warns(PrivacyLeakWarning, match="include_num_input_tokens_seen"):
        tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=2, save_strategy="steps",
                                                  save_steps=2,
                                                  include_num_input_tokens_seen="all"),
                       train_dataset=_TextSet(), privacy=PrivacyArguments(
                           noise_multiplier=1.0, seed=0), callbacks=[Spy()],
                       private_state_dir=tmp_path.parent / f"{tmp_path.name}-private")
    out = tr.train()
    assert seen_logs and set().union(*seen_logs) <= RELEASED_LOGS
    assert set(out.metrics) <= RELEASED_LOGS
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    allowed_state = {"epoch", "global_step", "max_steps", "num_train_epochs", "logging_steps",
                     "eval_steps", "save_steps", "train_batch_size", "total_flos",
                     "num_input_tokens_seen", "best_global_step", "best_metric"}
    for path, _value in _numbers(state):
        head = path.split(".")[0].split("[")[0]
        if head == "log_history":
            assert path.rsplit(".", 1)[-1] in RELEASED_LOGS, path
        elif head == "stateful_callbacks":
            continue  # the Trainer's control flags (booleans and step counters)
        else:
            assert head in allowed_state, path
    assert state["total_flos"] == 0 and state.get("num_input_tokens_seen", 0) == 0
    privacy = torch.load(tmp_path / "checkpoint-2" / PRIVACY_STATE_NAME, weights_only=False)
    # the keys of the sampler and the noise replay the next steps: kept out of the release
    # privacy_arguments: the settings chosen (data-independent), without the seed
    assert set(privacy) == {"format", "mechanism", "noise_multiplier", "max_grad_norm",
                            "accountant", "budget", "correlated", "private_state",
                            "privacy_arguments", "earlier_runs"}
    assert "dp_seed" not in privacy["privacy_arguments"]
    assert privacy["earlier_runs"] == []  # the report's descriptions of earlier runs: none
    assert privacy["correlated"] is None  # DP-SGD: no correlated-noise state


def test_user_arguments_are_not_modified(tmp_path):
    args = _args(tmp_path, max_steps=1, max_grad_norm=3.0)
    before = args.to_dict()
    with pytest.warns(UserWarning, match="max_grad_norm=3 .*not used by DPTrainer"):
        trainer = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(),
                            privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    trainer.train()
    assert args.to_dict() == before and args.max_grad_norm == 3.0


def test_every_run_of_model_init_trains_privately_and_composes(tmp_path):
    """With model_init, every train() after the first trained non-privately (a plain
    optimizer on raw gradients, the accountant left as it was); hyperparameter_search does
    exactly this. Each run now trains privately and epsilon composes them all."""
    inits = []

    def init():
        inits.append(_llama(seed=len(inits)))
        return inits[-1]

    tr = DPTrainer(model_init=init, args=_args(tmp_path, max_steps=2, logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.train()
    first = tr.privacy_engine
    assert tr.epsilon() == pytest.approx(_eps(1.0, 2), rel=1e-9)
    tr.train()  # a fresh model from model_init
    second = tr.privacy_engine
    assert second is not first and second.model is inits[-1] and len(inits) >= 3
    assert second.accountant.steps == 2
    from privlearn.torch.optimizer import DPOptimizer

    assert isinstance(tr.optimizer, DPOptimizer) and tr.optimizer is second.optimizer
    assert tr.epsilon() == pytest.approx(_eps(1.0, 4), rel=1e-9)  # both runs


def test_three_runs_compose_each_run_once(tmp_path):
    """Each finished run's mechanism already includes the runs before it; composing the
    list of them counted the first run twice from the third run on."""
    tr = DPTrainer(model_init=lambda: _llama(), args=_args(tmp_path, max_steps=1,
                                                              logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    for runs in (1, 2, 3):
        tr.train()
        assert tr.epsilon() == pytest.approx(_eps(1.0, runs), rel=1e-9)


def test_a_run_without_noise_makes_every_later_epsilon_infinite(tmp_path):
    """noise_multiplier=0 is allowed (as by make_private: epsilon inf); the second train()
    of such a trainer crashed building the first run's mechanism. It now trains and
    reports inf, and a later budget cap refuses to start."""
    tr = DPTrainer(model_init=lambda: _llama(), args=_args(tmp_path, max_steps=1,
                                                              logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=0.0, seed=0))
    tr.train()
    assert tr.epsilon() == math.inf
    tr.privacy = PrivacyArguments(noise_multiplier=1.0, seed=0)  # noise from now on
    out = tr.train()
    assert tr.privacy_engine.accountant.steps == 1
    assert tr.epsilon() == math.inf and out.metrics["epsilon"] == math.inf
    tr.privacy = PrivacyArguments(noise_multiplier=1.0, seed=0, max_epsilon=100.0)
    with pytest.raises(PrivacyBudgetExceededError, match="without noise"):
        tr.train()
    assert tr.privacy_engine.accountant.steps == 0



@pytest.mark.parametrize("noise", [1.0, 0.0])
def test_epsilon_at_a_given_delta_is_the_accountants_and_a_bad_delta_is_refused(tmp_path,
                                                                                noise):
    """``epsilon(delta)`` reads the steps at that delta (the closed composition; delta=0:
    the Gaussian mechanism's pure epsilon, inf), and a delta outside [0, 1] is refused
    naming it, before training, after it, and when a run without noise makes every
    epsilon infinite."""
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=1, logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=noise, seed=0))

    def refused():
        for bad, kind in ((-1e-5, ValueError), (1.5, ValueError),
                          (float("nan"), ValueError), ("1e-5", TypeError)):
            with pytest.raises(kind, match="delta"):
                tr.epsilon(bad)

    refused()
    assert tr.epsilon(1e-6) == 0.0  # nothing trained yet
    tr.train()
    refused()
    for delta in (1e-3, 1e-7):
        expected = _eps(noise, 1, delta=delta) if noise else math.inf
        assert tr.epsilon(delta) == pytest.approx(expected, rel=1e-9)
    assert tr.epsilon() == tr.epsilon(tr.privacy.target_delta)
    assert tr.epsilon(0.0) == math.inf


def test_model_init_runs_share_one_budget(tmp_path):
    cap = (_eps(1.0, 3) + _eps(1.0, 4)) / 2  # room for 3 steps in all
    tr = DPTrainer(model_init=lambda: _llama(), args=_args(tmp_path, max_steps=2,
                                                              logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, max_epsilon=cap, seed=0))
    tr.train()
    with pytest.warns(PrivacyBudgetWarning, match="stopped after step 1 of 2"):
        tr.train()
    assert tr.epsilon() <= cap and tr.privacy_engine.accountant.steps == 1


def test_flattening_collator_is_refused(tmp_path):
    """DataCollatorWithFlattening packs the batch into one row: the whole batch was
    clipped as one example (3.2 -> 12.8)."""
    collator = transformers.DataCollatorWithFlattening()
    with pytest.raises(ValueError, match="DataCollatorWithFlattening"):
        DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_TextSet(),
                  data_collator=collator, privacy=PrivacyArguments(noise_multiplier=1.0))


def test_packed_rows_are_refused_at_the_step_whatever_the_collator(tmp_path):
    def packing(features):  # a hand-written packer: the whole batch in one row
        batch = transformers.default_data_collator(features)
        return {k: v.reshape(1, -1) for k, v in batch.items()}

    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=2),
                   train_dataset=_TextSet(), data_collator=packing,
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    with pytest.raises(ValueError, match="packed or flattened"):
        tr.train()
    assert tr.privacy_engine.accountant.steps == 0


class _PackedSet(_TextSet):
    """Each row two texts packed together: positions start over at token 4 (trl's
    packing, texts concatenated with their own positions); ``restart=False``: one text."""

    def __init__(self, restart=True):
        super().__init__()
        self.restart = restart

    def __getitem__(self, i):
        pos = torch.cat([torch.arange(4), torch.arange(4, T) - 4 * self.restart])
        return {"input_ids": self.ids[i].clamp_min(1), "labels": self.ids[i].clamp_min(1),
                "position_ids": pos}


def test_rows_packing_several_sequences_are_refused_before_their_step(tmp_path):
    """Rows whose position_ids start over hold several records each (a record shares its
    row and clipping bound with others, or is cut across rows): they trained, accounted
    as one example per row. Refused at the first such batch, before its step; the same
    rows with one sequence each train."""
    model = _llama()
    before = [q.detach().clone() for q in model.parameters()]
    tr = DPTrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=_PackedSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    with pytest.raises(ValueError, match=r"position_ids start over inside row 0 \(token 4 "
                       r"has position 0 after 3\).*No step was taken"):
        tr.train()
    assert tr.privacy_engine.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=2),
                   train_dataset=_PackedSet(restart=False),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.train()
    assert tr.privacy_engine.accountant.steps == 2


def test_a_training_set_without_len_is_refused_when_the_trainer_is_built(tmp_path):
    """A map-style set without ``__len__`` cannot be sampled at rate B/N (a bare
    TypeError from len() when training started)."""
    class Indexed:
        def __getitem__(self, i):
            return _TextSet()[i]

    with pytest.raises(ValueError, match="train_dataset.*Indexed, which has no len"):
        DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=Indexed(),
                  privacy=PrivacyArguments(noise_multiplier=1.0))


def test_resumed_run_reports_the_epoch_it_reached(tmp_path):
    """Two steps an epoch (q = 1/2); resumed in the middle of the second epoch, the run
    reports the sampler's epoch, as the uninterrupted one does."""
    pa = PrivacyArguments(noise_multiplier=1.0, seed=1)
    args = _args(tmp_path / "out", max_steps=4, save_strategy="steps", save_steps=3,
                 per_device_train_batch_size=N // 2)
    private = tmp_path / "private"
    a = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=pa,
                  private_state_dir=private)
    a.train()
    b = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=pa,
                  private_state_dir=private)
    b.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    epochs_a = [h["epoch"] for h in a.state.log_history if "learning_rate" in h]
    epochs_b = [h["epoch"] for h in b.state.log_history if "learning_rate" in h]
    assert epochs_a == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert epochs_b == epochs_a  # the restored history and the step taken after it


class _UserTextSet(_TextSet):
    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["user"] = i // 4  # 16 users of 4 sequences
        return item


def test_user_column_makes_privacy_per_user(tmp_path):
    """A user column: users are sampled, each user's sequences are clipped together, and
    the epsilon is per user (the user-level sampling rate)."""
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=3, logging_steps=50,
                                              per_device_train_batch_size=4),
                   train_dataset=_UserTextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0, user_column="user",
                                            max_examples_per_user=2))
    tr.train()
    p = tr.privacy_engine
    assert p.config.privacy_unit == "user" and p.plan.dataset_size == 16
    assert tr.epsilon() == pytest.approx(_eps(1.0, 3, q=4 / 16), rel=1e-9)


class _GappedUserTextSet(_TextSet):
    """A user column with gaps (float ids, NaN where the id was lost): one person's 4
    sequences have NaN ids."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["user"] = float("nan") if i in (3, 9, 20, 41) else float(i // 4)
        return item


def test_user_column_with_missing_ids_is_refused(tmp_path):
    """NaN ids are never equal, so each NaN row would be a user of its own (one person's
    4 rows, 4 users): refused before any step, naming the column and the rows."""
    from privlearn.errors import ParameterValueError

    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=3, logging_steps=50,
                                              per_device_train_batch_size=4),
                   train_dataset=_GappedUserTextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0, user_column="user"))
    with pytest.raises(ParameterValueError, match=r"user_column='user' has a missing id .*"
                       r"rows 3, 9, 20, 41"):
        tr.train()
    assert tr.state.global_step == 0


def test_shuffled_epochs_through_the_trainer_is_accounted_under_replace_one(tmp_path):
    """DPTrainer with sampling='shuffled_epochs' (one permutation cut into batches): the
    epsilon holds under replace-one, as make_private's: each of the k participations of
    the replaced example moves its batch's sum by up to 2 C, the Gaussian mechanism of
    sensitivity 2 sqrt(k) C (closed form, Balle & Wang 2018, Theorem 8)."""
    from scipy.stats import norm

    cycle = N // B
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=2 * cycle, logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=2.0, seed=0,
                                            sampling="shuffled_epochs"))
    tr.train()
    p = tr.privacy_engine
    assert p.accountant.steps == 2 * cycle and p.plan.run.cycle == cycle
    eps, sigma, sens = tr.epsilon(), 2.0, 2 * math.sqrt(2)
    a = sens / (2 * sigma)

    def delta(e):
        return norm.cdf(a - e * sigma / sens) - math.exp(e) * norm.cdf(-a - e * sigma / sens)

    assert delta(eps) <= 1e-5 * (1 + 1e-9) < delta(eps - 0.01)
    assert p.neighbouring == "replace_one"


def test_a_second_run_of_a_sampling_accounted_whole_runs_its_plan_and_composes(tmp_path):
    """model_init, sampling='shuffled_epochs', one epoch a run: a run accounted as one
    mechanism is capped at its plan, and the cap was the plan's epsilon alone, which the
    first run already spent: every later run was refused before its first step (naming a
    max_epsilon never given). Each run now takes its planned steps, and the two compose
    to the closed form: two participations of the replaced example, a Gaussian of
    sensitivity 2 sqrt(2) C (Balle & Wang 2018, Theorem 8)."""
    from scipy.stats import norm

    cycle = N // B
    tr = DPTrainer(model_init=lambda: _llama(), args=_args(tmp_path, max_steps=cycle,
                                                          logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=2.0, seed=0,
                                            sampling="shuffled_epochs"))
    tr.train()
    tr.train()
    assert tr.privacy_engine.accountant.steps == cycle
    eps, sigma, sens = tr.epsilon(), 2.0, 2 * math.sqrt(2)
    a = sens / (2 * sigma)

    def delta(e):
        return norm.cdf(a - e * sigma / sens) - math.exp(e) * norm.cdf(-a - e * sigma / sens)

    assert delta(eps) <= 1e-5 * (1 + 1e-9) < delta(eps - 0.01)


def test_a_second_run_planned_by_target_epsilon_is_not_warned_past_its_plan(tmp_path):
    """With max_epsilon=inf, each model_init run is calibrated to target_epsilon; the
    second run's planned epsilon was its own plan's, which the first run's cost already
    exceeds, so its first step warned that training went past its plan. It now runs
    its planned steps silently; epsilon is the composition of both runs."""
    tr = DPTrainer(model_init=lambda: _llama(), args=_args(tmp_path, max_steps=3,
                                                          logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(target_epsilon=2.0, max_epsilon=float("inf"),
                                            seed=0))
    tr.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyBudgetWarning)
        tr.train()
    p = tr.privacy_engine
    assert p.accountant.steps == 3
    assert tr.epsilon() == pytest.approx(_eps(p.noise_multiplier, 6), rel=1e-9)


def test_correlated_noise_through_the_trainer(tmp_path):
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=4, logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0, noise="banded",
                                            bands=2, sampling="balls_in_bins"))
    tr.train()
    p = tr.privacy_engine
    assert p.optimizer.correlated is not None and p.accountant.steps == 4
    assert tr.epsilon() == pytest.approx(p.plan.planned_epsilon, rel=1e-12)


def test_learning_rate_schedule_runs_with_the_dp_optimizer_as_the_trainers(tmp_path):
    """The DP optimizer is a torch Optimizer, yet accelerate does not wrap it: the
    Trainer steps it (``trainer.optimizer is p.optimizer``, also for a second
    ``train()``), the scheduler's rates are those of ``transformers.get_scheduler`` on a
    plain optimizer, set on the groups the DP step updates with, and no scheduler warns
    that it stepped before the optimizer."""
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, lr_scheduler_type="linear",
                                              warmup_steps=1),
                   train_dataset=_TextSet(), privacy=PrivacyArguments(noise_multiplier=1.0,
                                                                      seed=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    assert [str(w.message) for w in caught if "optimizer.step()" in str(w.message)] == []
    p = tr.privacy_engine
    assert isinstance(p.optimizer, torch.optim.Optimizer) and tr.optimizer is p.optimizer
    ref = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    s = transformers.get_scheduler("linear", ref, num_warmup_steps=1, num_training_steps=4)
    expected = []
    for _ in range(4):
        expected.append(ref.param_groups[0]["lr"])
        ref.step()
        s.step()
    logged = [e["learning_rate"] for e in tr.state.log_history if "learning_rate" in e]
    assert logged == pytest.approx(expected) and len(set(expected)) > 2
    assert p.optimizer.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"])
    tr.train()  # the same run continues: its engine and optimizer are kept
    assert tr.privacy_engine is p and tr.optimizer is p.optimizer
    assert p.accountant.steps == 8


def test_dataloader_drop_last_is_named_where_poisson_batches_ignore_it(tmp_path):
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, dataloader_drop_last=True),
                   train_dataset=_TextSet(), privacy=PrivacyArguments(noise_multiplier=1.0,
                                                                      seed=0))
    with pytest.warns(UserWarning, match="drop_last=True, which does not apply"):
        tr.get_train_dataloader()


def test_dp_transformers_trainer_arguments_say_what_to_use(tmp_path):
    """dp-transformers' ``OpacusDPTrainer(..., privacy_args=..., author_mapping=...)``
    keywords: a typed error naming ``privacy=`` and ``user_column=``, not Python's bare
    missing-argument TypeError; nothing is built."""
    from privlearn.errors import ParameterTypeError

    model = _llama()
    with pytest.raises(ParameterTypeError, match=r"privacy must be a PrivacyArguments, got "
                       r"NoneType.*privacy=PrivacyArguments.*user_column="):
        DPTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=_TextSet(),
                  privacy_args=PrivacyArguments(noise_multiplier=1.0),
                  author_mapping=[[0, 1]])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_trainer_spends_from_a_ledger_budget(tmp_path):
    """DPTrainer(ledger=): the planned run is reserved before the first batch and settled
    to the steps that ran (the ledger's total is the trainer's mechanism); a run the
    budget cannot hold is refused before any step, the model untouched."""
    from privlearn.errors import BudgetExceededError
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "privacy.db", create=True)
    led.create_budget("text", epsilon=10.0, delta=1e-5)
    trainer = DPTrainer(model=_llama(), args=_args(tmp_path / "a", max_steps=3),
                        train_dataset=_TextSet(), ledger=led.budget("text"),
                        privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    spent = led.spent("text")
    assert spent.pending == 0 and spent.entries == 1
    assert spent.epsilon_spent == pytest.approx(_eps(1.0, 3), rel=1e-9)
    assert spent.epsilon_spent == pytest.approx(trainer.epsilon(1e-5), rel=1e-9)

    led.create_budget("small", epsilon=_eps(1.0, 3) * 1.0001, delta=1e-5)
    model = _llama()
    before = [w.detach().clone() for w in model.parameters()]
    small = DPTrainer(model=model, args=_args(tmp_path / "b", max_steps=4),
                      train_dataset=_TextSet(), ledger=led.budget("small"),
                      privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0))
    with pytest.raises(BudgetExceededError, match="whole planned run"):
        small.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert led.spent("small").entries == 0


def test_a_resumed_trainer_on_a_tight_ledger_budget_reserves_its_steps_as_they_run(tmp_path):
    """The budget holds 4 steps; a first process ran 2 (checkpoint-2, settled). The
    resumed trainer (noise_multiplier, max_steps=4) reserves its remaining steps as they
    run instead of the whole run again, and the ledger ends at exactly the 4 steps."""
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "privacy.db", create=True)
    led.create_budget("text", epsilon=_eps(1.0, 4) * 1.0001, delta=1e-5)
    privacy = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    out, private = tmp_path / "out", tmp_path / "private"
    first = DPTrainer(model=_llama(), train_dataset=_TextSet(), privacy=privacy,
                      args=_args(out, max_steps=2, save_strategy="steps", save_steps=2),
                      private_state_dir=private, ledger=led.budget("text"))
    first.train()
    assert led.spent("text").epsilon_spent == pytest.approx(_eps(1.0, 2), rel=1e-9)
    resumed = DPTrainer(model=_llama(), train_dataset=_TextSet(), privacy=privacy,
                        args=_args(out, max_steps=4, save_strategy="steps", save_steps=2),
                        private_state_dir=private, ledger=led.budget("text"))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.privacy_engine.accountant.steps == 4
    spent = led.spent("text")
    assert spent.pending == 0
    assert spent.epsilon_spent == pytest.approx(_eps(1.0, 4), rel=1e-9)
    assert resumed.epsilon(1e-5) == pytest.approx(_eps(1.0, 4), rel=1e-9)


def test_a_trainer_without_privacy_says_what_to_pass(tmp_path):
    from privlearn.errors import ParameterTypeError

    model = _llama()
    with pytest.raises(ParameterTypeError, match=r"got NoneType: pass .*privacy="
                       r"PrivacyArguments\(target_epsilon="):
        DPTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=_TextSet())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_resuming_in_a_trainer_that_already_trained_is_refused(tmp_path):
    """Run A (checkpoint at step 2), then a fresh run B (model_init): epsilon composes
    both (8 steps). Resuming A's checkpoint in the same trainer would load A's history in
    place of the trainer's (epsilon back to 4 steps' while 8 were taken) and replay A's
    noise keys: refused before anything runs, epsilon and the engine unchanged."""
    from privlearn.errors import ConfigurationError

    pa = PrivacyArguments(noise_multiplier=1.0, seed=0)
    private = tmp_path / "private"
    tr = DPTrainer(model_init=lambda *_: _llama(), train_dataset=_TextSet(), privacy=pa,
                   args=_args(tmp_path / "out", save_strategy="steps", save_steps=2,
                              logging_steps=50), private_state_dir=private)
    tr.train()
    ckpt = str(tmp_path / "out" / "checkpoint-2")
    # the same trainer after one run: refused too (its history would be replaced)
    with pytest.raises(ConfigurationError, match="already trained"):
        tr.train(resume_from_checkpoint=ckpt)
    assert tr.privacy_engine.accountant.steps == 4
    tr.args.save_strategy = "no"  # run B must not overwrite A's checkpoint
    tr.train()
    assert tr.epsilon() == pytest.approx(_eps(1.0, 8), rel=1e-9)
    engine = tr.privacy_engine
    with pytest.raises(ConfigurationError, match="already trained"):
        tr.train(resume_from_checkpoint=ckpt)
    assert tr.privacy_engine is engine and engine.accountant.steps == 4
    assert tr.epsilon() == pytest.approx(_eps(1.0, 8), rel=1e-9)
    # a new trainer resumes the checkpoint, as before
    fresh = DPTrainer(model=_llama(), train_dataset=_TextSet(), privacy=pa,
                      args=_args(tmp_path / "out", logging_steps=50),
                      private_state_dir=private)
    fresh.train(resume_from_checkpoint=ckpt)
    assert fresh.epsilon() == pytest.approx(_eps(1.0, 4), rel=1e-9)


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance", "sequential"])
def test_a_train_sampling_strategy_other_than_random_is_refused(tmp_path, strategy):
    """``train_sampling_strategy`` (length-grouped, rebalanced or sequential batches) is
    not a sampling the accountant describes; the DP sampler would silently replace it:
    refused when the trainer is built, naming the setting and PrivacyArguments.sampling."""
    _refused_at_build(tmp_path, rf"train_sampling_strategy='{strategy}'.*sampling=",
                      train_sampling_strategy=strategy)


def _refused_at_build(tmp_path, match, **training_arguments):
    """Building a DPTrainer with these TrainingArguments raises ConfigurationError
    matching ``match`` and leaves no hook on the model."""
    from privlearn.errors import ConfigurationError

    model = _llama()
    with pytest.raises(ConfigurationError, match=match):
        DPTrainer(model=model, args=_args(tmp_path, **training_arguments),
                  train_dataset=_TextSet(), privacy=PrivacyArguments(noise_multiplier=1.0))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_auto_find_batch_size_is_refused(tmp_path):
    """The Trainer halves the batch size after an out-of-memory error, which the DP loader
    (whose expected Poisson batch sets the accounted rate) never followed: refused when
    the trainer is built, naming the setting and what bounds memory instead."""
    _refused_at_build(tmp_path, r"auto_find_batch_size=True.*gradient_accumulation_steps",
                      auto_find_batch_size=True)


def test_neftune_is_refused(tmp_path):
    """NEFTune adds uniform noise of magnitude ``alpha / sqrt(L d)`` to the embeddings,
    ``L`` the batch's padded length: under the same random state, example 0's noise is
    twice as large next to an example of its own length (3) as next to one of length 12,
    so its gradient follows another example's length (the probe, which swaps examples
    of one padded batch, cannot see it). DPTrainer trained with it; now refused when it
    is built."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    emb = torch.nn.Embedding(10, 4)
    emb.neftune_noise_alpha = 5.0
    emb.register_forward_hook(neftune_post_forward_hook)

    def noise_of_example_0(padded):  # example 0: three tokens, padded to the batch's longest
        ids = torch.zeros(2, padded, dtype=torch.long)
        ids[0, :3] = 1
        torch.manual_seed(0)
        with torch.no_grad():
            return emb(ids)[0, :3] - emb.weight[1]

    torch.testing.assert_close(noise_of_example_0(3), 2 * noise_of_example_0(12))
    _refused_at_build(tmp_path, r"neftune_noise_alpha=5\.0.*padded length",
                      neftune_noise_alpha=5.0)
    model = _llama()  # set on the trainer after it was built: refused at train, no hook left
    tr = DPTrainer(model=model, args=_args(tmp_path), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0))
    tr.neftune_noise_alpha = 5.0
    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0"):
        tr.train()
    assert tr.privacy_engine is None
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("optim", ["lomo", "adalomo", "galore_adamw_layerwise",
                                   "apollo_adamw_layerwise"])
def test_optimizers_that_update_inside_backward_are_refused(tmp_path, optim):
    """LOMO/AdaLomo (accelerate's ``lomo_backward``) and the layer-wise GaLore/APOLLO
    optimizers (a gradient hook steps each parameter) update the model inside
    ``backward()`` from the batch's un-noised gradient, before the DP step: refused when
    the trainer is built, before the Trainer creates the optimizer and hooks it in."""
    _refused_at_build(tmp_path, rf"optim={optim!r}.*inside backward\(\)", optim=optim)


class _ModalSGD(torch.optim.SGD):
    """An optimizer with train and eval modes, as the schedule-free ones
    (``optim="schedule_free_adamw"``): ``step()`` refuses to run outside train mode."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.modes = []

    def train(self):
        self.modes.append("train")

    def eval(self):
        self.modes.append("eval")

    def step(self, closure=None):
        if not self.modes or self.modes[-1] != "train":
            raise RuntimeError("Optimizer was not in train mode when step is called")
        return super().step(closure)


def test_an_optimizer_with_train_and_eval_modes_gets_the_trainers_calls(tmp_path):
    """The Trainer puts an optimizer that has them in train mode before each step and in
    eval mode before evaluating; through the DP optimizer the calls were lost (it has no
    train()/eval()), and a schedule-free optimizer refused every step."""
    model = _llama()
    opt = _ModalSGD(model.parameters(), lr=0.05)
    tr = DPTrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=_TextSet(),
                   eval_dataset=_TextSet(n=8, seed=1), optimizers=(opt, None),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.train()
    assert tr.privacy_engine.accountant.steps == 2 and opt.modes == ["train", "train"]
    tr.evaluate()
    assert opt.modes[-1] == "eval"


def test_a_given_layerwise_optimizer_is_refused(tmp_path):
    """The layer-wise optimizer passed in ``optimizers=``: its hooks step each parameter
    with the raw gradient as soon as ``backward()`` accumulates it (shown here without DP),
    so it is refused when the trainer is built, naming it."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    from privlearn.errors import ConfigurationError

    model = _llama()
    per_param = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def hook(p):
        per_param[p].step()
        per_param[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    before = model.lm_head.weight.detach().clone()
    batch = transformers.default_data_collator([_TextSet()[i] for i in range(2)])
    model(**batch).loss.backward()
    assert not torch.equal(model.lm_head.weight, before)  # updated inside backward()
    opt = LayerWiseDummyOptimizer(optimizer_dict=per_param, lr=0.1)
    with pytest.raises(ConfigurationError, match=r"LayerWiseDummyOptimizer.*inside backward"):
        DPTrainer(model=model, args=_args(tmp_path), train_dataset=_TextSet(),
                  optimizers=(opt, None), privacy=PrivacyArguments(noise_multiplier=1.0))


@pytest.mark.parametrize("setting", [{"label_smoothing_factor": 0.1},
                                     {"train_sampling_strategy": "group_by_length"}])
def test_refused_settings_set_after_the_trainer_was_built_are_refused_at_train(tmp_path,
                                                                               setting):
    """hyperparameter_search's trials set TrainingArguments on the trainer's own after it
    was built (so can a script): a refused setting is refused when the run starts, before
    any step, not silently ignored (the smoothing was never applied, the batches were
    Poisson's)."""
    from privlearn.errors import ConfigurationError

    tr = DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    for k, v in setting.items():
        setattr(tr.args, k, v)
    with pytest.raises(ConfigurationError, match=next(iter(setting))):
        tr.train()
    assert tr.state.global_step == 0 and tr.privacy_engine is None


def test_torch_compile_reads_the_task_of_the_compiled_model_and_trains_as_eager(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer hands compute_loss the
    ``torch.compile`` wrapper (an ``OptimizedModule``); the task is the compiled model's
    (causal LM, not refused as an unknown class), and with the same seed the run gives the
    eager run's parameters and epsilon (the ``eager`` backend: no compiler needed)."""
    pa = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.01, seed=0)
    runs = []
    for kw in ({}, {"torch_compile": True, "torch_compile_backend": "eager"}):
        tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=2, logging_steps=50,
                                                  **kw),
                       train_dataset=_TextSet(), privacy=pa)
        tr.train()
        runs.append((torch.cat([p.detach().flatten() for p in tr.model.parameters()]),
                     tr.epsilon(), tr.privacy_engine.accountant.steps))
    assert type(tr.model_wrapped).__name__ == "OptimizedModule"
    (eager, eps_eager, steps_eager), (compiled, eps_compiled, steps_compiled) = runs
    assert steps_eager == steps_compiled == 2
    assert eps_compiled == eps_eager == pytest.approx(_eps(1.0, 2), rel=1e-9)
    assert not torch.equal(eager, torch.cat([p.flatten() for p in _llama().parameters()]))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_evaluating_on_the_training_set_warns_of_the_leak(tmp_path):
    """Evaluation metrics are released un-noised (as statistics of a separate set); when
    the evaluation set is the training set they are statistics of the private data: a
    PrivacyLeakWarning, during training and from evaluate(); a held-out set: none, and
    evaluation takes no privacy step."""
    from privlearn.errors import PrivacyLeakWarning

    train = _TextSet()
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=2, eval_strategy="steps",
                                              eval_steps=1, logging_steps=50),
                   train_dataset=train, eval_dataset=train,
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    with pytest.warns(PrivacyLeakWarning, match="evaluation set is the training set"):
        tr.train()
    with pytest.warns(PrivacyLeakWarning, match="evaluation set is the training set"):
        tr.evaluate(eval_dataset={"train": train, "held_out": _TextSet(n=8, seed=5)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        metrics = tr.evaluate(eval_dataset=_TextSet(n=8, seed=5))
    assert "eval_loss" in metrics and tr.privacy_engine.accountant.steps == 2
    with pytest.warns(PrivacyLeakWarning, match="evaluation set is the training set"):
        tr.predict(train)


def test_evaluating_the_training_set_by_its_name_warns_of_the_leak(tmp_path):
    """``evaluate("train")`` names a set of an ``eval_dataset`` dict (as the Trainer's own
    loop over the dict does): the training set named so gave no warning."""
    from privlearn.errors import PrivacyLeakWarning

    train = _TextSet(n=8)
    tr = DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=train,
                   eval_dataset={"train": train, "held_out": _TextSet(n=8, seed=5)},
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    with pytest.warns(PrivacyLeakWarning, match="evaluation set is the training set"):
        tr.evaluate("train")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        tr.evaluate("held_out")


@pytest.mark.parametrize("change", [
    {"privacy": PrivacyArguments(noise_multiplier=0.5, seed=0)},
    {"args": {"per_device_train_batch_size": 2 * B}},
])
def test_resuming_with_other_privacy_settings_is_refused_and_leaves_the_model(tmp_path,
                                                                             change):
    """A checkpoint resumed with another noise multiplier or batch size (sampling rate):
    refused before any step, naming what differs and what to keep in DPTrainer's terms;
    the model is left without the engine's hooks."""
    from privlearn.errors import ConfigurationError

    pa = PrivacyArguments(noise_multiplier=1.0, seed=0)
    private = tmp_path / "private"
    DPTrainer(model=_llama(), args=_args(tmp_path / "out", max_steps=2, save_strategy="steps",
                                         save_steps=2), train_dataset=_TextSet(),
              privacy=pa, private_state_dir=private).train()
    model = _llama()
    tr = DPTrainer(model=model, args=_args(tmp_path / "out", **change.get("args", {})),
                   train_dataset=_TextSet(), privacy=change.get("privacy", pa),
                   private_state_dir=private)
    with pytest.raises(ConfigurationError,
                       match=r"(noise_multiplier|sampling_rate): saved .*PrivacyArguments"):
        tr.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert tr.privacy_engine is None and tr.state.global_step == 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_token_counting_set_after_the_trainer_was_built_is_not_released(tmp_path):
    """include_num_input_tokens_seen set on trainer.args after it was built (as
    hyperparameter_search's trials set arguments): the token count of the private batches
    was logged and saved in the checkpoint's trainer_state.json; now switched off again
    when the run starts, with the PrivacyLeakWarning given at construction."""
    import json

    from privlearn.errors import PrivacyLeakWarning

    tr = DPTrainer(model=_llama(), args=_args(tmp_path / "out", max_steps=2,
                                              save_strategy="steps", save_steps=2),
                   train_dataset=_TextSet(), private_state_dir=tmp_path / "private",
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.args.include_num_input_tokens_seen = "all"
    with pytest.warns(PrivacyLeakWarning, match="include_num_input_tokens_seen"):
        tr.train()
    with open(tmp_path / "out" / "checkpoint-2" / "trainer_state.json") as f:
        state = json.load(f)
    assert not state.get("num_input_tokens_seen")
    assert all("tokens" not in k for entry in state["log_history"] for k in entry)
    assert all("tokens" not in k for entry in tr.state.log_history for k in entry)


def test_resume_true_without_a_checkpoint_is_refused(tmp_path):
    """train(resume_from_checkpoint=True) with no checkpoint in output_dir (a mistyped
    folder): the Trainer refuses it; DPTrainer started a fresh run instead, whose epsilon
    left out the steps of the run meant to be resumed. Refused before any step."""
    tr = DPTrainer(model=_llama(), args=_args(tmp_path / "empty"), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    with pytest.raises(ValueError, match="no checkpoint in output_dir"):
        tr.train(resume_from_checkpoint=True)
    assert tr.state.global_step == 0 and tr.privacy_engine is None


@pytest.mark.parametrize("sampling,cycle", [("balls_in_bins", 4), ("shuffled_epochs", 16)])
def test_num_train_epochs_plans_the_epochs_of_the_private_loader(tmp_path, sampling, cycle):
    """num_train_epochs=2 plans two passes over the private loader, whose epoch is
    cycle_length batches under a cycled sampling (not N / B = 8): the target epsilon is
    spent by the steps the Trainer runs, neither calibrated for steps that never run
    (cycle 4: too much noise) nor stopped half-way by the plan (cycle 16)."""
    tr = DPTrainer(model=_llama(), args=_args(tmp_path, max_steps=-1, num_train_epochs=2,
                                              logging_steps=50),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(target_epsilon=2.0, seed=0, sampling=sampling,
                                            cycle_length=cycle))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyBudgetWarning)  # no stop before the end
        tr.train()
    p = tr.privacy_engine
    assert p.plan.steps_per_epoch == len(p.data_loader)
    assert p.accountant.steps == tr.state.max_steps == 2 * len(p.data_loader)
    assert p.plan.planned_steps == p.accountant.steps
    assert tr.epsilon() == pytest.approx(2.0, rel=1e-3)
