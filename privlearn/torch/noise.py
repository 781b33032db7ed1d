"""Gaussian noise for DP-SGD, drawn on the device of the tensor it goes into.

Default mode: one ``torch.Generator`` per device (Mersenne Twister on the CPU, Philox on
CUDA), created the first time a tensor on that device is filled: the CPU's seeded with the
source's seed, any other device's with a hash of the seed and the device's name
(:func:`device_seed`), so no two devices share a stream, and two sources with different
seeds (one per distributed rank) have independent streams. The noise is drawn straight
into the given tensor, in its dtype, on its device: no host copy, no host
synchronisation. Fast, reproducible (a loaded state replays its noise; an unseeded run
re-keys on resume, :mod:`privlearn.torch._rekey`), fine for research. The engine calls
:meth:`NoiseSource.advance` after every step: the seed moves along a one-way hash chain,
so a saved state replays the noise of the steps after it but not of those before; whoever
knows the seed passed to ``make_private`` can still replay the whole run.

``secure_mode=True`` addresses two attacks on that textbook implementation:

* **Predictable generator.** A Mersenne-Twister state can be reconstructed from its
  outputs. Secure mode draws its bits from ChaCha20 (RFC 8439, a cryptographically secure
  stream cipher) keyed with 32 bytes from the operating system's CSPRNG (``os.urandom``),
  a fresh key for every source and device, never stored in a state dict; its block
  position only moves forward, so no keystream block is used twice. The cipher runs on the
  tensor's own device as integer tensor operations (:mod:`privlearn.torch._chacha`), on
  CUDA with ``triton`` installed as one fused kernel checked at its first use on each
  device (:mod:`privlearn.torch._chacha_triton`), and so does the transform below; on
  the CPU, OpenSSL's ChaCha20 (through the optional ``cryptography`` package, when
  installed) produces the same bits faster, and the transform runs in NumPy (the same
  operations; see :func:`_numpy_chunks` for why).
* **Floating-point attack** (Mironov 2012, "On Significance of the Least Significant Bits
  for Differential Privacy", CCS): floating-point samplers do not produce every float
  with the probability of the ideal distribution; the set of reachable outputs of
  ``x + noise`` depends on ``x``, so the low-order bits of a released value can reveal the
  un-noised value and break DP entirely. The mitigation of Holohan & Braghin 2021
  ("Secure Random Sampling in Differential Privacy", ESORICS), also used by Opacus, is to
  sample in double precision from 53-bit uniforms (Box-Muller) and return the normalised
  sum of ``n = 4`` independent draws, ``(Z_1 + ... + Z_4) / 2``, which has the same N(0, 1)
  law while smoothing the gaps that make the attack work; here it is scaled by ``std`` in
  double precision and rounded once to the output dtype: what the mitigation needs is this
  noise, whose values at the output's precision have the ideal law's probabilities.
  :meth:`NoiseSource.add_normal_` forms ``x + noise`` in double precision and rounds that
  value once to the output dtype (two roundings of the exact sum, the second a fixed
  function of the float64 noisy value); the DP optimizer draws into its gradient buffer
  and adds the clipped sums there. A mitigation; exact discrete samplers are the complete
  fix (Canonne, Kamath & Steinke 2020).

The uniforms keep all 53 bits on every device and for every output dtype, although a
float32 output has only 24 significand bits: they set how far the tails reach. A
Box-Muller radius from ``k``-bit uniforms never exceeds ``sqrt(2 k ln 2)`` (8.57 for
``k = 53``, 6.66 for ``k = 32``), a tail of probability ``2**-k`` per pair (two pairs per
coordinate) that the ideal Gaussian the accountant assumes has and the sampler never
produces. Over GPT-2 small's 124M coordinates that tail is a probability of up to 6% per
step with ``k = 32`` (so 32-bit uniforms are not used), up to ``3e-8`` with ``k = 53``.
Timing attacks (Jin et al. 2022) find nothing to measure in the draw: its operations and
their number depend only on the size of the output, never on the values drawn
(Box-Muller, no rejection sampling).

Secure noise is computed in chunks, so the memory it needs beyond the output stays
bounded: on the CPU, :data:`SECURE_CHUNK_ELEMENTS` (2**16 elements, 96 bytes of scratch
each: 6 MB, in cache); on an accelerator, as many elements as
:data:`SECURE_SCRATCH_BYTES` allows at :data:`SECURE_BYTES_PER_ELEMENT` (112) bytes each
(144 for float16 and bfloat16 outputs; by default ``min(8 GiB, 1/8 of the device's
memory)``), where a chunk is about 470 kernel launches whatever its size (about 23 with
the fused Triton kernel). A
non-contiguous output also takes one contiguous copy of itself.

References
----------
I. Mironov, "On Significance of the Least Significant Bits for Differential Privacy",
CCS 2012.

N. Holohan and S. Braghin, "Secure Random Sampling in Differential Privacy", ESORICS 2021,
sec. 4 (the sum of ``n`` Gaussian draws scaled by ``1 / sqrt(n)``).

J. Jin, E. McMurtry, B. I. P. Rubinstein and O. Ohrimenko, "Are We There Yet?
Timing and Floating-Point Attacks on Differential Privacy Systems", IEEE S&P 2022.

S. Boldo and G. Melquiond, "Emulation of FMA and Correctly Rounded Sums: Proved
Algorithms Using Rounding to Odd", IEEE Trans. Computers 57(4), 2008 (the single rounding
to half precision).

G. E. P. Box and M. E. Muller, "A Note on the Generation of Random Normal Deviates",
Ann. Math. Statist. 29(2), 1958.

Y. Nir and A. Langley, "ChaCha20 and Poly1305 for IETF Protocols", RFC 8439, 2018.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import numbers
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
from privlearn.torch import _chacha
from privlearn.torch._state_checks import entry, refuse_rewind

__all__ = ["NoiseSource", "device_seed", "SECURE_BYTES_PER_ELEMENT", "SECURE_CHUNK_ELEMENTS",
           "SECURE_SCRATCH_BYTES"]

#: Output elements per chunk of secure noise, by device type; a type not listed (an
#: accelerator) gets chunks sized by :data:`SECURE_SCRATCH_BYTES`. The CPU's chunks (96
#: bytes of scratch per element, 6 MB) stay in cache: measured on a 2-core EPYC, 10M draws
#: in 0.15 s with 2**16, 0.2 s with 2**12 (per-operation overhead) or 2**18.
SECURE_CHUNK_ELEMENTS: dict[str, int] = {"cpu": 1 << 16}

#: Scratch memory, in bytes, a secure draw may use on an accelerator, by device type; a
#: type not listed gets ``min(8 GiB, 1/8 of the device's memory)``. There a chunk is about
#: 480 kernel launches whatever its size (the cipher's 20 rounds as tensor operations,
#: :mod:`privlearn.torch._chacha`, or one launch of the fused Triton kernel on CUDA, and
#: the Holohan-Braghin transform), and takes
#: :data:`SECURE_BYTES_PER_ELEMENT` bytes of scratch per element, so chunks are as large as
#: the budget allows: with 8 GiB, at most 76.7M float32 or float64 elements a chunk, and
#: GPT-2 small's 124.4M parameters take two chunks of 62.2M (7.0 GB of scratch, about 960
#: launches; with fixed chunks of 2**21 elements it took 60 chunks and 45 thousand).
SECURE_SCRATCH_BYTES: dict[str, int] = {}
_DEFAULT_SECURE_SCRATCH = 8 << 30

#: Scratch bytes per element of a chunk of secure noise with the tensor cipher: its
#: workspace (``TENSOR_WORK_ROWS`` int64 words per block of two elements), which the
#: 53-bit uniforms and the float64 Holohan-Braghin arrays reuse; float16 and bfloat16
#: outputs add up to 32 for their single rounding (:func:`_copy_rounded_`).
SECURE_BYTES_PER_ELEMENT = _chacha.TENSOR_WORK_ROWS * 8 // 2
_HALF_ROUNDING_BYTES = 32

#: Output elements per chunk of the scratch buffer of :meth:`NoiseSource.add_normal_`
#: in the default mode.
_ADD_CHUNK_ELEMENTS = 1 << 22

_STATE_FORMAT = "privlearn.torch.NoiseSource/1"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: A bound on ``|Z|`` for both samplers: a Box-Muller draw from 53-bit uniforms never
#: exceeds ``sqrt(2 * 53 * ln 2) ~ 8.57`` (torch's from fewer bits, less), so the
#: Holohan-Braghin sum of four, halved, never exceeds ``4 * 8.57 / 2 ~ 17.2``.
_MAX_ABS_Z = 18.0
_WIDER = {torch.float16: "draw into float32, or ", torch.bfloat16: "draw into float32, or ",
          torch.float32: "draw into float64, or "}  # what a std outside a dtype's range can do


def _device_key(device: torch.device | str) -> str:
    """Canonical name of a device (``"cpu"``, ``"cuda:0"``, ...): an index is always
    given for accelerators, the current one when the device names none."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "meta":
        raise ParameterValueError("cannot draw noise into a tensor on the 'meta' device (it has no "
                         "data); materialise it on a real device first")
    index = device.index
    if index is None:
        module = getattr(torch, device.type, None)
        current = getattr(module, "current_device", None)
        index = int(current()) if callable(current) else 0
    return f"{device.type}:{index}"


