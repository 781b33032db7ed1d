"""The probe refuses a buffer written from the data even when replacing one example
leaves it unchanged (:mod:`privlearn.torch._probe_buffers`): a quantization-aware
training observer keeps the batch's minimum and maximum, which replacing one example moves
only when that example alone held them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.probe import BatchDependenceError  # noqa: E402


def _duplicated(n: int = 8, d: int = 6) -> TensorDataset:
    """``n`` standard normal rows, each twice (a data set with duplicates), and labels."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    return TensorDataset(torch.cat([x, x]), torch.arange(2 * n) % 3)


def _qat_model():
    """Quantization-aware training's FakeQuantize (its observer keeps the running
    minimum and maximum of what it sees, per tensor) before a Linear."""
    from torch.ao.quantization import FakeQuantize

    torch.manual_seed(0)
    return nn.Sequential(FakeQuantize(), nn.Linear(6, 3))


def test_an_observer_whose_extremes_two_examples_share_is_refused():
    """Every value of the batch is held by two examples, so the batch's minimum and
    maximum survive the replacement of any one example, and the probe's replacement
    passes saw the observer's buffers unchanged: the run trained with the training
    data's exact extremes in ``min_val``/``max_val`` (released with the state_dict, no
    noise). The batch collapsed to one example moves them: refused, naming the buffer,
    before anything is released; the buffers are back at their values before the step's
    forward (a state_dict saved after the refusal holds no extreme of the batch)."""
    ds = _duplicated()
    model = _qat_model()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=len(ds)),
        noise_multiplier=1.0,
        seed=0,
        sampling="fixed",
    )
    x, y = next(iter(p.data_loader))
    assert len(x) == len(ds)  # the whole data set: every extreme held twice
    before = [q.detach().clone() for q in model.parameters()]
    unwritten = [b.clone() for b in model[0].buffers()]
    nn.functional.cross_entropy(p.model(x), y).backward()
    obs = model[0].activation_post_process
    assert (obs.min_val, obs.max_val) == (ds.tensors[0].min(), ds.tensors[0].max())
    with pytest.raises(BatchDependenceError, match=r"buffer '0\..*replaced by example.*state_dict"):
        p.optimizer.step()
    assert p.accountant.steps == 0
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(unwritten, model[0].buffers(), strict=True))


def test_the_observer_disabled_trains():
    """The way out: the observer disabled (calibrated beforehand, on public data) writes
    nothing, and the same run trains with the quantization it was given."""
    from torch.ao.quantization import disable_observer

    ds = _duplicated()
    model = _qat_model()
    model.apply(disable_observer)
    kept = [b.clone() for b in model[0].buffers()]
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=len(ds)),
        noise_multiplier=1.0,
        seed=0,
        sampling="fixed",
    )
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        break
    assert p.accountant.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, model[0].buffers(), strict=True))


class _Seen(nn.Module):
    """A count of the training examples seen, kept in a buffer (to drive a schedule),
    before a Linear."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
        return self.lin(x)


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_count_of_the_examples_is_refused_where_the_batch_size_is_private(sampling):
    """Under Poisson sampling (add/remove neighbours) the count of examples seen is the
    sum of the private batch sizes (each example adds the number of times it was drawn),
    released unnoised with the state_dict; replacing or collapsing examples keeps it, so
    it trained. One example fewer moves it: refused. With fixed-size batches
    (replace-one neighbours) the batch size is public: the run trains."""
    ds = _duplicated()
    torch.manual_seed(0)
    model = _Seen()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=8),
        noise_multiplier=1.0,
        seed=0,
        sampling=sampling,
    )
    x, y = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(x), y).backward()
    if sampling == "fixed":
        p.optimizer.step()
        assert p.accountant.steps == 1 and model.seen.item() == 8
        return
    with pytest.raises(
        BatchDependenceError, match=r"buffer 'seen'.*last example.*was removed.*Poisson"
    ):
        p.optimizer.step()
    assert p.accountant.steps == 0 and model.seen.item() == 0  # the refused count undone
