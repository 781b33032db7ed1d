"""make_private runs: what ran must be what is accounted.

Each test reproduces a way ordinary use made the accountant describe something other
than what ran (gradient accumulation, a noise schedule, resuming, token-mean losses,
samplers the accountant cannot describe) and checks that it is now handled exactly or
refused before anything is released.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import toy_data  # noqa: E402
from train_loops import train_steps as _train  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import (  # noqa: E402
    ConfigurationError,
    PrivacyBudgetExceededError,
    TrainingLoopError,
)
from privlearn.torch import (  # noqa: E402
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    PrivacyBudgetWarning,
    make_private,
    per_sequence_cross_entropy,
)


def _mlp(seed=0, d=6, k=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, k))


def _private(model=None, ds=None, batch_size=8, **kw):
    model = model if model is not None else _mlp()
    ds = ds if ds is not None else toy_data()
    kw.setdefault("noise_multiplier", 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return make_private(model, opt, DataLoader(ds, batch_size=batch_size), **kw)


def _flat(model):
    return torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()])


# ------------------------------------------------------------------ accumulation


def test_second_backward_before_step_is_refused():
    """Two micro-batches backward()ed before one step(): example i of each would be
    summed and clipped as one example (sensitivity 2C). Refused, naming the option that
    does it right."""
    p = _private(max_grad_norm=0.1)
    it = iter(p.data_loader)
    x1, y1 = next(it)
    x2, y2 = next(it)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x1), y1).backward()
    with pytest.raises(RuntimeError, match="max_physical_batch_size"):
        nn.functional.cross_entropy(p.model(x2), y2).backward()
    assert p.accountant.steps == 0


def _virtual_fixed_run(ds, C, lr):
    """A noiseless run on ``ds`` in logical batches of 10 (fixed size, seed 1) in chunks
    of 3: ``(ds, model, its copy, the PrivateTraining, the first logical batch's
    indices)`` (a sampler with the same seed draws them)."""
    model = _mlp(seed=3)
    ref = copy.deepcopy(model)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                     DataLoader(ds, batch_size=10), noise_multiplier=0.0,
                     max_grad_norm=C, max_physical_batch_size=3, sampling="fixed", seed=1)
    return ds, model, ref, p, next(iter(FixedSizeBatchSampler(len(ds), 10, seed=1)))


def test_accumulation_via_virtual_batches_equals_naive_per_example_loop(oracle):
    """The supported way (max_physical_batch_size) equals clipping each example on its
    own (a loop of batch-size-1 backward passes) and summing, in float64."""
    torch.set_default_dtype(torch.float64)
    try:
        C, lr = 0.05, 0.5
        ds, model, ref, p, batch = _virtual_fixed_run(toy_data(n=40), C, lr)
        x_all, y_all = ds.tensors
        for x, y in p.data_loader:  # ... which the loader draws again, in 4 chunks
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if p.accountant.steps == 1:
                break
        oracle.step(ref, x_all[batch], y_all[batch], C, lr, 10)
        torch.testing.assert_close(_flat(model), _flat(ref), rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------ noise schedule


def test_noise_change_mid_run_is_a_new_segment():
    p = _private(noise_multiplier=1.1, max_grad_norm=1.0, seed=0)
    _train(p, 3)
    p.optimizer.noise_multiplier = 0.3
    _train(p, 2)
    segs = p.accountant.segments
    assert [(s.noise_multiplier, s.steps) for s in segs] == [(1.1, 3), (0.3, 2)]
    both = compose([subsample(Gaussian(1.1), rate=8 / 64), subsample(Gaussian(0.3), rate=8 / 64)],
                   steps=[3, 2])
    assert p.accountant.mechanism() == both
    assert p.epsilon(1e-5) == both.epsilon(1e-5)
    old = compose(subsample(Gaussian(1.1), rate=8 / 64), steps=5).epsilon(1e-5)
    assert p.epsilon(1e-5) > old  # what the accountant used to report
    assert p.noise_multiplier == 0.3  # one source of truth
    p.noise_multiplier = 0.5  # the same value, set through the PrivateTraining
    _train(p, 1)
    assert p.accountant.segments[-1] == type(segs[0])(0.5, 8 / 64, 1.0, 1)


def test_epsilon_without_delta_is_at_the_runs_target_delta():
    # p.epsilon() reads at the delta the run was calibrated and capped at (as
    # DPTrainer.epsilon() does), not a TypeError
    for delta in (1e-5, 1e-7):
        p = _private(noise_multiplier=None, target_epsilon=2.0, target_delta=delta, epochs=1,
                     seed=0)
        _train(p, 3)
        ran = compose(subsample(Gaussian(p.noise_multiplier), rate=8 / 64), steps=3)
        assert p.epsilon() == p.epsilon(delta) == ran.epsilon(delta)


def test_noise_change_changes_the_noise_actually_added():
    """The value the accountant records is the one the step uses: measured noise std."""
    model = nn.Linear(100, 200)
    ds = TensorDataset(torch.randn(1000, 100), torch.zeros(1000))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=50), noise_multiplier=2.0, max_grad_norm=0.3,
                     seed=0)
    stds = []
    for sigma in (2.0, 0.5):
        p.optimizer.noise_multiplier = sigma
        x, _ = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        (p.model(x).sum() * 0).backward()  # a zero loss: the gradient is the noise alone
        p.optimizer.step()
        stds.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).std().item())
    assert stds[0] / (2.0 * 0.3 / 50) == pytest.approx(1, abs=0.05)
    assert stds[1] / (0.5 * 0.3 / 50) == pytest.approx(1, abs=0.05)
    assert [s.noise_multiplier for s in p.accountant.segments] == [2.0, 0.5]


def test_max_grad_norm_change_recorded_and_sampling_rate_refused():
    p = _private(noise_multiplier=1.0, max_grad_norm=1.0)
    _train(p, 2)
    p.optimizer.max_grad_norm = 0.5
    _train(p, 1)
    assert [(s.max_grad_norm, s.steps) for s in p.accountant.segments] == [(1.0, 2), (0.5, 1)]
    with pytest.raises(AttributeError, match="sampling_rate cannot be changed"):
        p.data_loader.batch_sampler.sampling_rate = 0.5
    with pytest.raises(AttributeError, match="sampling_rate cannot be changed"):
        p.sampling_rate = 0.5
    with pytest.raises(ValueError, match="noise_multiplier"):
        p.optimizer.noise_multiplier = -1.0
    with pytest.raises(ValueError, match="max_grad_norm=inf"):
        p.optimizer.max_grad_norm = float("inf")


def test_max_grad_norm_cannot_change_between_the_chunks_of_a_logical_batch(oracle):
    """With virtual batches ``step()`` runs once per physical chunk, so a clipping
    schedule set after every ``step()`` (or in a step pre-hook) changed the bound in the
    middle of a logical batch: the earlier chunks were clipped at the old bound while the
    noise and the accountant used the new one (a lower bound: noise for a smaller
    sensitivity than the sum had). Refused; the batch is clipped, noised and recorded at
    the one bound, equal to the naive per-example loop; changing it after the logical
    batch is recorded for the next step."""
    torch.set_default_dtype(torch.float64)
    try:
        ds = toy_data(n=40)
        ds.tensors[0][:] *= 50  # every example's gradient is clipped
        C, lr = 1.0, 0.5
        ds, model, ref, p, batch = _virtual_fixed_run(ds, C, lr)
        refused = 0
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if p.accountant.steps == 1:
                break
            with pytest.raises(TrainingLoopError, match="between the physical chunks"):
                p.optimizer.max_grad_norm = 0.01
            refused += 1
            assert p.optimizer.max_grad_norm == C
        assert refused == 3  # 10 examples in chunks of 3: three chunks before the last
        x_all, y_all = ds.tensors
        oracle.step(ref, x_all[batch], y_all[batch], C, lr, 10)
        torch.testing.assert_close(_flat(model), _flat(ref), rtol=1e-10, atol=1e-12)
        assert p.accountant.segments[-1].max_grad_norm == C
        # a step pre-hook runs before the last chunk is clipped: refused the same way
        handle = p.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: setattr(opt, "max_grad_norm", 0.01))
        with pytest.raises(TrainingLoopError, match="between the physical chunks"):
            _train(p, 4)  # the fourth step() ends the next logical batch of 10
        handle.remove()
        assert p.accountant.steps == 1 and p.optimizer.max_grad_norm == C
        # between logical batches the change is the next step's bound, and recorded
        model2 = _mlp()
        p2 = make_private(model2, torch.optim.SGD(model2.parameters(), lr=lr),
                          DataLoader(ds, batch_size=10), noise_multiplier=1.0,
                          max_grad_norm=C, max_physical_batch_size=3, seed=2)
        for x, y in p2.data_loader:
            p2.optimizer.zero_grad()
            nn.functional.cross_entropy(p2.model(x), y).backward()
            steps = p2.accountant.steps
            p2.optimizer.step()
            if p2.accountant.steps > steps:  # a logical batch ended: change it now
                p2.optimizer.max_grad_norm = 0.5 if steps == 0 else 0.25
        assert [(s.max_grad_norm, s.steps) for s in p2.accountant.segments] == [
            (C, 1), (0.5, 1), (0.25, 2)]  # 40 examples, logical batches of 10
    finally:
        torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------ resume


def _run(total, save_at=None, seed=11, state=None, mid_epoch=False, device="cpu"):
    """Train ``total`` steps on ``device`` (from ``state`` if given); returns (p, state
    at save_at)."""
    model = _mlp(seed=2).to(device)
    p = _private(model=model, noise_multiplier=0.9, max_grad_norm=0.5, seed=seed,
                 batch_size=8)
    if state is not None:
        p.load_state_dict(state)
    saved = None
    done = p.accountant.steps
    loss_fn = nn.CrossEntropyLoss()
    while done < total:
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            loss_fn(p.model(x.to(device)), y.to(device)).backward()
            p.optimizer.step()
            done += 1
            if done == save_at:
                saved = copy.deepcopy(p.state_dict())
            if done == total:
                break
    return p, saved


@pytest.mark.parametrize("save_at", [8, 11])  # an epoch boundary (8 steps/epoch), mid-epoch
def test_resume_equals_uninterrupted_run(save_at, tmp_path):
    full, saved = _run(total=20, save_at=save_at)
    torch.save(saved, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed, _ = _run(total=20, state=state)
    assert resumed.accountant.steps == full.accountant.steps == 20
    assert abs(resumed.epsilon(1e-5) - full.epsilon(1e-5)) <= 1e-9
    # same batches and same noise: the parameters agree bit for bit
    assert torch.equal(_flat(resumed.model), _flat(full.model))
    # the interrupted-and-rebuilt run without loading replays other batches
    restarted, _ = _run(total=20 - save_at)
    assert restarted.accountant.steps == 20 - save_at


def test_resume_refuses_other_mechanism_and_used_run():
    p, saved = _run(total=3, save_at=3)
    other = _private(model=_mlp(seed=2), noise_multiplier=0.8, max_grad_norm=0.5, seed=11)
    with pytest.raises(ValueError, match="noise_multiplier"):
        other.load_state_dict(saved)
    other = _private(model=_mlp(seed=2), noise_multiplier=0.9, max_grad_norm=0.5, seed=11,
                     batch_size=16)
    with pytest.raises(ValueError, match="sampling_rate"):
        other.load_state_dict(saved)
    used, _ = _run(total=1)
    with pytest.raises(ValueError, match="fresh run"):
        used.load_state_dict(saved)
    with pytest.raises(ValueError, match="not a privlearn training state"):
        used.load_state_dict({"model": {}})


def test_target_epsilon_is_a_stop_by_default():
    """make_private(target_epsilon=3, epochs=1) and a loop of 3 epochs (the two epoch
    counts disagree): the step that would take epsilon past 3 is refused before it runs,
    saying how to go further; nothing of it is released."""
    ds = toy_data(n=64)
    p = _private(ds=ds, noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5,
                 epochs=1, max_grad_norm=1.0, seed=0)
    with pytest.raises(PrivacyBudgetExceededError, match=r"max_epsilon=float\('inf'\)"):
        _train(p, 3 * 8)
    k = p.accountant.steps
    assert k >= 8  # the planned epoch ran
    assert p.epsilon(1e-5) <= 3.0
    one_more = compose(subsample(Gaussian(p.noise_multiplier), rate=8 / 64),
                       steps=k + 1).epsilon(1e-5)
    assert one_more > 3.0  # the refused step was the one that would exceed the target
    before = _flat(p.model)
    with pytest.raises(PrivacyBudgetExceededError):
        _train(p, 1)
    assert torch.equal(before, _flat(p.model)) and p.accountant.steps == k


@pytest.mark.parametrize("lowered_to,cause", [
    (0.0, r"noise_multiplier=0: a step without noise has an infinite epsilon"),
    ("half", r"noise_multiplier .*below the run's .*lowered during the run.* after 3 of the "
             r"planned 8 steps"),
])
def test_a_refusal_after_the_noise_was_lowered_names_that_cause(lowered_to, cause):
    """A planned run whose noise multiplier is lowered (to 0, or below the plan's) after 3
    of its 8 planned steps runs out of budget early: the refusal says that, not that the
    loop ran longer than planned; nothing of the refused step is released."""
    p = _private(ds=toy_data(n=64), noise_multiplier=None, target_epsilon=3.0,
                 target_delta=1e-5, epochs=1, max_grad_norm=1.0, seed=0)
    _train(p, 3)
    sigma = p.noise_multiplier
    p.optimizer.noise_multiplier = sigma / 2 if lowered_to == "half" else lowered_to
    before = _flat(p.model)
    with pytest.raises(PrivacyBudgetExceededError, match=cause) as info:
        _train(p, 8)
    assert "ran longer" not in str(info.value)
    k = p.accountant.steps
    assert 3 <= k < 8 and p.epsilon(1e-5) <= 3.0
    if lowered_to == 0.0:  # refused at once; back at the plan's noise, the plan runs
        assert k == 3 and torch.equal(before, _flat(p.model))
        p.optimizer.noise_multiplier = sigma
        _train(p, 5)
        assert p.accountant.steps == 8


def test_going_past_the_target_is_one_explicit_setting_in_make_private_and_dptrainer():
    from privlearn.errors import ParameterValueError
    from privlearn.torch.config import DPConfig

    assert DPConfig(target_epsilon=3.0, epochs=1).max_epsilon == 3.0
    assert DPConfig(target_epsilon=3.0, epochs=1, max_epsilon=5.0).max_epsilon == 5.0
    assert DPConfig(noise_multiplier=1.0).max_epsilon is None
    assert math.isinf(DPConfig(target_epsilon=3.0, epochs=1,
                               max_epsilon=float("inf")).max_epsilon)
    with pytest.raises(ParameterValueError, match="max_epsilon"):
        DPConfig(target_epsilon=3.0, epochs=1, max_epsilon=0.0)
    pytest.importorskip("transformers")
    from privlearn.torch.hf import PrivacyArguments

    pa = PrivacyArguments(target_epsilon=3.0, max_epsilon=float("inf"))
    assert math.isinf(DPConfig(**pa.engine_settings(steps=4)).max_epsilon)
    pa = PrivacyArguments(target_epsilon=3.0)
    assert DPConfig(**pa.engine_settings(steps=4)).max_epsilon == 3.0


def test_planned_epsilon_warns_once_and_max_epsilon_stops_before_the_step():
    ds = toy_data(n=64)
    p = _private(ds=ds, noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5,
                 epochs=1, max_grad_norm=1.0, seed=0, max_epsilon=float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyBudgetWarning)
        _train(p, 8)  # the planned epoch: no warning
    assert p.epsilon(1e-5) <= 3.0
    with pytest.warns(PrivacyBudgetWarning, match="planned epsilon 3"):
        _train(p, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyBudgetWarning)
        _train(p, 2)  # only once
    # hard cap: the step that would exceed max_epsilon is refused before it runs
    q = _private(ds=ds, noise_multiplier=1.0, max_grad_norm=1.0, max_epsilon=4.0, seed=0)
    with pytest.raises(PrivacyBudgetExceededError, match="max_epsilon=4"):
        _train(q, 10_000)
    k = q.accountant.steps
    before = _flat(q.model)
    assert q.epsilon(1e-5) <= 4.0
    one_more = compose(subsample(Gaussian(1.0), rate=8 / 64), steps=k + 1).epsilon(1e-5)
    assert one_more > 4.0
    with pytest.raises(PrivacyBudgetExceededError):
        _train(q, 1)
    assert torch.equal(before, _flat(q.model)) and q.accountant.steps == k



def test_a_planned_run_without_noise_plans_an_infinite_epsilon():
    """Steps without noise release their gradients as they are: the plan says epsilon
    is infinite (None is kept for a run with no planned length), and training past the
    planned epoch does not warn of going past an infinite plan."""
    ds = toy_data(n=64)
    p = _private(ds=ds, noise_multiplier=0.0, epochs=1, seed=0)
    assert p.plan.planned_epsilon == math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyBudgetWarning)
        _train(p, 12)  # past the planned 8 steps
    assert p.epsilon(1e-5) == math.inf
    assert _private(ds=ds, noise_multiplier=0.0).plan.planned_epsilon is None
    assert _private(ds=ds, noise_multiplier=1.0).plan.planned_epsilon is None


@pytest.mark.parametrize("name", ["noise_multiplier", "max_grad_norm"])
def test_a_one_element_tensor_is_read_as_its_number_by_make_private_and_the_setter(name):
    """A schedule computing with tensors gives a 0-d tensor: make_private reads it as
    its optimizer's setter does; a tensor of several values is refused by both."""
    p = _private(**{name: torch.tensor(0.5)})
    assert getattr(p.optimizer, name) == 0.5 and type(getattr(p.optimizer, name)) is float
    setattr(p.optimizer, name, torch.tensor([0.7]))
    assert getattr(p.optimizer, name) == pytest.approx(0.7)
    bad = torch.tensor([0.5, 0.5])
    with pytest.raises(TypeError, match=name):
        _private(**{name: bad})
    with pytest.raises(TypeError, match=name):
        setattr(p.optimizer, name, bad)


# ------------------------------------------------------------------ samplers


@pytest.mark.parametrize("make_loader", [
    lambda ds: DataLoader(ds, batch_size=8, shuffle=True),
    lambda ds: DataLoader(ds, batch_size=8, sampler=torch.utils.data.WeightedRandomSampler(
        torch.ones(len(ds)), len(ds))),
    lambda ds: DataLoader(ds, batch_size=8, sampler=torch.utils.data.SubsetRandomSampler(
        range(32))),
    lambda ds: DataLoader(ds, batch_size=8, sampler=list(range(len(ds)))),
    lambda ds: DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(ds), 8, False)),
    lambda ds: DataLoader(ds, batch_sampler=FixedSizeBatchSampler(len(ds), 8)),
], ids=["shuffle", "weighted", "subset-random", "custom", "custom-batch", "fixed-as-poisson"])
def test_unaccountable_samplers_refused_before_training(make_loader):
    ds = toy_data()
    model = _mlp()
    before = _flat(model)
    with pytest.raises(ValueError, match="sampling='poisson'"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(ds),
                     noise_multiplier=1.0)
    assert torch.equal(before, _flat(model))


