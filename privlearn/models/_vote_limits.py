"""The largest vote array a PATE release accepts.

A release of ``n_queries`` hard votes over ``n_classes`` classes materialises the vote
histogram, the noise and the noisy votes: three float64 arrays of ``n_queries x
n_classes`` entries (and NumPy's temporaries of the same size). Past the machine's memory
NumPy fails with a bare ``MemoryError`` -- after the plan has been reserved on a ledger,
where it is charged in full. :func:`check_vote_size` refuses such a size while planning,
before anything is charged, with a :class:`~privlearn.errors.ParameterValueError`.
"""

from __future__ import annotations

import os

from privlearn.errors import ParameterValueError

#: float64 arrays of ``n_queries x n_classes`` entries held at once by a release
_ARRAYS_HELD = 4
#: the limit where the machine's memory cannot be read: 2**30 entries (8 GiB per array)
_FALLBACK_ENTRIES = 2**30


def max_vote_entries() -> int:
    """The most ``n_queries x n_classes`` entries a release accepts: the machine's
    physical memory divided among the :data:`_ARRAYS_HELD` float64 arrays a release
    holds (``2**30`` where the memory cannot be read)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no value
        return _FALLBACK_ENTRIES
    return max(1, memory // (8 * _ARRAYS_HELD))


def check_vote_size(n_queries: int, n_classes: int) -> None:
    """Refuse a vote array of ``n_queries x n_classes`` float64 entries past
    :func:`max_vote_entries`, naming both and what to do instead."""
    limit = max_vote_entries()
    if n_queries * n_classes <= limit:
        return
    gib = n_queries * n_classes * 8 / 2**30
    if n_classes > limit:
        advice = (
            "n_classes alone exceeds it: map the labels to a smaller public label "
            "set (the number of classes the teachers actually predict)"
        )
    else:
        advice = (
            f"release the queries in batches of at most {limit // n_classes} "
            "(each call is calibrated to epsilon and composed into the account: give "
            "each batch its share of the budget)"
        )
    raise ParameterValueError(
        f"n_classes={n_classes} with {n_queries} queries needs a vote array of "
        f"{n_queries} x {n_classes} float64 entries ({gib:.3g} GiB, several held at once), "
        f"above this machine's limit of {limit} entries (its memory / {_ARRAYS_HELD} "
        f"arrays of 8 bytes); nothing was charged. {advice}"
    )
