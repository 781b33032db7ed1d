"""Correlated noise and participation-bounding samplers in make_private.

The noise a banded or BLT run adds is exactly ``sigma C_max (C^{-1} z)_t`` for the draws a
DP-SGD run with the same seed adds as ``sigma C_max z_t`` (so a wrong band or a noise that
is not correlated as claimed fails here); every sampler keeps the participation its
accounting assumes (a sampler that breaks its separation fails here); the epsilon is the
matrix mechanism's of the steps taken, and with the identity strategy and one group it is
DP-SGD's exactly; a resumed run continues the same correlated noise bit for bit."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.correlated import (  # noqa: E402
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
)
from privlearn.correlated.sampling import check_participation  # noqa: E402
from privlearn.errors import ParameterTypeError, StrategyAdjustedWarning  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

N = 60


def _indexed(n=N, d=4):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, torch.zeros(n, dtype=torch.long))


class _Frozenish(nn.Module):
    """A model whose loss has zero gradient: p.grad is the noise alone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) * 0.0


def _attach(model, **kw):
    """``model`` made private at learning rate 0 (its parameters never move) on the
    indexed set, batches of 6, noise multiplier 1, seed 3, clip norm 1."""
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                        DataLoader(_indexed(), batch_size=6), noise_multiplier=1.0, seed=3,
                        max_grad_norm=1.0, **kw)


def _noises(steps, state=None, **kw):
    """The noise of the first ``steps`` steps of ``_attach(_Frozenish(), **kw)`` (after
    loading ``state`` if given: the steps a resumed run takes next) and the run."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _Frozenish()
        p = _attach(model, **kw)
        if state is not None:
            p.load_state_dict(state)
        out = []
        while len(out) < steps:
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
                out.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).clone())
                if len(out) == steps:
                    break
        return torch.stack(out).numpy() * p.expected_batch_size, p
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("noise,extra", [("banded", {"bands": 3}), ("blt", {"buffers": 2})])
def test_correlated_noise_is_C_inverse_of_the_independent_draws(noise, extra):
    steps = 12
    z, _ = _noises(steps, sampling="shuffled_epochs", epochs=2)
    w, p = _noises(steps, sampling="shuffled_epochs", epochs=2, noise=noise, **extra)
    C = p.plan.run.strategy.materialize(steps)
    np.testing.assert_allclose(w, np.linalg.solve(C, z), rtol=1e-9, atol=1e-9)
    if noise == "banded":
        assert p.plan.run.strategy.bands == 3
        assert not np.allclose(w, z)  # correlated: not the independent draws


@pytest.mark.parametrize("noise,extra,kept", [("banded", {"bands": 3}, 2),
                                              ("blt", {"buffers": 2}, 2)])
def test_correlated_state_is_O_bands_and_resumes_bit_for_bit(noise, extra, kept):
    w, p = _noises(7, sampling="shuffled_epochs", epochs=2, noise=noise, **extra)
    state = copy.deepcopy(p.state_dict())
    assert state["correlated"]["buffers"].shape[0] == kept  # b - 1 noises / m buffers
    full, _ = _noises(10, sampling="shuffled_epochs", epochs=2, noise=noise, **extra)
    np.testing.assert_array_equal(full[:7], w)
    # a new run loads the state and continues with the same noise
    rest, _ = _noises(3, state, sampling="shuffled_epochs", epochs=2, noise=noise, **extra)
    np.testing.assert_array_equal(rest, full[7:])



@pytest.mark.parametrize("noise,extra", [("banded", {"bands": 3}), ("blt", {"buffers": 2})])
def test_resume_refuses_a_run_whose_strategy_differs(noise, extra):
    """The strategy is optimised for the planned steps: a checkpoint of a 2-epoch run
    loaded into a 3-epoch run would continue the saved noise state under other
    coefficients (a row-mixed C that nobody accounted), so it is refused."""
    from privlearn.errors import ConfigurationError

    _, p = _noises(7, sampling="shuffled_epochs", epochs=2, noise=noise, **extra)
    state = copy.deepcopy(p.state_dict())
    model = _Frozenish()
    q = _attach(model, sampling="shuffled_epochs", epochs=3, noise=noise, **extra)
    assert q.plan.run.strategy != p.plan.run.strategy
    with pytest.raises(ConfigurationError, match="optimised for the planned steps"):
        q.load_state_dict(state)
    assert q.accountant.steps == 0 and q.optimizer.correlated.steps == 0
    # a checkpoint that does not say its strategy cannot be checked: refused as well
    del state["mechanism"]["strategy"]
    model = _Frozenish()
    same = _attach(model, sampling="shuffled_epochs", epochs=2, noise=noise, **extra)
    with pytest.raises(ConfigurationError, match="does not record"):
        same.load_state_dict(state)


def _logical_noises(steps, **kw):
    """The noise of each logical step (p.grad after the step that took it), with the loop
    stepping every physical chunk."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _Frozenish()
        p = _attach(model, sampling="cyclic_poisson", cycle_length=3,
                    epochs=2, noise="banded", bands=3, **kw)
        out = []
        while len(out) < steps:
            for x, y in p.data_loader:
                taken = p.accountant.steps
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
                if p.accountant.steps > taken:
                    out.append(torch.cat([v.grad.reshape(-1) for v in model.parameters()]))
                if len(out) == steps:
                    break
        return torch.stack(out).numpy(), p
    finally:
        torch.set_default_dtype(torch.float32)


