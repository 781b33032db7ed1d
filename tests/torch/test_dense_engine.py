"""A DenseStrategy in make_private: the noise of step ``t`` is ``(C^{-1} z)_t`` for the
draws a DP-SGD run with the same seed adds (a wrong row of ``C^{-1}`` fails here), the
state is every draw and resumes bit for bit, and a run longer than the strategy is
refused before any step."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from test_correlated import _attach, _Frozenish, _noises  # noqa: E402
from torch import nn  # noqa: E402

from privlearn.correlated import DenseStrategy, FixedEpochs, optimize_dense  # noqa: E402
from privlearn.errors import ConfigurationError, ParameterValueError  # noqa: E402
from privlearn.torch.correlated_noise import CorrelatedNoise  # noqa: E402

STEPS = 20  # 2 epochs of 60 examples in batches of 6


def _signed_strategy(n: int = STEPS) -> DenseStrategy:
    rng = np.random.default_rng(0)
    c = np.tril(rng.normal(size=(n, n))) * 0.3
    c[np.diag_indices(n)] = 1.0 + rng.random(n)
    return DenseStrategy(c)


@pytest.mark.parametrize("strategy", [_signed_strategy(), optimize_dense(STEPS, FixedEpochs(2))])
def test_dense_noise_is_C_inverse_of_the_independent_draws(strategy):
    steps = 12
    z, _ = _noises(steps, sampling="shuffled_epochs", epochs=2)
    w, p = _noises(steps, sampling="shuffled_epochs", epochs=2, noise=strategy)
    assert p.plan.run.strategy is strategy
    c = strategy.materialize(steps)
    np.testing.assert_allclose(w, np.linalg.solve(c, z), rtol=1e-9, atol=1e-9)
    assert not np.allclose(w, z)


def test_dense_state_is_every_draw_and_resumes_bit_for_bit():
    strategy = _signed_strategy()
    w, p = _noises(7, sampling="shuffled_epochs", epochs=2, noise=strategy)
    state = copy.deepcopy(p.state_dict())
    assert state["correlated"]["buffers"].shape[0] == STEPS  # every draw of the run
    full, _ = _noises(10, sampling="shuffled_epochs", epochs=2, noise=strategy)
    np.testing.assert_array_equal(full[:7], w)
    rest, _ = _noises(3, state, sampling="shuffled_epochs", epochs=2, noise=strategy)
    np.testing.assert_array_equal(rest, full[7:])


def test_a_run_longer_than_the_strategy_is_refused():
    with pytest.raises(ConfigurationError, match="defined for 10 steps"):
        _attach(_Frozenish(), sampling="shuffled_epochs", epochs=2, noise=_signed_strategy(10))


def test_torch_dense_noise_stops_at_n_and_keeps_its_strategy():
    strategy = _signed_strategy(3)
    gen = CorrelatedNoise(strategy.recurrence())
    z = torch.randn(3, 5, dtype=torch.float64)
    out = torch.stack([gen.apply_(zt.clone()) for zt in z])
    expected = np.linalg.solve(strategy.materialize(), z.numpy())
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigurationError, match="defined for 3 steps"):
        gen.apply_(z[0].clone())
    other = CorrelatedNoise(DenseStrategy(strategy.materialize() * 2.0).recurrence())
    with pytest.raises(ParameterValueError, match="not this one"):
        other.load_state_dict(gen.state_dict())  # another C of the same size


def test_the_step_past_the_strategy_is_refused_before_it_is_taken():
    from privlearn.errors import PrivacyBudgetExceededError

    torch.manual_seed(0)
    model = _Frozenish()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a random C costs more than DP-SGD: said so
        p = _attach(model, sampling="shuffled_epochs", epochs=2, noise=_signed_strategy())
    taken = 0
    with pytest.raises(PrivacyBudgetExceededError):
        for _ in range(3):
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
                taken += 1
    assert taken == STEPS
    assert p.plan.run.max_steps == STEPS


def test_a_checkpoint_resumes_only_under_the_same_dense_strategy():
    _, p = _noises(7, sampling="shuffled_epochs", epochs=2, noise=_signed_strategy())
    state = copy.deepcopy(p.state_dict())
    other = DenseStrategy(_signed_strategy().materialize() * 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = _attach(_Frozenish(), sampling="shuffled_epochs", epochs=2, noise=other)
    with pytest.raises(ValueError, match="sha256"):
        q.load_state_dict(state)
    assert q.optimizer.correlated.steps == 0  # nothing loaded
