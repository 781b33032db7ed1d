"""Pearson-Vajda terms of the Gaussian mechanism for the improved bound on sampling
without replacement (private helper of :mod:`privlearn.accounting.rdp`).

Wang, Balle & Kasiviswanathan (2019), Theorem 27: for a mechanism whose RDP is attained
by one pair of neighbouring inputs at every order (the Gaussian mechanism), the ``j``-th
term (``j >= 3``) of their Theorem 9 may be replaced by ``4 sqrt(D_{2 floor(j/2)}
D_{2 ceil(j/2)})`` whenever smaller, where ``D_k`` is the ``k``-th forward difference at
0 of the moment sequence ``A_i = exp((i - 1) eps(i))`` (``A_0 = A_1 = 1``), i.e. the
Pearson-Vajda ``chi^k`` divergence ``E_Q[(P/Q - 1)^k]`` of the pair (autodp's
``improved_bound_flag`` and Google dp_accounting's sampling-without-replacement RDP use
it).

``D_k = sum_i (-1)^(k-i) C(k, i) A_i`` cancels heavily, so it is evaluated in decimal
arithmetic at a precision raised until a rigorous bound on the rounding error is below
1e-9 of the value; the float returned is the logarithm of an upper bound. Orders whose
difference cannot be certified get ``inf`` (the caller keeps Theorem 9's term there).
"""

from __future__ import annotations

import decimal
import functools
import math

__all__ = ["gaussian_log_forward_differences", "MAX_IMPROVED_ORDER"]

#: Largest difference order evaluated (as autodp and dp_accounting: Theorem 27 up to 256).
MAX_IMPROVED_ORDER = 258
_MAX_DIGITS = 6000


@functools.lru_cache(maxsize=64)
def gaussian_log_forward_differences(sigma: float) -> tuple[float, ...]:
    """``log`` of certified upper bounds on ``D_k``, k = 0..MAX_IMPROVED_ORDER, for the
    Gaussian mechanism with noise multiplier ``sigma`` (``eps(i) = i / (2 sigma^2)``);
    ``-inf`` where ``D_k <= 0`` is certified, ``inf`` where no bound was certified."""
    n = MAX_IMPROVED_ORDER
    out = [math.inf] * (n + 1)
    two_s2 = decimal.Decimal(2.0 * sigma * sigma)  # exact: a float times 2 is exact
    if not (two_s2.is_finite() and two_s2 > 0):
        return tuple(out)
    # the largest exponent n (n - 1) / (2 sigma^2) sets the error of the moments A_i
    max_arg = n * (n - 1) / (2.0 * sigma * sigma)
    if not math.isfinite(max_arg):
        return tuple(out)
    out[0], out[1] = 0.0, -math.inf  # D_0 = A_0 = 1, D_1 = A_1 - A_0 = 0
    pending = list(range(2, n + 1))
    digits = 60 + n // 2 + int(math.log10(max_arg + 1.0))
    while pending and digits <= _MAX_DIGITS:
        ctx = decimal.Context(prec=digits, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN,
                              rounding=decimal.ROUND_HALF_EVEN)
        moments = [ctx.exp(ctx.divide(decimal.Decimal(i * (i - 1)), two_s2))
                   for i in range(n + 1)]
        # each term: the exponent's rounding (relative 10^(1-p), times the exponent
        # <= max_arg inside the exponential), the exponential's and the product's
        # (10^(1-p) each); the running sums add at most k + 1 roundings of magnitude at
        # most the sum of |terms|. Everything doubled for safety. Every operation on the
        # moments goes through ``ctx``: its exponent range holds e^(n^2 / (2 sigma^2))
        # for a small sigma, which the default context's overflows.
        unit = decimal.Decimal(10) ** (1 - digits)
        still = []
        for k in pending:
            total = decimal.Decimal(0)
            magnitude = decimal.Decimal(0)
            for i in range(k + 1):
                term = ctx.multiply(decimal.Decimal(math.comb(k, i)), moments[i])
                magnitude = ctx.add(magnitude, term)
                total = (ctx.add if (k - i) % 2 == 0 else ctx.subtract)(total, term)
            rel = 2 * unit * (decimal.Decimal(max_arg) + 4 + (k + 2))
            err = ctx.multiply(magnitude, rel)
            upper = ctx.add(total, err)
            if upper <= 0:
                out[k] = -math.inf
            elif err <= ctx.multiply(upper, decimal.Decimal("1e-9")):
                value = float(upper.ln(ctx))  # float rounding << the 1e-12 added
                out[k] = value + 1e-12 * max(1.0, abs(value))
            else:
                still.append(k)
        pending = still
        digits *= 2
    return tuple(out)
