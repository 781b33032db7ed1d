"""Noisy gradient descent for least squares (Bassily, Smith & Thakurta 2014; the notebook).

The private smoothness release and :class:`NoisyGDRegressor`, re-exported by
:mod:`privlearn.models.linear`, where the sensitivities and the privacy argument are
described; the loop and its learning rate are in :mod:`privlearn.models._gd`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn import _validation as _v
from privlearn._progress import progress
from privlearn.accounting import Gaussian, Mechanism, calibrate, compose
from privlearn.errors import ParameterValueError, PrivacyLeakWarning, PrivacyLossOverflowError
from privlearn.models._gd import noisy_gd_paths, theoretical_learning_rate
from privlearn.models._linear_base import COMMON_CONSTRAINTS, LinearPlan, _PrivateLinearBase
from privlearn.models._ssp import ADASSP_Z
from privlearn.models.base import make_rng, resolve_noise_multiplier, warn_person_fitting
from privlearn.models.constraints import N_ITER, VERBOSE, Integer, Real, Unchecked

#: Smoothness modes of :class:`NoisyGDRegressor` (besides a float).
SMOOTHNESS_MODES = ("private", "public", "data")

#: The most iterations ``n_iter=None`` calibrates to the budget: above it (about half an
#: hour of fitting or more; a huge epsilon at the default ``noise_multiplier`` asks for
#: billions) the fit is refused before anything is spent, with what to pass instead.
MAX_CALIBRATED_ITERATIONS = 10**8

#: Fraction of NoisyGD's budget, in ``1 / sigma^2`` (Gaussian-DP ``mu^2``), spent on the
#: private smoothness release. Fixed in advance (not tuned on any data set).
SMOOTHNESS_BUDGET_FRACTION = 0.01


def _noisy_gd_mechanism(sigma: float, n_iter: int, sigma_l: float | None) -> Mechanism:
    """What NoisyGD runs: ``n_iter`` Gaussians with multiplier ``sigma``, preceded by the
    smoothness release ``Gaussian(sigma_l)`` when there is one."""
    gd = compose(Gaussian(sigma), steps=n_iter)
    return gd if sigma_l is None else compose([Gaussian(sigma_l), gd])


@functools.lru_cache(maxsize=256)
def _smoothness_sigma(eps: float, delta: float, accountant: str) -> float:
    """``sigma_total / sqrt(SMOOTHNESS_BUDGET_FRACTION)`` with ``sigma_total`` the
    multiplier of one Gaussian that is exactly (eps, delta)-DP (rounded up)."""
    total = float(calibrate(lambda s: Gaussian(s), eps, delta, accountant=accountant))
    return total / math.sqrt(SMOOTHNESS_BUDGET_FRACTION)


@dataclass(frozen=True, kw_only=True)
class NoisyGDPlan(LinearPlan):
    """NoisyGD's plan: the schedule (``noise_multiplier``, ``n_iter``), the smoothness
    release's multiplier (None: not released), how the learning rate is set
    (``learning_rate``: a float, or None for the theoretical rate from ``smoothness``, a
    mode or a float) and the logging period."""

    noise_multiplier: float
    n_iter: int
    smoothness_noise_multiplier: float | None
    learning_rate: float | None
    smoothness: str | float
    log_every: int | None = None


class NoisyGDRegressor(_PrivateLinearBase):
    """Full-batch noisy gradient descent for least squares, (epsilon, delta)-DP, as in the
    notebook (the reference comparison of SSP, AdaSSP and noisy gradient descent that
    ``privlearn reproduce linear-regression`` reproduces; the documentation's provenance
    page).

    ``theta_{t+1} = theta_t - lr (sum_i x_i (x_i^T theta_t - y_i) + GS_t sigma N(0, I))``
    with the theta-dependent sensitivity ``GS_t = x_bound^2 ||theta_t|| + x_bound Y``
    (``Y`` the label bound, see ``y_bound``). The iterations are the composition of
    ``n_iter`` Gaussian mechanisms with multiplier ``sigma`` (Bassily, Smith & Thakurta
    2014), accounted exactly.

    The learning rate is part of what is released (it shapes every iterate), so it must
    not be an un-noised function of the data. By default (``smoothness="private"``) the
    smoothness ``L = lambda_max(X^T X)`` of the objective is released by one more Gaussian
    mechanism (sensitivity ``x_bound^2`` by Weyl's inequality), composed into
    ``mechanism_`` and paid from the same budget: it gets the fraction
    :data:`SMOOTHNESS_BUDGET_FRACTION` (1%) of the budget measured in ``1 / sigma^2``
    (Gaussian compositions add ``1 / sigma^2``; Dong, Roth & Su 2022, Cor. 3.3), i.e.
    multiplier ``sigma_L = sigma_total / sqrt(0.01)`` where ``sigma_total`` is the single
    Gaussian multiplier for (epsilon, delta). The learning rate uses the high-probability
    upper bound ``hat(L) = max(x_bound^2, noisy L + 1.96 sigma_L x_bound^2)``
    (post-processing). On the notebook's California setting (epsilon 2, delta 1e-6) this costs
    about 1% of the iterations and leaves the median training MSE at that of the notebook's
    exact-``L`` rate (tests/models/test_linear.py).

    Parameters
    ----------
    epsilon, delta, x_bound, y_bound, fit_intercept, accountant, random_state, ledger
        As :class:`SSPRegressor`.
    noise_multiplier : float > 0 or None
        ``sigma``. Default 500 (the notebook's "large noise, many iterations" regime; the
        seed's other regime is 50). With ``n_iter=None`` the number of iterations is
        calibrated to the budget (the largest integer that fits, rounded down). If None,
        ``n_iter`` must be given and sigma is calibrated instead (rounded up).
    n_iter : int or None
        Number of iterations; if both ``n_iter`` and ``noise_multiplier`` are given the
        budget is checked and a ValueError raised if exceeded. ``None`` (default) runs
        as many iterations as the budget allows at ``noise_multiplier``: ``T`` Gaussians
        of multiplier ``sigma`` compose to ``sqrt(T) / sigma``-Gaussian DP (Dong, Roth &
        Su 2022, Cor. 3.3), so ``T = floor(0.99 (sigma mu)^2)`` where ``mu`` is the
        Gaussian-DP parameter that is (epsilon, delta)-DP (``floor((sigma mu)^2)`` without
        the private smoothness release, whose 1% of ``mu^2`` the 0.99 leaves). The count
        grows with the square of ``sigma`` and, for large epsilon, roughly with the
        square of epsilon, with no cap (none is part of the rule, and the theoretical
        learning rate shrinks with ``T``, so more iterations keep fitting better): at the
        default ``sigma=500`` and ``delta=1e-6``, 13,867 iterations at epsilon 1, 257,679
        at 5 and 2,590,718 at 20 (fits of about 0.6 s, 5 s and 30-70 s on 1,000 x 10
        data on one shared CPU core; ``docs/benchmarks.md``). A smaller
        ``noise_multiplier`` runs fewer iterations (``sigma=50``: 100 times fewer);
        ``verbose=1`` shows the progress. A budget that would run more than
        :data:`MAX_CALIBRATED_ITERATIONS` (10^8) iterations, e.g. epsilon 1e4 at the
        default ``sigma``, is refused with ``ParameterValueError`` before anything is
        spent: pass ``n_iter`` (``noise_multiplier=None`` then calibrates the noise) or
        a smaller ``noise_multiplier``.
    learning_rate : "theory" or float > 0
        ``"theory"`` (default): the notebook's choice, see :func:`theoretical_learning_rate`.
        A float is used as given (then no smoothness is released and no budget spent on it).
    smoothness : "private", "public", "data" or float > 0
        The smoothness ``L`` used by the theoretical learning rate.

        * ``"private"`` (default): released with noise as described above; covered by
          ``mechanism_``.
        * a float: used as given (public knowledge, costs nothing).
        * ``"public"``: the bound ``x_bound^2 n`` (``x_bound`` after the intercept
          column). It uses the exact number of rows ``n``, which add/remove
          neighbouring treats as private, so it emits a
          :class:`~privlearn.errors.PrivacyLeakWarning`.
        * ``"data"`` (the notebook's choice): the exact ``lambda_max(X^T X)``, released
          without protection in ``smoothness_`` and through the learning rate; emits a
          :class:`~privlearn.errors.PrivacyLeakWarning`.
    log_every : int or None
        Record the iterate and the epsilon spent after iterations ``1, 1 + log_every,
        ...`` (the notebook's ``log_gap``) in ``coef_path_`` and ``epsilon_path_``.
    verbose : int >= 0 or bool
        0 (default): silent. 1 or more: a progress bar on standard error over the
        iterations of ``fit`` (``tqdm``: iterations done, their total ``n_iter_``,
        elapsed time and rate), as :class:`~privlearn.models.PrivateSearchCV` shows its
        runs. It never changes the result at a fixed ``random_state``.

    Attributes
    ----------
    coef_, intercept_ : final iterate
    n_iter_, noise_multiplier_, learning_rate_ : what ran
    smoothness_ : float or None
        The ``L`` the learning rate used (the noisy upper bound by default); None when
        ``learning_rate`` is a float.
    mechanism_ : ``compose([Gaussian(sigma_L), Gaussian(sigma) x n_iter])``
        (without the first part unless the smoothness was released privately)
    epsilon_, delta_ : certified epsilon spent at ``delta_``
    path_iterations_, coef_path_, intercept_path_, epsilon_path_ : trajectory (when
        ``log_every`` is set); ``epsilon_path_[k]`` is the exact epsilon after
        ``path_iterations_[k]`` iterations, including the smoothness release (analytic
        Gaussian composition, O(1) each).

    Notes
    -----
    How many rows or labels clipping changed is never stored (an exact count of the
    private data): a :class:`~privlearn.models.DataClippedWarning` tells the person
    fitting.
    """

    _parameter_constraints = {
        **COMMON_CONSTRAINTS,
        "noise_multiplier": Real(0, None, low_open=True, allow_none=True,
                                 hint="None calibrates it to n_iter"),
        "n_iter": Integer(1, allow_none=True, hint="None calibrates it to noise_multiplier",
                          maximum=N_ITER.maximum, max_hint=N_ITER.max_hint),
        "learning_rate": Unchecked("'theory' or a number > 0, checked by "
                                   "_check_lr_smoothness"),
        "smoothness": Unchecked("a mode or a number > 0, checked by _check_lr_smoothness"),
        "log_every": Integer(1, allow_none=True),
        "verbose": VERBOSE,
    }

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        x_bound: float = 1.0,
        y_bound: float = 1.0,
        fit_intercept: bool = True,
        noise_multiplier: float | None = 500.0,
        n_iter: int | None = None,
        learning_rate="theory",
        smoothness="private",
        log_every: int | None = None,
        accountant: str = "pld",
        random_state=None,
        ledger=None,
        verbose: int = 0,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.x_bound = x_bound
        self.y_bound = y_bound
        self.fit_intercept = fit_intercept
        self.noise_multiplier = noise_multiplier
        self.n_iter = n_iter
        self.learning_rate = learning_rate
        self.smoothness = smoothness
        self.log_every = log_every
        self.accountant = accountant
        self.random_state = random_state
        self.ledger = ledger
        self.verbose = verbose

    def _check_lr_smoothness(self) -> tuple[float | None, str | float]:
        """(the given learning rate, None for the theoretical one; smoothness mode or
        value); clear errors otherwise."""
        lr = self.learning_rate
        if isinstance(lr, str) and lr.lower() == "theory":
            lr = None
        elif isinstance(lr, str):
            raise ParameterValueError(
                f"learning_rate must be 'theory' or a finite number > 0, got {lr!r}; leave "
                "'theory' (the default) to set it from the smoothness, or pass e.g. 0.01")
        else:
            lr = _v.check_positive("learning_rate", lr)
        sm = self.smoothness
        if isinstance(sm, str):
            sm = _v.check_choice("smoothness", sm, SMOOTHNESS_MODES)
        else:
            try:
                sm = _v.check_positive("smoothness", sm)
            except ValueError:
                raise ParameterValueError(
                    f"smoothness must be one of {SMOOTHNESS_MODES} or a finite number > 0, "
                    f"got {self.smoothness!r}; the default 'private' releases it with noise"
                ) from None
        return lr, sm

    def _resolve_schedule(self, params: dict[str, Any], sigma_l: float | None
                          ) -> tuple[float, int]:
        eps, delta, acc = params["epsilon"], params["delta"], params["accountant"]
        sigma, n_iter = params["noise_multiplier"], params["n_iter"]
        if sigma is None and n_iter is None:
            raise ParameterValueError(
                "give noise_multiplier or n_iter (or both); got both None. E.g. "
                "noise_multiplier=500 calibrates n_iter to the budget"
            )

        def mech(s, k):
            return _noisy_gd_mechanism(s, int(k), sigma_l)

        if n_iter is None:
            try:
                one_step = mech(sigma, 1).epsilon(delta, acc)
            except PrivacyLossOverflowError:  # above 1e12 or unrepresentable
                one_step = math.inf
            if one_step > eps:
                raise ParameterValueError(
                    f"noise_multiplier={sigma} is too small for epsilon={eps} at "
                    f"delta={delta}: even one iteration exceeds the budget; use a larger "
                    "noise_multiplier"
                )
            # one above the ceiling: a count the search returns there exceeds it
            n_iter = int(calibrate(lambda k: mech(sigma, k), eps, delta,
                                   bounds=(1, MAX_CALIBRATED_ITERATIONS + 1), integer=True,
                                   accountant=acc))
            if n_iter > MAX_CALIBRATED_ITERATIONS:
                raise ParameterValueError(
                    f"epsilon={eps} at delta={delta} with noise_multiplier={sigma} and "
                    f"n_iter=None would run more than {MAX_CALIBRATED_ITERATIONS:,} "
                    "iterations (the count grows with the square of noise_multiplier and "
                    "with epsilon), a fit of hours; nothing was spent. Pass n_iter (e.g. "
                    "n_iter=1000 with noise_multiplier=None, which then calibrates the "
                    "noise to the budget), or a smaller noise_multiplier")
        else:  # the one "use the given noise or calibrate" path of the estimators
            extra = (
                " (including the private smoothness release; smoothness=<float> or "
                "learning_rate=<float> avoid it)" if sigma_l is not None else ""
            )
            sigma = resolve_noise_multiplier(
                sigma, lambda s: mech(s, n_iter), eps, delta, accountant=acc,
                describe=f"with n_iter={n_iter}{extra} (or leave n_iter=None)")
        return sigma, n_iter

    def _plan(self, params: dict[str, Any], X, y, *, reps: int | None = None) -> NoisyGDPlan:
        """The schedule and the smoothness release, from the budget alone."""
        common = self._bounds(params)
        lr, sm = self._check_lr_smoothness()
        sigma_l = (_smoothness_sigma(params["epsilon"], params["delta"], params["accountant"])
                   if lr is None and sm == "private" else None)
        sigma, n_iter = self._resolve_schedule(params, sigma_l)
        # the noise's scale on the first gradient (GS_0 sigma, GS_0 = x_bound Y at theta
        # = 0; it grows with the iterate) and on the smoothness, in the data's units
        xb = math.sqrt(2.0) * common["x_bound"] if self.fit_intercept else common["x_bound"]
        scales = {"the gradient": xb * common["label_bound"] * sigma}
        if sigma_l is not None:
            scales["lambda_max(X^T X)"] = xb * xb * sigma_l
        self._refuse_overflowing_noise(X, params, scales)
        if lr is None and sm in ("data", "public"):
            what = (
                "the exact largest eigenvalue of X^T X" if sm == "data"
                else "x_bound^2 times the exact number of rows n"
            )
            warn_person_fitting(
                f"NoisyGDRegressor(smoothness={sm!r}) sets the learning rate from {what}, "
                "which is not covered by mechanism_: the fitted model releases it "
                "un-noised. Use smoothness='private' (default) or a public float.",
                PrivacyLeakWarning,
                stacklevel=4,
            )
        one = _noisy_gd_mechanism(sigma, n_iter, sigma_l)
        return NoisyGDPlan(
            mechanism=one if reps is None else compose(one, steps=reps), reps=reps,
            noise_multiplier=sigma, n_iter=n_iter, smoothness_noise_multiplier=sigma_l,
            learning_rate=lr, smoothness=sm,
            log_every=params["log_every"] if reps is None else None, **common)

    def _release(self, X, y, plan: NoisyGDPlan) -> dict[str, Any]:
        """Run ``plan.draws`` independent chains (one batched run), each with its own
        smoothness release."""
        rng = make_rng(self.random_state)
        reps, sigma, n_iter, sigma_l = (plan.draws, plan.noise_multiplier, plan.n_iter,
                                        plan.smoothness_noise_multiplier)
        xb_eff, yb = self._effective_x_bound(plan), plan.label_bound
        XTX, XTy = X.T @ X, X.T @ y
        dim = X.shape[1]
        sm = plan.smoothness
        if plan.learning_rate is not None:
            L = None
            lr = np.full(reps, plan.learning_rate)
        else:
            if sm == "private":
                # One Gaussian release of lambda_max (sensitivity xb_eff^2, Weyl), then
                # post-processing: a 1.96-sigma upper bound, floored at one row's maximum.
                lam_max = float(np.linalg.eigvalsh(XTX)[-1])
                noisy = lam_max + xb_eff**2 * sigma_l * rng.standard_normal(reps)
                L = np.maximum(noisy + ADASSP_Z * sigma_l * xb_eff**2, xb_eff**2)
            elif sm == "data":
                L = np.full(reps, max(float(np.linalg.eigvalsh(XTX)[-1]), xb_eff**2))
            elif sm == "public":
                L = np.full(reps, xb_eff**2 * X.shape[0])
            else:
                L = np.full(reps, float(sm))
            gs_typical = xb_eff**2 * 1.0 + xb_eff * yb
            lr = np.array(
                [theoretical_learning_rate(float(l_), dim, sigma * gs_typical, n_iter)
                 for l_ in L]
            )
        with np.errstate(over="ignore", invalid="ignore"), self._progress(n_iter) as bar:
            theta, path, iters = noisy_gd_paths(
                XTX, XTy, sigma, lr, n_iter, xb_eff, yb, rng, reps=reps,
                log_every=plan.log_every, progress=bar.update,
            )
        if not np.all(np.isfinite(theta)):
            advice = "use a smaller learning_rate"
            if plan.learning_rate is None and not isinstance(sm, str):
                advice = (f"it was set from smoothness={sm!r}, too small if below the "
                          "largest eigenvalue of X^T X: pass a larger public smoothness, "
                          "leave smoothness='private', or pass a smaller learning_rate")
            raise FloatingPointError(
                f"NoisyGD diverged (learning_rate={float(np.max(lr)):.3g}); {advice}")
        fitted = self._coefficients(theta, plan)
        if plan.reps is not None:
            return fitted
        fitted.update(noise_multiplier_=sigma, n_iter_=n_iter, learning_rate_=float(lr[0]),
                      smoothness_=None if L is None else float(L[0]))
        if plan.log_every is not None:
            p = path[:, 0, :]
            fitted.update(
                path_iterations_=iters,
                coef_path_=p[:, :-1] if self.fit_intercept else p,
                intercept_path_=(p[:, -1] * plan.x_bound + self._label_centre()
                                 if self.fit_intercept else np.zeros(len(p))),
                epsilon_path_=np.array([
                    _noisy_gd_mechanism(sigma, int(t), sigma_l).epsilon(plan.delta,
                                                                        "analytic")
                    for t in iters]),
            )
        return fitted

    def _progress(self, n_iter: int):
        """A tqdm bar over the ``n_iter`` iterations on standard error, shown when
        ``verbose`` is on (else disabled: it writes nothing)."""
        return progress(total=n_iter, desc=type(self).__name__, unit="it",
                        enabled=bool(VERBOSE.check("verbose", self.verbose)), leave=True)

    def fit(self, X, y, **fit_params):
        """Run noisy gradient descent from zero (``sample_weight`` is refused)."""
        return self._fit(X, y, fit_params=fit_params)

    def sample_coefficients(self, X, y, n_repetitions: int) -> tuple[np.ndarray, np.ndarray]:
        """Final iterates of ``n_repetitions`` independent NoisyGD runs, as one batch.

        Runs the code of :meth:`fit` (same validation, schedule, learning rate and
        iteration, :func:`noisy_gd_paths`) with ``n_repetitions`` independent chains (each
        with its own smoothness release); with ``n_repetitions=1`` it returns
        ``fit(X, y).coef_`` for the same ``random_state``. Each row alone is
        (epsilon, delta)-DP; all rows together compose ``n_repetitions`` runs (what a
        ``ledger`` is charged). The estimator is not fitted by this call.

        Returns
        -------
        coef : ndarray (n_repetitions, n_features)
        intercept : ndarray (n_repetitions,)
        """
        return self._sample(X, y, n_repetitions)
