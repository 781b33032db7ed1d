"""Peak memory a private step adds, against a non-private step of the same model.

The figure is the peak of live tensor memory during one step (``zero_grad``, forward,
loss, backward, ``optimizer.step()``) over the memory live just before it: on the CPU
the allocator events of ``torch.profiler`` (``profile_memory=True``; the analogue of
CUDA's ``max_memory_allocated() - memory_allocated()``), on CUDA the allocator's own
counters. Fixed-size batches (``sampling="fixed"`` for the private run), measured on
the second step (the first probes batch independence and allocates the optimizer's
buffers). Every model is config-initialised (no download), dropout off.

Usage::

    python benchmarks/step_memory.py [--models gpt2,bert,llama,gpt2-lora]
                                     [--device cpu] [--dtype fp32|bf16] [--json FILE]
                                     [--device-masking]

Models: ``gpt2`` GPT-2 small (``GPT2Config()``, tied embeddings) on 4 x 256 tokens;
``bert`` BERT-base (``BertConfig()``), sequence classification, 8 x 128; ``llama`` a
~150M Llama (width 768, 12 layers, 12 query / 4 key-value heads, MLP 3072, vocabulary
32000) on 4 x 256; ``gpt2-lora`` GPT-2 small with LoRA rank 16 on ``c_attn``, 4 x 256.

``--device-masking``: the non-finite examples are found and masked on the device as on
an accelerator (``ClippingMixin._find_nonfinite``'s device branch: nothing read back, the
rows cleaned in every layer), where the CPU reads one flag back and cleans nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn

SHAPES = {"gpt2": (4, 256), "bert": (8, 128), "llama": (4, 256), "gpt2-lora": (4, 256)}


def build(name: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if name in ("gpt2", "gpt2-lora"):
        model = tf.GPT2LMHeadModel(tf.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0,
                                                 attn_pdrop=0.0))
        if name == "gpt2-lora":
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(
                r=16, lora_alpha=32, target_modules=["c_attn"], fan_in_fan_out=True,
                lora_dropout=0.0))
    elif name == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2))
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
            tie_word_embeddings=False))
    else:
        raise KeyError(name)
    model.train()
    return model


def _peak_cpu(fn) -> int:
    """Peak of live CPU tensor bytes during ``fn()`` over those live before it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    evs = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
           if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    evs.sort()
    live = peak = 0
    for _, nbytes in evs:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(name: str, mode: str, device: str = "cpu", dtype: str = "fp32",
            options: dict | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    from privlearn.torch import make_private, per_sequence_cross_entropy

    model = build(name).to(device)
    b, t = SHAPES[name]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    n = 3 * b
    ids = torch.randint(0, vocab, (n, t), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g) if name == "bert" else ids.clone()
    data = torch.utils.data.TensorDataset(ids, labels)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=b)
    if mode != "non-private":
        p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                         sampling="fixed", seed=0, **(options or {}))
        model, opt, loader = p.model, p.optimizer, p.data_loader
    batches = iter(loader)
    bf16 = dtype == "bf16"

    def step(xb, yb):
        opt.zero_grad()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=xb).logits
            if name == "bert":
                loss = F.cross_entropy(logits.float(), yb)
            else:
                loss = per_sequence_cross_entropy(logits, yb, shift=True)
        loss.backward()
        opt.step()

    xb, yb = (v.to(device) for v in next(batches))
    step(xb, yb)  # the first step: probe, optimizer state
    xb, yb = (v.to(device) for v in next(batches))
    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(xb, yb)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _peak_cpu(lambda: step(xb, yb))
    return {"model": name, "mode": mode, "dtype": dtype, "batch": b, "seq": t,
            "peak_added_mb": peak / 2**20, "seconds": time.perf_counter() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,bert,llama,gpt2-lora")
    ap.add_argument("--modes", default="non-private,privlearn")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="append one line per result")
    ap.add_argument("--device-masking", action="store_true",
                    help="non-finite examples masked on the device, as on an accelerator")
    args = ap.parse_args(argv)
    import torch

    if args.device_masking:
        from privlearn.torch import clipping
        from privlearn.torch._tracker_util import _nonfinite

        clipping.ClippingMixin._find_nonfinite = (
            lambda self, sq, masked, refuse, scaled: _nonfinite(sq, masked))

    torch.set_num_threads(args.threads)
    rows = {}
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            r = measure(name, mode, args.device, args.dtype)
            rows[(name, mode)] = r
            print(json.dumps(r), flush=True)
            if args.json is not None:
                with args.json.open("a") as f:
                    f.write(json.dumps(r) + "\n")
        base = rows.get((name, "non-private"))
        if base is not None:
            for mode in args.modes.split(","):
                if mode != "non-private" and (name, mode) in rows:
                    ratio = rows[(name, mode)]["peak_added_mb"] / base["peak_added_mb"]
                    print(f"{name} {mode}: {ratio:.2f}x non-private", flush=True)


if __name__ == "__main__":
    main()
