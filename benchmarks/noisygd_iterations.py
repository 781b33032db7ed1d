"""NoisyGD's number of iterations with ``n_iter=None`` and the time of one fit.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/noisygd_iterations.py [--epsilons 1 5 20]

``NoisyGDRegressor(epsilon=eps)`` (defaults: ``noise_multiplier=500``, ``delta=1e-6``,
private smoothness release, ``random_state=0``) on 1,000 x 10 synthetic data (rows
uniform in the cube, scaled to norm <= 1; labels a clipped linear function); prints one
Markdown row per epsilon: the iterations the budget allows, the closed form
``floor(0.99 (sigma mu)^2)`` (mu the Gaussian-DP parameter of (epsilon, delta)), the
wall time of ``fit`` and the training MSE.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from privlearn.accounting import Gaussian, calibrate  # noqa: E402
from privlearn.models import NoisyGDRegressor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 5.0, 20.0])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, (1000, 10)) / math.sqrt(10)
    y = np.clip(X @ rng.normal(size=10), -1, 1)
    print("| epsilon | n_iter_ | floor(0.99 (sigma mu)^2) | fit time (s) | training MSE |")
    print("|---|---|---|---|---|")
    for eps in args.epsilons:
        mu = 1.0 / float(calibrate(lambda s: Gaussian(s), eps, 1e-6))
        t = time.perf_counter()
        m = NoisyGDRegressor(epsilon=eps, random_state=0).fit(X, y)
        dt = time.perf_counter() - t
        mse = float(np.mean((m.predict(X) - y) ** 2))
        print(f"| {eps:g} | {m.n_iter_:,} | {math.floor(0.99 * (500 * mu) ** 2):,} | "
              f"{dt:.2f} | {mse:.4f} |", flush=True)


if __name__ == "__main__":
    main()
