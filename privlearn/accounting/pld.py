"""Privacy loss distribution (PLD) accountant -- placeholder being replaced.

Currently evaluates only compositions of Gaussians (exactly, via the analytic curve)
and raises UnsupportedMechanismError otherwise.
"""

from __future__ import annotations

from privlearn.accounting.accountants import (
    PrivacyBound,
    UnsupportedMechanismError,
    register_accountant,
)
from privlearn.accounting.analytic import (
    effective_noise_multiplier,
    gaussian_delta,
    gaussian_epsilon,
)
from privlearn.accounting.mechanisms import Mechanism


class PLDAccountant:
    name = "pld"

    def _sigma(self, mechanism: Mechanism) -> float:
        s = effective_noise_multiplier(mechanism)
        if s is None:
            raise UnsupportedMechanismError("pld: not implemented yet for this mechanism")
        return s

    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound:
        e = gaussian_epsilon(self._sigma(mechanism), delta)
        return PrivacyBound(e, e, self.name)

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound:
        d = gaussian_delta(self._sigma(mechanism), epsilon)
        return PrivacyBound(d, d, self.name)


register_accountant(PLDAccountant())
