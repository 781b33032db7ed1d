"""DP-SGD for logistic and linear regression (the DP-SGD tutorial; the accounting
tutorial, section 2).

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
from privlearn.models._noise_range import refuse_overflowing_noise
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
    NOISE_MULTIPLIER,
    RANDOM_STATE,
    VERBOSE,
    AccountantName,
    Boolean,
    Delta,
    Integer,
    Options,
    PublicClasses,
    Real,
)

__all__ = ["DPSGDClassifier", "DPSGDRegressor", "dpsgd_mechanism"]


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
        "n_iter": Integer(1),
        "learning_rate": Real(0, None, low_open=True, hint="e.g. 0.5"),
        "max_grad_norm": Real(0, None, low_open=True, hint="the per-example clipping bound"),
        "l2_regularization": Real(0, None, hint="0 for none"),
        "fit_intercept": Boolean(),
        "noise_multiplier": NOISE_MULTIPLIER,
        "accountant": ACCOUNTANT,
        "trajectory_points": Integer(1),
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
            if q < 1.0:
                idx = np.flatnonzero(rng.random(n) < q)
                Zb, Ub, yb, sb, nb = Z[idx], U[idx], y[idx], scale[idx], unorm[idx]
            else:
                Zb, Ub, yb, sb, nb = Z, U, y, scale, unorm
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
            if noise == "gaussian":
                total = total + rng.normal(scale=sigma * C, size=d)
            else:
                total = total + rng.laplace(scale=sigma * C, size=d)
            # 4. scale by the expected batch size; 5. step
            g = total / denom
            theta = theta - lr * (g + lam * theta)
            if path is not None:
                path[t] = theta
        if not np.all(np.isfinite(theta)):
            raise FloatingPointError("DP-SGD diverged; use a smaller learning_rate")
        k = min(int(self.trajectory_points), steps)
        ts = np.unique(np.round(np.linspace(1, steps, k)).astype(np.int64))
        acc = self.trajectory_accountant or plan.accountant
        fitted = {
            "noise_multiplier_": sigma,
            "n_iter_": steps,
            "trajectory_steps_": ts,
            "epsilon_trajectory_": np.array(
                [dpsgd_mechanism(noise, sigma, q, int(t)).epsilon(plan.delta, acc)
                 for t in ts]),
        }
        coef, intercept = self._split_theta(theta[None, :])
        fitted.update(coef_=coef[0], intercept_=float(intercept[0]))
        if path is not None:
            fitted["coef_path_"], fitted["intercept_path_"] = self._split_theta(path)
        return fitted

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
        logistic gradient has L1 norm up to ``d + 1`` and L2 norm up to ``sqrt(d + 1)``.
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
        Number of points of ``epsilon_trajectory_`` (evenly spaced steps in [1, T]).
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
    noise_multiplier_ : float
    mechanism_ : Mechanism
        What ran, e.g. ``compose(subsample(Gaussian(sigma), q), steps=T)``.
    epsilon_, delta_ : certified epsilon spent at ``delta_``
    trajectory_steps_, epsilon_trajectory_ : epsilon spent after each listed step count
"""


