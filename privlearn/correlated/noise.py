"""The online noise generator, in NumPy: the reference the PyTorch engine follows.

Step ``t`` adds ``(C^{-1} z)_t`` (times ``noise_multiplier * max_grad_norm``) where
``z_0, z_1, ...`` are i.i.d. standard Gaussian draws of the parameters' shape. The
generator keeps only the strategy's buffers -- ``b - 1`` past noises for a ``b``-banded
strategy, ``m`` buffers for a BLT -- so its memory is ``O(b)`` or ``O(m)`` times the
parameter size, never ``O(steps)``.

>>> import numpy as np
>>> from privlearn.correlated import BandedToeplitz
>>> from privlearn.correlated.noise import CorrelatedNoise
>>> gen = CorrelatedNoise(BandedToeplitz((1.0, 0.5)).recurrence(), shape=(3,))
>>> noises = [gen.step(z) for z in np.eye(3)]   # C^{-1} applied to e_0, e_1, e_2
>>> np.round(noises[2], 3).tolist()
[0.25, -0.5, 1.0]
"""

from __future__ import annotations

import numpy as np

from privlearn.correlated.strategies import (
    BandedRecurrence,
    BufferedRecurrence,
    DenseRecurrence,
    check_stable,
)
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = ["CorrelatedNoise"]


class CorrelatedNoise:
    """Applies ``C^{-1}`` online to a stream of Gaussian draws.

    Parameters
    ----------
    recurrence : BandedRecurrence, BufferedRecurrence or DenseRecurrence
        From the strategy's ``recurrence()``. A ``DenseRecurrence`` (of a
        :class:`~privlearn.correlated.strategies.DenseStrategy` of ``n`` steps) makes
        the generator keep every draw: ``n`` arrays of ``shape``, allocated up front.
    shape : tuple of int
        Shape of one draw (the parameters').

    Raises
    ------
    ConfigurationError
        ``C^{-1}`` grows without bound
        (:func:`~privlearn.correlated.strategies.check_stable`).
    """

    def __init__(
        self,
        recurrence: BandedRecurrence | BufferedRecurrence | DenseRecurrence,
        shape: tuple[int, ...],
    ) -> None:
        if not isinstance(recurrence, BandedRecurrence | BufferedRecurrence | DenseRecurrence):
            raise ParameterTypeError(
                "recurrence must be a BandedRecurrence, BufferedRecurrence or "
                f"DenseRecurrence (from a strategy's .recurrence()), got {recurrence!r}")
        if not isinstance(recurrence, DenseRecurrence):  # a dense C^{-1} is finite
            check_stable(recurrence)
        self.recurrence = recurrence
        self.shape = tuple(shape)
        self.buffers = np.zeros((recurrence.buffers, *self.shape))
        self.steps = 0

    def step(self, z: np.ndarray) -> np.ndarray:
        """The noise of the next step from the current draw ``z`` (shape ``shape``).

        Raises
        ------
        ParameterValueError
            ``z`` does not have the shape ``shape``: refused before the state moves, so
            the next draws still get the rows of ``C^{-1} z``.
        ConfigurationError
            A dense strategy's ``n`` steps are all drawn: it defines no noise past them.
        """
        z = np.asarray(z, dtype=float)
        if z.shape != self.shape:
            raise ParameterValueError(
                f"z must have the generator's shape {self.shape}, got shape {z.shape}; "
                "draw each step's Gaussian in the shape the generator was made with (a "
                "draw of another shape would be broadcast into, or corrupt, the noise "
                "state)")
        rec = self.recurrence
        if isinstance(rec, DenseRecurrence):
            t = self.steps
            if t >= rec.steps:
                raise ConfigurationError(
                    f"step {t + 1}: the dense strategy is defined for {rec.steps} steps, "
                    f"and all {rec.steps} are drawn; optimise a DenseStrategy for the "
                    "steps you run (optimize_dense), or use a Toeplitz strategy, which "
                    "runs for any number of steps")
            self.buffers[t] = z
            out = np.tensordot(rec.inverse[t, : t + 1], self.buffers[: t + 1], axes=1)
        elif isinstance(rec, BandedRecurrence):
            c = rec.coefs
            b = len(c)
            out = z.copy()
            # buffers hold noise_{t-1}, ..., noise_{t-b+1} in a ring indexed by t mod (b-1)
            for j in range(1, min(b, self.steps + 1)):
                out -= c[j] * self.buffers[(self.steps - j) % (b - 1)]
            out /= c[0]
            if b > 1:
                self.buffers[self.steps % (b - 1)] = out
        else:
            out = z.copy()
            for k, w in enumerate(rec.output_scale):
                out -= w * self.buffers[k]
            for k, d in enumerate(rec.buf_decay):
                self.buffers[k] *= d
                self.buffers[k] += out
        self.steps += 1
        return out
