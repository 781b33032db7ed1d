"""ApproxDP: a generic (epsilon, delta)-DP release, composed by the PLD accountant through
its four-outcome worst-case pair (Kairouz, Oh & Viswanath 2015)."""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import ApproxDP, Gaussian, compose
from privlearn.accounting.serialization import dumps, loads
from privlearn.errors import UnsupportedMechanismError


def _exact_delta(eps: float, d: float, k: int, t: float) -> float:
    """k-fold composition of the (eps, d) pair: an infinite-loss outcome unless every
    step avoids its delta atom, else k-fold binary randomized response (binomial sum)."""
    p = 1 / (1 + math.exp(-eps))
    r = 1 - p
    rr = sum(math.comb(k, i) * max(0.0, p ** (k - i) * r**i - math.exp(t) * p**i * r ** (k - i))
             for i in range(k + 1))
    return 1 - (1 - d) ** k + (1 - d) ** k * rr


@pytest.mark.parametrize("eps,d,k", [(1.0, 1e-6, 1), (0.5, 1e-5, 5), (0.3, 1e-7, 20)])
def test_composition_against_the_closed_form(eps, d, k):
    m = compose(ApproxDP(eps, d), steps=k)
    for t in (0.0, 0.5 * eps * k, 0.9 * eps * k, eps * k + 1.0):
        b = m.delta_bounds(t)
        exact = _exact_delta(eps, d, k, t)
        assert b.lower <= exact * (1 + 1e-9)
        assert exact <= b.upper * (1 + 1e-9) and b.upper <= exact * 1.01 + 1e-12


def test_one_release_spends_its_own_epsilon_at_a_little_more_delta():
    assert ApproxDP(1.3, 0.99e-6).epsilon(1e-6) == pytest.approx(1.3, abs=1e-4)
    assert ApproxDP(1.3, 0.99e-6).epsilon(1e-6) >= 1.3 - 1e-4
    # composed with a Gaussian it costs more than the Gaussian alone
    g = Gaussian(2.0)
    assert compose([g, ApproxDP(0.5, 1e-7)]).epsilon(1e-5) > g.epsilon(1e-5)


def test_no_rdp_guarantee_and_storable():
    with pytest.raises(UnsupportedMechanismError):
        ApproxDP(1.0, 1e-6).epsilon(1e-5, "rdp")
    m = compose([ApproxDP(1.0, 1e-6), Gaussian(3.0)])
    assert loads(dumps(m)) == m


@pytest.mark.parametrize("eps,d", [(-1.0, 1e-6), (1.0, 0.0), (1.0, 1.0), (math.nan, 1e-6)])
def test_bad_parameters(eps, d):
    with pytest.raises(ValueError, match="dp_"):
        ApproxDP(eps, d)


def test_epsilon_at_exactly_its_delta_is_refused_not_rounded_down():
    from privlearn.errors import CertificationError

    with pytest.raises(CertificationError):
        ApproxDP(1.0, 1e-6).epsilon(1e-6)
    with pytest.raises(CertificationError):  # below the mass at infinity: nothing certifies
        ApproxDP(1.0, 1e-6).epsilon(1e-7)


def _mp_delta(parts, t):
    """delta(t) of the composition of (eps_i, delta_i)-DP worst-case pairs, k_i times
    each, enumerated in 60-digit arithmetic (independent of the library): P-mass
    ``1 - prod (1 - delta_i)^k_i`` at +inf, and the product of binomials (randomized
    response with ``p_i = e^eps_i / (1 + e^eps_i)``) for the rest."""
    import itertools

    import mpmath

    with mpmath.workdps(60):
        fin = mpmath.mpf(1)
        for _, d, k in parts:
            fin *= (1 - mpmath.mpf(d)) ** k
        total = mpmath.mpf(0)
        for js in itertools.product(*[range(k + 1) for _, _, k in parts]):
            p_mass = q_mass = mpmath.mpf(1)
            for (e, _, k), j in zip(parts, js, strict=True):
                p = mpmath.e ** e / (1 + mpmath.e ** e)
                c = mpmath.binomial(k, j)
                p_mass *= c * p ** j * (1 - p) ** (k - j)
                q_mass *= c * (1 - p) ** j * p ** (k - j)
            total += max(mpmath.mpf(0), p_mass - mpmath.e ** t * q_mass)
        return 1 - fin + fin * total


