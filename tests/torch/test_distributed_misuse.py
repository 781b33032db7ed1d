"""make_private under torch.distributed (2 gloo processes) with the ways users wrap,
shard and feed a model, against a naive single-process loop (noise off: batch-of-one
backward passes over the union of the ranks' batches, clipped, summed, divided by the
expected global batch q N).

(a) Equal to the naive loop on both ranks: DDP with ``find_unused_parameters=True`` and
    a branch only rank 1's examples take, and that branch under FSDP2 (its head in the
    root's group: no all-gather of its own that rank 0 would skip); DDP with
    ``gradient_as_bucket_view=True``; a model wrapped in DDP after make_private; the
    loop run inside ``no_sync()``; non-reentrant activation checkpointing under DDP; FSDP2
    with
    ``reshard_after_forward=False`` and with a CPU offload policy; FSDP2 with a layer's
    weight frozen on every rank (neither trained nor counted in the per-example norms);
    FSDP2 with a bf16
    ``MixedPrecisionPolicy`` (to bf16's precision), whose clipping is nonetheless exact:
    one example with a huge gradient among zero inputs moves the parameters by exactly
    C / (q N) (the closed form of clipping it), not by C times a bf16 rounding error; a
    plain model whose initial weights differ on rank 1 (no common seed), which starts
    from rank 0's on both ranks, with a warning, as under DDP (each rank applying the
    update to its own weights would train two models).
    FSDP2 with trainable layers of two dtypes (as a bf16 model keeping some modules in
    float32): each parameter's rows are reduce-scattered and noised in its own dtype,
    equal to the naive loop with the noise off and, with it on, one draw per coordinate
    at the accounted std in each dtype (before, every step failed with a bare
    RuntimeError: the rows of every parameter were exchanged in the first one's dtype).
(b) Refused before any step, on both ranks alike: DDP with ``static_graph=True`` (its
    first backward would fail inside DDP's reducer); each rank given its own shard of the
    data (a ``TensorDataset`` of its rows, or a ``Subset``), which would leave half of
    each shard unsampled and account the shard's size as the dataset's; a
    ``DistributedSampler``; a parameter frozen on one rank only; the legacy
    ``FullyShardedDataParallel`` (FSDP1: flat parameters no layer owns, or each rank's
    slice of them) with either ``use_orig_params``; ``fully_shard`` applied after
    make_private (at the first step: the optimizer holds the replaced tensors, so every
    step would be accounted and none would train); gradient accumulation
    over two backward passes; a checkpoint of the two-rank run resumed in one process;
    rank 0's checkpoint loaded on both ranks (rank 1 refuses it, and rank 0 with it).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _ranks import one_worker, shared_ranks, step_and_record  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-fsdp")  # one group runs the modules of _ranks.SHARED["shared-fsdp"]
WORLD = 2
TIMEOUT = 900.0  # run_ranks' default
N = 40
B = 5  # per rank: q = W B / N = 0.25
C = 0.5  # below most per-example norms
LR = 0.5
STEPS = 2


class _TwoHeads(nn.Module):
    """A trunk and two heads; the second only for the examples that ask for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.trunk, self.h1, self.h2 = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x, use_b=False):
        t = torch.tanh(self.trunk(x))
        return self.h1(t) + self.h2(t) if use_b else self.h1(t)


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(lambda z: torch.tanh(self.a(z)), x, use_reentrant=False))


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(torch.randn(N, 6, generator=g),
                                          torch.randint(0, 3, (N,), generator=g),
                                          torch.arange(N))


def _flat(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach()
                      .reshape(-1).double().clone() for p in model.parameters()])


