"""Writes through ``.data`` during the training forward (:mod:`privlearn.torch._data_writes`).

``t.data`` is an alias of ``t`` with a version counter of its own: a statistic of the
batch written through it at a later step (old code's running averages) moved no version
counter, so the engine's notes missed it after the first step and the statistic was
released with the ``state_dict``. Data-independent writes through ``.data`` (a step
counter, an average of the weights, a constant) still train."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from train_loops import train_private  # noqa: E402

from privlearn.torch import _data_writes  # noqa: E402
from privlearn.torch.probe import BatchDependenceError  # noqa: E402

_AT = 5  # the step whose forward writes the batch's statistic


class _Late(nn.Module):
    """A step counter bumped through ``.data`` (public) and, from step ``_AT``, the
    batch's per-feature mean written into a buffer (or a frozen parameter) through
    ``.data``: ``how`` says which write."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("stat", torch.zeros(4))
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.seen = []

    def forward(self, x):
        self.steps.data += 1
        if self.steps.item() >= _AT:
            mean = x.detach().mean(0)
            if torch.is_grad_enabled():
                self.seen.append(mean)
            if self.how == "copy":
                self.stat.data.copy_(mean)
            elif self.how == "view":
                self.stat.data[:2].copy_(mean[:2])
            elif self.how == "assign":
                self.stat.data = mean.clone()
            else:  # "parameter"
                self.w.data.add_(mean)
        return self.lin(x)


@pytest.mark.parametrize("how", ["copy", "view", "assign"])
def test_a_statistic_written_through_data_at_a_later_step_is_refused(how):
    torch.manual_seed(0)
    model = _Late(how)
    with pytest.raises(BatchDependenceError, match=r"buffer 'stat' of a _Late"):
        train_private(model, 2 * _AT, sampling="fixed")
    assert model.steps.item() == _AT  # refused at that step, not later
    saved = model.state_dict()["stat"]
    assert model.seen and not any(torch.allclose(saved[:2], m[:2]) for m in model.seen)
    assert torch.equal(saved, torch.zeros(4))  # back at its value before the step
    assert not _data_writes._active and "data" not in torch.Tensor.__dict__


def test_a_parameter_written_through_data_at_a_later_step_is_refused():
    torch.manual_seed(0)
    model = _Late("parameter")
    with pytest.raises(BatchDependenceError, match=r"'w'"):
        train_private(model, 2 * _AT, sampling="fixed")
    assert model.steps.item() == _AT
    assert torch.isnan(model.state_dict()["w"]).all()  # not the batch's mean


class _Public(nn.Module):
    """Writes through ``.data`` of no example: a step counter, an average of the
    weights (reading the weights through ``.data`` too), a constant written first at
    step ``_AT``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(2, 4))
        self.register_buffer("const", torch.zeros(4))

    def forward(self, x):
        self.steps.data.add_(1)
        self.ema.data.mul_(0.9).add_(0.1 * self.lin.weight.data)
        if self.steps.item() >= _AT:
            self.const.data.fill_(1.0)
        return self.lin(x)


def test_writes_through_data_of_no_example_train():
    torch.manual_seed(0)
    model = _Public()
    p, steps = train_private(model, 2 * _AT, sampling="fixed")
    assert steps == 2 * _AT and p.accountant.steps == 2 * _AT
    assert model.steps.item() == 2 * _AT and torch.equal(model.const, torch.ones(4))
    assert model.ema.abs().sum() > 0
    assert not _data_writes._active and "data" not in torch.Tensor.__dict__


def test_a_forward_that_raises_leaves_data_as_it_was():
    """The watch ends with the forward, also when it raises: ``torch.Tensor.data`` is
    torch's own attribute again."""

    class _Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += torch.is_grad_enabled()  # training forwards
            if self.calls == 3:
                raise ValueError("boom")
            return self.lin(x)

    torch.manual_seed(0)
    with pytest.raises(ValueError, match="boom"):
        train_private(_Raises(), 4, sampling="fixed")
    assert not _data_writes._active and "data" not in torch.Tensor.__dict__


