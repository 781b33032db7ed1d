"""Per-example gradient rules against a naive loop of batch-size-1 backward passes.

For every supported layer (shapes drawn by Hypothesis) the engine's per-example squared
norms, per-example gradients and weighted sums ``sum_i c_i g_i`` must equal the naive
reference to float tolerance, in both the ghost-norm and the materialised mode.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

from privlearn.errors import UnsupportedModuleError  # noqa: E402
from privlearn.torch import _rows, grad_sample  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402

SETTINGS = settings(max_examples=8, deadline=None)


@pytest.fixture(autouse=True)
def _check_every_size(monkeypatch):
    """The dead-position check on gradients of any size (by default it skips the small
    ones these tests use), so that the dropping is exercised."""
    monkeypatch.setattr(_rows, "_MIN_CHECK_ELEMENTS", 0)


def naive_per_sample(model, inputs, loss_fn, batch_dims=None):
    """Per-example gradients (B, P) from one backward pass per example, computed on the
    model's device and returned in float64 on the CPU."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    b = inputs[0].shape[0 if batch_dims is None else batch_dims[0]]
    rows = []
    for i in range(b):
        args = []
        for k, x in enumerate(inputs):
            d = 0 if batch_dims is None else batch_dims[k]
            args.append(x.narrow(d, i, 1).contiguous() if d is not None else x)
        grads = torch.autograd.grad(loss_fn(model(*args)), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                               for g, p in zip(grads, params, strict=True)]))
    return torch.stack(rows).double().cpu(), params


def engine_per_sample(model, inputs, loss_fn, mode, instrument=True):
    """(sq_norms, per-example grads (B, P), weighted-sum function) from the tracker, run
    on the model's device; results in float64 on the CPU (the weighted-sum function takes
    its weights on the CPU too)."""
    params = [p for p in model.parameters() if p.requires_grad]
    dev = params[0].device
    tracker = GradSampleTracker(model, loss_reduction="sum", instrument_attention=instrument)
    try:
        if mode == "ghost":
            orig = grad_sample.use_ghost
            grad_sample.use_ghost = lambda *a, **k: True
        elif mode == "materialise":
            orig = grad_sample.use_ghost
            grad_sample.use_ghost = lambda *a, **k: False
        loss_fn(model(*inputs)).backward()
        contribs, batch, scale = tracker.contributions()
    finally:
        if mode in ("ghost", "materialise"):
            grad_sample.use_ghost = orig
        tracker.detach()
    assert scale == 1.0
    sq = sum(c.sq_norms() for c in contribs).double().cpu()
    by_id = {}
    for c in contribs:
        for p, g in zip(c.params, c.per_sample(), strict=True):
            by_id[id(p)] = g if id(p) not in by_id else by_id[id(p)] + g
    ps = torch.cat([by_id[id(p)].reshape(batch, -1).double().cpu() if id(p) in by_id
                    else torch.zeros(batch, p.numel(), dtype=torch.float64)
                    for p in params], 1)

    def weighted(cvec):
        cvec = cvec.to(dev)
        out = {}
        for c in contribs:
            for p, w in zip(c.params, c.weighted_sum(cvec), strict=True):
                out[id(p)] = w if id(p) not in out else out[id(p)] + w
        flat = torch.cat([out[id(p)].reshape(-1).double().cpu() if id(p) in out
                          else torch.zeros(p.numel(), dtype=torch.float64)
                          for p in params])
        # the in-place form the optimizer uses must give the same sums
        acc = {id(p): torch.zeros_like(p, dtype=torch.float64) for p in params}
        for c in contribs:
            c.accumulate_into(cvec, [acc[id(p)] for p in c.params])
        torch.testing.assert_close(torch.cat([acc[id(p)].reshape(-1) for p in params]).cpu(),
                                   flat, atol=1e-5 * (flat.abs().max().item() + 1), rtol=1e-5)
        return flat

    return sq, ps, weighted


def check(model, inputs, loss_fn, batch_dims=None, modes=("auto", "ghost", "materialise"),
          atol=1e-4, instrument=True):
    """The engine against the naive loop, both on the model's device (inputs already
    there): per-example gradients, squared norms and weighted sums, in every mode."""
    ref, _ = naive_per_sample(model, inputs, loss_fn, batch_dims)
    for mode in modes:
        sq, ps, weighted = engine_per_sample(model, inputs, loss_fn, mode, instrument)
        scale = ref.abs().max().item() + 1.0
        torch.testing.assert_close(ps, ref, atol=atol * scale, rtol=1e-4)
        torch.testing.assert_close(sq, (ref ** 2).sum(1), atol=atol * scale ** 2, rtol=1e-4)
        c = torch.rand(ref.shape[0])
        torch.testing.assert_close(weighted(c.float()), c.double() @ ref,
                                   atol=atol * scale * ref.shape[0], rtol=1e-4)


def sq_loss(out):
    if isinstance(out, tuple):
        return sum((o ** 2).sum() * (k + 1) for k, o in enumerate(_flat(out)))
    return (out ** 2).sum() + out.sum()


def _flat(out):
    res = []
    for o in out:
        if isinstance(o, tuple):
            res.extend(_flat(o))
        elif isinstance(o, torch.Tensor) and o.is_floating_point():
            res.append(o)
    return res


