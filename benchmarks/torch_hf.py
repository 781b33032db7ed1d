"""Step time and peak memory of DP-SGD on Hugging Face transformers: non-private,
privlearn and every Opacus mode, in one run, on the CPU or a GPU.

Usage::

    python benchmarks/torch_hf.py [--models gpt2,bert,llama,gpt2-lora] [--steps N]
                                  [--warmup W] [--rounds R] [--batch B]
                                  [--out docs/benchmarks.md]
    python benchmarks/torch_hf.py --device cuda --size small --dtype fp32,bf16 \\
                                  --out docs/benchmarks.md

Sizes (``--size``; every model config-initialised, no weights downloaded, dropout 0):

* ``mini`` (the default; the CPU figures): vocabulary 8000, 64 tokens, batch 32.
  ``gpt2``: GPT-2, 2 blocks of width 128, 4 heads, input and output embeddings **tied**
  (the default), causal LM; ``bert``: BERT, 2 layers of width 128, 4 heads, sequence
  classification (2 classes); ``llama``: Llama, 2 layers of width 128, 4 heads, causal
  LM; ``gpt2-lora``: the GPT-2 above with peft LoRA (rank 8) on ``c_attn``, only the
  adapters train.
* ``small`` (realistic sizes, for a GPU): ``gpt2``: ``GPT2Config()`` = GPT-2 small (124M
  parameters, tied), 16 sequences x 256 tokens; ``bert``: ``BertConfig()`` = BERT-base,
  sequence classification, 32 x 128; ``llama``: a ~153M Llama (width 768, 12 layers, 12
  query heads sharing 4 key/value heads, MLP 3072, vocabulary 32000, untied), 16 x 256;
  ``gpt2-lora``: GPT-2 small + LoRA rank 16 on ``c_attn``, 16 x 256.
* ``tiny``: the ``small`` structures at toy width (tied GPT-2, BERT, Llama with grouped
  key/value heads, LoRA rank 16 on ``c_attn``), 8 x 16: a smoke test of the code paths.

Every mode trains the same model from the same initial weights on the same synthetic
tokens with plain SGD (lr 0.05). The loss is the mean over sequences of the per-sequence
token cross-entropy (:func:`privlearn.torch.per_sequence_cross_entropy`; its ``reduction=
"none"`` form is Opacus ghost clipping's per-example loss), or cross-entropy over the
class logits for BERT. The private modes use ``max_grad_norm=1`` and
``noise_multiplier=1``. Batches (``--sampling``): ``fixed`` (the default) gives every mode
batches of exactly ``B`` rows (privlearn ``make_private(..., sampling="fixed")``, Opacus
``poisson_sampling=False`` over a shuffled loader dropping the last partial batch, and
that loader for non-private training), so that all modes do the same work; ``poisson``
makes the private modes sample Poisson batches at rate ``B / n`` (expected batch ``B``;
their realised sizes then differ between modes over a few steps). ``n`` is
``B x (steps + warmup + 8)`` for ``mini`` and ``64 B`` (rate 1/64) for ``small`` and
``tiny`` (``8 B`` with ``--processes interleaved``). Position ids are passed
expanded to ``(B, T)`` in every mode (Opacus fails on GPT-2/BERT's default broadcast
``(1, T)`` ids).

Precision (``--dtype``): ``fp32`` trains float32 weights (on CUDA with TF32 matmuls,
``torch.backends.cuda.matmul.allow_tf32 = True``); ``bf16`` runs the forward pass and
the loss of the same float32 model under ``torch.autocast(device, dtype=torch.bfloat16)``.

Measurement.

* ``--processes interleaved`` (the default on the CPU): every mode of a model trains its
  own deep copy of it in one forked process, on fixed-size batches; :func:`interleave`
  runs ``warmup`` untimed rounds, then ``steps`` timed rounds, each one step of every mode
  in an order rotated by one every round (the batch drawn and moved to the device untimed;
  timed: ``zero_grad``, forward, loss, backward, ``step``), so that a change of the shared
  machine's load hits every mode alike. ms/step is the median; the ratios between two
  modes are the medians over rounds of their same-round ratios; the CPU columns are the
  same from ``time.process_time`` (less sensitive to other jobs). Then one more, untimed
  step of each mode gives its peak memory: on the CPU the peak of live tensor bytes during
  the step over those live before it, from ``torch.profiler``'s allocator events
  (``profile_memory=True``, ``step_memory._peak_cpu``; the CPU analogue of CUDA's
  ``max_memory_allocated``); on CUDA ``max_memory_allocated()`` after
  ``reset_peak_memory_stats()`` minus ``memory_allocated()`` before the step.
  ``--rounds R`` repeats the whole measurement in R fresh processes (round times pooled).

Otherwise one step = draw the batch, move it to the device, ``zero_grad``, forward,
loss, backward, ``step`` (then ``torch.cuda.synchronize()`` on CUDA). ``warmup`` untimed
steps, then up to ``steps`` timed ones (stopping after ``--max-seconds`` once 3 ran);
the median step time is reported. ``--rounds`` interleaved rounds (every configuration,
then every configuration again) keep each configuration's fastest round and its highest
peak memory.

* ``--processes per-config``: the driver imports everything
  once, then runs each configuration in a forked child process (``torch.set_num_threads
  (1)`` before any work) so that its peak resident memory is its own: the child builds
  the model and the training objects, records its resident set size, resets the peak
  counter (``/proc/self/clear_refs``) and reports the peak RSS added by its steps.
* ``--processes one`` (the default on CUDA): one spawned child process runs the whole
  grid (a child that dies is replaced and the configuration it was running reported as
  failed). Each model is built once and every
  configuration trains a fresh deep copy of it. Peak memory is the CUDA memory a step
  adds: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus
  ``memory_allocated()`` just before the step, the highest over the timed steps; "held"
  is what stays allocated between steps (the model copy, gradients, optimizer and
  engine state). On the CPU this layout reports RSS figures that are not comparable
  between configurations (freed memory is reused); it exists there to smoke-test the
  GPU code path.

``--budget-seconds`` bounds the whole run: configurations not started in time are
reported as not run, and the section is still written.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn
from torch_dpsgd import (  # benchmarks/, this script's folder  # noqa: E402
    combine_rounds,
    proc_status_kb,
    reset_peak_rss,
)

ALL_MODELS = ["gpt2", "bert", "llama", "gpt2-lora"]
MODES = ["non-private", "privlearn", "opacus-hooks", "opacus-ew", "opacus-functorch",
         "opacus-ghost"]
OPACUS_MODES = {"opacus-hooks": "hooks", "opacus-ew": "ew", "opacus-functorch": "functorch",
                "opacus-ghost": "ghost"}
DTYPES = ["fp32", "bf16"]
SIZES = ["mini", "small", "tiny"]
SAMPLINGS = ["fixed", "poisson"]
LR, MAX_GRAD_NORM, NOISE_MULTIPLIER = 0.05, 1.0, 1.0
THREADS = 1  # torch threads per configuration on the CPU
SECTION = "## Hugging Face transformers (DP-SGD step time and memory)"
#: defaults per device: steps, warm-up steps, rounds, max seconds of timed steps
DEFAULTS = {"cpu": (6, 1, 2, 4.0), "cuda": (10, 3, 2, 5.0)}
#: with ``--processes interleaved``: interleaved rounds (one timed step of every mode
#: each), warm-up rounds, runs in fresh processes
INTERLEAVED_DEFAULTS = {"cpu": (10, 2, 1), "cuda": (20, 3, 1)}
RERUN_ON_GPU = (
    'How to rerun on a GPU: on a machine with internet access, `pip download --no-deps '
    'opacus==1.6.0 -d wheels/` in the checkout (Opacus is the only benchmark dependency '
    'that GPU images usually lack), then on the GPU machine, in the checkout, '
    '`OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh` (at most 7 minutes, no internet '
    'needed, nothing installed but Opacus from `wheels/`: it runs the CUDA tests, `python'
    ' -m pytest tests/torch -k cuda`, timed, and `python benchmarks/gpu_bench.py`, which '
    "appends each configuration's result to `$OUT/gpu_bench.jsonl` as soon as it is "
    "measured and ends with a summary table, `$OUT/gpu_bench.md`). This section's full "
    'grid (two rounds, every Opacus mode at both precisions) is `python '
    'benchmarks/torch_hf.py --device cuda --size small --dtype fp32,bf16 --out '
    'docs/benchmarks.md`.')


# --------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """One model at one size: its batch (expected, under Poisson sampling), sequence
    length, vocabulary and LoRA rank (``None`` without LoRA)."""

    size: str
    model: str
    batch: int
    seq: int
    vocab: int
    lora_rank: int | None

    @property
    def task(self) -> str:
        return "cls" if self.model == "bert" else "lm"

    def examples(self, steps: int, warmup: int) -> int:
        """Dataset size n (the sampling rate is batch / n)."""
        if self.size == "mini":
            return self.batch * (steps + warmup + 8)
        return 64 * self.batch


def workload(model: str, size: str = "mini", batch: int | None = None) -> Workload:
    """The workload of ``model`` at ``size``; ``batch`` replaces the size's batch."""
    if batch is not None:
        w = workload(model, size)
        return Workload(w.size, w.model, batch, w.seq, w.vocab, w.lora_rank)
    if model not in ALL_MODELS:
        raise ValueError(f"model must be one of {ALL_MODELS}, got {model!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    lora = model == "gpt2-lora"
    if size == "mini":
        return Workload(size, model, 32, 64, 8000, 8 if lora else None)
    if size == "tiny":
        return Workload(size, model, 8, 16, 128, 16 if lora else None)
    batch, seq = (32, 128) if model == "bert" else (16, 256)
    vocab = {"bert": 30522, "llama": 32000}.get(model, 50257)
    return Workload(size, model, batch, seq, vocab, 16 if lora else None)


_GPT2 = {"mini": dict(vocab_size=8000, n_positions=64, n_embd=128, n_layer=2, n_head=4),
         "tiny": dict(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2),
         "small": {}}  # GPT2Config() = GPT-2 small
_BERT = {"mini": dict(vocab_size=8000, hidden_size=128, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=512,
                      max_position_embeddings=64),
         "tiny": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64,
                      max_position_embeddings=16),
         "small": {}}  # BertConfig() = BERT-base
