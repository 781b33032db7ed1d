"""Cost of the batch-independence probe (privlearn.torch.probe) on the small Hugging Face
configurations of ``benchmarks/hf_engine.py``: the probe runs once, before the first
step (two forward passes without gradients), and never again.

For each model and round: a fresh ``make_private``, the first step with the probe timed
on its own, then ``--steps`` more steps; reported are the probe's time, the median
private step of the same round and their ratio (the target: the probe costs less than
one step), the time ``check_independence`` takes on the later steps, and the time of
the check every forward pass makes for changes that re-arm the probe (a fingerprint of
the module tree, training flags and hooks, compared with the last one; and the modules'
plain attributes, read before and after the forward: ``privlearn.torch._rearm``). Usage::

    python benchmarks/probe_cost.py --threads 1 --rounds 3
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's privlearn
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_engine import build, make_batch, model_parser  # noqa: E402


def one_round(name: str, steps: int, batch: int, seq: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import privlearn.torch.probe as probe_mod
    from privlearn.torch import make_private, retain_freed_memory

    model = build(name)
    ids, mask, y, loss = make_batch(name, batch, seq)

    def loss_fn(out):
        return loss(out, ids, mask, y)

    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    loader = DataLoader(TensorDataset(ids), batch_size=batch)  # rate 1: one batch a step
    retain_freed_memory()  # the opt-in CPU allocator setting
    p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    spent = []
    original = probe_mod.probe

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent.append(time.perf_counter() - t0)

    probe_mod.probe = timed
    check = p.optimizer.tracker.check_independence
    later = []
    try:
        times = []
        for k in range(steps + 1):
            next(iter(p.data_loader))
            t0 = time.perf_counter()
            p.optimizer.zero_grad()
            loss_fn(p.model(input_ids=ids, attention_mask=mask)).backward()
            if k:
                c0 = time.perf_counter()
                check(batch)  # what the step calls: nothing pending after the first
                later.append(time.perf_counter() - c0)
            p.optimizer.step()
            times.append(time.perf_counter() - t0)
    finally:
        probe_mod.probe = original
    assert len(spent) == 1, spent  # once, on the first step
    from privlearn.torch import _rearm
    from privlearn.torch._tracker_util import mixing_fingerprint

    tracker = p.optimizer.tracker
    attributes = _rearm._state(tracker)[0]
    model, rearm, attrs = tracker.model, [], []
    for _ in range(200):  # what each forward adds: the fingerprint and its comparison
        t0 = time.perf_counter()
        assert mixing_fingerprint(model) == tracker._mixing_shape
        rearm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # and the module attributes, before and after it
        assert not attributes.changed(model, tracker._mixing_shape, True)
        attributes.forward_pre(model, tracker._mixing_shape)
        attributes.forward_post(model, tracker._mixing_shape)
        attrs.append(time.perf_counter() - t0)
    return {"probe": spent[0], "first": times[0], "step": statistics.median(times[1:]),
            "later": statistics.median(later), "rearm": statistics.median(rearm),
            "attrs": statistics.median(attrs), "modules": sum(1 for _ in model.modules())}


def main() -> None:
    import torch

    a = model_parser(steps=6, rounds=3).parse_args()
    torch.set_num_threads(a.threads)
    print("| model | probe (ms) | private step (ms) | probe / step | check on later steps (us) "
          "| re-arm check per forward (us) | attribute check per forward (us) | modules |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        rs = [one_round(name, a.steps, a.batch, a.seq) for _ in range(a.rounds)]
        probe = statistics.median(r["probe"] for r in rs)
        step = statistics.median(r["step"] for r in rs)
        ratios = [r["probe"] / r["step"] for r in rs]
        later = statistics.median(r["later"] for r in rs)
        rearm = statistics.median(r["rearm"] for r in rs)
        attrs = statistics.median(r["attrs"] for r in rs)
        print(f"| {name} | {probe * 1e3:.1f} | {step * 1e3:.1f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{later * 1e6:.1f} | {rearm * 1e6:.1f} | {attrs * 1e6:.1f} | "
              f"{rs[0]['modules']} |", flush=True)


if __name__ == "__main__":
    main()
