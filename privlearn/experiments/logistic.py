"""DP-SGD logistic regression scenarios on synthetic data.

The scenarios of the DP-SGD logistic-regression study (see :doc:`/reference/provenance`),
``[epsilon, delta, gamma, T, lambda, eta]`` with ``n_train = n_test = 10000``, ``d = 20``,
plus the case the study leaves open (``delta > 0`` with subsampling), each repeated over
several random draws of the data and the noise (the study warns that one run is not
enough) and reported as median test accuracy with the 25-75% spread.

Differences from the study, on purpose: the noise is calibrated exactly by the
accounting engine (the study uses a loose zCDP conversion for Gaussian noise and a
formula with a misplaced parenthesis for subsampled Laplace noise), batches are Poisson
samples (the study samples with replacement, which its privacy formula does not cover),
and the sum of gradients is divided by the expected batch size. Gradients are clipped at
the largest possible per-example norm (``sqrt(1 + (d-1)/4)`` in L2, ``1 + (d-1)/2`` in
L1, since ``|y - p| <= 1`` and ``z = (1, u)``, ``u`` in ``[-1/2, 1/2]^(d-1)``), so
clipping never changes a gradient, as in the study.
"""

from __future__ import annotations

import math

import numpy as np

from privlearn.datasets import make_logistic_data
from privlearn.experiments._common import (
    ExperimentResult,
    format_table,
    prepare_out_dir,
    progress,
    pyplot,
    save_figure,
    write_csv,
)
from privlearn.models.dpsgd import DPSGDClassifier

__all__ = ["SCENARIOS", "run_logistic_regression", "nonprivate_gd"]

#: (label, epsilon, delta, sampling rate gamma, T, lambda, eta); delta "1/n" = 1/n_train.
SCENARIOS = [
    ("0: non-private", math.inf, 0.0, 1.0, 1000, 0.001, 1.0),
    ("1a: pure DP", 1.0, 0.0, 1.0, 1000, 0.001, 1.0),
    ("1b: pure DP, subsampled", 1.0, 0.0, 0.1, 1000, 0.001, 1.0),
    ("2a: (eps,delta)", 1.0, "1/n", 1.0, 1000, 0.001, 1.0),
    ("2b: (eps,delta), eps=0.5", 0.5, "1/n", 1.0, 1000, 0.001, 1.0),
    ("2c: (eps,delta), eps=0.1", 0.1, "1/n", 1.0, 1000, 0.001, 1.0),
    ("2d: (eps,delta), T=10000", 1.0, "1/n", 1.0, 10000, 0.001, 1.0),
    ("3: (eps,delta), subsampled", 1.0, "1/n", 0.1, 1000, 0.001, 1.0),
]


def nonprivate_gd(Z, y, lam, eta, T):
    """The study's update with no noise and full batches: the non-private scenario."""
    theta = np.zeros(Z.shape[1])
    path = np.zeros((T, Z.shape[1]))
    n = Z.shape[0]
    for t in range(T):
        p = 1.0 / (1.0 + np.exp(-(Z @ theta)))
        theta = theta - eta * (Z.T @ (p - y) / n + lam * theta)
        path[t] = theta
    return path


