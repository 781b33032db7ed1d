"""Secure mode draws every sampling from the OS CSPRNG: the batches and the run's fixed
layout (groups, bins, order), never from a seeded NumPy generator; a sampling that cannot
is refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.correlated.sampling import SAMPLINGS  # noqa: E402
from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.samplers import (  # noqa: E402
    BallsInBinsBatchSampler,
    FixedSizeBatchSampler,
    RegisteredBatchSampler,
)

BUILT_IN = ["poisson", "fixed", "cyclic_poisson", "balls_in_bins", "shuffled_epochs"]


def _no_seeded_generator(*args, **kwargs):
    raise AssertionError("a seeded NumPy generator drew part of a secure sampling")


@pytest.mark.parametrize("sampling", BUILT_IN)
def test_every_sampling_draws_from_the_os_csprng_in_secure_mode(sampling, monkeypatch):
    ds = TensorDataset(torch.randn(40, 3), torch.randn(40))
    model = nn.Linear(3, 1)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=4), noise_multiplier=1.0, epochs=1,
                     sampling=sampling, secure_mode=True)
    sampler = p.data_loader.batch_sampler
    assert sampler.secure
    monkeypatch.setattr(np.random, "default_rng", _no_seeded_generator)
    batches = [list(b) for b in itertools.islice(iter(sampler), 6)]
    assert all(len(set(b)) == len(b) and set(b) <= set(range(40)) for b in batches)
    if sampling == "fixed":
        assert {len(b) for b in batches} == {4}


def test_two_secure_layouts_differ_and_a_saved_one_is_restored():
    a, b = (BallsInBinsBatchSampler(200, 4, secure=True) for _ in range(2))
    assert [x.tolist() for x in a.parts()] != [x.tolist() for x in b.parts()]
    first = next(iter(a))
    state = a.state_dict()
    c = BallsInBinsBatchSampler(200, 4, secure=True)
    c.load_state_dict(state)
    assert [x.tolist() for x in c.parts()] == [x.tolist() for x in a.parts()]
    assert sorted(first) == a.parts()[0].tolist()


def test_secure_sampling_that_cannot_be_is_refused():
    with pytest.raises(ConfigurationError, match="sampling='poisson'"):
        FixedSizeBatchSampler(40, 4, world_size=2, secure=True)
    with pytest.raises(ConfigurationError, match="seed must be None"):
        FixedSizeBatchSampler(40, 4, seed=1, secure=True)
    import dataclasses

    seeded_only = dataclasses.replace(SAMPLINGS["poisson"], name="seeded_only", secure=False)
    with pytest.raises(ConfigurationError, match="secure=False"):
        RegisteredBatchSampler(seeded_only, 40, 0.1, secure=True)
