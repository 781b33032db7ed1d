"""The DP batch samplers of the PyTorch engine: torch wrappers of the registered
samplings of :mod:`privlearn.correlated.sampling`.

Each registry entry (:data:`privlearn.correlated.sampling.SAMPLINGS`) owns the draw of
its batches (NumPy: the layout fixed for the run and each step's index array) and the
law its accountant assumes; the samplers here add what a training loop needs around that
draw -- a forward-secure key chain for the randomness, the book-keeping of which batch
each step used, checkpoints, distributed shards and privacy units of several examples
(:class:`UnitIndex`). :func:`dp_batch_sampler` builds the sampler of a registered
sampling by name (the public class of a built-in entry, :class:`RegisteredBatchSampler`
for any other).
"""

from __future__ import annotations

import collections
import hashlib
import secrets
import warnings
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Sampler

from privlearn import _validation as _v
from privlearn._renamed import renamed_attribute, renamed_keywords
from privlearn.accounting import steps_per_epoch
from privlearn.correlated.sampling import SAMPLINGS, SamplingLaw, unit_subset
from privlearn.errors import (
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
    TrainingLoopError,
)
from privlearn.torch._fixed_seed import check_shared_generator
from privlearn.torch._layout_state import saved_layout
from privlearn.torch._sampler_fields import _law_field_error, _read_only
from privlearn.torch._sampler_state import read_sampler_state
from privlearn.torch._shard_stream import shard_seed

__all__ = [
    "PoissonBatchSampler",
    "FixedSizeBatchSampler",
    "CyclicPoissonBatchSampler",
    "BallsInBinsBatchSampler",
    "ShuffledEpochsBatchSampler",
    "RegisteredBatchSampler",
    "DistributedPoissonBatchSampler",
    "rank_partition",
    "UnitIndex",
    "DrawnBatch",
    "dp_batch_sampler",
]


_KEY_BYTES = 32


def _check_steps(steps) -> int:
    """The batches of one epoch of a sampler: an integer >= 1."""
    return _v.check_count("steps", steps, minimum=1,
                          hint="the number of batches of an epoch; None for round(1 / rate)")


def _initial_key(seed: int | None) -> bytes:
    """The first key of a sampler's key chain: from the seed, or fresh OS entropy."""
    if seed is None:
        return secrets.token_bytes(_KEY_BYTES)
    s = _v.check_count("seed", seed, minimum=-(2**127), hint="pass an int such as 0")
    if s >= 2**127:  # the key chain reads the seed as 16 signed bytes
        raise ParameterValueError(f"seed must be an integer in [-2**127, 2**127), got "
                                  f"{seed!r}; pass an int such as 0, or None for fresh entropy")
    raw = s.to_bytes(16, "little", signed=True)
    return hashlib.sha256(b"privlearn.sampler.seed" + raw).digest()


def _next_key(key: bytes) -> bytes:
    """One step of the key chain: ``k_{t+1} = SHA-256("privlearn.sampler.ratchet" || k_t)``.
    One-way: a saved key reveals nothing about the keys (hence the batches) before it."""
    return hashlib.sha256(b"privlearn.sampler.ratchet" + key).digest()


@dataclass(frozen=True)
class DrawnBatch:
    """One batch drawn by a DP sampler (book-keeping, never shown to the model).

    Attributes
    ----------
    index : int
        Position of the draw among all draws of the sampler (0, 1, ...).
    size : int
        Number of examples in the batch (on this rank).
    key_after : bytes or None
        The sampler's key after this draw (None for a secure, OS-entropy sampler): what a
        checkpoint taken after the step that trained on this batch saves.
    pos_after : int
        Position in the epoch of the next batch.
    groups : tuple of int or None
        With privacy units of several examples (users): the number of rows of each unit,
        in the order of the batch's rows (None: one row per example).
    """

    index: int
    size: int
    key_after: bytes | None
    pos_after: int
    groups: tuple[int, ...] | None = None


