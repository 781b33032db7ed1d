"""Few launches: a steady private ``optimizer.step()`` dispatches at most a few times the
operations of plain SGD's step on the same model (:data:`RATIO`: 4.6 for GPT-2, 3.6 for
BERT, 4.5 for Llama, 5 for GPT-2 + LoRA, each a few operations above the most any of its
configurations dispatches).

Every aten operation reaching the dispatcher (one kernel launch each on an accelerator,
views included) is counted by a ``TorchDispatchMode`` during the second step (the first
probes batch independence) of tiny Hugging Face models on the CPU, float32 and under
bfloat16 autocast (float32 parameters; the layers record bfloat16 inputs and output
gradients, the norms and the clipped sum are float32) and with bfloat16 parameters (the
gradient buffers bfloat16, the clipped sums formed in float32), and in float32 with ghost
norms in every layer (as layers of realistic width choose). The plain step is torch's default
``SGD`` (the optimizer the private step wraps and also runs), after a backward pass under
the same autocast.
With bfloat16 parameters the step is also counted on the path CUDA takes (half-precision
operands kept, each float32-accumulated product counted as the one operation CUDA
dispatches for it, see ``cuda_dispatch.py``) and with secure-mode noise.
With ghost norms in every layer the step is also counted with the non-finite examples masked
on the device as on an accelerator (the rows cleaned in every layer, nothing read back).
The operations of the private backward pass (the tracker's hooks compute the per-example
norms there) are counted too and reported, not bounded.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))

from privlearn.torch import make_private  # noqa: E402

#: the bound of the private step, in plain SGD steps, by model: the most of its
#: configurations below (GPT-2 131/30 ops with bfloat16 parameters masked on the device,
#: 149 before the per-layer norms were grouped and the biases weighed from their rows;
#: BERT 146/43; Llama 97/23; GPT-2 + LoRA 66/14) and a few operations more
RATIO = {"gpt2": 4.6, "bert": 3.6, "llama": 4.5, "gpt2_lora": 5.0}


#: operations that launch no kernel on an accelerator besides views (as
#: ``benchmarks/step_dispatch.py`` counts them)
NO_KERNEL = frozenset({"_unsafe_view", "_reshape_alias", "lift_fresh", "empty",
                       "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                       "_record_function_enter_new", "_record_function_exit"})


class Dispatched(TorchDispatchMode):
    """Counts the aten operations dispatched while active (``kernels``: those that launch
    a kernel on an accelerator, not a view, an allocation or a profiler mark)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        self.kernels += not func.is_view and name not in NO_KERNEL
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _loss(name, model, ids, mask, labels):
    from hf_models import loss_of

    return loss_of(name, model(input_ids=ids, attention_mask=mask), labels)


def dispatch_counts(name: str, autocast=None, dtype=torch.float32, secure: bool = False
                    ) -> tuple[Dispatched, Dispatched, Dispatched, Dispatched]:
    """(plain backward, plain SGD step, private backward, private step) of tiny ``name``
    with parameters in ``dtype``, its forward passes under CPU autocast to ``autocast``
    when given, the noise in secure mode when ``secure``."""
    from hf_models import build
    from test_host_reads import _data

    def cast():
        return torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                              enabled=autocast is not None)

    model = build(name, dtype=dtype)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.01)
    ids, mask, labels = next(iter(DataLoader(_data(name, 6), batch_size=6)))
    plain_backward, plain_step = Dispatched(), Dispatched()
    with cast():
        loss = _loss(name, model, ids, mask, labels)
    with plain_backward:
        loss.backward()
    with plain_step:
        opt.step()

    model = build(name, dtype=dtype)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.01)
    p = make_private(model, opt, DataLoader(_data(name, 12), batch_size=6),
                     noise_multiplier=1.0, max_grad_norm=1.0, sampling="fixed",
                     secure_mode=secure, seed=None if secure else 0)
    private_backward, private_step = Dispatched(), Dispatched()
    for i, (ids, mask, labels) in enumerate(p.data_loader):
        p.optimizer.zero_grad()
        with cast():
            loss = _loss(name, p.model, ids, mask, labels)
        with private_backward if i == 1 else Dispatched():
            loss.backward()
        with private_step if i == 1 else Dispatched():
            p.optimizer.step()
    assert p.accountant.steps == 2
    return plain_backward, plain_step, private_backward, private_step


