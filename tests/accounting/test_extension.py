"""Acceptance test of the mechanism registry: a new mechanism kind, defined here (outside
the package), gets epsilon from "pld", "rdp" and the autodp facade by registration alone.

The kind is the discrete Laplace mechanism: an integer query with sensitivity ``s`` plus
noise ``P(X = k) = (1-a)/(1+a) a^|k|``, ``a = exp(-1/t)`` (Inusah & Kozubowski 2006;
Canonne, Kamath & Steinke 2020, Section 2). Its privacy loss between ``s + X`` and ``X`` is
``(|k| - |k - s|) / t``; for ``s = 2`` it takes three values ``-2/t, 0, 2/t`` with
probabilities (under ``P = s + X`` and ``Q = X``)::

    P: a^2/(1+a), a(1-a)/(1+a), 1/(1+a)        Q: 1/(1+a), a(1-a)/(1+a), a^2/(1+a)

so the pure epsilon is ``s/t`` and every k-fold composition has an exact, enumerable
privacy loss distribution (trinomial), against which the accountants are checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from scipy import optimize, special

from privlearn.accounting import (
    Mechanism,
    UnsupportedMechanismError,
    compose,
    register_mechanism,
    subsample,
)
from privlearn.accounting.pairs import DiscretePair
from privlearn.accounting.registry import kind_of, pure_epsilon
from privlearn.compat.autodp import transformer_zoo
from privlearn.compat.autodp.autodp_core import Mechanism as FacadeMechanism


# ----------------------------------------------------------------------------------------
# the new kind: one frozen dataclass plus one registration
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiscreteLaplace(Mechanism):
    """Discrete Laplace noise of scale ``t`` on an integer query of sensitivity ``s``."""

    scale: float
    sensitivity: int = 2


def _atoms(m: DiscreteLaplace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(losses, P-masses, Q-masses) of one run (sensitivity 1 or 2 here)."""
    a = math.exp(-1.0 / m.scale)
    e = 1.0 / m.scale
    if m.sensitivity == 1:
        return np.array([-e, e]), np.array([a, 1.0]) / (1 + a), np.array([1.0, a]) / (1 + a)
    assert m.sensitivity == 2
    mid = a * (1 - a) / (1 + a)
    p = np.array([a * a / (1 + a), mid, 1.0 / (1 + a)])
    q = np.array([1.0 / (1 + a), mid, a * a / (1 + a)])
    return np.array([-2 * e, 0.0, 2 * e]), p, q


def _dl_rdp(m: DiscreteLaplace, alphas: np.ndarray) -> np.ndarray:
    """Exact Renyi divergence ``log(sum p^alpha q^(1-alpha)) / (alpha - 1)`` of the pair
    (symmetric under swapping P and Q), rounded up by a relative 1e-12."""
    _, p, q = _atoms(m)
    a = np.asarray(alphas, dtype=float)[:, None]
    val = special.logsumexp(a * np.log(p) + (1 - a) * np.log(q), axis=1) / (a[:, 0] - 1)
    return np.maximum(val, 0.0) * (1 + 1e-12) + 1e-300


register_mechanism(
    DiscreteLaplace,
    pure_epsilon=lambda m: m.sensitivity / m.scale,
    pld_pair=lambda m: DiscretePair(_atoms(m)[1], _atoms(m)[2]),
    rdp=_dl_rdp,
    scale_sensitivity=lambda m, f: DiscreteLaplace(m.scale, int(round(m.sensitivity * f))),
)


# ----------------------------------------------------------------------------------------
# exact references, computed independently of privlearn
# ----------------------------------------------------------------------------------------
def _compose_exact(losses, p, k):
    """Exact k-fold composition of a 3-atom loss distribution (trinomial enumeration)."""
    out_l, out_p = [], []
    logp = np.log(p)
    for i in range(k + 1):
        for j in range(k + 1 - i):
            r = k - i - j
            lc = special.gammaln(k + 1) - special.gammaln(i + 1) - special.gammaln(j + 1)
            lc -= special.gammaln(r + 1)
            out_p.append(math.exp(lc + i * logp[0] + j * logp[1] + r * logp[2]))
            out_l.append(i * losses[0] + j * losses[1] + r * losses[2])
    return np.array(out_l), np.array(out_p)


def _delta_exact(loss, prob, eps):
    return float(np.sum(prob * np.clip(-np.expm1(eps - loss), 0.0, None)))


