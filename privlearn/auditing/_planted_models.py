"""Self-test facility: plant a known privacy bug in ONE fit of a NumPy estimator of
:mod:`privlearn.models` (NOT for real fits).

``audit_estimator(..., inject_bug=BUG)`` and the privacy regression tests fit the real
estimator with one of these defects planted, to show that the audit catches it (the
PyTorch engine's counterpart is :mod:`privlearn.auditing._planted`). Each bug is a
context manager that patches ONE estimator instance (instance attributes, restored on
exit; nothing global is changed) while the estimator's plan, hence its ``mechanism_``
and ``epsilon_``, stays that of the *intended* configuration:

``no-noise``     every noise draw of the fit is 0;
``noise-x0.1``   every noise draw is 0.1 times the intended one;
``no-clipping``  the public bound is not enforced: the linear regressors keep rows above
                 ``x_bound`` (the row clipping of ``_check_data`` is skipped), DP-SGD clips
                 the per-example gradients at ``1e6 max_grad_norm`` (in effect never)
                 while its noise stays ``sigma max_grad_norm``;
``rate-x10``     (DP-SGD with ``sampling_rate < 1``) every record joins each Poisson batch
                 with probability ``min(1, 10 q)`` while the accountant uses ``q`` (and the
                 gradient is still divided by the expected batch size ``q n``).

Where a fit draws its randomness: every estimator makes one generator from its
``random_state`` (:func:`privlearn.models.base.make_rng`) and draws its noise from it
with ``standard_normal``, ``normal`` or ``laplace``, and DP-SGD its Poisson batches with
``random``. The noise and rate bugs set ``random_state`` to a :class:`_PlantedGenerator`
on the same bit stream whose noise draws are scaled (resp. whose uniforms are divided
by 10); the clipping bug patches the estimator's own clipping step. Which seams an
estimator type has is declared in :func:`_seams` (a
:class:`~privlearn._type_registry.TypeRegistry`): an estimator without an entry, or
without the seam of the bug asked for, is refused with a typed error before anything
is fitted.

This module is the only place that knows these internals; adapt it when they change.
Imports the estimators (scikit-learn) only when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from privlearn._type_registry import TypeRegistry
from privlearn.auditing._planted import _patch_attr
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = ["MODEL_BUGS", "check_model_bug", "planted_model_bug"]

#: The bugs :func:`planted_model_bug` plants ("none": the estimator as it is).
MODEL_BUGS = ("none", "no-noise", "noise-x0.1", "no-clipping", "rate-x10")

#: DP-SGD's clipping bound under ``no-clipping``, in units of ``max_grad_norm``.
_UNCLIPPED = 1e6

Patch = Callable[[Any], contextlib.AbstractContextManager]


@dataclasses.dataclass(frozen=True)
class _Seam:
    """Where one bug reaches one estimator type: ``plant(est)`` is the context manager
    that patches the instance; ``refuse(est)``, when given, raises a typed error for a
    configuration the bug cannot reach (called before anything is fitted)."""

    plant: Patch
    refuse: Callable[[Any], None] | None = None


class _PlantedGenerator(np.random.Generator):
    """A generator on ``bit_generator`` whose noise draws (``standard_normal``,
    ``normal``, ``laplace``) are ``noise`` times the plain ones and whose uniforms
    (``random``, Poisson sampling) are divided by ``rate``; same bits consumed, in the
    same order, as the plain generator's."""

    def __init__(self, bit_generator, *, noise: float = 1.0, rate: float = 1.0) -> None:
        super().__init__(bit_generator)
        self._noise = float(noise)
        self._rate = float(rate)

    def standard_normal(self, size=None, dtype=np.float64, out=None):
        drawn = super().standard_normal(size, dtype, out)
        if out is None:
            return self._noise * drawn
        out *= self._noise
        return out

    def normal(self, loc=0.0, scale=1.0, size=None):
        return loc + self._noise * super().normal(0.0, scale, size)

    def laplace(self, loc=0.0, scale=1.0, size=None):
        return loc + self._noise * super().laplace(0.0, scale, size)

    def random(self, size=None, dtype=np.float64, out=None):
        drawn = super().random(size, dtype, out)
        if out is None:
            return drawn / self._rate
        out /= self._rate
        return out


def _generator(*, noise: float = 1.0, rate: float = 1.0) -> Patch:
    """The seam of the noise (and DP-SGD's sampling): ``random_state`` becomes a
    :class:`_PlantedGenerator` on the bit stream the fit would have drawn from."""

    def patch(est):
        from privlearn.models.base import make_rng

        planted = _PlantedGenerator(
            make_rng(est.random_state).bit_generator, noise=noise, rate=rate
        )
        return _patch_attr(est, "random_state", planted)

    return patch


