"""DP-SGD for logistic (binary or multinomial) and linear regression (the DP-SGD
tutorial; the accounting tutorial, section 2).

One iteration (Abadi et al. 2016, Algorithm 1, with Poisson sampling as in the accounting tutorial):

1. **sample**: every record joins the batch independently with probability
   ``q = sampling_rate`` (``q = 1``: full batch);
2. **clip**: each per-example gradient is scaled to norm at most ``max_grad_norm = C``
   (L2 norm for Gaussian noise, L1 norm for Laplace noise);
3. **noise**: the *sum* of clipped gradients gets ``N(0, (sigma C)^2 I)`` or
   ``Laplace(b C)`` per coordinate;
4. **scale**: divide by the *expected* batch size ``q n`` -- never by the realised batch
   size, which is private (the accounting tutorial's cautionary note);
5. **step**: ``theta <- theta - lr (g + l2_regularization * theta)`` (the DP-SGD tutorial's update);
6. **account**: after ``T`` steps the mechanism is
   ``compose(subsample(Gaussian(sigma), q), steps=T)`` (or ``compose(Gaussian(sigma), T)``
   when ``q = 1``), resp. the same with ``Laplace(b)``; under add/remove neighbouring the
   clipped sum has L2 (resp. L1) sensitivity ``C``.

``sigma`` (resp. ``b``) is calibrated to (epsilon, delta) with the chosen accountant,
rounded up (safe side). Laplace noise with ``delta = 0`` gives pure DP (the DP-SGD tutorial's
scenarios 1a/1b); ``delta > 0`` with subsampling (the case the DP-SGD tutorial leaves open) is
accounted with the PLD accountant of :mod:`privlearn.accounting`.

References
----------
.. [1] M. Abadi et al. (2016), Deep learning with differential privacy, CCS, Alg. 1.
.. [2] R. Bassily, A. Smith, A. Thakurta (2014), Private ERM, FOCS (noisy (S)GD).
.. [3] Y. Zhu, Y.-X. Wang (2019), Poisson subsampled Renyi differential privacy, ICML.
.. [4] S. Yildirim, the DP-SGD tutorial (DP-SGD tutorial): scenarios and update rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit, log_expit
from sklearn.base import ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from privlearn._progress import progress
from privlearn.accounting import get_accountant
from privlearn.errors import (
    ParameterValueError,
    PrivacyLeakWarning,
    UnsupportedMechanismError,
)
from privlearn.models._dpsgd_steps import noisy_sum, poisson_batch
from privlearn.models._noise_range import refuse_overflowing_noise
from privlearn.models._softmax import (
    softmax_dpsgd,
    softmax_scores_to_log_proba,
    softmax_scores_to_proba,
)
from privlearn.models.base import (
    PrivateEstimator,
    ReleasePlan,
    _scaled_rows,
    check_class_labels,
    data_shape,
    make_rng,
    noisy_sum_mechanism,
    require_delta_for_gaussian,
    resolve_noise_multiplier,
    row_norms,
    validate_input,
    warn_person_fitting,
)
from privlearn.models.constraints import (
    ACCOUNTANT,
    EPSILON,
    LEDGER,
    N_ITER,
    NOISE_MULTIPLIER,
    RANDOM_STATE,
    TRAJECTORY_POINTS,
    VERBOSE,
    AccountantName,
    Boolean,
    Delta,
    Options,
    PublicClasses,
    Real,
)

__all__ = ["DPSGDClassifier", "DPSGDRegressor", "dpsgd_mechanism"]

#: What a refusal of labels outside a public label set suggests instead.
MULTICLASS_HINT = (
    "DPSGDClassifier fits any number K >= 2 of public classes (binary logistic "
    "regression for two, multinomial softmax regression for three or more): pass the "
    "whole public label set, e.g. classes=[0, 1, 2], or map y onto the labels of classes "
    "before fitting")


def _diverged(lr: float, lam: float) -> FloatingPointError:
    """The refusal of a fit whose iterate overflowed, naming both step settings (each step
    multiplies the iterate by ``1 - learning_rate * l2_regularization``)."""
    return FloatingPointError(
        f"DP-SGD diverged (learning_rate={lr!r}, l2_regularization={lam!r}); use a smaller "
        "learning_rate, and keep learning_rate * l2_regularization below 2 (each step "
        "multiplies the iterate by 1 - learning_rate * l2_regularization)")


def dpsgd_mechanism(noise: str, noise_multiplier: float, sampling_rate: float, steps: int):
    """The mechanism DP-SGD runs: ``steps`` compositions of the (Poisson-subsampled, if
    ``sampling_rate < 1``) Gaussian or Laplace mechanism with the given multiplier."""
    return noisy_sum_mechanism(noise, noise_multiplier, sampling_rate, steps)


def _scaled_design(Z: np.ndarray, ord_: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(U, s, ||u||)`` with ``z_i = s_i u_i`` for every row: ``s_i = 1`` and ``u_i = z_i``
    for a row whose ``ord_``-norm is a float (:func:`~privlearn.models.base.row_norms`,
    overflow-safe), else ``s_i`` its largest absolute entry (the rows
    :func:`~privlearn.models.base.clip_rows` scales first), so ``||u_i||`` is finite."""
    norms = row_norms(Z, ord_)
    scale = np.ones(Z.shape[0])
    huge = ~np.isfinite(norms) & np.all(np.isfinite(Z), axis=1)
    if not np.any(huge):
        return Z, scale, norms
    U = np.array(Z, dtype=float, copy=True)
    scale[huge], norms[huge] = _scaled_rows(Z[huge], ord_)
    U[huge] = Z[huge] / scale[huge][:, None]
    return U, scale, norms


