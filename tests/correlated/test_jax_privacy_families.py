"""jax_privacy's own test families for matrix factorization, reproduced through privlearn's
public API with the closed forms and reference values those tests state (no jax needed;
the same-run comparison with the peer is in ``test_peer_jax_privacy.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    Identity,
    MinSeparation,
    loss,
    optimize_blt,
    sensitivity,
)
from privlearn.correlated.sensitivity import gram_sensitivity_upper_bound, vector_sensitivity


@pytest.mark.parametrize("x,sep,k,want", [
    ([1.0, 0.5, 0.5, 0.5, 0.1], 1, 5, 2.6),  # min_sep 1 takes everything
    ([1.0, 1.0, 0.0, 1.0, 0.0, 1.0], 1, 6, 4.0),
    ([1.0, 1.0, 1.0, 1.0], 2, 2, 2.0),
    ([2.0], 3, 4, 2.0),
    ([0.0, 1.0, 0.0], 2, 2, 1.0),  # the optimum uses fewer participations than allowed
    ([-1.0, 1.0, -1.0, -1.0], 1, 4, 1.0),  # negative entries are left out
    ([-1.0, -1.0, -1.0], 2, 3, 0.0),  # no participation at all is optimal
])
def test_best_pattern_of_a_linear_function(x, sep, k, want):
    assert vector_sensitivity(np.asarray(x), sep, k) == pytest.approx(want, abs=1e-15)


def test_gram_bound_on_the_banded_example_of_the_peer():
    c = np.array([[1.0, 0, 0, 0], [2, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, -6.0]])
    assert gram_sensitivity_upper_bound(c, 2, 1) == pytest.approx(6.0, rel=1e-12)
    for sep in (2, 3):  # columns 1 and 3 (norms^2 5 and 36) are orthogonal
        assert gram_sensitivity_upper_bound(c, sep, 4) == pytest.approx(math.sqrt(41), rel=1e-12)
    dense = c.copy()
    dense[2, 0], dense[3, 0] = 0.5, 0.4
    x = dense.T @ dense  # every step may participate: the bound is sqrt(sum |X|)
    assert gram_sensitivity_upper_bound(dense, 1, 4) == pytest.approx(
        math.sqrt(np.abs(x).sum()), rel=1e-12)


@pytest.mark.parametrize("epochs", [1, 2, 4, 8, 16])
def test_fixed_epochs_closed_forms(epochs):
    assert sensitivity(Identity(), FixedEpochs(epochs), 16).value == pytest.approx(
        math.sqrt(epochs), rel=1e-15)
    coefs = np.linspace(1.0, 0.05, 16)
    full = BandedToeplitz(tuple(coefs))  # every step: ||C 1||
    want = np.linalg.norm(full.materialize(16).sum(axis=1))
    assert sensitivity(full, FixedEpochs(16), 16).value == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n,k", [(1, 1), (3, 4), (5, 11), (11, 4), (11, 11)])
def test_min_sep_one_closed_forms(n, k):
    # the identity: min(n, k) participations; the prefix sum: its first k columns summed
    assert sensitivity(Identity(), MinSeparation(1, k), n).value ** 2 == pytest.approx(min(n, k))
    tri = BandedToeplitz(tuple(np.ones(n)))
    want = np.sum(np.sum(np.tri(n)[:, :k], axis=1) ** 2)
    assert sensitivity(tri, MinSeparation(1, k), n).value ** 2 == pytest.approx(want, rel=1e-12)


def test_column_normalised_banded_under_its_separation():
    c = BandedToeplitz.square_root(4)  # ||c|| = 1: every column of the first 29 has norm 1
    assert sensitivity(c, MinSeparation(4), 32).value ** 2 == pytest.approx(8.0, rel=1e-12)
    assert sensitivity(c, MinSeparation(4, 6), 32).value ** 2 == pytest.approx(6.0, rel=1e-12)


@pytest.mark.parametrize("n,sep,k", [(10, 1, 3), (32, 8, None), (32, 2, 20), (33, 2, None)])
def test_identity_max_loss_is_participations_times_steps(n, sep, k):
    p = MinSeparation(sep, k)
    assert loss(Identity(), n, p, reduction="max") == pytest.approx(
        p.participations(n) * n, rel=1e-12)


@pytest.mark.slow
def test_blt_reaches_the_peer_golden_optimum_and_mathias_bound():
    """jax_privacy's golden BLT for 100,000 steps, 2 buffers, max error (its
    ``test_optimize_single_participation_golden``), and the near-optimality bound
    ``sqrt(loss) <= rtol (1 + ln n / pi)`` (Mathias 1993, Cor. 3.5; [DMPST24] Eq. 2.8)."""
    n = 100_000
    golden = BufferedToeplitz((0.9999528892, 0.9857068667), (0.0122853238, 0.1878393665))
    ours = optimize_blt(n, 2, reduction="max")
    assert loss(ours, n, reduction="max") <= loss(golden, n, reduction="max") * (1 + 1e-6)
    np.testing.assert_allclose(ours.buf_decay, golden.buf_decay, rtol=1e-5)
    np.testing.assert_allclose(ours.output_scale, golden.output_scale, rtol=1e-4)
    for steps, buffers, rtol in ((100, 2, 1.03), (1000, 3, 1.03)):
        root = math.sqrt(loss(optimize_blt(steps, buffers), steps, reduction="max"))
        assert root <= rtol * (1 + math.log(steps) / math.pi)
