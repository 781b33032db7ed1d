"""The sampling and noise steps of DP-SGD shared by the binary and multinomial paths
of :mod:`privlearn.models.dpsgd` (Abadi et al. 2016, Alg. 1: Poisson sampling with
rate ``q``; noise ``sigma C`` on each coordinate of the sum of clipped gradients).

References
----------
.. [1] M. Abadi et al. (2016), Deep learning with differential privacy, CCS, Alg. 1.
"""

from __future__ import annotations

import numpy as np

__all__ = ["noisy_sum", "poisson_batch"]


def poisson_batch(
    rng: np.random.Generator, q: float, *arrays: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Step 1: the rows of ``arrays`` (all of the same length ``n``) in a Poisson
    sample, each row kept independently with probability ``q`` (one ``rng.random(n)``
    draw); with ``q >= 1`` every row, drawing nothing."""
    if q < 1.0:
        idx = np.flatnonzero(rng.random(arrays[0].shape[0]) < q)
        return tuple(a[idx] for a in arrays)
    return arrays


def noisy_sum(total: np.ndarray, noise: str, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Step 3: ``total`` plus independent ``N(0, scale^2)`` (``noise="gaussian"``) or
    ``Laplace(scale)`` noise on each coordinate, drawn as one array of its shape."""
    if noise == "gaussian":
        return total + rng.normal(scale=scale, size=total.shape)
    return total + rng.laplace(scale=scale, size=total.shape)
