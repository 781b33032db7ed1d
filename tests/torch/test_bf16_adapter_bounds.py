"""peft adapters with bfloat16 parameters: every example's contribution to the clipped
sum stays within the clip bound (up to float32's rounding of the weighted sum), and the
clipped sum is as close to a float64 naive loop as bf16's own per-example gradients are.

The reference is the naive clipped loop (batches of one, autograd, clip, sum) in float64
on the same bfloat16 parameters upcast; the yardstick is the same loop run in bfloat16
(per-example gradients from bfloat16 autograd, clipped and summed in float64): the
rounding any bfloat16 computation of these gradients carries."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from privlearn.torch.losses import per_sequence_cross_entropy  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402

V, T, B = 61, 6, 4
#: example weights of the loss: two examples with gradients 1e2 and 1e4 times larger
WEIGHTS = (1.0, 1e4, 1.0, 1e2)
#: the documented rounding of the weighted sum (float32, docs' trust model): about
#: ``2^-24 T`` relative for an example whose per-position terms do not cancel
SUM_ROUNDING = 4 * (T + 4) * 2.0**-24


def _model(kind):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=V,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    targets = ["wte", "c_attn"] if kind == "lora_embedding" else ["c_attn", "c_proj"]
    model = peft.get_peft_model(
        tf.GPT2LMHeadModel(cfg),
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=targets,
            fan_in_fan_out=True,
            lora_dropout=0.0,
            use_dora=kind == "dora",
        ),
    )
    torch.manual_seed(1)
    with torch.no_grad():  # every adapter factor away from its initial zero
        for q in model.parameters():
            if q.requires_grad:
                q.add_(0.1 * torch.randn_like(q))
    return model.to(torch.bfloat16).train()


def _trainable(model):
    return [q for q in model.parameters() if q.requires_grad]


def _losses(model, ids):
    logits = model(input_ids=ids).logits.float()
    return per_sequence_cross_entropy(logits, ids, shift=True, reduction="none")


def _engine(model, ids, c, w):
    """The engine's clipped sum (float64, flattened) of the losses weighted by ``w``."""
    tracker = GradSampleTracker(model, loss_reduction="sum")
    try:
        (_losses(model, ids) * torch.tensor(w)).sum().backward()
        sums, _, _ = tracker.clipped_sum(c)
    finally:
        tracker.detach()
    for q in _trainable(model):
        q.grad = None
    return torch.cat(
        [
            sums[id(q)].reshape(-1).double()
            if id(q) in sums
            else q.new_zeros(q.numel(), dtype=torch.float64)
            for q in _trainable(model)
        ]
    )


def _naive(model, ids, c, dtype):
    """The naive clipped loop on a copy of ``model`` in ``dtype`` (float64 sum, norms)."""
    model = copy.deepcopy(model).to(dtype)
    params = _trainable(model)
    total, norms = 0, []
    for i in range(B):
        loss = (_losses(model, ids[i : i + 1]) * WEIGHTS[i]).sum()
        g = torch.cat([x.reshape(-1).double() for x in torch.autograd.grad(loss, params)])
        norms.append(g.norm().item())
        total = total + g * min(1.0, c / norms[-1])
    return total, norms


@pytest.mark.parametrize("kind", ["lora", "dora", "lora_embedding"])
def test_bf16_adapter_contributions_within_the_bound_and_bf16_accurate(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, V, (B, T), generator=g)
    ids[0, 2:] = ids[0, 1]  # a repeated token: embedding rows summed within an example
    _, n = _naive(model, ids, float("inf"), torch.float64)
    c = 1e-3 * min(n)  # every example clipped, the largest by a factor of ~1e7
    ref, _ = _naive(model, ids, c, torch.float64)
    bf16, _ = _naive(model, ids, c, torch.bfloat16)
    got = _engine(model, ids, c, WEIGHTS)
    err, own = ((got - ref).norm() / ref.norm()).item(), ((bf16 - ref).norm() / ref.norm()).item()
    assert 0 < err <= 1.5 * own, (err, own)
    for i in range(B):  # example i alone: the others' output gradients are exactly zero
        alone = [w if j == i else 0.0 for j, w in enumerate(WEIGHTS)]
        size = _engine(model, ids, c, alone).norm().item()
        assert c * (1 - 2.0**-6) < size <= c * (1 + SUM_ROUNDING), (i, size / c)
