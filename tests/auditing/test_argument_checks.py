"""Bad arguments of the audit entry points are refused before anything is calibrated,
fitted or trained, with a typed error naming the parameter the caller passed."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.errors import ParameterTypeError, ParameterValueError


@pytest.mark.parametrize(("kwargs", "err", "match"), [
    ({"delta": 0.0}, ParameterValueError, r"^delta must be in \(0, 1\)"),
    ({"epsilon": float("nan")}, ParameterValueError, "^epsilon must be"),
    ({"max_grad_norm": -1.0}, ParameterValueError, r"^max_grad_norm must be .*got -1\.0"),
    ({"learning_rate": float("nan")}, ParameterValueError, "^learning_rate must be"),
    ({"learning_rate": -0.5}, ParameterValueError, "^learning_rate must be"),
    ({"canary_gradient_norm": 0.0}, ParameterValueError, "^canary_gradient_norm must be"),
    ({"n_features": 0}, ParameterValueError, "^n_features must be"),
    # torch's generators take seeds below 2**64: a larger one was a bare ValueError
    # ("Overflow when unpacking long long") from inside the training
    ({"seed": 2**64}, ParameterValueError, r"^seed must be .*2\*\*64"),
    # past NumPy's integers a count was a TypeError from inside numpy (log10 of an int)
    ({"n_canaries": 10**22}, ParameterValueError, r"^n_canaries must be .*\[2, 1_000_000_000\]"),
])
def test_audit_dpsgd_refuses_bad_numbers_before_training(kwargs, err, match, monkeypatch):
    pytest.importorskip("torch")
    import privlearn.auditing.torch as at
    import privlearn.torch

    def no_training(*a, **k):
        raise AssertionError("trained with a bad argument")

    monkeypatch.setattr(privlearn.torch, "make_private", no_training)
    monkeypatch.setattr(at, "_calibrated_sigma", no_training)
    with pytest.raises(err, match=match):
        at.audit_dpsgd(**{"epsilon": 2.0, "delta": 1e-5, "n_canaries": 100, "steps": 2,
                          **kwargs})


@pytest.mark.parametrize(("kwargs", "err", "match"), [
    ({"delta": "abc"}, ParameterTypeError, "^delta must be a real number"),
    ({"canary_norm": -1.0}, ParameterValueError, r"^canary_norm must be .*got -1\.0"),
    ({"canary_norm": 0.0}, ParameterValueError, "^canary_norm must be"),
    ({"canary_norm": float("nan")}, ParameterValueError, "^canary_norm must be"),
])
def test_audit_estimator_refuses_bad_numbers_before_fitting(kwargs, err, match, monkeypatch):
    pytest.importorskip("sklearn")
    from privlearn.auditing.models import audit_estimator
    from privlearn.models import SSPRegressor

    def no_fit(self, *a, **k):
        raise AssertionError("fitted with a bad argument")

    monkeypatch.setattr(SSPRegressor, "fit", no_fit)
    X, y = np.zeros((10, 2)), np.zeros(10)
    with pytest.raises(err, match=match):
        audit_estimator(SSPRegressor(epsilon=1.0, delta=1e-5), X, y, 50, seed=0, **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"canaries": "gradient", "canary_gradient_norm": -1.0}, r"^canary_gradient_norm must"),
    ({"canaries": "gradient", "private": {"noise_multiplier": 1.0, "max_grad_norm": -1.0}},
     r"^private\['max_grad_norm'\] must .*got -1\.0"),
    ({"delta": 0.0}, r"^delta must be in \(0, 1\)"),
    ({"seed": 2**70}, r"^seed must be .*2\*\*64"),
])
def test_audit_training_refuses_bad_numbers_before_building_the_model(kwargs, match):
    pytest.importorskip("torch")
    from privlearn.auditing.torch import audit_training

    def make_model():
        raise AssertionError("built the model with a bad argument")

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, 3)).astype(np.float32), rng.integers(0, 2, 40)
    args = {"make_model": make_model, "batch_size": 10, "n_canaries": 50, "seed": 0,
            "private": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}, **kwargs}
    with pytest.raises(ParameterValueError, match=match):
        audit_training((X, y), **args)


@pytest.mark.parametrize("fpr", [[-0.1], [float("nan")], 1.5, [0.2, 2.0]])
def test_accountant_roc_names_fpr(fpr):
    from privlearn.accounting import Gaussian
    from privlearn.auditing import accountant_roc

    with pytest.raises(ParameterValueError, match="^fpr must be"):
        accountant_roc(Gaussian(1.0), fpr)
    with pytest.raises(ParameterTypeError, match="^fpr must be"):
        accountant_roc(Gaussian(1.0), "x")


def test_accountant_roc_says_where_the_mechanism_of_a_run_is():
    """Handed the object of a run instead of its mechanism (the natural first try when
    plotting an audit), accountant_roc says which attribute holds the mechanism, and the
    curve it then draws is that of the mechanism."""
    from privlearn.accounting import Gaussian, compose, subsample
    from privlearn.accounting.fdp import tradeoff_curve
    from privlearn.auditing import accountant_roc
    from privlearn.models import SSPRegressor

    mech = compose(subsample(Gaussian(1.0), rate=0.1), steps=20)

    class Accountant:
        def mechanism(self):
            return mech

    class Run:  # what make_private returns, as far as the mechanism goes
        accountant = Accountant()

    with pytest.raises(ParameterTypeError, match=r"p\.accountant\.mechanism\(\) \(p: this Run\)"):
        accountant_roc(Run(), [0.1])
    fitted = SSPRegressor(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=1.0).fit(
        np.full((50, 2), 0.5), np.zeros(50))
    with pytest.raises(ParameterTypeError,
                       match=r"est\.mechanism_ \(est: this fitted SSPRegressor\)"):
        accountant_roc(fitted, [0.1])
    with pytest.raises(ParameterTypeError, match="describe what ran"):
        accountant_roc(3.0, [0.1])
    grid = np.linspace(0, 1, 11)
    np.testing.assert_array_equal(accountant_roc(Run.accountant.mechanism(), grid),
                                  1.0 - tradeoff_curve(mech, grid))
