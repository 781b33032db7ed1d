"""Small refusals of the PyTorch engine: hooks run after a parameter's gradient is
accumulated (``register_post_accumulate_grad_hook``, an optimizer step inside backward)
never run under the engine, so they are refused at make_private and, registered later,
at the next training forward; the one transformers' Trainer registers itself is not.
Two behaviours the guide documents (not detectable by the engine): torch.autograd.grad of
the parameters, and a clip_grad_norm_ between backward() and step()."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import ConfigurationError, TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _private(model):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        sampling="fixed",
        epochs=1,
    )


def _step_in_backward(model):
    """The "optimizer step in backward" pattern: one SGD per parameter, stepped by a
    post-accumulate-grad hook."""
    per_param = {q: torch.optim.SGD([q], lr=0.1) for q in model.parameters()}

    def hook(q):
        per_param[q].step()
        per_param[q].zero_grad()

    return [q.register_post_accumulate_grad_hook(hook) for q in model.parameters()]


def test_a_step_in_backward_hook_is_refused_at_make_private():
    model = _model()
    _step_in_backward(model)
    with pytest.raises(
        ConfigurationError, match=r"post-accumulate-grad hooks.*'0.weight'.*never runs"
    ):
        _private(model)


def test_a_step_in_backward_hook_registered_later_is_refused_at_the_next_forward():
    """Registered after make_private, it never ran: the weights did not move in
    backward() (shown first with a hook that only counts)."""
    model = _model()
    p = _private(model)
    fired = []
    h = model[0].weight.register_post_accumulate_grad_hook(lambda q: fired.append(1))
    assert model[0].weight._post_accumulate_grad_hooks  # what the check reads
    xb, yb = next(iter(p.data_loader))
    with pytest.raises(TrainingLoopError, match=r"post-accumulate-grad hooks.*'0.weight'"):
        p.model(xb)
    h.remove()
    before = [q.detach().clone() for q in model.parameters()]
    handles = _step_in_backward(model)
    with pytest.raises(TrainingLoopError, match="handle.remove"):
        p.model(xb)
    for hd in handles:
        hd.remove()
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    assert fired == [] and all(
        torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True)
    )
    p.optimizer.step()  # trains as usual once removed
    assert not torch.equal(before[0], model[0].weight)


def test_a_hook_on_a_frozen_parameter_is_not_refused():
    model = _model()
    model[0].weight.register_post_accumulate_grad_hook(lambda q: None)
    model[0].requires_grad_(False)
    _private(model)


def test_the_trainers_replicated_gradient_average_is_not_refused(monkeypatch):
    """transformers' Trainer registers its own post-accumulate-grad hook (an average over
    the ranks) on the replicated trainable parameters of a model sharded at load time;
    registered here by the Trainer's own method with a two-rank group faked."""
    transformers = pytest.importorskip("transformers")
    import transformers.trainer as trainer_module

    model = _model()

    class _Dist:
        ReduceOp = torch.distributed.ReduceOp

        @staticmethod
        def is_available():
            return True

        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get_world_size():
            return 2

        @staticmethod
        def broadcast(tensor, src):
            return None

    monkeypatch.setattr(trainer_module, "dist", _Dist)
    transformers.Trainer._sync_replicated_trainable_parameters(None, model)
    assert all(q._post_accumulate_grad_hooks for q in model.parameters())
    p = _private(model)
    xb, yb = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    p.optimizer.step()


def test_ddps_compiled_autograd_reducer_hook_is_not_refused(tmp_path):
    """DistributedDataParallel under compiled autograd (optimize_ddp="python_reducer")
    registers a post-accumulate-grad hook (a functools.partial) on every parameter: its
    gradient exchange, which the engine replaces with its own; trained as before (a world
    of one process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        model = _model()
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
            ddp = nn.parallel.DistributedDataParallel(model)
        assert all(q._post_accumulate_grad_hooks for q in model.parameters())
        before = model[0].weight.detach().clone()
        p = _private(ddp)
        xb, yb = next(iter(p.data_loader))
        nn.functional.cross_entropy(p.model(xb), yb).backward()
        p.optimizer.step()
        assert not torch.equal(before, model[0].weight)
    finally:
        dist.destroy_process_group()


# The two behaviours below cannot be detected cheaply by the engine (torch raises before
# any hook runs; clip_grad_norm_ on the empty p.grad has no effect to see); the PyTorch
# guide documents them, and these tests hold what it says.


def test_autograd_grad_of_the_parameters_is_documented_behaviour():
    """torch.autograd.grad(loss, params) fails in torch itself (the layers run on
    detached aliases); with allow_unused=True it returns None and the step is refused,
    naming it."""
    model = _model()
    p = _private(model)
    xb, yb = next(iter(p.data_loader))
    loss = nn.functional.cross_entropy(p.model(xb), yb)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert all(g is None for g in grads)
    with pytest.raises(TrainingLoopError, match=r"torch\.autograd\.grad"):
        p.optimizer.step()


@pytest.mark.parametrize("zero", [True, False])
def test_clip_grad_norm_between_backward_and_step_changes_nothing(zero):
    """p.grad is empty from backward() to step() (or, without zero_grad(), the previous
    step's released gradient, which step() replaces): a batch-level clip there does not
    reach the update, compared with the same seeded run without it."""

    def run(clip):
        model = _model()
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
        p = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
            DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            sampling="fixed",
            epochs=1,
            seed=0,
        )
        norms = []
        for xb, yb in p.data_loader:
            if zero:
                p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(xb), yb).backward()
            if clip:
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1e-4)))
            p.optimizer.step()
        return [q.detach().clone() for q in model.parameters()], norms

    base, _ = run(False)
    clipped, norms = run(True)
    assert all(torch.equal(a, b) for a, b in zip(base, clipped, strict=True))
    assert norms[0] == 0.0 and (max(norms) == 0.0) == zero


def test_hooks_registered_later_are_refused_at_an_eval_mode_forward_with_gradients():
    """In eval mode the layers run on the parameters themselves, so autograd would carry
    the batch's raw gradient to a hook in backward(): a step in backward would move the
    weights by it, unclipped and noise-free, before step() refuses the eval-mode step.
    Refused at the forward instead, the weights unchanged; so is a gradient hook, which
    would see the raw gradient. Under torch.no_grad an eval forward is not refused."""
    model = _model()
    p = _private(model)
    before = [q.detach().clone() for q in model.parameters()]
    handles = _step_in_backward(model)
    xb, yb = next(iter(p.data_loader))
    model.eval()
    with torch.no_grad():
        p.model(xb)  # evaluation: no gradient can reach a hook
    with pytest.raises(TrainingLoopError, match=r"post-accumulate-grad hooks.*eval mode"):
        nn.functional.cross_entropy(p.model(xb), yb).backward()
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    for hd in handles:
        hd.remove()
    seen = []
    h = model[0].weight.register_hook(lambda g: seen.append(g.clone()))
    with pytest.raises(TrainingLoopError, match=r"gradient hooks.*'0.weight'.*eval mode"):
        nn.functional.cross_entropy(p.model(xb), yb).backward()
    assert seen == []
    h.remove()
    model.train()
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb), yb).backward()
    p.optimizer.step()  # trains as usual once removed
    assert not torch.equal(before[0], model[0].weight)
