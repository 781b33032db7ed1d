"""DP-SGD under torch.distributed: 2 CPU processes (gloo) against the single-process step.

(a) Noise off: after k steps, every rank's parameters equal (i) a naive single-process
    DP-SGD step (per-example backward passes, clip, sum, divide by the expected global
    batch q N) on the union of the ranks' batches, and (ii) privlearn's own
    single-process engine fed the same union batches. Run with the model plain and
    wrapped in ``DistributedDataParallel``.
(b) Noise on: the noise of the aggregated gradient (update minus the noise-free update
    on the same batches) has standard deviation sigma C / (q N) over ~10^4 coordinates,
    is identical on both ranks, and is not duplicated across ranks (same-seeded noise on
    the two ranks would give sqrt(2) times the right std); also in secure mode under DDP
    (each rank's CSPRNG noise, its 1 / sqrt(W) share, summed once).
(c) Fixed-size sampling: the ranks' batches have exactly B distinct indices each, are
    disjoint, and the noise-free step on their union equals the single-process step.
(d) Sampling: the ranks' Poisson batches are disjoint and the global batch size has
    mean q N (each example included with probability q, as in the single process).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
N = 240
PER_RANK_BATCH = 12  # global expected batch W * B = 24, q = 0.1
STEPS = 3
C = 0.5  # small enough that most examples are clipped
SIGMA = 1.3
LR = 0.5
TIMEOUT = 900.0  # run_ranks' default



def _data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 6, generator=g)
    y = torch.randint(0, 3, (N,), generator=g)
    idx = torch.arange(N)
    return torch.utils.data.TensorDataset(x, y, idx)


def _model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _wide_model() -> nn.Module:
    torch.manual_seed(8)
    return nn.Linear(6, 2000)  # 14,000 coordinates for the noise-std estimate


def _run_private(model, rank, *, noise_multiplier, seed, ddp, lr=LR, steps=STEPS,
                 sampling="poisson", secure_mode=False):
    """Train ``steps`` steps with make_private on this rank; return the global batches'
    index sets (gathered over ranks) and the parameter vector after each step."""
    from privlearn.torch import make_private

    ds = _data()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(ds, batch_size=PER_RANK_BATCH)
    p = make_private(
        model, opt, loader, noise_multiplier=noise_multiplier, max_grad_norm=C, seed=seed,
        sampling=sampling, secure_mode=secure_mode,
    )
    loss_fn = nn.CrossEntropyLoss()
    batches, local_batches, params = [], [], []
    inner = p.model.module if ddp else p.model
    autograd_grads = False  # did autograd (or DDP) produce parameter gradients itself?
    it = iter(p.data_loader)
    for _ in range(steps):
        x, y, idx = next(it)
        p.optimizer.zero_grad()
        loss_fn(p.model(x), y).backward()
        autograd_grads |= any(q.grad is not None for q in inner.parameters())
        p.optimizer.step()
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, idx.tolist())
        local_batches.append(gathered)
        batches.append(sorted(i for part in gathered for i in part))
        params.append(torch.cat([q.detach().reshape(-1).clone() for q in inner.parameters()]))
    return dict(
        batches=batches,
        local=local_batches,
        params=params,
        expected=p.expected_batch_size,
        rate=p.sampling_rate,
        noise_multiplier=p.noise_multiplier,
        autograd_grads=autograd_grads,
    )


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's run on ``rank`` of the shared group (``_ranks.SHARED``)."""
    results = {}
    for ddp in (False, True):
        results[f"exact_ddp={ddp}"] = _run_private(
            _model(), rank, noise_multiplier=0.0, seed=11, ddp=ddp
        )
    # fixed-size sampling, seed drawn on rank 0 and broadcast
    results["fixed"] = _run_private(
        _model(), rank, noise_multiplier=0.0, seed=None, ddp=True, sampling="fixed"
    )
    results["noise"] = _run_private(
        _wide_model(), rank, noise_multiplier=SIGMA, seed=None, ddp=False, lr=1.0, steps=4
    )
    # secure mode: each rank's CSPRNG noise (OS entropy, no seed), DDP-wrapped
    results["secure"] = _run_private(
        _wide_model(), rank, noise_multiplier=SIGMA, seed=None, ddp=True, lr=1.0, steps=4,
        secure_mode=True,
    )
    # sampling statistics: many draws of the per-rank Poisson samplers, no training
    from privlearn.torch import make_private

    m = _model()
    p = make_private(
        m,
        torch.optim.SGD(m.parameters(), lr=0.1),
        torch.utils.data.DataLoader(_data(), batch_size=PER_RANK_BATCH),
        noise_multiplier=1.0,
        max_grad_norm=C,
        seed=5,
    )
    draws = []
    for _ in range(20):
        for batch in p.data_loader.batch_sampler:
            draws.append(list(batch))
    results["draws"] = draws
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def _single_process_references(batches, expected, oracle):
    """Naive and engine single-process runs on the given global batches (noise off)."""
    from privlearn.torch import make_private

    x_all, y_all, _ = _data().tensors
    naive = _model()
    engine_model = _model()
    loader = torch.utils.data.DataLoader(_data(), batch_size=WORLD * PER_RANK_BATCH)
    p = make_private(
        engine_model,
        torch.optim.SGD(engine_model.parameters(), lr=LR),
        loader,
        noise_multiplier=0.0,
        max_grad_norm=C,
    )
    assert p.expected_batch_size == pytest.approx(expected)
    p.optimizer._sampler = None  # replays the given batches (no sampler check)
    loss_fn = nn.CrossEntropyLoss()
    naive_params, engine_params = [], []
    for b in batches:
        idx = torch.tensor(b, dtype=torch.long)
        oracle.step(naive, x_all[idx], y_all[idx], C, LR, expected)
        naive_params.append(torch.cat([q.detach().reshape(-1).clone() for q in naive.parameters()]))
        p.optimizer.zero_grad()
        loss_fn(p.model(x_all[idx]), y_all[idx]).backward()
        p.optimizer.step()
        engine_params.append(
            torch.cat([q.detach().reshape(-1).clone() for q in engine_model.parameters()])
        )
    return naive_params, engine_params