class DPSGDClassifier(ClassifierMixin, _DPSGDBase):
    __doc__ = (
        "Binary logistic regression trained by DP-SGD (the DP-SGD tutorial).\n" + _DOC_PARAMS
        + """    classes_ : ndarray of 2 labels

    Notes
    -----
    ``classes`` (keyword, last parameter): the public pair of labels, e.g.
    ``classes=[0, 1]``. ``classes_`` is the pair sorted, as scikit-learn's classifiers
    have it (its scorers read ``predict_proba``'s columns in sorted label order), and
    ``classes_[1]`` is the positive class. None (default) infers
    them from ``y``, which releases which labels occur in the private data (through
    ``classes_`` and ``predict``), so a :class:`~privlearn.errors.PrivacyLeakWarning` is
    emitted. With ``classes`` given, ``y`` may contain only one of them.
"""
    )

    _loss = "logistic"

    _parameter_constraints = {
        **_DPSGDBase._parameter_constraints,
        "classes": PublicClasses(size=2),
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
        """The public ``(negative, positive)`` labels, sorted, or None (inferred from
        ``y``). Sorted as ``np.unique`` sorts an inferred pair: scikit-learn's scorers
        (``roc_auc``, ``neg_log_loss``) read ``predict_proba``'s columns in sorted label
        order, so a pair kept as given, ``[1, 0]``, turned every such score upside down."""
        public = self._parameter_constraints["classes"]("classes", self.classes)
        if public is None:
            return None
        try:
            return np.sort(public)
        except TypeError as e:
            raise ParameterValueError(
                f"classes must be two labels of one kind (both numbers or both strings), "
                f"got {self.classes!r}; pass the public label pair, e.g. classes=[0, 1]"
            ) from e

    def _plan(self, params: dict[str, Any], X, y) -> DPSGDPlan:
        self._public_classes()  # a wrong classes parameter is refused before anything
        return super()._plan(params, X, y)

    def _check_data(self, X, y, plan: DPSGDPlan):
        """Validate ``X``, check the labels against the public ``classes`` (or infer them,
        with a warning) and encode them as 0/1."""
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
                    "DPSGDClassifier is binary: threshold y at a public value first, or fit "
                    "DPSGDRegressor")
            if np.any(bad) and kind == "multiclass":
                raise ParameterValueError(
                    "Only binary classification is supported. The type of the target is "
                    f"'multiclass': y holds labels not in classes={public.tolist()}: "
                    f"{np.unique(y[bad])[:5].tolist()}; DPSGDClassifier is binary: map y "
                    "onto the two labels of classes before fitting, or use PrivateKNN or "
                    "PATE with classes= for a multi-class release")
            if np.any(bad):
                raise ParameterValueError(
                    f"y contains labels not in classes={public.tolist()}: "
                    f"{np.unique(y[bad])[:5].tolist()}; DPSGDClassifier is binary and "
                    "classes is the public pair of labels y is written in: pass the two "
                    "labels of your schema (e.g. classes=['no', 'yes'] for text labels), or "
                    "map y onto the labels of classes before fitting"
                )
            classes = public
        else:
            classes = np.unique(y)
            if classes.size < 2:
                raise ParameterValueError(
                    "DPSGDClassifier needs binary labels; y has only one class: "
                    f"{classes.tolist()}. If the other class is known, pass classes=[a, b]"
                )
            if classes.size > 2 or kind not in ("binary",):
                raise ParameterValueError(
                    "Only binary classification is supported. The type of the target is "
                    f"{kind!r}: DPSGDClassifier needs binary labels y, got {classes.size} "
                    f"classes {classes[:10].tolist()}"
                )
            warn_person_fitting(
                "DPSGDClassifier: classes=None infers the two labels from the private y; "
                "classes_ and predict() then reveal which labels occur in the data. Pass "
                "the public label pair, e.g. classes=[0, 1].",
                PrivacyLeakWarning,
                stacklevel=5,
            )
        self.classes_ = classes
        return X, (y == classes[1]).astype(np.float64)

    def decision_function(self, X) -> np.ndarray:
        return self._decision(X)

    def predict_proba(self, X) -> np.ndarray:
        """Probabilities of ``classes_[0]`` and ``classes_[1]`` (logistic of the score;
        each column computed directly, so a probability near 1 keeps its small
        complement)."""
        s = self._decision(X)
        return np.column_stack([expit(-s), expit(s)])

    def predict_log_proba(self, X) -> np.ndarray:
        """Logarithms of :meth:`predict_proba`, computed without underflow (a score of
        -800 has log-probability -800, not ``-inf``)."""
        s = self._decision(X)
        return np.column_stack([log_expit(-s), log_expit(s)])

    def predict(self, X) -> np.ndarray:
        scores = self._decision(X)
        return self.classes_[(scores > 0).astype(int)]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
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
