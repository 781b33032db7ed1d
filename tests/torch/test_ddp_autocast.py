"""DP-SGD under DistributedDataParallel with bfloat16 autocast: 2 CPU processes (gloo).

Each rank runs its forward and loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``
(float32 parameters; the layers record bfloat16 activations and output gradients), the
noise off and the clipping bound below most per-example norms. After every step both
ranks hold the same parameters, equal (to bfloat16's precision) to a naive
single-process loop: batch-of-one backward passes under the same autocast over the
union of the ranks' batches, each example's gradient clipped, summed and divided by the
expected global batch ``q N``. With noise on, the update minus that noise-free update has
the standard deviation ``sigma C / (q N)`` of one global draw (each rank adding the whole
noise would give ``sqrt(2)`` times it, bfloat16 noise a coarser one); both ranks report
the epsilon of the global sampling rate.

With float16 autocast and a ``GradScaler``, an example whose loss-scaled gradient
overflows on rank 1 only is left out there, and both ranks take every step alike.
"""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
N = 32
PER_RANK = 4  # q = 8 / 32
STEPS = 3
C = 0.3
LR = 0.5
SIGMA = 1.2
TIMEOUT = 120.0  # a hang fails fast


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g), torch.arange(N)
    )


def _mlp() -> nn.Module:
    torch.manual_seed(9)
    return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 3))


def _flat(model) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1).double().clone() for q in model.parameters()])


def _run(sigma: float, seed) -> dict:
    from privlearn.torch import make_private

    model = nn.parallel.DistributedDataParallel(_mlp())
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        torch.utils.data.DataLoader(_data(), batch_size=PER_RANK),
        noise_multiplier=sigma,
        max_grad_norm=C,
        seed=seed,
    )
    out = dict(batches=[], params=[], expected=p.expected_batch_size, rate=p.sampling_rate)
    it = iter(p.data_loader)
    for _ in range(STEPS):
        x, y, idx = next(it)
        p.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(p.model(x), y)
        loss.backward()
        p.optimizer.step()
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, idx.tolist())
        out["batches"].append(sorted(i for part in gathered for i in part))
        out["params"].append(_flat(p.model.module))
    eps = [None] * WORLD
    dist.all_gather_object(eps, p.epsilon(1e-5) if sigma > 0 else None)
    out["epsilons"] = eps
    return out


