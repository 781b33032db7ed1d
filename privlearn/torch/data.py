"""Data loading that matches the accounting: the DP loader over a registered sampling's
batch sampler (:mod:`privlearn.torch.samplers`), empty-batch collation, and virtual
(logical vs physical) batches.

* :class:`PoissonBatchSampler` includes every example independently with probability
  ``q`` at every step (``round(1 / q)`` steps per epoch). Batch sizes vary and a batch
  can be empty; this is the sampling analysed by the Poisson-subsampled Gaussian
  accountants (Abadi et al. 2016; Mironov et al. 2019 "Renyi Differential Privacy of the
  Sampled Gaussian Mechanism"; Zhu, Dong & Wang 2022 for the PLD).
* :class:`FixedSizeBatchSampler` draws ``B`` distinct examples uniformly at every step
  (sampling without replacement), accounted with ``scheme="fixed"`` under the
  replace-one relation (Wang, Balle & Kasiviswanathan 2019).
* An empty Poisson batch is collated into tensors with a leading dimension of 0 (same
  trailing shapes and dtypes as a real batch; what the collate function adds to every
  batch that is not per example kept whole: :mod:`privlearn.torch._empty_batch`), so the
  user's loop runs unchanged; the optimizer still adds noise and steps (the mechanism
  releases a noisy zero sum).
* A :class:`~torch.utils.data.TensorDataset` (or a chain of ``Subset`` of one) with the
  default collate function is read through :class:`TensorBatchGather`: one indexing op
  per tensor per batch instead of one ``__getitem__`` per example and a ``torch.stack``
  (the same tensors ``default_collate`` would build; about 4x faster on a 256 x 784 float
  batch, where PyTorch's per-example fetch costs about as much as a small model's step).
* :class:`VirtualBatchLoader` splits each logical batch into physical chunks of at most
  ``max_physical_batch_size`` examples; the optimizer accumulates the clipped sums and
  adds noise and updates only after the last chunk of a logical batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.dataloader import default_collate
from torch.utils.data.dataset import IterableDataset

from privlearn._renamed import renamed_keywords
from privlearn.accounting import Neighbouring
from privlearn.errors import (
    BatchDependenceError,
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
    PlanMismatchError,
)
from privlearn.torch._empty_batch import collated_pair, empty_batch
from privlearn.torch._repeated_examples import check_distinct_examples

# the samplers live in privlearn.torch.samplers (wrapping the registered samplings of
# privlearn.correlated.sampling); their names stay importable from here
from privlearn.torch.samplers import (  # noqa: F401
    BallsInBinsBatchSampler,
    CyclicPoissonBatchSampler,
    DrawnBatch,
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    RegisteredBatchSampler,
    ShuffledEpochsBatchSampler,
    UnitIndex,
    _AccountedSampler,
    dp_batch_sampler,
)

__all__ = [
    "PoissonBatchSampler",
    "FixedSizeBatchSampler",
    "EmptyAwareCollate",
    "TensorBatchGather",
    "VirtualBatchLoader",
    "AugmentedLoader",
    "DPDataLoader",
    "CyclicPoissonBatchSampler",
    "BallsInBinsBatchSampler",
    "ShuffledEpochsBatchSampler",
    "UnitIndex",
    "DrawnBatch",
    "make_dp_loader",
]


class EmptyAwareCollate:
    """Wraps a collate function so that an empty batch is the batch of no example it
    stands for (built once, from ``dataset``: :func:`privlearn.torch._empty_batch.
    empty_batch`): every per-example entry with zero rows on the dimension that holds the
    examples, entries that are not per example (a vocabulary mask, class weights, a
    scalar) as the collate function returns them."""

    def __init__(self, dataset, collate_fn=None):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._empty = None

    def __call__(self, batch):
        if len(batch) > 0:
            return self.collate_fn(batch)
        return self.prepare()

    def prepare(self):
        """The empty batch (built on the first call).

        Raises
        ------
        ConfigurationError
            An entry of the batch changes with the number of examples without one row
            per example, and the collate function does not take an empty list.
        """
        if self._empty is None:
            self._empty = empty_batch(self.dataset, self.collate_fn)
        return self._empty


def _batch_dim(one, two) -> int | None:
    """The dimension a collated array stacks the examples on: 0 if it grows from 1 (one
    example) to 2 (two), else the first that does; None if none does."""
    if one.ndim != two.ndim or one.ndim == 0:
        return None
    grows = [d for d in range(one.ndim) if one.shape[d] == 1 and two.shape[d] == 2]
    return grows[0] if grows else None


def batch_dims_of(one, two, path: str = "batch"):
    """``(path, batch dimension, shape of two)`` of each tensor or array of the collated
    structures ``one`` and ``two`` (:func:`collated_pair`), entering mappings and
    sequences."""
    if isinstance(one, torch.Tensor | np.ndarray) and isinstance(two, torch.Tensor | np.ndarray):
        yield path, _batch_dim(one, two), tuple(two.shape)
    elif isinstance(one, Mapping) and isinstance(two, Mapping):
        for k in one:
            if k in two:
                yield from batch_dims_of(one[k], two[k], f"{path}[{k!r}]")
    elif isinstance(one, list | tuple) and isinstance(two, list | tuple) and len(one) == len(two):
        for i, (u, v) in enumerate(zip(one, two, strict=True)):
            yield from batch_dims_of(u, v, f"{path}[{i}]")


def check_batch_first(data_loader: DataLoader, law=None) -> None:
    """Refuse a collate function that stacks the examples on another dimension than the
    first (a sequence-first batch, e.g. one that transposes it): the engine's loader
    (empty Poisson batches, physical batches) and its check of the model's inputs cut
    and read batches on dimension 0. Collates ``dataset[0]`` once and twice
    (:func:`collated_pair`); nothing is checked for a dataset without random access, or
    where that collation fails (the first step's check of the inputs still runs).

    ``law``: the run's sampling (a registry entry); one of random batch sizes (add/remove
    neighbours: the Poisson family) draws empty batches, so the collate function's empty
    batch is built too (:func:`privlearn.torch._empty_batch.empty_batch`), and one that
    cannot be known is refused before the first step, not when an empty batch comes."""
    ds = data_loader.dataset
    if isinstance(ds, IterableDataset) or (
            data_loader.collate_fn is default_collate and _gatherable(ds)):
        return  # rows of tensors: stacked on dimension 0
    try:
        if len(ds) < 1:
            return
        one, two = collated_pair(ds, data_loader.collate_fn)
    except Exception:  # noqa: BLE001 - the check of the first step's inputs covers it
        return
    for path, dim, shape in batch_dims_of(one, two):
        if dim is not None and dim > 0:
            raise BatchDependenceError(
                f"data_loader's collate_fn puts the examples on dimension {dim} of {path} "
                f"(shape {shape} for two examples): a sequence-first batch. The engine "
                "cuts and reads batches on dimension 0 (one row per example). Make the "
                "collate_fn yield batch-first tensors and transpose inside the model's "
                "forward (batch_dims={layer name: 1} then names the layers that see "
                "sequence-first activations)")
    if (law is not None and law.relation is Neighbouring.ADD_REMOVE
            and data_loader.collate_fn is not default_collate):
        try:
            empty_batch(ds, data_loader.collate_fn, (one, two))
        except ConfigurationError:
            raise
        except Exception:  # noqa: BLE001 - built again when an empty batch is drawn
            return


def _subset_chain(ds) -> tuple[object, list[Subset]]:
    """The dataset under any ``Subset`` wrappers of ``ds``, and the wrappers (outermost
    first)."""
    chain = []
    while isinstance(ds, Subset):
        chain.append(ds)
        ds = ds.dataset
    return ds, chain


def _gatherable(ds) -> bool:
    """Whether ``ds`` is a TensorDataset or a ``Subset`` chain over one (an exact
    TensorDataset: subclasses may override ``__getitem__``)."""
    return type(_subset_chain(ds)[0]) is TensorDataset


class TensorBatchGather(Dataset):
    """Batched view of a :class:`~torch.utils.data.TensorDataset` (or of a ``Subset``
    chain over one) for the DataLoader's ``__getitems__`` protocol.

    ``__getitems__(indices)`` returns ``[t[indices] for t in tensors]``: exactly the
    list ``default_collate`` builds from the per-example tuples (same values, dtypes and
    shapes; zero-length tensors for an empty batch), with one indexing op per tensor.
    ``dataset`` is the wrapped dataset; ``len`` and ``[i]`` delegate to it. Use it with
    ``DataLoader(TensorBatchGather(ds), ..., collate_fn=TensorBatchGather.collate)``.
    """

    def __init__(self, dataset):
        if not _gatherable(dataset):
            raise ParameterValueError("dataset must be a TensorDataset or a Subset chain over one, "
                             f"got {type(dataset).__name__}")
        base, chain = _subset_chain(dataset)
        index_map = None  # maps indices of ``dataset`` to rows of the tensors
        for sub in reversed(chain):  # innermost Subset first
            idx = torch.as_tensor(sub.indices, dtype=torch.long)
            index_map = idx if index_map is None else index_map[idx]
        self.dataset = dataset
        self._tensors = base.tensors
        self._index_map = index_map

    @staticmethod
    def collate(batch):
        """Collate function to pair with this dataset (its batches arrive collated)."""
        return batch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def __getitems__(self, indices) -> list[torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self._index_map is not None:
            idx = self._index_map[idx]
        return [t[idx] for t in self._tensors]


def check_map_style(ds, users=None) -> None:
    """Refuse a dataset the DP samplers cannot draw from: one without random access by
    index or without a length (the sampling rate is ``batch_size / len(dataset)``), or
    one that puts an example at several positions through ``Subset`` or
    ``ConcatDataset``, unless ``users`` (an id per position, or a :class:`UnitIndex`)
    makes them one privacy unit (:mod:`privlearn.torch._repeated_examples`)."""
    if isinstance(ds, IterableDataset):
        raise ParameterValueError(
            f"data_loader wraps an IterableDataset ({type(ds).__name__}); DP sampling "
            "needs a map-style dataset (random access by index, and a length that sets "
            "the sampling rate). Materialise the examples, e.g. in a TensorDataset or a "
            "list")
    try:
        len(ds)
    except TypeError:
        raise ParameterTypeError(
            f"data_loader's dataset ({type(ds).__name__}) has no len(): the sampling rate "
            "is batch_size / len(dataset), so DP sampling needs a map-style dataset with "
            "__len__ and __getitem__") from None
    check_distinct_examples(ds, users)


#: The DataLoader options that say how batches are loaded, not which examples form them:
#: the private loader takes each from the user's loader (those this torch has)
_LOADING_OPTIONS = ("num_workers", "pin_memory", "timeout", "worker_init_fn",
                    "multiprocessing_context", "prefetch_factor", "persistent_workers",
                    "pin_memory_device", "in_order")


def loading_options(data_loader: DataLoader, stacklevel: int = 2) -> dict:
    """The options of ``data_loader`` the private loader keeps: every one of
    :data:`_LOADING_OPTIONS` this torch's DataLoader takes, as the user set it
    (``prefetch_factor`` and ``persistent_workers`` only with workers, where they apply).
    ``in_order=False`` is not kept, with a warning: workers would hand batches over in
    the order they finish, not the order drawn, so a step could train on another step's
    batch (with a sampling scheduled over steps, from another step's group) than the one
    it is accounted for."""
    import inspect

    accepted = inspect.signature(DataLoader.__init__).parameters
    out = {k: getattr(data_loader, k) for k in _LOADING_OPTIONS
           if k in accepted and hasattr(data_loader, k)}
    if not out.get("num_workers"):
        out.pop("prefetch_factor", None)
        out["persistent_workers"] = False
    if not out.get("pin_memory_device"):
        out.pop("pin_memory_device", None)
    if out.get("in_order") is False:
        import warnings

        warnings.warn(
            "data_loader has in_order=False, which the private loader does not keep: its "
            "workers would hand batches over in the order they finish, so a step could "
            "train on another batch than the one drawn (and accounted) for it. The "
            "private loader delivers the batches in the order drawn (in_order=True)",
            UserWarning, stacklevel=stacklevel)
        out["in_order"] = True
    return out


@renamed_keywords("make_dp_loader", sample_rate="sampling_rate")
def make_dp_loader(data_loader: DataLoader, *, sampling: str, sampling_rate: float,
                   batch_size: int, steps: int | None, seed: int | None,
                   rank: int = 0, world_size: int = 1, secure: bool = False,
                   shared_seed: int | None = None, cycle_length: int | None = None,
                   units: UnitIndex | None = None, stacklevel: int = 3) -> DataLoader:
    """A loader over the same dataset with the DP batch sampler (keeps the collate
    function and every loading option of ``data_loader``: workers, pinning, prefetching,
    persistent workers, ...; :func:`loading_options`).

    With the default collate function and a ``TensorDataset`` (or ``Subset`` chain over
    one), the loader's ``dataset`` is a :class:`TensorBatchGather` around yours (its
    ``.dataset``), which yields the same batches with one gather per tensor.
    ``shared_seed`` seeds the fixed-size sampler when ``world_size > 1`` (it must be the
    same on every rank). ``units``: the sampler draws these privacy units (users) and
    each batch lists the drawn units' examples together. ``sample_rate=``, the former
    name of ``sampling_rate``, is deprecated; ``stacklevel`` counts the frame of the
    wrapper that renames it.
    """
    ds = data_loader.dataset
    check_map_style(ds, units)
    n = len(ds) if units is None else units.n_units
    bs = dp_batch_sampler(sampling, n, sampling_rate=sampling_rate, batch_size=batch_size,
                          steps=steps, seed=seed, rank=rank, world_size=world_size,
                          secure=secure, shared_seed=shared_seed, cycle_length=cycle_length)
    bs.units = units
    if data_loader.collate_fn is default_collate and _gatherable(ds):
        loader_ds, collate_fn = TensorBatchGather(ds), TensorBatchGather.collate
    else:
        loader_ds, collate_fn = ds, EmptyAwareCollate(ds, data_loader.collate_fn)
    generator = data_loader.generator
    if generator is None:
        # its own generator for the workers' base seed: DataLoader otherwise draws it from
        # torch's global RNG at every iter(), which shifts dropout masks between a run and
        # the same run resumed from a checkpoint (the global state is restored first)
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed((int(seed) * 0x9E3779B1 + rank) % 2**63)
    loader = DPDataLoader(loader_ds, batch_sampler=bs, collate_fn=collate_fn,
                          generator=generator,
                          **loading_options(data_loader, stacklevel + 1))
    loader.dataset_size = len(ds)
    return loader


class DPDataLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` over a DP batch sampler that tells the
    sampler which batches it hands to the training loop (see
    :class:`_AccountedSampler`): batches drawn ahead by worker processes count only once
    the loop receives them, so each optimizer step is matched with the one batch it
    trained on. Made by :func:`make_dp_loader`; iterate it as any DataLoader.

    ``on_restart`` (set by :func:`privlearn.torch.make_private`) is called with the
    batches abandoned when a new pass over the loader starts before they were used by a
    step (the loop was left early), so that nothing computed from them is released.
    """

    on_restart = None
    #: ``len(dataset)`` when the sampler was built (None: not checked)
    dataset_size: int | None = None

    def check_dataset_size(self) -> None:
        """Refuse to draw from a dataset whose length changed since the sampler was
        built: the sampler draws indices of the examples there were then, at the rate
        accounted for them, so a shrunk dataset fails on an index past its end (or, one
        that wraps indices, includes each example at a multiple of that rate) and the
        examples of a grown one are never drawn.

        Raises
        ------
        PlanMismatchError
            ``len(dataset)`` is not the size the run was planned and accounted with.
        """
        if self.dataset_size is None:
            return
        now = len(self.dataset)
        if now != self.dataset_size:
            raise PlanMismatchError(
                f"the dataset of p.data_loader has {now} examples, but the run was planned "
                f"and accounted with {self.dataset_size} (its length at make_private): the "
                f"sampler draws indices of those {self.dataset_size} at the rate accounted "
                "for them, so a shrunk dataset would be read past its end (or, with indices "
                "wrapped, its examples drawn more often than accounted) and the examples of "
                "a grown one never drawn. Keep the dataset unchanged while training, or call "
                "make_private again (after p.detach()) with a loader over the new dataset. "
                "No batch was drawn")

    def __iter__(self):
        self.check_dataset_size()
        sampler = self.batch_sampler
        dropped = sampler._restart()
        if self.on_restart is not None:
            self.on_restart(dropped)
        it = super().__iter__()
        return _Delivering(it, sampler, sampler._fifo, self)


