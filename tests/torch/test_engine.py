"""make_private end to end: exactness, clipping, noise scale, virtual batches, accounting,
bad inputs."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import toy_data  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.torch import (  # noqa: E402
    UnsupportedModuleError,
    fix,
    make_private,
    validate,
)


def _mlp(seed=0, d=6, k=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.ReLU(inplace=True), nn.Linear(8, k))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_noise_zero_infinite_clip_is_plain_sgd(reduction):
    """sigma = 0, C = inf and batch = expected batch: the same parameter trajectory as
    plain SGD on the same batches, bit for bit."""
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    p = make_private(model, opt, DataLoader(toy_data(), batch_size=16), noise_multiplier=0.0,
                     max_grad_norm=float("inf"), sampling="fixed", loss_reduction=reduction,
                     seed=3)
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    div = 1.0 if reduction == "mean" else 16.0
    for _ in range(2):
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            loss_fn(p.model(x), y).backward()
            p.optimizer.step()
            ref_opt.zero_grad()
            (loss_fn(ref(x), y) / div).backward()
            ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        if reduction == "mean":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert p.accountant.steps == 2 * len(p.data_loader)


def test_clipped_aggregate_equals_naive_clip_and_sum(oracle):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randn(10, 2, 6), torch.randint(0, 3, (10,))
    C = 0.05  # most examples clipped
    ref, _ = oracle.clipped_sum(model, x, y, C)
    ds = TensorDataset(x, y)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=5), noise_multiplier=0.0, max_grad_norm=C)
    p.optimizer._sampler = None  # this test feeds its own batch (no sampler check)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.clip_and_accumulate()
    p.optimizer.add_noise()
    assert (p.optimizer.last_grad_norms > C).sum() >= 5
    # p.grad = clipped sum / expected batch size (5)
    torch.testing.assert_close(oracle.flat(q.grad for q in model.parameters()), ref / 5.0,
                               rtol=1e-5, atol=1e-7)


def test_step_equals_its_public_pieces():
    """step() draws the noise into the gradient buffer and accumulates the clipped sums
    into it in place; clip_and_accumulate() accumulates into the zeroed buffer and
    add_noise() adds the noise to it: with noise 0 the gradients agree, on a model with a
    conv and a dense layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randn(10, 2, 6), torch.randint(0, 3, (10,))
    grads = []
    for fused in (True, False):
        m = copy.deepcopy(model)
        p = make_private(m, torch.optim.SGD(m.parameters(), lr=0.0),
                         DataLoader(TensorDataset(x, y), batch_size=5), noise_multiplier=0.0,
                         max_grad_norm=0.05)
        p.optimizer._sampler = None  # this test feeds its own batch (no sampler check)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        if fused:
            p.optimizer.step()
        else:
            p.optimizer.clip_and_accumulate()
            p.optimizer.add_noise()
        grads.append([q.grad.clone() for q in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert any(g.abs().sum() > 0 for g in grads[0])


@pytest.mark.parametrize("secure", [False, True])
def test_noise_std(secure):
    """Measured noise std = sigma C / expected batch size within 5% (on ~20k coordinates,
    whose sampling error is ~0.5%: 10 standard errors). Secure mode cannot be seeded: the
    mean's bound is 7 standard errors, false alarm 2.6e-12 a run."""
    torch.manual_seed(0)
    model = nn.Linear(100, 200)
    n, b = 1000, 50
    sigma, C = 1.7, 0.3
    ds = TensorDataset(torch.randn(n, 100), torch.zeros(n))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=b), noise_multiplier=sigma, max_grad_norm=C,
                     secure_mode=secure, seed=None if secure else 0)
    x, _ = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    (p.model(x).sum() * 0).backward()  # a zero loss: the update is the noise alone
    p.optimizer.step()
    g = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
    expected = sigma * C / b
    assert abs(g.std().item() / expected - 1) < 0.05
    assert abs(g.mean().item()) < 7 * expected / math.sqrt(g.numel())
    assert p.accountant.steps == 1


@pytest.mark.parametrize("sampling, physical", [("poisson", None), ("poisson", 7),
                                                ("fixed", None)])
