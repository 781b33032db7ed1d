"""Accounting at the extremes: values and wall time against dp_accounting and prv_accountant.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/accounting_extremes.py [--repeats 2] [--timeout 300]
        [--quick] [--out docs/benchmarks.md]

Very long runs (10^5 to 5 x 10^7 steps), tiny and full sampling rates, small and huge
noise multipliers, delta from 1e-12 to 0.1, a heterogeneous composition of 200 different
subsampled Gaussians, and the calibration of the noise multiplier for a target epsilon at
5 x 10^7 steps. Every method runs in its own forked process with a wall-clock limit
(``--timeout``), methods interleaved within a case, ``--repeats`` times (median shown).

Methods: privlearn's ``pld`` (certified upper and lower bound) and ``rdp``; dp_accounting's
PLD accountant (pessimistic, ``value_discretization_interval`` 1e-3; at finer intervals it
does not finish 5 x 10^7 steps within the limit) and its RDP accountant; prv_accountant
(its lower and upper bound, ``eps_error`` 1e-2 relative to the estimate, ``delta_error``
delta/1000), Poisson-subsampled Gaussians only.

Checks per row: ``optimistic`` when privlearn's certified upper bound is below a peer's
lower bound (prv_accountant's lower bound) -- a privacy bug; ``slow`` when privlearn takes
more than 3 times the CPU time of the fastest PLD-family peer that answers (dp_accounting's
PLD, prv_accountant; RDP is a looser method); ``error`` when privlearn
refuses where a peer answers.

With ``--out FILE`` the "## Accounting at the extremes" section of FILE is replaced (or
appended); otherwise the markdown is printed.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
import warnings
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn

SECTION = "## Accounting at the extremes"
COMMAND = "OMP_NUM_THREADS=1 python benchmarks/accounting_extremes.py --out docs/benchmarks.md"

#: (label, [(sigma, q, steps), ...], delta)
CASES = [
    ("10^5 steps", [(1.0, 1e-3, 100_000)], 1e-5),
    ("10^6 steps, q 1e-4", [(1.0, 1e-4, 1_000_000)], 1e-5),
    ("5e7 steps, q 1e-6", [(1.0, 1e-6, 50_000_000)], 1e-5),
    ("5e7 steps, q 1e-3, sigma 5, delta 1e-8", [(5.0, 1e-3, 50_000_000)], 1e-8),
    ("5e7 steps, q 1e-3, sigma 0.8 (huge epsilon)", [(0.8, 1e-3, 50_000_000)], 1e-5),
    ("sigma 0.3, q 0.01, 10^5 steps", [(0.3, 0.01, 100_000)], 1e-5),
    ("sigma 1e3, q 1, 10^5 steps, delta 1e-12", [(1e3, 1.0, 100_000)], 1e-12),
    ("q 1e-6, sigma 2, 10^5 steps, delta 1e-12", [(2.0, 1e-6, 100_000)], 1e-12),
    ("q 0.5, sigma 1, 10^4 steps, delta 0.1", [(1.0, 0.5, 10_000)], 0.1),
]
QUICK = [0, 5, 7]


def _hetero(n: int = 200, seed: int = 0) -> list[tuple[float, float, int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(float(s), float(q), int(k)) for s, q, k in zip(
        rng.uniform(0.5, 5.0, n), 10 ** rng.uniform(-4, -1, n), rng.integers(1, 1000, n),
        strict=True)]


CASES.append(("200 different subsampled Gaussians", _hetero(), 1e-5))

#: calibration: (q, steps, target epsilon, delta)
CALIBRATIONS = [(1e-4, 1_000_000, 1.0, 1e-5), (1e-6, 50_000_000, 1.0, 1e-5)]


# ---------------------------------------------------------------------------------------
# methods (each returns (value, lower or None))
# ---------------------------------------------------------------------------------------
def _quiet() -> None:
    warnings.filterwarnings("ignore")
    try:
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
    except ImportError:  # pragma: no cover
        pass


def ours(parts, delta, accountant="pld"):
    from privlearn.accounting import Gaussian, compose, subsample

    m = compose([subsample(Gaussian(s), q) for s, q, _ in parts], steps=[k for *_, k in parts])
    if accountant == "rdp":
        return m.epsilon(delta, "rdp"), None
    b = m.epsilon_bounds(delta)
    return b.upper, b.lower


def _dpa_event(parts):
    import dp_accounting as dpa

    events = [dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), k)
              for s, q, k in parts]
    return events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)


def dpa_pld(parts, delta, interval=1e-3):
    _quiet()
    from dp_accounting.pld import pld_privacy_accountant as pa

    acc = pa.PLDAccountant(value_discretization_interval=interval)
    acc.compose(_dpa_event(parts))
    return acc.get_epsilon(delta), None


def dpa_rdp(parts, delta):
    _quiet()
    from dp_accounting.rdp import rdp_privacy_accountant as ra

    acc = ra.RdpAccountant()
    acc.compose(_dpa_event(parts))
    return acc.get_epsilon(delta), None


def prv(parts, delta):
    _quiet()
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=s)
            for s, q, _ in parts]
    acc = PRVAccountant(prvs=prvs, max_self_compositions=[k for *_, k in parts],
                        eps_error=1e-2, delta_error=delta / 1000)
    lo, est, up = acc.compute_epsilon(delta=delta, num_self_compositions=[k for *_, k in parts])
    return up, lo


def cal_ours(q, steps, eps, delta):
    from privlearn.accounting import Gaussian, calibrate, compose, subsample

    s = calibrate(lambda x: compose(subsample(Gaussian(x), q), steps=steps), eps, delta)
    return s, None


def cal_dpa(q, steps, eps, delta, kind="pld"):
    _quiet()
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant as pa
    from dp_accounting.rdp import rdp_privacy_accountant as ra

    def fresh():
        return (pa.PLDAccountant(value_discretization_interval=1e-3) if kind == "pld"
                else ra.RdpAccountant())

    s = dpa.calibrate_dp_mechanism(
        fresh, lambda x: dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(x)), steps),
        eps, delta, dpa.LowerEndpointAndGuess(0.1, 1.0), tol=1e-4)
    return s, None


METHODS = {
    "privlearn pld": ours,
    "privlearn rdp": lambda p, d: ours(p, d, "rdp"),
    "dp_accounting PLD 1e-3": dpa_pld,
    "dp_accounting RDP": dpa_rdp,
    "prv_accountant": prv,
}
CAL_METHODS = {
    "privlearn pld": cal_ours,
    "dp_accounting PLD 1e-3": cal_dpa,
    "dp_accounting RDP": lambda *a: cal_dpa(*a, kind="rdp"),
}


# ---------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------
def _child(conn, fn, args):
    try:
        t0 = time.process_time()
        val = fn(*args)
        conn.send(("ok", val, time.process_time() - t0))
    except BaseException as exc:  # noqa: BLE001 - reported
        conn.send(("error", f"{type(exc).__name__}: {str(exc)[:80]}", math.nan))
    conn.close()


def timed(fn, args, timeout: float):
    """(status, value or message, CPU seconds) of ``fn(*args)`` in a forked process (the
    machine is shared: CPU time, not wall time, is compared; the limit is wall time)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, fn, args))
    p.start()
    child.close()
    if parent.poll(timeout):
        out = parent.recv()
        p.join()
        return out
    p.kill()
    p.join()
    return ("timeout", f"> {timeout:g} s", math.inf)