@pytest.mark.parametrize("replacement", [True, False])
def test_random_sampler_refusal_names_what_was_passed(replacement):
    """A loader built with sampler=RandomSampler(ds, replacement=...) is refused in the
    terms the user wrote (the sampler class and its flag), not as shuffle=True, with the
    accounted samplings to use instead."""
    ds = toy_data()
    model = _mlp()
    loader = DataLoader(ds, batch_size=8, sampler=torch.utils.data.RandomSampler(
        ds, replacement=replacement))
    with pytest.raises(ConfigurationError) as info:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     noise_multiplier=1.0)
    msg = str(info.value)
    assert f"sampler=RandomSampler(replacement={replacement})" in msg
    assert "sampling='poisson'" in msg and "sampling='fixed'" in msg
    if replacement:
        assert "shuffle=True" not in msg and "with replacement" in msg


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(toy_data())


class _NoLength(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return toy_data()[i]


@pytest.mark.parametrize("dataset, error", [(_Stream(), ValueError),
                                            (_NoLength(), TypeError)],
                         ids=["iterable", "no-len"])
def test_a_dataset_without_random_access_or_length_is_refused_by_name(dataset, error):
    """No sampling rate can be set for a stream or a dataset without a length: refused
    with a typed error naming the dataset (it was a bare ``TypeError: object of type
    ... has no len()`` from inside the planning), and the model is left as it was."""
    model = _mlp()
    before = _flat(model)
    with pytest.raises(error, match=type(dataset).__name__) as info:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(dataset, batch_size=8), noise_multiplier=1.0)
    assert "map-style" in str(info.value)
    assert torch.equal(before, _flat(model)) and not model[0]._forward_hooks


