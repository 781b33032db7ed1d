"""make_private given something of its own on one rank only (2 gloo processes): refused
on every rank at once, typed, the group still usable; or trained as the naive ground
truth (one global mechanism: its noise added once, at the accounted std).

(a) Rank 1 alone gives make_private what it refuses before the ranks compare their
    settings: a shuffling loader (``RandomSampler``), a model in eval mode, a negative
    noise multiplier (the settings themselves refused), and, under FSDP2, fp16's
    ``grad_scaler`` or an optimizer built before ``fully_shard``. Rank 1 raises its own
    error; rank 0, whose arguments are fine, raises the same type naming rank 1 and its
    cause, well within ``agreement_timeout`` (before, rank 0 waited the whole timeout for
    rank 1, then raised ``RanksNotArrivedError`` and left the group unusable; under FSDP2
    rank 0 went on into the ledger's collective while rank 1 had left make_private). A
    correct run afterwards trains on both ranks.
(b) ``DistributedDataParallel.join()`` (uneven inputs) around the loop: refused on both
    ranks when it is entered, nothing accounted (before, rank 1, leaving its loop a step
    early, ran Join's one-element all-reduces against rank 0's status exchange of the
    step: gloo aborted rank 1's process on the size mismatch). The same with the
    wrapper made after make_private: refused at the first step on both ranks (more in
    ``test_distributed_join_after.py``).
(c) ``max_physical_batch_size`` on rank 1 only (a setting that may differ between the
    ranks: each rank's chunks of its own batch): both ranks end an epoch with the
    parameters of the run without it (the same seed, so the same batches), to float
    rounding, and with the same accounted steps.
(d) A buffer (an input scaling the model holds) built with another value on rank 1, in a
    plain model and in one sharded with FSDP2 (neither has DDP's broadcast of the
    buffers when it wraps the model): both ranks train with rank 0's buffer, with a
    warning, to the parameters of the run whose ranks had that value from the start
    (before, each rank computed its examples' gradients with its own buffer).
(e) Each rank loading its own state, but saved after another step (rank 0's of step 2,
    rank 1's of step 3): refused at ``load_state_dict`` on both ranks, nothing loaded
    (before, both loaded, and every step after was refused as out of step).
(f) The noise of one step (noise multiplier 50, the update all noise) against the
    accounted std: its squares' sum within the 1e-7 tails of the chi-square of its 4,000
    coordinates, also with rank 1 alone in physical chunks.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("torch.distributed.fsdp")  # its fsdp cases

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
N = 40
B = 5  # per rank: q = W B / N = 0.25, 4 steps an epoch
SIGMA = 50.0  # the noise dwarfs the clipped sum (at most W B C against sigma C per
# coordinate): the update is the released noise
AGREEMENT_TIMEOUT = 30.0  # agreement_timeout: a refusal must come well before it
# the scenario's limit in the shared group: before the fix rank 0 waited
# AGREEMENT_TIMEOUT seconds in each refused case
TIMEOUT = 240.0
REFUSED = {
    "shuffle": "ConfigurationError",
    "eval": "ParameterValueError",
    "noise_multiplier": "ParameterValueError",
    "fsdp_grad_scaler": "ConfigurationError",
    "fsdp_stale_optimizer": "ConfigurationError",
}
CAUSE = {
    "shuffle": "RandomSampler",
    "eval": "eval mode",
    "noise_multiplier": "noise_multiplier",
    "fsdp_grad_scaler": "grad_scaler",
    "fsdp_stale_optimizer": "optimizer after fully_shard",
}


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
    )


class _Scaled(nn.Module):
    """The MLP on inputs scaled by a buffer (a fixed preprocessing the model holds)."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.mlp = _mlp()
        self.register_buffer("scale", torch.full((6,), scale))

    def forward(self, x):
        return self.mlp(x * self.scale)


def _flat(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat(
        [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).double().clone()
            for p in model.parameters()
        ]
    )


