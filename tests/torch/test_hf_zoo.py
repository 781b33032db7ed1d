"""Hugging Face architectures users fine-tune (tests/torch/hf_zoo.py: tiny configs of
OPT, GPT-Neo, GPT-NeoX, BLOOM, Falcon, Mistral, Qwen2, Qwen3, Gemma 1-3, Phi, Phi-3,
StableLM, MPT, GPT-J, GPTBigCode, Mixtral, ELECTRA, DeBERTa-v2, XLM-RoBERTa, MobileBERT,
ConvBERT, DeiT, DINOv2, CLIP, BEiT, Swin, ConvNeXt, Wav2Vec2, Whisper, BART, mBART,
Marian, T5, BERT2BERT and Wav2Vec2-to-BERT (EncoderDecoderModel,
SpeechEncoderDecoderModel), LoRA adapters on six of them) trained through
``make_private``: one noise-free step of plain SGD moves the weights by the naive
clipped sum (a loop of batch-of-one backward passes, each gradient clipped on its own)
over the expected batch size, or ``make_private`` / the first step refuses the model
with a typed error before anything is released."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_zoo import FROZEN, LORA, ZOO, base_of, build, loss_of, make_batch, naive_grads  # noqa: E402

from privlearn.errors import (  # noqa: E402
    BatchDependenceError,
    TrainingLoopError,
    UnsupportedModuleError,
)

#: the models whose step is checked in the default suite (the rest are marked slow)
FAST = {"gpt_neox", "bloom", "falcon", "gemma", "phi3", "electra_mlm", "xlm_roberta_mlm",
        "convnext", "bart_frozen_positions", "t5", "opt", "deberta_v2_cls", "mistral",
        "beit", "whisper", "opt_lora", "bert2bert", "wav2vec2_bert"}
#: models refused before any release: the error and the words it says
REFUSED = {
    # tokens dispatched to experts by a router: rows not regrouped into examples
    "mixtral": (BatchDependenceError, "mixture-of-experts routers"),
    "swin": (BatchDependenceError, "without any tensor input"),
    # layers run once on a position table for the whole batch
    "deberta_v2_mlm": (UnsupportedModuleError, "disentangled relative attention"),
    "deberta_v2_cls": (UnsupportedModuleError, "disentangled relative attention"),
    "t5": (UnsupportedModuleError, "relative_attention_bias.requires_grad_"),
    "beit": (BatchDependenceError, "without any tensor input"),
    # SpecAugment's masks drawn from NumPy inside the forward, for the whole batch
    "wav2vec2_specaugment": (UnsupportedModuleError, "apply_spec_augment=False"),
    # its output layer multiplies by the tied embedding's weight outside the Embedding
    "mobilebert_mlm": (TrainingLoopError, "used outside their layers"),
}
#: RMSNorm computed in float32 whatever the model's dtype (by design of those models)
FLOAT32_INSIDE = {"mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "t5",
                  "mixtral"}


def _param(name):
    return pytest.param(name, marks=() if name in FAST else pytest.mark.slow, id=name)


def private_step(oracle, name, model, inputs, labels, c, autocast=None, made=None):
    """One noise-free make_private step of SGD (lr 1, fixed batches of all ``B``
    examples) on ``model`` in place; returns the naive clipped sum over the batch drawn
    and the move of the trainable parameters times ``B`` (both flat, float64). The engine
    is appended to ``made`` (a list) once make_private returns."""
    from torch.utils.data import DataLoader, Dataset

    from privlearn.torch import make_private

    b = labels.shape[0]

    class Rows(Dataset):
        def __len__(self):
            return b

        def __getitem__(self, i):
            return {**{k: v[i] for k, v in inputs.items()}, "labels": labels[i]}

    params = oracle.trainable(model)
    before = [q.detach().clone() for q in params]
    opt = torch.optim.SGD(params, lr=1.0)
    p = make_private(model, opt, DataLoader(Rows(), batch_size=b), noise_multiplier=0.0,
                     max_grad_norm=c, sampling="fixed", seed=0)
    if made is not None:
        made.append(p)
    try:
        batch = dict(next(iter(p.data_loader)))
        y = batch.pop("labels")
        ref, _ = oracle.clip_and_sum(naive_grads(oracle, name, model, batch, y, autocast), c)
        p.optimizer.zero_grad()
        ctx = (torch.autocast("cpu", dtype=autocast) if autocast is not None
               else torch.autocast("cpu", enabled=False))
        with ctx:
            loss = loss_of(name, p.model(**batch), y)
        loss.backward()
        p.optimizer.step()
    finally:
        p.detach()
    moved = oracle.flat(a - q for a, q in zip(before, params, strict=True))
    return ref, moved * b


def _clip(oracle, name, model, inputs, labels):
    rows = naive_grads(oracle, name, model, inputs, labels)
    norms = rows.norm(dim=1)
    c = norms.median().item()  # clips about half the examples
    assert (norms > c).sum() >= 2 and (norms <= c).sum() >= 2
    return c


@pytest.mark.parametrize("name", [_param(n) for n in [*ZOO, *LORA, *FROZEN]
                                   if n not in REFUSED])
def test_private_step_matches_batch_of_one_loop(name, oracle):
    model = build(name)
    inputs, labels = make_batch(name)
    c = _clip(oracle, name, model, inputs, labels)
    ref, got = private_step(oracle, name, model, inputs, labels, c)
    tol = 1e-6 if base_of(name) in FLOAT32_INSIDE else 1e-9
    assert got.abs().sum() > 0
    assert (got - ref).norm() <= tol * ref.norm(), (got - ref).norm() / ref.norm()


@pytest.mark.parametrize("name", [_param(n) for n in ["llama", "mistral", "gemma", "gemma2",
                                                       "deit"]])
def test_private_step_under_bf16_autocast(name, oracle):
    """Forward under CPU bfloat16 autocast (float32 weights): the engine's sum against
    the naive loop under the same autocast, to bfloat16's rounding (measured: 0.3-0.7%)."""
    if name == "llama":
        from hf_models import build as build_llama
        from hf_models import make_batch as llama_batch
        model, (inputs, labels) = build_llama("llama", torch.float32), llama_batch("llama")
        name = "qwen2"  # the same causal kind of batch and loss
    else:
        model, (inputs, labels) = build(name, torch.float32), make_batch(name)
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    c = _clip(oracle, name, copy.deepcopy(model), inputs, labels)
    ref, got = private_step(oracle, name, model, inputs, labels, c, autocast=torch.bfloat16)
    assert (got - ref).norm() <= 0.02 * ref.norm(), (got - ref).norm() / ref.norm()


