"""Lower-triangular Toeplitz arithmetic on coefficient vectors (private helper).

A lower-triangular Toeplitz ``n x n`` matrix ``T(c)`` is stored as its first column
``c`` (length ``n``, zero-padded). Such matrices commute, their products and inverses are
again lower-triangular Toeplitz, and every operation here costs ``O(n log n)`` (FFT
convolution) or ``O(n b)`` (banded solves) instead of ``O(n^2)``.
"""

from __future__ import annotations

import numpy as np

from privlearn.errors import ParameterValueError

_ZERO_LEAD = ("the strategy's leading coefficient c[0] must be non-zero (T(c) must be "
              "invertible), got {!r}; use a strategy with a positive leading term, e.g. "
              "BandedToeplitz((1.0, 0.5))")

__all__ = ["pad", "convolve", "correlate", "banded_solve", "inverse", "materialize"]


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


def banded_solve(c: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``T(c)^{-1} rhs`` for a short ``c`` (``c[0] != 0``): the recursion
    ``x_t = (rhs_t - sum_{j >= 1} c_j x_{t-j}) / c_0`` (forward substitution, ``O(n b)``)
    run by :func:`scipy.signal.lfilter`."""
    from scipy import signal  # imported here: scipy.signal imports scipy.stats (slow)

    if c[0] == 0.0:
        raise ParameterValueError(_ZERO_LEAD.format(c[0]))
    return signal.lfilter([1.0], np.asarray(c, dtype=float), np.asarray(rhs, dtype=float))


def inverse(c: np.ndarray, n: int) -> np.ndarray:
    """First column of ``T(c)^{-1}`` (length ``n``), by forward substitution
    (:func:`banded_solve`); trailing zeros of ``c`` are dropped, so ``b`` non-zero bands
    cost ``O(n b)``. ``c[0]`` must be non-zero."""
    c = np.asarray(c, dtype=float)[:n]
    nz = np.flatnonzero(c)
    if nz.size == 0 or c[0] == 0.0:
        raise ParameterValueError(_ZERO_LEAD.format(c[0]))
    rhs = np.zeros(n)
    rhs[0] = 1.0
    return banded_solve(c[: int(nz[-1]) + 1], rhs)


def materialize(c: np.ndarray, n: int) -> np.ndarray:
    """The dense ``n x n`` matrix ``T(c)``."""
    c = pad(c, n)
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)