dims = st.integers(1, 5)


@SETTINGS
@given(b=st.integers(1, 4), t=st.integers(1, 4), d=dims, p=dims, bias=st.booleans(),
       seq=st.booleans())
def test_linear(b, t, d, p, bias, seq):
    torch.manual_seed(b * 100 + t)
    x = torch.randn(b, t, d) if seq else torch.randn(b, d)
    check(nn.Linear(d, p, bias=bias), [x], sq_loss)


@SETTINGS
@given(b=st.integers(1, 3), cin=st.integers(1, 2), groups=st.sampled_from([1, 2]),
       k=st.integers(1, 3), stride=st.integers(1, 2), pad=st.integers(0, 1),
       dil=st.integers(1, 2), mode=st.sampled_from(["zeros", "reflect", "circular"]))
def test_conv2d(b, cin, groups, k, stride, pad, dil, mode):
    torch.manual_seed(b + 10 * k)
    conv = nn.Conv2d(cin * groups, 2 * groups, k, stride=stride, padding=pad, dilation=dil,
                     groups=groups, padding_mode=mode)
    check(conv, [torch.randn(b, cin * groups, 6, 5)], sq_loss)


# torch's notice that padding="same" with an even kernel copies the input is about speed
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@SETTINGS
@given(b=st.integers(1, 3), k=st.integers(1, 3), stride=st.integers(1, 2),
       pad=st.sampled_from([0, 1, "same"]), groups=st.sampled_from([1, 2]))
def test_conv1d(b, k, stride, pad, groups):
    if pad == "same":
        stride = 1
    torch.manual_seed(b + 10 * k)
    conv = nn.Conv1d(2 * groups, 3 * groups, k, stride=stride, padding=pad, groups=groups)
    check(conv, [torch.randn(b, 2 * groups, 7)], sq_loss)


@SETTINGS
@given(b=st.integers(1, 4), t=st.integers(1, 6), vocab=st.integers(2, 6),
       padding_idx=st.sampled_from([None, 0]))
def test_embedding(b, t, vocab, padding_idx):
    torch.manual_seed(b * 7 + t)
    emb = nn.Embedding(vocab, 3, padding_idx=padding_idx)
    ids = torch.randint(0, vocab, (b, t))  # repeated tokens are likely
    check(emb, [ids], sq_loss)


def test_embedding_expanded_position_ids():
    """The usual ``position_ids = arange(T).expand(B, -1)`` (a stride-0 view) works."""

    class PosModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(7, 4)
            self.pos = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, ids):
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            return self.out(self.tok(ids) + self.pos(pos))

    torch.manual_seed(0)
    check(PosModel(), [torch.randint(0, 7, (4, 5))], sq_loss)


@SETTINGS
@given(b=st.integers(1, 4), t=st.integers(1, 6), vocab=st.integers(2, 6),
       padding_idx=st.sampled_from([None, 0]))
def test_embedding_ids_shared_by_the_batch(b, t, vocab, padding_idx):
    """One id row broadcast over the batch (stride 0, as Hugging Face's position and
    token-type ids), with repeated ids and padding: the shared-row path of the rule."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, 3, padding_idx=padding_idx)
            self.lin = nn.Linear(2, 3)

        def forward(self, x, row):
            return self.emb(row.expand(x.shape[0], -1)) * self.lin(x)

    torch.manual_seed(b * 11 + t)
    row = torch.randint(0, vocab, (1, t))  # repeated ids are likely
    check(Shared(), [torch.randn(b, t, 2), row], sq_loss, batch_dims=[0, None])


@SETTINGS
@given(b=st.integers(1, 4), t=st.integers(1, 3), d=st.integers(2, 5),
       affine=st.booleans(), two=st.booleans())
def test_layernorm(b, t, d, affine, two):
    torch.manual_seed(b + t + d)
    shape = (t, d) if two else (d,)
    ln = nn.LayerNorm(shape, elementwise_affine=True, bias=affine)
    with torch.no_grad():
        ln.weight.normal_()
    check(ln, [torch.randn(b, t, d)], sq_loss, modes=("auto",))


@SETTINGS
@given(b=st.integers(1, 4), groups=st.sampled_from([1, 2]), spatial=st.integers(1, 3))
def test_groupnorm(b, groups, spatial):
    torch.manual_seed(b + spatial)
    gn = nn.GroupNorm(groups, 4)
    with torch.no_grad():
        gn.weight.normal_()
        gn.bias.normal_()
    check(gn, [torch.randn(b, 4, spatial, 3)], sq_loss, modes=("auto",))


@SETTINGS
@given(cls=st.sampled_from([nn.LSTM, nn.GRU, nn.RNN]), b=st.integers(1, 3),
       t=st.integers(1, 4), layers=st.integers(1, 2), bidir=st.booleans(),
       batch_first=st.booleans(), bias=st.booleans(), with_h0=st.booleans())
def test_recurrent(cls, b, t, layers, bidir, batch_first, bias, with_h0):
    torch.manual_seed(b * 10 + t)
    rnn = cls(3, 4, num_layers=layers, bidirectional=bidir, batch_first=batch_first,
              bias=bias)
    x = torch.randn(b, t, 3) if batch_first else torch.randn(t, b, 3)
    inputs, bdims = [x], [0 if batch_first else 1]
    if with_h0:
        h0 = torch.randn(layers * (2 if bidir else 1), b, 4)
        if cls is nn.LSTM:
            model = _LSTMWithState(rnn)
            inputs += [h0, torch.randn_like(h0)]
            bdims += [1, 1]
        else:
            model = _WithState(rnn)
            inputs.append(h0)
            bdims.append(1)
    else:
        model = rnn
    check(model, inputs, sq_loss, batch_dims=bdims)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("bidir", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_lstm_hand_written_bptt(layers, bidir, batch_first, with_state):
    """The LSTM rule's hand-written backpropagation through time, on every combination of
    depth, direction, layout and initial state (the hypothesis test above draws few)."""
    torch.manual_seed(layers * 8 + bidir * 4 + batch_first * 2 + with_state)
    rnn = nn.LSTM(3, 4, num_layers=layers, bidirectional=bidir, batch_first=batch_first)
    b, t = 3, 5
    x = torch.randn(b, t, 3) if batch_first else torch.randn(t, b, 3)
    bdim = 0 if batch_first else 1
    if with_state:
        h0 = torch.randn(layers * (2 if bidir else 1), b, 4)
        check(_LSTMWithState(rnn), [x, h0, torch.randn_like(h0)], sq_loss,
              batch_dims=[bdim, 1, 1])
    else:
        check(_OutputOnly(rnn), [x], sq_loss, batch_dims=[bdim])


class _OutputOnly(nn.Module):
    """Uses only the output sequence (h_n and c_n get no gradient)."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


