"""Time to draw Gaussian noise into a flat float32 tensor: default vs secure mode.

Usage::

    python benchmarks/noise.py [--sizes 1e6,1e7,1.24e8] [--repeats 5] [--device cpu]
                               [--threads 2] [--legacy-max 1e7] [--tensor-max 1e7]
    python benchmarks/noise.py --stages [--sizes 1.24e8] [--repeats 3] [--threads 1]
    python benchmarks/noise.py --launches [--parameters 124439808]

Modes, each filling a preallocated tensor of ``size`` float32 elements on ``--device`` with
``N(0, 1)`` draws (:meth:`privlearn.torch.NoiseSource.fill_normal_`):

* ``torch-normal_``: ``out.normal_(0, 1, generator=g)`` called directly, the baseline of
  ``default``;
* ``default``: the device's ``torch.Generator`` through ``fill_normal_`` (the same call
  after argument checks);
* ``secure``: ChaCha20 + Holohan-Braghin with the device's preferred cipher backend
  (OpenSSL through ``cryptography`` on the CPU when installed, tensor ChaCha20 otherwise);
* ``secure-numpy`` (CPU only): the same stream from the NumPy ChaCha20, the CPU's path when
  ``cryptography`` is absent;
* ``secure-tensor`` (CPU only): the same stream from the tensor ChaCha20 (the accelerators'
  cipher, here on the CPU; the transform stays in NumPy); sizes up to ``--tensor-max``
  only;
* ``legacy-secure``: the previous implementation, NumPy Box-Muller on ``os.urandom`` bytes,
  four float64 arrays of the full size, for comparison; sizes up to ``--legacy-max`` only.

Every (mode, size) pair runs once per round, ``--repeats`` interleaved rounds (all pairs,
then all pairs again), so that the load of a shared machine, which changes over minutes,
biases no mode in particular; the table gives each pair's median and its fastest round.
One untimed warm-up draw per pair first. On CUDA the timings synchronise the device.
On Linux CPU runs, the table also gives the largest peak of resident memory a draw added
(``VmHWM`` after the draw minus ``VmRSS`` before it, the peak reset through
``/proc/self/clear_refs``): the scratch memory beyond the preallocated output, a lower
bound (memory the process freed earlier and still holds is reused without counting). On
CUDA, the peak of ``torch.cuda.max_memory_allocated`` above the memory allocated before
the draw.

``--stages`` times the CPU's secure draw by stage instead (the real code path, its two
stages wrapped with ``time.perf_counter``): the keystream (OpenSSL ChaCha20 into the
preallocated uniforms, with their shift to 53 bits), the Holohan-Braghin transform
(uniforms to normals, float64), and the rest (scaling, the rounding copy into the output,
the chunk loop), wall-clock, and the process's CPU time for the whole draw (with one
thread, the draw's own work: on a shared machine, less sensitive to the other jobs than the
wall clock). ``--launches`` counts the tensor operations (aten calls, views aside) of
the accelerators' secure path, run on the CPU with the chunk size scaled down (a chunk is
the same operations whatever its size), and gives the chunks and operations of a draw of
``--parameters`` elements on an accelerator with the default scratch budget, and the
operations of one ``add_normal_foreach_`` over GPT-2 small's 148 parameter tensors (sizes
scaled down 2**12-fold) against one ``add_normal_`` per tensor.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from privlearn.torch import _chacha  # noqa: E402
from privlearn.torch.noise import NoiseSource  # noqa: E402


def _legacy_secure(out: torch.Tensor) -> None:
    """The secure mode this module replaced (NumPy, ``os.urandom``, full-size arrays)."""
    n = out.numel()
    z = np.zeros(n)
    for _ in range(4):
        m = (n + 1) // 2
        bits = np.frombuffer(os.urandom(16 * m), dtype=np.uint64).reshape(2, m)
        bits = bits >> np.uint64(11)
        u1 = (bits[0].astype(np.float64) + 1.0) * 2.0**-53
        u2 = bits[1].astype(np.float64) * 2.0**-53
        r = np.sqrt(-2.0 * np.log(u1))
        z += np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])[:n]
    out.copy_(torch.from_numpy(z * 0.5).view(out.shape))


class _OnlyBackend:
    """Context manager: the ChaCha20 backend ``name`` is the only one while inside."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.saved = dict(_chacha.BACKENDS)
        for other in [n for n in _chacha.BACKENDS if n != self.name]:
            del _chacha.BACKENDS[other]

    def __exit__(self, *exc):
        _chacha.BACKENDS.clear()
        _chacha.BACKENDS.update(self.saved)


