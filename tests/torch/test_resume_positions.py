"""A run's state is resumed only when its parts were saved after the same step.

``PrivateTraining.state_dict()`` saves the accountant's history, the sampler's position
and the correlated noise's state after one step. A state whose parts come from different
steps (a dict assembled from two checkpoints) used to load silently: the sampler then drew
again the batches of steps already taken (an example of a cyclic sampler took part twice
less than a cycle apart, which the accounted participation rules out), or the correlated
noise continued from another step than the accountant's (the banded ring then mixes its
coefficients: the noise is no longer ``C^{-1} z``). Such a state is refused, and nothing
is loaded; so is a correlated-noise state that counts steps but lost its past noises.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import ParameterValueError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

N = 48
SETTINGS = dict(sampling="balls_in_bins", cycle_length=4, epochs=3, noise="banded", bands=2)


def _run(model=None):
    model = model or nn.Linear(4, 1)
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(N, dtype=torch.float32)  # the example's index
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x), batch_size=12),
        noise_multiplier=1.0,
        seed=5,
        **SETTINGS,
    )


def _steps(p, k):
    """``k`` more steps of ``p``; the examples of each batch, and the state after each."""
    batches, states = [], []
    it = iter(p.data_loader)
    for _ in range(k):
        try:
            (x,) = next(it)
        except StopIteration:
            it = iter(p.data_loader)
            (x,) = next(it)
        p.optimizer.zero_grad()
        p.model(x).sum().backward()
        p.optimizer.step()
        batches.append(x[:, 0].long().tolist())
        states.append(copy.deepcopy(p.state_dict()))
    return batches, states


@pytest.fixture(scope="module")
def saved():
    batches, states = _steps(_run(), 7)
    return batches, states[4], states[6]  # after step 5 and after step 7


@pytest.mark.parametrize("part", ["sampler", "correlated"])
def test_parts_saved_after_different_steps_are_refused(saved, part):
    _, at5, at7 = saved
    mixed = {**at7, part: at5[part]}
    q = _run()
    with pytest.raises(ParameterValueError, match="different points of a run"):
        q.load_state_dict(mixed)
    assert q.accountant.steps == 0 and q.optimizer.correlated.steps == 0
    assert q.data_loader.batch_sampler.consumed == 0


def test_a_consistent_state_still_loads_and_continues(saved):
    _, _, at7 = saved
    q = _run()
    q.load_state_dict(at7)
    assert q.accountant.steps == q.optimizer.correlated.steps == 7
    assert q.data_loader.batch_sampler.consumed == 7


def test_a_correlated_state_of_steps_without_its_past_noises_is_refused(saved):
    """A correlated-noise state counting steps but holding no buffers (its past noises)
    loaded, and the next noises restarted from zero history: not the rows of C^{-1} z
    the run is accounted for."""
    _, _, at7 = saved
    state = {**at7, "correlated": {**at7["correlated"], "buffers": None, "layout": None}}
    q = _run()
    with pytest.raises(ParameterValueError, match="holds no buffers"):
        q.load_state_dict(state)
    assert q.accountant.steps == 0 and q.optimizer.correlated.steps == 0
