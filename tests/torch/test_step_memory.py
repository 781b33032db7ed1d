"""What a private step keeps alive: one budget for the per-example gradients it
materialises, and normalisation layers' records released during backward. Both change
only where the per-example quantities live, never the clipped sum (checked against a
loop of batch-of-one backward passes)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privlearn.torch import grad_sample, make_private
from privlearn.torch.tracker import GradSampleTracker


def _naive_clipped_sum(model, x, y, c):
    params = [p for p in model.parameters() if p.requires_grad]
    total = None
    for i in range(x.shape[0]):
        loss = nn.functional.mse_loss(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        g = g * min(1.0, c / g.norm().item())
        total = g if total is None else total + g
    return total


def _deep(width=16, depth=6):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("budget_layers", [0, 2, 100])
def test_materialised_per_example_gradients_share_one_budget(monkeypatch, budget_layers):
    """Layers that would materialise (T^2 (d + p) >= d p) do so only while the step's
    budget lasts; the rest use ghost norms; the clipped sum is the same either way."""
    model = _deep()
    b, t, d = 4, 8, 16
    per_layer = b * d * d * 8  # float64 weight gradients of one layer
    monkeypatch.setattr(grad_sample, "STEP_MATERIALISE_BUDGET_BYTES",
                        budget_layers * per_layer)
    x = torch.randn(b, t, d, dtype=torch.float64)
    y = torch.randn(b, t, d, dtype=torch.float64)
    ref = _naive_clipped_sum(model, x, y, 0.5)
    tracker = GradSampleTracker(model, loss_reduction="sum")
    seen = []
    orig = grad_sample.OuterProduct.__init__

    def spy(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        seen.append(self._ps is not None)

    monkeypatch.setattr(grad_sample.OuterProduct, "__init__", spy)
    try:
        nn.functional.mse_loss(model(x), y, reduction="sum").backward()
        sums, _, _ = tracker.clipped_sum(0.5)
    finally:
        tracker.detach()
    assert sum(seen) == min(budget_layers, 6) and len(seen) == 6
    got = torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, ref)


def test_norm_layers_are_clipped_from_what_backward_left():
    """After the first step, a LayerNorm's rule runs during backward and its recorded
    input and output gradient are released; the step's clipped sum is unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(),
                          nn.Linear(8, 3)).double()
    with torch.no_grad():
        model[1].weight.add_(0.3 * torch.randn(8, dtype=torch.float64))
    ref_model = copy.deepcopy(model)
    x = torch.randn(12, 5, dtype=torch.float64)
    y = torch.randn(12, 3, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    p = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=6),
                     noise_multiplier=0.0, max_grad_norm=0.3, sampling="fixed",
                     loss_reduction="sum")
    for i, (xb, yb) in enumerate(p.data_loader):
        p.optimizer.zero_grad()
        nn.functional.mse_loss(p.model(xb), yb, reduction="sum").backward()
        norm_recs = p.optimizer.tracker.records[
            [u.module for u in p.optimizer.tracker.units].index(model[1])]
        if i == 0:  # the first step's probe and checks read the records
            assert norm_recs[0].early is None and norm_recs[0].args
        else:
            assert norm_recs[0].early is not None and norm_recs[0].args == ()
        p.optimizer.step()
        got = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        ref = _naive_clipped_sum(ref_model, xb, yb, 0.3) / p.optimizer.expected_batch_size
        torch.testing.assert_close(got, ref)


