"""Step time and peak memory of DP-SGD on small Hugging Face transformers: non-private,
privlearn and every Opacus mode, in one run.

Usage::

    python benchmarks/torch_hf.py [--models gpt2,bert,llama,gpt2-lora] [--steps N]
                                  [--warmup W] [--repeats R] [--out docs/benchmarks.md]

Models (config-initialised, no weights downloaded; dropout 0; vocabulary 8000, 64 tokens,
batch 32):

* ``gpt2``: GPT-2, 2 blocks of width 128, 4 heads, input and output embeddings **tied**
  (the default), causal LM;
* ``bert``: BERT, 2 layers of width 128, 4 heads, sequence classification (2 classes);
* ``llama``: Llama, 2 layers of width 128, 4 heads, causal LM;
* ``gpt2-lora``: the GPT-2 above with peft LoRA (rank 8) on ``c_attn``; only the adapters
  train.

Every mode trains the same model from the same initial weights on the same synthetic
tokens with plain SGD (lr 0.05). The loss is the mean over sequences of the per-sequence
token cross-entropy (:func:`privlearn.torch.per_sequence_cross_entropy`; its ``reduction=
"none"`` form is Opacus ghost clipping's per-example loss), or cross-entropy over the
class logits for BERT. The private modes use Poisson sampling at rate ``32 / n``,
``max_grad_norm=1`` and ``noise_multiplier=1``; non-private training uses a shuffled
loader with fixed batches of 32. Position ids are passed expanded to ``(B, T)`` in every
mode (privlearn and Opacus both fail on GPT-2/BERT's default broadcast ``(1, T)`` ids at
the time of writing; issue 11).

Measurement: the driver imports everything once, then runs every (model, mode)
configuration in a forked child process (``torch.set_num_threads(THREADS)`` before any
work), so that each one's peak resident memory is its own: the child builds the model and
the training objects, records its resident set size and resets the peak counter
(``/proc/self/clear_refs``), runs ``warmup`` untimed and up to ``steps`` timed steps (draw
the batch, ``zero_grad``, forward, loss, backward, ``step``), and reports the median step
time and the peak RSS added. ``--repeats`` interleaved rounds (all modes, then all modes
again) keep each mode's fastest round and its highest peak memory.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ALL_MODELS = ["gpt2", "bert", "llama", "gpt2-lora"]
MODES = ["non-private", "privlearn", "opacus-hooks", "opacus-ew", "opacus-functorch",
         "opacus-ghost"]
OPACUS_MODES = {"opacus-hooks": "hooks", "opacus-ew": "ew", "opacus-functorch": "functorch",
                "opacus-ghost": "ghost"}
VOCAB, SEQ, BATCH, WIDTH = 8000, 64, 32, 128
LR, MAX_GRAD_NORM, NOISE_MULTIPLIER = 0.05, 1.0, 1.0
THREADS = 1
SECTION = "## Hugging Face transformers (DP-SGD step time and memory)"


# --------------------------------------------------------------------------- worker
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def build(model_name: str):
    """(model, task) for a benchmark model, initialised with seed 0."""
    import torch
    import transformers

    torch.manual_seed(0)
    if model_name in ("gpt2", "gpt2-lora"):
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH,
                                      n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        if model_name == "gpt2-lora":
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(
                r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0,
                fan_in_fan_out=True, task_type="CAUSAL_LM"))
        return model, "lm"
    if model_name == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=4 * WIDTH,
                                      max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, num_labels=2)
        return transformers.BertForSequenceClassification(cfg), "cls"
    if model_name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH,
                                       intermediate_size=344, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4,
                                       max_position_embeddings=SEQ)
        return transformers.LlamaForCausalLM(cfg), "lm"
    raise ValueError(f"model must be one of {ALL_MODELS}, got {model_name!r}")


def _criterion(task: str):
    import torch

    from privlearn.torch import per_sequence_cross_entropy

    class PerSequenceCE(torch.nn.Module):
        """Causal-LM loss per sequence; ``reduction`` as Opacus ghost clipping sets it."""

        def __init__(self):
            super().__init__()
            self.reduction = "mean"

        def forward(self, logits, labels):
            return per_sequence_cross_entropy(logits, labels, shift=True,
                                              reduction=self.reduction)

    return PerSequenceCE() if task == "lm" else torch.nn.CrossEntropyLoss()


def worker(model_name: str, mode: str, steps: int, warmup: int, max_seconds: float,
           device: str = "cpu") -> dict:
    import warnings

    import torch
    import transformers

    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    dev = torch.device(device)
    model, task = build(model_name)
    model.to(dev).train()
    n = BATCH * (steps + warmup + 8)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = ids.clone() if task == "lm" else torch.randint(0, 2, (n,), generator=g)
    dataset = torch.utils.data.TensorDataset(ids, labels)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    criterion = _criterion(task)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)
    if mode == "privlearn":
        from privlearn.torch import make_private

        p = make_private(model, optimizer, torch.utils.data.DataLoader(dataset,
                                                                       batch_size=BATCH),
                         noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM)
        model, optimizer, loader = p.model, p.optimizer, p.data_loader
    elif mode in OPACUS_MODES:
        import warnings

        from opacus import PrivacyEngine

        warnings.filterwarnings("ignore")
        out = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
            poisson_sampling=True, grad_sample_mode=OPACUS_MODES[mode])
        if OPACUS_MODES[mode] == "ghost":
            model, optimizer, criterion, loader = out
        else:
            model, optimizer, loader = out
    elif mode != "non-private":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def batches():
        while True:
            yield from loader

    it = batches()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base_kb = torch.cuda.memory_allocated() / 1024
        torch.cuda.reset_peak_memory_stats()
    else:
        base_kb = _status_kb("VmRSS")
        _reset_peak()
    times, sizes = [], []
    loss = None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        xb, yb = next(it)
        xb, yb = xb.to(dev), yb.to(dev)
        b, t = xb.shape
        # input_ids positional: Opacus's expanded-weights module takes its input that way
        kw = {"attention_mask": torch.ones_like(xb),
              "position_ids": torch.arange(t, device=dev).expand(b, t).contiguous()}
        if model_name == "bert":
            kw["token_type_ids"] = torch.zeros_like(xb)
        optimizer.zero_grad()
        logits = model(xb, **kw).logits
        loss = criterion(logits, yb)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            sizes.append(b)
            if len(times) >= 3 and sum(times) > max_seconds:
                break
    value = float(loss.item())  # Opacus ghost clipping's loss is a wrapper with item()
    if not math.isfinite(value):
        raise RuntimeError(f"non-finite loss {value}")
    peak_kb = (torch.cuda.max_memory_allocated() / 1024 if cuda else _status_kb("VmHWM"))
    return {"model": model_name, "mode": mode, "steps": len(times),
            "step_s": statistics.median(times), "mean_batch": statistics.fmean(sizes),
            "peak_added_mb": (peak_kb - base_kb) / 1024, "baseline_mb": base_kb / 1024}


def _child(conn, *args) -> None:
    try:
        conn.send(worker(*args))
    except BaseException as exc:  # reported as "fails: ..."
        msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
        conn.send({"model": args[0], "mode": args[1], "error": msg[:160],
                   "trace": traceback.format_exc()[-2000:]})
    finally:
        conn.close()


def run_config(model_name, mode, steps, warmup, max_seconds, timeout, device="cpu") -> dict:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, model_name, mode, steps, warmup,
                                            max_seconds, device))
    proc.start()
    child.close()
    if parent.poll(timeout):
        res = parent.recv()
    else:
        proc.kill()
        res = {"model": model_name, "mode": mode, "error": f"timed out after {timeout:.0f} s"}
    proc.join()
    return res


# --------------------------------------------------------------------------- report
def combine(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    best = dict(min(ok, key=lambda r: r["step_s"]))
    best["peak_added_mb"] = max(r["peak_added_mb"] for r in ok)
    best["rounds"] = len(ok)
    best["steps"] = sum(r["steps"] for r in ok)
    return best


def table(results: list[dict]) -> str:
    by = {r["mode"]: r for r in results}
    base = by.get("non-private", {})
    ours = by.get("privlearn", {})
    lines = ["| mode | ms/step | x non-private | x privlearn | peak MB added | "
             "x non-private's peak | timed steps | mean batch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mode']} | fails: {r['error']} | | | | | | |")
            continue
        rel = (f"{r['step_s'] / base['step_s']:.2f}" if "step_s" in base else "")
        vs = (f"{r['step_s'] / ours['step_s']:.2f}" if "step_s" in ours else "")
        mem = (f"{r['peak_added_mb'] / base['peak_added_mb']:.2f}"
               if base.get("peak_added_mb", 0) > 0 else "")
        lines.append(f"| {r['mode']} | {1000 * r['step_s']:.0f} | {rel} | {vs} | "
                     f"{r['peak_added_mb']:.0f} | {mem} | {r['steps']} | "
                     f"{r['mean_batch']:.1f} |")
    return "\n".join(lines)


def summary(all_results: dict[str, list[dict]]) -> str:
    rows = ["| model | privlearn x non-private | privlearn / fastest working Opacus | "
            "fastest Opacus mode | privlearn peak MB added (non-private) |",
            "|---|---|---|---|---|"]
    for model, results in all_results.items():
        ok = {r["mode"]: r for r in results if "error" not in r}
        base, ours = ok.get("non-private"), ok.get("privlearn")
        opa = [r for m, r in ok.items() if m.startswith("opacus")]
        fast = min(opa, key=lambda r: r["step_s"]) if opa else None
        rows.append(
            f"| {model} | "
            + (f"{ours['step_s'] / base['step_s']:.2f}" if ours and base else "n/a") + " | "
            + (f"{ours['step_s'] / fast['step_s']:.2f}" if ours and fast else "n/a") + " | "
            + (fast["mode"] if fast else "none works") + " | "
            + (f"{ours['peak_added_mb']:.0f} ({base['peak_added_mb']:.0f})"
               if ours and base else "n/a") + " |")
    return "\n".join(rows)


def render(command: str, all_results: dict, args, seconds: float) -> str:
    import opacus
    import peft
    import torch
    import transformers

    if args.device == "cpu":
        where = (f"{os.cpu_count()} vCPUs shared with other jobs, **{THREADS} torch thread** "
                 "per configuration, CPU; peak memory = resident set size added")
    else:
        where = (f"GPU {torch.cuda.get_device_name(0)}; peak memory = CUDA "
                 "max_memory_allocated added")
    out = [_section(args.device), "",
           f"Command: `{command}` ({seconds:.0f} s). torch {torch.__version__}, transformers "
           f"{transformers.__version__}, peft {peft.__version__}, opacus "
           f"{opacus.__version__}, Python {platform.python_version()}, {where}. "
           f"Batch {BATCH} (Poisson, expected), {SEQ} tokens, vocabulary {VOCAB}, "
           f"{args.repeats} interleaved rounds of up to {args.steps} timed steps after "
           f"{args.warmup} warm-up steps (fastest round's median step; highest round's "
           "peak memory). Position ids are passed expanded to `(B, T)` in every mode, so "
           "that all modes run the same inputs (privlearn also takes the default broadcast "
           "`(1, T)` ids; Opacus does not). Each mode runs in its own process, as a user "
           "would run it: the privlearn process has the glibc allocator tuning "
           "`make_private` applies to CPU models (`privlearn/torch/_allocator.py`), the "
           "others the default allocator. Method and models: `benchmarks/torch_hf.py` "
           "docstring.", "",
           "The load of the shared machine moves single times by tens of percent between "
           "rounds: compare ratios within a table, and several runs "
           "before quoting one. The private modes draw Poisson batches (expected size "
           f"{BATCH}): with a few timed steps their realised sizes differ between modes "
           "(column `mean batch`), which moves the ratios; `benchmarks/hf_engine.py "
           "--interleaved` times fixed-size batches.", "", "Summary:", "", summary(all_results), ""]
    names = {"gpt2": "GPT-2 (tied embeddings)", "bert": "BERT sequence classification",
             "llama": "Llama causal LM", "gpt2-lora": "GPT-2 + LoRA (r=8, c_attn)"}
    for model, results in all_results.items():
        out += [f"### {names[model]}", "", table(results), ""]
    return "\n".join(out)


def _section(device: str) -> str:
    return SECTION if device == "cpu" else SECTION[:-1] + ", CUDA)"


def write_section(path: Path, text: str, device: str = "cpu") -> None:
    head = _section(device)
    old = path.read_text() if path.exists() else ""
    start = old.find(head + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        nxt = old.find("\n## ", start + len(head))
        tail = "" if nxt < 0 else old[nxt:]
        new = old[:start] + text.rstrip("\n") + "\n" + tail
    path.write_text(new)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(ALL_MODELS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=4.0,
                    help="stop timing a configuration after this many seconds (>= 3 steps)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per configuration")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (peak memory: CUDA "
                    "max_memory_allocated instead of RSS)")
    ap.add_argument("--out", type=Path, default=None, help="markdown file to update")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    for m in models:
        if m not in ALL_MODELS:
            raise ValueError(f"--models entries must be in {ALL_MODELS}, got {m!r}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes entries must be in {MODES}, got {m!r}")

    import torch  # imported once here; the forked children inherit the modules

    torch.set_num_threads(THREADS)
    import opacus  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import privlearn.torch  # noqa: F401

    t0 = time.perf_counter()
    all_results: dict[str, list[dict]] = {}
    for model in models:
        rounds: dict[str, list[dict]] = {m: [] for m in modes}
        for rnd in range(args.repeats):
            for mode in modes:
                if rnd and "error" in rounds[mode][0]:
                    continue
                r = run_config(model, mode, args.steps, args.warmup, args.max_seconds,
                               args.timeout, args.device)
                rounds[mode].append(r)
                msg = (f"fails: {r['error']}" if "error" in r else
                       f"{1000 * r['step_s']:.0f} ms/step, +{r['peak_added_mb']:.0f} MB")
                print(f"{model:10s} {mode:17s} round {rnd + 1}: {msg}", flush=True)
        all_results[model] = [combine(rounds[m]) for m in modes]
        print(table(all_results[model]), flush=True)
    seconds = time.perf_counter() - t0
    print(summary(all_results))
    print(json.dumps(all_results))
    if args.out is not None:
        command = "python benchmarks/torch_hf.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        write_section(args.out, render(command.strip(), all_results, args, seconds),
                      args.device)
        print(f"wrote section {_section(args.device)!r} of {args.out}")


if __name__ == "__main__":
    main()