def test_released_gradient_minus_the_clipped_sum_is_the_stated_noise(oracle, sampling,
                                                                    physical):
    """With a fixed model (lr = 0) and a loss whose per-example gradients clipping
    bounds, ``p.grad`` minus the naive clipped sum over the expected batch size is the
    noise alone: ``sum z^2 / s^2`` over all coordinates of three steps is chi-square with
    that many degrees of freedom for ``s = sigma C / (q N)`` (the expected batch size,
    never the realised one: Poisson batches here are 30 to 70 examples), checked at its
    two-sided 1e-6 quantiles; the noise of consecutive steps is uncorrelated (Fisher's
    z of their correlation within 5 standard errors) and has mean zero (5 standard
    errors)."""
    from scipy import stats

    torch.manual_seed(0)
    model = nn.Linear(100, 50).double()
    n, b, sigma, C = 500, 50, 1.3, 0.2
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(n, 100, generator=g, dtype=torch.float64),
                       torch.randint(0, 50, (n,), generator=g))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                     DataLoader(ds, batch_size=b), noise_multiplier=sigma, max_grad_norm=C,
                     sampling=sampling, max_physical_batch_size=physical, seed=3)
    s = sigma * C / b
    noises, sizes, xs, ys = [], [], [], []
    for x, y in p.data_loader:
        xs.append(x)
        ys.append(y)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        if p.accountant.steps == len(noises):
            continue  # an earlier chunk of a virtual batch
        x, y, xs, ys = torch.cat(xs), torch.cat(ys), [], []
        total, norms = oracle.clipped_sum(model, x, y, C)
        assert (norms > C).all()  # every example clipped: the sum has norm <= len(x) C
        noises.append(oracle.flat(q.grad for q in model.parameters()) - total / b)
        sizes.append(len(y))
        if len(noises) == 3:
            break
    z = torch.cat(noises)
    dof = z.numel()
    stat = float((z / s).square().sum())
    assert stats.chi2.ppf(5e-7, dof) < stat < stats.chi2.ppf(1 - 5e-7, dof)
    assert abs(float(z.mean())) < 5 * s / math.sqrt(dof)
    r = float(torch.corrcoef(torch.stack(noises[:2]))[0, 1])
    assert abs(math.atanh(r)) < 5 / math.sqrt(noises[0].numel() - 3)
    assert p.accountant.steps == 3
    if sampling == "poisson":
        assert len(set(sizes)) > 1 or sizes[0] != b  # realised sizes are not b


def test_noise_added_once_per_logical_step_with_virtual_batches():
    torch.manual_seed(0)
    model = nn.Linear(50, 400)
    n, b = 400, 40
    ds = TensorDataset(torch.randn(n, 50), torch.zeros(n))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=b), noise_multiplier=2.0, max_grad_norm=1.0,
                     max_physical_batch_size=7, sampling="fixed", seed=0)
    x, _ = next(iter(p.data_loader))  # first chunk, not final
    p.optimizer.zero_grad()
    (model(x) * 0).sum().backward()
    before = [q.detach().clone() for q in model.parameters()]
    p.optimizer.step()
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    assert p.accountant.steps == 0


def test_virtual_batches_equal_one_big_batch():
    ds = toy_data(n=60)
    results = []
    for phys in (None, 4):
        model = _mlp(seed=5)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        p = make_private(model, opt, DataLoader(ds, batch_size=15), noise_multiplier=0.0,
                         max_grad_norm=0.1, max_physical_batch_size=phys, seed=9)
        loss_fn = nn.CrossEntropyLoss()
        sizes = 0
        for x, y in p.data_loader:
            sizes += 1
            p.optimizer.zero_grad()
            loss_fn(p.model(x), y).backward()
            p.optimizer.step()
        results.append((torch.cat([q.detach().reshape(-1) for q in model.parameters()]),
                        p.accountant.steps, sizes))
    (a, steps_a, chunks_a), (b, steps_b, chunks_b) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert steps_a == steps_b == 4
    assert chunks_b > chunks_a


def test_virtual_batches_with_noise_and_a_seed_equal_one_big_batch():
    """The same seed with and without max_physical_batch_size, noise on: the same
    batches, one noise draw per logical step from the same stream, so two epochs end at
    the same parameters (to float64 rounding; the sums are formed in another order) with
    the same number of accounted steps."""
    g = torch.Generator().manual_seed(2)
    ds = TensorDataset(torch.randn(100, 6, generator=g, dtype=torch.float64),
                       torch.randint(0, 3, (100,), generator=g))
    results = []
    for phys in (None, 3):
        model = _mlp(seed=5).double()
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                         DataLoader(ds, batch_size=20), noise_multiplier=1.0,
                         max_grad_norm=0.5, max_physical_batch_size=phys, seed=11)
        for _ in range(2):
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
        results.append((torch.cat([q.detach().reshape(-1) for q in model.parameters()]),
                        p.accountant.steps))
    (a, steps_a), (b, steps_b) = results
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert steps_a == steps_b == 10
    start = torch.cat([q.detach().reshape(-1) for q in _mlp(seed=5).double().parameters()])
    assert (a - start).abs().max() > 0.01  # the noise moved them: not a vacuous match


