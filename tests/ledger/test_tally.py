"""A spend's cost does not grow with the history, and the incremental tally gives what
the full recomposition of every entry gives (privlearn/ledger/_tally.py)."""

from __future__ import annotations

import cProfile
import pstats
import random

import pytest
from _tampering import tamper

from privlearn.accounting import Gaussian, Laplace, PureDP, compose
from privlearn.errors import BudgetExceededError, LedgerIntegrityError
from privlearn.ledger import Ledger
from privlearn.ledger._filter import evaluate_budget, reported_payload
from privlearn.ledger._relations import _read_all, _relation

POOL = [Gaussian(4.0), Gaussian(9.0), Laplace(6.0), PureDP(0.05), compose(Gaussian(12.0), steps=3)]


def _bulk_spend(led: Ledger, dataset: str, mechs) -> None:
    """Append spends of ``mechs`` in one transaction (a long history in milliseconds; the
    chain is built by the ledger's own append, so it verifies)."""
    from privlearn.accounting.serialization import dumps

    with led._write() as cur:
        for m in mechs:
            led._append(cur, "spend", dataset, "record", mechanism=dumps(m),
                        payload=reported_payload(0.0), who="test")


def _calls_of_one_spend(led: Ledger, m) -> int:
    prof = cProfile.Profile()
    prof.enable()
    led.spend("p", m)
    prof.disable()
    return pstats.Stats(prof).total_calls


def test_the_cost_of_a_spend_does_not_grow_with_the_history(tmp_path):
    # the number of Python calls of one spend (deterministic, unlike a timing) with 10
    # and with 1,000 entries of the same mechanisms: the whole history was re-read,
    # re-parsed and re-merged on every spend (about 12x the calls at 1,000 entries)
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("p", 1e6, 1e-6)
    rng = random.Random(0)
    _bulk_spend(led, "p", [rng.choice(POOL) for _ in range(10)])
    led.spend("p", POOL[0])  # warm: the tally is built once per object
    small = _calls_of_one_spend(led, POOL[1])
    _bulk_spend(led, "p", [rng.choice(POOL) for _ in range(1000)])
    led.spend("p", POOL[0])
    large = _calls_of_one_spend(led, POOL[1])
    assert large <= 1.5 * small, (small, large)
    assert led.verify().ok


def _naive(led: Ledger, dataset: str, floor: float | None, extra=None) -> tuple:
    """The full recomposition of every counted release, from the public history:
    ``(certified upper bound, releases, pending, adaptive epsilon)``."""
    hist = led.history(dataset)
    settled = {e.ref: e.mechanism for e in hist if e.kind == "settle"}
    mechs, pending, runs, run_of = [], 0, set(), {}
    for e in hist:
        if e.kind == "spend":
            mechs.append(e.mechanism)
            runs.add(("spend", e.seq))
        elif e.kind == "reserve":
            run = run_of[e.seq] = e.seq if e.ref is None else run_of.get(e.ref, e.ref)
            if e.seq in settled:
                if settled[e.seq] is None:
                    continue
                mechs.append(settled[e.seq])
            else:
                pending += 1
                mechs.append(e.mechanism)
            runs.add(("run", run))
    if extra is not None:
        mechs.append(extra)
    budget = led.budget_info(dataset)
    upper, _, aeps = evaluate_budget(budget, _read_all(budget, mechs, _relation(budget, mechs)))
    return max(upper, floor) if floor is not None else upper, len(runs), pending, aeps


@pytest.mark.parametrize("adaptive", [False, True])
def test_incremental_totals_and_refusals_equal_the_full_recomposition(tmp_path, adaptive):
    # a seeded mix of spends, reservations (some extending a run) and settles (in full,
    # nothing ran, a prefix of the plan), up to and past the cap: what the ledger reports
    # and refuses, from its incremental tally, against the full recomposition; the
    # reported total never decreases between settles (the ledger's monotone rule)
    rng = random.Random(7 + adaptive)
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", 3.0, 1e-6, adaptive=adaptive)
    other = Ledger(tmp_path / "l.db")  # a second writer: its entries are folded in too
    floor, pend, refused = None, [], 0
    for _ in range(22):
        m, r = rng.choice([*POOL, Gaussian(2.0)]), rng.random()
        writer = other if rng.random() < 0.2 else led
        if r < 0.3 and pend:
            res, plan = pend.pop(rng.randrange(len(pend)))
            actual = rng.choice([None, compose([]), plan])
            res.settle() if actual is None else res.settle(actual)
            floor = None
        else:
            want, _, _, aeps = _naive(led, "d", floor, extra=m)
            over = want > 3.0 or (adaptive and aeps > 3.0)
            try:
                if r < 0.75:
                    writer.spend("d", m)
                else:
                    ext = pend[-1][0] if pend and rng.random() < 0.5 else None
                    pend.append((writer.reserve("d", m, extends=ext), m))
            except BudgetExceededError:
                assert over
                refused += 1
            else:
                assert not over
                floor = want
        upper, n, pending, aeps = _naive(led, "d", floor)
        for s in (led.spent("d"), other.spent("d")):
            assert s.epsilon_spent == upper
            assert s.epsilon_remaining == max(0.0, 3.0 - max(upper, aeps or 0.0))
            assert (s.entries, s.pending, s.adaptive_epsilon) == (n, pending, aeps)
    assert refused > 0  # the cap was reached
    assert led.mechanism("d") == Ledger(tmp_path / "l.db").mechanism("d")


