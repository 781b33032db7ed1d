"""PyTorch features real training loops use, each run through ``make_private`` and
checked against the naive ground truth (a loop of batch-of-one backward passes, each
example's gradient clipped on its own, summed; tests/torch/conftest.py): channels_last
CNNs and non-contiguous inputs, parametrizations (spectral_norm's power iteration,
orthogonal, a user's own), and the accountant's count of what ran."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn.utils import parametrizations, parametrize  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import noiseless_run  # noqa: E402

from privlearn.torch import make_private  # noqa: E402

F64 = torch.float64


def _sum_loss(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum")


def _private_step(model, x, y, max_grad_norm, forward=None):
    """One noise-free ``make_private`` step (SGD at learning rate 0, fixed-size batch of
    all of ``x``, loss summed over the batch): the clipped sum stays in ``.grad``, divided
    by the batch size. Returns the run and the batch it drew."""
    p = noiseless_run(model, x, y, lr=0.0, max_grad_norm=max_grad_norm)
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    _sum_loss((forward or (lambda m, t: m(t)))(p.model, xb), yb).backward()
    p.optimizer.step()
    return p, xb, yb


def _check(oracle, build, x, y, *, forward=None, tol=1e-10):
    """The step's clipped sum of ``build()`` against the naive loop on another
    ``build()`` (same seed), both in float64; at least one example clipped, one not."""
    fwd = forward or (lambda m, t: m(t))
    ref = build()
    rows_model = build()
    p, xb, yb = _private_step(rows_model, x, y, 1.0, forward=forward)
    rows = oracle.grads(
        lambda i: _sum_loss(fwd(ref, xb[i : i + 1]), yb[i : i + 1]), len(yb), oracle.trainable(ref)
    )
    c = rows.norm(dim=1).median().item()
    want, _ = oracle.clip_and_sum(rows, c)
    # the same step again at the median norm, so that some examples are clipped
    model = build()
    _private_step(model, x, y, c, forward=forward)
    got = oracle.flat(q.grad for q in oracle.trainable(model)) * len(yb)
    assert (got - want).norm() <= tol * want.norm()
    assert p.accountant.steps == 1
    return model


def _cnn():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.GroupNorm(2, 6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, stride=2),
        nn.Flatten(),
        nn.Linear(36, 4),
    ).to(F64)


def _images(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g, dtype=F64)
    x = x * torch.linspace(0.2, 3.0, n, dtype=F64)[:, None, None, None]
    return x, torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("where", ["model", "input", "both", "in forward"])
def test_channels_last_cnn_matches_the_loop(where, oracle):
    """A Conv2d/GroupNorm CNN in channels_last memory format (its weights, its input or
    both, or the input converted inside the forward)."""
    x, y = _images()
    cl = torch.channels_last
    build = (lambda: _cnn().to(memory_format=cl)) if where in ("model", "both") else _cnn
    if where in ("input", "both"):
        x = x.contiguous(memory_format=cl)
    forward = (lambda m, t: m(t.contiguous(memory_format=cl))) if where == "in forward" else None
    _check(oracle, build, x, y, forward=forward)


@pytest.mark.parametrize("view", ["permuted", "strided", "transposed", "expanded"])
def test_non_contiguous_inputs_match_the_loop(view, oracle):
    """Inputs that are views (a permuted NHWC batch, a strided slice, a transposed
    matrix, a row broadcast over a sequence inside the forward)."""
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 4, (8,), generator=g)
    if view in ("permuted", "strided"):
        x = (
            torch.randn(8, 8, 8, 3, generator=g, dtype=F64).permute(0, 3, 1, 2)
            if view == "permuted"
            else torch.randn(8, 3, 16, 16, generator=g, dtype=F64)[:, :, ::2, ::2]
        )
        assert not x.is_contiguous()
        _check(oracle, _cnn, x, y)
        return

    def mlp():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(F64)

    x = torch.randn(6, 8, generator=g, dtype=F64).t()
    if view == "transposed":
        _check(oracle, mlp, x, y)
    else:
        _check(
            oracle,
            mlp,
            x.contiguous(),
            y,
            forward=lambda m, t: m(t[:, None, :].expand(-1, 5, -1)).sum(1),
        )


def _mlp(parametrization=None):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4)).to(F64)
    if parametrization is not None:
        parametrization(model[0])
    return model


class _Scaled(nn.Module):
    """A user's parametrization with a trainable parameter of its own."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5, dtype=F64))

    def forward(self, w):
        return w * self.s