def test_accepted_samplers_and_recorded_rate():
    ds = toy_data(n=64)
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_sampler=PoissonBatchSampler(64, 0.25)),
                     noise_multiplier=1.0)
    assert p.sampling_rate == 0.25
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=16), noise_multiplier=1.0)
    _train(p, 5)
    assert [(s.sampling_rate, s.steps) for s in p.accountant.segments] == [(0.25, 5)]


@pytest.mark.parametrize("sampling,warns", [("poisson", True), ("cyclic_poisson", True),
                                             ("fixed", False)])
def test_drop_last_is_named_where_it_cannot_apply(sampling, warns):
    """``drop_last=True`` is not silently ignored: under a sampling of random batch sizes
    (the Poisson family) make_private says it does not apply, and every batch, whatever
    its size, is trained on; fixed-size batches are what drop_last asks for."""
    model = _mlp()
    loader = DataLoader(toy_data(n=64), batch_size=8, drop_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                         noise_multiplier=1.0, sampling=sampling, seed=0, steps=40)
    named = [w for w in caught if "drop_last" in str(w.message)]
    assert len(named) == int(warns)
    if warns:
        assert issubclass(named[0].category, UserWarning)
        assert named[0].filename == __file__  # points at the make_private call
        assert "random" in str(named[0].message) and repr(sampling) in str(named[0].message)
        sizes = [len(y) for _, (_, y) in zip(range(40), p.data_loader, strict=False)]
        assert len(set(sizes)) > 1  # not all batches of 8: nothing dropped or padded


