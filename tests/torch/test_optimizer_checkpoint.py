"""A checkpoint of ``p.optimizer`` alone, Opacus-style: the state of a DP optimizer that
took private steps, loaded into a freshly made run, would continue that run with an
accountant that starts again from zero (the epsilon reported then leaves out every step
taken before the checkpoint). Refused before anything is loaded, naming the way that
keeps the history (``p.state_dict()`` / ``p.load_state_dict``)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _run(make_mlp, make_data, seed=0):
    model = make_mlp(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return make_private(
        model,
        opt,
        DataLoader(make_data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=3,
    )


def _train(p, steps):
    taken = 0  # the ground truth the accountant must agree with: steps counted here
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        taken += 1
        if taken == steps:
            return taken
    return taken


def test_an_optimizer_checkpoint_of_a_private_run_is_not_a_fresh_start(make_mlp, make_data):
    first = _run(make_mlp, make_data)
    taken = _train(first, 3)
    assert first.accountant.steps == taken == 3
    ckpt = copy.deepcopy(
        {"model": first.model.state_dict(), "optimizer": first.optimizer.state_dict()}
    )
    # the state still loads into a plain optimizer, as any optimizer's does
    plain = torch.optim.Adam(make_mlp(seed=1).parameters(), lr=0.5)
    plain.load_state_dict(ckpt["optimizer"])
    assert plain.param_groups[0]["lr"] == 0.01

    resumed = _run(make_mlp, make_data, seed=1)
    resumed.model.load_state_dict(ckpt["model"])
    before = copy.deepcopy(resumed.optimizer.original_optimizer.state_dict())
    with pytest.raises(ConfigurationError, match=r"3 private step.*p\.load_state_dict"):
        resumed.optimizer.load_state_dict(ckpt["optimizer"])
    assert resumed.optimizer.original_optimizer.state_dict() == before  # nothing loaded
    assert resumed.accountant.steps == 0

    # the run's own checkpoint carries the history: then its optimizer's state loads
    again = _run(make_mlp, make_data, seed=1)
    again.load_state_dict(first.state_dict())
    again.optimizer.load_state_dict(ckpt["optimizer"])
    assert again.accountant.steps == 3
    # a state saved earlier in the same run (a roll-back) loads as well
    _train(again, 1)
    again.optimizer.load_state_dict(ckpt["optimizer"])


def test_a_new_run_from_an_optimizer_state_on_purpose(make_mlp, make_data):
    """Composed after the earlier run (its steps are then in epsilon), the state loads;
    on other data, the entry is deleted, as the message says."""
    first = _run(make_mlp, make_data)
    _train(first, 2)
    state = first.optimizer.state_dict()
    composed = _run(make_mlp, make_data, seed=1)
    composed.compose_after(first.accountant.mechanism())
    composed.optimizer.load_state_dict(state)
    state.pop("privlearn_accounted_steps")  # the message's way to start a new run on purpose
    fresh = _run(make_mlp, make_data, seed=1)
    fresh.optimizer.load_state_dict(state)
    assert _train(fresh, 1) == fresh.accountant.steps == 1