def _eps_exact(loss, prob, delta):
    f = lambda e: _delta_exact(loss, prob, e) - delta  # noqa: E731
    top = float(loss.max())
    if f(0.0) <= 0:
        return 0.0
    return optimize.brentq(f, 0.0, top, xtol=1e-14, rtol=1e-14)


def _subsampled_pairs(m, q):
    """Exact remove and add pairs of Poisson subsampling (Zhu, Dong & Wang 2022, Thm 9)."""
    _, p, qq = _atoms(m)
    mix = (1 - q) * qq + q * p
    return (mix, qq), (qq, mix)


def _compose_pair_exact(P, Q, k):
    loss = np.log(P) - np.log(Q)
    return _compose_exact(loss, P, k)


# ----------------------------------------------------------------------------------------
# the acceptance checks
# ----------------------------------------------------------------------------------------
def test_registered_kind_is_known():
    kind = kind_of(DiscreteLaplace(2.0))
    assert kind is not None and kind.cls is DiscreteLaplace
    assert {"pure_epsilon", "pld_pair", "rdp", "scale_sensitivity"} <= set(kind.functions)


@pytest.mark.parametrize("t", [0.5, 2.0, 7.0])
def test_pure_epsilon_is_sensitivity_over_scale(t):
    m = DiscreteLaplace(t)
    exact = 2.0 / t
    for acc in ("pld", "rdp"):
        e = m.epsilon(0.0, accountant=acc)
        assert exact <= e <= exact * (1 + 1e-15), acc
    assert compose(m, 5).epsilon(0.0) == pytest.approx(5 * exact, rel=1e-15)
    assert compose(m, 5).epsilon(0.0) >= 5 * exact
    assert FacadeMechanism.from_privlearn(m).get_pureDP() == pytest.approx(exact, rel=1e-15)


@pytest.mark.parametrize("t,k,delta", [(2.0, 10, 1e-5), (5.0, 40, 1e-6), (1.0, 3, 1e-3)])
def test_pld_brackets_the_exact_composition(t, k, delta):
    m = DiscreteLaplace(t)
    losses, p, _ = _atoms(m)
    loss, prob = _compose_exact(losses, p, k)
    exact = _eps_exact(loss, prob, delta)
    b = compose(m, k).epsilon_bounds(delta, accountant="pld")
    assert b.lower <= exact * (1 + 1e-9) + 1e-12
    assert exact <= b.upper * (1 + 1e-9)
    assert b.upper <= exact * 1.01 + 1e-9  # tight, not only valid
    # delta(epsilon) likewise
    eps = 0.5 * exact
    d_exact = _delta_exact(loss, prob, eps)
    db = compose(m, k).delta_bounds(eps, accountant="pld")
    assert db.lower <= d_exact * (1 + 1e-9) and d_exact <= db.upper * (1 + 1e-9)


@pytest.mark.parametrize("t,k,delta", [(2.0, 10, 1e-5), (5.0, 40, 1e-6)])
def test_rdp_curve_and_epsilon(t, k, delta):
    m = compose(DiscreteLaplace(t), k)
    losses, p, q = _atoms(DiscreteLaplace(t))
    for alpha in (1.5, 2.0, 8.0, 32.0):
        ref = k * math.log(float(np.sum(p**alpha * q ** (1 - alpha)))) / (alpha - 1)
        assert m.rdp(alpha) == pytest.approx(ref, rel=1e-9)
        assert m.rdp(alpha) >= ref
    loss, prob = _compose_exact(losses, p, k)
    exact = _eps_exact(loss, prob, delta)
    e_rdp = m.epsilon(delta, accountant="rdp")
    assert exact <= e_rdp <= 2.0 / t * k  # valid, and never above the pure epsilon
    assert e_rdp >= m.epsilon(delta, accountant="pld") * (1 - 1e-9)  # PLD is tighter


@pytest.mark.parametrize("q,k,delta", [(0.1, 30, 1e-6), (0.5, 8, 1e-4)])
def test_subsampled_new_kind_against_exact_pairs(q, k, delta):
    base = DiscreteLaplace(1.5)
    m = compose(subsample(base, q), k)
    (P1, Q1), (P2, Q2) = _subsampled_pairs(base, q)
    exact = max(
        _eps_exact(*_compose_pair_exact(P1, Q1, k), delta),
        _eps_exact(*_compose_pair_exact(P2, Q2, k), delta),
    )
    b = m.epsilon_bounds(delta, accountant="pld")
    assert b.lower <= exact * (1 + 1e-9) + 1e-12 and exact <= b.upper * (1 + 1e-9)
    assert b.upper <= exact * 1.01 + 1e-9
    e_rdp = m.epsilon(delta, accountant="rdp")
    assert exact <= e_rdp
    # the pure epsilon of the subsampled step: log(1 + q (e^eps - 1)) (Balle et al. 2018)
    e0 = math.log1p(q * math.expm1(2.0 / 1.5))
    assert pure_epsilon(m) == pytest.approx(k * e0, rel=1e-14)
    assert pure_epsilon(m) >= k * e0 * (1 - 1e-15)