class _WithState(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0):
        return self.rnn(x, h0)


class _LSTMWithState(_WithState):
    def forward(self, x, h0, c0):
        return self.rnn(x, (h0, c0))


class _MHA(nn.Module):
    def __init__(self, batch_first, kdim, bias=True, use_weights=False, causal=False,
                 average=True):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=batch_first, kdim=kdim, vdim=kdim,
                                         bias=bias)
        self.use_weights, self.causal, self.average = use_weights, causal, average

    def forward(self, q, kv, mask):
        lq, lk = (q.shape[1], kv.shape[1]) if self.mha.batch_first else (q.shape[0], kv.shape[0])
        attn_mask = None
        if self.causal:
            attn_mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1)
            attn_mask[:, 0] = False  # keep one key visible to every query
        out, w = self.mha(q, kv, kv, key_padding_mask=mask, attn_mask=attn_mask,
                          average_attn_weights=self.average)
        if self.use_weights:
            return out, w
        return out


@SETTINGS
@given(b=st.integers(1, 3), lq=st.integers(1, 3), lk=st.integers(1, 3),
       batch_first=st.booleans(), kdim=st.sampled_from([None, 3]), bias=st.booleans(),
       use_weights=st.booleans(), causal=st.booleans(), average=st.booleans(),
       instrument=st.booleans())
def test_multihead_attention(b, lq, lk, batch_first, kdim, bias, use_weights, causal, average,
                             instrument):
    """Both the instrumented forward (gradients caught in backward) and the recomputing
    rule."""
    torch.manual_seed(b + lq * 3 + lk)
    model = _MHA(batch_first, kdim, bias, use_weights, causal, average)
    kd = kdim or 4
    q = torch.randn(b, lq, 4) if batch_first else torch.randn(lq, b, 4)
    kv = torch.randn(b, lk, kd) if batch_first else torch.randn(lk, b, kd)
    mask = torch.zeros(b, lk, dtype=torch.bool)
    mask[:, lk - 1] = lk > 1  # mask the last key when there is more than one
    bd = 0 if batch_first else 1
    check(model, [q, kv, mask], sq_loss, batch_dims=[bd, bd, 0], instrument=instrument)


class _SelfMHA(nn.Module):
    def __init__(self, batch_first, bias):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=batch_first, bias=bias)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


@SETTINGS
@given(b=st.integers(1, 3), t=st.integers(1, 4), batch_first=st.booleans(),
       bias=st.booleans(), instrument=st.booleans())
def test_self_attention_packed_projection(b, t, batch_first, bias, instrument):
    torch.manual_seed(b * 5 + t)
    x = torch.randn(b, t, 4) if batch_first else torch.randn(t, b, 4)
    check(_SelfMHA(batch_first, bias), [x], sq_loss, batch_dims=[0 if batch_first else 1],
          instrument=instrument)


