"""The DP optimizer's step: one gate for updates, one truth per privacy parameter, one
batch per step.

Each test is a way ordinary training released something the accountant did not cover:
a parameter the optimizer holds outside the model (a learnable temperature), a layer
unfrozen after make_private (progressive unfreezing), a writable copy of the sampling
rate, two batches of the private loader backpropagated into one step."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _step(p, x, y, loss=None):
    p.optimizer.zero_grad()
    out = p.model(x)
    (loss(out, y) if loss else nn.functional.cross_entropy(out, y)).backward()
    p.optimizer.step()


def test_parameter_outside_the_model_is_refused_before_anything_is_released(make_data, make_mlp):
    """A learnable temperature in its own param group: its gradient never went through
    clipping or noise, and the wrapped optimizer would step on it."""
    model = make_mlp(act=nn.Tanh)
    temp = nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [temp]}], lr=0.5)
    p = make_private(model, opt, DataLoader(make_data(), batch_size=8), noise_multiplier=1.0,
                     seed=0)
    before = [q.detach().clone() for q in model.parameters()]
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x) / temp, y).backward()
    with pytest.raises(RuntimeError, match="not a parameter of the model"):
        p.optimizer.step()
    assert temp.item() == 1.0 and p.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="not parameters of the model"):
        p.optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


def test_layer_unfrozen_after_make_private_is_clipped_with_the_others(oracle, make_data, make_mlp):
    """Progressive unfreezing: the unfrozen layer's gradient is clipped per example
    together with the others (equal to a naive per-example loop), never stepped raw."""
    torch.set_default_dtype(torch.float64)
    try:
        model = make_mlp(act=nn.Tanh, seed=1)
        for q in model[0].parameters():
            q.requires_grad_(False)
        ref = copy.deepcopy(model)
        C, lr = 0.05, 0.5
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                         DataLoader(make_data(), batch_size=8), noise_multiplier=0.0,
                         max_grad_norm=C, sampling="fixed", seed=2)
        it = iter(p.data_loader)
        x, y = next(it)
        _step(p, x, y)
        oracle.step(ref, x, y, C, lr, 8)
        for m in (model, ref):
            for q in m[0].parameters():
                q.requires_grad_(True)
        x, y = next(it)
        _step(p, x, y)
        oracle.step(ref, x, y, C, lr, 8)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert id(model[0].weight) in p.optimizer.tracker.param_ids
    finally:
        torch.set_default_dtype(torch.float32)


def test_param_group_added_from_a_generator_is_trained(oracle, make_data, make_mlp):
    """Progressive unfreezing with the usual idiom, ``add_param_group({"params":
    layer.parameters()})`` (a generator): the unfrozen layer is trained, clipped with the
    others, exactly as the naive per-example loop (the check of the group once spent the
    generator, so the wrapped optimizer got an empty group and the layer silently stayed
    as it was)."""
    torch.set_default_dtype(torch.float64)
    try:
        model = make_mlp(act=nn.Tanh, seed=1)
        model[0].requires_grad_(False)
        ref = copy.deepcopy(model)
        C, lr = 0.05, 0.5
        opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=lr)
        p = make_private(model, opt, DataLoader(make_data(), batch_size=8),
                         noise_multiplier=0.0, max_grad_norm=C, sampling="fixed", seed=2)
        for m in (model, ref):
            m[0].requires_grad_(True)
        p.optimizer.add_param_group({"params": model[0].parameters()})
        assert [len(g["params"]) for g in p.optimizer.param_groups] == [2, 2]
        x, y = next(iter(p.data_loader))
        _step(p, x, y)
        oracle.step(ref, x, y, C, lr, 8)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_weights_assigned_after_make_private_are_the_ones_trained(oracle, make_data, make_mlp):
    """Weights loaded after make_private by assignment (``load_state_dict(...,
    assign=True)``, ``layer.weight = nn.Parameter(...)``) and handed to the optimizer are
    the ones the forward uses and the step updates, exactly as the naive per-example loop
    (the engine once put its own copies of the old parameters back into the model)."""
    torch.set_default_dtype(torch.float64)
    try:
        model = make_mlp(act=nn.Tanh, seed=1)
        ref = make_mlp(act=nn.Tanh, seed=3)  # the weights to load
        C, lr = 0.05, 0.5
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        p = make_private(model, opt, DataLoader(make_data(), batch_size=8),
                         noise_multiplier=0.0, max_grad_norm=C, sampling="fixed", seed=2)
        model.load_state_dict(copy.deepcopy(ref.state_dict()), assign=True)
        opt.param_groups[0]["params"] = list(model.parameters())
        it = iter(p.data_loader)
        for _ in range(2):
            x, y = next(it)
            _step(p, x, y)
            oracle.step(ref, x, y, C, lr, 8)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_raw_gradient_of_a_model_parameter_is_refused(make_data, make_mlp):
    """A gradient set on a model parameter outside the engine (e.g. by a second,
    non-private backward through a detached copy) is refused by the gate."""
    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, seed=0)
    for q in model[0].parameters():
        q.requires_grad_(False)  # the engine forgets it at the next forward ...
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    model[0].weight.grad = torch.ones_like(model[0].weight)  # ... but it holds a gradient
    with pytest.raises(RuntimeError, match="'0.weight' of the model holds a gradient"):
        p.optimizer.step()


def test_layer_frozen_mid_run_with_gradients_zeroed_in_place(oracle, make_data, make_mlp):
    """A layer frozen between steps, gradients cleared with ``zero_grad(set_to_none=
    False)`` (which zeroes the frozen layer's gradient in place, as torch's does): every
    later step was refused (the gate took the zero gradient for a raw one and said to run
    a forward pass after unfreezing). A zero gradient releases nothing: the steps go on,
    the frozen layer stays where it was (plain SGD) and the trained ones step as the
    naive per-example loop says. A frozen parameter holding a gradient set before is still
    refused, with what to do."""
    torch.set_default_dtype(torch.float64)
    try:
        model = make_mlp(act=nn.Tanh)
        C, lr = 0.05, 0.5
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                         DataLoader(make_data(), batch_size=8), noise_multiplier=0.0,
                         max_grad_norm=C, sampling="fixed", seed=0)
        it = iter(p.data_loader)
        _step(p, *next(it))
        model[0].requires_grad_(False)
        ref, frozen = copy.deepcopy(model), copy.deepcopy(model[0])
        for _ in range(2):
            x, y = next(it)
            p.optimizer.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            oracle.step(ref, x, y, C, lr, 8)
        assert p.accountant.steps == 3
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        for a, b in zip(model[0].parameters(), frozen.parameters(), strict=True):
            assert torch.equal(a, b)
        x, y = next(it)
        p.optimizer.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(p.model(x), y).backward()
        model[0].bias.grad.fill_(1.0)
        with pytest.raises(TrainingLoopError, match="'0.bias' of the model.*frozen"):
            p.optimizer.step()
        assert p.accountant.steps == 3
    finally:
        torch.set_default_dtype(torch.float32)


def test_sampling_rate_has_one_truth(make_data, make_mlp):
    """The optimizer's sampling rate was a writable copy that the accountant recorded:
    setting it to 0.001 while the sampler drew at 0.1 reported 0.0235 for 10 steps
    instead of 2.85."""
    ds = make_data(n=80)
    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0, seed=0)
    for target in (p.optimizer, p):
        with pytest.raises(AttributeError, match="sampling_rate cannot be changed"):
            target.sampling_rate = 0.001
    with pytest.raises(AttributeError):
        p.optimizer.expected_batch_size = 1.0
    with pytest.raises(AttributeError):
        p.accountant.sampling_rate = 0.001
    for x, y in p.data_loader:
        _step(p, x, y)
    assert p.accountant.steps == 10
    want = compose(subsample(Gaussian(1.0), rate=0.1), steps=10).epsilon(1e-5)
    assert p.epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    assert p.epsilon(1e-5) > 2.8


def test_two_batches_backpropagated_into_one_step_are_refused(make_data, make_mlp):
    """``(loss(b1) + loss(b2)).backward()`` then one step: example i of each batch would be
    clipped together and two draws counted as one step (7.2 -> 16.1)."""
    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, seed=0,
                     sampling="fixed")  # equal batch sizes: nothing else can notice
    it = iter(p.data_loader)
    (x1, y1), (x2, y2) = next(it), next(it)
    p.optimizer.zero_grad()
    (nn.functional.cross_entropy(p.model(x1), y1)
     + nn.functional.cross_entropy(p.model(x2), y2)).backward()
    with pytest.raises(RuntimeError, match="2 batches of p.data_loader were drawn"):
        p.optimizer.step()
    assert p.accountant.steps == 0


def test_rows_seen_by_the_layers_must_be_the_examples_delivered(make_data, make_mlp):
    """Two augmented views concatenated into one batch: each row would be clipped as an
    example of its own (two rows per example). Refused, with the reason."""
    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, seed=0,
                     sampling="fixed")
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(torch.cat([x, x + 0.1])), torch.cat([y, y])).backward()
    with pytest.raises(ValueError, match="2 rows per example"):
        p.optimizer.step()
    assert p.accountant.steps == 0



@pytest.mark.parametrize("rows,causes", [
    (lambda x: x[:-1], ["Fewer rows (7) than examples (8)", "x[:k]", "masking"]),
    (lambda x: torch.cat([x, x[:3]]), ["More rows (11) than examples (8)", "x[:k]",
                                       "batch_dims="]),
], ids=["fewer", "more"])
def test_a_forward_of_another_size_names_what_was_seen_and_the_causes(make_data, make_mlp,
                                                                      rows, causes):
    """A forward pass on a slice of the batch (no packing anywhere) was blamed on "packed"
    batches; the refusal now says what was seen and the likely causes, a slice of the
    batch or another loader's batch first."""
    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, seed=0,
                     sampling="fixed")
    x, y = next(iter(p.data_loader))
    xs = rows(x)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xs), y[:1].expand(len(xs))).backward()
    with pytest.raises(ValueError) as err:
        p.optimizer.step()
    msg = str(err.value)
    assert f"saw {len(xs)} rows" in msg and "delivered 8 examples" in msg
    for cause in causes:
        assert cause in msg
    assert msg.index("x[:k]") < msg.find("packed") or "packed" not in msg
    assert p.accountant.steps == 0