def test_a_tampered_entry_under_a_warm_tally_is_refused(tmp_path):
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", 10.0, 1e-6)
    for _ in range(4):
        led.spend("d", Gaussian(5.0))
    before = led.spent("d").epsilon_spent
    tamper(tmp_path / "l.db", "DELETE FROM entries WHERE seq = 3")
    with pytest.raises(LedgerIntegrityError):
        led.spend("d", Gaussian(5.0))
    with pytest.raises(LedgerIntegrityError):
        led.spent("d")
    # an edit of an entry the tally already counted (a larger noise: a smaller total)
    led2 = Ledger(tmp_path / "m.db", create=True)
    led2.create_budget("d", 10.0, 1e-6)
    led2.spend("d", Gaussian(5.0))
    led2.spend("d", Gaussian(5.0))
    tamper(tmp_path / "m.db",
           "UPDATE entries SET mechanism = replace(mechanism, '5.0', '50.0') WHERE seq = 2")
    with pytest.raises(LedgerIntegrityError):
        led2.spent("d")
    assert before > 0


def test_a_tally_that_does_not_match_the_chain_is_rebuilt(tmp_path):
    # the cached state names the chain head it covers; one whose hash is not the chain's
    # at that position (corrupted, or the file replaced) is never used
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", 10.0, 1e-6)
    for m in (Gaussian(5.0), Laplace(8.0), Gaussian(5.0)):
        led.spend("d", m)
    truth = Ledger(tmp_path / "l.db").spent("d")
    tally = led._tallies[("d", "record")]
    tally.slots.clear()  # a corrupted tally: no releases, and a head it does not cover
    tally.releases, tally.n, tally.floor = None, 0, None
    tally.head = (tally.head[0] - 1, "f" * 64)
    assert led.spent("d") == truth
    led.spend("d", Gaussian(5.0))
    assert led.spent("d") == Ledger(tmp_path / "l.db").spent("d")


def _count_queries(monkeypatch) -> list:
    """Count the PLD accountant's epsilon queries (each one composes, or reads its own
    small cache of compositions)."""
    from privlearn.accounting import get_accountant

    acc, calls = get_accountant("pld"), []
    real = acc.epsilon

    def counted(mechanism, delta):
        calls.append(mechanism)
        return real(mechanism, delta)

    monkeypatch.setattr(acc, "epsilon", counted)
    return calls


def test_a_query_of_an_unchanged_budget_does_not_recompose(tmp_path, monkeypatch):
    # spent() asked the accountant again on every call, which recomposes every distinct
    # mechanism (seconds for a few dozen subsampled Gaussians) once its cache of a few
    # compositions was evicted, e.g. by a search checking many candidates
    rng = random.Random(3)
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("p", 1e6, 1e-6)
    _bulk_spend(led, "p", [rng.choice(POOL) for _ in range(30)])
    first = led.spent("p")
    calls = _count_queries(monkeypatch)
    for _ in range(3):
        assert led.spent("p") == first
    assert calls == []
    # a spend by another connection (another process's writer) is folded in: the next
    # query composes the new releases and gives what a newly opened ledger gives
    Ledger(tmp_path / "l.db").spend("p", Gaussian(3.0))
    calls.clear()  # (that writer's own queries)
    s = led.spent("p")
    assert calls and s.entries == first.entries + 1  # composed again
    assert s == Ledger(tmp_path / "l.db").spent("p")
    assert s.epsilon_spent == _naive(led, "p", 0.0)[0]
    # a budget's query is not another budget's: its own releases, its own answer
    led.create_budget("q", 1e6, 1e-6)
    assert led.spent("q").epsilon_spent == 0.0
    led.spend("q", Laplace(6.0))
    assert led.spent("p") == s
    assert led.spent("q").epsilon_spent == _naive(led, "q", None)[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_summaries_equal_the_accountant_on_random_ledgers(tmp_path, seed):
    # random ledgers (repeated and distinct releases, two writers, queries in between,
    # spends refused at the cap): every total and refusal against the releases composed
    # directly by the accountant from the public history
    rng = random.Random(seed)
    cap = rng.choice([1.5, 3.0])
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", cap, 1e-6)
    other = Ledger(tmp_path / "l.db")
    pool = [*POOL, Laplace(rng.uniform(5, 20)), Gaussian(rng.uniform(3, 10))]
    floor = None
    for _ in range(14):
        m = rng.choice(pool)
        writer = other if rng.random() < 0.3 else led
        direct = compose([e.mechanism for e in led.history("d") if e.kind == "spend"] + [m])
        want = direct.epsilon_bounds(1e-6).upper
        # (a PureDP release: basic composition where smaller, as the ledger's rule)
        want = min(want, _naive(led, "d", None, extra=m)[0])
        want = want if floor is None else max(want, floor)
        try:
            writer.spend("d", m)
        except BudgetExceededError:
            assert want > cap
        else:
            assert want <= cap
            floor = want
        for s in (led.spent("d"), other.spent("d"), led.spent("d")):
            assert s.epsilon_spent == (floor or 0.0)
