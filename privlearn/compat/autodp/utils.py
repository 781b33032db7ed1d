"""autodp-compatible ``utils``: the numerically stable helpers autodp's users import.

Plain NumPy implementations with autodp's names and semantics (log-domain sums and
differences); no privacy accounting happens here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.special import gammaln, logsumexp

from privlearn.compat.autodp._missing import missing
from privlearn.compat.autodp.privacy_calibrator import subsample_epsdelta

__all__ = [
    "stable_logsumexp",
    "stable_logsumexp_two",
    "stable_log_diff_exp",
    "stable_log_sinh",
    "logcomb",
    "subsample_epsdelta",
]


def stable_logsumexp(x: Any) -> float:
    """``log(sum(exp(x)))``."""
    return float(logsumexp(np.asarray(x, dtype=float)))


def stable_logsumexp_two(x: Any, y: Any) -> Any:
    """``log(exp(x) + exp(y))`` (elementwise)."""
    return np.logaddexp(x, y)


def stable_log_diff_exp(x: float, y: float) -> tuple[bool, float]:
    """``(sign, log|exp(y) - exp(x)|)`` with ``sign`` True when ``y > x`` (autodp's
    convention)."""
    if y > x:
        return True, y + math.log1p(-math.exp(x - y))
    if y < x:
        return False, x + math.log1p(-math.exp(y - x))
    return True, -math.inf


def stable_log_sinh(x: float) -> float:
    """``log(sinh(x))`` for ``x > 0``."""
    return x + math.log1p(-math.exp(-2.0 * x)) - math.log(2.0)


def logcomb(n: Any, k: Any) -> Any:
    """``log C(n, k)``."""
    return gammaln(np.asarray(n) + 1) - gammaln(np.asarray(k) + 1) - \
        gammaln(np.asarray(n) - np.asarray(k) + 1)


def __getattr__(name: str) -> Any:
    raise missing("utils", name, __all__)
