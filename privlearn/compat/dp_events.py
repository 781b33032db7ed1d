"""Google dp_accounting's ``DpEvent`` descriptions as privlearn mechanisms.

:func:`from_dp_event` reads a ``DpEvent`` tree (``GaussianDpEvent``,
``PoissonSampledDpEvent``, ``SelfComposedDpEvent``, ...) and returns the privlearn
:class:`~privlearn.accounting.Mechanism` describing the same release, so code that
builds events for dp_accounting can be accounted by privlearn's certified accountants::

    import dp_accounting
    from privlearn.compat.dp_events import from_dp_event

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)), 1000)
    eps = from_dp_event(event).epsilon(1e-5)

dp_accounting itself is never imported: events are read by their class name and fields
(each converter below owns one event class).

=======================================  ===================================================
event                                    privlearn mechanism
=======================================  ===================================================
``GaussianDpEvent(s)``                   ``Gaussian(s)``
``LaplaceDpEvent(b)``                    ``Laplace(b)``
``DiscreteLaplaceDpEvent(a, d)``         ``DiscreteLaplace(a, d)``
``RandomizedResponseDpEvent(n, k)``      ``RandomizedResponse(1 - n + n / k, k)`` (``n`` the
                                         probability of a uniform answer)
``ZCDpEvent(rho, xi)``                   ``ZCDP(rho, xi)``
``PoissonSampledDpEvent(q, e)``          ``subsample(e, q)``; a composition of Gaussians
                                         inside is its equivalent Gaussian (the same
                                         subsample feeds every part: Dong, Roth & Su 2022,
                                         Corollary 3.3)
``SampledWithoutReplacementDpEvent``     ``subsample(e, m / n, scheme="fixed")`` (replace-one;
                                         see the noise convention below)
``SelfComposedDpEvent(e, k)``            ``compose(e, steps=k)``
``ComposedDpEvent([...])``               ``compose([...])``
``NoOpDpEvent()``                        ``compose([])`` (0-DP)
``RepeatAndSelectDpEvent(e, mean, s)``   ``RepeatAndSelect(e, mean, s)``
``SingleEpochTreeAggregationDpEvent``    ``MatrixMechanism(s, sqrt(depth))``,
                                         ``depth = ceil(log2(max(step_counts) + 1))``
=======================================  ===================================================

``NonPrivateDpEvent``, ``UnsupportedDpEvent``, ``SampledWithReplacementDpEvent`` (which
no dp_accounting accountant evaluates either), ``MixtureOfGaussiansDpEvent`` and
``TruncatedSubsampledGaussianDpEvent`` are refused with
:class:`~privlearn.errors.UnsupportedMechanismError`.

Noise convention: a noise multiplier is read relative to the bound ``C`` on one record's
contribution under every relation (privlearn's convention, and that of dp_accounting's
PLD accountant), so a replacement moves a sum by ``2 C``. dp_accounting's RDP accountant
reads the noise multiplier inside ``SampledWithoutReplacementDpEvent`` relative to the
replace-one sensitivity instead (its ``GaussianDpEvent(s / 2)`` there is privlearn's
``Gaussian(s)``); the reading taken here is the conservative one of the two.

Neighbouring relation: ``ADD_OR_REMOVE_ONE`` (dp_accounting's default) reads the events
as privlearn does by default; ``REPLACE_ONE`` reads the result under replace-one
(:func:`privlearn.accounting.as_replace_one`: Poisson-subsampled Gaussians and Laplaces
get the tight replace-one pair, as dp_accounting's ``REPLACE_ONE``; sampling without
replacement is replace-one already). ``REPLACE_SPECIAL`` is refused: for a sum query,
zeroing a record out changes the output as removing it does, so pass
``ADD_OR_REMOVE_ONE`` for those.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from privlearn.accounting import (
    ZCDP,
    Composed,
    DiscreteLaplace,
    Gaussian,
    Laplace,
    MatrixMechanism,
    Mechanism,
    Neighbouring,
    RandomizedResponse,
    RepeatAndSelect,
    as_replace_one,
    compose,
    subsample,
)
from privlearn.accounting.registry import equivalent_gaussian
from privlearn.errors import ParameterTypeError, ParameterValueError, UnsupportedMechanismError

__all__ = ["from_dp_event"]

_Converter = Callable[[Any], Mechanism]


def _field(event: Any, name: str) -> Any:
    try:
        return getattr(event, name)
    except AttributeError:
        raise ParameterTypeError(
            f"{type(event).__name__} has no field {name!r}: not a dp_accounting event of "
            "that name (privlearn reads the events of dp_accounting 0.4 and later)"
        ) from None


def _is_count(x: Any) -> bool:
    """An integer (Python's or NumPy's, as dp_accounting accepts), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _one_step(event: Any, where: str) -> Mechanism:
    """The mechanism of ``event`` as one step to subsample: itself when it is not a
    composition, else its equivalent Gaussian (every part a Gaussian)."""
    m = _convert(event)
    if not isinstance(m, Composed):
        return m
    sigma = equivalent_gaussian(m)
    if sigma is None or not m.parts:
        raise UnsupportedMechanismError(
            f"the event inside {where} is a composition that is not of Gaussians only; "
            "privlearn subsamples one mechanism per step (subsample each part and compose "
            "them, if each part samples its own batch)"
        )
    return Gaussian(sigma)