class _AccountedSampler(Sampler[list[int]]):
    """Book-keeping shared by the DP batch samplers.

    **Forward-secure randomness.** Each batch is drawn with a generator seeded from the
    current key of a one-way key chain (:func:`_next_key`), and the key advances after
    every draw. A checkpoint saves only the key after the last batch a step trained on:
    it lets a resumed run continue with the same batches, but reveals nothing about which
    examples were in the earlier batches (a saved Mersenne-Twister or PCG state could be
    run backwards, and knowing the past batches would void the amplification by
    subsampling that the accountant assumes). It does name the batches *after* it, so a
    saved state is a secret like the data, never published with a later model.

    **Which batch each step used.** The private loader (:class:`DPDataLoader`) reports
    every batch it *delivers* to the training loop (batches drawn ahead by worker
    processes are not delivered until the loop asks for them). A logical step
    (:meth:`take`) uses exactly one delivered batch: a step without a new batch, or two
    batches delivered before one step (their examples would be clipped together), is
    refused. Batches delivered and abandoned when the loop was left and started again
    are dropped (nothing of them was released).

    Subclasses implement ``_draw(rng_seed)`` (one batch from a 64-bit seed, or from OS
    entropy when secure) and ``_params()`` (what must match for a saved state to load).
    """

    secure = False
    #: the registry entry whose draw and law this sampler wraps
    law: SamplingLaw | None = None
    _by_law: dict[str, type] = {}
    #: ``sampling_rate``'s former name (Opacus's), read with a DeprecationWarning
    sample_rate = renamed_attribute("sampler", "sample_rate", "sampling_rate")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if isinstance(cls.__dict__.get("law"), SamplingLaw):  # a registry entry's sampler
            _AccountedSampler._by_law[cls.law.name] = cls

    def _rng(self, seed: int | None) -> np.random.Generator | None:
        """The generator of one draw (None: OS-CSPRNG draws in secure mode)."""
        if seed is not None:
            return np.random.default_rng(seed)
        return None if self.law is not None and self.law.secure else np.random.default_rng()

    #: the fields that define the sampling law the accountant describes (and their
    #: backing fields): set while the sampler is built, read-only afterwards
    _LAW_FIELDS = frozenset({
        "num_samples", "sampling_rate", "_sampling_rate", "steps", "secure", "indices",
        "rank", "world_size", "cycle_length", "batch_size", "_batch_size", "law", "_law"})

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_built"):
            if name in self._LAW_FIELDS:
                raise _law_field_error(name)
            if name == "units" and self.units is not None:
                raise _law_field_error(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._LAW_FIELDS or name == "units":
            raise _law_field_error(name)
        object.__delattr__(self, name)

    def _init_bookkeeping(self, seed: int | None) -> None:
        self._built = True  # the law's fields are set: read-only from now on
        self.seed = seed  # (make_private rebuilds a sampler given to it with its seed)
        self._key = None if self.secure else _initial_key(seed)
        self.draws = 0  # batches drawn so far
        self.delivered = 0  # batches handed to the training loop so far
        self.consumed = 0  # logical steps that used a batch
        self._fifo: collections.deque | None = None  # draws of the current iteration
        self._unconsumed: list[DrawnBatch] = []  # delivered, no step yet
        self._refused: list[DrawnBatch] = []  # delivered, its step refused before release
        self._last_used: DrawnBatch | None = None
        self._next_pos = 0
        self._resume_pos = 0
        self._resume_key = self._key

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        fifo: collections.deque = collections.deque()
        self._fifo = fifo
        # the k-th batch of this pass is the one the (base + k)-th step will train on (a
        # step uses exactly one delivered batch, and a new pass drops undelivered ones):
        # samplers with a schedule over steps (cycles, bins) follow this step index
        self._iter_base = self.consumed + len(self._unconsumed)
        return self._iterate(fifo)

    units = None  # UnitIndex: privacy units of several examples (users)
    _shard = None  # a Poisson shard's smallest index: its own stream (_shard_stream)

    def _iterate(self, fifo):
        # the resumed position is taken when the pass draws its first batch, not when
        # iter() is called: torch's multi-process loader calls iter() twice on start and
        # advances only the second iterator
        start, self._resume_pos = self._resume_pos, 0
        for k, pos in enumerate(range(start, self.steps)):
            self._step = self._iter_base + k
            if self.secure:
                seed = None
            else:
                seed = shard_seed(int.from_bytes(self._key[:8], "little") >> 1, self._shard)
                self._key = _next_key(self._key)
            batch = self._draw(seed)
            groups = None
            if self.units is not None:
                batch, groups = self.units.expand(batch, seed)
            nxt = pos + 1 if pos + 1 < self.steps else 0
            fifo.append(DrawnBatch(self.draws, len(batch), self._key, nxt, groups))
            self.draws += 1
            self._next_pos = nxt
            yield batch

    # ---------------------------------------------------------------- consumption
    def _deliver(self, fifo) -> DrawnBatch:
        """The loader hands the next batch of iteration ``fifo`` to the training loop."""
        drawn = fifo.popleft()
        self.delivered += 1
        if self._refused:  # a step refused on them released nothing: the new batch
            self._unconsumed = [d for d in self._unconsumed if d not in self._refused]
            self._refused = []
        self._unconsumed.append(drawn)
        return drawn

    def _restart(self) -> list[DrawnBatch]:
        """A new pass over the loader begins: batches delivered by the previous pass and
        never used by a step are abandoned. Returns them."""
        dropped, self._unconsumed = self._unconsumed, []
        self._refused = []
        return dropped

    def _pass_must_end(self) -> bool:
        """Whether the current pass must end before its next batch (a sampler with a
        schedule over steps, after a refused batch: :class:`_ScheduledSampler`)."""
        return False

    def has_unconsumed_batch(self) -> bool:
        """Whether a batch was delivered that no optimizer step has used yet."""
        return bool(self._unconsumed)

    def pending(self) -> DrawnBatch | None:
        """The one delivered batch the next step will use (None: none)."""
        return self._unconsumed[-1] if self._unconsumed else None

    def take(self) -> DrawnBatch:
        """The batch the current logical step trains on (exactly one must be pending).

        Raises
        ------
        TrainingLoopError
            No batch delivered since the last step, or more than one (a
            ``RuntimeError``).
        """
        n = len(self._unconsumed)
        if n == 0:
            raise TrainingLoopError(
                "optimizer.step() was called without a new batch from p.data_loader: "
                f"{self.consumed} steps have used all {self.delivered} batches it delivered. "
                "Every step must train on the next batch of p.data_loader (the accountant "
                "describes its sampling); do not train on batches of another loader or on "
                "kept ones (itertools.cycle(p.data_loader) replays its first pass: iterate "
                "p.data_loader anew each epoch), and "
                "call step() once per batch (use max_physical_batch_size for batches that "
                "do not fit in memory). A wrapper that builds its own loader from "
                "p.data_loader's dataset and sampler (accelerate's Accelerator.prepare("
                "p.data_loader)) is such another loader: prepare the model and optimizer "
                "only and iterate p.data_loader")
        if n > 1:
            raise TrainingLoopError(
                f"{n} batches of p.data_loader were drawn since the last optimizer.step(): "
                "a step must train on exactly one batch (training on two at once would clip "
                "example i of each batch together and count two draws as one step). Call "
                "step() after every batch (an empty one too: its step adds the noise alone); "
                "a batch left without its step cannot be trained on any more: start a new "
                "pass over p.data_loader, which drops the batches of this one that no step "
                "used. For large batches use max_physical_batch_size")
        return self._unconsumed[0]

    def refused(self, drawn: DrawnBatch) -> None:
        """A step refused ``drawn`` before releasing anything computed from it: it stays
        pending (a retried step may still train on it) until the loader delivers the next
        batch, which replaces it (a sampler with a schedule over steps ends the pass
        instead: :meth:`_ScheduledSampler._pass_must_end`); it is never counted as used."""
        if drawn not in self._refused:
            self._refused.append(drawn)

    def consume(self, drawn: DrawnBatch) -> None:
        """Record that one logical step used ``drawn`` (from :meth:`take`)."""
        self._unconsumed.remove(drawn)
        if drawn in self._refused:
            self._refused.remove(drawn)
        self.consumed += 1
        self._last_used = drawn

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The sampler's state at the point training reached (after the last batch a step
        used): the key after that batch's draw and the position in the epoch of the next
        batch. ``key`` is None for a secure (OS-entropy) sampler, which cannot be
        replayed. Past batches cannot be recovered from it, later ones can: keep it
        private (see the class docstring)."""
        last = self._last_used
        if last is None:
            key, pos = self._resume_key, self._resume_pos_start
        else:
            key, pos = last.key_after, last.pos_after
        return {"format": _SAMPLER_FORMAT, "kind": type(self).__name__,
                "params": self._params(), "batches": self.consumed, "pos": pos,
                "key": None if key is None else key.hex()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state saved by :meth:`state_dict` (same sampler settings);
        refused, changing nothing, for one it cannot have written (:func:`read_sampler_state`:
        a missing entry, a wrong type, a negative count) or of other settings."""
        key, batches, pos = self.read_state(state)
        if key is not None and not self.secure:
            self._key = key
        self.draws = self.delivered = self.consumed = batches
        self._unconsumed = []
        self._last_used = None
        self._resume_key = self._key
        self._resume_pos = self._next_pos = pos
        self._resume_pos_start = self._resume_pos

    def read_state(self, state: dict) -> tuple[bytes | None, int, int]:
        """:meth:`load_state_dict`'s reading and refusals, before anything is changed:
        the saved key, the batches taken and the position in the epoch."""
        return read_sampler_state(self, state, _SAMPLER_FORMAT, _KEY_BYTES)

    _resume_pos_start = 0


