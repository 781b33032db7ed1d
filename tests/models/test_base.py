"""The public estimator base: the pipeline validate -> plan -> reserve -> check data ->
release -> settle -> record that every estimator runs through."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import privlearn.models as M
from privlearn.accounting import Gaussian, compose
from privlearn.errors import PrivacyLeakWarning
from privlearn.ledger import Ledger
from privlearn.models import NoisyGDRegressor, PrivateEstimator, ReleasePlan, SSPRegressor


def _data(n=300, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-0.5, 0.5, size=(n, 3))
    return X, X @ [1.0, 2.0, 3.0] + 0.1 * rng.normal(size=n)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_estimator_uses_the_base():
    """Every public class that fits or releases is a PrivateEstimator (except the Pipeline,
    whose steps are, and the frozen LabelRelease record), and none re-implements the
    pipeline: reserve / cancel / settle / record live in the base only."""
    from estimators import ESTIMATORS

    for cls in ESTIMATORS:
        if cls.__name__ != "PrivatePipeline":
            assert issubclass(cls, PrivateEstimator), cls.__name__
    for sub in _subclasses(PrivateEstimator):
        if sub.__module__.startswith("privlearn."):
            assert not {"_fit", "_run", "_record", "_reserve", "_refit"} & set(vars(sub)), sub


def test_refit_drops_the_previous_fits_attributes():
    """An attribute of an earlier fit on other data is not covered by the new
    ``mechanism_``: a refit that does not produce it removes it."""
    X, y = _data()
    m = NoisyGDRegressor(y_bound=3.0, noise_multiplier=None, n_iter=20, log_every=5)
    m.fit(X, y)
    assert hasattr(m, "coef_path_")
    m.set_params(log_every=None).fit(X[:100], y[:100])
    for name in ("coef_path_", "intercept_path_", "epsilon_path_", "path_iterations_"):
        assert not hasattr(m, name), name


def test_failed_fit_leaves_the_previous_fit_in_place():
    X, y = _data()
    m = SSPRegressor(y_bound=3.0).fit(X, y)
    before = {k: v for k, v in vars(m).items() if k.endswith("_")}
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        m.fit(X, y[:10])
    after = {k: v for k, v in vars(m).items() if k.endswith("_")}
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)


def test_a_release_that_raises_is_counted_in_full(tmp_path):
    """An error after the data was read (here NoisyGD diverging) may depend on the data:
    the reservation is settled with the whole plan, not cancelled or left pending."""
    X, y = _data()
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=5.0, delta=1e-5)
    m = NoisyGDRegressor(y_bound=3.0, noise_multiplier=None, n_iter=50, learning_rate=1e6,
                         ledger=led.budget("d"))
    plan = m.planned_mechanism(X, y)
    with pytest.raises(FloatingPointError, match="diverged"):
        m.fit(X, y)
    assert led.pending("d") == []
    kinds = [e.kind for e in led.history("d")]
    assert kinds == ["budget", "reserve", "settle"]
    assert led.history("d")[-1].mechanism == plan
    assert led.spent("d").epsilon_spent == pytest.approx(plan.epsilon(1e-5), rel=1e-12)
    assert not hasattr(m, "mechanism_")


def _spends(led):
    """What the ledger's readers see of the spends: every entry but the budget's."""
    return [(e.kind, e.mechanism, e.label) for e in led.history("d") if e.kind != "budget"]


@pytest.mark.parametrize("bad", ["y length", "1-D X", "no rows", "sparse X", "y strings"])
def test_a_mistake_of_shape_or_type_is_refused_before_the_reservation(bad, tmp_path):
    """The shape and the type of the data are public, the same for every data set of
    that schema: such a mistake is refused before anything is reserved, and the ledger
    records nothing (it used to reserve, then settle as "nothing ran")."""
    from scipy import sparse

    X, y = _data()
    X, y = {"y length": (X, y[:10]), "1-D X": (X[:, 0], y), "no rows": (X[:0], y[:0]),
            "sparse X": (sparse.csr_matrix(X), y), "y strings": (X, y.astype(str))}[bad]
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=5.0, delta=1e-5)
    with pytest.raises(ValueError, match="before anything was reserved"):
        SSPRegressor(y_bound=3.0, ledger=led.budget("d")).fit(X, y)
    assert _spends(led) == []


def _refused_values(case):
    """``(estimator factory, X, y, X', y')``: a clean data set and its neighbour that the
    data checks refuse for one record's value."""
    X, y = _data()
    if case == "nan in X":
        bad_X = X.copy()
        bad_X[7, 1] = np.nan
        return lambda: SSPRegressor(y_bound=3.0, random_state=0), X, y, bad_X, y
    if case == "label outside classes":
        labels = (y > 0).astype(int)
        bad = labels.copy()
        bad[7] = 2
        return (lambda: M.DPSGDClassifier(n_iter=5, classes=[0, 1], random_state=0), X,
                labels, X, bad)
    bad_y = y.copy()  # clipping configured to raise: a label outside y_bound
    bad_y[7] = 100.0
    bound = float(np.abs(y).max())
    return lambda: SSPRegressor(y_bound=bound, random_state=0), X, y, X, bad_y


