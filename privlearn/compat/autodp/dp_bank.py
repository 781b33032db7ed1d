"""autodp-compatible ``dp_bank``: epsilon(delta) of basic mechanisms.

Same names and signatures as autodp's; every value comes from privlearn's accountants
and is a certified upper bound. Where autodp converts an RDP curve, privlearn returns the
exact value when it has one (analytic Gaussian: Balle & Wang 2018, Theorem 8; Laplace and
randomized response: their exact privacy profiles, :mod:`privlearn.accounting.closed_form`),
which is never larger.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from privlearn._validation import check_delta
from privlearn.accounting import Laplace, RandomizedResponse, RDPMechanism, subsample
from privlearn.accounting.analytic import gaussian_delta_bounds, gaussian_epsilon
from privlearn.compat.autodp._missing import missing
from privlearn.compat.autodp.autodp_core import as_float
from privlearn.errors import ParameterValueError

__all__ = [
    "get_eps_rdp",
    "get_eps_rdp_subsampled",
    "get_eps_gaussian",
    "get_logdelta_ana_gaussian",
    "get_eps_ana_gaussian",
    "get_eps_laplace",
    "get_eps_randresp",
    "get_eps_randresp_optimal",
    "get_eps_gaussian_svt",
]


def _delta(delta: Any) -> float:
    return check_delta("delta", as_float("delta", delta), allow_one=True)


def get_eps_rdp(func: Callable[[float], float], delta: Any) -> float:
    """epsilon(delta) of a mechanism known by its RDP function ``func`` (RDP accountant,
    optimal conversion over orders)."""
    d = _delta(delta)
    return 0.0 if d == 1.0 else float(RDPMechanism(func).epsilon(d, "rdp"))


def get_eps_rdp_subsampled(func: Callable[[float], float], delta: Any, prob: Any) -> float:
    """As :func:`get_eps_rdp` for the mechanism run on a subsample of rate ``prob`` drawn
    without replacement (replace-one; Wang, Balle & Kasiviswanathan 2019, Theorem 9), as
    autodp's ``compose_subsampled_mechanism``."""
    d, q = _delta(delta), as_float("prob", prob)
    if not 0.0 <= q <= 1.0:
        raise ParameterValueError(
            f"prob must be in [0, 1] (the sampling probability), got {prob!r}: pass "
            "batch size / dataset size"
        )
    if q == 0.0 or d == 1.0:
        return 0.0
    if q == 1.0:
        return get_eps_rdp(func, d)
    m = subsample(RDPMechanism(func), q, scheme="fixed", neighbouring="replace_one")
    return float(m.epsilon(d, "rdp"))


def get_eps_gaussian(sigma: Any, delta: Any) -> float:
    """Gaussian mechanism: the exact (analytic) epsilon (autodp converts its RDP curve,
    which is never smaller)."""
    return get_eps_ana_gaussian(sigma, delta)


def get_logdelta_ana_gaussian(sigma: Any, eps: Any) -> float:
    """``log delta(eps)`` of the Gaussian mechanism, certified upper bound (``-inf`` when
    delta underflows to 0)."""
    s, e = as_float("sigma", sigma), as_float("eps", eps)
    up = gaussian_delta_bounds(s, e)[1]
    return math.log(up) if up > 0 else -math.inf


def get_eps_ana_gaussian(sigma: Any, delta: Any) -> float:
    """Exact epsilon(delta) of the Gaussian mechanism with noise ``sigma`` (Balle & Wang
    2018, Theorem 8): ``inf`` at delta 0, 0 at delta 1."""
    s, d = as_float("sigma", sigma), _delta(delta)
    if d == 0.0:
        return math.inf
    if d == 1.0:
        return 0.0
    return float(gaussian_epsilon(s, d))


def get_eps_laplace(b: Any, delta: Any) -> float:
    """Exact epsilon(delta) of the Laplace mechanism: ``max(0, 1/b + 2 log(1 - delta))``."""
    d = _delta(delta)
    return float(Laplace(as_float("b", b)).epsilon(d))


