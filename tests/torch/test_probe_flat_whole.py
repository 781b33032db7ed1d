"""The batch-independence probe on a batch due whole when a layer's rows are grouped per
example (``x.reshape(-1, d)`` before a Linear: OPT's decoder layers, Swin's windows).

Such a grouping is verified by replacing every example in turn; once the probe ran on
the whole batch (the first step, a batch larger than any before, any re-arm at a batch as
large), that was one pass over the whole batch per example: on a tiny OPT with batches of
64 the first step and every new padded length (dynamic padding re-arms the probe) took
about 1.6 s instead of 0.15 s, growing with the square of the batch size. The grouping is
verified on the first few examples, and the whole batch is run with its first and last
example replaced (a path that mixes examples only from some batch size on)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.probe import BatchDependenceError, planned_passes  # noqa: E402

T, E, B = 4, 6, 32


class _Flat(nn.Module):
    """A Linear on each example's tokens flattened into rows of their own; mixes
    examples (their mean subtracted) from ``threshold`` examples on."""

    def __init__(self, threshold: int | None = None):
        super().__init__()
        self.threshold, self.rows, self.seen = threshold, [], []
        self.lin, self.head = nn.Linear(E, 8), nn.Linear(8, 3)

    def forward(self, x):
        self.rows.append(x.shape[0])
        if torch.is_grad_enabled():
            self.seen.append(x)
        h = self.lin(x.reshape(-1, E)).reshape(x.shape[0], T, 8).mean(1)
        if self.threshold is not None and h.shape[0] >= self.threshold:
            h = h - h.mean(0)
        return self.head(torch.relu(h))


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, T, E, generator=g), torch.randint(0, 3, (n,), generator=g))


def _step(model):
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(_data(), batch_size=B),
        noise_multiplier=1.0,
        seed=0,
        sampling="fixed",
    )
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    return p


def test_grouped_rows_on_a_whole_batch_cost_passes_independent_of_its_size():
    """Before: B + 2 passes over the whole batch (every example replaced); now every
    example of a part of 7, then the whole batch with two replacements."""
    model = _Flat()
    p = _step(model)
    probe_rows = model.rows[1:]
    assert p.accountant.steps == 1
    assert probe_rows.count(B) <= 4, probe_rows  # base, first, last, a rerun
    assert len(probe_rows) < B // 2, probe_rows
    assert p.optimizer.tracker._flat  # the grouping was verified and is in use
    # FSDP2's plan covers what ran (every rank runs as many passes)
    assert (
        planned_passes(((model.seen[0],), {}, ()), B, every=True, whole=True)
        >= p.optimizer.tracker.probe_passes
    )


def test_grouped_rows_that_mix_only_large_batches_are_still_refused():
    """The whole batch still runs: a model mixing examples only from 12 on is refused."""
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        _step(_Flat(threshold=12))


class _WholeOnly(_Flat):
    """As :class:`_Flat`, but runs on a batch of ``B`` examples only (a size built in)."""

    def forward(self, x):
        if x.shape[0] != B:
            raise RuntimeError(f"this model runs on batches of {B}")
        return super().forward(x)


def test_a_model_that_needs_the_whole_batch_is_probed_within_the_planned_passes():
    """The part cannot run, so every example of the whole batch is replaced; FSDP2's plan
    counts that (a rank running more passes than planned would wait for ever)."""
    model = _WholeOnly()
    p = _step(model)
    assert p.accountant.steps == 1 and p.optimizer.tracker._flat
    assert p.optimizer.tracker.probe_passes >= B
    assert (
        planned_passes(((model.seen[0],), {}, ()), B, every=True, whole=True)
        >= p.optimizer.tracker.probe_passes
    )
