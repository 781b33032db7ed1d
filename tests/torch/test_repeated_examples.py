"""A dataset that puts one example at several positions (a Subset with a repeated index,
ConcatDataset([ds, ds])) is refused by make_private: the sampler draws positions at the
accounted rate, so such an example was drawn at about twice the rate accounted.
Ground truth: how often each example (not each position) is in a batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch._repeated_examples import repeated_positions  # noqa: E402

N = 20
X = torch.randn(N, 2)
IDS = torch.arange(N)  # each example's own id, as its label
BASE = TensorDataset(X, IDS)


def _private(dataset, batch_size=5, **kw):
    model = torch.nn.Linear(2, 1)
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(dataset, batch_size=batch_size),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
        **kw,
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: Subset(BASE, list(range(10)) * 2),
        lambda: Subset(BASE, [*range(N), 0]),
        lambda: Subset(BASE, [*range(N), -1]),  # -1 is example N - 1 again
        lambda: ConcatDataset([BASE, BASE]),
        lambda: ConcatDataset([BASE, TensorDataset(X, IDS)]),  # the same tensors twice
        lambda: ConcatDataset([Subset(BASE, range(0, 12)), Subset(BASE, range(8, N))]),
        lambda: Subset(ConcatDataset([Subset(BASE, [3]), BASE]), range(N + 1)),
    ],
    ids=[
        "subset-twice",
        "subset-one-extra",
        "negative-index",
        "concat-self",
        "concat-same-tensors",
        "overlapping-parts",
        "nested",
    ],
)
def test_an_example_at_two_positions_is_refused(make):
    """Such an example joins a step at rate 1 - (1 - q)^2, not q (it was accepted)."""
    ds = make()
    with pytest.raises(ConfigurationError, match="more than one position"):
        _private(ds)
    # the naive ground truth, on the positions make_private would sample: every example
    # reached from two positions (their labels) is there twice
    labels = [int(ds[i][1]) for i in range(len(ds))]
    twice = {v for v in labels if labels.count(v) > 1}
    found = {labels[int(g[0])] for g in repeated_positions(ds)}
    assert twice and found == twice


@pytest.mark.parametrize(
    "make",
    [
        lambda: Subset(BASE, list(range(0, N, 2)) + list(range(1, N, 2))),
        lambda: ConcatDataset([Subset(BASE, range(0, 8)), Subset(BASE, range(8, N))]),
        lambda: torch.utils.data.random_split(
            BASE, [12, 8], generator=torch.Generator().manual_seed(0)
        )[0],
    ],
    ids=["permuted", "disjoint-parts", "random-split"],
)
def test_each_example_of_distinct_positions_joins_a_batch_at_the_accounted_rate(make):
    """Distinct positions: each example is in a batch with the probability the
    accountant uses (counted over 600 Poisson batches, within 4.5 standard deviations
    for every example: a false alarm below 1e-4)."""
    ds = make()
    p = _private(ds)
    q, steps, counts = p.sampling_rate, 0, np.zeros(N)
    while steps < 600:
        for _, ids in p.data_loader:
            counts[ids.numpy()] += 1
            steps += 1
    used = sorted({int(ds[i][1]) for i in range(len(ds))})
    freq = counts[used] / steps
    assert np.abs(freq - q).max() < 4.5 * math.sqrt(q * (1 - q) / steps)
    assert counts[np.setdiff1d(np.arange(N), used)].sum() == 0


def test_users_that_make_the_positions_of_an_example_one_unit_are_accepted():
    """users= with one id for every position of an example: those positions are one
    privacy unit (clipped together), which the user-level accounting describes; ids
    that put them in two units are refused."""
    ds = Subset(BASE, list(range(10)) * 2)
    same = [i % 10 for i in range(20)]
    _private(ds, batch_size=2, users=same, max_examples_per_user=2).detach()
    split = list(range(20))
    with pytest.raises(ConfigurationError, match="different users"):
        _private(ds, batch_size=2, users=split, max_examples_per_user=2)
