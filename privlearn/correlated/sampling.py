"""How batches are sampled: one registry entry per sampling, owning both the draw of
each step's batch (NumPy) and the law the accountant assumes of it.

Each :class:`SamplingLaw` in :data:`SAMPLINGS` states, for one way of sampling:

* the draw: the run's fixed layout (``layout``: groups, bins or an order, drawn once) and
  the batch of each step (``batch``), as index arrays -- what
  :mod:`privlearn.torch.data` wraps into torch samplers;
* the law the accountant assumes: the neighbouring relation its accounting holds under
  (``relation``), the sampling rate and steps per epoch, the participation bound of one
  example (``participation``: at most ``k`` participations, at least ``b`` steps apart)
  and the rate at which an example is drawn in a step where it may be (``eligible_rate``),
  and what :func:`privlearn.correlated.accounting.correlated_mechanism` takes
  (``describe``).

:func:`privlearn.torch.make_private`, :class:`privlearn.torch.hf.DPTrainer`, the
accountant and the ledger all read the entry; registering a new sampling
(:func:`register_sampling`) is one entry, and the property test of the test suite
(``tests/correlated/test_sampling.py``) checks every registered entry's draw against its
law, under add/remove and replace-one neighbours of the dataset.

**Add/remove needs a coupled draw.** Under add/remove neighbouring the accountant assumes
that adding one example leaves the other examples' steps alone (in law). Every
add/remove entry draws so that this holds *with the same randomness*: an example's
participation depends on the random stream and its own index only, never on the dataset
size (Poisson by geometric skips, groups and bins by one uniform draw per example). A
sampling that cuts one permutation into near-equal batches (``shuffled_epochs``) moves
other examples to other steps when one is added (the batch sizes change): it is accounted
under replace-one only, and refused where an add/remove guarantee is needed.

Each record's group is drawn independently and uniformly (not by splitting a shuffled
dataset into equal parts), so that adding or removing a record leaves the others'
distribution unchanged: the add/remove relation the accounting uses.

References
----------
.. [ACGMMTZ16] Abadi et al. (2016), Deep Learning with Differential Privacy, CCS (Poisson
       sampling).
.. [WBK19] Wang, Balle & Kasiviswanathan (2019), Subsampled Renyi Differential Privacy and
       Analytical Moments Accountant, AISTATS (fixed-size sampling, replace-one).
.. [CC23a] Choquette-Choo, McMahan, Rush & Thakurta (2023), Multi-Epoch Matrix
       Factorization Mechanisms for Private Machine Learning, ICML, Sec. 2 ((k, b)
       participation of a fixed order).
.. [CC23b] Choquette-Choo et al. (2023), (Amplified) Banded Matrix Factorization, NeurIPS,
       Algorithm 2 (cyclic Poisson sampling).
.. [CGHKMSZ25] Chua, Ghazi, Harrison, Kumar, Manurangsi, Sinha & Zhang (2025),
       Balls-and-Bins Sampling for DP-SGD, AISTATS.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from privlearn._validation import check_count, check_rate
from privlearn.accounting import Neighbouring, steps_per_epoch
from privlearn.correlated.participation import FixedEpochs, MinSeparation, Participation
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = ["CyclicPoissonSampler", "BallsInBinsSampler", "check_participation",
           "SamplingLaw", "SAMPLINGS", "register_sampling", "partition", "poisson_subset",
           "fixed_subset", "shuffled_order", "unit_subset"]


def _set_count(obj: object, name: str) -> None:
    object.__setattr__(obj, name, check_count(name, getattr(obj, name), minimum=1))


def partition(n: int, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Every index of ``range(n)`` put in one of ``parts`` parts uniformly at random, one
    draw per index in index order (so the parts of the first ``n`` indices are the same
    for any larger ``n`` with the same ``rng``: adding an example leaves the others'
    parts alone). Each part lists its indices in increasing order.

    The one group partition of privlearn: the groups of cyclic Poisson sampling and the
    bins of balls-in-bins sampling, in :mod:`privlearn.correlated` and
    :mod:`privlearn.torch` alike."""
    g = rng.integers(0, parts, size=n)
    order = np.argsort(g, kind="stable")
    return np.split(order, np.cumsum(np.bincount(g, minlength=parts))[:-1])



def _os_uniforms(n: int) -> np.ndarray:
    """``n`` uniforms in [0, 1) with 53 random bits each from the OS CSPRNG."""
    bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    return bits.astype(np.float64) * 2.0**-53


_SKIP_CHUNK = 256  # geometric skips drawn at a time (a constant: the stream never
#                    depends on the dataset size)


