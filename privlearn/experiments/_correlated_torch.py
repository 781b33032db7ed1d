"""The PyTorch half of the correlated-noise study (:mod:`.correlated_noise`): the data
tensors and their validation split (MNIST pixels, or Adult records as token sequences),
the models (an MLP, or a small config-initialised BERT classifier), the engine's plan of
each strategy, and one training run (private, or the non-private reference). Imported
only when the study runs (it imports torch; transformers only for the BERT task);
everything the study reports comes from :func:`privlearn.torch.make_private` and its
accountant.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privlearn.correlated import per_query_error
from privlearn.datasets import load_mnist
from privlearn.errors import ParameterValueError, PlanMismatchError
from privlearn.torch import make_private, retain_freed_memory
from privlearn.torch.config import DPConfig
from privlearn.torch.privacy_engine import plan_run
from privlearn.torch.schedule import independent

__all__ = ["Split", "MnistSplit", "RunPlan", "RunResult", "mnist_split", "adult_split",
           "plan_strategy", "train_once", "train_nonprivate", "torch_threads"]


@dataclass(frozen=True)
class Split:
    """Inputs (MNIST: pixels in [0, 1], flattened, no data-dependent normalisation;
    Adult: token ids) and labels of the private training, validation and test sets."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


MnistSplit = Split


def _tensors(bunch, rows=None):
    x, y = bunch.data, bunch.target
    if rows is not None:
        x, y = x[rows], y[rows]
    x = torch.from_numpy(x.reshape(len(x), -1).astype(np.float32) / 255.0)
    return x, torch.from_numpy(y.astype(np.int64))


def mnist_split(n_validation: int, seed: int, n_train: int | None = None,
                n_test: int | None = None, data_home=None, download: bool = False
                ) -> Split:
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
    return Split(x_tr, y_tr, x_va, y_va, x_te, y_te)


def adult_split(n_validation: int, seed: int, n_train: int | None = None,
                n_test: int | None = None) -> Split:
    """The 30,162 complete Adult training records as token sequences
    (:mod:`._adult_tokens`), split at random (``seed``) into ``n_validation`` validation
    records and the private training set (the next ``n_train``, default all the rest);
    the first ``n_test`` of the 15,060 complete test records (default all). Label 1:
    income above 50K."""
    from privlearn.datasets import load_adult
    from privlearn.experiments._adult_tokens import adult_vocabulary

    vocab = adult_vocabulary()
    train = load_adult("train", features="raw")
    test = load_adult("test", features="raw")
    order = np.random.default_rng(seed).permutation(len(train.target))
    if n_validation >= len(order):
        raise ParameterValueError(f"n_validation must be below the {len(order)} training "
                                  f"records, got {n_validation}")
    val, rest = order[:n_validation], order[n_validation:]
    tr = rest if n_train is None else rest[:n_train]
    te = slice(None) if n_test is None else slice(0, n_test)

    def pair(bunch, rows):
        return (torch.from_numpy(vocab.encode(bunch.data[rows])),
                torch.from_numpy(bunch.target[rows].astype(np.int64)))

    return Split(*pair(train, tr), *pair(train, val), *pair(test, te))


