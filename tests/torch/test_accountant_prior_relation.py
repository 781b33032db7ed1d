"""The step-by-step accountant reads its prior under the relation of its steps: a prior
that is not subsampled (add/remove) before fixed-size steps (replace-one) is counted at
its replace-one cost, as every other entry point counts it."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from scipy.stats import norm  # noqa: E402

from privlearn.accounting import Gaussian  # noqa: E402
from privlearn.torch import PrivacyAccountant  # noqa: E402


def _gdp_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon(delta) of mu-GDP (Dong, Roth & Su 2022, Corollary 2.13), bisected."""

    def d(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("accountant", ["pld", "analytic"])
def test_bare_prior_before_fixed_size_steps_costs_its_replace_one_price(accountant):
    acct = PrivacyAccountant(scheme="fixed", accountant=accountant)
    acct.prior = Gaussian(2.0)  # add/remove: sensitivity C; under replace-one 2 C
    for _ in range(3):  # whole-batch fixed-size steps: replace-one, sensitivity 2 C
        acct.record_step(noise_multiplier=3.0, sampling_rate=1.0, max_grad_norm=1.0)
    mu = math.sqrt((2 / 2.0) ** 2 + 3 * (2 / 3.0) ** 2)
    exact = _gdp_epsilon(mu, 1e-6)
    assert exact * (1 - 1e-9) <= acct.epsilon(1e-6) <= exact * (1 + 1e-6)
