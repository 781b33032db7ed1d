"""Models from problems Opacus users reported, through one noise-free make_private step.

Each case is a model shape that broke Opacus's per-sample gradients (a layer called twice
on inputs of different shapes, a custom layer using its parameter twice, a norm module
shared by two places, attention with ``is_causal``, activation checkpointing of a
sequence of layers, layers without an Opacus grad sampler). The engine's clipped sum must
equal the definition: a float64 loop of batch-of-one backward passes, each example's
gradient clipped on its own, summed (the ``oracle`` of conftest.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint_sequential  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402

# torch.func has no batching rule for Bilinear's trilinear product (a slower loop)
pytestmark = [
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore:a Linear's forward is replaced:RuntimeWarning"),
]

B = 5


class _Word2Vec(nn.Module):
    """Skip-gram with negative sampling: the context embedding is called on the positive
    word (B, 1) and on the negatives (B, 3) in the same step."""

    def __init__(self):
        super().__init__()
        self.target = nn.Embedding(10, 4)
        self.context = nn.Embedding(10, 4)

    def forward(self, word, ctx, neg):
        e = self.target(word)
        pos = (e * self.context(ctx)[:, 0]).sum(-1, keepdim=True)
        negs = (self.context(neg) * e[:, None]).sum(-1)
        return torch.cat([pos, negs], 1)


class _LinearLike(nn.Module):
    """A custom layer (no registered rule) that uses its weight twice."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4) * 0.3)
        self.b = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x @ self.w.t() + torch.tanh(x @ self.w.t()) + self.b


class _ScaledLinear(nn.Module):
    """A custom layer with a parameter of its own and a child Linear."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.inner = nn.Linear(4, 3)

    def forward(self, x):
        return self.inner(x * self.scale)


class _SharedNorm(nn.Module):
    """One LayerNorm module applied at two places of the forward pass."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        h = self.norm(self.a(x))
        return self.b(self.norm(h + torch.relu(self.a(h))))


class _CausalAttention(nn.Module):
    """Batch-first self-attention called with a causal mask and ``is_causal=True``."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        out = self.attn(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return out.flatten(1)


class _Checkpointed(nn.Module):
    """Non-reentrant activation checkpointing of a Sequential in two segments."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(
            nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)
        )

    def forward(self, x):
        return checkpoint_sequential(self.seq, 2, x, use_reentrant=False)


