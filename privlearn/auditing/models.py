"""Canaries for the NumPy estimators of :mod:`privlearn.models`.

:func:`audit_estimator` audits one fit of a linear DP estimator (``SSPRegressor``,
``AdaSSPRegressor``, ``NoisyGDRegressor``, ``DPSGDRegressor``, ``DPSGDClassifier``)
with *feature canaries*: ``m`` extra feature columns that the data does not use (zero
for every data record); canary ``i`` is the record ``x = b e_{d+i}``, ``y = s_i *
y_bound`` (regression; with an interval ``y_bound = (lo, hi)``, ``hi`` for ``s_i = 1``
and ``lo`` for ``s_i = -1``) or the class ``s_i`` (binary classification), with a random
sign ``s_i`` known to the auditor and ``b`` the estimator's row bound. Only canary ``i``
touches coefficient ``d + i``, so canaries do not interfere and the score
``s_i * coef_[d + i]`` measures how much the fit absorbed canary ``i`` (the
input-space analogue of the Dirac gradient canaries of Nasr et al. 2023, "Tight
Auditing of Differentially Private Machine Learning"). The bound comes from the
one-run audit (:func:`privlearn.auditing.one_run_audit`).

A multinomial classifier (``K >= 3`` public classes, ``coef_`` of shape ``(K, d + m)``)
gets the same canaries with a label ``c_i`` drawn uniformly from the ``K`` classes
(known to the auditor, drawn independently of the inclusion), and the score
``coef_[c_i, d + i] - mean_k coef_[k, d + i]``: the canary's class score against the
mean of its column. A step's softmax gradient on that column is ``b (P - e_{c_i})``,
so an included canary raises its class's weight and lowers the others' (the binary
score is the case ``K = 2`` up to a factor 1/2). Any score computed from the released
model and public information is a valid statistic for the one-run bound (Steinke, Nasr
& Jagielski 2023, Theorem 3.1: the bound holds for every score function fixed
independently of the inclusion draw); this one is the projection of the column on the
direction the canary's gradient moves it at the start.

The claimed epsilon is the fitted estimator's ``epsilon_`` (what its accountant reports
for the fit that ran). NumPy only; the estimator is cloned with scikit-learn's
``clone`` (imported when called).
"""

from __future__ import annotations

import numpy as np

from privlearn._progress import check_show_progress, stderr_is_terminal
from privlearn._validation import check_positive
from privlearn.auditing._planted_models import check_model_bug, planted_model_bug
from privlearn.auditing.bounds import _check_delta
from privlearn.auditing.harness import (
    AuditResult,
    _check_n_canaries,
    _check_seed,
    check_audit_memory,
    one_run_audit,
)
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = ["audit_estimator"]


