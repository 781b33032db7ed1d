"""The public base of privlearn's estimators: :class:`PrivateEstimator` and
:class:`ReleasePlan`.

Every private fit (and every label release) is the same short pipeline, owned here as
scikit-learn's ``_fit_context`` owns validation:

1. **validate** the constructor parameters (the declared ``_parameter_constraints``,
   :mod:`privlearn.models.constraints`);
2. **plan** (``_plan``, the estimator's part): calibrate the noise from the budget and
   describe the mechanism that will run, a :class:`ReleasePlan`, from the parameters and
   the data's *shape* only; its epsilon is certified with the plan's accountant here, so
   an accountant that cannot evaluate it refuses the fit before anything is spent;
3. **reserve** the plan on the estimator's ``ledger`` (if any) before any value of the
   data is read (:meth:`privlearn.ledger.Ledger.reserve`; over budget it raises
   :class:`~privlearn.errors.BudgetExceededError` and records nothing); a budget per
   another privacy unit than the record is refused first
   (:func:`privlearn.ledger.check_privacy_unit`);
4. **check the data** (``_check_data``): it reads the data and releases nothing, but
   from the reservation on the plan counts as spent in full, whether the checks and the
   release succeed or raise: a refusal of the data (a NaN, a label outside ``classes``)
   may depend on one record's values, and a reservation settled as "nothing ran" would
   tell the ledger's readers so. Mistakes that the data's shape and type decide alone
   are refused before the reservation and record nothing
   (:func:`~privlearn.models._schema_gate.refuse_bad_schema`);
5. **release** (``_release``, the estimator's part): draw the noise and compute the
   fitted attributes;
6. **settle** the reservation and **record** the fitted attributes with ``mechanism_``,
   ``epsilon_`` (certified, by the plan's accountant) and ``delta_``, all at once.

A failed ``fit`` leaves the estimator as it was before the call (its previous fitted
attributes are put back). The trust model (docs/trust-model.md): everything that leaves
the call -- the fitted object, its ``get_params()``, its attributes, its pickle -- is a
release covered by ``mechanism_``; in particular nothing released holds a seed or a
generator that regenerates the noise (see :func:`make_rng`).

A new estimator implements ``__init__`` (stores its parameters), ``_plan`` and
``_release``, and a one-line ``fit``; docs/guides/extending.md, "A new estimator", is a
complete example (and a test).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import joblib
import numpy as np
import sklearn
from sklearn.base import BaseEstimator, is_regressor
from sklearn.pipeline import Pipeline
from sklearn.utils import get_tags
from sklearn.utils.validation import validate_data

import privlearn
from privlearn import _validation as _v
from privlearn.accounting import (
    Gaussian,
    Laplace,
    Mechanism,
    calibrate,
    compose,
    subsample,
    warn_if_delta_large,
)
from privlearn.errors import (
    BudgetExceededError,
    DataClippedWarning,
    NonFiniteInputError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyLossOverflowError,
    UnsupportedMechanismError,
)
from privlearn.ledger import check_privacy_unit
from privlearn.models._charge import charged_note, is_held, settle_in_full
from privlearn.models._meta_guard import (
    private_type,
    refuse_unaccounted_callers,
    seeded_by_ensemble,
)
from privlearn.models._refused_keywords import refuse_foreign_keywords
from privlearn.models._schema_gate import refuse_bad_schema
from privlearn.models.constraints import RANDOM_STATE, Constraint

__all__ = [
    "PrivateEstimator",
    "ReleasePlan",
    "make_rng",
    "data_shape",
    "validate_input",
    "check_finite_target",
    "check_class_labels",
    "clip_rows",
    "row_norms",
    "resolve_noise_multiplier",
    "require_delta_for_gaussian",
    "refuse_fit_params",
    "refuse_as_step",
    "quiet_data_checks",
    "warnings_once_per_fit",
    "warn_person_fitting",
]


def _default_delta(estimator: object) -> float | None:
    """The default of ``estimator``'s ``delta`` parameter (None when it has none), so that
    a warning about a delta the user did not set says it is the default."""
    try:
        parameter = inspect.signature(type(estimator).__init__).parameters.get("delta")
    except (TypeError, ValueError):  # a signature inspect cannot read
        return None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


@dataclass(frozen=True, kw_only=True)
class ReleasePlan:
    """What one release will run, decided before any value of the data is read.

    Estimators subclass it (frozen, keyword-only) to carry the quantities they
    calibrated, e.g. a noise multiplier or a number of steps, from ``_plan`` to
    ``_release``.

    Attributes
    ----------
    mechanism : Mechanism
        The mechanism the release runs; reserved on the ledger and recorded as
        ``mechanism_``.
    delta : float
        The delta at which ``epsilon_`` is reported.
    accountant : str
        The accountant that certifies ``epsilon_`` (default ``"pld"``).
    """

    mechanism: Mechanism
    delta: float
    accountant: str = "pld"


class MetaGuardedClone:
    """Mixin of the private types (:class:`PrivateEstimator`,
    :class:`~privlearn.models.PrivatePipeline`): ``sklearn.base.clone`` runs the checks
    of :func:`~privlearn.models._meta_guard.refuse_unaccounted_callers` before it copies.

    A meta-estimator clones its inner estimator within its own ``fit``, in the calling
    process, before joblib hands the copies to workers (``n_jobs`` > 1) whose frames do
    not show it: its refusal is raised there, before any fit or ledger reservation, and
    its warnings reach the person fitting from there. A ``clone`` outside a
    meta-estimator's fit (a user's, a :class:`~privlearn.models.PrivateSearchCV`
    candidate) copies as scikit-learn's does. Within a meta-estimator's fit, a second
    copy of the same estimator whose noise starts alike is warned of there
    (:mod:`~privlearn.models._meta_seeds`): its fits may run in workers."""

    def __sklearn_clone__(self) -> Any:
        refuse_unaccounted_callers(self, warn_person_fitting, rng_of=make_rng, cloned=True)
        return super().__sklearn_clone__()  # type: ignore[misc]


@private_type
class PrivateEstimator(MetaGuardedClone, BaseEstimator):
    """Base class of the private estimators: validate -> plan -> reserve -> release ->
    settle -> record (module docstring).

    A subclass declares ``_parameter_constraints`` and implements

    * ``_plan(self, params, X, y) -> ReleasePlan``: from the validated parameters
      (``params``, normalised values) and the data's shape only (never its values);
    * ``_release(self, X, y, plan) -> dict``: the fitted attributes (names ending in
      ``_``), from the checked data; every value must be covered by ``plan.mechanism``;
    * ``fit(self, X, y=None, **fit_params)``: ``return self._fit(X, y, fit_params=fit_params)``
      (with its own docstring); keyword arguments the release cannot account, such as
      ``sample_weight``, are refused before anything is reserved
      (:func:`refuse_fit_params`).

    and may override ``_check_data`` (default: :func:`sklearn.utils.validation.validate_data`
    to float64), ``_n_records`` (the number of private records, for
    :func:`~privlearn.accounting.warn_if_delta_large`; default the number of rows) and
    ``_account`` (the mechanism recorded as ``mechanism_``; default the plan's).

    The base sets ``mechanism_``, ``epsilon_`` and ``delta_``; it never stores the
    generator the noise was drawn from.
    """

    _parameter_constraints: ClassVar[dict[str, Constraint]] = {}
    #: what to try when a ledger budget cannot account this estimator's release (None:
    #: the budget's own error is enough)
    _ledger_advice: ClassVar[str | None] = None
    #: what lowers this estimator's cost when a ledger budget refuses it as too large
    _budget_advice: ClassVar[str] = "fit with a smaller epsilon"
    #: why this estimator cannot be a step of a PrivatePipeline or a PrivateSearchCV run,
    #: and what to do instead (None: it can); see :func:`refuse_as_step`
    _not_a_step: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A keyword of scikit-learn or diffprivlib that the subclass's ``__init__``
        does not take (``class_weight``, ``warm_start``, ``bounds``, ``data_norm``, ...)
        is a :class:`~privlearn.errors.ParameterTypeError` saying why and what to pass
        instead, not Python's bare "unexpected keyword argument"
        (:func:`~privlearn.models._refused_keywords.foreign_keywords`)."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = refuse_foreign_keywords(cls.__dict__["__init__"])

    # -- the estimator's parts ---------------------------------------------------------
    def _plan(self, params: dict[str, Any], X: Any, y: Any) -> ReleasePlan:
        raise NotImplementedError(f"{type(self).__name__} must implement _plan")

    def _release(self, X: Any, y: Any, plan: ReleasePlan) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement _release")

    def _check_data(self, X: Any, y: Any, plan: ReleasePlan) -> tuple[Any, Any]:
        """Validate the data (reads it, releases nothing); default: 2-D float64 ``X``
        and ``y`` of the same length (numeric for regressors; optional when the tags say
        the estimator needs no target)."""
        if y is None and not get_tags(self).target_tags.required:
            return validate_input(self, X, dtype=np.float64), None
        return validate_input(self, X, y, dtype=np.float64, y_numeric=is_regressor(self))

    def _n_records(self, X: Any, y: Any) -> int | None:
        """The number of private records the release reads (None: unknown)."""
        shape = data_shape(X)
        return int(shape[0]) if len(shape) >= 1 else None

    def _account(self, plan: ReleasePlan) -> Mechanism:
        """The mechanism recorded as ``mechanism_`` (the plan's, unless releases
        accumulate into one account, as PATE's do)."""
        return plan.mechanism

    def set_params(self, **params: Any) -> PrivateEstimator:
        """As scikit-learn's ``set_params``; a name the estimator does not take is a
        :class:`~privlearn.errors.ParameterValueError` (a ``ValueError``, as before)
        naming it and the parameters it takes, and nothing is set (scikit-learn sets the
        valid names before the first invalid one).

        A ``random_state`` seed that a scikit-learn ensemble with ``random_state=None``
        gives its copy of the estimator is not set (it would stay on the released copy and
        regenerate its noise): the copy keeps ``random_state=None``, fresh noise
        (:func:`~privlearn.models._meta_guard.seeded_by_ensemble`)."""
        valid = self.get_params(deep=False)
        for key in params:
            name = key.partition("__")[0]
            if name not in valid:
                hint = (" Each fit is a new release from scratch: there is no warm start "
                        "(training on, from a released model, is a further release its "
                        "mechanism_ would not cover)"
                        if name in ("warm_start", "partial_fit") else "")
                raise ParameterValueError(
                    f"Invalid parameter {name!r} for estimator {type(self).__name__}: it "
                    f"takes {', '.join(sorted(valid))}.{hint}")
        if "random_state" in params and seeded_by_ensemble():
            params = {**params, "random_state": None}
        return super().set_params(**params)

    # -- the pipeline ------------------------------------------------------------------
    def _validate_params(self) -> dict[str, Any]:
        """Check every declared parameter; returns ``{name: normalised value}``."""
        return {name: c(name, getattr(self, name))
                for name, c in self._parameter_constraints.items()}

    def planned_mechanism(self, X: Any, y: Any = None) -> Mechanism:
        """The mechanism ``fit(X, y)`` will run, from the parameters and the shape of
        ``X`` only (its values are never read): spend or check it on a ledger before
        fitting."""
        return self._plan(self._validate_params(), X, y).mechanism

    def _fit(self, X: Any, y: Any = None, *, fit_params: Mapping[str, Any] | None = None,
             **context: Any) -> PrivateEstimator:
        """The whole ``fit``: refuse unaccountable ``fit_params``, validate, plan, certify,
        reserve, check the data, release, settle, record. ``context`` goes to ``_plan``
        and ``_release`` (e.g. public validation data). On an exception the previous
        fitted state is put back."""
        refuse_fit_params(self, fit_params)
        with warnings_once_per_fit(), self._refit():
            plan = self._plan(self._validate_params(), X, y, **context)
            account = self._certify(plan)
            fitted = self._run(plan, X, y, **context)
            self._record(plan, fitted, account)
        return self

    def _certify(self, plan: ReleasePlan) -> tuple[Mechanism, float]:
        """The mechanism to record and its certified epsilon at ``plan.delta``, computed
        *before* anything is reserved or read: an accountant that cannot evaluate the
        plan (an unknown name, a failed certification) refuses the fit while nothing has
        been spent, instead of after the release."""
        mechanism = self._account(plan)
        return mechanism, float(mechanism.epsilon(plan.delta, plan.accountant))

    def _run(self, plan: ReleasePlan, X: Any, y: Any, *, label: str | None = None,
             **context: Any) -> dict[str, Any]:
        """Refuse data whose schema no fit accepts, reserve ``plan`` on the ledger, check
        the data, release, and settle the plan in full. Returns the fitted attributes;
        sets nothing.

        Once reserved, the plan is charged in full whatever happens, a refusal by the data
        checks included: such a refusal (a NaN, a label outside ``classes``, a clipping
        warning turned into an error) may depend on the values of one record, and a
        reservation settled as "nothing ran" would tell every reader of the ledger so.
        The mistakes that the data's shape and type decide alone are refused before the
        reservation (:func:`~privlearn.models._schema_gate.refuse_bad_schema`) and
        record nothing."""
        refuse_bad_schema(self, X, y)
        # a meta-estimator's bootstrap, a calibrator
        refuse_unaccounted_callers(self, warn_person_fitting, rng_of=make_rng)
        n = self._n_records(X, y)  # from the shape: public, as delta
        if n is not None and n > 0:
            # before the reservation: raised as an error, it records nothing
            warn_if_delta_large(plan.delta, n, stacklevel=5, default=_default_delta(self))
        reservation = self._reserve(plan.mechanism, label or type(self).__name__)
        try:
            try:
                X, y = self._check_data(X, y, plan)
            except Exception as e:
                if reservation is not None:
                    e.add_note(charged_note(type(self).__name__))
                raise
            return self._release(X, y, plan, **context)
        finally:
            settle_in_full([reservation])

    def _record(self, plan: ReleasePlan, fitted: Mapping[str, Any],
                account: tuple[Mechanism, float] | None = None) -> None:
        """Set the fitted attributes, ``mechanism_``, ``epsilon_`` and ``delta_``
        together; ``account`` is :meth:`_certify`'s result (computed here if None, before
        anything is set, so a failure sets nothing)."""
        mechanism, epsilon = self._certify(plan) if account is None else account
        self.__dict__.update(fitted)
        self.mechanism_ = mechanism
        self.epsilon_ = epsilon
        self.delta_ = float(plan.delta)

    def _reserve(self, mechanism: Mechanism, label: str):
        handle = getattr(self, "ledger", None)
        if handle is None or is_held(self, mechanism):
            return None  # no budget, or a PrivatePipeline reserved it and settles it
        if not callable(getattr(handle, "reserve", None)) or not hasattr(handle, "dataset"):
            raise ParameterTypeError(
                f"ledger must be a budget handle, e.g. Ledger(path).budget('dataset'), got "
                f"{handle!r}")
        check_privacy_unit(
            handle, "record", spender=type(self).__name__,
            remedy="The estimators count every row as one record (they have no notion of "
            "users): pass a per-record budget, Ledger(path).budget(dataset), or, for a "
            "per-user guarantee, train with privlearn.torch.make_private(..., users=..., "
            "max_examples_per_user=...) on the per-user budget.")
        try:
            return handle.reserve(mechanism, label=label)
        except BudgetExceededError as e:
            raise BudgetExceededError(
                f"{e}. The whole {type(self).__name__} release is reserved before the data "
                f"is read: {self._budget_advice}, or see what is left with "
                f"Ledger(path).spent({handle.dataset!r})") from e
        except UnsupportedMechanismError as e:
            if self._ledger_advice is None:
                raise
            raise UnsupportedMechanismError(
                f"the ledger budget cannot account this {type(self).__name__} ({e}). "
                f"{self._ledger_advice}") from e

    @contextlib.contextmanager
    def _not_fitting(self) -> Iterator[None]:
        """Run a release that is not a fit (``sample_coefficients``): the data checks set
        what they validate (``n_features_in_``, ``feature_names_in_``); put the fitted
        state back as it was, whether the call succeeds or raises, so that the estimator
        neither looks fitted nor has its fit's feature count replaced by this call's."""
        previous = {k: v for k, v in vars(self).items() if _is_fitted_name(k)}
        try:
            yield
        finally:
            for k in [k for k in vars(self) if _is_fitted_name(k)]:
                delattr(self, k)
            self.__dict__.update(previous)

    @contextlib.contextmanager
    def _refit(self) -> Iterator[None]:
        """Drop the previous fit's attributes (a release of other data, which this fit's
        ``mechanism_`` would not cover); put them back if the new fit raises."""
        previous = {k: v for k, v in vars(self).items() if _is_fitted_name(k)}
        for k in previous:
            delattr(self, k)
        try:
            yield
        except BaseException:
            for k in [k for k in vars(self) if _is_fitted_name(k)]:
                delattr(self, k)
            self.__dict__.update(previous)
            raise


def _is_fitted_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("__")


def data_shape(X: Any, name: str = "X") -> tuple[int, ...]:
    """The shape of ``X`` for planning: its ``shape`` attribute when it has one (arrays,
    DataFrames, sparse matrices: no value is read), else that of ``np.asarray(X)``.

    Rows of different lengths (a ragged list of lists) are a
    :class:`~privlearn.errors.ParameterValueError` naming ``name``, not NumPy's
    conversion error."""
    shape = getattr(X, "shape", None)
    if shape is not None:
        return tuple(shape)
    try:
        return tuple(np.asarray(X).shape)
    except ValueError as e:
        raise ParameterValueError(
            f"{name} must be a rectangular array (every row of the same length), got "
            f"rows of different lengths ({str(e).split('. ')[0]}); pad or drop the short "
            f"rows with a public rule, or pass a 2-D numpy array") from e


#: What to do about missing or infinite values without a data-dependent release.
_NON_FINITE_ADVICE = (
    "the private estimators need finite numbers: replace each such value with a public "
    "constant (e.g. a value inside the public bounds, chosen without looking at the data) "
    "or drop those rows before fitting; an imputation statistic computed from the private "
    "data (its mean or median) would be a release that nothing accounts"
)


def _dense_array(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array, or None when it is None, sparse (refused as such
    elsewhere) or not array-like at all (not the case of the checks below)."""
    if value is None or hasattr(value, "tocsr"):
        return None
    try:
        return np.asarray(value)
    except Exception:  # noqa: BLE001 - whatever cannot be an array is not our case
        return None


def _non_finite(value: Any) -> bool:
    """Whether ``value`` (array-like) is numeric and holds a NaN or an infinity."""
    if (arr := _dense_array(value)) is None:
        return False
    if arr.dtype.kind not in "fc":
        if arr.dtype.kind != "O":
            return False
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError):
            # numbers with missing values of pandas' nullable dtypes (pandas.NA) or None
            na = getattr(sys.modules.get("pandas"), "NA", None)
            missing = [v is None or (na is not None and v is na) for v in arr.ravel()]
            return any(missing) and all(m or isinstance(v, numbers.Real)
                                        for m, v in zip(missing, arr.ravel(), strict=True))
    return not bool(np.all(np.isfinite(arr)))


def _missing_label(value: Any) -> bool:
    """Whether ``value`` (array-like) is an object array of labels holding a missing one
    (``None``, ``pandas.NA``, a float NaN): a pandas ``string`` or ``category`` column
    with missing entries, on which scikit-learn's checks fail with "boolean value of NA
    is ambiguous" or "Input contains NaN"."""
    if (arr := _dense_array(value)) is None or arr.dtype.kind != "O":
        return False
    na = getattr(sys.modules.get("pandas"), "NA", None)
    return any(v is None or (na is not None and v is na)
               or (isinstance(v, float) and math.isnan(v)) for v in arr.ravel())


#: What to do about text in X without a data-dependent release.
_NON_NUMERIC_ADVICE = (
    "X must be numbers: encode text columns (categories) before fitting, with the "
    "categories listed from the schema, not found in the data, e.g. "
    "sklearn.preprocessing.OneHotEncoder(categories=[[...]], sparse_output=False) or "
    "pandas.get_dummies(pandas.Categorical(column, categories=[...])); categories found in "
    "the private data (OneHotEncoder's categories='auto', get_dummies of the raw column) "
    "would release which values occur"
)


def _non_numeric(value: Any) -> bool:
    """Whether ``value`` (array-like) holds text or objects that are not numbers."""
    if (arr := _dense_array(value)) is None:
        return False
    if arr.dtype.kind not in "OUS":
        return False
    try:
        arr.astype(np.float64)
    except (TypeError, ValueError):
        return True
    return False


def _non_finite_found(value: Any) -> str:
    """What ``value`` holds that is not a finite number: ``"NaN"``, ``"infinity"``,
    ``"NaN and infinity"`` or a missing value (None, ``pandas.NA``)."""
    arr = _dense_array(value)
    if arr is None:
        return "NaN or infinity"
    try:
        arr = arr.astype(np.float64)
    except (TypeError, ValueError):
        return "a missing value (None or pandas.NA)"
    found = [w for w, hit in (("NaN", np.isnan(arr).any()), ("infinity", np.isinf(arr).any()))
             if hit]
    return " and ".join(found) or "NaN or infinity"


def _non_finite_error(owner: str, name: str, value: Any) -> NonFiniteInputError:
    """The refusal of a NaN or an infinity in the input ``name`` (holding ``value``): one
    sentence naming the input, what it holds and what to do."""
    return NonFiniteInputError(
        f"{owner}: Input {name} contains {_non_finite_found(value)}, but "
        f"{_NON_FINITE_ADVICE}.")


def check_finite_target(owner: str, y: Any) -> None:
    """Refuse a numeric ``y`` holding NaN or infinity (:class:`NonFiniteInputError`)."""
    if _non_finite(y):
        raise _non_finite_error(owner, "y", y)


def check_class_labels(owner: str, y: np.ndarray) -> str:
    """The kind of a classifier's labels ``y`` (:func:`sklearn.utils.multiclass.type_of_target`);
    labels that are not all numbers or all strings (a ``None``, a mix of the two) are a
    :class:`~privlearn.errors.ParameterValueError` saying what to do, not NumPy's
    comparison error (reads the labels, releases nothing)."""
    from sklearn.utils.multiclass import type_of_target

    try:
        kind = type_of_target(y, input_name="y", raise_unknown=True)
        np.unique(y)  # sorting mixed types raises
    except (TypeError, ValueError) as e:
        raise ParameterValueError(
            f"{owner}: Unknown label type: the labels y must be all numbers or all "
            "strings, got labels of mixed types, objects or missing labels (None). Map "
            "each label "
            "to one of the public classes, and drop the rows without a label (a label "
            "imputed from the private data would be a release nothing accounts)") from e
    return kind


def validate_input(estimator: Any, X: Any = "no_validation", y: Any = "no_validation",
                   **kwargs: Any) -> Any:
    """:func:`sklearn.utils.validation.validate_data` with its refusals as privlearn's
    typed errors (reads the data, releases nothing).

    A NaN or an infinity in ``X`` or ``y`` is a :class:`~privlearn.errors.NonFiniteInputError`
    that names the input ("Input X contains NaN", as scikit-learn begins), what it holds
    and what to do without a data-dependent release (never
    scikit-learn's advice of a non-private estimator); any other refusal (no rows, a 1-D
    ``X``, a feature count that differs from the fit's, text in ``X``, with how to encode
    it without a data-dependent release) is a
    :class:`~privlearn.errors.ParameterValueError`, a sparse ``X`` (or, with
    ``y_numeric=True``, a ``y`` of strings) a
    :class:`~privlearn.errors.ParameterTypeError`; a missing label among text labels
    (a pandas ``string`` or ``category`` ``y`` with missing entries) a
    :class:`~privlearn.errors.NonFiniteInputError` saying to drop those rows.
    scikit-learn's own first sentence is kept, so code matching on it still does.

    The finiteness check runs whatever scikit-learn's configuration says: under
    ``sklearn.set_config(assume_finite=True)`` (set for speed) scikit-learn skips it, and
    a NaN in one record went into the release (a scaler's ``mean_`` of NaN on the data
    with that record, a number without it).
    """
    try:
        # scikit-learn's quick finiteness check sums the data: extreme finite entries
        # (near 1e308) overflow that sum and it checks entry by entry instead; its
        # overflow warning is not the caller's
        with np.errstate(over="ignore", invalid="ignore"), \
                sklearn.config_context(assume_finite=False):
            out = validate_data(estimator, X, y, **kwargs)
    except (ValueError, TypeError) as e:
        owner = type(estimator).__name__
        first = str(e).split("\n")[0]
        for name, value in (("X", X), ("y", y)):
            if not (isinstance(value, str) and value == "no_validation") and _non_finite(value):
                raise _non_finite_error(owner, name, value) from e
        if not (isinstance(y, str) and y == "no_validation") and _missing_label(y):
            raise NonFiniteInputError(
                f"{owner}: Input y contains a missing label (None, NaN or pandas.NA), but "
                "every record needs one of its labels: drop the rows without a label "
                "before fitting (a label imputed from the private data would be a release "
                "that nothing accounts)") from e
        if isinstance(e, TypeError):
            raise ParameterTypeError(f"{owner}: {e}") from e
        if not (isinstance(X, str) and X == "no_validation") and _non_numeric(X):
            raise ParameterValueError(f"{owner}: {first.rstrip('.')}. {_NON_NUMERIC_ADVICE}.") \
                from e
        raise ParameterValueError(f"{owner}: {e}") from e
    # scikit-learn's y_numeric converts an object y only: an array of strings passes
    # through and would fail later inside the release with a NumPy ufunc error
    y_out = out[1] if isinstance(out, tuple) else None
    if kwargs.get("y_numeric") and getattr(y_out, "dtype", None) is not None and (
            y_out.dtype.kind in "USV"):
        raise ParameterTypeError(
            f"{type(estimator).__name__}: y must be numeric (the target of a regressor), got "
            f"an array of dtype {y_out.dtype}; convert it with y.astype(float) if the strings "
            "are numbers, or use a classifier for class labels")
    if kwargs.get("y_numeric") and _non_finite(y_out):
        # scikit-learn converts an object y (a None, pandas.NA) to NaN without checking
        raise _non_finite_error(type(estimator).__name__, "y", y_out)
    return out


#: set while a pipeline or a search checks the data of a step or run it fits later
_QUIET_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "privlearn_quiet_data_checks", default=False)
#: the warnings given so far in the outermost fit running (None: no fit is running)
_GIVEN: contextvars.ContextVar[set[tuple[type, str]] | None] = contextvars.ContextVar(
    "privlearn_warnings_given", default=None)


@contextlib.contextmanager
def quiet_data_checks() -> Iterator[None]:
    """Run ``_check_data`` ahead of the fit it belongs to (a pipeline's or a search's
    checks before anything is released) without its warnings: the fit itself warns.

    A context variable that :func:`warn_person_fitting` reads, not
    ``warnings.catch_warnings``, which would change the process's warning filters."""
    token = _QUIET_CHECKS.set(True)
    try:
        yield
    finally:
        _QUIET_CHECKS.reset(token)


@contextlib.contextmanager
def warnings_once_per_fit() -> Iterator[None]:
    """Within the outermost fit (an estimator's, a pipeline's, a search's), give each
    distinct warning of :func:`warn_person_fitting` once: a search fits its runs (and a
    pipeline its steps) each warning the same. Python's own once-per-location registry
    cannot do it: it is reset whenever the warning filters change, which scikit-learn's
    input validation does on every call."""
    if _GIVEN.get() is not None:
        yield
        return
    token = _GIVEN.set(set())
    try:
        yield
    finally:
        _GIVEN.reset(token)


def warn_person_fitting(message: str, category: type[Warning], stacklevel: int) -> None:
    """``warnings.warn`` to the person fitting (``stacklevel`` counted from the caller),
    except inside :func:`quiet_data_checks` or when the same warning was already given
    in this fit (:func:`warnings_once_per_fit`)."""
    if _QUIET_CHECKS.get():
        return
    given = _GIVEN.get()
    if given is not None:
        if (category, message) in given:
            return
        given.add((category, message))
    warnings.warn(message, category, stacklevel=_past_library_frames(stacklevel + 1))


def warn_outside_ranges(owner: str, X: np.ndarray, ranges: np.ndarray, name: str,
                        clipped_to: str, stacklevel: int) -> None:
    """A :class:`~privlearn.errors.DataClippedWarning` to the person fitting (by
    :func:`warn_person_fitting`; ``stacklevel`` counted from the caller) counting the
    values of ``X`` outside the per-feature ``ranges`` (rows ``[low, high]``), the
    rows holding them and the first ten such features; nothing if all lie inside.
    ``name`` is the parameter holding the ranges; ``clipped_to`` ends the sentence
    "... and are clipped to ..."."""
    outside = (X < ranges[:, 0]) | (X > ranges[:, 1])
    if not np.any(outside):
        return
    cols = np.flatnonzero(outside.any(axis=0))
    warn_person_fitting(
        f"{owner}: {int(np.count_nonzero(outside))} values in "
        f"{int(np.count_nonzero(outside.any(axis=1)))} of {X.shape[0]} rows lie "
        f"outside {name} (features {cols[:10].tolist()}"
        f"{', ...' if cols.size > 10 else ''}) and are clipped to {clipped_to}. Widen "
        f"{name} (using public knowledge only) if this is more than expected.",
        DataClippedWarning,
        stacklevel=stacklevel + 1,
    )


#: the packages whose frames a warning to the person fitting passes over: a fit called
#: by scikit-learn's Pipeline (through joblib's caching) or by privlearn's own pipeline
#: or search is attributed to the code that called the pipeline, not to a library line
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep
                      for m in (sklearn, joblib, privlearn))


def _past_library_frames(stacklevel: int) -> int:
    """``stacklevel`` for ``warnings.warn`` called by the caller of this function, moved
    up past the frames of scikit-learn and privlearn (never below the one given)."""
    try:
        frame = sys._getframe(stacklevel)  # the frame ``stacklevel`` names, seen from there
    except ValueError:  # past the outermost frame: warnings.warn attributes it to sys
        return stacklevel
    while frame is not None and frame.f_back is not None and (
            os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS)):
        frame, stacklevel = frame.f_back, stacklevel + 1
    return stacklevel


