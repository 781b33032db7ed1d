"""Ledger misuse: refunds through the public settle, totals whose deltas pass the cap,
files of a format this version cannot read."""

from __future__ import annotations

import math
import sqlite3

import pytest

from privlearn.accounting import ApproxDP, Gaussian, PureDP, compose, subsample
from privlearn.errors import (
    BudgetExceededError,
    LedgerConflictError,
    LedgerIntegrityError,
    ParameterTypeError,
    ParameterValueError,
)
from privlearn.ledger import Ledger, default_filter_order, filter_epsilon


def test_ledger_settle_without_actual_keeps_the_plan(ledger):
    # Ledger.settle(r) and Ledger.settle(r, None) mean what Reservation.settle() means:
    # the plan ran in full. Only an explicit compose([]) takes the plan back.
    plan = compose(subsample(Gaussian(1.5), 0.01), steps=100)
    full = plan.epsilon_bounds(1e-6).upper
    r = ledger.reserve("adult", plan)
    ledger.settle(r, None)
    assert ledger.spent("adult").epsilon_spent == full
    assert ledger.pending("adult") == []
    r2 = ledger.reserve("adult", Gaussian(20.0))
    ledger.settle(r2.seq)
    both = compose([plan, Gaussian(20.0)]).epsilon_bounds(1e-6).upper
    assert ledger.spent("adult").epsilon_spent == both
    r3 = ledger.reserve("adult", Gaussian(30.0))
    ledger.settle(r3, compose([]))  # nothing ran: the explicit refund
    assert ledger.spent("adult").epsilon_spent == both


def test_ledger_settle_refuses_a_seq_that_is_not_an_int(ledger):
    r = ledger.reserve("adult", Gaussian(20.0))
    with pytest.raises(ParameterTypeError, match="reservation"):
        ledger.settle(str(r.seq))
    with pytest.raises(ParameterTypeError, match="reservation"):
        ledger.settle(True)
    assert len(ledger.pending("adult")) == 1


def test_deltas_adding_up_past_the_cap_are_refused_as_over_budget(ledger):
    # two (0.1, 6e-7)-DP releases: their deltas alone (1.2e-6) pass the budget's 1e-6,
    # so no epsilon at delta=1e-6 holds for the total: over budget, nothing recorded
    ledger.spend("adult", ApproxDP(0.1, 6e-7))
    before = ledger.history()
    with pytest.raises(BudgetExceededError, match="nothing was recorded"):
        ledger.spend("adult", ApproxDP(0.1, 6e-7))
    with pytest.raises(BudgetExceededError):
        ledger.reserve("adult", ApproxDP(0.1, 6e-7))
    with pytest.raises(BudgetExceededError):
        ledger.check("adult", ApproxDP(0.1, 6e-7))
    with pytest.raises(BudgetExceededError):
        ledger.spend("adult", ApproxDP(0.01, 2e-6))  # one release over the cap's delta
    assert ledger.history() == before


def _set_schema(path, value):
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value=? WHERE key='schema'", (value,))
    conn.commit()
    conn.close()


def test_a_ledger_of_a_newer_schema_is_refused(tmp_path):
    p = str(tmp_path / "l.db")
    with Ledger(p, create=True) as led:
        led.create_budget("a", 1.0, 1e-6)
    _set_schema(p, "2")
    with pytest.raises(LedgerConflictError, match="schema version 2"):
        Ledger(p)
    _set_schema(p, "x")
    with pytest.raises(LedgerIntegrityError, match="schema version"):
        Ledger(p)
    _set_schema(p, "1")
    with Ledger(p) as led:
        assert led.verify()


@pytest.mark.parametrize("version", ["0", "-1", "-7"])
def test_a_ledger_of_a_schema_below_one_is_refused(tmp_path, version):
    p = str(tmp_path / "l.db")
    with Ledger(p, create=True) as led:
        led.create_budget("a", 1.0, 1e-6)
    _set_schema(p, version)
    with pytest.raises(LedgerConflictError, match=f"schema version {version}\\b"):
        Ledger(p)
    _set_schema(p, "1")
    with Ledger(p) as led:
        assert led.verify()


