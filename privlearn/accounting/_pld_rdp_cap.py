"""The PLD accountant's answer capped by the RDP accountant's where fixed-size sampling
makes the PLD pair loose (private helper of :mod:`privlearn.accounting.pld`).

For a fixed-size batch drawn without replacement under replace-one neighbouring, the PLD
accountant composes one pair whose privacy profile is the pointwise maximum of the
single-step profiles (the symmetrised trade-off ``C_q(f)`` of Dong, Roth & Su 2022,
Theorem 9). That pair dominates every step, so its composition is a certified upper
bound; but the maximum is attained by different mechanisms at different epsilons, so no
single mechanism need attain the composed profile, and after many steps it can be looser
than the Renyi bound, which composes each order's supremum exactly (for a pure-DP base
the RDP accountant's divergences are attained: Wang, Balle & Kasiviswanathan 2019,
Theorem 9, and :mod:`privlearn.accounting._rdp_pure_subsampled`). Both are certified
upper bounds, so their minimum is one too.

When the cap is skipped. The RDP bound is a certified upper bound on the mechanism's
true value (epsilon at ``delta``, or delta at ``epsilon``), and that value is at least
the PLD accountant's certified lower end (which composes each direction's own pair, one
the mechanism attains at every step). So the cap can lower the answer by at most
``upper - lower``. Where that is at most :data:`_TIGHT` of the upper end, or the upper
end is 0, the RDP accountant is not run: one fixed-size Gaussian step, answered from its
pair in closed form, has a bracket of about ``1e-12`` relative (its floating-point
allowance). That is the only skip. A composition's bracket is wider (the symmetrised
pair's upper end against the directions' own lower end), and there the RDP bound is
evaluated -- fast (forward differences in floating point, :mod:`._rdp_wor_gaussian`) and
memoised per (mechanism, query).
"""

from __future__ import annotations

import functools
import math

from privlearn.accounting._types import PrivacyBound
from privlearn.accounting.accountants import get_accountant
from privlearn.accounting.mechanisms import Composed, Sampling, Subsampled
from privlearn.errors import AccountingError, UnsupportedMechanismError

__all__ = ["rdp_capped", "clear_cache"]

#: Relative width of the PLD bracket below which the cap is skipped (module docstring):
#: the cap could lower the upper end by less than this fraction of it.
_TIGHT = 1e-10


def _has_fixed_size_part(mechanism: object) -> bool:
    parts = mechanism.parts if isinstance(mechanism, Composed) else ((mechanism, 1),)
    # (at rate 1 nothing is sampled: the pair is the base's at the relation's
    # sensitivity, attained, and its composition is the tight answer)
    return any(
        isinstance(m, Subsampled) and m.scheme is Sampling.FIXED and m.rate < 1.0 for m, _ in parts
    )


def rdp_capped(bound: PrivacyBound, mechanism: object, what: str, at: float) -> PrivacyBound:
    """``bound`` (the PLD accountant's ``what``, ``"epsilon"`` at delta ``at`` or
    ``"delta"`` at epsilon ``at``), replaced by the RDP accountant's certified upper
    bound where ``mechanism`` has a part sampled at a fixed size (rate below 1) and that
    bound is smaller
    (``PrivacyBound.accountant`` then says ``"rdp"``). The lower end is kept where it
    is below that bound (it always is when both are right: it bounds the true value from
    below) and dropped (None) otherwise. Unchanged where the RDP accountant cannot
    evaluate ``mechanism``, and where the bracket ``[lower, upper]`` is narrower than
    :data:`_TIGHT` of ``upper`` (module docstring)."""
    if not _has_fixed_size_part(mechanism) or _closed(bound):
        return bound
    other = _rdp_upper(mechanism, what, at)
    if other is None or not other < bound.upper:
        return bound
    lower = bound.lower if bound.lower is not None and bound.lower <= other else None
    return PrivacyBound(other, lower, "rdp")


def _closed(bound: PrivacyBound) -> bool:
    """Whether the cap can lower ``bound.upper`` by at most :data:`_TIGHT` of it: the
    RDP bound is at least the mechanism's true value, itself at least ``bound.lower``."""
    up, lo = bound.upper, bound.lower
    if up == 0.0:
        return True  # no bound is below 0
    return lo is not None and math.isfinite(up) and 0.0 <= lo <= up and up - lo <= _TIGHT * up


def _rdp_upper(mechanism: object, what: str, at: float) -> float | None:
    """The RDP accountant's upper bound on ``what`` at ``at`` (None where it cannot
    evaluate ``mechanism``), memoised per (mechanism, query) where both are hashable (a
    budget check asks the same question again)."""
    acc = get_accountant("rdp")
    try:
        hash((mechanism, at))
    except TypeError:  # a mechanism or a value (a 0-d array) that cannot be a key
        return _rdp_upper_compute(acc, mechanism, what, at)
    return _rdp_upper_memo(acc, mechanism, what, at)


@functools.lru_cache(maxsize=128)
def _rdp_upper_memo(acc: object, mechanism: object, what: str, at: float) -> float | None:
    return _rdp_upper_compute(acc, mechanism, what, at)


def _rdp_upper_compute(acc: object, mechanism: object, what: str, at: float) -> float | None:
    try:
        return getattr(acc, what)(mechanism, at).upper
    except (UnsupportedMechanismError, AccountingError):
        return None


def clear_cache() -> None:
    """Forget the memoised RDP bounds (for honest cold-start timings)."""
    _rdp_upper_memo.cache_clear()
