"""The ChaCha20 keystream (RFC 8439) on any torch device, with an optional OpenSSL backend.

The stream (a 256-bit key and a 128-bit block position) and the cipher (integer tensor
operations, about 450 a run whatever its number of blocks, no host synchronisation) are
defined in :mod:`privlearn.torch._chacha_cipher`.

Backends (:data:`BACKENDS`), all producing the same bits: ``"tensor"`` runs anywhere torch
does (accelerators use it); for CUDA tensors, when ``triton`` is installed, ``"triton"``
computes a run in one fused kernel launch (:mod:`privlearn.torch._chacha_triton`), used on
a device only after a self-check there at its first use (the RFC test vector and the
tensor backend on a random key, across a counter carry), else the tensor backend, with a
warning; for CPU tensors, ``"openssl"`` uses OpenSSL's SIMD ChaCha20
through the optional ``cryptography`` package (asked for one run of at most ``2**32``
blocks at a time, so that no backend disagrees on how the counter carries), and
``"numpy"``, the tensor code in NumPy ``uint32`` (whose arithmetic wraps modulo ``2**32``),
serves when ``cryptography`` is absent: on the CPU, torch would run each of its thousands
of short operations in an OpenMP parallel region, slow on busy cores (measured on a loaded
2-core machine, per block: tensor 3 us, NumPy 0.13 us, OpenSSL 0.013 us). Which one a
device gets is :func:`backend_for`.

References
----------
Y. Nir and A. Langley, "ChaCha20 and Poly1305 for IETF Protocols", RFC 8439, 2018,
sec. 2.1-2.4.

D. J. Bernstein, "ChaCha, a variant of Salsa20", 2008.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from privlearn.errors import ConfigurationError, ParameterValueError

__all__ = [
    "BACKENDS",
    "BLOCK_BYTES",
    "KEY_BYTES",
    "TENSOR_OUT_ROWS",
    "TENSOR_WORK_ROWS",
    "UNIFORMS_PER_BLOCK",
    "backend_for",
    "backend_in_use",
    "block_words",
    "keystream_bytes",
    "uniform_bits53",
]

from privlearn.torch._chacha_cipher import (
    _LITTLE_ENDIAN,
    BLOCK_BYTES,
    KEY_BYTES,
    POSITION_LIMIT,  # noqa: F401 - re-exported
    TENSOR_OUT_ROWS,
    TENSOR_RUN_BLOCKS,  # noqa: F401 - re-exported (tests shrink it)
    TENSOR_WORK_ROWS,
    UNIFORMS_PER_BLOCK,
    _check,
    _numpy_bits53,
    _segments,
    _tensor_bits53,
    block_words,
)

# -------------------------------------------------------------------------- OpenSSL backend


@functools.cache
def _openssl_chacha20() -> Callable | None:
    """``cryptography``'s ChaCha20 cipher factory, or None when it is not installed (an
    installed but broken ``cryptography`` raises its ImportError)."""
    if importlib.util.find_spec("cryptography") is None:
        return None
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    def make(key: bytes, position: int):
        return Cipher(algorithms.ChaCha20(key, position.to_bytes(16, "little")),
                      mode=None).encryptor()

    return make


_ZEROS = bytearray()


def _zeros(n: int) -> memoryview:
    """A read-only view of ``n`` zero bytes (one buffer, grown as needed)."""
    global _ZEROS
    if len(_ZEROS) < n:
        _ZEROS = bytearray(n)
    return memoryview(_ZEROS)[:n].toreadonly()


def _openssl_bits53(key: bytes, position: int, out: torch.Tensor,
                    work: torch.Tensor | None = None) -> None:
    make = _openssl_chacha20()
    if make is None:
        raise ConfigurationError("the 'openssl' ChaCha20 backend needs the 'cryptography' "
                                 "package (pip install cryptography); the 'numpy' and "
                                 "'tensor' backends need nothing")
    words = out.numpy().reshape(-1).view(np.uint64)
    raw = words.view(np.uint8)
    for off, p, n in _segments(position, out.shape[0]):
        nbytes = n * BLOCK_BYTES
        lo = off * BLOCK_BYTES
        make(key, p).update_into(_zeros(nbytes), raw[lo:lo + nbytes])
    # the keystream's 64-bit little-endian words: their top 53 bits (NumPy, in this thread)
    np.right_shift(words, np.uint64(11), out=words)


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Backend:
    """A way to compute the stream's 53-bit uniforms.

    Attributes
    ----------
    name : str
    priority : int
        The available backend of highest priority is used.
    available : Callable[[torch.device], bool]
        Whether it can write into a tensor on that device.
    bits53 : Callable[[bytes, int, torch.Tensor, torch.Tensor | None], None]
        ``bits53(key, position, out, work)`` fills the contiguous ``int64`` tensor ``out``
        of shape ``(blocks, 8)`` with the top 53 bits of the stream's 64-bit little-endian
        words, blocks ``position, ..., position + blocks - 1`` in order; ``work`` (None,
        or ``TENSOR_WORK_ROWS * blocks`` int64 on ``out``'s device, which ``out`` may
        share as described at :func:`uniform_bits53`) is scratch a backend may use.
    """

    name: str
    priority: int
    available: Callable[[torch.device], bool]
    bits53: Callable[[bytes, int, torch.Tensor, torch.Tensor | None], None]


@functools.cache
def _triton_module():
    """:mod:`privlearn.torch._chacha_triton`, or None when ``triton`` is not installed or
    does not import (then with one warning)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        from privlearn.torch import _chacha_triton
    except Exception as e:  # noqa: BLE001 - a broken triton leaves the tensor backend
        warnings.warn(f"privlearn: triton is installed but does not import ({type(e).__name__}:"
                      f" {e}); secure noise on CUDA uses the tensor-operation cipher",
                      RuntimeWarning, stacklevel=2)
        return None
    return _chacha_triton


