"""autodp-compatible ``mechanism_zoo``: basic mechanisms as facade objects.

Each class builds a privlearn description (:mod:`privlearn.accounting`) and keeps autodp's
constructor signature, ``name`` and ``params``. autodp's switches that choose among its
own representations (``RDP_off``, ``approxDP_off``, ``phi_off``, ...) cannot change a
value here -- privlearn always evaluates the description with its tightest certified
accountant -- so, set away from autodp's defaults, they raise an
:class:`~privlearn.compat.autodp.autodp_core.AutodpArgumentWarning` saying so (never
silently dropped). ``SubsampleGaussianMechanism(phi_off=False, neighboring=...)`` is
honoured (one-sided relations) (see :mod:`privlearn.compat.autodp.autodp_core`).

Parameters may be Python or NumPy scalars (including 0-d and one-element arrays).

Length: mirrors autodp's ``mechanism_zoo`` one-to-one (one small class per autodp
mechanism) so that ported code keeps its imports.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privlearn._validation import check_count, check_nonnegative, check_positive
from privlearn.accounting import (
    ZCDP,
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
    non_default,
    warn_no_effect,
)
from privlearn.errors import ParameterValueError

_EXACT_REASON = (
    "privlearn always evaluates {what} with its exact privacy curve ({how}), which is at "
    "least as tight as every representation and conversion autodp lets these switches "
    "choose; RenyiDP, approxDP and f-DP (get_fDP) all stay available"
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
    "ExponentialMechanism",
    "DiscreteGaussianMechanism",
    "NoisySGD_Mechanism",
    "NoisyGD_Mechanism",
    "NoisyScreenMechanism",
    "GaussianSVT_Mechanism",
    "LaplaceSVT_Mechanism",
    "StageWiseMechanism",
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
        autodp's representation switches. They cannot change a value here (the exact
        curve is used whatever they say); set away from autodp's defaults they raise an
        :class:`~privlearn.compat.autodp.autodp_core.AutodpArgumentWarning` saying so.
        ``fdp_off`` is honoured trivially: f-DP is always available.
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
        warn_no_effect(
            "GaussianMechanism",
            non_default(
                {
                    "RDP_off": RDP_off,
                    "approxDP_off": approxDP_off,
                    "use_basic_RDP_to_approxDP_conversion": use_basic_RDP_to_approxDP_conversion,
                    "use_fDP_based_RDP_to_approxDP_conversion": (
                        use_fDP_based_RDP_to_approxDP_conversion
                    ),
                    "phi_off": phi_off,
                },
                {
                    "RDP_off": False,
                    "approxDP_off": False,
                    "use_basic_RDP_to_approxDP_conversion": False,
                    "use_fDP_based_RDP_to_approxDP_conversion": False,
                    "phi_off": True,
                },
            ),
            _EXACT_REASON.format(
                what="the Gaussian mechanism",
                how="Balle & Wang 2018, Theorem 8; mu-GDP, Dong, Roth & Su 2022",
            ),
        )


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
            raise ParameterValueError(
                "sigma must be in (0, inf) and finite, got None: pass the noise "
                "multiplier, e.g. ExactGaussianMechanism(sigma=1.0)"
            )
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
        autodp's representation switches; set away from autodp's defaults they raise an
        ``AutodpArgumentWarning`` (no effect: the exact curve is always used).

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
            raise ParameterValueError(
                "b must be in (0, inf) and finite, got None: pass the Laplace scale over "
                "the sensitivity, e.g. LaplaceMechanism(b=1.0)"
            )
        self.name = name
        self.params = {"b": b}
        self.delta0 = 0
        self._set_description(Laplace(check_positive("b", as_float("b", b))))
        warn_no_effect(
            "LaplaceMechanism",
            non_default(
                {"RDP_off": RDP_off, "phi_off": phi_off}, {"RDP_off": False, "phi_off": True}
            ),
            _EXACT_REASON.format(
                what="the Laplace mechanism",
                how="delta(eps) = 1 - exp((eps - 1/b) / 2), composed by PLD",
            ),
        )


class RandresponseMechanism(Mechanism):
    """Binary randomized response reporting the truth with probability ``p``;
    (log(p / (1 - p)), 0)-DP.

    Parameters
    ----------
    p : float in [1/2, 1)
        Probability of reporting the true bit.
    RDP_off, phi_off
        autodp's representation switches; set away from autodp's defaults they raise an
        ``AutodpArgumentWarning`` (no effect: the exact curve is always used).
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
            raise ParameterValueError(
                "p must be in [0.5, 1), got None: pass the probability of a truthful "
                "answer, e.g. RandresponseMechanism(p=0.75)"
            )
        self.name = name
        self.params = {"p": p}
        self.delta0 = 0
        self._set_description(RandomizedResponse(as_float("p", p), num_categories=2))
        warn_no_effect(
            "RandresponseMechanism",
            non_default(
                {"RDP_off": RDP_off, "phi_off": phi_off}, {"RDP_off": False, "phi_off": True}
            ),
            _EXACT_REASON.format(
                what="randomized response", how="its finite privacy loss distribution"
            ),
        )


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
        # the registered kind: its curve rounded up, storable, and group privacy known
        self._set_description(ZCDP(r, x))