def test_a_reservation_of_another_ledger_settles_nothing_here(tmp_path):
    # a Reservation object carries its entry: passing it to another ledger whose entry
    # of the same seq is a reservation too must not settle (refund) that one
    with Ledger(tmp_path / "a.db", create=True) as a, Ledger(tmp_path / "b.db",
                                                                create=True) as b:
        for led in (a, b):
            led.create_budget("adult", epsilon=1.0, delta=1e-6)
        ra = a.reserve("adult", Gaussian(20.0))
        rb = b.reserve("adult", Gaussian(30.0))
        assert ra.seq == rb.seq
        before = b.spent("adult").epsilon_spent
        with pytest.raises(LedgerConflictError, match="settle it on its own ledger"):
            b.settle(ra, compose([]))
        with pytest.raises(LedgerConflictError, match="extends"):
            b.reserve("adult", Gaussian(40.0), extends=ra)
        assert b.spent("adult").epsilon_spent == before
        assert len(b.pending("adult")) == 1
        b.settle(rb, compose([]))  # its own reservation settles
        assert b.spent("adult").epsilon_spent == 0.0


def test_remaining_of_an_adaptive_budget_is_what_its_filter_leaves(tmp_path):
    # the Renyi filter certifies more than the tight composition of the same releases,
    # and both are capped: what remains is the budget minus the larger one
    with Ledger(tmp_path / "l.db", create=True) as led:
        led.create_budget("a", epsilon=2.0, delta=1e-5, adaptive=True)
        led.spend("a", Gaussian(5.0))
        s = led.spent("a")
        assert s.adaptive_epsilon > s.epsilon_spent
        assert s.epsilon_remaining == pytest.approx(2.0 - s.adaptive_epsilon, abs=1e-12)


def test_a_pickle_never_carries_the_hmac_key(tmp_path):
    import pickle

    p = tmp_path / "l.db"
    key = b"a-secret-hmac-key"
    with Ledger(p, create=True, key=key) as led:
        led.create_budget("a", epsilon=2.0, delta=1e-5)
        h = led.budget("a")
        blob = pickle.dumps(h)  # e.g. inside a fitted estimator's ledger= parameter
        assert key not in blob
        h2 = pickle.loads(blob)  # loads, but cannot read or spend without the key
        with pytest.raises(ValueError, match="pickles never carry its HMAC key"):
            h2.spent()
        with pytest.raises(ValueError, match="pickles never carry its HMAC key"):
            h2.spend(Gaussian(5.0))
        h2.ledger.close()
        assert len(led.history("a")) == 1
    plain = tmp_path / "plain.db"
    with Ledger(plain, create=True) as led:  # an unkeyed ledger reopens from its pickle
        led.create_budget("a", epsilon=2.0, delta=1e-5)
        h3 = pickle.loads(pickle.dumps(led.budget("a")))
        h3.spend(Gaussian(5.0))
        assert led.spent("a").entries == 1
        h3.ledger.close()


def test_an_empty_privacy_unit_is_refused_not_read_as_the_default(ledger):
    # create_budget refuses privacy_unit=""; a spend with it was counted on the default
    # ("record") budget, another budget than the one named
    with pytest.raises(ParameterValueError, match="privacy_unit"):
        ledger.create_budget("adult", epsilon=1.0, delta=1e-6, privacy_unit="")
    with pytest.raises(ParameterValueError, match="privacy_unit"):
        ledger.spend("adult", Gaussian(20.0), privacy_unit="")
    with pytest.raises(ParameterValueError, match="privacy_unit"):
        ledger.reserve("adult", Gaussian(20.0), privacy_unit="")
    with pytest.raises(ParameterTypeError, match="privacy_unit"):
        ledger.spent("adult", privacy_unit=0)
    with pytest.raises(ParameterValueError, match="privacy_unit"):
        ledger.budget("adult", privacy_unit="")
    assert ledger.spent("adult").entries == 0


