"""Mixed precision: bf16 autocast agrees with float32 to bf16 tolerance; norms and
clipped sums are float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402

BF16_TOL = 3e-2  # per-example norms: a few units of bf16's 2^-7 rounding over layers


def _autograd_error(model, run) -> float:
    """Relative error of autograd's own (non-private) gradient under bf16 autocast
    against float32: the yardstick of "bf16 tolerance" for this model and batch."""
    grads = []
    for ac in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            loss = run()
        loss.backward()
        grads.append(torch.cat([q.grad.reshape(-1).double() for q in model.parameters()
                                if q.requires_grad and q.grad is not None]))
    model.zero_grad()
    return ((grads[1] - grads[0]).norm() / grads[0].norm()).item()


class _Scale(nn.Module):
    """A layer without a rule (handled by the torch.func fallback)."""

    def __init__(self, d):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.s


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.LayerNorm(8), _Scale(8),
                         nn.Linear(8, 3))


def _clipped(model, x, y, c, autocast):
    tracker = GradSampleTracker(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        sums, _, norms = tracker.clipped_sum(c)
    finally:
        tracker.detach()
    return torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()]), norms


def test_mlp_bf16_autocast_matches_float32():
    model = _mlp()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    tol = 2 * _autograd_error(model, lambda: nn.functional.cross_entropy(model(x).float(), y))
    _, n = _clipped(model, x, y, 1e9, False)
    c = n.median().item()
    ref, n32 = _clipped(model, x, y, c, False)
    got, nb = _clipped(model, x, y, c, True)
    assert nb.dtype == torch.float32 and got.dtype == torch.float32
    assert ((nb - n32).abs() / n32).max() < BF16_TOL
    assert 0 < (got - ref).norm() < tol * ref.norm()


def test_make_private_step_under_bf16_autocast():
    model = _mlp()
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=16),
                     noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    for xb, yb in p.data_loader:
        p.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(p.model(xb).float(), yb)
        loss.backward()
        p.optimizer.step()
    assert all(q.dtype == torch.float32 and torch.isfinite(q).all() for q in model.parameters())
    assert p.accountant.steps == 4


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "vit", "gpt2_lora"])
def test_hf_bf16_autocast_matches_float32(name):
    pytest.importorskip("transformers")
    if name == "gpt2_lora":
        pytest.importorskip("peft")
    from hf_models import build, engine_sum, loss_of, make_batch

    model = build(name, dtype=torch.float32)
    inputs, labels = make_batch(name, dtype=torch.float32)
    tol = 2 * _autograd_error(model, lambda: loss_of(name, model(**inputs), labels))
    _, n, _ = engine_sum(name, model, inputs, labels, 1e9)
    c = n.median().item()
    ref, n32, _ = engine_sum(name, model, inputs, labels, c)
    got, nb, _ = engine_sum(name, model, inputs, labels, c, autocast=torch.bfloat16)
    assert ((nb - n32).abs() / n32).max() < BF16_TOL
    assert 0 < (got - ref).norm() < max(tol, 1e-3) * ref.norm()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_static_loss_scale_is_unscaled_before_clipping(dtype):
    """fp16: a loss multiplied by S (a static loss scale) with ``tracker.loss_scale = S``
    gives the clipped sum of the unscaled loss (the scale never reaches the clip)."""
    model = _mlp()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    ref, n = _clipped(model, x, y, 0.5, False)
    tracker = GradSampleTracker(model)
    tracker.loss_scale = 1024.0
    with torch.autocast("cpu", dtype=dtype):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    (loss * 1024.0).backward()
    sums, _, norms = tracker.clipped_sum(0.5)
    tracker.detach()
    got = torch.cat([sums[id(q)].reshape(-1) for q in model.parameters()])
    assert ((norms - n).abs() / n).max() < BF16_TOL
    assert (got - ref).norm() < BF16_TOL * 3 * ref.norm()
