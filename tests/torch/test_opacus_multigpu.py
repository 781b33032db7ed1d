"""Opacus's multi-GPU tests on 2 CPU processes (gloo): the clippings and the virtual
batches that ``test_ddp.py`` does not run across ranks.

Opacus 1.6 checks that a distributed step equals the single-process one with per-layer
clipping (``multigpu_gradcheck_test.py``) and runs adaptive clipping under DDP
(``multigpu_adaptive_clipping_test.py``); ``BatchMemoryManager`` cuts each rank's batch.
Here each rank trains three noise-free steps with make_private, plain or wrapped in
``DistributedDataParallel``, and after each step the parameters of both ranks equal a
naive single-process step on the union of the ranks' batches (one backward pass per
example, each example's gradient clipped, summed, divided by the expected global batch
size ``q N``):

* per-layer clipping: each parameter's gradient clipped to its own bound;
* virtual batches (``max_physical_batch_size=3``): under Poisson and fixed-size sampling;
* adaptive clipping (Andrew et al. 2021, Algorithm 1), with and without virtual batches:
  the bound after each step is the geometric update from the fraction of the union's
  examples whose norm is within the bound (the count's noise made negligible:
  ``unclipped_num_std=1e-9``), so each rank's count is summed once.

With noise, per-layer clipping's noise has standard deviation ``sigma sqrt(sum_k C_k^2) /
(q N)`` (the sensitivity of the clipped sum), drawn once across the ranks.
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import close_gloo, init_gloo, one_worker, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

# two spawned processes and eight short runs: about 30 s, so slow
pytestmark = [one_worker(__name__), pytest.mark.slow]
WORLD = 2
N = 120
B = 10  # per rank: q = W B / N = 1/6
STEPS = 3
LR = 0.5
C = 0.4
BOUNDS = [0.1, 0.2, 0.3, 0.05]
ETA, GAMMA, C0 = 0.3, 0.5, 0.05  # adaptive clipping: rate, target quantile, first bound
SIGMA = 1.3

#: name -> make_private settings (besides the model, optimizer and loader) and DDP or not
CASES = {
    "per_layer": (dict(clipping="per_layer", max_grad_norm=BOUNDS), False),
    "per_layer_ddp": (dict(clipping="per_layer", max_grad_norm=BOUNDS), True),
    "virtual": (dict(max_grad_norm=C, max_physical_batch_size=3), False),
    "virtual_ddp": (dict(max_grad_norm=C, max_physical_batch_size=3), True),
    "virtual_fixed_ddp": (dict(max_grad_norm=C, max_physical_batch_size=4, sampling="fixed"), True),
    "adaptive": (
        dict(
            max_grad_norm=C0,
            clipping="adaptive",
            target_unclipped_quantile=GAMMA,
            clipbound_learning_rate=ETA,
            unclipped_num_std=1e-9,
        ),
        False,
    ),
    "adaptive_virtual_ddp": (
        dict(
            max_grad_norm=C0,
            clipping="adaptive",
            target_unclipped_quantile=GAMMA,
            clipbound_learning_rate=ETA,
            unclipped_num_std=1e-9,
            max_physical_batch_size=3,
        ),
        True,
    ),
}


def _data():
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (N,), generator=g),
        torch.arange(N),
    )


def _model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _wide_model():
    torch.manual_seed(8)
    return nn.Linear(6, 2000).double()  # 14,000 coordinates for the noise-std estimate


def _train(make, ddp, *, lr=LR, steps=STEPS, noise_multiplier=0.0, **settings):
    """``steps`` logical steps on this rank: the union of the ranks' batches, the
    parameters and the clipping bound after each."""
    from privlearn.torch import make_private

    model = make()
    wrapped = nn.parallel.DistributedDataParallel(model) if ddp else model
    p = make_private(
        wrapped,
        torch.optim.SGD(wrapped.parameters(), lr=lr),
        torch.utils.data.DataLoader(_data(), batch_size=B),
        noise_multiplier=noise_multiplier,
        seed=11,
        **settings,
    )
    out = dict(batches=[], params=[], bounds=[], expected=p.expected_batch_size, chunks=0)
    it, mine = iter(p.data_loader), []
    while len(out["params"]) < steps:
        x, y, idx = next(it)
        mine += idx.tolist()
        out["chunks"] += 1
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        before = p.accountant.steps
        p.optimizer.step()
        if p.accountant.steps > before:  # a logical batch ended: gather the ranks' parts
            parts = [None] * WORLD
            dist.all_gather_object(parts, mine)
            mine = []
            out["batches"].append(sorted(i for part in parts for i in part))
            out["params"].append(
                torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()])
            )
            out["bounds"].append(p.optimizer.max_grad_norm)
    return out


def _worker(rank: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, out_dir)
    try:
        results = {name: _train(_model, ddp, **settings) for name, (settings, ddp) in CASES.items()}
        results["noise_per_layer"] = _train(
            _wide_model,
            True,
            lr=1.0,
            steps=4,
            noise_multiplier=SIGMA,
            clipping="per_layer",
            max_grad_norm=[0.3, 0.4],
        )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_gloo()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("opacus_multigpu"), WORLD)


def _naive(make, batches, expected, oracle, *, lr=LR, bounds=None, adaptive=False):
    """The single-process steps by the definition on the given global batches: the
    parameters after each step and (adaptive) the bound after it."""
    model = make()
    x_all, y_all, _ = _data().tensors
    params = list(model.parameters())
    c = C0 if adaptive else bounds
    out, cs = [], []
    for b in batches:
        idx = torch.tensor(b, dtype=torch.long)
        x, y = x_all[idx], y_all[idx]
        rows = oracle.grads(
            lambda i, x=x, y=y: nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]),
            len(b),
            params,
        )
        if isinstance(c, list):
            total, _ = oracle.clip_and_sum(rows, c, [q.numel() for q in params])
        else:
            total, norms = oracle.clip_and_sum(rows, c)
        oracle.sgd_step(params, total, lr, expected)
        if adaptive:  # Algorithm 1: centred count over the expected batch, geometric step
            unclipped = (float((norms <= c).sum()) - 0.5 * len(b)) / expected + 0.5
            c = c * math.exp(-ETA * (unclipped - GAMMA))
            cs.append(c)
        out.append(oracle.flat(params))
    return out, cs


@pytest.mark.parametrize("name", sorted(CASES))
def test_distributed_step_equals_the_naive_single_process_step(ranks, name, oracle):
    r0, r1 = ranks[0][name], ranks[1][name]
    settings, _ = CASES[name]
    assert r0["batches"] == r1["batches"]
    assert r0["expected"] == pytest.approx(WORLD * B)
    assert all(len(b) > 0 for b in r0["batches"])
    if "max_physical_batch_size" in settings:  # chunks were cut: more calls than steps
        assert r0["chunks"] > STEPS
    if settings.get("sampling") == "fixed":
        assert all(len(b) == WORLD * B for b in r0["batches"])
    adaptive = settings.get("clipping") == "adaptive"
    want, bounds = _naive(
        _model,
        r0["batches"],
        r0["expected"],
        oracle,
        bounds=settings["max_grad_norm"],
        adaptive=adaptive,
    )
    start = oracle.flat(_model().parameters())
    for k in range(STEPS):
        assert not torch.allclose(r0["params"][k], start)  # the step moved the model
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        torch.testing.assert_close(r0["params"][k], want[k], rtol=1e-10, atol=1e-12)
    if adaptive:
        assert r0["bounds"] == r1["bounds"]
        assert r0["bounds"] == pytest.approx(bounds, rel=1e-9)
        assert r0["bounds"][-1] != C0  # the bound moved


def test_distributed_per_layer_noise_is_scaled_to_the_total_bound(ranks, oracle):
    """The update minus the noise-free update on the same global batches, over 4 steps
    of 14,000 coordinates: standard deviation ``sigma sqrt(0.3^2 + 0.4^2) / (q N)``
    within 5% (the estimate's standard error is about 0.3%), the same on both ranks."""
    r0, r1 = ranks[0]["noise_per_layer"], ranks[1]["noise_per_layer"]
    model = _wide_model()
    params = list(model.parameters())
    x_all, y_all, _ = _data().tensors
    noise = []
    for k, b in enumerate(r0["batches"]):
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        idx = torch.tensor(b, dtype=torch.long)
        x, y = x_all[idx], y_all[idx]
        rows = oracle.grads(
            lambda i, x=x, y=y: nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]),
            len(b),
            params,
        )
        total, _ = oracle.clip_and_sum(rows, [0.3, 0.4], [q.numel() for q in params])
        clean = oracle.flat(params) - total / r0["expected"]
        noise.append(clean - r0["params"][k])  # lr 1: the update's noise
        with torch.no_grad():  # continue from the noisy parameters, as the ranks did
            at = 0
            for q in params:
                q.copy_(r0["params"][k][at : at + q.numel()].view_as(q))
                at += q.numel()
    z = torch.cat(noise)
    target = SIGMA * math.hypot(0.3, 0.4) / r0["expected"]
    assert float(z.std()) == pytest.approx(target, rel=0.05)
    assert abs(float(z.mean())) < 7 * target / math.sqrt(z.numel())