def test_empty_batch_runs_noise_only_step():
    model = _mlp()
    ds = toy_data(n=200)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=1), noise_multiplier=1.0, max_grad_norm=1.0,
                     seed=4)
    seen_empty = False
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for x, y in p.data_loader:  # q = 1/200: about 37% of the batches are empty
        before = model[0].weight.detach().clone()
        p.optimizer.zero_grad()
        loss_fn(p.model(x), y).backward()
        p.optimizer.step()
        if len(y) == 0:
            seen_empty = True
            assert x.shape == (0, 6) and x.dtype == torch.float32 and y.dtype == torch.int64
            assert not torch.equal(before, model[0].weight)  # noise moved the weights
    assert seen_empty
    assert p.accountant.steps == 200


class _Head(nn.Module):
    """``layer`` then a linear head on its flattened output."""

    def __init__(self, layer, width):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.layer(x).flatten(1))


_LAYERS = {  # a layer whose rule is evaluated during backward after the first step
    "linear_on_sequences": (lambda: nn.Linear(6, 4), lambda n: torch.randn(n, 5, 6), 20),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), lambda n: torch.randn(n, 4, 3), 12),
    "layernorm": (lambda: nn.LayerNorm(6), lambda n: torch.randn(n, 6), 6),
    "embedding": (lambda: nn.Embedding(10, 4), lambda n: torch.randint(0, 10, (n, 5)), 20),
    # torch's own affine instance_norm fails on zero rows; the engine runs these layers
    "instancenorm1d": (lambda: nn.InstanceNorm1d(4, affine=True), lambda n: torch.randn(n, 4, 3),
                       12),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(2, affine=True),
                       lambda n: torch.randn(n, 2, 3, 3), 18),
}


@pytest.mark.parametrize("layer", sorted(_LAYERS))
def test_empty_batch_after_a_full_one(layer, monkeypatch):
    """An empty Poisson batch after the first step (when the layers' rules run during
    backward, not at the step) contributes nothing: without noise the step leaves the
    weights as they were, and it is accounted."""
    from privlearn.torch.samplers import PoissonBatchSampler

    draw = PoissonBatchSampler._draw
    monkeypatch.setattr(PoissonBatchSampler, "_draw",
                        lambda self, seed: [] if self.draws == 1 else draw(self, seed))
    make, inputs, width = _LAYERS[layer]
    torch.manual_seed(0)
    model = _Head(make(), width)
    ds = TensorDataset(inputs(32), torch.randint(0, 3, (32,)))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(ds, batch_size=8), noise_multiplier=0.0, max_grad_norm=1.0,
                     loss_reduction="sum", seed=0)
    weights, sizes = [], []
    for x, y in p.data_loader:  # 4 steps
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y, reduction="sum").backward()
        p.optimizer.step()
        sizes.append(len(y))
        weights.append(torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()]))
    assert sizes[1] == 0 and sizes[0] > 0 and sizes[2] > 0
    assert torch.equal(weights[1], weights[0])
    assert not torch.equal(weights[2], weights[1])
    assert p.accountant.steps == 4


def test_accountant_matches_composition():
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=64), batch_size=8), noise_multiplier=1.1,
                     max_grad_norm=1.0)
    assert p.accountant.epsilon(1e-5) == 0.0
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    assert p.accountant.steps == 8 and p.sampling_rate == 8 / 64
    m = compose(subsample(Gaussian(1.1), rate=8 / 64, scheme="poisson"), steps=8)
    assert p.accountant.mechanism() == m


def test_target_epsilon_calibrates_noise():
    model = _mlp()
    ds = toy_data(n=64)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), target_epsilon=5.0, target_delta=1e-3,
                     epochs=2, max_grad_norm=1.0)
    m = compose(subsample(Gaussian(p.noise_multiplier), rate=8 / 64), steps=16)
    assert m.epsilon(1e-3) <= 5.0 + 1e-9
    looser = compose(subsample(Gaussian(p.noise_multiplier * 0.98), rate=8 / 64), steps=16)
    assert looser.epsilon(1e-3) > 5.0


@pytest.mark.parametrize("accountant", ["pld", pytest.param("rdp", marks=pytest.mark.slow)])
def test_target_epsilon_run_reports_a_valid_near_tight_epsilon_against_a_peer(accountant):
    """make_private(target_epsilon=2, epochs=2), trained for its planned steps: the
    epsilon the run reports equals the accountant on its recorded history (every step
    Poisson at q = 0.1 with the calibrated sigma), is at most the target, and is a valid
    bound: at least Google dp_accounting's PLD epsilon of the same history (a peer,
    within its discretisation, 1e-3); with the PLD accountant also within 2% of it
    (the calibration is near-tight)."""
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=100), batch_size=10), target_epsilon=2.0,
                     target_delta=1e-5, epochs=2, max_grad_norm=1.0, accountant=accountant,
                     seed=0)
    for _epoch in range(2):
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
    assert p.accountant.steps == p.plan.planned_steps == 20
    sigma = p.noise_multiplier
    mine = compose(subsample(Gaussian(sigma), rate=0.1), steps=20).epsilon(
        1e-5, accountant=accountant)
    assert p.epsilon() == p.epsilon(1e-5) == mine <= 2.0
    peer = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    peer.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(sigma)), 20)
    true = peer.get_epsilon(1e-5)
    assert p.epsilon() >= true - 1e-3
    if accountant == "pld":
        assert p.epsilon() <= 1.02 * true