def run(methods, cases, repeats: int, timeout: float):
    """{case index: {method: (status, value, median seconds)}}, methods interleaved."""
    res: dict[int, dict[str, list]] = {i: {n: [] for n in methods} for i in range(len(cases))}
    for _ in range(repeats):
        for i, args in enumerate(cases):
            for name, fn in methods.items():
                prev = res[i][name]
                if prev and prev[-1][0] == "timeout":  # do not wait twice
                    continue
                res[i][name].append(timed(fn, args, timeout))
                print(i, name, res[i][name][-1], file=sys.stderr, flush=True)
    out = {}
    for i, by in res.items():
        out[i] = {}
        for name, runs in by.items():
            st, val, _ = runs[-1]
            secs = [r[2] for r in runs if r[0] == "ok"]
            t = statistics.median(secs) if secs else runs[-1][2]
            out[i][name] = (st, val, t)
    return out


def _fmt(st, val) -> str:
    if st != "ok":
        return f"**{val}**"
    up, lo = val
    if isinstance(up, float) and not math.isfinite(up):
        return f"{up}"
    return f"{up:.6g}" + ("" if lo is None else f" [{lo:.6g}]")


def tables(res, cal) -> list[str]:
    names = list(METHODS)
    out = ["| case | delta | " + " | ".join(names) + " | checks |",
           "|---|---|" + "---|" * (len(names) + 1)]
    for i, (label, _, delta) in enumerate(CASES):
        if i not in res:
            continue
        by = res[i]
        cells, flags = [], []
        for n in names:
            st, val, t = by[n]
            cells.append(f"{_fmt(st, val)} ({t:.2f} s)" if st == "ok" else _fmt(st, val))
        st, val, t_ours = by["privlearn pld"]
        peers_ok = {n: v for n, v in by.items() if not n.startswith("privlearn")
                    and v[0] == "ok" and v[1][0] is not None and math.isfinite(v[1][0])}
        if st != "ok":
            if peers_ok:
                flags.append("error")
        else:
            up = val[0]
            p = by["prv_accountant"]
            if p[0] == "ok" and p[1][1] is not None and up < p[1][1]:
                flags.append("optimistic")
            # time against the same family (PLD / PRV: RDP is a looser method)
            fastest = min((v[2] for n, v in peers_ok.items() if "RDP" not in n),
                          default=math.inf)
            if t_ours > 3 * fastest:
                flags.append(f"slow ({t_ours / fastest:.1f}x)")
            ref = by["dp_accounting PLD 1e-3"]
            if ref[0] == "ok" and math.isfinite(ref[1][0]) and ref[1][0] > 0:
                flags.append(f"ours/dpa {up / ref[1][0]:.4f}")
        out.append(f"| {label} | {delta:g} | " + " | ".join(cells) + f" | "
                   f"{', '.join(flags) or 'ok'} |")
    if cal:
        out += ["", "Calibration (noise multiplier for a target epsilon, Poisson-subsampled "
                "Gaussian); in brackets privlearn's certified epsilon at that multiplier:", "",
                "| q | steps | target eps | delta | " + " | ".join(CAL_METHODS) + " |",
                "|---|---|---|---|" + "---|" * len(CAL_METHODS)]
        for i, (q, T, e, d) in enumerate(CALIBRATIONS):
            if i not in cal:
                continue
            cells = []
            for n in CAL_METHODS:
                st, val, t = cal[i][n]
                if st != "ok":
                    cells.append(_fmt(st, val))
                    continue
                txt = f"{val[0]:.6g}"
                if math.isfinite(val[0]):
                    b, _ = ours([(val[0], q, T)], d)
                    txt += f" [{b:.5g}]"
                cells.append(f"{txt} ({t:.1f} s)")
            out.append(f"| {q:g} | {T:,} | {e:g} | {d:g} | " + " | ".join(cells) + " |")
    return out


