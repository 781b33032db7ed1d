"""How many steps a run takes: the one rule shared by the CLI, the estimators and
:func:`privlearn.torch.make_private`.

A data loader that samples each step at rate ``q`` (Poisson: every example joins with
probability ``q``; fixed-size: ``q N`` distinct examples) runs ``steps_per_epoch(q) =
max(1, round(1 / q))`` steps per epoch, so that one epoch processes ``N`` examples in
expectation, and ``epochs`` epochs run ``epochs * steps_per_epoch(q)`` steps. Every
place that turns epochs into steps calls these functions, so a run described by
``--epochs`` on the command line is accounted for exactly the steps the loader takes.
"""

from __future__ import annotations

import math

from privlearn import _validation as _v

__all__ = ["steps_per_epoch", "planned_steps"]


def steps_per_epoch(sampling_rate: float) -> int:
    """Steps in one epoch at sampling rate ``q``: ``max(1, round(1 / q))``.

    Parameters
    ----------
    sampling_rate : float in (0, 1]
        Probability that an example is in a given batch (batch size / dataset size).

    Returns
    -------
    int
        At least 1.
    """
    q = _v.check_rate("sampling_rate", sampling_rate)
    return max(1, round(1 / q))


def planned_steps(sampling_rate: float, epochs: float) -> int:
    """Steps of ``epochs`` epochs at sampling rate ``q``:
    ``ceil(epochs * steps_per_epoch(q))`` (``epochs * steps_per_epoch(q)`` for whole
    epochs; a fractional last epoch is rounded up, so no step is left unaccounted).

    Parameters
    ----------
    sampling_rate : float in (0, 1]
    epochs : float > 0

    Returns
    -------
    int
        At least 1.
    """
    e = _v.check_positive("epochs", epochs, hint="the number of passes over the data, e.g. 3")
    per_epoch = steps_per_epoch(sampling_rate)
    if float(e).is_integer():
        return int(e) * per_epoch
    return max(1, math.ceil(e * per_epoch))
