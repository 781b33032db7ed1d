"""The facade's legacy calibrators (``privacy_calibrator``) and ``DP_acct`` on random and
edge configurations: every returned parameter meets its (eps, delta) target when
evaluated forward with the same accountant -- exactly, not within a tolerance -- and
``DP_acct`` answers every history autodp's does (steps with epsilon 0, pure DP at
delta 0).

References: the pure-DP closed forms (k runs of ``Laplace(b)`` are ``(k / b, 0)``-DP;
randomized response with truth probability ``p`` is ``(log(p / (1 - p)), 0)``-DP and has
``eps(delta) = eps0 + log(1 - delta / p)``; Kairouz, Oh & Viswanath 2015).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privlearn.accounting import (
    Laplace,
    RandomizedResponse,
    RDPMechanism,
    compose,
    subsample,
)
from privlearn.compat.autodp import privacy_calibrator as pc
from privlearn.compat.autodp import rdp_bank
from privlearn.compat.autodp.dp_acct import DP_acct
from privlearn.errors import AutodpCalibrationError


def _rdp_gaussian_epsilon(sigma: float, q: float, k: int, delta: float) -> float:
    """Forward epsilon of what the calibrators search: ``k`` runs of the RDP function
    ``RDP_gaussian({'sigma': sigma})``, Poisson-subsampled at ``q < 1``, RDP accountant."""
    base = RDPMechanism(lambda a: rdp_bank.RDP_gaussian({"sigma": sigma}, a))
    if q < 1:
        base = subsample(base, q)
    return compose(base, steps=k).epsilon(delta, "rdp")


# ---------------------------------------------------------------------------------------
# subsampled_RDP_mech_get_prob / RDP_mech: the root is taken on the feasible side, also
# where epsilon jumps (the RDP accountant's epsilon leaves 0 discontinuously)
# ---------------------------------------------------------------------------------------
@pytest.mark.slow  # ~15 s: each evaluation is a generic subsampled RDP curve
def test_get_prob_stays_below_a_jump_of_epsilon() -> None:
    # at this configuration the RDP epsilon jumps from 0 to ~0.093 near q = 1.2e-7:
    # Brent's root sat on the upper side of the jump, 14% above the target
    s, k, d, e = 1.6660559436115423, 264, 1.2999226116829843e-06, 0.08116800197385253
    q = pc.subsampled_RDP_mech_get_prob(rdp_bank.RDP_gaussian, e, d, {"sigma": s}, k=k)
    assert 0 < q < 1
    assert _rdp_gaussian_epsilon(s, q, k, d) <= e


def test_get_prob_below_the_smallest_rate_is_a_typed_refusal() -> None:
    with pytest.raises(AutodpCalibrationError, match="infeasible"):
        pc.subsampled_RDP_mech_get_prob(rdp_bank.RDP_gaussian, 1e-3, 1e-12, {"sigma": 0.1},
                                        k=10**6)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(e=st.floats(0.01, 50.0), log_d=st.floats(-12, -2), k=st.integers(1, 1000),
       s=st.floats(0.5, 10.0))
def test_get_prob_meets_its_target(e: float, log_d: float, k: int, s: float) -> None:
    d = 10.0 ** log_d
    try:
        q = pc.subsampled_RDP_mech_get_prob(rdp_bank.RDP_gaussian, e, d, {"sigma": s}, k=k)
    except AutodpCalibrationError:
        return
    assert _rdp_gaussian_epsilon(s, q, k, d) <= e


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(e=st.floats(0.01, 50.0), log_d=st.floats(-12, -2), k=st.integers(1, 1000))
def test_rdp_mech_meets_its_target(e: float, log_d: float, k: int) -> None:
    # without subsampling: a subsampled generic RDP curve costs seconds per evaluation
    # (the subsampled search shares _feasible_root with get_prob, fuzzed above)
    d, q = 10.0 ** log_d, 1.0
    s = pc.RDP_mech(rdp_bank.RDP_gaussian, e, d, "sigma", {"sigma": 1.0}, k=k,
                    prob=q)["sigma"]
    assert _rdp_gaussian_epsilon(s, q, k, d) <= e


# ---------------------------------------------------------------------------------------
# laplace_mech / randresponse_mech: the pure-DP closed form is rounded to the safe side
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps, delta, k", [
    (29.78177869779331, 3.3775031515109675e-07, 10),  # b = k / eps: k / b rounds above eps
    (1.123863002013866, 0.0, 17),
    (11.979782630400603, 0.0, 78),
])
def test_laplace_mech_meets_its_target_exactly(eps: float, delta: float, k: int) -> None:
    b = pc.laplace_mech(eps, delta, k=k)["b"]
    assert b == pytest.approx(k / eps, rel=1e-12)  # the closed form, up to rounding
    assert compose(Laplace(b), steps=k).epsilon(delta) <= eps


@pytest.mark.parametrize("eps, delta, k", [
    (0.26257685545426024, 0.0, 731),  # log(p / (1 - p)) rounds above eps / k
    (1.0, 0.0, 5),
])
def test_randresponse_mech_meets_its_target_exactly(eps: float, delta: float, k: int) -> None:
    p = pc.randresponse_mech(eps, delta, k=k)["p"]
    assert p == pytest.approx(1.0 / (1.0 + math.exp(-eps / k)), rel=1e-12)
    assert compose(RandomizedResponse(p), steps=k).epsilon(delta) <= eps


# ---------------------------------------------------------------------------------------
# DP_acct
# ---------------------------------------------------------------------------------------
def test_dp_acct_takes_a_step_with_epsilon_zero() -> None:
    # a (0, 1e-6)-DP step (e.g. a release known only to be (0, delta)-DP) used to make
    # get_eps raise (PureDP(0) refused); it only adds its delta
    acct = DP_acct()
    acct.update_DPlosses(0.0, 1e-6)
    assert acct.get_eps(1e-5) == 0.0
    assert acct.get_eps(1e-7) == math.inf  # below the minimum delta
    acct.update_DPlosses(0.5, 0.0)
    # randomized response at eps0 = 0.5 (truth probability p): eps0 + log(1 - delta~ / p)
    # with 1 - 1e-5 = (1 - delta~)(1 - 1e-6)
    d_pure = 1.0 - (1.0 - 1e-5) / (1.0 - 1e-6)
    p = 1.0 / (1.0 + math.exp(-0.5))
    expected = 0.5 + math.log1p(-d_pure / p)
    assert expected <= acct.get_eps(1e-5) <= expected * (1 + 1e-9)


def test_dp_acct_pure_steps_at_delta_zero_is_the_sum() -> None:
    # pure DP composes to the sum of the epsilons at delta = 0 (autodp answers inf)
    acct = DP_acct()
    acct.update_DPlosses(1.0, 0.0)
    acct.update_DPlosses(0.5, 0.0)
    assert acct.get_eps(0.0) == 1.5
    acct.update_DPlosses(math.inf, 0.0)
    assert acct.get_eps(1e-5) == math.inf
