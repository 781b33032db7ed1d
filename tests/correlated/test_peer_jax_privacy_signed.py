"""Sensitivity of random *signed* strategies (banded with more bands than the separation,
BLTs with negative decays or weights: the upper-bound rules) between two references:
jax_privacy's upper bounds computed by the peer in the test (its dense
``get_min_sep_sensitivity_upper_bound``, [CC23b] Algorithm 4, and
``fixed_epoch_sensitivity``, [CC23b] Eq. (5)), and a lower bound from the participation
patterns themselves (the contributions of a pattern along one direction with signs
chosen greedily: a release the schema allows, so no sensitivity is below it).

Ours must never be below the lower bound (that would be optimistic) nor above the peer's
upper bound (our general rule takes the smaller of Algorithm 4 and a majorant bound).
Marked slow: the peer compiles each shape with XLA.
"""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
    sensitivity,
)

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jsens = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")

pytestmark = pytest.mark.slow


def _strategy(rng: np.random.Generator, n: int):
    if rng.random() < 0.5:
        c = rng.normal(size=int(rng.integers(2, min(n, 24) + 1)))
        c[0] = abs(c[0]) + 0.2
        return BandedToeplitz(tuple(c))
    m = int(rng.integers(1, 4))
    return BufferedToeplitz(tuple(rng.uniform(-1, 1, m)), tuple(0.3 * rng.normal(size=m)))


def _lower(C: np.ndarray, patterns) -> float:
    best = 0.0
    for p in patterns:
        cols, s = C[:, p], np.ones(len(p))
        v = np.linalg.norm(cols @ s)
        for i in range(len(p)):  # one greedy pass of sign flips
            s[i] = -1.0
            w = np.linalg.norm(cols @ s)
            if w > v:
                v = w
            else:
                s[i] = 1.0
        best = max(best, v)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_signed_strategies_lie_between_a_pattern_and_the_peer(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(24, 121))
    S = _strategy(rng, n)
    C = S.materialize(n)
    sep = int(rng.integers(1, 9))
    k = -(-n // sep)
    with jax.enable_x64(True):
        peer = float(
            jsens.get_min_sep_sensitivity_upper_bound(
                jnp.asarray(C), min_sep=sep, max_participations=k
            )
        )
    patterns = [list(range(j, n, sep)) for j in range(sep)]
    patterns += [list(range(j, n, sep + 1)) for j in range(sep + 1)]
    ours = sensitivity(S, MinSeparation(sep, k), n)
    assert _lower(C, patterns) <= ours.value <= peer * (1 + 1e-9)

    epochs = (
        max(d for d in range(2, 9) if n % d == 0) if any(n % d == 0 for d in range(2, 9)) else 1
    )
    per = n // epochs
    with jax.enable_x64(True):
        peer_fixed = jsens.fixed_epoch_sensitivity(jnp.asarray(C), epochs)
    fixed = sensitivity(S, FixedEpochs(epochs), n)
    lower = _lower(C, [list(range(j, n, per)) for j in range(per)])
    assert lower <= fixed.value <= peer_fixed * (1 + 1e-9)