def test_virtual_batches_advance_the_correlated_noise_once_per_logical_step():
    whole, _ = _logical_noises(6)
    chunked, p = _logical_noises(6, max_physical_batch_size=2)
    assert p.optimizer.correlated.steps == p.accountant.steps == 6
    np.testing.assert_array_equal(chunked, whole)

def _batches(p, steps):
    out = []
    while len(out) < steps:
        for x, _ in p.data_loader:
            out.append(np.sort(x[:, 0].long().numpy()))
            p.optimizer.zero_grad()
            (p.model(x).sum() * 0).backward()  # a zero loss: the step adds noise alone
            p.optimizer.step()
            if len(out) == steps:
                break
    return out


@pytest.mark.parametrize("sampling,schema", [
    ("cyclic_poisson", lambda b, k: MinSeparation(b, k)),
    ("balls_in_bins", lambda b, k: MinSeparation(b, k)),
    ("shuffled_epochs", lambda b, k: FixedEpochs(k)),
])
def test_samplers_keep_the_participation_they_are_accounted_for(sampling, schema):
    model = nn.Linear(4, 3)
    kw = {"cycle_length": 5} if sampling == "cyclic_poisson" else {}
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_indexed(), batch_size=6), noise_multiplier=1.0, epochs=3,
                     sampling=sampling, seed=1, **kw)
    b = p.plan.run.cycle
    steps = 3 * p.plan.steps_per_epoch
    batches = _batches(p, steps)
    check_participation(batches, schema(b, -(-steps // b)), steps)
    # a planted bug: the sampler drawing each batch twice in a row breaks the separation
    doubled = [bb for bb in batches for _ in range(2)]
    with pytest.raises(ValueError, match="closer than|not one epoch|participates"):
        check_participation(doubled, schema(b, -(-steps // b)), len(doubled))


def test_cyclic_poisson_with_one_group_is_dp_sgd_exactly():
    model = nn.Linear(4, 3)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_indexed(), batch_size=6), noise_multiplier=0.9, epochs=2,
                     sampling="cyclic_poisson", cycle_length=1, seed=0)
    _batches(p, 7)
    want = compose(subsample(Gaussian(0.9), rate=6 / N), steps=7).epsilon(1e-5)
    assert p.epsilon(1e-5) == want


def test_run_is_capped_at_its_plan_and_noise_cannot_change():
    from privlearn.errors import PrivacyBudgetExceededError

    model = nn.Linear(4, 3)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_indexed(), batch_size=6), noise_multiplier=1.0, epochs=1,
                     sampling="balls_in_bins", noise="banded", bands=2, seed=0)
    _batches(p, p.plan.planned_steps)
    assert p.epsilon(1e-5) == pytest.approx(p.plan.planned_epsilon, rel=1e-12)
    with pytest.raises(PrivacyBudgetExceededError):
        _batches(p, 1)
    with pytest.raises(ValueError, match="cannot change during a correlated-noise run"):
        p.optimizer.noise_multiplier = 0.5


def test_refused_combinations():
    model = nn.Linear(4, 3)
    loader = DataLoader(_indexed(), batch_size=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs a sampler that bounds"):
        make_private(model, opt, loader, noise_multiplier=1.0, epochs=1, noise="banded")
    with pytest.raises(ValueError, match="give epochs or steps"):
        make_private(model, opt, loader, noise_multiplier=1.0, sampling="balls_in_bins")
    with pytest.raises(ValueError, match="bands=3 only applies"):
        make_private(model, opt, loader, noise_multiplier=1.0, epochs=1, bands=3,
                     sampling="balls_in_bins")
    with pytest.raises(ValueError, match="noise must be one of"):
        make_private(model, opt, loader, noise_multiplier=1.0, epochs=1, noise="dp-ftrl",
                     sampling="balls_in_bins")


def test_identity_strategy_with_poisson_sampling_message_is_accurate():
    """Identity() under Poisson sampling is refused (a strategy object is accounted as a
    matrix mechanism of the run), but not as noise correlated across steps: the message
    says the noise is independent and names noise='dpsgd', which then runs."""
    from privlearn.correlated import Identity

    model = nn.Linear(4, 3)
    loader = DataLoader(_indexed(), batch_size=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as info:
        make_private(model, opt, loader, noise_multiplier=1.0, epochs=1, noise=Identity())
    msg = str(info.value)
    assert "correlates" not in msg
    assert "independent noise" in msg and "noise='dpsgd'" in msg and "'poisson'" in msg
    make_private(model, opt, loader, noise_multiplier=1.0, epochs=1, noise="dpsgd")



@pytest.mark.parametrize("strategy", [BufferedToeplitz((0.99,), (5.0,)),
                                      BandedToeplitz((1.0, 2.0))], ids=repr)
def test_a_strategy_whose_noise_overflows_is_refused_before_any_step(strategy):
    """C^{-1} growing geometrically: the noise of step t grows like 4^t (inf/nan in a few
    hundred steps), so the run is refused when it is made, not after the model is nan."""
    from privlearn.errors import ConfigurationError

    model = nn.Linear(4, 3)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigurationError, match="grows without bound"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_indexed(), batch_size=6), noise_multiplier=1.0, epochs=20,
                     sampling="shuffled_epochs", noise=strategy, seed=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])

def test_explicit_strategy_and_amplified_banded_accounting():
    model = nn.Linear(4, 3)
    C = BandedToeplitz.square_root(bands=3)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_indexed(), batch_size=6), noise_multiplier=1.2, steps=20,
                     sampling="cyclic_poisson", cycle_length=3, noise=C, seed=0)
    from privlearn.correlated.accounting import correlated_mechanism
    from privlearn.correlated.sampling import CyclicPoissonSampler

    _batches(p, 9)
    want = correlated_mechanism(C, CyclicPoissonSampler(N, 6 * 3 / N, 9, 3), 1.2)
    assert p.epsilon(1e-5) == want.epsilon(1e-5)


