"""Per-epoch time and peak memory of DP-SGD: privlearn vs non-private vs every Opacus mode.

Usage::

    python benchmarks/torch_dpsgd.py [--quick] [--models mlp,cnn,...] [--steps N]
                                     [--warmup W] [--out docs/benchmarks.md]

Every (model, mode) configuration runs in its own fresh Python subprocess with
``torch.set_num_threads(2)``, so that its peak resident memory is its own. In the worker:

1. build the model (``benchmarks/models_torch.py``), synthetic data of realistic shape, and
   the training objects for the mode (privlearn ``make_private``, Opacus
   ``PrivacyEngine.make_private(grad_sample_mode=...)``, or plain torch);
2. record the resident set size (``VmRSS``) and reset the peak counter (``VmHWM``, via
   ``/proc/self/clear_refs``);
3. run ``warmup`` untimed steps, then ``steps`` timed steps, each step being: draw the next
   batch from the loader, ``zero_grad``, forward, loss, backward, ``optimizer.step()``;
4. report the median step time scaled to an epoch of 60,000 examples
   (``60000 / batch_size`` steps), and the peak RSS added (``VmHWM`` minus the RSS of step 2).

The driver runs the modes of a model in ``--repeats`` interleaved rounds (all modes, then
all modes again) and keeps each mode's fastest round (and its highest peak memory), so that
the load of the shared machine, which changes over minutes, biases no mode in particular.

Sampling: the private modes (privlearn and Opacus) both use Poisson sampling with rate
``batch_size / n`` (variable batch sizes, expected ``batch_size``), each through its own
loader; non-private training uses a shuffled ``DataLoader`` with fixed batches. privlearn's
loader reads a ``TensorDataset`` with one gather per tensor per batch
(``privlearn.torch.data.TensorBatchGather``) where PyTorch's loader fetches and stacks
examples one by one; ``non-private-gather`` is non-private training with that same fast
fetch, so that the summary can also give the cost of DP itself. Batch 256,
``max_grad_norm=1``, ``noise_multiplier=1``, plain SGD (lr 0.05), cross-entropy (mean).

For the LSTM and transformer, Opacus runs its ``DPLSTM`` / ``DPMultiheadAttention``
replacements (required by Opacus); privlearn and non-private run ``nn.LSTM`` /
``nn.MultiheadAttention``. A mode that raises is reported as ``fails: <error>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ALL_MODELS = ["logreg", "mlp", "cnn", "transformer", "lstm"]
MODES = [
    "non-private",
    "non-private-gather",
    "privlearn",
    "opacus-hooks",
    "opacus-functorch",
    "opacus-ew",
    "opacus-ghost",
]
OPACUS_MODES = {
    "opacus-hooks": "hooks",
    "opacus-functorch": "functorch",
    "opacus-ew": "ew",
    "opacus-ghost": "ghost",
}
BATCH_SIZE = 256
EPOCH_EXAMPLES = 60_000
MAX_GRAD_NORM = 1.0
NOISE_MULTIPLIER = 1.0
LR = 0.05
THREADS = 2
SECTION = "## PyTorch DP-SGD"
READING_NOTE = """\
Reading the numbers:

- **Loader.** privlearn's Poisson loader reads a `TensorDataset` batch with one indexing op
  per tensor (`TensorBatchGather`); PyTorch's `DataLoader` fetches the examples one by one
  and stacks them. On the small models that fetch is a large part of a non-private step
  (MLP: about a third), so the "x non-private" ratio includes this saving. The
  "with the same batched loader" ratio (against `non-private-gather`) is the cost of DP
  itself.
- **Noise.** Most of the rest of DP's cost on the MLP is the Gaussian noise: one value per
  parameter per step (203,530 for the MLP), drawn by `torch.normal_`, PyTorch's serial
  Mersenne Twister. That takes 0.7-1.2 ms per step on this machine, depending on its load.
  Any DP-SGD implementation draws the same noise; Opacus uses the same sampler.