@pytest.mark.parametrize("case", ["nan in X", "label outside classes", "clipping raises"])
def test_a_refusal_of_the_data_values_is_charged_as_the_release_would_be(case, tmp_path):
    """Whether a fit is refused after its reservation can depend on one record (a NaN, a
    label outside ``classes``, a clipped label with clipping warnings turned into
    errors). The reservation used to be settled as "nothing ran" then, so a reader of
    the ledger learned that the data held such a record. The ledger now records the
    same for the refused neighbour as for the clean data set: the plan, charged in
    full; the curator is told so in the error."""
    from privlearn.errors import DataClippedWarning

    make, X, y, bad_X, bad_y = _refused_values(case)
    spends = {}
    for which, (A, b) in {"clean": (X, y), "refused": (bad_X, bad_y)}.items():
        led = Ledger(tmp_path / f"{which}.db", create=True)
        led.create_budget("d", epsilon=50.0, delta=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DataClippedWarning)
            est = make().set_params(ledger=led.budget("d"))
            if which == "clean":
                est.fit(A, b)
            else:
                with pytest.raises((ValueError, DataClippedWarning)) as e:
                    est.fit(A, b)
                assert any("charged in full" in n for n in getattr(e.value, "__notes__", []))
                assert not hasattr(est, "mechanism_")
        assert led.pending("d") == []
        spends[which] = _spends(led)
    assert spends["refused"] == spends["clean"]
    assert [k for k, *_ in spends["clean"]] == ["reserve", "settle"]


def test_delta_at_least_one_over_n_warns():
    """delta >= 1/n allows publishing a whole record (Dwork & Roth 2014, Sec. 2.3)."""
    X, y = _data(n=50)
    with pytest.warns(PrivacyLeakWarning, match=r"1/n = 1/50"):
        SSPRegressor(delta=0.05, y_bound=3.0).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        SSPRegressor(delta=1e-4, y_bound=3.0).fit(X, y)


def test_planned_mechanism_is_what_fit_runs_and_reads_no_values():
    class Shape:
        shape = (300, 3)

        def __array__(self, *args, **kwargs):
            raise AssertionError("the data was read")

    X, y = _data()
    for est in (SSPRegressor(y_bound=3.0),
                NoisyGDRegressor(y_bound=3.0, noise_multiplier=None, n_iter=10),
                M.DPSGDRegressor(n_iter=10),
                M.PrivateStandardScaler(feature_range=(-1, 1))):
        planned = est.planned_mechanism(Shape())
        assert planned == est.fit(X, y).mechanism_


class _NoisyMean(PrivateEstimator):
    """A minimal estimator on the base (its tests: exact epsilon, attributes set once)."""

    def __init__(self, epsilon=1.0, delta=1e-6, fail=False):
        self.epsilon, self.delta, self.fail = epsilon, delta, fail

    def _plan(self, params, X, y):
        return ReleasePlan(mechanism=Gaussian(4.0), delta=1e-6, accountant="pld")

    def _release(self, X, y, plan):
        if self.fail:
            raise RuntimeError("boom")
        return {"mean_": X.mean(axis=0) + np.random.default_rng().normal(size=X.shape[1])}

    def fit(self, X, y=None):
        return self._fit(X, y)


