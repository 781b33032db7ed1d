"""Exceptions and warnings shared by every layer of privlearn.

A leaf module: it imports nothing from the package, so any layer (accounting, models,
torch, auditing, ledger, the CLI) can raise or catch these without import cycles.
"""

from __future__ import annotations

__all__ = [
    "PrivacyLeakWarning",
    "GradientOverflowWarning",
    "PrivacyBudgetExceededError",
    "BudgetExceededError",
]


class PrivacyLeakWarning(UserWarning):
    """A non-private choice was made explicitly (for example a data-dependent default
    was opted into, or a parameter was set that releases un-noised information).

    Emitted to the person who runs the computation; the released object is then *not*
    covered by the accounted mechanism for the part the warning names.
    """


class GradientOverflowWarning(RuntimeWarning):
    """Some examples' (loss-scaled) per-example gradients were not finite (fp16
    overflow) and were left out of the clipped sum: they contributed zero to the step.

    Emitted to the person who runs the training loop (it reports a count of examples,
    which is not released by the training); the released update stays covered by the
    accounted mechanism (dropping an example keeps its contribution within the clipping
    bound).
    """


class PrivacyBudgetExceededError(RuntimeError):
    """A step or release would take the privacy loss past a cap the user set
    (``make_private(..., max_epsilon=...)``); raised *before* the step runs."""


class BudgetExceededError(PrivacyBudgetExceededError):
    """A spend against a persistent privacy ledger would exceed the dataset's budget;
    nothing was recorded and the data was not touched."""