def audit_estimator(estimator, X, y, n_canaries: int, *, delta: float | None = None,
                    seed: int | None = None, method: str = "one_run",
                    confidence: float = 0.95, canary_norm: float | None = None,
                    show_progress: bool | None = None, inject_bug: str = "none"
                    ) -> AuditResult:
    """Audit one fit of a linear DP estimator with ``n_canaries`` feature canaries.

    Parameters
    ----------
    estimator : privlearn.models estimator (unfitted; it is cloned)
        Must expose ``coef_`` and ``epsilon_`` after ``fit``. A classifier may have two
        classes (binary) or more (multinomial, ``coef_`` of shape ``(K, n_features)``);
        the classes are its public ``classes`` when given, else those of ``y``.
    X, y : the training data (the canaries are added to it).
    n_canaries : int >= 2
    delta : float, optional
        The delta of the claim (default: the estimator's ``delta``). The claim is the
        epsilon of the fit at this delta: the estimator's ``epsilon_`` at its own
        ``delta_``, else its ``mechanism_`` accounted at ``delta`` (with the estimator's
        ``accountant``, default PLD; ``inf`` for a Gaussian release at ``delta=0``), so
        that the bound and the claim hold at one delta.
    seed : int >= 0, optional
        Seeds the inclusion draw, the canary signs (an independent stream) and the
        estimator's ``random_state`` (default: drawn from fresh entropy and recorded in
        the result's ``seed``).
    method, confidence : see :func:`privlearn.auditing.one_run_audit` ("one_run" or
        "one_run_fdp"). With ``"one_run_fdp"``, an estimator whose ``mechanism_`` is not
        Gaussian (``DPSGDRegressor(noise="laplace")``) gets a ``UserWarning``
        recommending ``"one_run"``.
    canary_norm : float, optional
        ``b``, the norm of a canary's feature vector (default: the estimator's
        ``x_bound``, or ``max_grad_norm`` for the DP-SGD estimators; 10 times that with
        ``inject_bug="no-clipping"``, so that a bound left unenforced shows).
    show_progress : bool, optional
        The fit's progress bar on standard error, for an estimator that has one (a
        ``verbose`` parameter, e.g. ``NoisyGDRegressor``: its iterations): None (default)
        when standard error is a terminal, True always, False as the estimator's own
        ``verbose`` says. Changes nothing else.
    inject_bug : {"none", "no-noise", "noise-x0.1", "no-clipping", "rate-x10"}
        The self-test of the audit: plant a known privacy bug in every fit while the
        estimator's ``epsilon_`` stays that of the intended configuration (NOT for real
        fits; :mod:`privlearn.auditing._planted_models`). ``"none"`` (default) audits
        the estimator as it is; ``"no-noise"`` and ``"noise-x0.1"`` scale every noise
        draw by 0 and 0.1; ``"no-clipping"`` leaves the public bound unenforced (the rows
        above ``x_bound`` of the linear regressors, DP-SGD's per-example gradients);
        ``"rate-x10"`` (DP-SGD with ``sampling_rate < 1``) samples every record with
        probability ``min(1, 10 q)``. A bug the estimator has no seam for is refused
        before anything is fitted. A bound above the claim then shows the audit catches
        the bug.

    Returns
    -------
    AuditResult
    """
    from sklearn.base import clone, is_classifier, is_regressor

    n_canaries = _check_n_canaries(n_canaries)
    show_progress = check_show_progress(show_progress)
    seed = _check_seed(seed)  # one seed for the signs, the inclusion and the fit
    if (not hasattr(estimator, "get_params") or "delta" not in estimator.get_params()
            or not (is_classifier(estimator) or is_regressor(estimator))):
        raise ParameterTypeError(f"audit_estimator audits privlearn's linear DP estimators "
                        f"(SSPRegressor, AdaSSPRegressor, NoisyGDRegressor, DPSGDRegressor, "
                        f"DPSGDClassifier), got {type(estimator).__name__}, which is not a "
                        "private linear classifier or regressor (refused before any fit); "
                        "for another model write a train_and_score function and call "
                        "one_run_audit")
    X = np.asarray(X, dtype=float)
    y = np.asarray(y)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ParameterValueError(f"X must be 2-D and y 1-D of the same length, got {X.shape} and "
                         f"{y.shape}")
    # the augmented design matrix alone (float64): the records and the expected m/2
    # included canaries, each with the data's columns and one column per canary
    n_rows, n_cols = X.shape[0] + n_canaries // 2, X.shape[1] + n_canaries
    check_audit_memory(
        8 * n_rows * n_cols,
        f"an audit of n_canaries={n_canaries:,} (one feature column per canary) on "
        f"X of shape {X.shape} (a matrix of about {n_rows:,} x {n_cols:,} float64)",
        "use fewer canaries (hundreds to thousands give the audit its power: the guide "
        "'auditing privacy empirically', section 'How many canaries buy how much power')"
        " or fewer rows of X")
    params = estimator.get_params()
    d = _check_delta(params["delta"] if delta is None else delta)
    check_model_bug(inject_bug, estimator)  # before anything is fitted
    if canary_norm is None:
        b = params.get("x_bound", params.get("max_grad_norm", 1.0))
        b = check_positive("canary_norm", 1.0 if b is None else b,
                           hint="the estimator's row bound (x_bound) is the default")
        if inject_bug == "no-clipping":  # canaries within the bound need no clipping
            b *= 10.0
    else:
        b = check_positive("canary_norm", canary_norm, hint="pass the norm of a canary's "
                           "feature vector, e.g. the estimator's x_bound (the default)")
    y_low, y_high = _label_range(params.get("y_bound", 1.0))
    # the signs come from their own stream: drawn from the inclusion's seed they would
    # equal the inclusion bits, and a score could then read inclusion from the sign
    signs_rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5167]))
    signs = np.where(signs_rng.random(n_canaries) < 0.5, -1.0, 1.0)
    classifier = is_classifier(estimator)
    labels = None  # a multinomial classifier's canary labels (indices into classes)
    if classifier:
        classes = _audited_classes(params.get("classes"), y)
        if classes.size > 2:
            labels = signs_rng.integers(classes.size, size=n_canaries)
    fitted: dict = {}

    def train_and_score(inclusion: np.ndarray) -> np.ndarray:
        m, n, p = inclusion.size, X.shape[0], X.shape[1]
        inc = np.flatnonzero(inclusion)
        Xc = np.zeros((inc.size, p + m))
        Xc[np.arange(inc.size), p + inc] = b
        Xa = np.vstack([np.hstack([X, np.zeros((n, m))]), Xc])
        if labels is not None:
            yc = classes[labels[inc]]
        elif classifier:
            yc = classes[(signs[inc] > 0).astype(int)]
        else:
            yc = np.where(signs[inc] > 0, y_high, y_low)
        ya = np.concatenate([y, yc])
        est = clone(estimator)
        if "random_state" in est.get_params():
            est.set_params(random_state=seed + 1)
        shown = stderr_is_terminal() if show_progress is None else show_progress
        if shown and "verbose" in est.get_params():  # display only
            est.set_params(verbose=1)
        with planted_model_bug(inject_bug, est):
            est.fit(Xa, ya)
        if not hasattr(est, "epsilon_") or not hasattr(est, "coef_"):
            raise ParameterTypeError(f"{type(est).__name__} has no epsilon_ or coef_ after fit; "
                            "audit_estimator needs a linear DP estimator that reports the "
                            "epsilon of its fit")
        fitted["mechanism"] = getattr(est, "mechanism_", None)
        fitted["epsilon"] = _claim_at(est, d, fitted["mechanism"])
        if labels is not None:
            return _class_scores(est, classes, labels, p, m)
        coef = np.asarray(est.coef_, dtype=float).reshape(-1)
        return signs * coef[p:p + m]

    return one_run_audit(train_and_score, n_canaries,
                         claimed_epsilon=lambda: fitted["epsilon"], delta=d, seed=seed,
                         method=method, confidence=confidence,
                         mechanism=lambda: fitted["mechanism"])