def test_instrumented_attention_matches_pytorch_forward():
    """The captured forward computes what nn.MultiheadAttention computes, and leaves the
    module untouched."""
    torch.manual_seed(4)
    for batch_first in (True, False):
        model = _MHA(batch_first, None, True, True, True, False)
        ref = copy.deepcopy(model)
        q, kv = torch.randn(3, 5, 4), torch.randn(3, 6, 4)
        if not batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        mask = torch.zeros(3, 6, dtype=torch.bool)
        mask[0, 2] = True
        before = {m: dict(m.__dict__) for m in model.modules()}
        tracker = GradSampleTracker(model)
        out, w = model(q, kv, mask)
        # the projections were captured (no recomputation in the rule) ...
        recs = [r for rs in tracker.records.values() for r in rs if r.extra is not None]
        assert len(recs) == 1 and recs[0].extra["O"] is not None
        # ... without anything written onto the user's modules
        for m in model.modules():
            assert m.__dict__.keys() == before[m].keys()
            assert "forward" not in m.__dict__
        tracker.detach()
        ref_out, ref_w = ref(q, kv, mask)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_multihead_attention_fallback_configuration():
    """add_bias_kv is not reproduced by the dedicated rule: the torch.func fallback runs."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    check(M(), [torch.randn(3, 2, 4)], sq_loss, modes=("auto",))


class _Custom(nn.Module):
    """A layer with direct parameters and two inputs: handled by the torch.func fallback."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))
        self.mix = nn.Parameter(torch.randn(3, 3))

    def forward(self, x, z):
        return torch.tanh(x * self.scale) @ self.mix + z.sin() * self.scale ** 2


def test_custom_multi_input_fallback():
    torch.manual_seed(0)
    model = _Custom()
    check(model, [torch.randn(4, 2, 3), torch.randn(4, 2, 3)], sq_loss, modes=("auto",))


class _ExtraParam(nn.Module):
    """Opacus's ``LinearWithExtraParam``: a child layer, then a parameter of the module
    itself applied to its output (the torch.func fallback recomputes the child)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.extra_param = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return self.fc(x).matmul(self.extra_param)


def test_own_parameter_after_a_trainable_child_layer(oracle):
    """The per-example gradients match the naive loop, and the DP step runs: the
    fallback's gradients of the module's own parameter were still attached to the
    child's trainable weights, and accumulating them into the step's buffers raised
    inside autograd."""
    torch.manual_seed(0)
    check(_ExtraParam(), [torch.randn(4, 3, 5)], sq_loss, modes=("auto",))
    _one_dp_step_against_the_naive_loop(oracle, _ExtraParam(), torch.randn(10, 3, 5), 0.5,
                                        rtol=1e-4, atol=1e-5)


def _one_dp_step_against_the_naive_loop(oracle, model, x, max_grad_norm, rtol, atol):
    """One noiseless DP-SGD step of ``model`` on the batch ``x`` (loss ``sq_loss``)
    matches the float64 loop of batches of one."""
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    ref = copy.deepcopy(model)
    ds = TensorDataset(x, torch.zeros(len(x)))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(ds, batch_size=len(x)), noise_multiplier=0.0,
                     max_grad_norm=max_grad_norm, sampling="fixed", loss_reduction="sum",
                     seed=0)
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    sq_loss(p.model(xb)).backward()
    p.optimizer.step()
    oracle.step(ref, xb, yb, max_grad_norm, lr=0.5,
                expected_batch=p.optimizer.expected_batch_size,
                loss_fn=lambda out, _: sq_loss(out))
    torch.testing.assert_close(oracle.flat(model.parameters()), oracle.flat(ref.parameters()),
                               rtol=rtol, atol=atol)


class _Shared(nn.Module):
    """The same Linear called twice and weights tied between Embedding and output."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = self.lin(torch.tanh(self.lin(h)))
        return self.head(h)


def test_repeated_calls_and_tied_weights():
    torch.manual_seed(1)
    check(_Shared(), [torch.randint(0, 6, (3, 4))], sq_loss)


class _SharedForms(nn.Module):
    """A parameter shared between an Embedding (twice), a Linear on sequences, a Linear on
    vectors and a transposed use (every pair of factored forms of the cross terms)."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(5, 5, padding_idx=padding_idx)
        self.lin = nn.Linear(5, 5)
        self.lin.weight = self.emb.weight
        self.other = nn.Embedding(5, 5)
        self.other.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids) + self.other(ids.flip(1))
        h = torch.tanh(self.lin(h))
        v = self.lin(h.mean(1))
        return h.sum(1) + v + self.lin(torch.tanh(v))


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("t", [1, 3])
def test_tied_parameter_cross_terms(padding_idx, t):
    torch.manual_seed(4)
    check(_SharedForms(padding_idx), [torch.randint(0, 5, (4, t))], sq_loss)


def test_tied_parameters_do_not_materialise_other_layers():
    """Only the tied parameter pays: the other layers keep their ghost / rank-one forms."""
    model = _Shared()
    tracker = GradSampleTracker(model, loss_reduction="sum")
    sq_loss(model(torch.randint(0, 6, (3, 4)))).backward()
    contribs, _, _ = tracker.contributions()
    tracker.detach()
    assert not any(isinstance(c, grad_sample.Materialized) and c.params and
                   c.params[0] is model.lin.weight for c in contribs)


def test_frozen_parameters_ignored():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    check(model, [torch.randn(5, 3)], sq_loss)
    tracker = GradSampleTracker(model)
    assert all(p is not model[0].weight for p in tracker.params)
    tracker.detach()
    assert not model[0].weight.requires_grad and model[0].bias.requires_grad


def test_mean_loss_is_rescaled(oracle):
    """With loss_reduction="mean" the norms are those of the per-example losses."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    ref_model = copy.deepcopy(model)
    ref = oracle.grads(lambda i: nn.functional.cross_entropy(ref_model(x[i:i + 1]),
                                                             y[i:i + 1]),
                       6, list(ref_model.parameters())).float()
    tracker = GradSampleTracker(model, loss_reduction="mean")
    nn.functional.cross_entropy(model(x), y).backward()
    sums, batch, norms = tracker.clipped_sum(float("inf"))
    tracker.detach()
    assert batch == 6
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-5, atol=1e-6)
    total = torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(total, ref.sum(0), rtol=1e-5, atol=1e-6)


