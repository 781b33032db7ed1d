"""Shared validation and helpers for the private estimators.

Parameters are only stored by ``__init__`` (scikit-learn convention) and validated when
``fit`` starts, through :mod:`privlearn._validation` (the one validation vocabulary of
privlearn): a wrong value is a :class:`ValueError`, a wrong type a
:class:`~privlearn._validation.ParameterTypeError` (a TypeError that is also a
ValueError), each naming the parameter, the valid range, the value received and what
to try.
"""

from __future__ import annotations

import contextlib
import difflib
import numbers
from collections.abc import Callable, Iterator

import numpy as np

from privlearn import _validation as _v
from privlearn.accounting import Mechanism, compose

__all__ = [
    "ParameterTypeError",
    "check_privacy_budget",
    "check_positive_param",
    "clip_rows",
    "make_rng",
    "cancel_on_error",
    "reserve_on_ledger",
    "settle_on_ledger",
    "spend_on_ledger",
    "spent_epsilon",
]


# One validation vocabulary (privlearn._validation): wrong types raise
# ParameterTypeError (a TypeError, and a ValueError as scikit-learn's
# InvalidParameterError is), wrong values ValueError, each message naming the
# parameter, the valid range, the value received and what to try.
ParameterTypeError = _v.ParameterTypeError


def _real(name: str, value: object) -> float:
    return _v.check_real(name, value)


def check_privacy_budget(
    epsilon: object, delta: object, *, noise: str | None = None
) -> tuple[float, float]:
    """Validate a privacy budget: ``epsilon`` in (0, inf), ``delta`` in [0, 1).

    If ``noise == "gaussian"`` also reject ``delta == 0``: the Gaussian mechanism has no
    pure-DP guarantee, and the message points to the Laplace option.
    """
    eps = _v.check_positive(
        "epsilon", epsilon,
        hint="it is the privacy budget, typically between 0.1 and 10")
    dlt = _v.check_delta(
        "delta", delta, hint="use a value well below 1 / n_samples, e.g. 1e-6")
    if noise == "gaussian" and dlt == 0.0:
        raise ValueError(
            "delta=0 is impossible with Gaussian noise: the Gaussian mechanism satisfies "
            "no pure (epsilon, 0)-DP guarantee. Use noise='laplace' (L1 clipping, pure DP) "
            "for delta=0, or pass delta > 0."
        )
    return eps, dlt


def check_positive_param(name: str, value: object, *, allow_none: bool = False) -> float | None:
    """A finite number > 0 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return None
    return _v.check_positive(name, value)


def check_int_param(name: str, value: object, minimum: int = 1, allow_none: bool = False):
    """An ``int`` >= ``minimum`` (or None when ``allow_none``); floats are refused, as
    scikit-learn refuses them for counts."""
    if value is None and allow_none:
        return None
    return _v.check_count(name, value, minimum=minimum, integral_floats=False)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive), with a "did you mean" suggestion."""
    hint = None
    if isinstance(value, str) and value.lower() not in choices:
        close = difflib.get_close_matches(value.lower(), choices, n=1)
        hint = f"did you mean {close[0]!r}?" if close else None
    return _v.check_choice(name, value, choices, hint=hint)


def clip_rows(X: np.ndarray, bound: float, ord: int | float = 2) -> tuple[np.ndarray, int]:
    """Scale every row whose ``ord``-norm exceeds ``bound`` down to norm ``bound``.

    Returns the clipped copy and the number of rows that were clipped. Rows within the
    bound are unchanged, so data that already satisfies the bound is never altered.
    """
    norms = np.linalg.norm(X, ord=ord, axis=1)
    over = norms > bound
    if not np.any(over):
        return X, 0
    Xc = np.array(X, dtype=float, copy=True)
    Xc[over] *= (bound / norms[over])[:, None]
    return Xc, int(np.count_nonzero(over))


def make_rng(random_state: object) -> np.random.Generator:
    """A NumPy Generator from ``None``, an int seed, a Generator or a RandomState."""
    if random_state is None or isinstance(random_state, numbers.Integral | np.integer):
        if random_state is not None and int(random_state) < 0:
            raise ValueError(f"random_state must be a non-negative int, got {random_state!r}")
        return np.random.default_rng(random_state)
    if isinstance(random_state, np.random.Generator):
        return random_state
    if isinstance(random_state, np.random.RandomState):
        return np.random.default_rng(random_state.randint(0, 2**32 - 1, dtype=np.uint64))
    raise ValueError(
        f"random_state must be None, an int, a numpy Generator or RandomState, "
        f"got {random_state!r}"
    )


def spent_epsilon(mechanism: Mechanism, delta: float, accountant: str) -> float:
    """Certified epsilon of ``mechanism`` at ``delta`` (upper bound from the accountant)."""
    return float(mechanism.epsilon(delta, accountant))


def spend_on_ledger(estimator: object, mechanism: Mechanism, label: str | None = None):
    """Spend ``mechanism`` on the estimator's ``ledger`` (if it has one) *before* the
    release reads the data; raises :class:`privlearn.errors.BudgetExceededError` (and
    records nothing) when it would exceed the budget. Returns the ledger entry, or None.

    ``ledger`` must be a budget handle, ``Ledger(path).budget(dataset)``
    (:mod:`privlearn.ledger`); anything with a ``spend(mechanism, *, label)`` method works.
    """
    handle = _ledger_handle(estimator, "spend")
    if handle is None:
        return None
    return handle.spend(mechanism, label=label or type(estimator).__name__)


def _ledger_handle(estimator: object, method: str):
    handle = getattr(estimator, "ledger", None)
    if handle is None:
        return None
    if not callable(getattr(handle, method, None)) or not hasattr(handle, "dataset"):
        raise TypeError(
            f"ledger must be a budget handle, e.g. Ledger(path).budget('dataset'), got "
            f"{handle!r}"
        )
    return handle


def reserve_on_ledger(
    estimator: object, mechanism: Mechanism | Callable[[], Mechanism], label: str | None = None
):
    """Reserve the release's mechanism on the estimator's ``ledger`` *before* the data is
    read (:meth:`privlearn.ledger.Ledger.reserve`); raises
    :class:`privlearn.errors.BudgetExceededError` (recording nothing) when over budget.

    ``mechanism`` may be a zero-argument callable, evaluated only when there is a ledger
    (so calibration is not repeated without one). Returns the reservation, or None without
    a ledger. Wrap the input validation that follows in :func:`cancel_on_error` and call
    :func:`settle_on_ledger` once the release is done; a process that dies in between
    leaves the whole plan counted.
    """
    handle = _ledger_handle(estimator, "reserve")
    if handle is None:
        return None
    m = mechanism if isinstance(mechanism, Mechanism) else mechanism()
    return handle.reserve(m, label=label or type(estimator).__name__)


@contextlib.contextmanager
def cancel_on_error(reservation) -> Iterator[None]:
    """For input validation after :func:`reserve_on_ledger`: it may read the data but
    releases nothing, so if it raises, the reservation is settled as "nothing ran"."""
    try:
        yield
    except BaseException:
        if reservation is not None:
            reservation.settle(compose([]))
        raise


def settle_on_ledger(reservation) -> None:
    """Settle a reservation made by :func:`reserve_on_ledger` with its whole plan."""
    if reservation is not None:
        reservation.settle()
