"""The sensitivity of the strategies the optimisers return, against the definition.

For small ``n`` the sensitivity of ``C`` under a participation schema is computed by brute
force over every participation pattern the schema allows: ``sens^2 = max_pi max_{||g_i||
<= 1} sum_{i, i' in pi} (C^T C)_{i i'} <g_i, g_i'>``. Between ``max_s s^T X_pi s`` over
sign vectors (attained: a lower bound) and ``sum |X_pi|`` (an upper bound), the two equal
when ``X_pi >= 0``. privlearn's value must never be below the lower bound, and must equal
the truth where it says it is exact. The strategies are those privlearn's optimisers
return for the usual objectives (banded with ``bands <= min_sep`` and ``bands > min_sep``,
BLT), under min-separation and fixed epochs, so the check covers what training uses.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from test_sensitivity import _brute_force, _patterns

from privlearn.correlated import (
    FixedEpochs,
    MinSeparation,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
    sensitivity,
)

U = float(np.finfo(float).eps)


def _epoch_patterns(n: int, epochs: int):
    per = n // epochs
    return [list(range(j, n, per)) for j in range(per)]


def _optimized(kind: str, n: int, size: int, part, reduction: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bands past min_sep, idle buffers: adjusted
        if kind == "banded":
            return optimize_banded_toeplitz(n, size, part, reduction=reduction, show_progress=False)
        return optimize_blt(n, size, part, reduction=reduction, show_progress=False)


# (kind, n, bands or buffers, participation, reduction)
CASES = [
    *[
        ("banded", n, b, part, reduction)
        for n, b, part in [
            (16, 4, MinSeparation(4)),  # bands == min_sep: signed, orthogonal columns
            (16, 2, MinSeparation(4)),
            (15, 3, MinSeparation(5, 2)),  # n not a multiple of min_sep
            (16, 6, MinSeparation(3)),  # bands > min_sep: non-negative, non-increasing
            (14, 14, MinSeparation(2, 4)),  # every band
            (16, 4, FixedEpochs(4)),
            (16, 8, FixedEpochs(4)),  # bands > epoch length
        ]
        for reduction in ("mean", "max")
    ],
    ("blt", 16, 2, MinSeparation(4), "max"),
    ("blt", 16, 2, MinSeparation(4), "mean"),
    ("blt", 15, 3, MinSeparation(2, 5), "max"),
    ("blt", 16, 2, FixedEpochs(4), "mean"),
    ("blt", 16, 3, FixedEpochs(2), "max"),
]


@pytest.mark.parametrize("kind,n,size,part,reduction", CASES)
def test_optimized_strategy_sensitivity_is_the_brute_force_value(kind, n, size, part, reduction):
    C = _optimized(kind, n, size, part, reduction)
    if isinstance(part, MinSeparation):
        patterns = list(_patterns(n, part.min_sep, part.participations(n)))
    else:
        patterns = _epoch_patterns(n, part.epochs)
    lo, hi = _brute_force(C.materialize(n), patterns)
    s = sensitivity(C, part, n)
    # never below a value some pattern and contributions attain (up to the brute force's
    # own rounding), and the truth itself when it says it is exact
    assert s.value**2 >= lo * (1 - 64 * U)
    assert s.exact
    assert lo == pytest.approx(hi, rel=1e-12)  # X_pi >= 0 or orthogonal: no sign slack
    assert s.value**2 == pytest.approx(lo, rel=1e-12)
    # the loss the optimiser minimised is the error at this sensitivity
    err = np.linalg.solve(C.materialize(n).T, np.tri(n).T).T
    per_query = np.sum(err * err, axis=1)
    e = per_query.mean() if reduction == "mean" else per_query.max()
    assert loss(C, n, part, reduction=reduction) == pytest.approx(e * lo, rel=1e-10)
