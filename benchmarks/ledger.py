"""Privacy ledger benchmark: tightness of the total against diffprivlib, and spend latency.

Usage::

    python benchmarks/ledger.py [--rounds 5] [--out docs/benchmarks.md]

1. Tightness. A project history on one dataset -- a private scaler, 20 AdaSSP fits, a
   60-epoch DP-SGD run (q = 256/60000, sigma = 1.1) and 1,000 PATE queries (Gaussian,
   noise multiplier 40) -- is spent on a ledger (PLD composition) and on diffprivlib's
   ``BudgetAccountant``: each release as its own tight (epsilon_i, delta_i) with
   delta_i = delta / (2 n), the accountant's slack delta / 2 (so both totals are at
   delta = 1e-5), and with slack 0 (plain sum, delta = sum of delta_i).
2. Latency. Wall time of one ``Ledger.spend`` (check + append + fsync, in a
   ``BEGIN IMMEDIATE`` transaction) with a history of Gaussian-only releases (the
   analytic path) and with the history above (PLD composition), against
   ``BudgetAccountant.spend`` (in memory, no persistence). Rounds are interleaved; the
   median over rounds of the per-round median is reported.

3. Growth. Wall time of one spend against the length of the history (10 to 5,000
   entries of a few Gaussian and Laplace releases, appended in one transaction): on the
   ``Ledger`` that wrote them (its state of the counted releases is kept up to date) and
   on a newly opened one (its first use re-hashes the whole chain and reads every
   entry). ``--growth-only`` prints just this table.

4. Queries (``--queries``, printed only). A history of 10 to 1,000 entries drawn from
   up to 20 distinct mechanisms (Poisson-subsampled Gaussians of several noise
   multipliers, rates and step counts, Laplace and Gaussian releases, each repeated):
   one spend, ``spent`` on the same object, ``spent`` once the PLD accountant's own
   cache was cleared (as a search checking candidates evicts it), and
   ``python -m privlearn budget show`` (a new process). ``--json`` prints the medians
   as JSON (to compare two checkouts run alternately).

With ``--out FILE`` the "## Privacy ledger" section of FILE is replaced (or appended).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ledger"))

from test_tightness import DELTA, _diffprivlib_accountant, _history  # noqa: E402

from privlearn.accounting import Gaussian, Laplace, compose  # noqa: E402
from privlearn.accounting.serialization import dumps  # noqa: E402
from privlearn.ledger import Ledger  # noqa: E402


def tightness() -> dict:
    history = _history()
    n = len(history)
    with tempfile.TemporaryDirectory() as d:
        led = Ledger(os.path.join(d, "t.db"), create=True)
        led.create_budget("p", 1000.0, DELTA)
        for label, m in history:
            led.spend("p", m, label=label)
        s = led.spent("p")
        led.close()
    direct = compose([m for _, m in history]).epsilon_bounds(DELTA)
    BA = _diffprivlib_accountant()
    adv = BA(slack=DELTA / 2)
    plain = BA()
    for _, m in history:
        e = m.epsilon(DELTA / (2 * n))
        adv.spend(e, DELTA / (2 * n))
        plain.spend(e, DELTA / (2 * n))
    return {
        "n": n, "ledger": s.epsilon_spent, "lower": s.epsilon_lower, "direct": direct.upper,
        "adv": adv.total(), "plain": plain.total(),
    }


def latency(rounds: int, per_round: int = 20) -> dict:
    BA = _diffprivlib_accountant()
    res: dict[str, list[float]] = {"gaussian": [], "heavy": [], "diffprivlib": []}
    with tempfile.TemporaryDirectory() as d:
        g = Ledger(os.path.join(d, "g.db"), create=True)
        g.create_budget("p", 1e6, DELTA)
        for _ in range(200):
            g.spend("p", Gaussian(50.0))
        h = Ledger(os.path.join(d, "h.db"), create=True)
        h.create_budget("p", 1e6, DELTA)
        for label, m in _history():
            h.spend("p", m, label=label)
        acc = BA()
        for _ in range(rounds):  # interleaved rounds
            for name, fn in (
                ("gaussian", lambda: g.spend("p", Gaussian(50.0))),
                ("heavy", lambda: h.spend("p", Gaussian(50.0))),
                ("diffprivlib", lambda: acc.spend(0.01, 0.0)),
            ):
                ts = []
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                res[name].append(statistics.median(ts))
    return {k: statistics.median(v) for k, v in res.items()}


GROWTH_SIZES = (10, 100, 1000, 5000)


def growth(rounds: int, sizes=GROWTH_SIZES) -> dict:
    """Median wall time of one spend with ``n`` entries stored, per ``n``: on the object
    that wrote the history (``warm``) and on a newly opened one (``fresh``)."""
    import random

    pool = [Gaussian(20.0), Gaussian(30.0), Gaussian(50.0), Laplace(50.0), Laplace(100.0)]
    rng = random.Random(0)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.db")
        led = Ledger(path, create=True)
        led.create_budget("p", 1e6, DELTA)
        n = 0
        for size in sizes:
            with led._write() as cur:  # the history, appended by the ledger's own append
                for _ in range(size - n):
                    led._append(cur, "spend", "p", "record", mechanism=dumps(rng.choice(pool)),
                                payload=None, who="bench")
            led.spend("p", pool[0])  # the first spend after the bulk append
            warm, fresh = [], []
            for _ in range(rounds):  # no other writer in between: nothing to re-verify
                t0 = time.perf_counter()
                led.spend("p", rng.choice(pool))
                warm.append(time.perf_counter() - t0)
            for _ in range(rounds):
                other = Ledger(path)
                t0 = time.perf_counter()
                other.spend("p", rng.choice(pool))
                fresh.append(time.perf_counter() - t0)
                other.close()
            n = led.head()[0]
            out[size] = (statistics.median(warm), statistics.median(fresh))
        led.close()
    return out


QUERY_SIZES = (10, 60, 200, 1000)


def _query_pool(rng) -> list:
    from privlearn.accounting import subsample

    pool = [compose(subsample(Gaussian(s), rate=q), steps=k)
            for s, q, k in ((0.8, 0.004, 500), (1.0, 0.01, 100), (1.1, 0.004, 1000),
                            (1.5, 0.001, 1000), (2.0, 0.01, 500), (1.1, 0.01, 100),
                            (0.9, 0.001, 500), (1.3, 0.004, 100), (2.0, 0.001, 1000),
                            (1.0, 0.004, 500), (1.2, 0.01, 1000), (1.6, 0.004, 100))]
    pool += [Laplace(b) for b in (20.0, 50.0, 100.0, 200.0)]
    pool += [Gaussian(s) for s in (20.0, 50.0, 80.0, 120.0)]
    rng.shuffle(pool)
    return pool


def queries(sizes=QUERY_SIZES, spends: int = 3) -> dict:
    """Per history length: median seconds of one spend, of ``spent`` (warm), of
    ``spent`` after the accountant's cache was cleared, and of ``budget show``."""
    import random
    import subprocess

    from privlearn.accounting import get_accountant

    acc = get_accountant("pld")
    out = {}
    for n in sizes:
        rng = random.Random(n)
        pool = _query_pool(rng)
        history = pool[:n] + [rng.choice(pool) for _ in range(n - len(pool[:n]))]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "q.db")
            led = Ledger(path, create=True)
            led.create_budget("p", 1e6, 1e-6)
            with led._write() as cur:
                for m in history:
                    led._append(cur, "spend", "p", "record", mechanism=dumps(m),
                                payload=None, who="bench")
            led.spend("p", history[0])  # the first spend: the tally and the floor
            row = {"distinct": len(set(history))}
            for name, fn in (
                ("spend", lambda led=led, r=rng, h=history: led.spend("p", r.choice(h))),
                ("spent", lambda led=led: led.spent("p")),
                ("spent_evicted", lambda led=led: (acc._cache.clear(), led.spent("p"))),
            ):
                ts = []
                for _ in range(spends):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                row[name] = statistics.median(ts)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "privlearn", "budget", "show", path],
                           check=True, capture_output=True)
            row["show"] = time.perf_counter() - t0
            led.close()
        out[n] = row
    return out


