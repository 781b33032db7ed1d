"""A layer without a rule given a table shared by every example: the generic rule keeps
the role each argument had when first seen (:mod:`privlearn.torch._argument_roles`), so a
batch whose size happens to equal the table's row count at a step the probe does not
check does not split the table one row per example. Each step is compared with the naive
loop (one batch-of-one backward pass per example, clipped, summed; noise-free)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import trainable  # noqa: E402

from privlearn.errors import BatchDependenceError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

F64 = torch.float64
CLIP = 0.3


def loss_of(out) -> torch.Tensor:
    return (out**2).sum() + out.sum()


class _Scaled(nn.Module):
    """No rule: scales its input by its weight and the column means of a table it is
    given as an argument."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x, table):
        return x * (self.w * table.mean(0))


class _WithTable(nn.Module):
    """The table is a parameter of the model (trained through its own unit, whose
    gradient the split would also corrupt), passed to the layer without a rule."""

    def __init__(self, rows):
        super().__init__()
        self.inner = _Scaled()
        self.table = nn.Parameter(torch.randn(rows, 4))

    def forward(self, x, ctx=None):
        return self.inner(x, self.table * 2 if ctx is None else ctx)


def _private(model, n, batch, **kw):
    data = TensorDataset(torch.randn(n, 4, dtype=F64, generator=torch.Generator().manual_seed(1)))
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        DataLoader(data, batch_size=batch),
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        loss_reduction="sum",
        **kw,
    )


def _step_errors(oracle, p, model) -> list[tuple[int, float]]:
    """``(batch size, relative max error)`` of each step of one pass over
    ``p.data_loader`` against the naive clipped sum of the same batch."""
    out = []
    for (x,) in p.data_loader:
        before = copy.deepcopy(model)
        p.optimizer.zero_grad()
        loss_of(p.model(x)).backward()
        p.optimizer.step()
        rows = oracle.grads(
            lambda i, m=before, x=x: loss_of(m(x[i : i + 1])), len(x), trainable(before)
        )
        want = oracle.clip_and_sum(rows, CLIP)[0] / p.optimizer.expected_batch_size
        moved = oracle.flat(b - a for a, b in zip(trainable(model), trainable(before), strict=True))
        assert float(want.abs().max()) > 0  # the step moved the model: not vacuous
        out.append((len(x), float((moved - want).abs().max() / want.abs().max())))
    return out


def test_a_poisson_batch_of_the_tables_row_count_between_probed_sizes(oracle):
    """Poisson batches of 7, 7, 2, 5, 8 examples (seed 4) and a table of 5 rows: the
    probe checks the first batch and the new smallest (2) and largest (8) whole, not the
    batch of 5, at which the rule split the table one row per example (each example's
    gradient from one row of it: far off the naive loop). The table was seen shared (5 rows with
    a batch of 7) and stays shared."""
    torch.manual_seed(0)
    model = _WithTable(5).double()
    errors = _step_errors(oracle, _private(model, 32, 6, seed=4), model)
    sizes = [n for n, _ in errors]
    assert sizes[0] != 5 and 5 in sizes  # the coincidence happens, not at the first step
    at = sizes.index(5)
    assert min(sizes[:at]) < 5 < max(sizes[:at])  # in between: the probe did not re-run
    assert max(e for _, e in errors) < 1e-9, errors


def test_a_smaller_later_batch_of_the_tables_row_count(oracle):
    """Batches of 3, 3, 2, 2, 2 examples (shuffled epochs of 12 in 5 batches: as a
    fixed-size run's smaller last batch) and a table of 2 rows: the probe re-ran on the
    first batch of 2 and refused the table, which the rule would have split per example;
    the table was seen shared (2 rows with a batch of 3) and the rule keeps it whole, so
    the probe lets it pass and every step is the naive loop's, over two epochs."""
    torch.manual_seed(0)
    model = _WithTable(2).double()
    p = _private(model, 12, 3, sampling="shuffled_epochs", cycle_length=5, epochs=2, seed=0)
    errors = _step_errors(oracle, p, model) + _step_errors(oracle, p, model)
    assert [n for n, _ in errors] == [3, 3, 2, 2, 2] * 2
    assert max(e for _, e in errors) < 1e-9, errors


class _Context(nn.Module):
    """No rule: scales its input by its weight and a context, per example when it has
    a row per example, else by the context's column means (a shared table)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x, ctx):
        return x * self.w * (ctx if ctx.shape[0] == x.shape[0] else ctx.mean(0))


class _WithContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Context()

    def forward(self, x, ctx):
        return self.inner(x, ctx)


def test_an_argument_that_stops_following_the_examples_is_refused():
    """An argument with one row per example at the first (probed) step, then a table of
    another row count: the rule cannot tell whose its rows are (at a batch of the
    table's size it would have split it), so the step is refused, nothing accounted."""
    torch.manual_seed(0)
    model = _WithContext().double()
    p = _private(model, 12, 4, sampling="fixed", seed=0)
    batches = iter(p.data_loader)
    (x,) = next(batches)
    loss_of(p.model(x, x * 2)).backward()  # per example: x's own rows
    p.optimizer.step()
    (x,) = next(batches)
    p.optimizer.zero_grad()
    loss_of(p.model(x, torch.ones(3, 4, dtype=F64))).backward()
    with pytest.raises(BatchDependenceError, match=r"argument 1 .*earlier step.*3 rows"):
        p.optimizer.step()
    assert p.accountant.steps == 1


class _Sometimes(nn.Module):
    """A second layer without a rule, called only on batches of ``size`` examples (a
    path the probe never ran), with a table of as many rows."""

    def __init__(self, size):
        super().__init__()
        self.a, self.b = _Scaled(), _Scaled()
        self.size = size
        self.register_buffer("table", torch.randn(size, 4))

    def forward(self, x):
        h = self.a(x, self.table)
        return self.b(h, self.table) if x.shape[0] == self.size else h


def test_a_layer_first_called_at_a_step_the_probe_did_not_check_is_refused():
    """Seed 4 draws 7, 7, 2, 5, 8 examples: the layer ``b`` is first called at the batch
    of 5 (neither the largest nor the smallest: not probed) with a table of 5 rows, as
    many as the batch's; nothing tells whether its arguments follow the examples, so the
    step is refused rather than the table split per example."""
    torch.manual_seed(0)
    model = _Sometimes(5).double()
    p = _private(model, 32, 6, seed=4)
    with pytest.raises(BatchDependenceError, match=r"_Scaled .*probe did not check"):
        for (x,) in p.data_loader:
            p.optimizer.zero_grad()
            loss_of(p.model(x)).backward()
            p.optimizer.step()
    assert p.accountant.steps == 3
