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
        [--device-masking] [--whole] [--size test|small] [--batch B] [--seq T]

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
accelerator (a mask on the device, no flag read back) and skips the CPU-only check of
dead positions (``_rows.live_positions``, which reads a count back a layer) as an
accelerator does.

``--whole`` also counts the whole steady training step (``zero_grad``, forward, loss,
backward, ``optimizer.step()``) of each side, plain SGD (its second step) and private (its
third), and makes ``--sites`` break that whole private step down by call site (the
operations of no privlearn frame, the model's forward and autograd's backward, under
``?``). ``--size small`` counts the realistic structures of ``benchmarks/torch_hf.py``
(GPT-2 small, BERT-base, a ~150M Llama, GPT-2 small + LoRA r16) on a short batch
(``--batch`` x ``--seq``, default 2 x 16: the operations dispatched do not depend on the
batch, only the layers the budget puts in ghost form do, see ``--ghost``); the default
``--size test`` is the tiny models of ``tests/torch/hf_models.py`` (batch 6 x 7).
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


#: operations that launch no kernel on an accelerator besides views (``is_view``)
NO_KERNEL = frozenset({"_unsafe_view", "_reshape_alias", "lift_fresh", "empty",
                       "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                       "_record_function_enter_new", "_record_function_exit"})


def launches(func) -> bool:
    """Whether the dispatched operation ``func`` runs a kernel on an accelerator (not a
    view, an allocation or a profiler mark)."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL


def _counter(sites: bool = False):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()
            self.kernels = 0  # the operations that launch a kernel on an accelerator
            self.sites = collections.Counter()  # (call site, operation)
            self.site_kernels = collections.Counter()  # call site: kernels launched

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            self.ops[name] += 1
            self.kernels += launches(func)
            if sites:
                site = _site()
                self.sites[(site, name)] += 1
                self.site_kernels[site] += launches(func)
            return func(*args, **(kwargs or {}))

    return Count


def _loss(name, model, ids, mask, labels):
    from hf_models import loss_of

    return loss_of(name, model(input_ids=ids, attention_mask=mask), labels)


def _workload(name: str, size: str, batch: int, seq: int):
    """``(build(dtype), data(n), loss(model, ids, mask, labels))`` of ``name`` at
    ``size``: the tiny models of ``tests/torch/hf_models.py`` (``"test"``, batch 6 x 7;
    ``batch`` and ``seq`` unused) or the realistic structures of
    ``benchmarks/torch_hf.py`` (``"small"``) on ``batch`` x ``seq`` tokens."""
    import torch

    if size == "test":
        from hf_models import build
        from test_host_reads import _data

        return (lambda dtype: build(name, dtype=dtype)), (lambda n: _data(name, n)), \
            (lambda model, ids, mask, labels: _loss(name, model, ids, mask, labels))
    import torch_hf

    hf_name = name.replace("_", "-")
    w = torch_hf.workload(hf_name, "small")
    criterion = torch_hf._criterion(w.task)

    def build(dtype):
        return torch_hf.build(hf_name, "small")[0].to(dtype)

    def data(n):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, w.vocab, (n, seq), generator=g)
        labels = ids.clone() if w.task == "lm" else torch.randint(0, 2, (n,), generator=g)
        return torch.utils.data.TensorDataset(ids, torch.ones_like(ids), labels)

    def loss(model, ids, mask, labels):
        b, t = ids.shape
        kw = {"attention_mask": mask,
              "position_ids": torch.arange(t).expand(b, t).contiguous()}
        if hf_name == "bert":
            kw["token_type_ids"] = torch.zeros_like(ids)
        return criterion(model(ids, **kw).logits, labels)

    return build, data, loss


def count(name: str, steps: int = 2, dtype: str = "float32", secure: bool = False,
          autocast: str | None = None, sites: bool = False, whole: bool = False,
          size: str = "test", batch: int = 2, seq: int = 16) -> dict:
    """Dispatched operations of plain SGD's step and of the private step (and of the
    private backward pass's hooks) on the ``name`` model at ``size`` (see
    :func:`_workload`), its parameters in ``dtype``, the forward passes under CPU
    autocast to ``autocast`` when given, the noise in secure mode when ``secure``; with
    ``whole``, of the whole steady training step of each side too (``zero_grad``,
    forward, loss, backward, step); with ``sites``, the private step's (with ``whole``,
    the whole private step's) operations by call site too."""
    import contextlib

    import torch
    from torch.utils.data import DataLoader

    from privlearn.torch import make_private

    Count = _counter(False)
    build, data, loss_fn = _workload(name, size, batch, seq)
    b = 6 if size == "test" else batch
    cast = torch.autocast("cpu", dtype=getattr(torch, autocast or "bfloat16"),
                          enabled=autocast is not None)

    def train(model, opt, loader, backward, step, total):
        """``steps`` steps, the last one's backward, step and whole step counted."""
        for i, (ids, mask, labels) in enumerate(loader):
            steady = i == steps - 1
            with total if steady and whole else contextlib.nullcontext():
                opt.zero_grad()
                with cast:
                    loss = loss_fn(model, ids, mask, labels)
                with backward if steady else contextlib.nullcontext():
                    loss.backward()
                with step if steady else contextlib.nullcontext():
                    opt.step()

    # plain SGD (foreach on an accelerator, torch's default) on the same model and data
    model = build(getattr(torch, dtype))
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.01)
    plain_backward, sgd, plain_whole = Count(), Count(), Count()
    train(model, opt, DataLoader(data(b * steps), batch_size=b), plain_backward, sgd,
          plain_whole)

    model = build(getattr(torch, dtype))
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    p = make_private(model, opt, DataLoader(data(b * steps), batch_size=b),
                     noise_multiplier=1.0, max_grad_norm=1.0, sampling="fixed",
                     secure_mode=secure, seed=None if secure else 0)
    hooks = Count()
    private = _counter(sites and not whole)()
    private_whole = _counter(sites and whole)()
    train(p.model, p.optimizer, p.data_loader, hooks, private, private_whole)
    by_site = private_whole if whole else private
    row = {"model": name, "parameters": len(params),
           "sgd_step": sum(sgd.ops.values()), "private_step": sum(private.ops.values()),
           "ratio": round(sum(private.ops.values()) / max(1, sum(sgd.ops.values())), 2),
           "step_ops": dict(private.ops.most_common()),
           "step_sites": [[site, op, n] for (site, op), n in by_site.sites.most_common()],
           "site_kernels": dict(by_site.site_kernels),
           "backward_plain": sum(plain_backward.ops.values()),
           "backward_private": sum(hooks.ops.values())}
    if whole:
        row.update(whole_plain=sum(plain_whole.ops.values()),
                   whole_private=sum(private_whole.ops.values()),
                   whole_ratio=round(sum(private_whole.ops.values())
                                     / max(1, sum(plain_whole.ops.values())), 2),
                   kernels_plain=plain_whole.kernels, kernels_private=private_whole.kernels,
                   kernels_ratio=round(private_whole.kernels / max(1, plain_whole.kernels),
                                       2),
                   whole_ops=dict(private_whole.ops.most_common()))
    return row


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
                    help="call sites dispatching most of the private step shown (with "
                         "--whole: of the whole private step)")
    ap.add_argument("--whole", action="store_true",
                    help="count the whole steady training step of each side too")
    ap.add_argument("--size", default="test", choices=("test", "small"),
                    help="test: tests/torch/hf_models.py's tiny models; small: "
                         "benchmarks/torch_hf.py's realistic structures")
    ap.add_argument("--batch", type=int, default=2, help="--size small: sequences")
    ap.add_argument("--seq", type=int, default=16, help="--size small: tokens")
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
    if a.device_masking:  # as on an accelerator: no CPU-only dead-position check
        from privlearn.torch import _rows

        _rows._MIN_CHECK_ELEMENTS = float("inf")
    with stand_in:
        rows = [count(m, dtype=a.dtype, secure=a.secure, autocast=a.autocast,
                      sites=a.sites > 0, whole=a.whole, size=a.size, batch=a.batch,
                      seq=a.seq) for m in a.models.split(",")]
    whole = (f" {'whole plain':>12} {'private':>8} {'ratio':>6} {'non-view plain':>15} "
             f"{'private':>8} {'ratio':>6}" if a.whole else "")
    print(f"{'model':<10} {'params':>6} {'SGD step':>9} {'private step':>13} {'ratio':>6} "
          f"{'backward plain':>15} {'private':>8}{whole}")
    for r in rows:
        whole = (f" {r['whole_plain']:>12} {r['whole_private']:>8} {r['whole_ratio']:>6}"
                 f" {r['kernels_plain']:>15} {r['kernels_private']:>8} "
                 f"{r['kernels_ratio']:>6}" if a.whole else "")
        print(f"{r['model']:<10} {r['parameters']:>6} {r['sgd_step']:>9} "
              f"{r['private_step']:>13} {r['ratio']:>6} {r['backward_plain']:>15} "
              f"{r['backward_private']:>8}{whole}")
        top = list(r["whole_ops" if a.whole else "step_ops"].items())[:a.top]
        print("    " + ", ".join(f"{k} {v}" for k, v in top))
        by_site = collections.Counter()
        for site, _op, n in r["step_sites"]:
            by_site[site] += n
        for site, n in by_site.most_common(a.sites):
            ops = ", ".join(f"{op} {k}" for s, op, k in r["step_sites"] if s == site)
            print(f"      {n:>4} ({r['site_kernels'].get(site, 0):>4} non-view)  {site}: "
                  f"{ops}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