def test_a_module_moved_where_it_is_during_the_forward_trains():
    """``module.to()`` of a module already on that device and dtype assigns each
    parameter's ``.data`` its own value: no write."""

    class _Moves(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            self.lin.to(x.device, x.dtype)
            return self.lin(x)

    torch.manual_seed(0)
    p, steps = train_private(_Moves(), 3, sampling="fixed")
    assert steps == 3 and p.accountant.steps == 3


def test_a_data_read_racing_the_end_of_the_watch_reads_torchs_attribute():
    """Another thread that looked the property up just before the last watch ended (and
    uninstalled it) reads and assigns ``.data`` through torch's own attribute; it failed
    with ``'object' object has no attribute '__get__'``."""
    session = _data_writes.begin("forward", object(), [])
    prop = torch.Tensor.__dict__["data"]  # what a racing thread has looked up
    _data_writes.end(session)
    t, v = torch.ones(3), torch.zeros(3)
    assert torch.equal(prop.__get__(t), t)
    prop.__set__(t, v)
    assert torch.equal(t, v) and "data" not in torch.Tensor.__dict__


class _Interrupted(nn.Module):
    """Its third training forward is interrupted (``KeyboardInterrupt``, a
    ``BaseException``: torch runs no ``always_call`` hook for it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
        return self.lin(x)


@pytest.mark.parametrize("then", ["forward", "detach"])
def test_an_interrupted_forward_leaves_no_watch_open(then):
    """A forward stopped by Ctrl-C leaves its watch open; the model's next forward (an
    evaluation too) ends it, and so does the engine's ``detach()`` (after which
    ``torch.Tensor.data`` stayed a property recording every alias of the model's
    storages)."""
    from torch.utils.data import DataLoader, TensorDataset
    from train_loops import train_steps

    from privlearn.torch import make_private

    torch.manual_seed(0)
    model = _Interrupted()
    ds = TensorDataset(torch.randn(64, 4), torch.arange(64) % 2)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=16),
        noise_multiplier=1.0,
        seed=0,
        sampling="fixed",
    )
    with pytest.raises(KeyboardInterrupt):
        train_steps(p, 4)
    if then == "forward":
        model.eval()
        with torch.no_grad():
            p.model(torch.zeros(2, 4))
    else:
        p.detach()
    assert not _data_writes._active and "data" not in torch.Tensor.__dict__


class _SelfTeacher(nn.Module):
    """From step ``_AT`` its training forward keeps the batch's mean in a buffer (through
    ``.data``, or in place under ``no_grad``: written with gradients on only, which the
    probe's passes without gradients do not see), then runs itself as its own teacher
    under ``no_grad``: a call of the model inside its own forward."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 2)
        self.register_buffer("stat", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, teacher: bool = False):
        if teacher:
            return self.lin(x)
        if torch.is_grad_enabled():
            self.steps += 1
            if self.steps.item() >= _AT:
                if self.how == "data":
                    self.stat.data.copy_(x.detach().mean(0))
                else:
                    with torch.no_grad():
                        self.stat.copy_(x.mean(0))
        with torch.no_grad():
            self(x, teacher=True)
        return self.lin(x)


@pytest.mark.parametrize("how", ["data", "in place"])
def test_a_call_of_the_model_inside_its_forward_keeps_the_forwards_notes(how):
    """The inner call's hooks ended the outer forward's watch and cleared its notes, so
    the batch statistic was released with the ``state_dict`` at every step from ``_AT``."""
    torch.manual_seed(0)
    model = _SelfTeacher(how)
    with pytest.raises(BatchDependenceError, match=r"buffer 'stat' of a _SelfTeacher"):
        train_private(model, 2 * _AT, sampling="fixed")
    assert model.steps.item() == _AT
    assert torch.equal(model.stat, torch.zeros(4))
    assert not _data_writes._active and "data" not in torch.Tensor.__dict__
