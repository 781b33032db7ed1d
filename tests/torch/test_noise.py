"""NoiseSource and the ChaCha20 keystream behind its secure mode.

References used: the RFC 8439 test vectors (sec. 2.3.2 and 2.4.2), a scalar ChaCha20 written
here from the RFC's pseudo-code, ``cryptography``'s (OpenSSL's) ChaCha20 when installed, a
NumPy Box-Muller / Holohan-Braghin written from the documented construction, and closed
forms of the normal law (moments, tail probabilities, KS and Cramer-von Mises tests).
"""

from __future__ import annotations

import importlib.util
import io
import math
import os
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from scipy import stats

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from privlearn import errors  # noqa: E402
from privlearn.torch import _chacha  # noqa: E402
from privlearn.torch import noise as noise_mod  # noqa: E402
from privlearn.torch.noise import NoiseSource, device_seed  # noqa: E402

MASK32 = 0xFFFFFFFF


# ------------------------------------------------------------------ scalar RFC reference


def _rotl(v, r):
    return ((v << r) & MASK32) | (v >> (32 - r))


def _qr(s, a, b, c, d):
    s[a] = (s[a] + s[b]) & MASK32
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & MASK32
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & MASK32
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & MASK32
    s[b] = _rotl(s[b] ^ s[c], 7)


def ref_block(key: bytes, counter: int, nonce: bytes) -> bytes:
    """RFC 8439 sec. 2.3 pseudo-code, one block, scalar Python."""
    state = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574]
    state += [int.from_bytes(key[i:i + 4], "little") for i in range(0, 32, 4)]
    state += [counter]
    state += [int.from_bytes(nonce[i:i + 4], "little") for i in range(0, 12, 4)]
    w = list(state)
    for _ in range(10):
        _qr(w, 0, 4, 8, 12)
        _qr(w, 1, 5, 9, 13)
        _qr(w, 2, 6, 10, 14)
        _qr(w, 3, 7, 11, 15)
        _qr(w, 0, 5, 10, 15)
        _qr(w, 1, 6, 11, 12)
        _qr(w, 2, 7, 8, 13)
        _qr(w, 3, 4, 9, 14)
    return b"".join(((x + y) & MASK32).to_bytes(4, "little") for x, y in zip(w, state, strict=True))


def ref_stream(key: bytes, position: int, blocks: int) -> bytes:
    """The stream as the module docstring defines it: block p has words 12..15 = p."""
    out = []
    for p in range(position, position + blocks):
        raw = p.to_bytes(16, "little")
        out.append(ref_block(key, int.from_bytes(raw[:4], "little"), raw[4:]))
    return b"".join(out)


def ref_bits53(key: bytes, position: int, blocks: int) -> np.ndarray:
    words = np.frombuffer(ref_stream(key, position, blocks), dtype="<u8")
    return (words >> np.uint64(11)).astype(np.int64)


def _cryptography_block(key: bytes, position: int) -> bytes:
    ciphers = pytest.importorskip("cryptography.hazmat.primitives.ciphers")
    enc = ciphers.Cipher(ciphers.algorithms.ChaCha20(key, position.to_bytes(16, "little")),
                         mode=None).encryptor()
    return enc.update(bytes(64))


KEY = bytes(range(32))


# ------------------------------------------------------------------------ test vectors


def test_block_function_rfc8439_2_3_2():
    # counter 1, nonce 00:00:00:09:00:00:00:4a:00:00:00:00
    position = int.from_bytes((1).to_bytes(4, "little")
                              + bytes.fromhex("000000090000004a00000000"), "little")
    expected_state = [0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3,
                      0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
                      0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9,
                      0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2]
    serialized = bytes.fromhex(
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")
    assert _chacha.block_words(KEY, position, 1)[:, 0].tolist() == expected_state
    assert _chacha.keystream_bytes(KEY, position, 1) == serialized
    assert ref_block(KEY, 1, bytes.fromhex("000000090000004a00000000")) == serialized


SUNSCREEN = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one "
             b"tip for the future, sunscreen would be it.")
SUNSCREEN_CT = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
    "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d")


def test_keystream_rfc8439_2_4_2():
    # counter 1, nonce 00:00:00:00:00:00:00:4a:00:00:00:00, 114-byte plaintext
    assert len(SUNSCREEN) == len(SUNSCREEN_CT) == 114
    position = int.from_bytes((1).to_bytes(4, "little")
                              + bytes.fromhex("000000000000004a00000000"), "little")
    ks = _chacha.keystream_bytes(KEY, position, 2)
    assert bytes(p ^ k for p, k in zip(SUNSCREEN, ks[:114], strict=True)) == SUNSCREEN_CT


