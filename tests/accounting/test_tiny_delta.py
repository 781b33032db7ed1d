"""Tiny delta and long compositions: where the PLD grid cannot certify
delta (its FFT error allowance exceeds the target), ``epsilon`` returns the smaller of
the other certified answers -- the pure epsilon and the RDP accountant -- and names the
one that answered, instead of raising."""

from __future__ import annotations

import math

import pytest
from closed_forms import exact_randomized_response_epsilon

import privlearn.accounting as acc


def test_laplace_composition_at_1e_14_is_its_pure_epsilon():
    m = acc.compose(acc.Laplace(2.0), 5)
    b = m.epsilon_bounds(1e-14)
    # the pure epsilon 5/2 is a certified answer for every delta (and here the best one)
    assert b.upper == pytest.approx(2.5, rel=1e-15) and b.upper >= 2.5
    assert b.accountant in ("pld", "rdp")


def test_thousand_randomized_responses_at_1e_12_exact():
    # a composition of randomized responses has a finite PLD, composed exactly in closed
    # form (privlearn.accounting.closed_form) at any delta
    m = acc.compose(acc.RandomizedResponse(0.75), 1000)
    b = m.epsilon_bounds(1e-12)
    exact = exact_randomized_response_epsilon(0.75, 1000, 1e-12, xtol=1e-12)
    assert b.upper >= exact * (1 - 1e-12)  # certified (brentq's xtol is 1e-12)
    assert b.upper == pytest.approx(exact, rel=1e-9)
    assert b.lower <= exact * (1 + 1e-12)
    assert b.accountant == "pld"


def test_thousand_randomized_responses_and_a_laplace_at_1e_12_tilted_pld():
    # no closed form (the Laplace part): the plain grid cannot certify 1e-12; the
    # exponentially tilted composition does, far below RDP, with a tight certified gap
    m = acc.compose([acc.RandomizedResponse(0.75), acc.Laplace(1.0)], [1000, 1])
    b = m.epsilon_bounds(1e-12)
    exact_rr = exact_randomized_response_epsilon(0.75, 1000, 1e-12, xtol=1e-12)
    assert math.isfinite(b.upper) and b.accountant == "pld"
    assert b.upper >= exact_rr  # adding a mechanism never lowers epsilon
    assert b.upper <= exact_rr + 1.0 + 1e-9  # nor raises it by more than its pure epsilon
    assert b.upper < m.epsilon(1e-12, accountant="rdp")
    assert b.lower is not None and b.upper <= 1.01 * b.lower


def test_fallback_raises_when_nothing_can_answer(monkeypatch):
    # a Gaussian has no pure epsilon; with RDP refused too, the grid's error is raised
    from privlearn.accounting import accountants, pld

    class _NoRDP:
        name = "rdp"

        def epsilon(self, mechanism, delta):
            raise acc.UnsupportedMechanismError("no")

        def delta(self, mechanism, epsilon):
            raise acc.UnsupportedMechanismError("no")

    monkeypatch.setitem(accountants._REGISTRY, "rdp", _NoRDP())
    err = acc.AccountingError("grid")
    m = acc.compose(acc.subsample(acc.Gaussian(1.0), 0.01), 10)
    with pytest.raises(acc.AccountingError, match="grid"):
        pld.PLDAccountant()._fallback_epsilon(m, 1e-12, math.inf, err)


def test_fallback_can_be_switched_off():
    from privlearn.accounting.pld import PLDAccountant

    m = acc.compose([acc.RandomizedResponse(0.75), acc.Laplace(1.0)], [1000, 1])
    a = PLDAccountant(fallback=False)
    a._tilted_epsilon = lambda *args, **kwargs: None  # the tilted grid cannot answer either
    with pytest.raises(acc.AccountingError, match="cannot certify"):
        a.epsilon(m, 1e-12)
