"""Buffers a training forward writes at a step where the probe has not judged them
(:mod:`privlearn.torch._late_writes`): written only past a threshold, first written at a
later step, or written from the first training forward alone (a data-dependent
initialisation). Each would keep a statistic of a private batch in the model's
``state_dict`` without noise; data-independent ones (counters, caches built from shapes
or weights) still train."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from train_loops import train_private  # noqa: E402

from privlearn.torch.probe import BatchDependenceError  # noqa: E402

_LATE = 12  # past the probe's passes of the first step (which run the forward too)


class _Threshold(nn.Module):
    """A per-feature mean of the batch kept once a step counter (a buffer, or a plain
    attribute) passes a threshold."""

    def __init__(self, counter: str):
        super().__init__()
        self.counter = counter
        self.lin = nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.calls = 0
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x):
        if self.counter == "buffer":
            self.steps += 1
            late = bool(self.steps > _LATE)
        else:
            self.calls += 1
            late = self.calls > _LATE
        if late:
            self.stat.copy_(x.detach().mean(0))
        return self.lin(x)


class _LazyCache(nn.Module):
    """A cache slot empty until a later call, then refreshed every ``_LATE`` calls: from
    the batch (``data``) or from the weights alone."""

    def __init__(self, data: bool):
        super().__init__()
        self.data = data
        self.lin = nn.Linear(4, 2)
        self.calls = 0
        self.register_buffer("cache", None)

    def forward(self, x):
        self.calls += 1
        if self.calls % _LATE == 0:
            src = x.detach().amax(0) if self.data else self.lin.weight.detach().sum(0)
            self.cache = src.clone()
        return self.lin(x)


_GLOBAL_FLAG = {"initialized": False}


class _ActNormInit(nn.Module):
    """Data-dependent initialisation by the first training forward (ActNorm): the scale
    is set from the batch once, the flag a plain attribute, a buffer, or kept outside
    the module (where no pass can unset it); the scale applies from the next call."""

    def __init__(self, flag: str):
        super().__init__()
        self.flag = flag
        self.lin = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("done", torch.tensor(False))
        self.initialized = False

    def _get(self) -> bool:
        if self.flag == "buffer":
            return bool(self.done)
        return self.initialized if self.flag == "attribute" else _GLOBAL_FLAG["initialized"]

    def forward(self, x):
        if not self._get():
            with torch.no_grad():
                self.scale.copy_(x.abs().amax(0))
            self.done.fill_(True)
            self.initialized = True
            _GLOBAL_FLAG["initialized"] = True
            return self.lin(x)
        return self.lin(x / self.scale)


class _ShapeCache(nn.Module):
    """A rotary-like table built lazily from the sequence length alone (a plain attribute
    keeps the length it was built for), and a step counter: no data."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.cached = 0
        self.register_buffer("table", torch.zeros(0), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        if self.cached < x.shape[1]:
            self.cached = x.shape[1]
            self.table = torch.cos(torch.arange(x.shape[1], dtype=x.dtype))
        return self.lin(x * self.table)


def _run(model, steps: int, sampling: str = "poisson"):
    return train_private(model, steps, sampling=sampling)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("counter", ["buffer", "attribute"])
@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_buffer_written_past_a_threshold_is_refused_at_that_step(counter, sampling):
    torch.manual_seed(0)
    model = _Threshold(counter)
    with pytest.raises(BatchDependenceError, match=r"buffer 'stat' of a _Threshold"):
        _run(model, 2 * _LATE, sampling)
    # the refused step released nothing: the steps before it trained, this one did not
    assert model.steps.item() == _LATE + 1 or model.calls >= _LATE + 1


def test_a_cache_first_filled_at_a_later_step_from_the_batch_is_refused():
    torch.manual_seed(0)
    with pytest.raises(BatchDependenceError, match=r"buffer 'cache' of a _LazyCache"):
        _run(_LazyCache(data=True), 2 * _LATE)


@pytest.mark.parametrize(
    ("flag", "why"),
    [
        ("attribute", "written from the batch"),  # the passes unset the flag: compared
        ("buffer", "written from the batch"),
        ("global", "by none of the batch-independence probe's passes"),  # cannot be unset
    ],
)
def test_a_data_dependent_initialisation_by_the_first_forward_is_refused(flag, why):
    torch.manual_seed(0)
    _GLOBAL_FLAG["initialized"] = False
    model = _ActNormInit(flag)
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(BatchDependenceError, match=rf"buffer 'scale'.*{why}.*before make_private"):
        _run(model, 3)
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))


def test_an_initialisation_on_public_data_before_make_private_trains():
    """The remedy the refusal names: the scale set on public data, then trained on."""
    torch.manual_seed(0)
    model = _ActNormInit("attribute")
    model(torch.randn(8, 4))  # public data, before make_private
    scale = model.scale.clone()
    p, steps = _run(model, 2 * _LATE)
    assert steps == 2 * _LATE and p.accountant.steps == 2 * _LATE
    assert torch.equal(model.scale, scale)


@pytest.mark.parametrize("model", [lambda: _LazyCache(data=False), _ShapeCache])
def test_data_independent_late_and_lazy_buffers_train(model):
    torch.manual_seed(0)
    p, steps = _run(model(), 2 * _LATE + 1)
    assert p.accountant.steps == 2 * _LATE + 1


def test_a_late_write_reruns_the_probe_once(monkeypatch):
    """A data-independent cache refreshed every ``_LATE`` calls: the probe runs again at
    its first refresh only (once judged, later refreshes cost nothing)."""
    from privlearn.torch import probe as probe_mod

    runs = []
    real = probe_mod.probe
    monkeypatch.setattr(probe_mod, "probe", lambda t, *a: runs.append(t) or real(t, *a))
    torch.manual_seed(0)
    model = _LazyCache(data=False)
    _run(model, 3 * _LATE + 1, sampling="fixed")
    assert model.calls > 3 * _LATE  # refreshed three times
    assert len(runs) == 2  # the first step, and the first refresh


class _EveryStep(nn.Module):
    """A per-feature mean of the batch kept at every training forward (from the first)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x):
        self.stat.copy_(x.detach().mean(0))
        return self.lin(x)


def _means(model):
    """The batch means the model's training forwards saw (recorded by a hook)."""
    seen = []
    model.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach().mean(0)) if torch.is_grad_enabled() else None
    )
    return seen


@pytest.mark.parametrize(
    "make",
    [
        lambda: _Threshold("buffer"),  # a late write (the probe re-armed at that step)
        lambda: _Threshold("attribute"),
        _EveryStep,  # a write at the first step (the first probe)
        lambda: _ActNormInit("attribute"),  # a first-forward initialisation
        lambda: _ActNormInit("global"),  # one none of the probe's passes writes
    ],
)
def test_a_refused_write_is_undone_before_the_state_dict_is_read(make):
    """A user who catches the refusal and saves the model's state_dict releases nothing
    of the refused batch: the buffer it wrote is back at its value before the step."""
    torch.manual_seed(0)
    _GLOBAL_FLAG["initialized"] = False
    model = make()
    name = "scale" if isinstance(model, _ActNormInit) else "stat"
    initial = getattr(model, name).clone()
    seen = _means(model)
    with pytest.raises(BatchDependenceError, match=rf"buffer '{name}'"):
        _run(model, 2 * _LATE)
    saved = model.state_dict()[name]
    assert seen and not any(torch.allclose(saved, m) for m in seen)
    assert torch.equal(saved, initial)
