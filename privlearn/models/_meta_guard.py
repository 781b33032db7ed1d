"""What a private fit refuses, or warns of, when a scikit-learn meta-estimator calls it
(private helper of :mod:`privlearn.models.base` and :mod:`privlearn.models.preprocessing`).

scikit-learn's meta-estimators fit their inner estimator through its public ``fit``, so
a private estimator wrapped in one releases what its own ``mechanism_`` describes --
unless the meta-estimator changes what one record is, or fits a non-private model on the
same private data in the same call. The private fit cannot see its caller's parameters
through its arguments, so it reads them from the calling frames (in the thread that
runs the fit), before anything is reserved on a ledger:

* ``BaggingRegressor`` / ``BaggingClassifier`` with ``bootstrap=True`` (their default)
  hand each inner fit ``X[indices]`` drawn *with replacement* (the private estimators
  take no ``sample_weight``): a record drawn ``k`` times enters one release ``k`` times,
  a ``k``-fold sensitivity that the mechanism, calibrated to one record counted once,
  does not cover (group privacy would multiply the epsilon by ``k``, and ``k`` can be
  as large as the number of rows). Refused (:class:`~privlearn.errors.ParameterValueError`);
  ``bootstrap=False`` with ``max_samples < 1`` subsamples without replacement.
* scikit-learn's cross-validation (``cross_validate``, ``cross_val_score``,
  ``cross_val_predict``, ``learning_curve``, ``validation_curve``,
  ``permutation_test_score``, the searches, ``RFECV``, ``TunedThresholdClassifierCV``)
  fits each copy on ``X[train]`` for the training indices of a split, which a ``cv`` of
  the user's own may list with repeats (a bootstrap split drawn with replacement): a
  record listed ``k`` times enters that fit ``k`` times, as under bagging. Refused
  (:class:`~privlearn.errors.ParameterValueError`), in the worker that fits the copy
  (the splits are drawn there, from the splitter, never from the data's values).
* ``CalibratedClassifierCV``, ``StackingClassifier`` / ``StackingRegressor``,
  ``RANSACRegressor``, ``SelfTrainingClassifier``, ``AdaBoostRegressor`` and the
  gradient boosting estimators with a private ``init`` fit a non-private model on the
  private data within the same call (the calibrators, the final estimator, the inlier
  mask and residual threshold, the pseudo-labels of every unlabelled private row, the
  boosting weights and errors, the trees fitted to the private residuals),
  ``IterativeImputer`` unless its starting values, order and number of rounds are fixed
  by its parameters (its default ``initial_imputer_`` holds the exact column means),
  and ``TransformedTargetRegressor`` fits its ``transformer`` on the private ``y``
  unless that fit learns nothing from the values (the allow-list of
  :mod:`privlearn.models._public_fits`): what they release is not covered by any
  ``mechanism_`` and no ledger records it. Refused
  (:class:`~privlearn.errors.ConfigurationError`) with what to do instead.
* ``OneVsRestClassifier``, ``OneVsOneClassifier``, ``OutputCodeClassifier``,
  ``VotingClassifier`` and ``BaggingClassifier`` take their ``classes_`` from
  ``np.unique(y)`` of the private labels (and the first three run a number of fits that
  follows the classes found, so a ledger's history counts them): a
  :class:`~privlearn.errors.PrivacyLeakWarning` to the person fitting, as for
  ``classes=None``.
* scikit-learn's ``GridSearchCV``, ``RandomizedSearchCV``, the halving searches,
  ``RFECV``, ``SequentialFeatureSelector`` and ``TunedThresholdClassifierCV`` score
  their candidates on held-out private rows without noise and choose by those scores
  (``cv_results_``, ``best_params_``, the features, the threshold): a
  :class:`~privlearn.errors.PrivacyLeakWarning` pointing to
  :class:`~privlearn.models.PrivateSearchCV`. Each fit is still charged on the
  estimator's ledger.

* scikit-learn's own ``Pipeline``, ``ColumnTransformer`` and ``FeatureUnion`` (not a
  :class:`~privlearn.models.PrivatePipeline`) whose other steps learn from the private
  data (a ``StandardScaler``, a ``LogisticRegression`` after a private transformer):
  a :class:`~privlearn.errors.PrivacyLeakWarning` naming those steps and pointing to
  ``PrivatePipeline``, which refuses them (a plain pipeline stays the user's own
  composition, accounted by ``pipeline_mechanism`` with ``public_steps``).

Each warning is given once per call of the meta-estimator's ``fit``, not once per copy
it fits.

A meta-estimator that only composes private fits (``MultiOutputRegressor``,
``cross_val_predict``, ``RFE``, ``SelectFromModel``, ...) is left alone: each fit is a
release of its own, charged on the estimator's ledger, and the total is their
composition (:class:`~privlearn.models.PrivateSearchCV` accounts a search as one).

A scikit-learn ensemble (``BaggingRegressor``, ``BaggingClassifier``) seeds each copy of
its estimator with ``set_params(random_state=<int>)`` drawn from its own
``random_state``, and the seed stays on ``estimators_`` (their ``get_params()``, the
pickle): with the ensemble's ``random_state=None`` the person fitting fixed nothing, yet
every copy's noise could be regenerated from what is released. Such a seeding is not
applied to a private estimator (:func:`seeded_by_ensemble`): its copies keep
``random_state=None`` and draw their noise from fresh OS entropy, independent between
copies, which is what the ensemble's seeding is for. A ``random_state`` the person
fitting gave the ensemble is their choice (reproducible noise, for experiments), and
its seeds are kept.

Frames are read, never modified. A meta-estimator with ``n_jobs`` > 1 runs its inner
fits in joblib's worker processes or threads, whose frames do not show it; but it clones
its inner estimator (``sklearn.base.clone``) in its own fit, before it hands the copies
to the workers, so the private types run these checks when they are cloned too
(``__sklearn_clone__``, :class:`~privlearn.models.base.MetaGuardedClone`): a refusal is
raised in the calling thread before any copy is fitted or anything is reserved, and a
warning is given there, once. joblib takes the first tasks of a ``Parallel`` call in the
calling thread and the next ones in a callback thread; from there the frames are
followed into the thread that waits in ``Parallel.__call__`` (:func:`_dispatching_call`).
Bagging and ``OneVsRestClassifier``, ``OneVsOneClassifier``, ``OutputCodeClassifier``,
``MultiOutputRegressor`` clone in their workers: bagging's workers are recognised (its
refusal reaches the caller as the worker's exception); the ``classes_`` warnings of the
others are not seen, nor the warning of a plain ``Pipeline`` fitted in a worker (a
warning given in a worker process stays there). Backends that dispatch from elsewhere
(dask, ray) are not followed.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType
from typing import Any

from privlearn.errors import ConfigurationError, ParameterValueError, PrivacyLeakWarning
from privlearn.models._meta_seeds import running_frame_ids

__all__ = ["private_type", "refuse_unaccounted_callers", "seeded_by_ensemble"]

#: the classes whose fits are private and accounted by their own ``mechanism_``
#: (:class:`~privlearn.models.base.PrivateEstimator`, ``PrivatePipeline``), registered by
#: :func:`private_type` where they are defined (this module imports neither)
_PRIVATE_TYPES: list[type] = []


def private_type(cls: type) -> type:
    """Register ``cls`` as a private, self-accounting estimator type (a class decorator);
    its instances are never counted as steps learning from the data without noise."""
    _PRIVATE_TYPES.append(cls)
    return cls


def _is_private(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a registered private type."""
    return isinstance(obj, tuple(_PRIVATE_TYPES))

