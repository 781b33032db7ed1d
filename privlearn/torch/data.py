"""Data loading that matches the accounting: Poisson and fixed-size batch samplers,
empty-batch collation, and virtual (logical vs physical) batches.

* :class:`PoissonBatchSampler` includes every example independently with probability
  ``q`` at every step (``round(1 / q)`` steps per epoch). Batch sizes vary and a batch
  can be empty; this is the sampling analysed by the Poisson-subsampled Gaussian
  accountants (Abadi et al. 2016; Mironov et al. 2019 "Renyi Differential Privacy of the
  Sampled Gaussian Mechanism"; Zhu, Dong & Wang 2022 for the PLD).
* :class:`FixedSizeBatchSampler` draws ``B`` distinct examples uniformly at every step
  (sampling without replacement), accounted with ``scheme="fixed"`` under the
  replace-one relation (Wang, Balle & Kasiviswanathan 2019).
* An empty Poisson batch is collated into tensors with a leading dimension of 0 (same
  trailing shapes and dtypes as a real batch), so the user's loop runs unchanged; the
  optimizer still adds noise and steps (the mechanism releases a noisy zero sum).
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

import collections
import hashlib
import math
import os
import secrets
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset
from torch.utils.data.dataloader import default_collate
from torch.utils.data.dataset import IterableDataset

from privlearn import _validation as _v
from privlearn.accounting import steps_per_epoch

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


_KEY_BYTES = 32


def _initial_key(seed: int | None) -> bytes:
    """The first key of a sampler's key chain: from the seed, or fresh OS entropy."""
    if seed is None:
        return secrets.token_bytes(_KEY_BYTES)
    return hashlib.sha256(b"privlearn.sampler.seed" + int(seed).to_bytes(16, "little",
                                                                          signed=True)).digest()


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

    def _init_bookkeeping(self, seed: int | None) -> None:
        self._key = None if self.secure else _initial_key(seed)
        self.draws = 0  # batches drawn so far
        self.delivered = 0  # batches handed to the training loop so far
        self.consumed = 0  # logical steps that used a batch
        self._fifo: collections.deque | None = None  # draws of the current iteration
        self._unconsumed: list[DrawnBatch] = []  # delivered, no step yet
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
                seed = int.from_bytes(self._key[:8], "little") >> 1
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
        self._unconsumed.append(drawn)
        return drawn

    def _restart(self) -> list[DrawnBatch]:
        """A new pass over the loader begins: batches delivered by the previous pass and
        never used by a step are abandoned. Returns them."""
        dropped, self._unconsumed = self._unconsumed, []
        return dropped

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
        RuntimeError
            No batch delivered since the last step, or more than one.
        """
        n = len(self._unconsumed)
        if n == 0:
            raise RuntimeError(
                "optimizer.step() was called without a new batch from p.data_loader: "
                f"{self.consumed} steps have used all {self.delivered} batches it delivered. "
                "Every step must train on the next batch of p.data_loader (the accountant "
                "describes its sampling); do not train on batches of another loader, and "
                "call step() once per batch (use max_physical_batch_size for batches that "
                "do not fit in memory)")
        if n > 1:
            raise RuntimeError(
                f"{n} batches of p.data_loader were drawn since the last optimizer.step(): "
                "a step must train on exactly one batch (training on two at once would clip "
                "example i of each batch together and count two draws as one step). Call "
                "step() after every batch; to skip a batch, still call zero_grad() and step() "
                "(the step then adds its noise only); for large batches use "
                "max_physical_batch_size")
        return self._unconsumed[0]

    def consume(self, drawn: DrawnBatch) -> None:
        """Record that one logical step used ``drawn`` (from :meth:`take`)."""
        self._unconsumed.remove(drawn)
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
        """Continue from a state saved by :meth:`state_dict` (same sampler settings)."""
        if not isinstance(state, dict) or state.get("format") != _SAMPLER_FORMAT:
            raise ValueError("state is not a privlearn sampler state; pass what "
                             "state_dict() returned")
        if state["kind"] != type(self).__name__ or state["params"] != self._params():
            raise ValueError(
                f"the saved sampler was {state['kind']} with {state['params']}, this one is "
                f"{type(self).__name__} with {self._params()}; rebuild with the same "
                "sampling, batch size and dataset")
        if state["key"] is not None and not self.secure:
            self._key = bytes.fromhex(state["key"])
        self.draws = self.delivered = self.consumed = int(state["batches"])
        self._unconsumed = []
        self._last_used = None
        self._resume_key = self._key
        self._resume_pos = self._next_pos = int(state["pos"])
        self._resume_pos_start = self._resume_pos

    _resume_pos_start = 0


_SAMPLER_FORMAT = "privlearn.torch.sampler/2"


def _read_only(name: str):
    def getter(self):
        return getattr(self, "_" + name)

    def setter(self, value):
        raise AttributeError(
            f"{name} cannot be changed after the sampler is built: the accountant records "
            f"the {name} the batches were drawn with. Build a new private training run "
            "(make_private) with the new value")

    return property(getter, setter, doc=f"{name} (read-only)")


class PoissonBatchSampler(_AccountedSampler):
    """Batches in which each index is included independently with probability
    ``sample_rate``.

    Parameters
    ----------
    num_samples : int
        Size of the (global) dataset; ``indices`` restricts sampling to a shard (used
        per rank in distributed training; every example still has inclusion probability
        ``sample_rate``).
    sample_rate : float in (0, 1]
        Read-only after construction (the accountant records it).
    steps : int, optional
        Batches per epoch; default :func:`privlearn.accounting.steps_per_epoch`
        (``round(1 / sample_rate)``).
    seed : int, optional
        Seed of the key chain the batches are drawn from (default: fresh OS entropy).
    secure : bool
        Draw the inclusion decisions from the OS CSPRNG (``os.urandom``) instead of a
        seeded generator.
    """

    sample_rate = _read_only("sample_rate")

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 seed: int | None = None, indices=None, secure: bool = False):
        sample_rate = _v.check_rate("sample_rate", sample_rate)
        self.num_samples = int(num_samples)
        self._sample_rate = float(sample_rate)
        self.steps = steps_per_epoch(sample_rate) if steps is None else int(steps)
        self.indices = None if indices is None else torch.as_tensor(list(indices))
        if secure and seed is not None:
            raise ValueError(f"seed must be None when secure=True, got {seed!r}")
        self.secure = bool(secure)
        self._init_bookkeeping(seed)

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "sample_rate": self.sample_rate,
                "steps": self.steps, "secure": self.secure,
                "shard": None if self.indices is None else len(self.indices)}

    def _draw(self, seed: int | None) -> list[int]:
        n = self.num_samples if self.indices is None else len(self.indices)
        if self.secure:  # 53-bit uniforms from the OS CSPRNG
            bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
            mask = torch.from_numpy(bits.astype(np.float64) * 2.0**-53 < self.sample_rate)
            idx = mask.nonzero().flatten()
        else:
            # Poisson sampling drawn as "size ~ Binomial(n, q), then a uniformly random
            # subset of that size": the same distribution as n independent coin flips
            # (conditioned on its size, a Poisson sample is uniform), at O(q n) cost
            # instead of n uniforms per step.
            rng = np.random.default_rng(seed)
            k = int(rng.binomial(n, self.sample_rate))
            if k == n:
                chosen = np.arange(n)
            else:
                chosen = np.sort(rng.choice(n, size=k, replace=False))
            idx = torch.from_numpy(chosen.astype(np.int64))
        if self.indices is not None:
            idx = self.indices[idx]
        return idx.tolist()


class FixedSizeBatchSampler(_AccountedSampler):
    """Batches of exactly ``batch_size`` distinct indices drawn uniformly at each step
    (independently across steps): sampling without replacement, ``scheme="fixed"``.

    Distributed (``world_size > 1``): every rank draws the same global sample of
    ``world_size * batch_size`` distinct indices (the seed must be the same on all
    ranks) and keeps positions ``rank, rank + world_size, ...`` of it, so the ranks'
    batches are disjoint and their union is one uniform fixed-size sample of the dataset.
    ``batch_size`` is read-only after construction.
    """

    batch_size = _read_only("batch_size")

    def __init__(self, num_samples: int, batch_size: int, steps: int | None = None,
                 seed: int | None = None, rank: int = 0, world_size: int = 1):
        if not 1 <= world_size or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank!r}, "
                             f"world_size={world_size!r}")
        if not 0 < batch_size * world_size <= num_samples:
            raise ValueError(f"batch_size must be in [1, {num_samples // world_size}], "
                             f"got {batch_size!r}")
        self.num_samples, self._batch_size = int(num_samples), int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        global_batch = self.batch_size * self.world_size
        self._sample_rate = global_batch / num_samples
        self.steps = steps_per_epoch(self._sample_rate) if steps is None else int(steps)
        self._init_bookkeeping(seed)

    @property
    def sample_rate(self) -> float:
        """``world_size * batch_size / num_samples`` (read-only)."""
        return self._sample_rate

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "batch_size": self.batch_size,
                "steps": self.steps, "rank": self.rank, "world_size": self.world_size}

    def _draw(self, seed: int | None) -> list[int]:
        global_batch = self.batch_size * self.world_size
        g = torch.Generator()
        g.manual_seed(seed)
        chosen = torch.randperm(self.num_samples, generator=g)[:global_batch]
        return chosen[self.rank::self.world_size].tolist()


class UnitIndex:
    """The privacy units of a dataset when a unit holds several examples (the examples of
    one user): the sampler draws *units*, and each drawn unit contributes at most
    ``max_examples`` of its examples (a uniformly random subset, drawn independently of
    the data), listed together in the batch.

    Parameters
    ----------
    unit_of_example : sequence of hashable, length N
        The unit (user id) of every example of the dataset.
    max_examples : int >= 1
        k: examples of one unit in one batch at most.

    Attributes
    ----------
    members : list of ndarray
        The example indices of each unit (units numbered ``0 .. n_units - 1`` in order of
        first appearance).
    """

    def __init__(self, unit_of_example, max_examples: int):
        self.max_examples = _v.check_count("max_examples_per_user", max_examples, minimum=1)
        keys = list(unit_of_example.tolist() if hasattr(unit_of_example, "tolist")
                    else unit_of_example)
        if not keys:
            raise ValueError("unit_of_example is empty: give the user id of every example")
        number: dict = {}
        codes = np.fromiter((number.setdefault(k, len(number)) for k in keys),
                            dtype=np.int64, count=len(keys))
        order = np.argsort(codes, kind="stable")
        counts = np.bincount(codes, minlength=len(number))
        self.members = np.split(order, np.cumsum(counts)[:-1])
        self.n_units = len(number)
        self.n_examples = len(keys)

    def expand(self, units, seed: int | None) -> tuple[list[int], tuple[int, ...]]:
        """The rows of the drawn ``units`` (at most ``max_examples`` each, a uniform
        subset) and the number of rows of each."""
        rng = np.random.default_rng(None if seed is None else [seed, 1])
        rows, sizes = [], []
        k = self.max_examples
        for u in units:
            m = self.members[int(u)]
            if m.size > k:
                m = np.sort(rng.choice(m, size=k, replace=False))
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


def _partition(n: int, parts: int, seed: int) -> list[np.ndarray]:
    """Every index of ``range(n)`` put in one of ``parts`` parts uniformly at random
    (independently: adding or removing an example leaves the others' parts alone)."""
    g = np.random.default_rng(seed).integers(0, parts, size=n)
    order = np.argsort(g, kind="stable")
    return np.split(order, np.cumsum(np.bincount(g, minlength=parts))[:-1])


class _ScheduledSampler(_AccountedSampler):
    """A sampler with a layout fixed for the whole run (groups, bins or an order, drawn
    once from its own seed and saved with the state) and a schedule over steps: the batch
    of step ``t`` comes from part ``t mod cycle_length`` of the layout. The layout may be
    known (the accounting of these samplers does not rely on its secrecy)."""

    _label = b""

    def _init_layout(self, seed: int | None) -> None:
        self._layout_seed = _layout_seed(seed, self._label)
        self._parts: list[np.ndarray] | None = None

    def parts(self) -> list[np.ndarray]:
        """The layout: the examples of each of the ``cycle_length`` parts."""
        if self._parts is None:
            self._parts = self._make_parts(self._layout_seed)
        return self._parts

    def _part(self) -> np.ndarray:
        return self.parts()[self._step % self.cycle_length]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["layout"] = self._layout_seed
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._layout_seed = int(state["layout"])
        self._parts = None


class CyclicPoissonBatchSampler(_ScheduledSampler):
    """Cyclic Poisson sampling (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
    Factorization", NeurIPS, Algorithm 2): every example is put in one of
    ``cycle_length`` groups uniformly at random, once for the run; step ``t``
    Poisson-samples group ``t mod cycle_length`` at rate ``sample_rate``. An example
    therefore takes part only in steps ``j, j + b, j + 2b, ...`` (``b`` the cycle length),
    each independently with probability ``sample_rate``: the b-min-separation banded
    matrix factorization needs, with amplification by sampling. ``cycle_length=1`` is
    Poisson sampling. The Poisson draws come from the key chain.

    Parameters
    ----------
    num_samples : int
    sample_rate : float in (0, 1]
        Inclusion probability in the steps where an example's group is sampled; the
        expected batch is ``sample_rate * num_samples / cycle_length``.
    cycle_length : int >= 1
    steps : int, optional
        Batches per epoch; default ``round(cycle_length / sample_rate)`` (every example
        once in expectation per epoch).
    seed : int, optional
    secure : bool
    """

    sample_rate = _read_only("sample_rate")
    _label = b"privlearn.groups"

    def __init__(self, num_samples: int, sample_rate: float, cycle_length: int,
                 steps: int | None = None, seed: int | None = None, secure: bool = False):
        self._sample_rate = _v.check_rate("sample_rate", sample_rate)
        self.cycle_length = _v.check_count("cycle_length", cycle_length, minimum=1)
        self.num_samples = _v.check_count("num_samples", num_samples, minimum=1)
        self.steps = (max(1, round(self.cycle_length / self._sample_rate)) if steps is None
                      else int(steps))
        if secure and seed is not None:
            raise ValueError(f"seed must be None when secure=True, got {seed!r}")
        self.secure = bool(secure)
        self._init_bookkeeping(seed)
        self._init_layout(seed)

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "sample_rate": self.sample_rate,
                "cycle_length": self.cycle_length, "steps": self.steps,
                "secure": self.secure}

    def _make_parts(self, seed: int) -> list[np.ndarray]:
        return _partition(self.num_samples, self.cycle_length, seed)

    def _draw(self, seed: int | None) -> list[int]:
        group = self._part()
        if self.secure:
            bits = np.frombuffer(os.urandom(8 * group.size), dtype=np.uint64) >> np.uint64(11)
            keep = bits.astype(np.float64) * 2.0**-53 < self.sample_rate
        else:
            keep = np.random.default_rng(seed).random(group.size) < self.sample_rate
        return group[keep].tolist()


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
    seed : int, optional
    """

    _label = b"privlearn.bins"

    def __init__(self, num_samples: int, cycle_length: int, seed: int | None = None):
        self.num_samples = _v.check_count("num_samples", num_samples, minimum=1)
        self.cycle_length = _v.check_count("cycle_length", cycle_length, minimum=1)
        self.steps = self.cycle_length
        self._sample_rate = 1.0 / self.cycle_length
        self._init_bookkeeping(seed)
        self._init_layout(seed)

    @property
    def sample_rate(self) -> float:
        """``1 / cycle_length``: the fraction of the data in each batch (read-only)."""
        return self._sample_rate

    def _params(self) -> dict:
        return {"num_samples": self.num_samples, "cycle_length": self.cycle_length}

    def _make_parts(self, seed: int) -> list[np.ndarray]:
        return _partition(self.num_samples, self.cycle_length, seed)

    def _draw(self, seed: int | None) -> list[int]:
        return self._part().tolist()


class ShuffledEpochsBatchSampler(BallsInBinsBatchSampler):
    """Fixed-order epochs ((k, b)-participation; Choquette-Choo, McMahan, Rush & Thakurta
    2023, "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning",
    ICML, Sec. 2): one random permutation of the examples, drawn once, cut into
    ``cycle_length`` batches of (nearly) equal size, trained on in the same order every
    epoch. Accounted without amplification (each example contributes once per epoch,
    ``cycle_length`` steps apart).

    Parameters
    ----------
    num_samples : int
    cycle_length : int >= 1
        Batches per epoch (batch size about ``num_samples / cycle_length``).
    seed : int, optional
    """

    _label = b"privlearn.order"

    def __init__(self, num_samples: int, cycle_length: int, seed: int | None = None):
        if _v.check_count("cycle_length", cycle_length, minimum=1) > num_samples:
            raise ValueError(f"cycle_length must be at most the dataset size {num_samples}, "
                             f"got {cycle_length}; use a larger batch size")
        super().__init__(num_samples, cycle_length, seed)

    def _make_parts(self, seed: int) -> list[np.ndarray]:
        perm = np.random.default_rng(seed).permutation(self.num_samples)
        return np.array_split(perm, self.cycle_length)


class EmptyAwareCollate:
    """Wraps a collate function so that an empty batch becomes zero-length tensors shaped
    like a real batch (built once from ``dataset[0]``)."""

    def __init__(self, dataset, collate_fn=None):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._empty = None

    def __call__(self, batch):
        if len(batch) > 0:
            return self.collate_fn(batch)
        if self._empty is None:
            from torch.utils._pytree import tree_map

            one = self.collate_fn([self.dataset[0]])
            self._empty = tree_map(
                lambda t: t[:0].clone() if isinstance(t, torch.Tensor) else t, one)
        return self._empty


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
            raise ValueError("dataset must be a TensorDataset or a Subset chain over one, "
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


def make_dp_loader(data_loader: DataLoader, *, sampling: str, sample_rate: float,
                   batch_size: int, steps: int | None, seed: int | None,
                   rank: int = 0, world_size: int = 1, secure: bool = False,
                   shared_seed: int | None = None, cycle_length: int | None = None,
                   units: UnitIndex | None = None) -> DataLoader:
    """A loader over the same dataset with the DP batch sampler (keeps workers, pinning,
    the collate function and the worker settings of ``data_loader``).

    With the default collate function and a ``TensorDataset`` (or ``Subset`` chain over
    one), the loader's ``dataset`` is a :class:`TensorBatchGather` around yours (its
    ``.dataset``), which yields the same batches with one gather per tensor.
    ``shared_seed`` seeds the fixed-size sampler when ``world_size > 1`` (it must be the
    same on every rank). ``units``: the sampler draws these privacy units (users) and
    each batch lists the drawn units' examples together.
    """
    ds = data_loader.dataset
    if isinstance(ds, IterableDataset):
        raise ValueError("data_loader wraps an IterableDataset; DP sampling needs a "
                         "map-style dataset (random access by index)")
    n = len(ds) if units is None else units.n_units
    if sampling == "poisson":
        if world_size == 1:
            bs = PoissonBatchSampler(n, sample_rate, steps=steps, seed=seed, secure=secure)
        else:  # each rank samples its own part (privlearn.torch.distributed)
            from privlearn.torch.distributed import DistributedPoissonBatchSampler

            bs = DistributedPoissonBatchSampler(n, sample_rate, rank, world_size,
                                                steps=steps, seed=seed, secure=secure)
    elif sampling == "fixed":
        # distributed fixed-size sampling needs the same generator on every rank
        bs = FixedSizeBatchSampler(n, batch_size, steps=steps,
                                   seed=seed if world_size == 1 else shared_seed,
                                   rank=rank, world_size=world_size)
    elif sampling == "cyclic_poisson":
        bs = CyclicPoissonBatchSampler(n, sample_rate, cycle_length, steps=steps, seed=seed,
                                       secure=secure)
    elif sampling == "balls_in_bins":
        bs = BallsInBinsBatchSampler(n, cycle_length, seed=seed)
    else:
        bs = ShuffledEpochsBatchSampler(n, cycle_length, seed=seed)
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
    return DPDataLoader(
        loader_ds,
        batch_sampler=bs,
        collate_fn=collate_fn,
        generator=generator,
        num_workers=data_loader.num_workers,
        pin_memory=data_loader.pin_memory,
        timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn,
        multiprocessing_context=data_loader.multiprocessing_context,
        persistent_workers=data_loader.persistent_workers if data_loader.num_workers else False,
    )


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

    def __iter__(self):
        sampler = self.batch_sampler
        dropped = sampler._restart()
        if self.on_restart is not None:
            self.on_restart(dropped)
        it = super().__iter__()
        return _Delivering(it, sampler, sampler._fifo)


class _Delivering:
    """Iterator over a DataLoader iterator that reports each delivered batch."""

    def __init__(self, it, sampler, fifo):
        self._it, self._sampler, self._fifo = it, sampler, fifo

    def __iter__(self):
        return self

    def __next__(self):
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
    replaced under the same random state; every other row of the output unchanged).
    """

    def __init__(self, loader, augment, multiplicity: int, tracker=None):
        self.loader = loader
        self.augment = augment
        self.multiplicity = int(multiplicity)
        self._last = None  # the batch behind the views the loop trains on now
        if tracker is not None:
            tracker.input_checks.append(self.check_augment)

    def __iter__(self):
        for batch in self.loader:
            self._last = batch
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


