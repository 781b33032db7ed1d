"""The probe's buffer comparison again, with gradients on, for buffers written only then.

The probe's passes (:mod:`privlearn.torch.probe`) run without gradients. A forward that
writes a buffer from the data only when gradients are on (``if torch.is_grad_enabled():
self.mx.copy_(torch.maximum(self.mx, x.abs().amax(0)))``, or keyed on an activation's
``requires_grad``) writes it in every training step, while none of the probe's passes
sees the write: the statistic would be kept in the model and released with its
``state_dict``, without noise. :mod:`privlearn.torch._buffer_writes` notes which buffers
the step's training forwards wrote (version counter moved, or object replaced); when one
of them was written by none of the probe's passes without gradients, :func:`check` runs
the probe's buffer comparison passes again with gradients on (the batch, the batch with
its first and then its last example replaced, every example replaced by the first and by
the last, and, batch size private, one example fewer:
:mod:`privlearn.torch._probe_buffers`) and refuses a buffer written differently, as the
passes without gradients do. These passes run as a rule's evaluation (the engine's hooks
record nothing, the parameters are not swapped for aliases), no backward runs (no
``.grad`` is set) and each output, with its graph, is dropped at once. A model whose
passes without gradients write every buffer its training forward writes runs no more
passes; a buffer no pass writes is refused after the probe (:mod:`._late_writes`). Not
under FSDP2, whose probe passes are collectives counted beforehand (the note is not taken
there).
"""

from __future__ import annotations

from privlearn.torch import _data_writes, _probe_held
from privlearn.torch._buffer_writes import _version
from privlearn.torch._probe_buffers import check_rows_collapsed, judge

__all__ = ["check", "note_written", "versions"]


def versions(model) -> tuple:
    """``(module, name, buffer, version)`` of the model's buffers, before a probe pass,
    and the pass's watch of writes through ``.data``, which move no version counter
    (:mod:`privlearn.torch._data_writes`; ended by :func:`note_written`, or dropped by
    :func:`privlearn.torch._late_writes.put_back` when the pass raised)."""
    noted = [
        (mod, name, b, None if b is None else _version(b))
        for mod in model.modules()
        for name, b in mod._buffers.items()
    ]
    slots = [((id(mod), name), b) for mod, name, b, _ in noted if b is not None]
    return noted, _data_writes.begin("probe", model, slots)


def note_written(tracker, noted: tuple) -> None:
    """Add the buffers written since :func:`versions` took ``noted`` to the tracker's
    ``_probe_touched`` (the buffers the probe's passes write), if it keeps one, and to
    ``_probe_writes`` (those of the whole probe, :mod:`privlearn.torch._late_writes`)."""
    touched = getattr(tracker, "_probe_touched", None)
    noted, session = noted
    wrote = {(id(mod), name) for mod, name, b, version in noted
             if mod._buffers.get(name) is not b
             or b is not None and version is not None and _version(b) != version}
    wrote.update(_data_writes.end(session))
    if touched is not None:
        touched |= wrote
    tracker._probe_writes = (getattr(tracker, "_probe_writes", None) or set()) | wrote


def check(tracker, observe, leaves, batched, examples: int) -> None:
    """When the step's training forward wrote a buffer that none of the probe's passes
    without gradients wrote, compare the buffers again in passes with gradients on
    (``observe``: one such pass on given leaves and number of examples, returning the
    probe's triple); refuse a buffer written differently (module docstring).

    Raises
    ------
    BatchDependenceError
        Naming the buffer and its module.
    """
    wrote = getattr(tracker, "_forward_writes_step", None)
    touched = getattr(tracker, "_probe_touched", None) or set()
    if not wrote or wrote <= touched or examples < 2:
        return
    try:
        base = observe(leaves, examples)
    except _probe_held.NOT_REFUSED:  # out of memory: no answer about these inputs
        raise
    except Exception:  # noqa: BLE001 - it does not run so (a parameter written in place)
        return
    for j in (0, examples - 1):
        perturbed = _probe_held.replace_row(leaves, batched, j)
        if perturbed is None:
            return
        try:
            run = observe(perturbed, examples)
        except _probe_held.NOT_REFUSED:  # out of memory: no answer about these inputs
            raise
        except Exception:  # noqa: BLE001 - the passes without gradients said why
            continue
        judge(
            tracker,
            base[2],
            run[2],
            j,
            how=f"example {j} of the batch was replaced, in a forward pass with "
            "gradients enabled (the forward writes it only then, e.g. under "
            "torch.is_grad_enabled() or a tensor's requires_grad)",
        )
    check_rows_collapsed(tracker, observe, leaves, batched, examples, base)
