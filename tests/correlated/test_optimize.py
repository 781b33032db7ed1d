"""Optimised strategies: deterministic, fast, and better than their start points and the
closed-form strategies they generalise."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    FixedEpochs,
    Identity,
    MinSeparation,
    MomentumPrefixSum,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
    sensitivity,
)


def test_blt_is_deterministic_and_beats_identity():
    blt = optimize_blt(256, 3)
    assert optimize_blt(256, 3) == blt
    assert loss(blt, 256, reduction="max") < 0.05 * loss(Identity(), 256, reduction="max")


def test_banded_is_deterministic_and_fast(stopwatch):
    with stopwatch() as elapsed:
        a = optimize_banded_toeplitz(2000, 64)
    b = optimize_banded_toeplitz(2000, 64)
    assert a == b
    assert elapsed.seconds < 10.0
    assert np.linalg.norm(a.coefs) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "n,bands,participation",
    [(256, 8, None), (512, 16, MinSeparation(16)), (400, 20, FixedEpochs(10)),
     (300, 12, MinSeparation(4, 10))],
)
def test_banded_beats_square_root_and_identity(n, bands, participation):
    C = optimize_banded_toeplitz(n, bands, participation)
    start = BandedToeplitz.square_root(bands)
    assert loss(C, n, participation) <= loss(start, n, participation) * (1 + 1e-9)
    assert loss(C, n, participation) < loss(Identity(), n, participation)
    assert sensitivity(C, participation or MinSeparation(n, 1), n).exact


def test_bands_beyond_separation_stay_monotone():
    # bands > min_sep: coefficients constrained non-negative, non-increasing, so the
    # sensitivity stays exact (closed form)
    C = optimize_banded_toeplitz(300, 12, MinSeparation(4, 10))
    c = np.asarray(C.coefs)
    assert np.all(c >= 0) and np.all(np.diff(c) <= 1e-15)


def test_momentum_workload_changes_the_optimum():
    n = 256
    plain = optimize_banded_toeplitz(n, 8)
    mom = optimize_banded_toeplitz(n, 8, workload=MomentumPrefixSum(0.9))
    w = MomentumPrefixSum(0.9)
    assert loss(mom, n, workload=w) < loss(plain, n, workload=w)


def test_one_band_is_identity():
    assert optimize_banded_toeplitz(100, 1).coefs == (1.0,)


@pytest.mark.slow
def test_blt_close_to_best_toeplitz():
    n = 512
    blt = optimize_blt(n, 4)
    full = optimize_banded_toeplitz(n, n, reduction="max")  # the best Toeplitz strategy
    assert loss(blt, n, reduction="max") <= loss(full, n, reduction="max") * 1.01
    assert loss(blt, n, reduction="max") < 0.02 * loss(Identity(), n, reduction="max")
    assert optimize_blt(n, 4) == blt


@pytest.mark.slow
def test_blt_multi_participation():
    n, p = 1000, MinSeparation(50, 10)
    blt = optimize_blt(n, 3, p)
    s = sensitivity(blt, p, n)
    assert s.exact
    assert loss(blt, n, p, reduction="max") < loss(Identity(), n, p, reduction="max")


def test_bad_arguments():
    with pytest.raises(ValueError, match="bands must be in \\[1, steps=10\\]"):
        optimize_banded_toeplitz(10, 11)
    with pytest.raises(ValueError, match="reduction must be one of"):
        optimize_banded_toeplitz(10, 2, reduction="median")


def test_the_loss_of_an_overflowing_inverse_raises_instead_of_nan():
    from privlearn.correlated import BufferedToeplitz, per_query_error
    from privlearn.errors import AccountingError

    unstable = BufferedToeplitz((0.99,), (5.0,))  # C^{-1} grows like 4.01^t
    assert np.isfinite(loss(unstable, 100))  # still representable: a (huge) number
    with pytest.raises(AccountingError, match="not finite"):
        loss(unstable, 1000)
    with pytest.raises(AccountingError, match="not finite"):
        per_query_error(unstable, 1000)