# ------------------------------------------------------------------ bad input


def _mk(model=None, loader=None, **kw):
    model = model if model is not None else _mlp()
    loader = loader if loader is not None else DataLoader(toy_data(), batch_size=8)
    kw.setdefault("noise_multiplier", 1.0)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, **kw)


@pytest.mark.parametrize("c", [0, -1.0, float("nan")])
def test_bad_max_grad_norm(c):
    with pytest.raises(ValueError, match="max_grad_norm"):
        _mk(max_grad_norm=c)


def test_infinite_clip_only_without_noise():
    """No clipping bounds no sensitivity: rejected with noise (or a target epsilon),
    allowed with noise_multiplier=0 for non-private testing."""
    with pytest.raises(ValueError, match="max_grad_norm=inf"):
        _mk(max_grad_norm=float("inf"))
    with pytest.raises(ValueError, match="max_grad_norm=inf"):
        _mk(noise_multiplier=None, target_epsilon=1.0, epochs=1, max_grad_norm=float("inf"))
    _mk(noise_multiplier=0.0, max_grad_norm=float("inf"))


def test_target_epsilon_without_length():
    with pytest.raises(ValueError, match="epochs or steps"):
        _mk(noise_multiplier=None, target_epsilon=1.0)


def test_both_or_neither_noise_and_target():
    with pytest.raises(ValueError, match="exactly one"):
        _mk(noise_multiplier=1.0, target_epsilon=1.0, epochs=1)
    with pytest.raises(ValueError, match="exactly one"):
        _mk(noise_multiplier=None)


def test_eval_mode_rejected():
    model = _mlp().eval()
    with pytest.raises(ValueError, match="eval mode"):
        _mk(model=model)


def test_non_poisson_loader_rejected():
    ds = toy_data()
    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(ds), 8, False)
    with pytest.raises(ValueError, match="not 'poisson' sampling"):
        _mk(loader=DataLoader(ds, batch_sampler=sampler))


def test_unsupported_layers_listed_at_once_and_fixed():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8),
                          nn.LSTM(3, 3, num_layers=2, dropout=0.5),
                          nn.MultiheadAttention(4, 2, dropout=0.1, add_bias_kv=True))
    problems = validate(model)
    assert len(problems) == 4
    with pytest.raises(UnsupportedModuleError) as err:
        _mk(model=model)
    msg = str(err.value)
    assert msg.count("BatchNorm mixes examples") == 2 and "GroupNorm" in msg
    assert "dropout > 0 between recurrent layers" in msg
    assert "attention dropout" in msg
    fix(model)
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_channels == 4
    assert isinstance(model[4], nn.GroupNorm) and model[4].num_channels == 8
    assert len(validate(model)) == 2  # the dropouts cannot be fixed


