"""The DataLoader's loading options never change which examples the DP sampler draws:
workers (persistent or not) that reseed NumPy and torch, a generator of the user's, a
larger prefetch, and global reseeding in the loop all see the batches of the engine's
own key chain, each delivered to the step it is accounted for."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402

N = 24


class _Rows(Dataset):  # not a TensorDataset: the workers fetch and collate each example
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((2,), float(i)), i


def _reseed(_worker_id):
    np.random.seed(123)
    torch.manual_seed(123)


def _batches(loader, epochs=2):
    model = torch.nn.Linear(2, 1)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=11,
    )
    out = []
    for _ in range(epochs):
        for x, ids in p.data_loader:
            torch.manual_seed(0)  # a loop that reseeds the global generators
            np.random.seed(0)
            assert torch.equal(x[:, 0].long(), ids)
            out.append(ids.tolist())
            model(x).sum().backward()
            p.optimizer.step()
            p.optimizer.zero_grad()
    assert p.accountant.steps == len(out)
    return out


def test_workers_reseeding_and_a_users_generator_draw_the_engines_batches():
    want = _batches(DataLoader(_Rows(), batch_size=2))
    assert any(len(b) == 0 for b in want) and len({len(b) for b in want}) > 2  # Poisson
    got = _batches(
        DataLoader(
            _Rows(),
            batch_size=2,
            num_workers=2,
            persistent_workers=True,
            prefetch_factor=4,
            worker_init_fn=_reseed,
            generator=torch.Generator().manual_seed(5),
        )
    )
    assert got == want


def test_a_sequential_sampler_over_fewer_positions_is_refused_not_widened():
    """sampler=SequentialSampler(range(10)) over 24 examples reads the first 10; the
    private loader samples all 24, so 14 examples the loader left out were trained on
    (silently). A sequential sampler over the whole dataset (or over another object of
    its length) is what make_private replaces."""
    from torch.utils.data import SequentialSampler

    from privlearn.errors import ConfigurationError

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ConfigurationError, match=r"reads 10 positions.*range\(10\)"):
        make_private(
            model,
            opt,
            DataLoader(_Rows(), batch_size=2, sampler=SequentialSampler(range(10))),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            seed=0,
        )
    for source in (_Rows(), range(N)):
        make_private(
            model,
            opt,
            DataLoader(_Rows(), batch_size=2, sampler=SequentialSampler(source)),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            seed=0,
        ).detach()