def poisson_subset(n: int, rate: float, rng: np.random.Generator | None) -> np.ndarray:
    """The indices of ``range(n)`` each included independently with probability
    ``rate`` (Poisson sampling), increasing.

    Drawn by geometric skips between included indices, at ``O(rate n)`` cost: the
    included indices below ``n`` do not depend on ``n`` for a given ``rng`` (adding an
    example at the end leaves every other example's inclusion as it was). ``rng=None``:
    one uniform per index from the OS CSPRNG (secure mode)."""
    if rate >= 1.0:
        return np.arange(n, dtype=np.int64)
    if rng is None:
        return np.flatnonzero(_os_uniforms(n) < rate).astype(np.int64)
    out, last = [], -1
    while True:
        idx = last + np.cumsum(rng.geometric(rate, size=_SKIP_CHUNK), dtype=np.int64)
        out.append(idx[idx < n])
        if idx[-1] >= n:
            return np.concatenate(out)
        last = int(idx[-1])


def fixed_subset(n: int, size: int, rng: np.random.Generator | None) -> np.ndarray:
    """``size`` distinct indices of ``range(n)``, uniformly at random (sampling without
    replacement), in random order. ``rng=None``: the ``size`` smallest of ``n`` i.i.d.
    64-bit keys from the OS CSPRNG, in the order of their keys (secure mode; ties, of
    probability below ``n^2 / 2^65``, go to the lower index)."""
    if rng is None:
        keys = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
        if size < n:
            chosen = np.argpartition(keys, size - 1)[:size]
        else:
            chosen = np.arange(n)
        return chosen[np.argsort(keys[chosen], kind="stable")].astype(np.int64)
    return rng.permutation(n)[:size]


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9),
        np.uint64(0x94D049BB133111EB))


def _row_keys(seed: int, rows: np.ndarray) -> np.ndarray:
    """A pseudo-random 64-bit key per row index, a function of ``(seed, row)`` only
    (SplitMix64's finaliser; Steele, Lea & Flood 2014): the same row gets the same key
    whatever else is drawn."""
    with np.errstate(over="ignore"):
        z = rows.astype(np.uint64) * _MIX[0] + np.uint64(seed % 2**64)
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
        return z ^ (z >> np.uint64(31))


def unit_subset(members: np.ndarray, k: int, seed: int | None) -> np.ndarray:
    """The rows a drawn privacy unit (a user's examples, ``members``) contributes to a
    step: all of them when there are at most ``k``, else a uniformly random ``k``-subset
    (the ``k`` smallest of i.i.d. keys), increasing. The keys depend on the step's
    ``seed`` and the row only, so adding or removing another unit changes no unit's
    rows; ``seed=None``: keys from the OS CSPRNG (secure mode)."""
    members = np.asarray(members, dtype=np.int64)
    if members.size <= k:
        return members
    if seed is None:
        keys = np.frombuffer(os.urandom(8 * members.size), dtype=np.uint64)
    else:
        keys = _row_keys(seed, members)
    return np.sort(members[np.argpartition(keys, k - 1)[:k]])


