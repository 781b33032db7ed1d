"""autodp-compatible ``calibrator_zoo``: choose a parameter to meet an (eps, delta) budget.

Unlike autodp's calibrators, which minimise ``|eps - eps(x)|`` and may return a parameter
whose epsilon slightly *exceeds* the budget, these use
:func:`privlearn.accounting.calibrate` (bisection with the result on the feasible side):
the returned mechanism always has ``get_approxDP(delta) <= eps``, and is tight to the
relative tolerance ``rtol`` of the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from privlearn._validation import check_delta, check_positive
from privlearn.accounting import calibrate as _calibrate
from privlearn.accounting.analytic import gaussian_epsilon
from privlearn.compat.autodp.autodp_core import Calibrator, Mechanism, as_float
from privlearn.errors import (
    AutodpCalibrationError,
    CalibrationError,
    ParameterTypeError,
    ParameterValueError,
)

__all__ = ["eps_delta_calibrator", "generalized_eps_delta_calibrator", "ana_gaussian_calibrator"]


class _Evaluated:
    """Adapter giving a facade mechanism the ``epsilon(delta, accountant)`` method that
    :func:`privlearn.accounting.calibrate` calls (the facade chooses its own accountant)."""

    __slots__ = ("mech",)

    def __init__(self, mech: Any) -> None:
        if not isinstance(mech, Mechanism):
            raise ParameterTypeError(
                "mech_class must return a privlearn.compat.autodp Mechanism, got "
                f"{type(mech).__name__}: pass a class of mechanism_zoo (e.g. "
                "GaussianMechanism) or a function params -> Mechanism"
            )
        self.mech = mech

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        return float(self.mech.get_approxDP(delta))


def _bounds(bounds: Any) -> tuple[float, float]:
    try:
        lo_raw, hi_raw = bounds
    except (TypeError, ValueError):
        raise ParameterValueError(
            f"bounds must be a pair [lower, upper], got {bounds!r}: pass e.g. [0, 100]"
        ) from None
    lo, hi = as_float("bounds[0]", lo_raw), as_float("bounds[1]", hi_raw)
    if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 <= lo < hi):
        raise ParameterValueError(
            f"bounds must satisfy 0 <= lower < upper < inf, got {bounds!r}: pass finite "
            "bounds, e.g. [0, 100]"
        )
    return lo, hi


def _search(
    build: Callable[[float], Any], eps: float, delta: float, bounds: Any, rtol: float
) -> float:
    """Largest/smallest feasible parameter in ``bounds`` (see
    :func:`privlearn.accounting.calibrate`).

    A lower bound of 0 (autodp's usual ``[0, hi]``) is not a valid parameter for most
    mechanisms (sigma = 0, zero compositions); it is replaced by ``hi * 1e-12``. If the
    accountant cannot evaluate the mechanism at the lower end (an ``ArithmeticError`` or
    a numerical ``ValueError``, e.g. epsilon beyond 1e12 for almost no noise, or 1e21
    compositions), the lower end is raised geometrically until it can. Such points are
    the no-privacy end of the range and are taken to be infeasible; the bisection itself
    never skips an error (it propagates).
    """
    target = check_positive("eps", as_float("eps", eps))
    delta = check_delta("delta", as_float("delta", delta))
    lo, hi = _bounds(bounds)
    if lo == 0.0:
        lo = hi * 1e-12

    def factory(x: float) -> _Evaluated:
        return _Evaluated(build(x))

    for _ in range(60):
        try:
            factory(lo).epsilon(delta)
            break
        except (ArithmeticError, ValueError):
            # the accountant's numerics fail for this extreme parameter (e.g. 1e21
            # compositions at lo = hi * 1e-12): raise the lower end
            lo = math.sqrt(lo * hi)
            if hi - lo <= rtol * hi:
                break
    try:
        return float(_calibrate(factory, target, delta, bounds=(lo, hi), rtol=rtol))
    except CalibrationError as e:
        # autodp's calibrators raise RuntimeError here; ported code may catch it
        raise AutodpCalibrationError(str(e)) from e


class eps_delta_calibrator(Calibrator):  # noqa: N801 (autodp's name)
    """Calibrate the single parameter of ``mech_class`` to an (eps, delta) budget.

    ``eps_delta_calibrator()(mech_class, eps, delta, [lo, hi], name=None)`` returns
    ``mech_class(x)`` (or ``mech_class(x, name=name)``) where ``x`` in ``[lo, hi]`` is the
    parameter on the feasible side of the budget, ``|x - x*| <= rtol * x``: the smallest
    feasible value when epsilon decreases in ``x`` (noise scales), the largest when it
    increases (numbers of compositions, sampling rates).

    Raises
    ------
    privlearn.errors.AutodpCalibrationError
        if no parameter in ``bounds`` meets the budget: a
        :class:`~privlearn.accounting.CalibrationError` (a ``ValueError``) and, as in
        autodp, a ``RuntimeError``.
    """

    def __init__(self, rtol: float = 1e-7) -> None:
        Calibrator.__init__(self)
        self.name = "eps_delta_calibrator"
        self.rtol = rtol
        self.calibrate = self.param_from_eps_delta

    def param_from_eps_delta(
        self,
        mech_class: Callable[..., Mechanism],
        eps: float,
        delta: float,
        bounds: Any,
        name: str | None = None,
    ) -> Mechanism:
        x = _search(mech_class, eps, delta, bounds, self.rtol)
        return mech_class(x, name=name) if name else mech_class(x)


class generalized_eps_delta_calibrator(eps_delta_calibrator):  # noqa: N801 (autodp's name)
    """Calibrate one named entry of a parameter dictionary.

    ``generalized_eps_delta_calibrator()(mech_class, eps, delta, bounds, params=None,
    para_name=None, name=None)``: with ``params`` (a dict holding the fixed parameters)
    and ``para_name`` (the key to tune), each candidate is ``mech_class({**params,
    para_name: x})``; without ``params``, as :class:`eps_delta_calibrator`. As in autodp,
    ``params[para_name]`` is set to the calibrated value in place and the returned
    mechanism is built from ``params`` itself (the search works on copies, so ``params``
    holds no intermediate value even if the search raises).
    """

    def __init__(self, rtol: float = 1e-7) -> None:
        super().__init__(rtol)
        self.name = "generalized_eps_delta_calibrator"

    def param_from_eps_delta(
        self,
        mech_class: Callable[..., Mechanism],
        eps: float,
        delta: float,
        bounds: Any,
        params: dict[str, Any] | None = None,
        para_name: str | None = None,
        name: str | None = None,
    ) -> Mechanism:
        if params is None:
            return eps_delta_calibrator(self.rtol)(mech_class, eps, delta, bounds, name=name)
        if para_name is None:
            raise ParameterValueError(
                "para_name must name the entry of params to calibrate, got None: pass "
                "e.g. para_name='sigma'"
            )

        def build(x: float) -> Mechanism:
            return mech_class({**params, para_name: x})

        x = _search(build, eps, delta, bounds, self.rtol)
        params[para_name] = x  # in place, as autodp
        return mech_class(params, name=name) if name else mech_class(params)


class ana_gaussian_calibrator(Calibrator):  # noqa: N801 (autodp's name)
    """Smallest Gaussian noise multiplier with epsilon(delta) <= eps, from the exact
    analytic curve (Balle & Wang 2018, Theorem 8 and Algorithm 1); returns
    ``mech_class(sigma)``. Rounded up (relative tolerance ``tol``)."""

    def __init__(self) -> None:
        Calibrator.__init__(self)
        self.name = "ana_gaussian_calibrator"
        self.calibrate = self.param_from_eps_delta

    def param_from_eps_delta(
        self,
        mech_class: Callable[..., Mechanism],
        eps: float,
        delta: float,
        name: str | None = None,
        tol: float = 1e-12,
    ) -> Mechanism:
        target = check_positive("eps", as_float("eps", eps))
        delta = check_positive("delta", check_delta("delta", as_float("delta", delta)))

        class _G:
            def __init__(self, s: float) -> None:
                self.s = s

            def epsilon(self, d: float, accountant: str | None = None) -> float:
                return gaussian_epsilon(self.s, d)

        sigma = float(_calibrate(_G, target, delta, rtol=max(tol, 1e-15)))
        return mech_class(sigma, name=name) if name else mech_class(sigma)