def test_fixed_size_add_remove_uses_registered_scaling():
    # fixed-size sampling under add/remove takes the base at twice its sensitivity
    m = subsample(DiscreteLaplace(4.0, sensitivity=1), 0.2, scheme="fixed",
                  neighbouring="add_remove")
    e0 = math.log1p(0.2 * math.expm1(2.0 / 4.0))  # the base at sensitivity 2
    assert m.epsilon(0.0) == pytest.approx(e0, rel=1e-14)


def test_facade_uses_the_registered_kind():
    m = DiscreteLaplace(3.0)
    fm = FacadeMechanism.from_privlearn(m, name="dlap")
    comp = transformer_zoo.Composition()([fm], [12])
    expected = compose(m, 12).epsilon(1e-6, accountant="pld")
    assert comp.get_approxDP(1e-6) == pytest.approx(expected, rel=1e-12)
    assert comp.get_approxDP(1e-6) <= comp.get_pureDP()
    sub = transformer_zoo.AmplificationBySampling()(fm, 0.05)
    comp2 = transformer_zoo.Composition()([sub], [100])
    ref = compose(subsample(m, 0.05), 100).epsilon(1e-6)
    assert comp2.get_approxDP(1e-6) == pytest.approx(ref, rel=1e-12)
    assert comp2.RenyiDP(4.0) == pytest.approx(compose(subsample(m, 0.05), 100).rdp(4.0))


# an RDP-only kind: PLD refuses it by name, the facade falls back to RDP
@dataclass(frozen=True)
class ZCDPMechanism(Mechanism):
    rho: float


register_mechanism(
    ZCDPMechanism,
    pure_epsilon=lambda m: math.inf,
    rdp=lambda m, alphas: m.rho * np.asarray(alphas, dtype=float),
)


def test_rdp_only_kind():
    m = compose(ZCDPMechanism(0.1), 10)
    with pytest.raises(UnsupportedMechanismError, match="pld_pair.*register_mechanism"):
        m.epsilon(1e-5, accountant="pld")
    e = m.epsilon(1e-5, accountant="rdp")
    # zCDP conversion (Bun & Steinke 2016, Prop. 1.3) is looser than the RDP one we use
    rho = 1.0
    assert e <= rho + 2 * math.sqrt(rho * math.log(1e5))
    assert FacadeMechanism.from_privlearn(m).get_approxDP(1e-5) == pytest.approx(e, rel=1e-12)


# ----------------------------------------------------------------------------------------
# a kind with a finite dominating pair: exact composition by registration alone
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Coin(Mechanism):
    """A coin flip with bias e^eps / (1 + e^eps): exactly binary randomized response."""

    eps: float


def _register_coin() -> None:
    from privlearn.accounting import closed_form
    from privlearn.accounting._pld_pairs import pure_dp_pair
    from privlearn.accounting._rdp_math import _rr_rdp

    register_mechanism(
        Coin,
        pure_epsilon=lambda m: m.eps,
        pld_pair=lambda m: pure_dp_pair(m.eps),
        rdp=lambda m, alphas: _rr_rdp(m.eps, alphas),
        pld_atoms=lambda m: closed_form.pure_dp_atoms(m.eps),
    )


@pytest.mark.parametrize("q", [1.0, 0.1])
def test_registered_atoms_give_the_exact_closed_form(q):
    """With ``pld_atoms`` registered, the PLD accountant composes the new kind exactly
    (closed form, Kairouz-Oh-Viswanath / Murtagh-Vadhan), with no change to the
    accountants: the same bounds as PureDP, whose pair it is."""
    from privlearn.accounting import PureDP, closed_form

    _register_coin()
    mine = compose(subsample(Coin(0.7), q), steps=25)
    ref = compose(subsample(PureDP(0.7), q), steps=25)
    assert closed_form.discrete_pld(mine) is not None
    assert mine.epsilon_bounds(1e-6) == ref.epsilon_bounds(1e-6)
    b = mine.epsilon_bounds(1e-6)
    assert b.lower <= b.upper <= b.lower * (1 + 1e-9)  # exact up to rounding