def device_seed(seed: int, device: torch.device | str) -> int:
    """The seed of a default-mode source's generator on ``device``.

    On the CPU, the source's seed itself, as ``torch.Generator.manual_seed`` maps it (a
    negative seed to its two's complement, ``seed mod 2**64``), so that
    ``torch.Generator().manual_seed(seed)`` replays a source's CPU noise. On any other
    device, a 64-bit BLAKE2b hash of the seed and the device's canonical name
    (``"cuda:0"``), so that no device shares another's stream (nor, but with probability
    ``2**-64``, the CPU stream of another source). A seed outside ``manual_seed``'s range
    ``[-2**63, 2**64)`` is hashed on the CPU too.

    Parameters
    ----------
    seed : int
        The source's seed (any integer).
    device : torch.device or str
        The device.

    Returns
    -------
    int
        In ``[0, 2**64)``.
    """
    seed = int(seed)
    key = _device_key(device)
    if key == "cpu" and -(2**63) <= seed < 2**64:
        return seed % 2**64
    text = f"privlearn.torch.noise:{seed}:{key}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _scratch_budget(device: torch.device) -> int:
    """:data:`SECURE_SCRATCH_BYTES` of ``device``'s type, or ``min(8 GiB, 1/8 of its
    memory)`` (its total memory, or on MPS the recommended working set; 8 GiB where
    torch reports neither)."""
    budget = SECURE_SCRATCH_BYTES.get(device.type)
    if budget is not None:
        return int(budget)
    module = getattr(torch, device.type, None)
    props = getattr(module, "get_device_properties", None)
    recommended = getattr(module, "recommended_max_memory", None)  # MPS: unified memory
    try:
        total = (int(props(device).total_memory) if callable(props)
                 else int(recommended()) if callable(recommended) else None)
    except (AttributeError, RuntimeError, TypeError, ValueError, AssertionError):
        total = None
    return _DEFAULT_SECURE_SCRATCH if not total else min(_DEFAULT_SECURE_SCRATCH, total // 8)


def _secure_chunk(device: torch.device, n: int, dtype: torch.dtype) -> int:
    """Output elements per chunk of a secure draw of ``n`` elements (even: Box-Muller
    pairs). :data:`SECURE_CHUNK_ELEMENTS` where the device type is listed (the CPU);
    otherwise as many elements as :func:`_scratch_budget` holds at
    :data:`SECURE_BYTES_PER_ELEMENT` each, the draw cut into that many chunks of equal
    size (two chunks of ``n / 2``, not one full and one nearly empty)."""
    fixed = SECURE_CHUNK_ELEMENTS.get(device.type)
    if fixed is not None:
        chunk = min(int(fixed), n)
    else:
        per = SECURE_BYTES_PER_ELEMENT + (
            _HALF_ROUNDING_BYTES if dtype in (torch.float16, torch.bfloat16) else 0)
        most = max(2, _scratch_budget(device) // per)
        pieces = -(-n // most)
        chunk = -(-n // pieces)
    return max(2, chunk + (chunk & 1))


class _SecureStream:
    """The ChaCha20 stream of one device: a fresh key and the next unused block."""

    __slots__ = ("key", "position", "backend")

    def __init__(self, device: torch.device):
        self.key = os.urandom(_chacha.KEY_BYTES)
        self.position = 0
        self.backend = _chacha.backend_for(device)

    def take(self, blocks: int) -> int:
        """Reserve ``blocks`` blocks; returns the position of the first."""
        start = self.position
        if start + blocks > _chacha.POSITION_LIMIT:  # 2**128 blocks: never in practice
            raise ConfigurationError("the secure noise stream of this device is exhausted "
                                     "(2**128 ChaCha20 blocks); make a new NoiseSource")
        self.position = start + blocks
        return start


def _holohan_braghin_(bits: torch.Tensor, u: torch.Tensor, w: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
    """``(Z_1 + Z_2 + Z_3 + Z_4) / 2`` for ``m`` elements from ``4 m`` 53-bit uniform integers.

    ``bits``: ``4 m`` int64 in ``[0, 2**53)``; ``u``: float64 ``(4, m)``; ``w``, ``v``:
    float64 ``(2, m)``, scratch; ``m`` even. Returns ``v[0]``. All in float64.

    Rows 0-1 of ``u`` give the radii ``r = sqrt(-2 ln u_1)`` with ``u_1 = (b + 1) 2**-53`` in
    ``(0, 1]``, rows 2-3 the angles ``theta = 2 pi u_2`` with ``u_2 = b 2**-53`` in ``[0, 1)``:
    ``2 m`` Box-Muller pairs, each giving two independent N(0, 1) draws ``r cos theta`` and
    ``r sin theta``. The cosine and sine are formed from ``tau = tan(theta / 2)`` (finite:
    ``theta / 2`` is never exactly ``pi / 2``) as ``cos = (1 - tau^2) / (1 + tau^2)``,
    ``sin = 2 tau / (1 + tau^2)``: the same values up to rounding, from one vectorised
    function (NumPy's float64 ``sin`` and ``cos`` are scalar code, ten times slower than its
    ``tan``). Element ``j`` sums the cosine draws of pairs ``(0, j)``, ``(1, j)`` and the sine
    draws of pairs ``(0, k)``, ``(1, k)`` with ``k = j + m/2 (mod m)``: four draws from four
    distinct pairs, independent, and no draw is used twice, so the elements are independent
    too. The sum is formed as ``(c_0 + c_1) / 2 + (s_0 + s_1) / 2`` with the halving of the
    sines folded into their factor 2 (``sin = 2 tau / ...``): scaling by 2 is exact, so
    this is bit for bit ``(c_0 + c_1 + (s_0 + s_1)) / 2`` with one pass fewer.
    """
    m = u.shape[1]
    h = m // 2
    u.view(-1).copy_(bits)  # exact: every value is below 2**53
    r, tau = u[0:2], u[2:4]
    r.add_(1.0).mul_(2.0**-53).log_().mul_(-2.0).sqrt_()
    tau.mul_(math.pi * 2.0**-53).tan_()
    torch.mul(tau, tau, out=w)
    torch.add(w, 1.0, out=v)
    r.div_(v)  # r / (1 + tau^2)
    w.neg_().add_(1.0).mul_(r)  # r cos theta
    tau.mul_(r)  # r sin theta / 2
    z, s = v[0], v[1]
    torch.add(w[0], w[1], out=z).mul_(0.5)
    torch.add(tau[0], tau[1], out=s)
    z[:h].add_(s[h:])
    z[h:].add_(s[:h])
    return z


def _holohan_braghin_numpy(bits: np.ndarray, u: np.ndarray, w: np.ndarray,
                           v: np.ndarray) -> np.ndarray:
    """:func:`_holohan_braghin_` in NumPy: the same operations, in the same order."""
    m = u.shape[1]
    h = m // 2
    u.reshape(-1)[:] = bits
    r, tau = u[0:2], u[2:4]
    r += 1.0
    r *= 2.0**-53
    np.log(r, out=r)
    r *= -2.0
    np.sqrt(r, out=r)
    tau *= math.pi * 2.0**-53
    np.tan(tau, out=tau)
    np.multiply(tau, tau, out=w)
    np.add(w, 1.0, out=v)
    r /= v
    np.subtract(1.0, w, out=w)
    w *= r
    tau *= r
    z, s = v[0], v[1]
    np.add(w[0], w[1], out=z)
    z *= 0.5
    np.add(tau[0], tau[1], out=s)
    z[:h] += s[h:]
    z[h:] += s[:h]
    return z


def _to_odd_float32(src: torch.Tensor) -> torch.Tensor:
    """float64 ``src`` rounded to float32 *to odd*: truncated toward zero, then the last
    bit set if anything was cut off (see :func:`_copy_rounded_`)."""
    y = src.to(torch.float32)
    y = torch.where(y.double().abs() > src.abs(), torch.nextafter(y, torch.zeros_like(y)), y)
    y.view(torch.int32).bitwise_or_((y.double() != src).to(torch.int32))
    return y


def _copy_rounded_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst <- src`` (float64) rounded once, to nearest (ties to even), to ``dst``'s dtype.

    torch converts float64 to float16 and bfloat16 through float32: two roundings, which
    now and then land one unit away from the nearest value. Rounding to float32 *to odd*
    first (truncate, then set the last bit if anything was cut off) makes the second
    rounding give exactly the nearest half-precision value, float32 having at least two
    more significand bits than either (Boldo & Melquiond 2008, Theorem 5).
    """
    if dst.dtype in (torch.float32, torch.float64):
        dst.copy_(src)
        return
    dst.copy_(_to_odd_float32(src))


@dataclass(frozen=True)
class _SecureJob:
    """One secure draw: write (or add) ``std * HB`` from the stream ``key`` at block
    ``first`` on into the contiguous 1-D ``pieces`` (one dtype, one device), laid end to
    end as one sequence of ``n`` elements, in chunks of ``chunk`` elements."""

    key: bytes
    backend: str
    first: int
    pieces: tuple[torch.Tensor, ...]
    chunk: int
    std: float
    add: bool

    @property
    def ends(self) -> list[int]:
        """Cumulative sizes: piece ``i`` holds elements ``[ends[i-1], ends[i])``."""
        return list(itertools.accumulate(p.numel() for p in self.pieces))

    def overlaps(self, ends: list[int], start: int, m: int
                 ) -> Iterator[tuple[int, int, int, int]]:
        """``(lo, hi, i, at)``: elements ``[start + lo, start + hi)`` of the sequence are
        elements ``[at, at + hi - lo)`` of piece ``i``."""
        i = bisect.bisect_right(ends, start)
        while i < len(ends) and ends[i] - self.pieces[i].numel() < start + m:
            begin = ends[i] - self.pieces[i].numel()
            lo, hi = max(begin, start), min(ends[i], start + m)
            if hi > lo:
                yield lo - start, hi - start, i, lo - begin
            i += 1


def _torch_chunks(job: _SecureJob, starts: range) -> None:
    """The chunks ``starts`` of a job, with torch operations on the pieces' device (no
    host copy, no host synchronisation), in one workspace of
    :data:`SECURE_BYTES_PER_ELEMENT` bytes per chunk element: the cipher's state, then,
    in the same memory, the 53-bit uniforms (in the rows the cipher leaves free) and the
    float64 arrays of the transform. Per chunk, besides the cipher and the transform: one
    or two operations per piece it covers (the addition, the copy) and, for half-precision
    pieces, one rounding to odd."""
    ends = job.ends
    n, chunk, dev = ends[-1], job.chunk, job.pieces[0].device
    half = job.pieces[0].dtype in (torch.float16, torch.bfloat16)
    rows = _chacha.TENSOR_WORK_ROWS
    out_lo, out_hi = _chacha.TENSOR_OUT_ROWS
    work = torch.empty(rows * (chunk // 2), dtype=torch.int64, device=dev)
    for start in starts:
        m = min(chunk, n - start)
        m2 = m + (m & 1)
        blocks = m2 // 2
        ws = work[:rows * blocks]
        bits = ws[out_lo * blocks:out_hi * blocks].view(blocks, _chacha.UNIFORMS_PER_BLOCK)
        _chacha.uniform_bits53(job.key, job.first + start // 2, bits, backend=job.backend,
                               work=ws)
        f = ws[:16 * blocks].view(torch.float64)  # the state's rows, free once bits is out
        normal = _holohan_braghin_(bits.view(-1), f[:4 * m2].view(4, m2),
                                   f[4 * m2:6 * m2].view(2, m2),
                                   f[6 * m2:8 * m2].view(2, m2))[:m]
        normal.mul_(job.std)
        parts = [(lo, hi, job.pieces[i][at:at + hi - lo])
                 for lo, hi, i, at in job.overlaps(ends, start, m)]
        if not half:  # the sum (or the draw) in float64, then rounded to the piece's dtype
            for lo, hi, piece in parts:
                if job.add:
                    piece.add_(normal[lo:hi])
                else:
                    piece.copy_(normal[lo:hi])
            continue
        if job.add:
            for lo, hi, piece in parts:
                normal[lo:hi].add_(piece)
        rounded = _to_odd_float32(normal)
        for lo, hi, piece in parts:
            piece.copy_(rounded[lo:hi])  # one rounding after the rounding to odd


def _numpy_chunks(job: _SecureJob, starts: range) -> None:
    """The chunks ``starts`` of a job on CPU tensors, in NumPy, in the calling thread.

    Torch would run each operation in an OpenMP parallel region, and a secure draw is
    thousands of short operations: on a machine whose cores other processes also use, the
    OpenMP threads, which spin between regions, then slowed the draw more than ten-fold
    (measured on a loaded 2-core machine: 124M draws in 60 s, against 4 s there with
    ``OMP_WAIT_POLICY=PASSIVE``). NumPy runs each operation in this thread, unaffected.
    """
    ends = job.ends
    n, chunk = ends[-1], job.chunk
    bits_t = torch.empty((chunk // 2, _chacha.UNIFORMS_PER_BLOCK), dtype=torch.int64)
    bits = bits_t.numpy()
    u = np.empty(4 * chunk)
    w = np.empty(2 * chunk)
    v = np.empty(2 * chunk)
    numpy_dtype = job.pieces[0].dtype != torch.bfloat16  # NumPy has no bfloat16
    dsts = [p.numpy() for p in job.pieces] if numpy_dtype else None
    for start in starts:
        m = min(chunk, n - start)
        m2 = m + (m & 1)
        blocks = m2 // 2
        _chacha.uniform_bits53(job.key, job.first + start // 2, bits_t[:blocks],
                               backend=job.backend)
        normal = _holohan_braghin_numpy(bits[:blocks].reshape(-1), u[:4 * m2].reshape(4, m2),
                                        w[:2 * m2].reshape(2, m2), v[:2 * m2].reshape(2, m2))[:m]
        normal *= job.std
        parts = list(job.overlaps(ends, start, m))
        if numpy_dtype:
            for lo, hi, i, at in parts:
                dst = dsts[i][at:at + hi - lo]
                if job.add:
                    normal[lo:hi] += dst
                dst[:] = normal[lo:hi]  # the float64 value, rounded to nearest even
            continue
        zt = torch.from_numpy(normal)
        pieces = [(lo, hi, job.pieces[i][at:at + hi - lo]) for lo, hi, i, at in parts]
        if job.add:
            for lo, hi, piece in pieces:
                zt[lo:hi].add_(piece)
        rounded = _to_odd_float32(zt)
        for lo, hi, piece in pieces:
            piece.copy_(rounded[lo:hi])


#: How a secure draw computes its chunks, by device type; any other type:
#: :func:`_torch_chunks` (torch operations on the device).
_CHUNK_WORKERS: dict[str, Callable[[_SecureJob, range], None]] = {"cpu": _numpy_chunks}


def _check_std(std, dtype: torch.dtype) -> float:
    if isinstance(std, (torch.Tensor, bool)) or not isinstance(std, numbers.Real):
        raise ParameterTypeError(f"std must be a real number (a Python float), got "
                                 f"{type(std).__name__}; a tensor would need a host sync")
    std = float(std)
    if not (math.isfinite(std) and std >= 0.0):
        raise ParameterValueError(f"std must be a finite number >= 0, got {std!r}")
    info = torch.finfo(dtype)
    if std > 0.0 and std < info.tiny:
        raise ParameterValueError(
            f"std={std!r} is below the smallest normal {dtype} ({info.tiny:.3g}): the noise "
            "would round to subnormals, weaker than the accounted Gaussian (in training std "
            f"= noise_multiplier * max_grad_norm / batch); {_WIDER.get(dtype, '')}raise them")
    if std * _MAX_ABS_Z > info.max:
        raise ParameterValueError(
            f"std={std!r} is too large for {dtype} (largest {info.max:.3g}): draws would "
            "overflow to inf (in training std = noise_multiplier * max_grad_norm / batch); "
            f"{_WIDER.get(dtype, '')}lower noise_multiplier or max_grad_norm")
    return std


def _check_out(out) -> None:
    if not isinstance(out, torch.Tensor):
        raise ParameterTypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype not in _DTYPES:
        raise ParameterTypeError(f"out must have a floating dtype in "
                        f"{[str(d) for d in _DTYPES]}, got {out.dtype}; draw into a float "
                        "tensor and convert")


class NoiseSource:
    """Draws i.i.d. ``N(0, std^2)`` noise into tensors, on their own devices.

    Parameters
    ----------
    secure_mode : bool
        Draw from ChaCha20 keyed by the OS CSPRNG, with the Holohan-Braghin sum of four
        double-precision Box-Muller draws (see the module docstring); not replayable.
    seed : int, optional
        Seed of the default mode's generators (each device's is :func:`device_seed` of it);
        OS entropy when None. Must be None in secure mode (a seeded secure generator is not
        secure). Distributed ranks pass different seeds, and so draw independent noise.

    Notes
    -----
    :meth:`fill_normal_` and :meth:`add_normal_` are the interface: they write into a
    tensor in place, on its device and in its dtype. :meth:`standard_normal`,
    :meth:`normal` and :attr:`generator` (the CPU generator) remain for callers that draw
    on the CPU.
    """

    def __init__(self, secure_mode: bool = False, seed: int | None = None):
        if secure_mode and seed is not None:
            raise ConfigurationError("seed must be None when secure_mode=True (a seeded secure "
                             f"generator is not secure), got seed={seed!r}")
        if seed is not None:
            try:
                seed = operator.index(seed)
            except TypeError:
                raise ParameterTypeError(f"seed must be an integer or None, got "
                                f"{type(seed).__name__} {seed!r}") from None
        self._secure = bool(secure_mode)
        if self._secure:
            self._seed = None
        else:
            self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        self._generators: dict[str, torch.Generator] = {}
        self._pending: dict[str, torch.Tensor] = {}  # loaded states of devices not yet used
        self._streams: dict[str, _SecureStream] = {}
        self._buffer: torch.Tensor | None = None

    # ------------------------------------------------------------------ properties

    @property
    def secure_mode(self) -> bool:
        """Whether noise comes from ChaCha20 with the Holohan-Braghin sum."""
        return self._secure

    @property
    def seed(self) -> int | None:
        """The seed of the default-mode generators (None in secure mode)."""
        return self._seed

    def __repr__(self) -> str:
        if self._secure:
            return "NoiseSource(secure_mode=True)"
        return f"NoiseSource(seed={self._seed})"

    def generator_for(self, device: torch.device | str) -> torch.Generator:
        """The default mode's generator of ``device``, created on first use.

        Raises
        ------
        ValueError
            In secure mode (there is no ``torch.Generator``).
        """
        if self._secure:
            raise ParameterValueError(
                "a secure NoiseSource has no torch.Generator (its noise comes "
                "from ChaCha20); use fill_normal_ / add_normal_")
        key = _device_key(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=torch.device(key))
            pending = self._pending.pop(key, None)
            if pending is None:
                gen.manual_seed(device_seed(self._seed, key))
            else:
                gen.set_state(pending)
            self._generators[key] = gen
        return gen

    @property
    def generator(self) -> torch.Generator:
        """The CPU generator (default mode)."""
        return self.generator_for("cpu")

    def advance(self) -> None:
        """Forward secrecy: after a training step, replace the seed by a one-way hash of
        it, ``seed <- BLAKE2b("privlearn.torch.noise.ratchet" || seed)`` (63 bits), and
        re-seed every device's generator from the new seed. A state saved afterwards
        (:meth:`state_dict`) replays the next steps' noise but none of the steps before: a
        checkpoint of a training run is a release, and the noise of its past steps must not
        be recoverable from it (with past noise and two consecutive models, the un-noised
        update would be). No-op in secure mode (nothing is stored); no host
        synchronisation (re-seeding is a host-side operation on the generator)."""
        if self._secure:
            return
        digest = hashlib.blake2b(b"privlearn.torch.noise.ratchet"
                                 + int(self._seed).to_bytes(16, "little", signed=True),
                                 digest_size=8).digest()
        self._seed = int.from_bytes(digest, "little") >> 1
        for key, gen in self._generators.items():
            gen.manual_seed(device_seed(self._seed, key))
        self._pending = {}

    # ---------------------------------------------------------------------- drawing

    def fill_normal_(self, out: torch.Tensor, std: float) -> torch.Tensor:
        """Overwrite ``out`` with i.i.d. ``N(0, std^2)`` draws, in place.

        On ``out``'s device and in its dtype (float16, bfloat16, float32 or float64), with
        no host copy and no host synchronisation. In the default mode this is exactly
        ``out.normal_(0, std, generator=...)`` with the device's generator.

        Parameters
        ----------
        out : torch.Tensor
            The tensor to fill (any shape and layout).
        std : float
            Standard deviation, finite and ``>= 0``; ``0`` gives zeros (and draws nothing).

        Returns
        -------
        torch.Tensor
            ``out``.

        Raises
        ------
        TypeError
            ``out`` is not a floating tensor of a supported dtype, or ``std`` is not a real
            number.
        ValueError
            ``std`` is negative or not finite, or outside what the dtype can hold (noise
            below its smallest normal number, or overflowing it).
        """
        _check_out(out)
        std = _check_std(std, out.dtype)
        with torch.no_grad():
            if std == 0.0 or out.numel() == 0:
                return out.zero_()
            if self._secure:
                return self._secure_draw_(out, std, add=False)
            return out.normal_(0.0, std, generator=self.generator_for(out.device))

    def add_normal_(self, out: torch.Tensor, std: float) -> torch.Tensor:
        """``out += N(0, std^2)`` (i.i.d. per element), in place, on ``out``'s device.

        Default mode: the noise is drawn into a scratch buffer of at most 4M elements at a
        time (float32, float64 for a float64 ``out``) and added. Secure mode: the sum is
        formed in float64 and that value rounded once to ``out``'s dtype (two roundings
        of the exact sum, the second a fixed function of the float64 value).

        Parameters
        ----------
        out : torch.Tensor
            The tensor to add noise to.
        std : float
            Standard deviation, finite and ``>= 0``; ``0`` leaves ``out`` unchanged.

        Returns
        -------
        torch.Tensor
            ``out``.

        Raises
        ------
        TypeError, ValueError
            As :meth:`fill_normal_`.
        """
        _check_out(out)
        std = _check_std(std, out.dtype)
        with torch.no_grad():
            if std == 0.0 or out.numel() == 0:
                return out
            if self._secure:
                return self._secure_draw_(out, std, add=True)
            gen = self.generator_for(out.device)
            target = out if out.is_contiguous() else out.contiguous()
            flat = target if target.dim() == 1 else target.view(-1)
            n = flat.numel()
            scratch = torch.empty(min(n, _ADD_CHUNK_ELEMENTS), device=out.device, dtype=(
                torch.float64 if out.dtype == torch.float64 else torch.float32))
            for start in range(0, n, scratch.numel()):  # one chunk: no pieces viewed
                piece = flat if n == scratch.numel() else flat[start:start + scratch.numel()]
                z = scratch if n == scratch.numel() else scratch[:piece.numel()]
                piece.add_(z.normal_(0.0, std, generator=gen))
            if target is not out:
                out.copy_(target)
            return out

    def fill_normal_foreach_(self, tensors: Sequence[torch.Tensor],
                             std: float) -> list[torch.Tensor]:
        """:meth:`fill_normal_` on each of ``tensors``, in as few draws as possible.

        Every element gets an independent ``N(0, std^2)`` draw, as with one
        :meth:`fill_normal_` per tensor. In secure mode the tensors that share a device and
        a dtype are filled by one draw, as if they were one flat tensor: on an accelerator
        one set of chunks of the cipher (about 470 kernel launches a chunk, 23 with the
        fused Triton kernel, see
        :data:`SECURE_SCRATCH_BYTES`) plus one or two operations per tensor, instead of a
        set of chunks per tensor. The tensors should not share memory (an element
        written twice keeps its last draw).

        Parameters
        ----------
        tensors : list or tuple of torch.Tensor
            The tensors to fill (any shapes, devices and supported dtypes).
        std : float
            Standard deviation, as :meth:`fill_normal_`.

        Returns
        -------
        list of torch.Tensor
            ``tensors``.

        Raises
        ------
        TypeError, ValueError
            As :meth:`fill_normal_`, for any of the tensors (nothing is drawn then).
        """
        return self._foreach_(tensors, std, add=False)

    def add_normal_foreach_(self, tensors: Sequence[torch.Tensor],
                            std: float) -> list[torch.Tensor]:
        """:meth:`add_normal_` on each of ``tensors``, in as few draws as possible (see
        :meth:`fill_normal_foreach_`); in secure mode each sum is formed in float64 and
        that float64 value rounded once to the tensor's dtype (:meth:`add_normal_`).
        The tensors should not share memory (an element shared by two gets both
        draws)."""
        return self._foreach_(tensors, std, add=True)

    def _foreach_(self, tensors, std, add: bool) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, list | tuple):
            raise ParameterTypeError(
                f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}; "
                "for one tensor use fill_normal_ / add_normal_")
        tensors = list(tensors)
        for t in tensors:
            _check_out(t)
        std = _check_std(std, torch.float64)
        for dtype in {t.dtype for t in tensors}:
            _check_std(std, dtype)
        one = self.add_normal_ if add else self.fill_normal_
        if not self._secure or std == 0.0:
            for t in tensors:
                one(t, std)
            return tensors
        groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                groups.setdefault((_device_key(t.device), t.dtype), []).append(t)
        with torch.no_grad():
            for group in groups.values():
                self._secure_draws_(group, std, add)
        return tensors

    def _secure_draw_(self, out: torch.Tensor, std: float, add: bool) -> torch.Tensor:
        self._secure_draws_([out], std, add)
        return out

    def _secure_draws_(self, outs: list[torch.Tensor], std: float, add: bool) -> None:
        """One secure draw into the tensors ``outs`` (one device, one dtype), laid end to
        end: the same noise as one draw into their concatenation."""
        device = outs[0].device
        key = _device_key(device)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _SecureStream(device)
        targets = []
        for out in outs:
            if out.is_contiguous():
                targets.append(out)
            else:  # one contiguous copy; its values matter only when adding
                targets.append(out.contiguous() if add else torch.empty(
                    out.shape, dtype=out.dtype, device=out.device))
        pieces = tuple(t.view(-1) for t in targets if t.numel())
        n = sum(p.numel() for p in pieces)
        if n == 0:
            return
        chunk = _secure_chunk(device, n, outs[0].dtype)
        # 4 uniforms per element, 8 per block: chunk k (from element s = k * chunk) takes
        # the blocks from first + s / 2; only the last chunk can be odd (it takes a block
        # for its missing element)
        first = stream.take((n + 1) // 2)
        job = _SecureJob(stream.key, stream.backend.name, first, pieces, chunk, std, add)
        _CHUNK_WORKERS.get(device.type, _torch_chunks)(job, range(0, n, chunk))
        for out, target in zip(outs, targets, strict=True):
            if target is not out:
                out.copy_(target)

    def standard_normal(self, n: int) -> torch.Tensor:
        """``n`` i.i.d. N(0, 1) float32 draws on the CPU.

        The returned tensor is an internal buffer, overwritten by the next call: use it
        (add it to the gradients) before drawing again.

        Drawing the noise in a background thread was measured and rejected: on a CPU
        whose cores run PyTorch's OpenMP workers (which spin between parallel regions),
        a third thread only time-shares a busy core and the step gets slower.
        """
        buf = self._buffer
        if buf is None or buf.numel() != n:
            buf = self._buffer = torch.empty(n)
        # filled in place: a fresh 4n-byte allocation every step costs page faults
        return self.fill_normal_(buf, 1.0)

    def normal(self, std: float, like: torch.Tensor) -> torch.Tensor:
        """A new tensor of ``like``'s shape, dtype and device, filled with
        ``N(0, std^2)`` draws (:meth:`fill_normal_`)."""
        return self.fill_normal_(torch.empty(like.shape, dtype=like.dtype,
                                             device=like.device), std)

    # ----------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """The source's random state.

        Default mode: the seed and the state of every device's generator created so far,
        so that a source given this state (:meth:`load_state_dict`) draws the same noise on
        the same devices. Secure mode: only a marker that the stream is not replayable
        (the keys are never saved; whoever held them could subtract the noise).

        Returns
        -------
        dict
            ``{"format", "secure_mode", "seed", "generators"}`` (default mode; generator
            states are uint8 CPU tensors keyed by device name) or
            ``{"format", "secure_mode", "replayable"}`` (secure mode). Loadable by
            ``torch.load(..., weights_only=True)``.
        """
        if self._secure:
            return {"format": _STATE_FORMAT, "secure_mode": True, "replayable": False}
        states = {key: gen.get_state() for key, gen in self._generators.items()}
        states.update({key: s.clone() for key, s in self._pending.items()})
        return {"format": _STATE_FORMAT, "secure_mode": False, "seed": self._seed,
                "generators": states}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict` (default mode: the seed and every
        device's generator; a device without a saved state restarts from the seed).

        Raises
        ------
        ValueError
            ``state`` is not a NoiseSource state, or its mode differs from this source's
            (a secure source cannot replay a default-mode stream, and a secure stream
            cannot be replayed); nothing is changed.
        """
        hint = "pass what NoiseSource.state_dict() (p.state_dict()['noise']) returned"
        refuse_rewind(self, "p.optimizer.noise")  # a run's, once it has taken steps
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise (ParameterValueError if isinstance(state, dict) else ParameterTypeError)(
                f"state is not a NoiseSource state (format {_STATE_FORMAT!r}); {hint}")
        saved_secure = entry(state, "secure_mode", "the noise state", hint, bool)
        if saved_secure is not self._secure:
            if self._secure:
                raise ConfigurationError(
                    "cannot load a default-mode (seeded, replayable) noise state into a "
                    "secure NoiseSource: secure noise comes from fresh OS-keyed ChaCha20 "
                    "streams and never replays; build NoiseSource(secure_mode=False) to "
                    "resume that stream")
            raise ConfigurationError(
                "cannot load a secure-mode noise state into a default-mode NoiseSource: "
                "secure noise is not replayable (its keys are never saved); resume with "
                "NoiseSource(secure_mode=True), which draws fresh noise")
        if self._secure:
            return
        seed, states = state.get("seed"), state.get("generators")
        if not isinstance(seed, int) or not isinstance(states, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor)
                and v.dtype == torch.uint8 for k, v in states.items()):
            raise ParameterTypeError(
                "state['seed'] must be an int and state['generators'] a dict of device "
                f"name -> uint8 tensor, got {seed!r} and {type(states).__name__}; {hint}")
        states = {_device_key(k): v for k, v in states.items()}
        # validate every state on a fresh generator before changing anything (a state of a
        # device this process cannot open is kept as it is, for when that device is used)
        checked = {}
        for key, s in states.items():
            try:
                probe = torch.Generator(device=torch.device(key))
            except (RuntimeError, ValueError):
                probe = None
            if probe is not None:
                try:
                    probe.set_state(s)
                except (RuntimeError, ValueError) as e:
                    raise ParameterValueError(f"state['generators'][{key!r}] is not a generator "
                                     f"state for {key}: {e}") from None
            checked[key] = s.clone()
        self._seed = seed
        self._pending = {}
        for key, gen in self._generators.items():
            if key in checked:
                gen.set_state(checked.pop(key))
            else:
                gen.manual_seed(device_seed(seed, key))
        self._pending = checked  # devices not used yet: applied when first used
