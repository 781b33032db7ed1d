"""fp16 dynamic loss scaling: ``torch.amp.GradScaler`` drives the DP optimizer.

The clipped sum refers to the unscaled loss; an example whose scaled gradient overflows
contributes zero without skipping the step or lowering the scale; the scaler's decisions
depend on the noisy gradient only; a skipped step is accounted."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import GradientOverflowWarning, TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

FP16_TOL = 1e-2  # relative error of the clipped sum: fp16 rounding (2^-11) over layers

if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):  # pragma: no cover
    pytest.skip("torch.amp.GradScaler is not available", allow_module_level=True)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 3))


def _ce(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def _mse(out, y):
    return nn.functional.mse_loss(out.float(), y)


def _flat(params, grads=None):
    if grads is None:
        grads = [q.grad for q in params]
    return torch.cat([g.reshape(-1).double() for g in grads])


def _private(model, x, y, *, batch_size=16, noise_multiplier=0.0, max_grad_norm=1.0, lr=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=batch_size),
                        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                        seed=0)


def _scaled_step(p, scaler, xb, yb, loss_fn, device="cpu", dtype=torch.float16,
                 unscale_first=False):
    p.optimizer.grad_scaler = scaler
    p.optimizer.zero_grad()
    with torch.autocast(device, dtype=dtype):
        loss = loss_fn(p.model(xb), yb)
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(p.optimizer)
    scaler.step(p.optimizer)
    scaler.update()


def _first_batch(p):
    return next(iter(p.data_loader))


def _data(n=64, loss="ce"):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    if loss == "ce":
        return x, torch.randint(0, 3, (n,), generator=g)
    return x, torch.randn(n, 3, generator=g)


# --------------------------------------------------------------------------- (a)
def test_fp16_scaler_clipped_sum_matches_float32(oracle):
    """fp16 autocast + GradScaler with noise 0: the noisy gradient is the clipped sum of
    the unscaled per-example gradients (naive float32 loop), to fp16 tolerance, at a
    bound that clips about half the examples; the float32 engine agrees tightly."""
    x, y = _data()
    model, naive = _mlp(), _mlp()
    p = _private(model, x, y, max_grad_norm=1.0)
    xb, yb = _first_batch(p)
    _, norms = oracle.clipped_sum(naive, xb, yb, float("inf"), _ce)
    c = norms.median().item()
    ref_sum, _ = oracle.clipped_sum(naive, xb, yb, c, _ce)
    clipped = (norms > c).float().mean().item()
    assert 0.3 <= clipped <= 0.7
    m = p.optimizer.expected_batch_size
    params = list(model.parameters())

    p.optimizer.max_grad_norm = c
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientOverflowWarning)
        _scaled_step(p, scaler, xb, yb, _ce)
    assert p.optimizer.last_overflow_count == 0
    assert not p.optimizer.last_step_skipped
    assert scaler.get_scale() == 65536.0  # no back-off
    assert p.accountant.steps == 1
    got = _flat(params) * m
    assert all(q.grad.dtype == torch.float32 for q in params)
    err = ((got - ref_sum).norm() / ref_sum.norm()).item()
    assert 0 < err < FP16_TOL  # fp16 was used (not exact) and unscaled (close)

    # the float32 engine on the same batch: same mechanism, float32 rounding
    model32 = _mlp()
    p32 = _private(model32, x, y, max_grad_norm=c)
    xb32, yb32 = _first_batch(p32)
    assert torch.equal(xb32, xb)
    p32.optimizer.zero_grad()
    _ce(p32.model(xb32), yb32).backward()
    p32.optimizer.step()
    got32 = _flat(list(model32.parameters())) * m
    assert ((got32 - ref_sum).norm() / ref_sum.norm()).item() < 1e-5
    assert ((got - got32).norm() / got32.norm()).item() < FP16_TOL


def test_scaler_scale_is_divided_out_at_any_scale(oracle):
    """Very different scales give the clipped sum of the unscaled gradients (a scale
    reaching the clip would clip every example)."""
    x, y = _data()
    for init in (8.0, 4096.0):
        model, naive = _mlp(), _mlp()
        p = _private(model, x, y)
        xb, yb = _first_batch(p)
        _, norms = oracle.clipped_sum(naive, xb, yb, float("inf"), _ce)
        c = norms.median().item()
        ref_sum, _ = oracle.clipped_sum(naive, xb, yb, c, _ce)
        p.optimizer.max_grad_norm = c
        _scaled_step(p, torch.amp.GradScaler("cpu", init_scale=init), xb, yb, _ce)
        got = _flat(list(model.parameters())) * p.optimizer.expected_batch_size
        assert ((got - ref_sum).norm() / ref_sum.norm()).item() < FP16_TOL


# --------------------------------------------------------------------------- (b)
def test_overflowing_example_contributes_zero(oracle):
    """A planted example whose scaled gradient overflows fp16 is left out (zero
    contribution), the others' contributions are unchanged, the step is taken, the
    scale is not backed off, and a warning says so."""
    x, y = _data(loss="mse")
    model, naive = _mlp(), _mlp()
    p = _private(model, x, y, max_grad_norm=1.0, lr=0.1)
    xb, yb = _first_batch(p)
    yb = yb.clone()
    yb[3] = 1e6  # its output gradient 2e6 / B * scale overflows fp16 (max 65504)
    _, norms = oracle.clipped_sum(naive, xb, yb, float("inf"), _mse)
    c = norms[torch.arange(len(norms)) != 3].median().item()
    ref_sum, _ = oracle.clipped_sum(naive, xb, yb, c, _mse, skip=(3,))
    params = list(model.parameters())
    before = [q.detach().clone() for q in params]
    p.optimizer.max_grad_norm = c
    init = 1024.0
    scaler = torch.amp.GradScaler("cpu", init_scale=init)
    with pytest.warns(GradientOverflowWarning, match="1 example"):
        _scaled_step(p, scaler, xb, yb, _mse)
    assert p.optimizer.last_overflow_count == 1
    assert not torch.isfinite(p.optimizer.last_grad_norms[3])
    assert torch.isfinite(p.optimizer.last_grad_norms[torch.arange(len(xb)) != 3]).all()
    got = _flat(params) * p.optimizer.expected_batch_size
    assert torch.isfinite(got).all()
    assert ((got - ref_sum).norm() / ref_sum.norm()).item() < FP16_TOL
    assert not p.optimizer.last_step_skipped
    assert any(not torch.equal(b, q.detach()) for b, q in zip(before, params, strict=True))
    assert scaler.get_scale() == init
    assert p.accountant.steps == 1


@pytest.mark.parametrize("during_backward", [False, True], ids=["at_step", "in_backward"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
@pytest.mark.parametrize("shape,width", [((6, 4), 4), ((6, 3, 4), 4), ((6, 2, 64), 64)],
                         ids=["dense", "materialised", "ghost"])
def test_overflow_in_one_row_does_not_reach_the_others_through_matmuls(shape, width,
                                                                       per_layer,
                                                                       during_backward):
    """inf * 0 = nan inside the clipped sum's matmul (dense, materialised and ghost
    Linear rules, evaluated at the step or, without the first step's probe, during
    backward): the overflowing example's rows are cleaned before any reduction over
    examples, so the others' clipped sum is exactly theirs."""
    from privlearn.torch.tracker import GradSampleTracker

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))

    model, ref_model = build(), build()
    torch.manual_seed(1)
    x = torch.randn(*shape)
    x.view(6, -1)[2, 1] = float("inf")  # a non-finite activation of example 2
    keep = [0, 1, 3, 4, 5]
    tracker = GradSampleTracker(model, loss_reduction="sum",
                                check_independence=not during_backward)
    ref = GradSampleTracker(ref_model, loss_reduction="sum")
    try:
        w = 0.5  # four parameters: sum of w^2 = 1
        model(x).sum().backward()
        pp = {id(q): w for q in model.parameters()} if per_layer else None
        sums, _, norms = tracker.clipped_sum(1.0, per_param=pp)
        ref_model(x[keep]).sum().backward()
        pp = {id(q): w for q in ref_model.parameters()} if per_layer else None
        ref_sums, _, ref_norms = ref.clipped_sum(1.0, per_param=pp)
    finally:
        tracker.detach()
        ref.detach()
    assert tracker.last_overflow_count == 1
    assert torch.isinf(norms[2])
    torch.testing.assert_close(norms[keep], ref_norms)
    for q, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.isfinite(sums[id(q)]).all()
        torch.testing.assert_close(sums[id(q)], ref_sums[id(r)])


