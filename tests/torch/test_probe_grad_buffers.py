"""A buffer the forward writes from the data only with gradients on is compared by the
probe in passes with gradients (:mod:`privlearn.torch._probe_grad_buffers`): its passes
without gradients never see the write, and the statistic left in the model's
``state_dict`` without noise."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from train_loops import train_private  # noqa: E402

from privlearn.torch import probe as probe_mod  # noqa: E402
from privlearn.torch.probe import BatchDependenceError  # noqa: E402


class _GradOnlyMax(nn.Module):
    """Keeps the largest absolute input per feature, only when gradients are on."""

    def __init__(self, key: str = "grad_enabled"):
        super().__init__()
        self.key = key
        self.pre = nn.Linear(4, 4)
        self.lin = nn.Linear(4, 2)
        self.register_buffer("mx", torch.zeros(4))

    def forward(self, x):
        h = self.pre(x)
        on = torch.is_grad_enabled() if self.key == "grad_enabled" else h.requires_grad
        if on and self.key == "from_activation":  # written from h: carries its graph
            self.mx.copy_(torch.maximum(self.mx, h.abs().amax(0)))
        elif on:
            self.mx.copy_(torch.maximum(self.mx, x.abs().amax(0)))
        return self.lin(h)


class _Counter(nn.Module):
    """A step counter (no function of the data), written in every forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.lin(x)


class _GradOnlyCounter(_Counter):
    """The counter, only with gradients on: compared with gradients, and the same."""

    def forward(self, x):
        if torch.is_grad_enabled():
            self.steps += 1
        return self.lin(x)


class _Spectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))
        self.out = nn.utils.parametrizations.weight_norm(nn.Linear(4, 2))

    def forward(self, x):
        return self.out(torch.relu(self.lin(x)))


def _run(model, steps: int = 2, sampling: str = "poisson"):
    return train_private(model, steps, sampling=sampling)[0]


@pytest.fixture
def grad_passes(monkeypatch):
    """The probe's passes with gradients on, counted."""
    calls = []
    real = probe_mod._observe_run

    def counted(*args, **kwargs):
        calls.append(kwargs.get("grad", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(probe_mod, "_observe_run", counted)
    return calls


@pytest.mark.parametrize("key", ["grad_enabled", "requires_grad", "from_activation"])
@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_buffer_written_only_with_gradients_is_refused(key, sampling):
    """The buffer holds the batch's per-feature extremes (no noise): refused before the
    first step releases anything, naming it; the weights are untouched."""
    torch.manual_seed(0)
    model = _GradOnlyMax(key)
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(BatchDependenceError, match=r"buffer 'mx' of a _GradOnlyMax.*gradients"):
        _run(model, sampling=sampling)
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    assert all(q.grad is None for q in model.parameters())  # no pass left a gradient


@pytest.mark.parametrize("cls", [_Counter, _Spectral, nn.Linear])
def test_no_extra_pass_when_the_passes_without_gradients_see_every_write(cls, grad_passes):
    torch.manual_seed(0)
    model = cls(4, 2) if cls is nn.Linear else cls()
    p = _run(model)
    assert p.accountant.steps == 2
    assert grad_passes and not any(grad_passes)


def test_a_counter_written_only_with_gradients_trains(grad_passes):
    """Compared with gradients on (the extra passes run), the same in every pass: trains,
    leaves no gradient or record behind, and the counter counts the training forwards."""
    torch.manual_seed(0)
    model = _GradOnlyCounter()
    p = _run(model)
    assert p.accountant.steps == 2 and any(grad_passes)
    assert int(model.steps) == 2  # the probe's passes restored it
    assert not p.optimizer.tracker.records


class _LazyCache(nn.Module):
    """A cache of the weights' column sums built once, in the first training forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("cache", torch.zeros(4))
        self.built = False

    def forward(self, x):
        if not self.built and torch.is_grad_enabled():
            self.cache.copy_(self.lin.weight.detach().sum(0))
            self.built = True
        return self.lin(x)


def test_a_buffer_no_pass_writes_keeps_training(grad_passes):
    """Written by the first training forward alone, by no probe pass with or without
    gradients: compared (nothing differs) and trained, as before."""
    torch.manual_seed(0)
    model = _LazyCache()
    p = _run(model)
    assert p.accountant.steps == 2 and any(grad_passes) and model.cache.abs().sum() > 0
