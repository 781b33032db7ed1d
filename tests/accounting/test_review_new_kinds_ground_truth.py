"""Ground truth for the subsampled discrete Laplace and for RepeatAndSelect, computed
independently of privlearn's code.

* Poisson-subsampled discrete Laplace under add/remove: the pairs ``(q P + (1 - q) Q, Q)``
  (remove) and ``(Q, q P + (1 - q) Q)`` (add) with ``P = D + Z``, ``Q = Z`` enumerated on
  the integers; the exact epsilon of a few steps is the larger of the two directions'
  explicit convolutions, and the exact Renyi divergence the larger of the two sums.
* RepeatAndSelect of a Gaussian: Papernot & Steinke (2022), Theorem 2 with the exact
  ``gamma`` of the mean (root-finding) and the ``lambda_hat`` minimum in closed form
  (``(lambda_hat - 1) rho + log(1/gamma) / lambda_hat``), and Theorem 6 with the
  Gaussian's exact ``delta_hat``; the smallest bound at an order at least the queried
  one (monotonicity) is the least a correct implementation may report.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from privlearn.accounting import DiscreteLaplace, Gaussian, RepeatAndSelect, compose, subsample
from privlearn.accounting.rdp import rdp_epsilon


def _atoms(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keep = (p > 0) | (q > 0)
    loss = np.round(np.log(p[keep]) - np.log(q[keep]), 10)
    values, inv = np.unique(loss, return_inverse=True)
    return values, np.bincount(inv, p[keep]), np.bincount(inv, q[keep])


def _compose(atoms, steps):
    loss, p, q = atoms
    cur = {0.0: (1.0, 1.0)}
    for _ in range(steps):
        nxt: dict[float, tuple[float, float]] = {}
        for l0, (p0, q0) in cur.items():
            for l1, p1, q1 in zip(loss, p, q, strict=True):
                k = round(l0 + l1, 9)
                a, b = nxt.get(k, (0.0, 0.0))
                nxt[k] = (a + p0 * p1, b + q0 * q1)
        cur = nxt
    keys = np.array(sorted(cur))
    return keys, np.array([cur[k][0] for k in keys]), np.array([cur[k][1] for k in keys])


def _exact_epsilon(atoms, delta: float) -> float:
    loss, p, q = atoms

    def excess(eps: float) -> float:
        return float(np.sum(np.maximum(p - math.exp(eps) * q, 0.0))) - delta

    return 0.0 if excess(0.0) <= 0 else optimize.brentq(excess, 0.0, 60.0, xtol=1e-13)


def _subsampled_pairs(a: float, d: int, rate: float):
    ks = np.arange(-int(80 / a) - d, int(80 / a) + d + 1)
    z = math.tanh(a / 2.0) * np.exp(-a * np.abs(ks))
    zd = math.tanh(a / 2.0) * np.exp(-a * np.abs(ks - d))
    mix = rate * zd + (1.0 - rate) * z
    return _atoms(mix, z), _atoms(z, mix)


@pytest.mark.parametrize("a,d,rate", [(0.3, 2, 0.01), (1.0, 1, 0.3), (3.0, 3, 0.01), (1.0, 3, 0.3)])
def test_subsampled_discrete_laplace_is_not_below_enumeration(a, d, rate) -> None:
    remove, add = _subsampled_pairs(a, d, rate)
    for steps in (1, 3):
        m = compose(subsample(DiscreteLaplace(a, d), rate), steps=steps)
        for delta in (1e-3, 1e-7):
            exact = max(
                _exact_epsilon(_compose(remove, steps), delta),
                _exact_epsilon(_compose(add, steps), delta),
            )
            for accountant in ("pld", "rdp"):
                eps = m.epsilon_bounds(delta, accountant).upper
                assert eps >= exact - 1e-9, (accountant, steps, delta, eps, exact)
                assert eps <= 2.0 * exact + 1e-6  # and not vacuous
    orders = np.array([1.5, 2.0, 3.0, 8.0, 32.0])
    exact_rdp = np.array(
        [
            max(math.log(np.sum(p**o * q ** (1.0 - o))) / (o - 1.0) for _, p, q in (remove, add))
            for o in orders
        ]
    )
    ours = rdp_epsilon(subsample(DiscreteLaplace(a, d), rate), orders)
    assert np.all(ours >= exact_rdp * (1.0 - 1e-12))


def _tnb_mean(log_gamma: float, eta: float) -> float:
    g = math.exp(log_gamma)
    if eta == 0.0:
        return -math.expm1(log_gamma) / (g * -log_gamma)
    return eta * -math.expm1(log_gamma) / (g * -math.expm1(eta * log_gamma))


def _theorem_bound(sigma: float, mean: float, eta: float, orders: np.ndarray) -> np.ndarray:
    rho = 1.0 / (2.0 * sigma**2)
    if math.isinf(eta):  # Theorem 6, with the Gaussian's exact delta at eps_hat
        eps_hat = np.log1p(1.0 / (orders - 1.0))
        delta_hat = stats.norm.cdf(-eps_hat * sigma + 1 / (2 * sigma)) - np.exp(
            eps_hat
        ) * stats.norm.cdf(-eps_hat * sigma - 1 / (2 * sigma))
        return orders * rho + mean * delta_hat + math.log(mean) / (orders - 1.0)
    log_inv_gamma = -optimize.brentq(
        lambda x: _tnb_mean(x, eta) - mean, -700.0, -1e-12, xtol=1e-300, rtol=1e-15
    )
    lam_hat = max(1.0, math.sqrt(log_inv_gamma / rho))  # minimises (l - 1) rho + L / l
    c = (1.0 + eta) * ((lam_hat - 1.0) * rho + log_inv_gamma / lam_hat)
    return orders * rho + c + math.log(mean) / (orders - 1.0)


@pytest.mark.parametrize("sigma", [0.7, 3.0, 10.0])
@pytest.mark.parametrize("mean", [1.5, 10.0, 1000.0])
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 3.0, math.inf])
def test_repeat_and_select_is_not_below_papernot_steinke(sigma, mean, eta) -> None:
    dense = np.concatenate([1.0 + np.geomspace(1e-4, 1.0, 400), np.linspace(2.0, 300.0, 30000)])
    bound = _theorem_bound(sigma, mean, eta, dense)
    least = np.minimum.accumulate(bound[::-1])[::-1]  # monotone in the order
    queried = dense[::97]
    ours = rdp_epsilon(RepeatAndSelect(Gaussian(sigma), mean, eta), queried)
    # the dense grid's minimum is within 1e-4 of the continuous one (measured); below
    # that, privlearn would be claiming more than the theorem gives
    assert np.all(ours >= least[::97] * (1.0 - 1e-4)), np.min(ours / least[::97])
    assert np.all(ours <= least[::97] * 2.0 + 1e-9)  # and not vacuous
