"""Private preprocessing: a DP standard scaler, private bounds, and pipelines that report
one total epsilon.

A scikit-learn ``StandardScaler`` publishes the exact mean and variance of every feature,
and so does any model fitted on its output; a ``Pipeline(StandardScaler(), private
model)`` is therefore not private at all. Here:

* :class:`PrivateStandardScaler` estimates means and standard deviations with noise
  (optionally after privately finding clipping bounds), and exposes its ``mechanism_``;
* :func:`private_quantile`, :func:`choose_x_bound`, :func:`choose_y_bound` choose clipping
  bounds (``x_bound`` / ``y_bound`` of the linear models) privately;
* :class:`PrivatePipeline` (a scikit-learn ``Pipeline``) composes the mechanisms of its
  steps into one ``mechanism_`` with one ``epsilon_``, and refuses a step that learned
  from the data without a mechanism; :func:`pipeline_mechanism` does the same for a
  fitted plain ``Pipeline``.

References
----------
.. [1] F. McSherry, K. Talwar (2007), Mechanism Design via Differential Privacy, FOCS
       (exponential mechanism, Theorem 6).
.. [2] A. Smith (2011), Privacy-preserving statistical estimation with optimal
       convergence rates, STOC (private quantiles by the exponential mechanism).
.. [3] C. Dwork, A. Roth (2014), The Algorithmic Foundations of Differential Privacy,
       Sections 3.4-3.5 (Gaussian mechanism on clipped sums; composition).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.base import OneToOneFeatureMixin, TransformerMixin
from sklearn.pipeline import Pipeline
from sklearn.utils import get_tags
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from privlearn import _validation as _v
from privlearn.accounting import (
    Gaussian,
    Mechanism,
    calibrate,
    compose,
    get_accountant,
)
from privlearn.accounting.registry import pure_epsilon
from privlearn.errors import (
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyLeakWarning,
    UnsupportedMechanismError,
)
from privlearn.models import _public_sparsity as _sparsity
from privlearn.models._bounds import (
    choose_x_bound,
    choose_y_bound,
    feature_ranges,
    private_quantile,
)
from privlearn.models._charge import reserved_in_full
from privlearn.models._inverse_input import check_inverse_input
from privlearn.models._meta_guard import private_type, refuse_unaccounted_callers
from privlearn.models._pipeline_steps import (
    check_public_schema,
    check_step_data,
    check_steps,
    pipeline_getitem,
    restoring_fits,
    unplanned_step,
)
from privlearn.models._public_fits import public_fit_refusal, refuse_learning_public_fit
from privlearn.models._public_width import frozen_width, public_output_width
from privlearn.models._public_width import probe_width as _probe_width
from privlearn.models._refused_keywords import PIPELINE_KEYWORDS, refuse_keywords
from privlearn.models._schema_gate import refuse_bad_schema
from privlearn.models._shared_noise import frozen_seeds, shared_noise_groups
from privlearn.models.base import (
    MetaGuardedClone,
    PrivateEstimator,
    ReleasePlan,
    check_finite_target,
    data_shape,
    make_rng,
    refuse_as_step,
    refuse_fit_params,
    require_delta_for_gaussian,
    validate_input,
    warn_outside_ranges,
    warn_person_fitting,
    warnings_once_per_fit,
)
from privlearn.models.constraints import (
    ACCOUNTANT,
    EPSILON,
    LEDGER,
    N_BINS,
    RANDOM_STATE,
    Delta,
    Real,
    Unchecked,
)

__all__ = [
    "PrivatePipeline",
    "PrivateStandardScaler",
    "choose_x_bound",
    "choose_y_bound",
    "pipeline_mechanism",
    "private_quantile",
]


# ----------------------------------------------------------------------------------
# the scaler
# ----------------------------------------------------------------------------------


def scaler_mechanism(noise_multiplier: float, private_bounds: bool = True) -> Mechanism:
    """What :class:`PrivateStandardScaler` runs: a Gaussian histogram release (when the
    bounds are found privately) and a Gaussian release of the clipped moment sums, both
    with ``noise_multiplier`` relative to their L2 sensitivity."""
    return compose(Gaussian(noise_multiplier), steps=2 if private_bounds else 1)


@functools.lru_cache(maxsize=256)
def _calibrate_scaler(eps: float, delta: float, private_bounds: bool, accountant: str) -> float:
    return float(calibrate(lambda s: scaler_mechanism(s, private_bounds), eps, delta,
                           accountant=accountant))


def _bin_edges(lo: float, hi: float, n_bins: int) -> np.ndarray:
    """Edges uniform in ``asinh(x / w)`` over the public range ``[lo, hi]``, with
    ``w = max(|lo|, |hi|) 1e-4``: geometric away from 0 (a few bins locate the bulk of a
    heavy-tailed positive feature), nearly uniform on a range far from 0. Data-independent.
    """
    w = max(abs(lo), abs(hi)) * 1e-4
    t = np.linspace(math.asinh(lo / w), math.asinh(hi / w), n_bins + 1)
    edges = w * np.sinh(t)
    edges[0], edges[-1] = lo, hi
    return edges


@dataclass(frozen=True, kw_only=True)
class ScalerPlan(ReleasePlan):
    """The scaler's plan: the calibrated noise multiplier and the public ranges; bounds
    found privately at ``quantile`` (None: the public ranges are the bounds)."""

    noise_multiplier: float
    ranges: np.ndarray
    quantile: float | None
    n_bins: int
    min_scale: float


class PrivateStandardScaler(OneToOneFeatureMixin, TransformerMixin, PrivateEstimator):
    """Standardise features with privately estimated means and standard deviations,
    ``(epsilon, delta)``-DP.

    1. Bounds (``quantile`` not None). Each feature's public ``feature_range`` is cut into
       ``n_bins`` bins (uniform in ``asinh``, :func:`_bin_edges`); the ``d`` histograms are
       released at once with the Gaussian mechanism (one record adds 1 to one bin per
       feature: L2 sensitivity ``sqrt(d)``), and ``[lo_j, hi_j]`` is the span of the bins
       holding the noisy ``quantile`` and ``1 - quantile`` cumulative fractions.
       Otherwise ``[lo_j, hi_j]`` is the public range.
    2. Moments. With ``c = (lo + hi) / 2``, ``r = (hi - lo) / 2`` and
       ``u = (clip(x) - c) / r`` in ``[-1, 1]^d``, the sums of ``[u, u^2, 1]`` over the
       records (L2 sensitivity ``sqrt(2 d + 1)`` under add/remove) are released with the
       Gaussian mechanism; ``mean_ = c + r S_1 / N``, ``var_ = r^2 (S_2 / N - (S_1 / N)^2)``
       with the noisy count ``N`` (floored at 1) and ``var_`` floored at
       ``r^2 max(min_scale^2, 2 se)``, ``se`` the noise's standard error of the variance
       estimate (so noise cannot make a scale vanish).

    Both releases use the same noise multiplier, calibrated so that their composition is
    ``(epsilon, delta)``-DP (exact for Gaussians; Dong, Roth & Su 2022, Corollary 3.3).

    Parameters
    ----------
    epsilon : float > 0
        The budget of one fit (bounds and moments); ``epsilon_`` is what it spent.
    delta : float in (0, 1)
        Chosen well below ``1 / n_samples``, e.g. 1e-6.
    feature_range : (lower, upper) or array (n_features, 2)
        Public range of each feature (known without looking at the data). Required.
        Values outside it are clipped to it (a ``DataClippedWarning`` says how many).
    quantile : float in (0, 0.5) or None
        Clip at privately found quantiles (default 0.01) or, None, at ``feature_range``.
    n_bins : int >= 2
        Histogram bins per feature for the private bounds (default 64).
    min_scale : float > 0
        Floor of ``scale_`` relative to ``r`` (default 1e-3).
    accountant : str
    random_state : None, int or Generator
        The noise's source. None (default): fresh OS entropy, and nothing the fitted
        scaler carries can regenerate its noise. A seed or generator makes the noise
        reproducible by whoever knows it: fix it for experiments only.
    ledger : BudgetHandle, optional
        ``Ledger(path).budget(dataset)``: :meth:`fit` reserves ``mechanism_`` on it before
        reading the data (refused with ``BudgetExceededError`` when over budget).
        :meth:`planned_mechanism` gives it beforehand.

    Attributes
    ----------
    mean_, scale_, var_ : ndarray (n_features,)
    bounds_ : ndarray (n_features, 2)
        The clipping bounds used (released: they are part of the output).
    n_samples_seen_ : float
        The noisy count.
    mechanism_ : Mechanism
        ``compose(Gaussian(s), steps=2)`` (or 1 step with public bounds).
    noise_multiplier_ : float
    epsilon_, delta_ : float

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).normal(5.0, 2.0, size=(5000, 3))
    >>> sc = PrivateStandardScaler(epsilon=1.0, delta=1e-6, feature_range=(-100, 100),
    ...                            random_state=0).fit(X)
    >>> bool(np.all(np.abs(sc.mean_ - 5.0) < 0.5))
    True
    """

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        feature_range=None,
        quantile: float | None = 0.01,
        n_bins: int = 64,
        min_scale: float = 1e-3,
        accountant: str = "pld",
        random_state=None,
        ledger=None,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.feature_range = feature_range
        self.quantile = quantile
        self.n_bins = n_bins
        self.min_scale = min_scale
        self.accountant = accountant
        self.random_state = random_state
        self.ledger = ledger

    def _ranges(self, d: int) -> np.ndarray:
        if self.feature_range is None:
            raise ParameterValueError(
                "feature_range is required: the public (lower, upper) range of the features "
                "(a data-derived range would leak); e.g. feature_range=(0, 100)"
            )
        return feature_ranges(self.feature_range, d)

    _parameter_constraints = {
        "epsilon": EPSILON,
        "delta": Delta(),
        "feature_range": Unchecked("the public (lower, upper) range, checked against the "
                                   "number of features by _ranges"),
        "quantile": Real(0, 0.5, low_open=True, high_open=True, allow_none=True,
                         hint="the tail mass clipped on each side, e.g. 0.01"),
        "n_bins": N_BINS,
        "min_scale": Real(0, None, low_open=True, hint="e.g. 1e-3"),
        "accountant": ACCOUNTANT,
        "random_state": RANDOM_STATE,
        "ledger": LEDGER,
    }

    def _plan(self, params: dict[str, Any], X, y) -> ScalerPlan:
        """Calibrate one noise multiplier for the histogram and moment releases, from the
        budget and the number of features (the columns of ``X``, public)."""
        shape = data_shape(X)
        if len(shape) != 2:
            raise ParameterValueError(
                f"Expected 2D array, got an array of shape {shape} instead: X must be "
                "(n_samples, n_features); reshape a single feature with X.reshape(-1, 1)")
        require_delta_for_gaussian(params["delta"], type(self).__name__, laplace=False)
        q = params["quantile"]
        s = _calibrate_scaler(params["epsilon"], params["delta"], q is not None,
                              str(params["accountant"]))
        return ScalerPlan(mechanism=scaler_mechanism(s, q is not None), delta=params["delta"],
                          accountant=params["accountant"], noise_multiplier=s,
                          ranges=self._ranges(shape[1]), quantile=q, n_bins=params["n_bins"],
                          min_scale=params["min_scale"])

    def fit(self, X, y=None, **fit_params):
        """Estimate the means and scales privately (``sample_weight`` is refused)."""
        return self._fit(X, y, fit_params=fit_params)

    def _check_data(self, X, y, plan: ScalerPlan):
        """Validate ``X``; values outside ``feature_range`` are clipped to it (a
        :class:`DataClippedWarning` gives their count, which is never stored)."""
        X = validate_input(self, X, dtype=np.float64)
        warn_outside_ranges(type(self).__name__, X, plan.ranges, "feature_range",
                            "it; the fit uses the clipped data", stacklevel=5)
        return X, None

    def _release(self, X, y, plan: ScalerPlan) -> dict[str, Any]:
        """The noisy histogram (bounds), then the noisy clipped moments."""
        rng = make_rng(self.random_state)
        n, d = X.shape
        s, q, nb, ms, fr = (plan.noise_multiplier, plan.quantile, plan.n_bins,
                            plan.min_scale, plan.ranges)
        if q is None:
            bounds = fr.copy()
        else:
            edges = [_bin_edges(fr[j, 0], fr[j, 1], nb) for j in range(d)]
            hist = np.stack([
                np.bincount(np.clip(np.searchsorted(edges[j], X[:, j], side="right") - 1,
                                    0, nb - 1), minlength=nb)
                for j in range(d)
            ]).astype(float)
            hist += rng.normal(scale=s * math.sqrt(d), size=hist.shape)
            # scan each tail from its own end, so the noise of one tail's (nearly empty)
            # bins does not accumulate into the other bound
            left = np.cumsum(hist, axis=1)
            right = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]
            total = np.maximum(left[:, -1], 1.0)
            bounds = np.empty((d, 2))
            for j in range(d):
                hits_lo = np.flatnonzero(left[j] >= q * total[j])
                hits_hi = np.flatnonzero(right[j] >= q * total[j])
                i_lo = int(hits_lo[0]) if hits_lo.size else 0
                i_hi = int(hits_hi[-1]) if hits_hi.size else nb - 1
                if i_hi < i_lo:
                    i_lo, i_hi = i_hi, i_lo
                bounds[j] = edges[j][i_lo], edges[j][i_hi + 1]
        c = bounds.mean(axis=1)
        r = 0.5 * (bounds[:, 1] - bounds[:, 0])
        u = (np.clip(X, bounds[:, 0], bounds[:, 1]) - c) / r
        noisy = np.concatenate([u.sum(0), (u * u).sum(0), [float(n)]])
        noisy = noisy + rng.normal(scale=s * math.sqrt(2 * d + 1), size=noisy.shape)
        N = max(noisy[-1], 1.0)
        m1 = np.clip(noisy[:d] / N, -1.0, 1.0)
        m2 = np.clip(noisy[d : 2 * d] / N, 0.0, 1.0)
        # floor: ``min_scale^2`` or twice the noise's standard error of ``m2 - m1^2``
        # (post-processing of the noisy count), whichever is larger
        se = s * math.sqrt(2 * d + 1) / N * (1.0 + 2.0 * np.abs(m1))
        var_u = np.maximum(m2 - m1 * m1, np.maximum(ms * ms, 2.0 * se))
        var = r * r * var_u
        # scale_ as r sqrt(var_u), not sqrt(var): r^2 underflows to 0 for a narrow range
        return {"bounds_": bounds, "mean_": c + r * m1, "var_": var,
                "scale_": r * np.sqrt(var_u), "n_samples_seen_": float(N),
                "noise_multiplier_": s}

    def transform(self, X):
        """``(X - mean_) / scale_`` (post-processing: no privacy cost)."""
        check_is_fitted(self)
        X = validate_input(self, X, reset=False, dtype=np.float64)
        return (X - self.mean_) / self.scale_

    def inverse_transform(self, X):
        """``X * scale_ + mean_`` (post-processing: no privacy cost). ``X`` is in the
        transformed space, so its column names are not checked; its number of columns
        is."""
        check_is_fitted(self)
        X = check_inverse_input(self, X, self.n_features_in_)
        return X * self.scale_ + self.mean_


# ----------------------------------------------------------------------------------
# pipelines
# ----------------------------------------------------------------------------------


def pipeline_mechanism(pipe: Pipeline, *, public_steps: tuple[str, ...] = ()) -> Mechanism:
    """The composition of the ``mechanism_`` of every fitted step of ``pipe``.

    Steps that need no fitting (scikit-learn tag ``requires_fit=False``: ``Normalizer``,
    ``FunctionTransformer``, ...) and ``"passthrough"`` cost nothing. A step that learned
    from the data without a ``mechanism_`` (e.g. a plain ``StandardScaler``) makes the
    pipeline non-private, and is refused with ``ValueError`` unless its name is in
    ``public_steps`` (fitted on public data only -- your responsibility).
    """
    if not isinstance(pipe, Pipeline):
        raise ParameterTypeError(f"pipe must be a scikit-learn Pipeline, got {type(pipe).__name__}")
    public_steps = _check_public_steps(public_steps)
    mechs: list[Mechanism] = []
    for name, step in pipe.steps:
        if step is None or (isinstance(step, str) and step == "passthrough"):
            continue
        m = getattr(step, "mechanism_", None)
        if isinstance(m, Mechanism):
            mechs.append(m)
            continue
        _refuse_hidden_release(name, step)
        if name not in public_steps and get_tags(step).requires_fit:
            raise ParameterValueError(
                f"pipeline step {name!r} ({type(step).__name__}) learned from the data but "
                "has no mechanism_: it releases exact statistics. Use a private "
                "counterpart (e.g. PrivateStandardScaler for StandardScaler), or list it "
                "in public_steps if it was fitted on public data"
            )
    return compose(mechs)


@private_type
class PrivatePipeline(MetaGuardedClone, Pipeline):
    """A scikit-learn ``Pipeline`` whose fitted steps' mechanisms compose into one
    ``mechanism_`` and one ``epsilon_`` (at ``delta``).

    Parameters
    ----------
    steps : non-empty list of (name, estimator), checked when fitted or planned
    delta : float in (0, 1), optional
        The delta at which ``epsilon_`` is reported. Default: the sum of the steps'
        ``delta_`` (each step's own target).
    public_steps : tuple of str
        Names of steps whose fitted state may be released without noise (see
        :func:`pipeline_mechanism`). :meth:`fit` fits every step on the data it is given,
        these included, so a public step it fits must provably learn nothing from the
        values: it must be on the allow-list of :mod:`privlearn.models._public_fits`
        (``OneHotEncoder(categories=[...])``,
        ``SimpleImputer(strategy="constant", keep_empty_features=True)``, stateless
        steps, containers of them, ...). Any other (a ``StandardScaler``,
        ``PCA``, ``TargetEncoder``, an encoder with ``categories="auto"``) is refused
        with :class:`~privlearn.errors.ConfigurationError` before any step is fitted or
        any budget reserved. A step fitted beforehand on public data is kept as it is
        when wrapped in ``sklearn.frozen.FrozenEstimator``; passed fitted without it, it
        is refused rather than refitted on the private data.
    accountant : str
        Accountant composing the steps (default ``"pld"``: tight composition, so the
        total is at most, and usually below, the sum of the steps' epsilons).
    memory, verbose, transform_input
        As :class:`sklearn.pipeline.Pipeline`.

    Attributes
    ----------
    mechanism_ : Mechanism
    epsilon_, delta_ : float
    """

    @refuse_keywords(PIPELINE_KEYWORDS)
    def __init__(self, steps, *, delta=None, public_steps=(), accountant="pld",
                 transform_input=None, memory=None, verbose=False):
        super().__init__(steps, transform_input=transform_input, memory=memory,
                         verbose=verbose)
        self.delta = delta
        self.public_steps = public_steps
        self.accountant = accountant

    __getitem__ = pipeline_getitem  # a slice keeps delta, public_steps, accountant

    def planned_mechanism(self, X, y=None) -> Mechanism:
        """The mechanism :meth:`fit` will run, from the steps' parameters and the shape
        of ``X`` only: the composition, in order, of every step's planned mechanism
        (:meth:`PrivateEstimator.planned_mechanism
        <privlearn.models.PrivateEstimator.planned_mechanism>`), i.e. what ``mechanism_``
        will be. Steps that cost nothing (``"passthrough"``, steps that need no fitting,
        ``public_steps``) are skipped.

        Each step plans on the shape its input will have: a step that keeps the number
        of features (``PrivateStandardScaler`` and every scikit-learn one-to-one
        transformer) passes the shape on; a step that needs no fitting is applied to one
        row of zeros to learn its output width (data-independent); a public step that
        the pipeline fits has its width read off its parameters and the schema of ``X``,
        never off the data (``OneHotEncoder(categories=[[...], ...])``, a
        ``ColumnTransformer`` of such encoders...: ``_public_width.public_output_width``).
        One whose width would be learned from the data is refused (``categories="auto"``
        with ``ValueError``: pass the category lists); so is a step that learns from the
        data without a planned mechanism (it could not be accounted before the fit).

        Returns
        -------
        Mechanism
            Equal to the ``mechanism_`` that ``fit(X, y)`` will record.
        """
        return compose([mech for *_, mech in self._planned_steps(X, y)])

    def _planned_steps(self, X, y, *, strict: bool = True):
        """``(name, step, placeholder, plan, mechanism)`` of every private step in order,
        each planned on a read-only array of zeros (the placeholder) of the shape its
        input will have: by its own ``_plan`` (``plan``; None for a nested pipeline) and
        ``planned_mechanism``. A fitted step that may change the number of features
        before the last step ends the plan: refused with ``TypeError`` when ``strict``,
        else the steps after it are not yielded. A private step's, or a free step's,
        refusal of the schema of its input (its shape, a sparse matrix, complex numbers
        or dates, of ``X`` as given for the first step) is raised here, from shapes and
        dtypes only, so before anything is reserved."""
        check_steps(type(self).__name__, self.steps)
        shape = data_shape(X)
        if len(shape) != 2:
            raise ParameterValueError(
                f"Expected 2D array, got an array of shape {shape} instead: X must be "
                "(n_samples, n_features)")
        public = _check_public_steps(self.public_steps)
        columns = getattr(X, "columns", None)  # a DataFrame's column names: its schema
        names = [str(c) for c in columns] if columns is not None else None
        steps = [(n, s) for n, s in self.steps
                 if not (s is None or (isinstance(s, str) and s == "passthrough"))]
        is_sparse, previous = _sparsity.input_is_sparse(X), None  # of the next step's input
        for i, (name, step) in enumerate(steps):
            last = i == len(steps) - 1
            placeholder = np.broadcast_to(np.float64(0.0), shape)
            if isinstance(step, PrivateEstimator):  # its mechanism_ counts
                refuse_as_step(step, type(self).__name__, name)
                _sparsity.refuse_sparse_input(type(self).__name__, name, step, is_sparse,
                                              previous)
                plan = step._plan(step._validate_params(), placeholder, y)
                # the first step's input is X as given: its dtypes are its schema too
                refuse_bad_schema(step, X if i == 0 else placeholder, y)
                yield name, step, placeholder, plan, plan.mechanism
            elif isinstance(step, PrivatePipeline):
                yield name, step, placeholder, None, step.planned_mechanism(
                    X if i == 0 else placeholder, y)
            elif _frozen_release(step) is not None:  # released before, held by the fit
                yield name, step, placeholder, None, _frozen_release(step)
            else:
                _refuse_hidden_release(name, step)
                check_public_schema(type(self).__name__, name, step, shape[1],
                                    X=X if i == 0 else None, sparse_in=is_sparse,
                                    previous=previous)
                if name in public:
                    refuse_learning_public_fit(name, step)
                elif get_tags(step).requires_fit:
                    raise unplanned_step(name, step)
            if last:
                break
            previous = (name, step)
            is_sparse = _sparsity.output_is_sparse(name, step, shape[1], names, is_sparse,
                                                   private=isinstance(step, PrivateEstimator
                                                                      | PrivatePipeline))
            if isinstance(step, OneToOneFeatureMixin) or (
                    _frozen(step) and isinstance(step.estimator, OneToOneFeatureMixin)):
                continue
            if _frozen(step):  # its fit (on public data) is kept: probe its transform
                shape, names = (shape[0], frozen_width(name, step, shape[1])), None
                continue
            # a public step fitted here, or one that needs no fitting: its width from its
            # parameters and X's schema (never from the data it will be fitted on)
            try:
                width = public_output_width(name, step, shape[1], names, _probe_width)
            except (ParameterTypeError, ParameterValueError):
                if not strict:
                    return
                raise
            shape, names = (shape[0], width), None

    def _check_before_fit(self, X, y, delta: float | None) -> None:
        """Refuse, before the first step is fitted, what a later step would refuse after
        the earlier ones had spent their budgets: each private step's planning (its own
        ``_plan``: its parameters against the shape of its input), its own data checks
        (``_check_data``, which releases nothing) on ``y`` and on zeros of the shape of
        its input (the values of ``X`` a step sees exist only once the steps before it
        are fitted), and ``delta=0`` with a step adding Gaussian noise (no pure-DP
        guarantee), and a composition of the steps' planned mechanisms that ``accountant``
        cannot evaluate (the account after the fit would fail once every step has spent).
        Steps after one that may change the number of features are checked when they are
        fitted. The checks that read values (of ``y``) are :meth:`_check_values`."""
        mechs, deltas = [], []
        for name, step, placeholder, plan, mech in self._planned_steps(X, y, strict=False):
            mechs.append(mech)
            deltas.append(plan.delta if plan is not None else 0.0)
            if plan is not None:
                if y is None:  # zeros and no y: no value read, so checked before reserving
                    check_step_data(step, placeholder, y, plan)
            if delta == 0.0 and math.isinf(pure_epsilon(mech)):
                require_delta_for_gaussian(
                    delta, f"pipeline step {name!r} ({type(step).__name__})", laplace=False,
                    alternative="Pass a small delta such as 1e-6 (below 1/n_samples), or "
                                "leave delta=None to report epsilon_ at the sum of the "
                                "steps' own deltas")
        try:
            compose(mechs).epsilon(sum(deltas) if delta is None else delta, self.accountant)
        except UnsupportedMechanismError as e:
            raise UnsupportedMechanismError(
                f"{type(self).__name__}(accountant={self.accountant!r}) cannot compose its "
                f"steps' mechanisms ({e}), so the pipeline could not be accounted after its "
                "steps had spent; nothing was fitted. Pass an accountant that evaluates every "
                "step, e.g. accountant='rdp' for a PrivateSearchCV step with "
                "method='random_stopping' (an RDP curve)") from e

    def _check_values(self, X, y) -> None:
        """The refusals before the first step is fitted that read values, made once the
        steps' plans are reserved (:meth:`_charged`): a numeric ``y`` with a NaN or an
        infinity, and each private step's own data checks (``_check_data``, which
        releases nothing) on ``y`` and on zeros of the shape of its input."""
        check_finite_target(type(self).__name__, y)
        for _name, step, placeholder, plan, _mech in self._planned_steps(X, y, strict=False):
            if plan is not None and y is not None:
                check_step_data(step, placeholder, y, plan)

    def _ledger_steps(self, X, y):
        """``(estimator, planned mechanism)`` of every private estimator the fit runs,
        those of nested pipelines included, in order (as far as the plan reaches)."""
        for _name, step, placeholder, plan, mech in self._planned_steps(X, y, strict=False):
            if plan is not None:
                yield step, mech
            elif isinstance(step, PrivatePipeline):
                yield from step._ledger_steps(placeholder, y)

    def _private_steps(self):
        """Every private estimator among the steps, those of nested pipelines included."""
        for _name, step in self.steps:
            if isinstance(step, PrivatePipeline):
                yield from step._private_steps()
            elif isinstance(step, PrivateEstimator):
                yield step

    @contextlib.contextmanager
    def _charged(self, X, y):
        """Reserve every private step's planned mechanism on its ledger before any value
        is read, check the values, and run the block; the reservations are charged in
        full however it ends (:func:`~privlearn.models._charge.reserved_in_full`, the
        rule of :meth:`PrivateEstimator._run <privlearn.models.base.PrivateEstimator._run>`):
        whether the data is refused may depend on one record, and a missing entry
        would tell the ledger's readers so."""
        with restoring_fits(self), reserved_in_full(
                type(self).__name__, self._ledger_steps(X, y), self._private_steps()):
            for name in ("mechanism_", "epsilon_", "delta_"):  # set once all are fitted
                self.__dict__.pop(name, None)
            self._check_values(X, y)
            yield

    def fit(self, X, y=None, **params):
        """Fit every step, then account the whole pipeline.

        Refused before any step is fitted (a later step would refuse it after the
        earlier ones had released and spent their budgets): a numeric ``y`` with a NaN or
        an infinity, an invalid ``delta`` or ``accountant``, a step that learns from the
        data without a mechanism (unless in ``public_steps``), a private step's invalid
        parameter or refusal of the shape or type of ``y`` (its own planning and data
        checks, see :meth:`_check_before_fit`), ``delta=0`` with a step adding Gaussian
        noise, a step that needs no fitting but mixes rows before a private step
        (:class:`~privlearn.errors.BatchDependenceError`: one record would change every
        row the private step sees), a fit parameter a private step cannot account
        (``model__sample_weight``), and a step whose ledger budget cannot hold its
        planned mechanism (``BudgetExceededError``, see :meth:`_check_budgets`).

        With ledgers on the steps, every private step's planned mechanism is reserved
        once the checks that public information decides have passed (the shapes, the
        parameters, the budgets' room: these record nothing) and before any value is
        read; from then on it is charged in full whatever happens (a NaN in ``y``, a
        label outside a step's ``classes``, a public step's fit refusing a value), as
        an estimator's own reservation is."""
        delta = self._check_fit(X, y, params)
        with self._charged(X, y), warnings_once_per_fit():  # clipping once in a search
            super().fit(X, y, **params)
            self._account(delta)
        return self

    @available_if(lambda self: _final_has(self, "transform", "fit_transform",
                                                passthrough=True))
    def fit_transform(self, X, y=None, **params):
        """Fit every step and transform with the final one, accounted and refused as
        :meth:`fit` (scikit-learn's ``Pipeline.fit_transform`` does not call ``fit``)."""
        delta = self._check_fit(X, y, params)
        with self._charged(X, y), warnings_once_per_fit():  # clipping once in a search
            Xt = super().fit_transform(X, y, **params)
            self._account(delta)
        return Xt

    @available_if(lambda self: _final_has(self, "fit_predict"))
    def fit_predict(self, X, y=None, **params):
        """Fit every step and ``fit_predict`` with the final one, accounted and refused
        as :meth:`fit` (scikit-learn's ``Pipeline.fit_predict`` does not call ``fit``)."""
        delta = self._check_fit(X, y, params)
        with self._charged(X, y), warnings_once_per_fit():  # clipping once in a search
            y_pred = super().fit_predict(X, y, **params)
            self._account(delta)
        return y_pred

    def _check_fit(self, X, y, params: dict[str, Any], *, budgets: bool = True
                   ) -> float | None:
        """What every fitting method refuses before the first step is fitted (see
        :meth:`fit`) and that public information alone decides (the values are checked
        by :meth:`_check_values`); returns the validated ``delta`` (None: the steps' sum).
        ``budgets``: also check that the steps' ledger budgets can hold their planned
        mechanisms (False when the steps' ledgers will not be charged)."""
        check_steps(type(self).__name__, self.steps)
        refuse_unaccounted_callers(self, warn_person_fitting)
        delta = (None if self.delta is None
                 else _v.check_delta("delta", self.delta, hint="e.g. 1e-6"))
        get_accountant(self.accountant)
        self._check_steps(params)
        self._check_before_fit(X, y, delta)
        _warn_shared_seeds(self)
        if budgets:
            self._check_budgets(X, y)
        return delta

    def _check_budgets(self, X, y) -> None:
        """Refuse, before the first step is fitted, a step whose ledger budget cannot
        hold its planned mechanism (with those of the other steps charged to the same
        budget): otherwise the steps before it would release and spend, and the fit
        fail at that step (:class:`~privlearn.errors.BudgetExceededError`; advisory, as
        :meth:`privlearn.ledger.Ledger.check`: each step still reserves its own)."""
        groups: dict[tuple, tuple[Any, list[Mechanism]]] = {}
        for _name, step, _placeholder, plan, mech in self._planned_steps(X, y, strict=False):
            handle = getattr(step, "ledger", None) if plan is not None else None
            if handle is None or not callable(getattr(handle, "check", None)):
                continue  # no budget (or not a handle: the step's own fit refuses it)
            key = (str(getattr(getattr(handle, "ledger", None), "path", id(handle))),
                   getattr(handle, "dataset", None), getattr(handle, "privacy_unit", None))
            groups.setdefault(key, (handle, []))[1].append(mech)
        for handle, mechs in groups.values():
            handle.check(compose(mechs))

    def _account(self, delta: float | None) -> None:
        """Set ``mechanism_``, ``delta_`` and ``epsilon_`` from the fitted steps."""
        mechanism = pipeline_mechanism(self, public_steps=self.public_steps)
        if delta is None:
            deltas = [getattr(s, "delta_", 0.0) for _, s in self.steps
                      if isinstance(getattr(s, "mechanism_", None), Mechanism)]
            delta = float(sum(deltas))
        epsilon = float(mechanism.epsilon(delta, self.accountant))
        self.mechanism_, self.delta_, self.epsilon_ = mechanism, delta, epsilon

    def _check_steps(self, params: dict[str, Any]) -> None:
        """What :meth:`fit` refuses before fitting any step: a step that learns from the
        data without a mechanism (not in ``public_steps``), a private step's invalid
        parameter (its declared constraints), and ``step__param`` fit parameters that a
        private step's ``fit`` does not take (:func:`~privlearn.models.base.refuse_fit_params`)."""
        public = _check_public_steps(self.public_steps)
        if "sample_weight" in params:  # scikit-learn's Pipeline refuses it untyped
            refuse_fit_params(self, {"sample_weight": params["sample_weight"]})
        routed: dict[str, dict[str, Any]] = {}
        for key, value in params.items():
            name, sep, param = key.partition("__")
            if sep:
                routed.setdefault(name, {})[param] = value
        for name, step in self.steps:
            if step is None or (isinstance(step, str) and step == "passthrough"):
                continue
            if isinstance(step, PrivateEstimator):
                refuse_as_step(step, type(self).__name__, name)  # PATE has no fit at all
                step._validate_params()
                taken = inspect.signature(type(step).fit).parameters
                refuse_fit_params(step, {k: v for k, v in routed.get(name, {}).items()
                                         if k not in taken or k in ("self", "X", "y")})
            elif not isinstance(step, PrivatePipeline):
                _refuse_hidden_release(name, step)
                if name not in public and (
                        _frozen_release(step) is None and get_tags(step).requires_fit):
                    raise unplanned_step(name, step)
        refuse_refitting_public_fits(self)
        for name, step in _refitted_public_steps(self).items():
            refuse_learning_public_fit(name, step)


