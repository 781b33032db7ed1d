"""A sampler's seed is checked where the sampler takes it: the key chain reads it as 16
signed bytes, so a seed beyond them, a string (read by ``int``), a NaN or a bool is
refused with a typed error naming ``seed`` (a huge float raised a bare OverflowError
when the first batch was drawn)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from privlearn.errors import ParameterTypeError, ParameterValueError  # noqa: E402
from privlearn.torch import PoissonBatchSampler  # noqa: E402


@pytest.mark.parametrize(
    "seed", [1e308, 2**127, "1", math.nan, True], ids=["huge float", "2**127", "str", "nan", "bool"]
)
def test_bad_seed_is_refused_naming_it(seed):
    with pytest.raises((ParameterTypeError, ParameterValueError), match=r"^seed must"):
        list(PoissonBatchSampler(64, 0.1, steps=2, seed=seed))


def test_valid_seeds_give_the_same_batches_as_their_int():
    import numpy as np

    def draw(seed):
        return [list(b) for b in PoissonBatchSampler(64, 0.1, steps=3, seed=seed)]

    assert draw(np.int64(7)) == draw(7.0) == draw(7)
    assert draw(-(2**127)) == draw(-(2**127))  # the smallest seed the key chain takes
