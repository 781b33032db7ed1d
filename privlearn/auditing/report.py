"""Files of an audit: the ROC plot against the accountant's curve, and the scores as CSV.

matplotlib is imported only when a plot is written.
"""

from __future__ import annotations

import csv
import os

import numpy as np

from privlearn.accounting import Mechanism
from privlearn.accounting.fdp import gaussian_tradeoff, gdp_mu, tradeoff_curve
from privlearn.auditing.bounds import roc_curve
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = ["accountant_roc", "write_report"]


def accountant_roc(mechanism, fpr) -> np.ndarray:
    """Best true positive rate any attack can reach at each false positive rate
    according to the accountant: ``1 - f(fpr)`` with ``f`` the certified trade-off curve
    (:func:`privlearn.accounting.fdp.tradeoff_curve`). ``fpr``: a rate or an array of
    rates in [0, 1]."""
    _check_mechanism(mechanism)
    try:  # numbers only: not a string ("0.1" would read as 0.1), a bool, an object
        a = None if isinstance(fpr, (str, bytes)) else np.asarray(fpr)
    except (TypeError, ValueError):  # a ragged nesting
        a = None
    if a is None or a.dtype.kind not in "iuf":
        raise ParameterTypeError(f"fpr must be a false positive rate in [0, 1] or an array "
                                 f"of them, got {fpr!r} ({type(fpr).__name__}); pass a "
                                 "float such as 0.01 or np.linspace(0, 1, 101)")
    a = a.astype(float)
    if not np.all((a >= 0) & (a <= 1)):  # nan fails too
        bad = a[~((a >= 0) & (a <= 1))].reshape(-1)[0]
        raise ParameterValueError(f"fpr must be false positive rates in [0, 1], got {float(bad)!r} "
                                  "among them")
    return 1.0 - tradeoff_curve(mechanism, a)


def _check_mechanism(mechanism) -> None:
    """Refuse what is not a mechanism, naming the mechanism of the object given when it
    holds one (a ``make_private`` run, a fitted estimator, an audit's run)."""
    if isinstance(mechanism, Mechanism):
        return
    name = type(mechanism).__name__
    accountant = getattr(mechanism, "accountant", None)
    if callable(getattr(accountant, "mechanism", None)):
        hint = f"pass the mechanism that ran, p.accountant.mechanism() (p: this {name})"
    elif hasattr(mechanism, "mechanism_"):
        hint = f"pass the mechanism that ran, est.mechanism_ (est: this fitted {name})"
    elif isinstance(getattr(mechanism, "mechanism", None), Mechanism):
        hint = f"pass the mechanism it holds, .mechanism of this {name}"
    else:
        hint = ("describe what ran with privlearn.accounting, e.g. "
                "compose(subsample(Gaussian(1.1), rate=0.01), steps=1000), or pass "
                "p.accountant.mechanism() of a make_private run")
    raise ParameterTypeError(f"mechanism must be a privlearn.accounting Mechanism, got "
                             f"{name}: {hint}")


def write_report(run, out_dir: str, *, stem: str | None = None) -> list[str]:
    """Write ``<stem>_scores.csv`` (canary, included, score), ``<stem>_roc.csv`` (the
    empirical ROC) and ``<stem>_roc.png`` (empirical ROC, the accountant's best ROC and
    the ROC of the Gaussian curve at the empirical lower bound) for a
    :class:`privlearn.auditing.torch.DPSGDAudit` (the scores only when every canary was
    drawn in, or none: there is no ROC). Returns the paths written."""
    res = run.result
    os.makedirs(out_dir, exist_ok=True)
    stem = stem or f"audit_dpsgd_{run.bug}"
    paths = []
    p_scores = os.path.join(out_dir, f"{stem}_scores.csv")
    with open(p_scores, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["canary", "included", "score"])
        for i, (inc, s) in enumerate(zip(res.inclusion, res.scores, strict=True)):
            w.writerow([i, int(inc), repr(float(s))])
    paths.append(p_scores)
    if res.inclusion.all() or not res.inclusion.any():
        return paths  # every canary on one side: a valid outcome, but no ROC to draw
    fpr, tpr = roc_curve(res.in_scores, res.out_scores)
    p_roc = os.path.join(out_dir, f"{stem}_roc.csv")
    with open(p_roc, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["fpr", "tpr"])
        w.writerows(zip(fpr.tolist(), tpr.tolist(), strict=True))
    paths.append(p_roc)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.geomspace(1e-4, 1.0, 400)
    fig, ax = plt.subplots(figsize=(5.2, 4.4), dpi=110)
    ax.plot(grid, accountant_roc(run.mechanism(), grid), color="C3",
            label=f"accountant: epsilon = {res.claimed_epsilon:.2f}")
    if res.epsilon_lower_bound > 0:
        mu = gdp_mu(res.epsilon_lower_bound, res.delta)
        ax.plot(grid, 1 - gaussian_tradeoff(mu, grid), color="C2", ls="--",
                label=f"Gaussian curve at the bound {res.epsilon_lower_bound:.2f}")
    ax.step(fpr, tpr, where="post", color="C0",
            label=f"canary attack (AUC {res.auc:.3f}, {res.n_canaries} canaries)")
    ax.plot(grid, grid, color="0.6", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1.0 / max(res.out_scores.size, 1) / 2, 1.0)
    ax.set_ylim(1e-3, 1.05)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    verdict = "VIOLATION" if res.violation else "no violation"
    ax.set_title(f"DP-SGD audit, bug: {run.bug} ({verdict})", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    p_png = os.path.join(out_dir, f"{stem}_roc.png")
    fig.savefig(p_png)
    plt.close(fig)
    paths.append(p_png)
    return paths
