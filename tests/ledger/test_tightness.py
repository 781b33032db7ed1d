"""A realistic project history: the ledger's total is the tight composition, far below a
sum-of-epsilons accountant (diffprivlib's BudgetAccountant)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import numpy as np
import pytest

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.ledger import Ledger
from privlearn.models.label_release import label_release_mechanism
from privlearn.models.linear import adassp_mechanism, calibrate_ssp_scale
from privlearn.models.preprocessing import PrivateStandardScaler

DELTA = 1e-5


def _diffprivlib_accountant():
    """diffprivlib's BudgetAccountant. diffprivlib 0.6.6's package __init__ imports its
    models, which fail with scikit-learn >= 1.8 (a private sklearn.tree name); the
    accountant itself needs only numpy, so load it without the package __init__ then."""
    try:
        return importlib.import_module("diffprivlib.accountant").BudgetAccountant
    except ImportError:
        pass
    spec = importlib.util.find_spec("diffprivlib")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("diffprivlib is not installed (pip install privlearn[peers])")
    saved = {k: v for k, v in sys.modules.items() if k == "diffprivlib" or
             k.startswith("diffprivlib.")}
    for k in saved:
        del sys.modules[k]
    pkg = types.ModuleType("diffprivlib")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["diffprivlib"] = pkg
    try:
        return importlib.import_module("diffprivlib.accountant").BudgetAccountant
    finally:
        for k in [k for k in sys.modules if k == "diffprivlib" or k.startswith("diffprivlib.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _history():
    """(label, mechanism) of each release of a year-long project on one dataset."""
    scaler = PrivateStandardScaler(epsilon=0.3, delta=1e-7, feature_range=(0, 100))
    out = [("private scaler", scaler.planned_mechanism(np.zeros((1, 8))))]  # 8 features
    s = calibrate_ssp_scale(0.5, 1e-7, adaptive=True)
    out += [(f"AdaSSP fit {i}", adassp_mechanism(s)) for i in range(20)]
    out.append(("DP-SGD, 60 epochs", compose(subsample(Gaussian(1.1), 256 / 60000),
                                              steps=60 * 60000 // 256)))
    out.append(("PATE, 1000 queries", label_release_mechanism("gaussian", 40.0, 1000)))
    return out


def test_ledger_total_is_tight_and_beats_sum_of_epsilons(tmp_path):
    history = _history()
    led = Ledger(tmp_path / "t.db", create=True)
    led.create_budget("project", epsilon=100.0, delta=DELTA)
    for label, m in history:
        led.spend("project", m, label=label)
    spent = led.spent("project")

    direct = compose([m for _, m in history]).epsilon_bounds(DELTA)
    assert spent.epsilon_spent <= direct.upper
    assert spent.epsilon_lower is not None and spent.epsilon_lower <= spent.epsilon_spent

    # diffprivlib: one (epsilon_i, delta_i) per release, each the tight value for that
    # release alone at delta_i = DELTA / (2 n); the accountant's slack is DELTA / 2, so
    # its total is at the same delta as the ledger's.
    BudgetAccountant = _diffprivlib_accountant()
    n = len(history)
    acc = BudgetAccountant(slack=DELTA / 2)
    for _, m in history:
        acc.spend(m.epsilon(DELTA / (2 * n)), DELTA / (2 * n))
    dpl_eps, dpl_delta = acc.total()
    assert dpl_delta <= DELTA * (1 + 1e-9)
    print(f"ledger {spent.epsilon_spent:.4f} (lower {spent.epsilon_lower:.4f}); direct PLD "
          f"{direct.upper:.4f}; diffprivlib BudgetAccountant {dpl_eps:.4f}; ratio "
          f"{dpl_eps / spent.epsilon_spent:.2f}")
    assert 2 * spent.epsilon_spent <= dpl_eps


def _approx_ledger(tmp_path, epsilon, delta):
    from privlearn.ledger import Ledger as _Ledger

    ledger = _Ledger(tmp_path / "approx.db", create=True)
    ledger.create_budget("d", epsilon=epsilon, delta=delta)
    return ledger


def test_an_approx_dp_release_fills_its_own_budget_exactly(tmp_path):
    # (1, 1e-5)-DP is exactly a (1, 1e-5) budget (basic composition of one release); the
    # PLD's discretisation alone cannot certify any epsilon at a delta equal to the mass
    # at infinity, which refused it
    from privlearn.accounting import ApproxDP
    from privlearn.errors import BudgetExceededError

    ledger = _approx_ledger(tmp_path, 1.0, 1e-5)
    ledger.spend("d", ApproxDP(1.0, 1e-5))
    spent = ledger.spent("d")
    assert spent.epsilon_spent == 1.0
    with pytest.raises(BudgetExceededError):  # nothing more fits
        ledger.spend("d", ApproxDP(1e-9, 1e-12))


def test_approx_dp_releases_summing_to_the_budget_fit(tmp_path):
    # (0.5, 4e-6) twice: sum (1, 8e-6) <= (1, 1e-5) by Dwork & Roth Theorem 3.16; the
    # tight composition is below 1, its certified PLD bound was 1.00001 (refused)
    from privlearn.accounting import ApproxDP
    from privlearn.errors import BudgetExceededError

    ledger = _approx_ledger(tmp_path, 1.0, 1e-5)
    ledger.spend("d", ApproxDP(0.5, 4e-6))
    ledger.spend("d", ApproxDP(0.5, 4e-6))
    spent = ledger.spent("d")
    assert spent.epsilon_spent <= 1.0
    assert spent.epsilon_lower <= spent.epsilon_spent
    with pytest.raises(BudgetExceededError):
        ledger.spend("d", ApproxDP(0.5, 1e-6))  # epsilons past the cap


def test_basic_composition_with_a_gaussian_reads_it_at_the_delta_left(tmp_path):
    from privlearn.accounting import ApproxDP, Gaussian

    ledger = _approx_ledger(tmp_path, 2.0, 1e-5)
    ledger.spend("d", ApproxDP(0.5, 4e-6))
    ledger.spend("d", Gaussian(noise_multiplier=5.0))
    # basic composition: 0.5 + the Gaussian's epsilon at the 6e-6 left, an upper bound
    basic = 0.5 + Gaussian(noise_multiplier=5.0).epsilon(6e-6)
    spent = ledger.spent("d")
    assert spent.epsilon_spent <= basic + 1e-12
    # and never below the tight composition's certified lower bound
    tight = compose([ApproxDP(0.5, 4e-6), Gaussian(noise_multiplier=5.0)]).epsilon_bounds(1e-5)
    assert spent.epsilon_spent >= tight.lower


@pytest.mark.parametrize("accountant", ["rdp", "analytic"])
def test_a_budget_whose_accountant_has_no_curve_for_approx_dp_uses_basic_composition(
        tmp_path, accountant):
    # RDP and the analytic Gaussian accountant have no curve for an (epsilon, delta)
    # statement, but basic composition (Dwork & Roth Theorem 3.16) accounts it: the
    # release was refused with UnsupportedMechanismError instead of admitted at its sum
    from privlearn.accounting import ApproxDP, Gaussian
    from privlearn.errors import BudgetExceededError

    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=2.0, delta=1e-5, accountant=accountant)
    ledger.spend("d", ApproxDP(0.5, 4e-6))
    assert ledger.spent("d").epsilon_spent == 0.5
    ledger.spend("d", Gaussian(noise_multiplier=5.0))
    # 0.5 + the Gaussian's epsilon at the 6e-6 left, by the budget's own accountant
    basic = 0.5 + Gaussian(noise_multiplier=5.0).epsilon(6e-6, accountant)
    spent = ledger.spent("d")
    assert spent.epsilon_spent == pytest.approx(basic, rel=1e-12)
    assert spent.epsilon_spent >= basic
    with pytest.raises(BudgetExceededError):
        ledger.spend("d", ApproxDP(2.0 - spent.epsilon_spent + 1e-9, 1e-9))
    with pytest.raises(BudgetExceededError):  # the deltas alone exceed the cap
        ledger.spend("d", ApproxDP(1e-3, 7e-6))
    assert ledger.spent("d").entries == 2
