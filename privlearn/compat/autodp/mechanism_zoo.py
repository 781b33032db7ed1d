"""autodp-compatible ``mechanism_zoo``: basic mechanisms as facade objects.

Each class builds a privlearn description (:mod:`privlearn.accounting`) and keeps autodp's
constructor signature, ``name`` and ``params``. autodp's switches that choose among its
own representations (``RDP_off``, ``approxDP_off``, ``phi_off``, ...) are accepted and
ignored: privlearn always evaluates the description with its tightest certified
accountant (see :mod:`privlearn.compat.autodp.autodp_core`).

Parameters may be Python or NumPy scalars (including 0-d and one-element arrays).
"""

from __future__ import annotations

import math
from typing import Any

from privlearn._validation import check_count, check_nonnegative, check_positive
from privlearn.accounting import (
    Gaussian,
    Laplace,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    compose,
    subsample,
)
from privlearn.compat.autodp.autodp_core import (
    NO_PRIVACY_LOSS,
    Mechanism,
    as_float,
    equivalent_gaussian_sigma,
)

__all__ = [
    "GaussianMechanism",
    "ExactGaussianMechanism",
    "LaplaceMechanism",
    "RandresponseMechanism",
    "RandomizedResponseMechanism",
    "PureDP_Mechanism",
    "zCDP_Mechanism",
    "SubsampleGaussianMechanism",
    "ComposedGaussianMechanism",
]


class GaussianMechanism(Mechanism):
    """Gaussian mechanism with noise std ``sigma`` times the L2 sensitivity.

    Evaluated exactly (analytic Gaussian curve; Balle & Wang 2018, Theorem 8).

    Parameters
    ----------
    sigma : float > 0
        Noise standard deviation divided by the L2 sensitivity.
    name : str
    RDP_off, approxDP_off, fdp_off, use_basic_RDP_to_approxDP_conversion, \
use_fDP_based_RDP_to_approxDP_conversion, phi_off
        Accepted for autodp compatibility and ignored.
    """

    def __init__(
        self,
        sigma: Any,
        name: str = "Gaussian",
        RDP_off: bool = False,  # noqa: N803
        approxDP_off: bool = False,  # noqa: N803
        fdp_off: bool = True,
        use_basic_RDP_to_approxDP_conversion: bool = False,
        use_fDP_based_RDP_to_approxDP_conversion: bool = False,  # noqa: N803
        phi_off: bool = True,
    ) -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {"sigma": sigma}
        self.delta0 = 0
        self._set_description(Gaussian(check_positive("sigma", as_float("sigma", sigma))))


class ExactGaussianMechanism(Mechanism):
    """Gaussian mechanism with exact (analytic) privacy curve; see
    :class:`GaussianMechanism`.

    Parameters
    ----------
    sigma : float > 0
        Noise standard deviation divided by the L2 sensitivity (required).
    name : str
    """

    def __init__(self, sigma: Any = None, name: str = "Gaussian") -> None:
        Mechanism.__init__(self)
        if sigma is None:
            raise ValueError("sigma must be in (0, inf) and finite, got None")
        self.name = name
        self.params = {"sigma": sigma}
        self.delta0 = 0
        self._set_description(Gaussian(check_positive("sigma", as_float("sigma", sigma))))


class LaplaceMechanism(Mechanism):
    """Laplace mechanism with scale ``b`` times the L1 sensitivity; (1/b, 0)-DP.

    Parameters
    ----------
    b : float > 0
        Laplace scale divided by the L1 sensitivity.
    name : str
    RDP_off, phi_off
        Accepted for autodp compatibility and ignored.

    References
    ----------
    Dwork, McSherry, Nissim & Smith (2006), Calibrating Noise to Sensitivity.
    """

    def __init__(
        self,
        b: Any = None,
        name: str = "Laplace",
        RDP_off: bool = False,  # noqa: N803
        phi_off: bool = True,
    ) -> None:
        Mechanism.__init__(self)
        if b is None:
            raise ValueError("b must be in (0, inf) and finite, got None")
        self.name = name
        self.params = {"b": b}
        self.delta0 = 0
        self._set_description(Laplace(check_positive("b", as_float("b", b))))


