"""Auditing a user's own model and training in one call (audit_training): the canaries
reach the user's loop, the claim is the accountant's, a leaky run is caught and an honest
one is not."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from privlearn.auditing.torch import audit_training  # noqa: E402


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data[:600] / 16.0).astype(np.float32), d.target[:600]


def _model():
    return nn.Linear(64, 10)


PIECES = dict(make_model=_model, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5),
              batch_size=60, epochs=2)


def test_honest_run_with_gradient_canaries_keeps_its_claim(digits):
    r = audit_training(digits, **PIECES, private={"target_epsilon": 2.0, "max_grad_norm": 1.0},
                       canaries="gradient", n_canaries=300, delta=1e-5, seed=0)
    assert r.claimed_epsilon == pytest.approx(2.0, rel=1e-3)  # the accountant's epsilon
    assert not r.violation and r.epsilon_lower_bound < 2.0
    assert r.n_canaries == 300


def test_too_little_noise_for_the_claim_is_caught_by_gradient_canaries(digits):
    r = audit_training(digits, **PIECES, private={"noise_multiplier": 0.05},
                       canaries="gradient", n_canaries=300, delta=1e-5,
                       claimed_epsilon=1.0, seed=0)
    assert r.violation and r.epsilon_lower_bound > 1.0 and r.auc > 0.9


def test_the_users_loop_gets_the_included_canaries_and_its_claim_is_read(digits):
    X, y = digits
    seen = {}

    def train(dataset):
        seen["n"] = len(dataset)
        model = _model()
        p = __import__("privlearn.torch", fromlist=["make_private"]).make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(dataset, 60),
            target_epsilon=1.0, target_delta=1e-5, epochs=1)
        ce = nn.CrossEntropyLoss()
        for xb, yb in p.data_loader:
            p.optimizer.zero_grad()
            ce(p.model(xb), yb).backward()
            p.optimizer.step()
        seen["p"] = p
        return p

    captured = {}

    def score(model, inputs, targets):
        captured.update(inputs=inputs.numpy(), targets=targets.numpy())
        return -nn.functional.cross_entropy(model(inputs), targets, reduction="none").detach()

    r = audit_training(digits, train, n_canaries=100, delta=1e-5, score=score, seed=3)
    assert seen["n"] == len(y) + int(r.inclusion.sum())
    assert r.claimed_epsilon == seen["p"].epsilon(1e-5)
    # the default canaries: copies of records' inputs with another label
    for xi, ti in zip(captured["inputs"], captured["targets"], strict=True):
        rows = np.flatnonzero((X == xi).all(axis=1))
        assert rows.size and np.all(y[rows] != ti)


def test_a_non_private_loop_claimed_private_is_caught_by_data_canaries(digits):
    def train(dataset):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ce = nn.CrossEntropyLoss()
        for _ in range(40):
            for xb, yb in DataLoader(dataset, batch_size=128, shuffle=True):
                opt.zero_grad()
                ce(model(xb), yb).backward()
                opt.step()
        return model

    r = audit_training(digits, train, n_canaries=150, delta=1e-5, claimed_epsilon=0.5,
                       seed=0)
    assert r.violation and r.epsilon_lower_bound > 0.5


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(), ValueError, "train"),
    (dict(train=lambda d: None, make_model=_model), ValueError, "not both"),
    (dict(train=lambda d: None, canaries="gradient"), ValueError, "make_model"),
    (dict(train=lambda d: None, canaries="input"), ValueError, "canaries"),
    (dict(make_model=_model, batch_size=None), ValueError, "batch_size"),
    (dict(make_model=_model, batch_size=10, private={"loss_reduction": "mean"}), ValueError,
     "loss_reduction"),
    (dict(train=lambda d: None, n_canaries=1), ValueError, "n_canaries"),
])
def test_bad_input_is_refused_before_training(digits, kwargs, err, match):
    with pytest.raises(err, match=match):
        audit_training(digits, **kwargs)


def test_a_model_without_a_claim_is_refused(digits):
    with pytest.raises(ValueError, match="claimed_epsilon"):
        audit_training(digits, lambda d: _model(), n_canaries=20, seed=0)


@pytest.mark.filterwarnings("ignore:no outcome of this audit")
@pytest.mark.parametrize("canaries", ["data", "gradient"])
def test_a_user_level_run_gives_each_canary_a_user_of_its_own(digits, canaries):
    """``private["users"]`` names the user of each of the caller's records; the audit
    appends the included canaries, each a user of its own, so the run is accounted over
    ``users + included`` units: the claim is DP-SGD's epsilon at ``q = B / units``."""
    from privlearn.accounting import Gaussian, compose, planned_steps, subsample

    X, y = digits
    users = np.repeat(np.arange(300), 2)                 # 300 users of 2 records each
    r = audit_training(digits, **PIECES, canaries=canaries, n_canaries=40, delta=1e-5, seed=0,
                       private={"noise_multiplier": 1.5, "users": users,
                                "max_examples_per_user": 2})
    units = 300 + len(r.in_scores)
    q = 60 / units
    steps = planned_steps(q, epochs=2)
    expected = compose(subsample(Gaussian(noise_multiplier=1.5), rate=q), steps=steps)
    assert r.claimed_epsilon == pytest.approx(expected.epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("users,match", [
    (np.arange(599), "each of your 600 records"),
    (np.r_[np.arange(599), np.nan], "missing id"),
])
def test_users_that_do_not_name_each_record_are_refused(digits, users, match):
    with pytest.raises(ValueError, match=match):
        audit_training(digits, **PIECES, n_canaries=20, seed=0, private={"users": users})