@pytest.mark.parametrize("seed,warns", [(None, True), (3, False)])
def test_a_loader_generator_without_seed_is_named(seed, warns):
    """``DataLoader(..., generator=torch.Generator().manual_seed(0))`` draws no batch of
    the DP run (the DP sampler draws them, from ``seed=`` or the OS's entropy): a loop
    that sets it to repeat a run is told to pass ``seed=`` instead; with a seed, the batches
    repeat and nothing is said."""
    runs = []
    for _ in range(2):
        model = _mlp()
        loader = DataLoader(toy_data(n=64), batch_size=8,
                            generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                             noise_multiplier=1.0, seed=seed)
        named = [w for w in caught if "generator" in str(w.message)]
        assert len(named) == int(warns)
        if warns:
            assert named[0].filename == __file__ and "seed=" in str(named[0].message)
        runs.append([y.tolist() for _, y in p.data_loader])
    assert (runs[0] == runs[1]) is (seed is not None)


@pytest.mark.parametrize("sampler,sampling,match", [
    (lambda: PoissonBatchSampler(32, 0.25), "poisson", r"num_samples=32 \(the dataset has 64"),
    (lambda: PoissonBatchSampler(64, 0.25, indices=range(10)), "poisson",
     r"indices=.*Subset\(dataset, indices\)"),
    (lambda: PoissonBatchSampler(64, 0.25, secure=True), "poisson", "secure_mode=True"),
    (lambda: PoissonBatchSampler(64, 0.25, steps=10), "poisson",
     r"steps=10 \(the run's epoch is 4 steps"),
    (lambda: FixedSizeBatchSampler(128, 8), "fixed", "num_samples=128"),
], ids=["num_samples", "indices", "secure", "steps", "fixed-num_samples"])
def test_a_given_dp_sampler_is_not_silently_rebuilt_without_its_settings(sampler, sampling,
                                                                        match):
    """make_private rebuilds a given sampler from its rate over the whole dataset: its
    subset of indices (the training split), another dataset size, secure sampling or
    epoch length were silently dropped (the run sampled from held-out examples, or with
    the seeded generator). Now refused before anything, naming the setting."""
    from privlearn.errors import ConfigurationError

    model = _mlp()
    with pytest.raises(ConfigurationError, match=match):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=64), batch_sampler=sampler()), noise_multiplier=1.0,
                     sampling=sampling)