def _label_range(y_bound) -> tuple[float, float]:
    """The public label interval ``(lo, hi)`` of a regressor's ``y_bound`` (a bound
    ``Y``: ``[-Y, Y]``; a pair: the interval): the canary of sign ``+1`` gets ``hi``, of
    sign ``-1`` ``lo``, the labels farthest apart the estimator accepts unclipped."""
    from privlearn.models._ssp import check_label_range

    return check_label_range(y_bound)


def _audited_classes(public, y: np.ndarray) -> np.ndarray:
    """The classes the audited classifier fits, sorted: its public ``classes`` when
    given (the canaries' labels are drawn from them, and the fit has one row of
    ``coef_`` per public class even when ``y`` lacks some), else those of ``y``."""
    try:
        classes = np.unique(np.asarray(y if public is None else list(public)))
    except TypeError as e:  # labels of mixed kinds cannot be sorted
        raise ParameterValueError(
            f"the classes must be labels of one kind (all numbers or all strings), got "
            f"{public if public is not None else 'y'!r}; pass the public label set, e.g. "
            "classes=[0, 1, 2]") from e
    if classes.size < 2:
        raise ParameterValueError(
            f"audit_estimator audits a classifier of at least two classes, got "
            f"{classes.size} ({classes.tolist()}); pass the public label set as the "
            "estimator's classes (e.g. classes=[0, 1, 2])")
    return classes


def _class_scores(est, classes: np.ndarray, labels: np.ndarray, p: int, m: int
                  ) -> np.ndarray:
    """Score of each canary of a multinomial fit: its class's coefficient on its own
    column minus the mean of that column over the classes (module docstring)."""
    coef = np.asarray(est.coef_, dtype=float)
    fitted_classes = np.asarray(getattr(est, "classes_", classes))
    if coef.shape != (classes.size, p + m) or not np.array_equal(fitted_classes, classes):
        raise ParameterTypeError(
            f"{type(est).__name__} fitted on {classes.size} classes has coef_ of shape "
            f"{coef.shape} and classes_ {fitted_classes.tolist()}; audit_estimator needs "
            f"one row of coef_ per class, in the order of classes_ ({classes.tolist()}), "
            f"and {p + m} columns (the data's {p} and one per canary)")
    columns = coef[:, p:p + m]
    return columns[labels, np.arange(m)] - columns.mean(axis=0)


def _claim_at(est, delta: float, mechanism) -> float:
    """The epsilon the fitted ``est`` claims at ``delta``: its ``epsilon_`` when
    ``delta`` is the delta of that epsilon, else its ``mechanism_`` accounted at
    ``delta`` (an epsilon at another delta is another claim: compared with a bound at a
    smaller delta it would refute an honest release)."""
    fit_delta = getattr(est, "delta_", est.get_params()["delta"])
    if fit_delta is not None and float(fit_delta) == delta:
        return float(est.epsilon_)
    if mechanism is None:
        raise ConfigurationError(
            f"delta={delta:g}: {type(est).__name__} states its epsilon_ at delta="
            f"{fit_delta!r} only and has no mechanism_ to account at another delta; audit "
            "at its own delta (leave delta out)")
    accountant = est.get_params().get("accountant") or "pld"
    return float(mechanism.epsilon(delta, accountant))
