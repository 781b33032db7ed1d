"""Auditing benchmarks: tightness and speed against jax_privacy 2.0, power, the engine.

Run from the repository root::

    python benchmarks/auditing.py                 # everything (about 35 minutes, 2 cores)
    python benchmarks/auditing.py --part tightness --reps 5

Parts
-----
``tightness``  the ideal attack on a mu-GDP release (scores N(mu, 1) for included and
               N(0, 1) for excluded canaries, mu from the true epsilon at delta = 1e-5),
               for true epsilon in {1, 2, 4, 8} and 10^3, 10^4, 10^5 canaries: each
               method's 95% bound from privlearn and from jax_privacy 2.0's
               ``CanaryScoreAuditor`` method of the same name on the SAME scores, with the
               time of each call (calls interleaved, order alternating between reps).
``power``      median bound of the ideal attack by number of canaries (the table in
               docs/guides/auditing.md).
``huge``       time of one call of each method at 10^6 canaries (delta = 1e-8): the
               perfect attack, the ideal attack at true epsilon 2, and no signal.
``null``       validity under the null: scores independent of the labels (a (0, 0)-DP
               "mechanism", so every bound above 0 is a false refutation), the share of
               draws on which each library's 95% bound is above 0, with a Clopper-Pearson
               interval on that share; a valid procedure has a share of at most 5%.
               Any procedure at least as high as jax_privacy's on every draw has a share at
               least as large as jax_privacy's.
``engine``     ``privlearn audit dpsgd`` (a subprocess each, wall time included) for every
               planted bug, and the correct engine's bound beside the median bound of the
               ideal attack at the claimed epsilon with the same number of canaries.

jax_privacy is a benchmark-only extra, installed without its dependencies
(``pip install --no-deps jax-privacy==2.0.0``); its auditing module is loaded alone
(``benchmarks/_jax_privacy_auditing.py``), so jax itself is never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _jax_privacy_auditing import load as load_jax  # noqa: E402

from privlearn.accounting.fdp import gdp_mu  # noqa: E402
from privlearn.auditing import METHODS, epsilon_lower_bound  # noqa: E402

DELTA = 1e-5
ALPHA = 0.05


def _jax_call(ja, method, ins, outs):
    a = ja.CanaryScoreAuditor(ins, outs)
    if method == "one_run":
        return a.epsilon_one_run(ALPHA, DELTA)
    if method == "one_run_fdp":
        return a.epsilon_one_run_fdp(ALPHA, DELTA)
    if method == "clopper_pearson":
        return a.epsilon_clopper_pearson(ALPHA, DELTA)
    return a.epsilon_from_gdp(ALPHA, DELTA)


def _scores(eps, m, seed):
    rng = np.random.default_rng(seed)
    mu = gdp_mu(eps, DELTA)
    lab = rng.random(m) < 0.5
    s = rng.normal(size=m) + mu * lab
    return s[lab], s[~lab]


def tightness(reps: int) -> list[dict]:
    ja = load_jax()
    if ja is None:
        raise SystemExit("jax_privacy is not installed: pip install --no-deps jax-privacy==2.0.0")
    rows = []
    for eps in (1.0, 2.0, 4.0, 8.0):
        for m in (1_000, 10_000, 100_000):
            for method in METHODS:
                ours, theirs, t_ours, t_theirs = [], [], [], []
                for r in range(reps):
                    ins, outs = _scores(eps, m, seed=1_000_003 * r + int(eps * 7) + m)
                    order = ("ours", "jax") if r % 2 == 0 else ("jax", "ours")
                    for who in order:
                        t0 = time.perf_counter()
                        if who == "ours":
                            ours.append(epsilon_lower_bound(ins, outs, delta=DELTA,
                                                            method=method))
                            t_ours.append(time.perf_counter() - t0)
                        else:
                            theirs.append(float(_jax_call(ja, method, ins, outs)))
                            t_theirs.append(time.perf_counter() - t0)
                ours_a, theirs_a = np.array(ours), np.array(theirs)
                row = dict(eps=eps, m=m, method=method, reps=reps,
                           ours_mean=float(ours_a.mean()), jax_mean=float(theirs_a.mean()),
                           ours_ge_jax=int(np.sum(ours_a >= theirs_a - 1e-9)),
                           ours_over_true=int(np.sum(ours_a > eps)),
                           jax_over_true=int(np.sum(theirs_a > eps)),
                           t_ours=float(np.median(t_ours)), t_jax=float(np.median(t_theirs)),
                           t_ours_max=float(np.max(t_ours)))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def power(reps: int) -> list[dict]:
    rows = []
    for eps in (1.0, 2.0, 4.0, 8.0):
        for m in (100, 1_000, 10_000, 100_000):
            vals = {meth: [] for meth in ("one_run", "one_run_fdp")}
            for r in range(reps):
                ins, outs = _scores(eps, m, seed=7_919 * r + m + int(eps))
                for meth in vals:
                    vals[meth].append(epsilon_lower_bound(ins, outs, delta=DELTA, method=meth))
            row = dict(eps=eps, m=m, reps=reps,
                       **{k: float(np.median(v)) for k, v in vals.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    for m in (100, 1_000, 10_000, 100_000):  # every guess right: the most m canaries can give
        lab = np.arange(m) < m // 2
        s = lab + np.random.default_rng(0).random(m) * 0.5
        row = dict(eps="perfect", m=m, reps=1, **{
            meth: epsilon_lower_bound(s[lab], s[~lab], delta=DELTA, method=meth)
            for meth in ("one_run", "one_run_fdp")})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def engine(canaries: int, epsilon: float, reps: int) -> list[dict]:
    rows = []
    for bug in ("none", "no-noise", "noise-x0.1", "no-clipping", "rate-x10"):
        for seed in range(reps):
            cmd = [sys.executable, "-m", "privlearn", "audit", "dpsgd", "--epsilon",
                   str(epsilon), "--delta", str(DELTA), "--canaries", str(canaries),
                   "--inject-bug", bug, "--seed", str(seed), "--json"]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if out.returncode not in (0, 5):  # 5: a VIOLATION, reported in the JSON
                raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}")
            res = json.loads(out.stdout)
            row = dict(bug=bug, seed=seed, wall_s=wall, **{
                k: res[k] for k in ("claimed_epsilon", "epsilon_lower_bound", "violation",
                                    "auc", "method", "canaries")})
            rows.append(row)
            print(json.dumps(row), flush=True)
    ideal = []
    for r in range(21):
        ins, outs = _scores(epsilon, canaries, seed=r)
        ideal.append(epsilon_lower_bound(ins, outs, delta=DELTA, method="one_run"))
    row = dict(ideal_attack_median_one_run=float(np.median(ideal)), canaries=canaries,
               epsilon=epsilon)
    rows.append(row)
    print(json.dumps(row), flush=True)
    return rows


def huge(m: int = 1_000_000, delta: float = 1e-8) -> list[dict]:
    rows = []
    rng = np.random.default_rng(2026)
    lab = rng.random(m) < 0.5
    cases = {"perfect": lab + 0.1 * rng.random(m),
             "ideal eps 2": rng.normal(size=m) + gdp_mu(2.0, delta) * lab,
             "no signal": rng.normal(size=m)}
    for name, s in cases.items():
        for meth in METHODS:
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                b = epsilon_lower_bound(s[lab], s[~lab], delta=delta, method=meth)
            row = dict(scores=name, m=m, delta=delta, method=meth, bound=float(b),
                       seconds=time.perf_counter() - t)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _null_chunk(args):
    m, methods, seeds = args
    ja = load_jax()
    hits = {f"{who}:{meth}": 0 for meth in methods for who in ("privlearn", "jax")}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        lab = rng.random(m) < 0.5
        s = rng.normal(size=m)  # independent of the labels: a (0, 0)-DP release
        for meth in methods:
            hits[f"privlearn:{meth}"] += epsilon_lower_bound(
                s[lab], s[~lab], delta=DELTA, method=meth) > 0
            hits[f"jax:{meth}"] += float(_jax_call(ja, meth, s[lab], s[~lab])) > 0
    return hits


def null(m: int, trials: int, methods: tuple[str, ...], workers: int) -> list[dict]:
    """Share of null draws (scores independent of the labels) with a bound above 0."""
    from multiprocessing import Pool

    from scipy.stats import beta, binomtest

    if load_jax() is None:
        raise SystemExit("jax_privacy is not installed: pip install --no-deps jax-privacy==2.0.0")
    seeds = np.arange(trials) + 9_000_000
    chunks = [(m, methods, part) for part in np.array_split(seeds, max(1, workers) * 8)]
    total: dict[str, int] = {}
    with Pool(max(1, workers)) as pool:
        for hits in pool.imap_unordered(_null_chunk, chunks):
            for k, v in hits.items():
                total[k] = total.get(k, 0) + int(v)
    rows = []
    for key, k in total.items():
        who, meth = key.split(":")
        lo = float(beta.ppf(0.025, k, trials - k + 1)) if k else 0.0
        hi = float(beta.ppf(0.975, k + 1, trials - k)) if k < trials else 1.0
        p = binomtest(k, trials, ALPHA, alternative="greater").pvalue
        row = dict(library=who, method=meth, m=m, trials=trials, above_zero=k,
                   share=k / trials, ci_low=lo, ci_high=hi, p_share_gt_5pct=float(p))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def render(data: dict) -> str:
    """Markdown tables of a ``--json-out`` file."""
    out = []
    if "tightness" in data:
        out.append("| true eps | canaries | method | privlearn (mean) | jax_privacy (mean) | "
                   "privlearn >= jax | over true eps: privlearn / jax | time privlearn | "
                   "time jax |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in data["tightness"]:
            out.append(f"| {r['eps']:g} | {r['m']:,} | {r['method']} | {r['ours_mean']:.3f} | "
                       f"{r['jax_mean']:.3f} | {r['ours_ge_jax']}/{r['reps']} | "
                       f"{r['ours_over_true']}/{r['reps']} / {r['jax_over_true']}/{r['reps']} | "
                       f"{r['t_ours'] * 1e3:.0f} ms | {r['t_jax'] * 1e3:.0f} ms |")
    if "null" in data:
        out.append("| library | method | canaries | draws | bound > 0 | share (95% CI) | "
                   "p-value of H0: share <= 5% |")
        out.append("|---|---|---|---|---|---|---|")
        for r in sorted(data["null"], key=lambda r: (r["method"], r["library"])):
            out.append(f"| {r['library']} | {r['method']} | {r['m']:,} | {r['trials']:,} | "
                       f"{r['above_zero']:,} | {100 * r['share']:.2f}% "
                       f"({100 * r['ci_low']:.2f}-{100 * r['ci_high']:.2f}%) | "
                       f"{r['p_share_gt_5pct']:.1e} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("tightness", "power", "null", "engine", "huge", "all"),
                    default="all")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--trials", type=int, default=20_000, help="draws of the null part")
    ap.add_argument("--methods", default="one_run,one_run_fdp",
                    help="comma-separated methods of the null part")
    ap.add_argument("--workers", type=int, default=2, help="processes of the null part")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--render", default=None, help="print the tables of a --json-out file")
    a = ap.parse_args()
    if a.render:
        with open(a.render) as fh:
            print(render(json.load(fh)))
        return
    out = {}
    if a.part in ("tightness", "all"):
        out["tightness"] = tightness(a.reps)
    if a.part in ("power", "all"):
        out["power"] = power(max(a.reps, 11))
    if a.part in ("null", "all"):
        out["null"] = null(a.canaries, a.trials, tuple(a.methods.split(",")), a.workers)
    if a.part in ("engine", "all"):
        out["engine"] = engine(a.canaries, a.epsilon, reps=3)
    if a.part in ("huge", "all"):
        out["huge"] = huge()
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
