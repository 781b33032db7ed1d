"""Per-layer clipping against its naive definition, its accounting and its bad inputs."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402


def _model():
    torch.manual_seed(0)
    emb = nn.Embedding(11, 6)
    head = nn.Linear(6, 11, bias=False)
    head.weight = emb.weight  # tied: its bound applies to the summed gradient

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin, self.norm, self.head = emb, nn.Linear(6, 6), nn.LayerNorm(6), head

        def forward(self, ids):
            return self.head(self.norm(torch.tanh(self.lin(self.emb(ids))))).mean(1)

    return M().double()


def _data(n=40):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (n, 5), generator=g), torch.randint(0, 11, (n,), generator=g)


def test_per_layer_clipping_equals_naive_definition(oracle):
    model = _model()
    ids, y = _data()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    ref_model = copy.deepcopy(model)
    rows = oracle.grads(lambda i: nn.functional.cross_entropy(ref_model(ids[i:i + 1]),
                                                              y[i:i + 1]),
                        len(ids), list(ref_model.parameters()))
    sizes = [p.numel() for p in params]
    _, norms = oracle.clip_and_sum(rows, [math.inf] * len(sizes), sizes)
    # each parameter's bound at the median of its per-example norms: half are clipped
    bounds = norms.median(dim=0).values.tolist()
    ref, _ = oracle.clip_and_sum(rows, bounds, sizes)
    clipped = int((norms > torch.tensor(bounds, dtype=norms.dtype)).sum())
    assert 0 < clipped < len(ids) * len(bounds)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(ids, y), batch_size=len(ids))
    p = make_private(model, opt, loader, noise_multiplier=0.0, clipping="per_layer",
                     max_grad_norm=dict(zip(names, bounds, strict=True)), seed=0)
    assert p.max_grad_norm == pytest.approx(math.sqrt(sum(c * c for c in bounds)))
    # the full batch, one step: p.grad is the clipped sum / expected batch size
    next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(ids), y).backward()
    p.optimizer.step()
    torch.testing.assert_close(oracle.flat(q.grad for q in params) * len(ids), ref,
                               rtol=1e-10, atol=1e-12)


def test_per_layer_noise_and_accounting_use_the_total_bound():
    model = nn.Linear(3, 2)
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    p = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=10),
                     noise_multiplier=2.0, clipping="per_layer", max_grad_norm=[3.0, 4.0],
                     seed=0)
    assert p.max_grad_norm == pytest.approx(5.0)
    assert p.optimizer._noise_std() == pytest.approx(2.0 * 5.0 / 10)
    for xb, yb in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.mse_loss(p.model(xb), yb).backward()
        p.optimizer.step()
        break
    assert p.accountant.segments[-1].max_grad_norm == pytest.approx(5.0)


@pytest.mark.parametrize("bad, match", [
    ([1.0], "one bound per trainable parameter"),
    ([1.0, 1.0, 1.0], "got a list of 3"),
    ({"weight": 1.0}, "missing"),
    ({"weight": 1.0, "bias": 1.0, "x": 1.0}, "unknown"),
    ([1.0, -1.0], r"max_grad_norm\['bias'\] must be in \(0, inf\)"),
    (1.0, "needs max_grad_norm as a list"),
])
def test_per_layer_bad_input(bad, match):
    model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(20, 3)), batch_size=10)
    with pytest.raises(ValueError, match=match):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     noise_multiplier=1.0, clipping="per_layer", max_grad_norm=bad)


def test_list_bound_needs_per_layer_and_clipping_is_checked():
    model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(20, 3)), batch_size=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="clipping='per_layer'"):
        make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=[1.0, 1.0])
    with pytest.raises(ValueError, match="clipping must be"):
        make_private(model, opt, loader, noise_multiplier=1.0, clipping="layer")


def test_per_layer_clipping_refuses_a_layer_unfrozen_later():
    """The bounds are fixed per parameter at make_private (their root-sum-square is the
    accounted sensitivity); a layer unfrozen later has none: a clear refusal, not a
    KeyError naming a parameter id, and nothing released."""
    torch.manual_seed(0)
    x = torch.randn(128, 10)
    ds = TensorDataset(x, (x[:, 0] > 0).long())
    m = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    for q in m[0].parameters():
        q.requires_grad_(False)
    p = make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(ds, batch_size=32),
                     noise_multiplier=1.0, clipping="per_layer", max_grad_norm=[1.0, 1.0],
                     sampling="fixed", seed=0)
    it = iter(p.data_loader)
    xb, yb = next(it)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    p.optimizer.step()
    for q in m[0].parameters():
        q.requires_grad_(True)
    before = [q.detach().clone() for q in m.parameters()]
    xb, yb = next(it)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    with pytest.raises(ValueError, match=r"per-layer clipping.*'0\.weight'.*clipping='flat'"):
        p.optimizer.step()
    assert p.accountant.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