def test_saved_noise_state_cannot_replay_past_steps(make_data, make_mlp):
    """Forward secrecy: the noise source moves along a one-way chain after every step, so
    a checkpoint (a release) replays the noise of the next step, not of the last one."""
    from privlearn.torch import NoiseSource

    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, seed=5)
    first_seed = p.optimizer.noise.seed
    x, y = next(iter(p.data_loader))
    _step(p, x, y)
    state = p.state_dict()["noise"]
    assert state["seed"] != first_seed
    replay = NoiseSource(seed=0)
    replay.load_state_dict(state)
    a = replay.fill_normal_(torch.empty(1000), 1.0)
    past = torch.empty(1000).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(
        first_seed))
    assert not torch.equal(a, past)


def test_a_steady_step_reads_nothing_back_from_the_device(monkeypatch, make_data, make_mlp):
    """No host synchronisation on the hot path of a step but the one documented check
    (non-finite per-example norms, one read a step): patched reads are counted."""
    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, seed=5)
    it = iter(p.data_loader)
    x, y = next(it)
    _step(p, x, y)  # the first step runs the probe (documented, once)
    seen = [len(x)]
    for x, y in it:  # and so does a batch larger or smaller than any before
        if min(n for n in seen if n >= 2) < len(x) < max(seen):
            break
        seen.append(len(x))
        _step(p, x, y)
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    p.optimizer.zero_grad()
    out = nn.functional.cross_entropy(p.model(x), y)
    out.backward()
    reads.clear()
    p.optimizer.step()
    assert len(reads) <= 1, reads