@dataclass(frozen=True, kw_only=True)
class DPSGDPlan(ReleasePlan):
    """DP-SGD's plan: the noise, its (calibrated or given) multiplier, the Poisson
    sampling rate and the number of steps."""

    noise: str
    noise_multiplier: float
    sampling_rate: float
    steps: int


class _DPSGDBase(PrivateEstimator):
    _loss = "logistic"

    # the signature is DPSGDRegressor's (which inherits it); DPSGDClassifier's adds
    # ``classes`` and starts at learning_rate=1.0
    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-5,
        noise: str = "gaussian",
        sampling_rate: float = 1.0,
        n_iter: int = 1000,
        learning_rate: float = 0.5,
        max_grad_norm: float = 1.0,
        l2_regularization: float = 1e-3,
        fit_intercept: bool = True,
        noise_multiplier: float | None = None,
        accountant: str = "pld",
        trajectory_points: int = 20,
        trajectory_accountant: str | None = None,
        record_path: bool = False,
        random_state=None,
        ledger=None,
        verbose: int = 0,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.noise = noise
        self.sampling_rate = sampling_rate
        self.n_iter = n_iter
        self.learning_rate = learning_rate
        self.max_grad_norm = max_grad_norm
        self.l2_regularization = l2_regularization
        self.fit_intercept = fit_intercept
        self.noise_multiplier = noise_multiplier
        self.accountant = accountant
        self.trajectory_points = trajectory_points
        self.trajectory_accountant = trajectory_accountant
        self.record_path = record_path
        self.random_state = random_state
        self.ledger = ledger
        self.verbose = verbose

    # -- validation ------------------------------------------------------------------
    _parameter_constraints = {
        "epsilon": EPSILON,
        "delta": Delta(),
        "noise": Options("gaussian", "laplace"),
        "sampling_rate": Real(0, 1, low_open=True,
                              hint="it is the Poisson rate (expected batch size / n_samples), "
                                   "1 for full-batch noisy GD"),
        "n_iter": N_ITER,
        "learning_rate": Real(0, None, low_open=True, hint="e.g. 0.5"),
        "max_grad_norm": Real(0, None, low_open=True, hint="the per-example clipping bound"),
        "l2_regularization": Real(0, None, hint="0 for none"),
        "fit_intercept": Boolean(),
        "noise_multiplier": NOISE_MULTIPLIER,
        "accountant": ACCOUNTANT,
        "trajectory_points": TRAJECTORY_POINTS,
        "trajectory_accountant": AccountantName(allow_none=True),
        "record_path": Boolean(),
        "random_state": RANDOM_STATE,
        "ledger": LEDGER,
        "verbose": VERBOSE,
    }

    def fit(self, X, y, **fit_params):
        """Train with DP-SGD; validates everything before any privacy is spent
        (``sample_weight`` is refused)."""
        return self._fit(X, y, fit_params=fit_params)

    def _plan(self, params: dict[str, Any], X, y) -> DPSGDPlan:
        """Calibrate the noise multiplier (or check the given one) for ``n_iter`` steps."""
        noise, q, steps = params["noise"], params["sampling_rate"], params["n_iter"]
        eps, delta = params["epsilon"], params["delta"]
        if noise == "gaussian":
            require_delta_for_gaussian(delta, type(self).__name__, laplace=True)
        trajectory = params["trajectory_accountant"]
        if trajectory is not None:
            # used after training (epsilon_trajectory_): an unknown name must be refused
            # now, not once the release has been spent
            get_accountant(trajectory)
        sigma = resolve_noise_multiplier(
            params["noise_multiplier"], lambda s: dpsgd_mechanism(noise, s, q, steps), eps,
            delta, accountant=params["accountant"],
            describe=f"over n_iter={steps} steps at sampling_rate={q}")
        shape = data_shape(X) if X is not None else ()
        refuse_overflowing_noise(
            type(self).__name__, {"the clipped gradient sum": sigma * params["max_grad_norm"]},
            (int(shape[1]) if len(shape) == 2 else 1) + int(params["fit_intercept"]),
            f"max_grad_norm={params['max_grad_norm']!r}, noise_multiplier={sigma:.6g} "
            f"(epsilon={eps!r}, delta={delta!r})",
            "Divide X (and, for DPSGDRegressor, y) by public constants so that the "
            "per-example gradients are of order 1, and pass a max_grad_norm of that order")
        mechanism = dpsgd_mechanism(noise, sigma, q, steps)
        if trajectory is not None and trajectory != params["accountant"]:
            # and so must an accountant that cannot evaluate this run (the trajectory's
            # last point is the whole run): after training it would fail the fit with
            # its budget spent and no model returned
            try:
                mechanism.epsilon(delta, trajectory)
            except (UnsupportedMechanismError, ArithmeticError) as e:
                raise type(e)(
                    f"trajectory_accountant={trajectory!r} cannot evaluate this run "
                    f"({noise} noise, sampling_rate={q}, n_iter={steps}): {e}. Leave "
                    f"trajectory_accountant=None (the trajectory then uses "
                    f"accountant={params['accountant']!r}) or pass 'rdp'") from e
        return DPSGDPlan(mechanism=mechanism, delta=delta,
                         accountant=params["accountant"], noise=noise, noise_multiplier=sigma,
                         sampling_rate=q, steps=steps)

    # -- the algorithm ---------------------------------------------------------------
    def _residual(self, Z: np.ndarray, y: np.ndarray, theta: np.ndarray) -> np.ndarray:
        """Per-example gradients of these GLM losses are ``r_i z_i``; return ``r``."""
        z = Z @ theta
        return expit(z) - y if self._loss == "logistic" else z - y

    def _release(self, X: np.ndarray, y: np.ndarray, plan: DPSGDPlan) -> dict[str, Any]:
        """Train (the module docstring's steps 1-5); the plan is step 6."""
        rng = make_rng(self.random_state)
        Z = self._design(X)
        noise, sigma, q, steps = plan.noise, plan.noise_multiplier, plan.sampling_rate, plan.steps
        n, d = Z.shape
        C = float(self.max_grad_norm)
        lr = float(self.learning_rate)
        lam = float(self.l2_regularization)
        ord_ = 2 if noise == "gaussian" else 1
        denom = q * n
        theta = np.zeros(d)
        path = np.zeros((steps, d)) if self.record_path else None
        # Per-example gradient g_i = r_i z_i, so ||g_i|| = |r_i| ||z_i|| (any norm): the
        # clipping factor needs only the row norms, computed once, without overflow
        # (row_norms). A row whose norm exceeds the largest float is kept as s_i u_i (s_i
        # its largest entry, u_i = z_i / s_i), so its gradient is clipped to norm C in its
        # own direction, u_i / ||u_i||, not to zero (the rows clip_rows scales the same way)
        U, scale, unorm = _scaled_design(Z, ord_)
        bar = progress(range(steps), desc=type(self).__name__, unit="it",
                       enabled=bool(VERBOSE.check("verbose", self.verbose)), leave=True)
        for t in bar:
            # 1. sample (Poisson)
            Zb, Ub, yb, sb, nb = poisson_batch(rng, q, Z, U, y, scale, unorm)
            # 2. clip per example: g_i * min(1, C / ||g_i||), summed; g_i = (r_i s_i) u_i
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                r = self._residual(Zb, yb, theta)
                gnorm = np.abs(r) * sb * nb
                # above C: the coefficient of u_i of norm exactly C (its sign,
                # C / ||u_i||), also when an extreme row overflows r or ||g_i|| to
                # infinity; a residual that is not a number (inf - inf in z_i . theta)
                # contributes nothing. Either way one record moves the sum by at most
                # C, and one finite but extreme row cannot turn the release into a NaN
                c = np.where(gnorm > C, np.where(np.isfinite(gnorm), r * sb * (C / gnorm),
                                                 np.sign(r) * (C / nb)), r * sb)
                c = np.where(np.isfinite(c), c, 0.0)
            total = Ub.T @ c
            # 3. noise on the sum
            total = noisy_sum(total, noise, sigma * C, rng)
            # 4. scale by the expected batch size; 5. step
            g = total / denom
            with np.errstate(over="ignore", invalid="ignore"):  # divergence: refused below
                theta = theta - lr * (g + lam * theta)
            if path is not None:
                path[t] = theta
        if not np.all(np.isfinite(theta)):
            raise _diverged(lr, lam)
        fitted = self._trajectory(plan)
        coef, intercept = self._split_theta(theta[None, :])
        fitted.update(coef_=coef[0], intercept_=float(intercept[0]))
        if path is not None:
            fitted["coef_path_"], fitted["intercept_path_"] = self._split_theta(path)
        return fitted

    def _trajectory(self, plan: DPSGDPlan) -> dict[str, Any]:
        """What every fit releases besides the model: the multiplier, the step count and
        the epsilon spent after ``trajectory_points`` step counts (the plan's mechanism
        cut at each, by ``trajectory_accountant`` or the plan's accountant)."""
        noise, sigma, q, steps = plan.noise, plan.noise_multiplier, plan.sampling_rate, plan.steps
        k = min(int(self.trajectory_points), steps)
        ts = np.unique(np.round(np.linspace(1, steps, k)).astype(np.int64))
        acc = self.trajectory_accountant or plan.accountant
        return {
            "noise_multiplier_": sigma,
            "n_iter_": steps,
            "trajectory_steps_": ts,
            "epsilon_trajectory_": np.array(
                [dpsgd_mechanism(noise, sigma, q, int(t)).epsilon(plan.delta, acc)
                 for t in ts]),
        }

    def _design(self, X: np.ndarray) -> np.ndarray:
        if self.fit_intercept:
            return np.hstack([X, np.ones((X.shape[0], 1))])
        return X

    def _split_theta(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Coefficients (k, d) and intercepts (k,) from parameter rows ``theta``."""
        if self.fit_intercept:
            return theta[:, :-1].copy(), theta[:, -1].copy()
        return theta.copy(), np.zeros(theta.shape[0])

    def _decision(self, X) -> np.ndarray:
        check_is_fitted(self)
        X = validate_input(self, X, reset=False, dtype=np.float64)
        return X @ self.coef_ + self.intercept_


_DOC_PARAMS = """
    Parameters
    ----------
    epsilon : float > 0
        The privacy budget of one fit: the noise multiplier is calibrated so that the
        ``n_iter`` steps are ``(epsilon, delta)``-DP. With ``noise_multiplier`` given, the
        most the fit may spend (a fit that would spend more is refused). ``epsilon_``
        after ``fit`` is what it spent.
    delta : float in [0, 1)
        Must be > 0 with Gaussian noise; 0 with ``noise="laplace"`` gives pure DP. Chosen
        well below ``1 / n_samples`` (a ``PrivacyLeakWarning`` otherwise), e.g. 1e-6.
    noise : {"gaussian", "laplace"}
        Gaussian noise with L2 clipping, or Laplace noise with L1 clipping.
    sampling_rate : float in (0, 1]
        Poisson sampling rate ``q`` (1 = full-batch noisy gradient descent).
    n_iter : int
        Number of steps ``T``.
    learning_rate : float
    max_grad_norm : float
        Clipping norm ``C`` (L2 for Gaussian, L1 for Laplace noise). A vector of ``p``
        coordinates has ``||g||_1 <= sqrt(p) ||g||_2``, so with ``noise="laplace"`` the
        default of 1 clips far more: for rows in ``[0, 1]^d`` with an intercept the
        logistic gradient has L1 norm up to ``d + 1`` and L2 norm up to ``sqrt(d + 1)``
        (the softmax gradient of three or more classes: ``2 (d + 1)`` and
        ``sqrt(2 (d + 1))``).
        The L1 bound that clips like an L2 bound ``C`` is about ``sqrt(p) C``
        (``p = d + 1`` with an intercept), chosen from the public shape, not the data.
    l2_regularization : float >= 0
        ``lambda`` in the update ``theta - lr (g + lambda theta)`` (the DP-SGD tutorial).
    fit_intercept : bool
        Append a constant 1 feature (its gradient is clipped with the rest).
    noise_multiplier : float or None
        ``sigma`` (std / C) or Laplace ``b`` (scale / C). None (default): calibrated.
    accountant : str
        Accountant for calibration and ``epsilon_`` (default ``"pld"``).
    trajectory_points : int
        Number of points of ``epsilon_trajectory_`` (evenly spaced steps in [1, T]), at
        most 10**4 (each is one accountant evaluation).
    trajectory_accountant : str or None
        Accountant for the trajectory (default: ``accountant``; ``"rdp"`` is cheaper).
    record_path : bool
        Keep every iterate in ``coef_path_`` / ``intercept_path_`` (the DP-SGD tutorial's plots).
    random_state : None, int, Generator or RandomState
        The noise's and the sampling's source. None (default): fresh OS entropy, and
        nothing the fitted model carries can regenerate its noise. A seed or generator
        makes the run reproducible by whoever knows it (it travels with
        ``get_params()`` and the pickle): fix it for experiments only.
    ledger : BudgetHandle, optional
        ``Ledger(path).budget(dataset)`` (:mod:`privlearn.ledger`): the mechanism is
        reserved on it before the data is read (over budget,
        ``BudgetExceededError`` is raised and nothing is recorded or released) and
        settled when the fit is done.
    verbose : int >= 0 or bool
        0 (default): silent. 1 or more: a progress bar on standard error over the
        ``n_iter`` steps of ``fit`` (``tqdm``: steps done, their total, elapsed time and
        rate). It never changes the result at a fixed ``random_state``.

    Attributes
    ----------
    coef_, intercept_
        ``(n_features,)`` and a float; for a classifier of ``K >= 3`` classes
        ``(K, n_features)`` and ``(K,)``, as scikit-learn's multinomial
        ``LogisticRegression``.
    noise_multiplier_ : float
    mechanism_ : Mechanism
        What ran, e.g. ``compose(subsample(Gaussian(sigma), q), steps=T)``.
    epsilon_, delta_ : certified epsilon spent at ``delta_``
    trajectory_steps_, epsilon_trajectory_ : epsilon spent after each listed step count
"""


class DPSGDClassifier(ClassifierMixin, _DPSGDBase):
    __doc__ = (
        "Logistic regression trained by DP-SGD (the DP-SGD tutorial): binary for two "
        "classes, multinomial (softmax) for three or more.\n" + _DOC_PARAMS
        + """    classes_ : ndarray of K labels

    Notes
    -----
    ``classes`` (keyword, last parameter): the public label set, e.g. ``classes=[0, 1]``
    or ``classes=[0, 1, 2]``. ``classes_`` is the set sorted, as scikit-learn's
    classifiers have it (its scorers read ``predict_proba``'s columns in sorted label
    order). None (default) infers them from ``y``, which releases which labels occur in
    the private data (through ``classes_`` and ``predict``), so a
    :class:`~privlearn.errors.PrivacyLeakWarning` is emitted; ``classes=np.unique(y)``
    is the same release without the warning (nothing can tell it from a public list),
    so take the list from the schema. With ``classes`` given, ``y`` may lack some of
    them.

    With two classes the model is binary logistic regression: ``coef_`` has shape
    ``(n_features,)``, ``intercept_`` is a float, ``classes_[1]`` is the positive class
    and ``decision_function`` returns one score per row. With ``K >= 3`` classes it is
    multinomial logistic regression, as scikit-learn's ``LogisticRegression``: the
    per-example gradient of the softmax cross-entropy with respect to all ``K``
    weight vectors (and intercepts) is clipped to ``max_grad_norm`` as one vector and the
    noise is added to every coordinate; ``coef_`` has shape ``(K, n_features)``,
    ``intercept_`` shape ``(K,)``, ``decision_function`` returns ``K`` scores per row and
    ``predict_proba`` their softmax. The mechanism, hence ``epsilon_``, is the binary
    one for the same settings (clipping bounds one record's effect on the noisy sum by
    ``max_grad_norm`` whatever the number of coordinates). Unclipped, one record's
    gradient is ``x (p - e_y)^T`` of L2 norm at most ``sqrt(2) ||x||_2`` (L1 at most
    ``2 ||x||_1``), against ``||x||`` for the binary loss, so a clipping bound chosen
    for the binary model clips a little more here.
"""
    )

    _loss = "logistic"

    _parameter_constraints = {
        **_DPSGDBase._parameter_constraints,
        "classes": PublicClasses(),
    }

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-5,
        noise: str = "gaussian",
        sampling_rate: float = 1.0,
        n_iter: int = 1000,
        learning_rate: float = 1.0,
        max_grad_norm: float = 1.0,
        l2_regularization: float = 1e-3,
        fit_intercept: bool = True,
        noise_multiplier: float | None = None,
        accountant: str = "pld",
        trajectory_points: int = 20,
        trajectory_accountant: str | None = None,
        record_path: bool = False,
        random_state=None,
        classes=None,
        ledger=None,
        verbose: int = 0,
    ):
        super().__init__(
            epsilon=epsilon,
            delta=delta,
            noise=noise,
            sampling_rate=sampling_rate,
            n_iter=n_iter,
            learning_rate=learning_rate,
            max_grad_norm=max_grad_norm,
            l2_regularization=l2_regularization,
            fit_intercept=fit_intercept,
            noise_multiplier=noise_multiplier,
            accountant=accountant,
            trajectory_points=trajectory_points,
            trajectory_accountant=trajectory_accountant,
            record_path=record_path,
            random_state=random_state,
            ledger=ledger,
            verbose=verbose,
        )
        self.classes = classes

    def _public_classes(self) -> np.ndarray | None:
        """The public labels, sorted (with two: ``(negative, positive)``), or None
        (inferred from ``y``). Sorted as ``np.unique`` sorts inferred labels:
        scikit-learn's scorers (``roc_auc``, ``neg_log_loss``) read ``predict_proba``'s
        columns in sorted label order, so a pair kept as given, ``[1, 0]``, turned every
        such score upside down."""
        public = self._parameter_constraints["classes"]("classes", self.classes)
        if public is None:
            return None
        try:
            return np.sort(public)
        except TypeError as e:
            raise ParameterValueError(
                f"classes must be labels of one kind (all numbers or all strings), "
                f"got {self.classes!r}; pass the public label set, e.g. classes=[0, 1] "
                "or classes=['a', 'b', 'c']"
            ) from e

    def _plan(self, params: dict[str, Any], X, y) -> DPSGDPlan:
        self._public_classes()  # a wrong classes parameter is refused before anything
        return super()._plan(params, X, y)

    def _check_data(self, X, y, plan: DPSGDPlan):
        """Validate ``X``, check the labels against the public ``classes`` (or infer them,
        with a warning) and encode them: as 0/1 with two classes, else as the index of
        each label in ``classes_``."""
        public = self._public_classes()
        X, y = validate_input(self, X, y, dtype=np.float64)
        kind = check_class_labels(type(self).__name__, y)
        if public is not None:
            bad = ~np.isin(y, public)
            if np.any(bad) and kind.startswith("continuous"):
                # scikit-learn's refusal of a regression target; its values are not listed
                raise ParameterValueError(
                    f"Unknown label type: {kind!r}: y holds non-integer numbers outside "
                    f"classes={public.tolist()}, a regression target, not class labels; "
                    "DPSGDClassifier is a classifier: bin y at public values first (and "
                    "pass the bins as classes), or fit DPSGDRegressor")
            if np.any(bad) and kind == "multiclass" and public.size == 2:
                # scikit-learn's words for a binary model given a third class
                # (check_classifier_not_supporting_multiclass): with classes=[a, b] the
                # model is binary
                raise ParameterValueError(
                    "Only binary classification is supported with two public classes. The "
                    "type of the target is 'multiclass': y holds labels not in "
                    f"classes={public.tolist()}: {np.unique(y[bad])[:5].tolist()}; "
                    f"{MULTICLASS_HINT}")
            if np.any(bad):
                raise ParameterValueError(
                    f"y contains labels not in classes={public.tolist()}: "
                    f"{np.unique(y[bad])[:5].tolist()}; classes is the public set of "
                    "labels y is written in: pass every label of your schema (e.g. "
                    "classes=['no', 'yes'] for text labels), or map y onto the labels of "
                    "classes before fitting"
                )
            classes = public
        else:
            classes = np.unique(y)
            if classes.size < 2:
                raise ParameterValueError(
                    "DPSGDClassifier needs at least two classes; y has only one class: "
                    f"{classes.tolist()}. If the other classes are known, pass them all, "
                    "e.g. classes=[a, b]"
                )
            if kind not in ("binary", "multiclass"):
                raise ParameterValueError(
                    f"Unknown label type: {kind!r}: DPSGDClassifier needs class labels y "
                    f"(binary or multiclass), got {classes.size} distinct values "
                    f"{classes[:10].tolist()}; bin y at public values first (and pass the "
                    "bins as classes), or fit DPSGDRegressor"
                )
            warn_person_fitting(
                "DPSGDClassifier: classes=None infers the labels from the private y; "
                "classes_ and predict() then reveal which labels occur in the data. Pass "
                "the public label set, e.g. classes=[0, 1], from the schema: "
                "classes=np.unique(y) is the same release without this warning.",
                PrivacyLeakWarning,
                stacklevel=5,
            )
        self.classes_ = classes
        if classes.size > 2:
            return X, np.searchsorted(classes, y).astype(np.intp)
        return X, (y == classes[1]).astype(np.float64)

    def _release(self, X: np.ndarray, y: np.ndarray, plan: DPSGDPlan) -> dict[str, Any]:
        """Two classes: the binary path (:meth:`_DPSGDBase._release`). Three or more: the
        same steps on the softmax cross-entropy (:mod:`privlearn.models._softmax`), under
        the same plan (mechanism and accounting)."""
        if self.classes_.size <= 2:
            return super()._release(X, y, plan)
        rng = make_rng(self.random_state)
        Z = self._design(X)
        steps = plan.steps
        ord_ = 2 if plan.noise == "gaussian" else 1
        U, scale, unorm = _scaled_design(Z, ord_)
        K = int(self.classes_.size)
        path = np.zeros((steps, Z.shape[1], K)) if self.record_path else None
        bar = progress(range(steps), desc=type(self).__name__, unit="it",
                       enabled=bool(VERBOSE.check("verbose", self.verbose)), leave=True)
        theta = softmax_dpsgd(
            Z, U, scale, unorm, y, K, noise=plan.noise, sigma=plan.noise_multiplier,
            sampling_rate=plan.sampling_rate, C=float(self.max_grad_norm),
            lr=float(self.learning_rate), lam=float(self.l2_regularization), rng=rng,
            steps=bar, path=path)
        if not np.all(np.isfinite(theta)):
            raise _diverged(float(self.learning_rate), float(self.l2_regularization))
        fitted = self._trajectory(plan)
        # theta is (p, K): rows are features (last: the intercept), columns classes
        coef, intercept = self._split_theta(theta.T)
        fitted.update(coef_=coef, intercept_=intercept)
        if path is not None:
            if self.fit_intercept:
                fitted["coef_path_"] = np.swapaxes(path[:, :-1, :], 1, 2).copy()
                fitted["intercept_path_"] = path[:, -1, :].copy()
            else:
                fitted["coef_path_"] = np.swapaxes(path, 1, 2).copy()
                fitted["intercept_path_"] = np.zeros((steps, K))
        return fitted

    def _is_multinomial(self) -> bool:
        check_is_fitted(self)
        return np.ndim(self.coef_) == 2

    def _decision(self, X) -> np.ndarray:
        if self._is_multinomial():
            X = validate_input(self, X, reset=False, dtype=np.float64)
            return X @ self.coef_.T + self.intercept_
        return super()._decision(X)

    def decision_function(self, X) -> np.ndarray:
        """Scores: one per row (that of ``classes_[1]``) with two classes, else one per
        row and class, shape ``(n, K)``."""
        return self._decision(X)

    def predict_proba(self, X) -> np.ndarray:
        """Probabilities of ``classes_``, shape ``(n, K)``. Two classes: the logistic of
        the score, each column computed directly, so a probability near 1 keeps its small
        complement; more: the softmax of the scores."""
        s = self._decision(X)
        if s.ndim == 2:
            return softmax_scores_to_proba(s)
        return np.column_stack([expit(-s), expit(s)])

    def predict_log_proba(self, X) -> np.ndarray:
        """Logarithms of :meth:`predict_proba`, computed without underflow (a score of
        -800 has log-probability -800, not ``-inf``)."""
        s = self._decision(X)
        if s.ndim == 2:
            return softmax_scores_to_log_proba(s)
        return np.column_stack([log_expit(-s), log_expit(s)])

    def predict(self, X) -> np.ndarray:
        scores = self._decision(X)
        if scores.ndim == 2:
            return self.classes_[np.argmax(scores, axis=1)]
        return self.classes_[(scores > 0).astype(int)]

    def __sklearn_tags__(self):
        """Multi-class unless the public ``classes`` are a pair (then a third label in
        ``y`` is refused with scikit-learn's binary-only message)."""
        tags = super().__sklearn_tags__()
        classes = self.classes
        tags.classifier_tags.multi_class = not (
            classes is not None and hasattr(classes, "__len__") and len(classes) == 2)
        return tags


class DPSGDRegressor(RegressorMixin, _DPSGDBase):
    __doc__ = (
        "Least-squares linear regression trained by DP-SGD "
        "(per-example loss ``(x^T theta - y)^2 / 2``).\n" + _DOC_PARAMS
    )

    _loss = "squared"

    def predict(self, X) -> np.ndarray:
        return self._decision(X)


    def __sklearn_tags__(self):
        """scikit-learn's ``poor_score`` tag, as the private linear regressors carry it:
        the noise is calibrated to the worst case over the clipping bound, and with L1
        clipping (``noise="laplace"``, pure DP) a fit on scikit-learn's check data (200
        unbounded rows) does not reach its R^2 > 0.5; the check's other assertions
        still run."""
        tags = super().__sklearn_tags__()
        tags.regressor_tags.poor_score = True
        return tags