def _private_seeds(pipe: Pipeline, prefix: str = "") -> list[tuple[str, Any]]:
    """``(name, random_state)`` of the private steps, nested and frozen (frozen_seeds)."""
    seeds: list[tuple[str, Any]] = []
    for name, step in pipe.steps:
        if isinstance(step, PrivatePipeline):
            seeds.extend(_private_seeds(step, f"{prefix}{name}__"))
        elif isinstance(step, PrivateEstimator):
            seeds.append((prefix + name, getattr(step, "random_state", None)))
        elif _frozen_release(step) is not None:
            seeds.extend(frozen_seeds(_private_seeds(Pipeline([(name, step.estimator)]), prefix)))
    return seeds


def _warn_shared_seeds(pipe: Pipeline) -> None:
    """Warn (:class:`~privlearn.errors.PrivacyLeakWarning`) when private steps' noise
    starts alike (one integer ``random_state``, or generators in one state, e.g. copied by
    ``clone``: :mod:`~privlearn.models._shared_noise`): they draw the same normals, so
    combined releases cancel the noise, which ``mechanism_`` composes as independent."""
    for label, names in shared_noise_groups(_private_seeds(pipe)):
        warn_person_fitting(
            f"{type(pipe).__name__}: steps {names} share {label}: they draw the same "
            "noise, so their releases can be combined to cancel it, which mechanism_ (the "
            "composition of independent noise draws) does not cover. Give each private "
            "step its own seed (or one Generator object, drawn from in turn), or leave "
            "random_state=None.",
            PrivacyLeakWarning, stacklevel=4)


