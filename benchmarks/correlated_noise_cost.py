"""Cost of correlated noise against DP-SGD's independent noise, for GPT-2 small's 124M
parameters: the draw, plus ``C^{-1}`` applied online with 8 bands (a banded Toeplitz
strategy) or 4 buffers (a BLT), interleaved rounds, median seconds per step and ratios.
Usage::

    python benchmarks/correlated_noise_cost.py [--params 124000000] [--rounds 5]
        [--device cpu|cuda] [--threads 2] [--bands 8]

A small ``--params`` with many ``--bands`` measures the host work a step costs beyond the
arithmetic (e.g. ``--params 10 --bands 64 --rounds 200``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn


def main() -> None:
    import torch

    from privlearn.correlated import BandedToeplitz, MinSeparation, optimize_blt
    from privlearn.torch.correlated_noise import CorrelatedNoise

    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=124_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bands", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    flat = torch.empty(a.params, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    makers = {
        "dpsgd": None,
        f"banded-{a.bands}": lambda: CorrelatedNoise(
            BandedToeplitz.square_root(a.bands).recurrence()),
        "blt-4": lambda: CorrelatedNoise(optimize_blt(256, 4, MinSeparation(8)).recurrence()),
    }
    states = {k: (m() if m else None) for k, m in makers.items()}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = {k: [] for k in makers}
    for r in range(a.rounds + 1):
        for name, state in states.items():
            sync()
            t0 = time.perf_counter()
            flat.normal_(0.0, 1.0, generator=gen)
            if state is not None:
                state.apply_(flat).mul_(0.5)
            sync()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["dpsgd"])
    print(f"| noise ({a.params / 1e6:.0f}M parameters, {a.device}) | median s | ratio to DP-SGD |")
    print("|---|---|---|")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times["dpsgd"], strict=True)]
        print(f"| {name} | {statistics.median(ts):.3g} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    del base


if __name__ == "__main__":
    main()
