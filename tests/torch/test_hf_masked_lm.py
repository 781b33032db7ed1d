"""Masked language models (BertForMaskedLM, RobertaForMaskedLM): their heads register the
decoder's bias a second time (``cls.predictions.bias is cls.predictions.decoder.bias``)
and tie the decoder's weight to the word embeddings. One DP-SGD step through make_private
and through DPTrainer against the naive ground truth (a loop of batch-of-one backward
passes, each example's whole gradient clipped, summed; float64, no noise), in every
per-example gradient mode and with flat and per-layer clipping; the noise of the tied
bias is one draw (its released standard deviation measured)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import build, make_batch, trainable  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import grad_sample, make_private, per_sequence_cross_entropy  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402

#: examples in the training set, expected batch size
N, B = 8, 4
#: masked language models whose head registers its decoder's bias a second time
MASKED_LM = ["bert_mlm", "roberta_mlm"]
#: the per-example gradient forms the engine can choose from ("auto": its own choice)
MODES = ["auto", "ghost", "materialise"]
#: the registrations of the tied bias, (enclosing module's, decoder's)
TIED = {"bert_mlm": ("cls.predictions.bias", "cls.predictions.decoder.bias"),
        "roberta_mlm": ("lm_head.bias", "lm_head.decoder.bias")}


def _force(mode, monkeypatch):
    if mode != "auto":
        monkeypatch.setattr(grad_sample, "use_ghost", lambda *a, **k: mode == "ghost")


def _loss(name, model, ids, mask, labels, reduction="mean"):
    out = model(input_ids=ids, attention_mask=mask)
    return per_sequence_cross_entropy(out.logits, labels, reduction=reduction)


def _rows(name, model, ids, mask, labels):
    """Per-example gradients ``(n, P)`` (float64) over ``trainable(model)`` by the loop of
    batch-of-one backward passes, on a copy of the model."""
    model = copy.deepcopy(model)
    params = trainable(model)
    rows = []
    for i in range(ids.shape[0]):
        g = torch.autograd.grad(_loss(name, model, ids[i:i + 1], mask[i:i + 1],
                                      labels[i:i + 1]), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if x is None else x).reshape(-1)
                               for x, p in zip(g, params, strict=True)]).double())
    return torch.stack(rows)


def _bounds(name, model, rows, clipping):
    """A bound clipping some examples and not others: flat, the median per-example norm;
    per-layer, ``{name: median of that parameter's per-example norms}`` for every
    trainable parameter (each tensor once, under its model.named_parameters() name)."""
    if clipping == "flat":
        return rows.norm(dim=1).median().item()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in trainable(model)]
    assert len(names) == len(sizes)
    assert TIED[name][0] in names and TIED[name][1] not in names
    return {n: max(b.norm(dim=1).median().item(), 1e-6)
            for n, b in zip(names, rows.split(sizes, dim=1), strict=True)}


def _clipped_sum(rows, model, bound):
    """Each example's gradient clipped (flat: whole; per-layer: each parameter's block to
    its own bound), summed."""
    if not isinstance(bound, dict):
        factors = (bound / rows.norm(dim=1)).clamp(max=1.0)
        return (rows * factors[:, None]).sum(0)
    sizes = [p.numel() for p in trainable(model)]
    blocks = rows.split(sizes, dim=1)
    out = [(b * (c / b.norm(dim=1)).clamp(max=1.0)[:, None]).sum(0)
           for b, c in zip(blocks, bound.values(), strict=True)]
    return torch.cat(out)


def _moved(before, model):
    return torch.cat([(a - p.detach()).reshape(-1).double()
                      for a, p in zip(before, trainable(model), strict=True)])


# ----------------------------------------------------------------------- make_private


def _make_private_step(name, mode, clipping, monkeypatch):
    _force(mode, monkeypatch)
    model = build(name)
    inputs, labels = make_batch(name, b=N, seed=3)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    rows = _rows(name, model, ids, mask, labels)
    bound = _bounds(name, model, rows, clipping)
    before = [p.detach().clone() for p in trainable(model)]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = TensorDataset(torch.arange(N), ids, mask, labels)
    p = make_private(model, opt, DataLoader(data, batch_size=B), noise_multiplier=0.0,
                     max_grad_norm=bound, clipping=clipping, seed=2)
    idx, b_ids, b_mask, b_labels = next(iter(p.data_loader))
    assert idx.numel() >= 2
    opt_ = p.optimizer
    opt_.zero_grad()
    _loss(name, p.model, b_ids, b_mask, b_labels).backward()
    opt_.step()
    assert p.accountant.steps == 1
    return _moved(before, model), _clipped_sum(rows[idx], model, bound) / B, rows[idx], bound


@pytest.mark.parametrize("name", MASKED_LM)
def test_make_private_step_equals_the_naive_clipped_loop(name, monkeypatch):
    moved, ref, rows, c = _make_private_step(name, "auto", "flat", monkeypatch)
    norms = rows.norm(dim=1)
    assert (norms > c).any() and (norms <= c).any()  # the bound is what is compared
    assert (moved - ref).norm() <= 1e-9 * ref.norm()


@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MASKED_LM)
def test_make_private_step_in_every_mode_and_clipping(name, mode, clipping, monkeypatch):
    moved, ref, _, _ = _make_private_step(name, mode, clipping, monkeypatch)
    assert (moved - ref).norm() <= 1e-9 * ref.norm()


@pytest.mark.parametrize("name", MASKED_LM)
def test_per_layer_step_equals_the_naive_clipped_loop(name, monkeypatch):
    """The tied bias has one bound (under its first name), its block clipped once."""
    moved, ref, _, _ = _make_private_step(name, "ghost", "per_layer", monkeypatch)
    assert (moved - ref).norm() <= 1e-9 * ref.norm()


def test_per_layer_bound_under_the_second_name_of_a_tied_tensor_is_refused():
    model = build("bert_mlm")
    inputs, labels = make_batch("bert_mlm", b=N)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    bounds = {n: 1.0 for n in names}
    bounds["cls.predictions.decoder.bias"] = bounds.pop("cls.predictions.bias")
    data = TensorDataset(inputs["input_ids"], inputs["attention_mask"], labels)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match=r"cls\.predictions\.decoder\.bias.*same tensor as "
                                         r"'cls\.predictions\.bias'"):
        make_private(model, opt, DataLoader(data, batch_size=B), noise_multiplier=1.0,
                     max_grad_norm=bounds, clipping="per_layer")


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_the_tied_bias_gets_one_noise_draw(clipping):
    """The released gradient of the tied bias (SGD, lr 1: minus the update) has standard
    deviation sigma C / B, as every parameter's: one draw per tensor (a draw per name would
    give sqrt(2) sigma C / B). The clipped sum over B is at most 2 C in norm (at most 8
    examples), the noise about sqrt(V) sigma C / B: measured over 20 steps of V = 97
    entries each (per-layer: C = sqrt(sum_k C_k^2), the tied tensors' bounds once)."""
    sigma, steps = 200.0, 20
    model = build("bert_mlm")
    inputs, labels = make_batch("bert_mlm", b=N)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    bound = 1.0 if clipping == "flat" else {n: 0.5 for n in names}
    c = 1.0 if clipping == "flat" else 0.5 * len(names) ** 0.5  # sqrt(sum_k C_k^2)
    bias = model.cls.predictions.bias
    weight = model.bert.embeddings.word_embeddings.weight  # tied to the decoder's weight
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = TensorDataset(inputs["input_ids"], inputs["attention_mask"], labels)
    p = make_private(model, opt, DataLoader(data, batch_size=B), noise_multiplier=sigma,
                     max_grad_norm=bound, clipping=clipping, seed=0, max_epsilon=float("inf"))
    drawn = {"bias": [], "weight": []}
    it = iter(p.data_loader)
    for _ in range(steps):
        ids, mask, lab = next(it, None) or next(iter(p.data_loader))
        before = {"bias": bias.detach().clone(), "weight": weight.detach().clone()}
        p.optimizer.zero_grad()
        _loss("bert_mlm", p.model, ids, mask, lab).backward()
        p.optimizer.step()
        drawn["bias"].append(before["bias"] - bias.detach())
        drawn["weight"].append(before["weight"] - weight.detach())
    want = sigma * c / B
    for key, xs in drawn.items():
        x = torch.cat([t.reshape(-1) for t in xs])
        std = x.pow(2).mean().sqrt().item()
        # relative error of the estimate about 1 / sqrt(2 n) (n >= 1940): 1.6% or less
        assert abs(std / want - 1) < 0.12, (key, std, want)


def test_token_level_labels_to_the_model_stay_refused():
    """The model's own loss (labels=) averages over the batch's tokens: refused."""
    model = build("bert_mlm")
    inputs, labels = make_batch("bert_mlm", b=N)
    data = TensorDataset(inputs["input_ids"], inputs["attention_mask"], labels)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(data, batch_size=B), noise_multiplier=1.0, max_grad_norm=1.0)
    ids, mask, lab = next(iter(p.data_loader))
    with pytest.raises(ConfigurationError, match="token-level labels"):
        p.model(input_ids=ids, attention_mask=mask, labels=lab)
    assert p.accountant.steps == 0