def _vectors(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=F64) * torch.linspace(0.2, 3.0, n, dtype=F64)[:, None]
    return x, torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("kind", ["orthogonal", "user scale"])
def test_parametrizations_match_the_loop(kind, oracle):
    """``parametrizations.orthogonal`` and a user's ``register_parametrization`` with a
    trainable parameter of its own (clipped with the layer's)."""
    how = {
        "orthogonal": parametrizations.orthogonal,
        "user scale": lambda m: parametrize.register_parametrization(m, "weight", _Scaled()),
    }[kind]
    x, y = _vectors()
    model = _check(oracle, lambda: _mlp(how), x, y)
    if kind == "user scale":
        assert model[0].parametrizations.weight[0].s.grad is not None


def _spectral():
    return _mlp(parametrizations.spectral_norm)


def test_spectral_norm_gradient_is_of_the_forwards_weight(oracle):
    """spectral_norm's training forward runs a power iteration (updating its buffers
    ``_u``, ``_v`` in place) before normalising the weight: the released gradient is that
    of the weight the forward used, so the loop's reference is the model after one
    training forward, its iteration then frozen (eval mode of the parametrization).
    Before, the generic rule recomputed the layer with one more iteration: a clipped sum
    about 1e-4 (relative) away."""
    x, y = _vectors()
    model = _spectral()
    _, xb, yb = _private_step(model, x, y, 1.6)
    ref = _spectral()
    ref(xb)  # the one power iteration of the step's forward
    ref[0].parametrizations.weight[0].eval()
    rows = oracle.grads(
        lambda i: _sum_loss(ref(xb[i : i + 1]), yb[i : i + 1]), len(yb), oracle.trainable(ref)
    )
    want, norms = oracle.clip_and_sum(rows, 1.6)
    assert (norms > 1.6).any() and (norms < 1.6).any()
    got = oracle.flat(q.grad for q in oracle.trainable(model)) * len(yb)
    assert (got - want).norm() <= 1e-10 * want.norm()


def test_spectral_norm_buffers_advance_once_per_forward():
    """After a private step the power iteration's buffers are where one training forward
    leaves them (as in non-private training); before, the generic rule's recomputation
    ran another iteration on the module's own buffers at every step."""
    x, y = _vectors()
    model = _spectral()
    p, xb, _ = _private_step(model, x, y, 0.5)
    ref = _spectral()
    for step in range(3):
        ref(xb)
        sn, want = model[0].parametrizations.weight[0], ref[0].parametrizations.weight[0]
        assert torch.equal(sn._u, want._u) and torch.equal(sn._v, want._v), step
        xb, yb = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        _sum_loss(p.model(xb), yb).backward()
        p.optimizer.step()
    assert p.accountant.steps == 4


class _KeepRows(nn.Module):
    """A parametrization that leaves the weight as it is but passes its gradient to the
    rows of ``mask`` only (the others are held fixed): what a gradient hook
    ``weight.register_hook(lambda g: g * mask)`` meant, per example."""

    def __init__(self, mask):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, w):
        return torch.where(self.mask, w, w.detach())


def _embedding_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Embedding(12, 5), nn.Flatten(), nn.Linear(15, 3)).to(F64)


def _ids(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 12, (n, 3), generator=g), torch.randint(0, 3, (n,), generator=g)


_ROWS = (torch.arange(12) >= 8)[:, None]  # train the embedding rows of ids 8..11 only


def test_a_parameter_gradient_hook_is_refused_at_make_private():
    """A gradient hook on a parameter (``emb.weight.register_hook``: train some rows only)
    never ran under the engine, whose layers run on detached aliases of their
    parameters: every row was trained. Refused, naming the parameter and the
    parametrization to use instead."""
    from privlearn.errors import ConfigurationError

    model = _embedding_model()
    model[0].weight.register_hook(lambda g: g * _ROWS)
    x, y = _ids()
    with pytest.raises(ConfigurationError, match=r"\['0.weight'\].*register_parametrization"):
        _private_step(model, x, y, 1.0)
    assert model[0].weight.grad is None


