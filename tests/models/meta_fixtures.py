"""Data and a ledger budget shared by the meta-estimator guard tests of this folder
(``from meta_fixtures import X, Y, LABELS, THREE, budget``)."""

from __future__ import annotations

import numpy as np

from privlearn.ledger import Ledger

RNG = np.random.default_rng(3)
N = 90
X = RNG.uniform(-0.5, 0.5, size=(N, 3))
Y = X @ np.array([0.4, -0.3, 0.2])
LABELS = (Y > 0).astype(int)
THREE = np.digitize(Y, [-0.05, 0.05])


def budget(tmp_path):
    """A budget large enough for every fit of a test, on a fresh ledger file."""
    ledger = Ledger(tmp_path / "ledger.db", create=True)
    ledger.create_budget("d", epsilon=1e6, delta=1e-2)
    return ledger.budget("d")