def _run(case: str, rank: int, mesh) -> dict:
    """make_private with rank 1's own misuse of ``case``, then an epoch (``join``: rank 1
    stops a step early, inside ``model.join()``)."""
    from privlearn.torch import make_private

    odd = rank == 1
    kw = dict(noise_multiplier=0.0, max_grad_norm=0.5, seed=11, agreement_timeout=AGREEMENT_TIMEOUT)
    loader_kw, extra, stale = {}, {}, None
    if case.endswith(("buffer", "scaled")):  # rank 1 built with its own buffer value
        model = _Scaled(3.0 if odd and case.endswith("buffer") else 2.0)
        if case.startswith("fsdp"):
            from torch.distributed.fsdp import fully_shard

            for layer in (model.mlp[0], model.mlp[2], model):
                fully_shard(layer, mesh=mesh)
    elif case.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        model = _mlp()
        if odd and case == "fsdp_stale_optimizer":  # built over the tensors fully_shard replaces
            stale = torch.optim.SGD(model.parameters(), lr=0.5)
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        if odd and case == "fsdp_grad_scaler":
            extra["grad_scaler"] = torch.amp.GradScaler("cpu")
    elif case == "join_after":  # wrapped in DDP after make_private, as accelerate may
        model = _mlp()
    elif case == "buffer_extra":  # a plain model, rank 1's with a buffer of its own
        model = _mlp()
        if odd:
            model.register_buffer("extra", torch.zeros(3))
    else:
        model = nn.parallel.DistributedDataParallel(_mlp())
    if odd and case == "shuffle":
        loader_kw["shuffle"] = True
    elif odd and case == "eval":
        model.eval()
    elif odd and case == "noise_multiplier":
        kw["noise_multiplier"] = -1.0
    elif odd and case == "physical":
        kw["max_physical_batch_size"] = 2
    opt = stale if stale is not None else torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(_data(), batch_size=B, **loader_kw)
    start = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = make_private(model, opt, loader, **kw, **extra)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return dict(refused=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start)
    out = dict(refused=None, warned=any("differed between" in str(w.message) for w in caught))
    run = nn.parallel.DistributedDataParallel(p.model) if case == "join_after" else p.model
    joined = (model if case == "join" else run).join if case.startswith("join") else None
    try:
        with joined() if joined is not None else contextlib.nullcontext():
            for k, (x, y) in enumerate(p.data_loader):
                if case.startswith("join") and odd and k == 3:
                    break
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(run(x), y).backward()
                p.optimizer.step()
    except Exception as exc:  # noqa: BLE001
        out.update(refused=type(exc).__name__, message=str(exc), at_step=True)
    inner = getattr(model, "module", model)
    out.update(steps=p.accountant.steps, params=_flat(inner), buffers=list(inner.buffers()))
    p.detach()
    return out


def _states_apart(rank: int) -> dict:
    """Each rank's states after steps 2 and 3 of a run; a fresh run loading rank 0's of
    step 2 and rank 1's of step 3 (None: loaded, else (error type, message)); then
    another loading both ranks' of step 2, and its next step's parameters."""
    import io

    from privlearn.torch import make_private

    def fresh():
        model = nn.parallel.DistributedDataParallel(_mlp())
        return make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
            torch.utils.data.DataLoader(_data(), batch_size=B),
            noise_multiplier=1.0,
            max_grad_norm=0.5,
            seed=11,
        )

    def step(p, it):
        x, y = next(it)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()

    p, saved = fresh(), {}
    it = iter(p.data_loader)
    for k in (1, 2, 3):
        step(p, it)
        buf = io.BytesIO()
        torch.save(p.state_dict(), buf)
        saved[k] = buf.getvalue()
    out = {}
    for name, k in (("apart", 2 + rank), ("same", 2)):
        q = fresh()
        try:
            q.load_state_dict(torch.load(io.BytesIO(saved[k]), weights_only=False))
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out[name] = (type(exc).__name__, str(exc))
        out[name, "steps"] = q.accountant.steps
    step(q, iter(q.data_loader))
    out["params"] = _flat(q.model.module)
    out["steps"] = q.accountant.steps
    return out


def _noise(rank: int, chunk: int | None) -> torch.Tensor:
    """One noisy step of a wide model under DDP (rank 1 in physical chunks of ``chunk``
    rows, if given): the update scaled to N(0, 1) per coordinate, as accounted (the
    noise multiplier SIGMA, the bound C, the expected batch W B; lr 1)."""
    from privlearn.torch import make_private

    torch.manual_seed(5)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 400), nn.Tanh(), nn.Linear(400, 3))
    )
    kw = {} if chunk is None or rank == 0 else {"max_physical_batch_size": chunk}
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        torch.utils.data.DataLoader(_data(), batch_size=B),
        noise_multiplier=SIGMA,
        max_grad_norm=1e-3,
        **kw,
    )
    before = _flat(model.module)
    for x, y in p.data_loader:  # one logical batch (its chunks on rank 1)
        p.optimizer.zero_grad()
        if len(x):  # an empty Poisson batch: the step adds its noise alone
            nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        if p.accountant.steps == 1:
            break
    return (before - _flat(model.module)) * p.expected_batch_size / (SIGMA * 1e-3)


