"""autodp-compatible ``fdp_bank``: trade-off functions (f-DP) in closed form.

Dong, Roth & Su (2022), Gaussian Differential Privacy, JRSS-B: ``G_mu`` (Definition 2.7;
the Gaussian mechanism with noise ``sigma`` is exactly ``1/sigma``-GDP, Theorem 2.7) and
the (eps, delta)-DP curve ``f_{eps,delta}`` (Proposition 2.5).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.special import log_ndtr, ndtr, ndtri

from privlearn.compat.autodp._missing import missing
from privlearn.compat.autodp.autodp_core import as_float
from privlearn.errors import ParameterValueError

__all__ = [
    "fDP_gaussian",
    "fDP_approx_DP",
    "fDP_pure_DP",
    "fdp_grad_gaussian",
    "log_one_minus_fdp_gaussian",
    "log_neg_fdp_grad_gaussian",
]


def _fpr(fpr: Any) -> np.ndarray:
    a = np.asarray(fpr, dtype=float)
    if np.any(np.isnan(a)) or np.any((a < 0) | (a > 1)):
        raise ParameterValueError(
            f"fpr must be in [0, 1] (false positive rates), got {fpr!r}: pass values in "
            "[0, 1], e.g. np.linspace(0, 1, 101)"
        )
    return a


def _out(x: np.ndarray) -> Any:
    return float(x) if x.ndim == 0 else x


def _mu(params: dict[str, Any]) -> float:
    s = as_float("sigma", params["sigma"])
    if s < 0 or math.isnan(s):
        raise ParameterValueError(
            f"sigma must be in [0, inf] (the noise multiplier), got {s!r}: pass the "
            "Gaussian noise's standard deviation over the sensitivity"
        )
    return math.inf if s == 0 else 1.0 / s


def fDP_gaussian(params: dict[str, Any], fpr: Any) -> Any:  # noqa: N802 (autodp's name)
    """``G_mu(fpr) = Phi(Phi^{-1}(1 - fpr) - mu)``, ``mu = 1 / params['sigma']``."""
    a, mu = _fpr(fpr), _mu(params)
    if math.isinf(mu):
        return _out(np.zeros_like(a))
    return _out(ndtr(-ndtri(a) - mu))  # Phi^{-1}(1 - a) = -Phi^{-1}(a), accurate for tiny a


def fDP_approx_DP(params: dict[str, Any], fpr: Any) -> Any:  # noqa: N802
    """``max(0, 1 - delta - e^eps fpr, e^-eps (1 - delta - fpr))``."""
    a = _fpr(fpr)
    e, d = as_float("eps", params["eps"]), as_float("delta", params.get("delta", 0.0))
    if math.isinf(e):
        return _out(np.zeros_like(a))
    with np.errstate(over="ignore", invalid="ignore"):
        lin = np.where(a > 0, 1.0 - d - np.exp(e) * a, 1.0 - d)
    return _out(np.maximum(0.0, np.maximum(lin, math.exp(-e) * (1.0 - d - a))))


def fDP_pure_DP(params: dict[str, Any], fpr: Any) -> Any:  # noqa: N802
    """:func:`fDP_approx_DP` with delta 0 (``params`` is not modified)."""
    return fDP_approx_DP({"eps": params["eps"], "delta": 0.0}, fpr)


def fdp_grad_gaussian(params: dict[str, Any], fpr: Any) -> Any:
    """``G_mu'(fpr) = -exp(mu z - mu^2 / 2)``, ``z = Phi^{-1}(1 - fpr)``."""
    a, mu = _fpr(fpr), _mu(params)
    z = -ndtri(a)
    return _out(-np.exp(mu * z - 0.5 * mu * mu))


def log_one_minus_fdp_gaussian(params: dict[str, Any], logfpr: Any) -> Any:
    """``log(1 - G_mu(e^logfpr))`` = ``log Phi(mu - Phi^{-1}(1 - fpr))``."""
    mu = _mu(params)
    a = _fpr(np.exp(np.asarray(logfpr, dtype=float)))
    return _out(log_ndtr(mu + ndtri(a)))


def log_neg_fdp_grad_gaussian(params: dict[str, Any], logfpr: Any) -> tuple[Any, Any]:
    """``log(-G_mu'(e^logfpr)) = mu z - mu^2 / 2``, returned twice as a pair (autodp's
    return convention: left and right derivative)."""
    mu = _mu(params)
    a = _fpr(np.exp(np.asarray(logfpr, dtype=float)))
    with np.errstate(over="ignore"):
        g = _out(-mu * ndtri(a) - 0.5 * mu * mu)
    return g, g


_PROVIDED = __all__


def __getattr__(name: str) -> Any:
    raise missing("fdp_bank", name, _PROVIDED)