class _ScaledGradient(nn.Module):
    """A gradient hook on a layer's output in forward (``h.register_hook``): the layer's
    parameters receive the scaled gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: -2.0 * g)
        return self.b(torch.tanh(h))


class _Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(3, 4, 3)

    def forward(self, a, b):
        return self.bilinear(a, b)


def _cases():
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=g)

    return {
        "embedding twice, two shapes": (_Word2Vec, (ints(10, B), ints(10, B, 1), ints(10, B, 3))),
        "custom layers": (
            lambda: nn.Sequential(_LinearLike(), nn.Tanh(), nn.Linear(3, 4), _ScaledLinear()),
            (randn(B, 4),),
        ),
        "one norm at two places": (_SharedNorm, (randn(B, 4),)),
        "causal attention": (_CausalAttention, (randn(B, 3, 4),)),
        "checkpoint_sequential": (_Checkpointed, (randn(B, 4),)),
        "bilinear": (_Bilinear, (randn(B, 3), randn(B, 4))),
        "gradient hook in forward": (_ScaledGradient, (randn(B, 4),)),
        "prelu": (
            lambda: nn.Sequential(nn.Linear(4, 3), nn.PReLU(3), nn.Linear(3, 3)),
            (randn(B, 4),),
        ),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_clipped_sum_is_the_batch_of_one_definition(name, oracle):
    build, inputs = CASES[name]
    torch.manual_seed(1)
    model = build().double()
    with torch.no_grad():
        out_dim = model(*(t[:1] for t in inputs)).shape[1]
    target = torch.randn(
        B, out_dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )

    def loss_of(i):
        return ((model(*(t[i : i + 1] for t in inputs)) - target[i : i + 1]) ** 2).sum()

    params = oracle.trainable(model)
    rows = oracle.grads(loss_of, B, params)
    bound = float(rows.norm(dim=1).median())  # some examples clipped, some not
    ref, _ = oracle.clip_and_sum(rows, bound)

    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(*inputs, target), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=bound,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    *xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    ((p.model(*xb) - yb) ** 2).sum().backward()
    p.optimizer.step()
    got = oracle.flat(q.grad for q in params) * B  # the step divides by B
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


class _Mask(nn.Module):
    """The parametrization that keeps a pruning mask: ``weight = original * mask``."""

    def __init__(self, mask):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, w):
        return w * self.mask


def _step_matches_the_loop(model, x, target, oracle):
    """One noise-free private step of ``model`` on ``(x, target)`` (squared error, sum)
    equals the batch-of-one clipped sum, clipped at the median per-example norm."""
    params = oracle.trainable(model)
    rows = oracle.grads(lambda i: ((model(x[i : i + 1]) - target[i : i + 1]) ** 2).sum(), B, params)
    bound = float(rows.norm(dim=1).median())
    ref, _ = oracle.clip_and_sum(rows, bound)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, target), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=bound,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    ((p.model(xb) - yb) ** 2).sum().backward()
    p.optimizer.step()
    torch.testing.assert_close(oracle.flat(q.grad for q in params) * B, ref, rtol=1e-9, atol=1e-12)


def _pruned_mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def test_torch_prune_is_refused_before_anything_naming_the_parametrization():
    """torch.nn.utils.prune recomputes ``weight = weight_orig * weight_mask`` in a forward
    pre-hook, outside the layer: make_private refuses it up front (it used to accept it
    and refuse the first step as a parameter used in a functional call)."""
    from torch.nn.utils import prune

    from privlearn.errors import UnsupportedModuleError

    model = _pruned_mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    prune.random_unstructured(model[2], "bias", amount=0.5)
    prune.l1_unstructured(model[2], "bias", amount=0.2)  # iterative: a PruningContainer
    loader = DataLoader(TensorDataset(torch.randn(8, 4, dtype=torch.float64)), batch_size=2)
    with pytest.raises(UnsupportedModuleError) as info:
        make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0
        )
    msg = str(info.value)
    assert "'weight'" in msg and "'bias'" in msg and "register_parametrization" in msg
    assert model[0]._forward_pre_hooks  # the user's model is left as it was

    frozen = _pruned_mlp()
    prune.l1_unstructured(frozen[0], "weight", amount=0.5)
    frozen[0].requires_grad_(False)  # a frozen pruned layer is a fixed map: accepted
    p = make_private(
        frozen, torch.optim.SGD(frozen[2].parameters(), lr=0.1), loader, noise_multiplier=1.0
    )
    p.detach()


def test_a_pruning_mask_kept_as_a_parametrization_clips_the_definition(oracle):
    """What the refusal recommends trains the masked weight exactly."""
    from torch.nn.utils import parametrize

    model = _pruned_mlp()
    mask = (torch.rand(5, 4, generator=torch.Generator().manual_seed(3)) > 0.5).double()
    parametrize.register_parametrization(model[0], "weight", _Mask(mask))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, 4, generator=g, dtype=torch.float64)
    target = torch.randn(B, 3, generator=g, dtype=torch.float64)
    _step_matches_the_loop(model, x, target, oracle)
    original = model[0].parametrizations.weight.original
    assert (original.grad[mask == 0] == 0).all() and (original.grad[mask == 1] != 0).all()


def _hooked_gru():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 3, batch_first=True)
            self.head = nn.Linear(3, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    model = Model()
    model.rnn.register_forward_hook(lambda m, args, out: (out[0] * 2.0, out[1]))
    return model


def _hooked(first, hook):
    def build():
        model = nn.Sequential(first(), nn.Flatten(), nn.LazyLinear(3))
        model[0].register_forward_hook(hook)
        return model

    return build


HOOKED = {
    # a forward hook registered before make_private that replaces or changes a layer's
    # output: the layer's rule needs the gradient of the output forward returned
    "linear, out * 3": (_hooked(lambda: nn.Linear(4, 3), lambda m, a, out: out * 3.0), (B, 4)),
    "linear, in place": (_hooked(lambda: nn.Linear(4, 3), lambda m, a, out: out.mul_(3.0)), (B, 4)),
    "conv, relu * 2": (
        _hooked(lambda: nn.Conv2d(2, 3, 3), lambda m, a, out: torch.relu(out) * 2),
        (B, 2, 5, 5),
    ),
    "layernorm, squared": (_hooked(lambda: nn.LayerNorm(4), lambda m, a, out: out**2), (B, 4)),
    # ... or that registers a tensor hook scaling the output's gradient
    "linear, tensor hook": (
        _hooked(
            lambda: nn.Linear(4, 3),
            lambda m, a, out: (
                (out.register_hook(lambda g: 3 * g) and None) if out.requires_grad else None
            ),
        ),
        (B, 4),
    ),
    "gru, first output * 2": (_hooked_gru, (B, 3, 4)),
    # a layer without a rule (the generic torch.func one) called again by the rule: its
    # own hooks must not run a second time
    "custom layer, out * 3": (_hooked(_LinearLike, lambda m, a, out: out * 3.0), (B, 4)),
    "custom layer, tensor hook": (
        _hooked(
            _LinearLike,
            lambda m, a, out: (
                (out.register_hook(lambda g: 3 * g) and None) if out.requires_grad else None
            ),
        ),
        (B, 4),
    ),
}


def _pre_hooked_custom():
    model = nn.Sequential(_LinearLike(), nn.Tanh(), nn.Linear(3, 3))
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2.0 + 1.0,))
    return model


HOOKED["custom layer, pre-hook"] = (_pre_hooked_custom, (B, 4))


@pytest.mark.parametrize("name", sorted(HOOKED))
def test_a_forward_hook_that_changes_a_layer_output_keeps_the_definition(name, oracle):
    """The engine records each layer's output before the user's forward hooks: a hook
    registered first (``out * 3``) made it record the gradient of the hooked output,
    off by the hook's derivative."""
    build, shape = HOOKED[name]
    torch.manual_seed(1)
    model = build().double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        model(x[:1])  # a LazyLinear takes its size
    target = torch.randn(B, 3, generator=g, dtype=torch.float64)
    _step_matches_the_loop(model, x, target, oracle)