def test_an_uninitialised_lazy_batch_norm_is_not_fixed_into_a_broken_group_norm():
    """``fix`` replaced a LazyBatchNorm that had not seen a batch by GroupNorm(32, 0)
    (its feature count was still 0), which failed at the first forward pass. It is now
    refused, saying to run a forward pass first, and every layer replaced before it is
    put back; once initialised it is fixed and trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.LazyBatchNorm1d(), nn.Linear(64, 2))
    ds = TensorDataset(torch.randn(32, 1, 6, 6), torch.randint(0, 2, (32,)))
    with pytest.raises(UnsupportedModuleError, match="not initialised yet.*forward pass"):
        _mk(model=model, loader=DataLoader(ds, batch_size=8), fix_model=True)
    assert isinstance(model[1], nn.BatchNorm2d)  # the model as it was given
    with pytest.raises(UnsupportedModuleError, match="not initialised yet"):
        fix(model)
    assert isinstance(model[1], nn.BatchNorm2d)
    model(ds.tensors[0][:2])  # initialises the lazy layer
    p = _mk(model=model, loader=DataLoader(ds, batch_size=8), fix_model=True)
    assert isinstance(model[3], nn.GroupNorm) and model[3].num_channels == 64
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    assert p.accountant.steps == 1


def test_fix_model_option_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 2))
    ds = TensorDataset(torch.randn(32, 1, 6, 6), torch.randint(0, 2, (32,)))
    p = _mk(model=model, loader=DataLoader(ds, batch_size=8), fix_model=True)
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    assert isinstance(model[1], nn.GroupNorm)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="sampling"):
        _mk(sampling="shuffle")
    with pytest.raises(ValueError, match="loss_reduction"):
        _mk(loss_reduction="none")
    with pytest.raises(ValueError, match="noise_multiplier"):
        _mk(noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="seed"):
        _mk(secure_mode=True, seed=3)


def test_detach_restores_model():
    model = _mlp()
    p = _mk(model=model)
    assert all(q.requires_grad for q in model.parameters())  # make_private never changes it
    p.detach()
    assert all(q.requires_grad for q in model.parameters())
    nn.functional.cross_entropy(model(torch.randn(3, 6)), torch.tensor([0, 1, 2])).backward()
    assert model[0].weight.grad is not None


def test_fixed_size_sampling_is_accounted_as_fixed():
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=64), batch_size=8), noise_multiplier=1.1,
                     sampling="fixed", seed=0)
    for x, y in p.data_loader:
        assert len(y) == 8
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    m = compose(subsample(Gaussian(1.1), rate=8 / 64, scheme="fixed"), steps=8)
    assert p.accountant.mechanism() == m
    assert p.accountant.epsilon(1e-5) == m.epsilon(1e-5)


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


@pytest.mark.parametrize("half", [False, True])
def test_one_noise_draw_per_device_and_dtype(monkeypatch, half):
    """Parameters of several dtypes: step() draws the noise once per gradient buffer (one
    per device and dtype; secure mode), not once per parameter, and every coordinate gets
    std sigma C / expected batch size. With a bfloat16 parameter the sums are accumulated
    first and the noise added to them (formed in float64, rounded to the dtype)."""
    from privlearn.torch.noise import NoiseSource

    torch.manual_seed(0)
    last = torch.bfloat16 if half else torch.float32
    model = nn.Sequential(nn.Linear(40, 100).double(), _Cast(last),
                          nn.Linear(100, 60).to(last))
    n, b, sigma, C = 200, 20, 1.3, 0.5
    ds = TensorDataset(torch.randn(n, 40, dtype=torch.float64), torch.zeros(n))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=b), noise_multiplier=sigma, max_grad_norm=C,
                     secure_mode=True)
    draws = []
    real = NoiseSource._secure_draws_

    def counted(self, outs, std, add):
        draws.append((len(outs), outs[0].dtype, add))
        return real(self, outs, std, add)

    monkeypatch.setattr(NoiseSource, "_secure_draws_", counted)
    x, _ = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    (p.model(x).float().sum() * 0).backward()  # a zero loss: the update is the noise
    p.optimizer.step()
    assert sorted(str(d[1]) for d in draws) == sorted([str(torch.float64), str(last)])
    assert all(d[0] == 1 and d[2] == half for d in draws)  # one buffer each; add for half
    expected = sigma * C / b
    for dt in (torch.float64, last):
        g = torch.cat([q.grad.reshape(-1).double() for q in model.parameters()
                       if q.dtype == dt])
        # secure noise (fresh OS entropy): with >= 4100 draws, (n - 1) s^2 / sd^2 ~
        # chi2(n - 1) leaves 8% with probability 5e-13, the mean 7 standard errors 2.6e-12
        assert g.numel() > 4000
        assert abs(g.std().item() / expected - 1) < 0.08
        assert abs(g.mean().item()) < 7 * expected / math.sqrt(g.numel())


def test_a_refused_step_leaves_no_noise_behind():
    """A step refused after its noise was drawn into the gradient buffer (an example's
    gradient not finite) keeps nothing of it: the step retried on the batch holds one
    draw of noise, std sigma C / expected batch size, not two."""
    from privlearn.errors import NonFiniteInputError

    torch.manual_seed(0)
    model = nn.Linear(100, 200)
    n, b, sigma, C = 1000, 50, 1.7, 0.3
    ds = TensorDataset(torch.randn(n, 100), torch.zeros(n))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=b), noise_multiplier=sigma, max_grad_norm=C)
    x, _ = next(iter(p.data_loader))
    weight = torch.zeros(len(x), 1)
    weight[0] = float("inf")  # example 0's gradient is not finite (a loss without scaler)
    p.optimizer.zero_grad()
    (p.model(x) * weight).sum().backward()
    with pytest.raises(NonFiniteInputError, match="not finite"):
        p.optimizer.step()
    p.optimizer.zero_grad()  # the batch trained on again, with a finite loss
    (p.model(x).sum() * 0).backward()
    p.optimizer.step()
    g = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
    assert abs(g.std().item() / (sigma * C / b) - 1) < 0.05
    assert p.accountant.steps == 1


@pytest.mark.parametrize("dims", [1, 2])
def test_empty_first_batch_through_affine_instance_norm_is_the_noise_only_step(dims, monkeypatch):
    """An empty Poisson batch as the first batch of a model with an affine InstanceNorm
    (which torch itself cannot run on zero rows): the step runs, is accounted, and its
    update is the noise alone, of standard deviation ``lr sigma C / (q N)`` in every
    coordinate; the layer's output on a full batch is unchanged."""
    from privlearn.torch.samplers import PoissonBatchSampler

    draw = PoissonBatchSampler._draw
    monkeypatch.setattr(PoissonBatchSampler, "_draw",
                        lambda self, seed: [] if self.draws == 0 else draw(self, seed))
    torch.manual_seed(0)
    norm = (nn.InstanceNorm1d if dims == 1 else nn.InstanceNorm2d)(8, affine=True)
    shape = (8, 12) if dims == 1 else (8, 3, 3)
    model = _Head(norm, 8 * math.prod(shape[1:]))
    ds = TensorDataset(torch.randn(40, *shape), torch.randint(0, 3, (40,)))
    x = torch.randn(3, *shape)
    plain = model(x)
    lr, sigma, C = 0.5, 2.0, 1.5
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                     DataLoader(ds, batch_size=4), noise_multiplier=sigma, max_grad_norm=C,
                     seed=1)
    with torch.no_grad():
        torch.testing.assert_close(p.model(x), plain)
    before = torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()])
    xb, yb = next(iter(p.data_loader))
    assert len(yb) == 0
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    p.optimizer.step()
    after = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    assert p.accountant.steps == 1
    z = (before - after) / (lr * sigma * C / p.expected_batch_size)  # standard normal
    n = z.numel()  # > 200: a false alarm below 1e-8 at any seed (6 standard errors)
    assert n > 200 and abs(float(z.std()) - 1.0) < 0.3 and abs(float(z.mean())) < 0.4
    p.detach()
    assert "forward" not in vars(norm)


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_lazy_layer_not_yet_initialised_is_refused_and_leaves_the_model_as_it_was(oracle):
    """A LazyLinear before its first forward: refused by make_private naming the layer
    and the dry run that fixes it, with no hook left on the model (the engine's hooks,
    half installed when torch refused the uninitialised parameter, stayed on the model
    and broke the step of a later make_private); after a dry run it trains as the naive
    per-example loop."""
    from privlearn.torch.tracker import GradSampleTracker

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.Linear(3, 2))
        ds = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
        hooks = _hook_count(model)
        with pytest.raises(ValueError, match=r"0 \(LazyLinear\).*not initialised.*dry run"):
            make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                         DataLoader(ds, batch_size=8), noise_multiplier=0.0)
        with pytest.raises(ValueError):  # torch's refusal, inside the tracker itself
            GradSampleTracker(model)
        assert _hook_count(model) == hooks
        with torch.no_grad():
            model(ds.tensors[0][:2])
        ref = copy.deepcopy(model)
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                         DataLoader(ds, batch_size=8), noise_multiplier=0.0,
                         max_grad_norm=0.1, sampling="fixed", seed=0)
        x, y = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        p.optimizer.step()
        oracle.step(ref, x, y, 0.1, 0.5, 8)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


