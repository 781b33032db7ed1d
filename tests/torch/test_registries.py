"""Extending the PyTorch engine by registration alone: a layer defined outside
privlearn gets a per-example rule, a validator and an instrumenter through the public
registries, and its clipped gradient sum equals a naive loop of batch-size-1 backward
passes (float64, 1e-10 relative). Nothing is written onto the user's modules."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import privlearn.torch as pt  # noqa: E402
from privlearn.torch import grad_sample, validator  # noqa: E402
from privlearn.torch.grad_sample import Materialized  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402


class Hadamard(nn.Module):
    """``y = x * w + b`` over the last dimension (a layer privlearn has no rule for)."""

    def __init__(self, d: int, unsafe: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.unsafe = unsafe

    def forward(self, x):
        return torch.mul(x, self.weight) + self.bias


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.had = Hadamard(5)
        self.head = nn.Linear(5, 1, dtype=torch.float64)

    def forward(self, x):  # x: (B, T, 5)
        return self.head(torch.tanh(self.had(x))).sum((1, 2))


class _CaptureInput(TorchFunctionMode):
    """Instrumenter of Hadamard: captures the input of its ``torch.mul``."""

    def __init__(self, sink):
        super().__init__()
        self._sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.mul:
            self._sink({"x": args[0].detach()})
        return func(*args, **(kwargs or {}))


CALLS = {"rule": 0, "captured": 0}


def hadamard_rule(module, record, params):
    CALLS["rule"] += 1
    if record.extra is not None:
        CALLS["captured"] += 1
        x = record.extra["x"]
    else:
        x = record.args[0]
    g = record.grad(0)
    grads = {"weight": (x * g).sum(1), "bias": g.sum(1)}
    names = {id(p): n for n, p in module.named_parameters()}
    return Materialized(params, [grads[names[id(p)]] for p in params])


def hadamard_check(module, trainable):
    return ["unsafe=True is refused by this test's validator; pass unsafe=False"] \
        if module.unsafe else []


@pytest.fixture
def registered():
    grad_sample.register_rule(Hadamard)(hadamard_rule)
    grad_sample.register_instrumenter(Hadamard)(_CaptureInput)
    validator.register_validator(Hadamard)(hadamard_check)
    CALLS.update(rule=0, captured=0)
    yield
    grad_sample.RULES.pop(Hadamard, None)
    grad_sample.INSTRUMENTERS.pop(Hadamard, None)
    validator.VALIDATORS.pop(Hadamard, None)


def _naive_clipped_sum(model, x, c):
    """sum_i min(1, C / ||g_i||) g_i from one backward pass per example."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    total = None
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(model(x[i:i + 1]).sum(), params)
        g = torch.cat([t.reshape(-1) for t in grads])
        g = g * min(1.0, c / g.norm().item())
        total = g if total is None else total + g
    return total


def test_registered_rule_matches_naive_loop_and_leaves_modules_untouched(registered):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(8, 3, 5, dtype=torch.float64)
    before = {m: dict(m.__dict__) for m in model.modules()}
    tracker = GradSampleTracker(model, loss_reduction="sum")
    model(x).sum().backward()
    contribs, batch, scale = tracker.contributions()
    sq = sum(c.sq_norms() for c in contribs).double() * scale ** 2
    norms = sq.sqrt()
    c = float(norms.median())  # clips about half the examples
    factors = torch.clamp(c / norms, max=1.0)
    by_id = {}
    for con in contribs:
        for p, w in zip(con.params, con.weighted_sum(factors * scale), strict=True):
            by_id[id(p)] = w if id(p) not in by_id else by_id[id(p)] + w
    ours = torch.cat([by_id[id(p)].reshape(-1) for p in model.parameters()])
    tracker.detach()
    ref = _naive_clipped_sum(model, x, c)
    assert CALLS["rule"] == 1 and CALLS["captured"] == 1  # our rule, with our capture
    assert torch.allclose(ours, ref, rtol=1e-10, atol=1e-12 * ref.abs().max().item())
    for m in model.modules():
        assert m.__dict__.keys() == before[m].keys()
        assert "forward" not in m.__dict__


def test_registered_validator_refuses_before_the_first_step(registered):
    model = Net()
    model.had.unsafe = True
    problems = pt.validate(model)
    assert any("unsafe=True is refused" in p and "had (Hadamard)" in p for p in problems)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3, 5, dtype=torch.float64))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    with pytest.raises(validator.UnsupportedModuleError, match="unsafe=True"):
        pt.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                        noise_multiplier=1.0, max_grad_norm=1.0)


def test_without_registration_the_fallback_is_used():
    torch.manual_seed(1)
    model = Net()
    assert grad_sample.get_rule(model.had) is None
    assert grad_sample.get_instrumenter(model.had) is None
    assert pt.validate(model) == []


def _noop_rule(module, record, params):
    return None


def test_layer_rule_refuses_unknown_scope_and_own_layout_without_batch_dim():
    """Typed refusals naming the setting, the allowed values and the value received."""
    from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
    from privlearn.torch import LayerRule, Layout

    with pytest.raises(ParameterValueError, match=r"scope must be 'subtree' or 'direct', "
                                                  r"got 'children'"):
        LayerRule(_noop_rule, scope="children")
    with pytest.raises(ConfigurationError, match=r"own_layout=True needs batch_dim.*None"):
        Layout(own_layout=True)
    with pytest.raises(ParameterTypeError, match=r"layout must be a privlearn.torch.Layout"):
        LayerRule(_noop_rule, layout=0)
    with pytest.raises(ParameterTypeError, match=r"unknown option\(s\) \['colour'\]"):
        LayerRule(_noop_rule, colour="red")