def test_bf16_autocast_records_the_cast_input_and_matches_a_float64_loop():
    """Under bf16 autocast a Linear layer computes from its input cast to bf16: after the
    first step the engine records that cast (half the memory), and the clipped sum still
    matches per-example gradients of the same autocast forward (batch-of-one backward
    passes, clipped in float64) to bf16 accuracy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    ref_model = copy.deepcopy(model)
    x = torch.randn(16, 5, 6)
    y = torch.randn(16, 5, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    p = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=8),
                     noise_multiplier=0.0, max_grad_norm=0.5, sampling="fixed",
                     loss_reduction="sum")

    def loss_of(m, xb, yb):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(xb)
        return nn.functional.mse_loss(out.float(), yb, reduction="sum")

    params = list(ref_model.parameters())
    for i, (xb, yb) in enumerate(p.data_loader):
        p.optimizer.zero_grad()
        loss = loss_of(p.model, xb, yb)
        tracker = p.optimizer.tracker
        first = tracker.records[[u.module for u in tracker.units].index(model[0])][0]
        # the first layer's input is the float32 batch: recorded as it is on the first
        # step (its probe re-runs the layers), as the bf16 cast the layer used after it
        # (the record of the forward: after the first step the rule is evaluated during
        # backward, which releases it)
        assert first.args[0].dtype == (torch.float32 if i == 0 else torch.bfloat16)
        loss.backward()
        assert (first.early is None) == (i == 0)
        p.optimizer.step()
        got = torch.cat([q.grad.reshape(-1) for q in model.parameters()]).double()
        ref = None
        for j in range(xb.shape[0]):
            gs = torch.autograd.grad(loss_of(ref_model, xb[j:j + 1], yb[j:j + 1]), params)
            g = torch.cat([t.reshape(-1) for t in gs]).double()
            g = g * min(1.0, 0.5 / g.norm().item())
            ref = g if ref is None else ref + g
        ref = ref / p.optimizer.expected_batch_size
        assert (got - ref).norm() < 2e-2 * ref.norm()


@pytest.mark.parametrize("wide", [True, False], ids=["outputs_wider", "inputs_wider"])
def test_overflowing_example_is_masked_whichever_side_carries_the_weights(monkeypatch, wide):
    """The clipped sum of a ghost layer puts the clip factors on its narrower side and
    cleans the wider one: an example with a non-finite input still contributes exactly
    zero, and the others' sum is theirs (against the batch without it)."""
    def build():
        torch.manual_seed(0)
        d, p = (4, 48) if wide else (48, 4)
        return nn.Sequential(nn.Linear(d, p), nn.Tanh(), nn.Linear(p, 3)).double()

    monkeypatch.setattr(grad_sample, "STEP_MATERIALISE_BUDGET_BYTES", 0)  # ghost norms
    model, ref_model = build(), build()
    d = model[0].in_features
    x = torch.randn(6, 40, d, dtype=torch.float64)
    x[2, 5, 1] = float("inf")
    keep = [0, 1, 3, 4, 5]
    tracker = GradSampleTracker(model, loss_reduction="sum")
    ref = GradSampleTracker(ref_model, loss_reduction="sum")
    try:
        model(x).sum().backward()
        out = {id(q): torch.zeros_like(q) for q in model.parameters()}
        _, _, norms = tracker.clipped_sum(1.0, out=out)
        ref_model(x[keep]).sum().backward()
        ref_sums, _, _ = ref.clipped_sum(1.0)
    finally:
        tracker.detach()
        ref.detach()
    assert tracker.last_overflow_count == 1 and torch.isinf(norms[2])
    for q, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(out[id(q)], ref_sums[id(r)])


class _Shared(nn.Module):
    """Layers reading one input: three narrower ones (the wider input cleaned, as the
    query, key and value projections) and two wider ones (the input scaled, as a gated
    MLP's gate and up projections), and a layer reading another tensor between them."""

    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d, d)
        self.mid = nn.Linear(d, d)
        self.gate, self.up = nn.Linear(d, 3 * d), nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(3 * d, 2)

    def forward(self, x):
        h = torch.tanh(self.q(x)) + torch.tanh(self.v(x)) + self.k(x).repeat(1, 1, 2)
        h = self.mid(h)
        return self.out(torch.tanh(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("where", ["input", "gradient"])
def test_tensor_read_by_several_layers_is_masked_once_with_the_same_sums(monkeypatch,
                                                                         where):
    """Layers reading one recorded tensor share its cleaned (and scaled) form in the
    clipped sum that masks a non-finite example: the sums are those of the batch without
    the example, exactly zero from it, whichever side it was non-finite on."""
    def build():
        torch.manual_seed(0)
        return _Shared(8).double()

    from privlearn.torch import _rows, clipping

    monkeypatch.setattr(grad_sample, "GHOST_MEMORY_BUDGET_BYTES", 0)  # ghost norms
    monkeypatch.setattr(grad_sample, "STEP_MATERIALISE_BUDGET_BYTES", 0)
    seen = []
    real = clipping.shared_rows

    @contextlib.contextmanager
    def spy(tensors):
        with real(tensors):
            state = _rows._SHARED.get()
            seen.append(len(state))  # the tensors read by several layers
            yield
            seen.append(len(state))  # ... left after the sum (each after its last reader)

    monkeypatch.setattr(clipping, "shared_rows", spy)
    model, ref_model = build(), build()
    torch.manual_seed(1)
    x = torch.randn(6, 5, 8, dtype=torch.float64)
    keep = [0, 1, 3, 4, 5]
    w = torch.ones(6, 5, 2, dtype=torch.float64)
    if where == "input":
        x[2, 3, 1] = float("inf")
    else:
        w[2, 1, 0] = float("nan")  # a non-finite output gradient of example 2
    tracker = GradSampleTracker(model, loss_reduction="sum")
    ref = GradSampleTracker(ref_model, loss_reduction="sum")
    try:
        (model(x) * w).sum().backward()
        out = {id(q): torch.zeros_like(q) for q in model.parameters()}
        _, _, norms = tracker.clipped_sum(1.0, out=out)
        (ref_model(x[keep]) * w[keep]).sum().backward()
        ref_sums, _, ref_norms = ref.clipped_sum(1.0)
    finally:
        tracker.detach()
        ref.detach()
    assert tracker.last_overflow_count == 1 and not torch.isfinite(norms[2])
    assert seen[:2] == [2, 0]  # the input of q, k and v, that of gate and up; released
    torch.testing.assert_close(norms[keep], ref_norms)
    for q, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(out[id(q)], ref_sums[id(r)])