class _Delivering:
    """Iterator over a DataLoader iterator that reports each delivered batch."""

    def __init__(self, it, sampler, fifo, loader=None):
        self._it, self._sampler, self._fifo, self._loader = it, sampler, fifo, loader

    def __iter__(self):
        return self

    def __next__(self):
        if self._sampler._pass_must_end():
            raise StopIteration
        if self._loader is not None:  # before the next batch's indices are drawn
            self._loader.check_dataset_size()
        batch = next(self._it)
        self._sampler._deliver(self._fifo)
        return batch

    def __len__(self) -> int:
        return len(self._it)


class _LoaderView:
    """A loader over another one: its dataset, batch sampler and length are the
    underlying loader's (``self.loader``)."""

    loader = None

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader)


class AugmentedLoader(_LoaderView):
    """Iterate ``loader``'s batches as K augmented views of each example, on consecutive
    rows (De et al. 2022, augmentation multiplicity).

    ``augment`` maps one batch to one augmented view of it (same structure, same rows in
    the same order); it is called K times per batch, and every tensor whose leading
    dimension is the batch's examples is interleaved example-major: rows ``i K .. i K +
    K - 1`` are example ``i``'s views (labels and other per-example tensors repeated
    alike). Those are the rows the engine averages into example ``i``'s gradient before
    clipping, so the layout is the loader's, never the loop's. ``len()`` is the
    underlying loader's.

    With a ``tracker`` (:func:`~privlearn.torch.make_private` passes its own unless
    ``check_batch_independence=False``), ``augment`` is probed whenever the model is
    (the first step, and every step after a change that re-arms the probe): on the
    last batch it received, by :func:`privlearn.torch.probe.probe_augment` (one example
    replaced under the same random state; every other row of the output unchanged), and
    at the next step whenever ``augment``'s own state has changed since the last batch
    (:func:`augment_state`: a ``mixup`` flag switched on after the first step, an epoch
    or call counter that a schedule reads).
    """

    def __init__(self, loader, augment, multiplicity: int, tracker=None):
        self.loader = loader
        self.augment = augment
        self.multiplicity = int(multiplicity)
        self._last = None  # the batch behind the views the loop trains on now
        self._tracker = tracker
        self._state = None  # augment_state(augment) when the last batch was augmented
        if tracker is not None:
            tracker.input_checks.append(self.check_augment)

    def __iter__(self):
        for batch in self.loader:
            self._last = batch
            if self._tracker is not None:
                state = augment_state(self.augment)
                if state != self._state:  # what augment does may have changed: re-probe
                    self._state = state
                    self._tracker._probe_pending = self._tracker._probe_enabled
            yield augmented_views(batch, self.augment, self.multiplicity)

    def check_augment(self) -> None:
        """Probe ``augment`` on the last batch (see the class docstring).

        Raises
        ------
        BatchDependenceError
            ``augment`` mixes examples (or cannot be replayed under one random state).
        """
        if self._last is not None:
            from privlearn.torch.probe import probe_augment

            probe_augment(self.augment, self._last)


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_MAX_ITEMS = 64  # a longer container is read by identity and length


