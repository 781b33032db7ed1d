"""Hugging Face models unchanged (default position ids, padding, tied embeddings, tied
masked-LM biases, LoRA): the engine's clipped gradient sum against a naive loop of
batch-of-one backward passes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    build,
    engine_sum,
    make_batch,
    naive_grads,
)

MODELS = ["gpt2", "gpt2_untied", "bert", "llama", "vit", "gpt2_lora", "bert_mlm", "roberta_mlm",
          "albert_mlm", "distilbert_mlm"]


@pytest.mark.parametrize("name", MODELS)
def test_clipped_sum_matches_batch_of_one_loop(name, oracle):
    if name == "gpt2_lora":
        pytest.importorskip("peft")
    model = build(name)
    inputs, labels = make_batch(name)
    rows = naive_grads(oracle, name, model, inputs, labels)
    c = rows.norm(dim=1).median().item()  # clips about half the examples
    ref, ref_norms = oracle.clip_and_sum(rows, c)
    got, norms, batch = engine_sum(name, model, inputs, labels, c)
    assert batch == labels.shape[0]
    assert (ref_norms > c).sum() >= 2 and (ref_norms <= c).sum() >= 2
    # Llama's RMSNorm computes in float32 whatever the model dtype (by design)
    tol = 1e-5 if name == "llama" else 1e-10
    torch.testing.assert_close(norms, ref_norms, rtol=tol, atol=0)
    assert (got - ref).norm() <= tol * ref.norm()


def _checkpointing_enable(model, kwargs=None) -> None:
    """Hugging Face's activation checkpointing, by its current name where transformers has
    it (the former ``gradient_checkpointing_enable`` warns that it is deprecated there)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_gradient_checkpointing(name, oracle):
    """Hugging Face's (non-reentrant) checkpointing recomputes forwards inside backward:
    not recorded twice, not taken for a second backward pass."""
    model = build(name)
    inputs, labels = make_batch(name)
    rows = naive_grads(oracle, name, model, inputs, labels)
    c = rows.norm(dim=1).median().item()
    ref, _ = oracle.clip_and_sum(rows, c)
    _checkpointing_enable(model)
    got, _, _ = engine_sum(name, model, inputs, labels, c)
    assert (got - ref).norm() <= 1e-10 * ref.norm()


def test_reentrant_checkpointing_is_refused():
    model = build("gpt2")
    inputs, labels = make_batch("gpt2")
    _checkpointing_enable(model, {"use_reentrant": True})
    with pytest.raises(RuntimeError, match="use_reentrant"):
        engine_sum("gpt2", model, inputs, labels, 1.0)


def test_make_private_trains_hf_model_with_default_inputs():
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private, per_sequence_cross_entropy

    model = build("gpt2", dtype=torch.float32)
    inputs, labels = make_batch("gpt2", b=24)
    data = TensorDataset(inputs["input_ids"], inputs["attention_mask"], labels)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    p = make_private(model, opt, DataLoader(data, batch_size=8), noise_multiplier=1.0,
                     max_grad_norm=1.0, seed=0)
    before = [q.detach().clone() for q in model.parameters()]
    for ids, mask, lab in p.data_loader:
        p.optimizer.zero_grad()
        out = p.model(input_ids=ids, attention_mask=mask)
        per_sequence_cross_entropy(out.logits, lab, shift=True).backward()
        p.optimizer.step()
    assert p.accountant.steps == 3
    assert all(not torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))


def test_lora_only_adapters_cost_and_peft_sees_what_it_expects(tmp_path):
    peft = pytest.importorskip("peft")
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private, per_sequence_cross_entropy

    model = build("gpt2_lora", dtype=torch.float32)
    trainable_before = model.get_nb_trainable_parameters()
    flags = {n: q.requires_grad for n, q in model.named_parameters()}
    keys = list(model.state_dict())
    inputs, labels = make_batch("gpt2", b=16)
    data = TensorDataset(inputs["input_ids"], inputs["attention_mask"], labels)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.5)
    p = make_private(model, opt, DataLoader(data, batch_size=8), noise_multiplier=0.5,
                     max_grad_norm=1.0, seed=0)
    tracker = p.optimizer.tracker
    assert tracker.params and all(
        any(q is r for n, r in model.named_parameters() if "lora_" in n) for q in tracker.params)
    assert {type(u.module).__name__ for u in tracker.units} == {"Linear"}
    for ids, mask, lab in p.data_loader:
        p.optimizer.zero_grad()
        out = p.model(input_ids=ids, attention_mask=mask)
        per_sequence_cross_entropy(out.logits, lab, shift=True).backward()
        # while training: the flags and keys peft reports are the user's
        assert model.get_nb_trainable_parameters() == trainable_before
        assert {n: q.requires_grad for n, q in model.named_parameters()} == flags
        assert list(model.state_dict()) == keys
        p.optimizer.step()
    trained = {n: q.detach().clone() for n, q in model.named_parameters() if "lora_" in n}
    model.save_pretrained(tmp_path / "adapter")
    fresh = peft.PeftModel.from_pretrained(build("gpt2", dtype=torch.float32),
                                           tmp_path / "adapter")
    loaded = {n: q for n, q in fresh.named_parameters() if "lora_" in n}
    assert set(loaded) == set(trained)
    for n, q in trained.items():
        torch.testing.assert_close(loaded[n], q)


def test_dropout_inside_a_fallback_layer_is_refused_before_the_first_step():
    import transformers as tf
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import UnsupportedModuleError, make_private

    cfg = tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                       num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       hidden_dropout_prob=0.1, num_labels=3)
    model = tf.ViTForImageClassification(cfg).train()
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8)), batch_size=4)
    with pytest.raises(UnsupportedModuleError, match=r"vit.embeddings \(ViTEmbeddings\)"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     noise_multiplier=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt2", "llama", "vit"])
def test_clipped_sum_matches_batch_of_one_loop_cuda(name, oracle):
    model = build(name).cuda()
    inputs, labels = make_batch(name)
    inputs = {k: v.cuda() for k, v in inputs.items()}
    labels = labels.cuda()
    rows = naive_grads(oracle, name, model, inputs, labels)
    c = rows.norm(dim=1).median().item()
    ref, ref_norms = oracle.clip_and_sum(rows, c)
    got, norms, _ = engine_sum(name, model, inputs, labels, c)
    tol = 1e-5 if name == "llama" else 1e-9
    torch.testing.assert_close(norms, ref_norms, rtol=tol, atol=0)
    assert (got - ref).norm() <= tol * ref.norm()
