"""Repeat a mechanism a random number of times and release only the best run.

:class:`RepeatAndSelect` describes private selection by random stopping (Papernot &
Steinke 2022; Google dp_accounting's ``RepeatAndSelectDpEvent(event, mean, shape)``): the
base mechanism (one run: e.g. train with random hyperparameters, then score privately) is
run ``K`` times, ``K`` drawn independently of the data, and only the run with the best
score is released. Its Renyi-DP curve follows from the base's:

* ``K`` truncated negative binomial ``D_{eta, gamma}`` (``shape = eta`` in ``[0, inf)``:
  0 logarithmic, 1 geometric; Papernot & Steinke 2022, Definition 1) with mean
  ``E[K] = mean``: for every ``lambda > 1`` and ``lambda_hat > 1``,
  ``eps'(lambda) = eps(lambda) + (1 + eta) (1 - 1/lambda_hat) eps(lambda_hat)
  + (1 + eta) log(1/gamma) / lambda_hat + log(E[K]) / (lambda - 1)``
  (Papernot & Steinke 2022, Theorem 2), minimised over ``lambda_hat`` on a fixed grid;
* ``K ~ Poisson(mean)`` (``shape = inf``): ``eps'(lambda) = eps(lambda) + mean * delta_hat
  + log(mean) / (lambda - 1)`` where the base is ``(eps_hat, delta_hat)``-DP at
  ``eps_hat = log(1 + 1/(lambda - 1))`` (Papernot & Steinke 2022, Theorem 6;
  ``delta_hat`` is the base's certified delta from its RDP curve, Canonne, Kamath &
  Steinke 2020, Proposition 12);
* ``mean = 1`` with a truncated negative binomial: ``K = 1`` (a distribution on
  ``{1, 2, ...}`` with mean 1), one run of the base, whose curve it is (a Poisson ``K``
  of mean 1 is not: Theorem 6 applies).

Renyi divergence is non-decreasing in the order (van Erven & Harremoes 2014, Theorem 3),
so a bound at order ``lambda' >= lambda`` also holds at ``lambda``; the curve is the
smallest such bound over the requested order and a fixed grid above it. The
``gamma`` of a mean is found by bisection on the side where ``E[K]`` is at least the mean
(``gamma`` no larger than the exact one: the ``log(1/gamma)`` term is never
under-stated).

The kind is registered like any other (:func:`privlearn.accounting.register_mechanism`)
with this curve as its ``rdp`` representation, so the ``"rdp"`` accountant composes and
subsamples it; it has no dominating pair, and the ``"pld"`` accountant refuses it (as
dp_accounting's PLD accountant refuses ``RepeatAndSelectDpEvent``). Its pure epsilon is
taken as ``inf`` (none is claimed).

The base's guarantee must hold under add/remove neighbouring (every part of it stated
under add/remove: :func:`privlearn.accounting.registry.stated_relations`): the selection
is itself read as an add/remove guarantee when composed with other parts, so a base
stated under replace-one or a one-sided relation is refused.

References
----------
.. [PS22] Papernot & Steinke (2022), Hyperparameter Tuning with Renyi Differential
       Privacy, ICLR, Definition 1, Theorems 2 and 6.
.. [LT19] Liu & Talwar (2019), Private Selection from Private Candidates, STOC.
.. [vEH14] van Erven & Harremoes (2014), Renyi Divergence and Kullback-Leibler Divergence,
       IEEE Trans. Inf. Theory, Theorem 3.
.. [CKS20] Canonne, Kamath & Steinke (2020), The Discrete Gaussian for Differential
       Privacy, NeurIPS, Proposition 12.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn._validation import check_nonnegative, check_real
from privlearn.accounting import _builtin_kinds  # noqa: F401  (built-in kinds first)
from privlearn.accounting.mechanisms import Mechanism, Neighbouring
from privlearn.accounting.registry import read_relation, register_mechanism, stated_relations
from privlearn.errors import ParameterTypeError, ParameterValueError, UnsupportedMechanismError

__all__ = ["RepeatAndSelect"]

_ULP = sys.float_info.epsilon

#: Orders of the ``lambda_hat`` minimisation, of ``delta_hat`` and of the monotone
#: envelope (every grid point gives a valid bound; the grid only decides how tight, and
#: adding points can only tighten it). The geometric grids from ``1 + 1e-3`` to 2 and
#: from 2 to ``1e4`` add orders between the others (the optimum ``lambda_hat`` of a
#: costly base can lie in ``(1, 2)`` or beyond 256).
_GRID = np.unique(
    np.concatenate(
        [
            1.0 + np.geomspace(1e-3, 1.0, 40)[:-1],
            1.0 + np.geomspace(1e-3, 1.0, 30),
            np.arange(2.0, 32.0, 0.1),
            np.arange(32.0, 257.0),
            np.geomspace(2.0, 1e4, 120),
            np.geomspace(256.0, 1e5, 60)[1:],
        ]
    )
)


@dataclass(frozen=True, slots=True)
class RepeatAndSelect(Mechanism):
    """Run ``base`` a random number ``K`` of times and release only the best run.

    Parameters
    ----------
    base : Mechanism
        One run (possibly a composition, e.g. a subsampled training run and a private
        score), stated under add/remove neighbouring.
    mean : float >= 1
        ``E[K]``, the mean number of runs.
    shape : float in [0, inf]
        The distribution of ``K``: ``inf`` Poisson; otherwise the truncated negative
        binomial of that shape (``0`` logarithmic, ``1`` geometric).

    Only the ``"rdp"`` accountant evaluates it (see the module docstring for the bound).

    Examples
    --------
    >>> from privlearn.accounting import Gaussian, RepeatAndSelect, compose, subsample
    >>> run = compose(subsample(Gaussian(1.0), rate=0.01), steps=1000)
    >>> eps = RepeatAndSelect(run, mean=10, shape=1).epsilon(1e-6, accountant="rdp")

    References
    ----------
    Papernot & Steinke (2022), Hyperparameter Tuning with Renyi Differential Privacy,
    ICLR, Theorems 2 and 6.
    """

    base: Mechanism
    mean: float
    shape: float

    def __post_init__(self) -> None:
        if not isinstance(self.base, Mechanism):
            raise ParameterTypeError(
                f"base must be a privlearn Mechanism, got {self.base!r} "
                f"({type(self.base).__name__}); pass e.g. compose(subsample(Gaussian(1.0), "
                "rate=0.01), steps=1000)"
            )
        mean = check_real("mean", self.mean, hint="pass the mean number of runs, e.g. 10")
        if not (math.isfinite(mean) and mean >= 1.0):
            raise ParameterValueError(
                f"mean must be in [1, inf) and finite, got {self.mean!r}; pass the mean "
                "number of runs E[K] (K >= 1), e.g. 10"
            )
        shape = check_nonnegative(
            "shape",
            self.shape,
            allow_inf=True,
            hint="pass 1 (geometric), 0 (logarithmic) or inf (Poisson)",
        )
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "shape", shape)
        relations = stated_relations(read_relation(self.base))
        if relations and relations != frozenset({Neighbouring.ADD_REMOVE}):  # () is 0-DP
            raise UnsupportedMechanismError(
                "RepeatAndSelect needs a base stated under add/remove neighbouring (the "
                "selection is read as an add/remove guarantee), got a base stated under "
                f"{', '.join(sorted(r.value for r in relations))}; describe the runs under "
                "add/remove (e.g. Poisson sampling)"
            )


def _expected_runs(eta: float, gamma: float) -> float:
    """``E[K]`` of ``D_{eta, gamma}`` (Papernot & Steinke 2022, Section 2):
    ``eta (1 - gamma) / (gamma (1 - gamma^eta))``, and ``(1 - gamma) / (gamma
    log(1/gamma))`` at ``eta = 0``."""
    x = eta * math.log(gamma)
    if eta == 0.0 or -x < sys.float_info.min:
        # eta tiny (1e-320): x is subnormal or 0, so 1 - gamma^eta = -expm1(x) lost its
        # digits (or is 0: a division by zero); the eta = 0 form is then exact to float
        # precision (1 - gamma^eta = -x (1 + x / 2 + ...))
        return (1.0 - gamma) / (gamma * -math.log(gamma))
    return eta * (1.0 - gamma) / (gamma * -math.expm1(x))


@functools.lru_cache(maxsize=256)
def _gamma_below(eta: float, mean: float) -> float:
    """A ``gamma`` no larger than the one with ``E[K] = mean`` (``E[K]`` decreases in
    ``gamma``): bisection in ``log gamma`` keeping ``E[K](lo) >= mean (1 + 1e-9)``, a
    margin above the rounding of the formula."""
    target = mean * (1.0 + 1e-9)
    lo, hi = -745.0, -1e-15  # log gamma
    if _expected_runs(eta, math.exp(lo)) < target:  # pragma: no cover - mean ~ 1e300
        raise UnsupportedMechanismError(
            f"mean={mean!r} is beyond the range of the truncated negative binomial here"
        )
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _expected_runs(eta, math.exp(mid)) >= target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * abs(lo):
            break
    return math.exp(lo)


def _base_rdp(base: Mechanism, orders: np.ndarray) -> np.ndarray:
    from privlearn.accounting.rdp import rdp_epsilon

    out = np.asarray(rdp_epsilon(base, orders), dtype=float)
    return np.where(np.isnan(out), np.inf, out)


@functools.lru_cache(maxsize=64)
def _grid_terms(m: RepeatAndSelect) -> tuple[np.ndarray, float]:
    """The base curve on the grid and the constant of Theorem 2 (0 for Poisson ``K``,
    whose ``delta_hat`` term depends on the order)."""
    base = _base_rdp(m.base, _GRID)
    if math.isinf(m.shape):
        return base, 0.0
    eta, gamma = m.shape, _gamma_below(m.shape, m.mean)
    log_inv_gamma = -math.log(gamma)
    with np.errstate(invalid="ignore", over="ignore"):
        extra = (1.0 + eta) * ((1.0 - 1.0 / _GRID) * base + log_inv_gamma / _GRID)
    extra = np.where(np.isfinite(extra), extra, np.inf)
    c = float(np.min(extra))
    if math.isfinite(c):
        c = (c + 8.0 * _ULP * (abs(c) + (1.0 + eta) * log_inv_gamma)) * (1.0 + 4.0 * _ULP)
    return base, c


def _delta_hat(m: RepeatAndSelect, grid_base: np.ndarray, eps_hat: np.ndarray) -> np.ndarray:
    """The base's certified delta at each ``eps_hat`` from its RDP curve on the grid
    (Canonne, Kamath & Steinke 2020, Proposition 12), minimised over the grid; 0 where
    the base's pure epsilon is at most ``eps_hat``."""
    from privlearn.accounting.conversion import delta_from_rdp
    from privlearn.accounting.registry import pure_epsilon

    pure = pure_epsilon(m.base)
    out = np.empty_like(eps_hat)
    for i, e in enumerate(eps_hat.tolist()):
        out[i] = 0.0 if pure <= e else float(np.min(delta_from_rdp(_GRID, grid_base, e)))
    return out


