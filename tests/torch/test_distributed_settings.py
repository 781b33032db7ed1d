"""make_private under torch.distributed (2 gloo processes) refuses, on every rank and
before any step, ranks given different privacy settings: each rank's accountant
describes one global mechanism, so a rank with less noise, a larger clipping bound, its
own seed (under fixed-size sampling two seeds draw overlapping global samples), its own
batch size or dataset would be accounted with the other ranks' values; a checkpoint
resumed on one rank only would leave that rank loading it while the others step; an
optimizer with another learning rate or weight decay would train the replicas apart;
nor may the ranks differ in loss reduction, accountant, epsilon cap, clipping mode, the
batch-independence probe or secure mode (every field of the settings but the per-rank
ones is compared).
Ranks given the same settings run, and each rank's epsilon is the single-process epsilon
of the global sampling rate."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
N = 100
B = 10  # per rank: q = W B / N = 0.2
STEPS = 2
TIMEOUT = 900.0  # run_ranks' default

#: case -> (rank 0's settings, rank 1's settings) over the base ones
CASES = {
    "same": ({}, {}),
    "noise_multiplier": ({}, {"noise_multiplier": 0.3}),
    "max_grad_norm": ({}, {"max_grad_norm": 5.0}),
    "seed": ({"sampling": "fixed"}, {"sampling": "fixed", "seed": 4}),
    "seed_poisson": ({"seed": 1_000_003}, {"seed": 0}),
    "batch_size": ({}, {"batch_size": 20}),
    "dataset_size": ({}, {"n": 200}),
    "target_delta": ({}, {"target_delta": 1e-3}),
    "epochs": ({"epochs": 1}, {"epochs": 5}),
    "target_epsilon": ({"noise_multiplier": None, "target_epsilon": 3.0, "epochs": 1},
                       {"noise_multiplier": None, "target_epsilon": 8.0, "epochs": 1}),
    # a checkpoint found by rank 0 only (saved on rank 0 alone): rank 0 would load it (a
    # collective) while rank 1 steps, both waiting in their own collective for ever
    "resume": ({"resume": {"format": -1}}, {}),
    # each rank applies the all-reduced update with its own optimizer: another learning
    # rate (one scaled by the rank's batch) trains each replica into another model
    "lr": ({}, {"lr": 0.5}),
    "weight_decay": ({}, {"weight_decay": 1e-2}),
    # each rank's own: the scale of its examples' gradients, the accountant its epsilon
    # is certified by, its cap on epsilon (a step refused on one rank only), a bound that
    # moves on one rank only, the probe of batch independence skipped on one rank, and
    # the source of its share of the noise
    "loss_reduction": ({}, {"loss_reduction": "sum"}),
    "accountant": ({}, {"accountant": "rdp"}),
    "max_epsilon": ({}, {"max_epsilon": 50.0}),
    "adaptive": ({}, {"clipping": "adaptive", "target_unclipped_quantile": 0.5}),
    "probe": ({}, {"check_batch_independence": False}),
    "secure_mode": ({"seed": None}, {"seed": None, "secure_mode": True}),
}


def _attempt(rank: int, settings: dict):
    from privlearn.torch import make_private

    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, seed=3, batch_size=B, n=N, lr=0.1,
              weight_decay=0.0)
    kw.update(settings)
    n, b = kw.pop("n"), kw.pop("batch_size")
    lr, decay = kw.pop("lr"), kw.pop("weight_decay")
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g),
                                        torch.randint(0, 2, (n,), generator=g))
    torch.manual_seed(1)
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=decay)
    try:
        p = make_private(model, opt, torch.utils.data.DataLoader(ds, batch_size=b), **kw)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return dict(refused=type(exc).__name__, message=str(exc),
                    untouched=all(torch.equal(a, q) for a, q in zip(before, model.parameters(),
                                                                   strict=True)))
    it = iter(p.data_loader)
    for _ in range(STEPS):
        x, y = next(it)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    out = dict(refused=None, epsilon=p.accountant.epsilon(1e-5), rate=p.sampling_rate)
    p.detach()
    return out


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's attempts on ``rank`` of the shared group (``_ranks.SHARED``)."""
    return {case: _attempt(rank, pair[rank]) for case, pair in CASES.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


@pytest.mark.parametrize("case", [c for c in CASES if c != "same"])
def test_ranks_with_different_settings_are_refused_on_every_rank(ranks, case):
    for rank, res in enumerate(ranks):
        r = res[case]
        assert r["refused"] == "ConfigurationError", (rank, r)
        assert "different settings" in r["message"] and "rank 1" in r["message"]
        assert r["untouched"]


def test_same_settings_run_and_account_the_global_rate_on_every_rank(ranks):
    same = [res["same"] for res in ranks]
    assert all(r["refused"] is None for r in same), same
    q = WORLD * B / N
    assert all(r["rate"] == pytest.approx(q) for r in same)
    # one process, same settings, at the global rate: a loader of the global batch size
    single = _attempt(0, {"batch_size": WORLD * B})
    assert single["rate"] == pytest.approx(q)
    for r in same:
        assert r["epsilon"] == pytest.approx(single["epsilon"], rel=1e-9)