def augmented_views(batch, augment, k: int):
    """``k`` views ``augment(batch)`` of ``batch``, example-major (see
    :class:`AugmentedLoader`)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, spec = tree_flatten(batch)
    sizes = {t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            "augmentation_multiplicity needs batches whose tensors share one leading "
            f"dimension, the examples; got leading sizes {sorted(sizes)}")
    n = sizes.pop()
    views = []
    for _ in range(k):
        vf, _ = tree_flatten(augment(batch))
        if len(vf) != len(flat):
            raise ValueError(
                "augment must return a batch of the structure it receives (one augmented "
                f"view, same rows in the same order): it received {len(flat)} items "
                f"and returned {len(vf)}")
        for t, v in zip(flat, vf, strict=True):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and (
                    not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n):
                raise ValueError(
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
    ``len()`` is the number of logical steps. A logical batch left unfinished (the loop
    was left between its chunks) is discarded when the next one begins: the clipped sums
    of its chunks are dropped, never released.
    """

    def __init__(self, loader: DataLoader, max_physical_batch_size: int, optimizer):
        if int(max_physical_batch_size) < 1:
            raise ValueError("max_physical_batch_size must be >= 1, got "
                             f"{max_physical_batch_size!r}")
        self.loader = loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer

    def __iter__(self):
        from torch.utils._pytree import tree_flatten, tree_unflatten

        m = self.max_physical_batch_size
        sampler = self.loader.batch_sampler
        for batch in self.loader:
            flat, spec = tree_flatten(batch)
            sizes = {t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
            if len(sizes) > 1:
                raise ValueError(f"batch tensors have different leading sizes {sorted(sizes)}")
            n = sizes.pop() if sizes else 0
            drawn = sampler.pending()
            if drawn is not None and drawn.size != n:
                raise ValueError(
                    f"the batch has {n} examples but the sampler drew {drawn.size}: "
                    "max_physical_batch_size needs a collate function that keeps one row "
                    "per example on the leading dimension")
            self.optimizer._begin_logical_batch()
            for lo, hi, groups, final in _chunks(n, m, None if drawn is None else drawn.groups):
                part = [t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 0
                        else t for t in flat]
                self.optimizer._expect_chunk(hi - lo, final=final, groups=groups)
                yield tree_unflatten(part, spec)


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
        raise ValueError(
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
