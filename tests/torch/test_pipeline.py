"""make_private as a pipeline of named steps: each step on its own, the undo when a later
step refuses, the module fixers, and no process-wide state left behind."""

from __future__ import annotations

import atexit
import inspect

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from privlearn.errors import BudgetExceededError, UnsupportedModuleError  # noqa: E402
from privlearn.torch import DPConfig, make_private  # noqa: E402
from privlearn.torch.privacy_engine import (  # noqa: E402
    _Undo,
    attach_engine,
    plan_run,
    prepare_model,
)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_make_private_is_short():
    assert len(inspect.getsource(make_private).splitlines()) < 80


def test_fix_model_trains_the_replaced_parameters(make_data):
    """BatchNorm -> GroupNorm after the optimizer exists: the GroupNorm shares the
    BatchNorm's affine parameters, so the optimizer trains them."""
    model = _cnn()
    bn_weight = model[1].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    p = make_private(model, opt, DataLoader(make_data(), batch_size=8), noise_multiplier=0.5,
                     fix_model=True, seed=0)
    assert isinstance(model[1], nn.GroupNorm) and model[1].weight is bn_weight
    before = model[1].weight.detach().clone()
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    assert not torch.equal(before, model[1].weight)


def test_refusal_leaves_the_model_untouched(make_data):
    """A later step refuses (a loader whose sampling cannot be accounted): the fix is
    undone and no hook stays on the model."""
    model = _cnn()
    layers = list(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="shuffle=True"):
        make_private(model, opt, DataLoader(make_data(), batch_size=8, shuffle=True),
                     noise_multiplier=1.0, fix_model=True)
    assert list(model) == layers and isinstance(model[1], nn.BatchNorm1d)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # without fix_model the BatchNorm is refused, before anything is attached
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        make_private(model, opt, DataLoader(make_data(), batch_size=8), noise_multiplier=1.0)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_refused_ledger_reservation_leaves_no_hooks(tmp_path, make_data):
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=0.01, delta=1e-5)
    model = nn.Linear(6, 3)
    with pytest.raises(BudgetExceededError):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=0.5, epochs=3,
                     ledger=led.budget("d"))
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_each_step_on_its_own(make_data):
    cfg = DPConfig(target_epsilon=2.0, epochs=2)
    model = nn.Linear(6, 3)
    with _Undo() as undo:
        inner = prepare_model(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, undo)
    assert inner is model and not undo.actions
    plan = plan_run(cfg, inner, DataLoader(make_data(), batch_size=8))
    assert plan.sampling_rate == 8 / 64 and plan.steps_per_epoch == 8
    assert plan.planned_steps == 16 and plan.planned_epsilon == 2.0
    assert plan.run.mechanism(plan.noise_multiplier, 16).epsilon(1e-5) <= 2.0
    undo = _Undo()
    tracker = attach_engine(model, model, cfg, undo)
    assert model._forward_hooks
    for fn in reversed(undo.actions):
        fn()
    assert not model._forward_hooks and tracker.units


def test_no_process_wide_state(monkeypatch, make_data):
    """No allocator setting and no interpreter-exit handler of privlearn's per run; a DDP model's
    synchronisation flag is restored by detach()."""
    from privlearn.ledger import Ledger

    calls = []
    register = atexit.register

    def watched(fn, *a, **k):  # torch registers its own handlers on first import of a part
        if getattr(fn, "__module__", "").startswith("privlearn"):
            calls.append(fn)
        return register(fn, *a, **k)

    monkeypatch.setattr(atexit, "register", watched)
    from privlearn.torch import _allocator

    monkeypatch.setattr(_allocator, "retain_freed_memory",
                        lambda: calls.append("allocator"))
    model = nn.Linear(6, 3)
    wrapper = nn.Module()  # stands for DistributedDataParallel: .module and the flag
    wrapper.module = model
    wrapper.require_backward_grad_sync = True
    import tempfile
    from pathlib import Path

    led = Ledger(Path(tempfile.mkdtemp()) / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    p = make_private(wrapper, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, epochs=1,
                     ledger=led.budget("d"))
    assert wrapper.require_backward_grad_sync is False
    assert not calls
    p.detach()
    assert wrapper.require_backward_grad_sync is True
    assert not model._forward_hooks
