"""Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021, Algorithm 1): the engine
against a hand-written loop of the algorithm with the same noise draws, the accounting of
what ran, checkpoints, and bad configurations."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import toy_data  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.optimizer import gradient_noise_multiplier  # noqa: E402

N, B, SEED = 64, 16, 5


def _data(n=N, d=5, k=3, seed=0, dtype=torch.float64):
    return toy_data(n, d, k, seed, dtype=dtype, spread=True)


def _mlp(seed=0, d=5, k=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 7), nn.Tanh(), nn.Linear(7, k)).double()


def _grads(oracle, model, x, y):
    """Per-example gradients by the batch-of-one loop (float64)."""
    return oracle.grads(lambda i: nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                        len(y), list(model.parameters()))


def test_equals_naive_algorithm_with_same_noise(oracle):
    """Several steps of the engine equal Algorithm 1 written out: clip at C_t, noise
    sigma_g C_t on the sum with sigma_g = (sigma^-2 - (2 sigma_b)^-2)^(-1/2), noisy centred
    count, geometric update of C, SGD step -- same batches and same noise draws (the
    engine's noise source is seeded with seed + 7 and moves to the next key of its one-way
    chain after every step)."""
    sigma, gamma, eta, lr = 1.1, 0.5, 0.3, 0.2
    ds = _data()
    model = _mlp()
    naive = copy.deepcopy(model)
    c0 = _grads(oracle, model, *ds.tensors).norm(dim=1).median().item() * 0.5  # clips most
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                     DataLoader(ds, batch_size=B), noise_multiplier=sigma, max_grad_norm=c0,
                     clipping="adaptive", target_unclipped_quantile=gamma,
                     clipbound_learning_rate=eta, seed=SEED)
    batches, bounds = [], []
    for _ in range(2):
        for x, y in p.data_loader:
            batches.append((x.clone(), y.clone()))
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            bounds.append(p.optimizer.max_grad_norm)
    assert len(batches) == 8

    m = float(B)
    sigma_b = m / 20
    sigma_g = (sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5
    from privlearn.torch import NoiseSource

    source = NoiseSource(seed=SEED + 7)
    params = list(naive.parameters())
    c = c0
    for t, (x, y) in enumerate(batches):
        g = source.generator
        grads = _grads(oracle, naive, x, y)
        norms = grads.norm(dim=1)
        clipped = grads * (c / norms.clamp_min(1e-30)).clamp_max(1.0)[:, None]
        numel = sum(q.numel() for q in params)
        noise = torch.empty(numel, dtype=torch.float64).normal_(0.0, sigma_g * c / m,
                                                                generator=g)
        update = clipped.sum(0) / m + noise
        count = float((norms <= c).sum()) - 0.5 * x.shape[0]
        z = torch.normal(0.0, sigma_b, (1,), generator=g, dtype=torch.float64).item()
        frac = (count + z) / m + 0.5
        with torch.no_grad():
            off = 0
            for q in params:
                q -= lr * update[off:off + q.numel()].view_as(q)
                off += q.numel()
        c = c * math.exp(-eta * (frac - gamma))
        assert bounds[t] == pytest.approx(c, rel=1e-12)
        source.advance()
    for a, b in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the bound moved (it started below the median and half the examples were targeted)
    assert bounds[-1] > c0


def test_epsilon_is_composition_of_what_ran():
    """The accountant records sigma (the whole step, sum and count together) for every
    step, whatever the bound did; epsilon equals the composition of those steps."""
    ds = _data(dtype=torch.float32)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=B), noise_multiplier=1.0, max_grad_norm=0.1,
                     clipping="adaptive", target_unclipped_quantile=0.7, seed=1)
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    p.optimizer.noise_multiplier = 1.3  # a schedule on top: a new mechanism
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    segs = p.accountant.segments
    assert sum(s.steps for s in segs) == 8
    assert {s.noise_multiplier for s in segs} == {1.0, 1.3}
    assert len({s.max_grad_norm for s in segs}) == 8  # one bound per step, recorded
    q = B / N
    ref = compose([subsample(Gaussian(1.0), rate=q), subsample(Gaussian(1.3), rate=q)],
                  steps=[4, 4]).epsilon(1e-5)
    assert p.epsilon(1e-5) == pytest.approx(ref, rel=1e-9)


def test_gradient_noise_is_sigma_g_times_bound():
    """With no examples (empty gradients) the update is pure noise: its std per
    coordinate is sigma_g C / m (not sigma C / m)."""
    ds = TensorDataset(torch.randn(4000, 200), torch.zeros(4000, dtype=torch.long))
    model = nn.Linear(200, 50, bias=False)
    sigma, c, b = 1.5, 2.0, 40
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=b), noise_multiplier=sigma, max_grad_norm=c,
                     clipping="adaptive", target_unclipped_quantile=0.5,
                     clipbound_learning_rate=1e-9, seed=0)
    x, _ = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    (p.model(x).sum() * 0).backward()  # zero gradients: the update is the noise alone
    w0 = model.weight.detach().clone()
    p.optimizer.step()
    std = (w0 - model.weight.detach()).std().item()
    sigma_b = b / 20
    expect = (sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5 * c / b
    assert std == pytest.approx(expect, rel=0.02)  # 10000 draws: ~0.7% std error
    assert abs(std - sigma * c / b) > 0.05 * sigma * c / b


def test_bound_tracks_target_quantile(oracle):
    """With the model fixed (lr = 0) and little count noise, the bound settles near the
    target quantile of the per-example norms over the data set."""
    ds = _data(n=512)
    model = _mlp()
    norms = _grads(oracle, model, *ds.tensors).norm(dim=1)
    target = torch.quantile(norms, 0.3).item()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                     DataLoader(ds, batch_size=128), noise_multiplier=0.5,
                     max_grad_norm=10 * target, clipping="adaptive",
                     target_unclipped_quantile=0.3, clipbound_learning_rate=0.5, seed=0)
    tail = []
    for epoch in range(40):
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if epoch >= 30:
                tail.append(p.optimizer.max_grad_norm)
    settled = sum(tail) / len(tail)
    frac = (norms <= settled).double().mean().item()
    assert abs(frac - 0.3) < 0.1, (settled, target, frac)


def test_checkpoint_resume_continues_bound():
    """The live bound, the accountant and the noise state come back with the checkpoint:
    a resumed run continues exactly like the uninterrupted one."""
    ds = _data()

    def build():
        model = _mlp()
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(ds, batch_size=B), noise_multiplier=1.0,
                            max_grad_norm=0.05, clipping="adaptive",
                            target_unclipped_quantile=0.5, seed=2)

    def batches(p):
        while True:
            yield from p.data_loader  # the first pass after a resume ends the saved epoch

    def run(p, it, k):
        for _ in range(k):
            x, y = next(it)
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()

    a = build()
    it = batches(a)
    run(a, it, 3)  # mid-epoch (4 steps per epoch)
    state = copy.deepcopy(a.state_dict())
    assert state["max_grad_norm"] != 0.05
    run(a, it, 5)
    b = build()
    b.load_state_dict(state)
    assert b.max_grad_norm == state["max_grad_norm"]
    run(b, batches(b), 5)
    assert a.max_grad_norm == b.max_grad_norm
    for u, v in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(u, v)
    assert a.epsilon(1e-5) == b.epsilon(1e-5)
    # a run with other adaptive settings cannot take the state
    model = _mlp()
    other = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(ds, batch_size=B), noise_multiplier=1.0,
                         max_grad_norm=0.05, clipping="adaptive",
                         target_unclipped_quantile=0.9, seed=2)
    with pytest.raises(ValueError, match="adaptive"):
        other.load_state_dict(state)


def _make(**kw):
    model = nn.Linear(5, 3)
    args = dict(noise_multiplier=1.0, max_grad_norm=1.0)
    args.update(kw)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(_data(dtype=torch.float32), batch_size=B), **args)


def test_bad_configurations_refused_before_training():
    with pytest.raises(ValueError, match="target_unclipped_quantile.*got None"):
        _make(clipping="adaptive")
    with pytest.raises(ValueError, match=r"target_unclipped_quantile must be in \[0, 1\]"):
        _make(clipping="adaptive", target_unclipped_quantile=1.5)
    with pytest.raises(ValueError, match="clipbound_learning_rate"):
        _make(clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0)
    with pytest.raises(ValueError, match="clipping must be"):
        _make(clipping="quantile")
    with pytest.raises(ValueError, match="only apply to clipping='adaptive'"):
        _make(target_unclipped_quantile=0.5)
    # sigma_b = 16 / 20 = 0.8: sigma must stay below 1.6
    with pytest.raises(ValueError, match="unclipped_num_std > noise_multiplier / 2"):
        _make(clipping="adaptive", target_unclipped_quantile=0.5, noise_multiplier=1.6)
    with pytest.raises(ValueError, match="unclipped_num_std > noise_multiplier / 2"):
        _make(clipping="adaptive", target_unclipped_quantile=0.5, unclipped_num_std=0.4)
    with pytest.raises(ValueError, match="finite initial max_grad_norm"):
        _make(clipping="adaptive", target_unclipped_quantile=0.5, noise_multiplier=0.0,
              max_grad_norm=float("inf"))
    # calibrated sigma checked too
    with pytest.raises(ValueError, match="unclipped_num_std"):
        _make(clipping="adaptive", target_unclipped_quantile=0.5, noise_multiplier=None,
              target_epsilon=0.05, epochs=5, unclipped_num_std=0.3)
    p = _make(clipping="adaptive", target_unclipped_quantile=0.5)
    with pytest.raises(ValueError, match="unclipped_num_std"):
        p.optimizer.noise_multiplier = 2.0  # a schedule may not break the split either
    assert p.optimizer.noise_multiplier == 1.0


@given(st.floats(0.05, 50.0), st.floats(0.51, 100.0))
def test_noise_split_composes_to_sigma(sigma, ratio):
    """Sum (sensitivity C, noise sigma_g C) and centred count (sensitivity 1/2, noise
    sigma_b): the rescaled sensitivity of the pair is exactly 1 / sigma."""
    sigma_b = sigma * ratio
    sg = gradient_noise_multiplier(sigma, sigma_b)
    assert sg >= sigma
    joint = math.hypot(1.0 / sg, 0.5 / sigma_b)
    assert joint == pytest.approx(1.0 / sigma, rel=1e-9)


def test_virtual_batches_count_every_chunk():
    """With max_physical_batch_size the count sums over all chunks of a logical batch:
    the bound and the parameters follow the same trajectory as without chunking."""
    ds = _data()

    def run(chunk):
        model = _mlp()
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.2),
                         DataLoader(ds, batch_size=B), noise_multiplier=1.0,
                         max_grad_norm=0.05, clipping="adaptive",
                         target_unclipped_quantile=0.5, clipbound_learning_rate=0.5,
                         seed=4, max_physical_batch_size=chunk)
        bounds = []
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            before = p.accountant.steps
            p.optimizer.step()
            if p.accountant.steps > before:
                bounds.append(p.optimizer.max_grad_norm)
        return model, bounds

    whole, b1 = run(None)
    chunked, b2 = run(3)
    assert len(b1) == len(b2) == 4
    assert b2 == pytest.approx(b1, rel=1e-12)
    for u, v in zip(whole.parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)


def test_a_logical_batch_left_between_chunks_is_not_in_the_next_count():
    """A logical batch left between its physical chunks releases nothing: its chunks'
    examples must not reach the next step's released count either (they would move it by
    up to 1, twice the sensitivity the noise split assumes, from a batch nobody
    accounted). With the count's noise set to zero and every example clipped, the
    released fraction is exactly ``1/2 - rows / (2 m)`` of the batch that was trained."""
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_data(), batch_size=B), noise_multiplier=1.0,
                     max_grad_norm=1e-9, clipping="adaptive", target_unclipped_quantile=0.5,
                     sampling="fixed", seed=2, max_physical_batch_size=3)
    p.optimizer.noise.normal = lambda std, like: torch.zeros_like(like)
    for k, (x, y) in enumerate(p.data_loader):  # two chunks of a logical batch, then left
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        if k == 1:
            break
    assert p.accountant.steps == 0
    rows = 0
    with pytest.warns(RuntimeWarning, match="left unfinished"):
        for x, y in p.data_loader:
            rows += len(y)
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if p.accountant.steps == 1:
                break
    assert rows == B
    assert p.optimizer.last_unclipped_fraction == pytest.approx(0.5 - rows / (2 * B),
                                                               abs=1e-12)


@pytest.mark.parametrize("bound,gamma", [(1e-9, 1.0), (1e9, 0.0)],
                         ids=["overflow", "underflow"])
def test_a_bound_out_of_float_range_raises_after_an_accounted_step(bound, gamma):
    """eta = 2000 with every example clipped and gamma = 1 (or none clipped and
    gamma = 0): exp(-eta (b - gamma)) overflows (underflows to a bound of 0). That raised
    Python's OverflowError (or a max_grad_norm error naming nothing the caller set) in the
    middle of the step's bookkeeping, which then skipped moving the noise source past the
    step: a checkpoint taken next held the key of the noise just released. Now a
    ConfigurationError names clipbound_learning_rate; the step is accounted, the bound
    kept, and the noise key moved on as after any step."""
    from privlearn.errors import ConfigurationError

    p = _make(clipping="adaptive", target_unclipped_quantile=gamma, max_grad_norm=bound,
              clipbound_learning_rate=2000.0, sampling="fixed", seed=4)
    p.optimizer.noise.normal = lambda std, like: torch.zeros_like(like)  # b exactly 0 or 1
    key = p.optimizer.noise.seed
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(ConfigurationError, match="clipbound_learning_rate"):
        p.optimizer.step()
    assert p.optimizer.last_unclipped_fraction == pytest.approx(1.0 - gamma, abs=1e-12)
    assert p.accountant.steps == 1
    assert p.optimizer.max_grad_norm == bound
    assert p.optimizer.noise.seed != key
    assert p.state_dict()["noise"]["seed"] != key


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_bound_sequence_matches_opacus_adaclip_where_comparable():
    """Opacus 1.6's AdaClipDPOptimizer on the same batches (fixed size m: Opacus divides
    the count by the realised batch size, the engine by the expected one, which agree
    only then), without gradient noise and with a count noise of std 1e-12 on both
    sides: the same geometric update, so the same bounds step after step and the same
    parameters (to Opacus's 1e-6 in its clip factor). Opacus counts the uncentred
    number of unclipped examples; with n = m the fraction is the same."""
    opacus = pytest.importorskip("opacus")
    from opacus.optimizers import AdaClipDPOptimizer

    gamma, eta, lr, c0 = 0.6, 0.5, 0.3, 0.05
    ds = _data()
    model = _mlp()
    twin = copy.deepcopy(model)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                     DataLoader(ds, batch_size=B), noise_multiplier=0.0, max_grad_norm=c0,
                     clipping="adaptive", target_unclipped_quantile=gamma,
                     clipbound_learning_rate=eta, unclipped_num_std=1e-12,
                     sampling="fixed", seed=SEED)
    gsm = opacus.GradSampleModule(twin)
    opt = AdaClipDPOptimizer(torch.optim.SGD(twin.parameters(), lr=lr), noise_multiplier=0.0,
                             target_unclipped_quantile=gamma, clipbound_learning_rate=eta,
                             max_clipbound=1e9, min_clipbound=1e-9, unclipped_num_std=1e-12,
                             max_grad_norm=c0, expected_batch_size=B)
    ours, theirs = [], []
    for _ in range(2):
        for x, y in p.data_loader:
            assert len(y) == B
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            opt.zero_grad()
            nn.functional.cross_entropy(gsm(x), y).backward()
            opt.step()
            ours.append(p.optimizer.max_grad_norm)
            theirs.append(float(opt.max_grad_norm))
    assert len(set(ours)) == len(ours) > 4  # the bound moved every step
    assert ours == pytest.approx(theirs, rel=1e-6)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
