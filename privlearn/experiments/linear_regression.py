"""SSP vs AdaSSP vs NoisyGD on California housing, and NoisyGD's learning rate.

The SSP/AdaSSP/NoisyGD linear-regression study (see :doc:`/reference/provenance`). The data
pipeline is the study's: scikit-learn's California housing matrix, features
divided by fixed "natural ranges", rows L2-normalised (x_bound = 1), labels clipped to
[0, 5] (y_bound = 5), no intercept, training MSE. Repetitions are vectorised: all
repetitions at one epsilon are drawn and solved in one batched call, and training MSEs
are computed from the sufficient statistics,
``MSE(theta) = (y^T y - 2 theta^T X^T y + theta^T X^T X theta) / n``.

SSP and AdaSSP run the release kernels of :class:`~privlearn.models.SSPRegressor` and
:class:`~privlearn.models.AdaSSPRegressor` (:mod:`privlearn.models._ssp`: calibration,
noise, solver) on the study's sufficient statistics, and NoisyGD the kernel of
:class:`~privlearn.models.NoisyGDRegressor` (:mod:`privlearn.models._gd`): the same draws
and solutions as the estimators' ``sample_coefficients`` (tested), without importing
scikit-learn, which the estimator classes subclass and which would take a third of the
command's time. Calibration goes through :mod:`privlearn.accounting` (exact composition of
Gaussians); the NoisyGD epsilon log uses the analytic accountant, O(1) per logged point.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from privlearn._renamed import renamed_keywords
from privlearn.accounting import Gaussian, calibrate, compose
from privlearn.datasets import load_california_housing
from privlearn.errors import ParameterValueError
from privlearn.experiments._common import (
    ExperimentResult,
    format_table,
    prepare_out_dir,
    progress,
    pyplot,
    save_figure,
    write_csv,
)
from privlearn.models._gd import noisy_gd_paths, theoretical_learning_rate
from privlearn.models._ssp import (
    ADASSP_BUDGET_SPLIT,
    SSP_BUDGET_SPLIT,
    calibrate_ssp_scale,
    ssp_release,
)

__all__ = [
    "SeedProblem",
    "run_linear_regression",
    "run_noisygd_learning_rate",
    "compute_linear_regression",
    "ssp_estimators",
    "ssp_samples",
    "VARIANTS",
]

#: The release options of each variant. ``"default"``: the estimators' defaults;
#: ``"seed"``: the study's algorithms exactly (upper-triangle noise on X^T X, plain solve
#: for SSP, ridge for AdaSSP).
VARIANT_OPTIONS = {
    "default": dict(matrix_noise="frobenius", project_psd=True,
                    regularization="eigenvalue_floor"),
    "seed": dict(matrix_noise="upper_triangle", project_psd=False, regularization="ridge"),
}
VARIANTS = tuple(VARIANT_OPTIONS)

X_BOUND = 1.0
Y_BOUND = 5.0
DELTA = 1e-6


class SeedProblem:
    """The study's preprocessed data and its sufficient statistics."""

    def __init__(self) -> None:
        b = load_california_housing(preprocessing="bounded", x_bound=X_BOUND,
                                    y_bound=Y_BOUND)
        self.X, self.y = b.data, b.target
        self.n, self.dim = self.X.shape
        self.XTX = self.X.T @ self.X
        self.XTy = self.X.T @ self.y
        self.yty = float(self.y @ self.y)
        eig = np.linalg.eigvalsh(self.XTX)
        self.lambda_min, self.lambda_max = float(eig[0]), float(eig[-1])
        self.theta_nonprivate = np.linalg.solve(self.XTX, self.XTy)
        self.mse_nonprivate = float(np.linalg.norm(self.y - self.X @ self.theta_nonprivate) ** 2
                                    / self.n)
        self.mse_trivial = float(np.linalg.norm(self.y - np.mean(self.y)) ** 2 / self.n)

    def mse(self, theta: np.ndarray) -> np.ndarray:
        """Training MSE of each row of ``theta`` (..., dim), from sufficient statistics."""
        theta = np.asarray(theta, dtype=float)
        quad = np.einsum("...i,ij,...j->...", theta, self.XTX, theta)
        out = (self.yty - 2.0 * theta @ self.XTy + quad) / self.n
        return np.maximum(out, 0.0)

    @renamed_keywords("SeedProblem.noisy_gd", sigma="noise_multiplier")
    def noisy_gd(self, noise_multiplier: float, epsilon: float, delta: float, rng, reps: int,
                 log_every: int, lr_factor: float = 1.0, n_iter: int | None = None):
        """The study's NoisyGD run: niter calibrated (rounded down) unless given, the
        theoretical learning rate with the data's exact lambda_max (as the study; not
        private -- NoisyGDRegressor's default releases it with noise, accounted, see
        docs/trust-model.md), epsilon logged at each log point; ``reps`` independent
        chains. ``sigma=``, the former keyword, is deprecated."""
        sigma = noise_multiplier  # the study's notation
        if n_iter is None:
            n_iter = int(calibrate(lambda k: compose(Gaussian(sigma), steps=int(k)), epsilon,
                                   delta, bounds=(1, 10**7), integer=True))
        gs = X_BOUND**2 * 1.0 + X_BOUND * Y_BOUND
        lr = lr_factor * theoretical_learning_rate(self.lambda_max, self.dim, sigma * gs, n_iter)
        with np.errstate(over="ignore", invalid="ignore"):
            _, path, iters = noisy_gd_paths(self.XTX, self.XTy, sigma, lr, n_iter, X_BOUND,
                                            Y_BOUND, rng, reps=reps, log_every=log_every)
            mse = self.mse(path)  # (n_logs, reps)
        mse = np.where(np.isfinite(mse), mse, np.inf)
        eps = np.array([compose(Gaussian(sigma), steps=int(t)).epsilon(delta, "analytic")
                        for t in iters])
        return dict(n_iter=n_iter, lr=lr, iters=iters, mse=mse, eps=eps)