def _runner(mode: str, device: torch.device):
    if mode == "torch-normal_":
        g = torch.Generator(device=device).manual_seed(0)
        return lambda out: out.normal_(0.0, 1.0, generator=g)
    if mode == "default":
        src = NoiseSource(seed=0)
        return lambda out: src.fill_normal_(out, 1.0)
    if mode == "secure":
        src = NoiseSource(secure_mode=True)
        return lambda out: src.fill_normal_(out, 1.0)
    if mode in ("secure-numpy", "secure-tensor"):
        with _OnlyBackend(mode.split("-")[1]):
            src = NoiseSource(secure_mode=True)
            src.fill_normal_(torch.empty(2, device=device), 1.0)  # binds the backend
        return lambda out: src.fill_normal_(out, 1.0)
    if mode == "legacy-secure":
        return _legacy_secure
    raise ValueError(mode)


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _time(fn, out: torch.Tensor) -> tuple[float, float | None]:
    """(seconds, peak extra memory in MB or None)."""
    cuda = out.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(out.device)
        torch.cuda.reset_peak_memory_stats(out.device)
        base = torch.cuda.memory_allocated(out.device)
    else:
        base = _rss_kib("VmRSS") if _reset_peak_rss() else None
    t0 = time.perf_counter()
    fn(out)
    if cuda:
        torch.cuda.synchronize(out.device)
    dt = time.perf_counter() - t0
    if cuda:
        extra = (torch.cuda.max_memory_allocated(out.device) - base) / 2**20
    else:
        peak = _rss_kib("VmHWM")
        extra = None if base is None or peak is None else max(0, peak - base) / 1024
    return dt, extra


