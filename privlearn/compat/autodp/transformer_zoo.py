"""autodp-compatible ``transformer_zoo``: composition and amplification by sampling.

Transformers map facade mechanisms to a facade mechanism whose privlearn description is
built with :func:`privlearn.accounting.compose` / :func:`privlearn.accounting.subsample`;
names and ``params`` follow autodp's bookkeeping.

Notes
-----
Real (non-integer) coefficients: autodp composes RDP curves, so a coefficient may be any
real ``c >= 0``. Here:

* a Gaussian part with coefficient ``c`` is the Gaussian ``sigma / sqrt(c)`` (exact;
  Dong, Roth & Su 2022, Corollary 3.3) -- this is what the studies' calibrators rely on;
* any other part with a non-integer coefficient is composed ``ceil(c)`` times, which is
  conservative (more compositions never reduce epsilon); a :class:`UserWarning` says so.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

from privlearn._validation import check_nonnegative, check_rate
from privlearn.accounting import Composed, compose, subsample
from privlearn.accounting import Mechanism as PrivlearnMechanism
from privlearn.accounting.mechanisms import Gaussian
from privlearn.accounting.registry import doubles_on_replace_one, equivalent_gaussian, scaled
from privlearn.compat.autodp.autodp_core import (
    NO_PRIVACY_LOSS,
    Mechanism,
    Transformer,
    as_float,
    equivalent_gaussian_sigma,
    non_default,
    warn_no_effect,
)
from privlearn.compat.autodp.mechanism_zoo import ExactGaussianMechanism
from privlearn.errors import ParameterTypeError, ParameterValueError

_COMPOSE_DEFAULTS = {
    "RDP_compose_only": True,
    "BBGHS_conversion": True,
    "fDP_based_conversion": False,
}
_COMPOSE_REASON = (
    "privlearn composes the mechanisms' structured descriptions with its tightest certified "
    "accountant (exact for Gaussians and pure DP / randomized response, PLD otherwise), "
    "whatever composition and RDP conversion autodp would have chosen"
)


def _warn_compose_switches(where: str, **switches: Any) -> None:
    warn_no_effect(where, non_default(switches, _COMPOSE_DEFAULTS), _COMPOSE_REASON, stacklevel=5)


__all__ = [
    "Composition",
    "ComposeAFA",
    "ComposeGaussian",
    "AmplificationBySampling",
    "AmplificationBySampling_pld",
]


def _check_lists(mechanism_list: Sequence[Any], coeff_list: Sequence[Any]) -> list[float]:
    mechanism_list, coeff_list = list(mechanism_list), list(coeff_list)
    if len(mechanism_list) != len(coeff_list):
        raise ParameterValueError(
            f"coeff_list must have one entry per mechanism ({len(mechanism_list)}), "
            f"got {len(coeff_list)}: pass one composition count per mechanism"
        )
    for i, m in enumerate(mechanism_list):
        if not isinstance(m, Mechanism):
            raise ParameterTypeError(
                f"mechanism_list[{i}] must be a privlearn.compat.autodp Mechanism, "
                f"got {type(m).__name__}: pass mechanisms of mechanism_zoo"
            )
    return [
        check_nonnegative(f"coeff_list[{i}]", as_float(f"coeff_list[{i}]", c))
        for i, c in enumerate(coeff_list)
    ]


def _update_name(mechanism_list: Sequence[Mechanism], coeff_list: Sequence[Any]) -> str:
    s = ", ".join(f"{m.name}: {c}" for m, c in zip(mechanism_list, coeff_list, strict=True))
    return "Compose:{" + s + "}"


def _update_params(mechanism_list: Sequence[Mechanism]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for m in mechanism_list:
        params.update({f"{m.name}:{k}": v for k, v in m.params.items()})
    return params


class Composition(Transformer):
    """Adaptive composition of mechanisms, each repeated ``coeff`` times.

    ``Composition()([m1, m2], [k1, k2])`` returns a facade mechanism describing
    ``compose([m1, m2], steps=[k1, k2])``; it is evaluated with the PLD accountant (or
    exactly when every part is Gaussian). See the module docstring for real
    coefficients.

    References
    ----------
    Dwork, Rothblum & Vadhan (2010), Boosting and Differential Privacy (adaptive
    composition); Koskela, Jalko & Honkela (2020) and Gopi, Lee & Wutschitz (2021)
    (numerical PLD composition, implemented in :mod:`privlearn.accounting.pld`).
    """

    def __init__(self) -> None:
        Transformer.__init__(self)
        self.name = "Composition"
        self.transform = self.compose

    def compose(
        self,
        mechanism_list: Sequence[Mechanism],
        coeff_list: Sequence[Any],
        RDP_compose_only: bool = True,  # noqa: N803 (autodp's names)
        BBGHS_conversion: bool = True,  # noqa: N803
        fDP_based_conversion: bool = False,  # noqa: N803
    ) -> Mechanism:
        """Compose ``mechanism_list[i]`` ``coeff_list[i]`` times each.

        ``RDP_compose_only``, ``BBGHS_conversion`` and ``fDP_based_conversion`` select
        autodp's composition/conversion route; they cannot change a value here, and set
        away from autodp's defaults they raise an ``AutodpArgumentWarning`` saying so.
        """
        _warn_compose_switches(
            "Composition",
            RDP_compose_only=RDP_compose_only,
            BBGHS_conversion=BBGHS_conversion,
            fDP_based_conversion=fDP_based_conversion,
        )
        coeffs = _check_lists(mechanism_list, coeff_list)
        mechs: list[PrivlearnMechanism] = []
        counts: list[int] = []
        rounded: list[str] = []
        for m, c in zip(mechanism_list, coeffs, strict=True):
            if c == 0:
                continue
            d = m._description_for("Composition")
            if d is NO_PRIVACY_LOSS:
                continue
            if float(c).is_integer():
                mechs.append(d)
                counts.append(int(c))
                continue
            sigma = equivalent_gaussian(d)
            if sigma is not None:  # exact for Gaussians: sigma / sqrt(c)
                mechs.append(Gaussian(equivalent_gaussian_sigma([(sigma, c)])))
                counts.append(1)
            else:
                mechs.append(d)
                counts.append(math.ceil(c))
                rounded.append(f"{m.name}: {c} -> {math.ceil(c)}")
        if rounded:
            warnings.warn(
                "Composition: non-integer coefficients of non-Gaussian mechanisms rounded up "
                "(conservative): " + "; ".join(rounded),
                UserWarning,
                stacklevel=3,
            )
        newmech = Mechanism()
        newmech._set_description(compose(mechs, steps=counts) if mechs else NO_PRIVACY_LOSS)
        # parts with an alternative description (e.g. the exponential mechanism: pure DP
        # and zCDP) are also composed through it; the smaller certified epsilon is kept
        alts, alt_counts, used = [], [], False
        for m, c in zip(mechanism_list, coeffs, strict=True):
            if c == 0 or m._description_for("Composition") is NO_PRIVACY_LOSS:
                continue
            alt = m._alt_descriptions[0] if m._alt_descriptions else None
            if alt is not None and float(c).is_integer():
                alts.append(alt)
                used = True
            else:
                alts.append(m._description_for("Composition"))
                if not float(c).is_integer():
                    used = False
                    break
            alt_counts.append(int(c))
        if used and len(alts) == len(mechs):
            newmech._tighten_description(compose(alts, steps=alt_counts))
        newmech.delta0 = max((m.delta0 for m in mechanism_list), default=0)
        newmech.name = _update_name(mechanism_list, coeff_list)
        newmech.params = _update_params(mechanism_list)
        return newmech


class ComposeAFA(Composition):
    """autodp's characteristic-function composition; here identical to
    :class:`Composition` (privlearn's default accountant is already PLD-based)."""

    def __init__(self) -> None:
        Composition.__init__(self)
        self.name = "ComposeFourier"


class ComposeGaussian(Composition):
    """Composition of Gaussian mechanisms only, with real coefficients ``c_i >= 0``.

    Returns an :class:`~privlearn.compat.autodp.mechanism_zoo.ExactGaussianMechanism`
    with ``sigma = (sum_i c_i / sigma_i^2)^(-1/2)``, exactly equivalent (Dong, Roth & Su
    2022, Corollary 3.3); rounded down by a few ulps (conservative). Every mechanism must
    be a Gaussian or a composition of Gaussians (e.g. the result of an earlier
    ``ComposeGaussian``), else ``TypeError``.
    """

    def __init__(self) -> None:
        Composition.__init__(self)
        self.name = "ComposeGaussian"

    def compose(
        self,
        mechanism_list: Sequence[Mechanism],
        coeff_list: Sequence[Any],
        RDP_compose_only: bool = True,  # noqa: N803
        BBGHS_conversion: bool = True,  # noqa: N803
        fDP_based_conversion: bool = False,  # noqa: N803
    ) -> Mechanism:
        _warn_compose_switches(
            "ComposeGaussian",
            RDP_compose_only=RDP_compose_only,
            BBGHS_conversion=BBGHS_conversion,
            fDP_based_conversion=fDP_based_conversion,
        )
        coeffs = _check_lists(mechanism_list, coeff_list)
        pairs: list[tuple[float, float]] = []
        for i, (m, c) in enumerate(zip(mechanism_list, coeffs, strict=True)):
            d = m._description_for("ComposeGaussian")
            if d is NO_PRIVACY_LOSS:
                continue
            sigma = equivalent_gaussian(d)
            if sigma is None:
                raise ParameterTypeError(
                    f"ComposeGaussian composes only Gaussian mechanisms; mechanism_list[{i}] "
                    f"({m.name!r}) is {d!r}. Use Composition()."
                )
            pairs.append((sigma, c))
        sigma_eff = equivalent_gaussian_sigma(pairs)
        if math.isinf(sigma_eff):
            newmech = Mechanism()
            newmech._set_description(NO_PRIVACY_LOSS)
        else:
            newmech = ExactGaussianMechanism(sigma=sigma_eff)
        newmech.name = _update_name(mechanism_list, coeff_list)
        newmech.params = _update_params(mechanism_list)
        return newmech


def _stated_under_replace_one(d: PrivlearnMechanism) -> PrivlearnMechanism:
    """The privlearn description of a base whose autodp guarantee is stated under
    replace-one (``mechanism.neighboring = "replace_one"``): autodp's Gaussian(sigma) then
    has Renyi curve ``alpha / (2 sigma^2)`` between replace-one neighbours, i.e. unit
    sensitivity under replace-one, which privlearn (noise relative to the add/remove bound
    ``C``, doubled under replace-one) describes as ``Gaussian(2 sigma)``; likewise
    Laplace. Kinds that state their own epsilon for the relation (PureDP, randomized
    response) are unchanged."""
    if doubles_on_replace_one(d):
        return scaled(d, 0.5)
    return d


class AmplificationBySampling(Transformer):
    """Privacy amplification by subsampling.

    Parameters
    ----------
    PoissonSampling : bool
        True (default): Poisson sampling with inclusion probability ``prob``, guarantee
        under add/remove-one. False: a fixed-size batch of ``prob * n`` records drawn
        without replacement, guarantee under replace-one (as autodp).

    Calling it as ``(mechanism, prob)`` returns the facade of
    ``subsample(mechanism, prob, scheme)``. ``improved_bound_flag`` (either value) raises
    an ``AutodpArgumentWarning`` saying it has no effect: privlearn's accountants always
    use the tight amplification analysis of the dominating pair (Zhu, Dong & Wang 2022)
    for PLD and the tightest valid RDP bound they have (Mironov, Talwar & Zhang 2019;
    Zhu & Wang 2019; Wang, Balle & Kasiviswanathan 2019) for RDP -- valid for every base
    mechanism, so autodp's "if qualified" condition does not arise.

    A composition of Gaussians run on one subsample is subsampled as its equivalent
    single Gaussian (exact). Subsampling any other composition raises
    ``NotImplementedError`` (subsample each step, then compose).
    """

    def __init__(self, PoissonSampling: bool = True) -> None:  # noqa: N803
        Transformer.__init__(self)
        self.name = "PoissonSample" if PoissonSampling else "Subsample"
        self.PoissonSampling = PoissonSampling
        self.unary_operator = True
        self.preprocessing = True
        self.transform = self.amplify

    def amplify(
        self, mechanism: Mechanism, prob: Any, improved_bound_flag: bool | None = None
    ) -> Mechanism:
        if improved_bound_flag is not None:
            warn_no_effect(
                "AmplificationBySampling",
                {"improved_bound_flag": improved_bound_flag},
                "privlearn always uses its tightest valid amplification bound (the tight "
                "dominating-pair analysis for PLD; Mironov, Talwar & Zhang 2019 / Zhu & Wang "
                "2019 / Wang, Balle & Kasiviswanathan 2019 for RDP), for every base mechanism",
                stacklevel=4,
            )
        return self._amplify(mechanism, prob, None)

    def _amplify(self, mechanism: Mechanism, prob: Any, one_sided: str | None) -> Mechanism:
        if not isinstance(mechanism, Mechanism):
            raise ParameterTypeError(
                "mechanism must be a privlearn.compat.autodp Mechanism, got "
                f"{type(mechanism).__name__}: pass a mechanism of mechanism_zoo"
            )
        rate = as_float("prob", prob)
        if rate != 0.0:
            rate = check_rate("prob", rate)
        if self.PoissonSampling and mechanism.neighboring == "replace_one":
            raise ParameterValueError(
                "mechanism.neighboring must be 'add_remove' for Poisson sampling, got "
                "'replace_one' (no conversion exists without a dummy record)"
            )
        newmech = Mechanism()
        d = mechanism._description_for("AmplificationBySampling")
        if rate == 0.0 or d is NO_PRIVACY_LOSS:
            newmech._set_description(NO_PRIVACY_LOSS)
        else:
            if isinstance(d, Composed):
                sigma = equivalent_gaussian(d)
                if sigma is not None:
                    d = Gaussian(sigma)
                elif len(d.parts) == 1 and d.parts[0][1] == 1:
                    d = d.parts[0][0]
                else:
                    raise NotImplementedError(
                        "AmplificationBySampling: subsampling a composition of non-Gaussian "
                        "mechanisms that share one subsample is not supported; subsample each "
                        "step, then compose"
                    )
            if not self.PoissonSampling and mechanism.neighboring == "replace_one":
                d = _stated_under_replace_one(d)
            scheme = "poisson" if self.PoissonSampling else "fixed"
            newmech._set_description(subsample(d, rate, scheme=scheme, neighbouring=one_sided))
        if one_sided is not None:
            newmech.neighboring = one_sided
        else:
            newmech.neighboring = "add_remove" if self.PoissonSampling else "replace_one"
        # bookkeeping as autodp
        key, num, newname = f"{self.name}_{prob}", 0, self.name
        while key in mechanism.params:
            num += 1
            newname = f"{self.name}{num}"
            key = f"{newname}_{prob}"
        newmech.name = f"{newname}:{mechanism.name}"
        newmech.params = dict(mechanism.params)
        newmech.params[newname] = prob
        return newmech


class AmplificationBySampling_pld(AmplificationBySampling):  # noqa: N801 (autodp's name)
    """autodp's PLD amplification transformer: Poisson subsampling under a one-sided
    neighbouring relation.

    ``neighboring="remove_only"`` accounts the pair ``((1-q) Q + q P, Q)`` and
    ``"add_only"`` the pair ``(Q, (1-q) Q + q P)`` (Zhu, Dong & Wang 2022, Theorem 9 and
    Section 5), i.e. :class:`privlearn.accounting.Neighbouring` ``REMOVE_ONLY`` /
    ``ADD_ONLY``. Each is weaker than the add/remove guarantee of
    :class:`AmplificationBySampling`, which is the pointwise maximum of the two (autodp's
    own recipe: ``max(add_only.approxDP(d), remove_only.approxDP(d))``).

    Raises
    ------
    ValueError
        ``neighboring`` not one of the two, ``PoissonSampling=False`` (autodp's rule is for
        Poisson sampling only), or a base mechanism whose relation is the opposite
        one-sided relation (as autodp's assertion).
    """

    def __init__(self, PoissonSampling: bool = True, neighboring: str = "add_only") -> None:  # noqa: N803
        if neighboring not in ("add_only", "remove_only"):
            raise ParameterValueError(
                f"neighboring must be 'add_only' or 'remove_only', got {neighboring!r}; use "
                "AmplificationBySampling for add/remove"
            )
        if not PoissonSampling:
            raise ParameterValueError(
                "PoissonSampling must be True for AmplificationBySampling_pld (one-sided "
                "relations are defined for Poisson sampling); use "
                "AmplificationBySampling(PoissonSampling=False) for sampling without "
                "replacement under replace-one"
            )
        AmplificationBySampling.__init__(self, PoissonSampling=True)
        self.neighboring = neighboring

    def amplify(self, mechanism: Mechanism, prob: Any) -> Mechanism:  # type: ignore[override]
        opposite = "remove_only" if self.neighboring == "add_only" else "add_only"
        if isinstance(mechanism, Mechanism) and mechanism.neighboring == opposite:
            raise ParameterValueError(
                f"mechanism.neighboring is {opposite!r}, incompatible with "
                f"neighboring={self.neighboring!r}: build the transformer with "
                f"neighboring={opposite!r}"
            )
        return self._amplify(mechanism, prob, self.neighboring)