def test_layout_keywords_are_deprecated_not_broken():
    """The six layout fields given one by one (the old spelling) still build the same
    rule, with a DeprecationWarning; reading them from the rule warns too."""
    from privlearn.errors import ConfigurationError
    from privlearn.torch import LayerRule, Layout

    dims = lambda m, rec, b: ([0], {}, [0])  # noqa: E731
    with pytest.warns(DeprecationWarning, match=r"layout=Layout\("):
        old = LayerRule(_noop_rule, batch_dim=1, own_layout=True, moves=False,
                        expand_broadcast=False, record_dims=dims, scope="direct")
    new = LayerRule(_noop_rule, Layout(batch_dim=1, own_layout=True, moves=False,
                                       expand_broadcast=False, record_dims=dims),
                    scope="direct")
    assert old == new
    with pytest.warns(DeprecationWarning, match=r"rule\.layout\.own_layout"):
        assert old.own_layout is True
    with pytest.raises(ConfigurationError, match="pass only layout="):
        LayerRule(_noop_rule, Layout(), batch_dim=0)

    class Odd(nn.Module):
        pass

    try:
        with pytest.warns(DeprecationWarning, match="register_rule"):
            grad_sample.register_rule(Odd, batch_dim=0, scope="direct")(_noop_rule)
        rule = grad_sample.get_rule(Odd())
        assert rule.layout == Layout(batch_dim=0) and rule.scope == "direct"
        assert rule.compute is _noop_rule
    finally:
        grad_sample.RULES.pop(Odd, None)


def test_registries_refuse_a_key_that_is_not_a_class():
    from privlearn.errors import ParameterTypeError

    with pytest.raises(ParameterTypeError, match=r"register_rule: .*keyed by class, got "
                                                 r"'Linear'"):
        grad_sample.register_rule("Linear")
    with pytest.raises(ParameterTypeError, match="register_validator"):
        validator.register_validator(nn.Linear(2, 2))


class _ScaledLookup(nn.Embedding):
    """An Embedding whose forward scales the lookup (as Gemma's word embedding does)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


class _ShiftedLookup(nn.Embedding):
    """An Embedding looking up ids shifted by two (as OPT's learned positions do)."""

    def forward(self, ids):
        return super().forward(ids + 2)


def _lookup_model_and_naive_sum(layer, oracle):
    """A float64 model whose first layer is the lookup ``layer(12, 4)``, a batch of 4
    examples of 3 tokens, the median per-example gradient norm as clipping bound, and
    the naive loop's clipped sum and per-example norms at that bound."""
    torch.manual_seed(0)
    model = nn.Sequential(layer(12, 4, dtype=torch.float64), nn.Flatten(),
                          nn.Linear(12, 3, dtype=torch.float64))
    ids = torch.tensor([[1, 2, 3], [4, 4, 1], [0, 5, 9], [7, 7, 7]])
    y = torch.tensor([0, 1, 2, 1])
    rows = oracle.grads(lambda i: nn.functional.cross_entropy(model(ids[i:i + 1]), y[i:i + 1]),
                        4, list(model.parameters()))
    c = rows.norm(dim=1).median().item()
    ref, ref_norms = oracle.clip_and_sum(rows, c)
    return model, ids, y, c, ref, ref_norms


class _PlainSubclass(nn.Linear):
    """A subclass overriding nothing that computes: the Linear rule still applies."""


@pytest.mark.parametrize("layer", [_ScaledLookup, _ShiftedLookup])
def test_a_subclass_overriding_forward_does_not_inherit_the_base_rule(layer, oracle):
    """The base's rule describes the base's forward only: a subclass computing something
    else gets the generic rule (with a warning) and the clipped sum of the naive loop."""
    model, ids, y, c, ref, ref_norms = _lookup_model_and_naive_sum(layer, oracle)
    with pytest.warns(RuntimeWarning, match="overrides .*forward"):
        assert grad_sample.get_rule(model[0]) is None
    tracker = GradSampleTracker(model, loss_reduction="mean")
    try:
        nn.functional.cross_entropy(model(ids), y).backward()
        sums, _, norms = tracker.clipped_sum(c)
    finally:
        tracker.detach()
    got = torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-10, atol=0)
    assert (got - ref).norm() <= 1e-10 * ref.norm()


def test_a_subclass_overriding_nothing_keeps_the_base_rule():
    assert grad_sample.get_rule(_PlainSubclass(2, 2)) is grad_sample.get_rule(nn.Linear(2, 2))


class OddScaledWordEmbedding(nn.Embedding):
    """Named like Hugging Face's scaled word embeddings, with an ``embed_scale``, but
    adding it instead of multiplying by it: the class-name rule must notice."""

    embed_scale = 2.0

    def forward(self, ids):
        return super().forward(ids) ** 2 + self.embed_scale


def test_a_look_alike_scaled_embedding_is_checked_and_handed_to_the_generic_rule(oracle):
    model, ids, y, c, ref, _ = _lookup_model_and_naive_sum(OddScaledWordEmbedding, oracle)
    assert grad_sample.get_rule(model[0]).compute.__name__ == "scaled_embedding_rule"
    tracker = GradSampleTracker(model, loss_reduction="mean")
    try:
        nn.functional.cross_entropy(model(ids), y).backward()
        with pytest.warns(RuntimeWarning, match="does not behave as privlearn's rule"):
            sums, _, _ = tracker.clipped_sum(c)
    finally:
        tracker.detach()
    got = torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()])
    assert (got - ref).norm() <= 1e-10 * ref.norm()