#: how many calling frames are read at most (a meta-estimator fits its inner estimator a
#: few tens of frames above the private fit, joblib included)
_MAX_FRAMES = 200

#: the fitting methods whose ``self`` is read
_FIT_NAMES = frozenset({"fit", "fit_transform", "fit_predict", "_fit"})

#: scikit-learn's cross-validation functions (``sklearn.model_selection._validation``):
#: like a meta-estimator, each call fits several copies of the estimator
_VALIDATION_FUNCTIONS = frozenset({
    "cross_validate", "cross_val_predict", "learning_curve", "validation_curve",
    "permutation_test_score"})


def _sklearn_frames() -> Iterator[FrameType]:
    """The calling frames (innermost first) whose code is scikit-learn's; through a
    joblib callback thread, continued in the thread that called ``Parallel``
    (:func:`_dispatching_call`)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith("sklearn."):
            yield frame
        if module == "joblib.parallel" and frame.f_code.co_name == "dispatch_next":
            frame = _dispatching_call(frame.f_locals.get("self"))
        else:
            frame = frame.f_back


def _dispatching_call(parallel: Any) -> FrameType | None:
    """The frame of joblib's ``Parallel.__call__`` running ``parallel``, in whichever
    thread runs it (None: none is found).

    joblib takes the first tasks of a ``Parallel`` call from the caller's iterator in the
    calling thread, and the next ones in a callback thread (the threading backend's
    result handler, loky's in the parent process) as tasks complete: a meta-estimator's
    ``clone`` of its inner estimator (evaluated as its task is taken) then runs in that
    thread, whose own frames end in joblib's ``dispatch_next``. The calling thread is
    waiting in ``Parallel.__call__`` meanwhile, with the meta-estimator's fit above it.
    """
    if parallel is None:
        return None
    for frame in sys._current_frames().values():  # this thread's too: a backend may
        walk: FrameType | None = frame  # call back in the dispatching thread
        for _ in range(_MAX_FRAMES):
            if walk is None:
                break
            if (
                walk.f_code.co_name == "__call__"
                and walk.f_globals.get("__name__") == "joblib.parallel"
                and walk.f_locals.get("self") is parallel
            ):
                return walk
            walk = walk.f_back
    return None


#: scikit-learn's functions that fit a copy of the estimator on the rows of one
#: cross-validation split, and the name of their local holding its training indices
_SPLIT_FITS = {
    "_fit_and_score": "train",  # cross_validate, the searches, learning_curve, ...
    "_fit_and_predict": "train",  # cross_val_predict
    "_permutation_test_score": "train",
    "_rfe_single_fit": "train",  # RFECV
    "_fit_and_score_over_thresholds": "train_idx",  # TunedThresholdClassifierCV
}


def _repeated_rows_refusal(owner: str, frame: FrameType) -> ParameterValueError | None:
    """The refusal of a split whose training indices (the local :data:`_SPLIT_FITS`
    names in scikit-learn's ``frame``) list a row more than once (None: each row once,
    or a boolean mask). The indices come from the splitter, not from the data."""
    import numpy as np

    rows = frame.f_locals.get(_SPLIT_FITS[frame.f_code.co_name])
    try:
        rows = np.asarray(rows)
    except (TypeError, ValueError):  # not indices: nothing to check
        return None
    if rows.dtype.kind not in "iu" or rows.ndim != 1 or rows.size == 0:
        return None
    most = int(np.unique(rows, return_counts=True)[1].max())
    if most == 1:
        return None
    return ParameterValueError(
        f"{owner}: scikit-learn's {frame.f_code.co_name} fits it on the training rows of a "
        f"cross-validation split that lists a row up to {most} times (cv must give each "
        "row at most once per split; a bootstrap split drawn with replacement does not): "
        "one record then enters the fit as often as it is listed, while the noise of the "
        "fit is calibrated to one record counted once, so its mechanism_ and epsilon_ "
        "would not cover it. Use splits without repeated rows (KFold, ShuffleSplit, or "
        "subsamples drawn without replacement, e.g. rng.choice(n, m, replace=False))")


def _bootstrap_refusal(owner: str, ensemble: Any) -> ParameterValueError:
    kind = type(ensemble).__name__
    return ParameterValueError(
        f"{owner}: {kind}(bootstrap=True) fits each of its estimators on rows drawn with "
        "replacement, so one record enters a fit as often as it is drawn (up to the "
        "number of rows), while the noise of each fit is calibrated to one record counted "
        f"once: its mechanism_ and epsilon_ would not cover that fit. Use "
        f"{kind}(bootstrap=False, max_samples=0.5) (rows drawn without replacement: each "
        "record at most once per fit), or fit the private estimator alone"
    )


def _non_private_fit(owner: str, meta: Any) -> ConfigurationError | None:
    """The refusal of a meta-estimator ``meta`` that fits a non-private model on the
    private data in the call that fits ``owner`` (None: it does not)."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.compose import TransformedTargetRegressor
    from sklearn.ensemble import (
        AdaBoostRegressor,
        GradientBoostingClassifier,
        GradientBoostingRegressor,
        StackingClassifier,
        StackingRegressor,
    )
    from sklearn.linear_model import RANSACRegressor
    from sklearn.semi_supervised import SelfTrainingClassifier

    kind = type(meta).__name__
    if isinstance(meta, CalibratedClassifierCV):
        why = (
            "fits its calibrators (sigmoid or isotonic) on the private labels and the "
            "inner classifier's scores, without noise"
        )
        instead = (
            "Fit the private classifier, then calibrate it on public data: "
            "CalibratedClassifierCV(FrozenEstimator(clf)).fit(X_public, y_public) "
            "(sklearn.frozen.FrozenEstimator)"
        )
    elif isinstance(meta, StackingClassifier | StackingRegressor):
        why = (
            "fits its final_estimator on the private labels and on cross-fitted "
            "predictions (each record's features come from models trained on the other "
            "records), without noise"
        )
        instead = (
            f"Use {kind.replace('Stacking', 'Voting')} (a fixed combination, no learned "
            "final estimator), or fit the final estimator on public data"
        )
    elif isinstance(meta, RANSACRegressor):
        why = (
            "derives its residual_threshold (by default the median absolute deviation of "
            "the private y) and its inlier_mask_ from the private data without noise, and "
            "refits on the inliers it chose"
        )
        instead = "Fit the private regressor alone (its y_bound already clips outliers)"
    elif isinstance(meta, AdaBoostRegressor):
        why = (
            "fits each of its estimators on rows drawn with replacement, with "
            "probabilities set by the un-noised errors of the previous fits on the private "
            "rows (one record can enter a fit many times), and derives estimator_weights_ "
            "and estimator_errors_ from those errors"
        )
        instead = (
            "Fit the private regressor alone, or average private fits with "
            "VotingRegressor or BaggingRegressor(bootstrap=False, max_samples=0.5) (each "
            "fit charged on its own)"
        )
    elif isinstance(meta, GradientBoostingClassifier | GradientBoostingRegressor):
        why = (
            "uses it as init and then fits its trees (estimators_) to the residuals of "
            "the private y without noise"
        )
        instead = (
            "Fit the private estimator alone: boosted trees fitted on the private data "
            "are not private, whatever their init"
        )
    elif isinstance(meta, SelfTrainingClassifier):
        why = (
            "labels the private rows without a label by the inner classifier's exact "
            "predictions and stores one value per private row (transduction_, "
            "labeled_iter_), refitting on the rows it chose"
        )
        instead = "Fit the private classifier on the labelled rows alone"
    elif _is_iterative_imputer(meta) and (problems := _imputer_rounds(meta)):
        why = f"fits the private estimator in rounds decided by the private data ({problems})"
        instead = (
            "Use IterativeImputer(initial_strategy='constant', fill_value=<public value>, "
            "tol=0, n_nearest_features=None, imputation_order='roman', "
            "skip_complete=False), or impute with a public constant "
            "(SimpleImputer(strategy='constant', fill_value=...))"
        )
    elif isinstance(meta, TransformedTargetRegressor):
        from privlearn.models._public_fits import public_fit_refusal

        transformer = getattr(meta, "transformer_", meta.transformer)
        if _is_private(transformer):
            return None  # a private fit on y (a PrivateStandardScaler), accounted itself
        refusal = public_fit_refusal("transformer", transformer)
        if refusal is None:
            return None  # a function, or a fit that learns nothing from y's values
        why = (
            f"fits its transformer ({type(transformer).__name__}) on the private y without "
            "noise, and that fit learns from the values (only a function, a stateless "
            "transformer or one on the allow-list of public fits learns nothing)"
        )
        instead = (
            "Transform y by a public rule, func= and inverse_func= with constants from "
            "public knowledge (e.g. func=lambda y: (y - 2.0) / 1.5), and give the "
            "private regressor the matching y_bound"
        )
    else:
        return None
    return ConfigurationError(
        f"{owner} is being fitted by {kind}, which {why}: that release is not covered by "
        f"{owner}'s mechanism_ and no ledger records it. {instead}"
    )


def _search_leak(owner: str, meta: Any) -> str | None:
    """The warning for scikit-learn's own hyperparameter search ``meta`` (None: not
    one)."""
    from sklearn.feature_selection import RFECV, SequentialFeatureSelector
    from sklearn.model_selection import TunedThresholdClassifierCV
    from sklearn.model_selection._search import BaseSearchCV

    kind = type(meta).__name__
    if isinstance(meta, BaseSearchCV):
        what = "picks best_params_ by those scores: its cv_results_ and its choice"
    elif isinstance(meta, RFECV | SequentialFeatureSelector):
        what = "chooses the features by those scores: its cv_results_ and its choice"
    elif isinstance(meta, TunedThresholdClassifierCV):
        what = "chooses best_threshold_ by those scores: the threshold"
    else:
        return None
    return (
        f"{kind} (fitting {owner}) scores its candidates on held-out private rows without "
        f"noise and {what} are not covered by mechanism_, and a ledger records only the "
        "fits. Use privlearn.models.PrivateSearchCV, which accounts the scores and the "
        "selection, or choose on public validation data (PrivateSearchCV's X_val=, y_val=)"
    )


def _learning_parts(name: str, step: Any) -> Iterator[tuple[str, Any]]:
    """The ``(name, step)`` parts of a scikit-learn container ``step`` (itself when it
    is not one) that learn from the values of the data they are fitted on and are not
    private (the allow-list of :mod:`privlearn.models._public_fits`), nested ones with
    their names joined by ``__``."""
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import FeatureUnion, Pipeline

    from privlearn.models._public_fits import public_fit_refusal

    if _is_private(step):
        return  # accounted by its own mechanism_
    if isinstance(step, Pipeline):
        parts = [(n, s) for n, s in step.steps]
    elif isinstance(step, ColumnTransformer):
        parts = [(n, s) for n, s, _ in step.transformers]
        if not isinstance(step.remainder, str):
            parts.append(("remainder", step.remainder))
    elif isinstance(step, FeatureUnion):
        parts = [(n, s) for n, s in step.transformer_list]
    else:
        if not _holds_private(step) and public_fit_refusal(name, step) is not None:
            yield name, step
        return
    for part_name, part in parts:
        yield from _learning_parts(f"{name}__{part_name}" if name else part_name, part)


def _holds_private(step: Any) -> bool:
    """Whether ``step`` is a meta-estimator around a private estimator
    (``SelectFromModel(SSPRegressor())``): its own fit frames are checked when it fits
    that estimator, so a container does not count it as a step learning alone."""
    get_params = getattr(step, "get_params", None)
    if not callable(get_params):
        return False
    try:
        values = get_params(deep=True).values()
    except Exception:  # noqa: BLE001 - a step without scikit-learn's parameters
        return False
    return any(_is_private(v) for v in values)


def _container_leak(owner: str, meta: Any) -> str | None:
    """The warning for a scikit-learn ``Pipeline``, ``ColumnTransformer`` or
    ``FeatureUnion`` (not a :class:`~privlearn.models.PrivatePipeline`) that fits, next
    to the private estimator, a step learning from the private data (None: none)."""
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import FeatureUnion, Pipeline

    if not isinstance(meta, Pipeline | ColumnTransformer | FeatureUnion) or _is_private(meta):
        return None
    learning = list(_learning_parts("", meta))
    if not learning:
        return None
    named = ", ".join(f"{n!r} ({type(s).__name__})" for n, s in learning[:5])
    return (
        f"scikit-learn's {type(meta).__name__} fitting {owner} also fits {named} on the "
        "private data without noise: their fitted attributes are released with it and "
        f"not covered by {owner}'s mechanism_ (nor by a ledger). Use "
        "privlearn.models.PrivatePipeline, which refuses such steps before anything is "
        "fitted, with PrivateStandardScaler for scaling, or fit those steps on public "
        "data and wrap them in sklearn.frozen.FrozenEstimator"
    )


def _is_iterative_imputer(meta: Any) -> bool:
    """Whether ``meta`` is scikit-learn's experimental ``IterativeImputer`` (its module
    is loaded once the user enabled it; it is not imported here, which would enable
    it)."""
    module = sys.modules.get("sklearn.impute._iterative")
    return module is not None and isinstance(meta, module.IterativeImputer)


def _imputer_rounds(imputer: Any) -> str:
    """What makes scikit-learn's ``IterativeImputer`` fit on the private data beyond its
    inner estimator's fits ("" when nothing: its rounds, order and starting values are
    then fixed by its parameters)."""
    problems = []
    if imputer.initial_strategy != "constant":
        problems.append(
            f"initial_strategy={imputer.initial_strategy!r}: initial_imputer_ holds the "
            "exact column statistics"
        )
    if imputer.tol > 0:
        problems.append(f"tol={imputer.tol!r}: it stops after a data-dependent n_iter_")
    if imputer.n_nearest_features is not None:
        problems.append("n_nearest_features: chosen by the private correlations")
    if imputer.imputation_order in ("ascending", "descending"):
        problems.append(
            f"imputation_order={imputer.imputation_order!r}: ordered by the private missing counts"
        )
    if imputer.skip_complete:
        problems.append("skip_complete=True: skips the columns found complete")
    return "; ".join(problems)


def _classes_leak(owner: str, meta: Any) -> str | None:
    """The warning for a meta-estimator ``meta`` whose ``classes_`` are the labels found
    in the private ``y`` (None: not such a meta-estimator)."""
    from sklearn.ensemble import BaggingClassifier, VotingClassifier
    from sklearn.multiclass import (
        OneVsOneClassifier,
        OneVsRestClassifier,
        OutputCodeClassifier,
    )

    if not isinstance(
        meta,
        OneVsRestClassifier
        | OneVsOneClassifier
        | OutputCodeClassifier
        | VotingClassifier
        | BaggingClassifier,
    ):
        return None
    kind = type(meta).__name__
    count = (
        " and fits a number of private estimators that follows the classes found, so "
        "the number of entries on a ledger follows them too"
        if isinstance(meta, OneVsRestClassifier | OneVsOneClassifier | OutputCodeClassifier)
        else ""
    )
    return (
        f"{kind} (fitting {owner}) takes its classes_ from the labels that occur in the "
        f"private y{count}: which labels occur is not covered by mechanism_. Make sure "
        "every class of the public label set occurs (e.g. keep one public example of each "
        "in the data), or, for a multi-class model, fit DPSGDClassifier(classes=[...]) "
        "on all the public classes at once (one multinomial fit, one entry), or use "
        "PrivateKNN(classes=[...]) or PATE (release(votes, n_classes=K))"
    )


def refuse_unaccounted_callers(
    estimator: Any,
    warn: Callable[[str, type[Warning], int], None],
    *,
    rng_of: Callable[[Any], Any] | None = None,
    cloned: bool = False,
) -> None:
    """Refuse (or warn of) a scikit-learn meta-estimator calling ``estimator``'s fit in a
    way its mechanism does not cover (module docstring); reads the calling frames only,
    never the data, so it is called before anything is reserved, and when ``estimator``
    is cloned (by the meta-estimator, before the copies go to its workers).

    Parameters
    ----------
    estimator : PrivateEstimator or PrivatePipeline
        The private estimator being fitted (named in the messages).
    warn : callable
        ``warn(message, category, stacklevel)``: how a warning reaches the person fitting
        (:func:`privlearn.models.base.warn_person_fitting`).
    rng_of : callable, optional
        Given by the fit itself (not by ``clone``): how the fit makes the generator of its
        noise from ``random_state`` (:func:`privlearn.models.base.make_rng`); a second
        fit within one call of the meta-estimator whose noise starts as an earlier one's
        is then warned of (:mod:`privlearn.models._meta_seeds`).
    cloned : bool
        ``estimator`` is being cloned (with ``rng_of``: a second copy of it seeded alike
        within one call is warned of, unless the copies are seeded after the copy).

    Raises
    ------
    ParameterValueError
        A bagging meta-estimator with ``bootstrap=True`` fits it, or a cross-validation
        split lists one of its training rows more than once.
    ConfigurationError
        A meta-estimator that fits a non-private model on the same private data fits it.

    Warns
    -----
    PrivacyLeakWarning
        A classifier meta-estimator takes its ``classes_`` from the private labels, a
        scikit-learn search scores and chooses on private rows without noise, or copies
        seeded alike are fitted within one call.
    """
    from sklearn.ensemble import BaggingClassifier, BaggingRegressor

    owner = type(estimator).__name__
    outermost: dict[int, tuple[Any, FrameType]] = {}  # meta-estimator -> its first call
    scope: tuple[str, FrameType] | None = None  # the outermost call fitting copies
    group: Any = None  # the innermost private container (a PrivatePipeline) fitting it
    reseeded = False  # the copies being made are seeded afterwards
    for frame in _sklearn_frames():
        name = frame.f_code.co_name
        if name in _VALIDATION_FUNCTIONS and (
            frame.f_globals.get("__name__") == "sklearn.model_selection._validation"
        ):
            scope = (name, frame)
            if name == "validation_curve":
                reseeded |= _sets_seed([frame.f_locals.get("param_name")])
        if name in _SPLIT_FITS and (repeated := _repeated_rows_refusal(owner, frame)):
            raise repeated
        if name == "_make_estimator":  # an ensemble's copy, seeded by _set_random_states
            reseeded = True
        if name == "_fit_classifier_calibrator_pair":  # a calibration worker's frame
            from sklearn.calibration import CalibratedClassifierCV

            raise _non_private_fit(owner, CalibratedClassifierCV())  # type: ignore[misc]
        if name == "_parallel_build_estimators":
            ensemble = frame.f_locals.get("ensemble")
            if isinstance(ensemble, BaggingClassifier | BaggingRegressor) and bool(
                getattr(ensemble, "bootstrap", False)
            ):
                raise _bootstrap_refusal(owner, ensemble)
            continue
        meta = frame.f_locals.get("self") if name in _FIT_NAMES else None
        if meta is None or meta is estimator:
            continue
        refusal = _non_private_fit(owner, meta)
        if refusal is not None:
            raise refusal
        outermost[id(meta)] = (meta, frame)  # frames run outwards: the last one stays
        if _is_private(meta):  # a PrivatePipeline fits its steps once each, and warns
            group = meta if group is None else group  # of steps seeded alike itself
            continue
        scope = (type(meta).__name__, frame)
        reseeded |= _search_sets_seed(meta)
    if rng_of is not None and scope is not None and not (cloned and reseeded):
        from privlearn.models._meta_seeds import copies_seeded_alike

        message = copies_seeded_alike(
            owner,
            estimator,
            rng_of,
            *scope,
            group=group,
            source=estimator if cloned else None,
        )
        if message is not None:
            warn(message, PrivacyLeakWarning, 2)
    for meta, frame in outermost.values():
        messages = [
            m
            for leak in (_search_leak, _classes_leak, _container_leak)
            if (m := leak(owner, meta)) is not None
        ]
        if messages and _first_time(meta, frame):
            for message in messages:
                warn(message, PrivacyLeakWarning, 2)


def _sets_seed(names: Iterable[Any]) -> bool:
    """Whether a parameter name among ``names`` sets a ``random_state``."""
    return any(
        isinstance(n, str) and (n == "random_state" or n.endswith("__random_state"))
        for n in names
    )


def _search_sets_seed(meta: Any) -> bool:
    """Whether scikit-learn's search ``meta`` gives its candidates a ``random_state``
    (its grid or distributions name one): its copies are seeded after ``clone``."""
    from sklearn.model_selection._search import BaseSearchCV

    if not isinstance(meta, BaseSearchCV):
        return False
    grid = getattr(meta, "param_grid", getattr(meta, "param_distributions", None))
    grids = grid if isinstance(grid, list | tuple) else [grid]
    return any(_sets_seed(g) for g in grids if isinstance(g, Mapping))


#: the (meta-estimator, fit call) pairs warned of, most recent last: a meta-estimator
#: fits many copies of the estimator in one call, and each warns once per call. Each
#: holds its call's frame while that call runs (:func:`_drop_finished`): a finished
#: frame's id is reused, often by the next call of the same fit (a search fitted again),
#: which must warn again
_WARNED: collections.OrderedDict[tuple[int, int], FrameType] = collections.OrderedDict()
_WARNED_LOCK = threading.Lock()


def _first_time(meta: Any, frame: FrameType) -> bool:
    """Whether no copy fitted within this call of ``meta``'s fit (its ``frame``) has
    warned yet (keyed by ids, of calls still running, of which the 256 most recent are
    kept)."""
    key = (id(meta), id(frame))
    with _WARNED_LOCK:  # copies are cloned and fitted in several threads at once
        _drop_finished()
        if key in _WARNED:  # (its frame is held, so its id is this frame's)
            return False
        _WARNED[key] = frame
        while len(_WARNED) > 256:
            _WARNED.popitem(last=False)
    return True


def _drop_finished() -> None:
    """Forget the calls in :data:`_WARNED` whose frame is on no thread's stack any more
    (their fit returned); called under :data:`_WARNED_LOCK`."""
    if not _WARNED:
        return
    running = running_frame_ids()
    for key in [k for k, f in _WARNED.items() if id(f) not in running]:
        del _WARNED[key]



#: the methods a nested ``set_params`` passes through on its way down to a step
#: (``BaseEstimator.set_params``, ``_BaseComposition._set_params`` and the containers'
#: own ``set_params``: three frames per ``Pipeline``, ``ColumnTransformer`` or
#: ``FeatureUnion``)
_SET_PARAMS_NAMES = frozenset({"set_params", "_set_params"})


def seeded_by_ensemble() -> bool:
    """Whether the running ``set_params(random_state=...)`` of a private estimator is
    scikit-learn's ensemble seeding of a copy (``_set_random_states``, called by
    ``BaseEnsemble._make_estimator``) with seeds the person fitting did not fix: the
    ensemble's own ``random_state`` is None. Its seed would be stored on the fitted copy
    and regenerate that copy's noise (module docstring); reads the calling frames
    only: the chain of nested ``set_params`` calls above the estimator's, however deep
    its containers nest it, and the frame that started that chain."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None or frame.f_code.co_name not in _SET_PARAMS_NAMES:
            break
        frame = frame.f_back
    if (
        frame is None
        or frame.f_code.co_name != "_set_random_states"
        or frame.f_globals.get("__name__") != "sklearn.ensemble._base"
    ):
        return False
    maker = frame.f_back
    ensemble = maker.f_locals.get("self") if maker is not None else None
    return ensemble is not None and getattr(ensemble, "random_state", 0) is None