def _check_variant(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ParameterValueError(
            f"variant must be one of {VARIANTS}, got {variant!r}: 'default' for the "
            "estimators' defaults, 'seed' for the study's algorithms")
    return VARIANT_OPTIONS[variant]


def ssp_estimators(epsilon: float, rng: np.random.Generator, variant: str = "default"):
    """The study's SSP and AdaSSP as the package's estimators (``x_bound = 1``,
    ``y_bound = 5``, no intercept, delta = 1e-6), in the requested variant (imports
    scikit-learn)."""
    from privlearn.models.linear import AdaSSPRegressor, SSPRegressor

    opts = _check_variant(variant)
    kw = dict(epsilon=float(epsilon), delta=DELTA, x_bound=X_BOUND, y_bound=Y_BOUND,
              fit_intercept=False, random_state=rng)
    if variant == "seed":
        return (SSPRegressor(matrix_noise=opts["matrix_noise"],
                             project_psd=opts["project_psd"], **kw),
                AdaSSPRegressor(matrix_noise=opts["matrix_noise"],
                                regularization=opts["regularization"], **kw))
    return SSPRegressor(**kw), AdaSSPRegressor(**kw)


def ssp_samples(problem: SeedProblem, epsilon: float, rng: np.random.Generator, reps: int,
                variant: str = "default") -> tuple[list[np.ndarray], list[float]]:
    """``reps`` SSP and ``reps`` AdaSSP solutions at ``epsilon`` (delta = 1e-6) and their
    calibrated noise scales: what ``sample_coefficients`` of :func:`ssp_estimators`'
    estimators returns for the study's data with the same generator (the same kernels,
    calibration and draws, in the same order), computed from the problem's sufficient
    statistics.

    Returns ``([theta_ssp, theta_adassp], [scale_ssp, scale_adassp])``, each ``theta`` of
    shape (reps, dim).
    """
    opts = _check_variant(variant)
    thetas, scales = [], []
    for adaptive, split in ((False, SSP_BUDGET_SPLIT), (True, ADASSP_BUDGET_SPLIT)):
        s = calibrate_ssp_scale(float(epsilon), DELTA, adaptive=adaptive)
        theta, _ = ssp_release(
            problem.XTX, problem.XTy, s, split, X_BOUND, Y_BOUND, rng, reps=reps,
            adaptive=adaptive, name=f"{'AdaSSP' if adaptive else 'SSP'} at epsilon={epsilon:g}",
            **opts)
        thetas.append(theta)
        scales.append(s)
    return thetas, scales


def compute_linear_regression(
    *,
    reps: int = 20,
    seed: int = 0,
    epsilons=None,
    noisygd: bool = True,
    noisygd_reps: int | None = None,
    show_progress: bool | None = None,
    problem: SeedProblem | None = None,
    variant: str = "default",
) -> dict:
    """The numbers of the linear-regression figure (no files, no plot).

    SSP and AdaSSP run the estimators' release kernels (:func:`ssp_samples`: all ``reps``
    fits at one epsilon in one batched draw, as
    :meth:`~privlearn.models.SSPRegressor.sample_coefficients`); ``variant="seed"`` runs
    the study's original versions.
    NoisyGD runs ``noisygd_reps`` independent chains (default ``reps``), so its curves
    are medians too."""
    if epsilons is None:
        epsilons = np.linspace(0.1, 2.0, 50)
    epsilons = np.asarray(epsilons, dtype=float)
    _check_variant(variant)
    P = problem or SeedProblem()
    rng = np.random.default_rng(seed)
    mse = np.zeros((len(epsilons), reps, 2))
    scales = np.zeros((len(epsilons), 2))
    for i, eps in enumerate(progress(epsilons, desc="SSP/AdaSSP", enabled=show_progress)):
        thetas, scales[i] = ssp_samples(P, eps, rng, reps, variant)
        for j, theta in enumerate(thetas):
            mse[i, :, j] = P.mse(theta)
    out = dict(problem=P, epsilons=epsilons, mse=mse, scales=scales, gd={}, variant=variant)
    if noisygd:
        gd_reps = noisygd_reps if noisygd_reps is not None else reps
        for name, sigma, gap in (("NoisyGD-large-noise", 500.0, 100),
                                 ("NoisyGD-small-noise", 50.0, 10)):
            out["gd"][name] = P.noisy_gd(sigma, 2.0, DELTA, rng, gd_reps, gap)
    return out


def _rows(res: dict) -> list[dict]:
    P = res["problem"]
    rows = []
    for i, eps in enumerate(res["epsilons"]):
        for j, method in enumerate(("SSP", "AdaSSP")):
            m = res["mse"][i, :, j]
            rows.append(dict(method=method, epsilon=float(eps), delta=DELTA,
                             median_mse=float(np.median(m)), mean_mse=float(np.mean(m)),
                             q25_mse=float(np.quantile(m, 0.25)),
                             q75_mse=float(np.quantile(m, 0.75)),
                             noise_scale=float(res["scales"][i, j]), reps=m.size, n_iter=""))
    for name, g in res["gd"].items():
        for k, t in enumerate(g["iters"]):
            m = g["mse"][k]
            rows.append(dict(method=name, epsilon=float(g["eps"][k]), delta=DELTA,
                             median_mse=float(np.median(m)), mean_mse=float(np.mean(m)),
                             q25_mse=float(np.quantile(m, 0.25)),
                             q75_mse=float(np.quantile(m, 0.75)), noise_scale="",
                             reps=m.size, n_iter=int(t)))
    rows.append(dict(method="Nonprivate", epsilon=float("inf"), median_mse=P.mse_nonprivate))
    rows.append(dict(method="trivial", epsilon=0.0, median_mse=P.mse_trivial))
    return rows


def _mse_axis(ax, P: SeedProblem, title: str, ylabel: str) -> None:
    """Baselines, limits (both baselines inside the frame, with a margin) and labels."""
    ax.axhline(P.mse_nonprivate, color="k", ls="--", lw=1,
               label=f"non-private ({P.mse_nonprivate:.3f})")
    ax.axhline(P.mse_trivial, color="r", ls="--", lw=1,
               label=f"trivial: predict the mean ({P.mse_trivial:.3f})")
    span = P.mse_trivial - P.mse_nonprivate
    ax.set_ylim(P.mse_nonprivate - 0.08 * span, P.mse_trivial + 0.08 * span)
    ax.set_xlabel("epsilon")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.92))


