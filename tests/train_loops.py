"""The training loop the engine's tests share: a number of logical steps of a private run
over its loader, across epochs. Importable from every test module (like closed_forms.py:
pytest puts this folder, which holds the suite's conftest.py, on ``sys.path``); torch is
imported only when the loop runs."""

from __future__ import annotations


def train_steps(p, steps: int, loader=None, loss_fn=None) -> int:
    """``steps`` logical steps of ``p`` (what ``make_private`` returns) over ``loader``
    (``p.data_loader`` when None), as many epochs as they take, each on the loss
    ``loss_fn(output, y)`` (cross-entropy when None); returns the steps taken."""
    from torch.nn import functional as F

    loss_fn = loss_fn or F.cross_entropy
    done = 0
    while done < steps:
        for x, y in loader if loader is not None else p.data_loader:
            p.optimizer.zero_grad()
            loss_fn(p.model(x), y).backward()
            p.optimizer.step()
            done += 1
            if done == steps:
                return done
    return done


def train_private(model, steps: int, features: int = 4, classes: int = 2, **kw):
    """``model`` made private (SGD at lr 0.1, noise multiplier 1, seed 0, ``kw`` to
    ``make_private``) on 64 seeded examples of ``features`` standard normal features and
    labels ``i % classes``, in batches of 16, and trained ``steps`` steps
    (:func:`train_steps`); returns the run and the steps taken."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, features, generator=g), torch.arange(64) % classes)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=16),
        noise_multiplier=1.0,
        seed=0,
        **kw,
    )
    return p, train_steps(p, steps)
