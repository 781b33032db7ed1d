"""Training-loop patterns users write around ``p.model``, each checked against the naive
ground truth (batch-of-one backward passes: per-example gradient, clipped, summed) or
refused before anything is released.

The model called twice per step on one batch: the batch-independence probe replayed only
the step's first forward, so an operation that mixes examples on a path only a later
call takes (other keywords, another view), or one first made after some steps, trained
unchecked. ``torch.func.functional_call`` on the private model silently ran on the
model's own parameters, and on a layer inside it with a weight derived from its own left
the derivation out of the chain rule. A GAN loop that clears the discriminator with
``netD.zero_grad()``, or one that hands ``p.data_loader`` to ``Accelerator.prepare``, was
refused without naming the way out, as were ``torch.autograd.grad`` of the parameters in
place of ``backward()`` and a collated tensor not per example under virtual batches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from toys import toy_data  # noqa: E402

from privlearn.torch import BatchDependenceError, make_private  # noqa: E402

C, B = 0.5, 8


class _TwoPaths(nn.Module):
    """A per-example path, and one taken with ``centre=True`` that subtracts the batch
    mean of the hidden layer (it mixes examples)."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x, centre=False):
        h = torch.tanh(self.a(x))
        if centre:
            h = h - h.mean(0, keepdim=True)
        return self.head(h)


def _private(model):
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        DataLoader(toy_data(n=32, dtype=torch.float64), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=C,
        seed=0,
        sampling="fixed",
    )


def _flat(params):
    return torch.cat([q.detach().reshape(-1) for q in params])


@pytest.mark.parametrize("centred_call", ["second", "first"])
def test_a_later_call_that_mixes_examples_is_refused_before_any_release(centred_call):
    """``ce(model(x)) + ce(model(x, centre=True))``: removing one example moves every
    other example's gradient through the batch mean. With the mixing call second the step
    trained (the probe replayed the first call only); now refused like the reverse order,
    nothing released and no step accounted."""
    torch.manual_seed(0)
    model = _TwoPaths().double()
    p = _private(model)
    x, y = next(iter(p.data_loader))
    before = _flat(model.parameters())
    calls = [lambda: p.model(x), lambda: p.model(x, centre=True)]
    if centred_call == "first":
        calls.reverse()
    p.optimizer.zero_grad()
    (F.cross_entropy(calls[0](), y) + F.cross_entropy(calls[1](), y)).backward()
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        p.optimizer.step()
    assert torch.equal(_flat(model.parameters()), before)
    assert p.accountant.steps == 0


def test_a_mixing_call_first_made_after_some_steps_is_refused():
    """The probe ran at the first step only (and after changes of the modules): a call
    with other flags first made later (a consistency term switched on after warm-up,
    ``model(x, centre=True)``) trained unchecked. A forward of a new signature re-arms the
    probe: refused, that step released nothing and was not accounted."""
    torch.manual_seed(0)
    model = _TwoPaths().double()
    p = _private(model)
    for k, (x, y) in enumerate(p.data_loader):
        p.optimizer.zero_grad()
        loss = F.cross_entropy(p.model(x), y)
        if k == 2:
            loss = loss + F.cross_entropy(p.model(x, centre=True), y)
        loss.backward()
        if k < 2:
            p.optimizer.step()
            continue
        before = _flat(model.parameters())
        with pytest.raises(BatchDependenceError, match="examples are mixed"):
            p.optimizer.step()
        assert torch.equal(_flat(model.parameters()), before)
        break
    assert p.accountant.steps == 2


