"""A steady private step reads nothing back from the device.

Every host read of a tensor's values (``item``, ``bool``, ``int``, ``float``, ``tolist``,
``numpy``) and every operation whose output shape depends on the values (``unique``,
``nonzero``, ``masked_select``, boolean indexing) waits for the device to finish; on a GPU
one per layer or per step stalls the queue of launched kernels. These tests intercept all
of them (a :class:`~torch.overrides.TorchFunctionMode`) during the forward, backward and
``optimizer.step()`` of steady steps (after the first, which probes batch independence)
of tiny Hugging Face models, and count the calls made from privlearn's own code (the
nearest caller outside torch is a file of the ``privlearn`` package). On the CPU these are
the same calls; the CUDA variant (tests/torch/test_cuda.py) runs the steps under
``torch.cuda.set_sync_debug_mode("error")`` as well.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))

from privlearn.torch import make_private  # noqa: E402

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(
    sys.modules["privlearn.torch"].__file__)))
TORCH = os.path.dirname(os.path.abspath(torch.__file__))

T = torch.Tensor
#: value reads, and operations whose output shape depends on the values
READS = {T.item, T.__bool__, T.__int__, T.__float__, T.__index__, T.tolist, T.numpy,
         torch.unique, T.unique, torch.unique_consecutive, T.unique_consecutive,
         torch.nonzero, T.nonzero, torch.masked_select, T.masked_select, torch.argwhere,
         T.argwhere, torch.bincount, T.bincount, torch.repeat_interleave,
         T.repeat_interleave, torch.is_nonzero, T.is_nonzero, torch.equal, T.equal,
         torch.allclose, T.allclose}
#: privlearn functions that read only CPU tensors (gated on the device type; on an
#: accelerator they return before any read, see test_cpu_only_reads_stay_on_the_cpu)
CPU_ONLY = {"live_positions", "_find_nonfinite", "_cpu_value"}


def _privlearn_caller() -> str | None:
    """``file:line`` of the nearest caller outside torch and this file, when it is in
    privlearn; None otherwise (a read by torch itself, transformers or the test)."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(TORCH) or path == os.path.abspath(__file__):
            f = f.f_back
            continue
        if path.startswith(PACKAGE + os.sep):
            if f.f_code.co_name in CPU_ONLY:
                return None
            return f"{os.path.relpath(path, os.path.dirname(PACKAGE))}:{f.f_lineno}"
        return None
    return None


