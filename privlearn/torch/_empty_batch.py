"""The empty batch of a sampling that can draw no example (Poisson and its kin).

A collated batch can hold more than one row per example: a global tensor the collate
function adds to every batch (a vocabulary mask, a ``(num_classes,)`` tensor of class
weights, a scalar temperature) is not per example and must be passed on as it is, while
every per-example entry must have no rows. What is which is read from the collate
function itself, by collating example 0 once and twice (each call from the same random
state, so a collate function's random draws are the same in both):

* an entry whose shape changes from one example to two holds the examples' rows (or
  their tokens, concatenated): it is cut to zero rows on the dimension that went from 1
  to 2 (dimension 0 where none did);
* a sequence whose length changes (a column of strings) holds one entry per example:
  it is emptied;
* an entry that is the same for one example and for two is not per example: it is kept
  as for example 0 (a global mask or weights; a padding length, as the per-example
  entries keep example 0's padding);
* an entry of the same shape whose value changes with the number of examples (a count,
  a sum of token counts) has a value for no example that none of this shows: a collate
  function that takes an empty list answers it (its own empty batch is used when its
  per-example entries have no rows), otherwise the run is refused before its first
  step, naming the entry. (It is asked only then: an empty batch built from the
  collate function's batches of examples is the same whatever it answers.)

The empty batch carries no example's data either way: the per-example entries have no
rows, so the step's clipped sum is zero and it releases the noise alone (Abadi et al.
2016, Algorithm 1, with the Poisson sampling the accountant assumes).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data.dataloader import default_collate

from privlearn.errors import ConfigurationError

__all__ = ["collated_pair", "empty_batch"]

_ARRAY = (torch.Tensor, np.ndarray)
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


class _Unknown:
    """An entry of the same shape whose value changes with the number of examples (see
    the module docstring): nothing sound to put in an empty batch."""

    def __init__(self, path: str):
        self.path = path


class _Node:
    """A mapping (``items`` a dict) or sequence (a list) of entries, rebuilt as ``kind``."""

    def __init__(self, items, kind: type):
        self.items, self.kind = items, kind


class _Rows:
    """A per-example entry cut to zero rows on ``dim`` (``value``: the cut entry)."""

    def __init__(self, value, dim: int):
        self.value, self.dim = value, dim


def _collate(collate_fn, items):
    """``collate_fn(items)`` from the current global random states (torch CPU, NumPy,
    ``random``), which are left as they were: every call sees the same draws."""
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            return collate_fn(items)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def _rows_dim(one, two) -> int:
    """The dimension of a per-example entry that holds the examples: the one that goes
    from 1 (one example) to 2 (two), else 0 (examples concatenated, packed or flattened:
    the engine reads rows on dimension 0)."""
    if one.ndim != two.ndim:
        return 0
    grows = [d for d in range(one.ndim) if one.shape[d] == 1 and two.shape[d] == 2]
    return grows[0] if grows else 0


def _same(a, b) -> bool:
    """Whether two collated entries are equal (same type, shape, dtype and values)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return type(a) is type(b) and a == b
    return False


def _template(one, two, path: str):
    """The empty counterpart of ``one`` (a batch of example 0) from ``two`` (example 0
    twice), with :class:`_Rows` and :class:`_Unknown` markers (module docstring)."""
    if isinstance(one, _ARRAY):
        if not isinstance(two, _ARRAY):  # another structure for two examples
            return _Unknown(path)
        if tuple(one.shape) != tuple(two.shape):
            dim = _rows_dim(one, two)
            cut = two[(slice(None),) * dim + (slice(0, 0),)]
            return _Rows(cut.clone() if isinstance(cut, torch.Tensor) else cut.copy(), dim)
        if _same(one, two):
            return one.clone() if isinstance(one, torch.Tensor) else one.copy()
        return _Unknown(path)
    if isinstance(one, Mapping):
        if not isinstance(two, Mapping):
            return _Unknown(path)
        items = {k: _template(v, two.get(k), f"{path}[{k!r}]") for k, v in one.items()}
        return _Node(items, type(one))
    if isinstance(one, list | tuple):
        if not isinstance(two, list | tuple):
            return _Unknown(path)
        if len(one) != len(two):  # one entry per example: a column
            return _Rows(type(one)() if type(one) in (list, tuple) else [], 0)
        entries = [
            _template(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(one, two, strict=True))
        ]
        return _Node(entries, type(one))
    if isinstance(one, _PLAIN):
        return one if _same(one, two) else _Unknown(path)
    if one is two:  # the same object whatever the batch (a tokenizer, a config)
        return one
    return _Unknown(path)


