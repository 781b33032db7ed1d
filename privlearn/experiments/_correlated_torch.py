"""The PyTorch half of the correlated-noise study (:mod:`.correlated_noise`): the MNIST
tensors and their validation split, the engine's plan of each strategy, and one training
run. Imported only when the study runs (it imports torch); everything the study reports
comes from :func:`privlearn.torch.make_private` and its accountant.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privlearn.correlated import per_query_error
from privlearn.datasets import load_mnist
from privlearn.errors import ParameterValueError
from privlearn.torch import make_private, retain_freed_memory
from privlearn.torch.config import DPConfig
from privlearn.torch.privacy_engine import plan_run
from privlearn.torch.schedule import independent

__all__ = ["MnistSplit", "RunPlan", "RunResult", "mnist_split", "plan_strategy", "train_once",
           "torch_threads"]


@dataclass(frozen=True)
class MnistSplit:
    """Pixels in [0, 1] (flattened, no data-dependent normalisation) and labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def _tensors(bunch, rows=None):
    x, y = bunch.data, bunch.target
    if rows is not None:
        x, y = x[rows], y[rows]
    x = torch.from_numpy(x.reshape(len(x), -1).astype(np.float32) / 255.0)
    return x, torch.from_numpy(y.astype(np.int64))


def mnist_split(n_validation: int, seed: int, n_train: int | None = None,
                n_test: int | None = None, data_home=None, download: bool = False
                ) -> MnistSplit:
    """The 60,000 MNIST training images split at random (``seed``) into a validation set
    of ``n_validation`` images and the private training set (the next ``n_train``, default
    all the rest); the first ``n_test`` test images (default all 10,000)."""
    train = load_mnist("train", data_home, download=download)
    test = load_mnist("test", data_home, download=download)
    order = np.random.default_rng(seed).permutation(len(train.target))
    if n_validation >= len(order):
        raise ParameterValueError(f"n_validation must be below the {len(order)} training images, "
                         f"got {n_validation}")
    val = order[:n_validation]
    rest = order[n_validation:]
    tr = rest if n_train is None else rest[:n_train]
    x_tr, y_tr = _tensors(train, tr)
    x_va, y_va = _tensors(train, val)
    x_te, y_te = _tensors(test, None if n_test is None else np.arange(n_test))
    return MnistSplit(x_tr, y_tr, x_va, y_va, x_te, y_te)


def mlp(hidden: int) -> nn.Sequential:
    """784-``hidden``-10 ReLU network."""
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@dataclass(frozen=True)
class RunPlan:
    """What the engine plans for one strategy at one epsilon (from
    :func:`privlearn.torch.privacy_engine.plan_run`, before any data is read).

    Attributes
    ----------
    settings : dict
        The ``make_private`` keywords of the strategy (``noise="banded"``, ``bands=16``,
        ``sampling="cyclic_poisson"``, ...).
    run_settings : dict
        The same run with the engine's optimised strategy object as ``noise`` (so each
        training run does not optimise it again; the engine takes a strategy object as
        it is and calibrates the same noise multiplier).
    noise_multiplier : float
        sigma, calibrated by the engine (rounded up) for (epsilon, delta).
    steps : int
    expected_batch_size : float
    noise_rmse : float
        Root mean squared noise of the iterates at learning rate 1, per coordinate:
        ``sigma C / B * sqrt(mean_t ||(A C^{-1})[t, :]||^2)`` with ``A`` the prefix sums
        (:func:`privlearn.correlated.per_query_error`; ``C = I`` for DP-SGD, where it is
        ``sigma C / B * sqrt((T + 1) / 2)``).
    """

    settings: dict
    run_settings: dict
    noise_multiplier: float
    steps: int
    expected_batch_size: float
    noise_rmse: float


def plan_strategy(settings: dict, x_train: torch.Tensor, *, epsilon: float, delta: float,
                  epochs: int, batch_size: int, max_grad_norm: float) -> RunPlan:
    """The engine's plan of ``settings`` on a training set the size of ``x_train``."""
    cfg = DPConfig(target_epsilon=epsilon, target_delta=delta, epochs=epochs,
                   max_grad_norm=max_grad_norm, **settings)
    loader = DataLoader(TensorDataset(x_train), batch_size=batch_size)
    plan = plan_run(cfg, nn.Linear(1, 1), loader)
    strategy = plan.run.strategy  # Identity() for DP-SGD
    steps = int(plan.planned_steps)
    err = float(np.mean(per_query_error(strategy, steps)))
    rmse = plan.noise_multiplier * plan.max_grad_norm / plan.expected_batch_size * err ** 0.5
    run_settings = {k: v for k, v in settings.items() if k not in ("bands", "buffers")}
    if not independent(settings["noise"]):
        run_settings["noise"] = plan.run.strategy
        run_settings["cycle_length"] = plan.run.cycle
    return RunPlan(dict(settings), run_settings, plan.noise_multiplier, steps,
                   plan.expected_batch_size, rmse)


@dataclass(frozen=True)
class RunResult:
    accuracy: float
    epsilon: float
    seconds: float


def train_once(split: MnistSplit, plan: RunPlan, *, learning_rate: float, epsilon: float,
               delta: float, epochs: int, batch_size: int, max_grad_norm: float,
               hidden: int, seed: int, evaluate_on: str) -> RunResult:
    """Train the MLP with plain SGD (constant learning rate, no momentum: the prefix-sum
    workload the strategies are optimised for) through ``make_private`` on the private
    training set; the accuracy on ``evaluate_on`` ("val" or "test") of the final model and
    the accountant's epsilon for the steps taken."""
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    loader = DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=batch_size)
    p = make_private(model, optimizer, loader, target_epsilon=epsilon, target_delta=delta,
                     epochs=epochs, max_grad_norm=max_grad_norm, seed=seed,
                     **plan.run_settings)
    if p.plan.noise_multiplier != plan.noise_multiplier or p.plan.planned_steps != plan.steps:
        raise RuntimeError(
            f"the run's plan (sigma {p.plan.noise_multiplier}, {p.plan.planned_steps} steps) "
            f"differs from the strategy's (sigma {plan.noise_multiplier}, {plan.steps} steps)")
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for xb, yb in p.data_loader:
            p.optimizer.zero_grad(set_to_none=True)
            loss_fn(p.model(xb), yb).backward()
            p.optimizer.step()
    spent = p.epsilon(delta)
    model = p.detach()
    x, y = (split.x_val, split.y_val) if evaluate_on == "val" else (split.x_test, split.y_test)
    with torch.no_grad():
        accuracy = float((model(x).argmax(dim=1) == y).double().mean())
    return RunResult(accuracy, float(spent), time.perf_counter() - t0)


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """Run with ``threads`` intra-op threads (None: leave PyTorch's setting), restored
    afterwards; also keeps freed memory between steps
    (:func:`privlearn.torch.retain_freed_memory`, a process-wide opt-in)."""
    retain_freed_memory()
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
