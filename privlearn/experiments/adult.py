"""DP-SGD logistic regression on UCI Adult vs the non-private model, across epsilon.

Features: :func:`privlearn.datasets.load_adult` ``features="onehot"`` (five numeric
columns under fixed, data-independent transforms plus one-hot categoricals; 104
columns, rows with missing values dropped). The non-private reference is
scikit-learn's ``LogisticRegression`` (lbfgs, default C=1) on the same features.

DP-SGD defaults (:data:`ADULT_DPSGD`): full batch (``sampling_rate = 1``: noisy gradient
descent, which the analytic Gaussian composition accounts exactly), 200 steps, learning
rate 4, L2 clip 1 (per-example gradients ``(p - y) z`` have norm ``<= ||z|| <= 3.4``),
no regularisation, intercept fitted.
"""

from __future__ import annotations

import numpy as np

from privlearn.datasets import load_adult
from privlearn.experiments._common import (
    ExperimentResult,
    accuracy_spread,
    epsilon_log_axis,
    format_table,
    median_errorbar,
    prepare_out_dir,
    progress,
    pyplot,
    save_figure,
    write_csv,
)
from privlearn.models.dpsgd import DPSGDClassifier

__all__ = ["ADULT_DPSGD", "run_adult", "adult_nonprivate_accuracy"]

ADULT_DPSGD = dict(n_iter=200, learning_rate=4.0, max_grad_norm=1.0, l2_regularization=0.0,
                   sampling_rate=1.0, noise="gaussian")
ADULT_DELTA = 1e-5


def adult_nonprivate_accuracy(train=None, test=None) -> float:
    from sklearn.linear_model import LogisticRegression

    train = train or load_adult("train")
    test = test or load_adult("test")
    clf = LogisticRegression(max_iter=1000).fit(train.data, train.target)
    return float(clf.score(test.data, test.target))


def run_adult(out_dir=None, reps: int | None = None, seed: int = 0, *,
              epsilons=(0.1, 0.3, 1.0, 3.0, 10.0), delta: float = ADULT_DELTA,
              dpsgd_params: dict | None = None, plot: bool = True,
              show_progress: bool | None = None, verbose: bool = False) -> ExperimentResult:
    """Test accuracy of DP-SGD logistic regression on Adult for each epsilon (median and
    spread over ``reps`` seeds, default 3) next to the non-private accuracy."""
    out = prepare_out_dir(out_dir)
    reps = reps or 3
    params = dict(ADULT_DPSGD, **(dpsgd_params or {}))
    train, test = load_adult("train"), load_adult("test")
    base = adult_nonprivate_accuracy(train, test)
    acc = np.zeros((len(epsilons), reps))
    spent = np.zeros(len(epsilons))
    sig = np.zeros(len(epsilons))
    jobs = [(i, r) for i in range(len(epsilons)) for r in range(reps)]
    for i, r in progress(jobs, desc="adult", enabled=show_progress):
        clf = DPSGDClassifier(epsilon=float(epsilons[i]), delta=delta,
                              random_state=seed * 1000 + r, trajectory_points=2,
                              classes=[0, 1], **params)
        clf.fit(train.data, train.target)
        acc[i, r] = clf.score(test.data, test.target)
        spent[i], sig[i] = clf.epsilon_, clf.noise_multiplier_
    rows = [dict(method="DP-SGD", epsilon=float(e), delta=delta, epsilon_spent=float(spent[i]),
                 noise_multiplier=float(sig[i]), **accuracy_spread(acc[i]),
                 nonprivate_accuracy=base, gap_points=100 * (base - float(np.median(acc[i]))),
                 reps=reps)
            for i, e in enumerate(epsilons)]
    rows.append(dict(method="non-private LogisticRegression", epsilon=float("inf"),
                     median_accuracy=base, nonprivate_accuracy=base, gap_points=0.0))
    csv_path = write_csv(out / "adult.csv", rows)
    png = None
    if plot:
        plt = pyplot()

        fig, ax = plt.subplots(figsize=(7, 4.5))
        median_errorbar(ax, epsilons, acc, fmt="o-", label=f"DP-SGD (delta={delta:g})")
        ax.axhline(base, color="k", ls="--", label="non-private")
        epsilon_log_axis(ax, epsilons)
        ax.set_xlabel("epsilon")
        ax.set_ylabel("test accuracy")
        ax.set_title("UCI Adult, logistic regression")
        ax.legend()
        png = save_figure(fig, out / "adult.png")
    if verbose:
        print(format_table(rows, ["method", "epsilon", "median_accuracy", "nonprivate_accuracy",
                                  "gap_points"]))
    return ExperimentResult("adult", csv_path, png, rows=rows)