def _frozen(step: Any) -> bool:
    """Whether ``step`` is a ``sklearn.frozen.FrozenEstimator`` (its ``fit`` does nothing:
    it keeps the fit it wraps)."""
    from sklearn.frozen import FrozenEstimator

    return isinstance(step, FrozenEstimator)


def _frozen_release(step: Any) -> Mechanism | None:
    """The ``mechanism_`` of a private fit that a ``FrozenEstimator`` step keeps (None
    for any other step): the fitted pipeline holds that release, so it is part of the
    pipeline's ``mechanism_`` and of its plan alike (counted again by each fit, never
    less)."""
    if not _frozen(step):
        return None
    m = getattr(step.estimator, "mechanism_", None)
    return m if isinstance(m, Mechanism) else None


def _refitted_public_steps(pipe: Pipeline) -> dict[str, Any]:
    """``{name: step}`` of the public steps that ``pipe.fit`` fits on the data it is given:
    those that learn from data, other than a ``FrozenEstimator`` (whose ``fit`` keeps the
    fit it wraps) or a private step (accounted)."""
    public = _check_public_steps(pipe.public_steps)
    return {name: step for name, step in pipe.steps
            if name in public and not (step is None or isinstance(step, str))
            and not isinstance(step, PrivateEstimator | PrivatePipeline) and not _frozen(step)
            and get_tags(step).requires_fit}


