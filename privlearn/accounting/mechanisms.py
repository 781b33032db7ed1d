"""Mechanisms as small immutable descriptions, and the transformers that combine them.

A mechanism object says *what ran* (a Gaussian with noise multiplier 1.1, subsampled at
rate q, composed T times); accountants (:mod:`privlearn.accounting.accountants`) say
*what it costs*. The description is separate from the arithmetic, so adding an accountant
requires no change here.

Compatibility contract: the public fields of these classes are never removed and never
change meaning; new optional fields may be added with defaults that keep old behaviour.

Conventions
-----------
* ``noise_multiplier`` of :class:`Gaussian` is the noise standard deviation divided by
  ``C``, and of :class:`Laplace` the Laplace scale ``b`` divided by ``C``, where ``C`` is
  the bound on one record's contribution -- the add/remove L2 (Gaussian) or L1 (Laplace)
  sensitivity, e.g. ``max_grad_norm`` in DP-SGD -- **whatever the neighbouring
  relation** (Google dp_accounting's convention). Under replace-one neighbouring a
  record's contribution can move from ``+c`` to ``-c``, i.e. by ``2 C``, and the
  accountants account for that: a Poisson-subsampled Gaussian under replace-one is
  analysed with the tight pair ``((1-q) N(0, s^2) + q N(1, s^2), (1-q) N(0, s^2) +
  q N(-1, s^2))`` (``s`` the noise multiplier, ``q`` the rate; at ``q = 1`` a Gaussian
  with sensitivity 2), and likewise Laplace with ``Lap(+-1)``; fixed-size sampling
  (without replacement) under replace-one with the base at sensitivity 2 (the batch that
  misses the record holds another in its place: ``(1-q) N(0, s^2) + q N(2, s^2)`` against
  ``N(0, s^2)`` is attained); the RDP accountant uses the base mechanism at sensitivity 2
  (Gaussian RDP ``2 alpha / s^2``). A bare (non-subsampled)
  :class:`Gaussian` or :class:`Laplace` is add/remove: sensitivity ``C``.
* :class:`PureDP` and :class:`RandomizedResponse` state their guarantee (epsilon, truth
  probability) for the neighbouring relation under which they are used; no factor is
  applied to them.
* Subsampling (:func:`subsample`) carries the neighbouring relation explicitly:
  add/remove-one (the default, natural for Poisson sampling) or replace-one (default for
  fixed-size sampling).

References
----------
.. [1] Dwork & Roth (2014), The Algorithmic Foundations of Differential Privacy.
.. [2] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling: Tight
       Analyses via Couplings and Divergences, NeurIPS.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

from privlearn._validation import (
    check_count,
    check_delta,
    check_enum,
    check_epsilon,
    check_positive,
    check_probability,
    check_rate,
)
from privlearn.accounting._types import PrivacyBound
from privlearn.accounting.accountants import get_accountant, read_relation
from privlearn.errors import (
    AccountingError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyLossOverflowError,
    UnsupportedMechanismError,
)

__all__ = [
    "Neighbouring",
    "Sampling",
    "Mechanism",
    "Gaussian",
    "Laplace",
    "RandomizedResponse",
    "PureDP",
    "ApproxDP",
    "RDPMechanism",
    "Composed",
    "Subsampled",
    "compose",
    "subsample",
]

DEFAULT_ACCOUNTANT = "pld"


class Neighbouring(Enum):
    """Neighbouring relation between datasets."""

    ADD_REMOVE = "add_remove"
    """Datasets differ by adding or removing one record (default)."""
    REPLACE_ONE = "replace_one"
    """Datasets of equal size differ by replacing one record."""
    REMOVE_ONLY = "remove_only"
    """One-sided: only the divergence of ``M(D)`` from ``M(D')``, ``D'`` = ``D`` minus one
    record, is bounded (autodp's ``neighboring="remove_only"``; Zhu, Dong & Wang 2022,
    Section 5). Weaker than :attr:`ADD_REMOVE`, which is the worse of the two one-sided
    relations. Poisson subsampling only."""
    ADD_ONLY = "add_only"
    """One-sided: ``D'`` = ``D`` plus one record (autodp's ``neighboring="add_only"``).
    Poisson subsampling only."""


class Sampling(Enum):
    """Subsampling scheme."""

    POISSON = "poisson"
    """Each record is included independently with probability ``rate``."""
    FIXED = "fixed"
    """A batch of fixed size ``rate * n`` drawn uniformly without replacement."""


class Mechanism:
    """Base class of all mechanism descriptions.

    Subclasses are frozen dataclasses validated at construction. The methods below
    evaluate the description with a named accountant (default ``"pld"``).
    """

    __slots__ = ()

    # -- evaluation ------------------------------------------------------------------
    def epsilon(self, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
        """Certified upper bound on epsilon such that the mechanism is (epsilon, delta)-DP.

        Parameters
        ----------
        delta : float in [0, 1]
            (``delta = 1`` gives 0: every mechanism is (0, 1)-DP.)
        accountant : {"pld", "rdp", "analytic"}
            ``"pld"`` (default) composes privacy loss distributions with a pessimistic
            discretisation; ``"rdp"`` uses Renyi DP; ``"analytic"`` is exact for
            compositions of (non-subsampled) Gaussians only.
        """
        return self.epsilon_bounds(delta, accountant).upper

    def delta(self, epsilon: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
        """Certified upper bound on delta such that the mechanism is (epsilon, delta)-DP."""
        return self.delta_bounds(epsilon, accountant).upper

    def epsilon_bounds(self, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> PrivacyBound:
        """Upper bound and (where the accountant has one) lower bound on epsilon(delta)."""
        delta = check_delta("delta", delta, allow_one=True)
        acc = get_accountant(accountant)
        if delta == 1.0:  # every mechanism is (0, 1)-DP
            return PrivacyBound(upper=0.0, lower=0.0, accountant=acc.name)
        if isinstance(self, Composed) and not self.parts:  # nothing ran: exactly 0-DP
            return PrivacyBound(upper=0.0, lower=0.0, accountant=acc.name)
        m = _one_relation(self)
        with _numerical_failure(acc.name, m), _read_under_replace_one(acc.name, m is not self):
            return acc.epsilon(m, delta)

    def delta_bounds(self, epsilon: float, accountant: str = DEFAULT_ACCOUNTANT) -> PrivacyBound:
        """Upper bound and (where the accountant has one) lower bound on delta(epsilon)."""
        epsilon = check_epsilon("epsilon", epsilon)
        acc = get_accountant(accountant)
        if isinstance(self, Composed) and not self.parts:  # nothing ran: exactly 0-DP
            return PrivacyBound(upper=0.0, lower=0.0, accountant=acc.name)
        m = _one_relation(self)
        with _numerical_failure(acc.name, m), _read_under_replace_one(acc.name, m is not self):
            return acc.delta(m, epsilon)

    def rdp(self, orders: float | Sequence[float]):
        """Renyi-DP upper bound ``eps_RDP(alpha)`` at the given order(s) alpha > 1.

        Returns a float for a scalar order, else a NumPy array.
        """
        return get_accountant("rdp").rdp(_one_relation(self), orders)  # type: ignore[attr-defined]

    # -- convenience ------------------------------------------------------------------
    def compose(self, steps: int) -> Composed:
        """``compose(self, steps)``."""
        return compose(self, steps=steps)

    def subsample(self, rate: float, **kwargs) -> Subsampled:
        """``subsample(self, rate, ...)``."""
        return subsample(self, rate, **kwargs)


@dataclass(frozen=True, slots=True)
class Gaussian(Mechanism):
    """Gaussian mechanism: adds N(0, (noise_multiplier * sensitivity)^2 I).

    Parameters
    ----------
    noise_multiplier : float > 0
        Noise standard deviation divided by the L2 bound ``C`` on one record's
        contribution (the add/remove sensitivity, e.g. ``max_grad_norm``), under every
        neighbouring relation. Under replace-one (see :func:`subsample`) the accountants
        take the contribution to move by up to ``2 C`` (module docstring, Conventions).

    References
    ----------
    Balle & Wang (2018), Improving the Gaussian Mechanism for Differential Privacy:
    Analytical Calibration and Optimal Denoising, ICML, Theorem 8.
    """

    noise_multiplier: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )


@dataclass(frozen=True, slots=True)
class Laplace(Mechanism):
    """Laplace mechanism: adds Lap(noise_multiplier * sensitivity) noise per coordinate.

    Parameters
    ----------
    noise_multiplier : float > 0
        Laplace scale ``b`` divided by the L1 bound ``C`` on one record's contribution
        (the add/remove sensitivity), under every neighbouring relation. The mechanism is
        (1/noise_multiplier, 0)-DP under add/remove and (2/noise_multiplier, 0)-DP under
        replace-one (a contribution can move by ``2 C``; see :func:`subsample`).

    References
    ----------
    Dwork, McSherry, Nissim & Smith (2006), Calibrating Noise to Sensitivity.
    """

    noise_multiplier: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )


@dataclass(frozen=True, slots=True)
class RandomizedResponse(Mechanism):
    """k-ary randomized response.

    Reports the true category with probability ``truth_probability`` and otherwise one
    of the other ``num_categories - 1`` categories uniformly. It is
    (log(p (k-1) / (1-p)), 0)-DP for p >= 1/k.

    Parameters
    ----------
    truth_probability : float in [1/num_categories, 1)
    num_categories : int >= 2

    References
    ----------
    Warner (1965); Kairouz, Oh & Viswanath (2016), Extremal Mechanisms for Local DP.
    """

    truth_probability: float
    num_categories: int = 2

    def __post_init__(self) -> None:
        k = check_count("num_categories", self.num_categories, minimum=2)
        p = check_probability("truth_probability", self.truth_probability)
        if not (1.0 / k <= p < 1.0):
            raise ParameterValueError(
                f"truth_probability must be in [1/num_categories, 1) = [{1.0 / k:g}, 1), "
                f"got {self.truth_probability!r}"
            )
        object.__setattr__(self, "num_categories", k)
        object.__setattr__(self, "truth_probability", p)

    @property
    def pure_epsilon(self) -> float:
        """``|log(p (k-1) / (1-p))|``, the largest privacy loss ``|log(p / r)|`` with
        ``r = (1-p) / (k-1)``, from the exact ratio of the float ``p`` (>= 0; at a float
        ``p`` a hair below ``1/k``, e.g. ``1/3``, ``r`` is the larger of the two)."""
        p, k = Fraction(self.truth_probability), self.num_categories
        ratio = p * (k - 1) / (1 - p)  # p / r, exact
        if ratio >= 2:
            return math.log(float(ratio))
        # near p = 1/k: log1p of the exact excess, no cancellation; below, log(r / p)
        return math.log1p(float(ratio - 1 if ratio >= 1 else 1 / ratio - 1))


@dataclass(frozen=True, slots=True, init=False)
class PureDP(Mechanism):
    """A generic (epsilon, 0)-DP mechanism, analysed through its worst-case pair
    (randomized response with the same epsilon, which dominates every epsilon-DP
    mechanism; Kairouz, Oh & Viswanath 2015, Theorem 2.1).

    Parameters
    ----------
    pure_epsilon : float > 0
        The field holding epsilon (``epsilon`` is the name of the evaluation method).
    epsilon : float > 0, keyword-only
        The same value under its usual name: ``PureDP(epsilon=0.3) == PureDP(0.3) ==
        PureDP(pure_epsilon=0.3)``. Give one of the two.

    Examples
    --------
    >>> from privlearn.accounting import PureDP
    >>> PureDP(epsilon=0.3)
    PureDP(pure_epsilon=0.3)
    """

    pure_epsilon: float

    def __init__(self, pure_epsilon: float | None = None, *,
                 epsilon: float | None = None) -> None:
        name, value = _one_spelling("PureDP", "pure_epsilon", pure_epsilon, "epsilon", epsilon)
        object.__setattr__(self, "pure_epsilon", check_positive(name, value))


@dataclass(frozen=True, slots=True)
class ApproxDP(Mechanism):
    """A generic (epsilon, delta)-DP mechanism, analysed through its worst-case pair.

    Every ``(epsilon, delta)``-DP mechanism is dominated by the four-outcome pair with
    P-masses ``(delta, (1 - delta) e^eps / (1 + e^eps), (1 - delta) / (1 + e^eps), 0)`` and
    the same Q-masses in reverse order (Kairouz, Oh & Viswanath 2015, Theorem 2.1; its
    trade-off function is ``f_{eps, delta}``, Dong, Roth & Su 2022, Proposition 2.5), so
    the PLD accountant composes it with any other kind. It has no RDP guarantee (a
    ``delta > 0`` allows an unbounded Renyi divergence), so the RDP accountant refuses it.

    Use it for a release known only through an ``(epsilon, delta)`` guarantee, e.g. the
    conversion of an RDP curve at one delta (conservative: the curve's whole profile is
    replaced by one point of it). Its ``delta`` is privacy-loss mass at infinity, which
    every composition carries in full; the PLD accountant's certified epsilon needs a
    little more delta than that mass (at exactly ``dp_delta`` it raises
    :class:`~privlearn.errors.CertificationError` rather than round down), so charge
    ``ApproxDP(epsilon, 0.99 * delta)`` for a release that must be read at ``delta``.

    Parameters
    ----------
    dp_epsilon : float >= 0
        The field holding epsilon (``epsilon`` and ``delta`` are the names of the
        evaluation methods).
    dp_delta : float in (0, 1)
        (``delta = 0`` is :class:`PureDP`.)
    epsilon, delta : float, keyword-only
        The same values under their usual names: ``ApproxDP(epsilon=1.0, delta=1e-6) ==
        ApproxDP(1.0, 1e-6)``. Give one spelling of each.

    Examples
    --------
    >>> from privlearn.accounting import ApproxDP
    >>> ApproxDP(epsilon=1.0, delta=1e-6)
    ApproxDP(dp_epsilon=1.0, dp_delta=1e-06)
    """

    dp_epsilon: float
    dp_delta: float

    def __init__(self, dp_epsilon: float | None = None, dp_delta: float | None = None, *,
                 epsilon: float | None = None, delta: float | None = None) -> None:
        e_name, e = _one_spelling("ApproxDP", "dp_epsilon", dp_epsilon, "epsilon", epsilon)
        d_name, d = _one_spelling("ApproxDP", "dp_delta", dp_delta, "delta", delta)
        object.__setattr__(self, "dp_epsilon", check_epsilon(e_name, e))
        d = check_delta(d_name, d, hint="a delta in (0, 1); for delta = 0 use PureDP(epsilon)")
        if d == 0.0:
            raise ParameterValueError(
                f"{d_name} must be in (0, 1), got 0.0: use PureDP(epsilon) for a pure "
                "(epsilon, 0)-DP mechanism")
        object.__setattr__(self, "dp_delta", d)


def _one_spelling(cls: str, field_name: str, field_value: object, alias: str,
                  alias_value: object) -> tuple[str, object]:
    """The one value given for a field that also has a keyword alias, with the name it was
    given under; a :class:`~privlearn.errors.ParameterTypeError` naming both spellings
    when both or neither were given."""
    if field_value is not None and alias_value is not None:
        raise ParameterTypeError(
            f"{cls}() got both {field_name}={field_value!r} and {alias}={alias_value!r}, "
            f"two spellings of the same parameter; give one of them, e.g. "
            f"{cls}({alias}={alias_value!r})")
    if field_value is None and alias_value is None:
        raise ParameterTypeError(
            f"{cls}() missing the parameter {alias} (also spelled {field_name}); "
            f"give one of them, e.g. {cls}({alias}=1.0)")
    return (field_name, field_value) if alias_value is None else (alias, alias_value)


@dataclass(frozen=True)
class RDPMechanism(Mechanism):
    """A mechanism known only through a user-supplied Renyi-DP function.

    Only the ``"rdp"`` accountant can evaluate it.

    Parameters
    ----------
    rdp_function : callable alpha -> eps_RDP(alpha)
        Must be a valid RDP upper bound for every order alpha > 1 (non-negative,
        non-decreasing in alpha); ``inf`` is allowed where no bound is known.
    name : str
    pure_epsilon : float, optional
        A known pure-DP epsilon (used for delta = 0 and as the alpha -> inf limit).
    """

    rdp_function: Callable[[float], float] = field(compare=True)
    name: str = "custom"
    pure_epsilon: float = math.inf

    def __post_init__(self) -> None:
        if not callable(self.rdp_function):
            raise ParameterTypeError(f"rdp_function must be callable, got {self.rdp_function!r}")
        check_positive("pure_epsilon", self.pure_epsilon, allow_inf=True)

    def __hash__(self) -> int:
        return hash((id(self.rdp_function), self.name, self.pure_epsilon))


@dataclass(frozen=True, slots=True)
class Subsampled(Mechanism):
    """``base`` run on a random subsample of the data (privacy amplification).

    Use :func:`subsample` to build one.
    """

    base: Mechanism
    rate: float
    scheme: Sampling = Sampling.POISSON
    neighbouring: Neighbouring | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.base, Mechanism):
            raise ParameterTypeError(f"base must be a Mechanism, got {self.base!r}")
        object.__setattr__(self, "rate", check_rate("rate", self.rate))
        scheme = check_enum("scheme", self.scheme, Sampling)
        object.__setattr__(self, "scheme", scheme)
        if self.neighbouring is None:  # the relation natural to the scheme
            nb = Neighbouring.ADD_REMOVE if scheme is Sampling.POISSON else Neighbouring.REPLACE_ONE
        else:
            nb = check_enum("neighbouring", self.neighbouring, Neighbouring)
        one_sided = nb in (Neighbouring.REMOVE_ONLY, Neighbouring.ADD_ONLY)
        if one_sided and scheme is not Sampling.POISSON:
            raise ParameterValueError(
                f"neighbouring={nb.value!r} (one-sided) requires scheme='poisson', got "
                f"scheme={scheme.value!r}; use 'replace_one' for fixed-size sampling"
            )
        object.__setattr__(self, "neighbouring", nb)


@dataclass(frozen=True, slots=True)
class Composed(Mechanism):
    """Adaptive composition: each ``(mechanism, count)`` part runs ``count`` times.

    Use :func:`compose` to build one; it flattens nested compositions and merges equal
    parts, so ``compose(m, steps=k) == compose([m] * k)``.
    """

    parts: tuple[tuple[Mechanism, int], ...]

    def __post_init__(self) -> None:
        for m, k in self.parts:
            if not isinstance(m, Mechanism) or isinstance(m, Composed):
                raise ParameterTypeError(f"parts must hold non-composed Mechanisms, got {m!r}")
            check_count("steps", k, minimum=1)

    @property
    def total_steps(self) -> int:
        return sum(k for _, k in self.parts)


def _as_mechanism(m: object, name: str) -> Mechanism:
    if not isinstance(m, Mechanism):
        raise ParameterTypeError(f"{name} must be a privlearn Mechanism, got {m!r}")
    return m


def compose(
    mechanisms: Mechanism | Iterable[Mechanism],
    steps: int | Sequence[int] | None = None,
) -> Composed:
    """Compose mechanisms (adaptive composition).

    Parameters
    ----------
    mechanisms : Mechanism or iterable of Mechanism
        One mechanism (repeated ``steps`` times) or a heterogeneous list.
    steps : int or sequence of int, optional
        Number of repetitions: an int for a single mechanism (default 1), or one count per
        list entry (default 1 each).

    Returns
    -------
    Composed
        Nested compositions are flattened and equal parts merged (composition is
        commutative), so ``compose(m, steps=k) == compose([m] * k)``.

    Examples
    --------
    >>> from privlearn.accounting import Gaussian, compose, subsample
    >>> m = compose(subsample(Gaussian(noise_multiplier=1.1), rate=256 / 60000), steps=14040)
    """
    if isinstance(steps, Mechanism):
        raise ParameterTypeError(
            f"steps must be an integer number of repetitions, got the mechanism {steps!r}; "
            "to compose several mechanisms pass them as one list: compose([m1, m2]) "
            "(with steps=[k1, k2] for repetitions of each)")
    if isinstance(mechanisms, Mechanism):
        mlist: list[Mechanism] = [mechanisms]
        if steps is None:
            counts = [1]
        elif isinstance(steps, Sequence) and not isinstance(steps, str):
            counts = [check_count("steps", s) for s in steps]
            if len(counts) != 1:
                raise ParameterValueError(
                    f"steps must be one integer for one mechanism, got {steps!r}")
        else:
            counts = [check_count("steps", steps)]
    else:
        mlist = [_as_mechanism(m, "mechanisms[i]") for m in mechanisms]
        if steps is None:
            counts = [1] * len(mlist)
        elif isinstance(steps, Sequence) and not isinstance(steps, str):
            counts = [check_count("steps", s) for s in steps]
            if len(counts) != len(mlist):
                raise ParameterValueError(
                    f"steps must have one entry per mechanism ({len(mlist)}), "
                    f"got {len(counts)} entries"
                )
        else:
            k = check_count("steps", steps)
            counts = [k] * len(mlist)
    merged: dict[Mechanism, int] = {}
    order: list[Mechanism] = []
    for m, k in zip(mlist, counts, strict=True):
        inner = m.parts if isinstance(m, Composed) else ((m, 1),)
        for mm, kk in inner:
            total = kk * k
            if total == 0:
                continue
            if mm not in merged:
                merged[mm] = 0
                order.append(mm)
            merged[mm] += total
    return Composed(tuple((m, merged[m]) for m in order))


def subsample(
    mechanism: Mechanism,
    rate: float,
    scheme: Sampling | str = Sampling.POISSON,
    neighbouring: Neighbouring | str | None = None,
) -> Subsampled:
    """Privacy amplification by subsampling.

    Parameters
    ----------
    mechanism : Mechanism
        The mechanism run on the subsample (not itself a composition).
    rate : float in (0, 1]
        Poisson inclusion probability, or batch size / dataset size for ``"fixed"``.
    scheme : {"poisson", "fixed"}
        Poisson sampling (default) or a fixed-size batch drawn without replacement.
    neighbouring : {"add_remove", "replace_one"}, optional
        Neighbouring relation under which the amplified guarantee is stated. Default:
        the relation natural to the scheme -- add/remove for Poisson sampling,
        replace-one for fixed-size sampling without replacement. The noise multiplier
        of a :class:`Gaussian` or :class:`Laplace` base stays relative to the bound
        ``C`` on one record's contribution; under replace-one the record's contribution
        can move by ``2 C``. For Poisson sampling the accountants use the tight pair
        ``((1-q) N(0, s^2) + q N(1, s^2), (1-q) N(0, s^2) + q N(-1, s^2))`` (Laplace
        likewise with ``Lap(+-1)``; Google dp_accounting's
        ``NeighboringRelation.REPLACE_ONE``). For fixed-size sampling that pair does not
        dominate -- the batch that misses the record holds another in its place, so the
        record ``+C`` against a replacement ``-C`` attains ``((1-q) N(0, s^2) +
        q N(2, s^2), N(0, s^2))`` -- and the accountants use the base at sensitivity
        ``2 C`` (the symmetrised profile of Dong, Roth & Su 2022, Theorem 9; Lebeda,
        Regehr, Kamath & Steinke 2024). :class:`PureDP` and :class:`RandomizedResponse`
        bases state their epsilon for the given relation.

    References
    ----------
    Balle, Barthe & Gaboardi (2018), Theorems 8 and 9; Zhu, Dong & Wang (2022), Optimal
    Accounting of Differential Privacy via Characteristic Function, AISTATS.
    """
    mechanism = _as_mechanism(mechanism, "mechanism")
    if isinstance(mechanism, Composed):
        raise ParameterValueError(
            "mechanism must not be a composition: subsample each step, then compose "
            "(subsample(m, rate) composed T times)"
        )
    return Subsampled(mechanism, rate, scheme, neighbouring)


def _one_relation(mechanism: Mechanism) -> Mechanism:
    """:func:`privlearn.accounting.registry.read_relation` (the registry owns the reading
    and installs it in :mod:`~privlearn.accounting.accountants`: it imports this module)."""
    return read_relation(mechanism)


@contextlib.contextmanager
def _read_under_replace_one(accountant: str, converted: bool) -> Iterator[None]:
    """An accountant's refusal of the replace-one reading of a mixed composition
    (:func:`_one_relation`) says that the reading is ours, not the caller's."""
    try:
        yield
    except UnsupportedMechanismError as err:
        if not converted:
            raise
        raise UnsupportedMechanismError(
            "this composition mixes replace-one parts (e.g. fixed-size sampling) and "
            "add/remove parts (Poisson sampling, or parts that are not subsampled), so its "
            "add/remove parts are read under replace-one, which accountant "
            f"{accountant!r} cannot evaluate ({err}); use accountant='pld', or describe "
            "every part under one relation") from err


@contextlib.contextmanager
def _numerical_failure(accountant: str, mechanism: Mechanism) -> Iterator[None]:
    """A floating-point failure inside an accountant (overflow, division by zero) becomes
    a typed refusal: :class:`~privlearn.errors.PrivacyLossOverflowError` for an
    overflow (the privacy loss is beyond the floating-point range: essentially
    non-private), :class:`~privlearn.errors.AccountingError` otherwise; never a number."""
    try:
        yield
    except AccountingError:
        raise
    except OverflowError as err:
        raise PrivacyLossOverflowError(
            f"{accountant} accountant: the privacy loss of this "
            f"{type(mechanism).__name__.lower()} mechanism overflows floating point "
            f"({err}): it is essentially non-private, or beyond what this accountant can "
            "evaluate (accountant 'rdp' may answer)") from err
    except (ZeroDivisionError, FloatingPointError) as err:
        raise AccountingError(
            f"{accountant} accountant: numerical failure evaluating this "
            f"{type(mechanism).__name__.lower()} mechanism ({err})") from err
