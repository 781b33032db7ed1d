"""The ChaCha20 block function (RFC 8439) as integer tensor operations on any torch device
and as NumPy ``uint32`` arithmetic: the cipher that :mod:`privlearn.torch._chacha`'s
backends share (the Triton kernel of :mod:`privlearn.torch._chacha_triton` reproduces it).

The cipher is written with vectorised integer tensor operations: a 32-bit word is held in
an ``int64`` tensor element whose low 32 bits are the word; the high bits are let run
(additions and exclusive ors need no clean high bits) and cleared only before a right
shift, so nothing depends on signed overflow (every value stays in ``[0, 2**55)``), and
right shifts (arithmetic on signed integers in torch) only ever see non-negative values.
Every block of a run is computed at once (the 16 state words are 16 rows, one column per
block; a round is its four quarter rounds at once, on four rows of four words), on the
device of the output: no host copy and no host synchronisation, and about 450 tensor
operations per run whatever its number of blocks (so an accelerator computes a large
run in about 450 kernel launches), in a workspace of :data:`TENSOR_WORK_ROWS` int64
words per block.

Stream definition
-----------------
A stream is a 256-bit key and a 128-bit *block position* ``p``. Block ``p`` of the stream is
the RFC 8439 block function (sec. 2.3) of the state whose words 12..15 hold ``p`` as a
little-endian 128-bit integer: word 12 is the RFC's 32-bit block counter, words 13..15 its
96-bit nonce. Within a run of ``2**32`` blocks this is the RFC's counter; past it, the nonce
advances by one and the counter restarts at 0, so as long as a stream's position only
moves forward (and stays below ``2**128``) no (key, nonce, counter) triple is used twice.
Equivalently, block ``p`` is the first block of ``ChaCha20(key, nonce16=p.to_bytes(16,
"little"))`` in the ``cryptography`` package, whose 16-byte nonce is the RFC counter
followed by the RFC nonce.

References
----------
Y. Nir and A. Langley, "ChaCha20 and Poly1305 for IETF Protocols", RFC 8439, 2018,
sec. 2.1-2.4.

D. J. Bernstein, "ChaCha, a variant of Salsa20", 2008.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import torch

from privlearn.errors import ParameterValueError

#: Bytes of keystream per block.
BLOCK_BYTES = 64
#: Bytes of a key.
KEY_BYTES = 32
#: 64-bit words (hence 53-bit uniforms) per block.
UNIFORMS_PER_BLOCK = 8
#: One past the largest block position.
POSITION_LIMIT = 1 << 128

_MASK32 = 0xFFFFFFFF
_MASK53 = (1 << 53) - 1
_LITTLE_ENDIAN = sys.byteorder == "little"  # the openssl backend reads words in place
_SEGMENT = 1 << 32  # blocks per value of the RFC nonce (words 13..15)
#: "expand 32-byte k", RFC 8439 sec. 2.3.
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)


def _check(key: bytes, position: int, blocks: int) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise ParameterValueError(f"key must be {KEY_BYTES} bytes, got {type(key).__name__} of "
                         f"length {len(key) if hasattr(key, '__len__') else '?'}")
    if not 0 <= position or position + blocks > POSITION_LIMIT or blocks < 0:
        raise ParameterValueError(
            f"blocks [{position}, {position} + {blocks}) are outside the stream "
                         f"[0, 2**128)")


def _segments(position: int, blocks: int) -> Iterator[tuple[int, int, int]]:
    """Split ``blocks`` blocks from ``position`` into runs that keep the RFC nonce fixed:
    ``(offset in the request, position, count)``."""
    done = 0
    while done < blocks:
        p = position + done
        count = min(blocks - done, _SEGMENT - (p & _MASK32))
        yield done, p, count
        done += count


# --------------------------------------------------------------------------- tensor backend

#: Rows of ``blocks`` int64 words of workspace the tensor cipher uses (one row per block
#: and word): the 16 state words, and 12 more into which the rows of words 4..15 are
#: permuted between a column round and a diagonal round. 224 bytes per block.
TENSOR_WORK_ROWS = 28
#: Rows of the workspace free when the output is written: a caller's ``out`` of
#: :func:`uniform_bits53` may be these rows (as one contiguous ``(blocks, 8)`` view).
TENSOR_OUT_ROWS = (16, 24)

#: Per device, the two row permutations of words 4..15 (within each row of the RFC's
#: 4 x 4 state, a rotation by 1, 2, 3 turns the diagonals into columns, and back),
#: built on the device from an ``arange`` (no host copy) the first time.
_PERMUTATIONS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _permutations(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    perms = _PERMUTATIONS.get(device)
    if perms is None:
        i = torch.arange(12, dtype=torch.int64, device=device)
        g = torch.div(i, 4, rounding_mode="floor")  # 0, 1, 2: rows b, c, d of the state
        base = g * 4
        # diagonal layout: row g, column k holds word (k + g + 1) mod 4 of row g
        forward = (i + g + 1).remainder_(4).add_(base)
        backward = (i - g + 3).remainder_(4).add_(base)
        perms = _PERMUTATIONS[device] = (forward, backward)
    return perms


def _rounds_(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
             s: torch.Tensor) -> None:
    """One round (RFC 8439 sec. 2.1, the four quarter rounds of a column or diagonal round
    at once): rows ``a, b, c, d`` (each ``(4, blocks)``), ``s`` scratch.

    Words are held in int64 with only their low 32 bits meaningful: an addition or an
    exclusive or does not need clean high bits (the low 32 bits of a sum depend only on
    the low 32 bits of its terms), so the words are masked only before a right shift, the
    one operation that brings high bits down. The left rotation by ``r`` of a masked word
    ``t`` is ``(t >> (32 - r)) + t * 2**r``, one shift and one scaled addition (the two
    parts share no bit). The high bits stay bounded (below ``2**55`` after 20 rounds and
    the final addition), so no value overflows or turns negative.
    """
    for x, y, z, r in ((a, b, d, 16), (c, d, b, 12), (a, b, d, 8), (c, d, b, 7)):
        x.add_(y)                                    # a += b        (c += d)
        z.bitwise_xor_(x).bitwise_and_(_MASK32)      # d ^= a, masked (b ^= c)
        torch.bitwise_right_shift(z, 32 - r, out=s)
        torch.add(s, z, alpha=1 << r, out=z)         # d <<<= r      (b <<<= r)


def _counter_rows_(rows: torch.Tensor, position: int) -> None:
    """Words 12..15 of blocks ``position, position + 1, ...`` (one per column of the
    ``(4, blocks)`` int64 ``rows``): the block position as a little-endian 128-bit integer.
    By device operations on host scalars only, nothing copied from the host; a run that
    crosses a multiple of ``2**32`` blocks carries into words 13..15."""
    blocks = rows.shape[1]
    low = position & _MASK32
    nonce = position >> 32
    torch.arange(low, low + blocks, out=rows[0])
    if low + blocks <= _SEGMENT:
        for i in range(3):
            rows[1 + i].fill_((nonce >> (32 * i)) & _MASK32)
        return
    carry = torch.bitwise_right_shift(rows[0], 32, out=rows[1])  # 0 or 1 per block
    rows[0].bitwise_and_(_MASK32)
    for i in (2, 1, 0):  # the carry row itself last
        before = (nonce >> (32 * i)) & _MASK32
        after = ((nonce + 1) >> (32 * i)) & _MASK32
        torch.mul(carry, after - before, out=rows[1 + i]).add_(before)


def _state_words_(key: bytes, position: int, work: torch.Tensor) -> torch.Tensor:
    """The block function's output (RFC 8439 sec. 2.3: 20 rounds, then the initial state
    added) of blocks ``position, ...``, as a ``(16, blocks)`` view of ``work`` (words in
    ``[0, 2**32)``), computed in ``work``: int64, contiguous, of
    ``TENSOR_WORK_ROWS * blocks`` elements; its rows ``TENSOR_OUT_ROWS`` are free on
    return.

    About 450 tensor operations whatever the number of blocks: 5 per quarter-round step,
    vectorised over the four quarter rounds of a round and every block, and one index
    operation between a column round and a diagonal round.
    """
    blocks = work.numel() // TENSOR_WORK_ROWS
    rows = work.view(TENSOR_WORK_ROWS, blocks)
    x, other = rows[:16], rows[16:]
    words = _SIGMA + _key_words(key)
    consts = torch.empty((12, 1), dtype=torch.int64, device=work.device)
    for i, w in enumerate(words):
        consts[i].fill_(w)
    x[:12].copy_(consts.expand(12, blocks))
    _counter_rows_(x[12:16], position)
    forward, backward = _permutations(work.device)
    a, bcd = x[:4], x[4:]
    for _ in range(10):  # 20 rounds: a column round, then a diagonal round (sec. 2.3)
        _rounds_(a, bcd[0:4], bcd[4:8], bcd[8:12], other[:4])
        torch.index_select(bcd, 0, forward, out=other)  # diagonals -> columns
        _rounds_(a, other[0:4], other[4:8], other[8:12], bcd[:4])
        torch.index_select(other, 0, backward, out=bcd)
    x[:12].add_(consts)
    _counter_rows_(other[8:12], position)
    x[12:16].add_(other[8:12])
    return x.bitwise_and_(_MASK32)


def _key_words(key: bytes) -> tuple[int, ...]:
    return tuple(int.from_bytes(key[4 * i:4 * i + 4], "little") for i in range(8))


def block_words(key: bytes, position: int, blocks: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 output words of each of ``blocks`` consecutive blocks (tensor backend).

    Parameters
    ----------
    key : bytes
        The 32-byte key.
    position : int
        Block position of the first block (see the module docstring).
    blocks : int
        Number of blocks.
    device : torch.device or str
        Where to compute.

    Returns
    -------
    torch.Tensor
        ``int64`` of shape ``(16, blocks)``, values in ``[0, 2**32)``: column ``j`` is the
        block function's output state (RFC 8439 sec. 2.3) for block ``position + j``.
    """
    _check(key, position, blocks)
    work = torch.empty(TENSOR_WORK_ROWS * blocks, dtype=torch.int64, device=device)
    return _state_words_(key, position, work).clone()


