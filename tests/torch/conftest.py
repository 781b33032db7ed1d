"""Shared builders and the one naive ground truth of the engine's tests.

The ground truth of a DP-SGD step is its definition: a loop of batch-of-one forward and
backward passes (one per example), each example's gradient clipped on its own, summed
(Abadi et al. 2016, Algorithm 1, without noise). Tests take it through the ``oracle``
fixture::

    def test_x(oracle, make_mlp, make_data):
        model, (x, y) = make_mlp(), make_data().tensors
        ref, norms = oracle.clipped_sum(model, x, y, max_grad_norm=1.0)

and the small models and data sets through ``make_mlp`` / ``make_data``.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest

try:
    import torch
    from torch import nn
    from toys import toy_data, toy_mlp, trainable
except ImportError:  # the modules here skip themselves without torch
    torch = nn = toy_data = toy_mlp = trainable = None


def batch_of_one_grads(loss_of, n: int, params, *, autocast=None):
    """Per-example gradients ``(n, P)`` in float64 by ``n`` batch-of-one backward passes:
    row ``i`` is the gradient of ``loss_of(i)`` (the loss of example ``i`` alone) over
    ``params``, flattened in their order (zeros for a parameter the loss does not reach).
    With ``autocast`` (a dtype), forward and loss run under ``torch.autocast`` to it."""
    params = list(params)
    device = params[0].device.type
    rows = []
    for i in range(n):
        ctx = (torch.autocast(device, dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        with ctx:
            loss = loss_of(i)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double()
                               for g, p in zip(grads, params, strict=True)]))
    if not rows:
        return torch.zeros(0, sum(p.numel() for p in params), dtype=torch.float64)
    return torch.stack(rows)


def clip_and_sum(rows, max_grad_norm, sizes=None):
    """Each row clipped to norm ``max_grad_norm`` (flat), or, with ``sizes`` (the number
    of columns of each parameter) and one bound per parameter, each parameter's block of
    each row clipped to its own bound (per-layer); summed over rows. Returns the sum and
    the rows' norms (per parameter, ``(n, K)``, when per-layer)."""
    if sizes is None:
        norms = rows.norm(dim=1)
        factors = (max_grad_norm / norms).clamp(max=1.0)
        return (rows * factors[:, None]).sum(0), norms
    blocks = rows.split(list(sizes), dim=1)
    norms = torch.stack([b.norm(dim=1) for b in blocks], dim=1)
    bounds = torch.as_tensor(list(max_grad_norm), dtype=rows.dtype, device=rows.device)
    factors = (bounds / norms).clamp(max=1.0)
    return torch.cat([(b * factors[:, k:k + 1]).sum(0) for k, b in enumerate(blocks)]), norms


def naive_clipped_sum(model, x, y, max_grad_norm, loss_fn=None, *, autocast=None,
                      skip=()):
    """The clipped sum of a batch by the definition: ``batch_of_one_grads`` of
    ``loss_fn(model(x[i:i+1]), y[i:i+1])`` (default cross-entropy) over the trainable
    parameters of a copy of ``model``, then ``clip_and_sum`` (examples in ``skip``
    left out of the sum). Returns the flat float64 sum and the per-example norms."""
    loss_fn = loss_fn or nn.functional.cross_entropy
    model = copy.deepcopy(model)
    rows = batch_of_one_grads(lambda i: loss_fn(model(x[i:i + 1]), y[i:i + 1]), len(y),
                              trainable(model), autocast=autocast)
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[list(skip)] = False
    total, norms = clip_and_sum(rows[keep.to(rows.device)], max_grad_norm)
    return total, rows.norm(dim=1)


def naive_step(model, x, y, max_grad_norm, lr: float, expected_batch: float,
               loss_fn=None) -> None:
    """One noise-free DP-SGD step on ``model`` in place, by the definition: plain SGD
    with the naive clipped sum divided by the expected batch size."""
    total, _ = naive_clipped_sum(model, x, y, max_grad_norm, loss_fn)
    sgd_step(trainable(model), total, lr, expected_batch)


def sgd_step(params, total, lr: float, expected_batch: float) -> None:
    """``p -= lr * total / expected_batch`` for each parameter's block of the flat
    ``total`` (in place, in ``params``' order)."""
    with torch.no_grad():
        at = 0
        for q in params:
            q -= lr * total[at:at + q.numel()].view_as(q).to(q.dtype) / expected_batch
            at += q.numel()


def flat(tensors):
    """Tensors (or parameters' ``.grad``) flattened into one float64 vector."""
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


@pytest.fixture
def oracle():
    """The naive ground truth: ``grads`` (batch-of-one per-example gradients),
    ``clip_and_sum``, ``clipped_sum`` (both, for an ``x, y`` batch), ``step`` (a
    noise-free DP-SGD step by the definition), ``sgd_step`` (its update from a clipped
    sum), ``trainable``, ``flat``."""
    return SimpleNamespace(grads=batch_of_one_grads, clip_and_sum=clip_and_sum,
                           clipped_sum=naive_clipped_sum, step=naive_step,
                           sgd_step=sgd_step, trainable=trainable, flat=flat)


@pytest.fixture
def make_data():
    """The builder :func:`toy_data`."""
    return toy_data


@pytest.fixture
def make_mlp():
    """The builder :func:`toy_mlp`."""
    return toy_mlp


@pytest.fixture(autouse=True, scope="session")
def _frozen_import_heap():
    """The objects alive once the tests are collected (mostly the modules imported: torch,
    transformers) moved out of the garbage collector's reach for the session
    (``gc.freeze``): the Trainer runs ``gc.collect()`` at every ``train()``, which
    otherwise walks them all each time. Objects the tests create are collected as usual."""
    import gc

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