_SAMPLER_FORMAT = "privlearn.torch.sampler/2"


def _check_secure(secure: bool, seed: int | None) -> None:  # OS CSPRNG: no seed
    if secure and seed is not None:
        raise ConfigurationError(f"seed must be None when secure=True, got {seed!r}")


class PoissonBatchSampler(_AccountedSampler):
    """Batches in which each index is included independently with probability
    ``sampling_rate`` (the ``"poisson"`` entry of the sampling registry:
    :func:`privlearn.correlated.sampling.poisson_subset`, drawn by geometric skips
    between included indices, so an index's inclusion never depends on the dataset
    size: adding an example leaves every other example's batches as they were).

    Parameters
    ----------
    num_samples : int
        Size of the (global) dataset; ``indices`` restricts sampling to a shard (used
        per rank in distributed training; every example still has inclusion probability
        ``sampling_rate``).
    sampling_rate : float in (0, 1]
        Read-only after construction (the accountant records it). ``sample_rate``, its
        former name (Opacus's), still works, keyword and attribute, with a warning.
    steps : int, optional
        Batches per epoch; default :func:`privlearn.accounting.steps_per_epoch`
        (``round(1 / sampling_rate)``).
    seed : int, optional
        Seed of the key chain the batches are drawn from (default: fresh OS entropy). A
        shard draws from (seed, its smallest index): disjoint shards are independent.
    secure : bool
        Draw the inclusion decisions from the OS CSPRNG (``os.urandom``) instead of a
        seeded generator.
    """

    sampling_rate = _read_only("sampling_rate")
    law = SAMPLINGS["poisson"]

    @classmethod
    def _for_run(cls, n: int, run: dict) -> PoissonBatchSampler:
        world = run["world_size"]
        if world == 1:
            return cls(n, run["sampling_rate"], steps=run["steps"], seed=run["seed"],
                       secure=run["secure"])
        # each rank samples its own part
        return DistributedPoissonBatchSampler(n, run["sampling_rate"], run["rank"], world,
                                              steps=run["steps"], seed=run["seed"],
                                              secure=run["secure"])

    def __init__(self, num_samples: int, sampling_rate: float, steps: int | None = None,
                 seed: int | None = None, indices=None, secure: bool = False):
        sampling_rate = _v.check_rate("sampling_rate", sampling_rate)
        self.num_samples = _v.check_count("num_samples", num_samples, minimum=1,
                                          hint="pass the number of examples of the dataset")
        self._sampling_rate = float(sampling_rate)
        self.steps = steps_per_epoch(sampling_rate) if steps is None else _check_steps(steps)
        self.indices = None if indices is None else np.asarray(list(indices), dtype=np.int64)
        if self.indices is not None and self.indices.size:
            self._shard = int(self.indices.min())
        _check_secure(secure, seed)
        self.secure = bool(secure)
        self._init_bookkeeping(seed)

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "sampling_rate": self.sampling_rate,
                "steps": self.steps, "secure": self.secure,
                "shard": None if self.indices is None else len(self.indices)}

    def _draw(self, seed: int | None) -> list[int]:
        n = self.num_samples if self.indices is None else len(self.indices)
        idx = self.law.batch(n, self.sampling_rate, None, None, self._step, self._rng(seed))
        return (idx if self.indices is None else self.indices[idx]).tolist()