def get_eps_randresp(p: Any, delta: Any) -> float:
    """Exact epsilon(delta) of binary randomized response with truth probability ``p``
    (``p < 1/2`` is the same mechanism as ``1 - p``)."""
    q = as_float("p", p)
    if not 0.0 <= q <= 1.0:
        raise ParameterValueError(
            f"p must be in [0, 1] (the probability of a truthful answer), got {p!r}"
        )
    q = max(q, 1.0 - q)
    d = _delta(delta)
    if q == 1.0:
        return 0.0 if d == 1.0 else math.inf
    return float(RandomizedResponse(q).epsilon(d))


def get_eps_gaussian_svt(params: dict[str, Any], delta: Any) -> float:
    """epsilon(delta) of the stage-wise, length-capped Gaussian sparse vector technique
    (Zhu & Wang 2020, "Improving Sparse Vector Technique with Renyi Differential
    Privacy", NeurIPS, Theorem 12): ``params['c']`` positive answers are split into
    chunks of ``c_tilde`` (default ``floor(sqrt(c))``), each chunk of at most
    ``params['k']`` queries is ``(eps', delta')``-DP with ``eps' = (1 + c~) / (2 sigma^2)
    + sqrt((1 + c~) / (2 sigma^2) (log C(k, c~) + log(1/delta')))``, and the chunks are
    composed. As autodp, the per-chunk ``delta'`` is optimised (every choice gives a
    valid epsilon); the composition is the optimal one
    (:class:`privlearn.compat.autodp.dp_acct.DP_acct`) rather than autodp's
    Kairouz-Oh-Viswanath relaxation, so the value is never larger than autodp's at the
    same ``delta'``; the optimum is taken over a grid and a bounded search."""
    from scipy.optimize import minimize_scalar
    from scipy.special import comb

    from privlearn.compat.autodp.dp_acct import DP_acct

    d = _delta(delta)
    if d >= 1.0:
        return 0.0
    sigma = as_float("sigma", params["sigma"])
    k = int(as_float("k", params.get("k", 1)))
    c = int(as_float("c", params.get("c", 1)))
    c_tilde = int(as_float("c_tilde", params.get("c_tilde", int(math.sqrt(c)))))
    if not (sigma > 0 and k >= 1 and c >= 1 and c_tilde >= 1):
        raise ParameterValueError(
            "params must have sigma in (0, inf) and k, c, c_tilde >= 1, got "
            f"{params!r}: pass e.g. {{'sigma': 1.0, 'k': 10, 'c': 1}}"
        )
    coeff = float(comb(k, c_tilde))

    def composed(x: float) -> float:
        acct = DP_acct()
        per_delta = math.exp(x)
        if per_delta >= 1.0 / coeff:
            return math.inf
        left, ct, cf = c, c_tilde, coeff
        while left:
            if left >= ct:
                left -= ct
            else:
                ct, left = left, 0
                cf = float(comb(k, ct))
            a = (1.0 + ct) / (2.0 * sigma**2)
            acct.update_DPlosses(a + math.sqrt(a * (math.log(cf) - x)), per_delta)
        return acct.get_eps(d)

    right = min(d / (c_tilde + 1), 1.0 / coeff)
    left = d / (c_tilde * 10)
    while 10 * left > right:
        left *= 0.1
    lo, hi = math.log(left), math.log(right)
    grid = [lo + (hi - lo) * i / 32 for i in range(33)]
    vals = [composed(x) for x in grid]
    best = min(vals)
    res = minimize_scalar(composed, method="bounded", bounds=(lo, hi))
    return float(min(best, res.fun))


get_eps_randresp_optimal = get_eps_randresp

_PROVIDED = __all__


def __getattr__(name: str) -> Any:
    raise missing("dp_bank", name, _PROVIDED)