def mlp(hidden: int) -> nn.Sequential:
    """784-``hidden``-10 ReLU network."""
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class SequenceClassifier(nn.Module):
    """A config-initialised ``transformers.BertForSequenceClassification`` (post-LN
    blocks, ``width // 64`` heads, feed-forward ``4 width``, no dropout; the ``[CLS]``
    token's pooled state classifies) that maps token ids to logits (``model(ids)``, as
    the MLP maps pixels)."""

    def __init__(self, vocab_size: int, length: int, width: int, layers: int,
                 classes: int = 2) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        heads = max(1, width // 64)
        cfg = BertConfig(vocab_size=vocab_size, hidden_size=width, num_hidden_layers=layers,
                         num_attention_heads=heads, intermediate_size=4 * width,
                         max_position_embeddings=length, type_vocab_size=1,
                         num_labels=classes, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, pad_token_id=0)
        self.bert = BertForSequenceClassification(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids).logits


def build_model(task: str, hidden: int, layers: int, vocab_size: int, length: int
                ) -> nn.Module:
    """The study's model of ``task``: the MLP (``"mnist"``) or the BERT classifier of
    width ``hidden`` and ``layers`` blocks (``"adult-bert"``)."""
    if task == "mnist":
        return mlp(hidden)
    return SequenceClassifier(vocab_size, length, hidden, layers)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 2048
              ) -> float:
    model.eval()
    with torch.no_grad():
        right = sum(int((model(x[i:i + chunk]).argmax(dim=1) == y[i:i + chunk]).sum())
                    for i in range(0, len(x), chunk))
    return right / len(x)


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


def _model(seed: int, model: dict) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(**model)


def _optimizer(name: str, net: nn.Module, learning_rate: float) -> torch.optim.Optimizer:
    if name == "adam":  # default betas and eps
        return torch.optim.Adam(net.parameters(), lr=learning_rate)
    return torch.optim.SGD(net.parameters(), lr=learning_rate)


def train_once(split: Split, plan: RunPlan, *, learning_rate: float, epsilon: float,
               delta: float, epochs: int, batch_size: int, max_grad_norm: float,
               model: dict, seed: int, evaluate_on: str, optimizer: str = "sgd"
               ) -> RunResult:
    """Train the study's model (``model``: :func:`build_model`'s keywords) with plain SGD
    (constant learning rate, no momentum: the prefix-sum workload the strategies are
    optimised for) through ``make_private`` on the private training set; the accuracy on
    ``evaluate_on`` ("val" or "test") of the final model and the accountant's epsilon for
    the steps taken."""
    t0 = time.perf_counter()
    net = _model(seed, model)
    opt = _optimizer(optimizer, net, learning_rate)
    loader = DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=batch_size)
    p = make_private(net, opt, loader, target_epsilon=epsilon, target_delta=delta,
                     epochs=epochs, max_grad_norm=max_grad_norm, seed=seed,
                     **plan.run_settings)
    if p.plan.noise_multiplier != plan.noise_multiplier or p.plan.planned_steps != plan.steps:
        raise PlanMismatchError(
            f"the run's plan (sigma {p.plan.noise_multiplier}, {p.plan.planned_steps} steps) "
            f"differs from the strategy's (sigma {plan.noise_multiplier}, {plan.steps} "
            "steps); build the strategy for the run's settings (same epsilon, delta, "
            "batch size and epochs)")
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for xb, yb in p.data_loader:
            p.optimizer.zero_grad(set_to_none=True)
            loss_fn(p.model(xb), yb).backward()
            p.optimizer.step()
    spent = p.epsilon(delta)
    net = p.detach()
    x, y = (split.x_val, split.y_val) if evaluate_on == "val" else (split.x_test, split.y_test)
    return RunResult(_accuracy(net, x, y), float(spent), time.perf_counter() - t0)


def train_nonprivate(split: Split, *, learning_rate: float, epochs: int, batch_size: int,
                     model: dict, seed: int, evaluate_on: str, optimizer: str = "sgd"
                     ) -> RunResult:
    """The non-private reference: the same model, optimizer, batch size and epochs, with
    shuffled fixed-size batches, no clipping and no noise (epsilon = inf)."""
    t0 = time.perf_counter()
    net = _model(seed, model)
    opt = _optimizer(optimizer, net, learning_rate)
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=batch_size,
                        shuffle=True, generator=g)
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            loss_fn(net(xb), yb).backward()
            opt.step()
    x, y = (split.x_val, split.y_val) if evaluate_on == "val" else (split.x_test, split.y_test)
    return RunResult(_accuracy(net, x, y), math.inf, time.perf_counter() - t0)


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
