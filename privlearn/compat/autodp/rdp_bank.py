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
(2018), Composable and Versatile Privacy via Truncated CDP, STOC, Definition 1 (tCDP);
Zhu & Wang (2020), Improving Sparse Vector Technique with Renyi Differential Privacy,
NeurIPS (the SVT curves: Theorems 5, 8 and 9, Proposition 10); Zhu, Yu, Liang, Wang & Wang
(2020), Private-kNN, CVPR, Theorem 7 (noisy screening).
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
from privlearn.errors import ParameterValueError

__all__ = [
    "RDP_gaussian",
    "RDP_laplace",
    "RDP_randresponse",
    "RDP_pureDP",
    "RDP_zCDP",
    "RDP_truncatedCDP",
    "RDP_subsampled_pureDP",
    "RDP_svt_laplace",
    "RDP_gaussian_svt_cgreater1",
    "RDP_gaussian_svt_c1",
    "RDP_noisy_screen",
]


def _orders(alpha: Any) -> tuple[np.ndarray, bool]:
    a = np.asarray(alpha, dtype=float)
    if np.any(np.isnan(a)) or np.any(a < 1):
        raise ParameterValueError(
            f"alpha must be in [1, inf] (Renyi orders), got {alpha!r}: pass orders >= 1"
        )
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
    return _eval(Gaussian(s), alpha, 0.5 / s / s, math.inf)


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
        raise ParameterValueError(
            f"params['p'] must be in [0, 1] (the probability of a truthful answer), got {p!r}"
        )
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
        raise ParameterValueError(
            f"params['prob'] must be in [0, 1] (the sampling probability), got {q!r}"
        )
    if q == 0.0 or e == 0.0:
        a, scalar = _orders(alpha)
        return 0.0 if scalar else np.zeros(a.shape)
    m = subsample(PureDP(e), q)
    pure = math.log1p(q * math.expm1(e))
    a, scalar = _orders(alpha)
    # KL: the limit alpha -> 1 is below the value at any alpha > 1 (monotone in alpha)
    kl = float(np.asarray(m.rdp([1.0 + 1e-9]), dtype=float)[0])
    return _eval(m, alpha, kl, pure)



def _per_order(fn: Callable[[float], float], alpha: Any) -> Any:
    a, scalar = _orders(alpha)
    out = np.array([fn(float(x)) for x in a])
    return float(out[0]) if scalar else out


def _logaddexp(x: float, y: float) -> float:
    return float(np.logaddexp(x, y))