def refuse_refitting_public_fits(pipe: Pipeline) -> None:
    """Refuse (:class:`~privlearn.errors.ConfigurationError`) a public step that is
    already fitted and whose fit learns from the data's values: ``public_steps`` named
    steps fitted on public data, and the pipeline's ``fit`` would refit it on the
    private data it is given, releasing what it learns there un-noised (a scaler's
    exact means). Wrapping it in ``sklearn.frozen.FrozenEstimator`` keeps its public
    fit. A step that learns nothing from the values
    (:func:`~privlearn.models._public_fits.public_fit_refusal`) is refitted alike."""
    from sklearn.exceptions import NotFittedError

    for name, step in _refitted_public_steps(pipe).items():
        if public_fit_refusal(name, step) is None:
            continue
        try:
            check_is_fitted(step)
        except (NotFittedError, TypeError):
            continue
        raise ConfigurationError(
            f"public step {name!r} ({type(step).__name__}) is already fitted, but "
            f"{type(pipe).__name__}.fit fits every step on the data it is given: it would "
            "be refitted on the private data, and what it learns there released "
            "un-noised. To keep its fit on public data, wrap it: "
            f"({name!r}, sklearn.frozen.FrozenEstimator(step))")


def _check_public_steps(public_steps: Any) -> tuple[str, ...]:
    """``public_steps`` as a tuple of step names; a single string is refused (``"scale"
    in "scaler"`` would make a step public by a substring match)."""
    if isinstance(public_steps, str) or not all(
            isinstance(n, str) for n in _iterable(public_steps)):
        raise ParameterTypeError(
            f"public_steps must be a sequence of step names, got {public_steps!r}; e.g. "
            "public_steps=('encode',) for one step")
    return tuple(public_steps)


