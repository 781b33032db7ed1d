"""DPTrainer's per-example loss follows the model's task, read from transformers' auto-model
mappings (not from the class name): a plain GPT2LMHeadModel was trained as token
classification (unshifted: it learned to copy its input)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_trainer import (  # noqa: E402
    B,
    T,
    V,
    _args,
    _llama,
    _recording_collate,
    _TextSet,
)

from privlearn.torch import per_sequence_cross_entropy  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402


def _gpt2(seed=0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def _bert(cls, **kw):
    torch.manual_seed(0)
    return cls(transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=32,
                                       max_position_embeddings=32, **kw))


def test_gpt2_lm_head_model_trains_on_the_next_token(tmp_path):
    """sigma = 0, no clipping, SGD, one step: the update is the gradient of the *shifted*
    per-sequence loss (next-token prediction), summed over the batch, over B."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    seen = []

    collate = _recording_collate(seen)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    DPTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=_TextSet(),
              data_collator=collate, optimizers=(opt, None),
              privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=float("inf"),
                                       seed=3)).train()
    batch = seen[-1]  # after make_private's collations of example 0 (its layout check)
    assert len(seen) == 3 and batch["input_ids"].shape[0] > 0
    out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    per_sequence_cross_entropy(out.logits, batch["labels"], shift=True,
                               reduction="sum").backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach() - 0.05 * b.grad / B, rtol=1e-4,
                                   atol=1e-6, msg=name)


class _MyGPT(transformers.GPT2LMHeadModel):  # a user's subclass: its base class decides
    pass


class TinyForCausalLM(torch.nn.Module):  # named like a causal LM, in no mapping
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, V)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"logits": self.emb(input_ids)}


def test_task_is_read_from_transformers_mappings(tmp_path):
    peft = pytest.importorskip("peft")
    tr = DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0))
    tokens = torch.zeros(2, T, dtype=torch.long)
    per_example = torch.zeros(2, dtype=torch.long)
    gpt2 = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=16, n_layer=1,
                                   n_head=2)
    cases = [
        (_gpt2(), tokens, "causal_lm"),
        (_llama(), tokens, "causal_lm"),
        (_MyGPT(gpt2), tokens, "causal_lm"),
        (peft.get_peft_model(_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                      fan_in_fan_out=True)),
         tokens, "causal_lm"),  # a plain PeftModel (no task_type) around a GPT-2 LM
        (_bert(transformers.BertForSequenceClassification, num_labels=3), per_example,
         "sequence_classification"),
        (_bert(transformers.BertForTokenClassification, num_labels=3), tokens,
         "token_classification"),
        (_bert(transformers.BertForMaskedLM), tokens, "masked_lm"),
        (TinyForCausalLM(), per_example, "sequence_classification"),  # one label each
        (TinyForCausalLM(), torch.zeros(2, 3), "sequence_classification"),  # multi-label
    ]
    for model, labels, task in cases:
        assert tr._task(model, labels) == task, type(model).__name__


def test_an_undetermined_task_is_refused_until_given(tmp_path):
    """A custom class (whatever its name) or a class in two task mappings, with per-token
    labels, could be causal or not: refused, naming task=; a token-level model given one
    label per example is refused too."""
    tokens = torch.zeros(2, T, dtype=torch.long)
    tr = DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0))
    torch.manual_seed(0)
    xlm = transformers.XLMWithLMHeadModel(transformers.XLMConfig(
        vocab_size=V, emb_dim=16, n_layers=1, n_heads=2, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"TinyForCausalLM is not a transformers model "
                                         r"class.*PrivacyArguments\(task=\.\.\.\)"):
        tr._task(TinyForCausalLM(), tokens)
    with pytest.raises(ValueError, match=r"XLMWithLMHeadModel is in several.*causal_lm, "
                                         r"masked_lm.*PrivacyArguments\(task=\.\.\.\)"):
        tr._task(xlm, tokens)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is a causal_lm model.*shape \(2,\)"):
        tr._task(_gpt2(), torch.zeros(2, dtype=torch.long))
    given = DPTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_TextSet(),
                      privacy=PrivacyArguments(noise_multiplier=1.0, task="causal_lm"))
    assert given._task(TinyForCausalLM(), tokens) == given._task(xlm, tokens) == "causal_lm"


@pytest.mark.parametrize("first_batch", ["drawn", "empty"])
def test_refused_before_any_step(tmp_path, monkeypatch, first_batch):
    """Refused at the first step, also when the first Poisson batch is empty (one run in
    (7/8)^64 = 1 / 5,000 at B / N = 1/8): its labels' shape is checked as well."""
    if first_batch == "empty":
        from privlearn.torch.samplers import PoissonBatchSampler

        draw = PoissonBatchSampler._draw
        monkeypatch.setattr(PoissonBatchSampler, "_draw",
                            lambda self, seed: [] if self.draws == 0 else draw(self, seed))
    tr = DPTrainer(model=TinyForCausalLM(), args=_args(tmp_path, max_steps=2),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    with pytest.raises(ValueError, match="cannot tell how to compute the per-example loss"):
        tr.train()
    assert tr.state.global_step == 0 and tr.privacy_engine.accountant.steps == 0


@pytest.mark.parametrize("label_shape", [(4,), (4, 1)])
def test_regression_loss_of_a_batch_is_the_mean_of_its_examples_losses(tmp_path, label_shape):
    """num_labels=1 (regression): a float target per example, given as shape (B,) or
    (B, 1) (a one-element list per example, as collators build it). The batch's loss is
    the mean of the batch-size-1 losses (nothing mixes examples: broadcasting (B, 1)
    targets against (B,) outputs would give each example every other example's label);
    targets of a shape that is not one per example are refused."""
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=0, num_labels=1))
    tr = DPTrainer(model=model, args=_args(tmp_path), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    ds = _TextSet()
    g = torch.Generator().manual_seed(2)
    x = {"input_ids": ds.ids[:4], "attention_mask": ds.mask[:4],
         "labels": torch.randn(label_shape, generator=g)}
    with torch.no_grad():
        batch = tr.compute_loss(model, x)
        singles = [tr.compute_loss(model, {k: v[i:i + 1] for k, v in x.items()})
                   for i in range(4)]
        out = model(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
    torch.testing.assert_close(batch, torch.stack(singles).mean())
    naive = ((out.reshape(-1) - x["labels"].reshape(-1)) ** 2).mean()
    torch.testing.assert_close(batch, naive)
    with pytest.raises(ValueError, match=r"1 target\(s\) per example.*got shape \(4, 2\)"):
        tr.compute_loss(model, {**x, "labels": torch.randn(4, 2)})
