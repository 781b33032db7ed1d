"""The ChaCha20 keystream's 53-bit uniforms as one fused Triton kernel (CUDA devices).

The ``"tensor"`` backend of :mod:`privlearn.torch._chacha` runs the cipher as about 450
integer tensor operations per run, each streaming the run's whole int64 workspace through
the device's memory. Here one kernel launch computes a run: each program instance holds
the 16 state words of :data:`BLOCKS_PER_PROGRAM` blocks in 32-bit registers (four blocks
a lane), runs the 20 rounds (RFC 8439 sec. 2.1-2.3), adds the initial state and writes the
top 53 bits of the block's eight 64-bit little-endian words, the same bits, in the same
layout, as every other backend (``out[j, k] = w >> 11`` for the ``k``-th 64-bit word ``w``
of block ``position + j``). A run that crosses a multiple of ``2**32`` blocks (the RFC
nonce advancing, see the stream definition of :mod:`privlearn.torch._chacha_cipher`) is launched
as one kernel per side of the crossing. The kernel needs no workspace.

Safety net: the kernel is used on a device only after it has passed a self-check there,
once per device at its first use (:func:`passed`): the RFC 8439 sec. 2.3.2 test vector,
and, against the tensor backend on the same device, a random key and a run of blocks from
a random position that crosses a ``2**32`` carry (several programs, a partial last one).
That check synchronises with the host (two comparisons on the device, each read back as
one boolean), with CUDA's synchronisation debug mode off for its duration. If Triton does
not import, the kernel fails to compile or launch, or any word differs, the device keeps
the tensor backend, with one warning; a later launch that raises falls back the same way,
recomputing the whole run with the tensor backend, so no unchecked bits are ever used.
This module imports ``triton``: :mod:`privlearn.torch._chacha` imports it only for CUDA
tensors, when ``triton`` is installed.

References
----------
Y. Nir and A. Langley, "ChaCha20 and Poly1305 for IETF Protocols", RFC 8439, 2018,
sec. 2.1-2.3 and the test vector of sec. 2.3.2.

P. Tillet, H. T. Kung and D. Cox, "Triton: an intermediate language and compiler for tiled
neural network computations", MAPL 2019.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch
import triton
import triton.language as tl

from privlearn.torch import _chacha_cipher as _cipher

__all__ = ["BLOCKS_PER_PROGRAM", "bits53", "interpret_bits53", "launches", "passed", "usable"]

#: ChaCha20 blocks per program instance (4 warps of 32 lanes, 4 blocks a lane).
BLOCKS_PER_PROGRAM = 512
_NUM_WARPS = 4
#: Blocks of the random part of the self-check: several programs and a partial last one.
_CHECK_BLOCKS = 3 * BLOCKS_PER_PROGRAM + 37

#: The RFC 8439 sec. 2.3.2 test vector: key 00:01:..:1f, counter 1, nonce
#: 00:00:00:09:00:00:00:4a:00:00:00:00, and the serialized block.
_RFC_KEY = bytes(range(32))
_RFC_POSITION = int.from_bytes((1).to_bytes(4, "little")
                               + bytes.fromhex("000000090000004a00000000"), "little")
_RFC_BLOCK = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")


def _chacha20_bits53_kernel(out_ptr, blocks, k0, k1, k2, k3, k4, k5, k6, k7, ctr, n0, n1, n2,
                            BLOCK: tl.constexpr):
    """Blocks ``[pid * BLOCK, pid * BLOCK + BLOCK)`` of a run of ``blocks``: word 12 is
    ``ctr + j`` (the caller keeps it below ``2**32``), words 13..15 ``n0, n1, n2``; the
    key words and counters arrive as int32 (their bits), ``out`` is int64 ``(blocks, 8)``.
    The quarter rounds are written out (no helper function), so that one Python function
    serves both the compiler and the interpreter."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = j < blocks
    zero = tl.full([BLOCK], 0, dtype=tl.uint32)
    i0 = zero + 0x61707865
    i1 = zero + 0x3320646E
    i2 = zero + 0x79622D32
    i3 = zero + 0x6B206574
    i4 = zero + k0.to(tl.uint32, bitcast=True)
    i5 = zero + k1.to(tl.uint32, bitcast=True)
    i6 = zero + k2.to(tl.uint32, bitcast=True)
    i7 = zero + k3.to(tl.uint32, bitcast=True)
    i8 = zero + k4.to(tl.uint32, bitcast=True)
    i9 = zero + k5.to(tl.uint32, bitcast=True)
    i10 = zero + k6.to(tl.uint32, bitcast=True)
    i11 = zero + k7.to(tl.uint32, bitcast=True)
    i12 = ctr.to(tl.uint32, bitcast=True) + j.to(tl.uint32)  # j < 2**32: exact
    i13 = zero + n0.to(tl.uint32, bitcast=True)
    i14 = zero + n1.to(tl.uint32, bitcast=True)
    i15 = zero + n2.to(tl.uint32, bitcast=True)
    x0 = i0
    x1 = i1
    x2 = i2
    x3 = i3
    x4 = i4
    x5 = i5
    x6 = i6
    x7 = i7
    x8 = i8
    x9 = i9
    x10 = i10
    x11 = i11
    x12 = i12
    x13 = i13
    x14 = i14
    x15 = i15
    for _ in tl.static_range(10):
        # column round: (0, 4, 8, 12) (1, 5, 9, 13) (2, 6, 10, 14) (3, 7, 11, 15)
        x0 = x0 + x4
        t = x12 ^ x0
        x12 = (t << 16) | (t >> 16)
        x8 = x8 + x12
        t = x4 ^ x8
        x4 = (t << 12) | (t >> 20)
        x0 = x0 + x4
        t = x12 ^ x0
        x12 = (t << 8) | (t >> 24)
        x8 = x8 + x12
        t = x4 ^ x8
        x4 = (t << 7) | (t >> 25)
        x1 = x1 + x5
        t = x13 ^ x1
        x13 = (t << 16) | (t >> 16)
        x9 = x9 + x13
        t = x5 ^ x9
        x5 = (t << 12) | (t >> 20)
        x1 = x1 + x5
        t = x13 ^ x1
        x13 = (t << 8) | (t >> 24)
        x9 = x9 + x13
        t = x5 ^ x9
        x5 = (t << 7) | (t >> 25)
        x2 = x2 + x6
        t = x14 ^ x2
        x14 = (t << 16) | (t >> 16)
        x10 = x10 + x14
        t = x6 ^ x10
        x6 = (t << 12) | (t >> 20)
        x2 = x2 + x6
        t = x14 ^ x2
        x14 = (t << 8) | (t >> 24)
        x10 = x10 + x14
        t = x6 ^ x10
        x6 = (t << 7) | (t >> 25)
        x3 = x3 + x7
        t = x15 ^ x3
        x15 = (t << 16) | (t >> 16)
        x11 = x11 + x15
        t = x7 ^ x11
        x7 = (t << 12) | (t >> 20)
        x3 = x3 + x7
        t = x15 ^ x3
        x15 = (t << 8) | (t >> 24)
        x11 = x11 + x15
        t = x7 ^ x11
        x7 = (t << 7) | (t >> 25)
        # diagonal round: (0, 5, 10, 15) (1, 6, 11, 12) (2, 7, 8, 13) (3, 4, 9, 14)
        x0 = x0 + x5
        t = x15 ^ x0
        x15 = (t << 16) | (t >> 16)
        x10 = x10 + x15
        t = x5 ^ x10
        x5 = (t << 12) | (t >> 20)
        x0 = x0 + x5
        t = x15 ^ x0
        x15 = (t << 8) | (t >> 24)
        x10 = x10 + x15
        t = x5 ^ x10
        x5 = (t << 7) | (t >> 25)
        x1 = x1 + x6
        t = x12 ^ x1
        x12 = (t << 16) | (t >> 16)
        x11 = x11 + x12
        t = x6 ^ x11
        x6 = (t << 12) | (t >> 20)
        x1 = x1 + x6
        t = x12 ^ x1
        x12 = (t << 8) | (t >> 24)
        x11 = x11 + x12
        t = x6 ^ x11
        x6 = (t << 7) | (t >> 25)
        x2 = x2 + x7
        t = x13 ^ x2
        x13 = (t << 16) | (t >> 16)
        x8 = x8 + x13
        t = x7 ^ x8
        x7 = (t << 12) | (t >> 20)
        x2 = x2 + x7
        t = x13 ^ x2
        x13 = (t << 8) | (t >> 24)
        x8 = x8 + x13
        t = x7 ^ x8
        x7 = (t << 7) | (t >> 25)
        x3 = x3 + x4
        t = x14 ^ x3
        x14 = (t << 16) | (t >> 16)
        x9 = x9 + x14
        t = x4 ^ x9
        x4 = (t << 12) | (t >> 20)
        x3 = x3 + x4
        t = x14 ^ x3
        x14 = (t << 8) | (t >> 24)
        x9 = x9 + x14
        t = x4 ^ x9
        x4 = (t << 7) | (t >> 25)
    # the output words (sec. 2.3: the initial state added), then the top 53 bits of each
    # 64-bit little-endian word (x[2k] low half, x[2k+1] high half)
    row = out_ptr + j * 8
    x0 = x0 + i0
    x1 = x1 + i1
    x2 = x2 + i2
    x3 = x3 + i3
    x4 = x4 + i4
    x5 = x5 + i5
    x6 = x6 + i6
    x7 = x7 + i7
    x8 = x8 + i8
    x9 = x9 + i9
    x10 = x10 + i10
    x11 = x11 + i11
    x12 = x12 + i12
    x13 = x13 + i13
    x14 = x14 + i14
    x15 = x15 + i15
    w = (x1.to(tl.uint64) << 21) | (x0 >> 11).to(tl.uint64)
    tl.store(row + 0, w.to(tl.int64, bitcast=True), mask=live)
    w = (x3.to(tl.uint64) << 21) | (x2 >> 11).to(tl.uint64)
    tl.store(row + 1, w.to(tl.int64, bitcast=True), mask=live)
    w = (x5.to(tl.uint64) << 21) | (x4 >> 11).to(tl.uint64)
    tl.store(row + 2, w.to(tl.int64, bitcast=True), mask=live)
    w = (x7.to(tl.uint64) << 21) | (x6 >> 11).to(tl.uint64)
    tl.store(row + 3, w.to(tl.int64, bitcast=True), mask=live)
    w = (x9.to(tl.uint64) << 21) | (x8 >> 11).to(tl.uint64)
    tl.store(row + 4, w.to(tl.int64, bitcast=True), mask=live)
    w = (x11.to(tl.uint64) << 21) | (x10 >> 11).to(tl.uint64)
    tl.store(row + 5, w.to(tl.int64, bitcast=True), mask=live)
    w = (x13.to(tl.uint64) << 21) | (x12 >> 11).to(tl.uint64)
    tl.store(row + 6, w.to(tl.int64, bitcast=True), mask=live)
    w = (x15.to(tl.uint64) << 21) | (x14 >> 11).to(tl.uint64)
    tl.store(row + 7, w.to(tl.int64, bitcast=True), mask=live)

