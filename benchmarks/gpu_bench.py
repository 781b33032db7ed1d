"""The GPU measurements of one limited call: step time and peak memory of private
against non-private training on realistic Hugging Face models, in one process, each
configuration's result appended to a JSON-lines file as soon as it is measured (a run
killed at its deadline keeps everything measured before).

Usage (on a machine with a CUDA GPU; ``benchmarks/gpu_check.sh`` calls it)::

    python benchmarks/gpu_bench.py --out OUT/gpu_bench.jsonl --budget-seconds 240

Configurations, most important first (``--only`` picks some by name prefix): for each of
GPT-2 small (tied, 16 x 256 tokens), BERT-base (32 x 128), a ~153M Llama (16 x 256) and
GPT-2 small + LoRA rank 16 (16 x 256), the models of :mod:`torch_hf` at ``--size small``:
non-private and privlearn in float32 (TF32 matmuls), then in bfloat16 autocast; then on
GPT-2 small: privlearn in secure mode (its record names the keystream in use:
``"triton"``, the fused kernel, or ``"tensor"``), with banded (8 bands) and BLT (4
buffers) correlated noise; a secure draw alone (:func:`measure_noise`, GPT-2 small's
124.4M parameters, float32) with each keystream backend; each Opacus mode (when opacus
is installed); Opacus on BERT and Llama last. Each configuration trains a fresh copy of
its model (plain SGD, lr 0.05; privlearn ``noise_multiplier=1``, ``max_grad_norm=1``);
fixed-size batches (``sampling="fixed"``, or the sampler the correlated noise needs,
with the same batch size), ``--warmup`` untimed steps (the first one probes batch
independence), then up to ``--steps`` timed steps, each ended by
``torch.cuda.synchronize()``; the median step time is reported, and the peak memory a
step adds, ``max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus
``memory_allocated()`` before the step, the highest over the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's privlearn
sys.path.insert(0, str(HERE))

import torch_hf  # noqa: E402

MODELS = ["gpt2", "bert", "llama", "gpt2-lora"]
OPACUS = ["opacus-hooks", "opacus-functorch", "opacus-ghost", "opacus-ew"]
#: Keystream backends timed alone on a secure draw of GPT-2 small's parameter count.
NOISE_BACKENDS = ["triton", "tensor"]
NOISE_ELEMENTS = 124_439_808


def keystream_in_use(device) -> str:
    """The ChaCha20 backend that secure noise on ``device`` uses now (``"triton"``, the
    fused kernel once it passed its self-check there, or ``"tensor"``)."""
    import torch

    from privlearn.torch import _chacha

    return _chacha.backend_in_use(torch.device(device))


def measure_noise(backend: str, steps: int, warmup: int, device: str = "cuda",
                  elements: int = NOISE_ELEMENTS) -> dict:
    """Secure noise alone: ``fill_normal_`` into a preallocated float32 tensor of
    ``elements`` elements with the keystream of ``backend``; the median time of
    a draw (each ended by a synchronisation), the peak memory it adds, and the Triton
    kernel launches per draw."""
    import torch

    from privlearn.torch import _chacha
    from privlearn.torch.noise import NoiseSource

    dev = torch.device(device)
    if backend == "triton" and keystream_in_use(dev) != "triton":
        raise RuntimeError("not run: no Triton kernel here (no triton, or its self-check "
                           "failed)")
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    src = NoiseSource(secure_mode=True)
    out = torch.empty(elements, device=dev)
    src.fill_normal_(out[:2], 1.0)
    stream = next(iter(src._streams.values()))
    stream.backend = _chacha.BACKENDS[backend]
    times, peaks = [], []
    launches = None
    for i in range(warmup + steps):
        sync()
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        counted = _triton_launches()
        t0 = time.perf_counter()
        src.fill_normal_(out, 1.0)
        sync()
        dt = time.perf_counter() - t0
        if counted is not None:
            launches = _triton_launches() - counted
        if i >= warmup:
            times.append(dt)
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20 if cuda
                         else float("nan"))
    return {"step_ms": 1000 * statistics.median(times), "steps": len(times),
            "peak_added_mb": max(peaks), "keystream": backend,
            "triton_launches_per_draw": launches}


def _triton_launches() -> int | None:
    module = sys.modules.get("privlearn.torch._chacha_triton")
    return None if module is None else module.launches()


def plan() -> list[tuple[str, str, str]]:
    """(model, mode, dtype), most important first."""
    jobs = [(m, mode, "fp32") for m in MODELS for mode in ("non-private", "privlearn")]
    jobs += [(m, mode, "bf16") for m in MODELS for mode in ("non-private", "privlearn")]
    jobs += [("gpt2", mode, "fp32") for mode in ("secure", "banded8", "blt4")]
    jobs += [("noise", f"secure-{b}", "fp32") for b in NOISE_BACKENDS]
    jobs += [("gpt2", mode, "fp32") for mode in OPACUS]
    jobs += [(m, mode, "fp32") for m in ("bert", "llama") for mode in OPACUS]
    return jobs


def _private(mode: str, model, optimizer, dataset, batch: int, steps: int):
    from privlearn.torch import make_private

    opts = dict(noise_multiplier=1.0, max_grad_norm=1.0, sampling="fixed")
    if mode == "secure":
        opts["secure_mode"] = True
    elif mode == "banded8":
        opts.update(noise="banded", bands=8, sampling="cyclic_poisson", steps=steps)
    elif mode == "blt4":
        opts.update(noise="blt", buffers=4, sampling="balls_in_bins", steps=steps)
    loader = __import__("torch").utils.data.DataLoader(dataset, batch_size=batch)
    p = make_private(model, optimizer, loader, **opts)
    return p.model, p.optimizer, p.data_loader


def measure(base, w, mode: str, dtype: str, steps: int, warmup: int,
            max_seconds: float, device: str = "cuda") -> dict:
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = copy.deepcopy(base).to(dev)
    model.train()
    n = 64 * w.batch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, w.vocab, (n, w.seq), generator=g)
    labels = ids.clone() if w.task == "lm" else torch.randint(0, 2, (n,), generator=g)
    dataset = torch.utils.data.TensorDataset(ids, labels)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=torch_hf.LR)
    criterion = torch_hf._criterion(w.task)
    loader = torch.utils.data.DataLoader(dataset, batch_size=w.batch, shuffle=True,
                                         drop_last=True)
    if mode in OPACUS:
        from opacus import PrivacyEngine

        out = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
            grad_sample_mode=torch_hf.OPACUS_MODES[mode])
        if mode == "opacus-ghost":
            model, optimizer, criterion, loader = out
        else:
            model, optimizer, loader = out
    elif mode != "non-private":
        model, optimizer, loader = _private(mode, model, optimizer, dataset, w.batch,
                                            warmup + steps + 4)

    def batches():
        while True:
            yield from loader

    it = batches()
    times, peaks, sizes = [], [], []
    loss = None
    for i in range(warmup + steps):
        xb, yb = next(it)
        sync()
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
        b = xb.shape[0]
        loss = torch_hf.train_step(model, optimizer, criterion, w.model, xb, yb,
                                   dtype == "bf16")
        sync()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            sizes.append(b)
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20 if cuda
                         else float("nan"))
            if len(times) >= 3 and sum(times) > max_seconds:
                break
    value = float(loss.item())
    if not math.isfinite(value):
        raise RuntimeError(f"non-finite loss {value}")
    extra = {"keystream": keystream_in_use(dev)} if mode == "secure" else {}
    return {"step_ms": 1000 * statistics.median(times), "steps": len(times),
            "peak_added_mb": max(peaks), "mean_batch": statistics.fmean(sizes), **extra}


def summarise(path: Path) -> str:
    """A markdown table of the results in ``path`` with the ratios the goals name."""
    rows, head = {}, {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "gpu" in r:
            head = r
        elif "model" in r:
            rows[(r["model"], r["mode"], r["dtype"])] = r
    out = [f"GPU: {head.get('gpu', '?')}, torch {head.get('torch', '?')}", "",
           "| model | dtype | mode | step ms | peak added MB | time / non-private "
           "| memory / non-private | time / privlearn |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for (m, mode, dt), r in rows.items():
        if "error" in r:
            out.append(f"| {m} | {dt} | {mode} | {r['error'][:80]} | | | | |")
            continue
        base = rows.get((m, "non-private", dt), {})
        priv = rows.get((m, "privlearn", dt), {})
        if "keystream" in r and r["mode"] == "secure":
            mode = f"secure ({r['keystream']} keystream)"

        def ratio(key, ref, r=r):
            return f"{r[key] / ref[key]:.2f}" if key in ref and "error" not in ref else ""

        out.append(f"| {m} | {dt} | {mode} | {r['step_ms']:.1f} | {r['peak_added_mb']:.0f} "
                   f"| {ratio('step_ms', base)} | {ratio('peak_added_mb', base)} "
                   f"| {ratio('step_ms', priv)} |")
    for m in MODELS:  # bf16 against fp32, privlearn against the fastest Opacus mode
        f32, b16 = rows.get((m, "privlearn", "fp32")), rows.get((m, "privlearn", "bf16"))
        if f32 and b16 and "error" not in f32 and "error" not in b16:
            out.append(f"\n{m}: privlearn bf16 / fp32 step time "
                       f"{b16['step_ms'] / f32['step_ms']:.2f}")
        op = [rows[(m, o, "fp32")] for o in OPACUS if "error" not in rows.get(
            (m, o, "fp32"), {"error": 1})]
        if f32 and op and "error" not in f32:
            best = min(op, key=lambda r: r["step_ms"])
            out.append(f"\n{m}: fastest Opacus ({best['mode']}) / privlearn step time "
                       f"{best['step_ms'] / f32['step_ms']:.2f}")
    fused, plain = rows.get(("noise", "secure-triton", "fp32")), rows.get(
        ("noise", "secure-tensor", "fp32"))
    if fused and plain and "error" not in fused and "error" not in plain:
        out.append(f"\nsecure draw of {NOISE_ELEMENTS:,} float32: tensor keystream / Triton "
                   f"keystream time {plain['step_ms'] / fused['step_ms']:.2f}")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON-lines file to append to")
    ap.add_argument("--budget-seconds", type=float, default=240.0,
                    help="no configuration starts after this many seconds")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=3.0,
                    help="timed steps stop after this many seconds once 3 ran")
    ap.add_argument("--only", default="", help="comma-separated model/mode/dtype prefixes")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the code path")
    ap.add_argument("--size", default="small", choices=torch_hf.SIZES)
    ap.add_argument("--noise-elements", type=int, default=NOISE_ELEMENTS,
                    help="elements of the secure draws timed alone (GPT-2 small's)")
    ap.add_argument("--summary", type=Path, default=None,
                    help="only write the markdown summary of --out to this file")
    args = ap.parse_args(argv)
    if args.summary is not None:
        args.summary.write_text(summarise(args.out) if args.out.exists() else "no results\n")
        return
    t_start = time.perf_counter()
    import torch

    def emit(rec: dict) -> None:
        rec["t_s"] = round(time.perf_counter() - t_start, 1)
        line = json.dumps(rec)
        print(line, flush=True)
        with args.out.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    if args.device == "cuda" and not torch.cuda.is_available():
        emit({"skipped": "no CUDA device"})
        return
    empty_cache = torch.cuda.empty_cache if args.device == "cuda" else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        import opacus  # noqa: F401
        have_opacus = True
    except ImportError:
        have_opacus = False
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    emit({"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
          "torch": torch.__version__, "opacus": have_opacus, "triton": triton_version,
          "size": args.size})
    only = [s for s in args.only.split(",") if s]
    jobs = [j for j in plan() if not only or any("/".join(j).startswith(s) for s in only)]
    bases: dict[str, tuple] = {}
    for model_name, mode, dtype in jobs:
        key = {"model": model_name, "mode": mode, "dtype": dtype}
        if time.perf_counter() - t_start > args.budget_seconds:
            emit({**key, "error": "not run: time budget spent"})
            continue
        if mode in OPACUS and not have_opacus:
            emit({**key, "error": "not run: opacus is not installed"})
            continue
        try:
            if model_name == "noise":
                r = measure_noise(mode.removeprefix("secure-"), args.steps, args.warmup,
                                  args.device, args.noise_elements)
            else:
                if model_name not in bases:
                    bases.clear()
                    gc.collect()
                    empty_cache()
                    bases[model_name] = (torch_hf.build(model_name, args.size)[0],
                                         torch_hf.workload(model_name, args.size))
                base, w = bases[model_name]
                r = measure(base, w, mode, dtype, args.steps, args.warmup,
                            args.max_seconds, args.device)
            emit({**key, **r})
        except Exception as exc:  # one configuration failing does not stop the others
            emit({**key, "error": f"{type(exc).__name__}: {exc}"[:300],
                  "trace": traceback.format_exc()[-600:]})
        gc.collect()
        empty_cache()


if __name__ == "__main__":
    main()