def _fsdp(mesh, **kw) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _setup(case, rank, mesh):
    """(model given to make_private, its dataset, loader keywords)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    ddp = nn.parallel.DistributedDataParallel
    ds, loader_kw = _data(), {}
    if case == "unused_branch":
        model = ddp(_TwoHeads(), find_unused_parameters=True)
    elif case == "fsdp_unused_branch":  # the second head in the root's group
        from torch.distributed.fsdp import fully_shard

        model = _TwoHeads()
        for layer in (model.trunk, model.h1, model):
            fully_shard(layer, mesh=mesh)
    elif case == "bucket_view":
        model = ddp(_mlp(), gradient_as_bucket_view=True)
    elif case in ("no_sync", "accumulate", "frozen_one_rank", "static_graph"):
        model = ddp(_mlp(), static_graph=case == "static_graph")
        if case == "frozen_one_rank" and rank == 1:
            model.module[0].bias.requires_grad_(False)
    elif case == "checkpointed":
        model = ddp(_Checkpointed())
    elif case == "fsdp_no_reshard":
        model = _fsdp(mesh, reshard_after_forward=False)
    elif case == "fsdp_offload":
        model = _fsdp(mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    elif case == "fsdp_bf16":
        model = _fsdp(mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32))
    elif case == "fsdp_frozen":  # the first layer's weight frozen on every rank
        from torch.distributed.fsdp import fully_shard

        model = _mlp()
        model[0].weight.requires_grad_(False)
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    elif case == "own_tensor_shard":  # each rank builds the dataset of its own rows
        model = ddp(_mlp())
        ds = torch.utils.data.TensorDataset(*(t[rank::WORLD] for t in ds.tensors))
    elif case == "own_subset_shard":
        model = ddp(_mlp())
        ds = torch.utils.data.Subset(ds, list(range(rank, N, WORLD)))
    elif case in ("fsdp1", "fsdp1_orig_params"):  # legacy FullyShardedDataParallel
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu"),
                                         use_orig_params=case == "fsdp1_orig_params")
    elif case == "distributed_sampler":
        model = ddp(_mlp())
        loader_kw = dict(sampler=torch.utils.data.distributed.DistributedSampler(ds))
    elif case == "own_init":  # a plain model built without a common seed
        model = _mlp()
        if rank == 1:
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(torch.randn(q.shape, generator=torch.Generator().manual_seed(9)))
    else:  # "ddp_after": plain model, wrapped in DDP after make_private
        model = _mlp()
    return model, ds, loader_kw


def _train(case, rank, mesh) -> dict:
    from privlearn.torch import make_private

    model, ds, loader_kw = _setup(case, rank, mesh)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=LR)
    loader = torch.utils.data.DataLoader(ds, batch_size=B, **loader_kw)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = make_private(model, opt, loader, noise_multiplier=0.0, max_grad_norm=C,
                             seed=11)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return dict(refused=type(exc).__name__, message=str(exc))
    if case == "fsdp_after":  # sharded after make_private: the optimizer holds the old tensors
        from torch.distributed.fsdp import fully_shard

        for layer in (p.model[0], p.model[2], p.model):
            fully_shard(layer, mesh=mesh)
    run = nn.parallel.DistributedDataParallel(p.model) if case == "ddp_after" else p.model
    inner = getattr(run, "module", run)
    out = dict(refused=None, batches=[], params=[], expected=p.expected_batch_size,
               warned=[str(w.message) for w in caught if "differed between" in str(w.message)])
    it = iter(p.data_loader)
    for _ in range(STEPS):
        x, y, idx = next(it)
        p.optimizer.zero_grad()
        try:
            with run.no_sync() if case == "no_sync" else contextlib.nullcontext():
                if case == "accumulate":  # two micro-batches, one step
                    for part in (slice(0, 2), slice(2, None)):
                        nn.functional.cross_entropy(run(x[part]), y[part]).backward()
                elif case in ("unused_branch", "fsdp_unused_branch"):
                    nn.functional.cross_entropy(run(x, use_b=rank == 1), y).backward()
                else:
                    nn.functional.cross_entropy(run(x), y).backward()
            p.optimizer.step()
        except Exception as exc:  # noqa: BLE001
            return dict(refused=type(exc).__name__, message=str(exc), at_step=True,
                        steps=p.accountant.steps)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, idx.tolist())
        out["batches"].append(sorted(i for part in gathered for i in part))
        out["params"].append(_flat(inner))
    if case == "no_sync":
        buf = io.BytesIO()
        torch.save(p.state_dict(), buf)
        out["state"] = buf.getvalue()
    return out


EXACT = ("unused_branch", "fsdp_unused_branch", "bucket_view", "ddp_after", "no_sync",
         "checkpointed", "fsdp_no_reshard", "fsdp_offload", "fsdp_bf16", "fsdp_frozen",
         "own_init")
REFUSED = {"static_graph": "ConfigurationError", "own_tensor_shard": "ConfigurationError",
           "own_subset_shard": "ConfigurationError",
           "distributed_sampler": "ConfigurationError",
           "frozen_one_rank": "ConfigurationError", "accumulate": "TrainingLoopError",
           "fsdp1": "ConfigurationError", "fsdp1_orig_params": "ConfigurationError",
           "fsdp_after": "TrainingLoopError"}


def _planted_bf16(mesh) -> list[float]:
    """||update|| q N / C for one planted example (the others zero) under a bf16
    mixed-precision policy, q = 1, lr = 1: 1 when its clipped gradient has norm C."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from privlearn.torch import make_private

    ratios = []
    for trial in range(3):
        torch.manual_seed(trial)
        model = nn.Sequential(nn.Linear(16, 40, bias=False), nn.Tanh(),
                              nn.Linear(40, 5, bias=False))
        x = torch.zeros(4, 16)
        x[1] = torch.randn(16) * 37.0  # rank 1's part (odd indices); its norm >> C
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        before = _flat(model)
        ds = torch.utils.data.TensorDataset(x, torch.arange(4) % 5)
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                         torch.utils.data.DataLoader(ds, batch_size=2),
                         noise_multiplier=0.0, max_grad_norm=C, seed=1)
        xb, yb = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(xb), yb, reduction="sum").backward()
        p.optimizer.step()
        ratios.append(float((_flat(model) - before).norm()) * p.expected_batch_size / C)
    return ratios


