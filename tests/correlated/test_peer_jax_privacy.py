"""Sensitivity and error of banded Toeplitz and BLT strategies against jax_privacy's
``matrix_factorization`` (the peer implementation), computed by the peer in the test.

Needs ``jax-privacy==2.0.0`` (installed with ``--no-deps``) and its imports: jax, jaxlib,
chex, optax, absl-py, dp-accounting. Skipped when they are absent. Marked slow: the peer
compiles each configuration with XLA (about two minutes in all); run with ``-m slow``.
"""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
    MomentumPrefixSum,
    SingleParticipation,
    loss,
    optimize_banded_toeplitz,
    per_query_error,
    sensitivity,
)

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
toeplitz = pytest.importorskip("jax_privacy.matrix_factorization.toeplitz")
bt = pytest.importorskip("jax_privacy.matrix_factorization.buffered_toeplitz")
jsens = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")

RTOL = 1e-6
pytestmark = pytest.mark.slow

# (steps, bands, min_sep, max participations): steps up to 2000, bands 1-64, 1-10 participations
BANDED = [
    (16, 1, 1, 1), (64, 4, 4, 10), (100, 8, 8, 5), (256, 16, 16, 10), (500, 32, 50, 10),
    (1000, 64, 64, 10), (2000, 64, 200, 10), (2000, 8, 4, 10), (300, 10, 3, 7),
    (2000, 32, 2000, 1), (128, 64, 16, 8), (1024, 2, 100, 3),
]


def _coefs(bands: int, seed: int) -> np.ndarray:
    """Non-negative, non-increasing coefficients (the peer's min-sep function needs them):
    the banded square root perturbed, re-sorted."""
    rng = np.random.default_rng(seed)
    c = np.asarray(BandedToeplitz.square_root(bands).coefs) * rng.uniform(0.7, 1.3, bands)
    return np.sort(c)[::-1]


@pytest.mark.parametrize("n,bands,sep,k", BANDED)
def test_banded_sensitivity_and_error_agree_with_peer(n, bands, sep, k):
    c = _coefs(bands, seed=n + bands)
    C = BandedToeplitz(tuple(c))
    with jax.enable_x64(True):
        peer_sens = float(jnp.sqrt(toeplitz.minsep_sensitivity_squared(
            jnp.asarray(c), min_sep=sep, max_participations=k, n=n)))
        peer_err = np.asarray(toeplitz.per_query_error(strategy_coef=jnp.asarray(c), n=n))
        peer_mom = np.asarray(toeplitz.per_query_error(
            strategy_coef=jnp.asarray(c), n=n,
            workload_coef=jnp.asarray(MomentumPrefixSum(0.9).coefs(n))))
        peer_loss = float(toeplitz.loss(jnp.asarray(c), n=n))
    ours = sensitivity(C, MinSeparation(sep, k), n)
    assert ours.exact
    assert ours.value == pytest.approx(peer_sens, rel=RTOL)
    np.testing.assert_allclose(per_query_error(C, n), peer_err, rtol=RTOL)
    np.testing.assert_allclose(per_query_error(C, n, MomentumPrefixSum(0.9)), peer_mom, rtol=RTOL)
    assert loss(C, n) == pytest.approx(peer_loss, rel=RTOL)


@pytest.mark.parametrize("n,bands,sep,k", [b for b in BANDED if b[1] <= b[2]][:8])
def test_banded_dense_functions_agree_with_peer(n, bands, sep, k):
    # signed coefficients: the general banded theorem (bands <= min_sep) and the
    # (k, b)-fixed-epoch function on the materialised matrix
    rng = np.random.default_rng(bands)
    c = np.concatenate([[1.0], rng.uniform(-0.5, 0.5, bands - 1)])
    C = BandedToeplitz(tuple(c))
    n = min(n, 600)
    sep = min(sep, n)
    m = C.materialize(n)
    with jax.enable_x64(True):
        peer = jsens.get_sensitivity_banded(jnp.asarray(m), min_sep=sep, max_participations=k)
        epochs = max(d for d in range(1, 11) if n % d == 0)
        peer_fixed = jsens.fixed_epoch_sensitivity(jnp.asarray(m), epochs)
    assert sensitivity(C, MinSeparation(sep, k), n).value == pytest.approx(peer, rel=RTOL)
    ours_fixed = sensitivity(C, FixedEpochs(epochs), n)
    assert ours_fixed.value == pytest.approx(peer_fixed, rel=RTOL)