class SubsampleGaussianMechanism(Mechanism):
    """Poisson-subsampled Gaussian mechanism composed ``coeff`` times (autodp's
    calibration example).

    Parameters
    ----------
    params : dict with keys ``"prob"`` (rate in (0, 1]), ``"sigma"`` (> 0) and
        ``"coeff"`` (number of steps; a non-integer count is rounded *up*, which is
        conservative).
    phi_off : bool
        As in autodp: with ``phi_off=False`` the mechanism is accounted under the
        one-sided relation ``neighboring`` (``"remove_only"`` or ``"add_only"``; Zhu,
        Dong & Wang 2022), which is what autodp's characteristic-function representation
        reports; with the default ``phi_off=True`` it is accounted under add/remove (the
        worse of the two), and ``neighboring`` has no effect -- as in autodp, where it
        only selects the characteristic function. A non-default ``neighboring`` with
        ``phi_off=True`` raises an ``AutodpArgumentWarning``.
    RDP_off : bool
        No effect (the PLD accountant is used either way); ``True`` warns.
    neighboring : {"remove_only", "add_only"}
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
        if neighboring not in ("remove_only", "add_only"):
            raise ParameterValueError(
                f"neighboring must be 'remove_only' or 'add_only', got {neighboring!r}: "
                "pass one of them (one mechanism per side)"
            )
        ignored: dict[str, Any] = {"RDP_off": True} if RDP_off else {}
        if phi_off and neighboring != "remove_only":
            ignored["neighboring"] = neighboring
        warn_no_effect(
            "SubsampleGaussianMechanism",
            ignored,
            "with phi_off=True autodp (and this facade) account under add/remove, which "
            "covers both one-sided relations; pass phi_off=False to account under "
            "'neighboring' alone. RDP_off only switches autodp's RDP representation off "
            "(the PLD accountant is used either way)",
        )
        nb = "add_remove" if phi_off else neighboring
        if steps == 0 or prob == 0:
            self._set_description(NO_PRIVACY_LOSS)
        else:
            sigma = check_positive("sigma", as_float("sigma", params["sigma"]))
            base = subsample(Gaussian(sigma), prob, neighbouring=nb)
            self._set_description(compose(base, steps=steps))
        self.neighboring = nb


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


class ExponentialMechanism(Mechanism):
    """Exponential mechanism with pure-DP parameter ``eps`` (utility sensitivity
    normalised so that it is eps-DP).

    Described as :class:`~privlearn.accounting.PureDP` ``(eps)`` -- exact finite privacy
    loss distribution, composed exactly (Kairouz, Oh & Viswanath 2015) -- and, as in
    autodp, additionally as ``eps^2 / 8``-zCDP (Cesar & Rogers 2021, bounded range
    implies zCDP; RDP ``min(alpha eps^2 / 8, RDP of eps-DP)``); the facade reports the
    pointwise minimum of the two certified values.

    Parameters
    ----------
    eps : float >= 0
    RDP_off, phi_off, non_adaptive
        autodp's switches; set away from autodp's defaults they raise an
        ``AutodpArgumentWarning`` (no effect).
    name : str
    """

    def __init__(
        self,
        eps: Any,
        RDP_off: bool = False,  # noqa: N803
        phi_off: bool = True,
        non_adaptive: bool = False,
        name: str = "ExpMech",
    ) -> None:
        Mechanism.__init__(self)
        self.name = name
        e = check_nonnegative("eps", as_float("eps", eps))
        self.params = {"rho": e * e / 8.0, "xi": 0, "eps": eps}
        warn_no_effect(
            "ExponentialMechanism",
            non_default(
                {"RDP_off": RDP_off, "phi_off": phi_off, "non_adaptive": non_adaptive},
                {"RDP_off": False, "phi_off": True, "non_adaptive": False},
            ),
            "privlearn evaluates the exponential mechanism as exact eps-DP and as "
            "eps^2/8-zCDP, taking the smaller certified value",
        )
        self.delta0 = 0
        if e == 0:
            self._set_description(NO_PRIVACY_LOSS)
            return
        self._set_description(PureDP(e))
        pure_rdp = PureDP(e)
        rho = e * e / 8.0

        def rdp(alpha: float, rho: float = rho, pure: PureDP = pure_rdp) -> float:
            return min(rho * alpha, float(pure.rdp(alpha)))

        self._tighten_description(RDPMechanism(rdp, name=name, pure_epsilon=e))


class DiscreteGaussianMechanism(Mechanism):
    """Discrete Gaussian mechanism with scale ``sigma`` (per unit L2 sensitivity):
    ``1 / (2 sigma^2)``-zCDP (Canonne, Kamath & Steinke 2020, Theorem 14), evaluated
    with the RDP accountant, as autodp.

    Parameters
    ----------
    sigma : float > 0
    name : str
    """

    def __init__(self, sigma: Any, name: str = "DGM") -> None:
        Mechanism.__init__(self)
        self.name = name
        s = check_positive("sigma", as_float("sigma", sigma))
        self.params = {"rho": 0.5 / s / s, "xi": 0}
        rho = 0.5 / s / s

        def rdp(alpha: float, rho: float = rho) -> float:
            return rho * alpha

        self._set_description(RDPMechanism(rdp, name=name))


class NoisySGD_Mechanism(Mechanism):  # noqa: N801 (autodp's name)
    """``niter`` steps of the Gaussian mechanism (noise ``sigma``) on subsamples of rate
    ``prob``: ``compose(subsample(Gaussian(sigma), prob, scheme), steps=niter)``, the PLD
    accountant (Poisson sampling: add/remove; sampling without replacement:
    replace-one).

    Parameters
    ----------
    prob : float in (0, 1]
    sigma : float > 0
    niter : int >= 0 (a non-integer count is rounded up, which is conservative)
    PoissonSampling : bool
    name : str
    """

    def __init__(
        self,
        prob: Any,
        sigma: Any,
        niter: Any,
        PoissonSampling: bool = True,  # noqa: N803
        name: str = "NoisySGD",
    ) -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {"prob": prob, "sigma": sigma, "niter": niter,
                       "PoissonSampling": PoissonSampling}
        n = check_nonnegative("niter", as_float("niter", niter))
        steps = check_count("niter", math.ceil(n))
        q = check_nonnegative("prob", as_float("prob", prob))
        s = check_positive("sigma", as_float("sigma", sigma))
        if steps == 0 or q == 0:
            self._set_description(NO_PRIVACY_LOSS)
            return
        scheme = "poisson" if PoissonSampling else "fixed"
        self._set_description(compose(subsample(Gaussian(s), q, scheme=scheme), steps=steps))
        self.neighboring = "add_remove" if PoissonSampling else "replace_one"


class NoisyGD_Mechanism(GaussianMechanism):  # noqa: N801 (autodp's name)
    """Gradient descent with Gaussian noise multipliers ``sigma_list`` (one per step):
    exactly the Gaussian with ``(sum_i sigma_i^-2)^(-1/2)`` (Dong, Roth & Su 2022,
    Corollary 3.3).

    Parameters
    ----------
    sigma_list : array_like of floats > 0
    name : str
    """

    def __init__(self, sigma_list: Any, name: str = "NoisyGD") -> None:
        sig = np.asarray(sigma_list, dtype=float).reshape(-1)
        if sig.size == 0 or not np.all(np.isfinite(sig)) or np.any(sig <= 0):
            raise ParameterValueError(
                f"sigma_list must be a non-empty list of finite values in (0, inf), got "
                f"{sigma_list!r}: pass one positive noise multiplier per query"
            )
        GaussianMechanism.__init__(
            self, sigma=equivalent_gaussian_sigma([(float(x), 1.0) for x in sig]), name=name
        )
        self.params = {"sigma_list": sigma_list}


def _rdp_description(fn, params: dict, name: str) -> RDPMechanism:
    from privlearn.compat.autodp import rdp_bank

    f = getattr(rdp_bank, fn)
    f(params, 2.0)  # validates the parameters now, not at the first query

    frozen = dict(params)

    def rdp(alpha: float) -> float:
        return float(f(frozen, alpha))

    return RDPMechanism(rdp, name=name)


class NoisyScreenMechanism(Mechanism):
    """Noisy screening with data-dependent RDP (Zhu, Yu, Liang, Wang & Wang 2020,
    Private-kNN, CVPR, Theorem 7): ``params['logp']``, ``params['logq']`` are the log
    probabilities that the noisy maximum vote passes the threshold on the two datasets.
    Evaluated with the RDP accountant (:func:`~privlearn.compat.autodp.rdp_bank.
    RDP_noisy_screen`)."""

    def __init__(self, params: dict, name: str = "NoisyScreen") -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {"logp": params["logp"], "logq": params["logq"]}
        self._set_description(_rdp_description("RDP_noisy_screen", self.params, name))


class GaussianSVT_Mechanism(Mechanism):  # noqa: N801 (autodp's name)
    """The Gaussian sparse vector technique (Zhu & Wang 2020, NeurIPS): with
    ``rdp_c_1=True`` the cut-off-1 algorithm (Theorem 8 / Proposition 10; ``params``:
    ``sigma``, optional ``k``, ``sigma_nu`` or ``sigma2``, ``margin``, ``Delta``,
    ``gamma``), otherwise cut-off ``c > 1`` (Theorem 5; ``sigma``, ``k``, ``c``).
    Evaluated with the RDP accountant."""

    def __init__(self, params: dict, name: str = "GaussianSVT", rdp_c_1: bool = True) -> None:
        Mechanism.__init__(self)
        if rdp_c_1:
            self.name = name + "c_1"
            keys = ("sigma", "k", "margin", "sigma_nu", "Delta", "sigma2", "gamma")
            self.params = {kk: v for kk, v in params.items() if kk in keys}
            fn = "RDP_gaussian_svt_c1"
        else:
            self.name = name + "c>1"
            self.params = {"sigma": params["sigma"], "k": params["k"], "c": params["c"]}
            fn = "RDP_gaussian_svt_cgreater1"
        self._set_description(_rdp_description(fn, self.params, self.name))


class LaplaceSVT_Mechanism(Mechanism):  # noqa: N801 (autodp's name)
    """The Laplace sparse vector technique with cut-off ``c >= 1`` (Zhu & Wang 2020,
    Theorem 9; ``params``: ``b``, ``k``, ``c``). Evaluated with the RDP accountant.
    (autodp's default ``name`` for this class is ``'GaussianSVT'``; kept.)"""

    def __init__(self, params: dict, name: str = "GaussianSVT") -> None:
        Mechanism.__init__(self)
        self.name = name
        self.params = {kk: v for kk, v in params.items() if kk in ("b", "k", "c")}
        self._set_description(_rdp_description("RDP_svt_laplace", self.params, name))


class StageWiseMechanism(Mechanism):
    """The stage-wise, length-capped Gaussian sparse vector technique (Zhu & Wang 2020,
    Algorithm 3, Theorem 12; ``params``: ``sigma``, ``k``, ``c``, optional ``c_tilde``):
    an ``approxDP`` description from
    :func:`~privlearn.compat.autodp.dp_bank.get_eps_gaussian_svt` (optimal composition
    of the chunks, never looser than autodp's). With ``approxDP_off=True`` the mechanism
    has no description (as in autodp) and every query returns ``inf``."""

    def __init__(self, params: dict | None = None, approxDP_off: bool = False,  # noqa: N803
                 name: str = "StageWiseMechanism") -> None:
        Mechanism.__init__(self)
        self.name = name
        params = params or {}
        self.params = {"sigma": params["sigma"], "k": params["k"], "c": params["c"]}
        self.delta0 = 0
        if not approxDP_off:
            from privlearn.compat.autodp import dp_bank

            full = dict(params)
            self.propagate_updates(lambda d, full=full: dp_bank.get_eps_gaussian_svt(full, d),
                                   "approxDP_func")


def __getattr__(name: str) -> Any:
    from privlearn.compat.autodp._missing import missing

    raise missing("mechanism_zoo", name, __all__)
