"""DPTrainer on encoder-decoder models (BART, mBART, Marian, T5 with its relative
attention bias frozen, transformers' generic EncoderDecoderModel as BERT2BERT and
SpeechEncoderDecoderModel as Wav2Vec2 with a BERT decoder): each example's loss is the
mean over its own target tokens, the decoder fed with its labels shifted right as the
model does it, and one noise-free step moves the weights by the naive clipped sum (a loop
of batch-of-one passes, each loss the model's own ``labels=`` loss of that example alone)
over the expected batch size. T5 with a trainable relative attention bias, and
encoder-decoders trained as another task, are refused when the trainer is built."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_zoo import build  # noqa: E402
from test_hf_trainer import _args, _eps  # noqa: E402

from privlearn.errors import ConfigurationError, UnsupportedModuleError  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402

N, B, S, L = 16, 8, 7, 6  # examples, expected batch, source and target lengths
VOCAB = 97


class _Pairs(torch.utils.data.Dataset):
    """Source ids right-padded (pad 1) and target labels right-padded with -100, of
    lengths varying across examples (a token-level mean would weigh them unequally)."""

    def __init__(self, dtype_seed=0):
        g = torch.Generator().manual_seed(dtype_seed)
        self.src = torch.randint(3, VOCAB - 1, (N, S), generator=g)
        self.mask = torch.ones(N, S, dtype=torch.long)
        self.labels = torch.randint(3, VOCAB - 1, (N, L), generator=g)
        for i in range(N):
            self.mask[i, 2 + i % (S - 2) :] = 0
            self.labels[i, 1 + (3 * i) % (L - 1) :] = -100
        self.src = self.src.masked_fill(self.mask == 0, 1)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.src[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def _recording(seen):
    def collate(feats):
        batch = transformers.default_data_collator(feats)
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch

    return collate


def _own_loss_grads(oracle, model, batch):
    """(n, P) float64: row i the gradient of the model's own loss of example i alone
    (``labels=``: its mean over that example's target tokens)."""
    model = copy.deepcopy(model)
    model.train()

    def loss(i):
        return model(**{k: v[i : i + 1] for k, v in batch.items()}).loss

    return oracle.grads(loss, batch["labels"].shape[0], oracle.trainable(model))


def _noiseless_step(oracle, tmp_path, model, data, max_grad_norm):
    """One DPTrainer step without noise (SGD, learning rate 1) on ``data``: a copy of the
    model before it, its trainable parameters, their values before it, and the batches
    the trainer drew (the last is the step's)."""
    ref_model = copy.deepcopy(model)
    params = oracle.trainable(model)
    before = oracle.flat(params)
    seen = []
    DPTrainer(
        model=model,
        args=_args(tmp_path, max_steps=1, per_device_train_batch_size=B),
        train_dataset=data,
        data_collator=_recording(seen),
        optimizers=(torch.optim.SGD(params, lr=1.0), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=max_grad_norm, seed=1),
    ).train()
    return ref_model, params, before, seen


@pytest.mark.parametrize("name", ["bart", "mbart", "marian", "t5_frozen_bias", "bert2bert"])
@pytest.mark.filterwarnings("ignore:Version v4.12.0 introduces")  # EncoderDecoderModel's labels=
def test_step_is_the_naive_clipped_sum_of_per_example_losses(name, oracle, tmp_path):
    model = build(name)  # float64, norms and biases off their initial values
    data = _Pairs()
    everything = {"input_ids": data.src, "attention_mask": data.mask, "labels": data.labels}
    norms = _own_loss_grads(oracle, model, everything).norm(dim=1)
    c = norms.median().item()  # clips about half the examples
    ref_model, params, before, seen = _noiseless_step(oracle, tmp_path, model, data, c)
    batch = seen[-1]  # the batch drawn (after make_private's collations of example 0)
    assert batch["labels"].shape[0] >= 2
    rows = _own_loss_grads(oracle, ref_model, batch)
    assert (rows.norm(dim=1) > c).any() and (rows.norm(dim=1) <= c).any()
    ref, _ = oracle.clip_and_sum(rows, c)
    moved = (before - oracle.flat(params)) * B
    assert moved.abs().sum() > 0
    tol = 1e-6 if name.startswith("t5") else 1e-9  # T5's RMSNorm runs in float32 inside
    assert (moved - ref).norm() <= tol * ref.norm(), (moved - ref).norm() / ref.norm()


def test_bart_trains_a_few_noisy_steps_and_reports_its_epsilon(tmp_path):
    model = build("bart", torch.float32)
    start = copy.deepcopy(model.state_dict())
    tr = DPTrainer(
        model=model,
        args=_args(tmp_path, max_steps=3, per_device_train_batch_size=B),
        train_dataset=_Pairs(),
        privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0, seed=0),
    )
    tr.train()
    assert tr.privacy_engine.accountant.steps == 3
    assert tr.epsilon() == pytest.approx(_eps(1.0, 3, q=B / N), rel=1e-6)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in start.items())


