"""make_private under torch.compile (default backend, inductor) against the eager run:
steps, compilation, recompiles and whether the parameters after the run (clipping and
noise included) are the eager ones.

Each (model, mode) runs in its own subprocess (fresh compile caches); the modes are
``eager``, ``before`` (``model = torch.compile(model)`` given to make_private), ``after``
(``torch.compile(p.model)`` used in the loop) and ``step`` (``torch.compile`` of the
step function: zero_grad, forward, loss, backward, DP step). Models: ``mlp`` (10-32-32-2,
Poisson batches of expected size 32 of 512) and ``gpt2`` (``GPT2Config(n_layer=2,
n_embd=64, n_head=2, vocab_size=500)``, dropout 0, sequences of 16 tokens, Poisson
batches of expected size 32 of 256, per-sequence cross-entropy). Step times are CPU time
of the process (``time.process_time``, one thread): a loaded machine slows them less
than wall time. Usage::

    python benchmarks/compile_engine.py --models mlp,gpt2 --steps 16
    python benchmarks/compile_engine.py --models gpt2 --modes eager,after --dynamic
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's privlearn


def build(name: str):
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)
        )
        x = torch.randn(512, 10)
        data = TensorDataset(x, (x[:, 0] > 0).long())

        def loss(net, xb, yb):
            return nn.functional.cross_entropy(net(xb), yb)

        return model, data, loss
    from transformers import GPT2Config, GPT2LMHeadModel

    from privlearn.torch import per_sequence_cross_entropy

    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 500, (256, 16))

    def loss(net, xb, yb):
        return per_sequence_cross_entropy(net(input_ids=xb).logits, yb, shift=True)

    return model, TensorDataset(ids, ids.clone()), loss


def run_one(name: str, mode: str, steps: int, out: str, dynamic: bool | None = None) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from privlearn.torch import make_private

    torch.set_num_threads(1)
    limits = []

    class _Limit(logging.Handler):
        def emit(self, record):
            if "recompile_limit" in record.getMessage():
                limits.append(record.getMessage().splitlines()[1].strip())

    logging.getLogger("torch._dynamo").addHandler(_Limit())
    model, data, loss_of = build(name)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if mode == "before":
        model = torch.compile(model, dynamic=dynamic)
    p = make_private(model, optimizer, DataLoader(data, batch_size=32),
                     noise_multiplier=1.0, max_grad_norm=1.0, seed=0)  # fmt: skip
    net = torch.compile(p.model, dynamic=dynamic) if mode == "after" else p.model

    def step(xb, yb):
        p.optimizer.zero_grad()
        loss_of(net, xb, yb).backward()
        p.optimizer.step()

    if mode == "step":
        step = torch.compile(step, dynamic=dynamic)
    times, frames = [], []
    batches = iter(p.data_loader)
    while len(times) < steps:
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(p.data_loader)
            continue
        t = time.process_time()
        step(xb, yb)
        times.append(time.process_time() - t)
        frames.append(counters["frames"]["total"])
    params = torch.cat([q.detach().reshape(-1) for q in p.model.parameters()])
    torch.save(params, out)
    half = steps // 2
    return dict(
        model=name, mode=mode, dynamic=dynamic, first_s=round(times[0], 2),
        step_ms=round(1e3 * statistics.median(times[half:]), 2),
        frames=frames[-1], frames_second_half=frames[-1] - frames[half - 1],
        graph_breaks=sum(counters["graph_break"].values()), limit_hits=limits,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt2")
    ap.add_argument("--modes", default="eager,before,after,step")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True)")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "MODE", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(*a.one[:2], a.steps, a.one[2], True if a.dynamic else None)))
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            ref = None
            for mode in a.modes.split(","):
                out = str(Path(tmp) / f"{name}_{mode}.pt")
                cmd = [sys.executable, __file__, "--steps", str(a.steps), "--one", name, mode, out]
                cmd += ["--dynamic"] if a.dynamic else []
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if res.returncode != 0:
                    print(json.dumps(dict(model=name, mode=mode, error=res.stderr[-600:])))
                    continue
                row = json.loads(res.stdout.strip().splitlines()[-1])
                params = torch.load(out)
                if mode == "eager":
                    ref = params
                elif ref is not None:
                    row["max_abs_diff_vs_eager"] = float((params - ref).abs().max())
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