class _TwoDtypes(nn.Module):
    """A float64 layer then a float32 one (the first parameter's dtype is not the
    second's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b = nn.Linear(6, 64).double(), nn.Linear(64, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.double())).float())


MIXED_SIGMA = 50.0  # the noisy step's update is mostly noise


def _two_dtypes(mesh) -> dict:
    """FSDP2 on :class:`_TwoDtypes`: noise off, ``STEPS`` steps (the union batches, the
    parameters after each) and noise on, one step on the same first batch (same seed)."""
    from torch.distributed.fsdp import fully_shard

    from privlearn.torch import make_private

    out = {}
    for sigma in (0.0, MIXED_SIGMA):
        model = _TwoDtypes()
        for layer in (model.a, model.b, model):
            fully_shard(layer, mesh=mesh)
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                         torch.utils.data.DataLoader(_data(), batch_size=B),
                         noise_multiplier=sigma, max_grad_norm=C, seed=11)
        rec = dict(batches=[], params=[], expected=p.expected_batch_size, outcomes=[])
        for x, y, idx in itertools.islice(p.data_loader, STEPS if sigma == 0 else 1):
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            try:
                p.optimizer.step()
                rec["outcomes"].append(None)
            except Exception as exc:  # noqa: BLE001 - the test reads the type and message
                rec["outcomes"].append((type(exc).__name__, str(exc)))
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, idx.tolist())
            rec["batches"].append(sorted(i for part in gathered for i in part))
            rec["params"].append(_flat(model))
        rec["dtypes"] = [str(q.dtype) for q in model.parameters()]
        rec["steps"] = p.accountant.steps
        out[sigma] = rec
    return out


def _other_split(mesh) -> dict:
    """One step of an FSDP2 MLP whose last weight's shards are not torch.chunk's split
    (as under an FSDP version that shards otherwise: :func:`privlearn.torch.fsdp._layout`
    made to say so): the step's outcome, steps accounted, which parameters hold a
    gradient after it."""
    from torch.distributed.fsdp import fully_shard

    from privlearn.torch import fsdp, make_private

    model = _mlp()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                     torch.utils.data.DataLoader(_data(), batch_size=B),
                     noise_multiplier=1.0, max_grad_norm=C, seed=11)
    last = model[2].weight
    real = fsdp._layout
    fsdp._layout = lambda q: (3, 8, 3) if q is last else real(q)
    try:
        x, y, _ = next(iter(p.data_loader))
        nn.functional.cross_entropy(p.model(x), y).backward()
        out = dict(outcomes=[], steps=[])
        step_and_record(p, out)
    finally:
        fsdp._layout = real
    out["grads"] = [n for n, q in model.named_parameters() if q.grad is not None]
    return out


def _load_on_ranks(own: bytes, rank: int) -> dict:
    """Every rank loads rank 0's state (as after saving on rank 0 only), then its own, into
    a fresh run: None (loaded) or (error type, message)."""
    from privlearn.torch import make_private

    box = [own if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    out = {}
    for name, blob in (("rank0", box[0]), ("own", own)):
        model = nn.parallel.DistributedDataParallel(_mlp())
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                         torch.utils.data.DataLoader(_data(), batch_size=B),
                         noise_multiplier=0.0, max_grad_norm=C, seed=11)
        try:
            p.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out[name] = (type(exc).__name__, str(exc))
        out[name, "steps"] = p.accountant.steps
    return out


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's runs on ``rank`` of the shared group (``_ranks.SHARED``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    res = {case: _train(case, rank, mesh) for case in (*EXACT, *REFUSED)}
    res["planted_bf16"] = _planted_bf16(mesh)
    res["two_dtypes"] = _two_dtypes(mesh)
    res["other_split"] = _other_split(mesh)
    res["loaded"] = _load_on_ranks(res["no_sync"]["state"], rank)
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    return shared_ranks(__name__, tmp_path_factory)


def _naive(case, batches, expected) -> list[torch.Tensor]:
    x, y, _ = _data().tensors
    model = {"unused_branch": _TwoHeads, "fsdp_unused_branch": _TwoHeads,
             "checkpointed": _Checkpointed}.get(case, _mlp)()
    if case == "fsdp_frozen":  # neither trained nor in the per-example norm
        model[0].weight.requires_grad_(False)
    params = [q for q in model.parameters() if q.requires_grad]
    out = []
    for b in batches:
        total = [torch.zeros_like(q) for q in params]
        for i in b:  # rank_partition: odd examples are rank 1's, which take the branch
            kw = {"use_b": i % WORLD == 1} if case.endswith("unused_branch") else {}
            loss = nn.functional.cross_entropy(model(x[i:i + 1], **kw), y[i:i + 1])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            grads = [torch.zeros_like(q) if g is None else g for g, q in zip(grads, params,
                                                                            strict=True)]
            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
            for t, g in zip(total, grads, strict=True):
                t += g * min(1.0, C / norm)
        with torch.no_grad():
            for q, t in zip(params, total, strict=True):
                q -= LR * t / expected
        out.append(torch.cat([q.detach().reshape(-1).double().clone()
                              for q in model.parameters()]))
    return out


@pytest.mark.parametrize("case", EXACT)
def test_noise_free_distributed_run_equals_naive_loop(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["refused"] is None and r1["refused"] is None, (r0, r1)
    assert r0["batches"] == r1["batches"] and r0["expected"] == WORLD * B
    naive = _naive(case, r0["batches"], r0["expected"])
    start = _flat({"unused_branch": _TwoHeads, "fsdp_unused_branch": _TwoHeads,
                   "checkpointed": _Checkpointed}.get(case, _mlp)())
    for k in range(STEPS):
        moved = float((naive[k] - start).abs().max())
        assert moved > 1e-3
        # float32 parameters; under bf16 the forward and backward run at bf16's relative
        # precision (a per-shard norm or a missed clip would be off by the update's size)
        tol = 1e-2 * moved if case == "fsdp_bf16" else 1e-6
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        assert float((r0["params"][k] - naive[k]).abs().max()) <= tol
    # rank 1's own initial weights: both ranks start from rank 0's, and say so
    assert bool(r0["warned"]) == bool(r1["warned"]) == (case == "own_init")


def test_bf16_mixed_precision_clips_to_exactly_c(ranks):
    assert ranks[0]["planted_bf16"] == ranks[1]["planted_bf16"]
    for ratio in ranks[0]["planted_bf16"]:
        assert ratio == pytest.approx(1.0, abs=1e-5)


def test_fsdp_layers_of_two_dtypes_train_as_the_naive_loop(ranks):
    quiet, noisy = (ranks[0]["two_dtypes"][s] for s in (0.0, MIXED_SIGMA))
    for rank in range(WORLD):
        for rec in ranks[rank]["two_dtypes"].values():
            assert all(o is None for o in rec["outcomes"]), (rank, rec["outcomes"])
            assert rec["dtypes"] == ["torch.float64"] * 2 + ["torch.float32"] * 2
        assert ranks[rank]["two_dtypes"][0.0]["steps"] == STEPS
        for k in range(STEPS):
            assert torch.equal(ranks[rank]["two_dtypes"][0.0]["params"][k], quiet["params"][k])
    # noise off: the naive loop of batch-of-one gradients in the same two dtypes
    model = _TwoDtypes()
    x, y, _ = _data().tensors
    start = _flat(model)
    for k, batch in enumerate(quiet["batches"]):
        total = [torch.zeros_like(q) for q in model.parameters()]
        for i in batch:
            loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
            grads = torch.autograd.grad(loss, list(model.parameters()))
            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
            for t, g in zip(total, grads, strict=True):
                t += g * min(1.0, C / norm)
        with torch.no_grad():
            for q, t in zip(model.parameters(), total, strict=True):
                q -= LR * t / quiet["expected"]
        assert float((_flat(model) - start).abs().max()) > 1e-3
        assert float((quiet["params"][k] - _flat(model)).abs().max()) <= 1e-6
    # noise on, the same first batch: the update minus the noise-free one is the noise,
    # one draw per coordinate of each dtype's rows at sigma C lr / (q N)
    assert noisy["batches"][0] == quiet["batches"][0]
    assert torch.equal(ranks[1]["two_dtypes"][MIXED_SIGMA]["params"][0], noisy["params"][0])
    noise = noisy["params"][0] - quiet["params"][0]
    std = MIXED_SIGMA * C * LR / noisy["expected"]
    split = 6 * 64 + 64  # the float64 layer's coordinates, then the float32 layer's
    for part in (noise[:split], noise[split:]):
        assert float(part.std()) / std == pytest.approx(1.0, abs=0.2)


def test_shards_split_otherwise_are_refused_before_any_gradient_is_set(ranks):
    """Refused on both ranks before the exchange: no parameter holds a noisy gradient of
    the unaccounted step (before, the parameters ahead of the odd one in the step's
    order had theirs set when the refusal came)."""
    for rank in range(WORLD):
        r = ranks[rank]["other_split"]
        (kind, message), = r["outcomes"]
        assert kind == "TrainingLoopError" and "shards differently" in message, (rank, r)
        assert r["steps"] == [0] and r["grads"] == [], (rank, r)


@pytest.mark.parametrize("case", list(REFUSED))
def test_misuse_is_refused_on_every_rank_before_any_step(ranks, case):
    for rank in range(WORLD):
        r = ranks[rank][case]
        assert r["refused"] == REFUSED[case], (rank, r)
        # before any step: at make_private (gradient accumulation: at its 2nd backward;
        # fully_shard applied after make_private: at the first step, none accounted)
        assert "at_step" not in r or case in ("accumulate", "fsdp_after"), (rank, r)
        assert r.get("steps", 0) == 0, (rank, r)
    if case == "static_graph":
        assert "static_graph" in ranks[0][case]["message"]
    elif case.startswith("fsdp1"):  # named as the cause, with FSDP2 as the way out
        assert "legacy FullyShardedDataParallel" in ranks[0][case]["message"]
        assert "fully_shard" in ranks[0][case]["message"]
    elif case == "fsdp_after":  # the optimizer would update the replaced tensors only
        assert "replaced after make_private" in ranks[0][case]["message"]
    elif case.startswith("own_"):
        assert "dataset" in ranks[0][case]["message"] and "rank 1" in ranks[0][case]["message"]


def test_resume_with_another_world_size_is_refused(ranks):
    from privlearn.errors import ConfigurationError
    from privlearn.torch import make_private

    state = torch.load(io.BytesIO(ranks[0]["no_sync"]["state"]), weights_only=False)
    model = _mlp()
    # one process, the same global sampling rate: only the world size differs
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=LR),
                     torch.utils.data.DataLoader(_data(), batch_size=WORLD * B),
                     noise_multiplier=0.0, max_grad_norm=C, seed=11)
    assert p.sampling_rate == state["mechanism"]["sampling_rate"]
    with pytest.raises(ConfigurationError, match="world_size"):
        p.load_state_dict(state)


def test_dataset_digest_tells_shards_apart_and_not_index_containers():
    import numpy as np

    from privlearn.torch.distributed import dataset_digest

    ds = _data()
    same = [dataset_digest(torch.utils.data.Subset(ds, idx))
            for idx in (range(0, N, 2), list(range(0, N, 2)), np.arange(0, N, 2),
                        torch.arange(0, N, 2))]
    assert len(set(same)) == 1 and same[0] is not None
    assert dataset_digest(torch.utils.data.Subset(ds, range(1, N, 2))) != same[0]
    copy = torch.utils.data.TensorDataset(*(t.clone() for t in ds.tensors))
    assert dataset_digest(copy) == dataset_digest(ds)
    shard = torch.utils.data.TensorDataset(*(t[1::2] for t in ds.tensors))
    assert dataset_digest(shard) != dataset_digest(ds)

    class Items(torch.utils.data.Dataset):  # computed items: not read for a digest
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.randn(2)

    assert dataset_digest(Items()) is None
    assert dataset_digest(torch.utils.data.Subset(Items(), [0])) is None


def test_a_state_loaded_on_another_rank_is_refused_on_every_rank(ranks):
    """Rank 0's state loaded on both ranks: rank 1 refuses it (its sampler and noise keys
    are rank 0's), and so does rank 0, rather than train on alone into a collective rank 1
    never joins; each rank's own state loads."""
    for rank in range(WORLD):
        loaded = ranks[rank]["loaded"]
        assert loaded["rank0"] is not None, rank
        kind, message = loaded["rank0"]
        assert kind == "ConfigurationError"
        assert "rank" in message and "saves its own" in message
        assert loaded["own"] is None and loaded["own", "steps"] == STEPS
    assert "rank(s) [1]" in ranks[0]["loaded"]["rank0"][1]
