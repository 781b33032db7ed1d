"""Ledger basics: budgets, spends, refusals, reservations, the adaptive filter."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn.accounting import Gaussian, Laplace, RDPMechanism, compose, subsample
from privlearn.errors import BudgetExceededError, LedgerConflictError, ParameterTypeError
from privlearn.ledger import Ledger, LedgerIntegrityError, default_filter_order


def test_total_is_the_tight_composition_not_a_sum(ledger):
    ms = [Gaussian(5.0), Laplace(10.0), subsample(Gaussian(1.0), 0.01)]
    for m in ms:
        ledger.spend("adult", m, label="x")
    s = ledger.spent("adult")
    direct = compose(ms).epsilon_bounds(1e-6)
    assert s.epsilon_spent == direct.upper
    assert s.epsilon_lower == direct.lower
    assert s.epsilon_spent < sum(m.epsilon(1e-6) for m in ms)
    assert s.entries == 3 and s.pending == 0
    assert ledger.mechanism("adult") == compose(ms)
    assert [e.label for e in ledger.history("adult")] == [None, "x", "x", "x"]
    assert [e.kind for e in ledger.history("adult")] == ["budget", "spend", "spend", "spend"]


def test_refused_spend_records_nothing(ledger):
    ledger.spend("adult", Gaussian(10.0))
    before = ledger.history()
    with pytest.raises(BudgetExceededError, match="nothing was recorded"):
        ledger.spend("adult", Gaussian(0.5))
    assert ledger.history() == before
    with pytest.raises(BudgetExceededError):
        ledger.check("adult", Gaussian(0.5))
    assert ledger.check("adult", Gaussian(10.0)).epsilon_spent <= 1.0
    assert ledger.history() == before


def test_cap_is_never_exceeded_by_repeated_spends(ledger):
    n = 0
    while True:
        try:
            ledger.spend("adult", Gaussian(20.0))
        except BudgetExceededError:
            break
        n += 1
    s = ledger.spent("adult")
    assert s.entries == n > 1
    assert s.epsilon_spent <= 1.0
    assert compose(Gaussian(20.0), steps=n + 1).epsilon(1e-6) > 1.0


def test_budgets_are_separate_and_unique(tmp_path):
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("a", 1.0, 1e-6)
    led.create_budget("a", 5.0, 1e-6, privacy_unit="user")
    with pytest.raises(ValueError, match="already has a budget"):
        led.create_budget("a", 2.0, 1e-6)
    with pytest.raises(KeyError, match="no budget"):
        led.spend("b", Gaussian(1.0))
    led.spend("a", Gaussian(3.0), privacy_unit="user")
    assert led.spent("a").entries == 0
    assert led.spent("a", privacy_unit="user").entries == 1
    assert {(b.dataset, b.privacy_unit) for b in led.budgets()} == {("a", "record"), ("a", "user")}


def test_a_script_run_twice_finds_its_budget_with_exist_ok(tmp_path):
    # the second run of a project's script: create_budget(..., exist_ok=True) returns the
    # budget set by the first run when the settings are the same, refuses any other
    # setting (a budget is never raised), and writes nothing either way
    p = tmp_path / "l.db"
    settings_ = dict(epsilon=2.0, delta=1e-6)
    with Ledger(p, create=True) as led:
        first = led.create_budget("a", **settings_, exist_ok=True)
        led.spend("a", Gaussian(3.0))
    for adaptive in (False, True):
        with Ledger(p, create=True) as led:  # the second run opens the same file
            if adaptive:
                first = led.create_budget("f", **settings_, adaptive=True)
                n = len(led.history())
                again = led.create_budget("f", **settings_, adaptive=True, exist_ok=True)
            else:
                n = len(led.history())
                again = led.create_budget("a", **settings_, exist_ok=True)
            assert again == first == led.budget_info(first.dataset)
            assert len(led.history()) == n
    with Ledger(p) as led:
        n = len(led.history())
        for changed in (dict(epsilon=3.0), dict(delta=1e-5), dict(accountant="rdp"),
                        dict(adaptive=True), dict(neighbouring="replace_one")):
            with pytest.raises(LedgerConflictError, match="asked") as err:
                led.create_budget("a", **{**settings_, **changed}, exist_ok=True)
            name, value = next(iter(changed.items()))
            msg = str(err.value)  # an unset setting (neighbouring here) reads as words
            assert f"{name}=" in msg or f"{name} to be fixed by the first release" in msg
            assert f"(asked {value!r})" in msg and "None" not in msg
        with pytest.raises(LedgerConflictError, match="exist_ok=True"):  # says what to do
            led.create_budget("a", **settings_)
        with pytest.raises(ParameterTypeError, match="exist_ok"):
            led.create_budget("a", **settings_, exist_ok="yes")
        assert len(led.history()) == n
        assert led.spent("a").entries == 1


def test_bad_input_is_rejected_at_the_boundary(tmp_path):
    led = Ledger(tmp_path / "l.db", create=True)
    with pytest.raises(ValueError, match="epsilon"):
        led.create_budget("a", -1.0, 1e-6)
    with pytest.raises(ValueError, match="delta"):
        led.create_budget("a", 1.0, 2.0)
    with pytest.raises(ValueError, match="accountant"):
        led.create_budget("a", 1.0, 1e-6, accountant="nope")
    led.create_budget("a", 1.0, 1e-6)
    with pytest.raises(TypeError, match="Mechanism"):
        led.spend("a", 0.5)
    with pytest.raises(TypeError, match="TabulatedRDP"):
        led.spend("a", RDPMechanism(lambda a: a))
    assert led.history("a")[-1].kind == "budget"


def test_persists_across_instances(tmp_path):
    p = tmp_path / "l.db"
    with Ledger(p, create=True) as led:
        led.create_budget("a", 2.0, 1e-6)
        led.spend("a", Gaussian(3.0), label="first", who="alice")
    with Ledger(p) as led:
        (e,) = [e for e in led.history("a") if e.kind == "spend"]
        assert (e.label, e.who, e.mechanism) == ("first", "alice", Gaussian(3.0))
        assert led.verify()


def test_reserve_counts_in_full_until_settled(ledger):
    step = subsample(Gaussian(1.5), 0.01)
    r = ledger.reserve("adult", compose(step, steps=200), label="run")
    full = ledger.spent("adult")
    assert full.pending == 1
    assert full.epsilon_spent == compose(step, steps=200).epsilon(1e-6)
    assert len(ledger.pending("adult")) == 1
    r.settle(compose(step, steps=50))
    part = ledger.spent("adult")
    assert part.pending == 0
    assert part.epsilon_spent == compose(step, steps=50).epsilon(1e-6) < full.epsilon_spent
    with pytest.raises(ValueError, match="already settled"):
        r.settle(compose(step, steps=10))


def test_settle_must_be_covered_by_the_plan(ledger):
    step = subsample(Gaussian(1.0), 0.01)
    r = ledger.reserve("adult", compose(step, steps=20))
    with pytest.raises(ValueError, match="not covered"):
        r.settle(compose(step, steps=21))
    with pytest.raises(ValueError, match="not covered"):
        r.settle(Gaussian(1.0))
    r.settle(compose([]))  # nothing ran
    assert ledger.spent("adult").epsilon_spent == 0.0


def test_reservation_context_manager(ledger):
    m = Gaussian(8.0)
    with ledger.reserve("adult", m):
        pass
    assert ledger.pending("adult") == []
    with pytest.raises(RuntimeError), ledger.reserve("adult", m):
        raise RuntimeError("killed")
    assert len(ledger.pending("adult")) == 1  # plan kept in full
    assert ledger.spent("adult").epsilon_spent == compose(m, steps=2).epsilon(1e-6)


def test_adaptive_budget_uses_a_renyi_filter(tmp_path):
    led = Ledger(tmp_path / "l.db", create=True)
    b = led.create_budget("a", 1.0, 1e-6, adaptive=True)
    alpha = default_filter_order(1.0, 1e-6)
    assert b.adaptive_order == alpha == 1 + 2 * math.log(1e6)
    m = Gaussian(20.0)
    n = 0
    while True:
        try:
            led.spend("a", m)
        except BudgetExceededError as exc:
            assert "Renyi filter" in str(exc)
            break
        n += 1
    s = led.spent("a")
    # the filter's rule: sum of RDP at alpha, converted, stays within the cap
    rho = n * alpha / (2 * 20.0**2)
    assert s.adaptive_epsilon <= 1.0
    assert rho + math.log1p(-1 / alpha) - (math.log(1e-6) + math.log(alpha)) / (alpha - 1) <= 1.0
    # ... and the next one would break it
    rho1 = (n + 1) * alpha / (2 * 20.0**2)
    assert rho1 + math.log1p(-1 / alpha) - (math.log(1e-6) + math.log(alpha)) / (alpha - 1) > 1.0
    # the filter admits fewer releases than the tight non-adaptive total would
    assert compose(m, steps=n + 1).epsilon(1e-6) < 1.0
    assert s.epsilon_spent < s.adaptive_epsilon


def test_handle_pickles_and_deepcopies(ledger):
    h = ledger.budget("adult")
    assert copy.deepcopy(h) is h
    h2 = pickle.loads(pickle.dumps(h))
    h2.spend(Gaussian(10.0))
    assert h.spent().entries == 1


def test_append_refused_on_a_tampered_ledger(tmp_path):
    import sqlite3

    p = tmp_path / "l.db"
    led = Ledger(p, create=True)
    led.create_budget("a", 5.0, 1e-6)
    led.spend("a", Gaussian(3.0))
    con = sqlite3.connect(p)
    con.execute("DROP TRIGGER entries_no_delete")
    con.execute("DELETE FROM entries WHERE seq = 2")
    con.commit()
    con.close()
    with pytest.raises(LedgerIntegrityError):
        led.spend("a", Gaussian(3.0))
    assert not led.verify()


def test_keyed_ledger(tmp_path):
    p = tmp_path / "k.db"
    led = Ledger(p, create=True, key=b"secret")
    led.create_budget("a", 1.0, 1e-6)
    led.spend("a", Gaussian(10.0))
    assert led.verify()
    with pytest.raises(ValueError, match="pass key="):
        Ledger(p)
    assert not Ledger(p, key=b"other").verify()


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["spend", "reserve", "settle"]),
                              st.floats(3.0, 30.0), st.integers(1, 5)), max_size=12))
def test_random_histories_never_exceed_the_cap(tmp_path_factory, ops):
    led = Ledger(tmp_path_factory.mktemp("h") / "h.db", create=True)
    led.create_budget("a", 1.0, 1e-6)
    counted, open_res = [], []
    for op, sigma, k in ops:
        m = compose(Gaussian(sigma), steps=k)
        try:
            if op == "spend":
                led.spend("a", m)
                counted.append(m)
            elif op == "reserve":
                r = led.reserve("a", m)
                open_res.append((r, len(counted)))
                counted.append(m)
            elif open_res:
                r, i = open_res.pop()
                (step, planned), = r.mechanism.parts
                actual = compose(step, steps=max(1, planned - 1))  # fewer steps ran
                r.settle(actual)
                counted[i] = actual
        except BudgetExceededError:
            pass
        s = led.spent("a")
        assert s.epsilon_spent <= 1.0
        assert s.epsilon_spent == (compose(counted).epsilon(1e-6) if counted else 0.0)
    assert led.verify()


def test_a_ledger_in_a_missing_directory_names_the_directory(tmp_path):
    from privlearn.errors import LedgerNotFoundError

    missing = tmp_path / "not-there"
    for create in (True, False):
        with pytest.raises(LedgerNotFoundError, match=f"directory {missing} .*does not exist"):
            Ledger(missing / "x.db", create=create)
    assert not missing.exists()
    with pytest.raises(LedgerNotFoundError, match="is a directory"):
        Ledger(tmp_path, create=True)


def test_entries_count_releases(ledger):
    """A reservation settled with nothing (a fit that failed before touching the data) is
    no release; a reservation and the reservations extending it are one release; the
    privacy loss of every reserved step still counts."""
    step = subsample(Gaussian(1.0), 0.01)
    ledger.spend("adult", step)
    ledger.reserve("adult", step).settle(compose([]))
    assert ledger.spent("adult").entries == 1
    first = ledger.reserve("adult", compose(step, steps=5))
    second = ledger.reserve("adult", compose(step, steps=2), extends=first)
    s = ledger.spent("adult")
    assert (s.entries, s.pending) == (2, 2)
    first.settle()
    second.settle(step)
    s = ledger.spent("adult")
    assert (s.entries, s.pending) == (2, 0)
    assert s.epsilon_spent == pytest.approx(compose(step, steps=7).epsilon(1e-6), rel=1e-9)


def test_a_chain_of_extensions_is_one_release(ledger):
    # a reservation extending an extension was counted as a second run (its run was the
    # reservation it extends, not the first of the chain)
    step = subsample(Gaussian(1.0), 0.01)
    first = ledger.reserve("adult", compose(step, steps=5))
    second = ledger.reserve("adult", step, extends=first)
    third = ledger.reserve("adult", step, extends=second)
    ledger.reserve("adult", step, extends=first)
    s = ledger.spent("adult")
    assert (s.entries, s.pending) == (1, 4)
    third.settle(compose([]))  # nothing ran in the last extension: the run still released
    assert ledger.spent("adult").entries == 1
    ledger.spend("adult", step)
    assert ledger.spent("adult").entries == 2


def test_spent_epsilon_never_decreases_with_a_new_release(tmp_path, monkeypatch):
    # the PLD bound is certified but not monotone (its discretisation adapts to the
    # composition): simulate a certified bound that dips below the previous total
    # after some releases; what the ledger reports (and caps) must not decrease and
    # must never be below the certified bound of what was released
    import privlearn.ledger._summary as ledger_mod
    real = ledger_mod.evaluate_budget
    certified: list[float] = []

    def dipping(budget, mechs):
        upper, lower, aeps = real(budget, mechs)
        if len(mechs) % 2 == 0:  # a looser grid on odd counts, a finer one on even
            upper = lower = upper - 1e-3 * len(mechs)
        certified.append(upper)
        return upper, lower, aeps

    monkeypatch.setattr(ledger_mod, "evaluate_budget", dipping)
    led = Ledger(tmp_path / "m.db", create=True)
    led.create_budget("d", 10.0, 1e-6)
    shown = [0.0]
    for sigma in [5.0, 200.0, 7.0, 300.0, 400.0]:
        led.spend("d", Gaussian(sigma))
        s = led.spent("d")
        assert s.epsilon_spent >= certified[-1]  # never optimistic
        assert s.epsilon_spent >= shown[-1]  # never decreases
        shown.append(s.epsilon_spent)
    assert Ledger(tmp_path / "m.db").spent("d").epsilon_spent == shown[-1]  # persisted
    # the cap is checked on the same number: what check() says a release would leave
    # does not go below the total either, and the remaining budget is counted from it
    s = led.spent("d")
    assert s.epsilon_remaining == pytest.approx(10.0 - s.epsilon_spent, abs=0)
    assert led.check("d", Gaussian(500.0)).epsilon_spent >= s.epsilon_spent
    # a settle that ran less than planned may lower the total (not a new release)
    led3 = Ledger(tmp_path / "m3.db", create=True)
    led3.create_budget("f", 10.0, 1e-6)
    r = led3.reserve("f", compose(Gaussian(3.0), steps=4))
    planned = led3.spent("f").epsilon_spent
    r.settle(compose(Gaussian(3.0), steps=1))
    assert led3.spent("f").epsilon_spent < planned


def test_a_release_known_by_its_rdp_curve_is_accounted_on_a_pld_budget(tmp_path):
    # an RDPMechanism has no PLD: the PLD budget refused it; every release is then
    # composed under Renyi DP, a valid (looser) bound, never below the tight one
    import numpy as np

    from privlearn.accounting.serialization import TabulatedRDP

    curve = TabulatedRDP.from_function(lambda a: a / (2 * 3.0**2), np.arange(1.25, 256, 0.25))
    led = Ledger(tmp_path / "rdp.db", create=True)
    led.create_budget("d", 2.0, 1e-6)
    led.spend("d", Gaussian(8.0))
    led.spend("d", RDPMechanism(curve, name="gaussian sigma 3"))
    s = led.spent("d")
    rdp = compose([Gaussian(8.0), Gaussian(3.0)]).epsilon(1e-6, "rdp")
    tight = compose([Gaussian(8.0), Gaussian(3.0)]).epsilon_bounds(1e-6).upper
    assert s.epsilon_spent == pytest.approx(rdp, rel=1e-3) and s.epsilon_spent >= tight
    assert s.epsilon_lower is None and s.accountant == "pld"
    with pytest.raises(BudgetExceededError):  # the cap is checked on that bound
        led.spend("d", RDPMechanism(curve))