- **Variation.** A configuration's time moves by up to 40% between rounds on this shared
  2-vCPU machine (the per-round times are printed while the command runs). A ratio of
  fastest rounds inherits that noise, so compare several runs before quoting one."""


# --------------------------------------------------------------------------- worker


def proc_status_kb(field: str) -> int:
    """``field`` of ``/proc/self/status`` in kB (``VmRSS``: resident now, ``VmHWM``: its
    peak since the last :func:`reset_peak_rss`)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset the peak resident set size (``VmHWM``) to the current one."""
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _cycle(loader):
    while True:
        yield from loader


def worker(model_name: str, mode: str, steps: int, warmup: int, max_seconds: float) -> dict:
    """Time one configuration in this process; return a JSON-able result."""
    import torch
    from models_torch import build_model, synthetic_data
    from torch import nn

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    n = BATCH_SIZE * (steps + warmup + 4)
    x, y = synthetic_data(model_name, n)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = build_model(model_name, opacus_layers=mode.startswith("opacus"))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)

    if mode == "privlearn":
        # make_private draws Poisson batches itself and refuses shuffled loaders
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE)
        from privlearn.torch import make_private, retain_freed_memory

        retain_freed_memory()  # the opt-in CPU allocator setting (privlearn.torch)

        private = make_private(
            model,
            optimizer,
            loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
        )
        model, optimizer, loader = private.model, private.optimizer, private.data_loader
    elif mode in OPACUS_MODES:
        import warnings

        from opacus import PrivacyEngine

        warnings.filterwarnings("ignore")
        engine = PrivacyEngine(accountant="rdp")
        out = engine.make_private(
            module=model,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            poisson_sampling=True,
            grad_sample_mode=OPACUS_MODES[mode],
        )
        if OPACUS_MODES[mode] == "ghost":
            model, optimizer, criterion, loader = out
        else:
            model, optimizer, loader = out
    elif mode == "non-private-gather":
        from privlearn.torch.data import TensorBatchGather

        loader = torch.utils.data.DataLoader(
            TensorBatchGather(dataset),
            batch_size=BATCH_SIZE,
            shuffle=True,
            collate_fn=TensorBatchGather.collate,
        )
    elif mode != "non-private":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    model.train()
    batches = _cycle(loader)
    baseline_kb = proc_status_kb("VmRSS")
    reset_peak_rss()
    times = []
    sizes = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        xb, yb = next(batches)
        optimizer.zero_grad()
        loss = criterion(model(xb), yb)
        loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
            sizes.append(len(yb))
        if i >= warmup + 2 and sum(times) > max_seconds:
            break
    value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss.item())
    if not math.isfinite(value):
        raise RuntimeError(f"non-finite loss {value}")
    peak_kb = proc_status_kb("VmHWM")
    step = statistics.median(times)
    return {
        "model": model_name,
        "mode": mode,
        "steps": len(times),
        "warmup": warmup,
        "step_s": step,
        "epoch_s": step * EPOCH_EXAMPLES / BATCH_SIZE,
        "mean_batch": statistics.fmean(sizes),
        "peak_added_mb": (peak_kb - baseline_kb) / 1024,
        "baseline_mb": baseline_kb / 1024,
    }


# --------------------------------------------------------------------------- driver


def _short_error(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    # the last line of a traceback holds the exception; fall back to the tail.
    msg = lines[-1] if lines else "no output"
    msg = re.sub(r"\s+", " ", msg).replace("|", "/")
    return msg[:160]


def run_config(
    model_name: str, mode: str, steps: int, warmup: int, max_seconds: float, timeout: float
) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        model_name,
        mode,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--max-seconds",
        str(max_seconds),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model": model_name, "mode": mode, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"model": model_name, "mode": mode, "error": _short_error(proc.stderr or proc.stdout)}


def combine_rounds(rounds: list[dict], time_key: str = "epoch_s") -> dict:
    """Fastest round's time (``time_key``); highest round's peak memory (conservative
    for every mode); the first round's error if every round failed. Also torch_hf's."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    best = dict(min(ok, key=lambda r: r[time_key]))
    best["peak_added_mb"] = max(r["peak_added_mb"] for r in ok)
    best["rounds"] = len(ok)
    best["steps"] = sum(r["steps"] for r in ok)
    return best