@pytest.mark.parametrize("ddp", [False, True], ids=["plain", "DistributedDataParallel"])
def test_noise_free_distributed_step_equals_single_process(ranks, ddp, oracle):
    key = f"exact_ddp={ddp}"
    r0, r1 = ranks[0][key], ranks[1][key]
    assert r0["batches"] == r1["batches"]
    assert r0["expected"] == pytest.approx(WORLD * PER_RANK_BATCH)
    assert r0["rate"] == pytest.approx(WORLD * PER_RANK_BATCH / N)
    assert all(len(b) > 0 for b in r0["batches"])
    # no wasted work: neither autograd nor DDP computed or reduced the weight gradients
    assert not r0["autograd_grads"] and not r1["autograd_grads"]
    naive, engine = _single_process_references(r0["batches"], r0["expected"], oracle)
    start = torch.cat([q.detach().reshape(-1) for q in _model().parameters()])
    for k in range(STEPS):
        # the step moved the parameters (so equality is not vacuous) ...
        assert not torch.allclose(r0["params"][k], start)
        # ... identically on both ranks, and as the single-process mechanism would
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=1e-6)
        torch.testing.assert_close(r0["params"][k], naive[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r0["params"][k], engine[k], rtol=1e-5, atol=1e-6)


def test_fixed_size_sampling_across_ranks(ranks, oracle):
    r0, r1 = ranks[0]["fixed"], ranks[1]["fixed"]
    assert r0["batches"] == r1["batches"]
    assert r0["rate"] == pytest.approx(WORLD * PER_RANK_BATCH / N)
    for (b0, b1), union in zip(r0["local"], r0["batches"], strict=True):
        assert len(b0) == len(b1) == PER_RANK_BATCH
        assert len(set(b0) | set(b1)) == WORLD * PER_RANK_BATCH == len(union)
    # the steps draw different global samples (the shared seed is not a constant)
    assert len({tuple(b) for b in r0["batches"]}) == STEPS
    naive, _ = _single_process_references(r0["batches"], r0["expected"], oracle)
    for k in range(STEPS):
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=1e-6)
        torch.testing.assert_close(r0["params"][k], naive[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", ["noise", "secure"], ids=["seeded", "secure_mode"])
def test_distributed_noise_std_matches_single_process_mechanism(ranks, oracle, key):
    r0, r1 = ranks[0][key], ranks[1][key]
    assert r0["noise_multiplier"] == SIGMA
    expected = r0["expected"]
    x_all, y_all, _ = _data().tensors
    ref = _wide_model()
    prev = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
    residuals = []
    for k, b in enumerate(r0["batches"]):
        # both ranks hold the same (all-reduced) noisy update
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=1e-6)
        # noise-free update on the same global batch from the same starting point
        with torch.no_grad():
            for q, v in zip(
                ref.parameters(),
                torch.split(prev, [q.numel() for q in ref.parameters()]),
                strict=True,
            ):
                q.copy_(v.view_as(q))
        idx = torch.tensor(b, dtype=torch.long)
        oracle.step(ref, x_all[idx], y_all[idx], C, 1.0, expected)
        clean = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
        residuals.append(r0["params"][k] - clean)  # = -lr * noise, lr = 1
        prev = r0["params"][k]
    noise = torch.cat(residuals).double()
    target = SIGMA * C / expected
    # 56,000 coordinates: the std estimate's relative standard error is ~0.3%; the run draws
    # its noise from fresh OS entropy (seed=None), so the mean's bound is 7 standard errors
    # (a false alarm in 2.6e-12 of the runs, 5 would be 5.7e-7)
    assert abs(float(noise.mean())) < 7 * target / math.sqrt(noise.numel())
    assert float(noise.std()) == pytest.approx(target, rel=0.05)


def test_ranks_sample_disjoint_poisson_shards(ranks):
    d0, d1 = ranks[0]["draws"], ranks[1]["draws"]
    assert len(d0) == len(d1) > 100
    q = WORLD * PER_RANK_BATCH / N
    sizes = []
    for b0, b1 in zip(d0, d1, strict=True):
        assert not set(b0) & set(b1)
        sizes.append(len(b0) + len(b1))
    mean = sum(sizes) / len(sizes)
    # global batch size ~ Binomial(N, q): mean q N = 24, sd of the mean ~ 4.6/sqrt(#draws)
    sd = math.sqrt(N * q * (1 - q) / len(sizes))
    assert abs(mean - q * N) < 5 * sd
    # every example is reachable from exactly one rank and is drawn at rate ~ q
    counts = torch.zeros(N)
    for b in d0 + d1:
        counts[torch.tensor(b, dtype=torch.long)] += 1
    rate = counts / len(d0)
    assert float(rate.mean()) == pytest.approx(q, rel=0.1)
    # P(some example never drawn in 200 draws) <= N (1 - q)^200 < 1e-6
    assert int((counts == 0).sum()) == 0