def _naive_sum(model, loss_of, n):
    """Sum over examples of each example's gradient of ``loss_of(model, i)`` clipped to C,
    by batch-of-one backward passes (float64)."""
    rows = []
    for i in range(n):
        grads = torch.autograd.grad(loss_of(model, i), list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    rows = torch.stack(rows)
    return (rows * (C / rows.norm(dim=1)).clamp(max=1.0)[:, None]).sum(0)


def test_two_per_example_views_of_the_batch_train_as_the_loop_of_batches_of_one():
    """A consistency loss on an augmented second view (a later call on other inputs,
    probed too) is not refused: its update is the naive clipped sum of each example's
    two-view loss."""
    import copy

    torch.manual_seed(0)
    model = _TwoPaths().double()
    ref = copy.deepcopy(model)
    p = _private(model)
    x, y = next(iter(p.data_loader))

    def loss(m, xb, yb):
        a, b = m(xb), m(0.9 * xb + 0.1)
        return F.cross_entropy(a, yb) + ((a - b) ** 2).sum(1).mean()

    before = _flat(model.parameters())
    p.optimizer.zero_grad()
    loss(p.model, x, y).backward()
    p.optimizer.step()
    want = _naive_sum(ref, lambda m, i: loss(m, x[i : i + 1], y[i : i + 1]), len(y))
    torch.testing.assert_close(
        (before - _flat(model.parameters())) * B, want, rtol=1e-10, atol=1e-12
    )
    assert p.accountant.steps == 1


def test_functional_call_with_gradients_is_refused_and_the_run_goes_on():
    """``torch.func.functional_call(p.model, tensors, x)`` in a training forward ran on the
    model's own parameters (the engine put them back in the slots), not on the tensors
    given: outputs and per-example gradients silently of another function. Now refused;
    under ``no_grad`` it runs on the tensors given, and the loop then trains as the naive
    loop of batches of one."""
    import copy

    from torch.func import functional_call

    from privlearn.errors import TrainingLoopError

    torch.manual_seed(0)
    model = _TwoPaths().double()
    ref = copy.deepcopy(model)
    p = _private(model)
    x, y = next(iter(p.data_loader))
    zeros = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    with torch.no_grad():
        assert torch.equal(
            functional_call(p.model, zeros, (x,)), torch.zeros(len(x), 3, dtype=x.dtype)
        )
    fast = {k: v - 0.1 * torch.ones_like(v) for k, v in model.named_parameters()}
    with pytest.raises(TrainingLoopError, match="functional_call"):
        functional_call(p.model, fast, (x,))
    before = _flat(model.parameters())
    p.optimizer.zero_grad()
    F.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    want = _naive_sum(ref, lambda m, i: F.cross_entropy(m(x[i : i + 1]), y[i : i + 1]), len(y))
    torch.testing.assert_close(
        (before - _flat(model.parameters())) * B, want, rtol=1e-10, atol=1e-12
    )
    assert p.accountant.steps == 1


def _gan_step(p, gen, opt_g, x, z, zero_grad):
    """One iteration of the PyTorch DCGAN tutorial's loop: the private discriminator's
    step on real and generated rows (one summed loss), then the generator's step through
    the discriminator. Returns the discriminator's released update times B and its
    parameters after its step."""
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(len(x), 1, dtype=x.dtype), torch.zeros(len(x), 1, dtype=x.dtype)
    before = _flat(p.model.parameters())
    zero_grad()
    fake = gen(z)
    (bce(p.model(x), ones) + bce(p.model(fake.detach()), zeros)).backward()
    p.optimizer.step()
    update = (before - _flat(p.model.parameters())) * B
    stepped = {k: v.detach().clone() for k, v in p.model.state_dict().items()}
    opt_g.zero_grad()
    bce(p.model(fake), ones).backward()
    opt_g.step()
    return update, stepped


@pytest.mark.parametrize("zero_grad", ["model", "optimizer"])
def test_a_gan_loop_trains_with_the_optimizer_s_zero_grad_and_names_it_otherwise(zero_grad):
    """The generator's backward pass through the private discriminator is recorded; with
    the tutorial's ``netD.zero_grad()`` the next discriminator backward is refused as
    gradient accumulation, naming no way out. The message now names
    ``p.optimizer.zero_grad()``, with which each discriminator step is the naive clipped
    sum of its rows' real-plus-fake losses and the generator's gradient is autograd's
    through the discriminator."""
    import copy

    from privlearn.errors import TrainingLoopError

    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    gen = nn.Linear(3, 6).double()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    p = _private(disc)
    clear = p.model.zero_grad if zero_grad == "model" else p.optimizer.zero_grad
    bce = nn.BCEWithLogitsLoss()
    for k, (x, _) in enumerate(p.data_loader):
        z = torch.randn(len(x), 3, dtype=x.dtype)
        ref_d, ref_g = copy.deepcopy(disc), copy.deepcopy(gen)
        if zero_grad == "model" and k == 1:
            with pytest.raises(
                TrainingLoopError, match=r"call p\.optimizer\.zero_grad\(\) after it"
            ):
                _gan_step(p, gen, opt_g, x, z, clear)
            return
        update, stepped = _gan_step(p, gen, opt_g, x, z, clear)
        fake = ref_g(z).detach()

        def loss(m, i, x=x, fake=fake):
            one = torch.ones(1, 1, dtype=x.dtype)
            return bce(m(x[i : i + 1]), one) + bce(m(fake[i : i + 1]), 0 * one)

        torch.testing.assert_close(update, _naive_sum(ref_d, loss, len(x)), rtol=1e-10, atol=1e-12)
        ref_d.load_state_dict(stepped)
        bce(ref_d(ref_g(z)), torch.ones(len(x), 1, dtype=x.dtype)).backward()
        for a, b in zip(gen.parameters(), ref_g.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach() - 0.1 * b.grad, rtol=1e-12, atol=1e-12)
        if k == 2:
            break
    assert p.accountant.steps == 3


def test_adversarial_inputs_from_the_private_model_train_on_them():
    """FGSM adversarial training: ``torch.autograd.grad`` of the loss with respect to the
    inputs through ``p.model``, ``p.optimizer.zero_grad()``, then the step on the perturbed
    inputs equals the naive loop (each example's perturbation from its own gradient)."""
    import copy

    torch.manual_seed(0)
    model = _TwoPaths().double()
    ref = copy.deepcopy(model)
    p = _private(model)
    x, y = next(iter(p.data_loader))

    def attack(m, xb, yb):
        xa = xb.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(m(xa), yb, reduction="sum"), xa)
        return (xb + 0.3 * g.sign()).detach()

    before = _flat(model.parameters())
    xa = attack(p.model, x, y)
    p.optimizer.zero_grad()
    F.cross_entropy(p.model(xa), y).backward()
    p.optimizer.step()

    def loss(m, i):
        xi, yi = x[i : i + 1], y[i : i + 1]
        return F.cross_entropy(m(attack(m, xi, yi)), yi)

    want = _naive_sum(ref, loss, len(y))
    torch.testing.assert_close(
        (before - _flat(model.parameters())) * B, want, rtol=1e-10, atol=1e-12
    )


