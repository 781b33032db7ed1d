"""Samplers keep the participation schema they state; a sampler that breaks its
separation is caught by check_participation."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import FixedEpochs, MinSeparation
from privlearn.correlated.sampling import (
    BallsInBinsSampler,
    CyclicPoissonSampler,
    check_participation,
)


@pytest.mark.parametrize("cycle", [1, 3, 8])
def test_cyclic_poisson_keeps_separation_and_rate(cycle):
    s = CyclicPoissonSampler(dataset_size=2000, sampling_rate=0.3, steps=5 * cycle + 2,
                             cycle_length=cycle)
    batches = list(s.batches(0))
    check_participation(batches, s.participation, s.steps)
    sizes = np.array([b.size for b in batches])
    assert abs(sizes.mean() - 0.3 * 2000 / cycle) < 6 * np.sqrt(2000 / cycle * 0.3)
    assert s.participation == MinSeparation(cycle, -(-s.steps // cycle))


def test_balls_in_bins_uses_every_record_once_per_cycle():
    s = BallsInBinsSampler(dataset_size=500, steps=20, cycle_length=5)
    batches = list(s.batches(1))
    check_participation(batches, s.participation, 20)
    for start in range(0, 20, 5):
        ids = np.concatenate(batches[start:start + 5])
        assert np.array_equal(np.sort(ids), np.arange(500))
    check_participation(batches, FixedEpochs(4), 20)


def test_planted_sampler_bugs_are_caught():
    s = BallsInBinsSampler(dataset_size=200, steps=12, cycle_length=4)
    good = list(s.batches(2))
    # a sampler that re-draws the bins each epoch can put a record in adjacent steps
    rng = np.random.default_rng(3)
    redrawn = [b for _ in range(3) for b in BallsInBinsSampler(200, 4, 4).batches(rng)]
    with pytest.raises(ValueError, match="closer than min_sep=4"):
        check_participation(redrawn, s.participation, 12)
    # a sampler that adds one record to a neighbouring batch
    leaky = [b.copy() for b in good]
    leaky[5] = np.append(leaky[5], good[4][0])
    with pytest.raises(ValueError, match="closer than min_sep|participates"):
        check_participation(leaky, s.participation, 12)
    # too many participations
    with pytest.raises(ValueError, match="more than the 2"):
        check_participation(good, MinSeparation(4, 2), 12)


def test_samplers_validate_arguments():
    with pytest.raises(ValueError, match="sampling_rate must be in \\(0, 1\\]"):
        CyclicPoissonSampler(100, 1.5, 10)
    with pytest.raises(ValueError, match="cycle_length must be an integer >= 1"):
        BallsInBinsSampler(100, 10, 0)


# -------------------------------------------------- every registered sampling vs its law
# The property test of the registry: parametrized over SAMPLINGS, so an entry registered
# later gets it too. The draw of each entry is run with the same randomness (one layout
# seed, one seed per step: what the torch samplers' key chains give) on a dataset D and
# on its neighbours D', and the empirical law of "which examples share a step" is checked
# against the law the accountant assumes of the entry.
from privlearn.accounting import Neighbouring  # noqa: E402
from privlearn.correlated.sampling import SAMPLINGS, SamplingLaw  # noqa: E402

_N, _B, _SEEDS = 40, 10, 200


def _setting(law: SamplingLaw, n: int = _N):
    cycle = 4 if law.cycled else 1
    q = law.rate(_B, n, cycle)
    steps = 2 * law.per_epoch(law.rate(_B, _N, cycle), cycle)  # the same on D and D'
    return cycle, q, steps


def _draw(law: SamplingLaw, n: int, seed: int, q: float | None = None):
    """The batches of one run of ``law`` on ``n`` examples; layout and every step drawn
    from their own seed (the same on every dataset)."""
    cycle, q0, steps = _setting(law)
    q = q0 if q is None else q
    parts = None if law.layout is None else law.layout(
        n, cycle, np.random.default_rng([seed, 0xA11]))
    return [np.asarray(law.batch(n, q, _B, parts, t, np.random.default_rng([seed, t])),
                       dtype=np.int64) for t in range(steps)]


def _steps_of(batches, n: int) -> list[tuple[int, ...]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for t, b in enumerate(batches):
        for i in b.tolist():
            out[i].append(t)
    return [tuple(s) for s in out]


def add_remove_violations(law: SamplingLaw, n: int, seeds) -> tuple[int, int]:
    """``(layouts where another example changed step when one was added, layouts)``:
    D has ``n`` examples, D' one more (index ``n``), each pair drawn with the same
    randomness and the same rate (the accountant's ``q``)."""
    moved = 0
    _, q, _ = _setting(law, n)
    for s in seeds:
        a = _steps_of(_draw(law, n, s, q), n)
        b = _steps_of(_draw(law, n + 1, s, q), n + 1)
        moved += a != b[:n]
    return moved, len(seeds)


def check_add_remove_law(law: SamplingLaw) -> None:
    """Raise AssertionError unless ``law``'s draw keeps its add/remove law: adding one
    example leaves every other example's steps as they were (with the same randomness),
    and the added example takes part as the accountant assumes: at most k times, at
    least b steps apart, each eligible step at the entry's rate, in a uniformly random
    part of the layout."""
    cycle, q, steps = _setting(law)
    moved, total = add_remove_violations(law, _N, range(_SEEDS))
    assert moved == 0, f"{law.name}: {moved} of {total} layouts moved another example"
    schema = law.participation(_N + 1, q, steps, cycle)
    taken, eligible, part_of = 0, 0, []
    for s in range(_SEEDS):
        batches = _draw(law, _N + 1, s, q)
        check_participation(batches, schema, steps)
        mine = _steps_of(batches, _N + 1)[_N]
        if law.layout is not None:
            parts = law.layout(_N + 1, cycle, np.random.default_rng([s, 0xA11]))
            j = next(k for k, p in enumerate(parts) if _N in p.tolist())
            part_of.append(j)
            own = [t for t in range(steps) if t % cycle == j]
        else:
            own = list(range(steps))
        assert set(mine) <= set(own)
        taken += len(mine)
        eligible += len(own)
    r = law.eligible_rate(q)
    sd = np.sqrt(eligible * r * (1 - r)) or 1.0
    assert abs(taken - r * eligible) <= 5 * sd, (taken, eligible, r)
    if part_of:  # the added example's part is uniform over the cycle
        counts = np.bincount(part_of, minlength=cycle)
        p = 1 / cycle
        assert np.all(np.abs(counts - _SEEDS * p) <= 5 * np.sqrt(_SEEDS * p * (1 - p)))


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_registered_sampling_keeps_its_law_under_add_remove(name):
    """An add/remove entry passes :func:`check_add_remove_law`; an entry that does not
    hold under add/remove states replace-one, and its refusal (where add/remove is
    needed) says why and what to use instead."""
    law = SAMPLINGS[name]
    if law.relation is Neighbouring.ADD_REMOVE:
        check_add_remove_law(law)
    else:
        assert law.relation is Neighbouring.REPLACE_ONE
        why = law.refusal("this budget")
        assert f"sampling={name!r}" in why and "replace-one" in why
        assert "balls_in_bins" in why and "neighbouring='replace_one'" in why


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_registered_sampling_keeps_its_law_under_replace_one(name):
    """Replace-one: the dataset size is the same, so with the same randomness the
    replaced example takes the steps the original took; every example's pattern obeys
    the entry's participation bound, and each is drawn at the entry's rate."""
    law = SAMPLINGS[name]
    cycle, q, steps = _setting(law)
    schema = law.participation(_N, q, steps, cycle)
    counts = np.zeros(_N)
    for s in range(_SEEDS // 4):
        a = _draw(law, _N, s)
        assert all(np.array_equal(x, y) for x, y in zip(a, _draw(law, _N, s), strict=True))
        check_participation(a, schema, steps)
        for b in a:
            assert len(np.unique(b)) == len(b) and (len(b) == 0 or b.max() < _N)
            if law.scheme == "fixed":
                assert len(b) == _B
        counts += np.bincount(np.concatenate(a), minlength=_N)
    # every example is in a batch at the same rate: steps * q in expectation (an epoch
    # of a cycled sampling is one pass over the data)
    mean = counts / (_SEEDS // 4)
    want = steps * (q if not law.cycled else law.eligible_rate(q) / cycle)
    assert np.all(np.abs(mean - want) <= 0.25 * want + 0.2), (mean.min(), mean.max(), want)


def test_the_property_test_catches_a_split_permutation_under_add_remove():
    """The law of one permutation cut into near-equal batches (np.array_split), the
    shuffled_epochs layout, is not add/remove: adding one example shifts the batch
    boundaries, so other examples move to other steps. Declared add/remove, it fails the
    property test."""
    from dataclasses import replace

    law = replace(SAMPLINGS["shuffled_epochs"], relation=Neighbouring.ADD_REMOVE)
    with pytest.raises(AssertionError, match="moved another example"):
        check_add_remove_law(law)


def test_a_split_permutation_moves_the_release_by_more_than_one_bound():
    """N = 40 vs 41 examples in 2 batches of one permutation, coupled as closely as the
    law allows (D's order is D''s with the added example taken out, a uniform order of
    D): the per-epoch change of the two batch sums, each example contributing up to C,
    is more than the C the add/remove accounting assumed in about half the layouts (an
    example crosses the boundary: (+1, -2) C, norm sqrt 5 C)."""
    from privlearn.correlated.sampling import shuffled_order

    norms = []
    for s in range(300):
        b = shuffled_order(_N + 1, 2, np.random.default_rng(s))
        order = np.concatenate(b)
        a = np.array_split(order[order < _N], 2)
        # worst case per batch: every example entering or leaving moves its sum by C
        change = [len(set(x.tolist()) ^ set(y.tolist())) for x, y in zip(a, b, strict=True)]
        norms.append(float(np.hypot(*change)))
    norms = np.array(norms)
    assert norms.min() == 1.0 and norms.max() == pytest.approx(np.sqrt(5.0))
    assert 0.35 < np.mean(norms > 1.0) < 0.65


def test_a_unit_contributes_a_uniform_subset_of_its_rows():
    """A drawn user with more than k rows contributes a uniformly random k-subset
    (chi-square-like bound over the 10 subsets of 2 of 5 rows), all rows otherwise."""
    from itertools import combinations

    from privlearn.correlated.sampling import unit_subset

    rows = np.arange(10, 15)
    counts = dict.fromkeys(combinations(rows.tolist(), 2), 0)
    for s in range(3000):
        counts[tuple(unit_subset(rows, 2, s).tolist())] += 1
    want = 300
    assert all(abs(c - want) < 5 * np.sqrt(want * 0.9) for c in counts.values()), counts
    assert unit_subset(rows[:2], 2, 0).tolist() == [10, 11]
    assert len(set(unit_subset(rows, 3, None).tolist())) == 3  # secure: OS keys
