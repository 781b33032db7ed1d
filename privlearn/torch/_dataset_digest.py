"""A short digest of a dataset's contents, compared between the ranks of a distributed
run and between a layout sampling's saved state and the run that resumes it.

:func:`dataset_digest` is re-exported by :mod:`privlearn.torch.distributed`.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["dataset_digest"]


def dataset_digest(dataset) -> str | None:
    """A short digest of what ``dataset`` holds, to compare between ranks, or ``None``
    when it cannot be read cheaply and deterministically.

    Every rank must be given the whole dataset (the engine samples each rank's part of
    it); a rank given its own shard of the same size would sample only the examples of
    its shard that fall in its part, leaving the rest unused, and would account the
    shard's size as the dataset's. In the same order, too: a rank whose copy was
    shuffled apart (``dataset.shuffle()`` without a common seed) samples its part of its
    own order, so one example can sit in two ranks' parts and be drawn twice in a step
    (twice the sensitivity the accountant assumes). A ``TensorDataset`` is digested
    from three of its rows (first, middle, last), a ``Subset`` from its indices and its
    dataset's digest; any other map-style dataset from its items at those positions,
    each read twice, when they are tensors, arrays, numbers, strings and containers of
    them and read the same both times (``None`` otherwise: items computed at random, an
    image object, an item that cannot be read).
    """
    import hashlib

    from torch.utils.data import Subset, TensorDataset

    h = hashlib.sha256()
    if isinstance(dataset, Subset):
        inner = dataset_digest(dataset.dataset)
        if inner is None:
            return None
        h.update(inner.encode())
        idx = dataset.indices
        idx = (
            torch.arange(idx.start, idx.stop, idx.step)
            if isinstance(idx, range)
            else torch.as_tensor(idx, dtype=torch.int64)
        )
        h.update(idx.to(torch.int64).cpu().numpy().tobytes())
        return h.hexdigest()[:16]
    if isinstance(dataset, TensorDataset):
        n = len(dataset)
        rows = torch.tensor(sorted({0, n // 2, n - 1}) if n else [], dtype=torch.int64)
        for t in dataset.tensors:
            part = t.detach()[rows].cpu().contiguous()
            h.update(repr((str(part.dtype), tuple(t.shape))).encode())
            h.update(part.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]
    return _items_digest(dataset)


def _items_digest(dataset) -> str | None:
    """:func:`dataset_digest` of a map-style dataset read item by item (None: not
    readable, or not the same at a second read)."""
    import hashlib

    with _global_rng_kept():  # a random transform's draws leave the run's streams as they were
        try:
            return _read_items(dataset, hashlib)
        except Exception:  # noqa: BLE001 - an item that cannot be read: nothing to compare
            return None


def _read_items(dataset, hashlib) -> str | None:
    """The reads of :func:`_items_digest` (None: an item with no canonical bytes, or one
    that reads differently the second time)."""
    n = len(dataset)
    seen = []
    for _ in range(2):  # an item computed at random reads differently the second time
        h = hashlib.sha256()
        for i in sorted({0, n // 2, n - 1}) if n else ():
            if not _encode(dataset[i], h):
                return None
        seen.append(h.hexdigest()[:16])
    return seen[0] if seen[0] == seen[1] else None


@contextlib.contextmanager
def _global_rng_kept():
    """Restore the global generators (Python's ``random``, NumPy's, torch's CPU one and,
    when CUDA is initialised, every CUDA device's) after the block: the digest reads
    dataset items on a distributed run only, and a dataset whose items draw random
    numbers (a random transform) would otherwise start training from other states under
    DDP than in one process."""
    import random

    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _encode(value, h, depth: int = 0) -> bool:
    """Feed ``value`` into the hash ``h`` (False: a type with no canonical bytes)."""
    from collections.abc import Mapping

    import numpy as np

    if depth > 8:
        return False
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        h.update(repr(("tensor", str(t.dtype), tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return True
    if isinstance(value, np.ndarray | np.generic):
        a = np.asarray(value)
        if a.dtype.hasobject:
            return False
        h.update(repr(("array", a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
        return True
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        h.update(repr(("value", value)).encode())
        return True
    if isinstance(value, Mapping):  # a dict, or a UserDict (transformers' BatchEncoding)
        h.update(repr(("dict", len(value))).encode())
        return all(_encode(k, h, depth + 1) and _encode(v, h, depth + 1) for k, v in value.items())
    if isinstance(value, list | tuple):
        h.update(repr((type(value).__name__, len(value))).encode())
        return all(_encode(v, h, depth + 1) for v in value)
    return False