def format_table(results: list[dict]) -> str:
    by_mode = {r["mode"]: r for r in results}
    base = by_mode.get("non-private", {}).get("epoch_s")
    ours = by_mode.get("privlearn", {}).get("epoch_s")
    rows = [
        "| mode | s/epoch | x non-private | x privlearn | peak MB added | steps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['mode']} | fails: {r['error']} | | | | |")
            continue
        t = r["epoch_s"]
        vs_base = f"{t / base:.2f}" if base else "n/a"
        vs_ours = f"{t / ours:.2f}" if ours else "n/a"
        rows.append(
            f"| {r['mode']} | {t:.2f} | {vs_base} | {vs_ours} | {r['peak_added_mb']:.0f} "
            f"| {r['steps']} |"
        )
    return "\n".join(rows)


def summarise(all_results: dict[str, list[dict]]) -> str:
    """One line per model: privlearn vs non-private, and vs Opacus's fastest working mode."""
    lines = []
    for model_name, results in all_results.items():
        ok = {r["mode"]: r for r in results if "error" not in r}
        if "privlearn" not in ok or "non-private" not in ok:
            lines.append(f"- {model_name}: privlearn or non-private did not run")
            continue
        ours = ok["privlearn"]
        opacus = [r for m, r in ok.items() if m.startswith("opacus")]
        text = (
            f"- {model_name}: privlearn {ours['epoch_s'] / ok['non-private']['epoch_s']:.2f}x "
            "non-private"
        )
        if "non-private-gather" in ok:
            text += (
                f" ({ours['epoch_s'] / ok['non-private-gather']['epoch_s']:.2f}x non-private "
                "with the same batched loader)"
            )
        if opacus:
            fastest = min(opacus, key=lambda r: r["epoch_s"])
            leanest = min(opacus, key=lambda r: r["peak_added_mb"])
            text += (
                f"; Opacus's fastest ({fastest['mode']}) takes "
                f"{fastest['epoch_s'] / ours['epoch_s']:.2f}x privlearn's time "
                f"({fastest['epoch_s'] / ok['non-private']['epoch_s']:.2f}x non-private); "
                f"peak MB added: privlearn {ours['peak_added_mb']:.0f}, Opacus's lowest "
                f"({leanest['mode']}) {leanest['peak_added_mb']:.0f}"
            )
        lines.append(text)
    return "\n".join(lines)


