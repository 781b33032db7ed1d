"""Operations dispatched by ``optimizer.step()``: the private step against plain SGD.

Every aten operation that reaches the dispatcher (a kernel launch on an accelerator,
views included) is counted by a ``torch.utils._python_dispatch.TorchDispatchMode`` during
one steady ``optimizer.step()`` (the second step: the first probes batch independence) of
the tiny config-initialised Hugging Face models of ``tests/torch/hf_models.py`` (batch
6 x 7, float32, CPU), next to a plain ``torch.optim.SGD`` step (torch's default
implementation, foreach) on the same model and batch. The backward passes are counted
too: the private one includes the tracker's hooks (the per-example norms computed during
``backward()``) and skips the non-private weight gradients.

Usage::

    python benchmarks/step_dispatch.py [--models gpt2,bert,llama,gpt2_lora] [--json FILE]
        [--dtype float32|bfloat16|float16] [--autocast bfloat16|float16] [--secure]
        [--sites N] [--ghost] [--half-matmul auto|never|always] [--cuda-products]
        [--device-masking]

``--dtype`` sets the parameters' dtype (the gradient buffers follow it); ``--autocast``
keeps float32 parameters and runs the forward passes under CPU autocast to that dtype
(the layers record half-precision inputs and output gradients). ``--sites N`` prints the
N call sites (file:line in privlearn) that dispatch most of the private step's operations.
``--ghost`` forces ghost norms in every layer (no materialised per-example gradients, as
on layers of realistic width); ``--half-matmul always`` keeps half-precision operands in
the outer-product rules as on an accelerator (``grad_sample.LOW_PRECISION_MATMUL``; the CPU
emulates the float32 accumulation by two casts a product that a GPU does not dispatch;
``--cuda-products`` counts each such product as the one operation CUDA dispatches, see
``tests/torch/cuda_dispatch.py``). ``--device-masking`` finds non-finite examples as on an
accelerator (a mask on the device, no flag read back).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's privlearn
sys.path.insert(0, str(ROOT / "tests" / "torch"))  # the tiny models

MODELS = ("gpt2", "bert", "llama", "gpt2_lora")


def _site() -> str:
    """The innermost frame of privlearn (else of torch.optim) on the stack."""
    import traceback

    optim = None
    for fr in reversed(traceback.extract_stack()):
        path = fr.filename.replace("\\", "/")
        if "/privlearn/" in path:
            return f"{path.split('/privlearn/')[-1]}:{fr.lineno} {fr.name}"
        if optim is None and "/torch/optim/" in path:
            optim = f"torch.optim {fr.name}"
    return optim or "?"


def _counter(sites: bool = False):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()
            self.sites = collections.Counter()  # (call site, operation)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            self.ops[name] += 1
            if sites:
                self.sites[(_site(), name)] += 1
            return func(*args, **(kwargs or {}))

    return Count


def _loss(name, model, ids, mask, labels):
    from hf_models import loss_of

    return loss_of(name, model(input_ids=ids, attention_mask=mask), labels)


def count(name: str, steps: int = 2, dtype: str = "float32", secure: bool = False,
          autocast: str | None = None, sites: bool = False) -> dict:
    """Dispatched operations of plain SGD's step and of the private step (and of the
    private backward pass's hooks) on the tiny ``name`` model, its parameters in
    ``dtype``, the forward passes under CPU autocast to ``autocast`` when given, the
    noise in secure mode when ``secure``; with ``sites``, the private step's operations
    by call site too."""
    import torch
    from hf_models import build
    from test_host_reads import _data
    from torch.utils.data import DataLoader

    from privlearn.torch import make_private

    Count = _counter(sites)
    cast = torch.autocast("cpu", dtype=getattr(torch, autocast or "bfloat16"),
                          enabled=autocast is not None)
    # plain SGD (foreach, torch's default) on the same model and batch
    model = build(name, dtype=getattr(torch, dtype))
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    ids, mask, labels = next(iter(DataLoader(_data(name, 6), batch_size=6)))
    with cast:
        loss = _loss(name, model, ids, mask, labels)
    plain_backward = Count()
    with plain_backward:
        loss.backward()
    sgd = Count()
    with sgd:
        opt.step()

    model = build(name, dtype=getattr(torch, dtype))
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    loader = DataLoader(_data(name, 6 * steps), batch_size=6)
    p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                     sampling="fixed", secure_mode=secure, seed=None if secure else 0)
    private, hooks = Count(), Count()
    for i, (ids, mask, labels) in enumerate(p.data_loader):
        steady = i == steps - 1
        p.optimizer.zero_grad()
        with cast:
            loss = _loss(name, p.model, ids, mask, labels)
        if steady:
            with hooks:
                loss.backward()
            with private:
                p.optimizer.step()
        else:
            loss.backward()
            p.optimizer.step()
    return {"model": name, "parameters": len(params),
            "sgd_step": sum(sgd.ops.values()), "private_step": sum(private.ops.values()),
            "ratio": round(sum(private.ops.values()) / max(1, sum(sgd.ops.values())), 2),
            "step_ops": dict(private.ops.most_common()),
            "step_sites": [[site, op, n] for (site, op), n in private.sites.most_common()],
            "backward_plain": sum(plain_backward.ops.values()),
            "backward_private": sum(hooks.ops.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=8, help="most frequent operations shown")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--autocast", default=None, choices=("bfloat16", "float16"),
                    help="float32 parameters, forward passes under CPU autocast")
    ap.add_argument("--secure", action="store_true", help="secure-mode noise")
    ap.add_argument("--ghost", action="store_true", help="ghost norms in every layer")
    ap.add_argument("--half-matmul", default="auto", choices=("auto", "never", "always"),
                    help="grad_sample.LOW_PRECISION_MATMUL")
    ap.add_argument("--cuda-products", action="store_true",
                    help="count each float32-accumulated half-precision product as one "
                         "operation, as CUDA dispatches it")
    ap.add_argument("--device-masking", action="store_true",
                    help="non-finite examples masked on the device, as on an accelerator")
    ap.add_argument("--sites", type=int, default=0,
                    help="call sites dispatching most of the private step shown")
    a = ap.parse_args(argv)
    import torch

    from privlearn.torch import grad_sample

    torch.set_num_threads(1)
    grad_sample.LOW_PRECISION_MATMUL = a.half_matmul
    if a.ghost:
        grad_sample.GHOST_MEMORY_BUDGET_BYTES = 0
    import contextlib

    from cuda_dispatch import cuda_products

    stand_in = (cuda_products(a.device_masking) if a.cuda_products or a.device_masking
                else contextlib.nullcontext())
    with stand_in:
        rows = [count(m, dtype=a.dtype, secure=a.secure, autocast=a.autocast,
                      sites=a.sites > 0) for m in a.models.split(",")]
    print(f"{'model':<10} {'params':>6} {'SGD step':>9} {'private step':>13} {'ratio':>6} "
          f"{'backward plain':>15} {'private':>8}")
    for r in rows:
        print(f"{r['model']:<10} {r['parameters']:>6} {r['sgd_step']:>9} "
              f"{r['private_step']:>13} {r['ratio']:>6} {r['backward_plain']:>15} "
              f"{r['backward_private']:>8}")
        top = list(r["step_ops"].items())[:a.top]
        print("    " + ", ".join(f"{k} {v}" for k, v in top))
        by_site = collections.Counter()
        for site, _op, n in r["step_sites"]:
            by_site[site] += n
        for site, n in by_site.most_common(a.sites):
            ops = ", ".join(f"{op} {k}" for s, op, k in r["step_sites"] if s == site)
            print(f"      {n:>4}  {site}: {ops}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
