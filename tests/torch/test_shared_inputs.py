"""Layers that read one input tensor (a transformer's query, key and value projections)
share what the tracker forms from it: the input's Gram matrix of the ghost norms (formed
once during backward, ``_ghost_norms.SHARED_GRAM``) and, under autocast, the
half-precision copy of the input it records (``_tracker_util._autocast_input``). The
clipped sum is still the batch-of-one definition's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from cuda_dispatch import OpCounter  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import grad_sample as _gs  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch._ghost_norms import SHARED_GRAM, ghost_parts  # noqa: E402


class _QKV(nn.Module):
    """Three projections of one input, then a fourth of their mix."""

    def __init__(self, d: int = 12):
        super().__init__()
        torch.manual_seed(5)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


_C = 30.0  # the clipping bound: some of the examples below clipped, some not


def _train(model, x, y, steps=3, autocast=None, before_step=None):
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=0.0,
        max_grad_norm=_C,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    if before_step is not None:
        before_step(p)
    forward, backward = OpCounter(), OpCounter()
    for _ in range(steps):
        xb, yb = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        forward, backward = OpCounter(), OpCounter()
        with forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
            loss = (p.model(xb).float() * yb).sum()
        with backward:
            loss.backward()
        p.optimizer.step()
    return p, xb, yb, forward, backward


def _data(n=6, t=5, d=12):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(n, t, d, generator=gen) * torch.linspace(0.05, 2.0, n)[:, None, None]
    return x, torch.randn(n, t, d, generator=gen)


def test_layers_of_one_input_share_its_gram_matrix(oracle, monkeypatch):
    """Ghost norms in every layer: the steady backward pass forms the shared input's Gram
    matrix once for the three projections (eight Gram products before: two a layer) and
    the clipped sum (noise-free, some examples clipped, some not) is the float64
    batch-of-one definition's."""
    monkeypatch.setattr(_gs, "GHOST_MEMORY_BUDGET_BYTES", 0)
    x, y = _data()
    model, ref = _QKV(), _QKV()
    _, xb, yb, _, backward = _train(model, x, y)
    assert backward.ops["bmm"] == 6  # 1 input Gram for q, k, v; 3 of theirs; 2 for o
    want, norms = oracle.clipped_sum(ref, xb, yb, _C, loss_fn=lambda o, v: (o * v).sum())
    assert (norms > _C).any() and (norms < _C).any()
    got = oracle.flat(q.grad for q in model.parameters()) * len(xb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_shared_gram_matrix_is_the_one_formed_alone():
    """The ghost parts of layers reading one input, formed through the shared slot, are
    bitwise those formed one layer at a time; an input changed in place since (its version
    counter) gets its own Gram matrix again."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(3, 9, 16, generator=gen)
    gs = [torch.randn(3, 9, 10, generator=gen) for _ in range(3)]
    alone = [ghost_parts(a, g, torch.bmm) for g in gs]
    slot: list = []
    token = SHARED_GRAM.set(slot)
    try:
        ops = OpCounter()
        with ops:
            shared = [ghost_parts(a, g, torch.bmm) for g in gs]
        assert ops.ops["bmm"] == 4
        for s, o in zip(shared, alone, strict=True):
            assert torch.equal(s.rows, o.rows) and torch.equal(s.roots, o.roots)
            assert s.alpha == o.alpha and s.k == o.k
        a.mul_(2.0)
        again = ghost_parts(a, gs[0], torch.bmm)
    finally:
        SHARED_GRAM.reset(token)
    assert torch.equal(again.rows, ghost_parts(a, gs[0], torch.bmm).rows)
    assert not torch.equal(again.rows, alone[0].rows)


def test_autocast_copy_of_a_shared_input_is_made_once(monkeypatch):
    """Under bfloat16 autocast each projection's input is recorded as the half-precision
    copy the layer computed from: one copy for the three projections of one input (one a
    layer before), and the clipped sum is bitwise the one of a copy a layer."""
    monkeypatch.setattr(_gs, "GHOST_MEMORY_BUDGET_BYTES", 0)
    x, y = _data()
    plain = _QKV()
    forward_plain = OpCounter()
    with forward_plain, torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x).float()
    model = _QKV()
    _, _, _, forward, _ = _train(model, x, y, autocast=torch.bfloat16)
    # autocast's own copies of the input (one a projection) and the one recorded
    assert forward.ops["_to_copy"] == forward_plain.ops["_to_copy"] + 1

    def unshared(p):
        p.optimizer.tracker._cast_slot = None  # a copy a layer

    other = _QKV()
    _, _, _, forward_each, _ = _train(other, x, y, autocast=torch.bfloat16, before_step=unshared)
    assert forward_each.ops["_to_copy"] == forward_plain.ops["_to_copy"] + 3
    for q, r in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(q.grad, r.grad)
