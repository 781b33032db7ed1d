"""Shared accounting caches under threads: many threads computing epsilons at once (the
ledger and a web service do this) get exactly the single-threaded answers, with no
'OrderedDict mutated during iteration' and no lost or partial cache entry."""

from __future__ import annotations

import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from privlearn.accounting import Gaussian, Laplace, RandomizedResponse, compose, subsample
from privlearn.accounting.pld import PLDAccountant
from privlearn.accounting.rdp import RDPAccountant, clear_caches

DELTA = 1e-6
#: distinct mechanisms (different keys of the PLD cache), cheap on a coarse grid
DISTINCT = [compose(subsample(Gaussian(0.5 + 0.01 * i), 0.01), steps=20) for i in range(60)]
DISTINCT.append(compose([subsample(Laplace(2.0), 0.05), RandomizedResponse(0.8)], steps=[20, 3]))


@pytest.fixture
def frequent_switches():
    """Switch threads every microsecond (default 5 ms), so that a thread is interrupted
    inside the cache's bookkeeping as often as possible."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _pld(cache_size: int) -> PLDAccountant:
    return PLDAccountant(n_target=1 << 9, max_points=1 << 11, cache_size=cache_size,
                         rel_gap=1.0)


def _hammer(acc, jobs, workers: int = 8):
    """Every one of ``workers`` threads evaluates every job (each in its own order), all
    starting together; returns each thread's answers in job order."""
    start = threading.Barrier(workers)
    out: list[dict] = [{} for _ in range(workers)]
    errors: list[BaseException] = []

    def run(w: int) -> None:
        order = list(range(len(jobs)))
        random.Random(w).shuffle(order)
        start.wait(timeout=30)
        try:
            for i in order:
                out[w][i] = acc.epsilon(jobs[i], DELTA)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    return [[o[i] for i in range(len(jobs))] for o in out]


@pytest.mark.parametrize("cache_size", [1000, 4])  # no eviction / constant eviction
def test_pld_cache_under_eight_threads(frequent_switches, cache_size):
    """Distinct mechanisms (inserted, looked up and evicted concurrently) and identical
    ones (the first mechanism asked by every thread several times)."""
    jobs = DISTINCT + [DISTINCT[0]] * 5
    reference = [_pld(cache_size).epsilon(m, DELTA) for m in jobs]
    acc = _pld(cache_size)
    for answers in _hammer(acc, jobs):
        assert answers == reference
    assert len(acc._cache) <= cache_size
    assert all(acc._cache[k] is not None for k in acc._cache)


def test_rdp_curves_under_threads(frequent_switches):
    acc = RDPAccountant()
    ms = [compose(subsample(Gaussian(0.7 + 0.05 * i), 0.02), steps=100) for i in range(8)]
    clear_caches()
    reference = [acc.epsilon(m, DELTA) for m in ms]
    clear_caches()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda m: acc.epsilon(m, DELTA), ms * 4))
    assert got == reference * 4
