"""``augment=`` is probed as the model is: a transform that mixes examples (a batch-level
MixUp/CutMix, ``lam * x + (1 - lam) * x.roll(1, 0)``) passed the loader's shape check and
the model's probe (which sees the batch after mixing), and removing one example moved the
clipped sum by 3 C. It is now refused before the first step; per-example transforms pass,
and the global random streams are left as they were."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import BatchDependenceError, make_private  # noqa: E402


def _data(n=48, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = nn.functional.one_hot(torch.randint(0, 3, (n,), generator=g), 3).float()
    return TensorDataset(x, y)


def _private(augment, k=2, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(_data(), batch_size=8), noise_multiplier=1.0,
                        augmentation_multiplicity=k, augment=augment, sampling="fixed",
                        seed=0, **kw)


def _step(p, x, y):
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()


def _mixup(batch):
    x, y = batch
    lam = torch.distributions.Beta(0.4, 0.4).sample()
    return lam * x + (1 - lam) * x.roll(1, 0), lam * y + (1 - lam) * y.roll(1, 0)


def _mixup_labels_only(batch):
    x, y = batch
    return x, 0.8 * y + 0.2 * y.flip(0)


def _sometimes_mixes(batch):  # a transform applied with probability 1/2 per batch
    x, y = batch
    if torch.rand(()) < 0.5:
        return 0.5 * (x + x.roll(1, 0)), y
    return x, y


def _centres(batch):
    x, y = batch
    return x - x.mean(0), y


@pytest.mark.parametrize("augment", [_mixup, _mixup_labels_only, _sometimes_mixes,
                                     _centres],
                         ids=["mixup", "label-mixing", "mixes-on-some-draws", "centring"])
def test_an_augment_that_mixes_examples_is_refused_before_the_first_step(augment):
    p = _private(augment)
    before = [q.detach().clone() for q in p.model.parameters()]
    x, y = next(iter(p.data_loader))
    with pytest.raises(BatchDependenceError, match="augment mixes examples.*per-example"):
        _step(p, x, y)
    assert p.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, p.model.parameters(), strict=True))


def _per_example(batch):
    x, y = batch
    flip = (torch.rand(x.shape[0], 1) < 0.5).float()
    shift = torch.from_numpy(np.random.normal(size=x.shape).astype(np.float32))
    return (1 - 2 * flip) * x + 0.1 * shift + random.random(), y


def test_a_per_example_augment_passes_and_the_random_streams_are_left_alone():
    p = _private(_per_example, k=3)
    x, y = next(iter(p.data_loader))
    state = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    _step(p, x, y)
    assert p.accountant.steps == 1
    assert torch.equal(state[0], torch.get_rng_state())
    assert np.array_equal(state[1], np.random.get_state()[1])
    assert state[2] == random.getstate()


def test_an_augment_with_its_own_generator_cannot_be_checked_and_is_refused():
    g = torch.Generator().manual_seed(1)

    def own(batch):
        x, y = batch
        return x + 0.1 * torch.randn(x.shape, generator=g), y

    p = _private(own)
    x, y = next(iter(p.data_loader))
    with pytest.raises(BatchDependenceError, match="could not be checked"):
        _step(p, x, y)
    q = _private(own, check_batch_independence=False)  # the user's promise instead
    x, y = next(iter(q.data_loader))
    _step(q, x, y)
    assert q.accountant.steps == 1


def test_augment_is_probed_again_when_the_probe_re_arms():
    mixing = []

    def augment(batch):
        return _mixup(batch) if mixing else batch

    p = _private(augment)
    it = iter(p.data_loader)
    x, y = next(it)
    _step(p, x, y)
    mixing.append(True)  # the transform changes ...
    p.model[1].register_forward_hook(lambda m, a, out: out)  # ... and so does the model
    x, y = next(it)
    with pytest.raises(BatchDependenceError, match="augment mixes examples"):
        _step(p, x, y)
    assert p.accountant.steps == 1


class _MixUpLater:
    """A transform whose MixUp a schedule switches on after some epochs."""

    def __init__(self):
        self.mixup = False

    def __call__(self, batch):
        return _mixup(batch) if self.mixup else batch


def _switch_on_by_attribute():
    aug = _MixUpLater()
    return aug, lambda: setattr(aug, "mixup", True)


def _switch_on_in_a_closure():
    mixing = []
    return (lambda batch: _mixup(batch) if mixing else batch), lambda: mixing.append(1)


@pytest.mark.parametrize("make", [_switch_on_by_attribute, _switch_on_in_a_closure],
                         ids=["attribute", "closure"])
def test_an_augment_that_starts_mixing_after_the_first_step_is_refused(make):
    """Only the transform changes (the model does not): its state re-arms the probe, so
    the step after the switch is refused before anything is released."""
    augment, switch_on = make()
    p = _private(augment)
    it = iter(p.data_loader)
    x, y = next(it)
    _step(p, x, y)
    switch_on()
    x, y = next(it)
    before = [q.detach().clone() for q in p.model.parameters()]
    with pytest.raises(BatchDependenceError, match="augment mixes examples"):
        _step(p, x, y)
    assert p.accountant.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, p.model.parameters(), strict=True))