def _plot(res: dict, path: Path, *, include_gd: bool = True) -> Path:
    plt = pyplot()

    P, eps = res["problem"], res["epsilons"]
    reps = res["mse"].shape[1]
    med = np.median(res["mse"], axis=1)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(eps, med[:, 0], "o-", ms=4, label="SSP")
    ax.plot(eps, med[:, 1], "s-", ms=4, label="AdaSSP")
    styles = {"NoisyGD-large-noise": ("g.-", "NoisyGD, sigma=500"),
              "NoisyGD-small-noise": ("c.-", "NoisyGD, sigma=50")}
    if include_gd:
        for name, g in res["gd"].items():
            style, label = styles.get(name, (".-", name))
            chains = g["mse"].shape[1]
            ax.plot(g["eps"], np.median(g["mse"], axis=1), style, ms=3,
                    label=f"{label} (T={g['n_iter']}; epsilon spent along the run, "
                    f"{chains} run{'s' if chains != 1 else ''})")
    _mse_axis(ax, P, f"California housing, delta={DELTA:g}",
              f"median training MSE ({reps} repetitions)")
    return save_figure(fig, path)


def summary_table(res: dict, epsilons=(0.1, 0.5, 1.0, 2.0)) -> list[dict]:
    """Median MSE at the grid points nearest to ``epsilons`` and the NoisyGD end points."""
    P, grid = res["problem"], res["epsilons"]
    rows = []
    for e in epsilons:
        i = int(np.argmin(np.abs(grid - e)))
        if abs(grid[i] - e) > 0.05:
            continue
        rows.append(dict(method="SSP", epsilon=float(grid[i]),
                         median_mse=float(np.median(res["mse"][i, :, 0]))))
        rows.append(dict(method="AdaSSP", epsilon=float(grid[i]),
                         median_mse=float(np.median(res["mse"][i, :, 1]))))
    for name, g in res["gd"].items():
        rows.append(dict(method=f"{name} (T={g['n_iter']})", epsilon=float(g["eps"][-1]),
                         median_mse=float(np.median(g["mse"][-1]))))
    rows.append(dict(method="Nonprivate", epsilon=float("inf"), median_mse=P.mse_nonprivate))
    rows.append(dict(method="trivial", epsilon=0.0, median_mse=P.mse_trivial))
    return rows


