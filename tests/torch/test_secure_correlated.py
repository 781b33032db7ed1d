"""Correlated noise in secure mode gets DP-SGD's secure rounding.

A secure DP-SGD step releases ``x + std * Z`` formed in float64 and rounded once to the
gradient's dtype (the floating-point attack's mitigation, Mironov 2012). A secure
correlated-noise step must release ``x + std * (C^{-1} z)_t`` the same way: ``z`` drawn in
float64, the recurrence run on float64 buffers, one rounding at the end. The ground truth
is the NumPy reference generator (:mod:`privlearn.correlated.noise`, float64) run on the
very draws the step took, and NumPy's own float64 -> float32 / float16 conversion (one
correctly rounded conversion); bfloat16 against the nearest of its neighbouring values.
A float32 draw and recurrence (rounded at every step) differs from it by several units in
the last place for most coordinates.
"""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.correlated import BufferedToeplitz  # noqa: E402
from privlearn.correlated.noise import CorrelatedNoise as ReferenceNoise  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch._secure_correlated import (  # noqa: E402
    add_rounded_,
    add_secure_correlated_,
)
from privlearn.torch.correlated_noise import CorrelatedNoise  # noqa: E402
from privlearn.torch.noise import NoiseSource  # noqa: E402


def _private(secure, noise, extra, d_in=30, d_out=20):
    torch.manual_seed(0)
    model = nn.Linear(d_in, d_out)
    x = torch.randn(60, d_in, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DP-SGD-would-be-better notes)
        return make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            DataLoader(TensorDataset(x), batch_size=6),
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            sampling="balls_in_bins",
            epochs=2,
            secure_mode=secure,
            seed=None if secure else 3,
            noise=noise,
            **extra,
        )


def _record(p, steps):
    """Run ``steps`` steps; returns the draws ``z`` of each step and, for each step,
    ``(std, sums before the noise, sums after it, batch size)`` (flat tensors; a secure
    balls-in-bins batch is unseeded and may be empty)."""
    opt = p.optimizer
    draws, adds = [], []
    fill = opt.noise.fill_normal_

    def recording_fill(out, std):
        fill(out, std)
        draws.append(out.detach().clone())
        return out

    into = opt._correlated_into

    sizes = []

    def recording_into(std, add):
        views = [opt._out[id(q)] for q in opt.tracker.params]
        before = torch.cat([v.reshape(-1).clone() for v in views])
        into(std, add)
        after = torch.cat([v.reshape(-1).clone() for v in views])
        adds.append((std, before, after, sizes[-1]))

    opt.noise.fill_normal_ = recording_fill
    opt._correlated_into = recording_into
    taken = 0
    while taken < steps:
        for (x,) in p.data_loader:
            sizes.append(len(x))
            opt.zero_grad()
            p.model(x).sum().backward()
            opt.step()
            taken += 1
            if taken == steps:
                break
    return draws, adds


