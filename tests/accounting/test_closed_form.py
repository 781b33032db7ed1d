"""Exact closed forms (privlearn.accounting.closed_form) against independent ground truth:

* brute-force enumeration of every output sequence of small compositions, in 60-digit
  arithmetic (mpmath), with delta(eps) = sum_outputs max(0, P - e^eps Q) taken straight
  from the definition of (eps, delta)-DP and eps(delta) found by bisection;
* the Kairouz-Oh-Viswanath (2015) Theorem 3.3 formula at its grid points, in mpmath;
* the Laplace profile by numerical integration of its densities (mpmath.quad).
"""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
from closed_forms import smallest_meeting
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn.accounting import (
    Gaussian,
    Laplace,
    PureDP,
    RandomizedResponse,
    compose,
    subsample,
)
from privlearn.accounting import closed_form as cf

mpmath.mp.dps = 40


# ----------------------------------------------------------------------------------------
# brute force ground truth
# ----------------------------------------------------------------------------------------
def _pair(m):
    """Output distributions (P, Q) of one step's worst case, in mpmath."""
    if isinstance(m, PureDP):
        e = mpmath.e ** mpmath.mpf(m.pure_epsilon)
        p = e / (1 + e)
        return [p, 1 - p], [1 - p, p]
    p = mpmath.mpf(m.truth_probability)
    k = m.num_categories
    r = (1 - p) / (k - 1)
    return [p, r] + ([r * (k - 2)] if k > 2 else []), [r, p] + ([r * (k - 2)] if k > 2 else [])


_OUTCOMES: dict[tuple, list] = {}


def _outcomes(steps) -> list[tuple[mpmath.mpf, mpmath.mpf]]:
    """(P, Q) of every output sequence of the composition (cached)."""
    key = tuple(steps)
    if key not in _OUTCOMES:
        pairs = [_pair(m) for m in steps]
        _OUTCOMES[key] = [
            (
                mpmath.fprod(pairs[i][0][j] for i, j in enumerate(idx)),
                mpmath.fprod(pairs[i][1][j] for i, j in enumerate(idx)),
            )
            for idx in itertools.product(*[range(len(p)) for p, _ in pairs])
        ]
    return _OUTCOMES[key]


def _brute_delta(steps, eps) -> mpmath.mpf:
    """delta(eps) = sum over output sequences of max(0, P - e^eps Q) (definition)."""
    ee = mpmath.e ** mpmath.mpf(eps)
    return mpmath.fsum(max(mpmath.mpf(0), P - ee * Q) for P, Q in _outcomes(steps))


def _brute_epsilon(steps, delta) -> float:
    if _brute_delta(steps, 0) <= delta:
        return 0.0
    return float(smallest_meeting(lambda e: _brute_delta(steps, e), delta, mpmath.mpf(0),
                                  mpmath.mpf(sum(_pure(m) for m in steps)), 75))


def _pure(m) -> float:
    return m.pure_epsilon


# ----------------------------------------------------------------------------------------
# acceptance values
# ----------------------------------------------------------------------------------------
def test_pure_dp_eight_fold_optimal_composition() -> None:
    # Kairouz, Oh & Viswanath 2015: PureDP(0.3) x 8 at delta 1e-6; autodp reports the
    # same value 2.3999156576487093, basic composition 2.4
    steps = [PureDP(0.3)] * 8
    exact = _brute_epsilon(steps, mpmath.mpf("1e-6"))
    got = compose(steps).epsilon(1e-6)
    assert exact == pytest.approx(2.39991566, abs=5e-9)
    assert got >= exact
    assert got == pytest.approx(exact, rel=1e-9)
    lo, up = cf.epsilon_bounds(compose(steps), 1e-6)
    assert lo <= exact <= up