def _from_log(a) -> None:
    import ast

    res: dict[int, dict[str, tuple]] = {}
    for line in Path(a.from_log).read_text().splitlines():
        m = re.match(r"^(\d+) (.+?) (\('(?:ok|error|timeout)'.*\))$", line)
        if not m:
            continue
        val = ast.literal_eval(m.group(3).replace("np.float64(", "(").replace("inf)", "1e999)"))
        res.setdefault(int(m.group(1)), {})[m.group(2)] = val
    done = {i: by for i, by in res.items() if set(by) >= set(METHODS)}
    text = "\n".join(tables(done, {})) + "\n"
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-calibration", action="store_true")
    ap.add_argument("--only-calibration", action="store_true")
    ap.add_argument("--cal-timeout", type=float, default=600.0,
                    help="wall-clock limit of one calibration (default 600 s)")
    ap.add_argument("--out")
    ap.add_argument("--from-log", help="rebuild the tables from the progress lines a run "
                    "wrote to stderr (e.g. a run stopped early: the rows it finished)")
    a = ap.parse_args()
    if a.from_log:
        _from_log(a)
        return
    _quiet()
    import dp_accounting  # noqa: F401  (imported once, before the forks: not timed)
    import prv_accountant  # noqa: F401
    from dp_accounting.pld import pld_privacy_accountant  # noqa: F401
    from dp_accounting.rdp import rdp_privacy_accountant  # noqa: F401

    from privlearn.accounting import Gaussian, get_accountant

    for name in ("pld", "rdp"):
        get_accountant(name)
    Gaussian(1.0).epsilon(1e-5)
    idx = QUICK if a.quick else range(len(CASES))
    t0 = time.perf_counter()
    res = {}
    if not a.only_calibration:
        raw = run(METHODS, [(CASES[i][1], CASES[i][2]) for i in idx], a.repeats, a.timeout)
        res = {i: raw[j] for j, i in enumerate(idx)}
    cal = {}
    if not a.no_calibration and not a.quick:
        cal = run(CAL_METHODS, CALIBRATIONS, 1, a.cal_timeout)
    lines = tables(res, cal)
    total = time.perf_counter() - t0
    head = [SECTION, "", f"Command: `{COMMAND}`", "",
            f"Run {date.today().isoformat()}, {total:.0f} s in all. Python "
            f"{platform.python_version()} on {platform.machine()}, "
            f"{os.cpu_count()} CPU(s) shared with other jobs, one thread. "
            f"Each method in its own forked process (limit {a.timeout:g} s of wall time), "
            f"imports done before, methods interleaved within a case, {a.repeats} "
            "repeat(s), median CPU time of the query shown (the machine is shared). "
            "privlearn pld: certified upper bound [certified lower bound]; prv_accountant: "
            "upper [lower] bound; dp_accounting: pessimistic estimate (not certified). "
            "`checks`: `optimistic` (our upper bound below prv_accountant's lower bound), "
            "`slow` (over 3 x the fastest PLD-family peer), `error` (we refuse where a "
            "peer answers), "
            "and the ratio of our upper bound to dp_accounting's PLD.", ""]
    text = "\n".join(head + lines) + "\n"
    if a.out:
        path = Path(a.out)
        doc = path.read_text()
        pat = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
        doc = pat.sub(lambda _: text + "\n", doc) if pat.search(doc) else (
            doc.rstrip("\n") + "\n\n" + text)
        path.write_text(doc)
    print(text)


if __name__ == "__main__":
    main()
