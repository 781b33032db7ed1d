"""The run's accountant cannot be swapped for another (:mod:`privlearn.torch._run_fields`):
``p.accountant`` and ``p.optimizer.accountant`` are the one object every step is recorded
in, so another accountant assigned to either would report an epsilon leaving out steps."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import TrainingLoopError  # noqa: E402
from privlearn.torch import PrivacyAccountant, make_private  # noqa: E402


def _run():
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    return p, iter(p.data_loader)


def _step(p, batches):
    x, y = next(batches)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()


@pytest.mark.parametrize("owner", ["run", "optimizer"])
def test_another_accountant_assigned_to_the_run_is_refused(owner):
    """A fresh accountant assigned after three steps (to read the run with another
    method): on ``p.optimizer`` the later steps went to it and ``p.epsilon`` stayed at
    three steps; on ``p`` the epsilon read the empty one. Refused, naming the per-query
    way; every step keeps going to the one accountant ``p.epsilon`` reads."""
    p, batches = _run()
    for _ in range(3):
        _step(p, batches)
    held = p.accountant
    with pytest.raises(AttributeError, match=r"accountant cannot be replaced.*epsilon\(delta"):
        (p if owner == "run" else p.optimizer).accountant = PrivacyAccountant()
    _step(p, batches)
    assert p.accountant is held and p.optimizer.accountant is held
    assert p.accountant.steps == 4
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del p.optimizer.accountant
    p.accountant = held  # the same object: nothing changes
    assert p.accountant.epsilon(1e-5, accountant="rdp") >= p.epsilon(1e-5) > 0


def test_a_step_after_detach_is_refused_naming_the_way_on():
    """After ``p.detach()`` the hooks are gone: a step on a batch was refused as one
    whose forward ran under no_grad or on another model, and one on an empty batch
    took a noise-only step and charged it. Refused both ways, saying what detaching
    did; the way it names (make_private again, composed after this run) reports the
    epsilon of all the steps, as one run of as many steps does."""
    p, batches = _run()
    for _ in range(3):
        _step(p, batches)
    p.detach()
    with pytest.raises(TrainingLoopError, match=r"after p\.detach\(\).*compose_after"):
        _step(p, batches)
    p.optimizer.zero_grad()
    with pytest.raises(TrainingLoopError, match=r"after p\.detach\(\)"):
        p.optimizer.step()  # no forward: as on an empty batch
    assert p.accountant.steps == 3
    q, more = _run()
    q.compose_after(p.accountant.mechanism())
    _step(q, more)
    whole, again = _run()
    for _ in range(4):
        _step(whole, again)
    assert q.epsilon(1e-5) == pytest.approx(whole.epsilon(1e-5), rel=1e-9)