#: Most blocks the tensor backend computes at once, by device type (default: all asked
#: for). On the CPU, small runs keep the 28-row workspace in cache: 4096 blocks run about
#: 10x faster per block than 131072 (measured on a 2-core EPYC).
TENSOR_RUN_BLOCKS: dict[str, int] = {"cpu": 4096}


def _runs(position: int, blocks: int, limit: int) -> Iterator[tuple[int, int, int]]:
    """:func:`_segments`, each cut further into runs of at most ``limit`` blocks."""
    for off, p, n in _segments(position, blocks):
        for k in range(0, n, limit):
            yield off + k, p + k, min(limit, n - k)


def _bits53_(x: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst`` (8, n) <- the top 53 bits of the 64-bit little-endian words of the output
    words ``x`` (16, n): word ``k`` is ``x[2k] + 2**32 x[2k+1]``, its top 53 bits
    ``(x[2k+1] << 21) | (x[2k] >> 11)``, formed without leaving ``[0, 2**53)``
    (``x`` is overwritten)."""
    torch.bitwise_left_shift(x[1::2], 21, out=dst)
    dst.bitwise_or_(x[0::2].bitwise_right_shift_(11))


def _tensor_bits53(key: bytes, position: int, out: torch.Tensor,
                   work: torch.Tensor | None = None) -> None:
    blocks = out.shape[0]
    limit = TENSOR_RUN_BLOCKS.get(out.device.type)
    if limit is None or blocks <= limit:
        if work is None:
            work = torch.empty(TENSOR_WORK_ROWS * blocks, dtype=torch.int64,
                               device=out.device)
        _bits53_(_state_words_(key, position, work[:TENSOR_WORK_ROWS * blocks]), out.t())
        return
    run = torch.empty(TENSOR_WORK_ROWS * limit, dtype=torch.int64, device=out.device)
    for off, p, n in _runs(position, blocks, limit):
        _bits53_(_state_words_(key, p, run[:TENSOR_WORK_ROWS * n]), out[off:off + n].t())


# ---------------------------------------------------------------------------- NumPy backend


def _rotl_np(v: np.ndarray, r: int, scratch: np.ndarray) -> None:
    np.right_shift(v, 32 - r, out=scratch)
    np.left_shift(v, r, out=v)
    np.bitwise_or(v, scratch, out=v)


def _quarter_round_np(a, b, c, d, scratch) -> None:
    """RFC 8439 sec. 2.1 on uint32 rows (NumPy's unsigned arithmetic wraps mod 2**32)."""
    for r1, r2 in ((16, 12), (8, 7)):
        a += b
        d ^= a
        _rotl_np(d, r1, scratch)
        c += d
        b ^= c
        _rotl_np(b, r2, scratch)


def _block_words_np(key: bytes, position: int, blocks: int) -> np.ndarray:
    """:func:`_block_words_segment` in NumPy uint32: output words ``(16, blocks)``."""
    x0 = np.empty((16, blocks), dtype=np.uint32)
    x0[0:4] = np.array(_SIGMA, dtype=np.uint32)[:, None]
    x0[4:12] = np.frombuffer(key, dtype="<u4")[:, None]
    low = position & _MASK32
    x0[12] = np.arange(low, low + blocks, dtype=np.uint64)
    nonce = position >> 32
    for i in range(3):
        x0[13 + i] = (nonce >> (32 * i)) & _MASK32
    x = x0.copy()
    a, b, c, d = x[0:4], x[4:8], x[8:12], x[12:16]
    bd, cd, dd, scratch = (np.empty_like(a) for _ in range(4))
    for _ in range(10):
        _quarter_round_np(a, b, c, d, scratch)
        bd[:3], bd[3] = b[1:], b[0]  # rows rotated by 1, 2, 3: the diagonal round
        cd[:2], cd[2:] = c[2:], c[:2]
        dd[1:], dd[0] = d[:3], d[3]
        _quarter_round_np(a, bd, cd, dd, scratch)
        b[1:], b[0] = bd[:3], bd[3]
        c[2:], c[:2] = cd[:2], cd[2:]
        d[:3], d[3] = dd[1:], dd[0]
    x += x0
    return x


def _numpy_bits53(key: bytes, position: int, out: torch.Tensor,
                  work: torch.Tensor | None = None) -> None:
    words = out.numpy().view(np.uint64)
    for off, p, n in _runs(position, out.shape[0], TENSOR_RUN_BLOCKS["cpu"]):
        x = _block_words_np(key, p, n)
        dst = words[off:off + n].T  # (8, n) view
        np.left_shift(x[1::2], np.uint64(21), out=dst)
        dst |= x[0::2] >> np.uint32(11)
