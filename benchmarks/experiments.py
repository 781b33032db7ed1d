"""Benchmark: seed 000's linear-regression experiment, autodp (as the seed writes it)
vs ``privlearn.experiments.run_experiment("linear-regression")``, in the same process,
plotting excluded. Writes the section "Linear regression experiment (seed 000)" of
docs/benchmarks.md.

Run: ``python benchmarks/experiments.py``
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Linear regression experiment (seed 000)"


def seed_autodp_version(seed: int = 0) -> dict:
    """Seed 000's code (cells 1-5), verbatim apart from the data loader (the bundled copy of
    the same matrix) and the removed plotting."""
    from autodp.autodp_core import Mechanism
    from autodp.calibrator_zoo import eps_delta_calibrator
    from autodp.mechanism_zoo import ExactGaussianMechanism, GaussianMechanism
    from autodp.transformer_zoo import ComposeGaussian
    from sklearn import preprocessing

    from privlearn.datasets import load_california_housing

    np.random.seed(seed)

    class SSP(Mechanism):
        def __init__(self, sigma1, sigma2, name="SSP"):
            Mechanism.__init__(self)
            self.name = name
            self.params = {"sigma1": sigma1, "sigma2": sigma2}
            gm1 = ExactGaussianMechanism(sigma1, name="Release_XTX")
            gm2 = ExactGaussianMechanism(sigma2, name="Release_XTy")
            mech = ComposeGaussian()([gm1, gm2], [1, 1])
            self.set_all_representation(mech)

    class AdaSSP(Mechanism):
        def __init__(self, sigma1, sigma2, sigma3, name="AdaSSP"):
            Mechanism.__init__(self)
            self.name = name
            self.params = {"sigma1": sigma1, "sigma2": sigma2, "sigma3": sigma3}
            gm1 = ExactGaussianMechanism(sigma1, name="Release_XTX")
            gm2 = ExactGaussianMechanism(sigma2, name="Release_XTy")
            gm3 = ExactGaussianMechanism(sigma3, name="Release_lambdamin")
            mech = ComposeGaussian()([gm1, gm2, gm3], [1, 1, 1])
            self.set_all_representation(mech)

    calibrate = eps_delta_calibrator()

    class SSP_scale(SSP):
        def __init__(self, scale, name="SSP"):
            SSP.__init__(self, sigma1=scale * 2.0, sigma2=scale * 3.0, name=name)

    class AdaSSP_scale(AdaSSP):
        def __init__(self, scale, name="AdaSSP"):
            AdaSSP.__init__(self, sigma1=scale * 2.0, sigma2=scale * 3.0, sigma3=scale * 5.0,
                            name=name)

    dataset = load_california_housing()
    X, y = dataset.data, dataset.target
    dim, n = X.shape[1], X.shape[0]
    X = X @ np.diag(1.0 / np.array([10, 50, 100, 40, 40000, 1000, 50, 100]))
    x_bound, y_bound = 1, 5
    X = x_bound * preprocessing.normalize(X, norm="l2")
    y = np.clip(y, 0, y_bound)
    XTX = X.T @ X
    XTy = X.T @ y
    theta_nonprivate = np.linalg.solve(XTX, XTy)

    def MSE(theta):
        return np.linalg.norm(y - X @ theta) ** 2 / n

    def run_SSP(sigma1, sigma2):
        Z = x_bound**2 * sigma1 * np.random.normal(size=XTX.shape)
        Z_analyzegauss = np.triu(Z) + np.triu(Z, k=1).T
        hatXTX = XTX + Z_analyzegauss
        hatXTy = XTy + x_bound * y_bound * sigma2 * np.random.normal(size=XTy.shape)
        return np.linalg.solve(hatXTX, hatXTy)

    def run_AdaSSP(sigma1, sigma2, sigma3):
        Z = x_bound**2 * sigma1 * np.random.normal(size=XTX.shape)
        Z_analyzegauss = np.triu(Z) + np.triu(Z, k=1).T
        hatXTX = XTX + Z_analyzegauss
        hatXTy = XTy + x_bound * y_bound * sigma2 * np.random.normal(size=XTy.shape)
        u, s, vT = np.linalg.svd(XTX)
        lambdamin = s[-1] + x_bound**2 * sigma3 * np.random.normal(size=1)
        lambdamin_lowerbound = max(0, lambdamin - x_bound**2 * sigma3 * 1.96)
        lamb = max(0, np.sqrt(dim) * sigma1 * x_bound**2 * 1.96 - lambdamin_lowerbound)
        return np.linalg.solve(hatXTX + lamb * np.eye(dim), hatXTy)

    num, rep = 50, 20
    delta_budget = 1e-6
    eps_budget_list = np.linspace(0.1, 2, num)
    MSE_list = np.zeros(shape=(num, rep, 2))
    for i, eps in enumerate(eps_budget_list):
        mech_ssp = calibrate(SSP_scale, eps, delta_budget, [0, 100])
        mech_adassp = calibrate(AdaSSP_scale, eps, delta_budget, [0, 100])
        for j in range(rep):
            MSE_list[i, j, 0] = MSE(run_SSP(mech_ssp.params["sigma1"], mech_ssp.params["sigma2"]))
            MSE_list[i, j, 1] = MSE(run_AdaSSP(mech_adassp.params["sigma1"],
                                               mech_adassp.params["sigma2"],
                                               mech_adassp.params["sigma3"]))

    class NoisyGD_mech(Mechanism):
        def __init__(self, sigma, coeff, name="NoisyGD"):
            Mechanism.__init__(self)
            self.name = name
            self.params = {"sigma": sigma, "coeff": coeff}
            gm = GaussianMechanism(sigma, name="Release_gradient")
            mech = ComposeGaussian()([gm], [coeff])
            self.set_all_representation(mech)

    def gradient(theta):
        return XTX @ theta - XTy

    def run_NoisyGD_step(theta, sigma, lr):
        GS = x_bound**2 * np.linalg.norm(theta) + x_bound * y_bound
        return theta - lr * (gradient(theta) + GS * sigma * np.random.normal(size=theta.shape))

    delta = 1e-6

    def run_NoisyGD(sigma, lr, niter, log_gap=10):
        theta_GD = np.zeros_like(theta_nonprivate)
        MSE_GD, eps_GD = [], []
        for i in range(niter):
            theta_GD = run_NoisyGD_step(theta_GD, sigma, lr)
            if not i % log_gap:
                mech = NoisyGD_mech(sigma, i + 1)
                eps_GD.append(mech.approxDP(delta))
                MSE_GD.append(MSE(theta_GD))
        return MSE_GD, eps_GD

    def find_appropriate_niter(sigma, eps, delta):
        NoisyGD_fix_sigma = lambda x: NoisyGD_mech(sigma, x)  # noqa: E731
        mech = eps_delta_calibrator()(NoisyGD_fix_sigma, eps, delta, [0, 100000])
        return int(np.floor(mech.params["coeff"]))

    def theoretical_lr_choice(L, dim, sigma, niter):
        return np.minimum(1 / L, 4 / np.sqrt(dim * sigma * lambdamax * niter))

    u, s, vT = np.linalg.svd(XTX)
    lambdamax = s[0]
    GS = x_bound**2 * 1 + x_bound * y_bound
    out = {"ssp_adassp_median": np.median(MSE_list, axis=1)}
    for sigma, gap in ((500.0, 100), (50.0, 10)):
        niter = find_appropriate_niter(sigma, 2.0, 1e-6)
        lr = theoretical_lr_choice(lambdamax, dim, sigma * GS, niter)
        out[f"gd_{sigma:g}"] = (niter, *run_NoisyGD(sigma, lr, niter, log_gap=gap))
    return out


def main() -> None:
    from privlearn.experiments import run_experiment

    t0 = time.perf_counter()
    ref = seed_autodp_version()
    t_autodp = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = run_experiment("linear-regression", tmp, reps=20, seed=0, plot=False,
                             verbose=False)
        t_ours = time.perf_counter() - t0
    raw = res.summary["raw"]
    ours_med = np.median(raw["mse"], axis=1)
    ref_med = ref["ssp_adassp_median"]
    idx = [0, 23, 49]  # epsilon 0.1, ~1.0, 2.0
    lines = [
        SECTION,
        "",
        "Command: `python benchmarks/experiments.py` (2-core shared CPU; same process, "
        "plotting excluded).",
        "",
        "Seed 000's full grid: 50 epsilons in [0.1, 2] x 20 repetitions of SSP and AdaSSP, "
        "each epsilon calibrated, plus both NoisyGD runs (sigma=500 and 50, eps=2, "
        "delta=1e-6) with the seed's epsilon logging.",
        "",
        "| implementation | time (s) |",
        "|---|---|",
        f"| seed 000 code with autodp 0.2.3.1 | {t_autodp:.2f} |",
        f"| `run_experiment(\"linear-regression\")` (privlearn) | {t_ours:.2f} |",
        f"| ratio privlearn / autodp | {t_ours / t_autodp:.3f} (target <= 0.25) |",
        "",
        "Median training MSE (20 repetitions; different random streams, so the two agree "
        "up to Monte-Carlo noise):",
        "",
        "| epsilon | SSP autodp | SSP privlearn | AdaSSP autodp | AdaSSP privlearn |",
        "|---|---|---|---|---|",
    ]
    eps = raw["epsilons"]
    for i in idx:
        lines.append(f"| {eps[i]:.3f} | {ref_med[i, 0]:.4f} | {ours_med[i, 0]:.4f} | "
                     f"{ref_med[i, 1]:.4f} | {ours_med[i, 1]:.4f} |")
    lines += ["", "| NoisyGD | niter autodp | niter privlearn | final MSE autodp | "
              "final MSE privlearn | last logged eps autodp | privlearn |",
              "|---|---|---|---|---|---|---|"]
    for sigma, key in ((500.0, "NoisyGD-large-noise"), (50.0, "NoisyGD-small-noise")):
        n_a, mse_a, eps_a = ref[f"gd_{sigma:g}"]
        g = raw["gd"][key]
        lines.append(f"| sigma={sigma:g} | {n_a} | {g['n_iter']} | {mse_a[-1]:.4f} | "
                     f"{float(np.median(g['mse'][-1])):.4f} | {eps_a[-1]:.4f} | "
                     f"{g['eps'][-1]:.4f} |")
    section = "\n".join(lines) + "\n"
    print(section)
    doc = ROOT / "docs" / "benchmarks.md"
    doc.parent.mkdir(exist_ok=True)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(SECTION) + r".*?(?=\n## |\Z)", re.S)
    if pattern.search(text):
        text = pattern.sub(section.rstrip("\n"), text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text if text.endswith("\n") else text + "\n")


if __name__ == "__main__":
    sys.exit(main())
