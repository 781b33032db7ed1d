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

(Papernot & Steinke 2022, Theorem 2). ``E[K] = eta (1 - gamma) / (gamma (1 -
gamma^eta))`` (``eta > 0``; geometric for ``eta = 1``) and ``(1 - gamma) / (gamma
log(1/gamma))`` for ``eta = 0`` (logarithmic distribution). The search describes this
release as :class:`privlearn.accounting.RepeatAndSelect` ``(run, mean=expected_runs,
shape=eta)`` (Google dp_accounting's ``RepeatAndSelectDpEvent``), whose ``"rdp"``
accountant evaluates the bound (minimised over ``lambda_hat``) and converts it to
``(epsilon, delta)``; ``run`` is the candidates' common run, or, when they differ, the
worst of their RDP curves at each order, tabulated. Every run must be stated under
add/remove neighbouring (a fixed-size batch sampler's replace-one guarantee is refused:
use ``method="composition"``). The ``K`` drawn has ``E[K] <= expected_runs`` and a
``gamma`` no smaller than the one accounted, so neither term is under-stated.

Scores. A run's score is part of ``Q``: by default the sum over the training records of
the loss clipped to ``[0, loss_bound]`` (squared error for regressors, 0-1 loss for
classifiers) and the number of rows, each released with Laplace noise at half of
``score_epsilon`` (scales ``2 loss_bound / score_epsilon`` and ``2 / score_epsilon``;
sensitivities ``loss_bound`` and 1 under add/remove, where the number of rows is not
public), i.e. ``compose(Laplace(2 / score_epsilon), steps=2)`` composed into ``Q``. Their
ratio is reported as ``best_score_`` on the scale of
:meth:`PrivateSearchCV.score`: accuracy for classifiers, minus the mean squared error for
regressors. Pass *public* validation data to ``fit(X, y, X_val=, y_val=)`` to score
without noise and at no cost.

Pipelines. A :class:`~privlearn.models.PrivatePipeline` (e.g. a
:class:`~privlearn.models.PrivateStandardScaler` then a private model) is searched like an
estimator (``param_grid`` keys ``"step__param"``): its planned mechanism is the
composition of its steps' planned mechanisms, each run's fit is checked against it, and
every step is fitted with hidden noise and without its own ledger (the search spends for
all runs, once).

References
----------
.. [1] N. Papernot, T. Steinke (2022), Hyperparameter Tuning with Renyi Differential
       Privacy, ICLR, Theorem 2.
.. [2] J. Liu, K. Talwar (2019), Private Selection from Private Candidates, STOC.
.. [3] T. van Erven, P. Harremoes (2014), Renyi Divergence and Kullback-Leibler
       Divergence, IEEE Trans. Inf. Theory, Theorem 13.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.base import MetaEstimatorMixin, clone, is_classifier, is_regressor
from sklearn.model_selection import ParameterGrid
from sklearn.utils import get_tags
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from privlearn._progress import progress
from privlearn.accounting import (
    ApproxDP,
    Laplace,
    Mechanism,
    RDPMechanism,
    RepeatAndSelect,
    compose,
)
from privlearn.accounting.conversion import DEFAULT_ORDERS, EXTENSION_BLOCKS
from privlearn.accounting.registry import pure_epsilon
from privlearn.accounting.repeat_select import _GRID as _SELECTION_ORDERS
from privlearn.accounting.repeat_select import _expected_runs
from privlearn.accounting.serialization import TabulatedRDP
from privlearn.errors import (
    ConfigurationError,
    DataClippedWarning,
    ParameterTypeError,
    ParameterValueError,
    PlanMismatchError,
    UnsupportedMechanismError,
)
from privlearn.models._refused_keywords import SEARCH_KEYWORDS, refuse_keywords
from privlearn.models._schema_gate import refuse_bad_schema
from privlearn.models.base import (
    PrivateEstimator,
    ReleasePlan,
    data_shape,
    make_rng,
    quiet_data_checks,
    refuse_as_step,
    validate_input,
    warn_person_fitting,
)
from privlearn.models.constraints import (
    ACCOUNTANT,
    LEDGER,
    RANDOM_STATE,
    VERBOSE,
    Options,
    Real,
    Unchecked,
)
from privlearn.models.preprocessing import PrivatePipeline, refuse_refitting_public_fits

__all__ = [
    "PrivateSearchCV",
    "SearchPlan",
    "planned_mechanism",
    "random_stopping_rdp",
]


def planned_mechanism(estimator: PrivateEstimator | PrivatePipeline, X, y=None) -> Mechanism:
    """The mechanism ``estimator.fit(X, y)`` will run, from the shape of ``X`` only
    (:meth:`PrivateEstimator.planned_mechanism`, or
    :meth:`~privlearn.models.PrivatePipeline.planned_mechanism`: the composition of its
    steps' planned mechanisms); ``TypeError`` for anything else (its cost cannot be
    planned)."""
    if not isinstance(estimator, PrivateEstimator | PrivatePipeline):
        raise ParameterTypeError(
            f"no planned mechanism is known for {type(estimator).__name__}: a private "
            "search needs privlearn.models.PrivateEstimator candidates or a "
            "privlearn.models.PrivatePipeline of them (subclass PrivateEstimator: see "
            "help(privlearn.models.PrivateEstimator) and the guide 'extending privlearn', "
            "section 'A new estimator')")
    return estimator.planned_mechanism(X, y)


def _nested_keys(est, name: str) -> list[str]:
    """The parameters called ``name`` of ``est`` and of its nested estimators (a
    pipeline's steps: ``"clf__random_state"``)."""
    return [k for k in est.get_params(deep=True) if k == name or k.endswith("__" + name)]


def _sampling_gamma(expected: float, eta: float) -> float:
    """The ``gamma`` of the number of runs the search draws: at least the one giving
    ``E[K] = expected`` (bisection; ``E[K]`` decreases in ``gamma``), so that the drawn
    ``K`` has ``E[K] <= expected`` and a ``gamma`` no smaller than the one the
    accountant's :class:`~privlearn.accounting.RepeatAndSelect` takes (which is at most
    the exact one): both terms of Papernot & Steinke (2022), Theorem 2, are then
    accounted at values no smaller than the drawn distribution's."""
    lo, hi = 1e-12, 1.0 - 1e-12
    target = expected * (1.0 - 1e-12)  # below the rounding of the formula
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if _expected_runs(eta, mid) > target:
            lo = mid
        else:
            hi = mid
    return hi  # E[K](hi) <= expected


#: The orders at which a selection among candidates running different mechanisms
#: tabulates its worst run: those at which :class:`~privlearn.accounting.RepeatAndSelect`
#: minimises over ``lambda_hat`` and the orders the ``"rdp"`` accountant converts at.
_RUN_ORDERS = np.unique(np.concatenate(
    [_SELECTION_ORDERS, DEFAULT_ORDERS,
     *(b[b <= _SELECTION_ORDERS[-1]] for b in EXTENSION_BLOCKS)]))


def _selection(runs: list[Mechanism], expected_runs: float, eta: float) -> RepeatAndSelect:
    """Random stopping as one mechanism: ``RepeatAndSelect(run, expected_runs, eta)``
    (Papernot & Steinke 2022, Theorem 2), where one run is a uniformly random candidate,
    fitted and scored.

    When every candidate runs the same mechanism, the run is that mechanism. Otherwise a
    data-independent random choice among candidates is ``(lambda, max_i rho_i(lambda))``
    -RDP when candidate ``i`` is ``(lambda, rho_i(lambda))``-RDP (joint quasi-convexity of
    Renyi divergence, van Erven & Harremoes 2014, Theorem 13), and ``max_i eps_i``-DP:
    the run is that worst curve, tabulated at :data:`_RUN_ORDERS` (a storable
    :class:`~privlearn.accounting.serialization.TabulatedRDP`, conservative between its
    orders) with the candidates' largest pure epsilon. Every candidate's run must be
    stated under add/remove neighbouring, as the selection's base must be."""
    distinct = list(dict.fromkeys(runs))
    for run in distinct:  # the relation of each run, before any is hidden in a curve
        RepeatAndSelect(run, expected_runs, eta)
    if len(distinct) == 1:
        return RepeatAndSelect(distinct[0], expected_runs, eta)
    worst = np.max(np.stack([np.asarray(r.rdp(_RUN_ORDERS), dtype=float) for r in distinct]),
                   axis=0)
    worst = np.where(np.isnan(worst), np.inf, np.maximum(worst, 0.0))
    # Renyi divergence is non-decreasing in the order (van Erven & Harremoes 2014,
    # Theorem 3): a bound at order a' holds at every a <= a' (running minimum from the right)
    worst = np.minimum.accumulate(worst[::-1])[::-1]
    pure = max(pure_epsilon(r) for r in distinct)
    base = RDPMechanism(TabulatedRDP(tuple(_RUN_ORDERS), tuple(worst)),
                        name=f"a uniformly random one of {len(distinct)} runs",
                        pure_epsilon=pure if pure > 0.0 else math.inf)
    return RepeatAndSelect(base, expected_runs, eta)


def random_stopping_rdp(
    base_rdp: Callable[[np.ndarray], np.ndarray], eta: float, gamma: float
) -> Callable[[np.ndarray], np.ndarray]:
    """RDP curve of the best of ``K ~ D_{eta, gamma}`` runs of a base algorithm with RDP
    curve ``base_rdp`` (Papernot & Steinke 2022, Theorem 2).

    .. deprecated::
        Use :class:`~privlearn.accounting.RepeatAndSelect` (``RepeatAndSelect(run,
        mean, shape=eta)``, a mechanism every accountant and the ledger read). This
        function tabulates ``base_rdp`` at the selection's orders (conservative between
        them: the running minimum from the right, Renyi divergence being non-decreasing in
        the order) and returns that ``RepeatAndSelect``'s RDP curve, with the mean number
        of runs ``E[K]`` of ``D_{eta, gamma}``.
    """
    warnings.warn(
        "model_selection.random_stopping_rdp is deprecated: describe the selection as "
        "privlearn.accounting.RepeatAndSelect(run, mean, shape=eta) (mean = E[K]), which "
        "every accountant and the ledger read", DeprecationWarning, stacklevel=2)
    curve = np.asarray(base_rdp(_RUN_ORDERS), dtype=float)
    curve = np.where(np.isnan(curve), np.inf, np.maximum(curve, 0.0))
    curve = np.minimum.accumulate(curve[::-1])[::-1]
    base = RDPMechanism(TabulatedRDP(tuple(_RUN_ORDERS), tuple(curve)), name="a run")
    selection = RepeatAndSelect(base, max(1.0, _expected_runs(eta, gamma)), eta)
    return lambda orders: np.asarray(selection.rdp(np.asarray(orders, dtype=float)),
                                     dtype=float)


def _sample_runs(eta: float, gamma: float, rng: np.random.Generator) -> int:
    if gamma >= 1.0 - 1e-9:  # E[K] = 1: the distribution is concentrated on K = 1
        return 1
    if eta == 1.0:  # geometric on {1, 2, ...}
        return int(rng.geometric(gamma))
    if eta == 0.0:
        return int(rng.logseries(1.0 - gamma))
    if eta > 1.0:  # negative binomial conditioned on K >= 1 (accepted w.p. >= 1 - gamma)
        while True:
            k = int(rng.negative_binomial(eta, gamma))
            if k >= 1:
                return k
    # 0 < eta < 1: rejection would accept with probability 1 - gamma^eta, which vanishes
    # with eta; invert the CDF of P[K = k] = (1 - gamma)^k prod_{l<k} (l + eta) / (l + 1)
    # / (gamma^-eta - 1) (Papernot & Steinke 2022, Definition 1) instead
    u = rng.random()
    p = (1.0 - gamma) * eta / math.expm1(-eta * math.log(gamma))
    k, cdf = 1, p
    while cdf < u:
        p *= (1.0 - gamma) * (k + eta) / (k + 1)
        if cdf + p == cdf:  # the rest of the tail is below rounding: u was within it
            break
        k, cdf = k + 1, cdf + p
    return k


def _fit_with_hidden_noise(est, X, y, rng: np.random.Generator) -> None:
    """Fit ``est`` with noise drawn from a child stream of the search's generator, then
    put its declared ``random_state`` back.

    The child stream (:meth:`numpy.random.Generator.spawn`) is never stored: a seed or
    generator left in the released model's parameters (or its pickle) would let anyone
    refit with it, regenerate the noise and read the data back (a refit on a dataset with
    and without a record reproduces ``coef_`` exactly on the right one). The released
    model's ``random_state`` is the one it was declared with, which did not produce its
    noise.

    Only the private estimators' seeds are replaced (a pipeline: each private step's
    own): a scikit-learn step's ``random_state`` draws no privacy noise, and its
    validation refuses a Generator."""
    params = est.get_params(deep=True)
    keys = [k for k in _nested_keys(est, "random_state")
            if isinstance(params[k.rpartition("__")[0]] if "__" in k else est,
                          PrivateEstimator)]
    if not keys:
        est.fit(X, y)
        return
    declared = {k: params[k] for k in keys}
    est.set_params(**{k: child for k, child in zip(keys, rng.spawn(len(keys)), strict=True)})
    try:
        est.fit(X, y)
    finally:
        est.set_params(**declared)


def _progress(runs: list[int], desc: str, enabled: bool):
    """``runs``, with a tqdm progress bar over them on standard error when ``enabled``
    (else nothing is written)."""
    return progress(runs, desc=desc, unit="fit", enabled=enabled, leave=True)


def _budget_reading_no_rdp(handle):
    """The ledger budget of ``handle`` when its total is composed by an accountant other
    than ``"rdp"`` (e.g. the default PLD), which cannot read an RDP curve; else
    None."""
    if handle is None:
        return None
    try:
        budget = handle.ledger.budget_info(handle.dataset, privacy_unit=handle.privacy_unit)
    except Exception:  # not a budget handle, or no such budget: the reservation says why
        return None
    return budget if budget.accountant != "rdp" and not budget.adaptive else None


def _best_has(attr: str) -> Callable[[Any], bool]:
    """``available_if`` check: the released model (or, before fitting, the estimator)
    has ``attr`` (scikit-learn's ``GridSearchCV`` delegation)."""

    def check(search) -> bool:
        est = getattr(search, "best_estimator_", search.estimator)
        getattr(est, attr)  # AttributeError: the method is not available
        return True

    return check


@dataclass(frozen=True, kw_only=True)
class SearchPlan(ReleasePlan):
    """The search's plan: the candidates, each fit's planned mechanism, the private
    score's mechanism (None: public validation scores) and, for random stopping, the
    distribution of the number of runs ``K ~ D_{eta, gamma}``."""

    grid: tuple[dict, ...]
    fit_mechanisms: tuple[Mechanism, ...]
    #: each candidate's own plan (None for a pipeline), for its data checks
    fit_plans: tuple[ReleasePlan | None, ...] = ()
    score: Mechanism | None
    loss_bound: float
    eta: float | None = None
    gamma: float | None = None
    expected_runs: float | None = None


class PrivateSearchCV(MetaEstimatorMixin, PrivateEstimator):
    """Hyperparameter search over a private estimator, with its whole privacy cost.

    Parameters
    ----------
    estimator : PrivateEstimator
        A :class:`~privlearn.models.PrivateEstimator` (every estimator of
        :mod:`privlearn.models` with a ``fit``, or one of yours on the base): each
        candidate ``clone(estimator).set_params(**params)`` plans its mechanism before the
        data is read (:meth:`~privlearn.models.PrivateEstimator.planned_mechanism`), and
        after each fit the actual ``mechanism_`` is checked against it.
    param_grid : dict or list of dicts
        As :class:`sklearn.model_selection.GridSearchCV`.
    method : {"random_stopping", "composition"}
        ``"random_stopping"`` (default): a random number of runs ``K`` (mean
        ``expected_runs``), each a random candidate; only the best is released and ``K``
        stays hidden (Papernot & Steinke 2022, Theorem 2), at two to three times the
        costliest candidate's epsilon. ``"composition"``: every candidate once, all fits
        and scores composed. Details in the module docstring.
    expected_runs : float >= 1
        ``E[K]`` for random stopping (default: the number of candidates); refused with
        ``method="composition"``, which fits every candidate.
    eta : float >= 0
        Shape of the truncated negative binomial (1: geometric, Liu & Talwar 2019; 0:
        logarithmic).
    score_epsilon : float > 0
        Pure epsilon of each private score (two Laplace releases at half of it: the
        clipped losses' sum and the number of rows), when no public validation data is
        given.
    loss_bound : float > 0, optional
        Per-record loss clipping for the private score (required for regressors; 1 for
        classifiers' 0-1 loss); a ``DataClippedWarning`` says how many losses it clipped.
    delta : float in (0, 1)
        Delta at which ``epsilon_`` is reported.
    accountant : str
        For ``method="composition"``.
    ledger : BudgetHandle, optional
        ``ledger.budget(dataset)``: the search's whole cost is reserved before any data is
        read (refused with ``BudgetExceededError`` when over budget) and settled when the
        search is done; the candidates' own ledgers (a pipeline's steps' too) are not
        charged. With ``ledger=None`` a searched estimator that has a ledger of its own
        is refused (``ConfigurationError``): its fits would be charged nowhere. Random
        stopping on a budget whose accountant is not ``"rdp"`` is
        charged its ``(epsilon, delta)`` conversion (see ``mechanism_``).
    random_state : None, int or Generator
        Seeds the search's own generator: which runs happen, the scores' noise, and a
        child stream per fit. Each candidate is fitted with noise from that hidden child
        stream, never with a seed stored on it: ``best_estimator_`` keeps the
        ``random_state`` it was declared with, which did not produce its noise. With the
        default ``None`` the generator draws fresh OS entropy and nothing released lets
        anyone regenerate the noise. An int makes the whole search reproducible by
        whoever knows it (and so lets them remove the noise): fix it only for
        experiments. A Generator advances by the same four draws whatever the number of
        runs (it stays on the search, so it must not reveal ``K``).
    verbose : int >= 0 or bool
        0 (default): silent, as scikit-learn's searches. 1 or more: a progress bar on
        standard error over the runs (``tqdm``: runs done, their total, elapsed time and
        rate). It shows counts and times only, never a score. With random stopping the
        total is the number of runs ``K``, which the search's guarantee needs hidden
        (see the attributes): whoever runs ``fit`` may see it, but do not publish the
        output of a verbose search (e.g. a public CI log).

    Attributes
    ----------
    best_estimator_, best_params_, best_score_
        The released run: its model, its candidate and its score, on the scale of
        :meth:`score` (higher is better): **accuracy** for a classifier, **minus the mean
        squared error** for a regressor, as scikit-learn's ``GridSearchCV`` with
        ``scoring="accuracy"`` / ``"neg_mean_squared_error"``. Without public validation
        data it is measured on the training data, from the *noisy* sum of the clipped
        per-record losses (``loss_bound``) divided by the noisy number of rows (clipped to
        ``[0, 1]``, resp. ``<= 0``), so it is noisy and optimistic about generalisation:
        evaluate the released model on held-out data with :meth:`score`. With ``X_val,
        y_val`` it is the exact score on them.
    n_fits_, runs_, scores_, fit_mechanisms_ : ``method="composition"`` only
        The number of fits, every candidate, its noisy score and its mechanism (all are
        accounted). Random stopping does not set them: its guarantee rests on the number
        of runs ``K`` staying hidden (with ``K`` known, the best of ``K`` runs costs up to
        ``K`` fits), so nothing on the object reveals ``K`` or the other runs.
    mechanism_ : Mechanism
        ``method="composition"``: the composition of every fit and score. Random
        stopping: a :class:`~privlearn.accounting.RepeatAndSelect` of one run (evaluate
        it with the ``"rdp"`` accountant); on a ``ledger`` budget composed by another
        accountant (the default ``"pld"``, which cannot read an RDP curve), the curve's
        ``(epsilon, delta)`` guarantee at 0.99 times ``delta`` (or the budget's delta if
        smaller),
        :class:`~privlearn.accounting.ApproxDP`, which the PLD accountant composes with
        the budget's other releases (a conservative conversion: the curve's other
        points are not used).
    epsilon_, delta_ : float
    """

    @refuse_keywords(SEARCH_KEYWORDS)
    def __init__(self, estimator, param_grid, *, method="random_stopping", expected_runs=None,
                 eta=1.0, score_epsilon=0.1, loss_bound=None, delta=1e-6,
                 accountant="pld", ledger=None, random_state=None, verbose=0):
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
        self.verbose = verbose

    # -- pieces ----------------------------------------------------------------------
    def _loss_bound(self, loss_bound: float | None) -> float:
        """The per-record loss clipping of the private score (validated ``loss_bound``;
        the 0-1 loss's 1 for classifiers)."""
        if loss_bound is not None:
            return loss_bound
        if is_classifier(self.estimator):
            return 1.0
        raise ParameterValueError(
            "loss_bound is required for a regressor's private score: per-record squared "
            "errors are clipped to [0, loss_bound] (e.g. (2 * y_bound) ** 2), or pass "
            "public X_val, y_val to fit"
        )

    def _score(self, est, X, y, public: bool, lb: float, rng,
               clipped_counts: list[tuple[int, int]] | None = None) -> float:
        """The run's score on the scale of :meth:`score`: accuracy (classifiers) or minus
        the mean squared error (regressors). Private: from the noisy sum of the clipped
        per-record losses, divided by the noisy number of rows (``n`` changes between
        add/remove neighbours). ``clipped_counts`` gets the number of losses the private
        score clipped (for the person fitting only)."""
        pred = est.predict(X)
        if is_classifier(est):
            # flat, as the regressors' losses: a column y (n, 1) against the flat
            # predictions would broadcast to an (n, n) table, whose sum one record moves
            # by up to 2n - 1, far above the sensitivity 1 the score's noise is scaled to
            loss = (np.asarray(pred).ravel() != np.asarray(y).ravel()).astype(float)
        else:
            loss = (np.asarray(pred, float).ravel() - np.asarray(y, float).ravel()) ** 2
        if public:
            mean = float(np.mean(loss))
        else:
            # the number of rows changes between add/remove neighbours: released noisy,
            # as is the sum of the clipped losses (each Laplace(2 / score_epsilon) of a
            # sensitivity-1 count, the plan's score mechanism)
            z = rng.laplace(scale=2.0 / self.score_epsilon, size=2)
            # every clipped loss in [0, lb], a NaN (a prediction that failed) as lb: a
            # NaN sum would release whether such a row exists, whatever the noise
            clipped = np.where(np.isnan(loss), lb, np.minimum(loss, lb))
            if clipped_counts is not None:
                clipped_counts.append((int(np.count_nonzero(~(loss <= lb))), loss.size))
            total = float(np.sum(clipped)) / lb + z[0]
            mean = lb * total / max(len(loss) + z[1], 1.0)
        return 1.0 - mean if is_classifier(est) else -mean

    _parameter_constraints = {
        "estimator": Unchecked("a privlearn estimator, checked by planned_mechanism"),
        "param_grid": Unchecked("a scikit-learn parameter grid, expanded by ParameterGrid"),
        "method": Options("random_stopping", "composition"),
        "expected_runs": Real(1, 1e6, allow_none=True,
                              hint="the mean number of candidates tried, at most a million "
                                   "fits (more than any search runs); None: the grid size"),
        "eta": Real(0, None, hint="the truncated negative binomial's shape, e.g. 1.0"),
        "score_epsilon": Real(0, None, low_open=True, hint="e.g. 0.1"),
        "loss_bound": Real(0, None, low_open=True, allow_none=True,
                           hint="per-record losses are clipped to [0, loss_bound]"),
        "delta": Real(0, 1, low_open=True, high_open=True,
                      hint="a search needs delta > 0, e.g. 1e-6"),
        "accountant": ACCOUNTANT,
        "ledger": LEDGER,
        "random_state": RANDOM_STATE,
        "verbose": VERBOSE,
    }

    def _plan(self, params: dict[str, Any], X, y, *, X_val=None, y_val=None) -> SearchPlan:
        """The mechanism the whole search will run on data of this shape (before reading
        it): the composition of every run, or Papernot & Steinke's bound."""
        public = X_val is not None
        if public and y_val is None:
            raise ParameterValueError("give y_val with X_val")
        if y_val is not None and not public:
            raise ParameterValueError(
                "give X_val with y_val: without public validation features the search "
                "scores its runs privately on the training data and would ignore y_val")
        refuse_as_step(self.estimator, "PrivateSearchCV")
        if params["method"] == "composition" and params["expected_runs"] is not None:
            raise ConfigurationError(
                f"expected_runs={params['expected_runs']!r} applies to "
                "method='random_stopping' only (the mean number of candidates it tries); "
                "method='composition' fits every candidate once and composes all of them, "
                "so it would be ignored. Leave expected_runs out (None) with "
                "method='composition', or use method='random_stopping'")
        if not hasattr(self.estimator, "predict"):
            raise ParameterTypeError(
                f"PrivateSearchCV scores every run by its predictions, and "
                f"{type(self.estimator).__name__} has no predict; search a private "
                "regressor or classifier, or a PrivatePipeline ending in one (a label "
                "release, PATE or PrivateKNN, is not searched: it has no fit to account)")
        lb = 1.0 if public else self._loss_bound(params["loss_bound"])
        try:
            grid = tuple(ParameterGrid(self.param_grid))
        except (TypeError, ValueError) as e:
            typed = ParameterTypeError if isinstance(e, TypeError) else ParameterValueError
            raise typed(
                f"param_grid must be a dict (or a list of dicts) mapping each parameter to "
                f"a non-empty list of values, e.g. {{'epsilon': [0.5, 1.0]}}: {e}") from e
        if not grid:
            raise ParameterValueError("param_grid is empty")
        candidates = [self._candidate(p) for p in grid]
        if params["ledger"] is None:
            self._refuse_candidate_ledgers(candidates)
        if public:
            self._check_validation_data(X, X_val, y_val)
        for candidate in candidates:  # a grid may put one in a pipeline
            refuse_as_step(candidate, "PrivateSearchCV")
        # a public step fitted on public data (in the estimator, which the runs clone, or
        # in the grid) would be refitted on the private data in every run
        for pipe in (self.estimator, *candidates):
            if isinstance(pipe, PrivatePipeline):
                refuse_refitting_public_fits(pipe)
        unscorable = sorted({type(c).__name__ for c in candidates if not hasattr(c, "predict")})
        if unscorable:  # found before the runs read the data, not after the first fit
            raise ParameterTypeError(
                f"PrivateSearchCV scores each run by its predictions, and {unscorable} has "
                "no predict method; search over a regressor or classifier (a "
                "PrivatePipeline ending in one for a scaler's settings)")
        for c in (self, *candidates):  # the runs' refusals of the schema (dtypes too;
            if isinstance(c, PrivateEstimator):  # a pipeline's in its plan) come first
                refuse_bad_schema(c, X, y)
        fit_plans = tuple(c._plan(c._validate_params(), X, y)
                          if isinstance(c, PrivateEstimator) else None for c in candidates)
        fit_mechs = tuple(planned_mechanism(c, X, y) if fp is None else fp.mechanism
                          for c, fp in zip(candidates, fit_plans, strict=True))
        # the clipped losses' sum (sensitivity loss_bound) and the number of rows
        # (sensitivity 1), each with half of score_epsilon
        se = params["score_epsilon"]
        if not public and not math.isfinite(2.0 / se):  # a subnormal: Laplace(inf)
            raise ParameterValueError(
                f"score_epsilon must be a positive number whose Laplace scale 2 / "
                f"score_epsilon is finite (above about 1e-308), got {se!r}; pass a normal "
                "score budget, e.g. score_epsilon=0.1")
        score = None if public else compose(Laplace(2.0 / se), steps=2)
        runs = [m if score is None else compose([m, score]) for m in fit_mechs]
        common = dict(delta=params["delta"], grid=grid, fit_mechanisms=fit_mechs,
                      fit_plans=fit_plans, score=score, loss_bound=lb)
        if params["method"] == "composition":
            return SearchPlan(mechanism=compose(runs), accountant=params["accountant"],
                              **common)
        eta = params["eta"]
        ek = float(len(grid) if params["expected_runs"] is None else params["expected_runs"])
        gamma = _sampling_gamma(ek, eta) if ek > 1.0 else 1.0 - 1e-12  # K = 1 at E[K] = 1
        try:
            mech: Mechanism = _selection(runs, ek, eta)
            mech.rdp(2.0)  # a candidate without an RDP curve is refused here
        except UnsupportedMechanismError as e:
            raise UnsupportedMechanismError(
                "method='random_stopping' needs every run's RDP curve, stated under "
                "add/remove neighbouring (Papernot & Steinke 2022, Theorem 2), and a "
                f"candidate's run has none: {e}. Use method='composition', which composes "
                "the candidates' (epsilon, delta) guarantees") from e
        accountant = "rdp"
        budget = _budget_reading_no_rdp(self.ledger)
        if budget is not None:
            # the budget composes with an accountant that cannot read an RDP curve (the
            # default PLD): charge the curve's (epsilon, delta) guarantee at ``delta``, a
            # conservative conversion (one point of the curve's privacy profile), at 99%
            # of ``delta`` (and of the budget's) so that ``epsilon_`` at ``delta`` and the
            # budget's total can be certified
            d0 = 0.99 * min(params["delta"], budget.delta)
            mech, accountant = ApproxDP(float(mech.epsilon(d0, "rdp")), d0), "pld"
        return SearchPlan(mechanism=mech, accountant=accountant, eta=eta, gamma=gamma,
                          expected_runs=ek, **common)

    def _candidate(self, params: dict[str, Any]):
        """``clone(estimator).set_params(**params)``, a grid entry the estimator does not
        take refused as a :class:`~privlearn.errors.ParameterValueError`."""
        try:
            est = clone(self.estimator)
        except TypeError as e:
            raise ParameterTypeError(
                f"estimator must be an estimator instance, e.g. SSPRegressor(), got "
                f"{self.estimator!r}: {e}") from e
        try:
            # a copy of each value: ``{"step": [est], "step__param": [...]}`` would
            # otherwise set every candidate's value on the grid's one ``est`` (each plan
            # then reading the last value); a deep copy, not a clone, keeps a fitted
            # public step fitted for the checks that refuse refitting it
            return est.set_params(**{k: copy.deepcopy(v) for k, v in params.items()})
        except ValueError as e:
            if isinstance(e, ParameterValueError) and str(e).startswith("param_grid"):
                raise  # a nested search's, already naming its grid
            raise ParameterValueError(
                f"param_grid has an entry {params} that {type(self.estimator).__name__} "
                f"does not take: {e}") from e

    @staticmethod
    def _refuse_candidate_ledgers(candidates) -> None:
        """Without a ledger of its own the search charges none: a candidate (or a
        pipeline step) with a ledger would fit and release without the charge it
        asks for."""
        for cand in candidates:
            keys = [k for k in _nested_keys(cand, "ledger")
                    if cand.get_params(deep=True)[k] is not None]
            if keys:
                raise ConfigurationError(
                    f"the searched estimator has a ledger ({', '.join(keys)}), but "
                    "PrivateSearchCV(ledger=None) charges no budget: the search spends for "
                    "all its runs on its own ledger, never on the candidates'. Pass "
                    "PrivateSearchCV(..., ledger=<that budget>) (the search's whole cost is "
                    "then reserved on it before the data is read)")

    def _check_validation_data(self, X, X_val, y_val) -> None:
        """Refuse public validation data the runs could not be scored on (before the
        ledger is charged: a refusal after the fits would charge the whole search)."""
        X_val_given = X_val
        try:
            # on a copy: this search is not fitted yet (its own X is checked later)
            X_val, _ = validate_input(clone(self), X_val, y_val, **self._own_checks())
        except ValueError as e:  # the typed errors of validate_input, named for X_val
            raise type(e)(f"public validation data (X_val, y_val): {e}") from e
        width = data_shape(X)
        width_val = data_shape(X_val, "X_val")
        if len(width) == 2 and len(width_val) == 2 and width_val[1] != width[1]:
            raise ParameterValueError(
                f"X_val has {width_val[1]} features but X has {width[1]}: the public "
                "validation data must have the training data's columns")
        names, names_val = (getattr(getattr(a, "columns", None), "tolist", None)
                            for a in (X, X_val_given))
        if names is not None and names_val is not None and names() != names_val():
            raise ParameterValueError(
                f"X_val's columns {names_val()} differ from X's {names()} (names or "
                "order): the runs could not be scored on it; pass X_val[X.columns]")
        _refuse_private_validation(X, X_val_given, values=False)

    def _release(self, X, y, plan: SearchPlan, *, X_val=None, y_val=None) -> dict[str, Any]:
        """Fit the runs (every candidate, or ``K`` random ones), score them, keep the
        best."""
        if X_val is not None:  # reads the values: after the reservation, charged in full
            _refuse_private_validation(X, X_val, values=True)
        return self._search(X, y, plan, X_val=X_val, y_val=y_val)

    _budget_advice = (
        "lower expected_runs (random stopping's cost grows with it), the candidates' "
        "epsilons or score_epsilon; for a small grid, method='composition' may cost less")
    _ledger_advice = (
        "Use method='composition' (every run composed with the budget's accountant), or a "
        "budget created with accountant='rdp' (privlearn budget init --accountant rdp)")

    def fit(self, X, y, *, X_val=None, y_val=None, **fit_params):
        """Run the search. ``X_val, y_val``: *public* validation data (no cost), never a
        held-out split of the private data: its rows would be scored without noise and
        choose the released run, unaccounted (``X_val`` that is ``X`` or a copy is
        refused); without public data leave them None (each run scored privately).
        ``sample_weight`` is refused."""
        if y is None and (get_tags(self.estimator).target_tags.required or is_regressor(
                self.estimator) or is_classifier(self.estimator)):
            raise ParameterValueError(  # before the reservation: it records nothing
                f"PrivateSearchCV: {type(self.estimator).__name__} needs y, got y=None; "
                "pass the labels: fit(X, y) (planned_mechanism(X) gives the search's "
                "cost without them)")
        return self._fit(X, y, fit_params=fit_params, X_val=X_val, y_val=y_val)

    def planned_mechanism(self, X, y=None, *, X_val=None, y_val=None) -> Mechanism:
        """The mechanism :meth:`fit` will run, from the parameters and the shape of ``X``
        only (no value of ``X`` is read, and ``y`` is not needed: the candidates' plans
        do not depend on the labels). ``X_val, y_val``: the public validation data
        ``fit`` will get, if any (its scoring then costs nothing). Spend or check it on a
        ledger before loading the labels."""
        return self._plan(self._validate_params(), X, y, X_val=X_val, y_val=y_val).mechanism

    def _own_checks(self) -> dict[str, Any]:
        """How the search validates the data it hands to its runs: as a private
        estimator does (finite numbers), except for a pipeline, whose public steps may
        take what its private steps refuse (a NaN imputed with a public constant, text
        encoded over public categories, dates turned into numbers): then its schema
        only (the number of columns, their names), and each run's steps check the
        rest."""
        if isinstance(self.estimator, PrivatePipeline) and not _private_first(self.estimator):
            return {"skip_check_array": True}
        return {"dtype": None}

    def _check_data(self, X, y, plan: SearchPlan):
        """Check ``X`` and ``y`` with the search's and every candidate's own data checks
        before the release (a refusal here still charges the search's reservation in
        full, as any refusal of the data after the reservation does: it may depend on
        the values; the mistakes of shape and type are refused before the reservation);
        the candidates get the data as given."""
        validate_input(self, X, y, **self._own_checks())
        with quiet_data_checks():  # each run warns its caller when it is fitted
            for params, fit_plan in zip(plan.grid, plan.fit_plans, strict=False):
                candidate = self._candidate(params)
                if fit_plan is not None:
                    candidate._check_data(X, y, fit_plan)
                elif isinstance(candidate, PrivatePipeline):
                    # what the pipeline's fit refuses before its first step (each private
                    # step's own data checks, a non-finite y): refused here, not in a run
                    candidate._check_fit(X, y, {}, budgets=False)  # not charged
                    candidate._check_values(X, y)
        return X, y

    def _search(self, X, y, plan: SearchPlan, *, X_val=None, y_val=None) -> dict[str, Any]:
        """:meth:`_release` once ``X_val`` is checked."""
        # the search's own generator, seeded by a fixed number of draws from the declared
        # one: a Generator passed as ``random_state`` stays on the search (get_params, the
        # pickle), and how far it advanced (or how many child streams it spawned) would
        # otherwise reveal the number of runs K, which random stopping's guarantee needs
        # hidden
        rng = np.random.default_rng(
            make_rng(self.random_state).bit_generator.random_raw(4).tolist())
        public = plan.score is None
        if plan.eta is None:
            order = list(range(len(plan.grid)))
        else:
            k = _sample_runs(plan.eta, plan.gamma, rng)
            order = [int(i) for i in rng.integers(0, len(plan.grid), size=k)]
        Xs, ys = (X_val, y_val) if public else (X, y)
        best, scores, runs, ran, clipped = None, [], [], [], []
        # counts and elapsed time only: never a score (a release of the data), and with
        # random stopping the total K is shown only to whoever runs fit (see ``verbose``)
        for i in _progress(order, type(self).__name__, bool(self.verbose)):
            # a copy of the candidate's values too: estimator objects in the grid stay
            # on the search (param_grid), and must not carry the runs' fitted models
            est = clone(self.estimator).set_params(
                **{k: clone(v, safe=False) for k, v in plan.grid[i].items()})
            ledgers = _nested_keys(est, "ledger")  # the search spends for all its runs, once
            est.set_params(**dict.fromkeys(ledgers))
            _fit_with_hidden_noise(est, X, y, rng)
            if getattr(est, "mechanism_", None) != plan.fit_mechanisms[i]:
                raise PlanMismatchError(
                    f"candidate {plan.grid[i]} ran {getattr(est, 'mechanism_', None)!r}, not "
                    f"its planned mechanism {plan.fit_mechanisms[i]!r}; the search's "
                    "accounting would not cover it. The estimator's fit must run the "
                    "mechanism its settings declare (check its planned mechanism against "
                    "what fit does)")
            ran.append(est.mechanism_)
            score = self._score(est, Xs, ys, public, plan.loss_bound, rng, clipped)
            scores.append(score)
            runs.append(plan.grid[i])
            if best is None or score > best[1]:
                best = (est, score, plan.grid[i])
        best_estimator, best_score, best_params = best
        if any(count for count, _ in clipped):  # to the person fitting only, not stored
            count, n = max(clipped)
            warn_person_fitting(
                f"{type(self).__name__}: the private score clipped per-record losses above "
                f"loss_bound={plan.loss_bound:g} (up to {count} of {n} records in one "
                "run); scores then understate those runs' losses. Raise loss_bound "
                "(using public knowledge only) if this is more than expected.",
                DataClippedWarning, stacklevel=5)
        if self.ledger is not None:  # a refit of the released model spends too
            best_estimator.set_params(**dict.fromkeys(_nested_keys(best_estimator, "ledger"),
                                                      self.ledger))
        # reported in the score's range (post-processing; the selection used the raw
        # noisy values, so that noise pushing two runs past the range does not tie them)
        hi = 1.0 if is_classifier(self.estimator) else 0.0
        lo = 0.0 if is_classifier(self.estimator) else -math.inf
        fitted = {"best_estimator_": best_estimator,
                  "best_score_": float(np.clip(best_score, lo, hi)),
                  "best_params_": best_params}
        if plan.eta is None:
            fitted.update(runs_=runs, scores_=[float(np.clip(v, lo, hi)) for v in scores],
                          n_fits_=len(runs), fit_mechanisms_=ran)
        return fitted

    def __sklearn_tags__(self):
        """The searched estimator's type and prediction tags, as scikit-learn's
        ``GridSearchCV`` (``is_classifier(PrivateSearchCV(DPSGDClassifier(), ...))``)."""
        tags = super().__sklearn_tags__()
        try:
            sub = get_tags(self.estimator)
        except Exception:  # noqa: BLE001 - not an estimator: refused by fit, not here
            return tags
        tags.estimator_type = sub.estimator_type
        tags.classifier_tags = copy.deepcopy(sub.classifier_tags)
        tags.regressor_tags = copy.deepcopy(sub.regressor_tags)
        tags.input_tags.sparse = sub.input_tags.sparse
        return tags

    # -- the released model (post-processing: no privacy cost) --------------------------
    @available_if(_best_has("predict"))
    def predict(self, X):
        """``best_estimator_.predict(X)``."""
        check_is_fitted(self)
        return self.best_estimator_.predict(X)

    @available_if(_best_has("predict_proba"))
    def predict_proba(self, X):
        """``best_estimator_.predict_proba(X)``."""
        check_is_fitted(self)
        return self.best_estimator_.predict_proba(X)

    @available_if(_best_has("predict_log_proba"))
    def predict_log_proba(self, X):
        """``best_estimator_.predict_log_proba(X)``."""
        check_is_fitted(self)
        return self.best_estimator_.predict_log_proba(X)

    @available_if(_best_has("decision_function"))
    def decision_function(self, X):
        """``best_estimator_.decision_function(X)``."""
        check_is_fitted(self)
        return self.best_estimator_.decision_function(X)

    @available_if(_best_has("transform"))
    def transform(self, X):
        """``best_estimator_.transform(X)``."""
        check_is_fitted(self)
        return self.best_estimator_.transform(X)

    @available_if(_best_has("predict"))
    def score(self, X, y) -> float:
        """The released model's score on ``(X, y)``, on the scale of ``best_score_``:
        accuracy for a classifier, minus the mean squared error for a regressor (as
        ``GridSearchCV(scoring="accuracy")`` / ``scoring="neg_mean_squared_error"``;
        higher is better). Evaluate it on held-out data."""
        check_is_fitted(self)
        pred = self.best_estimator_.predict(X)
        if is_classifier(self.best_estimator_):
            return float(np.mean(np.asarray(pred).ravel() == np.asarray(y).ravel()))
        return -float(np.mean((np.asarray(pred, float).ravel()
                               - np.asarray(y, float).ravel()) ** 2))

    @property
    def classes_(self):
        """``best_estimator_.classes_``."""
        check_is_fitted(self)
        return self.best_estimator_.classes_


def _private_first(pipe: PrivatePipeline) -> bool:
    """Whether the first step that ``pipe`` fits (past ``"passthrough"``, into nested
    pipelines) is a private estimator: it then checks the data as given."""
    for _name, step in pipe.steps:
        if step is None or (isinstance(step, str) and step == "passthrough"):
            continue
        if isinstance(step, PrivatePipeline):
            return _private_first(step)
        return isinstance(step, PrivateEstimator)
    return False


def _refuse_private_validation(X, X_val, *, values: bool) -> None:
    """Refuse ``X_val`` that is ``X``: a view of its memory (``values=False``, before the
    reservation: the arrays' identity, not their values) or equal values (``values=True``,
    after it: whether one record differs is the data's)."""
    X_arr, X_val_arr = (None if hasattr(a, "tocsr") else np.asarray(a) for a in (X, X_val))
    if X_arr is not None and X_val_arr is not None and (
            np.shares_memory(X_arr, X_val_arr) if not values else (
                X_arr.shape == X_val_arr.shape and np.array_equal(X_arr, X_val_arr))):
        raise ParameterValueError(
            "X_val is the private training data X (or a view of it): its scores are "
            "exact statistics of the private data, and best_params_ / best_score_ "
            "chosen on them are not covered by the search's epsilon_. Pass public "
            "validation data (held out by a public rule and never used privately), "
            "or leave X_val=None to score each run privately on X")
