"""The ``steps`` parameter of :class:`~privlearn.models.PrivatePipeline`, checked when it
is fitted or planned (private helper of :mod:`privlearn.models.preprocessing`).

scikit-learn's ``Pipeline`` checks its steps only when fitted, with a plain
``ValueError`` (an empty list) or an unpacking error (a step that is not a pair); the
constructor only stores them, so that ``clone`` and ``get_params`` work. The pipeline
keeps that convention and refuses a malformed ``steps`` with a typed error before any
step is planned or fitted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sklearn.pipeline import Pipeline

from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.models.base import _is_fitted_name, quiet_data_checks

__all__ = ["check_public_schema", "check_step_data", "check_steps", "pipeline_getitem",
           "restoring_fits"]

_EXAMPLE = "e.g. steps=[('scale', PrivateStandardScaler(...)), ('model', DPSGDClassifier(...))]"


def check_steps(owner: str, steps: Any) -> None:
    """Refuse ``steps`` unless it is a non-empty list (or tuple) of ``(name, estimator)``
    pairs with string names.

    Raises
    ------
    ParameterTypeError
        ``steps`` is not a list or tuple, or an entry is not a ``(str, estimator)`` pair.
    ParameterValueError
        ``steps`` is empty.
    """
    if not isinstance(steps, list | tuple):
        raise ParameterTypeError(
            f"{owner}: steps must be a list of (name, estimator) pairs, got {steps!r} "
            f"({type(steps).__name__}); {_EXAMPLE}"
        )
    if len(steps) == 0:
        raise ParameterValueError(
            f"{owner}: steps must be a non-empty list of (name, estimator) pairs, got "
            f"{steps!r}; pass at least one step, {_EXAMPLE}"
        )
    for i, step in enumerate(steps):
        if not (isinstance(step, list | tuple) and len(step) == 2 and isinstance(step[0], str)):
            raise ParameterTypeError(
                f"{owner}: steps[{i}] must be a (name, estimator) pair with a str name, "
                f"got {step!r} in steps={steps!r}; {_EXAMPLE}"
            )


def pipeline_getitem(pipe: Any, ind: Any) -> Any:
    """``PrivatePipeline.__getitem__``: a step (by position or name), or, for a slice, a
    sub-pipeline of the same class with the pipeline's parameters.

    scikit-learn's ``Pipeline.__getitem__`` builds the slice from ``steps``, ``memory``
    and ``verbose`` only, so ``pipe[:-1]`` lost ``delta``, ``public_steps`` and
    ``accountant`` (a refit refused a public step, and accounted with another
    accountant) and had no ``epsilon_``. Slicing a fitted pipeline accounts the slice:
    its ``mechanism_`` is the composition of the sliced steps' mechanisms, at the
    pipeline's ``delta`` (or the sum of the sliced steps' ``delta_``).
    """
    got = Pipeline.__getitem__(pipe, ind)
    if not isinstance(ind, slice):
        return got
    params = {k: v for k, v in pipe.get_params(deep=False).items() if k != "steps"}
    sub = type(pipe)(got.steps, **params)
    if hasattr(pipe, "mechanism_"):
        sub._account(None if pipe.delta is None else pipe.delta_)
    return sub


def check_step_data(step: Any, placeholder: Any, y: Any, plan: Any) -> None:
    """A private step's own data checks (``_check_data``, which releases nothing) on
    zeros of its input's shape and ``y``. The checks set what they validate
    (``n_features_in_``, a classifier's ``classes_`` read off ``y``): the step's state
    is put back, so that a pipeline whose fit fails later leaves no step looking
    fitted."""
    state = dict(vars(step))
    try:
        with quiet_data_checks():  # the step warns when it is fitted
            step._check_data(placeholder, y, plan)
    finally:
        step.__dict__.clear()
        step.__dict__.update(state)


@contextlib.contextmanager
def restoring_fits(pipe: Any) -> Iterator[None]:
    """Run a pipeline's fit; if it raises, put back the fitted state of the pipeline and
    of every estimator it holds (its steps, nested ones included) as it was before.

    A refit that fails part-way has refitted the steps before the failure and not those
    after it: the pipeline held a mix of two fits, which nothing describes (its account
    is dropped), and ``predict`` combined them -- a new scaler before a model fitted on
    the old one's output. As an estimator's failed fit does
    (:meth:`PrivateEstimator._refit <privlearn.models.base.PrivateEstimator._refit>`), the
    pipeline is left as it was: the previous fit and the account that describes it. What
    the failed fit released was charged on the ledgers all the same."""
    original = pipe.steps  # scikit-learn puts fitted clones in it when memory= is set
    entries = list(original)
    held = {id(pipe): pipe}
    for value in pipe.get_params(deep=True).values():
        if hasattr(value, "fit") and hasattr(value, "__dict__") and not isinstance(value, type):
            held.setdefault(id(value), value)
    saved = [(est, {k: v for k, v in vars(est).items() if _is_fitted_name(k)})
             for est in held.values()]
    try:
        yield
    except BaseException:
        if isinstance(original, list):
            original[:] = entries
        pipe.steps = original
        for est, attrs in saved:
            for k in [k for k in vars(est) if _is_fitted_name(k)]:
                delattr(est, k)
            est.__dict__.update(attrs)
        raise


def check_public_schema(
    owner: str,
    name: str,
    step: Any,
    n_features: int,
    *,
    X: Any = None,
    sparse_in: bool | None = False,
    previous: tuple[str, Any] | None = None,
) -> None:
    """Refuse, while the pipeline plans (before anything is reserved), a free step whose
    parameters or input schema it cannot take: a step that declares such a check
    (``_check_public_schema``, e.g. :class:`~privlearn.models.PublicRangeScaler` with
    one bound per feature) runs it on the public width; otherwise its fit would refuse
    them only after the private steps' budgets were reserved, and charge them in full.

    Parameters
    ----------
    owner, name : str
        The pipeline's class name and the step's name (for the messages).
    step : estimator
        The free step.
    n_features : int
        The width of its input.
    X : array-like, optional
        The pipeline's own ``X`` when the step is the first one fitted (its input is
        then ``X`` as given): its schema is checked as a private estimator's is
        (:func:`~privlearn.models._schema_gate.refuse_bad_schema`: dimensions, rows and
        columns, complex numbers, dates; shapes and dtypes only, never a value).
    sparse_in : bool or None
        Whether the step's input is sparse by the schema (None: not known); a step whose
        tags say it takes dense data is then refused.
    previous : (name, step), optional
        The step whose output is the input (None: ``X`` itself).

    Raises
    ------
    ParameterTypeError
        A sparse input for a step that takes dense data; dates in ``X``.
    ParameterValueError
        The step's parameters do not fit ``n_features``; ``X`` is not 2-D, empty, or
        complex.
    """
    from privlearn.models._public_sparsity import refuse_sparse_input
    from privlearn.models._schema_gate import refuse_bad_schema

    check = getattr(step, "_check_public_schema", None)
    if not callable(check) or isinstance(step, type):
        return
    refuse_sparse_input(owner, name, step, sparse_in, previous)
    if X is not None:
        refuse_bad_schema(step, X)
    check(n_features)


def unplanned_step(name: str, step: Any) -> ParameterTypeError:
    """The refusal of a pipeline step that learns from the data without a mechanism."""
    return ParameterTypeError(
        f"pipeline step {name!r} ({type(step).__name__}) learns from the data but has no "
        "planned mechanism: it would release exact statistics, and the pipeline's cost "
        "cannot be known before fitting. Use a privlearn.models.PrivateEstimator step "
        "(e.g. PrivateStandardScaler for StandardScaler; PublicRangeScaler(bounds=...) "
        "for a MinMaxScaler over public ranges), or fit it on public data and "
        "pass sklearn.frozen.FrozenEstimator(fitted step). If its fit learns nothing from "
        "the values (an encoder given its category lists, a FunctionTransformer; the "
        "estimators guide, 'A DataFrame with text columns', lists such steps), name it: "
        f"PrivatePipeline(steps, public_steps=({name!r},))")
