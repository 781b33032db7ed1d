"""Count on the CPU what the CUDA half-precision path of the private step dispatches.

On CUDA the outer-product rules multiply half-precision operands into float32 with one
``torch.mm``/``torch.bmm``/``torch.addmm`` given ``out_dtype=torch.float32``; off CUDA
(:func:`privlearn.torch._rows._emulated_mm32` and ``_emulated_addmm32_``) the same product
is emulated by widening both operands first: two casts and a matmul (plus an addition)
that no GPU dispatches. :func:`cuda_products` replaces these two emulations, while
active, by custom operators (``privlearn_test::mm32`` and ``privlearn_test::addmm32_``)
whose kernels run exactly the emulation (same values) but which reach the dispatcher as
one operation each, as the CUDA product does: a ``TorchDispatchMode`` sees the custom
operator, and the casts and the matmul inside its kernel run with the mode set aside.
Likewise ``aten._fused_rms_norm`` (the RMSNorm rule's normalisation,
``rules.transformers._rms_normalised``), one CUDA kernel, is composite off CUDA (five
operations): a custom operator ``privlearn_test::fused_rms_norm`` runs it as one.

With ``device_masking=True`` the non-finite examples are also found as on an
accelerator (``ClippingMixin._find_nonfinite``'s device branch: a mask computed on the
device and applied through the weights, where the CPU reads one flag back instead), so
the count includes what that branch dispatches.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from privlearn.torch import _rows


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active, by name (``ops``)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


_OPS: dict = {}


def _ops():
    """The two custom operators, defined once per process."""
    if not _OPS:
        @torch.library.custom_op("privlearn_test::mm32", mutates_args=())
        def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return _EMULATED["mm32"](a, b)

        @mm32.register_fake
        def _(a, b):
            return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=torch.float32)

        @torch.library.custom_op("privlearn_test::mm32_out", mutates_args=("out",))
        def mm32_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
            _EMULATED["mm32_out"](a, b, out)

        @torch.library.custom_op("privlearn_test::addmm32_", mutates_args=("o",))
        def addmm32_(o: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
            _EMULATED["addmm32_"](o, a, b)

        @torch.library.custom_op("privlearn_test::fused_rms_norm", mutates_args=())
        def fused_rms_norm(x: torch.Tensor, n: int, eps: float) -> torch.Tensor:
            return _EMULATED["rms"](x, [n], None, eps)[0]

        @fused_rms_norm.register_fake
        def _(x, n, eps):
            return torch.empty_like(x)

        _OPS["mm32"], _OPS["addmm32_"], _OPS["rms"] = mm32, addmm32_, fused_rms_norm
        _OPS["mm32_out"] = mm32_out
    return _OPS


#: the emulations being stood in for (kept while the stand-ins are active)
_EMULATED: dict = {}


@contextlib.contextmanager
def cuda_products(device_masking: bool = False):
    """While active, each float32-accumulated product of half-precision operands
    dispatches one operation, as on CUDA (see the module docstring); with
    ``device_masking``, non-finite examples are masked as on an accelerator."""
    from privlearn.torch.rules import transformers

    ops = _ops()
    saved = _rows._emulated_mm32, _rows._emulated_addmm32_
    _EMULATED["mm32"], _EMULATED["addmm32_"] = saved
    _rows._emulated_mm32, _rows._emulated_addmm32_ = ops["mm32"], ops["addmm32_"]
    saved_out = _EMULATED["mm32_out"] = _rows._emulated_mm32_out
    _rows._emulated_mm32_out = lambda a, b, out: (ops["mm32_out"](a, b, out), out)[1]
    saved_rms = transformers._FUSED_RMS
    if saved_rms is not None:
        _EMULATED["rms"] = saved_rms
        transformers._FUSED_RMS = lambda x, shape, w, eps: (ops["rms"](x, shape[-1], eps), None)
    restore = None
    if device_masking:
        from privlearn.torch import clipping
        from privlearn.torch._tracker_util import _nonfinite

        cls = clipping.ClippingMixin
        restore = cls._find_nonfinite
        cls._find_nonfinite = lambda self, sq, masked, refuse, scaled: _nonfinite(sq, masked)
    try:
        yield
    finally:
        _rows._emulated_mm32, _rows._emulated_addmm32_ = saved
        _rows._emulated_mm32_out = saved_out
        transformers._FUSED_RMS = saved_rms
        if restore is not None:
            cls._find_nonfinite = restore