class RandresponseMechanism(Mechanism):
    """Binary randomized response reporting the truth with probability ``p``;
    (log(p / (1 - p)), 0)-DP.

    Parameters
    ----------
    p : float in [1/2, 1)
        Probability of reporting the true bit.
    RDP_off, phi_off
        Accepted for autodp compatibility and ignored.
    name : str

    References
    ----------
    Warner (1965); Kairouz, Oh & Viswanath (2016), Extremal Mechanisms for Local DP.
    """

    def __init__(
        self,
        p: Any = None,
        RDP_off: bool = False,  # noqa: N803
        phi_off: bool = True,
        name: str = "Randresponse",
    ) -> None:
        Mechanism.__init__(self)
        if p is None:
            raise ValueError("p must be in [0.5, 1), got None")
        self.name = name
        self.params = {"p": p}
        self.delta0 = 0
        self._set_description(RandomizedResponse(as_float("p", p), num_categories=2))


RandomizedResponseMechanism = RandresponseMechanism


class PureDP_Mechanism(Mechanism):  # noqa: N801 (autodp's name)
    """A generic (eps, 0)-DP mechanism, analysed through its worst case (randomized
    response with the same epsilon; Kairouz, Oh & Viswanath 2015, Theorem 2.1).

    Parameters
    ----------
    eps : float >= 0
    name : str
    """

    def __init__(self, eps: Any, name: str = "PureDP") -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {"eps": eps}
        e = check_nonnegative("eps", as_float("eps", eps))
        self._set_description(PureDP(e) if e > 0 else NO_PRIVACY_LOSS)
        self.delta0 = 0


class zCDP_Mechanism(Mechanism):  # noqa: N801 (autodp's name)
    """A (xi, rho)-zCDP mechanism: RDP ``xi + rho * alpha`` at every order alpha > 1.

    Evaluated with the RDP accountant.

    Parameters
    ----------
    rho : float > 0
    xi : float >= 0
    name : str

    References
    ----------
    Bun & Steinke (2016), Concentrated Differential Privacy: Simplifications, Extensions,
    and Lower Bounds, TCC, Definition 1.1.
    """

    def __init__(self, rho: Any, xi: Any = 0, name: str = "zCDP_mech") -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {"rho": rho, "xi": xi}
        r = check_nonnegative("rho", as_float("rho", rho))
        x = check_nonnegative("xi", as_float("xi", xi))

        def rdp(alpha: float, r: float = r, x: float = x) -> float:
            return x + r * alpha

        self._set_description(RDPMechanism(rdp, name=name))


class SubsampleGaussianMechanism(Mechanism):
    """Poisson-subsampled Gaussian mechanism composed ``coeff`` times (autodp's
    calibration example).

    Parameters
    ----------
    params : dict with keys ``"prob"`` (rate in (0, 1]), ``"sigma"`` (> 0) and
        ``"coeff"`` (number of steps; a non-integer count is rounded *up*, which is
        conservative).
    phi_off, RDP_off, neighboring
        Accepted for autodp compatibility. privlearn's analysis is under add/remove-one,
        which covers both autodp's ``"add_only"`` and ``"remove_only"``.
    name : str
    """

    def __init__(
        self,
        params: dict[str, Any],
        phi_off: bool = True,
        RDP_off: bool = False,  # noqa: N803
        neighboring: str = "remove_only",
        name: str = "SubsampleGaussian",
    ) -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {"prob": params["prob"], "sigma": params["sigma"], "coeff": params["coeff"]}
        coeff = as_float("coeff", params["coeff"])
        steps = check_count("coeff", math.ceil(check_nonnegative("coeff", coeff)))
        prob = check_nonnegative("prob", as_float("prob", params["prob"]))
        if steps == 0 or prob == 0:
            self._set_description(NO_PRIVACY_LOSS)
        else:
            sigma = check_positive("sigma", as_float("sigma", params["sigma"]))
            base = subsample(Gaussian(sigma), prob)
            self._set_description(compose(base, steps=steps))


class ComposedGaussianMechanism(Mechanism):
    """Gaussian mechanism composed ``coeff`` times (``coeff`` may be real): exactly the
    Gaussian with ``sigma / sqrt(coeff)`` (Dong, Roth & Su 2022, Corollary 3.3).

    Parameters
    ----------
    params : dict with keys ``"sigma"`` (> 0) and ``"coeff"`` (>= 0)
    name : str
    """

    def __init__(self, params: dict[str, Any], name: str = "ComposedGaussian") -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {"sigma": params["sigma"], "coeff": params["coeff"]}
        sigma = check_positive("sigma", as_float("sigma", params["sigma"]))
        coeff = check_nonnegative("coeff", as_float("coeff", params["coeff"]))
        if coeff == 0:
            self._set_description(NO_PRIVACY_LOSS)
        else:
            self._set_description(Gaussian(equivalent_gaussian_sigma([(sigma, coeff)])))
        self.delta0 = 0