def test_accelerate_prepared_loader_is_refused_naming_what_to_prepare():
    """``Accelerator.prepare(p.model, p.optimizer, p.data_loader)`` builds a loader of its
    own from the private loader's dataset and sampler, whose batches the engine cannot
    follow: the step is refused (nothing released), and the message says to prepare the
    model and optimizer only; iterating ``p.data_loader`` then trains as the naive loop."""
    import copy

    accelerate = pytest.importorskip("accelerate")
    from privlearn.errors import TrainingLoopError

    torch.manual_seed(0)
    model = _TwoPaths().double()
    ref = copy.deepcopy(model)
    p = _private(model)
    acc = accelerate.Accelerator(cpu=True)
    m, opt, loader = acc.prepare(p.model, p.optimizer, p.data_loader)
    x, y = next(iter(loader))
    opt.zero_grad()
    acc.backward(F.cross_entropy(m(x), y))
    with pytest.raises(TrainingLoopError, match=r"Accelerator\.prepare\(p\.data_loader\)"):
        opt.step()
    assert p.accountant.steps == 0
    p.optimizer.zero_grad()
    x, y = next(iter(p.data_loader))
    before = _flat(model.parameters())
    F.cross_entropy(m(x), y).backward()
    opt.step()
    want = _naive_sum(ref, lambda m, i: F.cross_entropy(m(x[i : i + 1]), y[i : i + 1]), len(y))
    torch.testing.assert_close(
        (before - _flat(model.parameters())) * B, want, rtol=1e-10, atol=1e-12
    )
    assert p.accountant.steps == 1