class HostReads(TorchFunctionMode):
    """Records every host read made from privlearn's code while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = func in READS
        if not read and func is T.__getitem__ and len(args) > 1:  # boolean-mask indexing
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            read = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if read:
            where = _privlearn_caller()
            if where is not None:
                self.calls.append(f"{getattr(func, '__name__', func)} at {where}")
        return func(*args, **kwargs)


def _data(name, n, t=7):
    from hf_models import VOCAB

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[::2, t - 2:] = 0
    labels = torch.randint(0, 3, (n,), generator=g) if name == "bert" else \
        ids.masked_fill(mask == 0, -100)
    return TensorDataset(ids, mask, labels)


def steady_step_reads(name: str, dtype=None, device: str = "cpu", steps: int = 3,
                      sync_debug: str | None = None) -> list[str]:
    """Host reads from privlearn during steps 2..steps of a private training loop (fixed
    batch size) of a tiny ``name`` model, under autocast to ``dtype`` when given. With
    ``sync_debug`` ("warn" or "error", CUDA), the steady steps run under
    ``torch.cuda.set_sync_debug_mode``; "warn": the synchronisations whose warning points
    at privlearn's code are counted as reads too."""
    if name == "opt":  # its feed-forward layers see the tokens flattened (regrouped)
        from hf_zoo import build, loss_of
    else:
        from hf_models import build, loss_of

    if name == "gpt2_lora":
        pytest.importorskip("peft")
    model = build(name, dtype=torch.float32).to(device)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    loader = DataLoader(_data(name, 6 * steps), batch_size=6)
    p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                     sampling="fixed", seed=0)
    reads = HostReads()
    for i, (ids, mask, labels) in enumerate(p.data_loader):
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        steady = i > 0
        if steady and sync_debug:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(sync_debug)
        try:
            with reads if steady else _null(), warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                p.optimizer.zero_grad()
                with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                    out = p.model(input_ids=ids, attention_mask=mask)
                    loss = loss_of(name, out, labels)
                loss.backward()
                p.optimizer.step()
        finally:
            if steady and sync_debug:
                torch.cuda.set_sync_debug_mode(0)
        if steady and sync_debug:
            reads.calls += [f"synchronisation at {w.filename}:{w.lineno}" for w in seen
                            if "synchroniz" in str(w.message).lower()
                            and os.path.abspath(w.filename).startswith(PACKAGE + os.sep)]
    assert p.accountant.steps == steps
    return reads.calls


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_interceptor_sees_reads_from_privlearn():
    """The check can fail: a host read made by privlearn's code is caught."""
    from privlearn.torch import grad_sample

    reads = HostReads()
    with reads:
        grad_sample.row_sq_norms(torch.ones(2, 3)).sum().item()  # from this file: not counted
    assert reads.calls == []
    x = torch.ones(3)
    with reads:
        grad_sample.Record((x,), {}, [x], []).has_grad()  # no read
        list(map(bool, [torch.tensor(True)]))  # bool() from a builtin: this file's frame
    assert reads.calls == []
    import privlearn.torch.units as units

    with reads:  # a function of privlearn that reads the largest unit's size (int())
        units.RowUnits.from_sizes([2, 1], "mean")
    assert reads.calls and all("privlearn" in c for c in reads.calls)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_steady_step_has_no_host_reads(name, dtype):
    assert steady_step_reads(name, dtype) == []


def test_steady_step_of_rows_regrouped_per_example_has_no_host_reads():
    """OPT's fc1, fc2 and final layer norm run on ``hidden.reshape(-1, d)``: once the
    first step verified their grouping, a steady step regroups their rows without
    reading anything back."""
    assert steady_step_reads("opt") == []


def test_cpu_only_reads_stay_on_the_cpu(monkeypatch):
    """The functions exempted above read nothing for a tensor on another device."""
    from privlearn.torch import _rows
    from privlearn.torch.grad_sample import live_positions

    monkeypatch.setattr(_rows, "_MIN_CHECK_ELEMENTS", 0)
    reads = HostReads()
    CPU_ONLY.discard("live_positions")
    try:
        with reads:
            assert live_positions(torch.zeros(2, 1, 8, 3, device="meta")) is None
        assert reads.calls == []
        g = torch.zeros(2, 1, 8, 3)
        g[:, :, 0] = 1.0
        with reads:  # on the CPU it reads (and drops the 7 dead positions)
            assert live_positions(g).tolist() == [0]
        assert reads.calls
    finally:
        CPU_ONLY.add("live_positions")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_cuda_steady_step_has_no_host_reads(name, dtype):
    """On a GPU: no host read from privlearn, and no synchronisation that CUDA's sync
    debug mode attributes to privlearn's code (transformers' own, e.g. its attention-mask
    checks, are theirs)."""
    assert steady_step_reads(name, dtype, device="cuda", sync_debug="warn") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steady_step_runs_under_sync_debug_error():
    """A model without Hugging Face code: every steady step of the private loop runs
    under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronisation raises)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 32),
                          nn.GELU(), nn.Linear(32, 50)).cuda()
    ids = torch.randint(0, 50, (24, 9))
    loader = DataLoader(TensorDataset(ids), batch_size=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                     sampling="fixed", seed=0)
    for i, (x,) in enumerate(p.data_loader):
        x = x.cuda()
        if i > 0:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            p.optimizer.zero_grad()
            logits = p.model(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 50), x[:, 1:].reshape(-1))
            loss.backward()
            p.optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert p.accountant.steps == 4
