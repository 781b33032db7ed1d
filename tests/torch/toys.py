"""The small models and data sets of the engine's tests and the parameters a step
trains (the ``make_mlp`` / ``make_data`` fixtures and the ``oracle`` of conftest.py; test
modules and hf_models.py import them from here: ``from toys import toy_data``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def trainable(model) -> list:
    """The parameters that take gradients, each once (tied ones once), in model order."""
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def toy_data(n: int = 64, d: int = 6, k: int = 3, seed: int = 0, dtype=None,
             spread: bool = False):
    """``n`` examples of ``d`` standard normal features (scaled from 0.2 to 3 across the
    examples with ``spread``, so that per-example norms differ) and a class in
    ``range(k)``, from their own generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype or torch.get_default_dtype())
    if spread:
        x = x * torch.linspace(0.2, 3.0, n, dtype=x.dtype)[:, None]
    return TensorDataset(x, torch.randint(0, k, (n,), generator=g))


def toy_mlp(d: int = 6, k: int = 3, hidden: int = 8, seed: int = 0, act=None, dtype=None,
            norm: bool = False):
    """``Linear(d, hidden) - act (default ReLU) [- LayerNorm(hidden)] - Linear(hidden,
    k)``, initialised from ``seed`` (the global generator), in ``dtype`` (default:
    torch's)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(d, hidden), (act or nn.ReLU)(),
              *([nn.LayerNorm(hidden)] if norm else []), nn.Linear(hidden, k)]
    model = nn.Sequential(*layers)
    return model if dtype is None else model.to(dtype)


class MixedIds(nn.Module):
    """Token ids (vocabulary 50) through an ``Embedding(50, 8)``, averaged over the
    sequence, ``Linear(8, 16)``, then ``h + c * h.flip(0)`` (mixes examples unless
    ``c = 0``) and ``Linear(16, 3)``: a model whose only input is an integer one, so the
    input changes with the replaced example."""

    def __init__(self, c: float):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 3)
        self.c = c

    def forward(self, ids):
        h = self.a(self.emb(ids).mean(1))
        return self.b(h + self.c * h.flip(0))


def noiseless_run(model, x, y, *, max_grad_norm: float, lr: float = 0.0):
    """A ``make_private`` run without noise of SGD at ``lr`` (at 0 the clipped sum stays in
    ``.grad``) over one fixed-size batch of all of ``x, y`` (loss summed over the batch,
    seed 0)."""
    from torch.utils.data import DataLoader

    from privlearn.torch import make_private

    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        DataLoader(TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=0.0,
        max_grad_norm=max_grad_norm,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )


def noiseless_sum_step(model, x, y, max_grad_norm: float):
    """One step of :func:`noiseless_run` at learning rate 0 with the loss
    ``sum(model(x) * y)``: the batch drawn."""
    p = noiseless_run(model, x, y, max_grad_norm=max_grad_norm)
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    (p.model(xb) * yb).sum().backward()
    p.optimizer.step()
    return xb, yb


def regression_engine(model):
    """``make_private`` of ``model`` (three features in, one out) trained by SGD at 0.1 on
    16 rows of standard normal features and targets drawn from the global generator
    (after ``model`` was built): fixed-size batches of 4, noise multiplier 1, clipping
    at 1, seed 0."""
    from torch.utils.data import DataLoader

    from privlearn.torch import make_private

    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sampling="fixed",
        seed=0,
    )


def regression_step(p, **kwargs):
    """One step of :func:`regression_engine`'s ``p`` on its next batch: the mean squared
    error of ``p.model(x, **kwargs)``."""
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    ((p.model(xb, **kwargs) - yb) ** 2).mean().backward()
    p.optimizer.step()
