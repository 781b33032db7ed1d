"""The strategy optimisers and the error computation refuse a horizon they cannot
allocate with a typed error naming the parameter, the valid range and the value --
``steps=1e308`` or ``10**12``, or a huge ``buffers``, answered a bare ``ValueError`` /
``MemoryError`` from NumPy. The limit is ``steps x max(1, buffers) <= 2**27`` float64
entries (1 GiB per array); the counts are checked as every count of the package
(``check_count``: integral floats and NumPy integers accepted, ``10.5`` and bools
refused)."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import Identity, loss, optimize_banded_toeplitz, optimize_blt
from privlearn.correlated.error import per_query_error
from privlearn.errors import ParameterTypeError, ParameterValueError

LIMIT = 2**27


@pytest.mark.parametrize("steps", [1e308, 10**30, 10**12, LIMIT + 1])
@pytest.mark.parametrize(
    "call",
    [
        lambda s: optimize_blt(steps=s, buffers=2),
        lambda s: optimize_banded_toeplitz(steps=s, bands=2),
        lambda s: loss(Identity(), s),
        lambda s: per_query_error(Identity(), s),
    ],
    ids=["optimize_blt", "optimize_banded_toeplitz", "loss", "per_query_error"],
)
def test_huge_steps_refused_naming_steps(call, steps):
    with pytest.raises(ParameterValueError, match=r"steps must be in \[1, 134217728\]") as e:
        call(steps)
    assert repr(steps) in str(e.value) and "smaller horizon" in str(e.value)


@pytest.mark.parametrize("buffers", [10**12, 1e308, LIMIT // 100 + 1])
def test_huge_buffers_refused_naming_buffers(buffers):
    with pytest.raises(ParameterValueError, match=r"buffers must be in \[1, 1342177\]") as e:
        optimize_blt(steps=100, buffers=buffers)
    assert repr(buffers) in str(e.value)


@pytest.mark.parametrize("bands", [10**12, 1e308])
def test_huge_bands_refused_naming_bands(bands):
    with pytest.raises(ParameterValueError, match=r"bands must be in \[1, steps=100\]"):
        optimize_banded_toeplitz(steps=100, bands=bands)


@pytest.mark.parametrize(
    "fn, size", [(optimize_blt, "buffers"), (optimize_banded_toeplitz, "bands")]
)
def test_count_types_consistent(fn, size):
    ref = fn(steps=16, **{size: 2})
    assert fn(steps=np.int64(16), **{size: np.int64(2)}) == ref
    assert fn(steps=16.0, **{size: 2.0}) == ref
    with pytest.raises(ParameterValueError, match="steps must be an integer >= 1, got 10.5"):
        fn(steps=10.5, **{size: 2})
    with pytest.raises(ParameterTypeError, match="steps must be an integer"):
        fn(steps=True, **{size: 2})
    with pytest.raises(ParameterTypeError, match=f"{size} must be an integer"):
        fn(steps=16, **{size: True})
