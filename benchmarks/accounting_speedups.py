"""Before/after CPU time of the PLD accountant's slow spots, interleaved, with dp_accounting.

Usage::

    git archive <old-commit> privlearn | tar -x -C /tmp/baseline
    OMP_NUM_THREADS=1 python benchmarks/accounting_speedups.py --baseline /tmp/baseline

Each query runs in a fresh process (imports included in neither time: the CPU time of the
query alone), the baseline checkout's and this checkout's alternately, ``--repeats`` times,
then dp_accounting's PLD (interval 1e-4) on the 5 x 10^7-step case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> (sigma, q, steps, delta, scheme)
CASES = {
    "5e7 steps, sigma 0.8, q 1e-3": (0.8, 1e-3, 50_000_000, 1e-5, "poisson"),
    "one step, sigma 0.3, q 1e-5, delta 1e-12 (Poisson)": (0.3, 1e-5, 1, 1e-12, "poisson"),
    "one step, sigma 0.3, q 1e-5, delta 1e-12 (fixed size)": (0.3, 1e-5, 1, 1e-12, "fixed"),
}


def _query(name: str) -> None:
    sigma, q, steps, delta, scheme = CASES[name]
    from privlearn.accounting import Gaussian, compose, subsample

    m = subsample(Gaussian(sigma), rate=q, scheme=scheme)
    m = compose(m, steps=steps) if steps > 1 else m
    from privlearn.accounting import get_accountant

    get_accountant("pld")  # load the accountant outside the timing
    t = time.process_time()
    b = m.epsilon_bounds(delta)
    print(json.dumps({"up": b.upper, "lo": b.lower, "cpu": time.process_time() - t}))


def _peer() -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    sigma, q, steps, delta, _ = CASES["5e7 steps, sigma 0.8, q 1e-3"]
    t = time.process_time()
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    e = acc.get_epsilon(delta)
    print(json.dumps({"up": e, "lo": None, "cpu": time.process_time() - t}))


def _run(args: list[str], path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="folder holding an older privlearn/ (required)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--query", help=argparse.SUPPRESS)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.query:
        return _query(a.query)
    if a.peer:
        return _peer()
    if not a.baseline:
        ap.error("--baseline is required")
    print("| case | before [lower] (CPU s) | after [lower] (CPU s) | dp_accounting 1e-4 |")
    print("|---|---|---|---|")
    for name in CASES:
        rows = []
        for _ in range(a.repeats):
            rows.append((_run(["--query", name], a.baseline), _run(["--query", name], str(ROOT))))
        peer = _run(["--peer"], str(ROOT)) if "5e7" in name else None
        before = ", ".join(f"{o['cpu']:.2f}" for o, _ in rows)
        after = ", ".join(f"{n['cpu']:.3f}" for _, n in rows)
        o, n = rows[0]
        p = f"{peer['up']:.6g} ({peer['cpu']:.2f} s)" if peer else "-"
        print(
            f"| {name} | {o['up']:.9g} [{o['lo']:.9g}] ({before}) | "
            f"{n['up']:.9g} [{n['lo']:.9g}] ({after}) | {p} |"
        )


if __name__ == "__main__":
    main()