def test_training_on_another_loader_is_refused():
    """Batches that did not come from p.data_loader are not what is accounted."""
    ds = toy_data()
    plain = DataLoader(ds, batch_size=8)
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), plain,
                     noise_multiplier=1.0)
    x, y = next(iter(plain))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(TrainingLoopError, match="without a new batch from p.data_loader"):
        p.optimizer.step()
    assert p.accountant.steps == 0


# ------------------------------------------------------------------ token-mean losses


def _tiny_causal_lm():
    """A config-initialised GPT-2 (no weights are downloaded), float64. (Llama's RMSNorm
    rounds through float32 by design, which rules out a 1e-10 comparison.)"""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double()


def _lm(model, ids, mask):
    pos = torch.arange(ids.shape[1]).expand_as(ids)  # per-example position ids
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def _padded_batch(b=6, t=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (b, t), generator=g)
    lengths = torch.tensor([10, 3, 7, 10, 5, 2])[:b]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def test_hf_token_level_labels_refused_before_any_step():
    model = _tiny_causal_lm()
    ids, mask, labels = _padded_batch()
    ds = TensorDataset(ids, mask, labels)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=3), noise_multiplier=1.0)
    # a fixed non-empty batch: a Poisson batch of this 6-row set is empty 1 time in 64
    x, m, y = ids[:3], mask[:3], labels[:3]
    with pytest.raises(ValueError, match="per_sequence_cross_entropy"):
        p.model(input_ids=x, attention_mask=m, labels=y)
    # sequence-level labels (B,) are a mean over examples: allowed
    assert p.model(input_ids=x, attention_mask=m).logits.shape[0] == len(x)
    assert p.accountant.steps == 0


def test_per_sequence_loss_with_padding_equals_naive_loop(oracle):
    """Per-sequence token-mean loss on a padded causal LM batch: the engine's clipped sum
    equals a loop of batch-size-1 backward passes (float64)."""
    model = _tiny_causal_lm()
    ref = copy.deepcopy(model)
    ids, mask, labels = _padded_batch()
    rows = oracle.grads(lambda i: per_sequence_cross_entropy(
        _lm(ref, ids[i:i + 1], mask[i:i + 1]), labels[i:i + 1], shift=True), len(ids),
        oracle.trainable(ref))
    C = rows.norm(dim=1).median().item()  # clips about half the examples
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(ids, mask, labels), batch_size=6),
                     noise_multiplier=0.0, max_grad_norm=C)
    p.optimizer._sampler = None  # this test feeds the whole batch itself
    p.optimizer.zero_grad()
    per_sequence_cross_entropy(_lm(p.model, ids, mask), labels, shift=True).backward()
    p.optimizer.clip_and_accumulate()
    p.optimizer.add_noise()  # noise 0: p.grad is the clipped sum
    got = {id(q): q.grad for q in model.parameters() if q.grad is not None}
    total, norms = oracle.clip_and_sum(rows, C)
    assert 0 < (norms > C).sum() < len(ids)
    torch.testing.assert_close(
        oracle.flat(got.get(id(q), torch.zeros_like(q)) for q in model.parameters()),
        total / 6, rtol=1e-10, atol=1e-12)


