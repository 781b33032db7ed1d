"""optimize_blt with several participations: buffers the optimum leaves unused are dropped,
with a warning naming how many are used (as the banded optimiser warns of unused bands)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from privlearn.correlated import MinSeparation, loss, optimize_blt
from privlearn.errors import StrategyAdjustedWarning


def _idle_or_merged(C) -> bool:
    theta, omega = np.array(C.buf_decay), np.array(C.output_scale)
    gaps = np.diff(np.log1p(-theta)) if theta.size > 1 else np.array([1.0])
    return bool(np.min(omega) < 1e-6 * np.max(omega) or np.min(np.abs(gaps)) < 1e-6)


@pytest.mark.parametrize("n,m,sep", [(64, 4, 8), (100, 3, 10)])
def test_unused_buffers_are_dropped_with_a_warning(n, m, sep):
    P = MinSeparation(sep)
    optimize_blt.cache_clear()
    with pytest.warns(StrategyAdjustedWarning, match=rf"buffers={m}: .* uses \d buffers"):
        C = optimize_blt(n, m, participation=P)
    assert C.buffers < m
    assert not _idle_or_merged(C)  # no weight ~0, no two buffers of one decay
    # still the class whose sensitivity is the exact closed form: positive, decreasing
    c = C.toeplitz_coefs(n)
    assert np.all(c > 0) and np.all(np.diff(c) <= 0)
    assert all(0 < t < 1 for t in C.buf_decay) and sum(C.output_scale) < 1
    # nothing lost: no worse than optimising that many buffers directly (m buffers can
    # do at least as well as fewer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StrategyAdjustedWarning)
        fewer = optimize_blt(n, C.buffers, participation=P)
    assert loss(C, n, participation=P) <= loss(fewer, n, participation=P) * (1 + 1e-8)
    assert math.isfinite(loss(C, n, participation=P))


def test_a_blt_that_uses_all_its_buffers_is_kept_without_warning():
    optimize_blt.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StrategyAdjustedWarning)
        C = optimize_blt(64, 2, participation=MinSeparation(32))
        D = optimize_blt(128, 3)
    assert C.buffers == 2 and D.buffers == 3


def test_the_reduced_blt_is_one_jax_privacy_inverts():
    """jax_privacy refuses BLTs whose decays are closer than 1e-9 (as optimize_blt's
    optimum had at these settings); the one returned now inverts to the same inverse."""
    jax = pytest.importorskip("jax")
    bt = pytest.importorskip("jax_privacy.matrix_factorization.buffered_toeplitz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StrategyAdjustedWarning)
        C = optimize_blt(64, 4, participation=MinSeparation(8))
    with jax.enable_x64(True):
        peer = bt.BufferedToeplitz.build(buf_decay=C.buf_decay, output_scale=C.output_scale)
        inv = np.asarray(peer.inverse().toeplitz_coefs(64))
    np.testing.assert_allclose(C.inverse_toeplitz_coefs(64), inv, rtol=1e-9, atol=1e-12)