def refuse_as_step(estimator: Any, where: str, name: str | None = None) -> None:
    """Raise :class:`~privlearn.errors.ParameterTypeError` if ``estimator``, or a step of
    it (a pipeline's, nested ones included), cannot be a pipeline step or a search's
    candidate (its ``_not_a_step`` says why and what to do instead). ``where``: the
    pipeline or search that refuses; ``name``: the step's name."""
    reason = getattr(type(estimator), "_not_a_step", None)
    if reason is not None:
        what = type(estimator).__name__
        label = what if name is None else f"pipeline step {name!r} ({what})"
        raise ParameterTypeError(
            f"{where}: {label} cannot be a step of a PrivatePipeline or a candidate of a "
            f"PrivateSearchCV: {reason}")
    if isinstance(estimator, Pipeline):
        for step_name, step in estimator.steps:
            refuse_as_step(step, where, step_name)


def refuse_fit_params(estimator: Any, fit_params: Mapping[str, Any] | None) -> None:
    """Refuse keyword arguments of ``fit`` that the release cannot account, before
    anything is reserved or read (:class:`~privlearn.errors.ParameterTypeError`, a
    ``TypeError``, naming each argument and what to do).

    The estimators do not take ``sample_weight``: their noise is calibrated to the
    sensitivity of one record counted once, and a weight above 1 multiplies a record's
    contribution beyond it (a weighted release would need its own sensitivity). The
    ``fit`` signatures keep it out, so scikit-learn's meta-estimators
    (``has_fit_parameter(est, "sample_weight")``) see the estimators as unweighted.
    """
    if not fit_params:
        return
    owner = type(estimator).__name__
    if "sample_weight" in fit_params:
        raise ParameterTypeError(
            f"{owner}.fit does not support sample_weight: the noise (and so epsilon_) is "
            "calibrated to each record counting once, and a weight above 1 would multiply "
            "one record's contribution beyond the accounted sensitivity. Fit without "
            "sample_weight (drop the rows you would weight 0; duplicating rows multiplies "
            "one record's influence too, which the guarantee does not cover)")
    accepted = [p.name for p in inspect.signature(type(estimator).fit).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    raise ParameterTypeError(
        f"{owner}.fit got unexpected keyword argument(s) {', '.join(map(repr, fit_params))}; "
        f"it takes {', '.join(accepted)}. Set the estimator's options in its constructor "
        "(or with set_params) before fitting")


def make_rng(random_state: object) -> np.random.Generator:
    """The generator a release draws its noise from, for this call only (never stored).

    ``None`` (default): fresh OS entropy, so nothing released can regenerate the noise.
    An int seed, a Generator or a RandomState is the user's choice and makes the noise
    reproducible by whoever knows it (the seed is a constructor parameter, so it travels
    with the model's ``get_params()`` and pickle): fix it for experiments only. A
    Generator is used as is (it advances); a RandomState seeds a new Generator from one
    draw.
    """
    random_state = RANDOM_STATE.check("random_state", random_state)
    if isinstance(random_state, np.random.Generator):
        return random_state
    if isinstance(random_state, np.random.RandomState):
        return np.random.default_rng(random_state.randint(0, 2**32 - 1, dtype=np.uint64))
    return np.random.default_rng(random_state)


def row_norms(X: np.ndarray, ord: int | float = 2) -> np.ndarray:
    """The ``ord``-norm of every row of ``X``, without overflow in the squares: a row
    whose plain norm overflows (entries beyond about ``1e154``) is scaled by its largest
    entry first, ``s ||x / s||``, which is ``inf`` only when the norm itself exceeds the
    largest float (and says nothing). Every other row's norm is ``np.linalg.norm``'s.
    ``X`` must be 2-D (:class:`~privlearn.errors.ParameterValueError` otherwise)."""
    X = np.asarray(X, dtype=float)
    if X.ndim != 2:
        raise ParameterValueError(
            f"X must be a 2-D array of rows (n_samples, n_features), got shape {X.shape}; "
            "reshape one row with X.reshape(1, -1)")
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.linalg.norm(X, ord=ord, axis=1)
    big = ~np.isfinite(norms) & np.all(np.isfinite(X), axis=1)
    if np.any(big):
        scale, rel = _scaled_rows(X[big], ord)
        with np.errstate(over="ignore"):
            norms[big] = scale * rel
    return norms


def _scaled_rows(X: np.ndarray, ord) -> tuple[np.ndarray, np.ndarray]:
    """The largest absolute entry ``s`` of each (finite, non-zero) row and the norm of
    ``x / s`` (entries in [-1, 1]: no overflow)."""
    scale = np.max(np.abs(X), axis=1)
    return scale, np.linalg.norm(X / scale[:, None], ord=ord, axis=1)


def clip_rows(X: np.ndarray, bound: float, ord: int | float = 2) -> tuple[np.ndarray, int]:
    """Scale every row whose ``ord``-norm exceeds ``bound`` down to norm ``bound``.

    Returns the clipped copy and the number of rows that were clipped. Rows within the
    bound are unchanged, so data that already satisfies the bound is never altered. A row
    of extreme finite entries (near ``1e308``, whose squares overflow) is scaled by its
    largest entry first, ``bound (x / s) / ||x / s||``: no overflow warning, and the row
    clipped to norm ``bound`` in its own direction (not to zero).

    ``bound`` must be a finite number > 0: a NaN bound would clip nothing and a negative
    one flip every row, both silently, so either is a
    :class:`~privlearn.errors.ParameterValueError` naming it.
    """
    bound = _v.check_positive("bound", bound, hint="the public bound on a row's norm")
    norms = row_norms(X, ord)
    over = norms > bound
    if not np.any(over):
        return X, 0
    Xc = np.array(X, dtype=float, copy=True)
    huge = over & ~np.isfinite(norms)  # the norm exceeds the largest float
    plain = over & ~huge
    Xc[plain] *= (bound / norms[plain])[:, None]
    if np.any(huge):
        scale, rel = _scaled_rows(Xc[huge], ord)
        Xc[huge] = (Xc[huge] / scale[:, None]) * (bound / rel)[:, None]
    return Xc, int(np.count_nonzero(over))


def noisy_sum_mechanism(noise: str, noise_multiplier: float, sampling_rate: float,
                        steps: int) -> Mechanism:
    """``steps`` compositions of ``Gaussian(noise_multiplier)`` (``noise="gaussian"``) or
    ``Laplace(noise_multiplier)``, Poisson-subsampled at ``sampling_rate`` when it is below
    1: the account of a sum of contributions of L2 (resp. L1) sensitivity 1 released with
    noise ``steps`` times (Abadi et al. 2016, Algorithm 1; Zhu & Wang 2019 for the
    sampling). DP-SGD's steps and the label releases' queries are this mechanism."""
    base = Gaussian(noise_multiplier) if noise == "gaussian" else Laplace(noise_multiplier)
    if sampling_rate < 1.0:
        base = subsample(base, sampling_rate, scheme="poisson")
    return compose(base, steps=steps)


def resolve_noise_multiplier(
    noise_multiplier: float | None,
    mechanism_of: Callable[[float], Mechanism],
    epsilon: float,
    delta: float,
    *,
    accountant: str = "pld",
    describe: str = "",
) -> float:
    """The noise multiplier a run uses: the given one, after checking that the mechanism
    it gives spends at most ``epsilon`` at ``delta`` (a clear error otherwise), or, when
    ``None``, the smallest one that does (:func:`privlearn.accounting.calibrate`,
    certified, rounded up). ``describe`` completes the error message ("over 100 steps").

    Every private estimator with a ``noise_multiplier=None`` option goes through here:
    one place decides "use the given noise or calibrate".
    """
    if noise_multiplier is not None:
        sigma = float(noise_multiplier)
        try:
            spent = float(mechanism_of(sigma).epsilon(delta, accountant))
        except PrivacyLossOverflowError:  # above 1e12 or unrepresentable: over any budget
            spent = math.inf
        if spent > epsilon:
            shown = f"{spent:.6g}" if math.isfinite(spent) else "above 1e12 (unrepresentable)"
            raise ParameterValueError(
                f"noise_multiplier={sigma} spends epsilon={shown} > epsilon={epsilon} "
                f"at delta={delta}{' ' + describe if describe else ''}; leave "
                "noise_multiplier=None to calibrate it, or raise epsilon")
        return sigma
    return float(calibrate(mechanism_of, epsilon, delta, accountant=accountant))


def require_delta_for_gaussian(delta: float, owner: str, *, laplace: bool,
                               alternative: str | None = None) -> None:
    """Refuse ``delta == 0`` with Gaussian noise, which has no pure (epsilon, 0)-DP
    guarantee; ``laplace``: the estimator offers ``noise="laplace"`` for pure DP;
    ``alternative``: what to do instead, when not the default advice."""
    if delta == 0.0:
        if alternative is None:
            alternative = ("Use noise='laplace' (L1 clipping, pure DP) for delta=0, or pass "
                           "delta > 0, e.g. 1e-6" if laplace
                           else "Pass a small delta such as 1e-6")
        raise ParameterValueError(
            f"delta=0 is impossible with Gaussian noise: the Gaussian mechanism satisfies "
            f"no pure (epsilon, 0)-DP guarantee, and {owner} adds Gaussian noise. "
            f"{alternative}")