CASES = (
    *REFUSED,
    "join",
    "join_after",
    "physical",
    "base",
    "own_buffer",
    "scaled",
    "fsdp_own_buffer",
    "fsdp_scaled",
    "buffer_extra",
)


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's run on ``rank`` of the shared group (``_ranks.SHARED``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    results = {case: _run(case, rank, mesh) for case in CASES}
    results["states_apart"] = _states_apart(rank)
    results["noise"] = [_noise(rank, chunk) for chunk in (None, 2)]
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def test_a_refusal_on_one_rank_is_raised_at_once_on_every_rank(ranks):
    for case in REFUSED:
        own, other = ranks[1][case], ranks[0][case]
        assert own["refused"] == other["refused"] == REFUSED[case], (case, own, other)
        assert CAUSE[case] in own["message"], case
        # rank 0 names rank 1 and its cause, and did not wait for the timeout
        assert "rank(s) [1]" in other["message"] and CAUSE[case] in other["message"], case
        assert other["seconds"] < AGREEMENT_TIMEOUT / 3, (case, other["seconds"])
    # the group is still usable: the correct run afterwards trained on both ranks
    base = [ranks[r]["base"] for r in range(WORLD)]
    assert base[0]["refused"] is None and base[1]["refused"] is None, base
    assert base[0]["steps"] == base[1]["steps"] == N // (WORLD * B)
    assert torch.equal(base[0]["params"], base[1]["params"])
    assert float((base[0]["params"] - _flat(_mlp())).abs().max()) > 1e-3


def test_ddp_join_is_refused_on_every_rank(ranks):
    for rank in range(WORLD):
        r = ranks[rank]["join"]
        assert r["refused"] == "ConfigurationError" and r.get("at_step"), (rank, r)
        assert "join()" in r["message"] and "uneven inputs" in r["message"]
        assert r["steps"] == 0


def test_ddp_join_of_a_wrapper_made_after_make_private_is_refused_on_every_rank(ranks):
    """Not known to make_private, the wrapper's join is seen at its forward and refused
    at the first step, on both ranks (before, two steps were released, then rank 1's join
    shadowed rank 0's next collectives and gloo aborted rank 0's process)."""
    for rank in range(WORLD):
        r = ranks[rank]["join_after"]
        assert r["refused"] == "TrainingLoopError" and r.get("at_step"), (rank, r)
        assert "join" in r["message"] and "uneven inputs" in r["message"]
        assert r["steps"] == 0
        torch.testing.assert_close(r["params"], _flat(_mlp()), rtol=0, atol=0)


def test_physical_chunks_on_one_rank_only_train_as_the_whole_batch(ranks):
    for rank in range(WORLD):
        r, base = ranks[rank]["physical"], ranks[rank]["base"]
        assert r["refused"] is None, r
        assert r["steps"] == base["steps"]
        torch.testing.assert_close(r["params"], base["params"], rtol=0, atol=1e-6)
    assert torch.equal(ranks[0]["physical"]["params"], ranks[1]["physical"]["params"])


def test_a_buffer_of_its_own_on_one_rank_becomes_the_first_ranks(ranks):
    """A plain model, and one sharded with FSDP2, whose input-scaling buffer rank 1 built
    with another value: both ranks train with rank 0's (with a warning), as when the
    buffer is the same on both ranks from the start; each rank's examples' gradients of
    its own buffer's model would mix two models in one update."""
    for kind in ("", "fsdp_"):
        for rank in range(WORLD):
            r, same = ranks[rank][kind + "own_buffer"], ranks[rank][kind + "scaled"]
            assert r["refused"] is None and same["refused"] is None, (kind, rank, r)
            assert r["warned"] and not same["warned"], (kind, rank)
            assert all(torch.equal(b, torch.full((6,), 2.0)) for b in r["buffers"])
            assert r["steps"] == same["steps"] == N // (WORLD * B)
            torch.testing.assert_close(r["params"], same["params"], rtol=0, atol=1e-6)
        assert float((same["params"] - ranks[0]["base"]["params"]).abs().max()) > 1e-3