def rank_partition(num_samples: int, rank: int, world_size: int) -> range:
    """The examples rank ``rank`` of ``world_size`` considers: ``rank, rank + W, ...``.
    The ranks' parts are disjoint and cover ``range(num_samples)``."""
    if not (isinstance(world_size, int) and world_size >= 1
            and isinstance(rank, int) and 0 <= rank < world_size):
        raise ParameterValueError(f"rank must be an int in [0, world_size) and world_size an int "
                         f">= 1, got rank={rank!r}, world_size={world_size!r}")
    return range(rank, int(num_samples), world_size)


class DistributedPoissonBatchSampler(PoissonBatchSampler):
    """Rank ``rank``'s part of a Poisson sample of the whole dataset at rate ``q``.

    Each rank considers only its own part of the indices (``rank, rank + world_size,
    ...``) and
    includes each of them independently with probability ``q`` (each draw seeded from
    the key chain *and* the rank, so the ranks' draws are independent even when every
    rank is given the same ``seed``). Every example is considered exactly once per step, by
    one rank, so the union of the ranks' batches includes every example of the dataset
    independently with probability ``q``: it *is* a Poisson sample of the dataset at rate
    ``q`` (Abadi et al. 2016, Sec. 3.1, the sampling the subsampled Gaussian accountant
    assumes), with expected size ``q N``. Same interface and state as
    :class:`PoissonBatchSampler`.

    Parameters
    ----------
    num_samples : int
        Size of the whole dataset.
    sampling_rate : float in (0, 1]
        q, the global rate (``world_size * batch_size / num_samples`` in
        :func:`~privlearn.torch.make_private`).
    rank, world_size : int
    steps, seed, secure
        As for :class:`PoissonBatchSampler`; the same ``seed`` on every rank is safe
        (the rank is mixed into the seed of every draw).
    """

    def __init__(self, num_samples: int, sampling_rate: float, rank: int, world_size: int,
                 steps: int | None = None, seed: int | None = None, secure: bool = False):
        part = rank_partition(num_samples, rank, world_size)
        self.rank, self.world_size = rank, world_size
        super().__init__(num_samples, sampling_rate, steps=steps, seed=seed,
                         indices=None if world_size == 1 else part, secure=secure)

    def read_state(self, state: dict) -> tuple[bytes | None, int, int]:
        """As :meth:`PoissonBatchSampler.read_state`; also accepts the state of a rank's
        ``PoissonBatchSampler`` over the same part (the same sampler, saved by earlier
        versions), which :meth:`load_state_dict` then loads."""
        if isinstance(state, dict) and state.get("kind") == "PoissonBatchSampler":
            state = {**state, "kind": type(self).__name__}
        return super().read_state(state)