def _ulps32(a, b):
    """Distance in float32 units in the last place (same-sign finite values)."""
    a = np.asarray(a, dtype=np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(b, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.abs(a - b)


@pytest.mark.parametrize("noise,extra", [("banded", {"bands": 3}), ("blt", {"buffers": 3})])
def test_secure_correlated_step_is_float64_C_inverse_z_rounded_once(noise, extra):
    steps = 10
    p = _private(True, noise, extra)
    draws, adds = _record(p, steps)
    # one float64 draw per step (no frozen streams here), float64 state
    assert len(draws) == steps and all(z.dtype == torch.float64 for z in draws)
    assert p.optimizer.correlated.state_dict()["buffers"].dtype == torch.float64
    assert p.state_dict()["correlated"]["buffers"].dtype == torch.float64
    ref = ReferenceNoise(p.optimizer.correlated.recurrence, shape=(draws[0].numel(),))
    mismatched = total = 0
    for z, (std, before, after, size) in zip(draws, adds, strict=True):
        assert before.dtype == after.dtype == torch.float32
        # the clipped sums are there (an empty batch adds the noise to zeros)
        assert (before.abs().max() > 0) == (size > 0)
        exact = before.double().numpy() + std * ref.step(z.numpy())  # float64
        want = exact.astype(np.float32)  # one correctly rounded conversion
        got = after.numpy()
        # the float64 noise agrees with the reference to ~1e-16 relative: the rounded
        # values agree except where that sits on a float32 rounding boundary (odds ~1e-8)
        assert _ulps32(got, want).max() <= 1
        mismatched += int((got != want).sum())
        total += got.size
    assert mismatched <= 2, f"{mismatched} of {total} values not the once-rounded sum"


def test_default_mode_keeps_float32_draws_and_state():
    """The default mode is unchanged: float32 draws and buffers for float32 parameters."""
    p = _private(False, "blt", {"buffers": 3})
    draws, adds = _record(p, 3)
    assert all(z.dtype == torch.float32 for z in draws)
    assert p.optimizer.correlated.state_dict()["buffers"].dtype == torch.float32


def _recurrence():
    return BufferedToeplitz(output_scale=(0.3, 0.2), buf_decay=(0.9, 0.5)).recurrence()


def test_add_secure_correlated_writes_the_once_rounded_float64_noise():
    """Without ``add``: ``std * (C^{-1} z)_t`` rounded once, for two parameters."""
    rec, n, std = _recurrence(), (7, 5), 0.37
    gen, ref = CorrelatedNoise(rec), ReferenceNoise(rec, shape=(sum(n),))
    noise = NoiseSource(seed=5)
    check = NoiseSource(seed=5)  # replays the same float64 draws
    for _ in range(6):
        targets = [torch.full((k,), 9.0) for k in n]
        add_secure_correlated_(gen, noise, targets, std, add=False)
        z = check.fill_normal_(torch.empty(sum(n), dtype=torch.float64), 1.0)
        want = (std * ref.step(z.numpy())).astype(np.float32)
        np.testing.assert_array_equal(torch.cat(targets).numpy(), want)
    assert gen.state_dict()["buffers"].dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_add_rounded_rounds_the_float64_sum_once(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g, dtype=torch.float64) * 4).to(dtype)
    e = torch.randn(20000, generator=g, dtype=torch.float64)
    std = 0.3
    exact = x.double().numpy() + std * e.numpy()
    got = x.clone()
    add_rounded_(got, e.clone(), std, add=True)
    if dtype == torch.bfloat16:  # no NumPy bfloat16: the nearest of the neighbours
        lo = torch.from_numpy(exact).to(dtype)  # through float32: maybe one unit off
        cands = torch.stack(
            [
                lo,
                torch.nextafter(lo, lo.new_full((), -np.inf)),
                torch.nextafter(lo, lo.new_full((), np.inf)),
            ]
        )
        dist = (cands.double() - torch.from_numpy(exact)).abs()
        best = dist.min(0).values
        assert torch.equal((got.double() - torch.from_numpy(exact)).abs(), best)
    else:
        want = exact.astype({torch.float16: np.float16, torch.float32: np.float32}[dtype])
        np.testing.assert_array_equal(got.numpy(), want)
    # a non-contiguous target: the same values
    y = x.clone().view(100, 200).t()
    add_rounded_(y, e.view(100, 200).t().contiguous().clone(), std, add=True)
    assert torch.equal(y.t().reshape(-1), got)


def test_secure_state_round_trips_and_an_old_float32_state_is_upcast():
    rec, n, std = _recurrence(), 12, 1.0
    source = NoiseSource(seed=1)
    a = CorrelatedNoise(rec)
    for _ in range(4):
        add_secure_correlated_(a, source, [torch.zeros(n)], std, add=True)
    saved = io.BytesIO()
    torch.save({"noise": source.state_dict(), "correlated": a.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    assert state["correlated"]["buffers"].dtype == torch.float64
    rest = [torch.zeros(n) for _ in range(3)]
    for t in rest:
        add_secure_correlated_(a, source, [t], std, add=True)
    b, again = CorrelatedNoise(rec), NoiseSource(seed=0)
    b.load_state_dict(state["correlated"])
    again.load_state_dict(state["noise"])
    for t in rest:
        u = torch.zeros(n)
        add_secure_correlated_(b, again, [u], std, add=True)
        assert torch.equal(u, t)
    # a state saved before secure mode kept float64 buffers (float32): loaded, and made
    # float64 on the next step, it continues from those float32 past noises exactly
    old = copy.deepcopy(state["correlated"])
    old["buffers"] = old["buffers"].float()
    c, d = CorrelatedNoise(rec), CorrelatedNoise(rec)
    c.load_state_dict(old)
    up = dict(old, buffers=old["buffers"].double())
    d.load_state_dict(up)
    s1, s2 = NoiseSource(seed=9), NoiseSource(seed=9)
    u, v = torch.zeros(n), torch.zeros(n)
    add_secure_correlated_(c, s1, [u], std, add=True)
    add_secure_correlated_(d, s2, [v], std, add=True)
    assert torch.equal(u, v)
    assert c.state_dict()["buffers"].dtype == torch.float64


def test_the_streams_of_frozen_parameters_are_drawn_in_float64_too():
    rec, source = _recurrence(), NoiseSource(seed=2)
    gen, drawn = CorrelatedNoise(rec), []

    def draw(out):
        drawn.append(out.dtype)
        return source.fill_normal_(out, 1.0)

    both = (("a", 3), ("b", 4))
    add_secure_correlated_(gen, source, [torch.zeros(3), torch.zeros(4)], 1.0, True, both, draw)
    add_secure_correlated_(gen, source, [torch.zeros(3)], 1.0, True, (("a", 3),), draw)
    assert drawn == [torch.float64]  # "b", frozen, still advances its stream
    assert gen.state_dict()["buffers"].dtype == torch.float64
    assert gen.state_dict()["buffers"].shape == (2, 7)
