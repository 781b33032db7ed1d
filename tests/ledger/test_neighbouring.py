"""One budget, one neighbouring relation: a replace-one release is refused by a budget
under add/remove, add/remove releases are counted at their replace-one cost by a budget
under replace-one, and a budget without a recorded relation is read conservatively."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from privlearn.accounting import (
    Gaussian,
    Neighbouring,
    PureDP,
    RDPMechanism,
    compose,
    subsample,
)
from privlearn.accounting.serialization import TabulatedRDP, dumps
from privlearn.errors import LedgerConflictError, ParameterValueError
from privlearn.ledger import Ledger

AR, RO = Neighbouring.ADD_REMOVE, Neighbouring.REPLACE_ONE
DELTA = 1e-5
#: an SSP-like fit (two Gaussian sums, add/remove) and a fixed-size DP-SGD run (replace-one)
SSP = compose([Gaussian(5.0), Gaussian(7.6)])
FIXED_RUN = compose(subsample(Gaussian(1.0), 0.05, scheme="fixed"), steps=20)


def _ro(sigma: float):
    """``Gaussian(sigma)`` stated under replace-one: sensitivity 2 C, what ``Gaussian(sigma
    / 2)`` costs under add/remove (a bare Gaussian next to a replace-one part is read as
    add/remove and doubled, so the expected readings are stated explicitly)."""
    return subsample(Gaussian(sigma), 1.0, scheme="fixed")
POISSON_RUN = compose(subsample(Gaussian(1.0), 0.05), steps=20)


def _gaussian_epsilon(sigma: float, sensitivity: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism (Balle & Wang 2018, Theorem 8), by
    bisection on its closed-form delta(eps)."""
    def d(eps):
        a, b = sensitivity / (2 * sigma), eps * sigma / sensitivity
        return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if d(mid) <= delta else (mid, hi)
    return hi


@pytest.fixture
def led(tmp_path):
    ledger = Ledger(tmp_path / "l.db", create=True)
    yield ledger
    ledger.close()


def test_a_replace_one_release_is_refused_by_a_budget_bound_to_add_remove(led):
    led.create_budget("d", epsilon=100.0, delta=DELTA)
    led.spend("d", SSP, label="ssp")
    before = (led.history("d"), led.spent("d"))
    assert before[1].neighbouring is AR
    for attempt in (lambda: led.spend("d", FIXED_RUN),
                    lambda: led.reserve("d", FIXED_RUN),
                    lambda: led.check("d", FIXED_RUN)):
        with pytest.raises(LedgerConflictError,
                           match="add/remove neighbours .*fixed by the releases it holds.*"
                                 "neighbouring='replace_one'"):
            attempt()
    assert (led.history("d"), led.spent("d")) == before
    led.spend("d", POISSON_RUN)  # the same run under add/remove is taken
    assert led.spent("d").neighbouring is AR


def test_an_add_remove_budget_refuses_replace_one_from_the_start(led):
    led.create_budget("d", epsilon=100.0, delta=DELTA, neighbouring="add_remove")
    assert led.budget_info("d").neighbouring is AR
    with pytest.raises(LedgerConflictError, match="set when it was created"):
        led.spend("d", FIXED_RUN)
    with pytest.raises(LedgerConflictError, match="remove-only"):
        led.spend("d", subsample(Gaussian(1.0), 0.1, neighbouring="remove_only"))
    assert led.spent("d").entries == 0


def test_a_replace_one_budget_counts_add_remove_releases_at_twice_the_sensitivity(led):
    led.create_budget("d", epsilon=100.0, delta=DELTA, neighbouring=RO)
    led.spend("d", Gaussian(4.0))
    s = led.spent("d")
    assert s.neighbouring is RO
    # one Gaussian sum under replace-one: sensitivity 2 C (closed form)
    assert s.epsilon_spent == pytest.approx(_gaussian_epsilon(4.0, 2.0, DELTA), rel=1e-5)
    assert s.epsilon_spent >= _gaussian_epsilon(4.0, 2.0, DELTA) * (1 - 1e-9)
    led.spend("d", SSP)
    led.spend("d", FIXED_RUN)
    expected = compose([_ro(4.0), _ro(5.0), _ro(7.6), FIXED_RUN])
    assert led.spent("d").epsilon_spent == expected.epsilon(DELTA)
    assert led.mechanism("d") == expected
    # what is stored is what ran (the add/remove descriptions)
    assert [e.mechanism for e in led.history("d") if e.kind == "spend"] == [
        Gaussian(4.0), SSP, FIXED_RUN]


def test_the_mixed_history_is_counted_above_its_replace_one_lower_bound(led):
    """SSP's X^T y under replace-one: one row (x, y) -> (x, -y) moves it by twice its
    add/remove bound, so that Gaussian alone is at sigma / 2 for this pair; composed with
    the fixed-size run it is a lower bound on the history's replace-one epsilon."""
    led.create_budget("d", epsilon=100.0, delta=DELTA)
    led.spend("d", FIXED_RUN)  # the first release fixes replace-one
    led.spend("d", SSP)        # counted at its replace-one cost
    s = led.spent("d")
    lower = compose([_ro(7.6), FIXED_RUN]).epsilon_bounds(DELTA).lower
    assert s.neighbouring is RO and s.epsilon_spent >= lower
    # the mixed composition is read under replace-one wherever it is evaluated
    assert s.epsilon_spent == pytest.approx(compose([SSP, FIXED_RUN]).epsilon(DELTA), rel=1e-9)


