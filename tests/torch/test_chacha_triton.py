"""The fused Triton ChaCha20 kernel of secure mode, and its fallback.

Without ``triton`` only the selection logic runs (privlearn must work without it). With
``triton`` installed, the kernel runs in Triton's interpreter on CPU tensors, checked bit
for bit against OpenSSL's ChaCha20 (through ``cryptography``), the scalar RFC 8439
reference of ``test_noise`` and the tensor backend, and the self-check is shown to catch
a corrupted kernel. On a CUDA device (marker ``gpu``) the compiled kernel is checked the
same way, and a secure draw is counted: kernel launches of the Triton kernel (counted by
the module's launch counter, and by the profiler's CUDA kernel events where it records
them; a Triton launch is not a torch operation, so a dispatch mode does not see it) and
the torch operations dispatched (a ``TorchDispatchMode``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_noise import (  # noqa: E402
    KEY,
    _CountOps,
    _device_path_on_cpu,
    _same_key,
    ref_bits53,
)

from privlearn.torch import _chacha  # noqa: E402
from privlearn.torch import noise as noise_mod  # noqa: E402
from privlearn.torch.noise import NoiseSource  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

RFC_POSITION = int.from_bytes((1).to_bytes(4, "little")
                              + bytes.fromhex("000000090000004a00000000"), "little")
RFC_BLOCK = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")

#: (position, blocks): from 0; a partial program; the RFC counter wrapping (the nonce's
#: first word 0 -> 1); a carry through two nonce words; near the top of the stream.
RUNS = [
    (0, 1),
    (12345, 700),
    (2**32 - 300, 1100),
    ((2**32 - 1) << 32 | (2**32 - 5), 9),
    (2**128 - 64, 64),
]


def _openssl_or_numpy(key: bytes, position: int, blocks: int) -> torch.Tensor:
    out = torch.empty((blocks, 8), dtype=torch.int64)
    name = "openssl" if _chacha.BACKENDS["openssl"].available(torch.device("cpu")) \
        else "numpy"
    return _chacha.uniform_bits53(key, position, out, backend=name)


def _tensor(key: bytes, position: int, blocks: int, device="cpu") -> torch.Tensor:
    out = torch.empty((blocks, 8), dtype=torch.int64, device=device)
    return _chacha.uniform_bits53(key, position, out, backend="tensor")


# --------------------------------------------------------------- selection, everywhere


def test_triton_backend_is_for_cuda_tensors_only():
    assert not _chacha.BACKENDS["triton"].available(torch.device("cpu"))
    assert _chacha.backend_for(torch.device("cpu")).name != "triton"
    assert _chacha.backend_in_use(torch.device("cpu")) == _chacha.backend_for(
        torch.device("cpu")).name


def _forget_the_kernel_module(monkeypatch) -> None:
    """As if this process had not imported the kernel's module (restored afterwards)."""
    import privlearn.torch

    _chacha._triton_module.cache_clear()
    monkeypatch.delitem(sys.modules, "privlearn.torch._chacha_triton", raising=False)
    monkeypatch.delattr(privlearn.torch, "_chacha_triton", raising=False)