def test_per_sequence_cross_entropy_matches_definition():
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 4, 4, 4, 4], [-100] * 5])
    got = per_sequence_cross_entropy(logits, labels, reduction="none")
    for i in range(3):
        keep = labels[i] != -100
        want = (nn.functional.cross_entropy(logits[i][keep], labels[i][keep])
                if keep.any() else torch.tensor(0.0, dtype=torch.float64))
        torch.testing.assert_close(got[i], want.double())
    assert per_sequence_cross_entropy(logits, labels).item() == pytest.approx(
        got.sum().item() / 3)
    with pytest.raises(ValueError, match="logits must be"):
        per_sequence_cross_entropy(logits[0], labels)


# ------------------------------------------------------------------ non-finite inputs


@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_a_nan_input_is_named_not_reported_as_mixing_or_overflow(first):
    """A NaN in one example's features was reported as batch mixing (first step, where
    the probe runs) or as a GradScaler overflow (no scaler in use) and the example
    silently dropped. Now the input and the row are named, and no step is taken."""
    from privlearn.errors import NonFiniteInputError

    x, y = toy_data(n=48).tensors
    x = x.clone()
    p = _private(ds=TensorDataset(x, y), batch_size=48, sampling="fixed", seed=0)
    if not first:
        _train(p, 1)
    x[30, 2] = float("nan")  # every batch holds example 30
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    before, steps = _flat(p.model), p.accountant.steps
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning on the way
        with pytest.raises(NonFiniteInputError, match=r"positional argument 0.*rows \[\d+\]"):
            p.optimizer.step()
    assert torch.equal(before, _flat(p.model)) and p.accountant.steps == steps


def test_a_nan_target_without_a_loss_scaler_is_refused_not_dropped():
    from privlearn.errors import NonFiniteInputError

    x, _ = toy_data(n=48).tensors
    t = torch.randn(48, 3)
    t[5, 1] = float("nan")
    p = _private(ds=TensorDataset(x, t), batch_size=48, sampling="fixed", seed=0)
    xb, tb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    ((p.model(xb) - tb) ** 2).sum(1).mean().backward()
    with pytest.raises(NonFiniteInputError, match="no loss scaler"):
        p.optimizer.step()
    assert p.accountant.steps == 0


def test_stepping_the_original_optimizer_says_to_use_p_optimizer():
    """A loop that kept ``optimizer.step()`` (the optimizer given to make_private) was
    told, at the next backward, that gradient accumulation is not supported."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = make_private(model, opt, DataLoader(toy_data(), batch_size=8), noise_multiplier=1.0,
                     seed=0)
    before = _flat(model)
    it = iter(p.data_loader)
    x, y = next(it)
    opt.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"p\.optimizer\.step\(\)"):
        opt.step()
    assert torch.equal(before, _flat(model)) and p.accountant.steps == 0
    p.optimizer.step()  # the right call then steps on that batch; detach() lifts the guard
    assert p.accountant.steps == 1
    p.detach()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_an_additive_mask_with_minus_inf_is_not_a_bad_input():
    """An input may hold -inf on purpose (an additive attention mask): only a NaN is
    refused up front; a step whose gradients stay finite runs."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x, bias):
            return self.lin(x) + torch.softmax(bias, -1)

    x, y = toy_data(n=48).tensors
    bias = torch.zeros(48, 3)
    bias[:, 2] = float("-inf")
    model = Masked()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(TensorDataset(x, bias, y), batch_size=8),
                     noise_multiplier=1.0, seed=0)
    for xb, bb, yb in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(xb, bb), yb).backward()
        p.optimizer.step()
    assert p.accountant.steps == len(p.data_loader)


# ------------------------------------------------------------------ one engine per model


def test_a_model_made_private_twice_is_refused_until_detached():
    """A second make_private on a model that already carries an engine (the same model,
    a model containing it, or one of its layers) used to be accepted, and the next
    step failed with a bare KeyError: each engine found the other's records. It is
    refused with the way out, the first run keeps training, and after ``p.detach()``
    the model can be made private again."""
    from privlearn.errors import ConfigurationError, ParameterTypeError

    model = _mlp()
    p = _private(model, seed=0)
    for other in (model, nn.Sequential(model, nn.Tanh()), model[0]):
        with pytest.raises(ConfigurationError, match=r"already attached.*p\.detach\(\)"):
            make_private(other, torch.optim.SGD(other.parameters(), lr=0.1),
                         DataLoader(toy_data(), batch_size=8), noise_multiplier=1.0)
    with pytest.raises(ParameterTypeError, match="already the DPOptimizer"):
        make_private(model, p.optimizer, DataLoader(toy_data(), batch_size=8),
                     noise_multiplier=1.0)
    _train(p, 2)
    assert p.accountant.steps == 2
    p2 = _private(p.detach(), seed=1)
    _train(p2, 2)
    assert p2.accountant.steps == 2