# ----------------------------------------------------------------------- DPTrainer


class _MaskedSet(torch.utils.data.Dataset):
    """:func:`make_batch`'s masked-LM examples as Trainer features."""

    def __init__(self, name):
        inputs, self.labels = make_batch(name, b=N, seed=3)
        self.ids, self.mask = inputs["input_ids"], inputs["attention_mask"]

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


def _args(out, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=B, max_steps=1, learning_rate=1.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        lr_scheduler_type="constant", disable_tqdm=True, dataloader_pin_memory=False, **kw)


def _trainer_step(name, mode, clipping, tmp_path, monkeypatch):
    _force(mode, monkeypatch)
    model = build(name)
    data = _MaskedSet(name)
    rows = _rows(name, model, data.ids, data.mask, data.labels)
    bound = _bounds(name, model, rows, clipping)
    before = [p.detach().clone() for p in trainable(model)]
    seen = []

    def collate(feats):
        batch = transformers.default_data_collator(feats)
        seen.append(batch["input_ids"].clone())
        return batch

    tr = DPTrainer(model=model, args=_args(tmp_path), train_dataset=data,
                   data_collator=collate,
                   optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
                   privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=bound,
                                            clipping=clipping, seed=3))
    tr.train()
    assert tr.privacy_engine.accountant.steps == 1
    idx = [next(i for i in range(N) if torch.equal(data.ids[i], r)) for r in seen[-1]]
    assert len(idx) >= 2
    return _moved(before, model), _clipped_sum(rows[idx], model, bound) / B