def test_more_bands_than_steps_cycles_over_the_steps():
    """noise='banded' with more bands than planned steps gets one band per step, and the
    default cycle of cyclic Poisson sampling is those bands, not the ones asked for (a
    cycle of 100 over 60 examples in batches of 6 has no valid rate): 5 steps in 5
    groups, each example in at most one step, accounted as one Poisson-subsampled
    Gaussian of the column norm (Choquette-Choo et al. 2023, Theorem 4)."""
    model = nn.Linear(4, 3)
    with pytest.warns(StrategyAdjustedWarning, match="bands=100 is more than the 5 planned"):
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(_indexed(), batch_size=6), noise_multiplier=1.5, steps=5,
                         sampling="cyclic_poisson", noise="banded", bands=100, seed=0)
    C = p.plan.run.strategy
    assert p.plan.run.cycle == 5 and C.bands == 5
    batches = _batches(p, 5)
    check_participation(batches, MinSeparation(5, 1), 5)
    column = float(np.linalg.norm(C.coefs))
    want = subsample(Gaussian(1.5 / column), rate=6 * 5 / N).epsilon(1e-5)
    # the certified factor of the float32 noise recurrence's rounding: below 1e-5
    assert want <= p.epsilon(1e-5) == pytest.approx(want, rel=1e-5)