def shuffled_order(n: int, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One random permutation of ``range(n)`` cut into ``parts`` near-equal batches
    (``np.array_split``). Adding an example changes the batch sizes, so other examples
    move to other batches: a replace-one layout only."""
    return np.array_split(rng.permutation(n), parts)


class _CycledSampler:
    """What the cycled samplers share: a record's steps are ``cycle_length`` apart, and the
    batches are the :data:`SAMPLINGS` law ``_law``'s draw at the per-step rate ``_rate``."""

    _law: str

    @property
    def participation(self) -> MinSeparation:
        """``MinSeparation(cycle_length)`` with at most ``ceil(steps / cycle_length)``
        participations."""
        return MinSeparation(self.cycle_length, math.ceil(self.steps / self.cycle_length))

    def batches(self, rng: np.random.Generator | int | None = None) -> Iterator[np.ndarray]:
        """Yield the index array of each step's batch."""
        rng = np.random.default_rng(rng)
        law = SAMPLINGS[self._law]  # the registry's draw
        groups = law.layout(self.dataset_size, self.cycle_length, rng)
        for t in range(self.steps):
            yield law.batch(self.dataset_size, self._rate, None, groups, t, rng)


@dataclass(frozen=True)
class CyclicPoissonSampler(_CycledSampler):
    """Cyclic Poisson sampling ([CC23b], Algorithm 2).

    Every record is put in one of ``cycle_length`` groups uniformly at random; step ``t``
    Poisson-samples group ``t mod cycle_length`` with rate ``sampling_rate``. A record
    therefore participates only in steps ``j, j + b, j + 2 b, ...`` (``b`` the cycle
    length), each independently with probability ``sampling_rate``. ``cycle_length = 1``
    is ordinary Poisson sampling (DP-SGD).

    Parameters
    ----------
    dataset_size : int >= 1
    sampling_rate : float in (0, 1]
        Inclusion probability in each step where the record is eligible; the expected
        batch size is ``sampling_rate * dataset_size / cycle_length``.
    steps : int >= 1
    cycle_length : int >= 1
    """

    dataset_size: int
    sampling_rate: float
    steps: int
    cycle_length: int = 1

    def __post_init__(self) -> None:
        _set_count(self, "dataset_size")
        object.__setattr__(self, "sampling_rate", check_rate("sampling_rate", self.sampling_rate))
        _set_count(self, "steps")
        _set_count(self, "cycle_length")

    _law = "cyclic_poisson"

    @property
    def _rate(self) -> float:
        return self.sampling_rate

    @property
    def participations(self) -> int:
        """Most participations of one record (its group's number of steps)."""
        return math.ceil(self.steps / self.cycle_length)


@dataclass(frozen=True)
class BallsInBinsSampler(_CycledSampler):
    """Balls-in-bins sampling ([CGHKMSZ25]): every record is put in one of
    ``cycle_length`` bins uniformly at random, and step ``t`` uses the whole bin
    ``t mod cycle_length``: a record participates in exactly the steps
    ``j, j + b, j + 2 b, ...`` of its bin ``j`` (``b`` the cycle length).

    Parameters
    ----------
    dataset_size : int >= 1
    steps : int >= 1
    cycle_length : int >= 1
        Steps per epoch; the expected batch size is ``dataset_size / cycle_length``.
    """

    dataset_size: int
    steps: int
    cycle_length: int

    def __post_init__(self) -> None:
        _set_count(self, "dataset_size")
        _set_count(self, "steps")
        _set_count(self, "cycle_length")

    _law = "balls_in_bins"

    @property
    def _rate(self) -> float:
        return 1.0 / self.cycle_length


def check_participation(
    batches: Iterable[np.ndarray], participation: Participation, steps: int | None = None
) -> None:
    """Raise ``ValueError`` naming the first record whose participations in ``batches``
    break ``participation`` (too close together, too many, or, for
    :class:`~privlearn.correlated.participation.FixedEpochs`, off its fixed positions)."""
    batches = [np.asarray(b, dtype=np.int64) for b in batches]
    n = len(batches) if steps is None else check_count("steps", steps, minimum=1)
    if not batches:
        return
    step_of = np.concatenate([np.full(b.size, t) for t, b in enumerate(batches)])
    ids = np.concatenate(batches)
    order = np.lexsort((step_of, ids))
    ids, step_of = ids[order], step_of[order]
    same = ids[1:] == ids[:-1]
    gaps = np.diff(step_of)
    counts = np.bincount(np.unique(ids, return_inverse=True)[1])
    limit = participation.participations(n)
    if counts.max() > limit:
        worst = np.unique(ids)[int(np.argmax(counts))]
        raise ParameterValueError(
            f"batches: record {int(worst)} participates {int(counts.max())} times, more "
            f"than the {limit} that participation={participation!r} allows in {n} steps; "
            "check the sampler against this participation schema, or pass the schema "
            "the batches follow")
    if isinstance(participation, MinSeparation):
        bad = np.nonzero(same & (gaps < participation.min_sep))[0]
        if bad.size:
            i = int(bad[0])
            raise ParameterValueError(
                f"batches: record {int(ids[i])} participates in steps {int(step_of[i])} "
                f"and {int(step_of[i + 1])}, closer than min_sep={participation.min_sep} "
                "steps; use a sampler that keeps each record's participations at least "
                "min_sep apart (a cyclic one), or a smaller min_sep")
    elif isinstance(participation, FixedEpochs):
        per = participation.steps_per_epoch(n)
        bad = np.nonzero(same & (gaps != per))[0]
        if bad.size:
            i = int(bad[0])
            raise ParameterValueError(
                f"batches: record {int(ids[i])} participates in steps {int(step_of[i])} "
                f"and {int(step_of[i + 1])}, not one epoch ({per} steps) apart as "
                f"participation={participation!r} requires; use the same batch order in "
                "every epoch, or MinSeparation for shuffled epochs")


# ------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class SamplingLaw:
    """One way of sampling batches: how its batches are drawn, and the law its accountant
    assumes of them (see the module docstring).

    Counts are of the units the sampler draws (examples, or users with user-level
    privacy). ``b`` is the loader's batch size, ``n`` the number of units, ``c`` the cycle
    length (1 for a sampling without one), ``q`` the sampling rate.

    Attributes
    ----------
    name : str
    relation : Neighbouring
        The neighbouring relation its accounting holds under: ``ADD_REMOVE`` when adding
        or removing one unit leaves the other units' steps alone (a coupled draw, see the
        module docstring), else ``REPLACE_ONE`` (the dataset size is public, one unit's
        data replaced). A replace-one sampling is refused where an add/remove guarantee
        is asked for (an add/remove ledger budget).
    cycled : bool
        Whether it has a cycle length (groups, bins or batches of a fixed order).
    rate : callable
        ``rate(b, n, c) -> q``: the probability that a unit is drawn in a step where it
        may be (Poisson, cyclic Poisson), or the fraction of the units in each batch.
    per_epoch : callable
        ``per_epoch(q, c) -> int``: steps in one epoch.
    expected_batch : callable
        ``expected_batch(q, n, c) -> float``: the normaliser of the noisy sum.
    layout : callable or None
        ``layout(n, c, rng) -> list of index arrays``: the layout fixed for the run (the
        ``c`` groups, bins or batches of an order), drawn once; None: none.
    batch : callable
        ``batch(n, q, size, parts, t, rng) -> index array``: the batch of step ``t``
        (``size`` the fixed batch size, ``parts`` the layout, ``rng`` a NumPy generator,
        or None for OS-CSPRNG draws in secure mode).
    participation : callable
        ``participation(n, q, steps, c) -> Participation``: the most one unit takes
        part in ``steps`` steps, and how far apart (what the sensitivity assumes).
    eligible_rate : callable
        ``eligible_rate(q) -> float``: the probability that a unit is in the batch of a
        step where it may be (1 when a unit takes part in every step of its pattern).
    describe : callable or None
        ``describe(n, q, steps, c)``: the sampler or participation schema
        :func:`~privlearn.correlated.accounting.correlated_mechanism` accounts a matrix
        mechanism with; None: accounted step by step only (subsampled Gaussian steps).
    scheme : str or None
        The subsampling scheme of a step-by-step accounting (``"poisson"``, ``"fixed"``).
    secure : bool
        Whether the draw supports OS-CSPRNG randomness (``rng=None``).
    distributed : bool
        Whether it runs on several ranks (each rank drawing its part of one batch).
    default_cycle : callable or None
        ``default_cycle(n, b, bands) -> c`` when no cycle length is given (None: ``n /
        b``, see :meth:`cycle_for`).
    """

    name: str
    relation: Neighbouring
    cycled: bool
    rate: Callable[[float, int, int], float]
    per_epoch: Callable[[float, int], int]
    expected_batch: Callable[[float, int, int], float]
    layout: Callable | None
    batch: Callable
    participation: Callable[[int, float, int, int], Participation]
    eligible_rate: Callable[[float], float]
    describe: Callable | None = None
    scheme: str | None = None
    secure: bool = False
    distributed: bool = False
    default_cycle: Callable[[int, float, int | None], int] | None = None

    @property
    def add_remove(self) -> bool:
        """Whether its accounting holds under add/remove neighbouring."""
        return self.relation is Neighbouring.ADD_REMOVE

    def cycle_for(self, n: int, b: float, bands: int | None = None) -> int:
        """The cycle length when none is given: ``default_cycle(n, b, bands)`` if the
        entry has one, else batches of about ``b`` units (``n / b`` steps per epoch); 1
        for a sampling without a cycle. ``bands``: those of a banded strategy, if any."""
        if not self.cycled:
            return 1
        if self.default_cycle is not None:
            return int(self.default_cycle(n, b, bands))
        return max(1, round(n / b))

    def refusal(self, where: str) -> str:
        """Why a replace-one sampling cannot be used ``where`` an add/remove guarantee is
        needed, and what to use instead (for an error message)."""
        return (
            f"sampling={self.name!r} is accounted under replace-one neighbouring only "
            f"(the dataset size public, one example's data replaced): {where} counts "
            "add/remove releases, and under add/remove this sampling has no guarantee "
            "at the accounted epsilon"
            + (" (adding one example changes the batch sizes, so other examples move to "
               "other steps)" if self.name == "shuffled_epochs" else "")
            + ". Use sampling='balls_in_bins' (each example's step drawn independently: "
              "add/remove) or 'poisson', or spend it on a budget created with "
              "neighbouring='replace_one'")


#: The registered samplings, by name (:func:`register_sampling`).
SAMPLINGS: dict[str, SamplingLaw] = {}


def register_sampling(law: SamplingLaw) -> SamplingLaw:
    """Register ``law`` under ``law.name`` (replacing an entry of that name): the one
    place a sampling is described. ``make_private(sampling=law.name)``,
    :class:`~privlearn.torch.hf.DPTrainer`, the accountant and the ledger then read it
    from :data:`SAMPLINGS`, the torch loader draws its batches with ``law.layout`` and
    ``law.batch`` (:class:`privlearn.torch.samplers.RegisteredBatchSampler`), and the
    property test of the test suite checks its draw against its law.

    Parameters
    ----------
    law : SamplingLaw

    Returns
    -------
    SamplingLaw
        ``law``.

    Raises
    ------
    TypeError
        ``law`` is not a :class:`SamplingLaw`.
    """
    if not isinstance(law, SamplingLaw):
        raise ParameterTypeError(
            f"register_sampling: law must be a SamplingLaw, got {law!r} (a "
            f"{type(law).__name__}); build one with SamplingLaw(name=..., ...)")
    SAMPLINGS[law.name] = law
    return law


def _whole(q: float) -> float:
    return 1.0


def _per_step(n: int, q: float, steps: int, c: int) -> Participation:
    return MinSeparation(1, steps)


def _cycled(n: int, q: float, steps: int, c: int) -> Participation:
    return MinSeparation(c, math.ceil(steps / c))


def _fixed_epochs(n: int, q: float, steps: int, c: int) -> Participation:
    # the batches of one order, passed over until ``steps``: the last pass may be cut short
    return FixedEpochs(math.ceil(steps / c), c)


def _own_part(n, q, size, parts, t, rng):
    return parts[t % len(parts)]


def _poisson_in_part(n, q, size, parts, t, rng):
    group = parts[t % len(parts)]
    if q >= 1.0:
        return group
    keep = (_os_uniforms(group.size) if rng is None else rng.random(group.size)) < q
    return group[keep]


register_sampling(SamplingLaw(
    "poisson", Neighbouring.ADD_REMOVE, False,
    rate=lambda b, n, c: b / n, per_epoch=lambda q, c: steps_per_epoch(q),
    expected_batch=lambda q, n, c: q * n, layout=None,
    batch=lambda n, q, size, parts, t, rng: poisson_subset(n, q, rng),
    participation=_per_step, eligible_rate=lambda q: q, scheme="poisson", secure=True,
    distributed=True))
register_sampling(SamplingLaw(
    "fixed", Neighbouring.REPLACE_ONE, False,
    rate=lambda b, n, c: b / n, per_epoch=lambda q, c: steps_per_epoch(q),
    expected_batch=lambda q, n, c: q * n, layout=None,
    batch=lambda n, q, size, parts, t, rng: fixed_subset(n, size, rng),
    participation=_per_step, eligible_rate=lambda q: q, scheme="fixed", secure=True,
    distributed=True))
register_sampling(SamplingLaw(
    "cyclic_poisson", Neighbouring.ADD_REMOVE, True,
    rate=lambda b, n, c: b * c / n, per_epoch=lambda q, c: max(1, round(c / q)),
    expected_batch=lambda q, n, c: q * n / c, layout=partition, batch=_poisson_in_part,
    participation=_cycled, eligible_rate=lambda q: q,
    describe=lambda n, q, steps, c: CyclicPoissonSampler(n, q, steps, c), secure=True,
    default_cycle=lambda n, b, bands: bands or 1))
register_sampling(SamplingLaw(
    "balls_in_bins", Neighbouring.ADD_REMOVE, True,
    rate=lambda b, n, c: 1.0 / c, per_epoch=lambda q, c: c,
    expected_batch=lambda q, n, c: n / c, layout=partition, batch=_own_part,
    participation=_cycled, eligible_rate=_whole,
    describe=lambda n, q, steps, c: BallsInBinsSampler(n, steps, c)))
register_sampling(SamplingLaw(
    "shuffled_epochs", Neighbouring.REPLACE_ONE, True,
    rate=lambda b, n, c: 1.0 / c, per_epoch=lambda q, c: c,
    expected_batch=lambda q, n, c: n / c, layout=shuffled_order, batch=_own_part,
    participation=_fixed_epochs, eligible_rate=_whole, describe=_fixed_epochs))