@pytest.mark.parametrize("name", MASKED_LM)
def test_dp_trainer_step_equals_the_naive_clipped_loop(name, tmp_path, monkeypatch):
    """DPTrainer's masked-LM loss is each example's mean over its own masked tokens."""
    moved, ref = _trainer_step(name, "auto", "flat", tmp_path, monkeypatch)
    assert (moved - ref).norm() <= 1e-9 * ref.norm()


@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MASKED_LM)
def test_dp_trainer_step_in_every_mode_and_clipping(name, mode, clipping, tmp_path,
                                                    monkeypatch):
    moved, ref = _trainer_step(name, mode, clipping, tmp_path, monkeypatch)
    assert (moved - ref).norm() <= 1e-9 * ref.norm()


def test_dp_trainer_token_level_mean_loss_stays_refused(tmp_path):
    """A compute_loss returning the model's own (token-level) loss is refused before the
    first batch."""

    class TokenMean(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            logits = out.logits
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), inputs["labels"].reshape(-1))

    model = build("bert_mlm")
    with pytest.warns(UserWarning, match="compute_loss overrides"):
        tr = TokenMean(model=model, args=_args(tmp_path), train_dataset=_MaskedSet("bert_mlm"),
                       optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
                       privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0))
    with pytest.raises(ConfigurationError, match="not a mean over the batch's examples"):
        tr.train()
