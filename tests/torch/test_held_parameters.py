"""A layer's parameter containers (``nn.ParameterDict`` / ``nn.ParameterList`` children,
never called) belong to the layer's unit: per-example gradients of the tensors its
forward reads from them, checked against a naive loop of batches of one."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from toys import toy_data  # noqa: E402

from privlearn.torch import make_private  # noqa: E402


class _Adapted(nn.Module):
    """A frozen linear layer with a trained per-feature scale and shift kept in
    containers, as peft keeps its adapters (one entry per adapter name)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(6, 8).requires_grad_(False)
        self.scale = nn.ParameterDict({"default": nn.Parameter(torch.linspace(0.5, 1.5, 8))})
        self.shift = nn.ParameterList([nn.Parameter(torch.linspace(-0.3, 0.3, 8))])

    def forward(self, x):
        return self.base(x) * self.scale["default"] + self.shift[0]


def test_container_parameters_below_the_root_get_per_example_gradients():
    """sigma = 0, a bound below every example's norm, SGD: one step equals the sum of
    each example's gradient (a batch of one), clipped, over the expected batch size --
    the container-held scale and shift included (they were refused as used outside
    their layers)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Adapted(), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    c, lr = 1e-3, 1.0
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        DataLoader(toy_data(n=32), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=c,
        seed=0,
    )
    x, y = next(iter(p.data_loader))
    assert x.shape[0] > 0
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    mine = [q for q in ref.parameters() if q.requires_grad]
    total = [torch.zeros_like(q) for q in mine]
    for i in range(x.shape[0]):
        g = torch.autograd.grad(nn.functional.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]), mine)
        norm = torch.sqrt(sum((t.double() ** 2).sum() for t in g)).item()
        assert norm > c
        for t, gi in zip(total, g, strict=True):
            t += (c / norm) * gi
    trained = [q for q in model.parameters() if q.requires_grad]
    assert len(trained) == 4  # scale, shift, the head's weight and bias
    for a, b, t in zip(trained, mine, total, strict=True):
        assert t.abs().max() > 0
        torch.testing.assert_close(a.detach(), b.detach() - lr * t / 8, rtol=1e-4, atol=1e-9)