class _ReadsSomePositions(nn.Module):
    """Two Linear layers and a LayerNorm on sequences, the loss reading only some
    positions (as a sequence classifier reads the [CLS] or last token): the output
    gradients after the first layer are exactly zero at the other positions in every
    example."""

    def __init__(self, d, p, positions):
        super().__init__()
        self.l1 = nn.Linear(d, p)
        self.norm = nn.LayerNorm(p)
        self.l2 = nn.Linear(p, 3)
        self.positions = positions

    def forward(self, x):
        return self.l2(self.norm(torch.tanh(self.l1(x))))[:, self.positions]


@SETTINGS
@given(b=st.integers(1, 4), t=st.integers(2, 6), d=dims, p=dims, data=st.data())
def test_linear_positions_the_loss_never_reads(b, t, d, p, data):
    """Positions whose output gradient is zero in every example are dropped
    (grad_sample.live_positions); the norms and sums still equal the naive loop, whatever
    subset the loss reads (none, some, all)."""
    positions = data.draw(st.lists(st.integers(0, t - 1), max_size=t, unique=True))
    torch.manual_seed(b * 10 + t)
    check(_ReadsSomePositions(d, p, positions), [torch.randn(b, t, d)], sq_loss)


@pytest.mark.parametrize("positions", [[0, 3], [1, 2, 7], [5]])
def test_linear_and_layernorm_with_several_live_positions(positions):
    """Most positions dead, several live: the dropping runs and keeps every live one."""
    torch.manual_seed(len(positions))
    check(_ReadsSomePositions(3, 4, positions), [torch.randn(3, 8, 3)], sq_loss)


def test_positions_the_loss_never_reads_are_dropped():
    """The dropping is active (the reason for it is speed: BERT's last layer) and exact."""
    torch.manual_seed(0)
    model = _ReadsSomePositions(4, 6, [0])
    tracker = GradSampleTracker(model, loss_reduction="sum")
    sq_loss(model(torch.randn(3, 5, 4))).backward()
    contribs, _, _ = tracker.contributions()
    tracker.detach()
    ts = sorted(c.dims[2] for c in contribs if isinstance(c, grad_sample.OuterProduct))
    assert ts == [1, 1]  # both layers: only position 0 reaches the loss


def test_live_positions_skips_small_gradients(monkeypatch):
    """Below the size threshold nothing is checked (the check would cost more than the
    dropped positions save), above it the dead positions are found."""
    g = torch.zeros(2, 1, 5, 3)
    g[0, 0, 1] = 1.0
    monkeypatch.setattr(_rows, "_MIN_CHECK_ELEMENTS", g.numel() + 1)
    assert grad_sample.live_positions(g) is None
    monkeypatch.setattr(_rows, "_MIN_CHECK_ELEMENTS", g.numel())
    assert grad_sample.live_positions(g).tolist() == [1]


def test_live_positions_keeps_nan_and_nonzero_positions():
    g = torch.zeros(2, 1, 5, 3)
    assert grad_sample.live_positions(torch.randn(2, 1, 5, 3)) is None  # all live: no copy
    g[1, 0, 3, 2] = 1e-45  # the smallest subnormal float32 is not zero
    g[0, 0, 1, 1] = float("nan")  # a NaN must propagate, never be dropped
    g[0, 0, 4, 0] = -2.0
    assert grad_sample.live_positions(g).tolist() == [1, 3, 4]
    # nothing live: one (zero) position is kept so that every shape stays non-empty
    assert grad_sample.live_positions(torch.zeros(2, 1, 5, 3)).tolist() == [0]
    assert grad_sample.live_positions(torch.zeros(2, 1, 1, 3)) is None  # one position