class _Gain(nn.Module):
    """A layer without a rule (the generic fallback, which does not drop examples by
    their weight alone): the overflowing examples' records are then cleaned and every
    rule evaluated again."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.w


@pytest.mark.parametrize("t", [1, 3, 40], ids=["dense", "materialised", "ghost"])
def test_overflow_dropped_from_rules_evaluated_during_backward(t):
    """Outer-product and embedding rules evaluated during backward (no first-step probe
    here), next to a layer that cannot drop an example by its weight: the example whose
    gradient is not finite is removed from what they hold, and the others' clipped sum
    and norms are exactly theirs."""
    from privlearn.torch.tracker import GradSampleTracker

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), _Gain(8), nn.Tanh(),
                             nn.Linear(8, 2))

    model, ref_model = build(), build()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (6, t), generator=g)
    weights = torch.ones(6, 1, 1)
    weights[2] = float("inf")  # example 2's loss, and so its gradients, overflow
    keep = [0, 1, 3, 4, 5]
    tracker = GradSampleTracker(model, loss_reduction="sum", check_independence=False)
    ref = GradSampleTracker(ref_model, loss_reduction="sum", check_independence=False)
    try:
        (model(ids) * weights).sum().backward()
        assert all(r.early is not None for i, recs in tracker.records.items()
                   for r in recs if not isinstance(tracker.units[i].module, _Gain))
        sums, _, norms = tracker.clipped_sum(1.0)
        ref_model(ids[keep]).sum().backward()
        ref_sums, _, ref_norms = ref.clipped_sum(1.0)
    finally:
        tracker.detach()
        ref.detach()
    assert tracker.last_overflow_count == 1
    assert not torch.isfinite(norms[2])
    torch.testing.assert_close(norms[keep], ref_norms)
    for q, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.isfinite(sums[id(q)]).all()
        torch.testing.assert_close(sums[id(q)], ref_sums[id(r)])


# --------------------------------------------------------------------------- (c)
def _poison_noisy_gradient(monkeypatch, opt):
    """Make the noisy gradient of the next steps non-finite (after the DP step)."""
    release = opt._release

    def poisoned():
        release()
        opt.tracker.params[0].grad.view(-1)[0] = float("nan")

    monkeypatch.setattr(opt, "_release", poisoned)


def _noisy_run_and_scaler():
    """A private MLP (noise on), its parameters, their values now, a GradScaler at 1024."""
    x, y = _data()
    model = _mlp()
    p = _private(model, x, y, noise_multiplier=1.0, lr=0.1)
    params = list(model.parameters())
    before = [q.detach().clone() for q in params]
    return p, params, before, torch.amp.GradScaler("cpu", init_scale=1024.0)


def test_nonfinite_noisy_gradient_skips_the_update_backs_off_and_is_accounted(monkeypatch):
    p, params, before, scaler = _noisy_run_and_scaler()
    _poison_noisy_gradient(monkeypatch, p.optimizer)
    xb, yb = _first_batch(p)
    _scaled_step(p, scaler, xb, yb, _ce)
    assert p.optimizer.last_step_skipped
    assert all(torch.equal(b, q.detach()) for b, q in zip(before, params, strict=True))
    assert p.accountant.steps == 1  # the batch was consumed and a gradient released
    assert scaler.get_scale() == 512.0  # backed off on the noisy gradient
    monkeypatch.undo()
    xb, yb = _first_batch(p)
    _scaled_step(p, scaler, xb, yb, _ce)  # the next batch: a normal step
    assert not p.optimizer.last_step_skipped
    assert p.accountant.steps == 2
    assert scaler.get_scale() == 512.0


def test_scaler_ignores_what_it_sees_in_p_grad_before_the_step():
    """GradScaler's own inf check (on p.grad before the step) is not what decides: a
    non-finite p.grad left there does not skip the step nor back off the scale."""
    p, params, before, scaler = _noisy_run_and_scaler()
    p.optimizer.grad_scaler = scaler
    xb, yb = _first_batch(p)
    p.optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _ce(p.model(xb), yb)
    scaler.scale(loss).backward()
    for q in params:
        q.grad = torch.full_like(q, float("inf"))  # what GradScaler's own check reads
    scaler.step(p.optimizer)
    scaler.update()
    assert not p.optimizer.last_step_skipped
    assert all(torch.isfinite(q.grad).all() for q in params)
    assert any(not torch.equal(b, q.detach()) for b, q in zip(before, params, strict=True))
    assert scaler.get_scale() == 1024.0


# --------------------------------------------------------------------------- (d)
def test_unscale_before_step_warns_and_changes_nothing():
    """scaler.unscale_(p.optimizer) before step: there is nothing to unscale (p.grad is
    made by the DP step); a warning says so once, and the step is the same."""
    x, y = _data()
    grads = []
    for unscale in (False, True):
        model = _mlp()
        p = _private(model, x, y, max_grad_norm=0.5)
        xb, yb = _first_batch(p)
        scaler = torch.amp.GradScaler("cpu")
        if unscale:
            with pytest.warns(UserWarning, match="nothing to unscale"):
                _scaled_step(p, scaler, xb, yb, _ce, unscale_first=True)
        else:
            _scaled_step(p, scaler, xb, yb, _ce)
        grads.append(_flat(list(model.parameters())))
        assert p.accountant.steps == 1
        assert scaler.get_scale() == 65536.0
    torch.testing.assert_close(grads[1], grads[0])


def test_unscale_warning_is_given_once():
    x, y = _data()
    p = _private(_mlp(), x, y)
    scaler = torch.amp.GradScaler("cpu")
    it = iter(p.data_loader)
    with pytest.warns(UserWarning, match="nothing to unscale"):
        _scaled_step(p, scaler, *next(it), _ce, unscale_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _scaled_step(p, scaler, *next(it), _ce, unscale_first=True)


def test_step_with_found_inf_outside_a_scaler_is_refused():
    x, y = _data()
    p = _private(_mlp(), x, y)
    xb, yb = _first_batch(p)
    _ce(p.model(xb), yb).backward()
    p.optimizer.grad_scale = torch.tensor(4.0)
    p.optimizer.found_inf = torch.tensor(0.0)
    with pytest.raises(RuntimeError, match="GradScaler that the DP optimizer was not given"):
        p.optimizer.step()


# --------------------------------------------------------------------------- virtual
def test_virtual_batches_under_scaler():
    """Physical chunks (max_physical_batch_size): every scaler.step divides by the scale
    of its chunk; one accounted step per logical batch."""
    x, y = _data()
    sums = []
    for physical in (None, 4):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        p = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=16),
                         noise_multiplier=0.0, max_grad_norm=0.5, seed=0,
                         max_physical_batch_size=physical)
        scaler = torch.amp.GradScaler("cpu")
        for xb, yb in p.data_loader:
            _scaled_step(p, scaler, xb, yb, _ce)
            if p.accountant.steps == 1:
                break
        sums.append(_flat(list(model.parameters())))
    assert ((sums[0] - sums[1]).norm() / sums[0].norm()).item() < FP16_TOL


# --------------------------------------------------------------------------- (e) CUDA
@pytest.mark.gpu
def test_cuda_fp16_scaler_matches_float32(oracle):
    x, y = _data()
    model, naive = _mlp().cuda(), _mlp().cuda()
    p = _private(model, x.cuda(), y.cuda(), max_grad_norm=1.0)
    xb, yb = _first_batch(p)
    _, norms = oracle.clipped_sum(naive, xb, yb, float("inf"), _ce)
    c = norms.median().item()
    ref_sum, _ = oracle.clipped_sum(naive, xb, yb, c, _ce)
    p.optimizer.max_grad_norm = c
    scaler = torch.amp.GradScaler("cuda")
    _scaled_step(p, scaler, xb, yb, _ce, device="cuda")
    got = _flat(list(model.parameters())) * p.optimizer.expected_batch_size
    assert ((got - ref_sum).norm() / ref_sum.norm()).item() < FP16_TOL
    assert scaler.get_scale() == 65536.0
    assert p.accountant.steps == 1


@pytest.mark.gpu
def test_cuda_overflowing_example_contributes_zero(oracle):
    x, y = _data(loss="mse")
    model, naive = _mlp().cuda(), _mlp().cuda()
    p = _private(model, x.cuda(), y.cuda(), max_grad_norm=1.0, lr=0.1)
    xb, yb = _first_batch(p)
    yb = yb.clone()
    yb[3] = 1e6
    _, norms = oracle.clipped_sum(naive, xb, yb, float("inf"), _mse)
    c = norms[torch.arange(len(norms), device="cuda") != 3].median().item()
    ref_sum, _ = oracle.clipped_sum(naive, xb, yb, c, _mse, skip=(3,))
    p.optimizer.max_grad_norm = c
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    with pytest.warns(GradientOverflowWarning):
        _scaled_step(p, scaler, xb, yb, _mse, device="cuda")
    got = _flat(list(model.parameters())) * p.optimizer.expected_batch_size
    assert ((got - ref_sum).norm() / ref_sum.norm()).item() < FP16_TOL
    assert not p.optimizer.last_step_skipped
    assert scaler.get_scale() == 1024.0


def test_a_direct_step_of_a_run_given_a_scaler_is_refused_until_the_scaler_steps(oracle):
    """``make_private(..., grad_scaler=scaler)``, ``scaler.scale(loss).backward()`` and
    then ``p.optimizer.step()`` instead of ``scaler.step(p.optimizer)``: the recorded
    gradients carry the scale (1024) and nothing divides it out, so every example was
    clipped at C / 1024 and the scaler never adapted, silently. Refused before anything
    is released; ``scaler.step`` then takes the same batch's step, whose gradient is the
    naive clipped sum of the unscaled loss. A disabled scaler scales nothing: its run
    steps directly as any other."""
    x, y = _data(n=64)
    model = _mlp()
    ref = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                     DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=0.0,
                     max_grad_norm=0.5, seed=0, grad_scaler=scaler)
    xb, yb = _first_batch(p)
    p.optimizer.zero_grad()
    scaler.scale(_ce(p.model(xb), yb)).backward()
    with pytest.raises(TrainingLoopError, match=r"scaler\.step\(p\.optimizer\)"):
        p.optimizer.step()
    assert p.accountant.steps == 0 and all(q.grad is None for q in model.parameters())
    scaler.step(p.optimizer)
    scaler.update()
    total, _ = oracle.clipped_sum(ref, xb, yb, 0.5, _ce)
    assert p.accountant.steps == 1
    torch.testing.assert_close(_flat(list(model.parameters())), total / 16, rtol=1e-4,
                               atol=1e-6)
    off = torch.amp.GradScaler("cpu", enabled=False)
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                     DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=0.0,
                     max_grad_norm=0.5, seed=0, grad_scaler=off)
    xb, yb = _first_batch(p)
    p.optimizer.zero_grad()
    off.scale(_ce(p.model(xb), yb)).backward()
    p.optimizer.step()
    assert p.accountant.steps == 1