def _triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    module = _triton_module()
    return module is not None and module.passed(device)


def _triton_bits53(key: bytes, position: int, out: torch.Tensor,
                   work: torch.Tensor | None = None) -> None:
    _triton_module().bits53(key, position, out, work)


#: The backends by name.
BACKENDS: dict[str, Backend] = {
    "triton": Backend("triton", 3, _triton_available, _triton_bits53),
    "openssl": Backend("openssl", 2,
                       lambda device: device.type == "cpu" and _LITTLE_ENDIAN
                       and _openssl_chacha20() is not None,
                       _openssl_bits53),
    "numpy": Backend("numpy", 1, lambda device: device.type == "cpu", _numpy_bits53),
    "tensor": Backend("tensor", 0, lambda device: True, _tensor_bits53),
}


def backend_for(device: torch.device) -> Backend:
    """The available backend of highest priority for ``device``."""
    usable = [b for b in BACKENDS.values() if b.available(device)]
    if not usable:
        raise ConfigurationError(f"no ChaCha20 backend is available for device {device}; "
                                 f"the registered ones are {sorted(BACKENDS)}")
    return max(usable, key=lambda b: b.priority)


def backend_in_use(device: torch.device) -> str:
    """The name of the backend that computes the keystream for ``device``'s tensors:
    :func:`backend_for`'s, except ``"tensor"`` where ``"triton"`` was selected but a
    launch of its kernel has failed since (it then runs the tensor backend)."""
    name = backend_for(device).name
    if name == "triton" and not _triton_module().usable(device):
        return "tensor"
    return name


def uniform_bits53(key: bytes, position: int, out: torch.Tensor,
                   backend: str | None = None,
                   work: torch.Tensor | None = None) -> torch.Tensor:
    """Fill ``out`` with 53-bit uniform integers from the stream.

    Parameters
    ----------
    key : bytes
        The 32-byte key.
    position : int
        Block position of the first block.
    out : torch.Tensor
        Contiguous ``int64`` tensor of shape ``(blocks, 8)``, on any device.
    backend : str, optional
        A name in :data:`BACKENDS`; default :func:`backend_for` ``out.device``.
    work : torch.Tensor, optional
        Scratch for the tensor backend: a contiguous ``int64`` tensor of
        ``TENSOR_WORK_ROWS * blocks`` elements on ``out``'s device (default: allocated).
        ``out`` may be its words ``[16 * blocks, 24 * blocks)`` (rows
        :data:`TENSOR_OUT_ROWS`), so the keystream needs no memory beyond ``work``.

    Returns
    -------
    torch.Tensor
        ``out``: entry ``(j, k)`` is ``w >> 11`` for the ``k``-th 64-bit little-endian word
        ``w`` of block ``position + j``, uniform on ``[0, 2**53)``. Identical bits from every
        backend and device.
    """
    if out.dtype != torch.int64 or out.dim() != 2 or out.shape[1] != UNIFORMS_PER_BLOCK \
            or not out.is_contiguous():
        raise ParameterValueError("out must be a contiguous int64 tensor of shape (blocks, 8), got "
                         f"{out.dtype} {tuple(out.shape)}")
    _check(key, position, out.shape[0])
    chosen = backend_for(out.device) if backend is None else BACKENDS[backend]
    if not chosen.available(out.device):
        raise ParameterValueError(f"ChaCha20 backend {chosen.name!r} is not available for device "
                         f"{out.device}; available: "
                         f"{[n for n, b in BACKENDS.items() if b.available(out.device)]}")
    if work is not None and (work.dtype != torch.int64 or work.device != out.device
                             or not work.is_contiguous()
                             or work.numel() < TENSOR_WORK_ROWS * out.shape[0]):
        raise ParameterValueError(
            f"work must be a contiguous int64 tensor on {out.device} of at least "
            f"{TENSOR_WORK_ROWS} * {out.shape[0]} elements, got {work.dtype} "
            f"{tuple(work.shape)} on {work.device}")
    chosen.bits53(key, position, out, work)
    return out


def keystream_bytes(key: bytes, position: int, blocks: int) -> bytes:
    """The serialized keystream of ``blocks`` blocks (tensor backend, on the CPU): the
    output words of each block in little-endian order (RFC 8439 sec. 2.3.2)."""
    words = block_words(key, position, blocks).t().contiguous()
    return b"".join(int(w).to_bytes(4, "little") for w in words.reshape(-1).tolist())
