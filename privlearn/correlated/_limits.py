"""The largest horizon the strategy optimisers and the error computation accept.

A loss evaluation materialises float64 arrays of ``steps`` entries (the workload, the
weights, ``C^{-1}``'s first column) and, for a BLT, a ``steps x buffers`` array of
powers (:meth:`BufferedToeplitz.toeplitz_coefs`). :data:`MAX_STEPS` bounds
``steps x max(1, buffers)`` by ``2**27`` entries (1 GiB per array, several held at once):
past it NumPy fails with a bare ``MemoryError``/``ValueError`` (or the optimisation runs
for hours: ``optimize_blt(100_000, 4)`` already takes about 10 s), so it is refused with
a :class:`~privlearn.errors.ParameterValueError` naming the parameter first. The same
limit applies to every public callable that materialises an array over the steps (a
strategy's coefficients, its inverse, :func:`~privlearn.correlated.sensitivity` of a
strategy that is not banded); a banded strategy's sensitivity needs only its bands and
takes any number of steps.
"""

from __future__ import annotations

from privlearn.errors import ParameterValueError

#: the largest ``steps x max(1, buffers)`` (float64 entries of one dense array)
MAX_STEPS = 2**27

_HINT = (
    "optimise for a smaller horizon: a strategy optimised for fewer steps can still "
    "run for more (its sensitivity and accounting are computed for the steps "
    "actually run)"
)


def check_horizon(
    n: int,
    steps: object,
    size_name: str | None = None,
    size: int = 1,
    given_size: object = None,
    *,
    name: str = "steps",
    hint: str = _HINT,
) -> None:
    """Refuse ``steps=n`` (with ``size_name=size`` buffers) past :data:`MAX_STEPS`.

    ``n`` and ``size`` are counts already checked by ``check_count``; ``steps`` and
    ``given_size`` the values as passed (named in the message). ``name`` is the
    parameter's name in the caller's signature (``"n"`` for a strategy's methods), and
    ``hint`` what to do instead.
    """
    if n > MAX_STEPS:
        raise ParameterValueError(
            f"{name} must be in [1, {MAX_STEPS}] (2**27: the computation holds arrays of "
            f"{name} float64 entries, 1 GiB each at the limit), got {steps!r}; {hint}"
        )
    if size_name is not None and n * size > MAX_STEPS:
        raise ParameterValueError(
            f"{size_name} must be in [1, {MAX_STEPS // n}] for {name}={n} ({name} x "
            f"{size_name} <= 2**27: the computation holds a {name} x {size_name} float64 "
            f"array, 1 GiB at the limit), got {given_size!r}; use fewer {size_name}, or "
            f"{hint}"
        )