class FixedSizeBatchSampler(_AccountedSampler):
    """Batches of exactly ``batch_size`` distinct indices drawn uniformly at each step
    (independently across steps): sampling without replacement, ``scheme="fixed"``,
    accounted under replace-one neighbouring (the ``"fixed"`` registry entry).

    Distributed (``world_size > 1``): every rank draws the same global sample of
    ``world_size * batch_size`` distinct indices (the seed must be the same on all
    ranks: ``seed=None`` is refused, per-rank seeds draw overlapping samples;
    ``make_private`` rebuilds a given sampler with one seed shared by the ranks) and keeps
    positions ``rank, rank + world_size, ...`` of it, so the ranks' batches are disjoint
    and their union is one uniform fixed-size sample of the dataset. ``batch_size`` is
    read-only after construction. ``secure=True`` draws every batch from the OS CSPRNG
    (one process only).
    """

    batch_size = _read_only("batch_size")
    law = SAMPLINGS["fixed"]

    @classmethod
    def _for_run(cls, n: int, run: dict) -> FixedSizeBatchSampler:
        # distributed fixed-size sampling needs the same generator on every rank
        world = run["world_size"]
        return cls(n, run["batch_size"], steps=run["steps"],
                   seed=run["seed"] if world == 1 else run["shared_seed"], rank=run["rank"],
                   world_size=world, secure=run["secure"])

    def __init__(self, num_samples: int, batch_size: int, steps: int | None = None,
                 seed: int | None = None, rank: int = 0, world_size: int = 1,
                 secure: bool = False):
        num_samples = _v.check_count("num_samples", num_samples, minimum=1,
                                     hint="pass the number of examples of the dataset")
        batch_size = _v.check_count("batch_size", batch_size, minimum=1,
                                    hint="pass the number of examples of every batch")
        world_size = _v.check_count("world_size", world_size, minimum=1)
        rank = _v.check_count("rank", rank)
        if not 1 <= world_size or not 0 <= rank < world_size:
            raise ParameterValueError(f"rank must be in [0, world_size), got rank={rank!r}, "
                             f"world_size={world_size!r}")
        if not 0 < batch_size * world_size <= num_samples:
            raise ParameterValueError(f"batch_size must be in [1, {num_samples // world_size}], "
                             f"got {batch_size!r}")
        self.num_samples, self._batch_size = int(num_samples), int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        global_batch = self.batch_size * self.world_size
        self._sampling_rate = global_batch / num_samples
        self.steps = (steps_per_epoch(self._sampling_rate) if steps is None
                      else _check_steps(steps))
        _check_secure(secure, seed)
        check_shared_generator(seed, world_size, secure)  # one global sample for all ranks
        self.secure = bool(secure)
        self._init_bookkeeping(seed)

    @property
    def sampling_rate(self) -> float:
        """``world_size * batch_size / num_samples`` (read-only)."""
        return self._sampling_rate

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "batch_size": self.batch_size,
                "steps": self.steps, "rank": self.rank, "world_size": self.world_size,
                "secure": self.secure}

    def _draw(self, seed: int | None) -> list[int]:
        global_batch = self.batch_size * self.world_size
        chosen = self.law.batch(self.num_samples, self.sampling_rate, global_batch, None,
                                self._step, self._rng(seed))
        return chosen[self.rank::self.world_size].tolist()


class UnitIndex:
    """The privacy units of a dataset when a unit holds several examples (the examples of
    one user): the sampler draws *units*, and each drawn unit contributes at most
    ``max_examples`` of its examples (a uniformly random subset, drawn independently of
    the data), listed together in the batch.

    Parameters
    ----------
    unit_of_example : sequence of hashable, length N
        The unit (user id) of every example of the dataset, by the rule of
        :func:`privlearn._validation.check_unit_ids`: no missing id (None, NaN, NA, NaT),
        one kind of id (numbers, or strings, ...); refused otherwise.
    max_examples : int >= 1
        k: examples of one unit in one batch at most.
    name : str
        What the ids are called in an error (the parameter or column they came from).

    Attributes
    ----------
    members : list of ndarray
        The example indices of each unit (units numbered ``0 .. n_units - 1`` in order of
        first appearance).
    """

    def __init__(self, unit_of_example, max_examples: int, name: str = "users"):
        self.max_examples = _v.check_count("max_examples_per_user", max_examples, minimum=1)
        keys = _v.check_unit_ids(name, unit_of_example)
        if not keys:
            raise ParameterValueError("unit_of_example is empty: give the user id of every example")
        number: dict = {}
        codes = np.fromiter((number.setdefault(k, len(number)) for k in keys),
                            dtype=np.int64, count=len(keys))
        order = np.argsort(codes, kind="stable")
        counts = np.bincount(codes, minlength=len(number))
        self.members = np.split(order, np.cumsum(counts)[:-1])
        self.n_units = len(number)
        self.n_examples = len(keys)

    @property
    def partition(self) -> str:
        """SHA-256 of the partition of the examples into units (each unit's example
        indices, units in order of first appearance; the ids themselves do not matter):
        what a checkpoint of a user-level run must match, as the history of its steps
        protects these units and no others."""
        h = hashlib.sha256(b"privlearn.units")
        for m in self.members:
            h.update(len(m).to_bytes(8, "little"))
            h.update(np.asarray(m, dtype="<i8").tobytes())
        return h.hexdigest()

    def expand(self, units, seed: int | None) -> tuple[list[int], tuple[int, ...]]:
        """The rows of the drawn ``units`` (at most ``max_examples`` each, a uniform
        subset: :func:`privlearn.correlated.sampling.unit_subset`, which another unit
        never changes) and the number of rows of each."""
        rows, sizes = [], []
        k = self.max_examples
        for u in units:
            m = unit_subset(self.members[int(u)], k, seed)
            rows.extend(m.tolist())
            sizes.append(int(m.size))
        return rows, tuple(sizes)


