"""Training-loop patterns users write around ``p.model``, each checked against the naive
ground truth (batch-of-one backward passes: per-example gradient, clipped, summed) or
refused before anything is released.

The model called twice per step on one batch: the batch-independence probe replayed only
the step's first forward, so an operation that mixes examples on a path only a later
call takes (other keywords, another view) trained unchecked."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from toys import toy_data  # noqa: E402

from privlearn.torch import BatchDependenceError, make_private  # noqa: E402

C, B = 0.5, 8


class _TwoPaths(nn.Module):
    """A per-example path, and one taken with ``centre=True`` that subtracts the batch
    mean of the hidden layer (it mixes examples)."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x, centre=False):
        h = torch.tanh(self.a(x))
        if centre:
            h = h - h.mean(0, keepdim=True)
        return self.head(h)


def _private(model):
    return make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                        DataLoader(toy_data(n=32, dtype=torch.float64), batch_size=B),
                        noise_multiplier=0.0, max_grad_norm=C, seed=0, sampling="fixed")


def _flat(params):
    return torch.cat([q.detach().reshape(-1) for q in params])


@pytest.mark.parametrize("centred_call", ["second", "first"])
def test_a_later_call_that_mixes_examples_is_refused_before_any_release(centred_call):
    """``ce(model(x)) + ce(model(x, centre=True))``: removing one example moves every
    other example's gradient through the batch mean. With the mixing call second the step
    trained (the probe replayed the first call only); now refused like the reverse order,
    nothing released and no step accounted."""
    torch.manual_seed(0)
    model = _TwoPaths().double()
    p = _private(model)
    x, y = next(iter(p.data_loader))
    before = _flat(model.parameters())
    calls = [lambda: p.model(x), lambda: p.model(x, centre=True)]
    if centred_call == "first":
        calls.reverse()
    p.optimizer.zero_grad()
    (F.cross_entropy(calls[0](), y) + F.cross_entropy(calls[1](), y)).backward()
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        p.optimizer.step()
    assert torch.equal(_flat(model.parameters()), before)
    assert p.accountant.steps == 0


def _naive_sum(model, loss_of, n):
    """Sum over examples of each example's gradient of ``loss_of(model, i)`` clipped to C,
    by batch-of-one backward passes (float64)."""
    rows = []
    for i in range(n):
        grads = torch.autograd.grad(loss_of(model, i), list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    rows = torch.stack(rows)
    return (rows * (C / rows.norm(dim=1)).clamp(max=1.0)[:, None]).sum(0)


def test_two_per_example_views_of_the_batch_train_as_the_loop_of_batches_of_one():
    """A consistency loss on an augmented second view (a later call on other inputs,
    probed too) is not refused: its update is the naive clipped sum of each example's
    two-view loss."""
    import copy

    torch.manual_seed(0)
    model = _TwoPaths().double()
    ref = copy.deepcopy(model)
    p = _private(model)
    x, y = next(iter(p.data_loader))

    def loss(m, xb, yb):
        a, b = m(xb), m(0.9 * xb + 0.1)
        return F.cross_entropy(a, yb) + ((a - b) ** 2).sum(1).mean()

    before = _flat(model.parameters())
    p.optimizer.zero_grad()
    loss(p.model, x, y).backward()
    p.optimizer.step()
    want = _naive_sum(ref, lambda m, i: loss(m, x[i:i + 1], y[i:i + 1]), len(y))
    torch.testing.assert_close((before - _flat(model.parameters())) * B, want,
                               rtol=1e-10, atol=1e-12)
    assert p.accountant.steps == 1
