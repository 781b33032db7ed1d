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
