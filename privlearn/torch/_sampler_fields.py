"""The read-only fields of a built sampler's sampling law (the dataset size, the
sampling rate, the batch size, ...): what the accountant describes cannot change under it.
"""

from __future__ import annotations

__all__ = ["_law_field_error", "_read_only"]


def _law_field_error(name: str) -> AttributeError:
    """The refusal to change a field of a built sampler's sampling law."""
    name = name.lstrip("_")
    return AttributeError(
        f"{name} cannot be changed after the sampler is built: it is part of the sampling "
        f"law the batches are drawn with and the accountant describes (dataset size, "
        "sampling rate, batch size, steps per epoch, shard, privacy units). Build a new "
        f"sampler, or a new private training run (make_private), with the new {name}"
    )


def _read_only(name: str) -> property:
    """A read-only property of the backing field ``_name``."""

    def getter(self):
        return getattr(self, "_" + name)

    def setter(self, value):
        raise _law_field_error(name)

    return property(getter, setter, doc=f"{name} (read-only)")
