"""privlearn's optimised banded and BLT strategies and amplified banded accounting against
jax_privacy 2.0.0 run in the test: the peer's sensitivity and per-query error of our
optimised strategies over a grid of steps, bands or buffers, separations and
participations; BLT fixed-epoch sensitivities and the upper bound for signed banded
strategies; our optimisers against the peer's on the same objective (loss and time);
the epsilon of amplified banded MF under cyclic Poisson sampling against the peer's
``amplified_bandmf_event`` (Choquette-Choo et al. 2023, Theorem 4).

Needs jax (CPU is enough) and jax_privacy's imports (chex, optax, dp-accounting);
skipped when they are absent. The optimiser comparisons are marked slow: the peer
compiles each configuration with XLA (tens of seconds on a loaded machine).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
    SingleParticipation,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
    per_query_error,
    sensitivity,
)
from privlearn.correlated.accounting import correlated_mechanism
from privlearn.correlated.sampling import CyclicPoissonSampler

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
toeplitz = pytest.importorskip("jax_privacy.matrix_factorization.toeplitz")
bt = pytest.importorskip("jax_privacy.matrix_factorization.buffered_toeplitz")
jsens = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")
jax_acc = pytest.importorskip("jax_privacy.experimental.accounting")
dp_accounting = pytest.importorskip("dp_accounting")

U = float(np.finfo(float).eps)


def _peer_sensitivity(strategy, coefs: np.ndarray, n: int, sep: int, k: int) -> float:
    """The peer's sensitivity: its Toeplitz rule for non-negative, non-increasing
    coefficients, else its banded rule on the dense matrix (bands <= min_sep)."""
    if np.all(coefs >= 0) and np.all(np.diff(coefs) <= 0):
        sq = toeplitz.minsep_sensitivity_squared(
            jnp.asarray(coefs), min_sep=sep, max_participations=k, n=n
        )
        return float(jnp.sqrt(sq))
    dense = jnp.asarray(strategy.materialize(n))
    return float(jsens.get_sensitivity_banded(dense, min_sep=sep, max_participations=k))


# (kind, steps, bands or buffers, min_sep, max participations)
GRID = [
    ("banded", 64, 4, 8, 8),
    ("banded", 256, 16, 32, 8),
    ("banded", 512, 8, 4, 100),
    ("banded", 300, 10, 3, 7),
    ("banded", 96, 12, 6, 16),
    ("banded", 1000, 5, 1000, 1),
    ("blt", 64, 2, 8, 8),
    ("blt", 256, 3, 16, 16),
    ("blt", 512, 4, 1, 1),
    ("blt", 512, 4, 64, 8),
    ("blt", 1000, 3, 10, 100),
    ("blt", 200, 5, 20, 10),
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::privlearn.errors.StrategyAdjustedWarning")  # bands > sep
@pytest.mark.parametrize("reduction", ["max", "mean"])
@pytest.mark.parametrize("kind,n,size,sep,k", GRID)
def test_optimized_strategy_sensitivity_and_error_agree_with_peer(kind, n, size, sep, k, reduction):
    part = SingleParticipation() if k == 1 else MinSeparation(sep, k)
    if kind == "banded":
        C = optimize_banded_toeplitz(n, size, part, reduction=reduction, show_progress=False)
        coefs = np.asarray(C.toeplitz_coefs(n))
    else:
        C = optimize_blt(n, size, part, reduction=reduction, show_progress=False)
    with jax.enable_x64(True):
        if kind == "blt":  # the peer's own coefficients of our BLT
            peer_blt = bt.BufferedToeplitz.build(buf_decay=C.buf_decay, output_scale=C.output_scale)
            coefs = np.asarray(peer_blt.toeplitz_coefs(n))
        peer_sens = _peer_sensitivity(C, coefs, n, sep, k)
        peer_err = np.asarray(toeplitz.per_query_error(strategy_coef=jnp.asarray(coefs), n=n))
    ours = sensitivity(C, part, n)
    assert ours.exact
    # ours is a certified upper bound: never below the peer's value beyond its rounding
    assert ours.value >= peer_sens * (1 - 8 * U)
    assert ours.value == pytest.approx(peer_sens, rel=1e-12)
    err = per_query_error(C, n)
    np.testing.assert_allclose(err, peer_err, rtol=1e-9)
    reduce = np.max if reduction == "max" else np.mean
    assert loss(C, n, part, reduction=reduction) == pytest.approx(
        float(reduce(peer_err)) * peer_sens**2, rel=1e-9
    )


def _peer_blt(loss_fn, buffers: int) -> BufferedToeplitz:
    blt, _ = bt.optimize_loss(loss_fn, num_buffers=buffers)
    return BufferedToeplitz(
        tuple(np.asarray(blt.buf_decay, float)), tuple(np.asarray(blt.output_scale, float))
    )


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# (steps, buffers, min_sep, max participations, reduction)
BLT_OPT = [
    (1024, 4, 1, 1, "max"),  # the peer's closed-form single-participation loss
    (256, 3, 1, 1, "mean"),
    (256, 3, 32, 8, "max"),
    (512, 3, 8, 64, "mean"),
]


@pytest.mark.slow
@pytest.mark.parametrize("n,buffers,sep,k,reduction", BLT_OPT)
def test_blt_optimizer_no_worse_and_no_slower_than_peer(n, buffers, sep, k, reduction):
    part = SingleParticipation() if k == 1 else MinSeparation(sep, k)
    with jax.enable_x64(True):
        if k == 1 and reduction == "max":
            loss_fn = bt.LossFn.build_closed_form_single_participation(n=n)
        else:
            loss_fn = bt.LossFn.build_min_sep(
                n=n, error=reduction, min_sep=sep, max_participations=k
            )
        peer, peer_time = _timed(lambda: _peer_blt(loss_fn, buffers))
    optimize_blt.cache_clear()
    ours, our_time = _timed(
        lambda: optimize_blt(n, buffers, part, reduction=reduction, show_progress=False)
    )
    theirs = loss(peer, n, part, reduction=reduction)
    assert loss(ours, n, part, reduction=reduction) <= theirs * 1.01
    assert our_time <= 3 * peer_time + 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "n,bands,reduction", [(1024, 16, "max"), (512, 4, "max"), (256, 8, "mean")]
)
def test_banded_optimizer_no_worse_and_no_slower_than_peer(n, bands, reduction):
    reduce = jnp.max if reduction == "max" else jnp.mean
    with jax.enable_x64(True):
        peer, peer_time = _timed(
            lambda: np.asarray(toeplitz.optimize_banded_toeplitz(n, bands, reduction_fn=reduce))
        )
    optimize_banded_toeplitz.cache_clear()
    ours, our_time = _timed(
        lambda: optimize_banded_toeplitz(n, bands, reduction=reduction, show_progress=False)
    )
    theirs = loss(BandedToeplitz(tuple(peer)), n, reduction=reduction)
    assert loss(ours, n, reduction=reduction) <= theirs * 1.01
    assert our_time <= 3 * peer_time + 1.0


# (steps, bands, cycle length >= bands, sampling rate, noise multiplier, scale of C)
AMPLIFIED = [
    (500, 3, 10, 0.5, 4.0, 0.5),  # cycle longer than the bands: ceil(500 / 10) rounds
    (97, 5, 7, 1.0, 5.0, 1.0),  # steps not a multiple of the cycle; no sampling
    # the peer's PLD of many compositions takes seconds
    pytest.param(300, 1, 1, 0.02, 1.1, 1.0, marks=pytest.mark.slow),  # one band: DP-SGD
    pytest.param(2000, 16, 16, 0.01, 0.8, 1.0, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("steps,bands,cycle,q,sigma,scale", AMPLIFIED)
def test_amplified_banded_epsilon_brackets_peer(steps, bands, cycle, q, sigma, scale):
    # the peer's event is for max column norm 1: its noise multiplier is sigma / ||c||
    C = BandedToeplitz(tuple(scale * c for c in BandedToeplitz.square_root(bands).coefs))
    event = jax_acc.amplified_bandmf_event(
        sigma / C.max_column_norm(steps), steps, num_bands=cycle, sampling_prob=q
    )
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    peer = acc.compose(event).get_epsilon(1e-6)
    ours = correlated_mechanism(C, CyclicPoissonSampler(10**6, q, steps, cycle), sigma)
    b = ours.epsilon_bounds(1e-6)
    # the peer's PLD is pessimistic: never below our certified lower bound, and our
    # certified upper bound is within 1% of it
    assert b.lower <= peer * (1 + 1e-6)
    assert peer * 0.99 <= b.upper <= peer * 1.01


# (strategy, steps, epochs): C >= 0 entrywise (exact fixed-epoch rule), a negative decay
FIXED_EPOCHS = [
    (BufferedToeplitz((0.99, 0.5), (0.1, 0.2)), 120, 4),
    (BufferedToeplitz((0.97, -0.6), (0.4, 0.3)), 96, 6),
    (BufferedToeplitz((0.95, 0.7, 0.3), (0.05, 0.1, 0.1)), 200, 5),
]


@pytest.mark.slow
@pytest.mark.parametrize("C,n,epochs", FIXED_EPOCHS)
def test_blt_fixed_epoch_sensitivity_agrees_with_peer(C, n, epochs):
    with jax.enable_x64(True):
        dense = jnp.asarray(C.materialize(n))
        peer = float(jsens.fixed_epoch_sensitivity(dense, epochs))
    ours = sensitivity(C, FixedEpochs(epochs), n)
    assert ours.exact
    assert ours.value >= peer * (1 - 8 * U)
    assert ours.value == pytest.approx(peer, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("bands,n,sep,k", [(6, 60, 2, 10), (8, 100, 3, 5), (12, 90, 4, 8)])
def test_signed_banded_upper_bound_is_at_most_the_peers(bands, n, sep, k):
    # signed coefficients and bands > min_sep: no exact rule; ours is the smaller of
    # [CC23b] Algorithm 4 (the peer's upper bound) and the majorant bound
    rng = np.random.default_rng(bands)
    C = BandedToeplitz(tuple(np.concatenate([[1.0], rng.uniform(-0.6, 0.6, bands - 1)])))
    with jax.enable_x64(True):
        peer = float(
            jsens.get_min_sep_sensitivity_upper_bound(
                jnp.asarray(C.materialize(n)), min_sep=sep, max_participations=k
            )
        )
    ours = sensitivity(C, MinSeparation(sep, k), n)
    assert not ours.exact
    assert peer * (1 - 8 * U) <= ours.value <= peer * (1 + 1e-9)
