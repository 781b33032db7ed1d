"""Time privlearn's strategy optimisers on the problems of the stored jax_privacy
reference (``tests/correlated/data/jax_privacy_strategies.json``, written by
``benchmarks/jax_privacy_strategies.py``) and print a Markdown table: jax_privacy's loss
and time beside privlearn's loss ratio and time. Usage::

    OMP_NUM_THREADS=1 python benchmarks/correlated_optimizers.py [--max-n 100000]
        [--only banded|blt]

(set ``OMP_NUM_THREADS`` to the thread count to measure; FFTs and the L-BFGS loop are
single-threaded either way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's privlearn


def main() -> None:
    from privlearn.correlated import MinSeparation, loss, optimize_banded_toeplitz, optimize_blt

    ap = argparse.ArgumentParser()
    ap.add_argument("--max-n", type=int, default=100_000)
    ap.add_argument("--only", choices=["banded", "blt"], default=None)
    a = ap.parse_args()
    ref = json.loads((ROOT / "tests/correlated/data/jax_privacy_strategies.json").read_text())
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"jax_privacy {ref['versions']['jax_privacy']} times from {ref['date']}")
    print("| strategy | steps | size | participation | reduction | jax_privacy loss | "
          "jax_privacy s | privlearn / jax_privacy loss | privlearn s |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|")
    if a.only in (None, "banded"):
        for r in ref["banded"]:
            if r["n"] > a.max_n:
                continue
            t0 = time.perf_counter()
            c = optimize_banded_toeplitz(r["n"], r["bands"], reduction=r["reduction"])
            dt = time.perf_counter() - t0
            ratio = loss(c, r["n"], reduction=r["reduction"]) / r["loss"]
            print(f"| banded | {r['n']} | {r['bands']} bands | single | {r['reduction']} | "
                  f"{r['loss']:.6g} | {r['seconds']:.1f} | {ratio:.6f} | {dt:.2f} |",
                  flush=True)
    if a.only in (None, "blt"):
        for r in ref["blt"]:
            if r["n"] > a.max_n:
                continue
            single = r["min_sep"] == 1 and r["max_participations"] == 1
            p = None if single else MinSeparation(r["min_sep"], r["max_participations"])
            t0 = time.perf_counter()
            c = optimize_blt(r["n"], r["buffers"], p, reduction=r["reduction"])
            dt = time.perf_counter() - t0
            ratio = loss(c, r["n"], p, reduction=r["reduction"]) / r["loss"]
            part = "single" if single else f"min_sep {r['min_sep']}" + (
                f", {r['max_participations']} max" if r["max_participations"] else "")
            print(f"| BLT | {r['n']} | {r['buffers']} buffers | {part} | {r['reduction']} | "
                  f"{r['loss']:.6g} | {r['seconds']:.1f} | {ratio:.6f} | {dt:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