@pytest.mark.parametrize("p", [0.75, 0.9, math.e / (1 + math.e)])
def test_randomized_response_exact(p: float) -> None:
    exact = math.log(p / (1 - p)) + math.log1p(-1e-6 / p)  # eps0 + log(1 - delta/p)
    brute = _brute_epsilon([RandomizedResponse(p)], mpmath.mpf("1e-6"))
    assert brute == pytest.approx(exact, rel=1e-12)
    got = RandomizedResponse(p).epsilon(1e-6)
    assert got >= brute
    assert got == pytest.approx(brute, rel=1e-9)


def test_pure_dp_one_is_below_one_at_delta_1e6() -> None:
    # the 0.9999986: a (1, 0)-DP mechanism is (1 + log(1 - delta/p), delta)-DP
    got = PureDP(1.0).epsilon(1e-6)
    assert got == pytest.approx(0.99999863212, rel=1e-10)
    assert got >= _brute_epsilon([PureDP(1.0)], mpmath.mpf("1e-6"))


@pytest.mark.parametrize("b", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-12, 1e-6, 0.01, 0.3])
def test_laplace_exact_profile(b: float, delta: float) -> None:
    eps0 = 1.0 / b
    # delta(eps) = int (p(x) - e^eps q(x))_+ dx with p = Lap(0, b), q = Lap(1, b)
    def numeric_delta(eps: float) -> mpmath.mpf:
        bb = mpmath.mpf(b)

        def f(x):
            p = mpmath.e ** (-abs(x) / bb) / (2 * bb)
            q = mpmath.e ** (-abs(x - 1) / bb) / (2 * bb)
            return max(mpmath.mpf(0), p - mpmath.e ** mpmath.mpf(eps) * q)

        kink = min(max(b * (eps0 - eps) / 2, 0.0), 1.0)  # where p = e^eps q
        return mpmath.quad(f, [-mpmath.inf, 0, mpmath.mpf(kink), 1, mpmath.inf])

    up = Laplace(b).epsilon(delta)
    expected = max(0.0, eps0 + 2 * math.log1p(-delta))
    assert up == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if up > 0:
        assert numeric_delta(up) <= delta * (1 + 1e-9)  # certified: delta(up) <= delta
        assert numeric_delta(up * (1 - 1e-6)) > delta  # and tight
    lo_d, up_d = cf.laplace_delta(b, 0.5 * eps0)
    nd = float(numeric_delta(0.5 * eps0))
    assert lo_d <= nd * (1 + 1e-12) and nd <= up_d * (1 + 1e-12)
    assert Laplace(b).delta(0.5 * eps0) == pytest.approx(-math.expm1(-0.25 * eps0), rel=1e-12)


def test_laplace_at_1e6_is_exact_value() -> None:
    assert Laplace(1.0).epsilon(1e-6) == pytest.approx(0.999998, rel=1e-9)
    assert Laplace(1.0).epsilon(1e-6) >= 1 + 2 * math.log1p(-1e-6)


# ----------------------------------------------------------------------------------------
# against brute force, heterogeneous and subsampled
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "steps",
    [
        [PureDP(0.3)] * 3 + [PureDP(1.1)] * 2 + [PureDP(0.05)],
        [RandomizedResponse(0.8)] * 4 + [RandomizedResponse(0.4, 5)] * 3,
        [PureDP(2.0), RandomizedResponse(0.6, 3), PureDP(0.7), PureDP(0.7)],
    ],
)
@pytest.mark.parametrize("delta", [1e-9, 1e-4, 0.05])
def test_heterogeneous_against_brute_force(steps, delta: float) -> None:
    exact = _brute_epsilon(steps, mpmath.mpf(delta))
    lo, up = cf.epsilon_bounds(compose(steps), delta)
    assert lo <= exact * (1 + 1e-15) and exact <= up
    assert up <= exact * (1 + 1e-10) + 1e-15
    m = compose(steps)
    eps = 0.5 * exact + 0.1
    d_lo, d_up = m.delta_bounds(eps).lower, m.delta(eps)
    bd = float(_brute_delta(steps, eps))
    assert d_lo <= bd * (1 + 1e-12) and bd <= d_up * (1 + 1e-12)
    assert d_up == pytest.approx(bd, rel=1e-9, abs=1e-300)