def test_releases_without_a_replace_one_reading_are_refused_under_replace_one(tmp_path):
    led = Ledger(tmp_path / "r.db", create=True)
    led.create_budget("d", epsilon=100.0, delta=DELTA, accountant="rdp",
                      neighbouring="replace_one")
    rdp_only = RDPMechanism(TabulatedRDP.from_function(lambda a: a / 8.0, orders=[2, 8, 32]),
                            name="custom")
    with pytest.raises(LedgerConflictError, match="replace-one.*scale_sensitivity"):
        led.spend("d", rdp_only)
    with pytest.raises(LedgerConflictError, match="one-sided"):
        led.spend("d", subsample(Gaussian(1.0), 0.1, neighbouring="add_only"))
    led.spend("d", subsample(PureDP(1.0), 1.0, scheme="fixed"))  # stated under replace-one
    assert 0.99 < led.spent("d").epsilon_spent <= 1.0  # not doubled
    assert led.spent("d").entries == 1


def test_the_relation_is_validated_at_the_boundary(led):
    for bad, match in (("remove_only", "one-sided"), ("nearby", "one of"),
                       (3, "one of")):
        with pytest.raises((ParameterValueError, TypeError), match="neighbouring") as info:
            led.create_budget("d", epsilon=1.0, delta=DELTA, neighbouring=bad)
        assert match in str(info.value)
    assert led.budgets() == []


def _legacy_budget(led, dataset, *releases):
    """A budget as stored without a relation, holding ``releases`` appended unchecked (a
    history written before one budget took one relation)."""
    payload = json.dumps({"epsilon": 50.0, "delta": DELTA, "accountant": "pld",
                          "adaptive": False, "adaptive_order": None}, sort_keys=True)
    with led._write() as cur:
        led._append(cur, "budget", dataset, "record", payload=payload, who="t")
        for m in releases:
            led._append(cur, "spend", dataset, "record", mechanism=dumps(m), who="t")


def test_a_budget_without_a_recorded_relation_is_read_conservatively(led):
    _legacy_budget(led, "mixed", SSP, FIXED_RUN)
    _legacy_budget(led, "plain", SSP)
    assert led.verify()
    assert led.budget_info("mixed").neighbouring is None
    mixed = led.spent("mixed")
    assert mixed.neighbouring is RO
    assert mixed.epsilon_spent == compose([_ro(5.0), _ro(7.6), FIXED_RUN]).epsilon(DELTA)
    led.spend("mixed", Gaussian(10.0))  # add/remove: taken at its replace-one cost
    assert led.spent("mixed").entries == 3
    plain = led.spent("plain")
    assert plain.neighbouring is AR and plain.epsilon_spent == SSP.epsilon(DELTA)
    with pytest.raises(LedgerConflictError, match="add/remove"):
        led.spend("plain", FIXED_RUN)


_RELEASES = {
    "gaussian": Gaussian(6.0),
    "pure": PureDP(0.05),
    "poisson": compose(subsample(Gaussian(2.0), 0.02), steps=5),
    "fixed": compose(subsample(Gaussian(2.0), 0.02, scheme="fixed"), steps=5),
}


@settings(max_examples=25, deadline=None)
@given(created=st.sampled_from([None, "add_remove", "replace_one"]),
       names=st.lists(st.sampled_from(sorted(_RELEASES)), max_size=6))
def test_every_admitted_history_holds_under_the_relation_reported(tmp_path_factory,
                                                                   created, names):
    """Whatever the order of releases: what is admitted is counted under one relation
    (each release as it is under that relation, or at its replace-one cost), and a
    release is refused only when it holds no guarantee under the budget's relation."""
    led = Ledger(tmp_path_factory.mktemp("h") / "h.db", create=True)
    led.create_budget("d", epsilon=1e6, delta=DELTA, neighbouring=created)
    admitted = []
    for name in names:
        m = _RELEASES[name]
        try:
            led.spend("d", m)
            admitted.append(name)
        except LedgerConflictError:
            relation = led.spent("d").neighbouring
            assert name == "fixed" and relation is AR
    s = led.spent("d")
    expected_relation = (RO if created == "replace_one" or (created is None and "fixed" in admitted)
                         else AR if created or admitted else None)
    assert s.neighbouring is expected_relation
    doubled = {"gaussian": _ro(6.0), "pure": subsample(PureDP(0.1), 1.0, scheme="fixed"),
               "poisson": compose(subsample(Gaussian(2.0), 0.02, neighbouring="replace_one"),
                                  steps=5),
               "fixed": _RELEASES["fixed"]}
    read = [doubled[n] if s.neighbouring is RO else _RELEASES[n] for n in admitted]
    assert s.epsilon_spent == compose(read).epsilon(DELTA)
    led.close()
