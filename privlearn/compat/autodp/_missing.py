"""Clear errors for autodp names the facade does not provide."""

from __future__ import annotations


def missing(module: str, name: str, provided: list[str]) -> AttributeError:
    """The AttributeError (ImportError for ``from ... import``) for an unported name."""
    return AttributeError(
        f"autodp.{module}.{name} is not provided by privlearn's autodp facade "
        f"(privlearn.compat.autodp.{module} provides: {', '.join(sorted(provided))}); "
        "build the mechanism from privlearn.compat.autodp.mechanism_zoo or "
        "privlearn.accounting instead"
    )