def test_t5_trainable_relative_attention_bias_is_refused_and_frozen_trains(tmp_path):
    model = build("t5", torch.float32)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    privacy = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(
        UnsupportedModuleError, match=r"relative_attention_bias.*requires_grad_\(False\)"
    ):
        DPTrainer(
            model=model, args=_args(tmp_path, max_steps=1), train_dataset=_Pairs(), privacy=privacy
        )
    assert not calls
    for m in model.modules():  # what the error says to do
        if hasattr(m, "relative_attention_bias"):
            m.relative_attention_bias.requires_grad_(False)
    tr = DPTrainer(
        model=model, args=_args(tmp_path, max_steps=1), train_dataset=_Pairs(), privacy=privacy
    )
    tr.train()
    assert tr.privacy_engine.accountant.steps == 1 and calls


def test_peft_lora_on_t5_trains(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build("t5", torch.float32), peft.LoraConfig(r=2, target_modules=["q", "v"])
    )
    tr = DPTrainer(
        model=model,
        args=_args(tmp_path, max_steps=1),
        train_dataset=_Pairs(),
        privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0),
    )
    tr.train()
    assert tr.privacy_engine.accountant.steps == 1


def _bart_classifier():
    torch.manual_seed(0)
    return transformers.BartForSequenceClassification(
        transformers.BartConfig(
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            pad_token_id=1,
            decoder_start_token_id=2,
        )
    )


@pytest.mark.parametrize(
    "make,task",
    [(lambda: build("bart", torch.float32), "masked_lm"), (_bart_classifier, None)],
    ids=["bart-as-masked-lm", "bart-classification"],
)
def test_encoder_decoder_of_another_task_is_refused_when_built(tmp_path, make, task):
    model = make()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ConfigurationError, match="encoder-decoder.*task='seq2seq_lm'"):
        DPTrainer(
            model=model,
            args=_args(tmp_path, max_steps=1),
            train_dataset=_Pairs(),
            privacy=PrivacyArguments(noise_multiplier=1.0, task=task),
        )
    with pytest.raises(ConfigurationError, match="encoder-decoder"):  # model_init too
        DPTrainer(
            model_init=make,
            args=_args(tmp_path, max_steps=1),
            train_dataset=_Pairs(),
            privacy=PrivacyArguments(noise_multiplier=1.0, task=task),
        )
    assert not calls


class _PadTargets(_Pairs):
    """Targets padded with the model's pad token (a tokenizer's ``text_target=`` with
    ``padding=True``), not ``-100``."""

    def __init__(self, pad):
        super().__init__()
        self.own = [int((row != -100).sum()) for row in self.labels]
        self.labels = self.labels.masked_fill(self.labels == -100, pad)


def test_targets_padded_with_the_pad_token_are_each_examples_own(oracle, tmp_path):
    """The pad targets after an example's end exist only next to a longer example: the
    step is the clipped sum of each example's loss alone with its target unpadded."""
    model = build("bart")
    data = _PadTargets(model.config.pad_token_id)
    ref_model, params, before, seen = _noiseless_step(oracle, tmp_path, model, data, 2.0)
    batch = seen[-1]
    rows = torch.tensor(
        [i for i in range(N) if any(torch.equal(data.src[i], s) for s in batch["input_ids"])]
    )
    assert len(rows) == batch["input_ids"].shape[0] >= 2
    trimmed = copy.deepcopy(ref_model)

    def loss(j):
        i = int(rows[j])
        return trimmed(
            input_ids=data.src[i : i + 1],
            attention_mask=data.mask[i : i + 1],
            labels=data.labels[i : i + 1, : data.own[i]],
        ).loss

    ref, _ = oracle.clip_and_sum(oracle.grads(loss, len(rows), oracle.trainable(trimmed)), 2.0)
    moved = (before - oracle.flat(params)) * B
    assert (moved - ref).norm() <= 1e-9 * ref.norm(), (moved - ref).norm() / ref.norm()


