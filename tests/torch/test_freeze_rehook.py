"""Parameters frozen or unfrozen mid-run when the model is itself one layer (its own
forward pre-hooks are replaced during its call), and layers replaced after make_private
(their new parameters outside the optimizer)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _data(d=5, k=3, n=48):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, k, (n,), generator=g)
    )


def _clipped_only(model, optimizer, max_grad_norm):
    """``make_private`` without noise, fixed-size batches of 8 of :func:`_data`, seeded:
    each step is the naive clipped step, to compare with a batch-of-one loop."""
    return make_private(
        model,
        optimizer,
        DataLoader(_data(), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=max_grad_norm,
        sampling="fixed",
        seed=0,
    )


def _bare(d=5, k=3):
    torch.manual_seed(0)
    return nn.Linear(d, k).double()


def _stack(d=5, k=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 4), nn.Tanh(), nn.Linear(4, k)).double()


def _last_bias(model):
    return model.bias if isinstance(model, nn.Linear) else model[2].bias


@pytest.mark.parametrize("build", [_bare, _stack], ids=["bare-linear", "sequential"])
def test_freezing_and_unfreezing_mid_run_matches_batch_of_one(build, oracle):
    """A parameter frozen between steps (the model a bare nn.Linear, whose own pre-hooks
    the engine replaces during its call, or a stack of layers) is not updated; the
    others move by the naive clipped step over the parameters still trainable; unfrozen
    again, it trains again. Every step is accounted once."""
    model, C, lr = build(), 0.05, 0.5
    ref = copy.deepcopy(model)
    p = _clipped_only(model, torch.optim.SGD(model.parameters(), lr=lr), C)
    batches = iter(p.data_loader)
    for frozen in (False, True, False):
        _last_bias(model).requires_grad_(not frozen)
        _last_bias(ref).requires_grad_(not frozen)
        before = _last_bias(model).detach().clone()
        x, y = next(batches)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        oracle.step(ref, x, y, C, lr=lr, expected_batch=p.optimizer.expected_batch_size)
        torch.testing.assert_close(
            oracle.flat(model.parameters()), oracle.flat(ref.parameters()), rtol=1e-9, atol=1e-12
        )
        assert torch.equal(_last_bias(model), before) == frozen
    assert p.accountant.steps == 3


def test_a_frozen_parameter_of_a_bare_layer_gets_no_noise():
    """With noise, the frozen bias of a bare nn.Linear stays exactly as it was while the
    weight moves; the step is accounted as any other."""
    model = _bare()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(_data(), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    batches = iter(p.data_loader)
    for _ in range(2):
        x, y = next(batches)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        model.bias.requires_grad_(False)
    bias, weight = model.bias.detach().clone(), model.weight.detach().clone()
    x, y = next(batches)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    assert torch.equal(model.bias, bias) and not torch.equal(model.weight, weight)
    assert p.accountant.steps == 3


def _replace_head(model):
    model[2] = nn.Linear(4, 3).double()


def _assign_head(model):
    model.load_state_dict(
        {
            "2.weight": torch.zeros(3, 4, dtype=torch.float64),
            "2.bias": torch.zeros(3, dtype=torch.float64),
        },
        strict=False,
        assign=True,
    )


@pytest.mark.parametrize("change", [_replace_head, _assign_head], ids=["setattr", "assign"])
@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_layer_replaced_after_make_private_is_refused(change, steps_before):
    """A layer replaced after make_private (before the first step or later) holds new
    parameters the optimizer does not hold: the step is refused, naming them, before
    anything is released or accounted, and the model is left unchanged."""
    model = _stack()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(_data(), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    batches = iter(p.data_loader)

    def step():
        x, y = next(batches)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()

    for _ in range(steps_before):
        step()
    change(model)
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(TrainingLoopError, match=r"2\.weight.*make_private"):
        step()
    assert p.accountant.steps == steps_before
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(TrainingLoopError, match=r"2\.weight"):  # refused again, not once
        step()
    assert p.accountant.steps == steps_before


def test_a_replaced_layer_added_to_the_optimizer_trains_clipped(oracle):
    """The new layer's parameters added to the optimizer: the step is taken and equals
    the naive clipped step over the model as it now is."""
    model, C, lr = _stack(), 0.05, 0.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    p = _clipped_only(model, opt, C)
    _replace_head(model)
    opt.add_param_group({"params": list(model[2].parameters())})
    ref = copy.deepcopy(model)
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    oracle.step(ref, x, y, C, lr=lr, expected_batch=p.optimizer.expected_batch_size)
    torch.testing.assert_close(
        oracle.flat(model.parameters()), oracle.flat(ref.parameters()), rtol=1e-9, atol=1e-12
    )


class _Head(nn.Linear):
    """A layer class of one's own that a head is converted to (as a conversion such as
    ``torch.ao.quantization.prepare_qat`` does): a new module holding the converted
    layer's own parameters."""

    @classmethod
    def holding(cls, layer: nn.Linear) -> _Head:
        head = cls(layer.in_features, layer.out_features, dtype=layer.weight.dtype)
        head.weight, head.bias = layer.weight, layer.bias
        return head


def test_a_layer_replaced_by_a_new_module_holding_its_parameters_trains_clipped(oracle):
    """After a step, the head is replaced by a new module holding the same parameters
    (the optimizer holds them already). The new module was not hooked, so its gradient
    was taken for a use outside any layer and every step was refused; it is hooked in
    place of the old one now, and the step equals the naive clipped step."""
    model, C, lr = _stack(), 0.05, 0.5
    p = _clipped_only(model, torch.optim.SGD(model.parameters(), lr=lr), C)
    batches = iter(p.data_loader)
    for k in range(2):
        if k == 1:
            model[2] = _Head.holding(model[2])
        ref = copy.deepcopy(model)
        x, y = next(batches)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        oracle.step(ref, x, y, C, lr=lr, expected_batch=p.optimizer.expected_batch_size)
        torch.testing.assert_close(
            oracle.flat(model.parameters()), oracle.flat(ref.parameters()), rtol=1e-9, atol=1e-12
        )
    assert p.accountant.steps == 2


class _TiedHead(nn.Module):
    """A head registering its decoder's bias as its own too (as Hugging Face's masked-LM
    heads do): the engine guards that second slot with a pre-hook of the head itself."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(5, 3).double()
        self.bias = self.decoder.bias

    def forward(self, x):
        return self.decoder(x)


def test_freezing_mid_run_leaves_a_root_modules_guarded_slot_as_it_was():
    """Freezing a parameter of a model whose own module holds a guarded second slot: the
    slot holds the parameter after the step (no watched alias left behind by a guard hook
    that the rediscovery removed during the model's call)."""
    torch.manual_seed(0)
    model = _TiedHead()
    p = _clipped_only(model, torch.optim.SGD(model.parameters(), lr=0.5), 1.0)
    batches = iter(p.data_loader)
    for freeze in (False, True, False):
        if freeze:
            model.decoder.weight.requires_grad_(False)
        x, y = next(batches)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        assert model._parameters["bias"] is model.decoder.bias
    assert p.accountant.steps == 3
