"""Saving a model while the engine is attached: pickling its hooks is refused with a typed
error naming what to save instead; the documented ways (p.state_dict(), or p.detach()
then the model) work. A deep copy of the attached model (an EMA or reference model) is a
model of its own, not recorded by the engine."""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _attached():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    p = make_private(model, opt, DataLoader(data, batch_size=4), noise_multiplier=1.0,
                     max_grad_norm=1.0, steps=4, seed=0)
    x, y = next(iter(p.data_loader))
    nn.functional.cross_entropy(model(x), y).backward()
    p.optimizer.step()
    p.optimizer.zero_grad()
    return model, p


def test_saving_an_attached_model_says_what_to_save_instead():
    model, p = _attached()
    for obj in (model, model[0], p.optimizer, p):
        with pytest.raises(TrainingLoopError) as err:
            torch.save(obj, io.BytesIO())
        assert "p.state_dict()" in str(err.value) and "p.detach()" in str(err.value)
    # the documented ways work: a checkpoint of the run, or the detached model
    torch.save(p.state_dict(), io.BytesIO())
    copy.deepcopy(model)  # copying (not pickling) is left as it was
    x = torch.randn(5, 3)
    expected = model(x)
    buf = io.BytesIO()
    torch.save(p.detach(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), expected)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in loaded.modules())


def test_a_deep_copy_of_the_attached_model_is_a_model_of_its_own(oracle):
    """``copy.deepcopy(p.model)`` after make_private (an EMA or a frozen reference model)
    used in the same loss: the step of the private model is the naive DP step of its own
    loss term (the copy's hooks were the engine's, so its layers' calls were recorded as
    calls of the original's layers and their gradients added to the original's
    parameters); the copy pickles and can be made private on its own."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        ref = copy.deepcopy(model)
        data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
        C, lr = 0.1, 0.5
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                         DataLoader(data, batch_size=8), noise_multiplier=0.0,
                         max_grad_norm=C, sampling="fixed", seed=0)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for q in twin.parameters():
                q.mul_(2.0)
        x, y = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        (nn.functional.cross_entropy(model(x), y)
         + nn.functional.cross_entropy(twin(x), y)).backward()
        p.optimizer.step()
        oracle.step(ref, x, y, C, lr, 8)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.save(twin, io.BytesIO())
        q = make_private(twin, torch.optim.SGD(twin.parameters(), lr=lr),
                         DataLoader(data, batch_size=8), noise_multiplier=1.0, seed=0)
        x, y = next(iter(q.data_loader))
        nn.functional.cross_entropy(twin(x), y).backward()
        q.optimizer.step()
        assert q.accountant.steps == 1 and p.accountant.steps == 1
    finally:
        torch.set_default_dtype(torch.float32)
