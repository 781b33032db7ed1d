"""privlearn's strategy optimisers against jax_privacy's under several participations.

Three comparisons, each printed as one JSON line per problem (loss = error times squared
sensitivity, as :func:`privlearn.correlated.loss` computes it; ``ratio`` is privlearn's
over the peer's, below 1 is better):

* ``blt``: :func:`privlearn.correlated.optimize_blt` against jax_privacy's
  ``buffered_toeplitz.optimize`` (number of buffers fixed) under b-min-separation, with
  and without a cap on the participations, max and mean error;
* ``banded``: :func:`privlearn.correlated.optimize_banded_toeplitz` under
  ``MinSeparation(sep)`` (``bands <= sep``) against jax_privacy's
  ``banded.optimize`` (a column-normalised banded matrix that is not Toeplitz: ``n x b``
  free entries, the wider family of Choquette-Choo et al. 2023b and McKenna 2024) and
  its ``toeplitz.optimize_banded_toeplitz`` (the same family as privlearn's); the
  non-Toeplitz matrix's loss is computed densely here;
* ``bandinv``: banded *inverse* Toeplitz noising matrices (BandInvMF; Kalinin, McKenna,
  Upadhyay & Lampert 2025, arXiv:2505.12128) optimised by jax_privacy's
  ``toeplitz.optimize_banded_inverse_toeplitz`` (newer than jax_privacy 2.0.0: pass
  ``--mf-source DIR``, a folder holding a copy of the newer
  ``jax_privacy/matrix_factorization`` package under the name ``jpm_mf``), against
  privlearn's banded strategy with the same number of bands and its BLTs.

jax_privacy is a benchmark-only extra (``pip install "jax[cpu]" chex optax absl-py
dp-accounting`` and ``pip install --no-deps jax-privacy==2.0.0`` in a private virtual
environment; never in the project's environment). Usage::

    python benchmarks/jax_privacy_participation.py --only blt|banded|bandinv
        [--mf-source DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn

# (n, buffers, min_sep, max_participations, reduction)
BLT = [
    (1000, 2, 10, None, "max"), (1000, 4, 20, None, "mean"), (2048, 3, 128, 8, "max"),
    (500, 5, 25, None, "mean"), (1024, 1, 64, None, "max"), (3000, 3, 300, 5, "mean"),
    (8192, 4, 512, None, "max"),
]
# (n, bands, min_sep, reduction), bands <= min_sep
BANDED = [(64, 4, 4, "mean"), (128, 8, 16, "mean"), (256, 8, 8, "mean"), (256, 4, 32, "max"),
          (512, 16, 16, "mean")]
# (n, participations): min_sep = n / participations, 8 bands
BANDINV = [(128, 1), (128, 4), (128, 16), (512, 4), (512, 16), (1024, 8)]


def _jax():
    import jax

    jax.config.update("jax_enable_x64", True)
    return jax


def run_blt() -> None:
    _jax()
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt

    from privlearn.correlated import BufferedToeplitz, MinSeparation, loss, optimize_blt

    for n, m, sep, k, red in BLT:
        t0 = time.perf_counter()
        peer = bt.optimize(n=n, min_sep=sep, max_participations=k, error=red,
                           min_buffers=m, max_buffers=m)
        peer_s = time.perf_counter() - t0
        loss_fn = bt.LossFn.build_min_sep(n=n, error=red, min_sep=sep, max_participations=k)
        p = MinSeparation(sep, k)
        peer_loss = loss(BufferedToeplitz(tuple(map(float, peer.buf_decay)),
                                          tuple(map(float, peer.output_scale))), n, p,
                         reduction=red)
        t0 = time.perf_counter()
        ours = optimize_blt(n, m, p, reduction=red)
        ours_s = time.perf_counter() - t0
        ours_loss = loss(ours, n, p, reduction=red)
        print(json.dumps({"kind": "blt", "n": n, "buffers": m, "min_sep": sep,
                          "max_participations": k, "reduction": red,
                          "peer_loss_own": float(loss_fn.loss(peer)), "peer_loss": peer_loss,
                          "privlearn_loss": ours_loss, "ratio": ours_loss / peer_loss,
                          "peer_s": round(peer_s, 1), "privlearn_s": round(ours_s, 2)}),
              flush=True)


def _dense_loss(m, sep: int, k: int, reduction: str) -> float:
    """Error times squared sensitivity of a dense banded ``m`` with ``bands <= sep``
    (orthogonal columns: the sensitivity is the best pattern of squared column norms)."""
    import numpy as np

    n = m.shape[0]
    err = np.sum((np.tril(np.ones((n, n))) @ np.linalg.inv(m)) ** 2, axis=1)
    e = err.mean() if reduction == "mean" else err.max()
    col2 = np.sum(m * m, axis=0)
    return float(e * max(col2[j::sep][:k].sum() for j in range(sep)))


def run_banded() -> None:
    jax = _jax()
    import numpy as np
    from jax_privacy.matrix_factorization import banded, toeplitz

    from privlearn.correlated import (
        BandedToeplitz,
        MinSeparation,
        loss,
        optimize_banded_toeplitz,
    )

    for n, b, sep, red in BANDED:
        k = math.ceil(n / sep)
        p = MinSeparation(sep)
        fn = jax.numpy.mean if red == "mean" else jax.numpy.max
        t0 = time.perf_counter()
        general = banded.optimize(n, bands=b, reduction_fn=fn, max_optimizer_steps=250)
        peer_s = time.perf_counter() - t0
        general_loss = _dense_loss(np.asarray(general.materialize()), sep, k, red)
        coef = toeplitz.optimize_banded_toeplitz(n, b, reduction_fn=fn)
        peer_toeplitz = loss(BandedToeplitz(tuple(map(float, coef))), n, p, reduction=red)
        t0 = time.perf_counter()
        ours = optimize_banded_toeplitz(n, b, p, reduction=red)
        ours_s = time.perf_counter() - t0
        ours_loss = loss(ours, n, p, reduction=red)
        print(json.dumps({"kind": "banded", "n": n, "bands": b, "min_sep": sep,
                          "reduction": red, "peer_general_loss": general_loss,
                          "peer_toeplitz_loss": peer_toeplitz, "privlearn_loss": ours_loss,
                          "ratio_general": ours_loss / general_loss,
                          "ratio_toeplitz": ours_loss / peer_toeplitz,
                          "peer_s": round(peer_s, 1), "privlearn_s": round(ours_s, 2)}),
              flush=True)


def run_bandinv(source: str | None) -> None:
    _jax()
    if source:
        sys.path.insert(0, source)
        from jpm_mf import toeplitz
    else:
        from jax_privacy.matrix_factorization import toeplitz
    if not hasattr(toeplitz, "optimize_banded_inverse_toeplitz"):
        raise SystemExit("this jax_privacy has no optimize_banded_inverse_toeplitz: pass "
                         "--mf-source with a newer copy of its matrix_factorization package")
    import numpy as np

    from privlearn.correlated import (
        BandedToeplitz,
        MinSeparation,
        _toeplitz,
        loss,
        optimize_banded_toeplitz,
        optimize_blt,
        sensitivity,
    )

    bands = 8
    for n, k in BANDINV:
        sep = n // k
        t0 = time.perf_counter()
        r = np.asarray(toeplitz.optimize_banded_inverse_toeplitz(
            n, sep, bands, max_participations=k, max_optimizer_steps=300))
        peer_s = time.perf_counter() - t0
        # the peer's strategy, C = (its banded C^{-1})^{-1}, through privlearn's loss
        peer = BandedToeplitz(tuple(_toeplitz.inverse(r, n)))
        p = MinSeparation(sep, k)
        peer_loss = loss(peer, n, p)
        row = {"kind": "bandinv", "n": n, "participations": k, "min_sep": sep,
               "bands": bands, "peer_loss": peer_loss,
               "peer_sensitivity_exact": sensitivity(peer, p, n).exact,
               "peer_s": round(peer_s, 1)}
        for name, strategy in (("banded8", optimize_banded_toeplitz(n, bands, p)),
                               ("blt4", optimize_blt(n, 4, p, reduction="mean")),
                               ("blt7", optimize_blt(n, 7, p, reduction="mean"))):
            row[f"ratio_{name}"] = loss(strategy, n, p) / peer_loss
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["blt", "banded", "bandinv"], required=True)
    ap.add_argument("--mf-source", default=None,
                    help="folder holding a newer jax_privacy matrix_factorization as jpm_mf")
    a = ap.parse_args()
    {"blt": run_blt, "banded": run_banded,
     "bandinv": lambda: run_bandinv(a.mf_source)}[a.only]()


if __name__ == "__main__":
    main()
