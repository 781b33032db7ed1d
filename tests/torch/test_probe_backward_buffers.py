"""A buffer written after the model's training forward (in the backward pass, by a
gradient hook) is refused at the step (:mod:`privlearn.torch._buffer_writes`): the
batch-independence probe's passes run the forward alone, so such a buffer, a statistic of
the gradients kept in the model and released with its ``state_dict``, trained unseen."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from train_loops import train_private  # noqa: E402

from privlearn.torch.probe import BatchDependenceError  # noqa: E402


class _GradMax(nn.Module):
    """A Linear whose output's gradient hook keeps the largest gradient entry seen (a
    gradient monitor) in a buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("gmax", torch.zeros(()))

    def _keep(self, g):
        self.gmax.copy_(torch.maximum(self.gmax, g.abs().max()))

    def forward(self, x):
        h = self.lin(x)
        if self.training and h.requires_grad:
            h.register_hook(self._keep)
        return h


def _run(model, steps: int = 2, **kw):
    return train_private(model, steps, features=6, classes=3, **kw)[0]


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_buffer_written_in_the_backward_pass_is_refused(sampling):
    """The buffer holds the batch's largest gradient entry (a function of the examples,
    no noise); the step is refused naming it, before anything is released, and the
    buffer no longer holds that entry (NaN: no value from before the write is kept), so a
    state_dict saved after catching the refusal releases nothing of the batch."""
    torch.manual_seed(0)
    model = _GradMax()
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(BatchDependenceError, match=r"buffer 'gmax' of a _GradMax.*backward"):
        _run(model, sampling=sampling)
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    assert torch.isnan(model.state_dict()["gmax"]).all()


def test_the_promise_of_check_batch_independence_false_trains():
    """``check_batch_independence=False`` promises what the probe would check: the run
    trains (and the user answers for the buffer)."""
    torch.manual_seed(0)
    model = _GradMax()
    p = _run(model, sampling="fixed", check_batch_independence=False)
    assert p.accountant.steps == 2 and model.gmax.item() > 0


class _Checkpointed(nn.Module):
    """Spectral norm (its power iteration writes ``_u``, from the weights alone) under
    activation checkpointing, and a step counter written in the forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6))
        self.b = nn.Linear(6, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.steps += 1
        h = checkpoint(self.a, x, use_reentrant=False)
        return self.b(torch.tanh(h))


def test_buffers_the_forward_writes_from_the_weights_train():
    """No false refusal: buffers written in the forward from no data (a step counter, a
    power iteration, also under activation checkpointing) train as before."""
    torch.manual_seed(0)
    model = _Checkpointed()
    p = _run(model, steps=3, sampling="poisson")
    assert p.accountant.steps == 3 and model.steps.item() >= 3


class _FrozenMax(nn.Module):
    """A per-feature running maximum of the inputs kept in a frozen ``nn.Parameter``
    (not a buffer), written in place by the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.seen_max = nn.Parameter(torch.full((6,), -1e9), requires_grad=False)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.seen_max.copy_(torch.maximum(self.seen_max, x.amax(0)))
        return self.lin(x)


def test_a_parameter_the_forward_writes_from_the_data_is_refused():
    """The frozen parameter holds the training data's per-feature maxima (its values
    are those of examples, no noise); the probe compares buffers only, so it trained.
    Refused at the first step, naming it, before any update."""
    torch.manual_seed(0)
    model = _FrozenMax()
    before = model.lin.weight.detach().clone()
    with pytest.raises(BatchDependenceError, match=r"parameter 'seen_max' was written"):
        _run(model, sampling="fixed")
    assert torch.equal(before, model.lin.weight)


class _FrozenMean(nn.Module):
    """The batch's mean copied into a frozen ``nn.Parameter``; ``mix``:
    the forward also centres each example by that mean (the probe refuses the step)."""

    def __init__(self, mix: bool = False):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.w = nn.Parameter(torch.zeros(6), requires_grad=False)
        self.mix = mix

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.w.copy_(x.mean(0))
            self.seen = x.detach().clone()
        return self.lin(x - self.w if self.mix else x)


@pytest.mark.parametrize("mix", [False, True], ids=["parameter_check", "probe"])
def test_a_refused_parameter_write_leaves_no_batch_mean_in_the_state_dict(mix):
    """Whether the parameter check or the probe (examples mixed through it) refuses the
    step, the parameter no longer holds the batch's mean after the refusal (NaN: no copy
    from before the forward is kept), so a state_dict saved after catching it releases
    nothing of the batch."""
    torch.manual_seed(0)
    model = _FrozenMean(mix)
    with pytest.raises(BatchDependenceError):
        _run(model, sampling="fixed")
    mean = model.seen.mean(0)  # the batch of the refused step's forward
    saved = model.state_dict()["w"]
    assert not torch.allclose(saved, mean, equal_nan=False)
    assert torch.isnan(saved).all()