def test_without_triton_cuda_keeps_the_tensor_backend(monkeypatch):
    """triton absent: nothing imports it and CUDA tensors get the tensor cipher."""
    _forget_the_kernel_module(monkeypatch)
    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` raises
    try:
        assert _chacha._triton_module() is None
        assert not _chacha.BACKENDS["triton"].available(torch.device("cuda", 0))
    finally:
        _chacha._triton_module.cache_clear()


def test_a_broken_triton_warns_and_keeps_the_tensor_backend(monkeypatch):
    """triton found but failing to import: one warning, and the tensor cipher."""
    _forget_the_kernel_module(monkeypatch)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(_chacha.importlib.util, "find_spec", lambda name: object())
    try:
        with pytest.warns(RuntimeWarning, match="does not import"):
            assert _chacha._triton_module() is None
        assert not _chacha.BACKENDS["triton"].available(torch.device("cuda", 0))
    finally:
        _chacha._triton_module.cache_clear()


# ------------------------------------------------------------- the interpreter (CPU)


@pytest.fixture(scope="module")
def kt():
    """The kernel module (needs triton)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from privlearn.torch import _chacha_triton

    return _chacha_triton


@needs_triton
def test_interpreted_kernel_reproduces_the_rfc_vector(kt):
    out = kt.interpret_bits53(KEY, RFC_POSITION, torch.empty((1, 8), dtype=torch.int64))
    words = np.frombuffer(RFC_BLOCK, dtype="<u8") >> np.uint64(11)
    assert out[0].tolist() == words.astype(np.int64).tolist()


@needs_triton
@pytest.mark.parametrize(("position", "blocks"), RUNS)
def test_interpreted_kernel_matches_openssl_and_tensor(kt, position, blocks):
    key = os.urandom(32)
    out = kt.interpret_bits53(key, position, torch.empty((blocks, 8), dtype=torch.int64))
    assert torch.equal(out, _openssl_or_numpy(key, position, blocks))
    assert torch.equal(out, _tensor(key, position, blocks))
    k = min(blocks, 5)  # the scalar RFC reference on the last blocks (carries included)
    assert out[-k:].reshape(-1).tolist() == ref_bits53(key, position + blocks - k,
                                                       k).tolist()


@needs_triton
def test_interpreted_self_check_passes_and_catches_a_corrupted_kernel(kt, monkeypatch):
    cpu = torch.device("cpu")
    assert kt._self_check(cpu, interpret=True) is None
    real = kt._launch

    def flip_one_bit(only_random_key):
        def launch(key, position, out, interpret):
            real(key, position, out, interpret)
            if not only_random_key or key != kt._RFC_KEY:
                out.view(-1)[-1] ^= 1 << 20  # the last word of the last block
        return launch

    monkeypatch.setattr(kt, "_launch", flip_one_bit(False))
    assert "RFC 8439" in kt._self_check(cpu, interpret=True)
    monkeypatch.setattr(kt, "_launch", flip_one_bit(True))
    assert "differs from the tensor" in kt._self_check(cpu, interpret=True)


@needs_triton
def test_secure_noise_through_the_interpreted_kernel_is_the_tensor_paths(kt, monkeypatch):
    """The kernel as the backend of a secure draw on the accelerators' path (several
    chunks, an odd last one): the same noise, bit for bit, as the tensor cipher."""
    _device_path_on_cpu(monkeypatch)
    monkeypatch.setitem(noise_mod.SECURE_CHUNK_ELEMENTS, "cpu", 1000)
    a = NoiseSource(secure_mode=True)
    x = a.fill_normal_(torch.empty(2501, dtype=torch.float64), 1.5)
    assert a._streams["cpu"].backend.name == "tensor"
    monkeypatch.setitem(_chacha.BACKENDS, "interpreted", _chacha.Backend(
        "interpreted", 9, lambda device: device.type == "cpu",
        lambda key, position, out, work: kt.interpret_bits53(key, position, out)))
    b = NoiseSource(secure_mode=True)
    _same_key(b, a)
    assert b._streams["cpu"].backend.name == "interpreted"
    y = b.fill_normal_(torch.empty(2501, dtype=torch.float64), 1.5)
    assert torch.equal(x, y)


@needs_triton
def test_kernel_compiles_for_an_h100_class_gpu_without_one(kt):
    """The compiled path (which the interpreter does not exercise: Triton's own type
    rules and lowering) builds a cubin for sm_90 with Triton's bundled ptxas, no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this triton has no CUDA backend")
    signature = {"out_ptr": "*i64", **dict.fromkeys(kt._SCALARS, "i32"), "BLOCK": "constexpr"}
    source = ASTSource(fn=kt._kernel(False), signature=signature,
                       constexprs={"BLOCK": kt.BLOCKS_PER_PROGRAM})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kt._NUM_WARPS})
    assert compiled.asm["cubin"]
    assert "shf." in compiled.asm["ptx"]  # the rotations became funnel shifts


# -------------------------------------------------------------------------- CUDA

cuda = pytest.mark.gpu


@cuda
@needs_triton
def test_cuda_triton_kernel_matches_openssl_and_tensor(kt):
    dev = torch.device("cuda", torch.cuda.current_device())
    assert kt.passed(dev) and _chacha.backend_in_use(dev) == "triton"
    out = torch.empty((1, 8), dtype=torch.int64, device=dev)
    _chacha.uniform_bits53(KEY, RFC_POSITION, out)
    assert out.cpu()[0].tolist() == (np.frombuffer(RFC_BLOCK, dtype="<u8")
                                     >> np.uint64(11)).astype(np.int64).tolist()
    for position, blocks in RUNS + [(2**32 - 77_777, 300_000)]:
        key = os.urandom(32)
        out = torch.empty((blocks, 8), dtype=torch.int64, device=dev)
        _chacha.uniform_bits53(key, position, out, backend="triton")
        assert torch.equal(out, _tensor(key, position, blocks, dev))
        assert torch.equal(out.cpu(), _openssl_or_numpy(key, position, blocks))


@cuda
@needs_triton
def test_cuda_secure_draw_is_one_kernel_launch_per_chunk(kt, monkeypatch):
    """Three chunks: three launches of the kernel (the module's counter, and the
    profiler's CUDA kernel events when it records any), about 22 torch operations per
    chunk besides (the Box-Muller / Holohan-Braghin transform), and the same noise, bit
    for bit, as the tensor cipher with the same key."""
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 3_000_000
    monkeypatch.setitem(noise_mod.SECURE_SCRATCH_BYTES, "cuda",
                        noise_mod.SECURE_BYTES_PER_ELEMENT * (n // 3 + 2))
    src = NoiseSource(secure_mode=True)
    src.fill_normal_(torch.empty(4, dtype=torch.float64, device=dev), 1.0)  # self-check
    key = f"cuda:{dev.index}"
    assert src._streams[key].backend.name == "triton"
    out = torch.empty(n, dtype=torch.float64, device=dev)
    before = kt.launches()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof, \
            _CountOps() as ops:
        src.fill_normal_(out, 1.0)
        torch.cuda.synchronize()
    assert kt.launches() - before == 3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:  # CUPTI recorded the device's kernels
        assert sum("chacha20" in e.name for e in kernels) == 3
    assert ops.ops <= 3 * 30, ops.ops
    ref = NoiseSource(secure_mode=True)
    ref._streams[key] = noise_mod._SecureStream(dev)
    ref._streams[key].key = src._streams[key].key
    ref._streams[key].backend = _chacha.BACKENDS["tensor"]
    ref._streams[key].position = 2  # after the 4-element first draw
    y = ref.fill_normal_(torch.empty(n, dtype=torch.float64, device=dev), 1.0)
    assert torch.equal(out, y)


@cuda
@needs_triton
def test_cuda_failed_self_check_or_launch_falls_back_to_the_tensor_cipher(kt, monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    name = f"cuda:{dev.index}"
    monkeypatch.setattr(kt, "_PASSED", {})
    monkeypatch.setattr(kt, "_BROKEN", set())
    monkeypatch.setattr(kt, "_WARNED", set())
    real = kt._launch

    def corrupt(key, position, out, interpret):
        real(key, position, out, interpret)
        out.view(-1)[-1:].bitwise_xor_(1)

    monkeypatch.setattr(kt, "_launch", corrupt)
    with pytest.warns(RuntimeWarning, match="self-check failed"):
        assert not kt.passed(dev)
    assert _chacha.backend_for(dev).name == "tensor"
    src = NoiseSource(secure_mode=True)
    src.fill_normal_(torch.empty(10, device=dev), 1.0)
    assert src._streams[name].backend.name == "tensor"

    # passed, then a launch raises: the whole run is recomputed by the tensor cipher
    kt._PASSED[name] = True
    kt._WARNED.clear()

    def fail(key, position, out, interpret):
        out.fill_(-1)
        raise RuntimeError("launch failed")

    monkeypatch.setattr(kt, "_launch", fail)
    key = os.urandom(32)
    out = torch.empty((1000, 8), dtype=torch.int64, device=dev)
    with pytest.warns(RuntimeWarning, match="a launch failed"):
        _chacha.uniform_bits53(key, 2**32 - 10, out, backend="triton")
    assert torch.equal(out, _tensor(key, 2**32 - 10, 1000, dev))
    assert _chacha.backend_in_use(dev) == "tensor"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        _chacha.uniform_bits53(key, 0, out, backend="triton")
