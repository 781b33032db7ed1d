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

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    Identity,
    MinSeparation,
    SingleParticipation,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
    sensitivity,
)
from privlearn.correlated.error import per_query_error
from privlearn.correlated.strategies import blt_inverse_coefs, square_root_coefs
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


# every public callable of privlearn.correlated that materialises an array over the
# steps: the same limit, the same typed error, naming its own parameter (it answered a
# bare MemoryError, or ran out of memory)
_BLT = BufferedToeplitz((0.9, 0.5), (0.2, 0.1))
_BANDED = BandedToeplitz.square_root(4)


@pytest.mark.parametrize("n", [10**12, LIMIT + 1, 1e308])
@pytest.mark.parametrize(
    "call",
    [
        lambda n: Identity().toeplitz_coefs(n),
        lambda n: _BANDED.toeplitz_coefs(n),
        lambda n: _BLT.toeplitz_coefs(n),
        lambda n: _BLT.coefs_error_bound(n),
        lambda n: _BANDED.inverse_toeplitz_coefs(n),
        lambda n: _BLT.inverse_toeplitz_coefs(n),
        lambda n: _BANDED.max_column_norm(n),
        lambda n: _BANDED.materialize(n),
        lambda n: square_root_coefs(n),
        lambda n: blt_inverse_coefs(np.array([0.9]), np.array([0.2]), n),
    ],
)
def test_a_strategy_refuses_a_horizon_past_the_limit(call, n):
    with pytest.raises(ParameterValueError, match=r"n must be in \[1, 134217728\]") as e:
        call(n)
    assert repr(n) in str(e.value) and "fewer steps" in str(e.value)


def test_a_blt_bounds_steps_times_buffers():
    many = BufferedToeplitz(tuple(np.linspace(0.1, 0.9, 1024)), (1e-4,) * 1024)
    for call in (many.toeplitz_coefs, many.coefs_error_bound, many.inverse_toeplitz_coefs):
        with pytest.raises(ParameterValueError, match=r"buffers must be in \[1, 2\] for "
                           r"n=67108864.*got 1024"):
            call(LIMIT // 2)  # an n x buffers array of 2**36 entries: 512 GiB
    assert many.toeplitz_coefs(1000).shape == (1000,)


def test_materialize_bounds_the_dense_matrix():
    with pytest.raises(ParameterValueError, match=r"n must be in \[1, 11585\].*toeplitz_coefs"):
        _BANDED.materialize(20_000)  # 4e8 entries: 3 GiB
    assert _BANDED.materialize(4).shape == (4, 4)


@pytest.mark.parametrize("participation", [SingleParticipation(), MinSeparation(4),
                                           FixedEpochs(epochs=2)])
def test_sensitivity_of_a_long_horizon_is_refused_where_it_needs_the_coefficients(
        participation):
    # a BLT's rules read its n coefficients: refused, naming steps; a banded strategy's
    # rules read its bands only and still take any number of steps
    with pytest.raises(ParameterValueError, match=r"steps must be in \[1, 134217728\]"):
        sensitivity(_BLT, participation, 10**12)
    assert sensitivity(_BANDED, participation, 10**12).value > 0