def test_rule_kit_against_naive_and_former_names():
    """The public helpers rules import equal naive loops; the former private names are
    the same objects (code that imported them keeps working)."""
    torch.manual_seed(0)
    v, ids = torch.randn(7, 3, dtype=torch.float64), torch.tensor([3, 0, 3, 1, 0, 3, 1])
    naive = torch.stack([sum((v[i] for i in range(7) if ids[i] == j), torch.zeros(3,
                         dtype=torch.float64)) for j in range(5)])
    assert torch.equal(grad_sample.segment_sum(v, ids, 5), naive)  # segments 2, 4 empty
    assert torch.allclose(grad_sample.row_sq_norms(v),
                          torch.tensor([float(r @ r) for r in v], dtype=torch.float64))
    h = v.to(torch.bfloat16)
    assert grad_sample.row_sq_norms(h).dtype == torch.float32
    c = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0, 3.0])
    x = v.clone()
    x[1, 0], x[3, 2] = float("inf"), float("nan")  # rows with weight 0: exactly zero
    y = grad_sample.row_scaled(x, c)
    assert torch.equal(y[[1, 3]], torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(y[[0, 2, 4]], v[[0, 2, 4]] * c[[0, 2, 4]].double()[:, None])
    assert grad_sample.as_dtype(v, torch.float64) is v
    assert grad_sample.as_dtype(v, torch.float32).dtype == torch.float32
    dummy = torch.zeros((), requires_grad=True)
    t = torch.ones(3)
    out = grad_sample.make_differentiable(t, dummy)
    seen = []
    out.register_hook(seen.append)
    (out * torch.arange(3.0)).sum().backward()
    assert out is t and torch.equal(seen[0], torch.arange(3.0)) and dummy.grad is None
    for old, new in [("_as", "as_dtype"), ("_rowdot", "row_sq_norms"),
                     ("_row_scaled", "row_scaled"), ("_segment_sum", "segment_sum"),
                     ("_live_positions", "live_positions")]:
        assert getattr(grad_sample, old) is getattr(grad_sample, new)
        assert new in grad_sample.__all__


class _FunctionalDropout(nn.Module):
    """A parameter-owning layer with randomness inside its own forward (no rule: the
    generic fallback cannot replay the random draw per example)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return nn.functional.dropout(x * self.a, 0.5, self.training)


def test_fallback_layer_with_its_own_randomness_is_a_clear_error():
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    net = nn.Sequential(nn.Linear(3, 4), _FunctionalDropout(), nn.Linear(4, 2))
    ds = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    p = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
                     seed=0)
    x, y = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(ValueError, match="_FunctionalDropout draws random numbers"):
        p.optimizer.step()
    assert p.accountant.steps == 0


class _TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.fc(x))


@pytest.mark.parametrize("config", ["LoHaConfig", "LoKrConfig"])
def test_peft_adapter_with_random_forward_is_refused_naming_the_supported_ones(config):
    """peft's LoHa and LoKr layers draw torch.rand in their own forward (module and rank
    dropout), which the generic rule cannot replay per example: the refusal names the
    adapter and says what to use instead (the refusal named only a "Linear")."""
    peft = pytest.importorskip("peft")
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    torch.manual_seed(0)
    net = peft.get_peft_model(_TwoLinear(), getattr(peft, config)(r=2, target_modules=["fc"]))
    ds = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    p = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
                     seed=0)
    x, y = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(x), y).backward()
    kind = config.removesuffix("Config")
    with pytest.raises(UnsupportedModuleError, match=f"peft's {kind} adapter") as err:
        p.optimizer.step()
    for supported in ("LoRA", "DoRA", "IA3", "VeRA"):
        assert supported in str(err.value)
    assert p.accountant.steps == 0


class _ScaledRecurrent(nn.Module):
    """A parameter of its own applied to a recurrent child's output: the torch.func
    fallback recomputes the child per example (``noise=True``: and draws noise)."""

    def __init__(self, cls, noise=False):
        super().__init__()
        self.rnn = cls(3, 4, batch_first=True)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.noise = noise

    def forward(self, x):
        out = self.rnn(x)[0] * self.scale
        return out + 0.01 * torch.randn_like(out) if self.noise else out


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_fallback_over_a_float64_recurrent_child_matches_the_naive_loop(cls, oracle):
    """torch's recurrent kernels cannot run under vmap here (float64 LSTM, and GRU/RNN in
    any dtype: the batched gates are written into an unbatched state), and the step
    raised torch's RuntimeError; the fallback now takes one example at a time, and the
    per-example gradients and the DP step match a float64 loop of batches of one."""
    torch.manual_seed(0)
    model = _ScaledRecurrent(cls).double()
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    check(model, [x], sq_loss, modes=("auto",), atol=1e-10)
    _one_dp_step_against_the_naive_loop(oracle, model, torch.randn(8, 4, 3, dtype=torch.float64),
                                        0.05, rtol=1e-10, atol=1e-12)


def test_fallback_one_example_at_a_time_still_refuses_randomness():
    """Where vmap cannot batch the forward (a GRU inside) it would not reach the random
    draw either: the example-by-example recomputation notices the draw and refuses."""
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    net = _ScaledRecurrent(nn.GRU, noise=True).double()
    ds = TensorDataset(torch.randn(8, 4, 3, dtype=torch.float64), torch.zeros(8))
    p = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
                     seed=0)
    x, _ = next(iter(p.data_loader))
    sq_loss(p.model(x)).backward()
    with pytest.raises(ValueError, match="_ScaledRecurrent draws random numbers"):
        p.optimizer.step()
    assert p.accountant.steps == 0


class _Packed(nn.Module):
    """A recurrent layer on a packed batch of sequences of different lengths (the
    lengths and the optional initial state travel with the examples)."""

    def __init__(self, rnn, with_state):
        super().__init__()
        self.rnn = rnn
        self.with_state = with_state

    def forward(self, x, lengths, *state):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        packed = pack_padded_sequence(x, lengths, batch_first=self.rnn.batch_first,
                                      enforce_sorted=False)
        hx = None
        if self.with_state:
            hx = tuple(state) if isinstance(self.rnn, nn.LSTM) else state[0]
        out, h = self.rnn(packed, hx)
        padded, _ = pad_packed_sequence(out, batch_first=True,
                                        total_length=x.shape[1 if self.rnn.batch_first else 0])
        hs = h if isinstance(h, tuple) else (h,)
        return padded, *hs


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("bidir", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_packed_sequences(cls, bidir, batch_first, with_state):
    """PackedSequence inputs (they crashed with an AttributeError): exact per-example
    gradients whatever each sequence's length, against the naive loop in which every
    example is packed on its own."""
    torch.manual_seed(bidir * 4 + batch_first * 2 + with_state)
    rnn = cls(3, 4, num_layers=2, bidirectional=bidir, batch_first=batch_first)
    b, t = 5, 6
    x = torch.randn(b, t, 3) if batch_first else torch.randn(t, b, 3)
    lengths = torch.tensor([6, 2, 4, 1, 3])
    inputs, bdims = [x, lengths], [0 if batch_first else 1, 0]
    if with_state:
        h0 = torch.randn(2 * (2 if bidir else 1), b, 4)
        inputs += [h0, torch.randn_like(h0)] if cls is nn.LSTM else [h0]
        bdims += [1, 1] if cls is nn.LSTM else [1]
    check(_Packed(rnn, with_state), inputs, sq_loss, batch_dims=bdims)


class _Bags(nn.Module):
    def __init__(self, bag, layout):
        super().__init__()
        self.bag = bag
        self.layout = layout
        self.head = nn.Linear(bag.embedding_dim, 2)

    def forward(self, ids, weights=None):
        if self.layout == "2d":
            out = self.bag(ids, per_sample_weights=weights)
        else:  # one row per example on the outside, offsets inside the model
            live = ids >= 0
            flat = ids[live]
            sizes = live.sum(1)
            offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
            if self.bag.include_last_offset:
                offsets = torch.cat([offsets, sizes.sum().reshape(1)])
            w = None if weights is None else weights[live]
            out = self.bag(flat, offsets, per_sample_weights=w)
        return self.head(torch.tanh(out))


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("layout", ["2d", "offsets", "offsets_last"])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_bag(mode, weighted, layout, padding_idx):
    """EmbeddingBag (refused before) with sum or mean bags, per-sample weights, 2-D input
    or 1-D ids with offsets, padding index: exact against the naive loop."""
    torch.manual_seed(3)
    bag = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=padding_idx,
                          include_last_offset=layout == "offsets_last")
    b, width = 5, 6
    ids = torch.randint(0, 9, (b, width))
    if layout != "2d":  # bags of different sizes: -1 marks what is not in the bag
        sizes = torch.tensor([3, 1, 6, 2, 5])
        ids = ids.masked_fill(torch.arange(width)[None, :] >= sizes[:, None], -1)
    inputs = [ids] + ([torch.rand(b, width)] if weighted else [])
    check(_Bags(bag, "2d" if layout == "2d" else "offsets"), inputs, sq_loss,
          modes=("auto",))


@pytest.mark.parametrize("seq", [False, True])
@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("d,p", [(7, 3), (3, 7)])
def test_half_precision_matmuls_with_float32_accumulation(monkeypatch, seq, ghost, transposed,
                                                          d, p):
    """The accelerator path for bf16 operands (kept in bf16, float32 accumulation and
    result; emulated on the CPU): norms equal the float64 ones of the same bf16 values,
    the weighted sum and the in-place sum the step forms are theirs within bf16 rounding
    of the factors, and no example's clipped contribution exceeds the bound (factors
    rounded down with a margin)."""
    from privlearn.torch.grad_sample import DenseOuterProduct, OuterProduct

    monkeypatch.setattr(grad_sample, "LOW_PRECISION_MATMUL", "always")
    torch.manual_seed(int(seq) * 4 + int(ghost) * 2 + int(transposed) + 8 * d)
    b, t = 6, 5
    a = torch.randn(b, t, d).to(torch.bfloat16) if seq else torch.randn(b, d).to(
        torch.bfloat16)
    g = torch.randn(b, t, p).to(torch.bfloat16) if seq else torch.randn(b, p).to(
        torch.bfloat16)
    shape = (d, p) if transposed else (p, d)
    w = torch.nn.Parameter(torch.zeros(shape))
    bias = torch.nn.Parameter(torch.zeros(p))
    if seq:
        c = OuterProduct(w, bias, a.unsqueeze(1), g.unsqueeze(1), ghost=ghost,
                         transposed=transposed)
    else:
        if not ghost:
            pytest.skip("dense layers have one form")
        c = DenseOuterProduct(w, bias, a, g, transposed=transposed)
    A, G = (a.double(), g.double()) if seq else (a.double()[:, None], g.double()[:, None])
    ref_w = torch.einsum("btp,btd->bpd", G, A)
    ref = torch.cat([ref_w.reshape(b, -1), G.sum(1)], 1)
    torch.testing.assert_close(c.sq_norms().double(), (ref ** 2).sum(1), rtol=1e-5, atol=1e-6)
    C = float(ref.norm(dim=1).median())
    f = (C / ref.norm(dim=1)).clamp(max=1.0).float()

    def weighted(f):
        acc = [torch.zeros(shape), torch.zeros(p)]
        c.accumulate_into(f, acc)  # the step's form: added into float32 buffers
        return c.weighted_sum(f), acc

    want = f.double() @ ref
    for got in weighted(f):
        assert all(x.dtype == torch.float32 for x in got)
        flat = torch.cat([(got[0].t() if transposed else got[0]).reshape(-1),
                          got[1]]).double()
        torch.testing.assert_close(flat, want, rtol=2e-2,
                                   atol=1e-2 * want.abs().max().item())
    # each example's contribution alone stays within the bound
    for i in range(b):
        e = torch.zeros(b)
        e[i] = f[i]
        for one in weighted(e):
            norm = torch.cat([x.reshape(-1) for x in one]).double().norm()
            assert norm <= C * (1 + 1e-6)


@pytest.mark.parametrize("ghost", [False, True, "dense"])
def test_float32_sum_into_half_precision_buffer_is_rounded_once(ghost):
    """bf16 records with float32 per-example gradients or sums (the CPU path; dense: a
    ``(B, d)`` input) added into a bf16 gradient buffer that already holds a sum (a tied
    parameter, an earlier chunk): the buffer holds the float64 sum of both rounded once
    to bf16 (half a unit in the last place), not the float32 sum (or the scaled rows)
    rounded first and the total rounded again."""
    from privlearn.torch.grad_sample import DenseOuterProduct, OuterProduct

    torch.manual_seed(int(ghost is True))
    b, t, d, p = 5, 1 if ghost == "dense" else 4, 6, 9
    a = torch.randn(b, 1, t, d).to(torch.bfloat16)
    g = torch.randn(b, 1, t, p).to(torch.bfloat16)
    w = torch.nn.Parameter(torch.zeros(p, d, dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.zeros(p, dtype=torch.bfloat16))
    c = torch.rand(b)
    ref_w = torch.einsum("b,btp,btd->pd", c.double(), g[:, 0].double(), a[:, 0].double())
    ref_b = torch.einsum("b,btp->p", c.double(), g[:, 0].double())
    # buffers that nearly cancel the sums: a second rounding would show there
    outs = [(-ref_w * 0.999).to(torch.bfloat16), (-ref_b * 0.999).to(torch.bfloat16)]
    want = [o.double() + r for o, r in zip(outs, (ref_w, ref_b), strict=True)]
    rule = DenseOuterProduct(w, bias, a[:, 0, 0], g[:, 0, 0]) if ghost == "dense" else \
        OuterProduct(w, bias, a, g, ghost=ghost)
    with grad_sample.rows_finite(True):
        rule.accumulate_into(c, outs)
    for o, r, s in zip(outs, want, (ref_w, ref_b), strict=True):
        assert o.dtype == torch.bfloat16
        # one rounding to nearest: half a bf16 ulp of the result (at most 2^-8 of it),
        # plus the float32 sum's error (a rounding of the sum to bf16 first: 2^-9 of it)
        err = (o.double() - r).abs()
        assert (err <= r.abs() * 2.0 ** -8 + s.abs() * 1e-5).all(), (err / s.abs()).max()


def test_low_factors_are_rounded_toward_zero():
    """The half-precision factors are the factors reduced by the margin and rounded
    toward zero: the nearest half-precision value, one step toward zero where that is
    larger in magnitude (the naive form), on values near every rounding boundary."""
    from privlearn.torch._rows import _round_factors
    from privlearn.torch.grad_sample import _LOW_MARGIN

    g = torch.Generator().manual_seed(0)
    c = torch.cat([torch.rand(4000, generator=g) * 2.0 ** torch.randint(-130, 20, (4000,),
                                                                         generator=g),
                   torch.tensor([0.0, 1.0, 0.5, 3.0, 1e-40, 3.4e38, -0.7, -1e-3])])
    c = torch.cat([c, torch.nextafter(c, torch.full_like(c, float("inf")))])
    for dt in (torch.bfloat16, torch.float16):
        m = c * (1.0 - _LOW_MARGIN[dt])
        near = m.to(dt)
        want = torch.where(near.double().abs() > m.double().abs(),
                           torch.nextafter(near, torch.zeros_like(near)), near)
        got = _round_factors(c, dt)
        assert got.dtype == dt
        assert torch.equal(got.double(), want.double())
        assert (got.double().abs() <= m.double().abs()).all()


def test_low_factors_follow_each_factor_vector():
    """The half-precision clip factors, formed once per factor vector and dtype, are
    those of the vector given: never larger than it and within the margin below it."""
    from privlearn.torch.grad_sample import _LOW_MARGIN, low_factors

    for seed in range(3):
        c = torch.rand(7, generator=torch.Generator().manual_seed(seed))
        for dt in (torch.bfloat16, torch.float16):
            low = low_factors(c, dt)
            assert low.dtype == dt and low is low_factors(c, dt)
            assert (low.double() <= c.double()).all()
            assert (low.double() >= c.double() * (1 - 2 * _LOW_MARGIN[dt])).all()