def RDP_svt_laplace(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """RDP of the Laplace-based sparse vector technique (noise scale ``params['b']`` per
    unit sensitivity on the threshold and the queries; stops after ``params['k']``
    queries or ``params['c']`` positive answers). Zhu & Wang (2020), Theorem 9: the
    smallest of (i) ``c eps_inf + eps_1(alpha)`` and (ii) ``c log(k/c) / (alpha - 1) +
    (c + 1) eps_1(alpha)``, with ``eps_1`` the Laplace RDP and ``eps_inf = 1/b``, (iii)
    the CDP bound ``alpha (c+1)^2 / (2 b^2)`` and (iv) the pure-DP-to-RDP (sinh) bound
    of ``(c + 1) / b``-DP (Bun & Steinke 2016, Proposition 3.3)."""
    b = as_float("b", params["b"])
    k = as_float("k", params["k"])
    c = max(as_float("c", params.get("c", 1)), 1.0)
    if not b > 0:
        raise ParameterValueError(
            f"b must be > 0 (params['b'], the Laplace scale over the sensitivity), "
            f"got {b!r}"
        )

    def f(a: float) -> float:
        e_inf = 1.0 / b
        if a <= 1:
            e1 = 1.0 / b + math.expm1(-1.0 / b)
        elif math.isinf(a):
            e1 = e_inf
        else:
            e1 = _logaddexp((a - 1.0) / b + math.log(a / (2.0 * a - 1.0)),
                            -a / b + math.log((a - 1.0) / (2.0 * a - 1.0))) / (a - 1.0)
        t = e_inf * (c + 1.0)
        if a == 1 or math.isinf(a):
            second = math.inf
        else:
            second = c * math.log(k / c) / (a - 1.0) + e1 * (c + 1.0)
        out = min(c * e_inf + e1, second, 0.5 * a * t * t)
        if a == 1 or math.isinf(a):
            return out
        # log((sinh(a t) - sinh((a-1) t)) / sinh(t)) / (a - 1), in a stable form
        num = _log_sinh_diff(a * t, (a - 1.0) * t)
        return min(out, (num - _log_sinh(t)) / (a - 1.0))

    return _per_order(f, alpha)


def _log_sinh(x: float) -> float:
    """log(sinh(x)) for x > 0."""
    return x + math.log1p(-math.exp(-2.0 * x)) - math.log(2.0)


def _log_sinh_diff(x: float, y: float) -> float:
    """log(sinh(x) - sinh(y)) for x > y >= 0: sinh x - sinh y = 2 cosh((x+y)/2)
    sinh((x-y)/2)."""
    s, d = 0.5 * (x + y), 0.5 * (x - y)
    log_cosh = s + math.log1p(math.exp(-2.0 * s)) - math.log(2.0)
    return math.log(2.0) + log_cosh + _log_sinh(d)


def RDP_gaussian_svt_cgreater1(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """RDP of the Gaussian-based sparse vector technique with cut-off ``params['c']``
    (threshold and query noise ``params['sigma']`` per unit sensitivity, at most
    ``params['k']`` queries): ``c log(k/c) / (alpha - 1) + (c + 1) alpha / (2 sigma^2)``
    (Zhu & Wang 2020, Theorem 5)."""
    sigma = as_float("sigma", params["sigma"])
    k = as_float("k", params["k"])
    c = max(as_float("c", params.get("c", 1)), 1.0)

    def f(a: float) -> float:
        if a == 1:
            return math.inf
        rho = 0.5 * a / sigma / sigma
        if math.isinf(a):
            return math.inf
        return c * math.log(k / c) / (a - 1.0) + rho * (c + 1.0)

    return _per_order(f, alpha)


def RDP_gaussian_svt_c1(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """RDP of the Gaussian-based sparse vector technique with cut-off 1 (Zhu & Wang 2020,
    Theorem 8): threshold noise ``params['sigma']`` (``sigma_1``), query noise
    ``params['sigma_nu']`` or ``params['sigma2']`` (``sigma_2``, default
    ``sqrt(3) sigma_1``), sensitivity ``params['Delta']`` (default 1):
    ``log(k) / (alpha - 1) + alpha Delta^2 / sigma_1^2 + 2 alpha Delta^2 / sigma_2^2``
    when ``params['k']`` is given, and, when ``sigma_2 >= sqrt(gamma + 1) sigma_1``
    (``params['gamma']``, default 2) for non-negative queries, the stopping-time moment
    bound of Proposition 10 with margin ``params['margin']`` (default 0); the smaller
    applies."""
    s1 = as_float("sigma", params["sigma"])
    s2 = as_float("sigma_nu", params.get("sigma_nu", math.sqrt(3.0) * s1))
    s2 = as_float("sigma2", params.get("sigma2", s2))
    margin = as_float("margin", params.get("margin", 0.0))
    dlt = as_float("Delta", params.get("Delta", 1.0))
    gamma = as_float("gamma", params.get("gamma", 2.0))
    has_k = "k" in params
    k = as_float("k", params["k"]) if has_k else None
    prop10 = s2 >= math.sqrt(gamma + 1.0) * s1
    if not prop10 and not has_k:
        raise ParameterValueError("params['k'] (the largest number of queries) is required: "
                         f"sigma2={s2!r} < sqrt(gamma + 1) sigma={math.sqrt(gamma + 1) * s1!r}, "
                         "so the k-free bound (Zhu & Wang 2020, Proposition 10) does not apply")

    def f(a: float) -> float:
        rho = a * dlt**2 / s1**2
        nu = 2.0 * a * dlt**2 / s2**2
        out = math.inf
        if has_k and a != 1:
            out = math.log(k) / (a - 1.0) + rho + nu
        if not prop10 or a == 1:
            return out
        log_part = (0.5 * math.log1p(gamma) + gamma * 0.5 * math.log(2.0 * math.pi)
                    + math.log((margin * (1.0 + gamma) / s1) ** gamma + 1.0))
        exp_part = gamma * margin**2 / (2.0 * s1**2)
        moment = _logaddexp(0.0, log_part + exp_part) / (gamma * (a - 1.0))
        return min(rho + nu + moment, out)

    return _per_order(f, alpha)


def RDP_noisy_screen(params: dict[str, Any], alpha: Any) -> Any:  # noqa: N802
    """Data-dependent RDP of noisy screening (Zhu, Yu, Liang, Wang & Wang 2020,
    Private-kNN, Theorem 7): the Renyi divergence between Bernoulli(p) and Bernoulli(q)
    with ``log p = params['logp']`` and ``log q = params['logq']``."""
    logp = as_float("logp", params["logp"])
    logq = as_float("logq", params["logq"])
    if logp > 0 or logq > 0:
        raise ParameterValueError(
            f"logp and logq (params['logp'], params['logq']) must be <= 0 (log-probabilities), "
            f"got {logp!r}, {logq!r}: pass math.log of probabilities"
        )

    def log1mexp(x: float) -> float:
        return math.log(-math.expm1(x)) if x > -0.693 else math.log1p(-math.exp(x))

    l1p, l1q = log1mexp(logp), log1mexp(logq)

    def f(a: float) -> float:
        if a == 1:
            return math.exp(logp) * (logp - logq) + (1 - math.exp(logp)) * (l1p - l1q)
        if math.isinf(a):
            return abs(math.exp(logp - logq))
        return _logaddexp(a * logp - (a - 1.0) * logq,
                          a * l1p - (a - 1.0) * l1q) / (a - 1.0)

    return _per_order(f, alpha)

_PROVIDED = __all__


def __getattr__(name: str) -> Callable[..., Any]:
    raise missing("rdp_bank", name, _PROVIDED)