def _layout_seed(seed: int | None, label: bytes) -> int:
    """A 63-bit seed for a sampler's fixed layout (groups, bins, order): from the run's
    seed, or fresh OS entropy."""
    if seed is None:
        return secrets.randbits(63)
    digest = hashlib.sha256(label + int(seed).to_bytes(16, "little", signed=True)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _ScheduledSampler(_AccountedSampler):
    """A sampler with a layout fixed for the whole run (groups, bins or an order, drawn
    once from its own seed and saved with the state) and a schedule over steps: the batch
    of step ``t`` comes from part ``t mod cycle_length`` of the layout. The layout may be
    known (the accounting of these samplers does not rely on its secrecy)."""

    _label = b""

    @classmethod
    def _for_run(cls, n: int, run: dict) -> _ScheduledSampler:
        return cls(n, run["cycle_length"], seed=run["seed"])

    def _make_parts(self, seed: int | None) -> list[np.ndarray]:
        # secure: the layout from the OS CSPRNG (kept in the state, it cannot be replayed)
        return self.law.layout(self.num_samples, self.cycle_length,
                               None if seed is None else np.random.default_rng(seed))

    def _draw(self, seed: int | None) -> list[int]:
        return self.law.batch(self.num_samples, self.sampling_rate, None, self.parts(),
                              self._step, self._rng(seed)).tolist()

    def _pass_must_end(self) -> bool:
        """A batch of this pass was refused (nothing of it was released) and is not
        retried: the batches drawn after it in the pass are those of the steps after its
        own, one step ahead of the steps that would train on them, so an example of part
        ``j`` could take part in two steps less than ``cycle_length`` apart, which the
        participation the accountant assumes rules out. The pass ends there, with a
        warning; the next pass continues the schedule at the step reached."""
        if not self._refused or self.cycle_length == 1:
            return False
        warnings.warn(
            f"a batch of p.data_loader was refused, and under sampling={self.law.name!r} "
            "the batch of step t is drawn from part t mod cycle_length: the batches after "
            "it in this pass were drawn for later steps, so the pass ends here (nothing "
            f"of them was used). The next pass continues at step {self.consumed}",
            RuntimeWarning, stacklevel=3)
        return True

    def _init_layout(self, seed: int | None) -> None:
        self._layout_seed = None if self.secure else _layout_seed(seed, self._label)
        self._parts: list[np.ndarray] | None = None

    def parts(self) -> list[np.ndarray]:
        """The layout: the examples of each of the ``cycle_length`` parts."""
        if self._parts is None:
            self._parts = self._make_parts(self._layout_seed)
        return self._parts

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["layout"] = self._layout_seed
        if self.secure:  # drawn from the OS CSPRNG: the parts themselves
            state["parts"] = [p.tolist() for p in self.parts()]
        return state

    def load_state_dict(self, state: dict) -> None:
        seed, parts = saved_layout(self, state)  # the run's layout, or refused first
        super().load_state_dict(state)
        self._layout_seed, self._parts = seed, parts


class CyclicPoissonBatchSampler(_ScheduledSampler):
    """Cyclic Poisson sampling (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
    Factorization", NeurIPS, Algorithm 2): every example is put in one of
    ``cycle_length`` groups uniformly at random, once for the run; step ``t``
    Poisson-samples group ``t mod cycle_length`` at rate ``sampling_rate``. An example
    therefore takes part only in steps ``j, j + b, j + 2b, ...`` (``b`` the cycle length),
    each independently with probability ``sampling_rate``: the b-min-separation banded
    matrix factorization needs, with amplification by sampling. ``cycle_length=1`` is
    Poisson sampling. The Poisson draws come from the key chain.

    Parameters
    ----------
    num_samples : int
    sampling_rate : float in (0, 1]
        Inclusion probability in the steps where an example's group is sampled; the
        expected batch is ``sampling_rate * num_samples / cycle_length``.
    cycle_length : int >= 1
    steps : int, optional
        Batches per epoch; default
        :func:`privlearn.accounting.steps_per_epoch` ``(sampling_rate, cycle_length)``,
        ``round(cycle_length / sampling_rate)`` (every example
        once in expectation per epoch).
    seed : int, optional
    secure : bool
    """

    sampling_rate = _read_only("sampling_rate")
    _label = b"privlearn.groups"
    law = SAMPLINGS["cyclic_poisson"]

    @classmethod
    def _for_run(cls, n: int, run: dict) -> CyclicPoissonBatchSampler:
        return cls(n, run["sampling_rate"], run["cycle_length"], steps=run["steps"],
                   seed=run["seed"], secure=run["secure"])

    def __init__(self, num_samples: int, sampling_rate: float, cycle_length: int,
                 steps: int | None = None, seed: int | None = None, secure: bool = False):
        self._sampling_rate = _v.check_rate("sampling_rate", sampling_rate)
        self.cycle_length = _v.check_count("cycle_length", cycle_length, minimum=1)
        self.num_samples = _v.check_count("num_samples", num_samples, minimum=1)
        self.steps = (self.law.per_epoch(self._sampling_rate, self.cycle_length) if steps is None
                      else _check_steps(steps))
        _check_secure(secure, seed)
        self.secure = bool(secure)
        self._init_bookkeeping(seed)
        self._init_layout(seed)

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "sampling_rate": self.sampling_rate,
                "cycle_length": self.cycle_length, "steps": self.steps,
                "secure": self.secure}


