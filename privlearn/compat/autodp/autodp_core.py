"""autodp-compatible core classes (``Mechanism``, ``Transformer``, ``Calibrator``).

A facade :class:`Mechanism` keeps autodp's user-facing vocabulary -- ``name``, ``params``,
``get_approxDP``, ``approxDP``, ``RenyiDP``, ``propagate_updates``,
``set_all_representation`` -- but holds an immutable privlearn mechanism *description*
(:mod:`privlearn.accounting.mechanisms`) instead of a dozen mutable callables. Every
number it reports comes from privlearn's accountants:

* compositions of (non-subsampled) Gaussians: the ``"analytic"`` accountant, exact
  (Balle & Wang 2018, Theorem 8; Dong, Roth & Su 2022, Corollary 3.3);
* anything else with a structured description: the ``"pld"`` accountant (certified upper
  bound from a pessimistic privacy-loss-distribution discretisation), falling back to
  ``"rdp"`` when PLD cannot evaluate part of the mechanism;
* mechanisms known only through a user-supplied RDP function: the ``"rdp"`` accountant.

Set ``mech.accountant = "rdp"`` (or any registered name) to force one accountant.

Notes
-----
Differences from autodp, deliberate:

* Values are certified upper bounds and are never larger than what autodp's RDP-based
  conversion reports for the same description (PLD is tighter than RDP), except for
  floating-point rounding *up* that certification requires.
* ``propagate_updates(f, "RDP")`` with ``f`` taken from another facade mechanism's
  ``RenyiDP`` recovers that mechanism's full description, so the tighter PLD accountant
  is still used; a user-written RDP function is wrapped in
  :class:`~privlearn.accounting.RDPMechanism` and evaluated with the RDP accountant.
* Invalid inputs raise :class:`ValueError` naming the parameter, not ``AssertionError``;
  unsupported representations (f-DP, characteristic functions, ...) raise
  :class:`NotImplementedError`.

References
----------
.. [1] Zhu, Dong & Wang (2022), Optimal Accounting of Differential Privacy via
       Characteristic Function, AISTATS (the autodp design this facade mirrors).
.. [2] Balle & Wang (2018), Improving the Gaussian Mechanism for Differential Privacy:
       Analytical Calibration and Optimal Denoising, ICML, Theorem 8.
.. [3] Dong, Roth & Su (2022), Gaussian Differential Privacy, JRSS-B, Corollary 3.3.
.. [4] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling: Tight
       Analyses via Couplings and Divergences, NeurIPS, Theorems 8 and 9.

Length: mirrors autodp's own ``autodp_core`` module one-to-one (same classes, same
methods) so that ported code keeps its imports; the computation lives in privlearn.accounting.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from privlearn._validation import check_delta, check_epsilon, check_real
from privlearn.accounting import Mechanism as PrivlearnMechanism
from privlearn.accounting import (
    PureDP,
    RDPMechanism,
    UnsupportedMechanismError,
)
from privlearn.accounting.registry import (
    combine_gaussians,
    equivalent_gaussian,
    pure_epsilon,
    supports,
)
from privlearn.errors import (
    AutodpArgumentWarning,
    ParameterTypeError,
    ParameterValueError,
)

__all__ = [
    "Mechanism",
    "Transformer",
    "Calibrator",
    "RenyiDPFunction",
    "NO_PRIVACY_LOSS",
    "as_float",
    "equivalent_gaussian_sigma",
    "AutodpArgumentWarning",
    "warn_no_effect",
    "pure_epsilon_of",
    "default_accountant",
]


def warn_no_effect(where: str, given: dict[str, Any], reason: str, stacklevel: int = 3) -> None:
    """Warn that the autodp arguments in ``given`` (name -> value, already filtered to the
    ones the caller set away from autodp's default) have no effect, and why."""
    if not given:
        return
    args = ", ".join(f"{k}={v!r}" for k, v in given.items())
    warnings.warn(
        f"{where}: {args} has no effect in privlearn's autodp facade: {reason}",
        AutodpArgumentWarning,
        stacklevel=stacklevel,
    )


def non_default(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that differ from autodp's ``defaults``."""
    return {k: v for k, v in values.items() if v != defaults[k]}


# ----------------------------------------------------------------------------------------
# helpers shared by the facade modules
# ----------------------------------------------------------------------------------------
def as_float(name: str, value: object) -> float:
    """``value`` as a Python float; accepts NumPy scalars and one-element arrays.

    Raises ``TypeError`` for non-numbers and ``ValueError`` for arrays of size != 1.
    """
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise ParameterValueError(
                f"{name} must be a scalar, got an array of shape {value.shape}: pass one "
                "number (e.g. float(x) or x.item())"
            )
        value = value.reshape(()).item()
    elif isinstance(value, np.generic):
        value = value.item()
    return check_real(name, value)


def equivalent_gaussian_sigma(sigmas_and_counts: list[tuple[float, float]]) -> float:
    """Noise multiplier of the single Gaussian equivalent to composing Gaussians
    ``sigma_i`` with (real, >= 0) coefficients ``c_i``: ``(sum_i c_i / sigma_i^2)^(-1/2)``
    (Dong, Roth & Su 2022, Corollary 3.3), rounded down; ``inf`` when every coefficient
    is 0. The shared :func:`privlearn.accounting.registry.combine_gaussians`.
    """
    return combine_gaussians(sigmas_and_counts)


class _NoPrivacyLoss:
    """Description of a mechanism that reveals nothing (autodp's ``prob == 0`` or
    ``coeff == 0``): it is (0, 0)-DP."""

    _instance: _NoPrivacyLoss | None = None

    def __new__(cls) -> _NoPrivacyLoss:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_PRIVACY_LOSS"


NO_PRIVACY_LOSS = _NoPrivacyLoss()

Description = PrivlearnMechanism | _NoPrivacyLoss | None


def pure_epsilon_of(mech: PrivlearnMechanism) -> float:
    """Certified pure-DP epsilon of a description (``inf`` when it has none): the shared
    :func:`privlearn.accounting.registry.pure_epsilon`, used by every accountant."""
    return pure_epsilon(mech)


def default_accountant(mech: PrivlearnMechanism) -> str:
    """The accountant the facade uses for ``mech``: ``"analytic"`` (exact) when it has an
    equivalent Gaussian (compositions of Gaussians), ``"pld"`` when every kind in it has a
    registered PLD pair, else ``"rdp"`` (e.g. a bare RDP function); see
    :mod:`privlearn.accounting.registry`."""
    if equivalent_gaussian(mech) is not None:
        return "analytic"
    if supports(mech, "pld_pair"):
        return "pld"
    return "rdp"


def evaluate_epsilon(mech: PrivlearnMechanism, delta: float, accountant: str | None) -> float:
    """Certified epsilon(delta) of a description, with the facade's accountant choice
    (``accountant=None``: :func:`default_accountant`, falling back from ``"pld"`` to
    ``"rdp"`` when PLD does not support part of the mechanism)."""
    if accountant is not None:
        return float(mech.epsilon(delta, accountant))
    acc = default_accountant(mech)
    try:
        return float(mech.epsilon(delta, acc))
    except UnsupportedMechanismError as err_pld:
        if acc != "pld":
            raise
        try:
            return float(mech.epsilon(delta, "rdp"))
        except UnsupportedMechanismError as err_rdp:
            raise UnsupportedMechanismError(
                f"neither the 'pld' ({err_pld}) nor the 'rdp' ({err_rdp}) accountant "
                f"can evaluate {mech!r}"
            ) from err_rdp


def evaluate_delta(mech: PrivlearnMechanism, epsilon: float, accountant: str | None) -> float:
    """Certified delta(epsilon) of a description (same accountant choice as
    :func:`evaluate_epsilon`)."""
    if accountant is not None:
        return float(mech.delta(epsilon, accountant))
    acc = default_accountant(mech)
    try:
        return float(mech.delta(epsilon, acc))
    except UnsupportedMechanismError:
        if acc != "pld":
            raise
        return float(mech.delta(epsilon, "rdp"))


def _tradeoff_curve(mech: PrivlearnMechanism, alphas: np.ndarray, accountant: str | None):
    """``privlearn.accounting.fdp.tradeoff_curve`` with the facade's accountant choice."""
    from privlearn.accounting.fdp import tradeoff_curve
    acc = accountant if accountant is not None else default_accountant(mech)
    if acc == "analytic":
        acc = "pld"  # (Gaussian compositions take the exact mu-GDP path before any accountant)
    try:
        grid = _epsilon_grid(mech, acc)
    except UnsupportedMechanismError:
        if accountant is not None or acc != "pld":
            raise
        acc = "rdp"
        grid = _epsilon_grid(mech, acc)
    return np.asarray(tradeoff_curve(mech, alphas, epsilons=grid, accountant=acc), dtype=float)


def _epsilon_grid(mech: PrivlearnMechanism, accountant: str) -> np.ndarray | None:
    """Grid of epsilons for the profile envelope: 200 points up to epsilon(delta) at the
    smallest delta in (1e-12, 1e-10, 1e-8, 1e-6) the accountant can certify, capped at
    700 (a shorter
    grid only loosens the envelope near fpr = 0; it stays a valid lower bound). ``None``
    (the default grid) for Gaussian compositions, which take the exact path."""
    if equivalent_gaussian(mech) is not None:
        return None
    err: Exception | None = None
    for d in (1e-12, 1e-10, 1e-8, 1e-6):
        try:
            top = float(mech.epsilon(d, accountant=accountant))
        except ArithmeticError as e:
            err = e
            continue
        if math.isfinite(top):
            # (epsilons above 700 only matter at fpr < e^-700; e^eps would overflow)
            top = min(top, 700.0)
            return np.concatenate([[0.0], top * np.linspace(0.0, 1.0, 201)[1:] ** 1.5])
    raise UnsupportedMechanismError(
        f"no finite certified epsilon at delta >= 1e-6 for {mech!r}: its privacy curve cannot "
        "be tabulated; give the mechanism more noise or an RDP or approxDP description"
    ) from err


class RenyiDPFunction:
    """Callable ``alpha -> eps_RDP(alpha)`` of a facade mechanism.

    It is what ``mech.RenyiDP`` returns. Besides being callable like autodp's RDP
    functions, it carries the privlearn description (:attr:`mechanism`), so that
    ``other.propagate_updates(mech.RenyiDP, "RDP")`` recovers the full description and
    the tighter PLD accountant keeps being used.

    Attributes
    ----------
    mechanism : privlearn Mechanism, NO_PRIVACY_LOSS or None
        The description (``None``: nothing known, the RDP bound is ``inf``).
    pure_epsilon : float
        A known pure-DP epsilon; RDP of every order is at most this (eps-DP implies
        (alpha, eps)-RDP for all alpha; Mironov 2017, Proposition 3).
    alternatives : tuple of privlearn Mechanism
        Further valid descriptions of the same mechanism (e.g. the exponential
        mechanism's ``eps^2 / 8``-zCDP next to its ``eps``-DP): the RDP reported is the
        pointwise minimum over all of them, as autodp's ``propagate_updates`` keeps it.
    """

    __slots__ = ("mechanism", "pure_epsilon", "alternatives")

    def __init__(self, mechanism: Description, pure_epsilon: float = math.inf,
                 alternatives: tuple[PrivlearnMechanism, ...] = ()) -> None:
        self.mechanism = mechanism
        self.pure_epsilon = pure_epsilon
        self.alternatives = tuple(alternatives)

    def __call__(self, alpha: Any) -> Any:
        scalar = np.ndim(alpha) == 0
        orders: Any = as_float("alpha", alpha) if scalar else np.asarray(alpha, float).tolist()
        if self.mechanism is NO_PRIVACY_LOSS:
            value: Any = 0.0 if scalar else np.zeros(len(orders))
        elif self.mechanism is None:
            value = math.inf if scalar else np.full(len(orders), math.inf)
        else:
            value = self.mechanism.rdp(orders)
        for alt in self.alternatives:
            try:
                value = np.minimum(value, alt.rdp(orders))
            except UnsupportedMechanismError:  # (an alternative without an RDP bound)
                continue
        if math.isfinite(self.pure_epsilon):
            value = np.minimum(value, self.pure_epsilon)
        return float(value) if scalar else np.asarray(value, float)

    def __repr__(self) -> str:
        return f"RenyiDPFunction({self.mechanism!r})"


# ----------------------------------------------------------------------------------------
# Mechanism
# ----------------------------------------------------------------------------------------
_SUPPORTED_UPDATES = ("RDP", "pureDP", "approxDP", "approxDP_func")


_INSTANCE_DEFAULTS: dict[str, Callable[[], Any]] = {
    "name": lambda: "generic",
    "params": dict,
    "accountant": lambda: None,
    "delta0": lambda: math.inf,
    "neighboring": lambda: "add_remove",
    "local_flag": lambda: False,
    "group_size": lambda: 1,
    "_mechanism": lambda: None,
    "_approxdp_bounds": list,
    "_alt_descriptions": list,
    "_pure_eps_bound": lambda: math.inf,
}
"""Defaults of :meth:`Mechanism.__init__`, for subclasses that do not call it."""


class Mechanism:
    """autodp-style mechanism backed by a privlearn description.

    Subclass it as in autodp: call ``Mechanism.__init__(self)``, set ``self.name`` and
    ``self.params``, build the mechanism with the zoo and transformers, then call
    ``self.set_all_representation(mech)`` or
    ``self.propagate_updates(mech.RenyiDP, type_of_update="RDP")``.

    Attributes
    ----------
    name : str
    params : dict
        The parameters (read by calibrators and by autodp-style user code).
    accountant : str or None
        Accountant forced for ``approxDP``/``approx_delta`` (``None``: automatic; see the
        module docstring).
    delta0 : float
        autodp's bookkeeping of the smallest delta with a finite epsilon (informational).
    neighboring : str
        ``"add_remove"`` (default) or ``"replace_one"``; read by
        :class:`~privlearn.compat.autodp.transformer_zoo.AmplificationBySampling`.
    """

    def __init__(self) -> None:
        self.name = "generic"
        self.params: dict[str, Any] = {}
        self.accountant: str | None = None
        self.delta0 = math.inf
        self.neighboring = "add_remove"
        self.local_flag = False
        self.group_size = 1
        self._mechanism: Description = None
        self._approxdp_bounds: list[Callable[[float], float]] = []
        self._alt_descriptions: list[PrivlearnMechanism] = []
        self._pure_eps_bound = math.inf

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a subclass that never called
        # Mechanism.__init__ (autodp's own tutorials do this and then call
        # set_all_representation) gets the defaults of __init__ on first use.
        factory = _INSTANCE_DEFAULTS.get(name)
        if factory is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = factory()
        object.__setattr__(self, name, value)
        return value

    @classmethod
    def from_privlearn(cls, mechanism: PrivlearnMechanism, name: str = "privlearn") -> Mechanism:
        """A facade mechanism wrapping a privlearn description (e.g. to hand a mechanism
        built with :mod:`privlearn.accounting` to autodp-style code)."""
        if not isinstance(mechanism, PrivlearnMechanism):
            raise ParameterTypeError(
                f"mechanism must be a privlearn Mechanism, got {mechanism!r}: build it with "
                "privlearn.accounting (e.g. Gaussian(sigma))"
            )
        out = cls()
        out.name = name
        out._set_description(mechanism)
        return out

    # -- the description ----------------------------------------------------------------
    @property
    def privlearn_mechanism(self) -> PrivlearnMechanism | None:
        """The privlearn description (``None`` if there is none or it reveals nothing)."""
        m = self._mechanism
        return m if isinstance(m, PrivlearnMechanism) else None

    def _set_description(self, mech: Description) -> None:
        """Internal: make ``mech`` the description (used by the zoo and transformers)."""
        if mech is not None and mech is not NO_PRIVACY_LOSS:
            if not isinstance(mech, PrivlearnMechanism):
                raise ParameterTypeError(
                    f"description must be a privlearn Mechanism, got {mech!r}: build it "
                    "with privlearn.accounting (e.g. Gaussian(sigma))"
                )
        self._mechanism = mech

    def _tighten_description(self, mech: Description) -> None:
        """Combine a second valid description with the current one (pointwise minimum,
        as autodp's ``propagate_updates`` does): the structured one stays primary; the
        other contributes its epsilon(delta) as an extra upper bound."""
        cur = self._mechanism
        if mech is None or mech == cur:
            return
        if cur is None or mech is NO_PRIVACY_LOSS:
            self._mechanism = mech
            return
        if cur is NO_PRIVACY_LOSS:
            return
        if not supports(cur, "pld_pair") and supports(mech, "pld_pair"):
            primary, secondary = mech, cur
        else:
            primary, secondary = cur, mech
        self._mechanism = primary
        acc = self.accountant
        self._approxdp_bounds.append(lambda d, m=secondary: evaluate_epsilon(m, d, acc))
        if isinstance(secondary, PrivlearnMechanism):
            # kept so that transformers can carry it through (Composition composes the
            # alternative descriptions too and keeps the smaller epsilon)
            self._alt_descriptions.append(secondary)

    def _description_for(self, what: str) -> PrivlearnMechanism | _NoPrivacyLoss:
        """The description, or a clear error if this mechanism cannot be transformed."""
        m = self._mechanism
        if m is None:
            if math.isfinite(self._pure_eps_bound):
                return PureDP(self._pure_eps_bound) if self._pure_eps_bound > 0 else NO_PRIVACY_LOSS
            raise NotImplementedError(
                f"{what}: mechanism {self.name!r} has no privlearn description (it was built "
                "only from 'approxDP'/'approxDP_func' updates, or not at all). Build it from "
                "the mechanism_zoo, or give it an RDP function with "
                "propagate_updates(func, 'RDP')."
            )
        return m

    # -- autodp representations ---------------------------------------------------------
    @property
    def eps_pureDP(self) -> float:
        """Pure-DP epsilon (``inf`` if the mechanism has none)."""
        m = self._mechanism
        if m is NO_PRIVACY_LOSS:
            return 0.0
        from_desc = pure_epsilon_of(m) if isinstance(m, PrivlearnMechanism) else math.inf
        return min(from_desc, self._pure_eps_bound)

    @eps_pureDP.setter
    def eps_pureDP(self, value: float) -> None:  # noqa: N802
        v = as_float("eps_pureDP", value)
        if math.isnan(v) or v < 0:
            raise ParameterValueError(
                f"eps_pureDP must be in [0, inf], got {value!r}: pass a non-negative "
                "epsilon (inf: no pure-DP bound)"
            )
        self._pure_eps_bound = v

    @property
    def RenyiDP(self) -> RenyiDPFunction:  # noqa: N802 (autodp's name)
        """RDP function ``alpha -> eps_RDP(alpha)`` carrying this mechanism's description."""
        return RenyiDPFunction(self._mechanism, self._pure_eps_bound,
                               tuple(self._alt_descriptions))

    @RenyiDP.setter
    def RenyiDP(self, func: Callable[[float], float]) -> None:  # noqa: N802
        # autodp semantics of direct assignment: replace the RDP representation.
        self._mechanism = None
        self._approxdp_bounds = []
        self.propagate_updates(func, "RDP")

    def approxDP(self, delta: float) -> float:  # noqa: N802 (autodp's name)
        """Certified epsilon such that the mechanism is (epsilon, delta)-DP.

        The minimum of the description's epsilon (accountant chosen as in the module
        docstring), of any extra bounds given through ``propagate_updates`` and of the
        pure-DP epsilon. ``inf`` when nothing is known.
        """
        delta = check_delta("delta", as_float("delta", delta), allow_one=True)
        m = self._mechanism
        if m is NO_PRIVACY_LOSS or delta == 1.0:  # every mechanism is (0, 1)-DP (as autodp)
            return 0.0
        bounds = [self.eps_pureDP]
        if isinstance(m, PrivlearnMechanism):
            bounds.append(evaluate_epsilon(m, delta, self.accountant))
        for f in self._approxdp_bounds:
            v = float(f(delta))
            if math.isnan(v):
                raise ParameterValueError(
                    f"func (an approxDP bound of {self.name!r}) must return a number in "
                    f"[0, inf], got nan at delta={delta}: fix the function, or return inf "
                    "where it has no bound"
                )
            bounds.append(v)
        return float(min(bounds))

    def approx_delta(self, eps: float) -> float:
        """Certified delta such that the mechanism is (eps, delta)-DP (1.0 if unknown)."""
        eps = check_epsilon("eps", as_float("eps", eps))
        m = self._mechanism
        if m is NO_PRIVACY_LOSS or eps >= self.eps_pureDP:
            return 0.0
        if isinstance(m, PrivlearnMechanism):
            return evaluate_delta(m, eps, self.accountant)
        return 1.0

    def get_approxDP(self, delta: float) -> float:  # noqa: N802
        """Epsilon as a function of delta (see :meth:`approxDP`)."""
        return self.approxDP(delta)

    def get_approx_delta(self, eps: float) -> float:
        """Delta as a function of epsilon (see :meth:`approx_delta`)."""
        return self.approx_delta(eps)

    def get_RDP(self, alpha: float) -> float:  # noqa: N802
        """RDP epsilon at order ``alpha``."""
        return self.RenyiDP(alpha)

    def get_pureDP(self) -> float:  # noqa: N802
        return self.eps_pureDP

    def get_eps(self, delta: float) -> float:
        """The smallest epsilon over all representations (as in autodp)."""
        return float(min(self.get_pureDP(), self.get_approxDP(delta)))

    def fDP(self, fpr: Any) -> Any:  # noqa: N802 (autodp's name)
        """Trade-off function: the smallest false negative rate (type II error) of any
        test of this mechanism's neighbouring outputs at false positive rate ``fpr``
        (f-DP; Dong, Roth & Su 2022, Definition 2.3). Scalar or array ``fpr`` in [0, 1].

        Exact for Gaussians and their compositions (``mu``-GDP); otherwise the lower
        envelope of the certified privacy profile (never above the true curve), and at
        least the pure-DP curve ``max(0, 1 - e^eps fpr, e^-eps (1 - fpr))`` when a pure
        epsilon is known. Computed by ``privlearn.accounting.fdp.tradeoff_curve``.
        """
        scalar = np.ndim(fpr) == 0
        a = np.asarray(fpr, dtype=float).reshape(-1)
        if a.size == 0 or not np.all((a >= 0) & (a <= 1)):
            raise ParameterValueError(
                f"fpr must be in [0, 1] (false positive rates), got {fpr!r}: pass values "
                "in [0, 1], e.g. np.linspace(0, 1, 101)"
            )
        f = self._tradeoff(a)
        return float(f[0]) if scalar else f.reshape(np.shape(fpr))

    def get_fDP(self, fpr: Any) -> Any:  # noqa: N802
        """See :meth:`fDP`."""
        return self.fDP(fpr)

    def plot_fDP(self, length: int = 101) -> tuple[np.ndarray, np.ndarray]:  # noqa: N802
        """``(fpr_list, fnr_list)`` on ``length`` equally spaced false positive rates in
        [0, 1] (as autodp), for plotting the trade-off curve."""
        fpr_list = np.linspace(0.0, 1.0, int(length))
        return fpr_list, self._tradeoff(fpr_list)

    def _tradeoff(self, alphas: np.ndarray) -> np.ndarray:
        m = self._mechanism
        if m is NO_PRIVACY_LOSS:
            return 1.0 - alphas
        f = np.zeros_like(alphas)
        e = self.eps_pureDP
        if math.isfinite(e):  # an eps-DP mechanism is f_eps-DP (Dong, Roth & Su, Prop 2.5)
            with np.errstate(over="ignore", invalid="ignore"):
                lin = np.where(alphas > 0, 1.0 - np.exp(e) * alphas, 1.0)
            f = np.maximum(0.0, np.maximum(lin, math.exp(-e) * (1.0 - alphas)))
        if isinstance(m, PrivlearnMechanism):
            f = np.maximum(f, _tradeoff_curve(m, alphas, self.accountant))
        return f

    def approxRDP(self, delta: float, alpha: float) -> float:  # noqa: N802
        raise NotImplementedError("approximate RDP is not provided by privlearn's autodp facade")

    def get_approxRDP(self, delta: float, alpha: float) -> float:  # noqa: N802
        return self.approxRDP(delta, alpha)

    # -- updates ----------------------------------------------------------------------
    def propagate_updates(
        self,
        func: Any,
        type_of_update: str,
        delta0: float = 0,
        BBGHS_conversion: bool = True,  # noqa: N803 (autodp's name; warns if changed)
        fDP_based_conversion: bool = False,  # noqa: N803
        n_quad: int = 700,
    ) -> None:
        """Add a privacy characterisation (autodp semantics: the pointwise minimum of all
        characterisations is reported).

        Parameters
        ----------
        func
            * ``"RDP"``: a callable ``alpha -> eps``. A :class:`RenyiDPFunction` (another
              facade mechanism's ``RenyiDP``) contributes that mechanism's full description;
              any other callable is wrapped in :class:`~privlearn.accounting.RDPMechanism`
              (evaluated with the RDP accountant).
            * ``"pureDP"``: a number eps >= 0.
            * ``"approxDP"``: a pair ``(eps, delta)``: epsilon is ``eps`` for every
              delta' >= delta (``inf`` below).
            * ``"approxDP_func"``: a callable ``delta -> eps`` that is a valid upper bound.
        type_of_update : {"RDP", "pureDP", "approxDP", "approxDP_func"}
            autodp's other kinds (f-DP, characteristic functions, cdf, pdf, approximate RDP)
            raise :class:`NotImplementedError`.
        delta0, BBGHS_conversion, fDP_based_conversion, n_quad
            Accepted for autodp compatibility; ``delta0`` is recorded; the others, when
            set away from autodp's defaults, raise an :class:`AutodpArgumentWarning`
            saying they have no effect (privlearn's conversions are always the tightest
            it has).
        """
        warn_no_effect(
            "propagate_updates",
            non_default(
                {
                    "BBGHS_conversion": BBGHS_conversion,
                    "fDP_based_conversion": fDP_based_conversion,
                    "n_quad": n_quad,
                },
                {"BBGHS_conversion": True, "fDP_based_conversion": False, "n_quad": 700},
            ),
            "privlearn converts every representation with its tightest certified accountant "
            "(PLD; for RDP-only mechanisms the conversion of Canonne, Kamath & Steinke 2020 "
            "and Balle et al. 2020), "
            "whatever conversion autodp would have chosen",
        )
        if type_of_update == "RDP":
            if isinstance(func, RenyiDPFunction):
                self._tighten_description(func.mechanism)
                for alt in func.alternatives:
                    self._tighten_description(alt)
                if math.isfinite(func.pure_epsilon):
                    self._pure_eps_bound = min(self._pure_eps_bound, func.pure_epsilon)
            elif callable(func):
                self._tighten_description(RDPMechanism(func, name=str(self.name)))
            else:
                raise ParameterTypeError(
                    f"func must be callable for type_of_update='RDP', got {func!r}: pass "
                    "a function alpha -> RDP epsilon"
                )
        elif type_of_update == "pureDP":
            eps = check_epsilon("eps", as_float("eps", func))
            self._pure_eps_bound = min(self._pure_eps_bound, eps)
            if self._mechanism is None:
                self._mechanism = PureDP(eps) if eps > 0 else NO_PRIVACY_LOSS
            self.delta0 = 0
        elif type_of_update == "approxDP":
            try:
                eps_raw, delta_raw = func
            except (TypeError, ValueError):
                raise ParameterValueError(
                    f"func must be a pair (eps, delta) for type_of_update='approxDP', got "
                    f"{func!r}: pass e.g. (1.0, 1e-5), or type_of_update='approxDP_func' "
                    "for a function delta -> eps"
                ) from None
            eps = check_epsilon("eps", as_float("eps", eps_raw))
            dlt = check_delta("delta", as_float("delta", delta_raw))
            self._approxdp_bounds.append(lambda d: eps if d >= dlt else math.inf)
            self.delta0 = min(self.delta0, dlt)
        elif type_of_update == "approxDP_func":
            if not callable(func):
                raise ParameterTypeError(
                    f"func must be callable for type_of_update='approxDP_func', got "
                    f"{func!r}: pass a function delta -> eps, or type_of_update='approxDP' "
                    "with a pair (eps, delta)"
                )
            self._approxdp_bounds.append(func)
            self.delta0 = min(self.delta0, float(delta0))
        else:
            raise NotImplementedError(
                f"type_of_update={type_of_update!r} is not supported by privlearn's autodp "
                f"facade; supported: {', '.join(repr(s) for s in _SUPPORTED_UPDATES)}"
            )

    def set_all_representation(self, mech: Mechanism) -> None:
        """Copy every privacy representation of ``mech`` (not its name or params)."""
        if not isinstance(mech, Mechanism):
            raise ParameterTypeError(
                "mech: set_all_representation expects a privlearn.compat.autodp Mechanism, "
                f"got {type(mech).__name__}: pass a mechanism of mechanism_zoo (e.g. "
                "GaussianMechanism(sigma))"
            )
        self._mechanism = mech._mechanism
        self._approxdp_bounds = list(mech._approxdp_bounds)
        self._alt_descriptions = list(mech._alt_descriptions)
        self._pure_eps_bound = mech._pure_eps_bound
        self.delta0 = mech.delta0
        self.neighboring = mech.neighboring
        if mech.accountant is not None:
            self.accountant = mech.accountant
        if "approxDP" in vars(mech):  # autodp-style direct assignment on the source
            self.approxDP = mech.approxDP  # type: ignore[method-assign]

    # -- plotting helper (as autodp) ---------------------------------------------------
    def plot_RDP(self, alphamax: float = 101, length: int = 101):  # noqa: N802
        """Orders in (1, alphamax] and the RDP values there (for plotting)."""
        alpha_list = np.linspace(1.0, alphamax, length)[1:]
        return alpha_list, np.asarray(self.RenyiDP(alpha_list), float)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} mechanism={self._mechanism!r}>"


class Transformer:
    """A callable that maps mechanism(s) to a mechanism (composition, subsampling)."""

    def __init__(self) -> None:
        self.name = "generic_transformer"
        self.unary_operator = False
        self.preprocessing = False
        self.transform: Callable[..., Mechanism] = lambda x: x

    def __call__(self, *args: Any, **kwargs: Any) -> Mechanism:
        return self.transform(*args, **kwargs)


class Calibrator:
    """A callable that chooses a mechanism's parameter to meet a privacy budget."""

    def __init__(self) -> None:
        self.name = "generic_calibrator"
        self.eps_budget = math.inf
        self.delta_budget = 1.0
        self.calibrate: Callable[..., Any] = lambda x: x

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.calibrate(*args, **kwargs)
