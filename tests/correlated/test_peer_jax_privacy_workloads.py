"""Optimised strategies for the momentum workload and several participations against
jax_privacy 2.0.0's optimisers run in the test on the same objective (the peer's error
and sensitivity functions): ours must be at least as good.

Needs jax (>= 0.8) and jax_privacy's imports; skipped when they are absent. Marked slow:
the peer compiles and optimises each case (about a minute in all).
"""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    MinSeparation,
    MomentumPrefixSum,
    SingleParticipation,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
)

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
toeplitz = pytest.importorskip("jax_privacy.matrix_factorization.toeplitz")
bt = pytest.importorskip("jax_privacy.matrix_factorization.buffered_toeplitz")
optimization = pytest.importorskip("jax_privacy.matrix_factorization.optimization")

pytestmark = pytest.mark.slow

MOMENTUM = MomentumPrefixSum(0.9)


@pytest.mark.parametrize("n,bands", [(256, 16), (1024, 4)])
def test_banded_momentum_optimum_is_no_worse_than_the_peer(n, bands):
    w = jnp.asarray(MOMENTUM.coefs(n))

    def peer_loss(c):
        err = jnp.mean(toeplitz.per_query_error(strategy_coef=c, n=n, workload_coef=w))
        return err * toeplitz.sensitivity_squared(c, n)

    with jax.enable_x64(True):
        init = toeplitz.optimal_max_error_strategy_coefs(bands)
        peer = np.asarray(optimization.optimize(peer_loss, init, max_optimizer_steps=250))
    ours = optimize_banded_toeplitz(n, bands, workload=MOMENTUM)
    theirs = loss(BandedToeplitz(tuple(peer)), n, workload=MOMENTUM)
    assert loss(ours, n, workload=MOMENTUM) <= theirs * (1 + 1e-6)


@pytest.mark.parametrize("reduction", ["max", "mean"])
def test_blt_momentum_optimum_under_min_separation_is_no_worse_than_the_peer(reduction):
    n, sep, k, buffers = 64, 16, 4, 4
    w = jnp.asarray(MOMENTUM.coefs(n))
    reduce = jnp.max if reduction == "max" else jnp.mean
    with jax.enable_x64(True):
        base = bt.LossFn.build_min_sep(n=n, error=reduction, min_sep=sep, max_participations=k)
        peer_fn = bt.LossFn(
            error_for_inv=lambda inv: reduce(
                toeplitz.per_query_error(noising_coef=inv.toeplitz_coefs(n), workload_coef=w)
            ),
            sensitivity_squared=base.sensitivity_squared,
            n=n,
            min_sep=sep,
            max_participations=k,
        )
        peer, _ = bt.optimize_loss(peer_fn, num_buffers=buffers)
        peer = BufferedToeplitz(
            tuple(np.asarray(peer.buf_decay, float)), tuple(np.asarray(peer.output_scale, float))
        )
    part = MinSeparation(sep, k)
    ours = optimize_blt(n, buffers, part, MOMENTUM, reduction)
    theirs = loss(peer, n, part, MOMENTUM, reduction)
    assert loss(ours, n, part, MOMENTUM, reduction) <= theirs * (1 + 1e-6)


def test_blt_prefix_optimum_is_no_worse_than_the_peer_single_participation():
    n = 256
    with jax.enable_x64(True):
        peer = bt.optimize(n=n, error="max", max_buffers=4)
        peer = BufferedToeplitz(
            tuple(np.asarray(peer.buf_decay, float)), tuple(np.asarray(peer.output_scale, float))
        )
    ours = optimize_blt(n, max(1, peer.buffers))
    theirs = loss(peer, n, SingleParticipation(), reduction="max")
    assert loss(ours, n, reduction="max") <= theirs * (1 + 1e-6)