def test_record_sets_mechanism_epsilon_and_delta():
    X, _ = _data()
    m = _NoisyMean().fit(X)
    assert m.mechanism_ == Gaussian(4.0)
    assert m.epsilon_ == Gaussian(4.0).epsilon(1e-6, "pld") and m.delta_ == 1e-6
    with pytest.raises(RuntimeError):
        _NoisyMean(fail=True).fit(X)
    failed = _NoisyMean(fail=True)
    with pytest.raises(RuntimeError):
        failed.fit(X)
    assert [k for k in vars(failed) if k.endswith("_")] == []
    assert compose([m.mechanism_]).epsilon(1e-6) == m.epsilon_


@pytest.mark.parametrize("make", [
    lambda led: M.DPSGDRegressor(n_iter=5, trajectory_accountant="rpd", ledger=led),
    lambda led: M.PrivateSearchCV(SSPRegressor(y_bound=3.0), {"epsilon": [0.5, 1.0]},
                                  method="composition", loss_bound=9.0, accountant="rpd",
                                  ledger=led),
], ids=["DPSGD-trajectory_accountant", "search-composition-accountant"])
def test_an_accountant_that_cannot_certify_refuses_before_the_ledger_is_charged(make,
                                                                                tmp_path):
    """The accountant that reports epsilon_ (or the trajectory) is used once the release
    ran: an unknown name was refused only then, with the ledger charged in full and
    nothing released. It is now refused while nothing has been spent."""
    X, y = _data()
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    m = make(led.budget("d"))
    with pytest.raises(ValueError, match="accountant must be one of"):
        m.fit(X, y)
    assert led.spent("d").epsilon_spent == 0.0 and led.pending("d") == []
    assert not hasattr(m, "mechanism_")


@pytest.mark.parametrize("kw", [dict(sampling_rate=0.5), dict(noise="laplace")],
                         ids=["subsampled", "laplace"])
def test_a_trajectory_accountant_that_cannot_evaluate_the_run_refuses_before_the_ledger(
        kw, tmp_path):
    """A known accountant that cannot evaluate the run (the analytic Gaussian accountant
    on subsampling or on Laplace noise) was found only when the trajectory was computed,
    after training: the fit failed with its budget charged and no model. It is refused
    now while nothing has been spent, naming the parameter and what to pass instead."""
    from privlearn.errors import UnsupportedMechanismError

    X, y = _data()
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    m = M.DPSGDRegressor(n_iter=5, trajectory_accountant="analytic", ledger=led.budget("d"),
                         **kw)
    with pytest.raises(UnsupportedMechanismError,
                       match="trajectory_accountant='analytic' cannot evaluate.*'rdp'"):
        m.fit(X, y)
    assert led.spent("d").epsilon_spent == 0.0 and led.pending("d") == []
    assert not hasattr(m, "mechanism_")
    fitted = M.DPSGDRegressor(n_iter=5, trajectory_accountant="rdp", **kw).fit(X, y)
    assert fitted.epsilon_trajectory_[-1] == fitted.mechanism_.epsilon(fitted.delta_, "rdp")


def test_a_delta_warning_raised_as_an_error_cancels_the_reservation(tmp_path):
    """With warnings turned into errors (``-W error``, a strict CI), the large-delta
    warning raised after the data checks but outside the reservation's clean-up: the fit
    failed with nothing released and a reservation left pending on the ledger for ever.
    It depends on delta and the number of rows only (public), so it is now given before
    the reservation, and raised it records nothing; the warning still points at the
    caller's line."""
    X, y = _data(n=20)
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=0.5)
    m = SSPRegressor(delta=0.1, y_bound=3.0, ledger=led.budget("d"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        with pytest.raises(PrivacyLeakWarning, match="delta=0.1 is at least 1/n"):
            m.fit(X, y)
    assert led.pending("d") == [] and led.spent("d").epsilon_spent == 0.0
    assert not hasattr(m, "mechanism_")
    with pytest.warns(PrivacyLeakWarning, match="delta=0.1") as record:
        m.fit(X, y)
    assert record[0].filename == __file__ and led.spent("d").entries == 1
