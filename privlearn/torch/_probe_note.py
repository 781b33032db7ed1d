"""A note on an exception the model's own forward raised in a pass of the
batch-independence probe (:mod:`privlearn.torch.probe`), saying where it came from.

The probe runs the step's forward again under ``torch.no_grad()``: code in a forward or
a forward hook that holds only with gradients on (``out.register_hook(fn)`` on a layer's
output, which then requires no gradient) fails there, and without the note its traceback
points into the probe alone. The exception keeps its type (a caller catching it still
does); ``add_note`` appends the explanation.
"""

from __future__ import annotations

__all__ = ["note_forward_error"]

_NOTE = (
    "privlearn: raised by the model's forward in a pass of the batch-independence probe, "
    "which runs the forward again on the step's batch under torch.no_grad() (and with "
    "one example replaced) to check that no example moves another's outputs. Code in the "
    "forward or a forward hook that needs gradients on (out.register_hook(fn): out "
    "requires no gradient there) must check them first (if out.requires_grad: ..., or "
    "torch.is_grad_enabled()). Nothing was released and no step was counted"
)


def note_forward_error(exc: BaseException) -> None:
    """Append the note to ``exc`` (once), unless privlearn raised it itself."""
    if type(exc).__module__.startswith("privlearn") or _NOTE in getattr(exc, "__notes__", ()):
        return
    exc.add_note(_NOTE)
