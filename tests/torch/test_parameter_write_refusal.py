"""The refusal of a parameter written in place during the training forward says what
the check sees (an in-place operation on the parameter, which moves its version
counter) and does not claim writes through ``.data``, which leave the counter alone."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import BatchDependenceError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


class _Stat(nn.Module):
    """A linear layer and a frozen parameter the forward overwrites with the batch's
    maximum (not used by the output: only the parameter check can see it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.stat = nn.Parameter(torch.zeros(3), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.stat.copy_(x.amax(0))
        return self.fc(x)


def test_the_refusal_names_the_in_place_write_and_not_data_writes():
    torch.manual_seed(0)
    X, y = torch.randn(32, 3), torch.randint(0, 2, (32,))
    model = _Stat()
    opt = torch.optim.SGD(model.fc.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = make_private(
            model,
            opt,
            DataLoader(TensorDataset(X, y), batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            epochs=1,
            seed=0,
        )
    xb, yb = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    with pytest.raises(BatchDependenceError, match="parameter 'stat' was written in place") as e:
        p.optimizer.step()
    message = str(e.value)
    assert "copy_" in message
    assert ".data" not in message  # a write through .data moves no version counter
