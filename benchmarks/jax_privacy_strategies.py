"""Reference optimised strategies from jax_privacy (the peer), stored for regression tests,
and the time each optimisation takes.

Runs jax_privacy's own optimisers (``toeplitz.optimize_banded_toeplitz`` and
``buffered_toeplitz.optimize`` with a fixed number of buffers) on a grid of problems and
writes their coefficients, their loss (as the peer computes it) and the wall time to a
small JSON file, with the versions used. The privlearn tests compare
``privlearn.correlated``'s optimisers with these values without needing jax.

jax_privacy is a benchmark-only extra: it needs jax, jaxlib, chex, optax and absl-py
(``pip install jax chex optax absl-py`` in a private virtual environment with system site
packages, jax_privacy 2.0.0 installed with ``--no-deps``). Usage::

    python benchmarks/jax_privacy_strategies.py [--out FILE.json] [--quick]
        [--only banded|blt] [--time-privlearn]

``--time-privlearn`` also times privlearn's optimisers on the same problems in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn

# (n, bands, reduction): the peer's banded optimiser is for single participation
BANDED = [
    (16, 4, "mean"), (64, 8, "mean"), (256, 2, "mean"), (256, 4, "mean"), (256, 5, "mean"),
    (256, 8, "mean"), (512, 4, "mean"), (1024, 4, "mean"), (2000, 3, "mean"),
    (2000, 64, "mean"), (256, 4, "max"), (1024, 8, "max"), (4096, 16, "mean"),
    (10_000, 64, "mean"),
]
# (n, buffers, min_sep, max_participations, reduction)
BLT = [
    (256, 3, 1, 1, "max"), (1000, 4, 1, 1, "max"), (10_000, 4, 1, 1, "max"),
    (1000, 2, 1, 1, "mean"), (512, 2, 16, None, "max"), (1000, 3, 50, 10, "mean"),
    (2000, 4, 100, None, "max"), (4096, 6, 256, None, "max"), (1024, 8, 1, 1, "max"),
    (100_000, 4, 1, 1, "max"), (100_000, 4, 1, 1, "mean"), (100_000, 8, 1, 1, "max"),
    (100_000, 4, 1000, None, "max"),
]


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    import jax
    import numpy

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "jax_privacy": version("jax-privacy"),
        "numpy": numpy.__version__,
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
    }


def run_banded(quick: bool, time_ours: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import toeplitz

    out = []
    for n, bands, reduction in BANDED:
        if quick and n > 2000:
            continue
        fn = jnp.mean if reduction == "mean" else jnp.max
        with jax.enable_x64(True):
            t0 = time.perf_counter()
            coef = toeplitz.optimize_banded_toeplitz(n, bands, reduction_fn=fn)
            coef.block_until_ready()
            elapsed = time.perf_counter() - t0
            peer_loss = float(toeplitz.loss(coef, n=n, reduction_fn=fn))
        row = {"n": n, "bands": bands, "reduction": reduction,
               "coefs": [float(x) for x in coef], "loss": peer_loss,
               "seconds": round(elapsed, 2)}
        if time_ours:
            row.update(_ours_banded(n, bands, reduction))
        print(json.dumps({k: v for k, v in row.items() if k != "coefs"}), flush=True)
        out.append(row)
    return out


def run_blt(quick: bool, time_ours: bool) -> list[dict]:
    import jax
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt

    out = []
    for n, m, sep, k, reduction in BLT:
        if quick and n > 10_000:
            continue
        with jax.enable_x64(True):
            t0 = time.perf_counter()
            blt = bt.optimize(n=n, min_sep=sep, max_participations=k, error=reduction,
                              min_buffers=m, max_buffers=m)
            elapsed = time.perf_counter() - t0
            if k == 1 and reduction == "max":
                loss_fn = bt.LossFn.build_closed_form_single_participation(n=n)
            else:
                loss_fn = bt.LossFn.build_min_sep(n=n, error=reduction, min_sep=sep,
                                                  max_participations=k)
            peer_loss = float(loss_fn.loss(blt))
        row = {"n": n, "buffers": m, "min_sep": sep, "max_participations": k,
               "reduction": reduction,
               "buf_decay": [float(x) for x in blt.buf_decay],
               "output_scale": [float(x) for x in blt.output_scale],
               "loss": peer_loss, "seconds": round(elapsed, 2)}
        if time_ours:
            row.update(_ours_blt(n, m, sep, k, reduction))
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _participation(n: int, sep: int, k: int | None):
    from privlearn.correlated import MinSeparation

    return None if sep == 1 and k == 1 else MinSeparation(sep, k)


def _ours_banded(n: int, bands: int, reduction: str) -> dict:
    from privlearn.correlated import loss, optimize_banded_toeplitz

    t0 = time.perf_counter()
    c = optimize_banded_toeplitz(n, bands, reduction=reduction)
    elapsed = time.perf_counter() - t0
    return {"privlearn_loss": loss(c, n, reduction=reduction),
            "privlearn_seconds": round(elapsed, 2)}


def _ours_blt(n: int, m: int, sep: int, k: int | None, reduction: str) -> dict:
    from privlearn.correlated import loss, optimize_blt

    p = _participation(n, sep, k)
    t0 = time.perf_counter()
    c = optimize_blt(n, m, p, reduction=reduction)
    elapsed = time.perf_counter() - t0
    return {"privlearn_loss": loss(c, n, p, reduction=reduction),
            "privlearn_seconds": round(elapsed, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="skip n > 10,000")
    ap.add_argument("--only", choices=["banded", "blt"], default=None)
    ap.add_argument("--time-privlearn", action="store_true")
    a = ap.parse_args()
    result = {"versions": _versions(),
              "command": "python benchmarks/jax_privacy_strategies.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    if a.only in (None, "banded"):
        result["banded"] = run_banded(a.quick, a.time_privlearn)
    if a.only in (None, "blt"):
        result["blt"] = run_blt(a.quick, a.time_privlearn)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