class _RecurrentHead(nn.Module):
    def __init__(self, layers, bidirectional):
        super().__init__()
        self.rnn = nn.LSTM(6, 5, num_layers=layers, bidirectional=bidirectional,
                           batch_first=True)
        self.head = nn.Linear(5 * (2 if bidirectional else 1), 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, True)])
def test_lstm_under_bf16_autocast_matches_the_float64_loop(layers, bidirectional, oracle):
    """nn.LSTM under bf16 autocast (float32 weights and inputs, bf16 output gradients):
    the LSTM rule recomputed the recurrence in the output gradient's dtype and step()
    raised torch's dtype mismatch on the float32 weights. It works in float32 as the
    other rules do: the clipped sum is the float64 loop of batch-of-one passes up to bf16
    rounding."""
    torch.manual_seed(0)
    model = _RecurrentHead(layers, bidirectional)
    x, y = torch.randn(8, 4, 6), torch.randint(0, 3, (8,))
    _, norms = oracle.clipped_sum(copy.deepcopy(model).double(), x.double(), y, 1.0)
    C = norms.median().item()  # about half the examples clipped
    ref, _ = oracle.clipped_sum(copy.deepcopy(model).double(), x.double(), y, C)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                     DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=0.0,
                     max_grad_norm=C, sampling="fixed", seed=0)
    xb, yb = next(iter(p.data_loader))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(p.model(xb).float(), yb)
    loss.backward()
    p.optimizer.step()
    got = oracle.flat(q.grad for q in model.parameters()) * 8
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-2 * ref.abs().max().item())


