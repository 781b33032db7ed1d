"""Communication per training step: non-private vs private DDP and FSDP2.

Two CPU processes (gloo) train a stack of ``--layers`` Linear(``--width``, ``--width``)
layers for a few steps (the private run with fixed-size batches, as the non-private one);
every collective of the last step (a steady-state step: the batch-independence probe runs
at the first step and at batch sizes not seen before) is counted with the bytes each rank
sends into it:

* FSDP2 and privlearn call ``torch.distributed``'s Python collectives
  (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``, ...), which are
  wrapped with a counter;
* DDP's reducer buckets the gradients in C++; a communication hook
  (``register_comm_hook``) that all-reduces each bucket as the default does counts them.

Run::

    python benchmarks/distributed_comm.py --width 512 --layers 4

and the table (markdown) is printed by rank 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter_single", "reduce_scatter_tensor", "all_gather",
               "reduce_scatter", "broadcast")


class Meter:
    """Counts calls and bytes of the wrapped collectives while ``on``."""

    def __init__(self):
        self.on = False
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.original = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.original[name] = fn
                setattr(dist, name, self._wrap(fn, name))

    def reset(self):
        self.calls, self.bytes = Counter(), Counter()

    def _wrap(self, fn, name):
        def wrapped(*args, **kwargs):
            if self.on:
                t = kwargs.get("input", kwargs.get("tensor"))
                if t is None:
                    t = args[0] if name in ("all_reduce", "broadcast") or len(args) < 2 \
                        else args[1]
                if isinstance(t, torch.Tensor):
                    self.calls[name] += 1
                    self.bytes[name] += t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return wrapped

    def ddp_hook(self, state, bucket):
        buf = bucket.buffer()
        if self.on:
            self.calls["all_reduce (DDP bucket)"] += 1
            self.bytes["all_reduce (DDP bucket)"] += buf.numel() * buf.element_size()
        world = dist.get_world_size()
        work = self.original["all_reduce"](buf.div_(world), async_op=True)
        return work.get_future().then(lambda f: f.value()[0])


def _model(width, layers):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers)])


def _run(rank, world, cfg, args, meter):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    wrapper, private = cfg
    model = _model(args.width, args.layers)
    n = 64 * world * args.batch
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, args.width, generator=g),
                                        torch.randn(n, args.width, generator=g))
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        if not private:
            model.register_comm_hook(None, meter.ddp_hook)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if private:
        from privlearn.torch import make_private

        p = make_private(model, opt, torch.utils.data.DataLoader(ds, batch_size=args.batch),
                         noise_multiplier=1.0, max_grad_norm=1.0, seed=3,
                         sampling="fixed")
        model, opt, loader = p.model, p.optimizer, p.data_loader
    else:
        sampler = torch.utils.data.DistributedSampler(ds, world, rank, shuffle=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch, sampler=sampler)
    it = iter(loader)
    times = []
    for step in range(args.steps + 1):
        x, y = next(it)
        meter.on = step == args.steps  # the last: past the probed first step
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        meter.on = False
    params = sum(q.numel() for q in model.parameters())
    return params, sorted(times[1:])[len(times[1:]) // 2]


def _worker(rank, world, port, args, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    meter = Meter()
    try:
        for cfg in (("ddp", False), ("ddp", True), ("fsdp", False), ("fsdp", True)):
            meter.reset()
            params, t = _run(rank, world, cfg, args, meter)
            rows.append((cfg, params, dict(meter.calls), dict(meter.bytes), t))
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.world, port, args, out), nprocs=args.world,
                       join=True, start_method="spawn")
    rows = out.get()
    print(f"{args.world} processes (gloo, CPU), {args.layers} x Linear({args.width}, "
          f"{args.width}), per-rank batch {args.batch}; one steady-state step, per rank\n")
    print("| wrapper | training | parameters | collectives (calls) | MiB sent | "
          "step (ms, median) |")
    print("|---|---|---|---|---|---|")
    for (wrapper, private), params, calls, nbytes, t in rows:
        what = ", ".join(f"{k} x{v}" for k, v in sorted(calls.items()))
        mib = sum(nbytes.values()) / 2**20
        print(f"| {'DDP' if wrapper == 'ddp' else 'FSDP2'} | "
              f"{'private' if private else 'non-private'} | {params:,} | {what} | "
              f"{mib:.2f} | {1000 * t:.1f} |")


if __name__ == "__main__":
    main()