def _times_three(layer):
    """``layer.forward`` replaced on the instance by a wrapper of the original."""
    original = layer.forward
    layer.forward = lambda inp: original(inp) * 3.0


def _monkeypatched_lora():
    """A LoRA added by monkeypatching: two parameters on a frozen Linear and its forward
    replaced on the instance."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    lin = model[0]
    lin.weight.requires_grad_(False)
    lin.lora_a = nn.Parameter(torch.randn(2, 4) * 0.3)
    lin.lora_b = nn.Parameter(torch.randn(3, 2) * 0.3)
    lin.forward = lambda inp: (
        nn.functional.linear(inp, lin.weight, lin.bias) + inp @ lin.lora_a.t() @ lin.lora_b.t()
    )
    return model


def _wrapped_mlp():
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    _times_three(model[0])
    return model


@pytest.mark.parametrize("when", ["before make_private", "after a step", "lora"])
def test_a_forward_replaced_on_the_instance_keeps_the_definition(when, oracle):
    """A layer whose ``forward`` is replaced on the instance (``layer.forward = f``: a
    wrapper, a monkeypatched LoRA) computes what ``f`` does: it is differentiated as it
    runs (it kept its class's rule, the gradients of a Linear's own formula, and a
    monkeypatched LoRA's parameters got none)."""
    build = {"before make_private": _wrapped_mlp, "lora": _monkeypatched_lora}.get(
        when, lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    )
    torch.manual_seed(1)
    reference = build().double()  # the same model, never attached
    if when == "after a step":
        _times_three(reference[0])
    torch.manual_seed(1)
    model = build().double()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(B, 4, generator=g, dtype=torch.float64)
    target = torch.randn(B, 3, generator=g, dtype=torch.float64)
    rows = oracle.grads(
        lambda i: ((reference(x[i : i + 1]) - target[i : i + 1]) ** 2).sum(),
        B,
        oracle.trainable(reference),
    )
    bound = float(rows.norm(dim=1).median())
    ref, _ = oracle.clip_and_sum(rows, bound)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, target), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=bound,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )

    def step():
        xb, yb = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        ((p.model(xb) - yb) ** 2).sum().backward()
        p.optimizer.step()

    if when == "after a step":
        step()  # (at learning rate 0 the parameters stay the reference's)
        _times_three(model[0])
    step()
    got = oracle.flat(q.grad for q in oracle.trainable(model)) * B
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


def test_a_layer_called_through_its_forward_method_is_refused_saying_so():
    """``self.fc.forward(x)`` skips the layer's hooks, so its parameters get autograd's
    batch gradient: refused (as any use outside the layer), and the error says to call
    the layer itself."""
    from privlearn.errors import TrainingLoopError

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc.forward(x)

    model = Model()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 3)), batch_size=8),
        noise_multiplier=1.0,
        sampling="fixed",
    )
    xb, yb = next(iter(p.data_loader))
    before = model.fc.weight.detach().clone()
    ((p.model(xb) - yb) ** 2).sum().backward()
    with pytest.raises(TrainingLoopError, match=r"layer\.forward\(x\).*call layer\(x\)"):
        p.optimizer.step()
    assert torch.equal(model.fc.weight, before) and p.accountant.steps == 0
