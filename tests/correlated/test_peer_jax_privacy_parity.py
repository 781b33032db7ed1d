"""privlearn's strategy optimisers against jax_privacy 2.0.0's on the problems the other
peer tests leave out, both strategies evaluated by the same loss (mean or max squared
error of the prefix sums times the squared sensitivity, by privlearn and by the peer's own
functions):

* full Toeplitz (``bands = steps``) against ``toeplitz.optimize_banded_toeplitz``;
* banded under min-separation with the last participation's column cut short, against
  the peer's optimum (for single participation, which its docstring prescribes for
  ``bands <= min_sep``) evaluated under the same participation;
* BLT under fixed epochs against ``buffered_toeplitz.optimize_loss`` on
  ``LossFn.build_min_sep(min_sep=steps / epochs, max_participations=epochs)``, and the
  two libraries' fixed-epoch sensitivities of the optimum.

Marked slow: the peer compiles every problem with XLA (5-40 s each on a loaded machine).
The stored results of ``benchmarks/jax_privacy_parity_sweep.py`` are checked by default in
``test_parity_reference.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
    sensitivity,
)

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
toeplitz = pytest.importorskip("jax_privacy.matrix_factorization.toeplitz")
bt = pytest.importorskip("jax_privacy.matrix_factorization.buffered_toeplitz")
jsens = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")

pytestmark = pytest.mark.slow
U = float(np.finfo(float).eps)


def _peer_error(coefs: np.ndarray, n: int, reduction: str) -> float:
    err = np.asarray(toeplitz.per_query_error(strategy_coef=jnp.asarray(coefs), n=n))
    return float(err.mean() if reduction == "mean" else err.max())


@pytest.mark.parametrize("reduction", ["mean", "max"])
@pytest.mark.parametrize("n", [16, 64])
def test_full_toeplitz_no_worse_than_peer(n, reduction):
    fn = jnp.mean if reduction == "mean" else jnp.max
    with jax.enable_x64(True):
        peer = np.asarray(toeplitz.optimize_banded_toeplitz(n, n, reduction_fn=fn))
        peer_loss = float(toeplitz.loss(jnp.asarray(peer), n=n, reduction_fn=fn))
    assert loss(BandedToeplitz(tuple(peer)), n, reduction=reduction) == pytest.approx(
        peer_loss, rel=1e-9
    )
    optimize_banded_toeplitz.cache_clear()
    ours = optimize_banded_toeplitz(n, n, reduction=reduction, show_progress=False)
    with jax.enable_x64(True):
        c = np.asarray(ours.toeplitz_coefs(n))
        ours_by_peer = _peer_error(c, n, reduction) * float(np.sum(c * c))
    assert loss(ours, n, reduction=reduction) == pytest.approx(ours_by_peer, rel=1e-9)
    assert ours_by_peer <= peer_loss * (1 + 1e-6)


@pytest.mark.parametrize("reduction", ["mean", "max"])
@pytest.mark.parametrize("n,bands,sep", [(100, 8, 30), (50, 4, 12)])
def test_banded_min_sep_with_a_cut_column_no_worse_than_peer(n, bands, sep, reduction):
    part = MinSeparation(sep)
    fn = jnp.mean if reduction == "mean" else jnp.max
    with jax.enable_x64(True):
        peer = BandedToeplitz(
            tuple(np.asarray(toeplitz.optimize_banded_toeplitz(n, bands, reduction_fn=fn)))
        )
    optimize_banded_toeplitz.cache_clear()
    ours = optimize_banded_toeplitz(n, bands, part, reduction=reduction, show_progress=False)
    with jax.enable_x64(True):
        by_peer = []
        for C in (ours, peer):
            s = float(
                jsens.get_sensitivity_banded(
                    jnp.asarray(C.materialize(n)),
                    min_sep=sep,
                    max_participations=part.participations(n),
                )
            )
            ps = sensitivity(C, part, n)
            assert ps.exact and ps.value >= s * (1 - 8 * U)
            assert ps.value == pytest.approx(s, rel=1e-12)
            by_peer.append(_peer_error(np.asarray(C.toeplitz_coefs(n)), n, reduction) * s * s)
    assert loss(ours, n, part, reduction=reduction) == pytest.approx(by_peer[0], rel=1e-9)
    assert by_peer[0] <= by_peer[1] * (1 + 1e-9)


@pytest.mark.parametrize(
    "n,buffers,epochs,reduction", [(64, 2, 4, "max"), (64, 3, 4, "mean"), (256, 4, 4, "max")]
)
def test_blt_fixed_epochs_no_worse_than_peer(n, buffers, epochs, reduction):
    part = FixedEpochs(epochs)
    with jax.enable_x64(True):
        loss_fn = bt.LossFn.build_min_sep(
            n=n, error=reduction, min_sep=n // epochs, max_participations=epochs
        )
        blt, peer_loss = bt.optimize_loss(loss_fn, num_buffers=buffers)
        peer_loss = float(peer_loss)
    peer = BufferedToeplitz(
        tuple(np.asarray(blt.buf_decay, float)), tuple(np.asarray(blt.output_scale, float))
    )
    assert loss(peer, n, part, reduction=reduction) == pytest.approx(peer_loss, rel=1e-8)
    optimize_blt.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # buffers the optimum leaves unused: dropped
        ours = optimize_blt(n, buffers, part, reduction=reduction, show_progress=False)
    with jax.enable_x64(True):
        peer_sens = float(jsens.fixed_epoch_sensitivity(jnp.asarray(ours.materialize(n)), epochs))
        peer_blt = bt.BufferedToeplitz.build(
            buf_decay=ours.buf_decay, output_scale=ours.output_scale
        )
        ours_by_peer = float(loss_fn.loss(peer_blt))
    s = sensitivity(ours, part, n)
    assert s.exact and s.value >= peer_sens * (1 - 8 * U)
    assert s.value == pytest.approx(peer_sens, rel=1e-12)
    assert loss(ours, n, part, reduction=reduction) == pytest.approx(ours_by_peer, rel=1e-8)
    assert ours_by_peer <= peer_loss * 1.01
