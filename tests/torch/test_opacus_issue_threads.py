"""Problems users reported on the trackers of Opacus and its peers, as privlearn programs.

Each test is the privlearn equivalent of one reported program (the thread is cited in its
docstring). It checks that the engine either does the right thing -- compared with a
naive ground truth: the batch-of-one definition of the clipped sum (conftest.py's
``oracle``), a closed form, or an independent accountant (``dp_accounting``) at the
parameters that actually ran -- or refuses with a typed error before anything is
released. Model-family reports are in test_opacus_reports.py, Opacus's own test suite in
test_opacus_families.py and test_opacus_expected.py, loop patterns in
test_loop_patterns.py.
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
from scipy.optimize import brentq  # noqa: E402
from scipy.stats import norm  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler  # noqa: E402
from toys import toy_data, toy_mlp, trainable  # noqa: E402

from privlearn.errors import ConfigurationError, TrainingLoopError  # noqa: E402
from privlearn.torch import PrivacyAccountant, make_private  # noqa: E402

DELTA = 1e-5


def _private(model, loader, lr=0.1, max_grad_norm=1.0, **kwargs):
    """``make_private`` of ``model`` trained by SGD at ``lr`` on ``loader``, clipping at
    ``max_grad_norm`` (1 unless given)."""
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        loader,
        max_grad_norm=max_grad_norm,
        **kwargs,
    )


def _loop(p, loss_fn=F.cross_entropy, steps=None):
    """The ordinary loop over ``p.data_loader`` (at most ``steps`` batches)."""
    for k, (x, y) in enumerate(p.data_loader):
        if steps is not None and k == steps:
            break
        p.optimizer.zero_grad()
        loss_fn(p.model(x), y).backward()
        p.optimizer.step()


def _dp_accounting_epsilon(event, relation=None) -> float:
    """epsilon at DELTA of ``event`` by dp_accounting's PLD accountant (add/remove) or,
    with ``relation``, its RDP accountant under that neighbouring relation."""
    dp_accounting = pytest.importorskip("dp_accounting")
    if relation is None:
        from dp_accounting.pld import pld_privacy_accountant

        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    else:
        from dp_accounting.rdp import rdp_privacy_accountant

        acc = rdp_privacy_accountant.RdpAccountant(
            neighboring_relation=getattr(dp_accounting.NeighboringRelation, relation)
        )
    acc.compose(event)
    return acc.get_epsilon(DELTA)


# --------------------------------------------------------------------------- accounting
def test_len_of_the_accountant_is_the_number_of_steps():
    """pytorch/opacus#834: ``len(accountant)`` is documented as the number of steps
    taken, but Opacus answered the number of distinct (sigma, q) runs (1 after 100
    steps). Here ``len(p.accountant)`` is the logical steps recorded: 0 before any,
    and it counts every step whether or not the noise changed."""
    model = toy_mlp()
    p = _private(model, DataLoader(toy_data(32), batch_size=8), noise_multiplier=1.0, seed=0)
    assert len(p.accountant) == 0
    _loop(p, steps=3)
    p.noise_multiplier = 2.0
    _loop(p, steps=2)
    assert len(p.accountant.segments) == 2
    assert len(p.accountant) == p.accountant.steps == 5
    acct = PrivacyAccountant(accountant="rdp")
    for _ in range(100):
        acct.record_step(noise_multiplier=1.0, sampling_rate=0.01, max_grad_norm=1.0)
    assert len(acct) == 100


def test_sampling_rate_one_is_the_composed_gaussian_and_a_larger_batch_is_refused():
    """pytorch/opacus#74: ``batch_size`` equal to (or above) the dataset size made the
    RDP computation take ``log(0)``. A batch of the whole dataset is q = 1: T steps are
    the Gaussian mechanism of multiplier sigma / sqrt(T), whose exact epsilon is the
    analytic Gaussian's (Balle & Wang 2018, Theorem 8); a batch above the dataset size
    is refused, naming it."""
    sigma, epochs = 2.0, 6
    model = toy_mlp()
    p = _private(model, DataLoader(toy_data(32), batch_size=32), noise_multiplier=sigma, seed=0)
    assert p.sampling_rate == 1.0
    for _ in range(epochs):
        _loop(p)
    assert p.accountant.steps == epochs
    s = sigma / math.sqrt(epochs)

    def delta_of(eps):
        return norm.cdf(0.5 / s - eps * s) - math.exp(eps) * norm.cdf(-0.5 / s - eps * s)

    exact = brentq(lambda e: delta_of(e) - DELTA, 1e-9, 100.0)
    assert exact <= p.epsilon(DELTA) <= exact * (1 + 1e-6)
    other = toy_mlp()
    with pytest.raises(ConfigurationError, match="batch size 40, 32 examples"):
        _private(other, DataLoader(toy_data(32), batch_size=40), noise_multiplier=sigma)


def test_the_calibrated_noise_does_not_overshoot_the_target_epsilon():
    """pytorch/opacus#346 (and lxuechen/private-transformers#8): the sigma found for a
    target epsilon could give an epsilon above the target. Here the sigma make_private
    calibrates, run for the planned steps, is checked by an independent accountant
    (dp_accounting's PLD, add/remove) at the parameters that ran, and the run refuses
    the step after its plan."""
    dp_accounting = pytest.importorskip("dp_accounting")
    model = toy_mlp()
    p = _private(
        model,
        DataLoader(toy_data(200), batch_size=20),
        target_epsilon=2.0,
        target_delta=DELTA,
        epochs=2,
        seed=0,
    )
    for _ in range(2):
        _loop(p)
    (seg,) = p.accountant.segments
    assert seg.steps == p.plan.planned_steps == 20
    assert p.epsilon(DELTA) <= 2.0
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            seg.sampling_rate, dp_accounting.GaussianDpEvent(seg.noise_multiplier)
        ),
        seg.steps,
    )
    assert _dp_accounting_epsilon(event) <= 2.0 * (1 + 1e-3)  # the peer's discretisation
    with pytest.raises(Exception, match="target_epsilon is a stop"):
        _loop(p, steps=1)
    assert p.accountant.steps == 20


def test_noise_changed_during_training_is_accounted_step_by_step():
    """tensorflow/privacy#132: how to account a noise multiplier that changes during
    training. Here the steps taken at each sigma are recorded as they ran; the run's
    epsilon is that of the composition of both runs of steps by an independent
    accountant (dp_accounting's PLD) -- at least it, and within the peer's
    discretisation of it."""
    dp_accounting = pytest.importorskip("dp_accounting")
    model = toy_mlp()
    p = _private(model, DataLoader(toy_data(64), batch_size=8), noise_multiplier=0.8, seed=0)
    _loop(p, steps=5)
    p.noise_multiplier = 1.6
    _loop(p, steps=7)
    assert [(s.noise_multiplier, s.steps) for s in p.accountant.segments] == [(0.8, 5), (1.6, 7)]
    q = p.sampling_rate
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), k
            )
            for sigma, k in [(0.8, 5), (1.6, 7)]
        ]
    )
    peer = _dp_accounting_epsilon(event)
    assert peer * (1 - 2e-3) <= p.epsilon(DELTA) <= peer * (1 + 2e-3)


def test_fixed_size_batches_are_not_accounted_as_poisson():
    """pytorch/opacus#80: batches of a constant size accounted as Poisson batches
    understate epsilon. ``sampling="fixed"`` draws batches of exactly B, states the
    replace-one relation, and its epsilon is never below the replace-one bound of
    sampling without replacement (Wang, Balle & Kasiviswanathan 2019) that dp_accounting
    computes for the same steps."""
    dp_accounting = pytest.importorskip("dp_accounting")
    model = toy_mlp()
    n, b = 64, 8
    p = _private(
        model, DataLoader(toy_data(n), batch_size=b), noise_multiplier=1.0, sampling="fixed", seed=0
    )
    sizes = []
    for x, y in p.data_loader:
        sizes.append(len(x))
        p.optimizer.zero_grad()
        F.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    assert set(sizes) == {b} and p.neighbouring == "replace_one"
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(n, b, dp_accounting.GaussianDpEvent(1.0)),
        len(sizes),
    )
    assert p.epsilon(DELTA) >= _dp_accounting_epsilon(event, relation="REPLACE_ONE")


def test_asking_for_epsilon_leaves_the_history_alone():
    """pytorch/opacus#535: the GDP accountant's ``get_epsilon`` popped the history, so
    asking twice (e.g. logging every epoch) changed the answer. Here asking, with any
    accountant, leaves the state and the answer as they were."""
    model = toy_mlp()
    p = _private(model, DataLoader(toy_data(32), batch_size=8), noise_multiplier=1.0, seed=0)
    _loop(p)
    state = p.accountant.state_dict()
    first = p.epsilon(DELTA)
    assert p.accountant.epsilon(DELTA, accountant="rdp") >= first
    assert p.epsilon(DELTA) == first and p.accountant.state_dict() == state


# --------------------------------------------------------------------------- the step
def test_the_update_divides_by_the_public_batch_size_not_the_data(oracle):
    """pytorch/opacus#571 and #819 (the normaliser from the private dataset size leaks
    it), #420 (the realised Poisson batch size differs from the divisor). The noise-free
    update here is the batch-of-one clipped sum of the batch drawn divided by the
    loader's batch size B, the same for a dataset and its neighbour with one example
    more, whatever the realised size."""
    for n in (9, 10):
        ds = toy_data(n, spread=True)
        model = toy_mlp().double()
        ref = copy.deepcopy(model)
        p = _private(
            model,
            DataLoader(ds, batch_size=3),
            lr=0.0,
            noise_multiplier=0.0,
            max_grad_norm=0.5,
            seed=n,
        )
        assert p.expected_batch_size == 3.0
        sizes = []
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            F.cross_entropy(p.model(x.double()), y).backward()
            p.optimizer.step()
            sizes.append(len(x))
            if len(x):
                got = torch.cat([q.grad.reshape(-1) for q in trainable(model)])
                want, _ = oracle.clipped_sum(ref, x.double(), y, 0.5)
                torch.testing.assert_close(got, want / 3.0, rtol=1e-9, atol=1e-12)
        assert len(set(sizes)) > 1  # the realised sizes varied, the divisor did not


def test_zero_grad_between_forward_and_backward_with_a_frozen_first_layer(oracle):
    """pytorch/opacus#409: ``optimizer.zero_grad()`` called between the forward and the
    backward pass, with the first layer frozen, raised Opacus's accumulation error.
    Here it trains, and the clipped sum is the batch-of-one definition's over the
    trainable parameters."""
    ds = toy_data(16, spread=True)
    model = toy_mlp().double()
    for q in model[0].parameters():
        q.requires_grad_(False)
    ref = copy.deepcopy(model)
    p = _private(
        model,
        DataLoader(ds, batch_size=16),
        lr=0.0,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        sampling="fixed",
    )
    for x, y in p.data_loader:
        out = p.model(x.double())
        p.optimizer.zero_grad()
        F.cross_entropy(out, y).backward()
        p.optimizer.step()
        want, _ = oracle.clipped_sum(ref, x.double(), y, 0.3)
        got = oracle.flat(q.grad for q in oracle.trainable(model)) * 16
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert p.accountant.steps == 1


def test_a_second_backward_before_the_step_is_refused_before_any_release():
    """pytorch/opacus#413 (two backward passes on two batches, then one step) and #683
    (gradient accumulation with ghost clipping divided by one batch's size): with
    Poisson batches, two micro-batches summed into one step clip example i of each
    together and are accounted as one batch of rate q. Here the second backward() is
    refused, naming max_physical_batch_size; no step is taken or accounted."""
    model = toy_mlp()
    before = [q.detach().clone() for q in model.parameters()]
    p = _private(model, DataLoader(toy_data(64), batch_size=8), noise_multiplier=1.0, seed=0)
    batches = iter(p.data_loader)
    x, y = next(batches)
    F.cross_entropy(p.model(x), y).backward()
    x, y = next(batches)
    with pytest.raises(TrainingLoopError, match="max_physical_batch_size"):
        F.cross_entropy(p.model(x), y).backward()
    assert p.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_gradient_penalty_through_the_private_model_is_refused():
    """pytorch/opacus#31 (WGAN-GP: several backward passes through the discriminator).
    A gradient penalty differentiates the model's gradient with respect to its inputs,
    which per-layer per-example gradients do not cover; it is refused saying so, and
    nothing is released."""
    torch.manual_seed(0)
    real, fake, mix = torch.randn(8, 3), torch.randn(8, 3), torch.rand(8, 1)
    critic = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    p = _private(
        critic,
        DataLoader(TensorDataset(real, fake, mix), batch_size=8),
        noise_multiplier=1.0,
        sampling="fixed",
    )
    for r, f, a in p.data_loader:
        p.optimizer.zero_grad()
        between = (a * r + (1 - a) * f).requires_grad_(True)
        (g,) = torch.autograd.grad(p.model(between).sum(), between, create_graph=True)
        loss = (p.model(f) - p.model(r)).mean() + 10 * ((g.norm(dim=1) - 1) ** 2).mean()
        with pytest.raises(TrainingLoopError, match="gradient penalty"):
            loss.backward()
    assert p.accountant.steps == 0


def test_a_teacher_model_in_the_loss_keeps_the_definition(oracle):
    """pytorch/opacus#636 (knowledge distillation: a frozen teacher's outputs in the
    student's loss). The teacher is not private and not trained; the student's clipped
    sum is the batch-of-one definition's of the distillation loss."""
    ds = toy_data(16, spread=True, dtype=torch.float64)
    teacher = toy_mlp(seed=5).double().eval()
    student = toy_mlp().double()
    ref = copy.deepcopy(student)

    def loss_fn(out, x, y):
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
        return F.kl_div(out.log_softmax(-1), soft, reduction="batchmean") + F.cross_entropy(out, y)

    p = _private(
        student,
        DataLoader(ds, batch_size=16),
        lr=0.0,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        sampling="fixed",
    )
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        loss_fn(p.model(x), x, y).backward()
        p.optimizer.step()
        rows = oracle.grads(
            lambda i, x=x, y=y: loss_fn(ref(x[i : i + 1]), x[i : i + 1], y[i : i + 1]),
            16,
            oracle.trainable(ref),
        )
        want, _ = oracle.clip_and_sum(rows, 0.3)
        got = oracle.flat(q.grad for q in oracle.trainable(student)) * 16
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_second_engine_on_the_same_model_is_refused_and_rounds_detach():
    """pytorch/opacus#608 and #636 ("Trying to add hooks twice to the same model": a
    federated client privatising the same model each round). A second make_private on
    an attached model is refused, saying to detach; rounds that detach train, each
    round's run accounting its own steps."""
    model = toy_mlp()
    loader = DataLoader(toy_data(32), batch_size=8)
    p = _private(model, loader, noise_multiplier=1.0, seed=0)
    with pytest.raises(ConfigurationError, match="detach"):
        _private(model, loader, noise_multiplier=1.0)
    for round_ in range(2):
        _loop(p)
        assert p.accountant.steps == len(p.data_loader)
        model = p.detach()
        p = _private(model, loader, noise_multiplier=1.0, seed=round_ + 1)
        assert p.accountant.steps == 0


def test_no_clipping_with_noise_is_refused():
    """pytorch/opacus#177 (noise without clipping, ``max_grad_norm=inf``): the
    sensitivity is unbounded, so no noise scale is private; refused with noise, and
    recorded with epsilon inf when the run adds none."""
    model = toy_mlp()
    with pytest.raises(ConfigurationError, match="max_grad_norm=inf"):
        _private(
            model,
            DataLoader(toy_data(32), batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=math.inf,
        )
    p = _private(
        model,
        DataLoader(toy_data(32), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=math.inf,
        seed=0,
    )
    _loop(p, steps=1)
    assert p.epsilon(DELTA) == math.inf


def test_the_noise_is_calibrated_to_the_sum_and_divided_with_it():
    """google-deepmind/jax_privacy#383 (noise calibrated to the clipped sum's
    sensitivity but added to the mean, i.e. ``B`` times too little). With zero
    gradients the update is the noise alone: ``lr * N(0, (sigma C)^2) / B`` per
    coordinate, B the expected batch size; the sample standard deviation of 20,000
    coordinates is checked against ``sigma C / B`` (its relative standard error is 0.5%)."""
    sigma, bound, b = 1.5, 0.7, 10
    layer = nn.Linear(400, 50, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    data = TensorDataset(torch.randn(100, 400), torch.zeros(100))
    p = _private(
        layer,
        DataLoader(data, batch_size=b),
        lr=1.0,
        noise_multiplier=sigma,
        max_grad_norm=bound,
        seed=7,
    )
    x, _ = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    (p.model(x) * 0.0).sum().backward()
    p.optimizer.step()
    std = layer.weight.detach().double().std().item()
    assert abs(std / (sigma * bound / b) - 1) < 0.03
    assert p.accountant.segments[0].noise_multiplier == sigma


# --------------------------------------------------------------------------- loop misuse
def test_a_sampler_that_cannot_be_accounted_is_refused_not_dropped():
    """pytorch/opacus#600: a ``WeightedRandomSampler`` on the loader was silently
    replaced by make_private. Here a sampler the accountant cannot describe (weighted
    with replacement, shuffled permutations) is refused, naming it, before anything is
    built."""
    data = toy_data(64)
    for loader, name in [
        (
            DataLoader(data, batch_size=8, sampler=WeightedRandomSampler(torch.rand(64), 64)),
            "WeightedRandomSampler",
        ),
        (DataLoader(data, batch_size=8, shuffle=True), "RandomSampler"),
    ]:
        model = toy_mlp()
        with pytest.raises(ConfigurationError, match=name):
            _private(model, loader, noise_multiplier=1.0)


def test_training_on_the_loader_given_instead_of_p_data_loader_is_refused():
    """pytorch/opacus#308 (the tutorial iterated the data loader it had passed in, not
    the one make_private returned, so its batches were not the Poisson batches
    accounted). Here a step on a batch that did not come from ``p.data_loader`` is
    refused before anything is released or accounted."""
    model = toy_mlp()
    before = [q.detach().clone() for q in model.parameters()]
    loader = DataLoader(toy_data(64), batch_size=8)
    p = _private(model, loader, noise_multiplier=1.0, seed=0)
    x, y = next(iter(loader))
    p.optimizer.zero_grad()
    F.cross_entropy(p.model(x), y).backward()
    with pytest.raises(TrainingLoopError, match="p.data_loader"):
        p.optimizer.step()
    assert p.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_forward_through_another_copy_of_the_model_is_refused():
    """pytorch/opacus#313 (the Lightning example ran its forward pass through the
    non-private model, so max_grad_norm and noise_multiplier had no effect). Here a
    step whose loss came from another model than ``p.model`` has no per-example
    gradients and is refused before anything is released."""
    model = toy_mlp()
    other = copy.deepcopy(model)
    before = [q.detach().clone() for q in model.parameters()]
    p = _private(model, DataLoader(toy_data(64), batch_size=16), noise_multiplier=1.0, seed=0)
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    F.cross_entropy(other(x), y).backward()
    with pytest.raises(TrainingLoopError, match="another model than p.model"):
        p.optimizer.step()
    assert p.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
