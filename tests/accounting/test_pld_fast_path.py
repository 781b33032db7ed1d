"""The fast path of the certified PLD accountant at very low sampling rates (q = 1e-5):
the direct low-frequency recomputation on each single-step PMF's bulk (its tail through
one FFT), the refinement loop shared by ``epsilon()`` and ``delta()`` and the refusal of
tilted grids that cannot reduce the allowance. Certification is checked against the exact
composition of Gaussian mechanisms (Balle & Wang 2018, Theorem 8, evaluated here with
``scipy.special.log_ndtr``), against the plain FFT bracket, and by monotonicity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import special

from privlearn.accounting import Gaussian, compose, pld, subsample
from privlearn.accounting import _pld_fft as fft
from privlearn.accounting._pld_profile import delta_at, delta_upper


def _gaussian_delta(mu: float, eps: float) -> float:
    """Exact delta(eps) of N(mu, 1) against N(0, 1) (mu = sqrt(T) / sigma for T steps)."""
    a = special.log_ndtr(-eps / mu + mu / 2.0)
    b = special.log_ndtr(-eps / mu - mu / 2.0)
    return float(math.exp(a) - math.exp(eps + b))


def _spy_bulk(monkeypatch) -> list[tuple[int, int, int]]:
    seen: list[tuple[int, int, int]] = []
    orig = fft._bulk_range

    def spy(p):
        lo, hi = orig(p)
        seen.append((lo, hi, p.size))
        return lo, hi

    monkeypatch.setattr(fft, "_bulk_range", spy)
    return seen


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sigma=st.floats(0.7, 4.0), steps=st.integers(2, 3000),
       quantile=st.floats(1e-9, 0.3))
def test_accurate_composition_is_certified_against_the_exact_gaussian(
        monkeypatch, sigma, steps, quantile):
    # the accurate (directly recomputed) composition of T Gaussian steps brackets the
    # exact composed curve, at an epsilon where delta spans 1e-9 .. 0.3
    seen = _spy_bulk(monkeypatch)
    mu = math.sqrt(steps) / sigma
    # an epsilon where the exact delta is about `quantile`
    eps = max(0.0, mu * mu / 2.0 + mu * float(special.ndtri(1.0 - quantile)))
    acc = pld.PLDAccountant(n_target=1 << 12)
    res = acc._compute(pld._parts(compose(Gaussian(sigma), steps)), 1.0, True)
    exact = _gaussian_delta(mu, eps)
    up = delta_upper(res, eps)
    lo = max(delta_at(low, eps, False) for _, low in res.directions)
    assert up >= exact * (1 - 1e-9) - 1e-300
    assert lo <= exact * (1 + 1e-9) + 1e-300
    assert seen  # the bulk/tail recomputation ran


def test_bulk_range_leaves_out_about_the_tail_fraction():
    rng = np.random.default_rng(1)
    p = rng.random(1000) ** 8
    p /= p.sum()
    lo, hi = fft._bulk_range(p)
    out = p[:lo].sum() + p[hi:].sum()
    assert 0 < out <= fft._TAIL_FRAC * 1.0001
    # a PMF with all its mass on one point but a light tail: the bulk is that point
    q = np.full(10_000, 1e-9)
    q[5000] = 1.0 - q.sum() + 1e-9
    lo, hi = fft._bulk_range(q)
    assert lo <= 5000 < hi and hi - lo <= 2


def test_heavy_tailed_step_accurate_allowance_is_small_and_brackets_overlap():
    # q = 1e-5: all but 1e-5 of each step's mass on a few grid points, the rest spread
    # over the window (350k points). The accurate composition must bring the FFT
    # allowance below 1% of delta = 1e-8 (a term-by-term sum over whole PMFs could
    # afford a few dozen frequencies and left 5% of it), and both certified brackets
    # overlap.
    m = compose(subsample(Gaussian(0.8), 1e-5), 20_000)
    acc = pld.PLDAccountant()
    parts = pld._parts(m)
    plain = acc._compute(parts, 1.0, False)
    accurate = acc._compute(parts, 1.0, True)
    assert accurate.slack() < 0.01 * 1e-8 < plain.slack()
    eps = 0.0135
    for a, b in ((plain, accurate), (accurate, plain)):
        lo_a = max(delta_at(low, eps, False) for _, low in a.directions)
        assert lo_a <= delta_upper(b, eps)


@pytest.fixture(scope="module")
def _low_rate_eps():
    cache: dict[tuple, pld.PrivacyBound] = {}

    def get(q: float, sigma: float, steps: int):
        key = (q, sigma, steps)
        if key not in cache:
            cache[key] = pld.PLDAccountant(n_target=1 << 13).epsilon(
                compose(subsample(Gaussian(sigma), q), steps), 1e-8)
        return cache[key]
    return get


@pytest.mark.slow  # 10-40 s
@pytest.mark.parametrize("small,large", [
    ((1e-5, 0.8, 10_000), (1e-5, 0.8, 20_000)),  # more steps
    ((1e-5, 0.9, 10_000), (1e-5, 0.8, 10_000)),  # less noise
    ((1e-5, 0.8, 10_000), (2e-5, 0.8, 10_000)),  # higher sampling rate
])
def test_low_rate_epsilon_is_monotone(_low_rate_eps, small, large):
    a, b = _low_rate_eps(*small), _low_rate_eps(*large)
    # the true epsilons are ordered, so the certified brackets are consistent with it...
    assert a.lower <= b.upper
    # ...and, these configurations being well apart, so are the returned upper ends
    assert a.upper < b.upper


@pytest.mark.slow  # 10-30 s
def test_delta_stops_early_like_epsilon(monkeypatch):
    # delta() refines through the same loop as epsilon(): with max_gap = rel_gap it
    # refines further than with the default, and both brackets are certified (overlap)
    m = compose(subsample(Gaussian(0.8), 1e-5), 20_000)
    eps = 0.0138
    calls: list[float] = []
    orig = pld.PLDAccountant._compute

    def spy(self, parts, h_scale, *args):
        calls.append(h_scale)
        return orig(self, parts, h_scale, *args)

    monkeypatch.setattr(pld.PLDAccountant, "_compute", spy)
    fast = pld.PLDAccountant(rel_gap=0.001, max_gap=0.05).delta(m, eps)
    n_fast = len(calls)
    calls.clear()
    full = pld.PLDAccountant(rel_gap=0.001, max_gap=0.001).delta(m, eps)
    assert len(calls) > n_fast
    assert fast.lower <= full.upper and full.lower <= fast.upper
    assert 0 < fast.lower <= fast.upper


def test_useless_tilt_is_refused_before_composing(monkeypatch):
    # q = 1e-5, sigma 0.8: the Chernoff factor of the heavy single-step tail stays near
    # 0.35, so the tilted grid (millions of points) would not reduce the allowance
    m = compose(subsample(Gaussian(0.8), 1e-5), 20_000)
    acc = pld.PLDAccountant(n_target=1 << 14)
    with pytest.raises(pld._NoTiltGain):
        acc._compute(pld._parts(m), 1.0, True, 0.0138)


@pytest.mark.slow  # about 15 s
def test_delta_at_the_returned_epsilon_is_near_the_target():
    # q = 1e-5, sigma 0.6: the plain grid's allowance (1.7e-6) is above delta itself; a
    # Chernoff bound used to answer delta() (4x the target at the epsilon whose delta is
    # certified to be 1e-8) without trying the accurate composition
    m = compose(subsample(Gaussian(0.6), 1e-5), 100_000)
    e = pld.PLDAccountant().epsilon(m, 1e-8)
    d = pld.PLDAccountant().delta(m, e.upper)
    # (the true delta at e.upper is <= 1e-8: the lower end cannot exceed it)
    assert d.lower <= 1e-8 and d.upper <= 1.1e-8
