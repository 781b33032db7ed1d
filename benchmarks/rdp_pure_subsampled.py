"""Tightness of the RDP accountant on subsampled pure-DP mechanisms, against autodp's
Zhu-Wang / Wang-Balle-Kasiviswanathan bounds and against our PLD accountant.

Usage::

    PYTHONPATH=. python benchmarks/rdp_pure_subsampled.py [--before CHECKOUT] \
        [--scheme poisson|fixed]

(from the checkout to measure: ``PYTHONPATH`` makes it the one imported).

For Laplace (b in {0.5, 1, 2, 5}), PureDP (eps in {0.1, 0.5, 1, 2}) and binary randomized
response (p in {0.6, 0.75, 0.9}), each subsampled at q in {0.001, 0.01, 0.1, 0.5} and
composed 1, 100 and 10,000 times, prints epsilon at delta = 1e-5 from

* our RDP curve (this checkout, and with ``--before CHECKOUT`` another checkout of
  privlearn, run in a subprocess),
* autodp's RDP curve (``AmplificationBySampling``; Poisson: the better of its general and
  ``improved_bound_flag`` bounds; fixed size: its Theorem 9 bound, the base at
  replace-one sensitivity, so ``LaplaceMechanism(b / 2)``),
* our PLD accountant.

The RDP curves are read at the same 19 orders and converted by the same formula
(Canonne, Kamath & Steinke 2020, Prop. 12), capped by each library's pure epsilon, so the
columns compare the curves, not the conversions. Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import warnings

DELTA = 1e-5
ORDERS = [1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256]
RATES = [0.001, 0.01, 0.1, 0.5]
STEPS = [1, 100, 10000]
BASES = (
    [(f"Laplace b={b:g}", "lap", b) for b in (0.5, 1, 2, 5)]
    + [(f"PureDP eps={e:g}", "pure", e) for e in (0.1, 0.5, 1, 2)]
    + [(f"RR p={p:g}", "rr", p) for p in (0.6, 0.75, 0.9)]
)


def _convert(curve: list[float], pure: float, steps: int) -> float:
    best = steps * pure
    for a, v in zip(ORDERS, curve, strict=True):
        e = steps * v + math.log((a - 1) / a) - (math.log(DELTA) + math.log(a)) / (a - 1)
        best = min(best, e)
    return max(best, 0.0)


def _mechanisms(scheme: str):
    """``(key, mechanism)``: each base subsampled at each rate by privlearn."""
    from privlearn.accounting import Laplace, PureDP, RandomizedResponse, subsample

    make = {"lap": Laplace, "pure": PureDP, "rr": lambda p: RandomizedResponse(p, 2)}
    for name, kind, v in BASES:
        for q in RATES:
            yield f"{name}|{q}", subsample(make[kind](v), q, scheme=scheme)


def _ours(scheme: str) -> dict[str, list[float]]:
    out = {}
    for key, m in _mechanisms(scheme):
        curve = [float(x) for x in m.rdp(ORDERS)]
        out[key] = [_convert(curve, m.rdp(math.inf), s) for s in STEPS]
    return out


def _autodp(scheme: str) -> dict[str, list[float]]:
    from autodp import mechanism_zoo as mz
    from autodp import transformer_zoo as tz

    poisson = scheme == "poisson"
    out = {}
    for name, kind, v in BASES:
        for q in RATES:
            curves = []
            for improved in (False, True) if poisson else (False,):
                if kind == "lap":
                    base = mz.LaplaceMechanism(b=v if poisson else v / 2)
                elif kind == "pure":
                    base = mz.PureDP_Mechanism(eps=v)
                else:
                    base = mz.RandresponseMechanism(p=v)
                if not poisson:
                    base.neighboring = "replace_one"
                amp = tz.AmplificationBySampling(PoissonSampling=poisson)
                m = amp(base, q, improved_bound_flag=improved)
                curve = [float(m.RenyiDP(a)) for a in ORDERS]
                curves.append([_convert(curve, float(m.RenyiDP(math.inf)), s) for s in STEPS])
            out[f"{name}|{q}"] = [min(c[i] for c in curves) for i in range(len(STEPS))]
    return out


def _pld(scheme: str) -> dict[str, list[float]]:
    from privlearn.accounting import compose

    return {
        key: [compose(m, s).epsilon(DELTA, accountant="pld") for s in STEPS]
        for key, m in _mechanisms(scheme)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another privlearn checkout for the 'before' column")
    ap.add_argument("--scheme", choices=["poisson", "fixed"], default="poisson")
    ap.add_argument("--json-ours", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.json_ours:
        print(json.dumps(_ours(args.scheme)))
        return
    after = _ours(args.scheme)
    before = None
    if args.before:
        env = dict(os.environ, PYTHONPATH=args.before)
        cmd = [sys.executable, __file__, "--json-ours", "--scheme", args.scheme]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        before = json.loads(res.stdout)
    theirs, pld = _autodp(args.scheme), _pld(args.scheme)
    head = "| base | q | steps | " + ("ours before | " if before else "")
    print(head + "ours | autodp | PLD | ours / autodp |")
    print("|---" * (7 + bool(before)) + "|")
    for key, vals in after.items():
        name, q = key.split("|")
        for i, s in enumerate(STEPS):
            cells = [name, q, str(s)]
            if before:
                cells.append(f"{before[key][i]:.4g}")
            cells += [f"{vals[i]:.4g}", f"{theirs[key][i]:.4g}", f"{pld[key][i]:.4g}"]
            cells.append(f"{vals[i] / theirs[key][i]:.3f}" if theirs[key][i] > 0 else "-")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
