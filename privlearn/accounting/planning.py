"""Planning a run: how many steps it takes (the one rule shared by the CLI, the
estimators and :func:`privlearn.torch.make_private`) and whether its delta is sensible.

A data loader that samples each step at rate ``q`` (Poisson: every example joins with
probability ``q``; fixed-size: ``q N`` distinct examples) runs ``steps_per_epoch(q) =
max(1, round(1 / q))`` steps per epoch, so that one epoch processes ``N`` examples in
expectation, and ``epochs`` epochs run ``epochs * steps_per_epoch(q)`` steps. Every
place that turns epochs into steps calls these functions, so a run described by
``--epochs`` on the command line is accounted for exactly the steps the loader takes.
"""

from __future__ import annotations

import math
import warnings

from privlearn._validation import check_count, check_delta, check_positive, check_rate
from privlearn.errors import ParameterValueError, PrivacyLeakWarning

__all__ = ["steps_per_epoch", "planned_steps", "warn_if_delta_large"]


def steps_per_epoch(sampling_rate: float, cycle_length: int = 1) -> int:
    """Steps in one epoch at sampling rate ``q``: ``max(1, round(c / q))``, ``c`` the
    cycle length (1 without one), which is ``round(N / B)`` for the rate ``q = B c / N``
    of batches of ``B`` of ``N`` examples.

    One exact integer rule for every sampler and the accountant: ``c / q`` is computed in
    floats, so an exact tie ``N / B = k + 1/2`` lands a few ulps on either side of it
    (``N = 49, B = 2``: ``1 / (2 / 49) = 24.500000000000004``). A ratio within a relative
    ``1e-12`` of a half-integer is that tie (a ratio of integers below ``5e11`` that is not
    a tie is further from one) and rounds half to even, as ``round(N / B)`` does.

    Parameters
    ----------
    sampling_rate : float in (0, 1]
        Probability that an example is in a given batch (batch size / dataset size;
        ``B c / N`` for cyclic Poisson sampling within ``c`` groups).
    cycle_length : int >= 1
        The number of groups an example's steps cycle through (1: Poisson, fixed-size).

    Returns
    -------
    int
        At least 1.
    """
    q = check_rate("sampling_rate", sampling_rate)
    c = check_count("cycle_length", cycle_length, minimum=1)
    ratio = c / q if c < 2**1000 else math.inf
    if not math.isfinite(ratio) and c == 1:  # a subnormal rate: 1 / q overflows
        raise ParameterValueError(
            f"sampling_rate must be in (0, 1] with a finite 1 / sampling_rate, got {q!r}; "
            "use batch size / dataset size")
    if not math.isfinite(ratio):  # a huge cycle: c / q overflows
        raise ParameterValueError(
            f"cycle_length / sampling_rate must be finite (the steps of one epoch), got "
            f"cycle_length={c!r}, sampling_rate={q!r}; use sampling_rate = batch size / "
            "dataset size and cycle_length = the number of groups (1 without cycling)")
    k = math.floor(ratio)
    if abs(ratio - (k + 0.5)) <= 1e-12 * ratio:  # the tie N / B = k + 1/2
        return max(1, k if k % 2 == 0 else k + 1)
    return max(1, round(ratio))


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
    e = check_positive("epochs", epochs, hint="the number of passes over the data, e.g. 3")
    per_epoch = steps_per_epoch(sampling_rate)
    if float(e).is_integer():
        return int(e) * per_epoch
    return max(1, math.ceil(e * per_epoch))


def warn_if_delta_large(delta: float, n: int, *, name: str = "delta",
                        stacklevel: int = 3, default: float | None = None) -> None:
    """Warn (:class:`privlearn.errors.PrivacyLeakWarning`) when ``delta >= 1 / n``.

    A mechanism that publishes one random record of ``n`` in the clear is
    ``(0, 1/n)``-DP, so a guarantee with ``delta`` at or above ``1 / n`` allows that and
    says little (Dwork & Roth 2014, "The Algorithmic Foundations of Differential
    Privacy", Sec. 2.3: delta should be much smaller than ``1 / n``). The computation is
    still accounted exactly; the warning tells the person running it to pick a smaller
    delta (``1 / n^1.1`` or ``1e-5`` for ``n`` up to ~100k are usual). ``default``: the
    caller's default for ``name``; a ``delta`` equal to it is called the default, so that
    whoever did not set it knows which setting the warning is about.
    """
    delta = check_delta(name, delta, allow_one=True)
    n = check_count("n", n, hint="pass the number of records in the dataset")
    if n >= 1 and delta > 0 and delta >= 1.0 / n:
        warnings.warn(
            f"{name}={delta:g}{' (the default)' if delta == default else ''} is at least "
            f"1/n = 1/{n} = {1.0 / n:.3g} for a dataset of {n} "
            f"records: a (epsilon, {delta:g})-DP release may still expose a whole record "
            f"(publishing one random record in the clear is (0, 1/n)-DP). Pick {name} well "
            f"below 1/n, e.g. {name}={_suggest_delta(n):.1g}",
            PrivacyLeakWarning, stacklevel=stacklevel)


def _suggest_delta(n: int) -> float:
    """A delta well below ``1 / n``: ``min(1e-5, n ** -1.1)``."""
    return min(1e-5, float(n) ** -1.1)