@pytest.mark.parametrize(("args", "name"), [
    ((1.0, 1.0, 1e-5), "order"),           # order 1: no (epsilon, delta) guarantee
    ((1.0, 0.5, 1e-5), "order"),
    ((1.0, math.inf, 1e-5), "order"),
    ((1.0, 2.0, 1.5), "delta"),
    ((1.0, 2.0, 0.0), "delta"),
    ((-1.0, 2.0, 1e-5), "rdp_total"),
    ((math.nan, 2.0, 1e-5), "rdp_total"),
])
def test_filter_epsilon_refuses_bad_input_instead_of_answering_zero(args, name):
    # these returned 0.0 (or a number for a negative RDP total): an optimistic epsilon
    with pytest.raises(ParameterValueError, match=f"^{name} must"):
        filter_epsilon(*args)


def test_filter_epsilon_is_the_rdp_conversion_and_default_order_checks_epsilon():
    # Canonne, Kamath & Steinke 2020, Proposition 12, at order 12.5
    a, rho, d = 12.5, 0.5, 1e-5
    closed = rho + math.log((a - 1) / a) - (math.log(d) + math.log(a)) / (a - 1)
    assert filter_epsilon(rho, a, d) == pytest.approx(closed, rel=1e-12)
    assert filter_epsilon(math.inf, a, d) == math.inf
    assert default_filter_order(1.0, 1e-5) == pytest.approx(1 + 2 * math.log(1e5))
    for eps in (0.0, -1.0, math.nan):
        with pytest.raises(ParameterValueError, match="^epsilon must"):
            default_filter_order(eps, 1e-5)


def test_a_dataset_that_is_not_a_string_is_a_typed_error(ledger):
    # it reached SQLite as a parameter it cannot bind (sqlite3.ProgrammingError)
    for call in (lambda: ledger.spend(["adult"], Gaussian(20.0)),
                 lambda: ledger.pending(["adult"]),
                 lambda: ledger.history(["adult"]),
                 lambda: ledger.check(b"adult", Gaussian(20.0))):
        with pytest.raises(ParameterTypeError, match="^dataset must be a string"):
            call()
    assert ledger.spent("adult").entries == 0


def test_verify_refuses_a_malformed_expected_head(ledger):
    # a malformed head raised a bare TypeError from the comparison inside
    n, h = ledger.head()
    assert ledger.verify((n, h))
    for bad in (("1", h), (n, "abc"), (-1, h), (True, h), (n, "z" * 64)):
        with pytest.raises(ParameterValueError, match="^expected_head must be"):
            ledger.verify(bad)
    with pytest.raises(ParameterTypeError, match="^expected_head must be"):
        ledger.verify(5)


def test_expected_head_is_compared_whatever_the_case_of_its_hex_digits(ledger):
    # an upper-case head passed the format check, then never matched the stored
    # lower-case hash: an intact ledger reported as not extending it
    ledger.spend("adult", Gaussian(20.0))
    n, h = ledger.head()
    assert ledger.verify((n, h.upper()))
    other = ("0" if h[0] != "0" else "1") + h[1:]
    assert not ledger.verify((n, other.upper()))


def test_a_closed_ledger_refuses_use_with_a_typed_error(tmp_path):
    # a budget handle used after its `with Ledger(...)` block reached SQLite's
    # "Cannot operate on a closed database" (sqlite3.ProgrammingError)
    path = tmp_path / "c.db"
    with Ledger(path, create=True) as led:
        led.create_budget("adult", epsilon=1.0, delta=1e-6)
        handle = led.budget("adult")
    for call in (lambda: handle.spend(Gaussian(20.0)), handle.spent,
                 lambda: led.spend("adult", Gaussian(20.0)), led.verify, led.head):
        with pytest.raises(ParameterValueError, match=r"^ledger: the Ledger on .* was closed"):
            call()
    led.close()  # closing again is harmless
    assert Ledger(path).spent("adult").entries == 0  # nothing was recorded


def test_a_path_that_is_not_a_path_is_a_typed_error():
    for bad in (3, None, b"l.db"):
        with pytest.raises(ParameterTypeError, match="^path must be a file path"):
            Ledger(bad, create=True)


