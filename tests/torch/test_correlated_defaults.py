"""Defaults and messages of correlated noise in make_private: the cycle a BLT gets under
cyclic Poisson sampling when none is given, the warning when DP-SGD noise of the same
error is accounted at a smaller epsilon, and the refusal at a correlated run's plan."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import privlearn.torch.schedule as schedule  # noqa: E402
from privlearn.correlated import BufferedToeplitz, MinSeparation  # noqa: E402
from privlearn.correlated.sampling import check_participation  # noqa: E402
from privlearn.errors import PrivacyBudgetExceededError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

_WARNED = "costs more privacy for no less noise"
#: a BLT given as an object (the BLT optimiser takes seconds on small runs)
_BLT = BufferedToeplitz(buf_decay=(0.9, 0.5), output_scale=(0.2, 0.1))


def _indexed(n, d=2):
    x = torch.zeros(n, d)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, torch.zeros(n, dtype=torch.long))


def _attach(n, batch_size, **kw):
    model = nn.Linear(2, 2)
    kw.setdefault("noise_multiplier", 1.0)
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(_indexed(n), batch_size=batch_size),
        max_grad_norm=1.0,
        seed=0,
        **kw,
    )


def _quiet_attach(n, batch_size, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _attach(n, batch_size, **kw)


def test_blt_under_cyclic_poisson_defaults_to_an_epoch_of_groups(monkeypatch):
    """No cycle_length: a BLT (as a strategy object, or by name) gets N // B groups, so an
    example takes part once per epoch, at least N // B steps apart (read off the batches
    drawn), as multi-epoch matrix factorization assumes (Choquette-Choo et al. 2023), and
    the BLT by name is optimised for that participation; with one group (the former
    default) every example could take part at every step, at a far larger epsilon."""
    n, b = 600, 40  # 15 batches of 40: the rate b c / n is exactly 1
    p = _quiet_attach(n, b, sampling="cyclic_poisson", noise=_BLT, epochs=2)
    assert p.plan.run.cycle == n // b
    assert p.plan.expected_batch_size == pytest.approx(b)
    batches = [x[:, 0].long().numpy() for _ in range(2) for x, _ in p.data_loader]
    assert len(batches) == 2 * (n // b)
    check_participation(batches, MinSeparation(n // b, 2), len(batches))
    one = _quiet_attach(n, b, sampling="cyclic_poisson", noise=_BLT, epochs=2, cycle_length=1)
    assert p.plan.planned_epsilon < one.plan.planned_epsilon / 2
    asked = []

    def optimize_blt(steps, buffers, participation, **kw):  # the optimiser is slow
        asked.append(participation)
        return _BLT

    monkeypatch.setattr(schedule, "optimize_blt", optimize_blt)
    named = _quiet_attach(n, b, sampling="cyclic_poisson", noise="blt", epochs=2)
    assert named.plan.run.cycle == n // b
    assert asked == [MinSeparation(n // b, 2)]


def _naive_error_ratio(strategy, steps):
    """sqrt(max_t ||(A C^{-1})[t, :]||^2 / steps) from dense matrices: A the prefix sums,
    C the lower-triangular Toeplitz matrix of the strategy's coefficients."""
    c = np.asarray(strategy.toeplitz_coefs(steps), dtype=float)
    dense = np.zeros((steps, steps))
    for i in range(steps):
        dense[i, : i + 1] = c[: i + 1][::-1]
    a = np.tril(np.ones((steps, steps)))
    b = a @ np.linalg.inv(dense)
    return math.sqrt(float(np.max(np.sum(b * b, axis=1))) / steps)


def test_warns_when_dpsgd_noise_of_the_same_error_costs_less():
    """A BLT close to the identity (what one optimised for participation at every step
    comes out as) with one group (cycle_length=1) is accounted without amplification:
    DP-SGD noise of the same expected error is accounted at a far smaller epsilon. The
    warning names both epsilons; the DP-SGD one is dp_accounting's PLD epsilon of the
    Poisson-subsampled Gaussian at the noise multiplier of equal error (from dense
    matrices). A BLT that lowers the error, under the default cycle, does not warn."""
    dp_accounting = pytest.importorskip("dp_accounting")
    n, b, sigma = 1000, 64, 1.0
    near_identity = BufferedToeplitz(buf_decay=(0.5,), output_scale=(0.01,))
    with pytest.warns(UserWarning, match=_WARNED) as rec:
        p = _attach(n, b, sampling="cyclic_poisson", noise=near_identity, epochs=1, cycle_length=1)
    msg = next(str(w.message) for w in rec if _WARNED in str(w.message))
    steps = p.plan.planned_steps
    eps_run, eps_ref = (float(v) for v in re.findall(r"epsilon=([0-9.e+]+)[ :]", msg)[:2])
    sigma_ref = float(re.search(r"noise_multiplier=([0-9.]+) and", msg).group(1))
    assert eps_run == pytest.approx(p.plan.planned_epsilon, rel=1e-3)
    assert sigma_ref == pytest.approx(
        sigma * _naive_error_ratio(p.plan.run.strategy, steps), rel=1e-3
    )
    acct = dp_accounting.pld.PLDAccountant()
    acct.compose(
        dp_accounting.PoissonSampledDpEvent(b / n, dp_accounting.GaussianDpEvent(sigma_ref)), steps
    )
    assert eps_ref == pytest.approx(acct.get_epsilon(1e-5), rel=0.02)
    assert eps_ref < eps_run / 5
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _attach(n, b, sampling="cyclic_poisson", noise=_BLT, epochs=1)
    assert not [w for w in rec if _WARNED in str(w.message)]


def test_correlated_refusal_names_the_plan_apart_from_max_epsilon():
    """max_epsilon=100 on a correlated run: the cap is the plan's epsilon (the run cannot
    go past its plan), and the refusal names that number as the plan's and 100 as the
    max_epsilon given, not the plan's epsilon as max_epsilon."""
    p = _quiet_attach(60, 6, sampling="cyclic_poisson", noise=_BLT, steps=10, max_epsilon=100.0)
    planned = p.plan.planned_epsilon
    assert planned < 100
    with pytest.raises(PrivacyBudgetExceededError) as err:
        while True:
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
    text = str(err.value)
    assert p.accountant.steps == 10
    assert f"planned epsilon {planned:g}" in text
    assert "max_epsilon=100 is larger" in text
    assert f"max_epsilon={planned:g}" not in text
