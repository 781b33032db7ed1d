"""What a correlated-noise run is accounted at when it stops early or goes past its plan,
and the noise it adds when the draws cannot be aligned with a DP-SGD run's (secure mode).

* Stopped early after ``k`` of the planned steps, the run released the first ``k`` rows of
  its matrix mechanism: its epsilon is the Gaussian mechanism's of the sensitivity of the
  ``k x k`` leading block of ``C`` over the participation patterns of the bins that drew
  the batches, found here by enumerating the patterns (closed form of Balle & Wang 2018).
* Past its plan, a step is taken only when the mechanism of all the steps taken, accounted
  again, stays within the planned epsilon (never the planned epsilon reused): with cyclic
  Poisson sampling and ``bands <= cycle`` a record takes part at most ``ceil(n / cycle)``
  times, so steps 11 and 12 of a 10-step plan of cycle 4 cost nothing more and step 13
  is refused; the epsilon is dp_accounting's PLD of ``ceil(n / 4)`` Poisson-subsampled
  Gaussians (Choquette-Choo et al. 2023, Theorem 4), and the noise of the extra steps
  is still ``C^{-1} z``.
* In secure mode (no seed), ``C`` times the noise of many coordinates is white: its
  covariance over the steps is the identity within a 6-sigma sampling band.
* With bfloat16 parameters the noise is still ``C^{-1} z``, to bfloat16's precision.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import PrivacyBudgetExceededError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _gaussian_delta(eps, sigma, sens):
    """delta(eps) of the Gaussian mechanism of sensitivity ``sens``, noise std ``sigma``
    (Balle & Wang 2018, Theorem 8)."""
    from scipy.stats import norm

    a, b = sens / (2 * sigma), eps * sigma / sens
    return norm.cdf(a - b) - np.exp(eps) * norm.cdf(-a - b)


class _Silent(nn.Module):
    """A zero loss: p.grad is the noise alone."""

    def __init__(self, d_in=4, d_out=3):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        return self.lin(x) * 0.0


def _run(n, batch, d_in=4, d_out=3, **kw):
    torch.manual_seed(0)
    model = _Silent(d_in, d_out)
    x = torch.randn(n, d_in, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DP-SGD-would-be-better notes)
        return make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            DataLoader(TensorDataset(x), batch_size=batch),
            max_grad_norm=1.0,
            **kw,
        )


def _noises(p, steps):
    """The noise of each of ``steps`` more steps (times the expected batch size)."""
    out = []
    while len(out) < steps:
        for (x,) in p.data_loader:
            p.optimizer.zero_grad()
            p.model(x.to(next(p.model.parameters()).dtype)).sum().backward()
            p.optimizer.step()
            out.append(torch.cat([q.grad.reshape(-1).double() for q in p.model.parameters()]))
            if len(out) == steps:
                break
    return torch.stack(out).numpy() * p.expected_batch_size


def test_a_run_stopped_early_is_accounted_for_the_steps_taken():
    sigma, k = 1.5, 6
    p = _run(
        48,
        12,
        noise_multiplier=sigma,
        epochs=3,
        sampling="balls_in_bins",
        noise="banded",
        bands=3,
        seed=2,
    )
    assert p.plan.run.cycle == 4 and p.plan.planned_steps == 12
    _noises(p, k)
    C = p.plan.run.strategy.materialize(k)
    # the bins' patterns over the k steps taken: j, j + 4 (< k); every sign of the
    # contributions (unit vectors along one direction: the worst case of Eq. (5))
    sens = max(
        np.linalg.norm(C[:, list(pi)] @ np.array(s))
        for j in range(4)
        for pi in [range(j, k, 4)]
        for s in itertools.product((1.0, -1.0), repeat=len(pi))
    )
    upper = max(
        np.sqrt(np.abs(C.T @ C)[np.ix_(pi, pi)].sum())
        for pi in (list(range(j, k, 4)) for j in range(4))
    )
    assert sens == pytest.approx(upper, rel=1e-12)  # the worst case is exact here
    eps = p.epsilon(1e-5)
    assert _gaussian_delta(eps, sigma, sens) <= 1e-5 * (1 + 1e-9)  # never below the truth
    assert _gaussian_delta(eps * 0.999, sigma, sens) > 1e-5  # and tight
    assert eps < p.plan.planned_epsilon  # not the plan's


def test_past_its_plan_a_run_is_accounted_again_or_refused():
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    sigma, settings = 1.0, dict(sampling="cyclic_poisson", cycle_length=4, steps=10, seed=4)
    p = _run(96, 6, noise_multiplier=sigma, noise="banded", bands=4, **settings)
    q = p.sampling_rate
    assert q == 0.25 and p.plan.run.strategy.bands == 4
    w = _noises(p, 12)  # steps 11 and 12: a record still takes part at most 3 times
    with pytest.raises(PrivacyBudgetExceededError):
        _noises(p, 1)  # step 13: a fourth participation, past the planned epsilon
    assert p.accountant.steps == 12 and p.optimizer.correlated.steps == 12
    C = p.plan.run.strategy.materialize(12)
    col = np.linalg.norm(C[:, 0])
    acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acct.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / col)), 3
    )
    peer = acct.get_epsilon(1e-5)
    assert p.epsilon(1e-5) == pytest.approx(peer, rel=2e-3)
    assert p.epsilon(1e-5) <= p.plan.planned_epsilon
    # the noise of every step, the two past the plan too, is C^{-1} of the draws a
    # DP-SGD run with the same seed adds
    z = _noises(_run(96, 6, noise_multiplier=sigma, noise="dpsgd", **settings), 12)
    np.testing.assert_allclose(w, np.linalg.solve(C, z), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("noise,extra", [("banded", {"bands": 3}), ("blt", {"buffers": 2})])
def test_secure_noise_is_C_inverse_of_white_noise(noise, extra):
    steps = 12
    p = _run(
        60,
        6,
        d_in=100,
        d_out=60,
        noise_multiplier=1.0,
        secure_mode=True,
        sampling="balls_in_bins",
        epochs=2,
        noise=noise,
        **extra,
    )
    w = _noises(p, steps)  # (steps, d): each coordinate a draw of the steps' noise
    d = w.shape[1]
    C = p.plan.run.strategy.materialize(steps)
    white = C @ w
    cov = white @ white.T / d
    band = 6 * np.sqrt(2.0 / d)  # 6 standard errors of a sample covariance entry
    assert np.abs(cov - np.eye(steps)).max() < band
    if noise == "banded":  # correlated across steps: far from white before C
        assert np.abs(w @ w.T / d - np.eye(steps)).max() > 3 * band


@pytest.mark.parametrize("noise,extra", [("banded", {"bands": 3}), ("blt", {"buffers": 2})])
def test_bf16_parameters_get_C_inverse_noise_to_their_precision(noise, extra):
    """bfloat16 parameters: the draws and the recurrence run in float32 (the state is
    float32), and each step's noise is C^{-1} of the draws a float32 DP-SGD run with the
    same seed adds, to bfloat16's precision (8 significant bits)."""
    steps, settings = 10, dict(sampling="balls_in_bins", epochs=2, seed=3, noise_multiplier=1.0)
    z = _noises(_run(60, 6, **settings), steps)
    p = _run(60, 6, noise=noise, **settings, **extra)
    p.model.to(torch.bfloat16)
    w = _noises(p, steps)
    assert p.optimizer.correlated.state_dict()["buffers"].dtype == torch.float32
    want = np.linalg.solve(p.plan.run.strategy.materialize(steps), z)
    np.testing.assert_allclose(w, want, rtol=0, atol=2**-7 * np.abs(want).max())