def augment_state(augment, depth: int = 4) -> tuple:
    """A fingerprint of what ``augment`` can read besides its batch, from Python
    attributes only (no device access, no tensor values): an object's attributes (an
    ``nn.Module``'s flags and submodules, a ``Compose``'s list of transforms), a
    function's defaults, closure cells and the module globals it names, a
    ``functools.partial``'s arguments, ``depth`` levels deep; a tensor or array counts by
    identity and in-place version, a container of more than 64 items by identity and
    length. Compared at every batch of :class:`AugmentedLoader`:
    a change (``augment.mixup = True`` after the first step, a counter) re-arms the
    probe, so a transform that starts mixing examples later is checked, not promised."""
    seen: set[int] = set()

    def state(o, d):
        if isinstance(o, _PLAIN):
            return o
        if isinstance(o, torch.Tensor):
            try:
                return ("tensor", id(o), o._version)
            except RuntimeError:  # an inference tensor has no version counter
                return ("tensor", id(o))
        if d <= 0 or id(o) in seen or isinstance(o, (type, type(math))):
            return ("ref", id(o))
        seen.add(id(o))
        if isinstance(o, (list, tuple, set, frozenset, dict)) and len(o) > _MAX_ITEMS:
            return (type(o).__name__, id(o), len(o))  # data, not settings
        if isinstance(o, (list, tuple, set, frozenset)):
            return (type(o).__name__, *(state(v, d - 1) for v in o))
        if isinstance(o, dict):
            return ("dict", *((repr(k), state(v, d - 1)) for k, v in o.items()))
        code = getattr(o, "__code__", None)
        if code is not None and hasattr(o, "__globals__"):  # a Python function
            g = o.__globals__
            return ("function", id(code), state(o.__defaults__, d - 1),
                    state(o.__kwdefaults__, d - 1),
                    *(state(c.cell_contents, d - 1) for c in (o.__closure__ or ())
                      if _filled(c)),
                    *((n, state(g[n], d - 1)) for n in code.co_names if n in g))
        if isinstance(o, functools.partial):
            return ("partial", state(o.func, d - 1), state(o.args, d - 1),
                    state(o.keywords, d - 1))
        bound = getattr(o, "__self__", None)
        if bound is not None and getattr(o, "__func__", None) is not None:  # a method
            return ("method", state(o.__func__, d - 1), state(bound, d - 1))
        if hasattr(o, "shape") and hasattr(o, "dtype"):  # an array of another library
            return ("array", id(o), getattr(o, "shape", None))
        attrs = getattr(o, "__dict__", None)
        if attrs is None:
            return (type(o).__qualname__, id(o))
        out = [id(type(o))]
        for k, v in attrs.items():
            if k in _MODULE_HOOK_DICTS:
                out.append((k, tuple(v)))
            else:
                out.append((k, state(v, d - 1)))
        call = type(o).__dict__.get("__call__")  # a class's own __call__ (its globals)
        if getattr(call, "__code__", None) is not None:
            out.append(("__call__", state(call, d - 1)))
        return tuple(out)

    return state(augment, depth)


