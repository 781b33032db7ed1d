"""The batch sizes that re-arm the batch-independence probe
(:mod:`privlearn.torch._probe_size`): a packed sequence's batch is read (it was skipped,
so a model given packed input never re-armed on a larger batch), and a batch smaller than
any seen re-arms the probe and is probed whole (a model that mixes examples only at small
batch sizes trained unrefused); the added probes stay rare on Poisson batches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn.utils.rnn import pack_sequence  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import BatchDependenceError, _probe_size, _rearm, make_private  # noqa: E402

E = 4


class _Recurrent(nn.Module):
    """An LSTM given a packed sequence, its last hidden state to a linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(E, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, seq):
        _, (h, _) = self.rnn(seq)
        return self.head(h[-1])


def _packed(n: int, sort: bool):
    g = torch.Generator().manual_seed(n)
    lengths = [3] * n if sort else [1 + i % 3 for i in range(n)]
    return pack_sequence([torch.randn(t, E, generator=g) for t in lengths], enforce_sorted=sort)


@pytest.mark.parametrize("sort", [True, False], ids=["batch_sizes", "sorted_indices"])
def test_a_larger_packed_batch_re_arms_the_probe(sort):
    """Only the leading dimension of a tensor argument was read: a packed sequence was
    skipped, so a larger packed batch re-armed nothing. Its batch is read from
    ``sorted_indices`` or ``batch_sizes`` (a CPU tensor whatever the data's device: on
    the meta device, whose values cannot be read, it is still known)."""
    model = _Recurrent()
    data = TensorDataset(torch.randn(16, E), torch.randint(0, 2, (16,)))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        seed=0,
    )
    tracker = p.optimizer.tracker
    assert _rearm.changed(tracker, (_packed(5, sort),), {})  # the first forward
    assert not _rearm.changed(tracker, (_packed(5, sort),), {})
    assert _rearm.changed(tracker, (_packed(3, sort),), {})  # smaller than any seen
    assert not _rearm.changed(tracker, (_packed(4, sort),), {})  # neither
    assert _rearm.changed(tracker, (_packed(9, sort),), {})  # larger than any seen
    for n in (2, 9):
        on_meta = _packed(n, sort).to("meta")
        assert on_meta.batch_sizes.device.type == "cpu"  # torch's contract
        assert _probe_size.batch_of(on_meta) == n


class _PerExample(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(E, 8), nn.Linear(8, 2)
        self.sizes: list[int] = []

    def forward(self, x):
        self.sizes.append(x.shape[0])
        return self.b(torch.relu(self.a(x)))


class _MixesSmallBatches(_PerExample):
    """Centres its hidden layer over the batch only below four examples."""

    def forward(self, x):
        self.sizes.append(x.shape[0])
        h = self.a(x)
        if h.shape[0] < 4:
            h = h - h.mean(0)
        return self.b(torch.relu(h))


def _train(model, n, batch, steps, seed=0):
    """Poisson batches of expected size ``batch`` from ``n`` rows: the sizes of the
    ``steps`` steps trained (fewer when the probe refuses one), and the steps at which
    the model ran more than one forward (the probe's passes)."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, E, generator=g), torch.randint(0, 2, (n,), generator=g))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=batch),
        noise_multiplier=1.0,
        seed=seed,
    )
    sizes, probed = [], []
    while len(sizes) < steps:
        for x, y in p.data_loader:
            if len(sizes) == steps:
                break
            sizes.append(len(x))
            before = len(model.sizes)
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if len(model.sizes) - before > 1:
                probed.append(len(sizes) - 1)
    return sizes, probed


def test_a_forward_that_mixes_only_small_batches_is_refused():
    """The probe ran on the first batch (at least four examples with this seed) and on
    batches larger than any before; a batch of two or three, which this model centres,
    was never probed and trained. A batch smaller than any seen re-arms the probe now,
    which runs on it whole: refused before its step."""
    model = _MixesSmallBatches()
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        _train(model, 200, 6, 200)
    sizes = model.sizes
    assert sizes[0] >= 4 and 2 <= sizes[-1] < 4


def _records(sizes) -> list[int]:
    """The steps whose batch is larger than every earlier one, or smaller than every
    earlier one of at least two examples (the first step included)."""
    out, hi, lo = [], 0, None
    for i, s in enumerate(sizes):
        if s > hi or (s >= 2 and (lo is None or s < lo)):
            out.append(i)
        hi = max(hi, s)
        lo = s if s >= 2 and (lo is None or s < lo) else lo
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_added_probes_are_rare_on_poisson_batches(seed):
    """200 Poisson steps of expected size 64: the probe runs at the first step and at
    each new largest or smallest batch, as many as a naive count of the records of the
    sizes (about ``2 ln 200``), not at other steps."""
    sizes, probed = _train(_PerExample(), 1280, 64, 200, seed=seed)
    assert len(sizes) == 200 and probed == _records(sizes)
    assert len(probed) <= 16, probed


@pytest.mark.parametrize("after", [(), (5, 4)], ids=["first-step", "after-a-smaller-batch"])
def test_a_row_of_another_example_beside_a_batch_of_one_is_refused(after):
    """A step of one example whose forward also ran on another example's row (kept from
    elsewhere): while the probe was pending (the first step; a forward of fewer rows than
    any seen) the extra row was taken as the example's own and clipped with it, so the
    other example's data reached the release in a step that did not sample it."""
    from privlearn.torch import GradSampleTracker

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    tracker = GradSampleTracker(model, loss_reduction="sum")
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))

    def step(rows, examples):
        nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum").backward()
        try:
            tracker.clipped_sum(1.0, examples=examples)
        finally:
            model.zero_grad()

    for n in after:
        step(list(range(n)), n)
    with pytest.raises(BatchDependenceError, match="saw 2 rows per example"):
        step([0, 7], 1)
    step([0], 1)  # the example on its own trains