def test_a_parameter_gradient_hook_registered_later_is_refused():
    """One registered after make_private is refused at the next training forward, before
    anything is recorded; no step is taken or counted."""
    model = _embedding_model()
    x, y = _ids()
    p, xb, yb = _private_step(model, x, y, 1.0)
    before = [q.detach().clone() for q in model.parameters()]
    handle = model[0].weight.register_hook(lambda g: g * _ROWS)
    with pytest.raises(RuntimeError, match=r"\['0.weight'\].*registered after make_private"):
        p.model(xb)
    handle.remove()
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    _sum_loss(p.model(xb), yb).backward()
    p.optimizer.step()
    assert p.accountant.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_parametrization_the_refusal_names_trains_the_rows_the_hook_meant(oracle):
    """The replacement the message names: a parametrization holding the other rows fixed
    gives the naive loop's clipped sum with the gradient hook (each example's gradient
    masked, then clipped)."""
    x, y = _ids()
    ref = _embedding_model()
    ref[0].weight.register_hook(lambda g: g * _ROWS)
    rows = oracle.grads(
        lambda i: _sum_loss(ref(x[i : i + 1]), y[i : i + 1]), len(y), oracle.trainable(ref)
    )
    c = rows.norm(dim=1).median().item()
    want, _ = oracle.clip_and_sum(rows, c)
    model = _embedding_model()
    parametrize.register_parametrization(model[0], "weight", _KeepRows(_ROWS))
    _private_step(model, x, y, c)
    w = model[0].parametrizations.weight.original
    got = oracle.flat([w.grad, *(q.grad for q in model[2].parameters())]) * len(y)
    assert (got - want).norm() <= 1e-10 * want.norm()
    assert torch.equal(w.grad[:8], torch.zeros_like(w.grad[:8]))


def test_a_forward_hook_needing_gradients_fails_in_the_probe_with_a_note(oracle):
    """A forward hook that registers a tensor hook on its layer's output without checking
    ``requires_grad`` fails in the batch-independence probe's passes (run under
    ``torch.no_grad()``): the error keeps torch's type and says where it came from and
    what to check; nothing is counted. With the check, the step is the naive loop's."""
    x, y = _vectors()

    def build(guarded):
        model = _mlp()

        def hook(module, args, out):
            if out.requires_grad or not guarded:
                out.register_hook(lambda g: 2.0 * g)

        model[0].register_forward_hook(hook)
        return model

    model = build(guarded=False)
    p = noiseless_run(model, x, y, lr=0.0, max_grad_norm=1.0)
    xb, yb = next(iter(p.data_loader))
    _sum_loss(p.model(xb), yb).backward()
    with pytest.raises(RuntimeError, match="doesn't require gradient") as info:
        p.optimizer.step()
    assert any(
        "batch-independence probe" in n and "requires_grad" in n
        for n in getattr(info.value, "__notes__", ())
    )
    assert p.accountant.steps == 0
    _check(oracle, lambda: build(guarded=True), x, y)


@pytest.mark.parametrize("misuse", ["layer in eval mode", "weight used functionally"])
def test_a_refused_step_leaves_no_raw_gradient_behind(misuse):
    """A trainable layer run in eval mode, or its weight used outside it, gives its
    parameters autograd's own gradient of the batch (neither per example nor clipped):
    the step is refused, and that gradient is not left in ``.grad`` either (it was, while
    the message said nothing was released)."""
    from privlearn.errors import TrainingLoopError

    x, y = _vectors()
    model = _mlp()
    p = noiseless_run(model, x, y, lr=0.1, max_grad_norm=1.0)
    xb, yb = next(iter(p.data_loader))
    if misuse == "layer in eval mode":
        p.model[0].eval()
        out = p.model(xb)
    else:
        out = p.model(xb) + 0.1 * (xb @ model[0].weight.t())[:, :4]
    _sum_loss(out, yb).backward()
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(TrainingLoopError, match="nothing was released"):
        p.optimizer.step()
    assert model[0].weight.grad is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert p.accountant.steps == 0


