"""autodp's legacy ``subsample_epsdelta`` helpers round on the safe side: checked in
50-digit arithmetic (mpmath) against the amplification formula of Li, Qardaji & Su
(2012), Theorem 1, ``eps' = log(1 + q (e^eps - 1))``, ``delta' = q delta``."""

from __future__ import annotations

import random

import mpmath as mp
import pytest

from privlearn.compat.autodp import privacy_calibrator as pc


def _amplified(eps: float, q: float) -> mp.mpf:
    with mp.workdps(50):
        return mp.log1p(mp.mpf(q) * mp.expm1(mp.mpf(eps)))


def _cases(n: int = 300):
    rng = random.Random(7)
    for _ in range(n):
        et = 10 ** rng.uniform(-3, 1)
        yield et, min(et * 10 ** rng.uniform(0, 3), 2000.0), 10 ** rng.uniform(-6, 0)


def test_forward_amplification_is_never_below_the_exact_value():
    for _, eb, q in _cases():
        eps, delta = pc.subsample_epsdelta(eb, 1e-5, q)
        assert _amplified(eb, q) <= eps
        with mp.workdps(50):
            assert mp.mpf(q) * mp.mpf(1e-5) <= delta


def test_inverse_base_amplifies_to_at_most_the_target_and_is_tight():
    for et, _, q in _cases():
        e0, d0 = pc.subsample_epsdelta_inverse(et, 1e-5, q)
        exact = _amplified(e0, q)
        assert exact <= et  # it exceeded eps by an ulp in about half of the cases
        assert exact >= et * (1 - 1e-12)
        with mp.workdps(50):
            assert mp.mpf(q) * mp.mpf(d0) <= mp.mpf(1e-5)


def test_largest_rate_amplifies_to_at_most_the_target():
    for et, eb, _ in _cases():
        q = pc.subsample_epsdelta_get_prob(et, 1e-5, eb, 1e-9)
        assert _amplified(eb, q) <= et
        with mp.workdps(50):
            assert mp.mpf(q) * mp.mpf(1e-9) <= mp.mpf(1e-5)


def test_a_base_epsilon_beyond_the_float_range_gives_a_rate_not_an_overflow():
    # e^1000 overflows floats (it raised OverflowError); the rate is below 1e-300
    assert 0.0 <= pc.subsample_epsdelta_get_prob(1.0, 1e-5, 1000.0, 0.0) < 1e-300
    e0, _ = pc.subsample_epsdelta_inverse(800.0, 1e-5, 0.5)
    assert _amplified(e0, 0.5) <= 800.0


@pytest.mark.parametrize("prob", [0.0, -0.1, 1.5])
def test_inverse_refuses_a_probability_outside_0_1(prob):
    with pytest.raises(ValueError, match="prob must be in"):
        pc.subsample_epsdelta_inverse(0.5, 1e-6, prob)
