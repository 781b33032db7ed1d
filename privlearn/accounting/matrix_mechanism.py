"""The Gaussian matrix-factorization (correlated-noise) mechanism as a mechanism kind.

A matrix-factorization mechanism with strategy ``C`` releases (a post-processing of)
``C x + sigma z``, ``z ~ N(0, I)``, where ``x`` stacks the clipped per-step contributions;
one record moves ``C x`` by at most ``sens(C)`` (in units of the clipping bound) under the
participation schema of the sampler (:mod:`privlearn.correlated.sensitivity`). Its privacy
curve is therefore exactly that of the Gaussian mechanism with noise multiplier
``sigma / sens(C)`` (Choquette-Choo et al. 2023a, Section 2; Denisov et al. 2022).

:class:`MatrixMechanism` describes one such release: un-amplified matrix factorization
(fixed epochs, b-min-separation without sampling) is ``MatrixMechanism(sigma, sens(C))``.
Amplified banded matrix factorization with cyclic Poisson sampling reduces to
``compose(subsample(MatrixMechanism(sigma, c), rate=q), steps=ceil(n / b))`` with ``c``
the largest column norm of the ``b``-banded ``C`` (Choquette-Choo et al. 2023b, Theorem 4):
the participations of a record land in disjoint row blocks of ``C``, each a
Poisson-subsampled Gaussian mechanism of sensitivity at most ``c``
(:func:`privlearn.correlated.accounting.correlated_mechanism` builds it).

The kind is registered like any other (:func:`privlearn.accounting.register_mechanism`):
its representations are those of ``Gaussian(sigma / sensitivity)``, so ``"pld"``,
``"rdp"``, ``"analytic"``, subsampling, :func:`~privlearn.accounting.calibrate`, the
ledger, serialisation and the autodp facade take it with no special case; with
``sensitivity = 1`` every epsilon is bit-for-bit that of :class:`Gaussian`.

References
----------
.. [DMRST22] Denisov, McMahan, Rush, Smith & Thakurta (2022), Improved Differential Privacy
       for SGD via Optimal Private Linear Operators on Adaptive Streams, NeurIPS.
.. [CC23a] Choquette-Choo, McMahan, Rush & Thakurta (2023), Multi-Epoch Matrix
       Factorization Mechanisms for Private Machine Learning, ICML, Section 2.
.. [CC23b] Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu (2023), (Amplified)
       Banded Matrix Factorization: A unified approach to private training, NeurIPS,
       Theorem 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from privlearn._validation import check_positive
from privlearn.accounting import _builtin_kinds  # noqa: F401  (Gaussian registered first)
from privlearn.accounting.mechanisms import Gaussian, Mechanism
from privlearn.accounting.registry import register_mechanism, representation_of
from privlearn.errors import ParameterValueError

__all__ = ["MatrixMechanism"]


@dataclass(frozen=True, slots=True)
class MatrixMechanism(Mechanism):
    """A Gaussian matrix-factorization release of L2 sensitivity ``sensitivity``.

    Parameters
    ----------
    noise_multiplier : float > 0
        Standard deviation of the i.i.d. noise ``z`` (the noise added at step ``t`` is
        ``noise_multiplier * max_grad_norm * (C^{-1} z)_t``) divided by the clipping bound.
    sensitivity : float > 0
        ``sens(C)`` under the participation schema, in units of the clipping bound
        (:func:`privlearn.correlated.sensitivity`); the largest column norm of ``C`` for one
        block of amplified banded matrix factorization.

    Examples
    --------
    >>> from privlearn.accounting import MatrixMechanism, Gaussian
    >>> m = MatrixMechanism(noise_multiplier=4.0, sensitivity=2.0)
    >>> m.epsilon(1e-5) == Gaussian(2.0).epsilon(1e-5)
    True
    """

    noise_multiplier: float
    sensitivity: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )
        object.__setattr__(
            self,
            "sensitivity",
            check_positive(
                "sensitivity", self.sensitivity,
                hint="pass sens(C) from privlearn.correlated.sensitivity",
            ),
        )

    @property
    def gaussian(self) -> Gaussian:
        """``Gaussian(noise_multiplier / sensitivity)``, the same privacy curve. The
        quotient is rounded down (less noise is the conservative side)."""
        ratio = self.noise_multiplier / self.sensitivity
        # compared exactly: the float product ``ratio * sensitivity`` rounds, and hid a
        # quotient one ulp above the exact one in about half of all cases
        if Fraction(ratio) * Fraction(self.sensitivity) > Fraction(self.noise_multiplier):
            ratio = math.nextafter(ratio, 0.0)
        return Gaussian(ratio)


def _delegate(name: str):
    fn = representation_of(Gaussian, name)
    assert fn is not None, name
    return lambda m, *args: fn(m.gaussian, *args)


def _to_dict(m: MatrixMechanism) -> dict[str, Any]:
    return {"noise_multiplier": float(m.noise_multiplier), "sensitivity": float(m.sensitivity)}


def _from_dict(d: dict[str, Any]) -> MatrixMechanism:
    if not isinstance(d, dict) or set(d) != {"noise_multiplier", "sensitivity"}:
        raise ParameterValueError(
            f"a MatrixMechanism is stored as {{'noise_multiplier', 'sensitivity'}}, got {d!r}"
        )
    return MatrixMechanism(d["noise_multiplier"], d["sensitivity"])


def _rdp(m: MatrixMechanism, alphas: np.ndarray) -> np.ndarray:
    return representation_of(Gaussian, "rdp")(m.gaussian, alphas)


register_mechanism(
    MatrixMechanism,
    pure_epsilon=lambda m: math.inf,
    pld_pair=_delegate("pld_pair"),
    rdp=_rdp,
    equivalent_gaussian=lambda m: m.gaussian.noise_multiplier,
    scale_sensitivity=lambda m, factor: MatrixMechanism(
        m.noise_multiplier, m.sensitivity * factor
    ),
    pld_replace_one_pair=_delegate("pld_replace_one_pair"),
    rdp_poisson_subsampled=_delegate("rdp_poisson_subsampled"),
    replace_one_doubles_sensitivity=True,
    to_dict=_to_dict,
    from_dict=_from_dict,
)
