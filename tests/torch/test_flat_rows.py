"""Layers that see each example's tokens flattened into rows of their own
(``h.reshape(-1, d)``, as OPT's decoder layers): the engine regroups the rows into
examples only once the batch-independence probe has verified the grouping at the
inputs' shapes, and the clipped sum is then the naive batch-of-one loop's; rows in any
other order are refused before anything is released."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from privlearn.errors import BatchDependenceError  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402

D = 6


class Flattening(nn.Module):
    """A per-example model (each example's output depends on its own tokens only) whose
    middle layers run on the tokens flattened to rows: example-major (``order(T)`` is
    "example", ``h.reshape(-1, d)``) or position-major ("position", ``h.transpose(0,
    1).reshape(-1, d)``, undone afterwards, so the model's outputs stay per example)."""

    def __init__(self, order=lambda t: "example"):
        super().__init__()
        self.order = order
        self.emb = nn.Embedding(11, D)
        self.inp = nn.Linear(2, D)
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, ids, x):
        h = self.emb(ids) + self.inp(x)  # (B, T, D)
        b, t, d = h.shape
        by_position = self.order(t) == "position"
        rows = (h.transpose(0, 1) if by_position else h).reshape(-1, d)
        rows = rows + self.fc2(torch.tanh(self.fc1(self.ln(rows))))
        h = rows.reshape(t, b, d).transpose(0, 1) if by_position else rows.reshape(b, t, d)
        return self.head(torch.tanh(h).mean(1))


def _batch(b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 11, (b, t), generator=g),
            torch.randn(b, t, 2, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (b,), generator=g))


def _loss(model, ids, x, y):
    return nn.functional.cross_entropy(model(ids, x), y, reduction="sum")


def _assert_first_step_refused(make_model, match: str) -> None:
    """The model built by ``make_model`` (seed 0, float64) refuses its first step of 5
    examples of 4 tokens with a BatchDependenceError matching ``match``, recording
    nothing."""
    torch.manual_seed(0)
    model = make_model().double()
    tracker = GradSampleTracker(model, loss_reduction="sum")
    ids, x, y = _batch(5, 4)
    try:
        _loss(model, ids, x, y).backward()
        with pytest.raises(BatchDependenceError, match=match):
            tracker.clipped_sum(1.0, examples=5)
        assert not tracker.records
    finally:
        tracker.detach()


def _step(oracle, model, tracker, ids, x, y):
    """The tracker's clipped sum of one batch and the naive loop's (flat, float64), at
    the median norm (some examples clipped, some not)."""
    params = oracle.trainable(model)
    naive = copy.deepcopy(model)  # a plain model (the copy holds no engine hook)
    rows = oracle.grads(lambda i: _loss(naive, ids[i:i + 1], x[i:i + 1], y[i:i + 1]),
                        len(y), oracle.trainable(naive))
    c = rows.norm(dim=1).median().item()
    ref, norms = oracle.clip_and_sum(rows, c)
    assert (norms > c).any() and (norms < c).any()
    _loss(model, ids, x, y).backward()
    probed = tracker._probe_pending
    sums, _, _ = tracker.clipped_sum(c, examples=len(y))
    return oracle.flat(sums[id(p)] for p in params), ref, probed


def test_example_major_rows_are_regrouped_exactly(oracle):
    """Rows ``h.reshape(-1, d)`` of a batch-first ``h``: clipped per example as the
    batch-of-one loop does, at the first step (probe) and at later ones (the rows
    regrouped as recorded), after the sequence length changes (probe re-armed) and the
    batch size."""
    torch.manual_seed(0)
    model = Flattening().double()
    tracker = GradSampleTracker(model, loss_reduction="sum")
    try:
        # the probe runs at the first step, at a new sequence length and at a batch
        # smaller or larger than any seen, not at a batch size between them
        for b, t, seed, probed in ((5, 4, 0, True), (5, 4, 1, False), (6, 3, 2, True),
                                   (4, 3, 3, True), (6, 4, 4, False), (5, 3, 5, False)):
            got, ref, pending = _step(oracle, model, tracker, *_batch(b, t, seed))
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
            assert pending == probed
        assert set(tracker._flat) == {i for i, u in enumerate(tracker.units)
                                      if u.name in ("ln", "fc1", "fc2")}
    finally:
        tracker.detach()


def test_position_major_rows_are_refused(oracle):
    """Rows in another order than the examples' (``h.transpose(0, 1).reshape(-1, d)``:
    each run of ``T`` rows mixes examples) are refused at the first step, never
    regrouped by their count; the forward itself keeps examples apart."""
    _assert_first_step_refused(lambda: Flattening(order=lambda t: "position"),
                               "not grouped example by example")


def test_an_order_that_changes_with_the_shapes_is_refused_when_it_does(oracle):
    """A grouping verified at one sequence length is not trusted at another: the probe
    runs again, and refuses the length at which the rows come position-major."""
    torch.manual_seed(0)
    model = Flattening(order=lambda t: "example" if t == 4 else "position").double()
    tracker = GradSampleTracker(model, loss_reduction="sum")
    try:
        got, ref, _ = _step(oracle, model, tracker, *_batch(5, 4))
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
        ids, x, y = _batch(5, 3, seed=1)
        _loss(model, ids, x, y).backward()
        assert tracker._probe_pending  # re-armed by the new shapes
        with pytest.raises(BatchDependenceError, match="not grouped example by example"):
            tracker.clipped_sum(1.0, examples=5)
    finally:
        tracker.detach()


def test_rows_padded_to_a_multiple_of_the_batch_are_refused():
    """Rows whose count happens to be a whole multiple of the batch (20 token rows
    padded to 30, "6 per example") are not grouped by their count: refused."""

    class Padded(Flattening):
        def forward(self, ids, x):
            h = self.emb(ids) + self.inp(x)
            b, t, d = h.shape
            rows = torch.cat([h.reshape(-1, d), h.new_zeros(10, d)])
            out = self.fc1(rows)[:b * t]
            return self.head(self.fc2(out).reshape(b, t, D).mean(1))

    _assert_first_step_refused(Padded, "not grouped example by example")


def test_rows_of_two_middle_examples_swapped_are_refused():
    """Example-major rows except that examples 1 and 2 trade places (undone afterwards):
    the first and the last example's rows are where they belong, so only replacing every
    example in turn, as the probe does for such layers, shows it."""

    class Swapped(Flattening):
        def forward(self, ids, x):
            h = self.emb(ids) + self.inp(x)
            b, t, d = h.shape
            order = torch.tensor([0, 2, 1, *range(3, b)])
            rows = h[order].reshape(-1, d)
            rows = rows + self.fc2(torch.tanh(self.fc1(self.ln(rows))))
            return self.head(torch.tanh(rows.reshape(b, t, d)[order]).mean(1))

    _assert_first_step_refused(Swapped, "replacing example 1 of the batch")
