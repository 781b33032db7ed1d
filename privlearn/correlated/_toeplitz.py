"""Lower-triangular Toeplitz arithmetic on coefficient vectors (private helper).

A lower-triangular Toeplitz ``n x n`` matrix ``T(c)`` is stored as its first column
``c`` (length ``n``, zero-padded). Such matrices commute, their products and inverses are
again lower-triangular Toeplitz, and every operation here costs ``O(n log n)`` (FFT
convolution) or ``O(n b)`` (banded solves) instead of ``O(n^2)``.
"""

from __future__ import annotations

import numpy as np
from scipy import linalg

__all__ = ["pad", "convolve", "correlate", "inverse", "materialize"]


def pad(c: np.ndarray, n: int) -> np.ndarray:
    """``c`` truncated or zero-padded to length ``n`` (float64)."""
    c = np.asarray(c, dtype=float)[:n]
    out = np.zeros(n)
    out[: c.size] = c
    return out


def _fft_len(n: int) -> int:
    return 1 << int(2 * n - 1).bit_length()


def convolve(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """First column of ``T(a) T(b)``: the first ``n`` terms of the convolution ``a * b``."""
    a, b = pad(a, n), pad(b, n)
    if n <= 64:
        return np.convolve(a, b)[:n]
    m = _fft_len(n)
    return np.fft.irfft(np.fft.rfft(a, m) * np.fft.rfft(b, m), m)[:n]


def correlate(g: np.ndarray, a: np.ndarray, n: int) -> np.ndarray:
    """``T(a)^T g``: ``out[j] = sum_{i >= j} g[i] a[i - j]`` (adjoint of ``convolve``)."""
    return convolve(pad(g, n)[::-1], a, n)[::-1]


def inverse(c: np.ndarray, n: int) -> np.ndarray:
    """First column of ``T(c)^{-1}`` (length ``n``), by a banded triangular solve.

    ``c[0]`` must be non-zero. The cost is ``O(n * len(c))``.
    """
    c = np.asarray(c, dtype=float)[:n]
    b = c.size
    if b == 0 or c[0] == 0.0:
        raise ValueError("the strategy's leading coefficient c[0] must be non-zero")
    rhs = np.zeros(n)
    rhs[0] = 1.0
    if b == 1:
        return rhs / c[0]
    ab = np.zeros((b, n))  # lower banded storage: ab[i, j] = T[i + j, j]
    for i in range(b):
        ab[i, : n - i] = c[i]
    return linalg.solve_banded((b - 1, 0), ab, rhs, check_finite=False)


def materialize(c: np.ndarray, n: int) -> np.ndarray:
    """The dense ``n x n`` matrix ``T(c)``."""
    c = pad(c, n)
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)
