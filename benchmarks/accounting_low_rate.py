"""Low sampling rate, many steps: privlearn's certified PLD against dp_accounting and
prv_accountant, values and times.

Usage::

    python benchmarks/accounting_low_rate.py [--quick] [--no-prv] [--csv FILE]
    python benchmarks/accounting_low_rate.py --timing

    python benchmarks/accounting_low_rate.py --low-q [--before CHECKOUT]

``--timing`` times one query (q=1e-4, T=1e5, delta=1e-8, sigma 0.8 and 0.5; best of 3,
minimum of wall and CPU time) against dp_accounting's PLD, and the calibration of sigma
for epsilon=1 against dp_accounting's ``calibrate_dp_mechanism``.

``--low-q`` times ``epsilon(delta=1e-8)`` and ``delta(epsilon)`` at that epsilon for
q=1e-5, sigma in {0.5, 0.6, 0.8}, T in {1e5, 1e6}, each query in a fresh process with a
fresh accountant; with ``--before CHECKOUT`` (another checkout of privlearn, e.g. a
``git worktree`` of an older commit) the same queries on that checkout are run
interleaved with this one's, and dp_accounting's PLD (interval 1e-4, pessimistic and
optimistic) in the same run. Times are the minimum of wall and CPU time of one call.

The regime of large datasets (N = 1e6, batch 100: q = 1e-4, 1e4-1e6 steps). For each
Poisson-subsampled Gaussian (add/remove) of the grid q in {1e-5, 1e-4, 1e-3}, sigma in
{0.5, 0.8, 1, 2}, T in {1e4, 1e5, 1e6} and delta in {1e-5, 1e-8} it reports

* privlearn's certified bracket ``epsilon_bounds(delta)`` (fresh accountant, no cache
  shared between cells) and its time;
* dp_accounting's PLD (``value_discretization_interval`` 1e-4, connect-the-dots
  pessimistic and the optimistic estimate) and its time;
* prv_accountant's bounds (``eps_error`` 1e-3 epsilon, ``delta_error`` delta / 1000).

Flags: ``optimistic`` when our upper bound is below dp_accounting's optimistic estimate
or prv_accountant's lower bound (that would be a privacy bug); ``loose`` when it is more
than 1% above dp_accounting's pessimistic value. Times are wall seconds of one call in
this process (single-threaded BLAS is advised: ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn
warnings.filterwarnings("ignore")


def ours(q: float, sigma: float, steps: int, delta: float):
    from privlearn.accounting import Gaussian, compose, subsample
    from privlearn.accounting.pld import PLDAccountant

    m = compose(subsample(Gaussian(sigma), q), steps)
    t0 = time.perf_counter()
    b = PLDAccountant().epsilon(m, delta)  # a fresh accountant: no cached composition
    return b, time.perf_counter() - t0


def dpa(q: float, sigma: float, steps: int, delta: float, pessimistic: bool):
    from dp_accounting.pld import privacy_loss_distribution as pl

    t0 = time.perf_counter()
    p = pl.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=1e-4,
        pessimistic_estimate=pessimistic, use_connect_dots=pessimistic)
    p = p.self_compose(steps)
    return p.get_epsilon_for_delta(delta), time.perf_counter() - t0


def prv(q: float, sigma: float, steps: int, delta: float, eps_guess: float):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    t0 = time.perf_counter()
    acc = PRVAccountant(
        prvs=[PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)],
        max_self_compositions=[steps], eps_error=max(1e-3 * eps_guess, 1e-4),
        delta_error=delta / 1000)
    low, _est, up = acc.compute_epsilon(delta=delta, num_self_compositions=[steps])
    return low, up, time.perf_counter() - t0


def _clock(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, min(time.perf_counter() - t0, time.process_time() - c0)


def timing(repeats: int = 3) -> None:
    from dp_accounting import dp_event as de
    from dp_accounting import mechanism_calibration as mc
    from dp_accounting.pld import PLDAccountant as DpaPLD

    from privlearn.accounting import Gaussian, calibrate, compose, subsample

    q, T, d = 1e-4, 100_000, 1e-8
    print("| sigma | privlearn upper [lower] | time | dp_accounting PLD pess. (1e-4) | time |")
    print("|---|---|---|---|---|")
    for s in (0.8, 0.5):
        runs = [_clock(lambda s=s: ours(q, s, T, d)[0]) for _ in range(repeats)]
        dp = [_clock(lambda s=s: dpa(q, s, T, d, True)[0]) for _ in range(repeats)]
        b = runs[0][0]
        print(f"| {s:g} | {b.upper:.6g} [{b.lower:.6g}] | {min(t for _, t in runs):.2f} s "
              f"| {dp[0][0]:.6g} | {min(t for _, t in dp):.2f} s |", flush=True)
    n = [0]

    def fac(x):
        n[0] += 1
        return compose(subsample(Gaussian(x), q), T)

    s_ours, t_ours = _clock(lambda: calibrate(fac, 1.0, d))
    s_dpa, t_dpa = _clock(lambda: mc.calibrate_dp_mechanism(
        lambda: DpaPLD(value_discretization_interval=1e-4),
        lambda x: de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(x)), T),
        1.0, d, bracket_interval=mc.LowerEndpointAndGuess(0.3, 1.0), tol=1e-5))
    print(f"calibration eps=1: privlearn sigma {s_ours:.7g} ({n[0]} evaluations) {t_ours:.1f} s; "
          f"dp_accounting sigma {s_dpa:.7g} {t_dpa:.1f} s", flush=True)


def _one_query(q: float, sigma: float, steps: int, delta: float) -> None:
    """Child process of ``--low-q``: epsilon(delta) and delta at that epsilon, as JSON."""
    import json

    from privlearn.accounting import Gaussian, compose, subsample
    from privlearn.accounting.pld import PLDAccountant

    m = compose(subsample(Gaussian(sigma), q), steps)
    b, t_eps = _clock(lambda: PLDAccountant().epsilon(m, delta))
    d, t_del = _clock(lambda: PLDAccountant().delta(m, b.upper))
    import privlearn

    print(json.dumps(dict(module=privlearn.__file__, eps_up=b.upper, eps_low=b.lower,
                          t_eps=t_eps, delta_up=d.upper, delta_low=d.lower, t_delta=t_del)))


def _query_in(root: Path, q: float, sigma: float, steps: int, delta: float) -> dict:
    import json
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--root", str(root), "--one", str(q), str(sigma),
           str(steps), str(delta)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def low_q(before: Path | None, steps: list[int] | None = None) -> None:
    """q=1e-5 timing table: before (``before`` checkout) and after (this checkout),
    interleaved, against dp_accounting."""
    here = Path(__file__).resolve().parents[1]
    d = 1e-8
    print("| sigma | T | query | before: upper [lower] | time | after: upper [lower] | time "
          "| dp_accounting pess. / opt. (1e-4) | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T, s in itertools.product(steps or (10**5, 10**6), (0.8, 0.6, 0.5)):
        old = _query_in(before, 1e-5, s, T, d) if before else None
        new = _query_in(here, 1e-5, s, T, d)
        (pe, t_pe), _ = _clock(lambda s=s, T=T: dpa(1e-5, s, T, d, True))
        (op, _), _ = _clock(lambda s=s, T=T: dpa(1e-5, s, T, d, False))
        cells = []
        for r in (old, new):
            if r is None:
                cells.append(("-", "-", "-", "-"))
                continue
            cells.append((f"{r['eps_up']:.6g} [{r['eps_low']:.6g}]", f"{r['t_eps']:.2f} s",
                          f"{r['delta_up']:.4g} [{r['delta_low']:.4g}]",
                          f"{r['t_delta']:.2f} s"))
        print(f"| {s:g} | {T:.0e} | epsilon(1e-8) | {cells[0][0]} | {cells[0][1]} "
              f"| {cells[1][0]} | {cells[1][1]} | {pe:.6g} / {op:.6g} | {t_pe:.2f} s |",
              flush=True)
        print(f"| {s:g} | {T:.0e} | delta(eps) | {cells[0][2]} | {cells[0][3]} "
              f"| {cells[1][2]} | {cells[1][3]} | | |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--no-prv", action="store_true",
                    help="skip prv_accountant (minutes per cell at delta_error = delta/1000)")
    ap.add_argument("--steps", type=int, nargs="+", help="the T values (default the grid's)")
    ap.add_argument("--timing", action="store_true", help="the timing tables only")
    ap.add_argument("--low-q", action="store_true", help="the q=1e-5 timing table only")
    ap.add_argument("--before", type=Path, help="with --low-q: the checkout to compare")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        if args.root:  # the checkout whose privlearn answers
            sys.path.insert(0, str(args.root.resolve()))
        q, s, T, d = args.one
        _one_query(float(q), float(s), int(T), float(d))
        return
    if args.timing:
        timing()
        return
    if args.low_q:
        low_q(args.before, args.steps)
        return
    qs, sigmas, steps, deltas = [1e-5, 1e-4, 1e-3], [0.5, 0.8, 1.0, 2.0], [10**4, 10**5, 10**6], [
        1e-5, 1e-8]
    if args.quick:
        qs, sigmas, steps = [1e-4], [0.5, 0.8], [10**5]
    if args.steps:
        steps = args.steps
    rows = []
    print("| q | sigma | T | delta | privlearn [lower] | time | dp_accounting pess. / opt. "
          "| time (pess.) | prv_accountant [low, up] | ours / pess. | flags |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for q, s, T in itertools.product(qs, sigmas, steps):
        for d in deltas:
            b, t_ours = ours(q, s, T, d)
            try:
                pe, t_pe = dpa(q, s, T, d, True)
                op, _ = dpa(q, s, T, d, False)
            except Exception:  # noqa: BLE001 - reported as missing
                pe = op = t_pe = math.nan
            pl_ = pu_ = math.nan
            if not args.no_prv:
                try:
                    pl_, pu_, _ = prv(q, s, T, d, b.upper)
                except Exception:  # noqa: BLE001 - reported as missing
                    pass
            flags = []
            if b.upper < op or b.upper < pl_:
                flags.append("optimistic")
            if b.upper > 1.01 * pe and b.upper - pe > 1e-3:
                flags.append("loose")
            lo = "-" if b.lower is None else f"{b.lower:.6g}"
            print(f"| {q:g} | {s:g} | {T} | {d:g} | {b.upper:.6g} [{lo}] | {t_ours:.2f} s "
                  f"| {pe:.6g} / {op:.6g} | {t_pe:.2f} s | [{pl_:.6g}, {pu_:.6g}] "
                  f"| {b.upper / pe:.4f} | {' '.join(flags)} |", flush=True)
            rows.append(dict(q=q, sigma=s, T=T, delta=d, ours=b.upper, ours_lower=b.lower,
                             t_ours=t_ours, dpa_pess=pe, dpa_opt=op, t_dpa=t_pe,
                             prv_low=pl_, prv_up=pu_, flags=" ".join(flags)))
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