BLTS = [
    # (decays, output scales, steps, min_sep, participations)
    ((0.9,), (0.3,), 100, 1, 1),
    ((0.99, 0.5), (0.1, 0.2), 500, 10, 10),
    ((0.999, 0.95, 0.6), (0.03, 0.1, 0.25), 2000, 100, 10),
    ((0.995, 0.8), (0.05, 0.3), 1000, 1000, 1),
    ((0.97, 0.7, 0.3, 0.1), (0.05, 0.1, 0.1, 0.1), 256, 16, 10),
    ((0.5,), (0.5,), 64, 8, 8),
    ((0.9999, 0.99), (0.01, 0.05), 2000, 200, 10),
    ((0.8, 0.6), (0.2, 0.2), 300, 30, 5),
    ((0.98, 0.9, 0.5), (0.02, 0.05, 0.4), 1200, 120, 10),
    ((0.999,), (0.2,), 1500, 1500, 1),
    ((0.95, 0.75, 0.4, 0.2, 0.05), (0.04, 0.06, 0.1, 0.1, 0.1), 800, 50, 10),
]


@pytest.mark.parametrize("theta,omega,n,sep,k", BLTS)
def test_blt_sensitivity_and_error_agree_with_peer(theta, omega, n, sep, k):
    C = BufferedToeplitz(theta, omega)
    with jax.enable_x64(True):
        blt = bt.BufferedToeplitz.build(buf_decay=theta, output_scale=omega)
        peer_coefs = np.asarray(blt.toeplitz_coefs(n))
        peer_single = float(jnp.sqrt(bt.sensitivity_squared(blt, n)))
        peer_minsep = float(jnp.sqrt(toeplitz.minsep_sensitivity_squared(
            blt.toeplitz_coefs(n), min_sep=sep, max_participations=k, n=n)))
        inv = blt.inverse()
        peer_max_err = float(bt.max_error(inv, n))
        peer_inv = np.asarray(inv.toeplitz_coefs(n))
        peer_err = np.asarray(toeplitz.per_query_error(noising_coef=inv.toeplitz_coefs(n)))
        peer_max_loss = float(bt.max_loss(blt, n))
    np.testing.assert_allclose(C.toeplitz_coefs(n), peer_coefs, rtol=1e-12)
    np.testing.assert_allclose(C.inverse_toeplitz_coefs(n), peer_inv, rtol=RTOL, atol=1e-12)
    assert sensitivity(C, SingleParticipation(), n).value == pytest.approx(peer_single, rel=RTOL)
    ours = sensitivity(C, MinSeparation(sep, k), n)
    assert ours.exact and ours.value == pytest.approx(peer_minsep, rel=RTOL)
    err = per_query_error(C, n)
    np.testing.assert_allclose(err, peer_err, rtol=RTOL)
    assert err[-1] == pytest.approx(peer_max_err, rel=RTOL)  # the peer's closed form
    assert loss(C, n, reduction="max") == pytest.approx(peer_max_loss, rel=RTOL)


@pytest.mark.parametrize("n,bands", [(256, 8), (2000, 64)])
def test_optimized_banded_matches_peer_optimum(n, bands):
    ours = optimize_banded_toeplitz(n, bands)
    with jax.enable_x64(True):
        peer = np.asarray(toeplitz.optimize_banded_toeplitz(n, bands))
    peer_loss = loss(BandedToeplitz(tuple(peer)), n)
    assert loss(ours, n) <= peer_loss * (1 + 1e-6)