class BallsInBinsBatchSampler(_ScheduledSampler):
    """Balls-in-bins sampling (Chua, Ghazi, Harrison et al. 2025, "Balls-and-Bins
    Sampling for DP-SGD", AISTATS): every example is put in one of ``cycle_length`` bins
    uniformly at random, once for the run, and step ``t`` trains on the whole bin
    ``t mod cycle_length``: each example takes part in exactly one step per epoch, at
    the same position every epoch. Accounted without amplification (the certified
    analysis: b-min-separation with ``ceil(steps / b)`` participations).

    Parameters
    ----------
    num_samples : int
    cycle_length : int >= 1
        Steps per epoch; the expected batch is ``num_samples / cycle_length``.
    seed, secure : int or None, bool
        The layout's seed; ``secure=True``: the bins from the OS CSPRNG (no seed).
    """

    _label = b"privlearn.bins"
    law = SAMPLINGS["balls_in_bins"]

    @classmethod
    def _for_run(cls, n: int, run: dict) -> BallsInBinsBatchSampler:
        return cls(n, run["cycle_length"], seed=run["seed"], secure=run["secure"])

    def __init__(self, num_samples: int, cycle_length: int, seed: int | None = None,
                 secure: bool = False):
        self.num_samples = _v.check_count("num_samples", num_samples, minimum=1)
        self.cycle_length = _v.check_count("cycle_length", cycle_length, minimum=1)
        self.steps = self.cycle_length
        self._sampling_rate = 1.0 / self.cycle_length
        _check_secure(secure, seed)
        self.secure = bool(secure)
        self._init_bookkeeping(seed)
        self._init_layout(seed)

    @property
    def sampling_rate(self) -> float:
        """``1 / cycle_length``: the fraction of the data in each batch (read-only)."""
        return self._sampling_rate

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "cycle_length": self.cycle_length,
                "secure": self.secure}


class ShuffledEpochsBatchSampler(BallsInBinsBatchSampler):
    """Fixed-order epochs ((k, b)-participation; Choquette-Choo, McMahan, Rush & Thakurta
    2023, "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning",
    ICML, Sec. 2): one random permutation of the examples, drawn once, cut into
    ``cycle_length`` batches of (nearly) equal size, trained on in the same order every
    epoch. Accounted under **replace-one** neighbouring only, without amplification
    (each example contributes once per epoch, ``cycle_length`` steps apart; the replaced
    example's contribution moves by up to twice the clipping bound). Not add/remove:
    adding an example changes the batch sizes of the split, so other examples move to
    other steps; use :class:`BallsInBinsBatchSampler` for an add/remove guarantee.

    Parameters
    ----------
    num_samples : int
    cycle_length : int >= 1
        Batches per epoch (batch size about ``num_samples / cycle_length``).
    seed : int, optional
    """

    _label = b"privlearn.order"
    law = SAMPLINGS["shuffled_epochs"]

    def __init__(self, num_samples: int, cycle_length: int, seed: int | None = None,
                 secure: bool = False):
        if _v.check_count("cycle_length", cycle_length, minimum=1) > num_samples:
            raise ParameterValueError(
                f"cycle_length must be at most the dataset size {num_samples}, "
                f"got {cycle_length}; use a larger batch size")
        super().__init__(num_samples, cycle_length, seed, secure)