def test_a_model_cast_after_make_private_trains_as_the_naive_loop(make_data, make_mlp, oracle):
    """``p.model.double()`` (or ``.to(device)``) after make_private: the optimizer's
    gradient buffers follow the parameters' new dtype (they used to stay float32: the
    step after the cast updated the parameters wrongly, by 0.07 here, or failed inside
    torch assigning a float32 gradient to a float64 parameter), and the steps before and
    after the cast equal the naive per-example loop."""
    ds = make_data(n=40, spread=True)
    model = make_mlp(seed=4)
    ref = copy.deepcopy(model).double()
    C, lr = 0.5, 1.0
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                     DataLoader(ds, batch_size=8), noise_multiplier=0.0, max_grad_norm=C,
                     sampling="fixed", seed=0)
    batches = iter(p.data_loader)
    for k in range(3):
        if k == 1:
            p.model.double()
        x, y = next(batches)
        _step(p, x.to(model[0].weight.dtype), y)
        oracle.step(ref, x.double(), y, C, lr, 8)
        tol = 1e-5 if k == 0 else 1e-6  # float32 before the cast
        torch.testing.assert_close(oracle.flat(model.parameters()),
                                   oracle.flat(ref.parameters()), rtol=tol, atol=tol)
    assert model[0].weight.grad.dtype == torch.float64 and p.accountant.steps == 3


