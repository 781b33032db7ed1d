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
