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
"""

from __future__ import annotations

from privlearn.accounting._types import PrivacyBound
from privlearn.accounting.accountants import get_accountant
from privlearn.accounting.mechanisms import Composed, Sampling, Subsampled
from privlearn.errors import AccountingError, UnsupportedMechanismError

__all__ = ["rdp_capped"]


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
    is below that bound; above it, it was the composed symmetrised pair's rather than
    the mechanism's (module docstring) and is dropped (None). Unchanged where the RDP
    accountant cannot evaluate ``mechanism``."""
    if not _has_fixed_size_part(mechanism):
        return bound
    try:
        other = getattr(get_accountant("rdp"), what)(mechanism, at).upper
    except (UnsupportedMechanismError, AccountingError):
        return bound
    if not other < bound.upper:
        return bound
    lower = bound.lower if bound.lower is not None and bound.lower <= other else None
    return PrivacyBound(other, lower, "rdp")