def test_an_optimizer_over_another_models_parameters_is_refused():
    """An optimizer built over a copy of the model (equal values, other tensors), as in
    Opacus's ``test_parameters_match``: no step would ever update the model, while every
    step is accounted. Refused up front, naming the cause; nothing attached."""
    from privlearn.errors import ConfigurationError

    model, twin = _mlp(), _mlp()
    twin.load_state_dict(model.state_dict())
    with pytest.raises(ConfigurationError, match="none of the model's 4 trainable"):
        make_private(model, torch.optim.SGD(twin.parameters(), lr=0.1),
                     DataLoader(toy_data(), batch_size=8), noise_multiplier=1.0)
    assert dict(model._forward_hooks) == {} and dict(model._forward_pre_hooks) == {}


def test_parameters_replaced_after_make_private_are_refused_at_the_step():
    """The model's parameters replaced after make_private (here ``load_state_dict(...,
    assign=True)``; under torch.distributed, ``fully_shard`` applied then): the wrapped
    optimizer still holds the old tensors, so each step was accounted while nothing
    trained. The first step is refused, naming the cause; nothing is accounted and the
    model is unchanged."""
    model = _mlp()
    p = _private(model, seed=0)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(TrainingLoopError, match="none of the model's 4 trainable parameters"):
        _train(p, 1)
    assert p.accountant.steps == 0
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))


def test_trainable_parameters_the_optimizer_does_not_hold_are_named():
    """An optimizer over the head of a model whose backbone still requires gradients
    (a fine-tuning loop that forgot to freeze it): the engine clips over every trainable
    parameter, so the head is clipped harder than its own norm says and the backbone's
    noise is wasted. make_private warns, naming them; frozen, nothing is said."""
    model = _mlp()
    with pytest.warns(UserWarning, match=r"in no param group of the optimizer \(2: 0\.weight"):
        make_private(model, torch.optim.SGD(model[2].parameters(), lr=0.1),
                     DataLoader(toy_data(), batch_size=8), noise_multiplier=1.0)
    model = _mlp()
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_private(model, torch.optim.SGD(model[2].parameters(), lr=0.1),
                     DataLoader(toy_data(), batch_size=8), noise_multiplier=1.0)


def _frozen_batchnorm_cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 16, 3))
    bn = model[1]
    with torch.no_grad():  # pretrained statistics and affine terms
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    return model


def test_a_frozen_batchnorm_with_its_statistics_trains_the_rest(oracle):
    """A pretrained BatchNorm kept frozen with its running statistics (eval mode, no
    trainable parameter) is a fixed map of each example: make_private accepts it and the
    step equals the naive per-example one. Switched back to training mode (batch
    statistics, which mix examples), the next step is refused before anything is
    released; trainable or in training mode, it is refused at make_private."""
    from privlearn.errors import BatchDependenceError, UnsupportedModuleError
    from privlearn.torch import validate

    ds = TensorDataset(torch.randn(24, 2, 6, 6), torch.randint(0, 3, (24,)))
    for change in (lambda bn: bn.requires_grad_(False), lambda bn: bn.eval()):
        model = _frozen_batchnorm_cnn()
        change(model[1])
        assert validate(model) and "bn.eval()" in validate(model)[0]
        with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
            make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(ds, batch_size=8), noise_multiplier=1.0)

    model = _frozen_batchnorm_cnn()
    model[1].eval().requires_grad_(False)
    assert validate(model) == []
    from privlearn.torch import fix

    bn = model[1]
    assert fix(model)[1] is bn  # nothing to fix: its statistics are kept
    ref = copy.deepcopy(model)
    trained = [q for q in model.parameters() if q.requires_grad]
    p = make_private(model, torch.optim.SGD(trained, lr=0.5), DataLoader(ds, batch_size=8),
                     noise_multiplier=0.0, max_grad_norm=0.3, sampling="fixed", seed=0)
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    p.optimizer.step()
    oracle.step(ref, xb, yb, 0.3, lr=0.5, expected_batch=p.optimizer.expected_batch_size)
    torch.testing.assert_close(oracle.flat(model.parameters()), oracle.flat(ref.parameters()),
                               rtol=1e-4, atol=1e-6)

    model.train()  # the whole model, BatchNorm included, back to batch statistics
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    with pytest.raises(BatchDependenceError):
        p.optimizer.step()
    assert p.accountant.steps == 1


