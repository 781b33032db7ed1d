"""autodp's sparse vector technique mechanisms, their RDP functions, ``dp_acct`` and the
stage-wise SVT bound, run once on autodp 0.2.3.1 (test-only peer) and
once on the facade: every RDP value equal to autodp's to 1e-12 relative (same closed
forms, Zhu & Wang 2020), every epsilon no larger than autodp's beyond 1e-9 relative, and
the optimal-composition accountant never looser than autodp's Kairouz-Oh-Viswanath
relaxation and never below the exact optimal composition."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from privlearn.accounting import PureDP, compose
from privlearn.compat.autodp import dp_acct, dp_bank, mechanism_zoo, rdp_bank

autodp = pytest.importorskip("autodp")
from autodp import dp_acct as a_dp_acct  # noqa: E402
from autodp import dp_bank as a_dp_bank  # noqa: E402
from autodp import mechanism_zoo as a_mz  # noqa: E402
from autodp import rdp_bank as a_rdp_bank  # noqa: E402

REL = 1e-9
ORDERS = [1.0, 1.5, 2.0, 5.0, 32.0, 200.0]

RDP_CASES = [
    ("RDP_svt_laplace", dict(b=1.0, k=100, c=1)),
    ("RDP_svt_laplace", dict(b=0.5, k=10, c=3)),
    ("RDP_svt_laplace", dict(b=3.0, k=1000, c=10)),
    ("RDP_gaussian_svt_cgreater1", dict(sigma=1.0, k=100, c=2)),
    ("RDP_gaussian_svt_cgreater1", dict(sigma=5.0, k=1000, c=10)),
    ("RDP_gaussian_svt_c1", dict(sigma=1.0, k=100)),
    ("RDP_gaussian_svt_c1", dict(sigma=2.0, k=50, sigma_nu=5.0, margin=1.0)),
    ("RDP_gaussian_svt_c1", dict(sigma=2.0, sigma_nu=4.0, margin=0.5)),
    ("RDP_noisy_screen", dict(logp=-0.1, logq=-0.3)),
    ("RDP_noisy_screen", dict(logp=-5.0, logq=-3.0)),
]


@pytest.mark.parametrize("fn,params", RDP_CASES)
def test_rdp_functions_equal_autodp(fn, params):
    for a in ORDERS:
        if a == 1.0 and fn.startswith("RDP_gaussian_svt"):
            continue  # autodp divides by alpha - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ref = float(getattr(a_rdp_bank, fn)(dict(params), a))
        ours = float(getattr(rdp_bank, fn)(dict(params), a))
        if math.isinf(ref):
            assert ours <= ref
        else:
            assert ours <= ref * (1 + 1e-12) + 1e-15 and ours >= ref * (1 - 1e-12) - 1e-15


MECH_CASES = [
    ("NoisyScreenMechanism", (dict(logp=-0.5, logq=-1.0),), {}),
    ("GaussianSVT_Mechanism", (dict(sigma=2.0, k=100),), {}),
    ("GaussianSVT_Mechanism", (dict(sigma=2.0, sigma_nu=5.0, margin=1.0),), {}),
    ("GaussianSVT_Mechanism", (dict(sigma=3.0, k=100, c=5),), dict(rdp_c_1=False)),
    ("LaplaceSVT_Mechanism", (dict(b=5.0, k=100, c=3),), {}),
    ("StageWiseMechanism", (dict(sigma=2.0, k=50, c=9),), {}),
]


@pytest.mark.parametrize("name,args,kw", MECH_CASES)
def test_svt_mechanisms_never_looser_than_autodp(name, args, kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = getattr(a_mz, name)(*args, **kw)
        ours = getattr(mechanism_zoo, name)(*args, **kw)
        for d in (1e-3, 1e-6, 1e-9):
            e_ref, e_ours = ref.get_approxDP(d), ours.get_approxDP(d)
            assert e_ours <= e_ref * (1 + REL)
            assert e_ours >= 0.5 * e_ref  # the same mechanism: the same order of magnitude
    assert ours.name == ref.name and ours.params == ref.params


def test_svt_composes_with_other_mechanisms():
    from privlearn.compat.autodp.transformer_zoo import Composition

    svt = mechanism_zoo.LaplaceSVT_Mechanism(dict(b=5.0, k=100, c=3))
    g = mechanism_zoo.GaussianMechanism(sigma=3.0)
    both = Composition()([svt, g], [2, 1])
    assert both.get_approxDP(1e-6) > max(svt.get_approxDP(1e-6), g.get_approxDP(1e-6))


@pytest.mark.parametrize("losses", [
    [(0.1, 1e-7)] * 20,
    [(0.5, 1e-6), (0.2, 0.0), (1.0, 1e-8), (0.05, 1e-9)] * 5,
    [(1.0, 0.0)] * 3,
])
def test_dp_acct_optimal_composition(losses):
    ref, ours = a_dp_acct.DP_acct(), dp_acct.DP_acct()
    for e, d in losses:
        ref.update_DPlosses(e, d)
        ours.update_DPlosses(e, d)
    for delta in (1e-2, 1e-3, 1e-5, 1e-6):
        r, o = ref.get_eps(delta), ours.get_eps(delta)
        assert o <= r * (1 + REL) or (math.isinf(r) and math.isinf(o))
        # and equal to the exact optimal composition of the pure parts at the remaining delta
        keep = np.prod([1 - d for _, d in losses])
        if 1 - delta < keep:
            d_pure = 1 - (1 - delta) / keep
            exact = compose([PureDP(e) for e, _ in losses]).epsilon(d_pure)
            assert o == pytest.approx(exact, rel=1e-9)
    assert ours.get_minimum_possible_delta() == pytest.approx(ref.get_minimum_possible_delta())
    assert ours.get_eps_delta_naive() == pytest.approx(ref.get_eps_delta_naive())


@pytest.mark.parametrize("params", [dict(sigma=1.0, k=10, c=4), dict(sigma=3.0, k=100, c=16),
                                    dict(sigma=2.0, k=50, c=1)])
def test_stagewise_svt_epsilon_never_looser(params):
    for d in (1e-5, 1e-3):
        assert dp_bank.get_eps_gaussian_svt(params, d) <= \
            a_dp_bank.get_eps_gaussian_svt(params, d) * (1 + REL)


def test_bad_svt_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="params\\['k'\\]"):
        rdp_bank.RDP_gaussian_svt_c1(dict(sigma=2.0, sigma_nu=2.0), 2.0)
    with pytest.raises(ValueError, match="b must be > 0"):
        mechanism_zoo.LaplaceSVT_Mechanism(dict(b=0.0, k=10, c=1))
    with pytest.raises(ValueError, match="logp and logq"):
        rdp_bank.RDP_noisy_screen(dict(logp=0.5, logq=-1.0), 2.0)
    with pytest.raises(ValueError, match="delta"):
        dp_acct.DP_acct().update_DPlosses(1.0, 2.0)