@pytest.mark.parametrize("autocast,dtype,ghost", [(None, torch.float32, False),
                                                 (torch.bfloat16, torch.float32, False),
                                                 (None, torch.bfloat16, False),
                                                 (None, torch.float32, True)],
                         ids=["float32", "bf16_autocast", "bf16_params", "float32_ghost"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_private_step_dispatches_a_few_sgd_steps(name, autocast, dtype, ghost,
                                                        monkeypatch):
    """... and with ghost norms in every layer (no per-example gradient materialised),
    as layers of realistic width choose."""
    if name == "gpt2_lora":
        pytest.importorskip("peft")
    if ghost:
        from privlearn.torch import grad_sample

        monkeypatch.setattr(grad_sample, "GHOST_MEMORY_BUDGET_BYTES", 0)
    plain_backward, plain_step, private_backward, private_step = dispatch_counts(
        name, autocast, dtype)
    n_params = sum(1 for _ in plain_step.ops.elements())
    assert n_params > 0  # the counter sees the plain step
    print(f"\n{name} {dtype} {autocast or 'no autocast'} ghost={ghost}: "
          f"SGD step {plain_step.total}, private step {private_step.total}; "
          f"backward plain {plain_backward.total}, private (with the hooks) "
          f"{private_backward.total}; most frequent in the private step: "
          f"{private_step.ops.most_common(6)}")
    assert private_step.total <= RATIO[name] * plain_step.total, private_step.ops.most_common()


def _check(name, plain_step, private_step, label):
    assert sum(1 for _ in plain_step.ops.elements()) > 0  # the counter sees the plain step
    print(f"\n{name} {label}: SGD step {plain_step.total}, private step "
          f"{private_step.total}; most frequent: {private_step.ops.most_common(6)}")
    assert private_step.total <= RATIO[name] * plain_step.total, private_step.ops.most_common()


@pytest.mark.parametrize("ghost", [False, True], ids=["held", "ghost"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_half_precision_step_as_on_cuda_dispatches_a_few_sgd_steps(name, ghost,
                                                                          monkeypatch):
    """bfloat16 parameters on the path CUDA takes: half-precision operands kept
    (``LOW_PRECISION_MATMUL = "always"``), each float32-accumulated product counted as the
    one operation CUDA dispatches for it (``cuda_dispatch.cuda_products``: the CPU's
    emulation casts are not counted), with the per-example gradients held (as the
    budget chooses on these tiny layers) and with ghost norms in every layer."""
    from cuda_dispatch import cuda_products

    from privlearn.torch import grad_sample

    if name == "gpt2_lora":
        pytest.importorskip("peft")
    monkeypatch.setattr(grad_sample, "LOW_PRECISION_MATMUL", "always")
    if ghost:
        monkeypatch.setattr(grad_sample, "GHOST_MEMORY_BUDGET_BYTES", 0)
    with cuda_products():
        _, plain_step, _, private_step = dispatch_counts(name, dtype=torch.bfloat16)
    _check(name, plain_step, private_step, f"bfloat16 half-precision products ghost={ghost}")


@pytest.mark.parametrize("autocast,dtype", [(None, torch.float32),
                                            (None, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)],
                         ids=["float32", "bf16_params", "bf16_autocast"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_ghost_step_masking_on_the_device_dispatches_a_few_sgd_steps(name, autocast,
                                                                             dtype,
                                                                             monkeypatch):
    """Ghost norms in every layer (as wide layers choose on a GPU), the non-finite
    examples masked on the device as on an accelerator
    (``cuda_products(device_masking=True)``: nothing read back, so every layer cleans the
    rows a dropped example could make non-finite; the layers' rows cleaned together,
    ``_grouped``), float32, and on the path CUDA takes (half-precision operands kept,
    each float32-accumulated product one operation) with bfloat16 parameters and under
    bfloat16 autocast.
    GPT-2 + LoRA has every LoRA matrix in ghost form (not chosen at realistic lengths,
    where their per-example gradients are small)."""
    from cuda_dispatch import cuda_products

    from privlearn.torch import grad_sample

    if name == "gpt2_lora":
        pytest.importorskip("peft")
    monkeypatch.setattr(grad_sample, "GHOST_MEMORY_BUDGET_BYTES", 0)
    if dtype == torch.bfloat16 or autocast is not None:
        monkeypatch.setattr(grad_sample, "LOW_PRECISION_MATMUL", "always")
    with cuda_products(device_masking=True):
        _, plain_step, _, private_step = dispatch_counts(name, autocast, dtype)
    _check(name, plain_step, private_step,
           f"{dtype} {autocast or 'no autocast'} ghost, masked on the device")


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_secure_bf16_step_dispatches_a_few_sgd_steps(name):
    """Secure-mode noise (the CPU's draw) with bfloat16 parameters."""
    if name == "gpt2_lora":
        pytest.importorskip("peft")
    _, plain_step, _, private_step = dispatch_counts(name, dtype=torch.bfloat16,
                                                     secure=True)
    _check(name, plain_step, private_step, "bfloat16 secure")


#: the bound of the whole private training step, in whole plain steps, by model (see
#: below): the most of float32 and bfloat16 autocast (GPT-2 673/368, BERT 729/403, Llama
#: 838/607, GPT-2 + LoRA 615/454 ops) and about 2% more (2.0, 2.0, 1.6, 1.5 before the
#: layers of one input shared their Gram matrix and autocast copy, the RMSNorm rule's
#: normalisation was one operation and the ghost products and the sums over positions
#: of biases and LayerNorms were reduced by groups; 1.91, 1.89, 1.46, 1.42 before the
#: LayerNorms' and RMSNorms' normalisations and products were formed by groups too and
#: the ghost norms of one (N, T) summed together; 1.89, 1.87, 1.43, 1.41 before the ghost
#: layers' Gram products were multiplied by one operation a group)
WHOLE_RATIO = {"gpt2": 1.87, "bert": 1.85, "llama": 1.41, "gpt2_lora": 1.38}
#: the same of the operations that launch a kernel (views, allocations left out): the
#: most of float32 and bfloat16 autocast (GPT-2 297/185, BERT 297/165, Llama 389/310,
#: GPT-2 + LoRA 256/203) and about 2% more (the same changes: 1.88, 2.22, 1.54, 1.44;
#: then 1.74, 1.94, 1.37, 1.36; then 1.68, 1.90, 1.33, 1.34)
WHOLE_KERNEL_RATIO = {"gpt2": 1.64, "bert": 1.84, "llama": 1.28, "gpt2_lora": 1.29}


def whole_step_counts(name: str, autocast=None) -> tuple[Dispatched, Dispatched]:
    """(plain, private) operations of one whole steady training step (``zero_grad``,
    forward, loss, backward, ``optimizer.step()``) of tiny ``name`` in float32, its forward
    passes under CPU autocast to ``autocast`` when given: plain SGD's second step, the
    private third (the first probes batch independence)."""
    from hf_models import build
    from test_host_reads import _data

    def train(model, opt, loader, counted):
        for i, (ids, mask, labels) in enumerate(loader):
            with counted if i == len(loader) - 1 else Dispatched():
                opt.zero_grad()
                with torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                    enabled=autocast is not None):
                    loss = _loss(name, model, ids, mask, labels)
                loss.backward()
                opt.step()

    plain, private = Dispatched(), Dispatched()
    model = build(name, dtype=torch.float32)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.01)
    train(model, opt, DataLoader(_data(name, 12), batch_size=6), plain)
    model = build(name, dtype=torch.float32)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.01)
    p = make_private(model, opt, DataLoader(_data(name, 18), batch_size=6),
                     noise_multiplier=1.0, max_grad_norm=1.0, sampling="fixed", seed=0)
    train(p.model, p.optimizer, p.data_loader, private)
    assert p.accountant.steps == 3
    return plain, private


_WHOLE: dict = {}


def _device_whole_counts(name: str, autocast=None) -> tuple[Dispatched, Dispatched]:
    """:func:`whole_step_counts` on the path an accelerator takes (see below), once per
    process for each model and autocast dtype."""
    from cuda_dispatch import cuda_products

    from privlearn.torch import grad_sample

    if name == "gpt2_lora":
        pytest.importorskip("peft")
    key = (name, autocast)
    if key not in _WHOLE:
        saved = grad_sample.GHOST_MEMORY_BUDGET_BYTES, grad_sample.LOW_PRECISION_MATMUL
        grad_sample.GHOST_MEMORY_BUDGET_BYTES = 0
        if autocast is not None:
            grad_sample.LOW_PRECISION_MATMUL = "always"
        try:
            with cuda_products(device_masking=True):
                _WHOLE[key] = whole_step_counts(name, autocast)
        finally:
            grad_sample.GHOST_MEMORY_BUDGET_BYTES, grad_sample.LOW_PRECISION_MATMUL = saved
    return _WHOLE[key]


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "bf16_autocast"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_whole_private_step_dispatches_at_most_twice_plain_steps(name, autocast):
    """The whole training step on the path an accelerator takes, where every dispatched
    operation but a view is a kernel launch: ghost norms in every layer (as layers of
    realistic width choose), the non-finite examples masked on the device
    (``cuda_products(device_masking=True)``), under bfloat16 autocast the half-precision
    operands kept with each float32-accumulated product one operation. The private step
    (the tracker's forward hooks, the per-example norms in the backward hooks, the clipped
    sum and the noise) dispatches at most :data:`WHOLE_RATIO` times the plain step's
    operations (the forward, autograd's backward with the weight gradients, SGD): twice
    for GPT-2 and BERT, 1.6 times for Llama, 1.5 times for GPT-2 + LoRA. Each layer's
    weight and bias norms once went through a per-layer addition and each ghost layer's
    Gram matrices through ``matmul``'s reshaping views: GPT-2 2.22x, BERT 2.36x then
    (1.9-2.0x after); the rigorous bound on a ghost norm's rounding
    (``_ghost_norms.ghost_sq``: the triangle-inequality cap and the sums in two stages)
    added five operations per ghost layer: BERT 2.21x; the ghost norms of one shape
    finished together and the held rows' norms concatenated (``_row_norms``), the biases
    weighed from their rows: GPT-2 1.91x, BERT 1.94x, Llama 1.53x, LoRA 1.44x; the layers of
    one input sharing its Gram matrix (and its autocast copy), the RMSNorm rule
    normalising by one operation and the ghost products and the sums over positions of
    biases and LayerNorms reduced by groups: GPT-2 1.88x, BERT 1.85x, Llama 1.43x, LoRA
    1.39x; the LayerNorms' and RMSNorms' weights' rows (normalisation, product, sum) formed
    by groups and the ghost norms of one ``(N, T)`` summed together: GPT-2 1.85x, BERT
    1.84x, Llama 1.40x, LoRA 1.38x; the ghost layers' output-gradient Gram matrices formed
    in their group's buffer and multiplied by the inputs' by one ``_foreach_mul_`` a
    group: GPT-2 1.83x, BERT 1.81x, Llama 1.38x, LoRA 1.35x. The operations that launch a kernel
    (views and allocations left out) are bounded likewise (:data:`WHOLE_KERNEL_RATIO`)."""
    plain, private = _device_whole_counts(name, autocast)
    assert plain.ops["addmm"] + plain.ops["mm"] > 0  # the counter sees the plain step
    print(f"\n{name} {autocast or 'float32'} whole step: plain {plain.total}, private "
          f"{private.total} ({private.total / plain.total:.2f}x), launching a kernel "
          f"{plain.kernels}, {private.kernels} ({private.kernels / plain.kernels:.2f}x); "
          f"most frequent in the private step: {private.ops.most_common(6)}")
    assert private.total <= WHOLE_RATIO[name] * plain.total, private.ops.most_common()
    assert private.kernels <= WHOLE_KERNEL_RATIO[name] * plain.kernels, \
        private.ops.most_common()


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt2_lora"])
def test_bf16_autocast_private_step_adds_no_more_kernels_than_float32(name):
    """Under bfloat16 autocast the private step adds (over the plain step under the same
    autocast, whose own casts it cannot avoid) no more kernel launches than in float32:
    no cast or copy for the bookkeeping of dtypes (the half-precision copy of an input
    the layers record is shared by the layers that read it, the products of
    half-precision operands accumulate in float32 by one operation)."""
    plain32, private32 = _device_whole_counts(name)
    plain16, private16 = _device_whole_counts(name, torch.bfloat16)
    added32 = private32.kernels - plain32.kernels
    added16 = private16.kernels - plain16.kernels
    print(f"\n{name}: kernels the private step adds: float32 {added32}, bf16 autocast "
          f"{added16}")
    assert added16 <= added32, (private16.ops - private32.ops).most_common()