@contextlib.contextmanager
def _unclipped_rows(est) -> Iterator[None]:
    """The linear regressors' clipping seam: ``_check_data`` clips the rows to
    ``plan.x_bound``; the patched one runs it with a bound no row exceeds (the largest
    row norm of ``X``), then puts back the intercept column (the constant ``x_bound``).
    The noise keeps the plan's bound, which ``_release`` reads from its own plan."""
    from privlearn.models.base import row_norms

    check = est._check_data

    def unclipped(X, y, plan):
        widest = float(np.max(row_norms(np.asarray(X, dtype=float)), initial=0.0))
        Xc, yc = check(X, y, dataclasses.replace(plan, x_bound=max(plan.x_bound, widest)))
        if est.fit_intercept:
            Xc = Xc.copy()
            Xc[:, -1] = plan.x_bound
        return Xc, yc

    with _patch_attr(est, "_check_data", unclipped):
        yield


@contextlib.contextmanager
def _unclipped_gradients(est) -> Iterator[None]:
    """DP-SGD's clipping seam: the fit clips at ``max_grad_norm`` and adds noise
    ``sigma max_grad_norm``, both read from the parameter when the fit runs; it becomes
    ``1e6 max_grad_norm`` (no gradient of the audit reaches it) and every noise draw is
    scaled by ``1e-6``, so the noise stays the intended ``sigma max_grad_norm``. The
    plan (hence ``epsilon_``) does not depend on ``max_grad_norm``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_generator(noise=1.0 / _UNCLIPPED)(est))
        stack.enter_context(
            _patch_attr(est, "max_grad_norm", _UNCLIPPED * float(est.max_grad_norm))
        )
        yield


def _refuse_full_batch(est) -> None:
    """rate-x10 needs Poisson sampling: a full-batch fit draws no uniforms to boost."""
    if float(est.sampling_rate) >= 1.0:
        raise ConfigurationError(
            f"inject_bug='rate-x10' needs a Poisson-sampled {type(est).__name__} "
            f"(sampling_rate < 1), got sampling_rate={est.sampling_rate!r}: a full-batch "
            "fit draws no sample to boost; pass e.g. sampling_rate=0.05"
        )


@functools.cache
def _seams() -> TypeRegistry[dict[str, _Seam]]:
    """``estimator type -> {bug: patch}``: where each bug reaches each type's fit
    (built on first use: it imports the estimators)."""
    from privlearn.models import (
        AdaSSPRegressor,
        DPSGDClassifier,
        DPSGDRegressor,
        NoisyGDRegressor,
        SSPRegressor,
    )

    noise = {"no-noise": _Seam(_generator(noise=0.0)), "noise-x0.1": _Seam(_generator(noise=0.1))}
    registry: TypeRegistry[dict[str, _Seam]] = TypeRegistry("planted-bug seams")
    registry.register(
        SSPRegressor,
        AdaSSPRegressor,
        NoisyGDRegressor,
        value={**noise, "no-clipping": _Seam(_unclipped_rows)},
    )
    registry.register(
        DPSGDClassifier,
        DPSGDRegressor,
        value={
            **noise,
            "no-clipping": _Seam(_unclipped_gradients),
            "rate-x10": _Seam(_generator(rate=10.0), _refuse_full_batch),
        },
    )
    return registry


def check_model_bug(bug: str, estimator) -> Patch | None:
    """The patch that plants ``bug`` in ``estimator`` (None for ``"none"``); a typed
    error naming what is supported when the estimator's type has no seam for it, or its
    configuration none the bug can reach."""
    if not isinstance(bug, str) or bug not in MODEL_BUGS:
        raise ParameterValueError(
            f"inject_bug must be one of {MODEL_BUGS}, got {bug!r}; 'none' (the default) "
            "audits the estimator as it is"
        )
    if bug == "none":
        return None
    seams = _seams().lookup(estimator)
    if seams is None:
        names = ", ".join(sorted(c.__name__ for c in _seams()))
        raise ParameterTypeError(
            f"inject_bug={bug!r}: no bug can be planted in {type(estimator).__name__}; "
            f"the planted bugs reach {names}. Audit it with inject_bug='none'"
        )
    if bug not in seams:
        raise ConfigurationError(
            f"inject_bug={bug!r} does not apply to {type(estimator).__name__}, which "
            f"supports {', '.join(sorted(seams))} (rate-x10 needs Poisson sampling)"
        )
    seam = seams[bug]
    if seam.refuse is not None:
        seam.refuse(estimator)
    return seam.plant


@contextlib.contextmanager
def planted_model_bug(bug: str, estimator) -> Iterator[None]:
    """Plant ``bug`` (one of :data:`MODEL_BUGS`) in ``estimator`` for the block: fit it
    inside. Its ``mechanism_`` and ``epsilon_`` stay those of the intended fit."""
    patch = check_model_bug(bug, estimator)
    if patch is None:
        yield
        return
    with patch(estimator):
        yield
