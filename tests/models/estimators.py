"""The one list of the estimators the model tests cover (imported by the test modules of
this folder: ``from estimators import ESTIMATORS``).

Every public class of :mod:`privlearn.models` that a user fits or releases with is in
:data:`ESTIMATORS`, read from ``privlearn.models.__all__``: a new estimator is covered by
every test that sweeps the list, and a test whose own table of configurations misses it
fails its coverage check (``assert_covers``)."""

from __future__ import annotations

import inspect

import privlearn.models as M

#: The public classes of privlearn.models (warnings aside).
PUBLIC_CLASSES = tuple(
    obj for obj in (getattr(M, name) for name in M.__all__)
    if inspect.isclass(obj) and not issubclass(obj, Warning))

#: Bases and records: public, but nothing a user fits or releases with.
NOT_ESTIMATORS = (M.PrivateEstimator, M.ReleasePlan, M.LabelRelease,
                  # fitted on the schema only, no mechanism: test_public_range_scaler.py
                  M.PublicRangeScaler)

#: Every public class that fits or releases (PrivatePipeline and PrivateSearchCV included).
ESTIMATORS = tuple(
    cls for cls in PUBLIC_CLASSES
    if (hasattr(cls, "fit") or hasattr(cls, "release")) and cls not in NOT_ESTIMATORS
    and not inspect.isabstract(cls))

ESTIMATOR_NAMES = frozenset(cls.__name__ for cls in ESTIMATORS)


def assert_covers(names, what: str, *, except_for=()) -> None:
    """That ``names`` (class names, of a test's configurations) cover every estimator but
    ``except_for``, with nothing unknown."""
    names = set(names)
    missing = ESTIMATOR_NAMES - names - set(except_for)
    assert not missing, f"{what} covers no configuration of {sorted(missing)}"
    unknown = names - ESTIMATOR_NAMES
    assert not unknown, f"{what} names classes that are not estimators: {sorted(unknown)}"
