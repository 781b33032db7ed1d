"""Parity sweep of privlearn's strategy optimisers against jax_privacy 2.0.0's.

For a grid of steps (16 to 4096), bands or buffers (1 to 8) and participation patterns
(single; ``k`` participations at least ``b`` steps apart; fixed epochs), optimises the
strategy with privlearn and with jax_privacy in the same run, and evaluates BOTH strategies
with the same loss -- mean or max per-query squared error of the prefix sums times the
squared multi-participation sensitivity -- twice: by ``privlearn.correlated.loss`` and by
jax_privacy's own functions (``toeplitz.per_query_error`` and its sensitivity rules). It
also checks that the two libraries' sensitivities of each strategy agree. Families:

* ``banded``: ``optimize_banded_toeplitz`` against ``toeplitz.optimize_banded_toeplitz``
  (the peer optimises for single participation; with ``bands <= min_sep`` its optimum is
  evaluated under the participation pattern, as its docstring prescribes);
* ``toeplitz``: the same with ``bands = steps`` (full Toeplitz);
* ``blt``: ``optimize_blt`` against ``buffered_toeplitz.optimize_loss`` with
  ``LossFn.build_min_sep`` (or the closed-form single-participation loss), buffers fixed;
* ``dense``: ``optimize_dense`` against jax_privacy's ``dense.optimize`` (a non-Toeplitz
  ``n x n`` strategy, mean error, fixed epochs), each evaluated by both libraries; also
  privlearn's best streaming strategies (banded with every band, 8-buffer BLT: a fixed
  recurrence for any number of steps) against the peer's dense optimum, which shows what
  streaming costs.

Usage (jax on CPU, float64)::

    OMP_NUM_THREADS=1 python benchmarks/jax_privacy_parity_sweep.py [--quick]
        [--only banded|toeplitz|blt|dense] [--steps N ...] [--out FILE.json]

Each row prints as a JSON line; the worst ratio of each family at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn

STEPS = [16, 64, 256, 1024, 4096]
SIZES = [1, 2, 4, 8]
BLT_SIZES = [2, 4]  # the peer's BLT optimiser takes 10-40 s a problem: every size at 256


def _patterns(n: int) -> list[tuple[int, int]]:
    """(min_sep, participations): single, all participations n/16 apart, 4 epochs."""
    out = [(n, 1), (max(1, n // 16), 16), (n // 4, 4)]
    return out


def _part(n: int, sep: int, k: int, epochs: bool = False):
    from privlearn.correlated import FixedEpochs, MinSeparation, SingleParticipation

    if k == 1:
        return SingleParticipation()
    if epochs:
        return FixedEpochs(k)
    return MinSeparation(sep, k)


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def _peer_loss(
    coefs: np.ndarray, n: int, sep: int, k: int, reduction: str, dense: np.ndarray | None = None
) -> float:
    """jax_privacy's loss of the Toeplitz strategy with these coefficients: its per-query
    error times its sensitivity (its Toeplitz rule for non-negative, non-increasing
    coefficients, else its banded rule on the dense matrix)."""
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import sensitivity as jsens
    from jax_privacy.matrix_factorization import toeplitz

    err = np.asarray(toeplitz.per_query_error(strategy_coef=jnp.asarray(coefs), n=n))
    e = float(err.mean() if reduction == "mean" else err.max())
    if np.all(coefs >= 0) and np.all(np.diff(coefs) <= 0):
        s2 = float(
            toeplitz.minsep_sensitivity_squared(
                jnp.asarray(coefs), min_sep=sep, max_participations=k, n=n
            )
        )
    else:
        mat = (
            dense
            if dense is not None
            else np.tril(
                np.array(
                    [
                        [coefs[i - j] if 0 <= i - j < coefs.size else 0.0 for j in range(n)]
                        for i in range(n)
                    ]
                )
            )
        )
        s2 = (
            float(jsens.get_sensitivity_banded(jnp.asarray(mat), min_sep=sep, max_participations=k))
            ** 2
        )
    return e * s2


def _row(family, n, size, sep, k, reduction, ours, theirs, t_ours, t_theirs, part):
    from privlearn.correlated import BufferedToeplitz, loss, sensitivity

    lo = loss(ours, n, part, reduction=reduction)
    lt = loss(theirs, n, part, reduction=reduction)
    co = np.asarray(ours.toeplitz_coefs(n))
    ct = np.asarray(theirs.toeplitz_coefs(n))
    bands_ok = (
        k == 1
        or (ours.bands is not None and ours.bands <= sep)
        or (np.all(co >= 0) and np.all(np.diff(co) <= 0))
    )
    po = _peer_loss(co, n, sep, k, reduction) if bands_ok and n <= 1024 else None
    pt = _peer_loss(ct, n, sep, k, reduction) if bands_ok and n <= 1024 else None
    so = sensitivity(ours, part, n)
    row = {
        "family": family,
        "n": n,
        "size": size,
        "min_sep": sep,
        "k": k,
        "reduction": reduction,
        "privlearn_loss": lo,
        "jax_loss": lt,
        "ratio": lo / lt,
        "privlearn_s": round(t_ours, 3),
        "jax_s": round(t_theirs, 2),
        "sens_exact": so.exact,
    }
    if isinstance(theirs, BufferedToeplitz):
        row["peer"] = {
            "buf_decay": list(theirs.buf_decay),
            "output_scale": list(theirs.output_scale),
        }
    else:
        row["peer"] = {"coefs": list(theirs.coefs)}
    if pt is not None:
        row["jax_loss_by_jax_eval"] = pt
    if po is not None and pt is not None:
        row["ratio_by_jax_eval"] = po / pt
        row["eval_agree"] = abs(po / lo - 1) < 1e-8 and abs(pt / lt - 1) < 1e-8
    return row


def run_banded(quick: bool, full: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import toeplitz

    from privlearn.correlated import BandedToeplitz, optimize_banded_toeplitz

    rows = []
    for n in STEPS[:3] if quick else STEPS:
        for size in [n] if full else SIZES:
            if size > n or (full and n > 256):
                continue
            for sep, k in _patterns(n):
                if k > 1 and size > sep:
                    continue  # the peer's banded optimum is for bands <= min_sep
                for reduction in ("mean", "max"):
                    fn = jnp.mean if reduction == "mean" else jnp.max
                    with jax.enable_x64(True):
                        peer, tp = _timed(
                            toeplitz.optimize_banded_toeplitz, n, size, reduction_fn=fn
                        )
                        peer = np.asarray(peer)
                    part = _part(n, sep, k)
                    optimize_banded_toeplitz.cache_clear()
                    ours, to = _timed(
                        optimize_banded_toeplitz,
                        n,
                        size,
                        part,
                        reduction=reduction,
                        show_progress=False,
                    )
                    with jax.enable_x64(True):
                        row = _row(
                            "toeplitz" if full else "banded",
                            n,
                            size,
                            sep,
                            k,
                            reduction,
                            ours,
                            BandedToeplitz(tuple(peer)),
                            to,
                            tp,
                            part,
                        )
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def run_blt(quick: bool) -> list[dict]:
    import jax
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt

    from privlearn.correlated import BufferedToeplitz, optimize_blt

    rows = []
    for n in STEPS[:3] if quick else STEPS:
        for size in SIZES if n == 256 else BLT_SIZES:
            for sep, k in _patterns(n):
                epochs = k == 4
                for reduction in ("max", "mean") if n == 64 else ("max",):
                    with jax.enable_x64(True):
                        if k == 1 and reduction == "max":
                            loss_fn = bt.LossFn.build_closed_form_single_participation(n=n)
                        else:
                            loss_fn = bt.LossFn.build_min_sep(
                                n=n, error=reduction, min_sep=sep, max_participations=k
                            )
                        try:
                            (blt, _), tp = _timed(bt.optimize_loss, loss_fn, num_buffers=size)
                        except (RuntimeError, ValueError) as e:
                            print(
                                json.dumps(
                                    {
                                        "family": "blt",
                                        "n": n,
                                        "size": size,
                                        "min_sep": sep,
                                        "k": k,
                                        "peer_failed": str(e)[:80],
                                    }
                                )
                            )
                            continue
                    theirs = BufferedToeplitz(
                        tuple(np.asarray(blt.buf_decay, float)),
                        tuple(np.asarray(blt.output_scale, float)),
                    )
                    part = _part(n, sep, k, epochs)
                    optimize_blt.cache_clear()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        ours, to = _timed(
                            optimize_blt, n, size, part, reduction=reduction, show_progress=False
                        )
                    with jax.enable_x64(True):
                        row = _row("blt", n, size, sep, k, reduction, ours, theirs, to, tp, part)
                    row["epochs"] = epochs
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def run_dense(quick: bool) -> list[dict]:
    """jax_privacy's dense (non-Toeplitz) optimum under fixed epochs against privlearn's
    (``optimize_dense``) and its best streaming strategies (banded with every band,
    8-buffer BLT), all evaluated by the dense definition: ``mean_t ||(A C^{-1})[t]||^2 *
    sens^2``, privlearn's dense strategy also by jax_privacy's own ``per_query_error`` and
    ``fixed_epoch_sensitivity``."""
    import jax
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import dense
    from jax_privacy.matrix_factorization import sensitivity as jsens

    from privlearn.correlated import (
        FixedEpochs,
        loss,
        optimize_banded_toeplitz,
        optimize_blt,
        optimize_dense,
    )

    rows = []
    for n in (16, 64) if quick else (16, 64, 256):
        for epochs in (1, 4):
            with jax.enable_x64(True):
                c_dense, tp = _timed(dense.optimize, n, epochs=epochs)
                c_dense = np.asarray(c_dense)
                err = np.asarray(dense.per_query_error(strategy_matrix=jnp.asarray(c_dense)))
                sens = float(jsens.fixed_epoch_sensitivity(jnp.asarray(c_dense), epochs))
            peer = float(err.mean()) * sens**2
            part = FixedEpochs(epochs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                toep, to = _timed(optimize_banded_toeplitz, n, n, part, show_progress=False)
                blt = optimize_blt(n, 8, part, reduction="mean", show_progress=False)
            optimize_dense.cache_clear()
            ours, td = _timed(optimize_dense, n, part, show_progress=False)
            with jax.enable_x64(True):
                c_ours = jnp.asarray(ours.materialize())
                err_o = np.asarray(dense.per_query_error(strategy_matrix=c_ours))
                sens_o = float(jsens.fixed_epoch_sensitivity(c_ours, epochs))
            row = {
                "family": "dense",
                "n": n,
                "epochs": epochs,
                "jax_dense_loss": peer,
                "dense_ratio": loss(ours, n, part) / peer,
                "dense_ratio_by_jax": float(err_o.mean()) * sens_o**2 / peer,
                "toeplitz_ratio": loss(toep, n, part) / peer,
                "blt8_ratio": loss(blt, n, part) / peer,
                "privlearn_dense_s": round(td, 3),
                "privlearn_s": round(to, 3),
                "jax_s": round(tp, 2),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="steps up to 256 only")
    ap.add_argument("--only", choices=["banded", "toeplitz", "blt", "dense"], default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, nargs="+", default=None, help="steps to sweep")
    a = ap.parse_args()
    if a.steps:
        STEPS[:] = a.steps
    rows: list[dict] = []
    if a.only in (None, "banded"):
        rows += run_banded(a.quick, full=False)
    if a.only in (None, "toeplitz"):
        rows += run_banded(a.quick, full=True)
    if a.only in (None, "blt"):
        rows += run_blt(a.quick)
    if a.only in (None, "dense"):
        rows += run_dense(a.quick)
    for fam in ("banded", "toeplitz", "blt"):
        fr = [r for r in rows if r.get("family") == fam and "ratio" in r]
        if fr:
            worst = max(fr, key=lambda r: r["ratio"])
            print(
                f"{fam}: {len(fr)} rows, worst privlearn/jax {worst['ratio']:.6f} at "
                f"n={worst['n']} size={worst['size']} sep={worst['min_sep']} k={worst['k']} "
                f"{worst['reduction']}; privlearn {sum(r['privlearn_s'] for r in fr):.1f} s, "
                f"jax {sum(r['jax_s'] for r in fr):.1f} s in all"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