def test_trailing_pad_targets_are_ignored_but_an_end_token_equal_to_pad():
    from types import SimpleNamespace

    from privlearn.torch._hf_collate import own_target_labels

    labels = torch.tensor([[5, 6, 0, 0], [5, 0, 6, 0], [5, 6, 7, 8]])
    model = SimpleNamespace(config=SimpleNamespace(pad_token_id=0, eos_token_id=2))
    want = torch.tensor([[5, 6, -100, -100], [5, 0, 6, -100], [5, 6, 7, 8]])
    assert torch.equal(own_target_labels(model, labels, {}), want)
    model.config.eos_token_id = 0  # the first pad of the run is the end
    want = torch.tensor([[5, 6, 0, -100], [5, 0, 6, 0], [5, 6, 7, 8]])
    assert torch.equal(own_target_labels(model, labels, {}), want)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])  # its own mask decides
    got = own_target_labels(model, labels, {"decoder_attention_mask": mask})
    assert torch.equal(got, torch.tensor([[5, 6, 0, -100], [5, 0, 6, 0], [5, 6, 7, 8]]))


class _Speech(torch.utils.data.Dataset):
    """Whisper's mel features and target labels (-100 after each end)."""

    def __init__(self):
        g = torch.Generator().manual_seed(2)
        self.features = torch.randn(N, 8, 16, generator=g, dtype=torch.float64)
        self.labels = _Pairs().labels

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_features": self.features[i], "labels": self.labels[i]}


@pytest.mark.filterwarnings("ignore:WhisperPositionalEmbedding subclasses Embedding")
def test_whisper_decoder_inputs_are_shifted_from_the_config(oracle, tmp_path):
    """Whisper has no prepare_decoder_input_ids_from_labels: its decoder inputs are the
    labels shifted right behind config.decoder_start_token_id (-100 read as padding), as
    its forward builds them from labels=."""
    model = build("whisper")
    assert not hasattr(model, "prepare_decoder_input_ids_from_labels")
    ref_model, params, before, seen = _noiseless_step(oracle, tmp_path, model, _Speech(), 1.0)
    rows = _own_loss_grads(oracle, ref_model, seen[-1])
    ref, _ = oracle.clip_and_sum(rows, 1.0)
    moved = (before - oracle.flat(params)) * B
    assert moved.abs().sum() > 0
    assert (moved - ref).norm() <= 1e-9 * ref.norm(), (moved - ref).norm() / ref.norm()


class _Waves(_Speech):
    """Raw waveforms (a Wav2Vec2 encoder's input_values) and target labels."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.features = torch.randn(N, 400, generator=g, dtype=torch.float64)

    def __getitem__(self, i):
        return {"input_values": self.features[i], "labels": self.labels[i]}


@pytest.mark.filterwarnings("ignore:.*batching rule for aten")
def test_speech_encoder_decoder_step_is_the_naive_clipped_sum(oracle, tmp_path):
    """transformers' generic SpeechEncoderDecoderModel (a Wav2Vec2 encoder, a BERT decoder
    with cross-attention): each example's clipped gradient is that of its own loss."""
    model = build("wav2vec2_bert")
    data = _Waves()
    everything = {"input_values": data.features, "labels": data.labels}
    c = _own_loss_grads(oracle, model, everything).norm(dim=1).median().item()
    ref_model, params, before, seen = _noiseless_step(oracle, tmp_path, model, data, c)
    rows = _own_loss_grads(oracle, ref_model, seen[-1])
    assert (rows.norm(dim=1) > c).any() and (rows.norm(dim=1) <= c).any()
    ref, _ = oracle.clip_and_sum(rows, c)
    moved = (before - oracle.flat(params)) * B
    assert moved.abs().sum() > 0
    assert (moved - ref).norm() <= 1e-9 * ref.norm(), (moved - ref).norm() / ref.norm()