def test_a_banded_strategy_given_cycles_over_its_bands():
    """An explicit 3-banded strategy under cyclic Poisson sampling with no cycle_length
    gets 3 groups, as noise='banded' with bands=3 does, so it is amplified: 9 steps are 3
    participations, each a Poisson-subsampled Gaussian of the column norm
    (Choquette-Choo et al. 2023, Theorem 4), not 9 un-amplified ones."""
    model = nn.Linear(4, 3)
    C = BandedToeplitz((1.0, -0.4, 0.3))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_indexed(), batch_size=6), noise_multiplier=1.2, steps=9,
                     sampling="cyclic_poisson", noise=C, seed=0)
    assert p.plan.run.cycle == 3
    check_participation(_batches(p, 9), MinSeparation(3, 3), 9)
    step = subsample(Gaussian(1.2 / math.sqrt(1.0 + 0.16 + 0.09)), rate=6 * 3 / N)
    want = compose(step, steps=3).epsilon(1e-5)  # times the rounding factor (< 1e-5)
    assert want <= p.epsilon(1e-5) == pytest.approx(want, rel=1e-5)


def test_banded_noise_defaults_to_bands_its_cycle_amplifies():
    """noise='banded' under cyclic Poisson sampling with cycle_length=3 and no bands gets
    3 bands (the documented default: the cycle length when shorter than 8), which the
    cycle amplifies, rather than 8 bands accounted without amplification."""
    model = nn.Linear(4, 3)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_indexed(), batch_size=6), noise_multiplier=1.2, steps=9,
                     sampling="cyclic_poisson", cycle_length=3, noise="banded", seed=0)
    C = p.plan.run.strategy
    assert C.bands == 3
    step = subsample(Gaussian(1.2 / float(np.linalg.norm(C.coefs))), rate=6 * 3 / N)
    want = compose(step, steps=3).epsilon(1e-5)  # times the rounding factor (< 1e-5)
    assert want <= p.plan.planned_epsilon == pytest.approx(want, rel=1e-5)


def test_bands_past_the_cycle_are_dropped_with_a_warning_and_the_noise_is_unchanged():
    """bands=6 with cycle_length=3: the optimum puts zero on bands 4-6 (participations 3
    steps apart), so the run is that of 3 bands -- the same noise, bit for bit, 2 noise
    buffers instead of 5, the same amplified epsilon -- and a warning says so."""
    common = dict(noise="banded", sampling="cyclic_poisson", cycle_length=3, epochs=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StrategyAdjustedWarning)
        want, p3 = _noises(9, bands=3, **common)
    with pytest.warns(StrategyAdjustedWarning,
                      match=r"bands=6: 3 bands are used.*at least 3 steps apart"):
        got, p6 = _noises(9, bands=6, **common)
    assert p6.plan.run.strategy == p3.plan.run.strategy
    assert p6.plan.run.noise_transform().buffers == 2
    np.testing.assert_array_equal(got, want)
    assert p6.plan.planned_epsilon == p3.plan.planned_epsilon


def test_blt_buffers_past_the_steps_are_reduced_with_a_warning():
    """Over 4 steps C has 3 coefficients below its diagonal: a BLT of 6 buffers is one of
    3 (Caratheodory), so 3 are used and a warning says so; the default (4) is reduced
    silently."""
    model = nn.Linear(4, 3)
    kw = dict(noise_multiplier=1.0, steps=4, sampling="balls_in_bins", noise="blt",
              seed=0)
    with pytest.warns(StrategyAdjustedWarning, match="buffers=6 is more than a BLT over 4"):
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(_indexed(), batch_size=6), buffers=6, **kw)
    assert p.plan.run.strategy.buffers == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", StrategyAdjustedWarning)
        other = nn.Linear(4, 3)
        q = make_private(other, torch.optim.SGD(other.parameters(), lr=0.1),
                         DataLoader(_indexed(), batch_size=6), **kw)
    assert q.plan.run.strategy.buffers == 3


def test_blt_buffers_the_optimum_leaves_unused_are_dropped_with_a_warning():
    """Several participations (cycle 8 over 64 steps): the optimised BLT of 4 buffers
    leaves some unused (a weight of ~0 or the decay of another buffer); they are dropped,
    a warning names the buffers used, and the noise runs with that many buffers."""
    model = nn.Linear(4, 3)
    with pytest.warns(StrategyAdjustedWarning, match=r"buffers=4: \d buffers are used"):
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(_indexed(), batch_size=6), noise_multiplier=1.0,
                         steps=64, sampling="cyclic_poisson", cycle_length=8, noise="blt",
                         buffers=4, seed=0)
    C = p.plan.run.strategy
    assert C.buffers < 4 and min(C.output_scale) > 1e-6 * max(C.output_scale)
    assert p.plan.run.noise_transform().buffers == C.buffers