# an nn.Module's hook dictionaries: their keys (handle ids) are its hooks
_MODULE_HOOK_DICTS = frozenset({
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"})


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def augmented_views(batch, augment, k: int):
    """``k`` views ``augment(batch)`` of ``batch``, example-major (see
    :class:`AugmentedLoader`)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, spec = tree_flatten(batch)
    sizes = {t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ParameterValueError(
            "augmentation_multiplicity needs batches whose tensors share one leading "
            f"dimension, the examples; got leading sizes {sorted(sizes)}")
    n = sizes.pop()
    views = []
    for _ in range(k):
        vf, _ = tree_flatten(augment(batch))
        if len(vf) != len(flat):
            raise ParameterValueError(
                "augment must return a batch of the structure it receives (one augmented "
                f"view, same rows in the same order): it received {len(flat)} items "
                f"and returned {len(vf)}")
        for t, v in zip(flat, vf, strict=True):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and (
                    not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n):
                raise ParameterValueError(
                    f"augment must keep the {n} rows of the batch (one view of each "
                    "example, in the same order); a tensor of shape "
                    f"{tuple(t.shape)} came back as "
                    f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        views.append(vf)
    out = []
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            out.append(torch.stack([v[i] for v in views], 1).flatten(0, 1))
        else:
            out.append(views[0][i])
    return tree_unflatten(out, spec)


class VirtualBatchLoader(_LoaderView):
    """Iterate physical chunks of the logical batches of ``loader``.

    Each logical batch (a collated structure whose tensors share a leading batch
    dimension) is split into chunks of at most ``max_physical_batch_size`` examples. Before
    yielding a chunk it tells ``optimizer`` whether the chunk ends its logical batch; the
    optimizer then only accumulates clipped sums on the other chunks, and adds noise,
    updates the parameters and counts one privacy step after the last one. Peak memory is
    bounded by the physical size; the result equals one step on the whole logical batch.
    ``len()`` is the number of logical steps an epoch, by design (the unit of a
    learning-rate schedule and of a trainer's step count), not the number of chunks
    iterating yields, which is larger and random under Poisson sampling (Opacus's
    ``BatchMemoryManager`` counts physical batches). A logical batch left unfinished (the loop
    was left between its chunks) is discarded when the next one begins: the clipped sums
    of its chunks are dropped, never released.
    """

    def __init__(self, loader: DataLoader, max_physical_batch_size: int, optimizer):
        if int(max_physical_batch_size) < 1:
            raise ParameterValueError("max_physical_batch_size must be >= 1, got "
                             f"{max_physical_batch_size!r}")
        self.loader = loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer

    def __iter__(self):
        for batch in self.loader:
            for chunk, _ in self.split(batch):
                yield chunk

    def split(self, batch):
        """The physical chunks of one logical ``batch`` of ``self.loader`` (the batch its
        sampler delivered last), each as ``(chunk, final)``: the optimizer is told that a
        new logical batch begins, and before each chunk is yielded, its size and whether
        it ends the logical batch. The caller runs forward and backward on each chunk, then
        ``optimizer.step()`` (which only accumulates until the final chunk). An empty
        batch is one final chunk of no rows. What :meth:`__iter__` does for every batch;
        a training loop that takes logical batches one at a time (Hugging Face's Trainer:
        :mod:`privlearn.torch._hf_accumulate`) calls it itself.

        Raises
        ------
        ParameterValueError
            The batch's tensors have different leading sizes, or not the sampler's number
            of examples (a collate function that does not keep one row per example).
        """
        from torch.utils._pytree import tree_flatten, tree_unflatten

        m = self.max_physical_batch_size
        flat, spec = tree_flatten(batch)
        sizes = {t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(sizes) > 1:
            raise ParameterValueError(
                f"batch tensors have different leading sizes {sorted(sizes)}: "
                "max_physical_batch_size splits every tensor of the collated batch into "
                "chunks of rows, so each must hold one row per example. Keep a tensor "
                "that is not per example (class weights, a vocabulary table) out of the "
                "collate function's output and pass it to the loss or model directly")
        n = sizes.pop() if sizes else 0
        drawn = self.loader.batch_sampler.pending()
        if drawn is not None and drawn.size != n:
            raise ParameterValueError(
                f"the batch has {n} examples but the sampler drew {drawn.size}: "
                "max_physical_batch_size needs a collate function that keeps one row "
                "per example on the leading dimension")
        self.optimizer._begin_logical_batch()
        for lo, hi, groups, final in _chunks(n, m, None if drawn is None else drawn.groups):
            part = [t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 0
                    else t for t in flat]
            self.optimizer._expect_chunk(hi - lo, final=final, groups=groups)
            yield tree_unflatten(part, spec), final


def _chunks(n: int, m: int, groups):
    """``(start, stop, groups, final)`` of each physical chunk of a logical batch of ``n``
    rows: at most ``m`` rows each, and whole privacy units (``groups``: rows per unit) in
    each, so that no unit is clipped in two parts.

    Raises
    ------
    ValueError
        A unit has more rows than ``m``.
    """
    if groups is None:
        count = max(1, math.ceil(n / m))
        return [(k * m, min(n, (k + 1) * m), None, k == count - 1) for k in range(count)]
    if groups and max(groups) > m:
        raise ParameterValueError(
            f"a privacy unit has {max(groups)} rows, more than max_physical_batch_size={m}: "
            "a unit must fit in one physical chunk (its rows are clipped together); raise "
            "max_physical_batch_size or lower max_examples_per_user")
    out, start, rows, current = [], 0, 0, []
    for g in groups:
        if rows + g > m and current:
            out.append((start, start + rows, tuple(current)))
            start, rows, current = start + rows, 0, []
        rows += g
        current.append(g)
    out.append((start, start + rows, tuple(current)))
    return [(a, b, g, k == len(out) - 1) for k, (a, b, g) in enumerate(out)]
