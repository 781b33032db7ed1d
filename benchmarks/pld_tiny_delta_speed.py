"""Time of one certified ``epsilon(delta)`` query of the PLD accountant at tiny delta.

Each query runs in a fresh process (a new :class:`PLDAccountant`, nothing cached; the
import is not timed), one thread. With ``--against PATH`` (another checkout of privlearn)
the same queries run with that checkout too, interleaved case by case and repeat by
repeat, so that both see the same machine load; the median of the repeats is reported
with the certified bracket of each.

Run: ``OMP_NUM_THREADS=1 python benchmarks/pld_tiny_delta_speed.py [--against PATH]
[--repeats 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [
    # (base, param, rate, scheme, neighbouring, steps, delta)
    ("gaussian", 0.61, 1.5e-4, "poisson", "add_remove", 9617, 1.4e-11),
    ("gaussian", 0.356, 5.83e-4, "fixed", "replace_one", 1264, 7e-14),
    ("gaussian", 1.0, 1e-3, "poisson", "add_remove", 10_000, 1e-12),
    ("gaussian", 0.8, 1e-3, "poisson", "replace_one", 2000, 1e-13),
    ("gaussian", 0.5, 1e-4, "poisson", "add_remove", 50_000, 1e-12),
    ("gaussian", 2.0, 0.01, "poisson", "add_remove", 5000, 1e-14),
    ("laplace", 1.0, 1e-3, "poisson", "add_remove", 10_000, 1e-12),
    # fixed-size sampling at a tiny rate; make_private(..., epochs=1e12) at batch 256 of
    # 60000 (no untilted grid can certify delta: the RDP fallback answers)
    ("gaussian", 1.0, 1e-6, "fixed", "replace_one", 1_000_000, 1e-12),
    ("gaussian", 1.0, 256 / 60000, "poisson", "add_remove", 234_000_000_000_000, 1e-5),
]

_CHILD = """
import json, sys, time
import privlearn.accounting as acc
from privlearn.accounting.pld import PLDAccountant
base, param, q, scheme, nb, steps, delta = json.loads(sys.argv[1])
b0 = acc.Gaussian(param) if base == "gaussian" else acc.Laplace(param)
m = acc.compose(acc.subsample(b0, q, scheme=scheme, neighbouring=nb), steps)
t0 = time.perf_counter()
b = PLDAccountant().epsilon(m, delta)
print(json.dumps([time.perf_counter() - t0, b.upper, b.lower, b.accountant]))
"""


def _run(root: str, case) -> tuple[float, float, float | None, str]:
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(case)], env=env,
                         capture_output=True, text=True, check=True, cwd="/")
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default=None, help="another privlearn checkout to time")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    roots = [("this", here)] + ([("other", args.against)] if args.against else [])
    rows = []
    for case in CASES:
        times = {name: [] for name, _ in roots}
        last = {}
        for r in range(args.repeats):
            order = roots if r % 2 == 0 else roots[::-1]
            for name, root in order:
                t, up, lo, who = _run(root, case)
                times[name].append(t)
                last[name] = (up, lo, who)
        base, param, q, scheme, nb, steps, delta = case
        label = (f"{base} {param}, q={q:g}, {scheme}, {nb}, {steps:,} steps, "
                 f"delta={delta:g}")
        cells = []
        for name, _ in roots:
            up, lo, who = last[name]
            lo_s = "-" if lo is None else f"{lo:.6g}"
            cells.append(f"{statistics.median(times[name]):.2f} s | {up:.6g} / {lo_s} ({who})")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    head = "| case | " + " | ".join(f"{n}: time | upper / lower (by)" for n, _ in roots) + " |"
    print("\n" + head + "\n|" + "---|" * (1 + 2 * len(roots)) + "\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