def test_strategy_progress_goes_to_stderr_only_when_asked(capfd):
    from privlearn.correlated import optimize_banded_toeplitz

    def attach(**kw):
        optimize_banded_toeplitz.cache_clear()  # optimised afresh: its bar shows
        model = nn.Linear(4, 3)
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(_indexed(), batch_size=6), noise_multiplier=1.0,
                            steps=30, sampling="balls_in_bins", noise="banded", bands=4,
                            seed=0, **kw)

    quiet = attach()  # default: not a terminal here, so silent
    assert capfd.readouterr() == ("", "")
    loud = attach(show_progress=True)
    out, err = capfd.readouterr()
    assert out == "" and "optimising 4 bands for 30 steps" in err
    assert loud.plan.run.strategy == quiet.plan.run.strategy
    assert loud.plan.planned_epsilon == quiet.plan.planned_epsilon
    with pytest.raises(ParameterTypeError, match="show_progress"):
        attach(show_progress="on")


def test_calibration_progress_goes_to_stderr_only_when_asked(capfd):
    def attach(**kw):
        model = nn.Linear(4, 3)
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(_indexed(), batch_size=6), target_epsilon=2.0,
                            epochs=2, seed=0, **kw)

    quiet = attach()
    assert capfd.readouterr() == ("", "")
    loud = attach(show_progress=True)
    out, err = capfd.readouterr()
    assert out == "" and "calibrating the noise for 20 steps" in err
    assert loud.noise_multiplier == quiet.noise_multiplier


# ---------------------------------------------------- shuffled epochs: replace-one only
def _gaussian_delta(eps, sigma, sens):
    """The exact delta(eps) of the Gaussian mechanism of L2 sensitivity ``sens`` and
    noise std ``sigma`` (Balle & Wang 2018, Theorem 8)."""
    from scipy.stats import norm

    a, b = sens / (2 * sigma), eps * sigma / sens
    return norm.cdf(a - b) - np.exp(eps) * norm.cdf(-a - b)


def test_shuffled_epochs_is_accounted_under_replace_one():
    """N = 40, 2 batches of one permutation, sigma 2, 2 epochs: adding an example moves
    another to the other batch, so no add/remove guarantee holds at the epsilon it was
    accounted at (2.94; the release is 6.51-DP under add/remove). The run states
    replace-one, where both participations of the replaced example move their sums by
    up to 2 C: the Gaussian mechanism of sensitivity 2 sqrt 2 C, closed form."""
    from privlearn.accounting.registry import stated_relations

    ds = TensorDataset(torch.randn(40, 4), torch.zeros(40, dtype=torch.long))
    model = nn.Linear(4, 3)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=20), noise_multiplier=2.0, epochs=2,
                     sampling="shuffled_epochs", seed=0)
    assert p.plan.run.cycle == 2
    for _ in range(2):
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
    eps = p.epsilon(1e-5)
    sens = 2 * np.sqrt(2.0)
    assert _gaussian_delta(eps, 2.0, sens) <= 1e-5 * (1 + 1e-9)  # never below the truth
    assert _gaussian_delta(eps - 0.01, 2.0, sens) > 1e-5  # and tight
    assert eps > 6.51 and eps == pytest.approx(p.plan.planned_epsilon, rel=1e-12)
    assert {r.value for r in stated_relations(p.accountant.mechanism())} == {"replace_one"}
    assert p.neighbouring == "replace_one"