@pytest.mark.parametrize("name", [_param(n) for n in REFUSED])
def test_refused_before_any_release(name, oracle):
    """make_private or the first step raises a typed error saying why and what to do,
    and the weights are left as they were (nothing was released)."""
    model = build(name, torch.float32)
    inputs, labels = make_batch(name, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    error, words = REFUSED[name]
    made = []
    with pytest.raises(error, match=words):
        private_step(oracle, name, model, inputs, labels, 1.0, made=made)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.accountant.steps == 0 for p in made)


@pytest.mark.parametrize("name", ["gemma", "bart_frozen_positions"])
def test_scaled_word_embeddings_get_their_own_rule(name):
    """Gemma's and BART's word embeddings (``embedding(ids) * embed_scale``) are not
    handed to the plain Embedding rule (which would miss the scale) nor, for their large
    vocabularies, to the generic rule: the scaled rule, checked above by the step."""
    from privlearn.torch.grad_sample import get_rule
    from privlearn.torch.rules.transformers import _RULE_STATE
    from privlearn.torch.tracker import GradSampleTracker

    model = build(name, torch.float32)
    emb = model.get_input_embeddings()
    assert type(emb).__name__.endswith("ScaledWordEmbedding")
    assert get_rule(emb).compute.__name__ == "scaled_embedding_rule"
    inputs, labels = make_batch(name, dtype=torch.float32)
    tracker = GradSampleTracker(model, loss_reduction="mean")
    try:
        loss_of(name, model(**inputs), labels).backward()
        tracker.clipped_sum(1.0)
    finally:
        tracker.detach()
    # the embeddings called (BART's encoder and decoder hold their own, tied) agreed with
    # the generic rule: not replaced by it
    states = [_RULE_STATE.get(m) for m in model.modules() if type(m) is type(emb)]
    assert "ok" in states and "fallback" not in states
