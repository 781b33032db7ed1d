"""DPTrainer with ``gradient_accumulation_steps``: peak memory and time of a logical step.

A logical batch of ``B k`` rows trained in ``k`` chunks of ``B`` rows against the same
logical batch in one pass (``per_device_train_batch_size = B k``, ``k = 1``) and against
one chunk alone (a logical batch of ``B``). Fixed-size batches (``sampling="fixed"``), so
every configuration trains exactly its nominal rows.

* **peak**: the peak of live CPU tensor bytes during one ``training_step`` (the forward
  and backward passes of all the chunks, and the accumulation of their clipped sums) over
  those live just before it, from the allocator events of ``torch.profiler``
  (``profile_memory=True``: the analogue of CUDA's ``max_memory_allocated``), on the last
  step;
* **ms/step**: median wall time of a logical step (``on_step_begin`` to ``on_step_end``:
  the chunks, the noise and the update) over the timed steps, after one warm-up step (it
  probes the model), the profiled step excluded.

The model is a config-initialised GPT-2 (no download), dropout off. Usage::

    python benchmarks/hf_accumulation.py [--steps 4] [--width 128] [--layers 2]
                                         [--tokens 64] [--chunk 8] [--ks 1,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn


def measure(b: int, k: int, steps: int, width: int, layers: int, tokens: int) -> dict:
    import torch
    import transformers as tf
    from step_memory import _peak_cpu  # benchmarks/, this script's folder

    from privlearn.torch.hf import DPTrainer, PrivacyArguments

    torch.manual_seed(0)
    vocab = 8000
    model = tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=vocab, n_positions=tokens, n_embd=width, n_layer=layers,
        n_head=max(1, width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (512, tokens), generator=g)
    data = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]
    total = steps + 2  # a warm-up step, the timed steps, the profiled step
    times, peaks = [], []

    class Timer(tf.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    class Measured(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.state.global_step < total - 1:
                return super().training_step(model, inputs, num_items_in_batch)
            out = []
            peaks.append(_peak_cpu(lambda: out.append(
                super(Measured, self).training_step(model, inputs, num_items_in_batch))))
            return out[0]

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = tf.TrainingArguments(
            output_dir=out, per_device_train_batch_size=b, gradient_accumulation_steps=k,
            max_steps=total, learning_rate=1e-3, save_strategy="no", report_to=[],
            use_cpu=True, disable_tqdm=True, dataloader_pin_memory=False,
            logging_steps=10_000)
        tr = Measured(model=model, args=args, train_dataset=data, callbacks=[Timer()],
                      privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0,
                                               sampling="fixed", seed=0))
        tr.train()
    timed = times[1:-1]
    return {"chunk": b, "k": k, "logical": b * k, "peak_mb": peaks[-1] / 2**20,
            "ms": 1e3 * statistics.median(timed), "steps": len(timed)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--ks", default="1,4,8")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    b = a.chunk
    rows = []
    for k in (int(x) for x in a.ks.split(",")):
        rows.append(measure(b, k, a.steps, a.width, a.layers, a.tokens))
        if k > 1:
            rows.append(measure(b * k, 1, a.steps, a.width, a.layers, a.tokens))
    one = next(r for r in rows if r["logical"] == b and r["k"] == 1)
    print(f"GPT-2 width {a.width}, {a.layers} layers, vocabulary 8000, {a.tokens} tokens; "
          f"torch {torch.__version__}, 1 thread")
    print("| logical batch | chunks x rows | peak MB | x one chunk's peak | ms/step | "
          "timed steps |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['logical']} | {r['k']} x {r['chunk']} | {r['peak_mb']:.2f} | "
              f"{r['peak_mb'] / one['peak_mb']:.2f} | {r['ms']:.0f} | {r['steps']} |")


if __name__ == "__main__":
    main()