class _ParameterListOnly(nn.Module):
    """Every parameter in an nn.ParameterList, used functionally by the forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(6, 6) * 0.3),
                                         nn.Parameter(torch.randn(6, 3) * 0.3)])

    def forward(self, x):
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


def test_parameters_reached_only_outside_a_layer_are_named(make_data):
    """A model whose parameters are all used outside any layer (an nn.ParameterList in
    the forward) is refused naming them, as when a layer's parameter is also used
    functionally; it was refused with 'no per-example gradient was recorded: the forward
    ran under torch.no_grad() ...', a cause that did not apply."""
    model = _ParameterListOnly()
    before = [q.detach().clone() for q in model.parameters()]
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(n=32), batch_size=8), noise_multiplier=1.0)
    x, y = next(iter(p.data_loader))
    with pytest.raises(TrainingLoopError, match=r"\['weights.0', 'weights.1'\] are used "
                                                "outside their layers"):
        _step(p, x, y)
    assert p.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _UpdatesThenFails(torch.optim.SGD):
    """An optimizer whose step applies the update, then raises (a failing hook or
    logging call, an interrupt arriving after the update)."""

    fail = True

    def step(self, closure=None):
        super().step(closure)
        if self.fail:
            self.fail = False
            raise RuntimeError("after the update")


def test_a_step_whose_wrapped_optimizer_raises_after_the_update_is_accounted(make_data,
                                                                             make_mlp):
    """The noisy gradient is released (``p.grad``, and the update the wrapped optimizer
    applied) before the wrapped step returns: a step that raises there is still
    accounted and its batch used. It used to leave the parameters updated with no step
    recorded (epsilon understated) and the next step refused for two batches drawn."""
    model = make_mlp()
    before = [q.detach().clone() for q in model.parameters()]
    p = make_private(model, _UpdatesThenFails(model.parameters(), lr=0.1),
                     DataLoader(make_data(n=64), batch_size=8), noise_multiplier=1.0,
                     seed=0)
    batches = iter(p.data_loader)
    x, y = next(batches)
    with pytest.raises(RuntimeError, match="after the update"):
        _step(p, x, y)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    one = subsample(Gaussian(noise_multiplier=1.0), rate=8 / 64)
    assert p.accountant.steps == 1
    assert p.epsilon(1e-5) == compose(one, steps=1).epsilon(1e-5)
    x, y = next(batches)
    _step(p, x, y)  # the loop goes on: the failed step's batch was used
    assert p.accountant.steps == 2
    assert p.epsilon(1e-5) == compose(one, steps=2).epsilon(1e-5)