def test_bits53_match_rfc_vector_on_every_backend():
    position = int.from_bytes((1).to_bytes(4, "little")
                              + bytes.fromhex("000000090000004a00000000"), "little")
    words = np.frombuffer(bytes.fromhex(
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"), dtype="<u8")
    want = (words >> np.uint64(11)).astype(np.int64).tolist()
    for name, backend in _chacha.BACKENDS.items():
        if backend.available(torch.device("cpu")):
            out = torch.empty(1, 8, dtype=torch.int64)
            _chacha.uniform_bits53(KEY, position, out, backend=name)
            assert out.view(-1).tolist() == want, name


_positions = st.one_of(
    st.integers(0, 2**40),
    st.integers(0, 2**96 - 2).map(lambda k: (k << 32) + (2**32 - 3)),  # near a carry
    st.integers(2**127, 2**128 - 8),
)


@hsettings(max_examples=25)
@given(key=st.binary(min_size=32, max_size=32), position=_positions,
       blocks=st.integers(1, 6))
def test_ciphers_match_scalar_reference(key, position, blocks):
    assert _chacha.keystream_bytes(key, position, blocks) == ref_stream(key, position, blocks)
    want = ref_bits53(key, position, blocks).tolist()
    for name, backend in _chacha.BACKENDS.items():
        if backend.available(torch.device("cpu")):
            out = torch.empty(blocks, 8, dtype=torch.int64)
            _chacha.uniform_bits53(key, position, out, backend=name)
            assert out.view(-1).tolist() == want, name


@hsettings(max_examples=25)
@given(key=st.binary(min_size=32, max_size=32), position=_positions,
       blocks=st.integers(1, 6))
def test_openssl_backend_matches_cryptography_and_tensor(key, position, blocks):
    pytest.importorskip("cryptography")
    # block by block, each its own cryptography call: no reliance on how OpenSSL carries
    want = b"".join(_cryptography_block(key, p) for p in range(position, position + blocks))
    assert _chacha.keystream_bytes(key, position, blocks) == want
    a = torch.empty(blocks, 8, dtype=torch.int64)
    b = torch.empty(blocks, 8, dtype=torch.int64)
    _chacha.uniform_bits53(key, position, a, backend="openssl")
    _chacha.uniform_bits53(key, position, b, backend="tensor")
    assert torch.equal(a, b)


def test_long_runs_cross_the_counter_carry_identically():
    pytest.importorskip("cryptography")
    key = os.urandom(32)
    position = (5 << 32) + 2**32 - 4100  # long runs (4096-block CPU runs) and a carry
    a, b, c = (torch.empty(9000, 8, dtype=torch.int64) for _ in range(3))
    _chacha.uniform_bits53(key, position, a, backend="openssl")
    _chacha.uniform_bits53(key, position, b, backend="tensor")
    _chacha.uniform_bits53(key, position, c, backend="numpy")
    assert torch.equal(a, b)
    assert torch.equal(a, c)
    carry = 4100  # first block of the next nonce
    assert a[carry].tolist() == ref_bits53(key, position + carry, 1).tolist()
    assert a[carry - 1].tolist() == ref_bits53(key, position + carry - 1, 1).tolist()


def test_uniform_bits53_rejects_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        _chacha.uniform_bits53(b"short", 0, torch.empty(1, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"shape \(blocks, 8\)"):
        _chacha.uniform_bits53(KEY, 0, torch.empty(1, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"outside the stream"):
        _chacha.uniform_bits53(KEY, 2**128 - 1, torch.empty(2, 8, dtype=torch.int64))

    with pytest.raises(errors.ParameterValueError, match="work must be"):
        _chacha.uniform_bits53(KEY, 0, torch.empty(4, 8, dtype=torch.int64), backend="tensor",
                               work=torch.empty(27 * 4, dtype=torch.int64))
    for name in list(_chacha.BACKENDS):
        monkeypatch.delitem(_chacha.BACKENDS, name)
    with pytest.raises(errors.ConfigurationError, match="no ChaCha20 backend"):
        _chacha.backend_for(torch.device("cpu"))


@pytest.mark.parametrize("position", [
    2**32 - 3,  # the RFC counter wraps, the nonce's first word goes 0 -> 1
    ((2**32 - 1) << 32) + 2**32 - 2,  # ... and its first word wraps, carrying into the second
    ((2**96 - 2) << 32) + 2**32 - 1,  # the last run of the stream but one
    (7 << 32) + 5,  # no carry
])
def test_one_tensor_run_carries_the_position_like_the_reference(position, monkeypatch):
    """The tensor cipher computes a run that crosses a multiple of 2**32 blocks at once
    (words 12..15 carry on the device): block by block the scalar RFC reference, and the
    53-bit uniforms of the OpenSSL backend (asked per nonce) when installed."""
    monkeypatch.delitem(_chacha.TENSOR_RUN_BLOCKS, "cpu")
    blocks = 5
    assert _chacha.keystream_bytes(KEY, position, blocks) == ref_stream(KEY, position, blocks)
    out = torch.empty(blocks, 8, dtype=torch.int64)
    _chacha.uniform_bits53(KEY, position, out, backend="tensor")
    assert out.view(-1).tolist() == ref_bits53(KEY, position, blocks).tolist()
    if _chacha.BACKENDS["openssl"].available(torch.device("cpu")):
        want = torch.empty(blocks, 8, dtype=torch.int64)
        _chacha.uniform_bits53(KEY, position, want, backend="openssl")
        assert torch.equal(out, want)


@pytest.mark.parametrize("key", [bytes(32), b"\xff" * 32, KEY], ids=["zeros", "ones", "rfc"])
def test_tensor_cipher_words_stay_non_negative_and_below_2_55(key):
    """The documented invariant that makes the int64 arithmetic exact: every value any
    operation of the cipher produces (high bits let run) lies in [0, 2**55)."""

    class Range(TorchDispatchMode):
        lo, hi = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.numel()
                    and not func.is_view and "empty" not in str(func)):  # computed values
                self.lo = min(self.lo, int(out.min()))
                self.hi = max(self.hi, int(out.max()))
            return out

    position = ((2**96 - 2) << 32) + 2**32 - 8  # the nonce's words all ones but one, a carry
    with Range() as r:
        words = _chacha.block_words(key, position, 16)
    assert r.lo >= 0 and r.hi < 2**55, (r.lo, r.hi)
    assert r.hi >= 2**40  # the high bits do run
    assert _chacha.keystream_bytes(key, position, 16) == ref_stream(key, position, 16)
    assert words.max() < 2**32


def test_tensor_cipher_writes_into_the_free_rows_of_its_workspace(monkeypatch):
    """``out`` sharing the workspace's rows TENSOR_OUT_ROWS gives the same bits as a
    separate ``out``: the cipher does not use those rows once it writes the output."""
    monkeypatch.delitem(_chacha.TENSOR_RUN_BLOCKS, "cpu")
    key, position, blocks = os.urandom(32), 2**32 - 300, 1000
    work = torch.full((_chacha.TENSOR_WORK_ROWS * blocks,), -1, dtype=torch.int64)
    lo, hi = _chacha.TENSOR_OUT_ROWS
    shared = work[lo * blocks:hi * blocks].view(blocks, 8)
    _chacha.uniform_bits53(key, position, shared, backend="tensor", work=work)
    alone = torch.empty(blocks, 8, dtype=torch.int64)
    _chacha.uniform_bits53(key, position, alone, backend="openssl"
                           if _chacha.BACKENDS["openssl"].available(torch.device("cpu"))
                           else "numpy")
    assert torch.equal(shared, alone)


# --------------------------------------------------------------- statistical checks


def _normality_failures(x: np.ndarray, level: float = 1e-11, z_max: float = 7.0) -> list:
    """The checks of ``x ~ N(0, 1) i.i.d.`` that fail: moments against their standard
    errors (``z_max``), KS and Cramer-von Mises against the fully specified N(0, 1), tail
    counts against the binomial law of P(|Z| > 3), P(|Z| > 4) (``level``). Secure noise
    cannot be seeded, so a correct sampler fails them by chance in about 4 * 2.6e-12
    (moments, normal approximation) + 4 * 1e-11 (tests) = 5e-11 of the runs."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    fails = []
    m = x.mean()
    c = x - m
    var = (c @ c) / n
    skew = (c**3).mean() / var**1.5
    kurt = (c**4).mean() / var**2 - 3.0
    for name, val, se in (("mean", m, 1 / math.sqrt(n)), ("var", var - 1, math.sqrt(2 / n)),
                          ("skew", skew, math.sqrt(6 / n)),
                          ("kurtosis", kurt, math.sqrt(24 / n))):
        if abs(val) > z_max * se:
            fails.append(f"{name}: {val:.3g} is {abs(val) / se:.1f} standard errors")
    if (p := stats.kstest(x, "norm").pvalue) < level:
        fails.append(f"KS p={p:.3g}")
    if (p := stats.cramervonmises(x, "norm").pvalue) < level:
        fails.append(f"CvM p={p:.3g}")
    for t in (3.0, 4.0):
        k = int((np.abs(x) > t).sum())
        if (p := stats.binomtest(k, n, 2 * stats.norm.sf(t)).pvalue) < level:
            fails.append(f"P(|Z|>{t}): {k} of {n}, p={p:.3g}")
    return fails


def test_normality_checks_have_power():
    """The checks above catch the defects a broken sampler would show."""
    rng = np.random.default_rng(0)
    n = 200_000  # a fifth of the draws of the tests below: they have more power still
    x = rng.standard_normal(n)
    assert _normality_failures(x) == []
    assert _normality_failures(1.02 * x)  # 2% too much (or too little) noise
    assert _normality_failures(0.98 * x)
    assert _normality_failures(x + 0.02)
    irwin_hall = rng.random((n, 12), dtype=np.float32).sum(1) - 6.0  # wrong tails
    assert _normality_failures(irwin_hall)


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draws_are_standard_normal(secure, dtype):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=12345)
    out = torch.empty(1_000_000, dtype=dtype)
    src.fill_normal_(out, 2.5)
    assert out.dtype == dtype
    assert _normality_failures(out.double().numpy() / 2.5) == []


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_draws_have_normal_moments(secure, dtype):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=5)
    out = src.fill_normal_(torch.empty(200_000, dtype=dtype), 0.5)
    x = out.double().numpy() / 0.5
    n = x.size
    # secure noise is not seeded: 7 standard errors, false alarm 2.6e-12 each
    assert abs(x.mean()) < 7 / math.sqrt(n)
    assert abs(x.var() - 1) < 7 * math.sqrt(2 / n) + 0.01  # + rounding of bfloat16
    # |x| > 2 after rounding: the draw lies past the midpoint between 1 and the dtype's
    # next value above 1 (bfloat16's step 2^-7 takes 8e-4 off the rate 2 P(Z > 2), which
    # secure bfloat16 runs failed against in 1.2e-6 of the runs). The rate's sd is 4.6e-4:
    # 0.003 is 6.5 sd, a false alarm in 1e-10 of the runs (exact binomial tails)
    one = torch.tensor(1.0, dtype=dtype)
    step = torch.nextafter(one, torch.tensor(2.0, dtype=dtype)).item() - 1.0
    assert abs(np.mean(np.abs(x) > 2) - 2 * stats.norm.sf(2 * (1 + step / 2))) < 0.003


@pytest.mark.parametrize("path", ["cpu", "device"])
def test_secure_noise_is_the_documented_construction(path, monkeypatch):
    """Secure noise equals a NumPy Box-Muller (with cos and sin) / Holohan-Braghin written
    from the documentation, on the keystream of the scalar reference cipher; and a second
    draw continues the stream (no block reused). Both the CPU's path (OpenSSL, NumPy) and
    the accelerators' (tensor ChaCha20, torch), run on the CPU."""
    if path == "device":
        _device_path_on_cpu(monkeypatch)
    src = NoiseSource(secure_mode=True)
    n = 2048  # even, one chunk: element j pairs with k = j + n/2 (mod n)
    first = src.fill_normal_(torch.empty(n, dtype=torch.float64), 1.0)
    stream = src._streams["cpu"]
    assert stream.position == n // 2  # 4 uniforms per element, 8 per block
    second = src.fill_normal_(torch.empty(n, dtype=torch.float64), 3.0)
    assert stream.position == n

    def expected(position, std):
        u = ref_bits53(stream.key, position, n // 2).reshape(4, n).astype(np.float64)
        r = np.sqrt(-2.0 * np.log((u[0:2] + 1.0) * 2.0**-53))
        theta = 2.0 * np.pi * (u[2:4] * 2.0**-53)
        c, s = r * np.cos(theta), r * np.sin(theta)
        k = (np.arange(n) + n // 2) % n
        return (c[0] + c[1] + s[0][k] + s[1][k]) / 2.0 * std

    np.testing.assert_allclose(first.numpy(), expected(0, 1.0), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(second.numpy(), expected(n // 2, 3.0), rtol=1e-13, atol=1e-13)


def _same_key(dst: NoiseSource, src: NoiseSource) -> None:
    """``dst`` draws the CPU stream ``src`` has drawn, from its start."""
    dst._streams["cpu"] = noise_mod._SecureStream(torch.device("cpu"))
    dst._streams["cpu"].key = src._streams["cpu"].key


def _device_path_on_cpu(monkeypatch) -> None:
    """CPU tensors take the path of accelerator tensors: the tensor ChaCha20 and the torch
    Holohan-Braghin (instead of OpenSSL or NumPy, and NumPy)."""
    for name in [n for n in _chacha.BACKENDS if n != "tensor"]:
        monkeypatch.delitem(_chacha.BACKENDS, name)
    monkeypatch.delitem(noise_mod._CHUNK_WORKERS, "cpu", raising=False)


@pytest.fixture
def device_path_on_cpu(monkeypatch):
    _device_path_on_cpu(monkeypatch)


def test_secure_noise_is_backend_independent(monkeypatch):
    pytest.importorskip("cryptography")
    monkeypatch.setitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu", 1000)  # several chunks
    a = NoiseSource(secure_mode=True)
    x = a.fill_normal_(torch.empty(4321, dtype=torch.float64), 1.5)
    assert a._streams["cpu"].backend.name == "openssl"
    for gone, expected in (("openssl", "numpy"), ("numpy", "tensor")):
        monkeypatch.delitem(_chacha.BACKENDS, gone)
        b = NoiseSource(secure_mode=True)
        _same_key(b, a)
        assert b._streams["cpu"].backend.name == expected
        y = b.fill_normal_(torch.empty(4321, dtype=torch.float64), 1.5)
        assert torch.equal(x, y)
        assert b._streams["cpu"].position == a._streams["cpu"].position == 4 * 500 + 322 // 2


def test_cpu_and_device_paths_agree(monkeypatch):
    """NumPy (the CPU's) and torch (the accelerators') Holohan-Braghin: the same operations,
    hence the same noise up to the last-ulp differences of their log, sqrt and tan."""
    monkeypatch.setitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu", 1 << 12)  # several chunks
    a = NoiseSource(secure_mode=True)
    x = a.fill_normal_(torch.empty(10_001, dtype=torch.float64), 2.0)
    monkeypatch.delitem(noise_mod._CHUNK_WORKERS, "cpu")
    b = NoiseSource(secure_mode=True)
    _same_key(b, a)
    y = b.fill_normal_(torch.empty(10_001, dtype=torch.float64), 2.0)
    torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13)
    assert not torch.equal(x, torch.zeros_like(x))


def test_secure_mode_works_without_cryptography(monkeypatch):
    _chacha._openssl_chacha20.cache_clear()
    monkeypatch.setitem(sys.modules, "cryptography", None)  # as if not installed
    try:
        assert _chacha.backend_for(torch.device("cpu")).name == "numpy"
        # the fused kernel where triton is installed and passed its check on a GPU
        assert _chacha.backend_for(torch.device("cuda:0")).name in ("tensor", "triton")
        if importlib.util.find_spec("triton") is None:
            assert _chacha.backend_for(torch.device("cuda:0")).name == "tensor"
        src = NoiseSource(secure_mode=True)
        x = src.fill_normal_(torch.empty(100_000), 1.0)
        assert src._streams["cpu"].backend.name == "numpy"
        # 7 standard errors of the std: false alarm 2.6e-12 (the key is fresh OS entropy)
        assert abs(x.double().std().item() - 1.0) < 7 * math.sqrt(0.5 / 100_000)
    finally:
        monkeypatch.undo()
        _chacha._openssl_chacha20.cache_clear()


def test_chunking_does_not_change_the_law(monkeypatch):
    """Odd sizes, many chunks, a last chunk of one element."""
    monkeypatch.setitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu", 4096)
    src = NoiseSource(secure_mode=True)
    out = src.fill_normal_(torch.empty(25 * 4096 + 1, dtype=torch.float64), 1.0)
    assert torch.isfinite(out).all()
    assert src._streams["cpu"].position == 25 * 2048 + 1  # the last element takes a block
    x = out.numpy()
    # the key is fresh OS entropy: false alarms 2.6e-12 + 2.6e-12 + 1e-11 a run
    assert abs(x.mean()) < 7 / math.sqrt(x.size)
    assert abs(x.var() - 1) < 7 * math.sqrt(2 / x.size)
    assert stats.kstest(x, "norm").pvalue > 1e-11


class _CountOps(TorchDispatchMode):
    """Counts the tensor operations dispatched (views aside: they launch nothing) and the
    bytes of the tensors they create (outputs neither written in place nor views)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.fresh_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops += 1
            if not func._schema.is_mutable and isinstance(out, torch.Tensor):
                self.fresh_bytes += out.numel() * out.element_size()
        return out


def _accelerator_sizing_on_cpu(monkeypatch, budget: int) -> None:
    """CPU tensors take the accelerators' path and chunk sizing, with ``budget`` bytes."""
    _device_path_on_cpu(monkeypatch)
    monkeypatch.delitem(_chacha.TENSOR_RUN_BLOCKS, "cpu")
    monkeypatch.delitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu")
    monkeypatch.setitem(noise_mod.SECURE_SCRATCH_BYTES, "cpu", budget)


GPT2_SMALL_PARAMETERS = 124_439_808


@pytest.mark.parametrize(("memory", "chunks"), [(141e9, 2), (80e9, 2), (24e9, 5), (None, 2)])
def test_accelerator_chunks_fill_the_scratch_budget(memory, chunks, monkeypatch):
    """Default budget min(8 GiB, memory / 8), SECURE_BYTES_PER_ELEMENT bytes per element,
    equal chunks: GPT-2 small's parameters take two chunks on an 80 GB or larger device."""
    class Props:
        total_memory = int(memory) if memory else 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    dev = torch.device("cuda:0")
    budget = min(8 << 30, int(memory) // 8) if memory else 8 << 30
    assert noise_mod._scratch_budget(dev) == budget
    most = budget // noise_mod.SECURE_BYTES_PER_ELEMENT
    chunk = noise_mod._secure_chunk(dev, GPT2_SMALL_PARAMETERS, torch.float32)
    assert math.ceil(GPT2_SMALL_PARAMETERS / chunk) == chunks == math.ceil(
        GPT2_SMALL_PARAMETERS / most)
    assert chunk % 2 == 0 and chunk <= most
    monkeypatch.setitem(noise_mod.SECURE_SCRATCH_BYTES, "cuda", 1 << 20)
    assert noise_mod._secure_chunk(dev, 10**6, torch.float32) * 112 <= 1 << 20


def test_secure_draw_of_gpt2_size_is_about_a_thousand_operations(monkeypatch):
    """On an accelerator a chunk of secure noise is a fixed number of tensor operations
    whatever its size, and GPT-2 small's 124.4M parameters take two chunks (test above).
    Counted on the CPU, on the accelerators' path, with the budget scaled down so that a
    draw of 2**15 elements also takes two chunks: the same count (checked independent of
    the chunk's size at 2**13), within 1000; and no tensor created beyond the budget."""
    counts = {}
    for n in (1 << 13, 1 << 15):
        budget = noise_mod.SECURE_BYTES_PER_ELEMENT * (n // 2)
        _accelerator_sizing_on_cpu(monkeypatch, budget)
        src = NoiseSource(secure_mode=True)
        src.fill_normal_(torch.empty(4), 1.0)  # first use: the key, the permutations
        out = torch.empty(n)
        with _CountOps() as c:
            src.fill_normal_(out, 0.5)
        counts[n] = c.ops
        assert c.fresh_bytes <= budget + 4096
        assert src._streams["cpu"].position == 2 + n // 2
        monkeypatch.undo()
    assert counts[1 << 13] == counts[1 << 15] <= 1000, counts


def test_accelerator_sized_chunks_draw_the_documented_construction(monkeypatch):
    """Large chunks in one workspace (cipher state, uniforms and transform sharing it):
    the same noise as the CPU's path (OpenSSL or NumPy, NumPy transform) with the same
    chunks, for an odd size and a stream position whose run crosses a nonce carry."""
    n = 40_001
    a = NoiseSource(secure_mode=True)
    a.fill_normal_(torch.empty(2), 1.0)
    a._streams["cpu"].position = 2**32 - 7_000  # the second chunk's run carries
    budget = noise_mod.SECURE_BYTES_PER_ELEMENT * (n // 2 + 1)
    monkeypatch.setitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu", 20_002)  # two chunks
    x = a.fill_normal_(torch.empty(n, dtype=torch.float64), 1.5)
    monkeypatch.undo()
    _accelerator_sizing_on_cpu(monkeypatch, budget)
    assert noise_mod._secure_chunk(torch.device("cpu"), n, torch.float64) == 20_002
    b = NoiseSource(secure_mode=True)
    _same_key(b, a)
    b._streams["cpu"].position = 2**32 - 7_000
    y = b.fill_normal_(torch.empty(n, dtype=torch.float64), 1.5)
    torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13)
    assert b._streams["cpu"].position == a._streams["cpu"].position


def _pieces(dtype, make=torch.randn):
    """Tensors of assorted sizes, one not contiguous and one empty, and a copy of each."""
    shapes = [(3000,), (7, 11), (0,), (1,), (50, 40), (4999,), (2, 3, 5)]
    xs = [make(s, dtype=torch.float64).to(dtype) for s in shapes]
    xs[4] = xs[4].t()  # not contiguous
    return xs, [x.clone() for x in xs]


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True], ids=["fill", "add"])
def test_foreach_is_one_draw_into_the_concatenation(path, dtype, add, monkeypatch):
    """Secure fill/add over a list of tensors: bit for bit one draw into their
    concatenation, chunks spanning several tensors (chunks of 1000 elements)."""
    if path == "device":
        _device_path_on_cpu(monkeypatch)
    monkeypatch.setitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu", 1000)
    a = NoiseSource(secure_mode=True)
    xs, originals = _pieces(dtype)
    (a.add_normal_foreach_ if add else a.fill_normal_foreach_)(xs, 0.7)
    b = NoiseSource(secure_mode=True)
    _same_key(b, a)
    flat = torch.cat([x.reshape(-1) for x in originals])
    (b.add_normal_ if add else b.fill_normal_)(flat, 0.7)
    assert torch.equal(torch.cat([x.reshape(-1) for x in xs]), flat)
    assert b._streams["cpu"].position == a._streams["cpu"].position == (flat.numel() + 1) // 2


def test_foreach_default_mode_and_mixed_groups():
    """Default mode: one draw per tensor (the same as calling fill_normal_ in turn);
    secure mode with two dtypes: one draw per dtype, each element standard normal."""
    xs, _ = _pieces(torch.float32)
    src = NoiseSource(seed=9)
    src.fill_normal_foreach_(xs, 2.0)
    ref = NoiseSource(seed=9)
    assert all(torch.equal(x, ref.fill_normal_(torch.empty_like(x), 2.0)) for x in xs)
    sec = NoiseSource(secure_mode=True)
    ys = [torch.zeros(100_000), torch.zeros(100_001, dtype=torch.float64), torch.zeros(3)]
    sec.fill_normal_foreach_(ys, 1.0)
    assert sec._streams["cpu"].position == 50_000 + 50_001 + 2  # two draws, one per dtype
    assert _uncorrelated(ys[0], ys[1][:100_000])
    for y in ys[:2]:
        assert _normality_failures(y.double().numpy()) == []


def test_foreach_rejects_bad_arguments_before_drawing():
    src = NoiseSource(secure_mode=True)
    with pytest.raises(errors.ParameterTypeError, match="list or tuple"):
        src.add_normal_foreach_(torch.zeros(3), 1.0)
    xs = [torch.zeros(3), torch.zeros(3, dtype=torch.int64)]
    with pytest.raises(errors.ParameterTypeError, match="floating dtype"):
        src.fill_normal_foreach_(xs, 1.0)
    xs = [torch.zeros(3), torch.zeros(3, dtype=torch.float16)]
    with pytest.raises(errors.ParameterValueError, match="too large for torch.float16"):
        src.add_normal_foreach_(xs, 1e4)
    assert not src._streams and not xs[0].any()  # nothing drawn
    assert src.fill_normal_foreach_([], 1.0) == []


def test_foreach_of_many_parameters_is_about_a_thousand_operations(monkeypatch):
    """GPT-2 small's 148 parameter tensors (bfloat16, as in a pure-bf16 run, where the
    gradients are not one flat buffer), scaled down 2**12-fold, in two chunks: about a
    thousand operations in one secure add, where one add per tensor takes 148 draws."""
    sizes = [max(1, n >> 12) for n in [38597376, 786432] + (
        [768, 768, 1769472, 2304, 589824, 768, 768, 768, 2359296, 3072, 2359296, 768]
        * 12) + [768, 768]]
    assert len(sizes) == 148
    n = sum(sizes)
    budget = (noise_mod.SECURE_BYTES_PER_ELEMENT + noise_mod._HALF_ROUNDING_BYTES) * (
        n // 2 + 1)
    _accelerator_sizing_on_cpu(monkeypatch, budget)
    src = NoiseSource(secure_mode=True)
    src.fill_normal_(torch.empty(4, dtype=torch.bfloat16), 1.0)
    grads = [torch.zeros(k, dtype=torch.bfloat16) for k in sizes]
    with _CountOps() as c:
        src.add_normal_foreach_(grads, 0.1)
    with _CountOps() as one:
        src.add_normal_(grads[5], 0.1)
    assert c.ops <= 1300, c.ops
    assert 148 * one.ops > 50 * c.ops
    assert all(g.any() for g in grads)


# ----------------------------------------------------------- independence of streams


def _uncorrelated(x: torch.Tensor, y: torch.Tensor) -> bool:
    """|corr| below 7 / sqrt(n): independent draws exceed it with probability 2.6e-12."""
    x, y = x.double().numpy(), y.double().numpy()
    return abs(np.corrcoef(x, y)[0, 1]) < 7 / math.sqrt(x.size)


@pytest.mark.parametrize("seeds", [(0, 1), (7, 1_000_010), (123, 124)])
def test_sources_with_different_seeds_are_independent(seeds):
    a = NoiseSource(seed=seeds[0]).fill_normal_(torch.empty(200_000, dtype=torch.float64), 1)
    b = NoiseSource(seed=seeds[1]).fill_normal_(torch.empty(200_000, dtype=torch.float64), 1)
    assert _uncorrelated(a, b)
    assert np.intersect1d(a.numpy(), b.numpy()).size == 0  # not shifted copies either


def test_secure_sources_never_share_draws():
    a, b = NoiseSource(secure_mode=True), NoiseSource(secure_mode=True)
    x = a.fill_normal_(torch.empty(200_000, dtype=torch.float64), 1.0)
    y = b.fill_normal_(torch.empty(200_000, dtype=torch.float64), 1.0)
    x2 = a.fill_normal_(torch.empty(200_000, dtype=torch.float64), 1.0)
    assert a._streams["cpu"].key != b._streams["cpu"].key
    assert _uncorrelated(x, y)
    values = [v.numpy() for v in (x, y, x2)]
    # no draw repeats anywhere (a reused stream would repeat 200,000 of them): two
    # independent N(0, 1) float64 draws are equal with probability ~2.5e-17, so among
    # 600,000 one pair coincides in 4.6e-6 of the runs, two pairs in 1e-11
    assert np.unique(np.concatenate(values)).size >= 600_000 - 1


def test_device_seeds_differ_per_device_and_seed():
    devices = ["cpu", "cuda:0", "cuda:1", "mps:0", "xpu:0"]
    seeds = {device_seed(s, d) for s in (0, 1, 2**70, -5, 2**64 - 1) for d in devices}
    assert len(seeds) == 5 * len(devices)
    assert all(0 <= s < 2**64 for s in seeds)
    # the CPU's is the seed as torch maps it: manual_seed(seed) replays the CPU noise
    for s in (0, 42, -5, -(2**63), 2**64 - 1):
        assert device_seed(s, "cpu") == torch.Generator().manual_seed(s).initial_seed()
    g = torch.Generator().manual_seed(42)
    want = torch.empty(1000).normal_(0.0, 1.5, generator=g)
    assert torch.equal(NoiseSource(seed=42).fill_normal_(torch.empty(1000), 1.5), want)
    assert device_seed(2**64, "cpu") != 0  # out of manual_seed's range: hashed
    # and the streams seeded for two devices are unrelated
    big = [torch.empty(200_000, dtype=torch.float64).normal_(
        generator=torch.Generator().manual_seed(device_seed(42, d))) for d in devices[:2]]
    assert _uncorrelated(*big)


def test_secure_keys_are_fresh_per_device():
    keys = {noise_mod._SecureStream(torch.device(d)).key for d in ["cpu", "cuda:0", "cpu"]}
    assert len(keys) == 3


# ------------------------------------------------------------------- default mode


def test_default_fill_is_exactly_normal_with_the_device_generator():
    src = NoiseSource(seed=3)
    g = torch.Generator().manual_seed(device_seed(3, "cpu"))
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        out = torch.empty(5, 7, dtype=dtype)
        want = torch.empty(5, 7, dtype=dtype).normal_(0.0, 0.25, generator=g)
        assert torch.equal(src.fill_normal_(out, 0.25), want)
    t = torch.empty(6, 4).t()  # non-contiguous: filled in place as it is
    want = torch.empty(6, 4).t().normal_(0.0, 2.0, generator=g)
    assert torch.equal(src.fill_normal_(t, 2.0), want)
    assert src.generator is src.generator_for("cpu") is src.generator_for(torch.device("cpu"))


def test_default_add_equals_value_plus_fill():
    x = torch.randn(3_000_001, generator=torch.Generator().manual_seed(0))
    a = NoiseSource(seed=9).add_normal_(x.clone(), 0.5)
    b = x + NoiseSource(seed=9).fill_normal_(torch.empty_like(x), 0.5)
    assert torch.equal(a, b)
    xt = x[:3_000_000].view(1000, 3000).t()
    a = NoiseSource(seed=9).add_normal_(xt.clone(), 0.5)  # clone keeps the strides
    b = xt + NoiseSource(seed=9).fill_normal_(torch.empty(3000, 1000), 0.5)
    assert torch.equal(a, b)


def test_secure_add_rounds_once():
    """``add_normal_`` forms ``x + std Z`` in float64 and rounds once to the dtype."""
    a = NoiseSource(secure_mode=True)
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(1))
    got = a.add_normal_(x.clone(), 0.3)
    b = NoiseSource(secure_mode=True)
    _same_key(b, a)
    z = b.fill_normal_(torch.empty(10_001, dtype=torch.float64), 0.3)
    assert torch.equal(got, (x.double() + z).float())
    xt = torch.zeros(40, 30).t()
    c = NoiseSource(secure_mode=True)
    got = c.add_normal_(xt, 1.0)
    d = NoiseSource(secure_mode=True)
    _same_key(d, c)
    assert got.data_ptr() == xt.data_ptr()
    assert torch.equal(got, d.fill_normal_(torch.empty(30, 40), 1.0))


def _nearest_bfloat16(x: float) -> float:
    """x rounded to the nearest bfloat16 (8 significand bits), ties to even: exact
    arithmetic on the binary expansion."""
    from fractions import Fraction

    if x == 0:
        return 0.0
    m, e = math.frexp(abs(x))  # |x| = m 2**e, m in [0.5, 1)
    scaled = Fraction(m) * 2**8
    lo = math.floor(scaled)
    rest = scaled - lo
    k = lo + 1 if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and lo % 2) else lo
    return math.copysign(k * 2.0 ** (e - 8), x)


def _near_ties(rng, n, dtype):
    """float64 values within a few float64 ulps of halfway between two neighbours of dtype
    (where a double rounding goes wrong), and ordinary values."""
    h = torch.from_numpy(rng.standard_normal(n)).to(dtype)
    up = torch.nextafter(h.float(), torch.tensor(float("inf"))).to(dtype)  # next in dtype
    up = torch.where(up == h, torch.nextafter(up, torch.tensor(float("inf"))).to(dtype), up)
    mid = (h.double() + up.double()) / 2
    jitter = torch.from_numpy(rng.integers(-3, 4, n)).double() * mid.abs() * 2.0**-52
    return torch.cat([mid + jitter, torch.from_numpy(rng.standard_normal(n))])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_to_half_precision_is_single(dtype):
    """The secure path rounds float64 noise once to the nearest half-precision value (torch's
    own conversion goes through float32 and is sometimes one unit off)."""
    rng = np.random.default_rng(3)
    x = _near_ties(rng, 5_000, dtype)
    got = torch.empty(x.numel(), dtype=dtype)
    noise_mod._copy_rounded_(got, x)
    if dtype == torch.float16:
        want = torch.from_numpy(x.numpy().astype(np.float16))  # NumPy: one rounding
    else:
        want = torch.tensor([_nearest_bfloat16(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(got.double(), want.double())
    assert not torch.equal(x.to(dtype).double(), want.double())  # torch's own: not always


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_secure_half_precision_output_is_the_rounded_float64(path, dtype, monkeypatch):
    if path == "device":
        monkeypatch.delitem(noise_mod._CHUNK_WORKERS, "cpu")
    a = NoiseSource(secure_mode=True)
    x = torch.randn(5001, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = a.add_normal_(x.clone(), 0.01)
    b = NoiseSource(secure_mode=True)
    _same_key(b, a)
    exact = x.double() + b.fill_normal_(torch.empty(5001, dtype=torch.float64), 0.01)
    want = torch.empty(5001, dtype=dtype)
    noise_mod._copy_rounded_(want, exact)
    assert torch.equal(got, want)


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_zero_std_gives_zeros_and_draws_nothing(secure):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=1)
    out = torch.full((10,), 3.0)
    assert torch.equal(src.fill_normal_(out, 0.0), torch.zeros(10))
    y = torch.arange(10.0)
    assert torch.equal(src.add_normal_(y, 0), torch.arange(10.0))
    if secure:
        assert src._streams == {}
    else:
        fresh = NoiseSource(seed=1)
        assert torch.equal(src.fill_normal_(torch.empty(5), 1.0),
                           fresh.fill_normal_(torch.empty(5), 1.0))


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_shapes_empty_and_scalar(secure):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=1)
    assert src.fill_normal_(torch.empty(0, 3), 1.0).shape == (0, 3)
    s = src.fill_normal_(torch.empty(()), 1.0)
    assert s.shape == () and torch.isfinite(s)
    assert src.add_normal_(torch.zeros(1), 1.0).shape == (1,)
    p = torch.nn.Parameter(torch.zeros(4))  # a leaf that requires grad: filled under no_grad
    src.add_normal_(p, 1.0)
    assert p.requires_grad and p.grad_fn is None


# ------------------------------------------------------------------ state, resume


def test_resume_is_bit_identical(tmp_path):
    src = NoiseSource(seed=77)
    src.fill_normal_(torch.empty(1000), 1.0)
    src.add_normal_(torch.zeros(10, dtype=torch.float64), 1.0)
    state = src.state_dict()
    want = [src.fill_normal_(torch.empty(500), 0.7), src.add_normal_(torch.zeros(33), 2.0)]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    other = NoiseSource(seed=1)  # a different seed: the state carries the seed
    other.fill_normal_(torch.empty(7), 1.0)
    other.load_state_dict(loaded)
    assert other.seed == 77
    got = [other.fill_normal_(torch.empty(500), 0.7), other.add_normal_(torch.zeros(33), 2.0)]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # the saved state is a snapshot: drawing more did not change it
    third = NoiseSource()
    third.load_state_dict(state)
    assert torch.equal(third.fill_normal_(torch.empty(500), 0.7), want[0])


def test_resume_restarts_unsaved_devices_from_the_seed():
    src = NoiseSource(seed=5)
    state = src.state_dict()  # no device used yet
    assert state["generators"] == {}
    used = NoiseSource(seed=8)
    used.fill_normal_(torch.empty(100), 1.0)
    gen = used.generator
    used.load_state_dict(state)
    assert used.generator is gen  # reseeded in place
    assert torch.equal(used.fill_normal_(torch.empty(50), 1.0),
                       NoiseSource(seed=5).fill_normal_(torch.empty(50), 1.0))


def test_state_of_an_absent_device_is_kept_for_later():
    src = NoiseSource(seed=5)
    fake = {"format": src.state_dict()["format"], "secure_mode": False, "seed": 5,
            "generators": {"cuda:3": torch.zeros(16, dtype=torch.uint8)}}
    src.load_state_dict(fake)  # not validated: cuda:3 may not exist here
    assert set(src.state_dict()["generators"]) == {"cuda:3"}
    src.fill_normal_(torch.empty(3), 1.0)
    assert set(src.state_dict()["generators"]) == {"cpu", "cuda:3"}


def test_secure_state_is_a_marker_and_modes_cannot_mix():
    sec = NoiseSource(secure_mode=True)
    sec.fill_normal_(torch.empty(10), 1.0)
    state = sec.state_dict()
    assert state["secure_mode"] is True and state["replayable"] is False
    assert not any(isinstance(v, bytes | torch.Tensor) for v in state.values())  # no key
    sec.load_state_dict(state)  # allowed: nothing to restore
    plain = NoiseSource(seed=3)
    plain.fill_normal_(torch.empty(10), 1.0)
    before = plain.state_dict()
    with pytest.raises(ValueError, match="secure-mode noise state into a default-mode"):
        plain.load_state_dict(state)
    with pytest.raises(ValueError, match="default-mode .* into a secure NoiseSource"):
        sec.load_state_dict(before)
    after = plain.state_dict()
    assert after["seed"] == before["seed"]
    assert torch.equal(after["generators"]["cpu"], before["generators"]["cpu"])


@pytest.mark.parametrize("bad", [None, {}, {"format": "x"}, [1, 2]])
def test_load_state_rejects_foreign_objects(bad):
    with pytest.raises(ValueError, match="not a NoiseSource state"):
        NoiseSource(seed=1).load_state_dict(bad)


def test_load_state_rejects_a_corrupt_generator_state_and_changes_nothing():
    src = NoiseSource(seed=2)
    src.fill_normal_(torch.empty(4), 1.0)
    state = src.state_dict()
    bad = dict(state, seed=99, generators={"cpu": torch.zeros(3, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"generators'\]\['cpu'\]"):
        src.load_state_dict(bad)
    assert src.seed == 2
    with pytest.raises(ValueError, match="must be an int"):
        src.load_state_dict(dict(state, seed="2"))


# ------------------------------------------------------------------- bad input


def test_constructor_validation():
    with pytest.raises(ValueError, match="seed must be None when secure_mode=True"):
        NoiseSource(secure_mode=True, seed=0)
    with pytest.raises(TypeError, match="seed must be an integer or None, got float"):
        NoiseSource(seed=1.5)
    assert NoiseSource(seed=np.int64(4)).seed == 4
    a, b = NoiseSource(), NoiseSource()
    assert a.seed != b.seed  # OS entropy
    assert NoiseSource(secure_mode=True).seed is None


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_fill_validation(secure):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=1)
    out = torch.zeros(4)
    for bad, exc, msg in [(-1.0, ValueError, r"std must be a finite number >= 0, got -1.0"),
                          (float("nan"), ValueError, "finite"),
                          (float("inf"), ValueError, "finite"),
                          (torch.tensor(1.0), TypeError, "std must be a real number"),
                          (True, TypeError, "got bool"),
                          ("1", TypeError, "got str")]:
        for method in (src.fill_normal_, src.add_normal_):
            with pytest.raises(exc, match=msg):
                method(out, bad)
    assert torch.equal(out, torch.zeros(4))
    with pytest.raises(TypeError, match="out must have a floating dtype.*got torch.int64"):
        src.fill_normal_(torch.zeros(3, dtype=torch.int64), 1.0)
    with pytest.raises(TypeError, match="got torch.complex64"):
        src.add_normal_(torch.zeros(3, dtype=torch.complex64), 1.0)
    with pytest.raises(TypeError, match="out must be a torch.Tensor, got ndarray"):
        src.fill_normal_(np.zeros(3), 1.0)
    with pytest.raises(ValueError, match=r"below the smallest normal torch.float16"):
        src.fill_normal_(torch.zeros(3, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match=r"too large for torch.float16"):
        src.add_normal_(torch.zeros(3, dtype=torch.float16), 1e4)
    src.fill_normal_(torch.zeros(3, dtype=torch.float32), 1e-6)  # fine in float32
    if secure:
        with pytest.raises(ValueError, match="no torch.Generator"):
            src.generator_for("cpu")
    with pytest.raises(ValueError, match="meta"):
        src.fill_normal_(torch.empty(3, device="meta"), 1.0)


# ------------------------------------------------------------- no host synchronisation


@pytest.fixture
def no_host_sync(monkeypatch):
    """Make every tensor -> host value conversion raise."""

    def refuse(name):
        def f(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} called: a host synchronisation")
        return f

    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__",
                 "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_drawing_needs_no_host_values(secure, device_path_on_cpu, no_host_sync):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=1)
    for dtype in (torch.float32, torch.float16):
        out = torch.zeros(3001, dtype=dtype)
        src.fill_normal_(out, 1.0)
        src.add_normal_(out, 1.0)
        src.fill_normal_(out[:3000].view(60, 50).t(), 0.5)  # not contiguous
        src.add_normal_(out[:3000].view(60, 50).t(), 0.5)
        src.add_normal_foreach_([out[:1000], out[1000:3000].view(40, 50).t()], 0.5)
        src.fill_normal_foreach_([out[:7], out[7:]], 0.5)
    src.state_dict()


# ---------------------------------------------------------------- legacy interface


def test_legacy_methods_still_draw():
    src = NoiseSource(seed=4)
    z = src.standard_normal(1000)
    assert z.shape == (1000,) and z.dtype == torch.float32
    assert src.standard_normal(1000).data_ptr() == z.data_ptr()  # reused buffer
    like = torch.empty(3, 4, dtype=torch.float64)
    assert src.normal(0.5, like).shape == (3, 4)
    sec = NoiseSource(secure_mode=True)
    assert sec.standard_normal(10).shape == (10,)
    assert sec.normal(1.0, like).dtype == torch.float64


# ------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.gpu


@cuda
def test_cuda_tensor_cipher_matches_reference():
    position = (9 << 32) + 2**32 - 3  # crosses a carry
    key = os.urandom(32)
    dev = _chacha.block_words(key, position, 6, device="cuda")
    host = _chacha.block_words(key, position, 6, device="cpu")
    assert torch.equal(dev.cpu(), host)
    out = torch.empty(6, 8, dtype=torch.int64, device="cuda")
    _chacha.uniform_bits53(key, position, out)
    assert out.cpu().view(-1).tolist() == ref_bits53(key, position, 6).tolist()


@cuda
@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_draws_are_standard_normal(secure, dtype):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=12345)
    out = torch.empty(1_000_000, dtype=dtype, device="cuda")
    src.fill_normal_(out, 2.5)
    assert out.device.type == "cuda" and out.dtype == dtype
    assert _normality_failures(out.double().cpu().numpy() / 2.5) == []


@cuda
def test_cuda_secure_noise_matches_the_cpu_stream(monkeypatch):
    """Same key, same chunking: the same uniforms on both devices (bit for bit), hence the
    same noise up to the last-ulp differences of the devices' log, sqrt and tan."""
    chunk = noise_mod._secure_chunk(torch.device("cuda"), 600_001, torch.float64)
    monkeypatch.setitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu", chunk)
    a = NoiseSource(secure_mode=True)
    x = a.fill_normal_(torch.empty(600_001, dtype=torch.float64, device="cuda"), 1.0)
    b = NoiseSource(secure_mode=True)
    b._streams["cpu"] = noise_mod._SecureStream(torch.device("cpu"))
    b._streams["cpu"].key = a._streams[f"cuda:{x.device.index}"].key
    y = b.fill_normal_(torch.empty(600_001, dtype=torch.float64), 1.0)
    torch.testing.assert_close(x.cpu(), y, rtol=1e-12, atol=1e-12)


@cuda
def test_cuda_resume_is_bit_identical():
    src = NoiseSource(seed=77)
    src.fill_normal_(torch.empty(1000, device="cuda"), 1.0)
    src.fill_normal_(torch.empty(10), 1.0)
    state = src.state_dict()
    assert set(state["generators"]) == {"cpu", f"cuda:{torch.cuda.current_device()}"}
    want = src.add_normal_(torch.zeros(12345, device="cuda"), 0.7)
    other = NoiseSource(seed=1)
    other.load_state_dict(state)
    assert torch.equal(other.add_normal_(torch.zeros(12345, device="cuda"), 0.7), want)


@cuda
def test_cuda_and_cpu_streams_of_one_source_differ():
    src = NoiseSource(seed=3)
    x = src.fill_normal_(torch.empty(200_000, dtype=torch.float64, device="cuda"), 1.0)
    y = src.fill_normal_(torch.empty(200_000, dtype=torch.float64), 1.0)
    assert _uncorrelated(x.cpu(), y)
    sec = NoiseSource(secure_mode=True)
    x = sec.fill_normal_(torch.empty(200_000, dtype=torch.float64, device="cuda"), 1.0)
    y = sec.fill_normal_(torch.empty(200_000, dtype=torch.float64), 1.0)
    assert sec._streams["cpu"].key != sec._streams[f"cuda:{x.device.index}"].key
    assert _uncorrelated(x.cpu(), y)


@cuda
@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_cuda_drawing_never_synchronises(secure):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=1)
    outs = [torch.zeros(300_001, dtype=dt, device="cuda")
            for dt in (torch.float32, torch.bfloat16, torch.float64)]
    src.fill_normal_(outs[0], 1.0)  # first use creates the generator / key: allowed to sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for out in outs:
            src.fill_normal_(out, 1.0)
            src.add_normal_(out, 0.5)
            src.add_normal_(out[:300_000].view(600, 500).t(), 0.5)  # not contiguous
            src.add_normal_foreach_([out[:1000], out[1000:300_000].view(500, 598).t()], 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(o).all() for o in outs)
