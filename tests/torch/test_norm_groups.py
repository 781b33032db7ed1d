"""Per-example squared norms formed by groups of layers (``_row_norms``): ghost layers of one
shape finished together, held rows (biases, LayerNorms) concatenated, at the end of the
backward pass; the clipped sum is still the float64 batch-of-one definition's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from cuda_dispatch import OpCounter  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import grad_sample as _gs  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch._ghost_norms import finish_parts, ghost_parts, ghost_sq  # noqa: E402


def _exact_sq(a, g):
    return torch.einsum("ntp,ntd->npd", g.double(), a.double()).flatten(1).square().sum(1)


@pytest.mark.parametrize("t", [8, 256])
def test_ghost_layers_finished_together_are_each_layer_alone(t):
    """Four layers of one shape finished by one stacked reduction: bitwise each layer's
    own ``ghost_sq`` for short rows (the same sums a row); for long rows (two-stage sums)
    never below the exact squared norm and within a few percent of it."""
    gen = torch.Generator().manual_seed(t)
    xs = [
        (torch.randn(3, t, 24, generator=gen), torch.randn(3, t, 20, generator=gen))
        for _ in range(4)
    ]
    got = finish_parts([ghost_parts(a, g, torch.bmm) for a, g in xs])
    assert got.shape == (4, 3)
    for row, (a, g) in zip(got, xs, strict=True):
        exact = _exact_sq(a, g)
        assert (row.double() >= exact).all() and (row.double() <= exact * 1.05).all()
        if t <= 128:
            assert torch.equal(row, ghost_sq(a, g, torch.bmm))


def _model():
    torch.manual_seed(3)
    layers = []
    for i in range(4):
        layers.append(nn.Linear(12, 12))
        if i < 3:
            layers.append(nn.LayerNorm(12))
    return nn.Sequential(*layers)


def test_grouped_norms_give_the_batch_of_one_clipped_sum(oracle, monkeypatch):
    """Ghost norms in every Linear (four of one shape) and three LayerNorms: the backward
    pass of a steady step finishes the four ghost norms by one ``addcmul`` (one a layer
    before) and the ten held rows' norms (biases, LayerNorm weights and biases) by one
    ``vector_norm`` (one a parameter before), the step adds each bias by one product; the
    clipped sum (noise-free, SGD at rate 0) is the float64 batch-of-one definition's,
    some examples clipped, some not."""
    monkeypatch.setattr(_gs, "GHOST_MEMORY_BUDGET_BYTES", 0)
    n, t = 6, 5
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, t, 12, generator=gen) * torch.linspace(0.05, 2.0, n)[:, None, None]
    y = torch.randn(n, t, 12, generator=gen)
    model = _model()
    ref = _model()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, y), batch_size=n),
        noise_multiplier=0.0,
        max_grad_norm=55.0,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    for _ in range(3):
        xb, yb = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        loss = (p.model(xb) * yb).sum()
        ops, step_ops = OpCounter(), OpCounter()
        with ops:
            loss.backward()
        with step_ops:
            p.optimizer.step()
    assert ops.ops["bmm"] >= 8  # the ghost form: two Gram products a layer
    assert ops.ops["addcmul"] == 1
    assert ops.ops["linalg_vector_norm"] == 1
    # the step weighs each bias's per-example rows by one product (a sum of the scaled
    # output gradients and an addition before): its additions are plain SGD's alone, one
    # a parameter
    n_params = sum(1 for _ in model.parameters())
    assert step_ops.ops["add_"] == n_params and step_ops.ops["sum"] <= 2
    want, norms = oracle.clipped_sum(ref, xb, yb, 55.0, loss_fn=lambda o, v: (o * v).sum())
    assert (norms > 55.0).any() and (norms < 55.0).any()
    got = oracle.flat(q.grad for q in model.parameters()) * n  # / expected batch size
    # float32 sums and the ghost bound's over-statement (~1e-6 of a norm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
