"""The digest the ranks of a distributed run compare of their datasets
(:func:`privlearn.torch.distributed.dataset_digest`) for map-style datasets read item by
item: the same for two copies, different for another order or another item, and none
for items that read differently each time or have no canonical bytes."""

from __future__ import annotations

from collections import UserDict

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from privlearn.torch.distributed import dataset_digest  # noqa: E402

N = 9


class _Rows(torch.utils.data.Dataset):
    """Items of every kind a loader meets: a dict of a tensor, an array, numbers, a
    string, a list and another mapping; in ``order``."""

    def __init__(self, order=None, encoded=0):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(N, 3, generator=g)
        self.order = list(range(N)) if order is None else list(order)
        self.encoded = encoded

    def __len__(self):
        return N

    def __getitem__(self, i):
        k = self.order[i]
        return {
            "x": self.x[k],
            "a": np.arange(3) * k,
            "label": k % 2,
            "w": 0.5 * k,
            "text": f"row {k}",
            "ids": [k, k + 1],
            # a mapping that is not a dict, as transformers' BatchEncoding
            "encoded": UserDict(ids=torch.tensor([k + self.encoded])),
        }


def test_two_copies_digest_alike_and_another_order_or_item_differs():
    ours = dataset_digest(_Rows())
    assert ours is not None and dataset_digest(_Rows()) == ours
    assert dataset_digest(_Rows(order=reversed(range(N)))) != ours
    rolled = _Rows(order=[*range(1, N), 0])  # another order at every read position
    assert dataset_digest(rolled) != ours
    changed = _Rows()
    changed.x = changed.x.clone()
    changed.x[0, 0] += 1.0
    assert dataset_digest(changed) != ours
    # a mapping that is not a dict is read by its items too
    assert dataset_digest(_Rows(encoded=1)) not in (None, ours)
    assert dataset_digest(torch.utils.data.Subset(_Rows(), [0, 2])) != dataset_digest(
        torch.utils.data.Subset(_Rows(), [0, 3])
    )


def test_items_that_cannot_be_compared_give_no_digest():
    class Random(torch.utils.data.Dataset):  # computed at random: differs between reads
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.randn(2)

    class Objects(torch.utils.data.Dataset):  # no canonical bytes (an image object)
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return (object(), i)

    class Failing(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise OSError("file not found")

    for ds in (Random(), Objects(), Failing()):
        assert dataset_digest(ds) is None
        assert dataset_digest(torch.utils.data.Subset(ds, [0])) is None


def test_reading_items_leaves_the_global_random_streams_as_they_were():
    """A dataset whose items draw from the global generators (a random transform): the
    digest, computed on distributed runs only, must not shift the streams the run trains
    from (else a run under DDP starts from other states than the same run in one
    process)."""
    import random

    class Augmented(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            noise = torch.rand(1).item() + np.random.rand() + random.random()
            return torch.tensor([float(i)]), noise > 10.0  # the draws do not show in the item

    def streams(read: bool):
        torch.manual_seed(3)
        np.random.seed(3)
        random.seed(3)
        if read:
            assert dataset_digest(Augmented()) is not None
        py = [random.random() for _ in range(4)]
        return torch.rand(4).tolist(), np.random.rand(4).tolist(), py

    assert streams(True) == streams(False)
