"""Random stopping is described as the accounting's ``RepeatAndSelect`` kind: its
parameters are the search's, its epsilon lies between the true Papernot & Steinke (2022)
Theorem 2 bound (dense grids, closed-form base curves) and Google dp_accounting's
``RepeatAndSelectDpEvent``, and the number of runs it draws is covered by what it
accounts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc
from scipy import optimize
from test_model_selection_privacy import NoisyMeanRegressor

from privlearn.accounting import (
    Gaussian,
    Laplace,
    RepeatAndSelect,
    compose,
    subsample,
)
from privlearn.accounting.repeat_select import _gamma_below
from privlearn.accounting.serialization import mechanism_from_dict, mechanism_to_dict
from privlearn.errors import UnsupportedMechanismError
from privlearn.models import ReleasePlan
from privlearn.models.model_selection import PrivateSearchCV


def _pmf_mean(eta: float, gamma: float) -> float:
    """E[K] of the truncated negative binomial by summing its probability mass function
    (Papernot & Steinke 2022, Definition 1; no closed form)."""
    k = np.arange(1, 400_000)
    if eta > 0:
        logp = k * math.log1p(-gamma) + np.cumsum(np.log((k - 1 + eta) / k))
    else:
        logp = k * math.log1p(-gamma) - np.log(k)
    p = np.exp(logp - logp.max())
    return float((k * p).sum() / p.sum())


def _laplace_rdp(a: np.ndarray, b: float) -> np.ndarray:
    """Laplace mechanism of scale ``b`` (sensitivity 1), Mironov (2017), Prop. 6."""
    return np.logaddexp(
        np.log(a / (2 * a - 1)) + (a - 1) / b, np.log((a - 1) / (2 * a - 1)) - a / b
    ) / (a - 1)


def _theorem_2_epsilon(base, eta: float, mean: float, delta: float) -> float:
    """The least epsilon Theorem 2 gives: its bound minimised over dense ``lambda_hat``
    and ``lambda`` with the exact ``gamma`` (root of the summed E[K]), converted with
    Canonne, Kamath & Steinke (2020), Prop. 12 over the same orders. Every valid use of
    the theorem (any grids, any conservative rounding) is at least this."""
    gamma = optimize.brentq(lambda g: _pmf_mean(eta, g) - mean, 1e-6, 1 - 1e-9, xtol=1e-15)
    lam_hat = 1.0 + np.geomspace(1e-6, 1e6, 40_000)
    c = np.min((1 + eta) * ((1 - 1 / lam_hat) * base(lam_hat) - math.log(gamma) / lam_hat))
    lam = 1.0 + np.geomspace(1e-3, 1e6, 40_000)
    curve = base(lam) + c + math.log(mean) / (lam - 1)
    return float(np.min(curve + np.log1p(-1 / lam) - (math.log(delta) + np.log(lam)) / (lam - 1)))


@pytest.mark.parametrize(
    "eta, mean, sigma, score_eps",
    [
        (1.0, 5.0, 2.0, 0.5),
        (0.0, 12.0, 1.0, 0.2),
        (0.5, 40.0, 4.0, 1.0),
        (3.0, 2.5, 3.0, 0.1),
    ],
)
def test_the_search_is_a_repeat_and_select_between_theorem_2_and_dp_accounting(
    eta, mean, sigma, score_eps
):
    X, y = np.zeros((200, 1)), np.random.default_rng(0).uniform(-1, 1, 200)
    search = PrivateSearchCV(
        NoisyMeanRegressor(),
        {"noise_multiplier": [sigma]},
        eta=eta,
        expected_runs=mean,
        score_epsilon=score_eps,
        loss_bound=4.0,
        delta=1e-6,
    )
    planned = search.planned_mechanism(X, y)
    run = compose([Gaussian(sigma), compose(Laplace(2.0 / score_eps), steps=2)])
    # one kind, with the search's parameters: mean = expected_runs, shape = eta
    assert planned == RepeatAndSelect(run, mean, eta)
    assert mechanism_from_dict(mechanism_to_dict(planned)) == planned
    ours = planned.epsilon(1e-6, "rdp")

    def base(a):
        return a / (2 * sigma**2) + 2 * _laplace_rdp(a, 2.0 / score_eps)

    assert ours >= _theorem_2_epsilon(base, eta, mean, 1e-6) * (1 - 1e-9)
    acc = rdp_acc.RdpAccountant()
    acc.compose(
        dp_event.RepeatAndSelectDpEvent(
            dp_event.ComposedDpEvent(
                [
                    dp_event.GaussianDpEvent(sigma),
                    dp_event.SelfComposedDpEvent(dp_event.LaplaceDpEvent(2.0 / score_eps), 2),
                ]
            ),
            mean,
            eta,
        )
    )
    assert ours <= acc.get_epsilon(1e-6) * 1.002
    fitted = search.set_params(random_state=0).fit(X, y)
    assert fitted.mechanism_ == planned and fitted.epsilon_ == ours


def test_a_grid_of_different_runs_is_bounded_by_its_worst_run():
    """Candidates that run different mechanisms: one run is a uniformly random one, whose
    RDP curve is at most the worst candidate's (joint quasi-convexity). The search
    accounts the worst curve tabulated (never below it, between its orders the next
    one's value): its epsilon lies between the selection of the worst run (exact curve)
    and 0.2% above it."""
    X, y = np.zeros((200, 1)), np.random.default_rng(0).uniform(-1, 1, 200)
    search = PrivateSearchCV(
        NoisyMeanRegressor(),
        {"noise_multiplier": [1.0, 3.0, 8.0]},
        eta=1.0,
        expected_runs=6.0,
        score_epsilon=0.3,
        loss_bound=4.0,
    )
    planned = search.planned_mechanism(X, y)
    assert isinstance(planned, RepeatAndSelect)
    assert (planned.mean, planned.shape) == (6.0, 1.0)
    worst = RepeatAndSelect(
        compose([Gaussian(1.0), compose(Laplace(2.0 / 0.3), steps=2)]), 6.0, 1.0
    ).epsilon(1e-6, "rdp")
    ours = planned.epsilon(1e-6, "rdp")
    assert worst * (1 - 1e-12) <= ours <= worst * 1.002
    back = mechanism_from_dict(mechanism_to_dict(planned))  # a ledger stores it
    assert back.epsilon(1e-6, "rdp") == ours


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("mean", [1.5, 7.0, 250.0])
def test_the_drawn_number_of_runs_is_covered_by_the_accounted_one(eta, mean):
    """The ``K`` the search draws has ``E[K] <= expected_runs`` (summed from its mass
    function) and a ``gamma`` no smaller than the one ``RepeatAndSelect`` accounts: both
    terms of Theorem 2 are then accounted at values no smaller than the drawn ones."""
    X, y = np.zeros((50, 1)), np.zeros(50)
    search = PrivateSearchCV(
        NoisyMeanRegressor(),
        {"noise_multiplier": [1.0]},
        eta=eta,
        expected_runs=mean,
        loss_bound=1.0,
    )
    plan = search._plan(search._validate_params(), X, y)
    assert plan.gamma >= _gamma_below(eta, mean)
    assert _pmf_mean(eta, plan.gamma) <= mean * (1 + 1e-9)
    assert _pmf_mean(eta, plan.gamma) == pytest.approx(mean, rel=1e-6)  # the same law


class FixedBatchRegressor(NoisyMeanRegressor):
    """Declares a fixed-size batch sampler: a guarantee stated under replace-one only."""

    def _plan(self, params, X, y):
        return ReleasePlan(
            mechanism=compose(
                subsample(Gaussian(params["noise_multiplier"]), 0.1, scheme="fixed"), steps=20
            ),
            delta=1e-6,
        )


def test_random_stopping_over_replace_one_runs_is_refused():
    """A replace-one guarantee says nothing about add/remove neighbours, and the
    selection is stated (and composed in a ledger) as an add/remove guarantee: random
    stopping over such runs is refused before any fit; composition states each run under
    its own relation."""
    X, y = np.zeros((100, 1)), np.zeros(100)
    with pytest.raises(UnsupportedMechanismError, match="add/remove.*method='composition'"):
        PrivateSearchCV(
            FixedBatchRegressor(), {"noise_multiplier": [1.0, 2.0]}, loss_bound=1.0
        ).fit(X, y)
    s = PrivateSearchCV(
        FixedBatchRegressor(),
        {"noise_multiplier": [1.0, 2.0]},
        method="composition",
        loss_bound=1.0,
        random_state=0,
    ).fit(X, y)
    assert math.isfinite(s.epsilon_)


def test_the_former_random_stopping_rdp_warns_and_is_the_repeat_and_select_curve():
    """The removed helper is kept, deprecated: it warns and gives the curve of
    ``RepeatAndSelect`` over the same run (here a Gaussian's closed-form curve), which is
    Theorem 2's bound; its rows are never below the run's own curve (K >= 1)."""
    import warnings

    from privlearn.accounting import Gaussian, RepeatAndSelect
    from privlearn.accounting.repeat_select import _expected_runs
    from privlearn.models.model_selection import random_stopping_rdp

    sigma, eta, gamma = 3.0, 1.0, 0.1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        curve = random_stopping_rdp(lambda a: a / (2 * sigma**2), eta, gamma)
    assert [w.category for w in caught] == [DeprecationWarning]
    orders = np.array([1.5, 2.0, 8.0, 32.0, 128.0])
    want = RepeatAndSelect(Gaussian(sigma), _expected_runs(eta, gamma), eta).rdp(orders)
    np.testing.assert_allclose(curve(orders), want, rtol=1e-9)
    assert np.all(curve(orders) >= orders / (2 * sigma**2))