@pytest.mark.parametrize("make_opt,named", [
    (lambda m: torch.optim.LBFGS(m.parameters()), "closure"),
    (lambda m: torch.optim.SparseAdam(list(m[0].parameters())), "sparse"),
])
def test_optimizer_whose_step_cannot_take_the_dp_gradient_is_refused_at_make_private(
        make_opt, named):
    """LBFGS's step requires a closure (the DP step calls the wrapped step() once, without
    one) and SparseAdam refuses the dense noisy gradient: accepted, either raised inside
    the first optimizer.step(), after its noisy gradient was released and accounted."""
    model = nn.Sequential(nn.Embedding(5, 4), nn.Flatten(), nn.Linear(8, 3))
    ds = TensorDataset(torch.randint(0, 5, (32, 2)), torch.randint(0, 3, (32,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SparseAdam holds only the embedding
        with pytest.raises(TypeError, match=named):
            make_private(model, make_opt(model), DataLoader(ds, batch_size=8),
                         noise_multiplier=1.0)
    # the model is left as it was: a first-order optimizer trains it
    p = make_private(model, torch.optim.Adam(model.parameters()),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0)
    _train(p, 1)
    assert p.accountant.steps == 1


@pytest.mark.parametrize("other", ["architecture", "param_groups"])
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_anything_is_loaded(other):
    """load_state_dict of a checkpoint saved from another model (or another optimizer
    layout) is refused with nothing loaded: it failed in the model's own load, after the
    privacy history (and some of the weights) had been loaded, so the run then neither
    trained from its own start nor accepted the right checkpoint ("already taken steps")."""
    saved = _private(seed=0)
    _train(saved, 2)
    state = saved.state_dict()
    if other == "architecture":
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        model = _mlp()
        opt = torch.optim.SGD([{"params": model[0].parameters()},
                               {"params": model[2].parameters()}], lr=0.1, momentum=0.9)
    p = make_private(model, opt, DataLoader(toy_data(), batch_size=8), noise_multiplier=1.0,
                     seed=0)
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(ValueError, match="does not fit"):
        p.load_state_dict(state)
    assert p.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    _train(p, 1)
    assert p.accountant.steps == 1


def test_an_empty_dataset_is_refused_with_a_typed_error():
    """An empty training set: a ValueError naming the dataset (it was a ZeroDivisionError
    from the sampling rate)."""
    empty = TensorDataset(torch.randn(0, 6), torch.randint(0, 3, (0,)))
    for sampling in ("poisson", "fixed"):
        with pytest.raises(ValueError, match="dataset is empty"):
            _private(ds=empty, sampling=sampling)


def test_the_warning_past_the_plan_raised_as_an_error_leaves_the_step_complete():
    """Under warnings-as-errors (-W error, or a filter to stop at the plan) the
    PrivacyBudgetWarning of the first step past the planned epsilon was raised before the
    step used its batch and moved its noise key on: every later step was refused (the
    loader's batches piled up) and a checkpoint held the key of the noise just released.
    Now the step is complete when the warning is raised: the next batches train, the
    key moved on, and the accountant holds every step once."""
    from privlearn.errors import PrivacyBudgetWarning

    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=64), batch_size=16), noise_multiplier=1.0,
                     max_grad_norm=1.0, epochs=1, seed=0)
    raised = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyBudgetWarning)
        for _ in range(2):
            for x, y in p.data_loader:
                key = p.optimizer.noise.seed
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                try:
                    p.optimizer.step()
                except PrivacyBudgetWarning:
                    raised.append(p.accountant.steps)
                    assert p.optimizer.noise.seed != key
                    assert p.state_dict()["noise"]["seed"] != key
    assert raised == [5]
    assert p.accountant.steps == 8 and p.data_loader.batch_sampler.consumed == 8
    assert p.epsilon(1e-5) == pytest.approx(
        compose(subsample(Gaussian(1.0), rate=0.25), steps=8).epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_refused_checkpoint_leaves_the_run_fresh(sampling):
    """A seeded run's state loaded into a secure_mode run is refused (its sampler, or its
    noise, cannot continue a replayable stream): the history and the model were loaded
    before the sampler refused, so the refused run had the checkpoint's steps (and every
    later load_state_dict was refused as "already taken steps") and its weights. Now
    nothing is changed: no step, the same weights, and the run's own state still loads."""
    from privlearn.errors import ConfigurationError

    def run(**kw):
        model = _mlp()
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(toy_data(n=64), batch_size=16), noise_multiplier=1.0,
                            max_grad_norm=1.0, sampling=sampling, **kw)

    seeded = run(seed=0)
    for x, y in seeded.data_loader:
        seeded.optimizer.zero_grad()
        nn.functional.cross_entropy(seeded.model(x), y).backward()
        seeded.optimizer.step()
        break
    secure = run(secure_mode=True)
    before = [q.detach().clone() for q in secure.model.parameters()]
    own = secure.state_dict()
    with pytest.raises(ConfigurationError, match="sampler|secure"):
        secure.load_state_dict(seeded.state_dict())
    assert secure.accountant.steps == 0 and secure.epsilon(1e-5) == 0.0
    for a, b in zip(secure.model.parameters(), before, strict=True):
        assert torch.equal(a, b)
    secure.load_state_dict(own)  # still a fresh run
    assert secure.accountant.steps == 0
@pytest.mark.parametrize("sampling", ["shuffled_epochs", "balls_in_bins"])
def test_a_run_composed_after_earlier_runs_takes_its_planned_steps_and_no_more(sampling):
    """compose_after(prior) before the first step: a run accounted as one mechanism is
    capped at its plan, and that cap (the plan's epsilon alone) was below the prior's:
    no step could run. The cap is now the plan composed after the prior: the planned
    steps run, epsilon is the composition, and the step past the plan is refused."""
    model = _mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=32), batch_size=8), noise_multiplier=1.0,
                     max_grad_norm=1.0, sampling=sampling, epochs=1, seed=0)
    run = p.plan.run.mechanism(1.0, p.plan.planned_steps)
    p.compose_after(run)  # as if an identical run came before
    steps = 0
    with pytest.raises(PrivacyBudgetExceededError, match="cannot go past its plan"):
        for _ in range(2):
            for xb, yb in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(xb), yb).backward()
                p.optimizer.step()
                steps += 1
    assert steps == p.accountant.steps == p.plan.planned_steps
    assert p.epsilon() == pytest.approx(
        compose([run, run], steps=[1, 1]).epsilon(1e-5), rel=1e-9)


def test_a_loader_without_batching_is_refused_in_its_own_terms():
    """DataLoader(ds, batch_size=None) turns batching off (one example at a time): the
    refusal says so, rather than naming a batch_sampler the user never passed."""
    ds = toy_data()
    model = _mlp()
    with pytest.raises(ConfigurationError) as info:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=None), noise_multiplier=1.0)
    msg = str(info.value)
    assert "batch_size=None" in msg and "NoneType" not in msg
    assert "DataLoader(dataset, batch_size=B)" in msg