def test_a_reservation_settled_inside_its_with_block_stands(ledger):
    # settling inside the block (fewer steps than planned) made the exit's automatic
    # settle raise "already settled" after a successful run
    step = subsample(Gaussian(1.5), 0.01)
    with ledger.reserve("adult", compose(step, steps=200)) as r:
        r.settle(compose(step, steps=20))
    assert ledger.pending("adult") == []
    assert ledger.spent("adult").epsilon_spent == compose(step, steps=20).epsilon_bounds(
        1e-6).upper
    with ledger.reserve("adult", Gaussian(30.0)):  # not settled inside: the plan in full
        pass
    assert ledger.pending("adult") == []
    assert ledger.spent("adult").entries == 2


@pytest.mark.parametrize(("who", "error"), [
    (123, ParameterTypeError), (b"alice", ParameterTypeError), (["alice"], ParameterTypeError),
    ("", ParameterValueError), ("   ", ParameterValueError),
    ("alice\nbob", ParameterValueError), ("alice\x1b[2J", ParameterValueError),
])
@pytest.mark.parametrize("call", ["create_budget", "spend", "reserve"])
def test_who_is_one_line_of_text_or_refused_before_anything_is_recorded(
        ledger, who, error, call):
    """``who`` of every entry (a budget's too): a number would be stored as text and
    break the entry's hash (the whole ledger then fails verification), a line break or
    escape would break ``budget history``'s one line per entry, a blank one would be
    silently replaced by user@host. Each is refused with a typed error naming ``who``;
    the ledger is unchanged and still verifies."""
    head = ledger.head()
    with pytest.raises(error, match="who"):
        if call == "create_budget":
            ledger.create_budget("census", 1.0, 1e-6, who=who)
        else:
            getattr(ledger, call)("adult", Gaussian(50.0), who=who)
    assert ledger.head() == head and ledger.verify().ok
    assert [b.dataset for b in ledger.budgets()] == ["adult"]


def test_who_given_to_create_budget_is_recorded(ledger):
    ledger.create_budget("census", 1.0, 1e-6, who="alice@lab")
    assert ledger.history("census")[0].who == "alice@lab" and ledger.verify().ok


def test_an_unpickled_handle_refuses_its_ledger_rolled_back(tmp_path):
    # a handle pickled after a spend, loaded where the file was restored from a backup
    # older than that spend: spending there would forget it, so every use is refused
    import pickle
    import shutil

    from privlearn.errors import LedgerNotFoundError

    path, backup = tmp_path / "l.db", tmp_path / "backup.db"
    with Ledger(path, create=True) as led:
        led.create_budget("a", epsilon=2.0, delta=1e-5)
    shutil.copy(path, backup)
    with Ledger(path) as led:
        led.spend("a", Gaussian(5.0))
        blob = pickle.dumps(led.budget("a"))
    shutil.copy(backup, path)
    h = pickle.loads(blob)
    with pytest.raises(LedgerNotFoundError, match="older backup"):
        h.spend(Gaussian(5.0))
    with Ledger(path) as led:
        assert led.spent("a").entries == 0
    h.ledger.close()


@pytest.mark.parametrize("method", ["spend", "reserve"])
def test_an_epsilon_given_for_the_mechanism_is_refused_naming_the_mechanisms_to_use(
        ledger, method):
    """ledger.spend("adult", 0.3) -- an epsilon where the mechanism goes -- is refused
    with the mechanisms that describe such a release (pure DP, Laplace, (eps, delta)),
    and they are accepted as said; nothing is recorded by the refusal."""
    with pytest.raises(ParameterTypeError) as info:
        getattr(ledger, method)("adult", 0.3)
    msg = str(info.value)
    assert "got 0.3" in msg and "PureDP(0.3)" in msg and "ApproxDP(0.3, delta)" in msg
    assert "Laplace(noise_multiplier=b)" in msg
    assert ledger.spent("adult").entries == 0
    with pytest.raises(ParameterTypeError) as info:
        ledger.spend("adult", "gaussian")
    assert "PureDP" not in str(info.value)  # only a number is read as an epsilon
    ledger.spend("adult", PureDP(0.3))
    ledger.spend("adult", ApproxDP(0.3, 1e-7))
    assert ledger.spent("adult").entries == 2
