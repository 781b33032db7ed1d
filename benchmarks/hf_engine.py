"""Step time and peak memory of the DP engine on small Hugging Face configs against
non-private training of the same model, in one run (issue 11).

Each (model, mode) runs in its own subprocess so that peak memory (``ru_maxrss``) is
its own; rounds are interleaved (non-private, private, non-private, ...) and the step
time is the median over steps of all rounds. Usage::

    python benchmarks/hf_engine.py --threads 1 --steps 10 --rounds 3
    python benchmarks/hf_engine.py --interleaved --threads 1 --steps 20

The second form times both modes in one process, alternating step by step (the order
rotated every round: ``torch_hf.interleave``), so that a loaded machine slows both alike
(no memory figures).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn
from torch_hf import interleave  # noqa: E402  (benchmarks/, this script's folder)


def build(name: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    v = 8000
    if name in ("gpt2", "gpt2_untied", "gpt2_lora"):
        cfg = tf.GPT2Config(vocab_size=v, n_positions=128, n_embd=128, n_layer=2, n_head=4,
                            tie_word_embeddings=name != "gpt2_untied", bos_token_id=0,
                            eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
        if name == "gpt2_lora":
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(
                r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))
    elif name == "bert":
        cfg = tf.BertConfig(vocab_size=v, hidden_size=128, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=512,
                            max_position_embeddings=128, num_labels=2)
        model = tf.BertForSequenceClassification(cfg)
    elif name == "llama":
        cfg = tf.LlamaConfig(vocab_size=v, hidden_size=128, intermediate_size=344,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise KeyError(name)
    model.train()
    return model


def make_batch(name: str, n: int, seq: int):
    """``n`` sequences of ``seq`` token ids (every other one padded from ``seq // 2``),
    their attention mask and a class label each (for BERT); and the task's loss of a
    forward's output on them, ``loss(out, ids, mask, y)``."""
    import torch

    from privlearn.torch import per_sequence_cross_entropy

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 8000, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[::2, seq // 2:] = 0
    y = torch.randint(0, 2, (n,), generator=g)

    def loss(out, ids_b, mask_b, y_b):
        if name == "bert":
            return torch.nn.functional.cross_entropy(out.logits, y_b)
        return per_sequence_cross_entropy(out.logits, ids_b.masked_fill(mask_b == 0, -100),
                                          shift=True)

    return ids, mask, y, loss


def worker(name: str, mode: str, steps: int, threads: int, batch: int, seq: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private, retain_freed_memory

    torch.set_num_threads(threads)
    model = build(name)
    ids, mask, y, loss_fn = make_batch(name, batch * 4, seq)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    if mode == "private":
        loader = DataLoader(TensorDataset(ids, mask, y), batch_size=batch)
        retain_freed_memory()  # the opt-in CPU allocator setting (privlearn.torch)
        p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
        it = iter(p.data_loader)
        fixed = (ids[:batch], mask[:batch], y[:batch])
        for _ in range(steps):
            next(it, None)  # a batch drawn from the private loader (accounted) ...
            ib, mb, yb = fixed  # ... but a fixed size, for comparable timings
            t0 = time.perf_counter()
            p.optimizer.zero_grad()
            loss_fn(p.model(input_ids=ib, attention_mask=mb), ib, mb, yb).backward()
            p.optimizer.step()
            times.append(time.perf_counter() - t0)
            if len(times) % 4 == 0:
                it = iter(p.data_loader)
    else:
        ib, mb, yb = ids[:batch], mask[:batch], y[:batch]
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(input_ids=ib, attention_mask=mb), ib, mb, yb).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"times": times[1:], "added_mb": (peak - base) / 1024}


def interleaved(name: str, steps: int, threads: int, batch: int, seq: int) -> dict:
    """Step times of non-private and private training of two copies of the model in one
    process, alternating step by step (both see the same machine load)."""
    import copy

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private, retain_freed_memory

    torch.set_num_threads(threads)
    base = build(name)
    priv = copy.deepcopy(base)
    ids, mask, y, loss = make_batch(name, batch, seq)

    def loss_fn(out):
        return loss(out, ids, mask, y)

    opt_n = torch.optim.SGD([q for q in base.parameters() if q.requires_grad], lr=1e-3)
    opt_p = torch.optim.SGD([q for q in priv.parameters() if q.requires_grad], lr=1e-3)
    loader = DataLoader(TensorDataset(ids), batch_size=batch)  # rate 1: one batch a step
    retain_freed_memory()  # the opt-in CPU allocator setting (privlearn.torch)
    p = make_private(priv, opt_p, loader, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)

    def nonprivate():
        opt_n.zero_grad()
        loss_fn(base(input_ids=ids, attention_mask=mask)).backward()
        opt_n.step()

    def private():
        p.optimizer.zero_grad()
        loss_fn(p.model(input_ids=ids, attention_mask=mask)).backward()
        p.optimizer.step()

    # the private step consumes a batch of its sampler, untimed; the first round warms up
    times = interleave({"nonprivate": nonprivate, "private": private}, steps, warmup=1,
                       untimed={"private": lambda: next(iter(p.data_loader))})
    tn, tp = times["nonprivate"], times["private"]
    return {"nonprivate": tn, "private": tp}


def model_parser(*, steps: int, rounds: int) -> argparse.ArgumentParser:
    """The options of the scripts that time :func:`build`'s models: which models, threads,
    steps per round, rounds, batch size and sequence length."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,gpt2_untied,bert,llama,gpt2_lora")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    return ap


def main() -> None:
    ap = model_parser(steps=8, rounds=2)
    ap.add_argument("--worker", nargs=2)
    ap.add_argument("--interleaved", action="store_true",
                    help="time both modes in one process, alternating steps (no memory)")
    a = ap.parse_args()
    if a.interleaved:
        for name in a.models.split(","):
            r = interleaved(name, a.steps, a.threads, a.batch, a.seq)
            tn, tp = statistics.median(r["nonprivate"]), statistics.median(r["private"])
            ratios = [q / n for n, q in zip(r["nonprivate"], r["private"], strict=True)]
            print(f"{name:12s} nonprivate {tn * 1e3:8.1f} ms  private {tp * 1e3:8.1f} ms  "
                  f"ratio of medians {tp / tn:5.2f}  median of step ratios "
                  f"{statistics.median(ratios):5.2f}", flush=True)
        return
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], a.steps, a.threads, a.batch, a.seq)))
        return
    rows = []
    for name in a.models.split(","):
        res = {"nonprivate": [], "private": []}
        mem = {"nonprivate": [], "private": []}
        for _ in range(a.rounds):
            for mode in ("nonprivate", "private"):
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", name, mode, "--steps", str(a.steps),
                     "--threads", str(a.threads), "--batch", str(a.batch), "--seq", str(a.seq)],
                    capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                res[mode] += r["times"]
                mem[mode].append(r["added_mb"])
        tn, tp = statistics.median(res["nonprivate"]), statistics.median(res["private"])
        mn, mp = max(mem["nonprivate"]), max(mem["private"])
        rows.append((name, tn * 1e3, tp * 1e3, tp / tn, mn, mp, mp / max(mn, 1e-9)))
        print(f"{name:12s} nonprivate {tn * 1e3:8.1f} ms  private {tp * 1e3:8.1f} ms  "
              f"ratio {tp / tn:5.2f}   peak added MB: nonprivate {mn:7.1f} private {mp:7.1f} "
              f"ratio {mp / max(mn, 1e-9):5.2f}", flush=True)


if __name__ == "__main__":
    main()