def test_a_step_after_an_eval_mode_forward_leaves_no_raw_gradient_behind():
    """``p.model.eval()`` before the training forward: nothing is recorded, the step is
    refused, and autograd's gradient of the batch (the layers ran on the parameters
    themselves) is not left in ``.grad``; after ``p.model.train()`` the next batch trains
    as usual."""
    from privlearn.errors import TrainingLoopError

    x, y = _vectors()
    model = _mlp()
    p = noiseless_run(model, x, y, lr=0.1, max_grad_norm=1.0)
    xb, yb = next(iter(p.data_loader))
    p.model.eval()
    _sum_loss(p.model(xb), yb).backward()
    with pytest.raises(TrainingLoopError, match="eval mode"):
        p.optimizer.step()
    assert all(q.grad is None for q in model.parameters())
    assert p.accountant.steps == 0
    p.model.train()
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    _sum_loss(p.model(xb), yb).backward()
    p.optimizer.step()
    assert p.accountant.steps == 1


def test_backward_with_inputs_is_refused_naming_it():
    """``loss.backward(inputs=[...])`` restricted to some parameters reaches none of them
    (the layers run on detached aliases): the step is refused, the message naming that
    call and what to do instead; nothing is counted."""
    from privlearn.errors import TrainingLoopError

    x, y = _vectors()
    model = _mlp()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sampling="fixed",
        seed=0,
    )
    xb, yb = next(iter(p.data_loader))
    before = [q.detach().clone() for q in model.parameters()]
    _sum_loss(p.model(xb), yb).backward(inputs=list(model[2].parameters()))
    with pytest.raises(TrainingLoopError, match=r"backward\(inputs=.*requires_grad_\(False\)"):
        p.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert p.accountant.steps == 0


def test_a_retained_graph_of_an_earlier_batch_is_not_released_again():
    """``backward(retain_graph=True)`` on one batch, then that loss added to the next
    batch's and backpropagated again: the second step releases the second batch's
    clipped sum alone (the first batch's examples, already released and accounted, do
    not enter a step charged for another batch)."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=g, dtype=F64), torch.randint(0, 4, (8,), generator=g)

    def build():
        torch.manual_seed(2)
        return nn.Linear(6, 4).to(F64)

    model = build()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=0.0,
        max_grad_norm=1e6,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    batches = iter(p.data_loader)
    xb, yb = next(batches)
    first = _sum_loss(p.model(xb), yb)
    first.backward(retain_graph=True)
    p.optimizer.step()
    xb2, yb2 = next(batches)
    p.optimizer.zero_grad()
    (_sum_loss(p.model(xb2), yb2) + first).backward()
    p.optimizer.step()
    ref = build()
    want = torch.autograd.grad(_sum_loss(ref(xb2), yb2), list(ref.parameters()))
    for q, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(q.grad * 4, w, rtol=1e-12, atol=1e-12)
    assert p.accountant.steps == 2


def test_llama_with_tied_embeddings_and_checkpointing_matches_the_loop(oracle):
    """A config-initialised Llama with its LM head tied to the embedding and Hugging
    Face's activation checkpointing (non-reentrant by default), through make_private."""
    tf = pytest.importorskip("transformers")
    from privlearn.torch import per_sequence_cross_entropy

    def build():
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(
            vocab_size=53,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = tf.LlamaForCausalLM(cfg).to(F64)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        # (the current name where transformers has it; the former one warns)
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
        model.train()
        return model

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 53, (6, 7), generator=g)

    def forward(m, t):
        return m(input_ids=t).logits

    def loss(out, labels):
        return per_sequence_cross_entropy(out, labels, reduction="sum")

    ref = build()
    rows = oracle.grads(
        lambda i: loss(forward(ref, ids[i : i + 1]), ids[i : i + 1]), 6, oracle.trainable(ref)
    )
    c = rows.norm(dim=1).median().item()
    model = build()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(ids, ids), batch_size=6),
        noise_multiplier=0.0,
        max_grad_norm=c,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    xb, yb = next(iter(p.data_loader))  # the same examples, in the sampler's order
    loss(forward(p.model, xb), yb).backward()
    p.optimizer.step()
    rows = oracle.grads(
        lambda i: loss(forward(ref, xb[i : i + 1]), yb[i : i + 1]), 6, oracle.trainable(ref)
    )
    want, _ = oracle.clip_and_sum(rows, c)
    got = oracle.flat(q.grad for q in oracle.trainable(model)) * 6
    assert (got - want).norm() <= 1e-10 * want.norm()
    assert p.accountant.steps == 1
