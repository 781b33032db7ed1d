"""DP-SGD on FSDP2 (``fully_shard``) and DDP models: 2 CPU processes (gloo) against a
naive single-process loop.

(a) Noise off: after k steps the parameters (the shards gathered) equal those of a naive
    loop of batch-of-one backward passes, clipped per example and summed over the union
    of the ranks' batches, divided by the expected global batch q N: an MLP (sampling
    rate 0.1, sharded per layer and at the root), a small GPT-2 (tied embeddings) and a
    small BERT (sampling rate 1, sharded per block and at the root), each under FSDP2
    and under DistributedDataParallel. Every example's norm is that of its whole
    gradient: with C below most norms, a norm computed on one shard would clip
    differently and fail the comparison.
(b) Noise on (FSDP2): the update minus the noise-free update on the same global batch
    has standard deviation sigma C / (q N) over 56,000 coordinates (noise drawn once per
    coordinate: doubled draws would give sqrt(2) times it, too few 1/sqrt(2)); every
    rank reports the same epsilon.
(c) Fixed-size sampling under FSDP2 and per-layer clipping under FSDP2 and DDP equal the
    naive loop (per-layer bounds); adaptive
    clipping moves one bound on every rank; secure mode trains;
    max_physical_batch_size and tensor-parallel placements (FSDP2), correlated noise and
    user-level privacy (both wrappers) are refused before any step;
    a checkpoint taken after step 2 and resumed gives the uninterrupted run's step 3.
"""

from __future__ import annotations

import io
import math

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")  # every test reads the ranks' run, which builds GPT-2 and BERT

pytestmark = one_worker("shared-fsdp")  # one group runs the modules of _ranks.SHARED["shared-fsdp"]
WORLD = 2
N = 240
PER_RANK = 12  # q = 0.1 for the MLP
STEPS = 3
C = 0.5
SIGMA = 1.3
LR = 0.5
TIMEOUT = 900.0  # run_ranks' default
HF_N = 8  # q = 1 for the transformers: W * 4 = 8 examples, all in every batch
HF_C = 0.05



def _mlp_data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 6, generator=g)
    y = torch.randint(0, 3, (N,), generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _wide() -> nn.Module:
    torch.manual_seed(8)
    return nn.Sequential(nn.Linear(6, 2000))  # 14,000 coordinates (odd shards: 1000 rows)


def _hf(name):
    from hf_models import build

    return build(name, dtype=torch.float64, seed=3)


def _hf_data(name):
    from hf_models import make_batch

    inputs, labels = make_batch(name, b=HF_N, seed=4)
    return torch.utils.data.TensorDataset(inputs["input_ids"], inputs["attention_mask"],
                                          labels, torch.arange(HF_N))


def _mlp_loss(model, batch):
    x, y, _ = batch
    return nn.functional.cross_entropy(model(x), y)


def _hf_loss(name):
    from hf_models import loss_of

    def fn(model, batch):
        ids, mask, labels, _ = batch
        return loss_of(name, model(input_ids=ids, attention_mask=mask), labels)

    return fn


def _shard(model, name, mesh):
    from torch.distributed.fsdp import fully_shard

    if name == "mlp":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
    elif name == "gpt2":
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
    elif name == "bert":
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _flat(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach()
                      .reshape(-1).double().clone() for p in model.parameters()])