def test_autograd_grad_of_the_parameters_instead_of_backward_is_refused_naming_backward():
    """``torch.autograd.grad(loss, model.parameters(), allow_unused=True)`` then ``step()``:
    no per-example gradient exists (the layers run on detached aliases, so every
    gradient is None); the step is refused before any noise is added, and the message
    now names ``loss.backward()`` as what to call."""
    from privlearn.errors import TrainingLoopError

    torch.manual_seed(0)
    model = _TwoPaths().double()
    p = _private(model)
    x, y = next(iter(p.data_loader))
    before = _flat(model.parameters())
    p.optimizer.zero_grad()
    loss = F.cross_entropy(p.model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert all(g is None for g in grads)
    with pytest.raises(TrainingLoopError, match=r"autograd\.grad.*call loss\.backward\(\)"):
        p.optimizer.step()
    assert torch.equal(_flat(model.parameters()), before)
    assert p.accountant.steps == 0


def test_a_collated_tensor_not_per_example_under_virtual_batches_is_named():
    """A collate function returning class weights (one row per class, not per example)
    next to the batch: with ``max_physical_batch_size`` the batch cannot be split, refused
    before any step with a message that now says what to do with such a tensor."""
    from privlearn.errors import ParameterValueError

    weights = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)

    def collate(items):
        x = torch.stack([a for a, _ in items])
        return x, torch.stack([b for _, b in items]), weights

    torch.manual_seed(0)
    model = _TwoPaths().double()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        DataLoader(toy_data(n=32, dtype=torch.float64), batch_size=B, collate_fn=collate),
        noise_multiplier=0.0,
        max_grad_norm=C,
        seed=0,
        sampling="fixed",
        max_physical_batch_size=4,
    )
    with pytest.raises(ParameterValueError, match="not per example"):
        next(iter(p.data_loader))
    assert p.accountant.steps == 0


class _Masked(nn.Module):
    """A layer called through ``functional_call`` on a weight derived from its own
    (``w * 0.5``, a fixed drop-connect mask), or with that transform registered as a
    parametrization (``parametrize=True``)."""

    def __init__(self, parametrize=False):
        super().__init__()
        self.fc, self.head = nn.Linear(6, 5), nn.Linear(5, 3)
        self.parametrize = parametrize
        if parametrize:
            from torch.nn.utils.parametrize import register_parametrization

            register_parametrization(self.fc, "weight", _Half())

    def forward(self, x):
        if self.parametrize:
            h = self.fc(x)
        else:
            from torch.func import functional_call

            w = {"weight": self.fc.weight * 0.5, "bias": self.fc.bias}
            h = functional_call(self.fc, w, (x,))
        return self.head(torch.tanh(h))


class _Half(nn.Module):
    def forward(self, w):
        return w * 0.5


@pytest.mark.parametrize("parametrize", [False, True])
def test_a_layer_run_on_a_tensor_derived_from_its_weight_is_refused_or_differentiated(
    parametrize,
):
    """``functional_call(self.fc, {"weight": self.fc.weight * 0.5, ...}, x)`` inside the
    forward: the per-example gradient was clipped as the weight's own, the mask's factor
    0.5 of the chain rule left out (0.18 off the loop of batches of one). Now refused,
    nothing released; the same transform as a parametrization trains as that loop."""
    import copy

    from privlearn.errors import TrainingLoopError

    torch.manual_seed(0)
    model = _Masked(parametrize).double()
    ref = copy.deepcopy(model)
    p = _private(model)
    x, y = next(iter(p.data_loader))
    before = _flat(model.parameters())
    p.optimizer.zero_grad()
    if not parametrize:
        with pytest.raises(TrainingLoopError, match="functional_call"):
            p.model(x)
        assert all(type(q) is nn.Parameter for q in model.fc._parameters.values())
        assert p.accountant.steps == 0
        return
    F.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    want = _naive_sum(ref, lambda m, i: F.cross_entropy(m(x[i : i + 1]), y[i : i + 1]), len(y))
    torch.testing.assert_close(
        (before - _flat(model.parameters())) * B, want, rtol=1e-10, atol=1e-12
    )


def test_itertools_cycle_over_the_private_loader_is_refused_naming_it():
    """``itertools.cycle(p.data_loader)`` (an endless-iterator idiom of GAN and
    semi-supervised loops) replays the batches of its first pass: the first step past it
    is refused before anything is released, and the message names the idiom and the
    way out (a new pass over p.data_loader each epoch), not only another loader."""
    import itertools

    from privlearn.errors import TrainingLoopError

    model = nn.Sequential(nn.Linear(6, 3)).double()
    p = _private(model)
    batches = itertools.cycle(p.data_loader)
    for _ in range(len(p.data_loader)):
        x, y = next(batches)
        p.optimizer.zero_grad()
        F.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    x, y = next(batches)  # the first pass's first batch again
    p.optimizer.zero_grad()
    F.cross_entropy(p.model(x), y).backward()
    before = _flat(model.parameters())
    with pytest.raises(TrainingLoopError, match=r"itertools\.cycle.*anew each epoch"):
        p.optimizer.step()
    assert p.accountant.steps == len(p.data_loader)
    assert torch.equal(before, _flat(model.parameters()))
