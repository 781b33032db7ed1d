"""Private hyperparameter search whose whole cost is accounted.

Running scikit-learn's ``GridSearchCV`` over a private estimator fits it once per
candidate and fold on the same private data and releases the best: the privacy cost is
the composition of **every** fit (``n_candidates x n_folds`` releases, plus the
selection), not the ``epsilon_`` of the returned ``best_estimator_``. Account it as
``compose([fit.mechanism_] * n_fits)`` (about ``n_fits x epsilon`` by basic composition;
less with the PLD accountant) -- or use :class:`PrivateSearchCV`:

* ``method="random_stopping"`` (default): Papernot & Steinke (2022) private selection. A
  random number ``K`` of runs is drawn from a truncated negative binomial distribution;
  each run picks a candidate uniformly at random, fits it and scores it (privately), and
  only the best run is released. Its cost is close to *one* fit's, independently of the
  number of candidates (Theorem 2 below).
* ``method="composition"``: every candidate is fitted once and scored privately; the
  cost is the tight composition of all fits and scores.

Privacy of random stopping
--------------------------
Let ``Q`` be one run (random candidate, fit, private score). By joint quasi-convexity of
Renyi divergence (van Erven & Harremoes 2014, Theorem 13), a data-independent random
choice among candidates is ``(lambda, max_i rho_i(lambda))``-RDP when candidate ``i`` is
``(lambda, rho_i(lambda))``-RDP. With ``K ~ D_{eta, gamma}`` (``eta > -1`` ... here
``eta >= 0``, ``gamma in (0, 1)``), releasing the best of ``K`` runs is
``(lambda, eps')``-RDP for every ``lambda > 1`` and ``lambda_hat > 1`` with

``eps' = rho(lambda) + (1 + eta) (1 - 1/lambda_hat) rho(lambda_hat)
+ (1 + eta) log(1/gamma) / lambda_hat + log(E[K]) / (lambda - 1)``

(Papernot & Steinke 2022, Theorem 2). We minimise over a grid of ``lambda_hat``, and
convert the curve to ``(epsilon, delta)`` with
:func:`privlearn.accounting.conversion.rdp_to_epsilon`. ``E[K] = eta (1 - gamma) /
(gamma (1 - gamma^eta))`` (``eta > 0``; geometric for ``eta = 1``) and ``(1 - gamma) /
(gamma log(1/gamma))`` for ``eta = 0`` (logarithmic distribution).

Scores. A run's score is part of ``Q``: by default the sum over the training records of
the loss clipped to ``[0, loss_bound]`` (squared error for regressors, 0-1 loss for
classifiers), released with Laplace noise of scale ``loss_bound / score_epsilon``
(sensitivity ``loss_bound`` under add/remove), i.e. ``Laplace(1 / score_epsilon)``
composed into ``Q``. Pass *public* validation data to ``fit(X, y, X_val=, y_val=)`` to
score without noise and at no cost.

References
----------
.. [1] N. Papernot, T. Steinke (2022), Hyperparameter Tuning with Renyi Differential
       Privacy, ICLR, Theorem 2.
.. [2] J. Liu, K. Talwar (2019), Private Selection from Private Candidates, STOC.
.. [3] T. van Erven, P. Harremoes (2014), Renyi Divergence and Kullback-Leibler
       Divergence, IEEE Trans. Inf. Theory, Theorem 13.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from sklearn.base import BaseEstimator, MetaEstimatorMixin, clone, is_classifier
from sklearn.model_selection import ParameterGrid

from privlearn.accounting import Laplace, Mechanism, RDPMechanism, compose
from privlearn.accounting.serialization import TabulatedRDP
from privlearn.models._base import check_positive_param, make_rng, spend_on_ledger
from privlearn.models._params import (
    ACCOUNTANT,
    LEDGER,
    RANDOM_STATE,
    Options,
    PrivateEstimatorMixin,
    Real,
    Unchecked,
)

__all__ = [
    "PrivateSearchCV",
    "planned_mechanism",
    "random_stopping_rdp",
    "register_planned_mechanism",
]

_PLANNERS: dict[type, Callable] = {}


def register_planned_mechanism(cls: type, fn: Callable) -> None:
    """Register ``fn(estimator, X, y) -> Mechanism``: the mechanism a ``fit(X, y)`` of an
    unfitted ``estimator`` of type ``cls`` will run, computed without reading the data's
    values (only its shape)."""
    _PLANNERS[cls] = fn


def planned_mechanism(estimator, X, y=None) -> Mechanism:
    """The mechanism ``estimator.fit(X, y)`` will run (from a planner registered for its
    type or a base class); ``TypeError`` for an estimator without one."""
    for cls in type(estimator).__mro__:
        if cls in _PLANNERS:
            return _PLANNERS[cls](estimator, X, y)
    raise TypeError(
        f"no planned mechanism is known for {type(estimator).__name__}; register one with "
        "privlearn.models.model_selection.register_planned_mechanism"
    )


def _plan_linear(est, X, y) -> Mechanism:
    return est._planned_mechanism()


def _plan_noisy_gd(est, X, y) -> Mechanism:
    from privlearn.models.linear import _noisy_gd_mechanism

    eps, delta, _, _ = est._validate_common()
    theory, sm = est._check_lr_smoothness()
    sigma_l = est._smoothness_multiplier(eps, delta, theory and sm == "private")
    sigma, n_iter = est._resolve_schedule(eps, delta, sigma_l)
    return _noisy_gd_mechanism(sigma, n_iter, sigma_l)


def _plan_dpsgd(est, X, y) -> Mechanism:
    from privlearn.models.dpsgd import dpsgd_mechanism

    noise, eps, delta, q, steps = est._validate_params_dp()
    return dpsgd_mechanism(noise, est._calibrate(noise, eps, delta, q, steps), q, steps)


def _plan_scaler(est, X, y) -> Mechanism:
    return est.planned_mechanism(np.shape(X)[1])


def _register_builtin() -> None:
    from privlearn.models.dpsgd import _DPSGDBase
    from privlearn.models.linear import NoisyGDRegressor, SSPRegressor
    from privlearn.models.preprocessing import PrivateStandardScaler

    register_planned_mechanism(SSPRegressor, _plan_linear)  # and AdaSSPRegressor (subclass)
    register_planned_mechanism(NoisyGDRegressor, _plan_noisy_gd)
    register_planned_mechanism(_DPSGDBase, _plan_dpsgd)
    register_planned_mechanism(PrivateStandardScaler, _plan_scaler)


_register_builtin()

_LAMBDA_HAT = np.concatenate([1.0 + np.geomspace(1e-3, 1.0, 30), np.geomspace(2.0, 1e4, 120)])


def _expected_runs(eta: float, gamma: float) -> float:
    if eta == 0.0:
        return (1.0 - gamma) / (gamma * math.log(1.0 / gamma))
    return eta * (1.0 - gamma) / (gamma * (1.0 - gamma**eta))


def _gamma_for(expected: float, eta: float) -> float:
    """The ``gamma`` giving ``E[K] = expected`` (bisection; E[K] decreases in gamma)."""
    lo, hi = 1e-12, 1.0 - 1e-12
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if _expected_runs(eta, mid) > expected:
            lo = mid
        else:
            hi = mid
    return hi  # E[K](hi) <= expected


def random_stopping_rdp(
    base_rdp: Callable[[np.ndarray], np.ndarray], eta: float, gamma: float
) -> Callable[[np.ndarray], np.ndarray]:
    """RDP curve of the best of ``K ~ D_{eta, gamma}`` runs of a base algorithm with RDP
    curve ``base_rdp`` (Papernot & Steinke 2022, Theorem 2), minimised over ``lambda_hat``
    on a fixed grid (every grid point gives a valid bound)."""
    rho_hat = np.asarray(base_rdp(_LAMBDA_HAT), dtype=float)
    extra = (1.0 + eta) * ((1.0 - 1.0 / _LAMBDA_HAT) * rho_hat + math.log(1.0 / gamma)
                           / _LAMBDA_HAT)
    c = float(np.nanmin(np.where(np.isfinite(extra), extra, np.inf)))
    log_ek = math.log(_expected_runs(eta, gamma))

    def curve(orders: np.ndarray) -> np.ndarray:
        a = np.asarray(orders, dtype=float)
        return np.asarray(base_rdp(a), dtype=float) + c + log_ek / (a - 1.0)

    return curve


def _sample_runs(eta: float, gamma: float, rng: np.random.Generator) -> int:
    if gamma >= 1.0 - 1e-9:  # E[K] = 1: the distribution is concentrated on K = 1
        return 1
    if eta == 1.0:  # geometric on {1, 2, ...}
        return int(rng.geometric(gamma))
    if eta == 0.0:
        return int(rng.logseries(1.0 - gamma))
    while True:  # negative binomial conditioned on K >= 1
        k = int(rng.negative_binomial(eta, gamma))
        if k >= 1:
            return k


def _fit_with_hidden_noise(est, X, y, rng: np.random.Generator) -> None:
    """Fit ``est`` with noise drawn from a child stream of the search's generator, then
    put its declared ``random_state`` back.

    The child stream (:meth:`numpy.random.Generator.spawn`) is never stored: a seed or
    generator left in the released model's parameters (or its pickle) would let anyone
    refit with it, regenerate the noise and read the data back (a refit on a dataset with
    and without a record reproduces ``coef_`` exactly on the right one). The released
    model's ``random_state`` is the one it was declared with, which did not produce its
    noise."""
    if "random_state" not in est.get_params():
        est.fit(X, y)
        return
    declared = est.random_state
    est.set_params(random_state=rng.spawn(1)[0])
    try:
        est.fit(X, y)
    finally:
        est.set_params(random_state=declared)


class PrivateSearchCV(PrivateEstimatorMixin, MetaEstimatorMixin, BaseEstimator):
    """Hyperparameter search over a private estimator, with its whole privacy cost.

    Parameters
    ----------
    estimator : private estimator
        Each candidate ``clone(estimator).set_params(**params)`` must have a planned
        mechanism (:func:`planned_mechanism`; built in for SSP, AdaSSP, NoisyGD, DP-SGD and
        the private scaler). After each fit the actual ``mechanism_`` is checked against it.
    param_grid : dict or list of dicts
        As :class:`sklearn.model_selection.GridSearchCV`.
    method : {"random_stopping", "composition"}
        See the module docstring.
    expected_runs : float >= 1
        ``E[K]`` for random stopping (default: the number of candidates).
    eta : float >= 0
        Shape of the truncated negative binomial (1: geometric, Liu & Talwar 2019; 0:
        logarithmic).
    score_epsilon : float > 0
        Pure epsilon of each private score (Laplace), when no public validation data is
        given.
    loss_bound : float > 0, optional
        Per-record loss clipping for the private score (required for regressors; 1 for
        classifiers' 0-1 loss).
    delta : float in (0, 1)
        Delta at which ``epsilon_`` is reported.
    accountant : str
        For ``method="composition"``.
    ledger : BudgetHandle, optional
        ``ledger.budget(dataset)``: the search's whole cost is spent before any data is
        read (refused with ``BudgetExceededError`` when over budget).
    random_state : None, int or Generator
        Seeds the search's own generator: which runs happen, the scores' noise, and a
        child stream per fit. Each candidate is fitted with noise from that hidden child
        stream, never with a seed stored on it: ``best_estimator_`` keeps the
        ``random_state`` it was declared with, which did not produce its noise. With the
        default ``None`` the generator draws fresh OS entropy and nothing released lets
        anyone regenerate the noise. An int makes the whole search reproducible by
        whoever knows it (and so lets them remove the noise): fix it only for
        experiments.

    Attributes
    ----------
    best_estimator_, best_params_, best_score_
        The released run: its model, its candidate and its noisy score (higher is
        better).
    n_fits_, runs_, scores_, fit_mechanisms_ : ``method="composition"`` only
        The number of fits, every candidate, its noisy score and its mechanism (all are
        accounted). Random stopping does not set them: its guarantee rests on the number
        of runs ``K`` staying hidden (with ``K`` known, the best of ``K`` runs costs up to
        ``K`` fits), so nothing on the object reveals ``K`` or the other runs.
    mechanism_ : Mechanism
        ``method="composition"``: the composition of every fit and score. Random
        stopping: an :class:`RDPMechanism` with the tabulated Theorem 2 curve (evaluate
        it with the ``"rdp"`` accountant).
    epsilon_, delta_ : float
    """

    def __init__(self, estimator, param_grid, *, method="random_stopping", expected_runs=None,
                 eta=1.0, score_epsilon=0.1, loss_bound=None, delta=1e-6,
                 accountant="pld", ledger=None, random_state=None):
        self.estimator = estimator
        self.param_grid = param_grid
        self.method = method
        self.expected_runs = expected_runs
        self.eta = eta
        self.score_epsilon = score_epsilon
        self.loss_bound = loss_bound
        self.delta = delta
        self.accountant = accountant
        self.ledger = ledger
        self.random_state = random_state

    # -- pieces ----------------------------------------------------------------------
    def _loss_bound(self) -> float:
        if is_classifier(self.estimator):
            return 1.0 if self.loss_bound is None else check_positive_param(
                "loss_bound", self.loss_bound)
        if self.loss_bound is None:
            raise ValueError(
                "loss_bound is required for a regressor's private score: per-record squared "
                "errors are clipped to [0, loss_bound] (e.g. (2 * y_bound) ** 2), or pass "
                "public X_val, y_val to fit"
            )
        return check_positive_param("loss_bound", self.loss_bound)

    def _score(self, est, X, y, public: bool, lb: float, rng) -> float:
        pred = est.predict(X)
        if is_classifier(est):
            loss = (pred != y).astype(float)
        else:
            loss = (np.asarray(pred, float) - np.asarray(y, float)) ** 2
        if public:
            return -float(np.mean(loss))
        total = float(np.sum(np.minimum(loss, lb)))
        return -(total + rng.laplace(scale=lb / self.score_epsilon))

    _parameter_constraints = {
        "estimator": Unchecked("a privlearn estimator, checked by planned_mechanism"),
        "param_grid": Unchecked("a scikit-learn parameter grid, expanded by ParameterGrid"),
        "method": Options("random_stopping", "composition"),
        "expected_runs": Real(1, None, allow_none=True,
                              hint="the mean number of candidates tried; None: the grid size"),
        "eta": Real(0, None, hint="the truncated negative binomial's shape, e.g. 1.0"),
        "score_epsilon": Real(0, None, low_open=True, hint="e.g. 0.1"),
        "loss_bound": Real(0, None, low_open=True, allow_none=True,
                           hint="per-record losses are clipped to [0, loss_bound]"),
        "delta": Real(0, 1, low_open=True, high_open=True,
                      hint="a search needs delta > 0, e.g. 1e-6"),
        "accountant": ACCOUNTANT,
        "ledger": LEDGER,
        "random_state": RANDOM_STATE,
    }

    def _validate(self):
        p = self._validate_params()
        eta = p["eta"]
        grid = list(ParameterGrid(self.param_grid))
        if not grid:
            raise ValueError("param_grid is empty")
        return float(eta), grid

    def plan(self, X, y, *, public_scores: bool = False) -> tuple[Mechanism, dict]:
        """The mechanism the whole search will run on data of this shape (before reading
        it), and the data-independent quantities it uses."""
        eta, grid = self._validate()
        cands = [clone(self.estimator).set_params(**p) for p in grid]
        fit_mechs = [planned_mechanism(c, X, y) for c in cands]
        score_mech = None if public_scores else Laplace(1.0 / self.score_epsilon)
        runs = [m if score_mech is None else compose([m, score_mech]) for m in fit_mechs]
        info = {"grid": grid, "fit_mechanisms": fit_mechs, "score": score_mech}
        if self.method == "composition":
            return compose(runs), info
        ek = float(len(grid) if self.expected_runs is None else self.expected_runs)
        if not ek >= 1.0:
            raise ValueError(f"expected_runs must be >= 1, got {self.expected_runs!r}")
        gamma = _gamma_for(ek, eta) if ek > 1.0 else 1.0 - 1e-12

        def base_rdp(orders):
            return np.max(np.stack([np.atleast_1d(r.rdp(np.atleast_1d(orders)))
                                    for r in runs]), axis=0)

        curve = random_stopping_rdp(base_rdp, eta, gamma)
        orders = np.concatenate([1.0 + np.geomspace(1e-2, 1.0, 40)[:-1], np.arange(2.0, 257.0),
                                 np.geomspace(257.0, 1e5, 60)[1:]])
        # Renyi divergence is non-decreasing in the order, so a bound at order a' holds at
        # every a <= a': take the running minimum from the right (a valid, monotone curve)
        values = np.minimum.accumulate(np.maximum(curve(orders), 0.0)[::-1])[::-1]
        mech = RDPMechanism(TabulatedRDP(tuple(orders), tuple(values)),
                            name=f"private selection (Papernot-Steinke, eta={eta:g}, "
                            f"E[K]={ek:g})")
        info.update(gamma=gamma, eta=eta, expected_runs=ek)
        return mech, info

    def fit(self, X, y, *, X_val=None, y_val=None):
        """Run the search. ``X_val, y_val``: *public* validation data (no cost)."""
        public = X_val is not None
        if public and y_val is None:
            raise ValueError("give y_val with X_val")
        lb = 1.0 if public else self._loss_bound()
        mech, info = self.plan(X, y, public_scores=public)
        acc = "rdp" if self.method == "random_stopping" else self.accountant
        spend_on_ledger(self, mech, f"PrivateSearchCV({type(self.estimator).__name__}, "
                        f"{self.method})")
        rng = make_rng(self.random_state)
        grid, fit_mechs = info["grid"], info["fit_mechanisms"]
        if self.method == "composition":
            order = list(range(len(grid)))
        else:
            k = _sample_runs(info["eta"], info["gamma"], rng)
            order = [int(i) for i in rng.integers(0, len(grid), size=k)]
        Xs, ys = (X_val, y_val) if public else (X, y)
        best, fits, runs, ran = None, [], [], []
        for i in order:
            est = clone(self.estimator).set_params(**grid[i])
            params = est.get_params()
            if "ledger" in params:  # the search spends for all its runs, once
                est.set_params(ledger=None)
            _fit_with_hidden_noise(est, X, y, rng)
            if getattr(est, "mechanism_", None) != fit_mechs[i]:
                raise RuntimeError(
                    f"candidate {grid[i]} ran {getattr(est, 'mechanism_', None)!r}, not its "
                    f"planned mechanism {fit_mechs[i]!r}; the search's accounting would not "
                    "cover it"
                )
            ran.append(est.mechanism_)
            score = self._score(est, Xs, ys, public, lb, rng)
            fits.append(score)
            runs.append(grid[i])
            if best is None or score > best[1]:
                best = (est, score, grid[i])
        self.best_estimator_, self.best_score_, self.best_params_ = best
        if self.method == "composition":
            self.runs_ = runs
            self.scores_ = fits
            self.n_fits_ = len(runs)
            self.fit_mechanisms_ = ran
        if self.ledger is not None and "ledger" in self.best_estimator_.get_params():
            self.best_estimator_.set_params(ledger=self.ledger)
        self.mechanism_ = mech
        self.delta_ = float(self.delta)
        self.epsilon_ = float(mech.epsilon(self.delta_, acc))
        return self

    def predict(self, X):
        """The best run's prediction (post-processing)."""
        return self.best_estimator_.predict(X)