def test_the_public_pieces_of_a_step_are_accounted_as_one(make_data, make_mlp):
    """``clip_and_accumulate()`` then ``add_noise()`` puts the batch's noisy clipped sum
    in ``p.grad``: a release, accounted as one step of the batch drawn for it (as
    ``step()``, without the update). It used to be accounted as nothing: a loop of them,
    applying ``p.grad`` by hand, trained with ``p.epsilon()`` reporting 0."""
    model = make_mlp()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(n=64), batch_size=8), noise_multiplier=1.0,
                     seed=0)
    released = 0
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.clip_and_accumulate()
        p.optimizer.add_noise()
        released += 1
        with torch.no_grad():
            for q in model.parameters():
                q -= 0.1 * q.grad
        if released == 3:
            break
    one = subsample(Gaussian(noise_multiplier=1.0), rate=8 / 64)
    assert p.accountant.steps == 3
    assert p.epsilon(1e-5) == compose(one, steps=3).epsilon(1e-5) > 0
    # a second release of the same batch (noise again, or a step) is refused
    with pytest.raises(TrainingLoopError, match="without a new batch"):
        p.optimizer.add_noise()
    with pytest.raises(TrainingLoopError, match="without a new batch"):
        p.optimizer.step()
    assert p.accountant.steps == 3


def test_the_loop_goes_on_once_the_cause_of_a_refused_step_is_fixed(make_data, make_mlp):
    """A step refused by a check of the model (here a layer left in eval mode) released
    nothing; its batch is dropped, so that after the fix the next batch trains (the
    refused batch stayed pending and every later step was refused for two batches
    drawn)."""
    model = make_mlp(act=nn.Tanh)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, seed=0)
    model[2].eval()
    it = iter(p.data_loader)
    x, y = next(it)
    with pytest.raises(TrainingLoopError, match="eval mode"):
        _step(p, x, y)
    assert p.accountant.steps == 0
    model.train()
    for done in (1, 2):
        x, y = next(it)
        _step(p, x, y)
        assert p.accountant.steps == done


def _noise_free(make_data, make_mlp, **kw):
    """A float64 run without noise (``p.grad`` is then the clipped sum / the expected
    batch size) of the toy MLP, with a clipping bound that binds."""
    model = make_mlp(act=nn.Tanh, seed=1, dtype=torch.float64)
    return model, make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                               DataLoader(make_data(dtype=torch.float64), batch_size=8),
                               noise_multiplier=0.0, max_grad_norm=0.05, seed=0, **kw)


def test_a_batch_accumulated_twice_is_refused_not_counted_twice(oracle, make_data, make_mlp):
    """``clip_and_accumulate()``, then a second backward pass over the same batch and its
    ``step()``: each example's clipped gradient was added twice (sensitivity 2 C) to one
    step accounted at C. Refused before anything is released; ``add_noise()`` then
    releases the batch counted once (the naive clipped sum)."""
    model, p = _noise_free(make_data, make_mlp)
    ref = copy.deepcopy(model)
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.clip_and_accumulate()
    with pytest.raises(TrainingLoopError, match="already added to the step"):
        p.optimizer.step()  # finds nothing left to clip: says where it went
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()  # the same examples again
    with pytest.raises(TrainingLoopError, match="count each example twice"):
        p.optimizer.step()
    with pytest.raises(TrainingLoopError, match="count each example twice"):
        p.optimizer.clip_and_accumulate()
    assert p.accountant.steps == 0 and all(q.grad is None for q in model.parameters())
    p.optimizer.zero_grad()
    p.optimizer.add_noise()
    total, _ = oracle.clipped_sum(ref, x, y, 0.05)
    assert torch.allclose(oracle.flat(q.grad for q in model.parameters()), total / 8,
                          rtol=1e-10, atol=1e-14)
    assert p.accountant.steps == 1


