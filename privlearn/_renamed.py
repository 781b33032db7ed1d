"""Former names of public keywords and attributes, kept working with a DeprecationWarning.

privlearn names each privacy parameter once, with the field's name (``epsilon``,
``delta``, ``noise_multiplier``, ``sampling_rate``, ``max_grad_norm``, ``steps``). A public
name that differed is renamed with a deprecation period: :func:`renamed_keywords` lets a
function take the former keyword (warning, then passing it on under the new name), and
:func:`renamed_attribute` reads the former attribute. No torch import here.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from privlearn.errors import ParameterTypeError

__all__ = ["renamed_keywords", "renamed_attribute"]

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keywords(where: str, **renamed: str) -> Callable[[F], F]:
    """Decorate a function whose keywords ``renamed`` (former name -> new name) were
    renamed: the former keyword still works, with a :class:`DeprecationWarning` naming the
    new one; both at once (by keyword, or the new one by position) raise
    :class:`~privlearn.errors.ParameterTypeError`. ``where`` names the function in the
    messages (e.g. ``"PoissonBatchSampler"``)."""

    def decorate(fn: F) -> F:
        params = list(inspect.signature(fn).parameters)
        position = {new: params.index(new) for new in renamed.values()}

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            used = [(old, new) for old, new in renamed.items() if old in kwargs]
            for old, new in used:
                if new in kwargs or len(args) > position[new]:
                    raise ParameterTypeError(
                        f"{where} got both {new} and {old} (its former name, deprecated); "
                        f"pass {new} alone"
                    )
                kwargs[new] = kwargs.pop(old)
            if used:
                olds = ", ".join(old for old, _ in used)
                news = ", ".join(new for _, new in used)
                warnings.warn(
                    f"{where}: the keyword{'s' * (len(used) > 1)} {olds} "
                    f"{'are' if len(used) > 1 else 'is'} deprecated; pass {news} "
                    "(the same value)",
                    DeprecationWarning,
                    stacklevel=2,
                )
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def renamed_attribute(owner: str, old: str, new: str) -> property:
    """A read-only property ``old`` reading ``new`` with a :class:`DeprecationWarning`
    (setting it raises what setting ``new`` raises)."""

    def get(self: Any) -> Any:
        warnings.warn(
            f"{owner}.{old} is deprecated; read {owner}.{new} (the same value)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, new)

    def put(self: Any, value: Any) -> None:
        setattr(self, new, value)

    return property(get, put, doc=f"Deprecated: ``{new}``.")
