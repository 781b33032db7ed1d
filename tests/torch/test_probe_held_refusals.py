"""The batch-independence probe's runs with the integer inputs held
(:mod:`privlearn.torch._probe_held`) when the model refuses one: every exception was
taken as "no evidence" and the case passed on the one-ulp rule alone (which a mix below
an ulp passes), out-of-memory included. A model's refusal now refuses the model, naming
``check_batch_independence=False``; running out of memory propagates."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import BatchDependenceError, make_private  # noqa: E402

T = 5


class _PaddingChecked(nn.Module):
    """A packed LSTM on padded sequences, each example on its own, that raises ``error``
    when a sequence has non-zero values past its length (the probe's run with example
    ``j``'s floating inputs from a longer example and its length kept)."""

    def __init__(self, error):
        super().__init__()
        self.rnn = nn.LSTM(3, 6, batch_first=True)
        self.head = nn.Linear(6, 2)
        self.error = error

    def forward(self, x, lengths):
        past = torch.arange(x.shape[1]) >= lengths[:, None]
        if x[past].abs().sum() > 0:
            raise self.error("padding past a sequence's length must be zero")
        seq = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        h = pad_packed_sequence(self.rnn(seq)[0], batch_first=True, total_length=T)[0]
        return self.head(h.sum(1))


def _step(model):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, T + 1, (16,), generator=g)
    lengths[0], lengths[1] = 1, T  # example 0's donor (example 1) is longer
    x = torch.randn(16, T, 3, generator=g)
    x[torch.arange(T) >= lengths[:, None]] = 0.0
    y = torch.randint(0, 2, (16,), generator=g)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(x, lengths, y), batch_size=8),
        noise_multiplier=1.0,
        seed=0,
        sampling="fixed",
    )
    xb, lb, yb = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(xb, lb), yb).backward()
    p.optimizer.step()
    return p


@pytest.mark.parametrize("error", [ValueError, RuntimeError, AssertionError])
def test_a_run_the_model_refuses_refuses_the_model_naming_the_escape_hatch(error):
    torch.manual_seed(0)
    with pytest.raises(BatchDependenceError, match="check_batch_independence=False") as e:
        _step(_PaddingChecked(error))
    assert "padding past" in str(e.value) and "integer inputs" in str(e.value)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
def test_running_out_of_memory_in_a_held_run_propagates(error):
    torch.manual_seed(0)
    with pytest.raises(error, match="padding past"):
        _step(_PaddingChecked(error))


def test_the_model_with_consistent_inputs_passes():
    """The same model, its refusal never triggered (an escape hatch for the check above
    only): the step is taken."""

    class _Never(_PaddingChecked):
        def forward(self, x, lengths):
            seq = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            h = pad_packed_sequence(self.rnn(seq)[0], batch_first=True, total_length=T)[0]
            return self.head(h.sum(1))

    torch.manual_seed(0)
    assert _step(_Never(ValueError)).accountant.steps == 1


class _OutOfMemoryOnReplaced(nn.Module):
    """Per example; runs out of memory on the probe's second pass (the batch with its
    first example replaced)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:  # the step's forward, the probe's base run, then this one
            raise torch.OutOfMemoryError("out of memory on the replaced batch")
        return self.lin(x)


def test_running_out_of_memory_on_the_replaced_batch_propagates():
    """It was read as a model that cannot run on the batch with one example replaced
    (a BatchDependenceError saying its inputs are not one row per example)."""
    torch.manual_seed(0)
    model = _OutOfMemoryOnReplaced()
    data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        seed=0,
        sampling="fixed",
    )
    xb, yb = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    with pytest.raises(torch.OutOfMemoryError, match="replaced batch"):
        p.optimizer.step()