def _poisson(event: Any) -> Mechanism:
    q = _field(event, "sampling_probability")
    return subsample(_one_step(_field(event, "event"), "PoissonSampledDpEvent"), q)


def _without_replacement(event: Any) -> Mechanism:
    n, m = _field(event, "source_dataset_size"), _field(event, "sample_size")
    if not (_is_count(n) and _is_count(m) and 0 < m <= n):
        raise ParameterValueError(
            f"SampledWithoutReplacementDpEvent needs integers 0 < sample_size <= "
            f"source_dataset_size, got sample_size={m!r}, source_dataset_size={n!r}"
        )
    n, m = int(n), int(m)
    base = _one_step(_field(event, "event"), "SampledWithoutReplacementDpEvent")
    return subsample(base, m / n, scheme="fixed", neighbouring="replace_one")


def _randomized_response(event: Any) -> Mechanism:
    noise, k = _field(event, "noise_parameter"), _field(event, "num_buckets")
    return RandomizedResponse(1.0 - noise + noise / k, k)


def _tree(event: Any) -> Mechanism:
    raw = _field(event, "step_counts")
    if _is_count(raw):
        counts = [raw]
    else:
        try:
            counts = list(raw)
        except TypeError:
            raise ParameterTypeError(
                f"SingleEpochTreeAggregationDpEvent needs an integer step count or a "
                f"sequence of them, got {raw!r} ({type(raw).__name__}); pass e.g. 100 or "
                "[100, 100]"
            ) from None
    if not counts or any(not _is_count(c) or c < 0 for c in counts):
        raise ParameterValueError(
            f"SingleEpochTreeAggregationDpEvent needs integer step counts >= 0, got {raw!r}; "
            "pass e.g. 100 or [100, 100]"
        )
    depth = math.ceil(math.log2(int(max(counts)) + 1))
    if depth == 0:
        return compose([])
    # sqrt rounded up: a larger sensitivity is the conservative side
    return MatrixMechanism(
        _field(event, "noise_multiplier"), math.nextafter(math.sqrt(depth), math.inf)
    )


def _refuse(why: str) -> _Converter:
    def refuse(event: Any) -> Mechanism:
        raise UnsupportedMechanismError(f"{type(event).__name__}: {why}")

    return refuse


