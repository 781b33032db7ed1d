"""Before/after CPU time of the PLD accountant's slow spots, interleaved, with dp_accounting.

Usage::

    git archive <old-commit> privlearn | tar -x -C /tmp/baseline
    OMP_NUM_THREADS=1 python benchmarks/accounting_speedups.py --baseline /tmp/baseline

Each query runs in a fresh process (imports included in neither time: the CPU time of the
query alone), the baseline checkout's and this checkout's alternately, ``--repeats`` times,
then dp_accounting's PLD on the cases it can answer (interval 1e-4; 1e-5 too at the tiny
rate). The heterogeneous cases compose 100 distinct Poisson-subsampled Gaussians (a noise
schedule, 10 steps each) or grow a history by one distinct part per step, asking for
epsilon after each (as a budget cap does).
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
    "1e6 steps, sigma 0.6, q 1e-6": (0.6, 1e-6, 1_000_000, 1e-5, "poisson"),
    "10 steps, sigma 1e-5, q 0.5": (1e-5, 0.5, 10, 1e-5, "poisson"),
    "1e4 steps, sigma 0.3, q 1e-6 (long PMF)": (0.3, 1e-6, 10_000, 1e-5, "poisson"),
    "1000 steps, sigma 1, q 0.01 (fixed size)": (1.0, 0.01, 1000, 1e-5, "fixed"),
}

#: name -> accountant; a schedule of 100 sigmas in [0.8, 1.6] at q 0.01, 10 steps each
HETEROGENEOUS = {
    "100 distinct sigmas x 10 steps, q 0.01 (RDP)": "rdp",
    "100 distinct sigmas x 10 steps, q 0.01 (PLD)": "pld",
    "history of 40 distinct sigmas, epsilon after each (RDP)": "rdp",
}


def _schedule(n: int):
    import numpy as np

    from privlearn.accounting import Gaussian, subsample

    return [subsample(Gaussian(float(s)), rate=0.01) for s in np.linspace(0.8, 1.6, n)]


def _heterogeneous(name: str) -> None:
    from privlearn.accounting import compose, get_accountant

    acc = get_accountant(HETEROGENEOUS[name])
    t = time.process_time()
    if name.startswith("history"):
        parts = []
        for part in _schedule(40):
            parts.append(part)
            b = acc.epsilon(compose(parts, steps=10), 1e-5)
    else:
        b = acc.epsilon(compose(_schedule(100), steps=10), 1e-5)
    lo = float("nan") if b.lower is None else b.lower
    print(json.dumps({"up": b.upper, "lo": lo, "cpu": time.process_time() - t}))


def _query(name: str) -> None:
    if name in HETEROGENEOUS:
        return _heterogeneous(name)
    sigma, q, steps, delta, scheme = CASES[name]
    from privlearn.accounting import Gaussian, compose, subsample

    m = subsample(Gaussian(sigma), rate=q, scheme=scheme)
    m = compose(m, steps=steps) if steps > 1 else m
    from privlearn.accounting import get_accountant

    get_accountant("pld")  # load the accountants outside the timing (the PLD accountant
    get_accountant("rdp")  # runs the RDP one for fixed-size sampling)
    t = time.process_time()
    b = m.epsilon_bounds(delta)
    print(json.dumps({"up": b.upper, "lo": b.lower, "cpu": time.process_time() - t}))


#: the cases dp_accounting's PLD is run on, with its discretization intervals
PEER = {"5e7 steps, sigma 0.8, q 1e-3": (1e-4,), "1e6 steps, sigma 0.6, q 1e-6": (1e-4, 1e-5)}


def _peer(name: str, interval: float) -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    sigma, q, steps, delta, _ = CASES[name]
    t = time.process_time()
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    e = acc.get_epsilon(delta)
    print(json.dumps({"up": e, "lo": None, "cpu": time.process_time() - t}))


def _run(args: list[str], path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _lo(row: dict) -> str:
    """The certified lower bound, or "-" where the accountant gives none (RDP)."""
    return "-" if row["lo"] != row["lo"] else f"{row['lo']:.9g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="folder holding an older privlearn/ (required)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--query", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--interval", type=float, default=1e-4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.query:
        return _query(a.query)
    if a.peer:
        return _peer(a.peer, a.interval)
    if not a.baseline:
        ap.error("--baseline is required")
    print("| case | before [lower] (CPU s) | after [lower] (CPU s) | dp_accounting |")
    print("|---|---|---|---|")
    for name in [n for n in [*CASES, *HETEROGENEOUS] if a.only in n]:
        rows = []
        for _ in range(a.repeats):
            rows.append((_run(["--query", name], a.baseline), _run(["--query", name], str(ROOT))))
        peers = [
            (i, _run(["--peer", name, "--interval", str(i)], str(ROOT))) for i in PEER.get(name, ())
        ]
        before = ", ".join(f"{o['cpu']:.2f}" for o, _ in rows)
        after = ", ".join(f"{n['cpu']:.3f}" for _, n in rows)
        o, n = rows[0]
        p = "; ".join(f"{p['up']:.6g} at {i:g} ({p['cpu']:.2f} s)" for i, p in peers) or "-"
        print(
            f"| {name} | {o['up']:.9g} [{_lo(o)}] ({before}) | "
            f"{n['up']:.9g} [{_lo(n)}] ({after}) | {p} |"
        )


if __name__ == "__main__":
    main()