class _InPlaceAfter(nn.Module):
    """``head(f(layer(x)))`` where ``f`` modifies the layer's output in place."""

    def __init__(self, layer, head_in, inplace, pick=lambda out: out):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(head_in, 3)
        self.inplace, self.pick = inplace, pick

    def forward(self, x):
        out = self.pick(self.layer(x))
        self.inplace(out)
        return self.head(out.flatten(1))


class _ViewOut(nn.Module):
    """A layer of no registered rule (the torch.func fallback) returning a view."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return (x * self.w).view(x.shape[0], 2, 2)


class _MHASelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x)


@pytest.mark.parametrize("name", ["instance_norm_first", "instance_norm_after_conv",
                                  "lstm_output", "attention_output", "fallback_view"])
def test_output_modified_in_place_keeps_the_layer_gradient(name, oracle):
    """A layer whose output is a view (InstanceNorm's ``view_as``, a custom ``.view``; a
    multi-output layer's outputs, which the tracker aliased by a view) followed by an
    in-place op (``ReLU(inplace=True)``, ``relu_``): autograd rebases a view modified in
    place, the hook registered on it never fired, and the layer's parameters were left
    out of the per-example norms and the clipped sum, silently. The clipped sum is now the
    float64 loop of batch-of-one passes."""
    torch.manual_seed(0)
    relu_ = nn.ReLU(inplace=True)
    models = {
        "instance_norm_first": (lambda: _InPlaceAfter(
            nn.InstanceNorm2d(2, affine=True), 32, relu_), (2, 4, 4)),
        "instance_norm_after_conv": (lambda: _InPlaceAfter(
            nn.Sequential(nn.Conv2d(2, 3, 3, padding=1),
                          nn.InstanceNorm2d(3, affine=True)), 48, relu_), (2, 4, 4)),
        "lstm_output": (lambda: _InPlaceAfter(nn.LSTM(4, 5, batch_first=True), 15, relu_,
                                              pick=lambda out: out[0]), (3, 4)),
        "attention_output": (lambda: _InPlaceAfter(_MHASelf(), 12, lambda t: t.mul_(2),
                                                   pick=lambda out: out[0]), (3, 4)),
        "fallback_view": (lambda: _InPlaceAfter(_ViewOut(), 4, relu_), (4,)),
    }
    build, shape = models[name]
    _assert_one_step_is_the_loop(build().double(), shape, oracle)



def _assert_one_step_is_the_loop(model, shape, oracle, C=0.5):
    """One noise-free step of ``make_private`` on 8 random float64 examples of ``shape``
    (3 classes): its per-example norms and clipped sum are the float64 loop of
    batch-of-one passes (``oracle``)."""
    x, y = torch.randn(8, *shape, dtype=torch.float64), torch.randint(0, 3, (8,))
    ref, norms = oracle.clipped_sum(model, x, y, C)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=0.0,
                     max_grad_norm=C, sampling="fixed", seed=0)
    p.optimizer._sampler = None  # the test feeds its own batch (no sampler check)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.clip_and_accumulate()
    p.optimizer.add_noise()
    torch.testing.assert_close(p.optimizer.last_grad_norms, norms, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(oracle.flat(q.grad for q in model.parameters()), ref / 8.0,
                               rtol=1e-9, atol=1e-12)

class _Checkpointed(nn.Module):
    """``head(f(layer(x)))`` with ``f(layer(x))`` run under non-reentrant activation
    checkpointing (recomputed during backward)."""

    def __init__(self, layer, head_in, after=lambda t: t, pick=lambda out: out):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(head_in, 3)
        self.after, self.pick = after, pick

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda z: self.after(self.pick(self.layer(z))), x, use_reentrant=False)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("name", ["attention", "lstm_then_relu_", "instance_norm_then_relu_"])
def test_activation_checkpointing_recomputes_the_recorded_graph(name, oracle):
    """Non-reentrant checkpointing recomputes a forward during backward and requires it
    to save the tensors the first forward saved. Around ``nn.MultiheadAttention`` (whose
    first forward the engine computes with its projections exposed) and around a layer
    whose outputs the engine gave nodes of their own, followed by an in-place op, the
    recomputation saved other tensors and backward() raised torch's CheckpointError. The
    recomputation now builds the same graph: the clipped sum is the float64 loop of
    batch-of-one passes."""
    torch.manual_seed(0)
    models = {
        "attention": (lambda: _Checkpointed(_MHASelf(), 12, pick=lambda out: out[0]),
                      (3, 4)),
        "lstm_then_relu_": (lambda: _Checkpointed(nn.LSTM(4, 5, batch_first=True), 15,
                                                  after=torch.relu_,
                                                  pick=lambda out: out[0]), (3, 4)),
        "instance_norm_then_relu_": (lambda: _Checkpointed(
            nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.InstanceNorm2d(3, affine=True)),
            48, after=torch.relu_), (2, 4, 4)),
    }
    build, shape = models[name]
    _assert_one_step_is_the_loop(build().double(), shape, oracle)


class _AttentionHead(nn.Module):
    def __init__(self, attention, need_weights=True, cross=False):
        super().__init__()
        self.att, self.head = attention, nn.Linear(8, 3)
        self.need_weights, self.cross = need_weights, cross

    def forward(self, x):
        kv = x[..., :6] if self.cross else x
        return self.head(self.att(x, kv, kv, need_weights=self.need_weights)[0].mean(1))


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)
        # the residual dropout after attention draws its mask in the memory layout of
        # the attention's output, which differs between the two forwards compared
        self.enc.dropout1.p = 0.0
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


@pytest.mark.parametrize("name", ["weights", "fused", "cross_kdim", "encoder_layer"])
def test_attention_dropout_trains_with_the_step_masks(name):
    """``nn.MultiheadAttention(dropout > 0)`` (``nn.TransformerEncoderLayer``'s default)
    was refused. The instrumented forward applies the dropout itself and captures the
    gradients of Q, K, V and the head outputs as the step's masks made them. Ground
    truth: each example's gradient of its own loss in one batched forward of a plain
    copy of the model, drawn from the same generator state (the same masks; examples do
    not interact), clipped and summed in float64."""
    torch.manual_seed(0)
    model = {
        "weights": lambda: _AttentionHead(nn.MultiheadAttention(8, 2, dropout=0.3,
                                                                batch_first=True)),
        "fused": lambda: _AttentionHead(nn.MultiheadAttention(8, 2, dropout=0.3,
                                                              batch_first=True), False),
        "cross_kdim": lambda: _AttentionHead(nn.MultiheadAttention(
            8, 2, dropout=0.3, kdim=6, vdim=6, batch_first=True), cross=True),
        "encoder_layer": _Encoder,
    }[name]().double()
    x, y = torch.randn(8, 5, 8, dtype=torch.float64), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    torch.manual_seed(123)
    losses = nn.functional.cross_entropy(ref(x), y, reduction="none")
    rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        losses[i], list(ref.parameters()), retain_graph=True)]) for i in range(8)])
    C = rows.norm(dim=1).median().item()  # about half the examples clipped
    clipped = (rows * (C / rows.norm(dim=1)).clamp(max=1.0)[:, None]).sum(0)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=0.0,
                     max_grad_norm=C, sampling="fixed", seed=0,
                     check_batch_independence=False)  # the probe would draw masks too
    p.optimizer._sampler = None  # this test feeds its own batch (no sampler check)
    p.optimizer.zero_grad()
    torch.manual_seed(123)
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.clip_and_accumulate()
    p.optimizer.add_noise()
    torch.testing.assert_close(p.optimizer.last_grad_norms, rows.norm(dim=1), rtol=1e-9,
                               atol=1e-12)
    torch.testing.assert_close(torch.cat([q.grad.reshape(-1) for q in model.parameters()]),
                               clipped / 8, rtol=1e-8, atol=1e-12)


def test_attention_dropout_with_the_probe_trains():
    """The default run (batch-independence probe on, Poisson batches) of a Transformer
    encoder layer with its default dropout 0.1: it trains and is accounted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
                          nn.Flatten(), nn.Linear(40, 3))
    ds = TensorDataset(torch.randn(64, 5, 8), torch.randint(0, 3, (64,)))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
                     seed=0)
    before = copy.deepcopy(model.state_dict())
    for xb, yb in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(xb), yb).backward()
        p.optimizer.step()
    assert p.accountant.steps == 4
    after = model.state_dict()
    assert not torch.equal(before["0.self_attn.in_proj_weight"],
                           after["0.self_attn.in_proj_weight"])


def test_a_gradient_penalty_is_refused_naming_it():
    """``torch.autograd.grad`` through the model and then ``backward()`` (a gradient
    penalty) is a second backward pass before the step: refused, the message naming the
    gradient penalty rather than only gradient accumulation."""
    from privlearn.errors import TrainingLoopError

    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
                     max_grad_norm=1.0, sampling="fixed", seed=0)
    xb, yb = next(iter(p.data_loader))
    xb.requires_grad_(True)
    loss = ((p.model(xb) - yb) ** 2).mean()
    (g,) = torch.autograd.grad(loss, xb, create_graph=True)
    with pytest.raises(TrainingLoopError, match="gradient penalty"):
        (loss + g.pow(2).sum()).backward()