#: One converter per dp_accounting event class (by class name).
_CONVERTERS: dict[str, _Converter] = {
    "GaussianDpEvent": lambda e: Gaussian(_field(e, "noise_multiplier")),
    "LaplaceDpEvent": lambda e: Laplace(_field(e, "noise_multiplier")),
    "DiscreteLaplaceDpEvent": lambda e: DiscreteLaplace(
        _field(e, "noise_parameter"), _field(e, "sensitivity")
    ),
    "RandomizedResponseDpEvent": _randomized_response,
    "ZCDpEvent": lambda e: ZCDP(_field(e, "rho"), _field(e, "xi")),
    "PoissonSampledDpEvent": _poisson,
    "SampledWithoutReplacementDpEvent": _without_replacement,
    "SelfComposedDpEvent": lambda e: compose(
        _convert(_field(e, "event")), steps=_field(e, "count")
    ),
    "ComposedDpEvent": lambda e: compose([_convert(x) for x in _field(e, "events")]),
    "NoOpDpEvent": lambda e: compose([]),
    "RepeatAndSelectDpEvent": lambda e: RepeatAndSelect(
        _convert(_field(e, "event")), _field(e, "mean"), _field(e, "shape")
    ),
    "SingleEpochTreeAggregationDpEvent": _tree,
    "NonPrivateDpEvent": _refuse("a non-private release has no finite epsilon"),
    "UnsupportedDpEvent": _refuse("dp_accounting marks it as not accountable"),
    "SampledWithReplacementDpEvent": _refuse(
        "sampling with replacement is not accounted by privlearn (nor by dp_accounting's "
        "accountants); sample without replacement or by Poisson sampling"
    ),
    "MixtureOfGaussiansDpEvent": _refuse(
        "a mixture of Gaussians is not a privlearn mechanism kind yet"
    ),
    "TruncatedSubsampledGaussianDpEvent": _refuse(
        "truncated Poisson sampling is not accounted by privlearn; account the batches "
        "without truncation only if truncation never happens"
    ),
}


def _convert(event: Any) -> Mechanism:
    name = type(event).__name__
    fn = _CONVERTERS.get(name)
    if fn is None:
        raise UnsupportedMechanismError(
            f"no privlearn mechanism is known for {name} ({event!r}); the events read are "
            f"{', '.join(sorted(_CONVERTERS))}"
        )
    return fn(event)


def _relation(neighboring_relation: Any) -> Neighbouring:
    if neighboring_relation is None:
        return Neighbouring.ADD_REMOVE
    if isinstance(neighboring_relation, Neighbouring):
        return neighboring_relation
    name = getattr(neighboring_relation, "name", neighboring_relation)
    table = {
        "ADD_OR_REMOVE_ONE": Neighbouring.ADD_REMOVE,
        "add_remove": Neighbouring.ADD_REMOVE,
        "REPLACE_ONE": Neighbouring.REPLACE_ONE,
        "replace_one": Neighbouring.REPLACE_ONE,
    }
    if name == "REPLACE_SPECIAL":
        raise UnsupportedMechanismError(
            "neighboring_relation=REPLACE_SPECIAL is not a privlearn relation; for sum "
            "queries (Gaussian, Laplace, tree aggregation) zeroing a record out changes the "
            "output as removing it does: pass ADD_OR_REMOVE_ONE"
        )
    if not isinstance(name, str) or name not in table:
        raise ParameterValueError(
            f"neighboring_relation must be dp_accounting's ADD_OR_REMOVE_ONE or REPLACE_ONE "
            f"(or 'add_remove' / 'replace_one'), got {neighboring_relation!r}"
        )
    return table[name]


def from_dp_event(event: Any, neighboring_relation: Any = None) -> Mechanism:
    """The privlearn mechanism describing the release of a dp_accounting ``DpEvent``.

    Parameters
    ----------
    event : dp_accounting.DpEvent
        The event tree (module docstring for the events read).
    neighboring_relation : dp_accounting.NeighboringRelation or str, optional
        ``ADD_OR_REMOVE_ONE`` (default) or ``REPLACE_ONE`` (the accountant's
        ``neighboring_relation``); ``"add_remove"`` / ``"replace_one"`` or a
        :class:`~privlearn.accounting.Neighbouring` also work.

    Returns
    -------
    Mechanism
        Evaluate it with any privlearn accountant, e.g. ``.epsilon(delta)``.

    Raises
    ------
    UnsupportedMechanismError
        For an event privlearn cannot account (module docstring) or
        ``REPLACE_SPECIAL``.
    """
    relation = _relation(neighboring_relation)
    m = _convert(event)
    if relation is Neighbouring.REPLACE_ONE and not (isinstance(m, Composed) and not m.parts):
        m = as_replace_one(m)
    return m