def render_section(command: str, all_results: dict[str, list[dict]], args) -> str:
    import opacus
    import torch

    parts = [
        SECTION,
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), "
        f"torch {torch.__version__}, opacus {opacus.__version__}, "
        f"`torch.set_num_threads({THREADS})`; run "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Setup: batch {BATCH_SIZE}, `max_grad_norm={MAX_GRAD_NORM:g}`, "
        f"`noise_multiplier={NOISE_MULTIPLIER:g}`, SGD. Private modes (privlearn and every "
        "Opacus mode) use Poisson sampling at rate 256/n (variable batch, expected 256) "
        "through their own loaders; non-private uses fixed shuffled batches of 256 from "
        "PyTorch's `DataLoader` (per-example fetch + `default_collate`), non-private-gather "
        "the same batches read with privlearn's one-gather-per-tensor `TensorBatchGather`, "
        "which privlearn's loader uses for a `TensorDataset`. "
        "Synthetic data of real shape (MNIST-shaped 784-vectors / 1x28x28 images, 10 classes; "
        "text: vocabulary 10,000, 64 tokens, 2 classes). Each configuration runs in a fresh "
        f"subprocess: {args.warmup} warm-up steps, then up to {args.steps} timed steps "
        f"(fewer, but at least 3, once the timed steps exceed {args.max_seconds:g} s) of "
        "loader + zero_grad + forward + backward + step. The modes of a model run in "
        f"{args.repeats} interleaved rounds (all modes, then all modes again, ...), against "
        "the load of the shared machine; s/epoch = the fastest round's median step time x "
        f"{EPOCH_EXAMPLES}/{BATCH_SIZE}; `steps` = timed steps over all rounds. Peak MB added "
        "= the highest round's peak RSS during the steps "
        "(`VmHWM`, reset before the first step) minus RSS before the first step. Opacus runs "
        "`DPLSTM` / `DPMultiheadAttention` for the LSTM / transformer (required by Opacus); "
        "privlearn and non-private run `nn.LSTM` / `nn.MultiheadAttention`.",
        "",
        "Summary:",
        "",
        summarise(all_results),
        "",
        READING_NOTE,
    ]
    titles = {
        "logreg": "Logistic regression (Linear 784-10)",
        "mlp": "MLP 784-256-10",
        "cnn": "MNIST CNN (Tramer & Boneh)",
        "transformer": "Transformer encoder classifier (2 blocks, d=64, 4 heads, 64 tokens)",
        "lstm": "Embedding + LSTM classifier (embed 64, hidden 128, 64 tokens)",
    }
    for model_name, results in all_results.items():
        parts += ["", f"### {titles.get(model_name, model_name)}", "", format_table(results)]
    return "\n".join(parts) + "\n"


