"""The query of an accountant -- the delta it is asked an epsilon at, or the epsilon it
is asked a delta at -- checked at the public boundary (private helper of the
accountants).

An accountant answers for one number: a NumPy scalar or 0-d array is read as its float
(hashable, so the accountants' caches can hold it); anything else -- a string, a
sequence, NaN, a delta outside ``[0, 1]``, a negative epsilon -- is refused with a
typed error naming the parameter, rather than answered (a NaN delta compared as false
everywhere and gave an epsilon of 0).
"""

from __future__ import annotations

from privlearn._validation import DELTA_HINT, check_delta, check_nonnegative

__all__ = ["query_delta", "query_epsilon"]


def query_delta(delta: object) -> float:
    """``delta`` as a float in ``[0, 1]``, or a typed error naming it."""
    return check_delta("delta", delta, allow_one=True, hint=DELTA_HINT)


def query_epsilon(epsilon: object) -> float:
    """``epsilon`` as a float in ``[0, inf]``, or a typed error naming it."""
    return check_nonnegative(
        "epsilon", epsilon, allow_inf=True, hint="pass an epsilon >= 0 such as 1.0"
    )
