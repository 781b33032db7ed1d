"""Opacus 1.6's accountant and calibration tests, through privlearn's PyTorch engine.

The torch-free halves of Opacus's ``opacus/tests/accountants_test.py`` (epsilons of the
composed subsampled Gaussian, ``get_noise_multiplier`` against ``calibrate``) are in
tests/accounting/test_conformance_peer_families.py; this file runs the same cases
through what an Opacus user calls: ``make_private(..., target_epsilon=...)`` (Opacus's
``make_private_with_epsilon``) and ``PrivacyAccountant`` (Opacus's ``RDPAccountant`` /
``PRVAccountant``: ``step``, ``get_epsilon``, ``state_dict``, ``load_state_dict``).

Expected values are Opacus's own: the constants of its tests, and the answers of
``opacus.accountants.utils.get_noise_multiplier`` (opacus 1.6.0), which stops its
bisection once epsilon is within ``epsilon_tolerance=0.01`` below the target.
privlearn's epsilons are certified upper bounds, so they may be below Opacus's (a
finer RDP order set; an exact PLD bound where Opacus's PRV reports an estimate's upper
end) by at most the peer's own slack, never above its exact value.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.torch import PrivacyAccountant, make_private  # noqa: E402

# accountants_test.py: sigma 1.5, q 0.04, 90 epochs (2250 steps), delta 1e-5
_SIGMA, _Q, _T, _DELTA = 1.5, 0.04, int(90 / 0.04), 1e-5
_OPACUS_RDP = 7.32911117143  # test_rdp_accountant (Opacus's order grid)
_OPACUS_PRV = 6.777395712150674  # test_prv_accountant (eps_error 0.01)


def _recorded(steps: int, accountant: str = "rdp") -> PrivacyAccountant:
    acct = PrivacyAccountant(accountant=accountant)
    for _ in range(steps):
        acct.record_step(noise_multiplier=_SIGMA, sampling_rate=_Q, max_grad_norm=1.0)
    return acct


# ----------------------------------------------------------------------------------------
# opacus/tests/accountants_test.py
# ----------------------------------------------------------------------------------------
def test_rdp_and_prv_accountant_values_step_by_step() -> None:
    # AccountingTest.test_rdp_accountant and test_prv_accountant: 2250 calls of
    # accountant.step(noise_multiplier=1.5, sample_rate=0.04), then get_epsilon(1e-5)
    acct = _recorded(_T)
    assert acct.steps == _T
    rdp = acct.epsilon(_DELTA)  # every order and Balle et al. (2020)'s conversion
    assert _OPACUS_RDP - 0.01 <= rdp <= _OPACUS_RDP + 1e-9
    pld = acct.epsilon(_DELTA, "pld")
    assert pld <= rdp
    assert abs(pld - _OPACUS_PRV) <= 0.01  # within the PRV accountant's eps_error
    # the history is the composition of the steps (built independently of the engine)
    ref = compose(subsample(Gaussian(_SIGMA), _Q), _T)
    assert rdp == pytest.approx(ref.epsilon(_DELTA, "rdp"), rel=1e-12)


def test_accountant_state_dict() -> None:
    # AccountingTest.test_accountant_state_dict: the history in the state is equal to the
    # accountant's but not the same object; state_dict(destination) fills the given dict
    # (the accountant's entries added, the caller's kept) and returns it
    acct = _recorded(10)
    state = acct.state_dict()
    assert state == acct.state_dict()
    state["segments"][0][3] = 99  # editing the returned state leaves the history alone
    assert acct.steps == 10 and acct.segments[0].steps == 10
    dest = {"dummy_k": "dummy_v"}
    out = acct.state_dict(dest)
    assert out is dest and dest["dummy_k"] == "dummy_v"
    assert dest["accountant"] == "rdp" and dest["segments"] == [[_SIGMA, _Q, 1.0, 10]]
    fresh = PrivacyAccountant(accountant="rdp")
    fresh.load_state_dict(dest)  # the caller's extra key is ignored
    assert fresh.segments == acct.segments


@pytest.mark.parametrize("bad", [{}, {"1": 2}, {"history": []}])
def test_load_state_dict_refuses_what_state_dict_does_not_write(bad: dict) -> None:
    # AccountingTest.test_accountant_load_state_dict, corner cases: a ValueError each
    fresh = PrivacyAccountant(accountant="rdp")
    with pytest.raises(ValueError, match="state"):
        fresh.load_state_dict(bad)
    assert fresh.steps == 0


def test_load_state_dict_of_another_accountant_is_refused() -> None:
    # ... new_gdp_accountant.load_state_dict(rdp_state) raises ValueError: here the state
    # of an 'rdp' accountant loaded into a 'pld' one
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant(accountant="pld").load_state_dict(_recorded(3).state_dict())


def test_load_state_dict_then_more_steps_is_the_uninterrupted_epsilon() -> None:
    # ... the state after 1250 steps loaded into a new accountant, which takes the last
    # 1000: the epsilon is test_rdp_accountant's
    saved = _recorded(_T - 1000)
    fresh = PrivacyAccountant(accountant="rdp")
    assert fresh.state_dict() != saved.state_dict()
    fresh.load_state_dict(saved.state_dict())
    assert fresh.state_dict() == saved.state_dict()
    for _ in range(1000):
        fresh.record_step(noise_multiplier=_SIGMA, sampling_rate=_Q, max_grad_norm=1.0)
    assert fresh.steps == _T
    assert fresh.epsilon(_DELTA) == _recorded(_T).epsilon(_DELTA)
    assert fresh.epsilon(_DELTA) <= _OPACUS_RDP + 1e-9


# ----------------------------------------------------------------------------------------
# opacus/tests/privacy_engine_test.py
# ----------------------------------------------------------------------------------------
def _make_private(**kw):
    torch.manual_seed(42)
    ds = TensorDataset(torch.randn(512, 4), torch.randint(0, 2, (512,)))  # DATA_SIZE 512
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0)  # LR 0.5
    return make_private(model, opt, DataLoader(ds, batch_size=64), max_grad_norm=1.0, **kw)


@pytest.mark.parametrize(
    "accountant, opacus_sigma",
    [
        # get_noise_multiplier(target_epsilon=2, target_delta=1e-5, sample_rate=1/8,
        # steps=16, accountant=...) of opacus 1.6.0: "rdp", and "prv" for privlearn's "pld"
        pytest.param("rdp", 1.60400390625, marks=pytest.mark.slow),  # RDP calibration: ~5 s
        ("pld", 1.474609375),
    ],
)
def test_make_private_with_epsilon(accountant: str, opacus_sigma: float) -> None:
    # BasePrivacyEngineTest.test_make_private_with_epsilon: 512 records in batches of 64
    # (q = 1/8), 2 epochs, target (2, 1e-5); after 2 epochs of steps get_epsilon(1e-5)
    # is the target to 2 places
    p = _make_private(target_epsilon=2.0, target_delta=1e-5, epochs=2, accountant=accountant)
    sigma = p.optimizer.noise_multiplier
    steps = 0
    for _ in range(2):
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            steps += 1
    assert steps == 2 * 8 and p.accountant.steps == steps
    eps = p.epsilon(1e-5)
    assert round(eps - 2.0, 2) == 0 and eps <= 2.0
    # the calibration is at least as tight as Opacus's (epsilon_tolerance 0.01): never a
    # larger noise than get_noise_multiplier's, and no feasible sigma 1e-4 smaller
    assert sigma <= opacus_sigma
    mech = compose(subsample(Gaussian(sigma * (1 - 1e-4)), 1 / 8), steps)
    assert mech.epsilon(1e-5, accountant) > 2.0


@pytest.mark.parametrize("kw", [dict(epochs=2, steps=16), dict()])
def test_make_private_with_epsilon_needs_one_length(kw: dict) -> None:
    # get_noise_multiplier raises ValueError unless exactly one of epochs and steps is
    # given (opacus/accountants/utils.py); make_private's error is a ValueError too
    with pytest.raises(ValueError, match="epochs"):
        _make_private(target_epsilon=2.0, target_delta=1e-5, **kw)


def test_make_private_with_epsilon_refuses_delta_zero() -> None:
    # a Gaussian mechanism has no finite epsilon at delta 0: refused before any step
    # (Opacus's bisection would double sigma up to MAX_SIGMA and raise)
    with pytest.raises(ValueError, match="target_delta"):
        _make_private(target_epsilon=2.0, target_delta=0.0, epochs=1)


def test_epsilon_is_monotone_in_the_steps_taken() -> None:
    # the get_epsilon of Opacus's engine after each step never decreases; a sanity
    # check of the engine's history against the closed composition at every step count
    p = _make_private(noise_multiplier=1.0)
    last = 0.0
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        eps = p.epsilon(1e-5)
        assert eps >= last and not math.isinf(eps)
        last = eps
    ref = compose(subsample(Gaussian(1.0), 1 / 8), 8).epsilon(1e-5)
    assert last == pytest.approx(ref, rel=1e-9)