def _iterable(value: Any) -> tuple:
    try:
        return tuple(value)
    except TypeError:
        return (None,)  # not a sequence: refused as not holding names


def _final_has(pipe: Pipeline, *methods: str, passthrough: bool = False) -> bool:
    """``available_if`` check: the final step has one of ``methods`` (or, with
    ``passthrough``, is ``"passthrough"``), as scikit-learn's ``Pipeline`` decides which
    of its fitting methods exist."""
    last = pipe._final_estimator
    if (passthrough and isinstance(last, str) and last == "passthrough") or any(
            hasattr(last, m) for m in methods):
        return True
    raise AttributeError(f"the final step {type(last).__name__} has none of {methods}")


def _refuse_hidden_release(name: str, step: Any) -> None:
    """Refuse (:class:`~privlearn.errors.ParameterTypeError`) a step that is neither a
    private step nor a frozen private fit but holds one (a ``ColumnTransformer``,
    ``FeatureUnion``, scikit-learn ``Pipeline`` or ``FrozenEstimator`` around a private
    estimator): the pipeline accounts only its own private steps, so that release would
    be missing from ``mechanism_`` and ``epsilon_`` (in ``public_steps`` too, which
    only says that what a step learns reveals nothing)."""
    if _frozen_release(step) is not None:
        return
    inner, todo = None, [("", step)]
    while todo and inner is None:  # FrozenEstimator's get_params is not deep: walk it
        prefix, outer = todo.pop()
        for key, est in (outer.get_params(deep=True) if hasattr(outer, "get_params")
                         else {}).items():
            if isinstance(est, PrivateEstimator | PrivatePipeline):
                inner = (prefix + key, est)
                break
            if hasattr(est, "get_params") and not isinstance(est, type):
                todo.append((f"{prefix}{key}__", est))
    if inner is None:
        return
    raise ParameterTypeError(
        f"pipeline step {name!r} ({type(step).__name__}) holds the private estimator "
        f"{inner[0]!r} ({type(inner[1]).__name__}), whose release a PrivatePipeline "
        f"cannot account inside a {type(step).__name__}: it would be missing from the "
        "pipeline's mechanism_ and epsilon_ (listing the step in public_steps does not "
        "account it). Make each private estimator a step of the PrivatePipeline itself: "
        "e.g. one PrivateStandardScaler over every column, with feature_range one "
        "(lower, upper) row per column, after a public encoding step such as "
        "ColumnTransformer([('cat', OneHotEncoder(categories=[...]), columns)], "
        "remainder='passthrough') listed in public_steps")