_LLAMA = {"mini": dict(vocab_size=8000, hidden_size=128, intermediate_size=344,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=64),
          "tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=16),
          "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=3072,
                        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                        max_position_embeddings=2048)}


def build(model_name: str, size: str = "mini"):
    """(model, task) for a benchmark model, initialised with seed 0 (on the CPU)."""
    import torch
    import transformers

    w = workload(model_name, size)
    torch.manual_seed(0)
    if model_name in ("gpt2", "gpt2-lora"):
        cfg = transformers.GPT2Config(**_GPT2[size], resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        if w.lora_rank is not None:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(
                r=w.lora_rank, lora_alpha=2 * w.lora_rank, target_modules=["c_attn"],
                lora_dropout=0.0, fan_in_fan_out=True, task_type="CAUSAL_LM"))
        return model, w.task
    if model_name == "bert":
        cfg = transformers.BertConfig(**_BERT[size], hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, num_labels=2)
        return transformers.BertForSequenceClassification(cfg), w.task
    cfg = transformers.LlamaConfig(**_LLAMA[size])
    return transformers.LlamaForCausalLM(cfg), w.task


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


def _param_counts(model) -> tuple[int, int]:
    """(all, trainable) parameters, tied ones counted once."""
    seen, total, train = set(), 0, 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
            train += p.numel() if p.requires_grad else 0
    return total, train


# --------------------------------------------------------------------------- one configuration
def train_step(model, optimizer, criterion, model_name: str, xb, yb, bf16: bool):
    """One training step on the token ids ``xb`` and targets ``yb`` (on the model's
    device), under bf16 autocast with ``bf16``; returns the loss."""
    import torch

    b, t = xb.shape
    # input_ids positional: Opacus's expanded-weights module takes its input that way
    kw = {"attention_mask": torch.ones_like(xb),
          "position_ids": torch.arange(t, device=xb.device).expand(b, t).contiguous()}
    if model_name == "bert":
        kw["token_type_ids"] = torch.zeros_like(xb)
    optimizer.zero_grad()
    with torch.autocast(xb.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(xb, **kw).logits
        loss = criterion(logits, yb)
    loss.backward()
    optimizer.step()
    return loss


def prepare(model, w: Workload, mode: str, n: int, sampling: str = "fixed"):
    """``(model, optimizer, criterion, loader)`` of ``mode`` over ``n`` synthetic
    sequences (seed 1), ``model`` already on its device. ``sampling="fixed"``: every mode
    draws batches of exactly ``w.batch`` rows (privlearn ``make_private(...,
    sampling="fixed")``, Opacus ``poisson_sampling=False`` over a shuffled loader that
    drops the last partial batch, non-private the same loader); ``"poisson"``: the
    private modes sample Poisson batches at rate ``w.batch / n``."""
    import torch

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, w.vocab, (n, w.seq), generator=g)
    labels = ids.clone() if w.task == "lm" else torch.randint(0, 2, (n,), generator=g)
    dataset = torch.utils.data.TensorDataset(ids, labels)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    criterion = _criterion(w.task)
    loader = torch.utils.data.DataLoader(dataset, batch_size=w.batch, shuffle=True,
                                         drop_last=True)
    if mode == "privlearn":
        from privlearn.torch import make_private

        p = make_private(model, optimizer, torch.utils.data.DataLoader(dataset,
                                                                       batch_size=w.batch),
                         noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
                         sampling=sampling, seed=0)
        model, optimizer, loader = p.model, p.optimizer, p.data_loader
    elif mode in OPACUS_MODES:
        from opacus import PrivacyEngine

        out = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
            poisson_sampling=sampling == "poisson", grad_sample_mode=OPACUS_MODES[mode])
        if OPACUS_MODES[mode] == "ghost":
            model, optimizer, criterion, loader = out
        else:
            model, optimizer, loader = out
    return model, optimizer, criterion, loader


