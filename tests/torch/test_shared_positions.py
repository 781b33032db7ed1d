"""A learned positional embedding whose one output row is shared by the batch (BART's
decoder: positions of shape ``(1, T)`` added to every example): the engine expands it
over the batch, and its per-example gradients are the batch-of-one loop's; one computed
from the batch's contents is refused by the probe."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from privlearn.errors import BatchDependenceError  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402


class ToyLearnedPositionalEmbedding(nn.Embedding):
    """Positions ``arange(T)`` (``+ shift(ids)``) looked up once, shape ``(1, T, d)``."""

    shift = staticmethod(lambda ids: 0)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]) + 2 + self.shift(ids)
        return super().forward(pos[None])


class Decoder(nn.Module):
    def __init__(self, shift=None):
        super().__init__()
        self.tok = nn.Embedding(11, 6)
        self.pos = ToyLearnedPositionalEmbedding(12, 6)
        if shift is not None:
            self.pos.shift = shift
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(ids)  # the (1, T, 6) positions broadcast
        return self.head(torch.tanh(h)).mean(1)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (5, 4), generator=g), torch.randint(0, 3, (5,), generator=g)


def _loss(model, ids, y):
    return nn.functional.cross_entropy(model(ids), y, reduction="sum")


def test_shared_positions_are_clipped_per_example(oracle):
    torch.manual_seed(0)
    model = Decoder().double()
    naive = copy.deepcopy(model)
    tracker = GradSampleTracker(model, loss_reduction="sum")
    try:
        for seed in (0, 1):  # the probe's step and a steady one
            ids, y = _batch(seed)
            rows = oracle.grads(lambda i, ids=ids, y=y: _loss(naive, ids[i:i + 1], y[i:i + 1]),
                                5,
                                oracle.trainable(naive))
            pos = slice(11 * 6, 11 * 6 + 12 * 6)  # the table's columns: moves per example
            assert rows[:, pos].abs().sum() > 0
            c = rows.norm(dim=1).median().item()
            ref, _ = oracle.clip_and_sum(rows, c)
            _loss(model, ids, y).backward()
            sums, _, _ = tracker.clipped_sum(c, examples=5)
            got = oracle.flat(sums[id(p)] for p in oracle.trainable(model))
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    finally:
        tracker.detach()


def test_shared_positions_computed_from_the_batch_are_refused():
    """Positions shifted by a function of the whole batch's ids: the shared row depends
    on every example, so no per-example gradient exists; the probe refuses it."""
    torch.manual_seed(0)
    model = Decoder(shift=lambda ids: int(ids.sum()) % 3).double()
    tracker = GradSampleTracker(model, loss_reduction="sum")
    ids, y = _batch()
    try:
        _loss(model, ids, y).backward()
        with pytest.raises(BatchDependenceError, match="examples are mixed"):
            tracker.clipped_sum(1.0, examples=5)
    finally:
        tracker.detach()
