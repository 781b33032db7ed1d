"""Google dp_accounting's pld/accountant_test.py families (noise for a privacy target,
advanced composition and its inverse) through privlearn's ``calibrate`` and optimal
composition, and the calibration of a parameter that moves the mass at infinity.

dp_accounting's values come from its pessimistic PLD (or from the advanced composition
theorem, Dwork, Rothblum & Vadhan 2010): privlearn's certified answers must meet the same
target with no more noise than the peer's (up to the peer's stated tolerance), and never
miss the target.
"""

from __future__ import annotations

import pytest

from privlearn.accounting import (
    ApproxDP,
    CalibrationError,
    CertificationError,
    Gaussian,
    Laplace,
    PureDP,
    calibrate,
    compose,
    subsample,
)


@pytest.mark.parametrize(
    "sensitivity, eps, delta, queries, expected",
    [
        # test_get_smallest_laplace_noise (dp_accounting checks to 0.1)
        (21, 3, 0, 10, 70),
        (1, 1, 1e-4, 20, 13.6),
        (0.5, 1, 1e-4, 20, 6.8),
        (1, 1, 1e-4, 500, 71.0),
    ],
)
def test_smallest_laplace_noise(sensitivity, eps, delta, queries, expected) -> None:
    def mech(b: float):
        return compose(Laplace(b), queries)

    b = calibrate(mech, eps, delta)
    assert mech(b).epsilon(delta) <= eps
    assert expected - 0.1 <= sensitivity * b <= expected + 0.1
    if delta == 0:  # pure: the sum of the per-query epsilons, exactly
        assert sensitivity * b == pytest.approx(sensitivity * queries / eps, rel=1e-5)


@pytest.mark.parametrize(
    "sensitivity, eps, delta, queries, expected",
    [
        # test_get_smallest_gaussian_noise (7 places): delta 0.78760074 is the exact delta of
        # the Gaussian with mu = 3 at epsilon 1
        (1, 1, 0.78760074, 1, 1 / 3),
        (6, 1, 0.78760074, 25, 10),
    ],
)
def test_smallest_gaussian_noise(sensitivity, eps, delta, queries, expected) -> None:
    def mech(s: float):
        return compose(Gaussian(s), queries)

    s = calibrate(mech, eps, delta, rtol=1e-10)
    assert mech(s).epsilon(delta) <= eps
    assert sensitivity * s == pytest.approx(expected, abs=5e-8)


@pytest.mark.parametrize(
    "eps, delta, queries, sensitivity, q, expected",
    [
        # test_get_smallest_subsampled_gaussian_noise (7 places, dp_accounting's own
        # pessimistic PLD): privlearn's certified answer is within 1e-5 relative of it
        (1, 1e-5, 1, 1, 0.01, 0.67379294682),
        (1, 1e-5, 25, 6, 0.001, 3.20956502598),
    ],
)
def test_smallest_subsampled_gaussian_noise(eps, delta, queries, sensitivity, q, expected) -> None:
    def mech(s: float):
        return compose(subsample(Gaussian(s), q), queries)

    s = calibrate(mech, eps, delta, rtol=1e-9)
    assert mech(s).epsilon(delta) <= eps
    assert sensitivity * s == pytest.approx(expected, rel=1e-5)


def _part(eps: float, delta: float):
    return PureDP(eps) if delta == 0 else ApproxDP(eps, delta)


@pytest.mark.parametrize(
    "eps, delta, total_delta, queries, expected",
    [
        # test_advanced_composition: the theorem's total epsilon; privlearn composes the
        # (eps, delta) parts optimally (Kairouz, Oh & Viswanath 2015), so it is never larger
        (1, 0, 0, 30, 30),
        (1, 0.001, 0.06, 30, 22),
        (1, 0.001, 0.1, 30, 20),
    ],
)
def test_advanced_composition(eps, delta, total_delta, queries, expected) -> None:
    total = compose([_part(eps, delta)] * queries).epsilon(total_delta)
    assert total <= expected
    if delta == 0:
        assert total == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "eps, delta, total_delta, queries",
    [
        # total_delta_too_small, total_delta_too_small2: the parts' own deltas already
        # exceed the total (1 - (1 - delta)^k > total delta): no epsilon holds
        (1, 0.2, 0.1, 1),
        (1, 0.01, 0.26, 30),
    ],
)
def test_advanced_composition_total_delta_too_small(eps, delta, total_delta, queries) -> None:
    assert 1 - (1 - delta) ** queries > total_delta
    with pytest.raises(CertificationError, match="mass at infinity"):
        compose([_part(eps, delta)] * queries).epsilon(total_delta)


@pytest.mark.parametrize(
    "total_eps, total_delta, delta, queries, expected",
    [
        # test_get_smallest_epsilon_from_advanced_composition: the per-query epsilon whose
        # composition meets the total; optimal composition allows at least as much
        (30, 0, 0, 30, 1),
        (22, 0.06, 0.001, 30, 1),
        (5, 0.01, 0, 50, 0.25),
    ],
)
def test_epsilon_per_query_for_a_total(total_eps, total_delta, delta, queries, expected) -> None:
    def mech(e: float):
        return compose([_part(e, delta)] * queries)

    e = calibrate(mech, total_eps, total_delta, rtol=1e-9)
    assert mech(e).epsilon(total_delta) <= total_eps
    assert e >= expected * (1 - 1e-6)
    if delta == 0 and total_delta == 0:
        assert e == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "total_eps, total_delta, delta, queries",
    [
        (1, 0.1, 0.2, 1),
        (30, 0.26, 0.01, 30),
    ],
)
def test_epsilon_per_query_total_delta_too_small(total_eps, total_delta, delta, queries) -> None:
    # dp_accounting answers None; privlearn's calibrate raises CalibrationError (not the
    # accountant's CertificationError from its first probe) and says why
    with pytest.raises(CalibrationError, match="mass at infinity"):
        calibrate(lambda e: compose([_part(e, delta)] * queries), total_eps, total_delta)


def test_calibration_past_parameters_that_cannot_be_certified() -> None:
    # the sampling rate of an (epsilon, delta)-DP step moves the mass at infinity, q d:
    # at q = 1 it is above the target delta 5e-4 (no epsilon holds there) but below
    # q = 1/2 it is not. The largest certifiable rate is the answer; the first probe
    # (q = 1) used to end the search with the accountant's CertificationError
    d, target_delta = 1e-3, 5e-4

    def mech(q: float):
        return subsample(ApproxDP(1.0, d), q)

    q = calibrate(mech, 5.0, target_delta, bounds=(1e-3, 1.0), rtol=1e-2)
    assert mech(q).epsilon(target_delta) <= 5.0
    # the binding limit is the mass at infinity: at q = 1/2 it reaches delta
    assert q <= 0.5 and q == pytest.approx(0.5, rel=2e-2)
    with pytest.raises(CertificationError):
        mech(0.5).epsilon(target_delta)