def run_linear_regression(out_dir=None, reps: int | None = None, seed: int = 0, *,
                          epsilons=None, noisygd: bool = True, noisygd_reps: int | None = None,
                          plot: bool = True, show_progress: bool | None = None,
                          variant: str = "default", verbose: bool = False) -> ExperimentResult:
    """The linear-regression figure: median training MSE vs epsilon (delta = 1e-6) for
    SSP, AdaSSP, NoisyGD in both regimes (medians over ``reps`` chains), non-private and
    trivial baselines. Default grid: 50 epsilons in [0.1, 2] x 20 repetitions (the
    study's). ``variant="seed"`` runs the study's SSP / AdaSSP instead of the package
    defaults (see :func:`ssp_estimators`)."""
    out = prepare_out_dir(out_dir)
    t0 = time.perf_counter()
    res = compute_linear_regression(reps=reps or 20, seed=seed, epsilons=epsilons,
                                    noisygd=noisygd, noisygd_reps=noisygd_reps,
                                    show_progress=show_progress, variant=variant)
    elapsed = time.perf_counter() - t0
    csv_path = write_csv(out / "linear_regression.csv", _rows(res))
    png = _plot(res, out / "linear_regression.png") if plot else None
    table = summary_table(res)
    if verbose:
        print(format_table(table, ["method", "epsilon", "median_mse"]))
    return ExperimentResult("linear-regression", csv_path, png, rows=table,
                            summary=dict(compute_seconds=elapsed, raw=res))


@renamed_keywords("run_noisygd_learning_rate", sigma="noise_multiplier")
def run_noisygd_learning_rate(out_dir=None, reps: int | None = None, seed: int = 0, *,
                              n_iter: int = 50000, noise_multiplier: float = 500.0,
                              log_every: int = 100,
                              factors=(1.0, 10.0, 0.1), plot: bool = True,
                              show_progress: bool | None = None,
                              verbose: bool = False) -> ExperimentResult:
    """The learning-rate sensitivity figure: NoisyGD (noise multiplier 500) with the
    calibrated number of iterations at the theoretical learning rate, and with
    ``n_iter = 50000`` at 10x and 0.1x that rate (as the study). Median over ``reps``
    chains (default 5; the study runs one). ``sigma=``, the former name of
    ``noise_multiplier``, is deprecated."""
    out = prepare_out_dir(out_dir)
    P = SeedProblem()
    rng = np.random.default_rng(seed)
    reps = reps or 5
    runs = {}
    for f in progress(factors, desc="NoisyGD lr", enabled=show_progress):
        label = "NoisyGD" if f == 1.0 else f"NoisyGD-lr*{f:g}"
        runs[label] = P.noisy_gd(noise_multiplier, 2.0, DELTA, rng, reps, log_every,
                                 lr_factor=f,
                                 n_iter=None if f == 1.0 else n_iter)
    rows, table = [], []
    for label, g in runs.items():
        for k, t in enumerate(g["iters"]):
            m = g["mse"][k]
            rows.append(dict(method=label, lr=g["lr"], n_iter=int(t), epsilon=float(g["eps"][k]),
                             median_mse=float(np.median(m)), reps=m.size))
        table.append(dict(method=label, lr=g["lr"], n_iter=g["n_iter"],
                          epsilon=float(g["eps"][-1]), median_mse=float(np.median(g["mse"][-1]))))
    rows.append(dict(method="Nonprivate", median_mse=P.mse_nonprivate))
    rows.append(dict(method="trivial", median_mse=P.mse_trivial))
    csv_path = write_csv(out / "noisygd_learning_rate.csv", rows)
    png = None
    if plot:
        plt = pyplot()

        fig, ax = plt.subplots(figsize=(8, 5))
        for (label, g), st in zip(runs.items(), ("g.-", "c--", "m:"), strict=False):
            ax.plot(g["eps"], np.median(g["mse"], axis=1), st,
                    label=f"{label} (lr={g['lr']:.3g}, T={g['n_iter']})")
        _mse_axis(ax, P, f"NoisyGD learning rate, noise multiplier {noise_multiplier:g}, "
                  f"delta={DELTA:g}",
                  f"median training MSE ({reps} runs)")
        png = save_figure(fig, out / "noisygd_learning_rate.png")
    if verbose:
        print(format_table(table, ["method", "lr", "n_iter", "epsilon", "median_mse"], ".4g"))
    return ExperimentResult("noisygd-learning-rate", csv_path, png, rows=table)
