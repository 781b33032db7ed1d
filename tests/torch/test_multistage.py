"""Training on with another batch size: a second ``make_private`` after ``p.detach()`` is a
run with an accountant of its own; ``compose_after`` with the first run's mechanism makes
its epsilon that of both stages, as a peer accountant composes them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting.pld import pld_privacy_accountant  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from train_loops import train_steps as _train  # noqa: E402

from privlearn.torch import make_private  # noqa: E402


@pytest.mark.slow  # about 7 s: two PLD compositions
def test_a_second_stage_with_another_batch_size_composes_after_the_first(make_mlp, make_data):
    model, data = make_mlp(), make_data()  # 64 examples
    n, sigma, delta = len(data), 1.0, 1e-5

    def stage(batch_size, seed):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return make_private(
            model,
            opt,
            DataLoader(data, batch_size=batch_size),
            noise_multiplier=sigma,
            max_grad_norm=1.0,
            seed=seed,
        )

    first = stage(8, 0)
    taken_first = _train(first, 3)
    first.detach()
    second = stage(16, 1)
    assert second.epsilon(delta) == 0.0  # its own accountant: nothing of the first stage
    second.compose_after(first.accountant.mechanism())
    taken_second = _train(second, 2)
    assert second.accountant.steps == taken_second == 2

    peer = pld_privacy_accountant.PLDAccountant()
    for rate, steps in ((8 / n, taken_first), (16 / n, taken_second)):
        event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma))
        peer.compose(event, steps)
    expected = peer.get_epsilon(delta)
    assert expected <= second.epsilon(delta) <= expected * 1.001