def _cycle(loader):
    while True:
        yield from loader


def measure(model, w: Workload, mode: str, dtype: str, steps: int, warmup: int,
            max_seconds: float, device: str = "cpu", held_from: int = 0,
            sampling: str = "fixed") -> dict:
    """Train ``model`` (already on ``device``) in ``mode`` and time its steps. On CUDA,
    ``held_from`` is the memory allocated before the model was placed there."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    total, trainable = _param_counts(model)
    model.train()
    model, optimizer, criterion, loader = prepare(model, w, mode, w.examples(steps, warmup),
                                                  sampling)
    it = _cycle(loader)
    bf16 = dtype == "bf16"
    if not cuda:
        base_kb = proc_status_kb("VmRSS")
        reset_peak_rss()
    times, sizes, peaks = [], [], []
    loss = None
    for i in range(warmup + steps):
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        xb, yb = next(it)
        xb, yb = xb.to(dev), yb.to(dev)
        b = xb.shape[0]
        loss = train_step(model, optimizer, criterion, w.model, xb, yb, bf16)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            sizes.append(b)
            if cuda:
                peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
            if len(times) >= 3 and sum(times) > max_seconds:
                break
    value = float(loss.item())  # Opacus ghost clipping's loss is a wrapper with item()
    if not math.isfinite(value):
        raise RuntimeError(f"non-finite loss {value}")
    res = {"model": w.model, "mode": mode, "dtype": dtype, "steps": len(times),
           "step_s": statistics.median(times), "mean_batch": statistics.fmean(sizes),
           "params": total, "trainable": trainable}
    if cuda:
        res["peak_added_mb"] = max(peaks)
        res["held_mb"] = (torch.cuda.memory_allocated() - held_from) / 2**20
    else:
        res["peak_added_mb"] = (proc_status_kb("VmHWM") - base_kb) / 1024
        res["baseline_mb"] = base_kb / 1024
    return res


def worker(model_name: str, mode: str, steps: int, warmup: int, max_seconds: float,
           device: str = "cpu", size: str = "mini", dtype: str = "fp32",
           sampling: str = "fixed", batch: int | None = None) -> dict:
    """One configuration in a fresh process: build, then :func:`measure`."""
    import warnings

    import torch
    import transformers

    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model, _ = build(model_name, size)
    held_from = torch.cuda.memory_allocated() if device == "cuda" else 0
    model.to(torch.device(device))
    return measure(model, workload(model_name, size, batch), mode, dtype, steps, warmup,
                   max_seconds, device, held_from, sampling)


def _error(key: tuple, exc: BaseException) -> dict:
    model, dtype, mode = key
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return {"model": model, "dtype": dtype, "mode": mode, "error": msg[:160],
            "trace": traceback.format_exc()[-2000:]}


def _child(conn, model, mode, steps, warmup, max_seconds, device, size, dtype, sampling,
           batch) -> None:
    try:
        conn.send(worker(model, mode, steps, warmup, max_seconds, device, size, dtype,
                         sampling, batch))
    except BaseException as exc:  # reported as "fails: ..."
        conn.send(_error((model, dtype, mode), exc))
    finally:
        conn.close()


def run_config(model_name, mode, steps, warmup, max_seconds, timeout, device="cpu",
               size="mini", dtype="fp32", sampling="fixed", batch=None) -> dict:
    """One configuration in its own process (``--processes per-config``): forked on the
    CPU (the modules imported by the driver are inherited), spawned on CUDA (see
    :func:`run_grid`)."""
    ctx = mp.get_context("fork" if device == "cpu" else "spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, model_name, mode, steps, warmup,
                                            max_seconds, device, size, dtype, sampling,
                                            batch))
    proc.start()
    child.close()
    if parent.poll(timeout):
        try:
            res = parent.recv()
        except EOFError:
            res = None
    else:
        proc.kill()
        res = {"error": f"timed out after {timeout:.0f} s"}
    proc.join()
    if res is None:
        res = {"error": f"the process died (exit code {proc.exitcode})"}
    res.update(model=model_name, mode=mode, dtype=dtype)
    return res


# ------------------------------------------------------------------ the grid in one process
def _grid_child(conn, jobs, opts: dict) -> None:
    """Run ``jobs`` ((round, model, dtype, mode) tuples) in this process, sending
    ``("start", job)`` then ``("done", job, result)`` for each (result None: skipped,
    the configuration failed in an earlier round)."""
    import warnings

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    dev = torch.device(opts["device"])
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(THREADS)
    bases: dict[str, object] = {}
    failed = set(opts.get("failed", ()))
    for job in jobs:
        _, model_name, dtype, mode = job
        conn.send(("start", job))
        if job[1:] in failed:
            conn.send(("done", job, None))
            continue
        if time.time() > opts["deadline"]:
            conn.send(("done", job, {"model": model_name, "dtype": dtype, "mode": mode,
                                     "error": "not run: time budget spent"}))
            continue
        try:
            if model_name not in bases:
                base, _ = build(model_name, opts["size"])
                bases[model_name] = base.to(dev)
            held_from = torch.cuda.memory_allocated() if cuda else 0
            model = copy.deepcopy(bases[model_name])
            res = measure(model, workload(model_name, opts["size"], opts.get("batch")), mode,
                          dtype, opts["steps"], opts["warmup"], opts["max_seconds"],
                          opts["device"], held_from, opts.get("sampling", "fixed"))
        except BaseException as exc:  # reported as "fails: ..."
            res = _error((model_name, dtype, mode), exc)
            failed.add(job[1:])
            if cuda and "CUDA error" in res["error"]:
                # the context may be unusable: a fresh process takes the remaining jobs
                conn.send(("done", job, res))
                conn.close()
                os._exit(3)
        model = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        conn.send(("done", job, res))
    conn.close()


def run_grid(jobs: list[tuple], opts: dict, timeout: float, report) -> None:
    """Run ``jobs`` in one child process (``--processes one``); ``report(job, result)``
    is called for each that ran. A child that dies or overruns ``timeout`` on one job is
    killed, the job reported as failed, and a new child takes the remaining jobs.

    The child is spawned, not forked: CUDA cannot run in a child forked from a process
    in which anything (an import included) queried CUDA."""
    ctx = mp.get_context("spawn")
    todo = list(jobs)
    failed: set[tuple] = set()
    while todo:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_grid_child,
                           args=(child, todo, dict(opts, failed=sorted(failed))))
        proc.start()
        child.close()
        current, progress, msg = None, False, ""
        while todo:
            if not parent.poll(timeout):
                msg = f"timed out after {timeout:.0f} s"
                proc.kill()
                break
            try:
                kind, job, *rest = parent.recv()
            except EOFError:
                proc.join()
                msg = f"the process died (exit code {proc.exitcode})"
                break
            progress = True
            if kind == "start":
                current = job
                continue
            todo.remove(job)
            current = None
            if rest[0] is not None:
                if "error" in rest[0]:
                    failed.add(job[1:])
                report(job, rest[0])
        proc.join()
        if not progress:  # the child died before its first job: so would the next one
            for job in list(todo):
                todo.remove(job)
                report(job, {"model": job[1], "dtype": job[2], "mode": job[3],
                             "error": f"not run: {msg}"})
        if current is not None:  # the job in flight failed with its process
            _, model, dtype, mode = current
            todo.remove(current)
            failed.add(current[1:])
            report(current, {"model": model, "dtype": dtype, "mode": mode, "error": msg})


# ------------------------------------------------- every mode in one process, interleaved
def interleave(steps: dict, rounds: int, warmup: int = 0, untimed: dict | None = None,
               on_error=None, cpu: dict | None = None) -> dict[str, list[float]]:
    """Step times of several training setups in one process, interleaved round by round.

    ``steps`` maps a name to a callable running one step. ``warmup`` untimed rounds, then
    ``rounds`` timed ones; a round runs every setup's step once, ``untimed[name]()`` (the
    draw of its batch) first and outside the timing, in an order rotated by one each round,
    so that a change of the machine's load hits every setup alike. Returns each setup's
    ``rounds`` step times in seconds, aligned by round. A setup whose step (or draw) raises
    is dropped from then on and ``on_error(name, exc)`` called; only the setups that ran
    every round are returned. ``cpu``, a dict, receives each setup's CPU times of the same
    steps (``time.process_time``: the processor time of this process, which the other
    processes of a loaded machine do not add to)."""
    names = list(steps)
    alive = list(names)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu_times: dict[str, list[float]] = {n: [] for n in names}
    untimed = untimed or {}
    for r in range(warmup + rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if name not in alive:
                continue
            try:
                if name in untimed:
                    untimed[name]()
                c0, t0 = time.process_time(), time.perf_counter()
                steps[name]()
                dt = time.perf_counter() - t0
                dc = time.process_time() - c0
            except Exception as exc:  # reported, the others go on
                alive.remove(name)
                if on_error is None:
                    raise
                on_error(name, exc)
                continue
            if r >= warmup:
                times[name].append(dt)
                cpu_times[name].append(dc)
    if cpu is not None:
        cpu.update({n: cpu_times[n] for n in alive})
    return {n: times[n] for n in alive}


def measure_interleaved(model_name: str, modes: list[str], dtype: str, rounds: int,
                        warmup: int, size: str = "mini", batch: int | None = None,
                        device: str = "cpu") -> list[dict]:
    """Every mode of ``modes`` trains its own copy of the model, in this process, on
    fixed-size batches of exactly ``B`` rows; :func:`interleave` times one step of each per
    round. Then one more step of each mode, untimed, gives the peak memory it adds: on
    the CPU the peak of live tensor bytes over those live before the step, from
    ``torch.profiler``'s allocator events (``benchmarks/step_memory.py``); on CUDA
    ``max_memory_allocated`` after ``reset_peak_memory_stats`` minus
    ``memory_allocated`` before it."""
    import torch
    from step_memory import _peak_cpu  # benchmarks/, this script's folder

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    w = workload(model_name, size, batch)
    base, _ = build(model_name, size)
    base.to(dev)
    total, trainable = _param_counts(base)
    n = 8 * w.batch
    bf16 = dtype == "bf16"
    errors: dict[str, dict] = {}
    setups = {}
    for mode in modes:
        try:
            model = copy.deepcopy(base)
            model.train()
            setups[mode] = prepare(model, w, mode, n, "fixed")
        except Exception as exc:  # reported as "fails: ..."
            errors[mode] = _error((model_name, dtype, mode), exc)
    current: dict[str, tuple] = {}
    sizes: dict[str, list[int]] = {m: [] for m in setups}
    losses: dict[str, object] = {}

    def runner(mode):
        model, optimizer, criterion, loader = setups[mode]
        it = _cycle(loader)

        def draw():
            xb, yb = next(it)
            sizes[mode].append(int(xb.shape[0]))
            current[mode] = (xb.to(dev), yb.to(dev))

        def step():
            xb, yb = current[mode]
            losses[mode] = train_step(model, optimizer, criterion, model_name, xb, yb, bf16)
            if cuda:
                torch.cuda.synchronize()

        return draw, step

    fns = {m: runner(m) for m in setups}

    def failed(mode, exc):
        errors[mode] = _error((model_name, dtype, mode), exc)

    cpu: dict[str, list[float]] = {}
    times = interleave({m: f[1] for m, f in fns.items()}, rounds, warmup,
                       untimed={m: f[0] for m, f in fns.items()}, on_error=failed, cpu=cpu)
    print(f"{model_name}: {rounds} interleaved rounds timed, {len(times)} modes ran; "
          "measuring peak memory", flush=True)
    out = []
    for mode in modes:
        if mode not in times:
            out.append(errors.get(mode) or {"model": model_name, "dtype": dtype,
                                            "mode": mode, "error": "did not run"})
            continue
        draw, step = fns[mode]
        try:
            draw()
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                peak = torch.cuda.max_memory_allocated() - before
            else:
                peak = _peak_cpu(step)
            value = float(losses[mode].item())  # Opacus ghost's loss wrapper has item()
            if not math.isfinite(value):
                raise RuntimeError(f"non-finite loss {value}")
        except Exception as exc:
            out.append(_error((model_name, dtype, mode), exc))
            continue
        out.append({"model": model_name, "mode": mode, "dtype": dtype, "batch": w.batch,
                    "steps": len(times[mode]), "times": times[mode],
                    "step_s": statistics.median(times[mode]), "cpu_times": cpu[mode],
                    "cpu_step_s": statistics.median(cpu[mode]),
                    "mean_batch": statistics.fmean(sizes[mode]),
                    "min_batch": min(sizes[mode]), "peak_added_mb": peak / 2**20,
                    "peak": "allocator", "params": total, "trainable": trainable})
    return out


def _interleaved_child(conn, *args) -> None:
    import warnings

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    if args[-1] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(THREADS)
    try:
        conn.send(measure_interleaved(*args))
    except BaseException as exc:  # reported as "fails: ..." for every mode
        conn.send([_error((args[0], args[2], mode), exc) for mode in args[1]])
    finally:
        conn.close()


def run_interleaved(model_name, modes, dtype, rounds, warmup, timeout, size="mini",
                    batch=None, device="cpu") -> list[dict]:
    """:func:`measure_interleaved` in a process of its own (``--processes
    interleaved``): forked on the CPU, spawned on CUDA (see :func:`run_grid`)."""
    ctx = mp.get_context("fork" if device == "cpu" else "spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_interleaved_child, args=(
        child, model_name, modes, dtype, rounds, warmup, size, batch, device))
    proc.start()
    child.close()
    res = None
    msg = f"timed out after {timeout:.0f} s"
    if parent.poll(timeout):
        try:
            res = parent.recv()
        except EOFError:
            msg = "the process died"
    else:
        proc.kill()
    proc.join()
    if res is None:
        res = [{"model": model_name, "dtype": dtype, "mode": m, "error": msg} for m in modes]
    return res


def combine_interleaved(repeats: list[dict]) -> dict:
    """One mode's results of several interleaved runs (each in a fresh process): their
    round times pooled (aligned with the other modes', the runs in the same order), the
    highest peak memory; the first error if every run failed."""
    ok = [r for r in repeats if "error" not in r]
    if not ok:
        return repeats[0]
    res = dict(ok[0])
    for key in ("times", "cpu_times"):
        res[key] = [t for r in ok for t in r[key]]
    res["step_s"] = statistics.median(res["times"])
    res["cpu_step_s"] = statistics.median(res["cpu_times"])
    res["steps"] = len(res["times"])
    res["rounds"] = len(ok)
    res["peak_added_mb"] = max(r["peak_added_mb"] for r in ok)
    res["mean_batch"] = statistics.fmean(r["mean_batch"] for r in ok)
    return res


# --------------------------------------------------------------------------- report
def ratio(a: dict, b: dict, cpu: bool = False) -> float:
    """Step time of ``a`` over ``b``: the median over rounds of the ratio of the two
    modes' times in the same round where both ran the same interleaved rounds, else the
    ratio of their median step times. ``cpu``: of their CPU times (interleaved runs)."""
    key = "cpu_times" if cpu else "times"
    ta, tb = a.get(key), b.get(key)
    if ta and tb and len(ta) == len(tb):
        return statistics.median(x / y for x, y in zip(ta, tb, strict=True))
    if cpu:
        return a["cpu_step_s"] / b["cpu_step_s"]
    return a["step_s"] / b["step_s"]


def table(results: list[dict]) -> str:
    by = {r["mode"]: r for r in results}
    base = by.get("non-private", {})
    ours = by.get("privlearn", {})
    held = any("held_mb" in r for r in results)
    cpu = any("cpu_step_s" in r for r in results)
    lines = ["| mode | ms/step | x non-private | x privlearn | "
             + ("CPU ms/step | CPU x non-private | " if cpu else "")
             + "peak MB added | x non-private's peak | " + ("held MB | " if held else "")
             + "timed steps | mean batch |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if held else "")
             + ("---|---|" if cpu else "")]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mode']} | fails: {r['error']} | | | | | | |"
                         + (" |" if held else "") + (" | |" if cpu else ""))
            continue
        rel = (f"{ratio(r, base):.2f}" if "step_s" in base else "")
        vs = (f"{ratio(r, ours):.2f}" if "step_s" in ours else "")
        if cpu:
            vs += (f" | {1000 * r['cpu_step_s']:.0f} | "
                   + (f"{ratio(r, base, cpu=True):.2f}" if "cpu_step_s" in base else ""))
        mem = (f"{r['peak_added_mb'] / base['peak_added_mb']:.2f}"
               if base.get("peak_added_mb", 0) > 0 else "")
        ms = 1000 * r["step_s"]
        lines.append(f"| {r['mode']} | {ms:.0f} | {rel} | {vs} | "
                     f"{r['peak_added_mb']:.0f} | {mem} | "
                     + (f"{r['held_mb']:.0f} | " if held else "")
                     + f"{r['steps']} | {r['mean_batch']:.1f} |")
    return "\n".join(lines)


def summary(all_results: dict[str, list[dict]]) -> str:
    cpu = any("cpu_step_s" in r for rs in all_results.values() for r in rs)
    rows = ["| model | privlearn x non-private | "
            + ("privlearn x non-private, CPU time | " if cpu else "")
            + "privlearn / fastest working Opacus | "
            "fastest Opacus mode | privlearn peak MB added (non-private) | "
            "peak added x non-private |",
            "|---|---|---|---|---|---|" + ("---|" if cpu else "")]
    for model, results in all_results.items():
        ok = {r["mode"]: r for r in results if "error" not in r}
        base, ours = ok.get("non-private"), ok.get("privlearn")
        opa = [r for m, r in ok.items() if m.startswith("opacus")]
        fast = min(opa, key=lambda r: r["step_s"]) if opa else None
        rows.append(
            f"| {model} | "
            + (f"{ratio(ours, base):.2f}" if ours and base else "n/a") + " | "
            + ((f"{ratio(ours, base, cpu=True):.2f}" if ours and base else "n/a") + " | "
               if cpu else "")
            + (f"{ratio(ours, fast):.2f}" if ours and fast else "n/a") + " | "
            + (fast["mode"] if fast else "none works") + " | "
            + (f"{ours['peak_added_mb']:.0f} ({base['peak_added_mb']:.0f})"
               if ours and base else "n/a") + " | "
            + (f"{ours['peak_added_mb'] / base['peak_added_mb']:.2f}"
               if ours and base and base["peak_added_mb"] > 0 else "n/a") + " |")
    return "\n".join(rows)


#: the CPU targets for the private step: at most this times non-private's step time, at
#: least this much faster than Opacus hooks, at most this times non-private's peak added
CPU_TARGETS = (1.3, 1.3, 1.15)


def targets(all_results: dict[str, list[dict]]) -> str:
    """The measured figures against :data:`CPU_TARGETS`, one row per model. The time
    targets are stated for tied GPT-2 (vocabulary 8000, 16 x 64 tokens, 1 thread): the
    other models' times are shown without a verdict; the memory target holds for all."""
    t_np, t_hooks, t_mem = CPU_TARGETS
    rows = ["Against the CPU targets (time: stated for tied GPT-2, vocabulary 8000, "
            "batch 16, 64 tokens, 1 thread; memory: allocator peak, fixed-size batches):", "",
            f"| model | privlearn x non-private (<= {t_np}) | Opacus hooks / privlearn "
            f"(>= {t_hooks}) | peak added x non-private (<= {t_mem}) |",
            "|---|---|---|---|"]

    def cell(value, ok, judged=True):
        if value is None:
            return "n/a"
        return f"{value:.2f} ({'met' if ok(value) else 'missed'})" if judged else (
            f"{value:.2f} (no target)")

    for model, results in all_results.items():
        ok = {r["mode"]: r for r in results if "error" not in r}
        base, ours, hooks = ok.get("non-private"), ok.get("privlearn"), ok.get("opacus-hooks")
        x = ratio(ours, base) if ours and base else None
        h = ratio(hooks, ours) if ours and hooks else None
        hc = (f"; CPU time {ratio(hooks, ours, cpu=True):.2f}"
              if ours and hooks and "cpu_step_s" in ours and "cpu_step_s" in hooks else "")
        m = (ours["peak_added_mb"] / base["peak_added_mb"]
             if ours and base and base["peak_added_mb"] > 0 else None)
        xc = (f"; CPU time {ratio(ours, base, cpu=True):.2f}"
              if ours and base and "cpu_step_s" in ours and "cpu_step_s" in base else "")
        timed = model.split()[0] == "gpt2"  # tied GPT-2: the time targets' model
        rows.append(f"| {model} | {cell(x, lambda v: v <= t_np, timed)}{xc} | "
                    f"{cell(h, lambda v: v >= t_hooks, timed)}{hc} | "
                    f"{cell(m, lambda v: v <= t_mem)} |")
    return "\n".join(rows)


TITLES = {"gpt2": "GPT-2 (tied embeddings)", "bert": "BERT sequence classification",
          "llama": "Llama causal LM", "gpt2-lora": "GPT-2 + LoRA (r={r}, c_attn)"}
SMALL_TITLES = {"gpt2": "GPT-2 small (tied embeddings)",
                "bert": "BERT-base sequence classification",
                "llama": "Llama ~150M, grouped key/value heads (12 query, 4 key/value)",
                "gpt2-lora": "GPT-2 small + LoRA (r={r}, c_attn)"}
DTYPE_TITLES = {"fp32": "fp32", "bf16": "bf16 autocast"}


def _label(model: str, dtype: str, tagged: bool) -> str:
    return f"{model} {dtype}" if tagged else model


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 10**6 else f"{n / 1e3:.1f}k"


def _models_line(args, all_results: dict) -> str:
    parts = []
    titles = SMALL_TITLES if args.size == "small" else TITLES
    for model in args.model_list:
        w = workload(model, args.size, args.batch)
        counted = [r for rs in all_results.values() for r in rs
                   if r.get("model") == model and "params" in r]
        count = ""
        if counted:
            r = counted[0]
            count = f", {_count(r['params'])} parameters"
            if r["trainable"] != r["params"]:
                count += f" ({_count(r['trainable'])} trainable)"
        kind = "expected" if args.sampling == "poisson" else "fixed"
        parts.append(f"{model}: {titles[model].format(r=w.lora_rank)}{count}, batch "
                     f"{w.batch} ({kind}) x {w.seq} tokens, vocabulary {w.vocab}")
    return "; ".join(parts)


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _where(args) -> str:
    import torch

    if args.device == "cpu" and args.processes == "interleaved":
        return (f"{os.cpu_count()} vCPUs shared with other jobs, **{THREADS} torch thread**, "
                "CPU; peak memory = the peak of live CPU tensor bytes during one step over "
                "those live before it, from `torch.profiler`'s allocator events "
                "(`profile_memory=True`; resident set size not measured)")
    if args.device == "cpu" and args.size == "mini":
        return (f"{os.cpu_count()} vCPUs shared with other jobs, **{THREADS} torch thread** "
                "per configuration, CPU; peak memory = resident set size added")
    if args.device == "cpu":
        return (f"{os.cpu_count()} vCPUs, {THREADS} torch thread, CPU; peak memory = "
                "resident set size added")
    if not torch.cuda.is_available():
        return "no CUDA device found"
    props = torch.cuda.get_device_properties(0)
    return (f"GPU **{torch.cuda.get_device_name(0)}** ({props.total_memory / 2**30:.0f} GiB), "
            f"CUDA {torch.version.cuda}, {torch.get_num_threads()} CPU threads for torch; "
            "peak memory = CUDA memory added by a step (`max_memory_allocated` after "
            "`reset_peak_memory_stats`, minus `memory_allocated` before the step; highest "
            "over the timed steps), held = allocated between steps (model copy, gradients, "
            "optimizer and engine state)")


def _workloads(args, all_results: dict) -> str:
    kind = ("Poisson, expected" if args.sampling == "poisson" else
            "fixed size, every mode")
    if args.size == "mini" and args.device == "cpu":
        w = workload("gpt2", "mini", args.batch)
        return f"Batch {w.batch} ({kind}), {w.seq} tokens, vocabulary {w.vocab}"
    rate = ("fixed-size batches" if args.sampling == "fixed" else
            "Poisson sampling rate " + ("1/64" if args.size != "mini" else "B / n"))
    fp32 = "fp32 = float32 with TF32 matmuls, " if args.device == "cuda" else ""
    return ("Models (config-initialised, dropout 0): " + _models_line(args, all_results)
            + f". {rate}, noise multiplier {NOISE_MULTIPLIER:g}, "
            f"max_grad_norm {MAX_GRAD_NORM:g}; {fp32}bf16 = the float32 model under "
            "`torch.autocast(..., dtype=torch.bfloat16)`")


def render(command: str, all_results: dict, args, seconds: float) -> str:
    import peft
    import torch
    import transformers

    tagged = args.device != "cpu" or args.dtype_list != ["fp32"]
    if args.processes == "interleaved":
        timing = (
            "All modes of a model train their own copy of it (same initial weights) in one "
            "process, on fixed-size batches of exactly B rows (privlearn "
            "`make_private(..., sampling=\"fixed\")`, Opacus `poisson_sampling=False`), "
            f"interleaved: {args.warmup} warm-up rounds, then {args.steps} timed rounds, "
            "each running one step of every mode in an order rotated by one every round "
            "(the batch drawn untimed; timed: `zero_grad`, forward, loss, backward, "
            "`step`)" + (f", the whole run repeated {args.rounds} times in fresh processes"
                         if args.rounds > 1 else "") + ". ms/step: the median step time; "
            "`x non-private` and `x privlearn`: the median over rounds of the ratio of the "
            "two modes' step times in the same round (a change of load hits both); "
            "`CPU ms/step` and `CPU x non-private`: the same from the processor time the "
            "process spent in the step (`time.process_time`), which the other jobs of the "
            "machine do not inflate as they do wall time. Peak "
            "memory: one more step of each mode, untimed. The process has the default "
            "allocator settings (`privlearn.torch.retain_freed_memory` not called).")
    else:
        timing = (
            f"{args.rounds} interleaved rounds of up to {args.steps} timed steps after "
            f"{args.warmup} warm-up steps (fastest round's median step; highest round's "
            "peak memory). " + (
                "Each mode runs in its own process, as a user would run it."
                if args.processes == "per-config" else
                "All configurations run in one process, each on a fresh copy of the model, "
                "interleaved (every configuration once, then again)."))
    out = [_section(args.device, args.size, args.batch), "",
           f"Command: `{command}` (run {datetime.date.today().isoformat()}, {seconds:.0f} s). "
           f"torch {torch.__version__}, transformers "
           f"{transformers.__version__}, peft {peft.__version__}, opacus "
           f"{_version('opacus')}, Python {platform.python_version()}, {_where(args)}. "
           f"{_workloads(args, all_results)}. {timing} Position ids are passed expanded to "
           "`(B, T)` in every mode, so that all modes run the same inputs (privlearn also "
           "takes the default broadcast `(1, T)` ids; Opacus does not). Method and models: "
           "`benchmarks/torch_hf.py` docstring.", ""]
    poisson = ("The private modes draw Poisson batches: with a few timed steps their realised "
               "sizes differ between modes (column `mean batch`), which moves the ratios."
               if args.sampling == "poisson" else "")
    if args.device == "cpu":
        out += [("The load of the shared machine moves single times by tens of percent: "
                 "compare ratios within a table. " + poisson).strip(), ""]
    else:
        out += ([poisson, ""] if poisson else []) + [RERUN_ON_GPU, ""]
    out += ["Summary:", "", summary({_label(m, d, tagged): rs
                                     for (m, d), rs in all_results.items()}), ""]
    if args.device == "cpu" and args.processes == "interleaved":
        out += [targets({_label(m, d, tagged): rs for (m, d), rs in all_results.items()}),
                ""]
    titles = SMALL_TITLES if args.size == "small" else TITLES
    for (model, dtype), results in all_results.items():
        title = titles[model].format(r=workload(model, args.size).lora_rank)
        if args.batch is not None:
            title += f", batch {args.batch}"
        if tagged:
            title += ", " + ("fp32 (TF32 matmuls)" if dtype == "fp32" and args.device == "cuda"
                             else DTYPE_TITLES[dtype])
        out += [f"### {title}", "", table(results), ""]
    return "\n".join(out)


def _section(device: str, size: str = "mini", batch: int | None = None) -> str:
    """The heading of the section a run writes: one per device, size and batch."""
    extra = "" if batch is None else f", batch {batch}"
    if device == "cpu" and size == "mini":
        return SECTION if batch is None else SECTION[:-1] + f"{extra})"
    extra = ("" if size == "mini" else f", {size} models") + extra
    return SECTION[:-1] + f"{extra}, {device.upper()})"


def write_section(path: Path, text: str, device: str = "cpu", size: str = "mini",
                  batch: int | None = None) -> None:
    head = _section(device, size, batch)
    old = path.read_text() if path.exists() else ""
    start = old.find(head + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        nxt = old.find("\n## ", start + len(head))
        tail = "" if nxt < 0 else old[nxt:]
        new = old[:start] + text.rstrip("\n") + "\n" + tail
    path.write_text(new.lstrip("\n"))


# --------------------------------------------------------------------------- driver
def _split(value: str, valid: list[str], option: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    for v in items:
        if v not in valid:
            raise SystemExit(f"{option} entries must be in {valid}, got {v!r}")
    if not items:
        raise SystemExit(f"{option} must name at least one of {valid}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(ALL_MODELS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--size", default="mini", choices=SIZES,
                    help="model sizes (docstring): mini (default), small (realistic, for a "
                    "GPU) or tiny (smoke test)")
    ap.add_argument("--dtype", default="fp32",
                    help="comma-separated precisions: fp32 (on CUDA with TF32 matmuls), "
                    "bf16 (bfloat16 autocast)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu, or cuda (peak memory: CUDA memory added by a step instead "
                    "of RSS)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per round (default: 6 on cpu, 10 on cuda)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first (default: 1 on cpu, 3 on cuda)")
    ap.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=None,
                    help="interleaved rounds (default 2)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop timing a configuration after this many seconds of timed "
                    "steps, once 3 ran (default: 4 on cpu, 5 on cuda)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per configuration before its process is killed (default: "
                    "120 on cuda; on cpu 180, 1800 for --size small; with --processes "
                    "interleaved, per model: that times the modes, more for many rounds)")
    ap.add_argument("--budget-seconds", type=float, default=None,
                    help="configurations not started within this many seconds of the start "
                    "are reported as not run")
    ap.add_argument("--processes", choices=["interleaved", "per-config", "one"],
                    default=None,
                    help="interleaved (default on cpu): every mode of a model in one "
                    "process, one step of each per round, fixed-size batches, allocator "
                    "peak memory; per-config: a forked process per configuration (its RSS "
                    "is its own); one: one process for the whole grid (default on cuda)")
    ap.add_argument("--sampling", choices=SAMPLINGS, default="fixed",
                    help="fixed (default): every mode trains on batches of exactly B rows; "
                    "poisson: the private modes sample Poisson batches of expected size B "
                    "(not with --processes interleaved)")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch size B instead of the size's (mini: 32)")
    ap.add_argument("--out", type=Path, default=None, help="markdown file to update")
    ap.add_argument("--json", type=Path, default=None,
                    help="file to write every round's raw results to")
    args = ap.parse_args(argv)
    args.model_list = _split(args.models, ALL_MODELS, "--models")
    args.mode_list = _split(args.modes, MODES, "--modes")
    args.dtype_list = _split(args.dtype, DTYPES, "--dtype")
    if args.processes is None:
        args.processes = "interleaved" if args.device == "cpu" else "one"
    steps, warmup, rounds, max_seconds = DEFAULTS[args.device]
    if args.processes == "interleaved":
        steps, warmup, rounds = INTERLEAVED_DEFAULTS[args.device]
        if args.sampling != "fixed":
            raise SystemExit("--processes interleaved times fixed-size batches: --sampling "
                             "must be fixed (use --processes per-config for poisson)")
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {args.batch}")
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    args.rounds = rounds if args.rounds is None else args.rounds
    args.max_seconds = max_seconds if args.max_seconds is None else args.max_seconds
    if args.timeout is None:  # a GPT-2 small step takes minutes on one CPU thread
        args.timeout = (120.0 if args.device == "cuda" else
                        1800.0 if args.size == "small" else 180.0)
        if args.processes == "interleaved":  # the timeout covers every mode of a model
            args.timeout *= len(args.mode_list) * max(1.0, (args.steps + args.warmup) / 6)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch  # imported once here; forked children inherit the modules

    if args.device == "cpu":
        torch.set_num_threads(THREADS)
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import privlearn.torch  # noqa: F401

    try:
        import opacus  # noqa: F401
    except ImportError:
        opacus = None

    t0 = time.perf_counter()
    deadline = time.time() + (args.budget_seconds if args.budget_seconds is not None
                              else float("inf"))
    cells = [(m, d) for m in args.model_list for d in args.dtype_list]
    rounds: dict[tuple, list[dict]] = {(m, d, mo): [] for m, d in cells
                                       for mo in args.mode_list}
    jobs = [(rnd, m, d, mo) for rnd in range(args.rounds) for m, d in cells
            for mo in args.mode_list]
    print(f"{len(jobs)} configurations ({len(cells)} model/precision pairs x "
          f"{len(args.mode_list)} modes x {args.rounds} rounds), at most "
          f"{len(jobs) * (args.steps + args.warmup)} steps; device {args.device}, size "
          f"{args.size}, processes {args.processes}", flush=True)

    def report(job, r):
        rnd, m, d, mo = job
        rounds[(m, d, mo)].append(r)
        msg = (f"fails: {r['error']}" if "error" in r else
               f"{1000 * r['step_s']:.0f} ms/step, +{r['peak_added_mb']:.0f} MB")
        print(f"{m:10s} {d:5s} {mo:17s} round {rnd + 1}: {msg} "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)

    if opacus is None:  # reported, not run
        for job in [j for j in jobs if j[3] in OPACUS_MODES]:
            jobs.remove(job)
            if job[0] == 0:
                report(job, {"model": job[1], "dtype": job[2], "mode": job[3],
                             "error": "not run: opacus is not installed"})

    def failed_before(job) -> bool:
        rnd, m, d, mo = job
        return rnd > 0 and bool(rounds[(m, d, mo)]) and "error" in rounds[(m, d, mo)][0]

    if args.processes == "interleaved":
        modes = [mo for mo in args.mode_list if opacus is not None or mo not in OPACUS_MODES]
        for rnd in range(args.rounds):
            for m, d in cells:
                if time.time() > deadline:
                    res = [{"model": m, "dtype": d, "mode": mo,
                            "error": "not run: time budget spent"} for mo in modes]
                else:
                    res = run_interleaved(m, modes, d, args.steps, args.warmup, args.timeout,
                                          args.size, args.batch, args.device)
                for r in res:
                    report((rnd, m, d, r["mode"]), r)
    elif args.processes == "one":
        opts = {"device": args.device, "size": args.size, "steps": args.steps,
                "warmup": args.warmup, "max_seconds": args.max_seconds, "deadline": deadline,
                "sampling": args.sampling, "batch": args.batch}
        run_grid(jobs, opts, args.timeout, report)  # a failed mode is not retried
    else:
        for job in jobs:
            if failed_before(job):
                continue
            _, m, d, mo = job
            if time.time() > deadline:
                r = {"model": m, "dtype": d, "mode": mo,
                     "error": "not run: time budget spent"}
            else:
                r = run_config(m, mo, args.steps, args.warmup, args.max_seconds,
                               args.timeout, args.device, args.size, d, args.sampling,
                               args.batch)
            report(job, r)
    combine = (combine_interleaved if args.processes == "interleaved" else
               lambda rs: combine_rounds(rs, time_key="step_s"))
    all_results = {(m, d): [combine(rounds[(m, d, mo)]) for mo in args.mode_list
                            if rounds[(m, d, mo)]]
                   for m, d in cells}
    tagged = args.device != "cpu" or args.dtype_list != ["fp32"]
    for (m, d), results in all_results.items():
        print(f"{_label(m, d, tagged)}:\n{table(results)}", flush=True)
    seconds = time.perf_counter() - t0
    print(summary({_label(m, d, tagged): rs for (m, d), rs in all_results.items()}))
    raw = {f"{m}/{d}/{mo}": rs for (m, d, mo), rs in rounds.items()}
    if args.json is not None:
        args.json.write_text(json.dumps(raw, indent=1))
    else:
        print(json.dumps(raw))
    if args.out is not None:
        shown = list(argv if argv is not None else sys.argv[1:])
        if "--json" in shown[:-1]:  # where the raw results went changes no figure
            i = shown.index("--json")
            del shown[i:i + 2]
        command = "python benchmarks/torch_hf.py " + " ".join(shown)
        write_section(args.out, render(command.strip(), all_results, args, seconds),
                      args.device, args.size, args.batch)
        print(f"wrote section {_section(args.device, args.size, args.batch)!r} of "
              f"{args.out}")
    return all_results


if __name__ == "__main__":
    main()