def test_sums_of_a_batch_whose_step_was_refused_are_not_added_to_the_next(oracle, make_data,
                                                                          make_mlp):
    """``clip_and_accumulate()`` on one batch, its ``step()`` refused (nothing recorded
    since), then the next batch's ordinary step: the refused batch's clipped sums were
    added to it, two batches released as one step at rate q. They are dropped with a
    warning: the step releases its own batch alone."""
    model, p = _noise_free(make_data, make_mlp)
    it = iter(p.data_loader)
    x, y = next(it)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.clip_and_accumulate()
    with pytest.raises(TrainingLoopError):
        p.optimizer.step()
    x2, y2 = next(it)
    assert len(x) and len(x2)
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match="earlier batch, whose step was refused"):
        _step(p, x2, y2)
    total, _ = oracle.clipped_sum(ref, x2, y2, 0.05)
    assert torch.allclose(oracle.flat(q.grad for q in model.parameters()), total / 8,
                          rtol=1e-10, atol=1e-14)
    assert p.accountant.steps == 1


def test_each_chunk_of_a_virtual_batch_is_added_once(oracle, make_data, make_mlp):
    """With physical chunks, a chunk's rows added by ``clip_and_accumulate()`` and again
    by ``step()`` after a second backward pass are refused too; the logical batch is then
    dropped (nothing of it released) and the next one's chunks, each added once, give
    the naive clipped sum of that batch."""
    model, p = _noise_free(make_data, make_mlp, max_physical_batch_size=3, sampling="fixed")
    it = iter(p.data_loader)
    x, y = next(it)  # the first of the chunks 3, 3, 2 of a batch of 8
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.clip_and_accumulate()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(TrainingLoopError, match="physical chunk"):
        p.optimizer.step()
    for _ in range(2):  # the rest of the refused batch
        _step(p, *next(it))
    assert p.accountant.steps == 0 and all(q.grad is None for q in model.parameters())
    ref, xs, ys = copy.deepcopy(model), [], []
    for x, y in it:
        xs.append(x)
        ys.append(y)
        _step(p, x, y)
        if p.accountant.steps:
            break
    assert [len(c) for c in xs] == [3, 3, 2]
    total, _ = oracle.clipped_sum(ref, torch.cat(xs), torch.cat(ys), 0.05)
    assert torch.allclose(oracle.flat(q.grad for q in model.parameters()), total / 8,
                          rtol=1e-10, atol=1e-14)


def test_add_noise_without_the_batch_s_clipped_sum_is_refused(oracle, make_data, make_mlp):
    """``add_noise()`` after ``backward()`` but without ``clip_and_accumulate()``
    released noise alone, charged as the batch's step, and left its per-example
    gradients behind: the next batch's ``step()`` without a backward pass of its own
    then released them as that batch's (fixed-size batches: the row count agrees).
    Refused, as is ``add_noise()`` for a batch with examples of which nothing was added;
    the batch then trains through ``clip_and_accumulate()`` and ``add_noise()``."""
    model, p = _noise_free(make_data, make_mlp, sampling="fixed")
    ref = copy.deepcopy(model)
    it = iter(p.data_loader)
    x, y = next(it)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(TrainingLoopError, match="clip_and_accumulate"):
        p.optimizer.add_noise()
    assert p.accountant.steps == 0 and all(q.grad is None for q in model.parameters())
    p.optimizer.clip_and_accumulate()
    p.optimizer.add_noise()
    total, _ = oracle.clipped_sum(ref, x, y, 0.05)
    assert torch.allclose(oracle.flat(q.grad for q in model.parameters()), total / 8,
                          rtol=1e-10, atol=1e-14)
    x, y = next(it)
    p.optimizer.zero_grad()
    with pytest.raises(TrainingLoopError, match="nothing of it was added"):
        p.optimizer.add_noise()
    assert p.accountant.steps == 1