_SCALARS = ["blocks", "k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "ctr", "n0", "n1", "n2"]


@functools.cache
def _kernel(interpret: bool):
    """The kernel, compiled (``interpret=False``) or run by Triton's interpreter on CPU
    tensors (a check of the kernel's arithmetic on a machine without a GPU). Its scalars
    are not specialised on their values (one compilation for every key and run)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_chacha20_bits53_kernel, do_not_specialize=_SCALARS)
    return triton.jit(_chacha20_bits53_kernel, do_not_specialize=_SCALARS)


def _signed32(word: int) -> int:
    """A 32-bit word as the int32 of the same bits (every scalar then has Triton's type
    ``i32``, whatever its value)."""
    return word - (1 << 32) if word >= 1 << 31 else word


#: Launches of the kernel in this process (for tests that count them: a Triton launch is
#: not a torch operation, so a dispatch mode or the profiler's operator list misses it).
_LAUNCHES = [0]


def launches() -> int:
    """How many times the kernel has been launched in this process."""
    return _LAUNCHES[0]


def _launch(key: bytes, position: int, out: torch.Tensor, interpret: bool) -> None:
    kernel = _kernel(interpret)
    key_words = [_signed32(w) for w in _cipher._key_words(key)]
    for off, p, n in _cipher._segments(position, out.shape[0]):
        nonce = p >> 32
        grid = (triton.cdiv(n, BLOCKS_PER_PROGRAM),)
        kernel[grid](out[off:off + n], n, *key_words, _signed32(p & 0xFFFFFFFF),
                     *(_signed32((nonce >> (32 * i)) & 0xFFFFFFFF) for i in range(3)),
                     BLOCK=BLOCKS_PER_PROGRAM, num_warps=_NUM_WARPS)
        _LAUNCHES[0] += 1


def interpret_bits53(key: bytes, position: int, out: torch.Tensor) -> torch.Tensor:
    """The kernel run by Triton's interpreter into the CPU tensor ``out`` (``(blocks, 8)``
    int64, contiguous): for tests on a machine without a GPU. Slow (NumPy per operation)."""
    _cipher._check(key, position, out.shape[0])
    _launch(key, position, out, interpret=True)
    return out


# ------------------------------------------------------------------------ self-check

_LOCK = threading.Lock()
#: Per device (``"cuda:0"``, ...): whether the self-check passed (absent: not run yet).
_PASSED: dict[str, bool] = {}
#: Devices where a launch raised after the self-check passed: the backend stays selected
#: there (a stream keeps its backend) but computes with the tensor backend.
_BROKEN: set[str] = set()
_WARNED: set[str] = set()


def _device_name(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{device.type}:{index}"


def _warn_once(name: str, why: str) -> None:
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(f"privlearn: the Triton ChaCha20 kernel is not used on {name} ({why}); "
                  "secure noise there uses the tensor-operation cipher (same bits, more "
                  "kernel launches)", RuntimeWarning, stacklevel=4)


def _self_check(device: torch.device, interpret: bool = False) -> str | None:
    """None if the kernel reproduces the RFC vector and the tensor backend on ``device``,
    else what went wrong (``interpret``: the interpreter's kernel, on the CPU)."""
    rfc = torch.empty((1, _cipher.UNIFORMS_PER_BLOCK), dtype=torch.int64, device=device)
    _launch(_RFC_KEY, _RFC_POSITION, rfc, interpret)
    words = [int.from_bytes(_RFC_BLOCK[8 * k:8 * k + 8], "little") >> 11 for k in range(8)]
    expected = torch.tensor(words, dtype=torch.int64).to(device)
    key = os.urandom(_cipher.KEY_BYTES)
    r = int.from_bytes(os.urandom(16), "little")
    # a random nonce (words 13..15), a counter 0..99 blocks before it wraps
    position = ((r >> 32) % ((1 << 96) - 1)) << 32 | ((1 << 32) - 1 - (r & 0xFFFFFFFF) % 100)
    mine = torch.empty((_CHECK_BLOCKS, _cipher.UNIFORMS_PER_BLOCK), dtype=torch.int64,
                       device=device)
    _launch(key, position, mine, interpret)
    ref = torch.empty_like(mine)
    _cipher._tensor_bits53(key, position, ref)
    ok_rfc = torch.equal(rfc[0], expected)  # host synchronisations, at first use only
    ok_ref = torch.equal(mine, ref)
    if not ok_rfc:
        return "it does not reproduce the RFC 8439 sec. 2.3.2 test vector"
    if not ok_ref:
        return "it differs from the tensor-operation cipher on a random key"
    return None


def passed(device: torch.device) -> bool:
    """Whether the kernel passed its self-check on ``device`` (a CUDA device), running the
    check at the first call per device; a failed check warns once."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    name = _device_name(device)
    verdict = _PASSED.get(name)
    if verdict is not None:
        return verdict
    with _LOCK:
        if name in _PASSED:
            return _PASSED[name]
        debug = None
        try:
            debug = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            with torch.cuda.device(device):
                why = _self_check(torch.device(name))
        except Exception as e:  # noqa: BLE001 - any failure keeps the checked fallback
            why = f"{type(e).__name__}: {e}"
        finally:
            if debug is not None:
                torch.cuda.set_sync_debug_mode(debug)
        _PASSED[name] = why is None
        if why is not None:
            _warn_once(name, f"its self-check failed: {why}")
        return _PASSED[name]


def usable(device: torch.device) -> bool:
    """Whether tensors on ``device`` get the kernel: it passed its self-check there
    (:func:`passed`) and no launch has raised there since."""
    return passed(device) and _device_name(device) not in _BROKEN


def bits53(key: bytes, position: int, out: torch.Tensor,
           work: torch.Tensor | None = None) -> None:
    """The ``"triton"`` backend's ``bits53`` (see :class:`privlearn.torch._chacha.Backend`):
    the kernel on a device where it is :func:`usable`, else (or if a launch raises) the
    tensor backend, which writes the same bits into all of ``out``."""
    if usable(out.device):
        try:
            with torch.cuda.device(out.device):
                _launch(key, position, out, interpret=False)
            return
        except Exception as e:  # noqa: BLE001 - recomputed below by the checked backend
            name = _device_name(out.device)
            _BROKEN.add(name)
            _warn_once(name, f"a launch failed: {type(e).__name__}: {e}")
    _cipher._tensor_bits53(key, position, out, work)
