"""Tiny config-initialised Hugging Face models and a naive per-example reference (shared
by the tests/torch/test_hf_*.py files; no weights are downloaded)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from toys import trainable  # noqa: F401  (re-exported: tests take it from here too)

from privlearn.torch.losses import per_sequence_cross_entropy
from privlearn.torch.tracker import GradSampleTracker

VOCAB = 97
T = 7
B = 6
#: masked language models (labels -100 but at the masked positions, loss unshifted)
MASKED_LM = ("bert_mlm", "roberta_mlm", "albert_mlm", "distilbert_mlm")
#: the id of the mask token in :func:`make_batch`'s masked-LM inputs
MASK_ID = VOCAB - 1


class TokenSet(torch.utils.data.Dataset):
    """``n`` random sequences of ``t`` token ids in ``[1, vocab)``, unpadded and labelled by
    themselves: a causal language-modelling training set for DPTrainer tests."""

    def __init__(self, n: int, t: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, t), generator=g)

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.ids[i]}


class UserColumn(torch.utils.data.Dataset):
    """The features of ``inner`` with a ``user`` column: users of ``per_user``
    consecutive examples (example ``i`` belongs to user ``i // per_user``)."""

    def __init__(self, inner, per_user: int):
        self.inner, self.per_user = inner, per_user

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return {**self.inner[i], "user": i // self.per_user}


class BatchSet(torch.utils.data.Dataset):
    """The ``n`` examples of :func:`make_batch` (``name``'s inputs, float32, from
    ``seed``) as Trainer features: ``input_ids``, ``attention_mask``, ``labels``."""

    def __init__(self, name: str = "gpt2", n: int = B, seed: int = 4):
        inputs, labels = make_batch(name, b=n, seed=seed, dtype=torch.float32)
        self.ids, self.mask, self.labels = inputs["input_ids"], inputs["attention_mask"], labels

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


class FeatureSet(torch.utils.data.Dataset):
    """``n`` examples of six standard normal features (from seed 0) labelled by the sign
    of the first, as Trainer features ``x``, ``labels``: for :class:`FeatureModel`."""

    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class FeatureModel(torch.nn.Module):
    """``Linear(6, 2)`` answering the Trainer's ``{"loss", "logits"}`` (the loss, the
    cross-entropy, only when given ``labels``): the smallest model a DPTrainer trains."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 2)

    def forward(self, x, labels=None):
        logits = self.fc(x)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def build(name: str, dtype=torch.float64, seed: int = 0, vocab: int = VOCAB):
    import transformers as tf

    torch.manual_seed(seed)
    if name in ("gpt2", "gpt2_untied", "gpt2_lora"):
        cfg = tf.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=name != "gpt2_untied",
                            bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, num_labels=3)
        model = tf.BertForSequenceClassification(cfg)
    elif name == "bert_mlm":  # decoder.bias is cls.predictions.bias, its weight the embedding
        cfg = tf.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        model = tf.BertForMaskedLM(cfg)
    elif name == "roberta_mlm":  # decoder.bias is lm_head.bias
        cfg = tf.RobertaConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=32,
                               max_position_embeddings=40, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        model = tf.RobertaForMaskedLM(cfg)
    elif name == "albert_mlm":  # predictions.decoder.bias is predictions.bias
        cfg = tf.AlbertConfig(vocab_size=vocab, embedding_size=8, hidden_size=16,
                              num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, max_position_embeddings=32,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = tf.AlbertForMaskedLM(cfg)
    elif name == "distilbert_mlm":  # vocab_projector.weight tied, its bias its own
        cfg = tf.DistilBertConfig(vocab_size=vocab, dim=16, n_layers=2, n_heads=2,
                                  hidden_dim=32, max_position_embeddings=32, dropout=0.0,
                                  attention_dropout=0.0)
        model = tf.DistilBertForMaskedLM(cfg)
    elif name == "llama":
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=32,
                             bos_token_id=0, eos_token_id=0)
        model = tf.LlamaForCausalLM(cfg)
    elif name == "vit":
        cfg = tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                           num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           num_labels=3)
        model = tf.ViTForImageClassification(cfg)
    else:
        raise KeyError(name)
    with torch.no_grad():  # non-trivial norm weights and biases (and masked-LM biases)
        for n, p in model.named_parameters():
            if ("norm" in n.lower() or "ln" in n.split(".")[-2:][0]
                    or n in ("cls.predictions.bias", "lm_head.bias", "predictions.bias",
                             "vocab_projector.bias")):
                p.add_(0.1 * torch.randn_like(p))
    if name == "gpt2_lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
            lora_dropout=0.0))
        with torch.no_grad():  # LoRA B starts at zero: move it so every factor matters
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    model = model.to(dtype)
    model.train()
    return model


def pad_every_other(ids: torch.Tensor) -> torch.Tensor:
    """Right-pad every other example of the ``(b, t)`` token ids in place (example ``i``
    keeps its first ``2 + i % (t - 2)`` tokens, the rest set to 0); the attention mask."""
    b, t = ids.shape
    mask = torch.ones(b, t, dtype=torch.long)
    for i in range(0, b, 2):
        n = 2 + (i % (t - 2))
        mask[i, n:] = 0
        ids[i, n:] = 0
    return mask


def make_batch(name: str, b: int = B, t: int = T, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return {"pixel_values": torch.randn(b, 3, 8, 8, generator=g, dtype=dtype)}, \
            torch.randint(0, 3, (b,), generator=g)
    ids = torch.randint(1, VOCAB, (b, t), generator=g)
    mask = pad_every_other(ids)
    if name == "bert":
        return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (b,), generator=g)
    if name in MASKED_LM:  # about a third of the real tokens masked, the rest -100
        picked = (torch.rand(b, t, generator=g) < 0.35) & (mask == 1)
        picked[:, 0] |= mask[:, 0] == 1  # every example has a masked token
        labels = ids.masked_fill(~picked, -100)
        return {"input_ids": ids.masked_fill(picked, MASK_ID), "attention_mask": mask}, labels
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def loss_of(name: str, out, labels, reduction: str = "mean"):
    logits = out.logits
    if logits.dim() == 3:
        return per_sequence_cross_entropy(logits, labels, shift=name not in MASKED_LM,
                                          reduction=reduction)
    return F.cross_entropy(logits.float() if logits.dtype in (torch.bfloat16, torch.float16)
                           else logits, labels, reduction=reduction)


def autocast_to(device_type: str, dtype=None):
    """``torch.autocast(device_type, dtype=dtype)``, or no autocast when dtype is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def naive_grads(oracle, name, model, inputs, labels, autocast=None):
    """Per-example gradients (B, P) in float64 by the batch-of-one loop of ``oracle``
    (tests/torch/conftest.py) on a copy of ``model``, each example's inputs sliced from
    ``inputs`` (forward and loss under ``torch.autocast`` to ``autocast`` when given)."""
    model = copy.deepcopy(model)

    def loss(i):
        return loss_of(name, model(**{k: v[i:i + 1] for k, v in inputs.items()}),
                       labels[i:i + 1])

    return oracle.grads(loss, labels.shape[0], trainable(model), autocast=autocast)


def engine_sum(name, model, inputs, labels, max_grad_norm, autocast=None):
    """The tracker's clipped sum (flattened, float64) and per-example norms."""
    params = trainable(model)
    tracker = GradSampleTracker(model, loss_reduction="mean")
    try:
        with autocast_to(params[0].device.type, autocast):
            loss = loss_of(name, model(**inputs), labels)
        loss.backward()
        sums, batch, norms = tracker.clipped_sum(max_grad_norm)
    finally:
        tracker.detach()
    flat = torch.cat([sums[id(p)].reshape(-1).double() if id(p) in sums
                      else torch.zeros(p.numel(), dtype=torch.float64, device=p.device)
                      for p in params])
    return flat, norms.double(), batch
