"""The online noise recurrence produces exactly C^{-1} z, with O(bands) memory; planted
bugs in it (uncorrelated noise, a wrong band, a wrong decay) are caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from privlearn.correlated import (
    BandedRecurrence,
    BandedToeplitz,
    BufferedRecurrence,
    BufferedToeplitz,
    Identity,
    optimize_banded_toeplitz,
    optimize_blt,
)
from privlearn.correlated.noise import CorrelatedNoise

STRATEGIES = [
    Identity(),
    BandedToeplitz((1.0, 0.5)),
    BandedToeplitz.square_root(8),
    optimize_banded_toeplitz(64, 16),
    BufferedToeplitz((0.9, 0.5), (0.2, 0.1)),
    optimize_blt(64, 3),
]


def _run(recurrence, z):
    gen = CorrelatedNoise(recurrence, z.shape[1:])
    return np.array([gen.step(zt) for zt in z]), gen


def _correlation_error(strategy, recurrence, n=40, d=3):
    """max |C noise - z|: zero iff the generator applies C^{-1}."""
    z = np.random.default_rng(0).normal(size=(n, d))
    noise, _ = _run(recurrence, z)
    return float(np.abs(strategy.materialize(n) @ noise - z).max())


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_noise_is_c_inverse_z(strategy):
    assert _correlation_error(strategy, strategy.recurrence()) < 1e-10
    n = 40
    r = strategy.inverse_toeplitz_coefs(n)  # and matches the first column of C^{-1}
    e0 = np.zeros((n, 1))
    e0[0] = 1.0
    noise, _ = _run(strategy.recurrence(), e0)
    np.testing.assert_allclose(noise[:, 0], r, atol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_memory_does_not_grow_with_steps(strategy):
    z = np.random.default_rng(1).normal(size=(500, 7))
    _, gen = _run(strategy.recurrence(), z)
    bands = strategy.bands
    want = bands - 1 if bands is not None else strategy.buffers
    assert gen.buffers.shape == (want, 7)


def test_noise_covariance_is_c_inverse_c_inverse_transpose():
    # empirical: the noise of steps 0..n-1 has covariance C^{-1} C^{-T}
    C = BandedToeplitz((1.0, 0.6, 0.3))
    n, reps = 6, 40000
    z = np.random.default_rng(2).normal(size=(n, reps))
    noise, _ = _run(C.recurrence(), z)
    cinv = np.linalg.inv(C.materialize(n))
    np.testing.assert_allclose(np.cov(noise), cinv @ cinv.T, atol=0.05)


def test_planted_bugs_are_caught():
    banded = BandedToeplitz.square_root(6)
    blt = BufferedToeplitz((0.9, 0.5), (0.2, 0.1))
    planted = {
        "independent noise": (banded, BandedRecurrence((1.0,))),
        "one band short": (banded, BandedRecurrence(banded.coefs[:-1])),
        "one band too many": (banded, BandedRecurrence(banded.coefs + (0.1,))),
        "coefficients shifted": (banded, BandedRecurrence(banded.coefs[1:] + (0.0,))),
        "wrong decay": (blt, dataclasses.replace(blt.recurrence(), buf_decay=(0.9, 0.6))),
        "buffer dropped": (blt, BufferedRecurrence((0.9,), (0.2,))),
    }
    for name, (strategy, rec) in planted.items():
        assert _correlation_error(strategy, rec) > 1e-3, name


# an unstable C^{-1}: its noise grows geometrically (a BLT whose inverse decay, the
# eigenvalue of diag(theta) - 1 omega^T, is 0.99 - 5 = -4.01; a banded C = 1 + 2x whose
# inverse is sum (-2x)^t)
UNSTABLE = [BufferedToeplitz((0.99,), (5.0,)), BandedToeplitz((1.0, 2.0)),
            BufferedToeplitz((0.9, 0.5), (1.0, 1.5))]


@pytest.mark.parametrize("strategy", UNSTABLE, ids=repr)
def test_a_recurrence_whose_noise_grows_without_bound_is_refused(strategy):
    from privlearn.errors import ConfigurationError

    r = strategy.inverse_toeplitz_coefs(60)
    assert abs(r[-1]) > 1e10  # the closed form: C^{-1}'s entries do grow geometrically
    with pytest.raises(ConfigurationError, match="C\\^\\{-1\\}"):
        CorrelatedNoise(strategy.recurrence(), (3,))


@pytest.mark.parametrize("strategy", [
    BandedToeplitz((1.0, -1.0)),  # C^{-1} = prefix sums: bounded (a root on the circle)
    BufferedToeplitz((1.0,), (0.0,)),  # C = I
    BufferedToeplitz((0.99, -0.1), (0.01, -0.1)),  # a negative decay (jax_privacy's tests)
    *STRATEGIES,
], ids=repr)
def test_stable_recurrences_are_accepted(strategy):
    z = np.random.default_rng(1).normal(size=(50, 2))
    noise, _ = _run(strategy.recurrence(), z)
    np.testing.assert_allclose(strategy.materialize(50) @ noise, z, atol=1e-9)


@pytest.mark.parametrize("strategy", [BufferedToeplitz((0.99, -0.9), (0.2, 0.3)),
                                      BandedToeplitz((1.0, 2.0))], ids=repr)
def test_an_overflowing_inverse_raises_instead_of_nan(strategy):
    # C^{-1} grows like 1.23^t and 2^t: representable over 100 steps (and equal to the
    # dense inverse there), inf or nan over 10^4, which is refused, never returned
    from privlearn.errors import AccountingError

    n = 100
    dense = np.linalg.solve(strategy.materialize(n), np.eye(n)[:, 0])
    np.testing.assert_allclose(strategy.inverse_toeplitz_coefs(n), dense, rtol=1e-6)
    with pytest.raises(AccountingError, match="not finite"):
        strategy.inverse_toeplitz_coefs(10_000)


@pytest.mark.parametrize("strategy", [BandedToeplitz((1.0, 0.5, 0.2)),
                                      BufferedToeplitz((0.9,), (0.2,)), Identity()])
def test_a_draw_of_another_shape_is_refused_and_leaves_the_noise_state_alone(strategy):
    """A draw that is not of the generator's shape is refused with a typed error before
    the state moves (it was broadcast into the buffers, or half-applied to a BLT's
    buffers before numpy failed), and the later draws still get the rows of C^{-1} z."""
    from privlearn.errors import ParameterValueError

    z = np.random.default_rng(1).normal(size=(6, 3))
    gen = CorrelatedNoise(strategy.recurrence(), (3,))
    got = [gen.step(z[0]), gen.step(z[1])]
    for bad in (np.ones(4), np.ones((2, 3)), np.ones(())):
        with pytest.raises(ParameterValueError, match=r"shape \(3,\)"):
            gen.step(bad)
    got += [gen.step(zt) for zt in z[2:]]
    want = np.linalg.solve(strategy.materialize(6), z)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-12, atol=1e-12)
