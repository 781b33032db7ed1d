"""make_private under torch.compile (default backend): the model compiled before or after
make_private, or the whole training step compiled, trains as the eager run of the same
seed does (the same clipped gradients and the same noise), and the engine's hooks are not
themselves compiled (Dynamo would recompile them for every hook, up to its recompile
limit). A model compiled and called before make_private runs its compiled code without
the engine's hooks: refused at the step, saying so."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch._tracker_util import _Hook  # noqa: E402
from privlearn.torch.probe import _Collector  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402

dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from nothing, with a recompile limit hit raising."""
    dynamo.reset()
    with dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    dynamo.reset()


def _inner(fn, name: str):
    """The code of the function ``name`` defined inside ``fn``."""
    (code,) = [c for c in fn.__code__.co_consts if getattr(c, "co_name", None) == name]
    return code


def _compiled_engine_code() -> list[str]:
    """The engine's functions of which Dynamo holds compiled versions: the module hooks'
    wrapper, the probe's hooks, the gradient hooks of a backward pass and its end."""
    frames = torch._C._dynamo.eval_frame
    if not hasattr(frames, "_debug_get_cache_entry_list"):
        pytest.skip("this torch does not list Dynamo's cache entries")
    codes = [
        _Hook.__call__.__code__,
        _inner(_Collector.hook, "fn"),
        _inner(GradSampleTracker._grad_hook, "fn"),
        GradSampleTracker._end_backward.__code__,
    ]
    return [c.co_name for c in codes if frames._debug_get_cache_entry_list(c)]


def _sequences(make_data) -> TensorDataset:
    """32 examples of 4 positions of 6 features each, and a class."""
    x, y = make_data(n=128).tensors
    return TensorDataset(x.reshape(32, 4, 6), y[:32])


def _loss(out, y):
    """Cross-entropy of the logits averaged over the positions."""
    return nn.functional.cross_entropy(out.mean(1), y)


def _train(make_mlp, make_data, order, steps=4, noise=1.0, backend="aot_eager"):
    """``steps`` DP-SGD steps (fixed-size batches of 8 of 32 sequences, seed 0) of a small
    MLP applied at each position (its first layer's output is then a view: compiled, one
    made under no_grad, which the engine could not make differentiable in place before
    the fix) compiled as ``order`` says (``"eager"``: not at all) with ``backend`` (Dynamo's
    graph breaks, guards and recompiles are the same for all; ``"aot_eager"`` runs the
    captured graphs through AOTAutograd without generating code, fast on CPU); returns
    the parameters after each step (flat), the run and the batches drawn."""
    model = make_mlp(norm=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if order == "before":
        model = torch.compile(model, backend=backend)
    p = make_private(
        model,
        optimizer,
        DataLoader(_sequences(make_data), batch_size=8),
        noise_multiplier=noise,
        max_grad_norm=0.1,
        sampling="fixed",
        seed=0,
    )
    net = torch.compile(p.model, backend=backend) if order == "after" else p.model

    def step(x, y):
        p.optimizer.zero_grad()
        _loss(net(x), y).backward()
        p.optimizer.step()

    if order == "step":
        step = torch.compile(step, backend=backend)
    out, batches = [], []
    for x, y in itertools.islice(p.data_loader, steps):
        step(x, y)
        batches.append((x, y))
        out.append(torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()]))
    return out, p, batches


@pytest.mark.parametrize("order", ["after", pytest.param("before", marks=pytest.mark.slow)])
def test_compiled_model_trains_as_eager_and_hooks_are_not_compiled(order, make_mlp, make_data):
    """Compiled after make_private (``torch.compile(p.model)``) or before it (the compiled
    model given to make_private): every step's parameters equal the eager run's with the
    same seed (clipping and noise as eager), no frame hits Dynamo's recompile limit (it
    raises here), and neither the engine's hook wrapper nor the probe's hooks were
    compiled (before the fix the wrapper was, once for every kind of hook call, up to
    the limit)."""
    ref, _, _ = _train(make_mlp, make_data, "eager")
    got, _, _ = _train(make_mlp, make_data, order)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ref[0], ref[-1])  # it trained
    assert _compiled_engine_code() == []


@pytest.mark.slow
def test_compiled_training_step_trains_as_eager(make_mlp, make_data, oracle):
    """``torch.compile`` of the whole step function (zero_grad, forward, backward, the DP
    step): the optimizer's methods and the backward hooks run eagerly (before the fix,
    Dynamo traced into the DP step and failed with an internal error); the parameters
    equal the eager run's; without noise the first step's gradient is the naive
    batch-of-one clipped sum over the batch drawn, divided by the batch size."""
    ref, _, _ = _train(make_mlp, make_data, "eager")
    got, _, _ = _train(make_mlp, make_data, "step", backend="inductor")
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert _compiled_engine_code() == []
    dynamo.reset()
    _, p, batches = _train(make_mlp, make_data, "step", steps=1, noise=0.0, backend="inductor")
    ((x, y),) = batches
    want, _ = oracle.clipped_sum(make_mlp(norm=True), x, y, max_grad_norm=0.1, loss_fn=_loss)
    grad = torch.cat([q.grad.reshape(-1) for q in p.optimizer.param_groups[0]["params"]])
    torch.testing.assert_close(grad.double(), want / len(y), rtol=1e-5, atol=1e-7)


def test_model_compiled_and_called_before_make_private_is_refused(make_mlp, make_data):
    """Compiled code traced before make_private has no hook of the engine (Dynamo does not
    guard on module hooks): the parameters get autograd's gradient, the step is refused
    (nothing released) with that cause; after ``torch._dynamo.reset()`` it trains as
    eager."""
    data = make_data(n=32)
    model = make_mlp()
    compiled = torch.compile(model, backend="aot_eager")
    x, y = data.tensors[0][:8], data.tensors[1][:8]
    nn.functional.cross_entropy(compiled(x), y).backward()  # compiled without the hooks
    model.zero_grad()
    p = make_private(
        compiled,
        torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=0.1,
        sampling="fixed",
        seed=0,
    )
    xb, yb = next(iter(p.data_loader))
    nn.functional.cross_entropy(compiled(xb), yb).backward()
    with pytest.raises(TrainingLoopError, match="torch.compile and called before make_private"):
        p.optimizer.step()
    assert p.accountant.steps == 0


@pytest.mark.slow
def test_compiled_gpt2_step_trains_as_eager():
    """A small GPT-2 (config-initialised, dropout 0, tied head) whose whole training step
    is compiled (``aot_eager``; the MLP's test runs inductor): three noisy steps give the
    eager run's parameters, without a recompile limit hit and without compiling the
    engine's code."""
    pytest.importorskip("transformers")
    from hf_models import VOCAB, build, loss_of

    ids = torch.randint(1, VOCAB, (16, 8), generator=torch.Generator().manual_seed(1))

    def run(compiled: bool) -> list:
        model = build("gpt2", dtype=torch.float32)
        p = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
            DataLoader(TensorDataset(ids, ids.clone()), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=0.1,
            sampling="fixed",
            seed=0,
        )

        def step(x, y):
            p.optimizer.zero_grad()
            loss_of("gpt2", model(input_ids=x), y).backward()
            p.optimizer.step()

        step = torch.compile(step, backend="aot_eager") if compiled else step
        out = []
        for x, y in itertools.islice(p.data_loader, 3):
            step(x, y)
            out.append(torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()]))
        return out

    ref, got = run(False), run(True)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert not torch.equal(ref[0], ref[-1])
    assert _compiled_engine_code() == []
