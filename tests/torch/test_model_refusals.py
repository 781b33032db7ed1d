"""Models make_private refuses: torch's global module hooks (run before the engine's, so
per-example gradients would be wrong: checked against a float64 one-example-at-a-time
loop) at make_private and when registered later, and a model with no trainable
parameter."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.modules.module as torch_module  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import toy_mlp  # noqa: E402

from privlearn.errors import ConfigurationError, TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _double_linear_outputs(module, args, out):
    return out * 2 if hasattr(module, "in_features") else None


def _double_linear_inputs(module, args):
    return (args[0] * 2,) if hasattr(module, "in_features") else None


def _triple_grad_inputs(module, grad_in, grad_out):
    return tuple(None if g is None else 3 * g for g in grad_in)


_REGISTER = {
    "register_module_forward_hook": lambda: torch_module.register_module_forward_hook(
        _double_linear_outputs
    ),
    "register_module_forward_pre_hook": lambda: torch_module.register_module_forward_pre_hook(
        _double_linear_inputs
    ),
    "register_module_full_backward_hook": lambda: torch_module.register_module_full_backward_hook(
        _triple_grad_inputs
    ),
}


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (8,), generator=g
    )


def _private(model, x, y):
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=0.0,
        max_grad_norm=1e6,
        sampling="fixed",
        epochs=1,
    )


def _one_step(p, model):
    for xb, yb in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
        p.optimizer.step()
        return [q.grad.clone() for q in model.parameters()]


def _loop_sum(model, x, y):
    """The summed gradient, one float64 example at a time (no clipping at 1e6)."""
    out = [torch.zeros_like(q) for q in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        for o, q in zip(out, model.parameters(), strict=True):
            o += q.grad
    return out


@pytest.mark.parametrize("kind", sorted(_REGISTER))
def test_a_global_module_hook_is_refused_at_make_private(kind):
    x, y = _data()
    handle = _REGISTER[kind]()
    try:
        with pytest.raises(ConfigurationError, match=kind):
            _private(toy_mlp(dtype=torch.float64), x, y)
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", sorted(_REGISTER))
def test_a_global_module_hook_registered_later_is_refused_at_the_forward(kind):
    x, y = _data()
    model = toy_mlp(dtype=torch.float64)
    p = _private(model, x, y)
    handle = _REGISTER[kind]()
    try:
        with pytest.raises(TrainingLoopError, match=kind):
            _one_step(p, model)
    finally:
        handle.remove()
    assert all(q.grad is None or not q.grad.any() for q in model.parameters())


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_hooks_on_the_modules_give_the_per_example_loop_gradients():
    """What the refusal tells to do instead: the same hooks on the modules, registered
    before or after make_private, give the gradients of a one-example-at-a-time loop
    with those hooks (a global forward hook would not: see below)."""
    x, y = _data()

    def hooked(model):
        return [
            h
            for m in model.modules()
            for h in (
                m.register_forward_hook(_double_linear_outputs),
                m.register_full_backward_hook(_triple_grad_inputs),
            )
        ]

    ref_model = toy_mlp(dtype=torch.float64)
    hooked(ref_model)
    ref = _loop_sum(ref_model, x, y)
    for when in ("before", "after"):
        model = toy_mlp(dtype=torch.float64)
        if when == "before":
            hooked(model)
        p = _private(model, x, y)
        if when == "after":
            hooked(model)
        for got, want in zip(_one_step(p, model), ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        p.detach()


def test_a_global_forward_hook_would_make_the_gradients_wrong():
    """Why the global hooks are refused: with the check bypassed, the engine's gradients
    under a global forward hook that doubles the Linear outputs differ from the loop's."""
    from privlearn.torch import _model_refusals, tracker

    x, y = _data()
    ref_model = toy_mlp(dtype=torch.float64)
    handle = _REGISTER["register_module_forward_hook"]()
    try:
        ref = _loop_sum(ref_model, x, y)
        model = toy_mlp(dtype=torch.float64)
        mp = pytest.MonkeyPatch()
        with mp.context() as m:
            m.setattr(_model_refusals, "_GLOBAL_HOOKS", ())
            p = _private(model, x, y)
            assert tracker._model_refusals is _model_refusals  # its check reads the table
            got = _one_step(p, model)
    finally:
        handle.remove()
    assert any(not torch.allclose(g, r, rtol=1e-6) for g, r in zip(got, ref, strict=True))


def test_a_model_with_no_trainable_parameter_is_refused():
    x, y = _data()
    model = toy_mlp(dtype=torch.float64).requires_grad_(False)
    with pytest.raises(ConfigurationError, match=r"no trainable parameter.*requires_grad_\(True\)"):
        _private(model, x, y)