def test_states_saved_at_different_steps_are_refused_on_every_rank(ranks):
    """Rank 0 loads its state of step 2, rank 1 its state of step 3: refused on both at
    load_state_dict, nothing loaded (each would go on from its own step, every later
    step refused as out of step); the states of one step load and train on."""
    for rank in range(WORLD):
        r = ranks[rank]["states_apart"]
        assert r["apart"] is not None, rank
        kind, said = r["apart"]
        assert kind == "ConfigurationError" and "different numbers of steps" in said
        assert "rank 0: 2, rank 1: 3" in said
        assert r["apart", "steps"] == 0
        assert r["same"] is None and r["same", "steps"] == 2 and r["steps"] == 3
    assert torch.equal(ranks[0]["states_apart"]["params"], ranks[1]["states_apart"]["params"])


def test_the_noise_released_is_the_accounted_noise_once(ranks):
    """The update of one noisy step, scaled by the accounted std sigma C / (W B): its
    squares sum to a chi-square of as many degrees of freedom as coordinates (each
    rank's N(0, (sigma C)^2 / W) summed once), within the chi-square's 1e-7 tails; also
    with rank 1 alone training its batch in physical chunks (noise per chunk, or per
    rank and not shared, would give twice the sum or more; equal noise on the two ranks
    twice it, cancelling noise none)."""
    from scipy.stats import chi2

    for k in range(2):
        z0, z1 = ranks[0]["noise"][k], ranks[1]["noise"][k]
        torch.testing.assert_close(z0, z1, rtol=0, atol=1e-9)
        n, total = z0.numel(), float((z0**2).sum())
        assert n > 4000
        assert chi2.ppf(1e-7, n) < total < chi2.ppf(1 - 1e-7, n), (k, total / n)


def test_a_rank_whose_group_fails_too_raises_its_own_refusal(monkeypatch):
    """One process, a two-rank group simulated: the exchange of a rank that refused fails
    (the group is broken); the rank raises its own refusal, not the group's error, and a
    rank that did not refuse raises the group's."""
    import torch.distributed as dist

    from privlearn.torch import distributed

    def broken(*args, **kwargs):
        raise RuntimeError("gloo: connection closed by peer")

    monkeypatch.setattr(distributed, "world_info", lambda group=None: (0, 2))
    monkeypatch.setattr(dist, "all_gather_object", broken)
    own = ValueError("this rank's own cause")
    with pytest.raises(ValueError, match="own cause") as caught:
        distributed.check_same_on_ranks({}, error=own)
    assert caught.value is own and isinstance(own.__context__, RuntimeError)
    with pytest.raises(RuntimeError, match="connection closed"):
        distributed.check_same_on_ranks({"seed": 1})


def test_a_malformed_step_count_on_another_rank_is_that_ranks_refusal(monkeypatch):
    """One process, a two-rank group simulated: the other rank's saved state has a step
    count that is no count (a list: it refuses its state itself and waits in the
    exchange of refusals). This rank raises that rank's refusal from the exchange, not a
    TypeError before it that would leave the other rank waiting there."""
    import types

    import torch.distributed as dist

    from privlearn.errors import ConfigurationError
    from privlearn.torch import distributed
    from privlearn.torch._agree import StepAgreement

    sent = []

    def gather(out, obj, group=None):
        sent.append(obj)
        out[0] = obj
        out[1] = [3] if len(sent) == 1 else "ParameterTypeError: 'batches' must be an int"

    monkeypatch.setattr(distributed, "world_info", lambda group=None: (0, 2))
    monkeypatch.setattr(dist, "all_gather_object", gather)
    agreement = types.SimpleNamespace(agree=lambda *a, **k: None, group=None)
    rank = types.SimpleNamespace(_agreement=agreement, world_size=2, process_group=None)
    with pytest.raises(ConfigurationError, match=r"refused on rank\(s\) \[1\].*'batches'"):
        StepAgreement._agree_on_load(rank, None, 2)
    assert sent == [2, None]  # the counts, then this rank's "no refusal"


def test_a_buffer_on_one_rank_only_is_refused_on_every_rank(ranks):
    """Rank 1's model has a buffer rank 0's lacks: refused at make_private on both ranks,
    naming it, before the ranks broadcast rank 0's buffers (over lists of different
    lengths rank 0 went on with the run while rank 1 waited for one more broadcast)."""
    for rank in range(WORLD):
        r = ranks[rank]["buffer_extra"]
        assert r["refused"] == "ConfigurationError", (rank, r)
        assert "buffers" in r["message"] and "'extra'" in r["message"], (rank, r)
        assert r["seconds"] < AGREEMENT_TIMEOUT / 3, (rank, r["seconds"])