def growth_table(g: dict, rounds: int) -> str:
    rows = "\n".join(f"| {n:,} | {w * 1e3:.0f} ms | {f * 1e3:.0f} ms |" for n, (w, f) in g.items())
    return f"""Cost of one spend against the history (`--growth-only`; median of {rounds} spends
each; a history of 5 distinct Gaussian and Laplace releases, PLD budget):

| entries stored | spend on the ledger that wrote them | first spend of a newly opened `Ledger` |
|---|---|---|
{rows}
"""


def markdown(t: dict, lat: dict, rounds: int, g: dict | None = None) -> str:
    adv_e, adv_d = t["adv"]
    pl_e, pl_d = t["plain"]
    led = t["ledger"]
    rows = [
        (f"privlearn ledger (PLD; certified lower bound {t['lower']:.4f})", led, DELTA),
        ("the same mechanisms composed directly (PLD)", t["direct"], DELTA),
        ("diffprivlib BudgetAccountant, slack = delta/2", adv_e, adv_d),
        ("diffprivlib BudgetAccountant, no slack (sum)", pl_e, pl_d),
    ]
    table = "\n".join(f"| {n} | {e:.4f} | {d:.3g} | {e / led:.2f} |" for n, e, d in rows)
    lrows = [
        ("`Ledger.spend`, 200 Gaussian releases stored (analytic composition)",
         f"{lat['gaussian'] * 1e3:.1f} ms"),
        ("`Ledger.spend`, the history above stored (PLD composition)",
         f"{lat['heavy'] * 1e3:.0f} ms"),
        ("diffprivlib `BudgetAccountant.spend` (in memory, not persisted)",
         f"{lat['diffprivlib'] * 1e3:.3f} ms"),
    ]
    ltable = "\n".join(f"| {n} | {v} |" for n, v in lrows)
    return f"""## Privacy ledger

Command: `python benchmarks/ledger.py --rounds {rounds} --out docs/benchmarks.md`
(Python {platform.python_version()}, {platform.machine()}, shared 2-core machine).

Tightness: one project's history on one dataset ({t['n']} releases: a private scaler, 20
AdaSSP fits, a 60-epoch DP-SGD run with q = 256/60000 and sigma = 1.1, 1,000 PATE queries).
diffprivlib gets each release's own tight (epsilon_i, delta_i) at delta_i = delta/(2n).

| accountant | epsilon | delta | ratio to ledger |
|---|---|---|---|
{table}

Latency of one spend (median over {rounds} interleaved rounds of the median of 20 spends):

| operation | time |
|---|---|
{ltable}

{growth_table(g, rounds) if g else ""}
A spend composes the whole history under the write lock (and fsyncs), so it costs what
one accountant evaluation of the history's distinct mechanisms costs; the ledger object
keeps the counted releases merged into (mechanism, count) parts and reads only the entries
appended since (by it or another writer), so the cost does not grow with the number of
entries. diffprivlib adds two numbers in
memory and persists nothing. diffprivlib's slack (advanced composition) does not lower its
total here: its bound is the minimum of the sum and two advanced-composition bounds
(Dwork-Rothblum-Vadhan, Kairouz-Oh-Viswanath), and for a few heterogeneous releases the
sum is the smallest.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--growth-only", action="store_true")
    ap.add_argument("--queries", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.queries:
        q = queries()
        if a.json:
            import json

            print(json.dumps(q))
        else:
            for n, r in q.items():
                print(n, {k: round(v, 4) for k, v in r.items()})
        return
    if a.growth_only:
        print(growth_table(growth(a.rounds), a.rounds))
        return
    md = markdown(tightness(), latency(a.rounds), a.rounds, growth(a.rounds))
    if a.out is None:
        print(md)
        return
    text = Path(a.out).read_text() if Path(a.out).exists() else ""
    pat = re.compile(r"^## Privacy ledger\n.*?(?=^## |\Z)", re.S | re.M)
    text = pat.sub(md, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + md
    Path(a.out).write_text(text)
    print(md)


if __name__ == "__main__":
    main()