def run_logistic_regression(out_dir=None, reps: int | None = None, seed: int = 0, *,
                            n_train: int = 10000, n_test: int = 10000, dim: int = 20,
                            scenarios=None, iteration_scale: float = 1.0, plot: bool = True,
                            show_progress: bool | None = None, accountant: str = "pld",
                            verbose: bool = False) -> ExperimentResult:
    """The scenario table over ``reps`` repetitions (default 5): median and spread of the
    test accuracy; the plot shows the accuracy of every scenario and the median squared
    distance to the true parameter along training.

    ``iteration_scale`` multiplies every T (tests use a reduced grid)."""
    out = prepare_out_dir(out_dir)
    reps = reps or 5
    scenarios = SCENARIOS if scenarios is None else scenarios
    c2 = math.sqrt(1.0 + (dim - 1) / 4.0)
    c1 = 1.0 + (dim - 1) / 2.0
    acc = np.full((len(scenarios), reps), np.nan)
    eps_spent = np.full(len(scenarios), np.nan)
    sigmas = np.full(len(scenarios), np.nan)
    se_paths: dict[int, list[np.ndarray]] = {i: [] for i in range(len(scenarios))}
    jobs = [(i, r) for r in range(reps) for i in range(len(scenarios))]
    data_cache: dict[int, object] = {}
    for i, r in progress(jobs, desc="scenarios", enabled=show_progress):
        if r not in data_cache:
            data_cache.clear()
            data_cache[r] = make_logistic_data(n_train, n_test, dim, random_state=seed + r)
        data = data_cache[r]
        label, eps, delta, gamma, T, lam, eta = scenarios[i]
        T = max(1, int(round(T * iteration_scale)))
        delta = 1.0 / n_train if delta == "1/n" else float(delta)
        if math.isinf(eps):
            path = nonprivate_gd(data.X_train, data.y_train, lam, eta, T)
            theta = path[-1]
        else:
            noise = "laplace" if delta == 0 else "gaussian"
            clf = DPSGDClassifier(
                epsilon=eps, delta=delta, noise=noise, sampling_rate=gamma, n_iter=T,
                learning_rate=eta, max_grad_norm=c2 if noise == "gaussian" else c1,
                l2_regularization=lam, fit_intercept=False, accountant=accountant,
                trajectory_points=2, record_path=plot, random_state=seed * 1000 + r,
                classes=[0, 1],
            ).fit(data.X_train, data.y_train)
            theta = clf.coef_
            path = clf.coef_path_ if plot else None
            eps_spent[i] = clf.epsilon_
            sigmas[i] = clf.noise_multiplier_
        acc[i, r] = float(np.mean((data.X_test @ theta > 0) == data.y_test))
        if plot:
            se_paths[i].append(np.sum((path - data.theta_true) ** 2, axis=1))
    rows = []
    for i, sc in enumerate(scenarios):
        label, eps, delta, gamma, T, lam, eta = sc
        a = acc[i]
        rows.append(dict(
            scenario=label, epsilon=float(eps),
            delta=1.0 / n_train if delta == "1/n" else float(delta), sampling_rate=gamma,
            T=max(1, int(round(T * iteration_scale))), noise_multiplier=float(sigmas[i]),
            epsilon_spent=float(eps_spent[i]), median_accuracy=float(np.median(a)),
            q25_accuracy=float(np.quantile(a, 0.25)), q75_accuracy=float(np.quantile(a, 0.75)),
            min_accuracy=float(np.min(a)), max_accuracy=float(np.max(a)), reps=reps,
        ))
    csv_path = write_csv(out / "logistic_regression.csv", rows)
    png = None
    if plot:
        plt = pyplot()

        labels = [sc[0] for sc in scenarios]
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 5),
                                       gridspec_kw=dict(width_ratios=[1, 1.1]))
        ypos = np.arange(len(scenarios))[::-1]
        med = np.median(acc, axis=1)
        q25, q75 = np.quantile(acc, 0.25, axis=1), np.quantile(acc, 0.75, axis=1)
        colors = [f"C{i}" for i in range(len(scenarios))]
        ax0.hlines(ypos, acc.min(axis=1), acc.max(axis=1), color="0.6", lw=1)
        ax0.hlines(ypos, q25, q75, color=colors, lw=5, alpha=0.6)
        ax0.scatter(med, ypos, color=colors, zorder=3)
        for y, m in zip(ypos, med, strict=True):
            ax0.annotate(f"{m:.3f}", (m, y), xytext=(0, 7), textcoords="offset points",
                         ha="center", fontsize=8)
        nonpriv = [i for i, sc in enumerate(scenarios) if math.isinf(sc[1])]
        if nonpriv:
            ax0.axvline(med[nonpriv[0]], color="k", ls="--", lw=1, label="non-private median")
        ax0.axvline(0.5, color="0.4", ls=":", lw=1, label="chance")
        ax0.legend(fontsize=8, loc="lower left")
        ax0.set_yticks(ypos, labels, fontsize=9)
        ax0.set_xlabel(f"test accuracy (median dot, 25-75% bar, min-max line; {reps} "
                       f"repetition{'s' if reps != 1 else ''})")
        ax0.set_title("Test accuracy per scenario")
        ax0.grid(axis="x", alpha=0.3)
        for i, sc in enumerate(scenarios):
            curves = se_paths[i]
            n = min(len(c) for c in curves)
            curve = np.median(np.stack([c[:n] for c in curves]), axis=0)
            frac = np.arange(1, n + 1) / n
            ax1.plot(frac, curve, color=colors[i], lw=1.2, label=sc[0])
        ax1.set_yscale("log")
        ax1.set_xlabel("fraction of the T training steps")
        ax1.set_ylabel("squared distance to the true parameter")
        ax1.set_title(f"Median over {reps} repetition{'s' if reps != 1 else ''} "
                      "along training")
        ax1.grid(alpha=0.3)
        ax1.legend(fontsize=7, ncol=2, loc="center right", bbox_to_anchor=(1.0, 0.6))
        fig.suptitle(f"DP-SGD logistic regression, synthetic data (n={n_train}, d={dim})")
        fig.tight_layout()
        png = save_figure(fig, out / "logistic_regression.png", tight=False)
    if verbose:
        print(format_table(rows, ["scenario", "epsilon", "delta", "sampling_rate", "T",
                                  "median_accuracy", "q25_accuracy", "q75_accuracy"]))
    return ExperimentResult("logistic-regression", csv_path, png, rows=rows)