def _scaled(rank: int) -> dict:
    """fp16 autocast and a ``GradScaler`` under DDP; at the second step one example of
    rank 1's batch is huge, so its loss-scaled gradient overflows on rank 1 alone."""
    from privlearn.errors import GradientOverflowWarning
    from privlearn.torch import make_private

    model = nn.parallel.DistributedDataParallel(_mlp())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                     torch.utils.data.DataLoader(_data(), batch_size=PER_RANK),
                     noise_multiplier=SIGMA, max_grad_norm=C, seed=11, grad_scaler=scaler)
    out = dict(params=[], steps=[], scales=[], overflows=[], warned=[], sizes=[])
    it = iter(p.data_loader)
    for k in range(STEPS):
        x, y, _ = next(it)
        if k == 1 and rank == 1:
            x = x.clone()
            x[0] = 1e30
        p.optimizer.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(p.model(x), y)
            scaler.scale(loss).backward()
            scaler.step(p.optimizer)
            scaler.update()
        out["sizes"].append(len(x))
        out["warned"].append(any(issubclass(w.category, GradientOverflowWarning)
                                 for w in caught))
        out["overflows"].append(p.optimizer.last_overflow_count)
        out["steps"].append(p.accountant.steps)
        out["scales"].append(float(scaler.get_scale()))
        out["params"].append(_flat(p.model.module))
    return out


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's runs on ``rank`` of the shared group (``_ranks.SHARED``)."""
    warnings.simplefilter("ignore")
    return {"clean": _run(0.0, 11), "noisy": _run(SIGMA, None), "scaled": _scaled(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def _naive_step(oracle, model, batch, expected) -> torch.Tensor:
    """One noise-free DP-SGD step of ``model`` on ``batch`` by the definition, under
    bfloat16 autocast; the parameters after it."""
    x, y, _ = _data().tensors
    params = list(model.parameters())
    rows = oracle.grads(
        lambda j: nn.functional.cross_entropy(
            model(x[batch[j] : batch[j] + 1]), y[batch[j] : batch[j] + 1]
        ),
        len(batch),
        params,
        autocast=torch.bfloat16,
    )
    total, norms = oracle.clip_and_sum(rows, C)
    assert float((norms > C).float().mean()) > 0.5  # the bound clips most examples
    with torch.no_grad():
        at = 0
        for q in params:
            q -= (LR * total[at : at + q.numel()].view_as(q) / expected).to(q.dtype)
            at += q.numel()
    return _flat(model)


def _load(model, flat) -> None:
    with torch.no_grad():
        for q, v in zip(
            model.parameters(),
            torch.split(flat, [q.numel() for q in model.parameters()]),
            strict=True,
        ):
            q.copy_(v.view_as(q))


def test_bf16_autocast_under_ddp_equals_the_naive_loop(ranks, oracle):
    r0, r1 = ranks[0]["clean"], ranks[1]["clean"]
    assert r0["batches"] == r1["batches"]
    assert r0["expected"] == pytest.approx(WORLD * PER_RANK)
    model, prev = _mlp(), _flat(_mlp())
    for k in range(STEPS):
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        _load(model, prev)  # each step from the run's own parameters (no drift)
        naive = _naive_step(oracle, model, r0["batches"][k], r0["expected"])
        step = r0["params"][k] - prev
        assert float(step.abs().max()) > 1e-3  # the step moved them
        # bfloat16 keeps 8 bits: the update agrees to within 1% of its size (0.24% seen)
        assert float((step - (naive - prev)).norm()) < 0.01 * float(step.norm())
        prev = r0["params"][k]


def test_bf16_autocast_under_ddp_adds_the_noise_once(ranks, oracle):
    r0, r1 = ranks[0]["noisy"], ranks[1]["noisy"]
    assert r0["rate"] == pytest.approx(WORLD * PER_RANK / N)
    model, prev = _mlp(), _flat(_mlp())
    residuals = []
    for k in range(STEPS):
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        _load(model, prev)
        clean = _naive_step(oracle, model, r0["batches"][k], r0["expected"])
        residuals.append((r0["params"][k] - clean) / LR)  # = -noise / (q N)
        prev = r0["params"][k]
    noise = torch.cat(residuals)  # 3 x 643 coordinates: the std to about 2%
    target = SIGMA * C / r0["expected"]
    assert float(noise.std()) == pytest.approx(target, rel=0.1)
    assert abs(float(noise.mean())) < 6 * target / math.sqrt(noise.numel())
    assert r0["epsilons"][0] == r0["epsilons"][1] == r1["epsilons"][0]
    assert math.isfinite(r0["epsilons"][0]) and r0["epsilons"][0] > 0


def test_an_overflow_on_one_rank_under_a_grad_scaler_steps_every_rank_alike(ranks):
    """The overflowing example is left out on rank 1 (counted, warned there only); the
    scaler's skip decision reads the all-reduced noisy gradient, the same on every rank,
    so both ranks take every step, account it and keep the same parameters and scale
    (a decision from rank 1's own overflow would skip its update alone)."""
    r0, r1 = ranks[0]["scaled"], ranks[1]["scaled"]
    assert r1["sizes"][1] > 0  # rank 1's second batch holds the planted example
    assert r1["overflows"] == [0, 1, 0] and r1["warned"] == [False, True, False]
    assert r0["overflows"] == [0, 0, 0] and not any(r0["warned"])
    for r in (r0, r1):
        assert r["steps"] == [1, 2, 3]
        assert r["scales"] == [2.0**16] * STEPS  # no step skipped, the scale kept
    prev = _flat(_mlp())
    for k in range(STEPS):
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        assert float((r0["params"][k] - prev).abs().max()) > 1e-4  # the update was taken
        assert bool(torch.isfinite(r0["params"][k]).all())
        prev = r0["params"][k]