def render_mnist(path: Path) -> str:
    """Subsection recording a run of ``examples/mnist_dpsgd.py`` from its ``--out`` JSON."""
    r = json.loads(Path(path).read_text())
    lines = [
        "### MNIST example (`examples/mnist_dpsgd.py`)",
        "",
        f"Command: `{r['command']}` (run separately, in the background on the same shared "
        "2-core machine; its JSON is rendered here with `--mnist-json`).",
        "",
        f"Result: **{100 * r['test_accuracy']:.2f}% test accuracy at epsilon = "
        f"{r['epsilon']:.3f}, delta = {r['delta']:g}** after {r['epochs']} epochs "
        f"({r['total_seconds'] / 60:.1f} min wall, {r['threads']} threads). Tramer & Boneh "
        "CNN, Poisson sampling at rate "
        f"{r['sampling_rate']:.5f} (expected batch {r['batch_size']}), SGD lr {r['lr']:g} "
        f"momentum {r['momentum']:g}, `max_grad_norm={r['max_grad_norm']:g}`, noise multiplier "
        f"{r['noise_multiplier']:.4f}"
        + (
            f" calibrated by privlearn (`{r['accountant']}` accountant, rounded up) so that "
            f"the planned run is ({r['target_epsilon']:g}, {r['delta']:g})-DP"
            if r.get("target_epsilon") is not None
            else " (given)"
        )
        + "; the epsilon column is the accountant's certified bound for the steps taken.",
        "",
        "| epoch | train loss | test accuracy | epsilon | epoch s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for h in r["history"]:
        lines.append(
            f"| {h['epoch']} | {h['train_loss']:.4f} | {h['test_accuracy']:.4f} | "
            f"{h['epsilon']:.3f} | {h['epoch_seconds']:.0f} |"
        )
    return "\n".join(lines)


MNIST_HEADING = "### MNIST example"


def _split_section(path: Path) -> tuple[str, str | None, str | None, str]:
    """``(before, tables, mnist, after)``: the file around our section, and the section's
    benchmark part and MNIST subsection (None when absent)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == SECTION), None)
    if start is None:
        return text.rstrip("\n") + "\n\n", None, None, ""
    end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
    body = lines[start:end]
    m = next((k for k, ln in enumerate(body) if ln.startswith(MNIST_HEADING)), None)
    tables = "".join(body if m is None else body[:m]).rstrip("\n") + "\n"
    mnist = None if m is None else "".join(body[m:]).rstrip("\n") + "\n"
    return "".join(lines[:start]), tables, mnist, "".join(lines[end:])


def write_section(path: Path, tables: str | None, mnist: str | None) -> None:
    """Rewrite our ``## PyTorch DP-SGD`` section of ``path``, keeping the rest of the file.

    ``tables`` (the benchmark part, starting with the section heading) and ``mnist`` (the
    MNIST-example subsection) replace their counterparts; None keeps what is there."""
    before, old_tables, old_mnist, after = _split_section(path)
    tables = tables if tables is not None else old_tables
    mnist = mnist if mnist is not None else old_mnist
    if tables is None:
        tables = f"{SECTION}\n\n(pending: `python benchmarks/torch_dpsgd.py`)\n"
    section = tables + ("\n" + mnist if mnist else "")
    path.write_text(before + section + ("\n" + after if after else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for development")
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 50)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop timing a config after this many seconds of timed steps (at least 3 "
        "steps; default 6, quick 5)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved rounds (default 3, quick 1)"
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per config")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to update")
    parser.add_argument(
        "--mnist-json",
        type=Path,
        default=None,
        help="--out JSON of an examples/mnist_dpsgd.py run to record in the section",
    )
    parser.add_argument(
        "--mnist-only",
        action="store_true",
        help="only (re)write the MNIST subsection from --mnist-json; keep the tables",
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 50
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.max_seconds is None:
        args.max_seconds = 5.0 if args.quick else 6.0
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {args.steps}, {args.warmup}")

    if args.mnist_only:
        if args.out is None or args.mnist_json is None:
            raise ValueError("--mnist-only needs --out and --mnist-json")
        write_section(args.out, None, render_mnist(args.mnist_json) + "\n")
        print(f"wrote the MNIST subsection of {SECTION!r} in {args.out}")
        return

    if args.worker:
        result = worker(args.worker[0], args.worker[1], args.steps, args.warmup, args.max_seconds)
        print(json.dumps(result))
        return

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in models:
        if m not in ALL_MODELS:
            raise ValueError(f"--models entries must be in {ALL_MODELS}, got {m!r}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes entries must be in {MODES}, got {m!r}")

    all_results: dict[str, list[dict]] = {}
    t_start = time.perf_counter()
    for model_name in models:
        # Rounds interleave the modes (A B C ... A B C ...) so that a change in the load of
        # the shared machine hits every mode alike; a mode's time is its fastest round.
        rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
        for rnd in range(args.repeats):
            for mode in modes:
                if rnd > 0 and "error" in rounds[mode][0]:
                    continue
                r = run_config(
                    model_name, mode, args.steps, args.warmup, args.max_seconds, args.timeout
                )
                rounds[mode].append(r)
                status = (
                    f"fails: {r['error']}"
                    if "error" in r
                    else f"{r['epoch_s']:.2f} s/epoch, +{r['peak_added_mb']:.0f} MB"
                )
                print(f"{model_name:12s} {mode:18s} round {rnd + 1}: {status}", flush=True)
        results = [combine_rounds(rounds[mode]) for mode in modes]
        all_results[model_name] = results
        print(format_table(results), flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print(summarise(all_results))

    if args.out is not None:
        command = "python benchmarks/torch_dpsgd.py " + " ".join(
            a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:])
        )
        mnist = None if args.mnist_json is None else render_mnist(args.mnist_json) + "\n"
        write_section(args.out, render_section(command.strip(), all_results, args), mnist)
        print(f"wrote section {SECTION!r} of {args.out}")


if __name__ == "__main__":
    main()