def test_shuffled_epochs_is_refused_on_add_remove_budgets(tmp_path):
    """A replace-one sampling on a ledger budget counted under add/remove: refused
    before any step, naming sampling, why, and what to use instead; a replace-one
    budget takes it."""
    from privlearn.errors import LedgerConflictError
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("ar", epsilon=50.0, delta=1e-5, neighbouring="add_remove")
    led.create_budget("ro", epsilon=50.0, delta=1e-5, neighbouring="replace_one")
    kw = dict(noise_multiplier=2.0, epochs=2, sampling="shuffled_epochs", seed=0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(LedgerConflictError, match=r"sampling='shuffled_epochs' is accounted "
                       r"under replace-one .*other examples move.*sampling='balls_in_bins'"):
        make_private(model, opt, DataLoader(_indexed(), batch_size=6),
                     ledger=led.budget("ar"), **kw)
    assert led.spent("ar").entries == 0
    # a budget whose relation its first (add/remove) release fixed refuses it alike
    led.create_budget("fixed_by_use", epsilon=50.0, delta=1e-5)
    led.budget("fixed_by_use").spend(subsample(Gaussian(2.0), rate=0.1), label="poisson")
    with pytest.raises(LedgerConflictError, match=r"sampling='shuffled_epochs'.*balls_in_bins"):
        make_private(model, opt, DataLoader(_indexed(), batch_size=6),
                     ledger=led.budget("fixed_by_use"), **kw)
    p = make_private(model, opt, DataLoader(_indexed(), batch_size=6),
                     ledger=led.budget("ro"), **kw)
    assert p.neighbouring == "replace_one"
    p.detach()
    # balls-in-bins, the add/remove alternative, is taken by the add/remove budget
    p = make_private(model, opt, DataLoader(_indexed(), batch_size=6),
                     ledger=led.budget("ar"), **{**kw, "sampling": "balls_in_bins"})
    assert p.neighbouring == "add_remove"


# ------------------------------------------------------------------ unfreezing mid-run


@pytest.mark.parametrize("strategy", [
    BandedToeplitz(coefs=(1.0, 0.6, -0.2)),
    BufferedToeplitz(buf_decay=(0.9, 0.5), output_scale=(0.2, 0.1)),
], ids=["banded", "blt"])
def test_each_parameter_keeps_its_own_stream_across_freezing(strategy):
    """Naive reference: a parameter first trained at step t0 gets C[t0:, t0:]^{-1} of its
    draws from t0 on (a fresh stream: post-processing of the accounted C X + Z with its
    column of X zero before t0); one frozen and unfrozen again gets rows of the full
    C^{-1} of all its draws (drawn on while frozen, so the stream never restarts)."""
    from privlearn.torch.correlated_noise import CorrelatedNoise

    steps = 10
    sizes = {"a": 3, "b": 2}
    plan = [("a",)] * 2 + [("a", "b")] * 3 + [("b",)] * 2 + [("b", "a")] * 3
    cn = CorrelatedNoise(strategy.recurrence())
    g = torch.Generator().manual_seed(0)
    drawn = {k: {} for k in sizes}  # key -> step -> draw
    got = {k: {} for k in sizes}
    for t, live in enumerate(plan):
        layout = tuple((k, sizes[k]) for k in live)
        z = torch.randn(sum(sizes[k] for k in live), generator=g, dtype=torch.float64)
        at = 0
        for k in live:
            drawn[k][t] = z[at:at + sizes[k]].clone()
            at += sizes[k]
        extra = []

        def draw(out, extra=extra):
            out.copy_(torch.randn(out.shape, generator=g, dtype=out.dtype))
            extra.append(out.clone())
            return out

        w = cn.apply_(z, layout, draw)
        at = 0
        for k in live:
            got[k][t] = w[at:at + sizes[k]].clone()
            at += sizes[k]
        if t in (5, 6):  # "a" frozen: its stream's draws are the extra ones
            drawn["a"][t] = extra[0]
    C = strategy.materialize(steps)
    za = torch.stack([drawn["a"][t] for t in range(steps)]).numpy()
    wa = np.linalg.solve(C, za)
    for t in got["a"]:
        np.testing.assert_allclose(got["a"][t].numpy(), wa[t], rtol=1e-10, atol=1e-12)
    zb = torch.stack([drawn["b"][t] for t in range(2, steps)]).numpy()
    wb = np.linalg.solve(C[2:, 2:], zb)
    for t in got["b"]:
        np.testing.assert_allclose(got["b"][t].numpy(), wb[t - 2], rtol=1e-10, atol=1e-12)
    # the state names its streams: a resumed run continues them (bit for bit)
    twin = CorrelatedNoise(strategy.recurrence())
    twin.load_state_dict(copy.deepcopy(cn.state_dict()))
    z = torch.randn(5, generator=g, dtype=torch.float64)
    layout = (("a", 3), ("b", 2))
    torch.testing.assert_close(twin.apply_(z.clone(), layout), cn.apply_(z.clone(), layout),
                               rtol=0, atol=0)


class _TwoLayers(nn.Module):
    """Zero gradient everywhere (p.grad is the noise alone), two layers to freeze."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return (self.a(x) + self.b(x)[:, :1]) * 0.0


def _unfreezing_noises(noise, schedule, steps=12):
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _TwoLayers()
        model.b.requires_grad_(False)
        kw = {} if noise == "dpsgd" else {"bands": 3}
        p = _attach(model, sampling="balls_in_bins", epochs=2, noise=noise, **kw)
        out = []
        while len(out) < steps:
            for x, y in p.data_loader:
                if len(out) in schedule:
                    model.b.requires_grad_(schedule[len(out)])
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
                out.append({n: q.grad.reshape(-1).clone() * p.expected_batch_size
                            for n, q in model.named_parameters() if q.grad is not None})
                p.optimizer.zero_grad()
                if len(out) == steps:
                    break
        return out, p
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_layer_unfrozen_and_frozen_mid_run_with_correlated_noise():
    """noise='banded' stopped inside CorrelatedNoise.apply_ with torch's size mismatch
    when a layer was unfrozen. Now the always-trained layer's noise is C^{-1} of the
    draws a DP-SGD run with the same seed adds, and the unfrozen layer's is
    C[t0:, t0:]^{-1} of its draws from t0 on; the run is accounted as planned."""
    schedule = {3: True, 8: False}  # b trained at steps 3..7
    z, _ = _unfreezing_noises("dpsgd", schedule)
    w, p = _unfreezing_noises("banded", schedule)
    n = len(w)
    C = p.plan.run.strategy.materialize(n)
    for name in ("a.weight", "a.bias"):
        za = np.stack([s[name].numpy() for s in z])
        np.testing.assert_allclose(np.stack([s[name].numpy() for s in w]),
                                   np.linalg.solve(C, za), rtol=1e-9, atol=1e-9)
    for name in ("b.weight", "b.bias"):
        zb = np.stack([z[t][name].numpy() for t in range(3, 8)])
        wb = np.stack([w[t][name].numpy() for t in range(3, 8)])
        np.testing.assert_allclose(wb, np.linalg.solve(C[3:8, 3:8], zb), rtol=1e-9,
                                   atol=1e-9)
        assert all(name not in w[t] for t in (0, 1, 2, 8, 9))
    assert p.accountant.steps == n and math.isfinite(p.epsilon(1e-5))


def test_the_noise_state_loads_only_into_the_same_recurrence():
    from privlearn.errors import ParameterValueError
    from privlearn.torch.correlated_noise import CorrelatedNoise

    gen = CorrelatedNoise(BandedToeplitz((1.0, 0.5, 0.25)).recurrence())
    for _ in range(3):
        gen.apply_(torch.randn(5, dtype=torch.float64))
    state = gen.state_dict()
    same = CorrelatedNoise(BandedToeplitz((1.0, 0.5, 0.25)).recurrence())
    same.load_state_dict(state)
    z = torch.randn(5, dtype=torch.float64)
    assert torch.equal(same.apply_(z.clone()), gen.apply_(z.clone()))
    for other in (BandedToeplitz((1.0, 0.5, 0.3)), BandedToeplitz((1.0, 0.5)),
                  BufferedToeplitz((0.9, 0.5), (0.2, 0.1))):
        with pytest.raises(ParameterValueError, match="same strategy"):
            CorrelatedNoise(other.recurrence()).load_state_dict(state)


class _CountedCoefs(tuple):
    """A coefficient tuple that counts how often an entry is read."""

    reads = 0

    def __getitem__(self, i):
        type(self).reads += 1
        return super().__getitem__(i)


def test_a_banded_step_does_no_host_work_that_grows_with_the_bands():
    """The ring's (b-1) x (b-1) coefficient table is built on the first step only: a later
    step reads O(1) coefficients on the host (it read all (b-1)^2 of them every step, about
    3 ms a step at 64 bands), and the noise is still C^{-1} z."""
    import dataclasses

    from privlearn.torch.correlated_noise import CorrelatedNoise

    strategy = BandedToeplitz.square_root(bands=32)
    rec = strategy.recurrence()
    counted = dataclasses.replace(rec, coefs=_CountedCoefs(rec.coefs))
    gen = CorrelatedNoise(counted)
    z = torch.randn(40, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = [gen.apply_(z[0].clone())]
    _CountedCoefs.reads = 0
    out += [gen.apply_(row.clone()) for row in z[1:]]
    assert _CountedCoefs.reads <= 2 * (len(z) - 1)
    want = np.linalg.solve(strategy.materialize(len(z)), z.numpy())
    np.testing.assert_allclose(torch.stack(out).numpy(), want, rtol=1e-12, atol=1e-12)
