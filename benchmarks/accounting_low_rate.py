"""Low sampling rate, many steps: privlearn's certified PLD against dp_accounting and
prv_accountant, values and times.

Usage::

    python benchmarks/accounting_low_rate.py [--quick] [--no-prv] [--csv FILE]
    python benchmarks/accounting_low_rate.py --timing

``--timing`` times one query (q=1e-4, T=1e5, delta=1e-8, sigma 0.8 and 0.5; best of 3,
minimum of wall and CPU time) against dp_accounting's PLD, and the calibration of sigma
for epsilon=1 against dp_accounting's ``calibrate_dp_mechanism``.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--no-prv", action="store_true",
                    help="skip prv_accountant (minutes per cell at delta_error = delta/1000)")
    ap.add_argument("--steps", type=int, nargs="+", help="the T values (default the grid's)")
    ap.add_argument("--timing", action="store_true", help="the timing tables only")
    args = ap.parse_args()
    if args.timing:
        timing()
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