@settings(max_examples=25, deadline=None)
@given(
    eps0=st.floats(0.01, 3.0),
    k=st.integers(1, 12),
    delta=st.floats(1e-12, 0.5),
)
def test_homogeneous_matches_kov_theorem(eps0: float, k: int, delta: float) -> None:
    """KOV Theorem 3.3: at eps_i = (k - 2i) eps0 the optimal delta is
    sum_{l<i} C(k,l) (e^{(k-l) eps0} - e^{(k-2i+l) eps0}) / (1 + e^eps0)^k."""
    m = compose(PureDP(eps0), steps=k)
    E = mpmath.e ** mpmath.mpf(eps0)
    for i in range(1, k // 2 + 1):
        d_i = mpmath.fsum(
            math.comb(k, ell) * (E ** (k - ell) - E ** (k - 2 * i + ell)) for ell in range(i)
        ) / (1 + E) ** k
        lo, up = m.delta_bounds((k - 2 * i) * eps0).lower, m.delta((k - 2 * i) * eps0)
        assert lo <= float(d_i) * (1 + 1e-10) and float(d_i) <= up * (1 + 1e-10)
    # epsilon at delta is never below the KOV grid value just below it
    e = m.epsilon(delta)
    assert e <= k * eps0 * (1 + 1e-12)
    assert float(m.delta(e)) <= delta * (1 + 1e-9)


def test_subsampled_pure_dp_matches_numerical_pld_bracket() -> None:
    m = compose(subsample(PureDP(1.0), 0.01), steps=1000)
    lo, up = cf.epsilon_bounds(m, 1e-6)
    assert up - lo <= 1e-9 * up
    # the FFT-based PLD accountant brackets the same exact value
    from privlearn.accounting.pld import PLDAccountant

    numeric = PLDAccountant()._composed(m, list(m.parts), h_scale=1.0)
    u, low = PLDAccountant()._eps_bounds(numeric, 1e-6)
    assert low <= up and lo <= u


def test_subsampled_brute_force_two_directions() -> None:
    """Poisson-subsampled (add/remove) pure DP, 3 steps: the remove and add pairs are
    enumerated by brute force and the worse one is the answer."""
    q, e0 = mpmath.mpf("0.2"), mpmath.mpf("1.5")
    E = mpmath.e**e0
    p = E / (1 + E)
    P, Q = [p, 1 - p], [1 - p, p]
    rem = ([(1 - q) * b + q * a for a, b in zip(P, Q, strict=True)], Q)
    add = (Q, rem[0])

    def delta_of(pair, eps):
        tot = mpmath.mpf(0)
        for idx in itertools.product(range(2), repeat=3):
            pp = mpmath.fprod(pair[0][j] for j in idx)
            qq = mpmath.fprod(pair[1][j] for j in idx)
            tot += max(0, pp - mpmath.e ** mpmath.mpf(eps) * qq)
        return tot

    m = compose(subsample(PureDP(1.5), 0.2), steps=3)
    for eps in [0.0, 0.3, 0.8, 1.2]:
        exact = max(delta_of(rem, eps), delta_of(add, eps))
        assert m.delta(eps) == pytest.approx(float(exact), rel=1e-10, abs=1e-300)
        assert m.delta(eps) >= float(exact) * (1 - 1e-15)


# ----------------------------------------------------------------------------------------
# pure DP of any epsilon (the worst-case pair has atoms with p or q below 1e-300)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps0", [37.5, 40.0, 100.0, 700.0, 5000.0])
def test_pure_dp_any_epsilon(eps0: float) -> None:
    exact = eps0 + math.log1p(-1e-6 * (1 + math.exp(-eps0)))
    assert PureDP(eps0).epsilon(1e-6) == pytest.approx(exact, rel=1e-12)
    assert PureDP(eps0).epsilon(1e-6, "rdp") >= exact * (1 - 1e-12)
    assert compose(PureDP(eps0), steps=3).epsilon(1e-6) <= 3 * eps0 * (1 + 1e-12)
    assert compose(subsample(PureDP(eps0), 0.1), steps=2).epsilon(1e-6) < 2 * eps0


@pytest.mark.parametrize("eps0", [37.5, 45.0, 100.0])
def test_pure_dp_large_epsilon_mixed_with_gaussian(eps0: float) -> None:
    # the numerical PLD (no closed form for the mix) must accept the pair too
    m = compose([PureDP(eps0), Gaussian(1.0)])
    e = m.epsilon(1e-6)
    # basic composition bounds it (the numerical PLD is within 1e-5 of that here)
    assert eps0 < e < eps0 + Gaussian(1.0).epsilon(1e-6) + 1e-4


@pytest.mark.parametrize("eps0", [800.0, 1e6, 1e12])
def test_huge_pure_dp_mixed_with_gaussian_basic_composition(eps0: float) -> None:
    # beyond e^-eps underflow the pair cannot be discretised; basic composition bounds it
    m = compose([PureDP(eps0), Gaussian(1.0)])
    b = m.epsilon_bounds(1e-6)
    g = Gaussian(1.0).epsilon(1e-6)
    assert b.upper == pytest.approx(eps0 + g, rel=1e-12)
    assert b.lower <= b.upper and b.lower >= PureDP(eps0).epsilon(1e-6) * (1 - 1e-12)
    assert m.delta(eps0 + g + 1e-3) <= 1e-6  # (the rounding of E is within 1e-3 here)


def test_too_many_atoms_falls_back() -> None:
    steps = [PureDP(0.1 + 0.01 * i) for i in range(40)]  # 2^40 atoms
    assert cf.discrete_pld(compose(steps)) is None
    e = compose(steps).epsilon(1e-6)  # numerical PLD answers
    assert 0 < e < sum(s.pure_epsilon for s in steps)


def test_pure_dp_composition_epsilon_helper() -> None:
    assert cf.pure_dp_composition_epsilon([0.3] * 8, 1e-6) == pytest.approx(
        2.3999156576487, rel=1e-11
    )
    assert cf.pure_dp_composition_epsilon([], 1e-6) == 0.0


def test_long_randomized_response_tiny_delta() -> None:
    # 1,000 randomized responses at delta 1e-12: exact in closed form
    m = compose(RandomizedResponse(0.75), steps=1000)
    b = m.epsilon_bounds(1e-12)
    assert math.isfinite(b.upper) and b.upper - b.lower <= 1e-9 * b.upper
    assert float(m.delta(b.upper)) <= 1e-12 * (1 + 1e-9)
    assert np.isfinite(m.delta(0.5 * b.upper))


def test_a_rounding_allowance_of_every_mass_leaves_the_lower_bound_at_zero() -> None:
    # after ~1e12 compositions an atom's relative allowance reaches 1: the lower side then
    # bounds each mass by 0 (it raised "math domain error" from log1p(-1)); the upper side
    # doubles the masses, as its allowance says
    from privlearn.accounting.closed_form import DiscretePLD

    pld = DiscretePLD(np.array([0.5, 2.0]), np.log(np.array([0.7, 0.3])), 0.0, 1.0)
    assert pld.delta(0.1, upper=False) == 0.0
    assert pld.epsilon(0.01, upper=False) == 0.0
    exact = 0.7 * -math.expm1(0.1 - 0.5) + 0.3 * -math.expm1(0.1 - 2.0)
    assert pld.delta(0.1, upper=True) == pytest.approx(min(1.0, 2.0 * exact), rel=1e-12)