class RegisteredBatchSampler(_ScheduledSampler):
    """The torch sampler of a registered sampling that has no class of its own: the
    entry's layout (if any) drawn once, and its batch of each step from the key chain.

    Parameters
    ----------
    law : SamplingLaw
    num_samples : int
    sampling_rate : float in (0, 1]
    cycle_length : int >= 1
    steps : int
        Batches per epoch.
    batch_size : int, optional
        The fixed batch size, for an entry whose draw takes one.
    seed : int, optional
    secure : bool
    """

    def __init__(self, law: SamplingLaw, num_samples: int, sampling_rate: float,
                 cycle_length: int = 1, steps: int | None = None,
                 batch_size: int | None = None, seed: int | None = None,
                 secure: bool = False):
        if not isinstance(law, SamplingLaw):
            raise ParameterTypeError(f"law must be a SamplingLaw, got {law!r}")
        self._law = law
        self.num_samples = _v.check_count("num_samples", num_samples, minimum=1)
        self._sampling_rate = _v.check_rate("sampling_rate", sampling_rate)
        self.cycle_length = _v.check_count("cycle_length", cycle_length, minimum=1)
        self.batch_size = batch_size
        self.steps = (law.per_epoch(self._sampling_rate, self.cycle_length) if steps is None
                      else _check_steps(steps))
        _check_secure(secure, seed)
        if secure and not law.secure:
            raise ConfigurationError(
                f"secure=True (secure_mode) with sampling={law.name!r}, whose registry entry "
                "has secure=False (a seeded draw only): register it with secure=True (its "
                "batch and layout drawn from the OS CSPRNG given rng=None), or use another "
                f"sampling ({', '.join(k for k, v in SAMPLINGS.items() if v.secure)})")
        self.secure = bool(secure)
        self._label = b"privlearn.layout." + law.name.encode()
        self._init_bookkeeping(seed)
        self._init_layout(seed)

    @property
    def law(self) -> SamplingLaw:  # type: ignore[override]
        return self._law

    @property
    def sampling_rate(self) -> float:
        return self._sampling_rate

    @classmethod
    def _for_run(cls, n: int, run: dict, law: SamplingLaw | None = None):
        return cls(law, n, run["sampling_rate"], run["cycle_length"] or 1, steps=run["steps"],
                   batch_size=run["batch_size"], seed=run["seed"], secure=run["secure"])

    def _params(self) -> dict:
        return {"sampling": self.law.name, "num_samples": self.num_samples,
                "sampling_rate": self.sampling_rate, "cycle_length": self.cycle_length,
                "steps": self.steps, "secure": self.secure}

    def _make_parts(self, seed: int) -> list[np.ndarray]:
        if self.law.layout is None:
            return [np.arange(self.num_samples)]
        return super()._make_parts(seed)

    def _draw(self, seed: int | None) -> list[int]:
        parts = None if self.law.layout is None else self.parts()
        return np.asarray(self.law.batch(self.num_samples, self.sampling_rate, self.batch_size,
                                         parts, self._step, self._rng(seed))).tolist()

@renamed_keywords("dp_batch_sampler", sample_rate="sampling_rate")
def dp_batch_sampler(sampling: str, num_samples: int, *, sampling_rate: float,
                     batch_size: int, steps: int | None, seed: int | None, rank: int = 0,
                     world_size: int = 1, secure: bool = False,
                     shared_seed: int | None = None,
                     cycle_length: int | None = None) -> _AccountedSampler:
    """The torch batch sampler of the registered sampling ``sampling`` over
    ``num_samples`` units: the public class of a built-in entry
    (:class:`PoissonBatchSampler`, ...), else a :class:`RegisteredBatchSampler`."""
    law = SAMPLINGS.get(sampling)
    if law is None:
        raise ParameterValueError(f"sampling must be one of {sorted(SAMPLINGS)}, got {sampling!r}")
    if world_size > 1 and not law.distributed:
        raise ConfigurationError(f"sampling={sampling!r} draws its batches in one process; "
                         "distributed training supports "
                         f"{sorted(k for k, v in SAMPLINGS.items() if v.distributed)}")
    run = {"sampling_rate": sampling_rate, "batch_size": batch_size, "steps": steps,
           "seed": seed, "rank": rank, "world_size": world_size, "secure": secure,
           "shared_seed": shared_seed, "cycle_length": cycle_length}
    cls = _AccountedSampler._by_law.get(sampling)
    if cls is None or cls.law is not law:  # an entry registered (or replaced) later
        return RegisteredBatchSampler._for_run(num_samples, run, law)
    return cls._for_run(num_samples, run)


for _cls in (PoissonBatchSampler, DistributedPoissonBatchSampler, CyclicPoissonBatchSampler,
             RegisteredBatchSampler):  # sample_rate=: sampling_rate's former name (Opacus's)
    _cls.__init__ = renamed_keywords(_cls.__name__, sample_rate="sampling_rate")(_cls.__init__)