def _unknowns(node) -> list[str]:
    if isinstance(node, _Unknown):
        return [node.path]
    if isinstance(node, _Node):
        values = node.items.values() if isinstance(node.items, dict) else node.items
        return [p for v in values for p in _unknowns(v)]
    return []


def _build(node):
    """The empty batch of a template without :class:`_Unknown` entries."""
    if isinstance(node, _Rows):
        return node.value
    if isinstance(node, _Node):
        items, kind = node.items, node.kind
        if isinstance(items, dict):
            built = {k: _build(v) for k, v in items.items()}
            try:
                return kind(built)
            except TypeError:
                return built
        built = [_build(v) for v in items]
        return kind(*built) if hasattr(kind, "_fields") else kind(built)
    return node


def _fits(own, node) -> bool:
    """Whether the collate function's own empty batch ``own`` has the structure of the
    template ``node`` and no row in any of its per-example entries."""
    if isinstance(node, _Rows):
        if isinstance(node.value, _ARRAY):
            return (
                isinstance(own, _ARRAY)
                and own.ndim == node.value.ndim
                and own.shape[node.dim] == 0
                and own.dtype == node.value.dtype
            )
        return isinstance(own, list | tuple) and len(own) == 0
    if isinstance(node, _Node):
        items = node.items
        if isinstance(items, dict):
            return (
                isinstance(own, Mapping)
                and set(own.keys()) == set(items)
                and all(_fits(own[k], v) for k, v in items.items())
            )
        return (
            isinstance(own, list | tuple)
            and len(own) == len(items)
            and all(_fits(o, v) for o, v in zip(own, items, strict=True))
        )
    return True  # not per example: the collate function's own value


def collated_pair(dataset, collate_fn) -> tuple[object, object]:
    """``collate_fn`` of ``[dataset[0]]`` and of ``[dataset[0], dataset[0]]``: the same
    example once and twice, so that the only dimension of a tensor that grows from 1 to 2
    is the one the examples are stacked on (padding lengths stay the same). Each call
    starts from the global random states (torch CPU, NumPy, ``random``) as they were, and
    leaves them so, for a collate function that draws (masking)."""
    first = dataset[0]
    return _collate(collate_fn, [first]), _collate(collate_fn, [first, first])


def empty_batch(dataset, collate_fn=None, pair: tuple | None = None):
    """The batch of no example that ``collate_fn`` stands for (module docstring).

    Parameters
    ----------
    dataset : map-style dataset with at least one example
    collate_fn : callable, optional
        Default: ``default_collate``.
    pair : tuple, optional
        :func:`collated_pair` of ``dataset`` and ``collate_fn``, when already made.

    Raises
    ------
    ConfigurationError
        An entry of the collated batch changes with the number of examples without
        holding a row per example (a count), and ``collate_fn`` does not build an empty
        batch itself from an empty list.
    """
    collate_fn = collate_fn or default_collate
    one, two = collated_pair(dataset, collate_fn) if pair is None else pair
    node = _template(one, two, "batch")
    unknown = _unknowns(node)
    if not unknown:
        return _build(node)
    if collate_fn is not default_collate:  # (default_collate cannot collate no example)
        try:
            own = _collate(collate_fn, [])
        except Exception:  # noqa: BLE001 - it does not take an empty list: refused below
            own = None
        if own is not None and _fits(own, node):
            return own
    raise ConfigurationError(
        f"data_loader's collate_fn returns {', '.join(unknown)}, which changes with the "
        "number of examples without holding one row per example (its shape is the same "
        "for one example and for two, its value is not: a count, a sum), so its value "
        "in an empty batch (which Poisson sampling draws, and whose step must still "
        "run) cannot be known. Make the collate_fn accept an empty list and return the "
        "empty batch itself (tensors of zero rows, and that entry's value for no "
        "example, with the structure of a batch), or compute that entry in the model or "
        "loss from the batch's rows. No step was taken"
    )
