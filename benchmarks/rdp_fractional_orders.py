"""Time of the RDP curve of a Poisson-subsampled Gaussian composed 10^6 times, on Opacus's
default order grid (``1 + x/10`` for x in 1..99, then 12..63: mostly fractional orders).

Usage::

    python benchmarks/rdp_fractional_orders.py [--before CHECKOUT] [--repeat 5]

Each cell times ``compose(subsample(Gaussian(sigma), q), steps=10**6).rdp(orders)`` after
clearing the RDP caches (a cold curve), best of ``--repeat`` runs, wall seconds, for q in
{1e-5, 1e-3, 0.01, 0.1} and sigma in {0.8, 2, 10}. With ``--before CHECKOUT`` (another
checkout of privlearn, e.g. a ``git worktree`` of an older commit) the same cells are timed
on that checkout in a subprocess, interleaved with this one's. Single-threaded BLAS is
advised (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)]
CELLS = [(q, s) for q in (1e-5, 1e-3, 0.01, 0.1) for s in (0.8, 2.0, 10.0)]


def _time_cells(repeat: int) -> list[float]:
    from privlearn.accounting import Gaussian, compose, subsample
    from privlearn.accounting.rdp import clear_caches

    out = []
    for q, s in CELLS:
        best = float("inf")
        for _ in range(repeat):
            clear_caches()
            t0 = time.perf_counter()
            compose(subsample(Gaussian(s), q), steps=10**6).rdp(ORDERS)
            best = min(best, time.perf_counter() - t0)
        out.append(best)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another privlearn checkout to time the same cells on")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(_time_cells(args.repeat)))
        return
    before = None
    if args.before:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.before))
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--json",
                              "--repeat", str(args.repeat)], env=env, check=True,
                             capture_output=True, text=True, cwd=args.before)
        before = json.loads(res.stdout)
    now = _time_cells(args.repeat)
    print("| q | sigma | time (s) |" + (" before (s) | ratio |" if before else ""))
    print("|---|---|---|" + ("---|---|" if before else ""))
    for k, (q, s) in enumerate(CELLS):
        row = f"| {q:g} | {s:g} | {now[k]:.4f} |"
        if before:
            row += f" {before[k]:.4f} | {now[k] / before[k]:.2f} |"
        print(row)
    print(f"total {sum(now):.3f} s" + (f", before {sum(before):.3f} s" if before else ""))


if __name__ == "__main__":
    main()
