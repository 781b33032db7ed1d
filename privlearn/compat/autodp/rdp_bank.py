"""autodp-compatible ``rdp_bank``: Renyi-DP curves ``eps(alpha)`` of basic mechanisms.

Each function keeps autodp's signature ``f(params, alpha)`` and is backed by privlearn's
RDP engine (:meth:`privlearn.accounting.Mechanism.rdp`) for orders ``alpha > 1``, with the
closed-form limits at ``alpha = 1`` (KL divergence) and ``alpha = inf`` (pure epsilon).
``alpha`` may be a scalar or an array. Orders below 1 are rejected (ValueError): Renyi DP
is defined for ``alpha >= 1`` in every accountant here.

References
----------
Mironov (2017), Renyi Differential Privacy, CSF, Table II (Gaussian, Laplace, randomized
response); Bun & Steinke (2016), Concentrated Differential Privacy, TCC, Lemma 1.4 /
Proposition 3.3 (pure DP -> RDP; zCDP Definition 1.1); Bun, Dwork, Rothblum & Steinke
(2018), Composable and Versatile Privacy via Truncated CDP, STOC, Definition 1 (tCDP).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from privlearn.accounting import Gaussian, Laplace, PureDP, RandomizedResponse, subsample
from privlearn.accounting import Mechanism as PrivlearnMechanism
from privlearn.compat.autodp._missing import missing
from privlearn.compat.autodp.autodp_core import as_float

__all__ = [
    "RDP_gaussian",
    "RDP_laplace",
    "RDP_randresponse",
    "RDP_pureDP",
    "RDP_zCDP",
    "RDP_truncatedCDP",
    "RDP_subsampled_pureDP",
]


def _orders(alpha: Any) -> tuple[np.ndarray, bool]:
    a = np.asarray(alpha, dtype=float)
    if np.any(np.isnan(a)) or np.any(a < 1):
        raise ValueError(f"alpha must be in [1, inf], got {alpha!r}")
    return a.reshape(-1), a.ndim == 0


def _eval(
    mech: PrivlearnMechanism, alpha: Any, kl: float, pure: float
) -> float | np.ndarray:
    a, scalar = _orders(alpha)
    out = np.empty_like(a)
    mid = (a > 1) & np.isfinite(a)
    if np.any(mid):
        out[mid] = np.asarray(mech.rdp(a[mid].tolist()), dtype=float)
    out[a == 1] = kl
    out[np.isinf(a)] = pure
    return float(out[0]) if scalar else out


def RDP_gaussian(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802 (autodp's name)
    """``alpha / (2 sigma^2)`` for the Gaussian mechanism with ``params['sigma']``."""
    s = as_float("sigma", params["sigma"])
    return _eval(Gaussian(s), alpha, 0.5 / s**2, math.inf)


def RDP_laplace(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """Laplace mechanism with ``params['b']`` (scale / L1 sensitivity); KL at 1 is
    ``1/b + e^{-1/b} - 1``."""
    b = as_float("b", params["b"])
    return _eval(Laplace(b), alpha, 1.0 / b + math.expm1(-1.0 / b), 1.0 / b)


def RDP_randresponse(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """Binary randomized response reporting the truth with ``params['p']`` (``p < 1/2``
    is the same mechanism as ``1 - p``)."""
    p = as_float("p", params["p"])
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    p = max(p, 1.0 - p)
    if p == 1.0:
        a, scalar = _orders(alpha)
        return math.inf if scalar else np.full(a.shape, math.inf)
    if p == 0.5:
        a, scalar = _orders(alpha)
        return 0.0 if scalar else np.zeros(a.shape)
    rr = RandomizedResponse(p)
    return _eval(rr, alpha, (2 * p - 1) * math.log(p / (1 - p)), rr.pure_epsilon)


def RDP_pureDP(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """RDP of an ``params['eps']``-DP mechanism (that of randomized response with the same
    epsilon, which dominates it; equal to Bun & Steinke 2016, Lemma 1.4's bound)."""
    e = as_float("eps", params["eps"])
    if e == 0:
        a, scalar = _orders(alpha)
        return 0.0 if scalar else np.zeros(a.shape)
    kl = e * (math.cosh(e) - 1.0) / math.sinh(e) if e < 700 else e
    return _eval(PureDP(e), alpha, kl, e)


def RDP_zCDP(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """``xi + rho alpha`` ((xi, rho)-zCDP; Bun & Steinke 2016, Definition 1.1)."""
    rho = as_float("rho", params["rho"])
    xi = as_float("xi", params.get("xi", 0.0))
    a, scalar = _orders(alpha)
    out = xi + rho * a
    return float(out[0]) if scalar else out


def RDP_truncatedCDP(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """``rho alpha`` for ``alpha < w``, ``inf`` beyond ((rho, w)-tCDP)."""
    rho, w = as_float("rho", params["rho"]), as_float("w", params["w"])
    a, scalar = _orders(alpha)
    out = np.where(a < w, rho * a, math.inf)
    return float(out[0]) if scalar else out


def RDP_subsampled_pureDP(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """RDP of an ``params['eps']``-DP mechanism run on a Poisson subsample with rate
    ``params['prob']`` (add/remove), from privlearn's subsampled-RDP bound (Zhu & Wang
    2019, Theorem 6, capped by the RDP of randomized response with the amplified pure
    epsilon). autodp's optional ``eps2`` is not needed (the exact pure-DP RDP is used)."""
    e, q = as_float("eps", params["eps"]), as_float("prob", params["prob"])
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {q!r}")
    if q == 0.0 or e == 0.0:
        a, scalar = _orders(alpha)
        return 0.0 if scalar else np.zeros(a.shape)
    m = subsample(PureDP(e), q)
    pure = math.log1p(q * math.expm1(e))
    a, scalar = _orders(alpha)
    # KL: the limit alpha -> 1 is below the value at any alpha > 1 (monotone in alpha)
    kl = float(np.asarray(m.rdp([1.0 + 1e-9]), dtype=float)[0])
    return _eval(m, alpha, kl, pure)


_PROVIDED = __all__


def __getattr__(name: str) -> Callable[..., Any]:
    raise missing("rdp_bank", name, _PROVIDED)
