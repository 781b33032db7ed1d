"""Certified sensitivities of strategies whose entries are near the ends of the float64
range: compared with exact rational arithmetic, and never a hang or an untyped error."""

from __future__ import annotations

import itertools
import math
import signal
from fractions import Fraction

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    DenseStrategy,
    FixedEpochs,
    MinSeparation,
    SingleParticipation,
)
from privlearn.correlated.sensitivity import sensitivity
from privlearn.errors import AccountingError


@pytest.fixture
def deadline():
    """Fail, instead of hanging, a computation that does not end within 20 s."""

    def stop(signum, frame):
        raise TimeoutError("did not finish within 20 s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _exact_lower_bound_squared(c: np.ndarray, patterns: list[tuple[int, ...]]) -> Fraction:
    """``max ||C s||^2`` over sign vectors ``s`` on each pattern, in exact rationals: a
    lower bound on the squared sensitivity (attained by contributions ``s_i g``)."""
    n = c.shape[0]
    q = [[Fraction(float(c[i, j])) for j in range(n)] for i in range(n)]
    best = Fraction(0)
    for p in patterns:
        for signs in itertools.product((1, -1), repeat=len(p)):
            col = [sum(s * q[i][j] for s, j in zip(signs, p, strict=True)) for i in range(n)]
            best = max(best, sum(v * v for v in col))
    return best


@pytest.mark.parametrize("scale", [1e-200, 1e-160, 1e-100, 1.0])
@pytest.mark.parametrize(
    "part,patterns",
    [
        (SingleParticipation(), [(j,) for j in range(4)]),
        (FixedEpochs(2), [(0, 2), (1, 3)]),
        (MinSeparation(2), [(0, 2), (0, 3), (1, 3)]),
    ],
)
def test_tiny_entries_keep_a_certified_bound(deadline, scale, part, patterns):
    rng = np.random.default_rng(3)
    c = np.tril(rng.uniform(0.5, 1.5, (4, 4))) * scale
    s = sensitivity(DenseStrategy(c), part, 4)
    truth = _exact_lower_bound_squared(c, patterns)
    assert Fraction(s.value) ** 2 >= truth
    if s.exact:
        assert s.value == pytest.approx(math.sqrt(truth), rel=1e-9)


def test_a_toeplitz_column_below_1e_154_does_not_hang(deadline):
    s = sensitivity(BandedToeplitz([1e-200, 1e-200]), SingleParticipation(), 3)
    assert Fraction(s.value) ** 2 >= 2 * Fraction(1e-200) ** 2
    assert s.value == pytest.approx(math.sqrt(2) * 1e-200, rel=1e-15)


def test_huge_entries_give_the_norm_or_a_typed_error(deadline):
    s = sensitivity(DenseStrategy(np.eye(3) * 1e300), SingleParticipation(), 3)
    assert s.value == 1e300
    with pytest.raises(AccountingError, match="overflowed"):
        sensitivity(DenseStrategy(np.tril(np.ones((4, 4))) * 1e308), SingleParticipation(), 4)
    with pytest.raises(AccountingError, match="overflowed"):
        sensitivity(DenseStrategy(np.eye(4) * 1e200), FixedEpochs(2), 4)
