"""Positions of a dataset that reach the same example (through ``Subset`` and
``ConcatDataset``).

The DP samplers draw *positions* ``0 .. len(dataset) - 1``, each with the probability the
accountant uses (Poisson: independently with probability ``q`` at every step; Abadi et
al. 2016, Sec. 3.1). That is a sampling of the examples only when every position holds
its own example. A ``Subset`` with a repeated index (oversampling a class), or a
``ConcatDataset`` holding one dataset twice (``ConcatDataset([ds, ds])``), puts one
example at ``m`` positions: it joins a step with probability ``1 - (1 - q)^m`` (about
``m q``), and with ``m`` rows when several of its positions are drawn, each clipped on
its own, so its contribution to a step is bounded by ``m C``, not ``C``. The accountant
describes neither: such a dataset is refused, unless ``users=`` makes the positions of
each example one privacy unit (its rows are then clipped together and capped by
``max_examples_per_user``).

Datasets are followed through ``Subset`` and ``ConcatDataset`` down to the objects that
hold the examples (a ``TensorDataset`` by its tensors, so one built twice over the same
tensors is one holder); repeats inside a holder, or in a dataset class of the user's own
(``__getitem__`` reading ``i % n``), cannot be seen and are not looked for.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import ConcatDataset, Subset, TensorDataset

from privlearn._validation import check_unit_ids
from privlearn.errors import ConfigurationError

__all__ = ["check_distinct_examples"]

_MAX_DEPTH = 64  # a deeper chain is not built by hand: read as a holder


def _holder_key(ds) -> tuple:
    """What identifies the object holding ``ds``'s examples."""
    if type(ds) is TensorDataset:
        return ("tensors", *(id(t) for t in ds.tensors))
    return ("dataset", id(ds))


def _walk(ds, local: np.ndarray, positions: np.ndarray, depth: int, out: dict) -> None:
    """Map the indices ``local`` of ``ds`` (at the top-level ``positions``) to their
    holders: ``out[key] = [(holder indices, positions), ...]``."""
    if isinstance(ds, Subset) and depth < _MAX_DEPTH:
        inner = _indices(ds.indices)
        idx = inner[local]
        if idx.size and idx.min() < 0:  # counted from the end
            idx = np.where(idx < 0, idx + len(ds.dataset), idx)
        _walk(ds.dataset, idx, positions, depth + 1, out)
        return
    if isinstance(ds, ConcatDataset) and depth < _MAX_DEPTH:
        ends = np.asarray(ds.cumulative_sizes, dtype=np.int64)
        part = np.searchsorted(ends, local, side="right")
        for k, sub in enumerate(ds.datasets):
            mine = part == k
            if mine.any():
                start = ends[k - 1] if k else 0
                _walk(sub, local[mine] - start, positions[mine], depth + 1, out)
        return
    out.setdefault(_holder_key(ds), []).append((local, positions))


def _indices(inner) -> np.ndarray:
    """A ``Subset``'s indices (a range, a sequence, an array, a tensor) as int64."""
    if isinstance(inner, range):
        return np.arange(inner.start, inner.stop, inner.step)
    if hasattr(inner, "detach"):  # a tensor, on any device
        inner = inner.detach().cpu().numpy()
    return np.asarray(inner, dtype=np.int64).reshape(-1)


def repeated_positions(dataset) -> list[np.ndarray]:
    """The groups of positions of ``dataset`` that reach one example (each group sorted,
    groups in order of their first position); empty when every position holds its own,
    or when an index is out of range (reading that position fails in the loader)."""
    if not isinstance(dataset, Subset | ConcatDataset):
        return []
    n = len(dataset)
    out: dict = {}
    try:
        _walk(dataset, np.arange(n), np.arange(n), 0, out)
    except IndexError:
        return []
    groups = []
    for parts in out.values():
        idx = np.concatenate([p[0] for p in parts])
        pos = np.concatenate([p[1] for p in parts])
        if idx.size and idx.min() >= 0 and idx.max() < 4 * idx.size + 1024:
            repeated = np.bincount(idx)[idx] > 1  # (linear: indices of the holder)
        else:
            _, inverse, counts = np.unique(idx, return_inverse=True, return_counts=True)
            repeated = counts[inverse] > 1
        if not repeated.any():
            continue
        _, inverse = np.unique(idx[repeated], return_inverse=True)
        order = np.lexsort((pos[repeated], inverse))
        inv, p = inverse[order], pos[repeated][order]
        groups += np.split(p, np.flatnonzero(np.diff(inv)) + 1)
    return sorted(groups, key=lambda g: int(g[0]))


def check_distinct_examples(dataset, users=None) -> None:
    """Refuse a dataset whose positions repeat an example (module docstring), unless
    ``users`` (the privacy unit of every position, :func:`~privlearn.torch.make_private`'s
    ``users=``, or a :class:`~privlearn.torch.samplers.UnitIndex`) puts all the positions
    of each repeated example in one unit.

    Raises
    ------
    ConfigurationError
        An example is at several positions (through ``Subset`` or ``ConcatDataset``), in
        more than one privacy unit.
    """
    groups = repeated_positions(dataset)
    if hasattr(users, "members"):  # a UnitIndex: the unit of each position
        ids = np.empty(users.n_examples, dtype=np.int64)
        for u, m in enumerate(users.members):
            ids[m] = u
        users = ids.tolist()
    if groups and users is not None and len(users) == len(dataset):  # (else refused later)
        ids = check_unit_ids("users", users)
        groups = [g for g in groups if len({ids[int(i)] for i in g}) > 1]
    if not groups:
        return
    shown = "; ".join(
        f"positions {', '.join(str(int(i)) for i in g[:4])}" + (", ..." if len(g) > 4 else "")
        for g in groups[:3]
    )
    where = (
        "users= gives the positions of one example different users"
        if users is not None
        else "each position is sampled on its own"
    )
    raise ConfigurationError(
        f"data_loader's dataset holds {len(groups)} example(s) at more than one position "
        f"(through Subset or ConcatDataset: {shown}{'; ...' if len(groups) > 3 else ''}), "
        f"and {where}: such an example joins a step with probability up to 1 - (1 - q)^m "
        "for m positions, with a row (clipped on its own) for each position drawn, while "
        "the accountant assumes one row with probability q. Use each example once "
        "(a Subset of distinct indices; weight the loss instead of repeating examples), or "
        "pass users= with one id per position, the same for the positions of one example "
        "(user-level privacy: its rows are then clipped together). Nothing was changed"
    )