@pytest.mark.parametrize("parts,delta", [
    # delta just above the mass at infinity (1 - (1 - 1e-7)^100 = 9.99995e-6): the
    # grid's bracket was [4.31, 6.70] around 6.378
    ([(0.1, 1e-7, 100)], 1e-5),
    ([(1.0, 1e-8, 10)], 1e-6),
    ([(0.5, 1e-6, 8), (0.2, 1e-9, 30)], 1e-5),
])
def test_epsilon_of_approx_dp_compositions_is_exact(parts, delta):
    """The composition of (eps, delta) steps is exact (Kairouz, Oh & Viswanath 2015,
    Theorem 3.3): the certified bracket holds the 60-digit value and is tight."""
    m = compose([ApproxDP(e, d) for e, d, _ in parts], steps=[k for *_, k in parts])
    b = m.epsilon_bounds(delta)
    # delta(upper) <= target <= delta(lower) on the exact profile
    assert float(_mp_delta(parts, b.upper)) <= delta * (1 + 1e-12)
    assert float(_mp_delta(parts, b.lower)) >= delta * (1 - 1e-12)
    assert b.upper - b.lower <= 1e-8 * b.upper
    d = m.delta_bounds(b.upper)
    assert d.lower <= float(_mp_delta(parts, b.upper)) <= d.upper <= delta * (1 + 1e-9)


def test_approx_dp_composed_with_pure_dp_and_randomized_response_is_exact():
    from privlearn.accounting import PureDP, RandomizedResponse

    m = compose([ApproxDP(0.4, 1e-7), PureDP(0.3), RandomizedResponse(0.6)], steps=[20, 10, 5])
    rr_eps = math.log(0.6 / 0.4)  # binary randomized response is rr_eps-DP, tight
    parts = [(0.4, 1e-7, 20), (0.3, 0.0, 10), (rr_eps, 0.0, 5)]
    b = m.epsilon_bounds(1e-5)
    assert float(_mp_delta(parts, b.upper)) <= 1e-5 * (1 + 1e-12)
    assert float(_mp_delta(parts, b.lower)) >= 1e-5 * (1 - 1e-12)
    assert b.upper - b.lower <= 1e-8 * b.upper


def _small():
    from hypothesis import HealthCheck, settings

    return settings(max_examples=5, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _hyp():
    from hypothesis import given
    from hypothesis import strategies as st

    part = st.tuples(st.floats(0.0, 2.0), st.floats(-10.0, -3.0).map(lambda x: 10.0 ** x),
                     st.integers(1, 25))
    return given(parts=st.lists(part, min_size=1, max_size=2),
                 extra=st.floats(1e-3, 1.0))


@_small()
@_hyp()
def test_approx_dp_bracket_holds_the_exact_profile(parts, extra):
    """Any delta above the mass at infinity: the bracket holds the 60-digit epsilon,
    the grid's bracket (with a negligible Gaussian part, so no closed form applies) is
    never below its lower end, and epsilon and delta invert each other."""
    mass = 1.0 - math.prod((1.0 - d) ** k for _, d, k in parts)
    delta = min(mass * (1.0 + extra) + 1e-12, 0.5)
    m = compose([ApproxDP(e, d) for e, d, _ in parts], steps=[k for *_, k in parts])
    b = m.epsilon_bounds(delta)
    assert math.isfinite(b.upper) and 0.0 <= b.lower <= b.upper
    assert float(_mp_delta(parts, b.upper)) <= delta * (1 + 1e-12)
    if b.lower > 0:
        assert float(_mp_delta(parts, b.lower)) >= delta * (1 - 1e-12)
    assert m.delta_bounds(b.upper).upper <= delta * (1 + 1e-9)
    grid = compose([m, Gaussian(1e4)]).epsilon_bounds(delta)
    assert grid.upper >= b.lower


def test_refusal_at_its_own_delta_says_which_delta_to_pass():
    from privlearn.errors import CertificationError

    with pytest.raises(CertificationError, match="pass a delta above 1e-06") as info:
        ApproxDP(1.0, 1e-6).epsilon(1e-6)
    assert "accountant='rdp'" in str(info.value)
    # the advice works: just above its own delta the epsilon is (close to) its own
    assert ApproxDP(1.0, 1e-6).epsilon(2e-6) == pytest.approx(1.0, abs=1e-5)