def _stages(sizes: list[int], repeats: int) -> None:
    """Per-stage times of the CPU's secure draw (see the module docstring)."""
    from privlearn.torch import noise as noise_mod

    spent = {"keystream": 0.0, "transform": 0.0}

    def timed(fn, stage):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[stage] += time.perf_counter() - t0
        return wrapper

    saved = (_chacha.uniform_bits53, noise_mod._holohan_braghin_numpy)
    _chacha.uniform_bits53 = timed(saved[0], "keystream")
    noise_mod._holohan_braghin_numpy = timed(saved[1], "transform")
    try:
        src = NoiseSource(secure_mode=True)
        backend = None
        print("| size | round | keystream (s) | transform (s) | rest (s) | total (s) "
              "| process CPU time (s) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in sizes:
            out = torch.zeros(n, dtype=torch.float32)
            src.fill_normal_(out[: min(n, 1 << 20)], 1.0)
            backend = src._streams["cpu"].backend.name
            for r in range(repeats):
                spent.update(keystream=0.0, transform=0.0)
                c0, t0 = time.process_time(), time.perf_counter()
                src.fill_normal_(out, 1.0)
                total, cpu = time.perf_counter() - t0, time.process_time() - c0
                rest = total - spent["keystream"] - spent["transform"]
                print(f"| {n:,} | {r + 1} | {spent['keystream']:.3f} | "
                      f"{spent['transform']:.3f} | {rest:.3f} | {total:.3f} | {cpu:.3f} |")
        print(f"\nbackend {backend}, {torch.get_num_threads()} torch threads, load average "
              f"at the end {os.getloadavg()[0]:.2f}")
    finally:
        _chacha.uniform_bits53, noise_mod._holohan_braghin_numpy = saved


def _launches(parameters: int) -> None:
    """Tensor operations of the accelerators' secure path (see the module docstring)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from privlearn.torch import noise as noise_mod

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    n = 1 << 15
    saved = (dict(_chacha.BACKENDS), dict(noise_mod._CHUNK_WORKERS),
             dict(_chacha.TENSOR_RUN_BLOCKS), dict(noise_mod.SECURE_CHUNK_ELEMENTS),
             dict(noise_mod.SECURE_SCRATCH_BYTES))
    try:
        for name in [k for k in _chacha.BACKENDS if k != "tensor"]:
            del _chacha.BACKENDS[name]
        noise_mod._CHUNK_WORKERS.pop("cpu", None)
        _chacha.TENSOR_RUN_BLOCKS.pop("cpu", None)
        noise_mod.SECURE_CHUNK_ELEMENTS.pop("cpu", None)
        rows, foreach = [], []
        for chunks in (1, 2):
            noise_mod.SECURE_SCRATCH_BYTES["cpu"] = \
                noise_mod.SECURE_BYTES_PER_ELEMENT * (n // chunks)
            for dtype in (torch.float32, torch.bfloat16):
                src = NoiseSource(secure_mode=True)
                src.fill_normal_(torch.empty(4, dtype=dtype), 1.0)
                out = torch.empty(n, dtype=dtype)
                with Count() as c:
                    src.fill_normal_(out, 1.0)
                got = -(-n // noise_mod._secure_chunk(torch.device("cpu"), n, dtype))
                rows.append((chunks if dtype == torch.float32 else got, dtype, c.ops))
        # GPT-2 small's 148 parameter tensors, scaled down 2**12-fold, one secure add for
        # all (add_normal_foreach_) against one add_normal_ per tensor, two chunks
        sizes = [max(1, k >> 12) for k in [38597376, 786432] + [
            768, 768, 1769472, 2304, 589824, 768, 768, 768, 2359296, 3072, 2359296, 768]
            * 12 + [768, 768]]
        total = sum(sizes)
        for dtype in (torch.float32, torch.bfloat16):
            half = dtype == torch.bfloat16
            noise_mod.SECURE_SCRATCH_BYTES["cpu"] = (
                noise_mod.SECURE_BYTES_PER_ELEMENT
                + (noise_mod._HALF_ROUNDING_BYTES if half else 0)) * (total // 2 + 1)
            src = NoiseSource(secure_mode=True)
            grads = [torch.zeros(k, dtype=dtype) for k in sizes]
            src.add_normal_(grads[0][:4], 1.0)
            with Count() as many:
                src.add_normal_foreach_(grads, 1.0)
            with Count() as each:
                for g in grads:
                    src.add_normal_(g, 1.0)
            foreach.append((dtype, len(sizes), many.ops, each.ops))
    finally:
        for target, old in zip((_chacha.BACKENDS, noise_mod._CHUNK_WORKERS,
                                _chacha.TENSOR_RUN_BLOCKS, noise_mod.SECURE_CHUNK_ELEMENTS,
                                noise_mod.SECURE_SCRATCH_BYTES), saved, strict=True):
            target.clear()
            target.update(old)
    print("| chunks | dtype | tensor operations of the draw |")
    print("|---:|---|---:|")
    for chunks, dtype, ops in rows:
        print(f"| {chunks} | {dtype} | {ops} |")
    budget = noise_mod._DEFAULT_SECURE_SCRATCH
    most = budget // noise_mod.SECURE_BYTES_PER_ELEMENT
    chunks = -(-parameters // most)
    chunk = -(-parameters // chunks)
    per_chunk = rows[2][2] - rows[0][2]
    print(f"\n{parameters:,} float32 elements with the default {budget / 2**30:.0f} GiB "
          f"budget: {chunks} chunk(s) of {chunk:,} elements, "
          f"{chunk * noise_mod.SECURE_BYTES_PER_ELEMENT / 1e9:.1f} GB of scratch, about "
          f"{rows[0][2] + (chunks - 1) * per_chunk} tensor operations "
          f"({per_chunk} a chunk).")
    print("\n| dtype | tensors | add_normal_foreach_ (2 chunks) | add_normal_ per tensor |")
    print("|---|---:|---:|---:|")
    for dtype, k, many, each in foreach:
        print(f"| {dtype} | {k} | {many} | {each} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7,1.24e8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's own choice)")
    ap.add_argument("--legacy-max", type=float, default=1e7)
    ap.add_argument("--tensor-max", type=float, default=1e7)
    ap.add_argument("--modes",
                    default="torch-normal_,default,secure,secure-numpy,secure-tensor,"
                            "legacy-secure")
    ap.add_argument("--stages", action="store_true",
                    help="time the CPU's secure draw by stage")
    ap.add_argument("--launches", action="store_true",
                    help="count the accelerators' secure path's tensor operations")
    ap.add_argument("--parameters", type=int, default=124_439_808,
                    help="with --launches: the draw to size (default GPT-2 small)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.launches:
        _launches(args.parameters)
        return
    if args.stages:
        _stages([int(float(s)) for s in args.sizes.split(",")], args.repeats)
        return
    device = torch.device(args.device)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    limits = {"legacy-secure": args.legacy_max, "secure-tensor": args.tensor_max}
    if device.type != "cpu":
        modes = [m for m in modes
                 if m not in ("secure-numpy", "secure-tensor", "legacy-secure")]
    pairs = [(m, n) for n in sizes for m in modes if n <= limits.get(m, math.inf)]
    # outputs allocated and touched once: a draw's memory peak is then its own scratch
    outs = {n: torch.zeros(n, dtype=torch.float32, device=device) for n in sizes}
    runners = {m: _runner(m, device) for m in modes}
    times: dict[tuple[str, int], list[float]] = {p: [] for p in pairs}
    extra: dict[tuple[str, int], list[float]] = {p: [] for p in pairs}
    for m, n in pairs:  # warm-up
        runners[m](outs[n][: min(n, 1 << 20)])
    for r in range(args.repeats):
        for m, n in pairs:
            dt, mb = _time(runners[m], outs[n])
            times[(m, n)].append(dt)
            if mb is not None:
                extra[(m, n)].append(mb)
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine())
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(f"\nNoise generation, float32 output, device {device} ({dev_name}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average at the end {load[0]:.2f}; "
          f"{args.repeats} interleaved rounds.\n")
    print("| mode | size | median (s) | fastest (s) | ns / element (median) "
          "| peak extra memory (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, n in sorted(pairs, key=lambda p: (p[1], modes.index(p[0]))):
        ts = times[(m, n)]
        med = statistics.median(ts)
        mem = f"{max(extra[(m, n)]):.0f}" if extra[(m, n)] else "n/a"
        print(f"| {m} | {n:,} | {med:.3f} | {min(ts):.3f} | {med / n * 1e9:.1f} | {mem} |")


if __name__ == "__main__":
    main()