def _raw(
    m: RepeatAndSelect, orders: np.ndarray, base: np.ndarray, c: float, grid_base: np.ndarray
) -> np.ndarray:
    """The bound of Theorem 2 (or 6) at each order, before the monotone envelope."""
    log_mean = math.log(m.mean)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = log_mean / (orders - 1.0)
        if math.isinf(m.shape):
            eps_hat = np.log1p(1.0 / (orders - 1.0))
            extra = m.mean * _delta_hat(m, grid_base, eps_hat)
        else:
            extra = np.full_like(orders, c)
        raw = base + extra + t
        raw = (raw + 8.0 * _ULP * (np.abs(base) + np.abs(extra) + np.abs(t))) * (1.0 + 4.0 * _ULP)
    return np.where(np.isnan(raw), np.inf, raw)


@functools.lru_cache(maxsize=64)
def _grid_envelope(m: RepeatAndSelect) -> np.ndarray:
    """The monotone envelope on the grid: at each grid order, the least bound at it or
    at any larger grid order."""
    grid_base, c = _grid_terms(m)
    raw = _raw(m, _GRID, grid_base, c, grid_base)
    return np.minimum.accumulate(raw[::-1])[::-1]


def repeat_and_select_rdp(m: RepeatAndSelect, alphas: np.ndarray) -> np.ndarray:
    """RDP upper bound of :class:`RepeatAndSelect` at the orders ``alphas > 1`` (module
    docstring: Papernot & Steinke 2022, Theorems 2 and 6, with monotonicity in the
    order, van Erven & Harremoes 2014, Theorem 3)."""
    alphas = np.asarray(alphas, dtype=float)
    base = _base_rdp(m.base, alphas)
    if m.mean == 1.0 and not math.isinf(m.shape):  # K >= 1 with mean 1: K = 1, one run
        return base  # (not so for Poisson K, which can be 0 or 2 at mean 1)
    grid_base, c = _grid_terms(m)
    own = _raw(m, alphas, base, c, grid_base)
    env = _grid_envelope(m)
    idx = np.searchsorted(_GRID, alphas, side="left")  # first grid order >= alpha
    above = np.where(idx < len(_GRID), env[np.minimum(idx, len(_GRID) - 1)], np.inf)
    return np.minimum(own, above)


def _to_dict(m: RepeatAndSelect) -> dict[str, Any]:
    from privlearn.accounting.serialization import mechanism_to_dict

    return {
        "base": mechanism_to_dict(m.base),
        "mean": float(m.mean),
        "shape": "inf" if math.isinf(m.shape) else float(m.shape),
    }


def _from_dict(d: dict[str, Any]) -> RepeatAndSelect:
    from privlearn.accounting.serialization import mechanism_from_dict

    if not isinstance(d, dict) or set(d) != {"base", "mean", "shape"}:
        raise ParameterValueError(
            f"a RepeatAndSelect is stored as {{'base', 'mean', 'shape'}}, got {d!r}"
        )
    shape = d["shape"]
    if shape == "inf":
        shape = math.inf
    return RepeatAndSelect(mechanism_from_dict(d["base"]), d["mean"], shape)


register_mechanism(
    RepeatAndSelect,
    pure_epsilon=lambda m: math.inf,  # none claimed
    rdp=repeat_and_select_rdp,
    to_dict=_to_dict,
    from_dict=_from_dict,
)
