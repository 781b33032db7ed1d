"""What leaves a make_private training loop -- the model's state_dict, the optimizer's
state_dict, the accountant's record and epsilon -- is post-processing of the noisy steps:
trained on a data set and on its neighbour (one example replaced by an extreme one) with
the same seed, and again with another seed, no released value may change with the data
while staying fixed across seeds (an exact statistic of the private batches)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402


def _values(obj, path="", out=None) -> dict:
    """Every tensor and number in nested dicts / lists, by path."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[path] = obj.detach().cpu().numpy().copy()
    elif isinstance(obj, dict):
        out[path + ".keys"] = sorted(map(repr, obj))
        for k, v in obj.items():
            _values(v, f"{path}[{k!r}]", out)
    elif isinstance(obj, list | tuple):
        out[path + ".len"] = len(obj)
        for i, v in enumerate(obj):
            _values(v, f"{path}[{i}]", out)
    else:
        out[path] = repr(obj)
    return out


def _train(x, y, seed, plant=False, **settings) -> dict:
    torch.manual_seed(123)  # the same initial model
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    p = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=32),
                     **{"noise_multiplier": 1.0, "max_grad_norm": 1.0, "steps": 5,
                        "seed": seed, **settings})
    for _, (xb, yb) in zip(range(5), p.data_loader, strict=False):
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        p.optimizer.step()
    released = {"model": model.state_dict(), "optimizer": p.optimizer.state_dict(),
                "accountant": p.accountant.state_dict(), "epsilon": p.epsilon(1e-5)}
    if plant:  # an exact statistic of the data, to show the check finds one
        released["planted"] = float(x.abs().max())
    return _values(released)


def _same(a, b) -> bool:
    return np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b


def _deterministic_in_the_data(plant=False, **settings) -> list[str]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, generator=g), torch.randint(0, 2, (64,), generator=g)
    f0, f2 = _train(x, y, 0, plant, **settings), _train(x, y, 1, plant, **settings)
    for row in range(8):  # the first example the seed's batches draw
        x1, y1 = x.clone(), y.clone()
        x1[row], y1[row] = 1e4, 1 - y[row]
        f1 = _train(x1, y1, 0, plant, **settings)
        if any(not _same(f0[k], f1[k]) for k in f0 if k.startswith("['model']")):
            break  # it took part: the model differs between the neighbours
    else:
        pytest.fail("none of the first 8 examples took part in the run")
    return sorted(k for k in set(f0) | set(f1)
                  if k not in f0 or k not in f1
                  or (not _same(f0[k], f1[k]) and k in f2 and _same(f0[k], f2[k])))


@pytest.mark.parametrize("settings", [
    {},
    {"sampling": "fixed"},
    {"sampling": "shuffled_epochs"},
    {"max_physical_batch_size": 8},
    {"clipping": "adaptive", "target_unclipped_quantile": 0.5, "unclipped_num_std": 2.0},
], ids=["poisson", "fixed", "shuffled", "physical-batches", "adaptive"])
def test_no_released_value_follows_the_data_without_noise(settings):
    assert _deterministic_in_the_data(**settings) == []


def test_the_check_finds_an_exact_statistic():
    assert _deterministic_in_the_data(plant=True) == ["['planted']"]