def _train(name, wrapper, mesh, *, sigma=0.0, seed=11, steps=STEPS, lr=LR, c=None,
           model=None, data=None, loss=None, per_rank=None, checkpoint=None, resume=None,
           **kw):
    """``steps`` private steps on this rank; the global batches (indices) and the full
    parameters after each step."""
    from privlearn.torch import make_private

    model = model if model is not None else (_mlp() if name == "mlp" else _hf(name))
    data = data if data is not None else (_mlp_data() if name == "mlp" else _hf_data(name))
    loss = loss if loss is not None else (_mlp_loss if name == "mlp" else _hf_loss(name))
    per_rank = per_rank or (PER_RANK if name == "mlp" else HF_N // WORLD)
    c = c if c is not None else (C if name == "mlp" else HF_C)
    if wrapper == "fsdp":
        model = _shard(model, name, mesh)
    elif wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    p = make_private(model, opt, torch.utils.data.DataLoader(data, batch_size=per_rank),
                     noise_multiplier=sigma, max_grad_norm=c, seed=seed, **kw)
    inner = p.model.module if wrapper == "ddp" else p.model
    out = dict(batches=[], params=[], expected=p.expected_batch_size, rate=p.sampling_rate)
    if resume is not None:
        p.load_state_dict(torch.load(io.BytesIO(resume), weights_only=False))
    it = iter(p.data_loader)
    for k in range(steps):
        batch = next(it, None)
        if batch is None:  # a new epoch
            it = iter(p.data_loader)
            batch = next(it)
        p.optimizer.zero_grad()
        loss(p.model, tuple(batch)).backward()
        p.optimizer.step()
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, batch[-1].tolist())
        out["batches"].append(sorted(i for part in gathered for i in part))
        out["params"].append(_flat(inner))
        out.setdefault("bounds", []).append(p.max_grad_norm)
        if checkpoint is not None and k + 1 == checkpoint:
            buf = io.BytesIO()  # as saved to disk (the state holds live tensors)
            torch.save(p.state_dict(), buf)
            out["state"] = buf.getvalue()
    eps = [None] * WORLD
    dist.all_gather_object(eps, p.epsilon(1e-5) if sigma > 0 else None)
    out["epsilons"] = eps
    return out


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's run on ``rank`` of the shared group (``_ranks.SHARED``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    res = {}
    for name in ("mlp", "gpt2", "bert"):
        for wrapper in ("fsdp", "ddp"):
            res[name, wrapper] = _train(name, wrapper, mesh)
    res["fixed"] = _train("mlp", "fsdp", mesh, seed=None, sampling="fixed")
    res["noise"] = _train("mlp", "fsdp", mesh, sigma=SIGMA, seed=None, lr=1.0, steps=4,
                          model=_wide(), loss=lambda m, b: m(b[0]).pow(2).mean())
    names = [n for n, _ in _mlp().named_parameters()]
    bounds = dict(zip(names, (0.3, 0.1, 0.2, 0.05), strict=True))
    res["per_layer"] = {w: _train("mlp", w, mesh, c=bounds, clipping="per_layer")
                        for w in ("fsdp", "ddp")}
    res["secure"] = _train("mlp", "fsdp", mesh, sigma=1.0, seed=None, steps=2,
                           secure_mode=True)
    res["adaptive"] = _train("mlp", "fsdp", mesh, sigma=1.0, seed=5, clipping="adaptive",
                             target_unclipped_quantile=0.5, c=1.0)
    full = _train("mlp", "fsdp", mesh, sigma=1.0, seed=21, checkpoint=2)
    resumed = _train("mlp", "fsdp", mesh, sigma=1.0, seed=21, steps=1,
                     resume=full.pop("state"))
    res["resume"] = (full, resumed)
    refusals = {}
    from privlearn.torch import make_private

    for wrapper in ("fsdp", "ddp"):  # one-process mechanisms, refused under both
        for what, kw in (("correlated", dict(noise="banded", sampling="cyclic_poisson",
                                             steps=10)),
                         ("users", dict(users=list(range(N // 2)) * 2))):
            m = _mlp()
            m = _shard(m, "mlp", mesh) if wrapper == "fsdp" else \
                nn.parallel.DistributedDataParallel(m)
            try:
                make_private(m, torch.optim.SGD(m.parameters(), lr=0.1),
                             torch.utils.data.DataLoader(_mlp_data(), batch_size=PER_RANK),
                             noise_multiplier=1.0, max_grad_norm=1.0, **kw)
                refusals[what, wrapper] = None
            except ValueError as e:
                refusals[what, wrapper] = str(e)
    for what in ("max_physical_batch_size", "tensor_parallel", "stale_optimizer"):
        m = _mlp()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        if what == "stale_optimizer":  # built before fully_shard: it would update nothing
            m = _shard(m, "mlp", mesh)
            kw = {}
        elif what == "tensor_parallel":
            from torch.distributed.tensor import Replicate, distribute_tensor

            with torch.no_grad():
                m[0].weight = nn.Parameter(distribute_tensor(m[0].weight, mesh,
                                                             [Replicate()]))
            kw = {}
        else:
            m = _shard(m, "mlp", mesh)
            kw = {"max_physical_batch_size": 4}
        if what != "stale_optimizer":
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
        try:
            make_private(m, opt,
                         torch.utils.data.DataLoader(_mlp_data(), batch_size=PER_RANK),
                         noise_multiplier=1.0, max_grad_norm=1.0, **kw)
            refusals[what] = None
        except ValueError as e:
            refusals[what] = str(e)
    res["refusals"] = refusals
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def _naive(oracle, name, batches, expected, *, lr=LR, c=None, bounds=None, model=None,
           data=None, loss=None):
    """Naive noise-free DP-SGD (the batch-of-one loop of ``oracle``): each example's
    gradient clipped (flat, or per parameter with ``bounds``), summed, divided by the
    expected batch size; the parameters after each batch."""
    model = model if model is not None else (_mlp() if name == "mlp" else _hf(name))
    data = data if data is not None else (_mlp_data() if name == "mlp" else _hf_data(name))
    loss = loss if loss is not None else (_mlp_loss if name == "mlp" else _hf_loss(name))
    c = c if c is not None else (C if name == "mlp" else HF_C)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    sizes = None if bounds is None else [p.numel() for p in params]
    out = []
    for b in batches:
        rows = oracle.grads(lambda j, idx=list(b): loss(model, tuple(
            t[idx[j]:idx[j] + 1] for t in data.tensors)), len(b), params)
        total, _ = oracle.clip_and_sum(rows, c if bounds is None else
                                       [bounds[n] for n, _ in named], sizes)
        with torch.no_grad():
            at = 0
            for p in params:
                p -= (lr * total[at:at + p.numel()].view_as(p) / expected).to(p.dtype)
                at += p.numel()
        out.append(torch.cat([p.detach().reshape(-1).double().clone() for p in params]))
    return out


def _initial(name) -> torch.Tensor:
    model = _mlp() if name == "mlp" else _hf(name)
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
@pytest.mark.parametrize("name", ["mlp", "gpt2", "bert"])
def test_noise_free_sharded_step_equals_naive_loop(ranks, name, wrapper, oracle):
    r0, r1 = ranks[0][name, wrapper], ranks[1][name, wrapper]
    assert r0["batches"] == r1["batches"]
    per_rank = PER_RANK if name == "mlp" else HF_N // WORLD
    n = N if name == "mlp" else HF_N
    assert r0["rate"] == pytest.approx(WORLD * per_rank / n)
    assert r0["expected"] == pytest.approx(WORLD * per_rank)
    if name != "mlp":  # sampling rate 1: every example in every step
        assert r0["batches"] == [list(range(HF_N))] * STEPS
    naive = _naive(oracle, name, r0["batches"], r0["expected"])
    start = _initial(name)
    tol = dict(rtol=1e-5, atol=1e-6) if name == "mlp" else dict(rtol=1e-9, atol=1e-11)
    for k in range(STEPS):
        assert (r0["params"][k] - start).abs().max() > 1e-4  # the step moved them
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        torch.testing.assert_close(r0["params"][k], naive[k], **tol)


def test_fixed_size_sampling_under_fsdp_equals_naive_loop(ranks, oracle):
    r0 = ranks[0]["fixed"]
    assert r0["batches"] == ranks[1]["fixed"]["batches"]
    assert all(len(set(b)) == len(b) == WORLD * PER_RANK for b in r0["batches"])
    naive = _naive(oracle, "mlp", r0["batches"], r0["expected"])
    for k in range(STEPS):
        torch.testing.assert_close(r0["params"][k], naive[k], rtol=1e-5, atol=1e-6)


def test_sharded_noise_is_drawn_once_per_coordinate(ranks, oracle):
    r0, r1 = ranks[0]["noise"], ranks[1]["noise"]
    expected = r0["expected"]
    data = _mlp_data()
    loss = lambda m, b: m(b[0]).pow(2).mean()  # noqa: E731
    ref = _wide()
    residuals = []
    prev = _initial_of(ref)
    for k, b in enumerate(r0["batches"]):
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        _load(ref, prev)
        clean = _naive(oracle, "mlp", [b], expected, lr=1.0, model=ref, data=data, loss=loss)[0]
        residuals.append(r0["params"][k] - clean)  # = -lr * noise / (q N), lr = 1
        prev = r0["params"][k]
    noise = torch.cat(residuals)
    target = SIGMA * C / expected
    # 56,000 coordinates: the std estimate's relative standard error is ~0.3%; the run draws
    # its noise from fresh OS entropy (seed=None), so the mean's bound is 7 standard errors
    # (a false alarm in 2.6e-12 of the runs, 5 would be 5.7e-7)
    assert abs(float(noise.mean())) < 7 * target / math.sqrt(noise.numel())
    assert float(noise.std()) == pytest.approx(target, rel=0.03)
    # the accounting is global and identical on the ranks
    assert r0["rate"] == pytest.approx(WORLD * PER_RANK / N)
    assert r0["epsilons"][0] == r0["epsilons"][1] == r1["epsilons"][0]
    assert math.isfinite(r0["epsilons"][0]) and r0["epsilons"][0] > 0


def _initial_of(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().clone() for p in model.parameters()])


def _load(model, flat) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(),
                        torch.split(flat, [p.numel() for p in model.parameters()]),
                        strict=True):
            p.copy_(v.view_as(p))


def test_per_layer_clipping_under_fsdp_equals_naive_loop(ranks, oracle):
    f0, d0 = ranks[0]["per_layer"]["fsdp"], ranks[0]["per_layer"]["ddp"]
    assert f0["batches"] == d0["batches"]
    names = [n for n, _ in _mlp().named_parameters()]
    bounds = dict(zip(names, (0.3, 0.1, 0.2, 0.05), strict=True))
    expected = f0["expected"]
    naive = _naive(oracle, "mlp", f0["batches"], expected, bounds=bounds)
    for k in range(STEPS):
        torch.testing.assert_close(f0["params"][k], naive[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d0["params"][k], naive[k], rtol=1e-5, atol=1e-6)


def test_secure_mode_and_resume_under_fsdp(ranks):
    s0, s1 = ranks[0]["secure"], ranks[1]["secure"]
    torch.testing.assert_close(s0["params"][-1], s1["params"][-1], rtol=0, atol=0)
    assert bool(torch.isfinite(s0["params"][-1]).all())
    assert not torch.allclose(s0["params"][-1], _initial("mlp"))
    for r in ranks:
        full, resumed = r["resume"]
        assert resumed["batches"][0] == full["batches"][2]
        torch.testing.assert_close(resumed["params"][0], full["params"][2], rtol=0, atol=0)
        assert resumed["epsilons"] == full["epsilons"]


def test_adaptive_clipping_under_fsdp_moves_one_bound_on_every_rank(ranks):
    a0, a1 = ranks[0]["adaptive"], ranks[1]["adaptive"]
    assert a0["bounds"] == a1["bounds"]  # the noisy count is all-reduced: one bound
    assert len(set(a0["bounds"])) == STEPS and a0["bounds"][0] != 1.0
    torch.testing.assert_close(a0["params"][-1], a1["params"][-1], rtol=0, atol=0)


def test_unsupported_sharded_settings_are_refused_up_front(ranks):
    for r in ranks:
        msg = r["refusals"]
        assert msg["max_physical_batch_size"] is not None
        assert "max_physical_batch_size" in msg["max_physical_batch_size"]
        assert msg["tensor_parallel"] is not None
        assert "tensor parallelism" in msg["tensor_parallel"]
        assert "after fully_shard" in (msg["stale_optimizer"] or "")
        for wrapper in ("fsdp", "ddp"):
            assert "one process" in (msg["correlated", wrapper] or "")
            assert "one process" in (msg["users", wrapper] or "")
