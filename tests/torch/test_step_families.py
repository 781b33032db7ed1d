"""Opacus's per-sample-gradient families through whole DP-SGD steps, in every mode.

Opacus 1.6 checks layer by layer that per-sample gradients equal a loop of batch-size-1
backward passes (``opacus/tests/grad_samples/``), and that a noise-free step equals the
clipped sum, flat and per layer (``privacy_engine_test.py``). ``test_grad_sample.py`` and
``test_layer_families.py`` compare privlearn's per-layer contributions with that loop on
one backward pass. Here the same families go through ``make_private`` and two optimizer
steps with noise 0, in float64: the first step evaluates every rule at ``step()``, the
second evaluates the normalisation, Linear and Embedding rules during ``backward()``
(after the first step only), and both updates must equal the naive one -- each example's
gradient of the whole model clipped to ``max_grad_norm`` (flat) or each parameter's
gradient to its own bound (per layer), summed, divided by the batch size -- with the
engine's automatic choice and with ghost norms or materialised gradients forced, for sum
and mean losses and for virtual batches. Frozen parameters, tied weights and modules
called twice in one forward are among the cases. Layers privlearn cannot clip are
refused with a typed error before any step, by ``make_private`` and by
``GradSampleTracker`` alike.

A representative draw runs by default; the full grid is ``@pytest.mark.slow``.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import trainable  # noqa: E402

from privlearn.torch import GradSampleTracker, make_private  # noqa: E402
from privlearn.torch import grad_sample as _gs  # noqa: E402
from privlearn.torch.validator import UnsupportedModuleError  # noqa: E402

F64 = torch.float64
N = 6  # examples per batch
CLIP = 0.3
#: relative tolerance of the float64 comparisons
TOL = 1e-9


def loss_of(out) -> torch.Tensor:
    """A sum of per-example terms over the first floating output, non-linear in it."""
    if isinstance(out, tuple):
        out = out[0]
    return (out ** 2).sum() + out.sum()


# --------------------------------------------------------------------------- the models


class _Seq(nn.Module):
    """A sequence-first layer fed from batch-first data (the dataset's layout)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.transpose(0, 1))[0].transpose(0, 1)


class _Attention(nn.Module):
    def __init__(self, batch_first, kdim=None, vdim=None, bias_kv=False, zero_attn=False,
                 bias=True, opacus=False):
        super().__init__()
        if opacus:
            cls = pytest.importorskip("opacus.layers").DPMultiheadAttention
        else:
            cls = nn.MultiheadAttention
        extra = {} if opacus else {"batch_first": batch_first}
        self.attn = cls(4, 2, kdim=kdim, vdim=vdim, add_bias_kv=bias_kv,
                        add_zero_attn=zero_attn, bias=bias, **extra)
        self.batch_first = batch_first and not opacus

    def forward(self, q, k, v):
        if not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out, w = self.attn(q, k, v)
        out = out if self.batch_first else out.transpose(0, 1)
        return out + (w ** 2).sum(-1, keepdim=True)


class _Recurrent(nn.Module):
    """A recurrent layer on padded sequences of the given lengths, packed or not."""

    def __init__(self, layer, packed):
        super().__init__()
        self.rnn, self.packed = layer, packed

    def forward(self, x, lengths):
        bf = self.rnn.batch_first
        x = x if bf else x.transpose(0, 1)
        if self.packed:
            seq = pack_padded_sequence(x, lengths, batch_first=bf, enforce_sorted=False)
            out, _ = pad_packed_sequence(self.rnn(seq)[0], batch_first=bf,
                                         total_length=x.shape[1 if bf else 0])
        else:
            out = self.rnn(x)[0]
        return out if bf else out.transpose(0, 1)


class _Bags(nn.Module):
    """EmbeddingBag on 1-D ids with offsets (bags of the given sizes, empty ones too) or
    on a 2-D batch of ids, with per-sample weights in mode "sum"."""

    def __init__(self, mode, offsets, weighted, padding_idx=None, last=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(7, 3, mode=mode, padding_idx=padding_idx,
                                   include_last_offset=last)
        self.offsets, self.weighted, self.last = offsets, weighted, last

    def forward(self, ids, sizes, w):
        w = w if self.weighted else None
        if not self.offsets:
            return self.bag(ids, per_sample_weights=w)
        keep = torch.arange(ids.shape[1])[None, :] < sizes[:, None]
        ends = torch.cumsum(sizes, 0)
        offsets = torch.cat([ends.new_zeros(1), ends if self.last else ends[:-1]])
        return self.bag(ids[keep], offsets, per_sample_weights=None if w is None else w[keep])


class _Tied(nn.Module):
    """Embedding and output head sharing one weight, a LayerNorm and a Linear each called
    twice in one forward (the Linear once more on the mean over positions)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.norm(self.emb(ids))
        h = self.norm(self.lin(torch.tanh(self.lin(h))))
        return self.head(h) + self.head(self.lin(h.mean(1)))[:, None, :]


class _TiedAcross(nn.Module):
    """Parameters shared between layers of different kinds: a LayerNorm's weight with an
    RMSNorm and its bias with a GroupNorm (normalisation rules evaluated during
    backward), a Linear's bias with a Conv1d, an Embedding's weight with a Linear head,
    a GRU's input weight with a Linear (each pair's cross terms from different forms)."""

    def __init__(self):
        super().__init__()
        self.ln, self.rms, self.gn = nn.LayerNorm(4), nn.RMSNorm(4), nn.GroupNorm(2, 4)
        self.rms.weight, self.gn.bias = self.ln.weight, self.ln.bias
        self.lin, self.conv = nn.Linear(4, 4), nn.Conv1d(4, 4, 1)
        self.conv.bias = self.lin.bias
        self.emb, self.head = nn.Embedding(4, 4), nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight
        self.gru, self.proj = nn.GRU(4, 4, batch_first=True), nn.Linear(4, 12, bias=False)
        self.proj.weight = self.gru.weight_ih_l0

    def forward(self, x):
        h = self.rms(self.lin(self.ln(x)))
        h = self.gn(self.conv(h.transpose(1, 2))).transpose(1, 2)
        ids = (x[..., 0] > 0).long()
        return (self.head(h) + self.emb(ids) + self.gru(h)[0]
                + self.proj(torch.tanh(h))[..., :4])


class _Frozen(nn.Module):
    """Frozen parameters among trainable ones: a frozen weight with a trainable bias, a
    frozen embedding, a BatchNorm frozen with its running statistics (a fixed affine map
    of each example, which the validator accepts)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.a = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.b = nn.Linear(4, 2)
        self.emb.weight.requires_grad_(False)
        self.a.weight.requires_grad_(False)
        self.bn.requires_grad_(False)
        self.bn.eval()
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x, ids):
        return self.b(torch.tanh(self.bn(self.a(x + self.emb(ids)))))


class _SequenceBias(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        layers = pytest.importorskip("opacus.layers")
        self.bias = layers.SequenceBias(4, batch_first=batch_first)
        self.lin = nn.Linear(4, 3)
        self.batch_first = batch_first

    def forward(self, x):
        out = self.bias(x if self.batch_first else x.transpose(0, 1))
        return self.lin(out if self.batch_first else out.transpose(0, 1))


def _ids(*shape, vocab=7):
    return lambda g: [torch.randint(0, vocab, (N, *shape), generator=g)]


def _x(*shape):
    return lambda g: [torch.randn(N, *shape, generator=g, dtype=F64)]


def _attention_inputs(kdim=4, vdim=4):
    return lambda g: [torch.randn(N, 3, 4, generator=g, dtype=F64),
                      torch.randn(N, 2, kdim, generator=g, dtype=F64),
                      torch.randn(N, 2, vdim, generator=g, dtype=F64)]


def _sequences(g):
    return [torch.randn(N, 4, 3, generator=g, dtype=F64),
            torch.randint(1, 5, (N,), generator=g)]


def _bag_inputs(g):
    sizes = torch.randint(0, 5, (N,), generator=g)
    sizes[1] = 0  # an empty bag
    return [torch.randint(0, 7, (N, 4), generator=g), sizes,
            torch.rand(N, 4, generator=g, dtype=F64)]


def _frozen_inputs(g):
    return [torch.randn(N, 3, generator=g, dtype=F64), torch.randint(0, 5, (N,), generator=g)]


def _opacus_layer(name):
    def make():
        layers = pytest.importorskip("opacus.layers")
        return getattr(layers, name)(3, 4, num_layers=2, bidirectional=True,
                                     batch_first=True)
    return make


#: ``name -> (model factory, input factory from a generator)``; each family of Opacus's
#: grad-sample tests with the hyperparameters its grid draws (groups, strides, paddings
#: "same"/"valid" and padding modes, dilations, affine or not, padding_idx, offsets and
#: per-sample weights, kdim/vdim, bias_kv, zero_attn, layers, directions, layouts, packed
#: sequences), plus the shared and frozen parameters of the engine's own cases.
CASES = {
    "linear-2d": (lambda: nn.Linear(3, 4), _x(3)),
    "linear-3d-no-bias": (lambda: nn.Linear(3, 4, bias=False), _x(5, 3)),
    "linear-4d": (lambda: nn.Linear(3, 4), _x(2, 3, 3)),
    "conv1d-same-even-dilated-groups": (
        lambda: nn.Conv1d(2, 4, 4, padding="same", dilation=2, groups=2), _x(2, 9)),
    "conv1d-valid-stride": (lambda: nn.Conv1d(2, 3, 3, padding="valid", stride=2), _x(2, 9)),
    "conv2d-reflect-same": (
        lambda: nn.Conv2d(2, 4, (2, 3), padding="same", padding_mode="reflect", groups=2,
                          dilation=(1, 2)), _x(2, 5, 6)),
    "conv2d-replicate-no-bias": (
        lambda: nn.Conv2d(2, 3, 3, stride=(2, 1), padding=(1, 2), padding_mode="replicate",
                          bias=False), _x(2, 5, 4)),
    "conv3d-circular-stride-groups": (
        lambda: nn.Conv3d(2, 4, 2, stride=(1, 2, 1), padding=1, padding_mode="circular",
                          groups=2), _x(2, 3, 4, 3)),
    "conv-transpose1d": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), _x(2, 4)),
    "conv-transpose2d-groups": (
        lambda: nn.ConvTranspose2d(2, 4, 3, stride=2, groups=2, output_padding=1),
        _x(2, 3, 2)),
    "layer-norm-2-dims-no-bias": (lambda: nn.LayerNorm((2, 3), bias=False), _x(4, 2, 3)),
    "layer-norm-no-affine": (
        lambda: nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3, elementwise_affine=False)),
        _x(4, 3)),
    "group-norm": (lambda: nn.Sequential(nn.Conv2d(4, 4, 1), nn.GroupNorm(2, 4)),
                   _x(4, 3, 2)),
    "group-norm-no-affine": (
        lambda: nn.Sequential(nn.Conv1d(4, 4, 1), nn.GroupNorm(2, 4, affine=False)),
        _x(4, 5)),
    "instance-norm1d": (lambda: nn.InstanceNorm1d(3, affine=True), _x(3, 5)),
    "instance-norm3d": (lambda: nn.InstanceNorm3d(2, affine=True), _x(2, 3, 2, 2)),
    "rms-norm": (lambda: nn.Sequential(nn.Linear(3, 3), nn.RMSNorm(3)), _x(4, 3)),
    "rms-norm-2-dims": (lambda: nn.RMSNorm((2, 3), eps=1e-3), _x(4, 2, 3)),
    "embedding-padding-idx": (lambda: nn.Embedding(7, 3, padding_idx=2), _ids(5)),
    "embedding-1d-ids": (lambda: nn.Embedding(7, 3), _ids()),
    "embedding-3d-ids": (lambda: nn.Embedding(7, 3), _ids(2, 3)),
    "embedding-bag-sum-weighted-offsets": (lambda: _Bags("sum", True, True), _bag_inputs),
    "embedding-bag-mean-offsets-last": (lambda: _Bags("mean", True, False, last=True),
                                        _bag_inputs),
    "embedding-bag-mean-2d-padding-idx": (lambda: _Bags("mean", False, False, 1),
                                          _bag_inputs),
    "attention-batch-first-kdim-vdim": (lambda: _Attention(True, 3, 5), _attention_inputs(3, 5)),
    "attention-bias-kv-zero-attn": (
        lambda: _Attention(False, 3, 5, bias_kv=True, zero_attn=True),
        _attention_inputs(3, 5)),
    "attention-no-bias-bias-kv": (lambda: _Attention(True, bias_kv=True, bias=False),
                                  _attention_inputs()),
    "lstm-packed-bidirectional": (
        lambda: _Recurrent(nn.LSTM(3, 4, num_layers=2, bidirectional=True), True),
        _sequences),
    "gru-batch-first-packed": (
        lambda: _Recurrent(nn.GRU(3, 4, batch_first=True, bias=False), True), _sequences),
    "rnn-relu-bidirectional": (
        lambda: _Recurrent(nn.RNN(3, 4, nonlinearity="relu", num_layers=2,
                                  bidirectional=True, batch_first=True), False),
        _sequences),
    "tied-and-called-twice": (_Tied, _ids(4)),
    "tied-across-layer-types": (_TiedAcross, _x(3, 4)),
    "frozen": (_Frozen, _frozen_inputs),
    "opacus-dp-lstm-packed": (lambda: _Recurrent(_opacus_layer("DPLSTM")(), True),
                              _sequences),
    "opacus-dp-attention": (
        lambda: _Attention(False, 3, 5, bias_kv=True, zero_attn=True, opacus=True),
        _attention_inputs(3, 5)),
    "opacus-sequence-bias": (lambda: _SequenceBias(False), _x(3, 4)),
}

MODES = ("auto", "ghost", "materialise")


# --------------------------------------------------------------------------- reference




def _naive_update(oracle, model, batch, bounds, reduction_n: int | None = None):
    """The clipped sum of ``batch`` by the definition: one backward pass per example on a
    copy of ``model``, each example's gradient clipped flat (``bounds`` a number) or per
    parameter (a list), summed."""
    model = copy.deepcopy(model)
    params = trainable(model)
    rows = oracle.grads(lambda i: loss_of(model(*[x[i:i + 1] for x in batch])),
                        batch[0].shape[0], params)
    if isinstance(bounds, list):
        total, _ = oracle.clip_and_sum(rows, bounds, [p.numel() for p in params])
    else:
        total, _ = oracle.clip_and_sum(rows, bounds)
    return total


def _force(monkeypatch, mode: str) -> None:
    """Ghost norms or materialised per-example gradients wherever a rule can choose."""
    if mode != "auto":
        monkeypatch.setattr(_gs, "use_ghost", lambda *a, **k: mode == "ghost")


def check_steps(oracle, name, *, mode="auto", clipping="flat", reduction="sum",
                physical=None, steps=2, seed=0):
    """``steps`` noise-free DP-SGD steps (lr 1) of case ``name`` through make_private,
    each update compared with the naive clipped sum of the batch it was given."""
    make, inputs = CASES[name]
    torch.manual_seed(seed)
    model = make().to(F64)
    data = inputs(torch.Generator().manual_seed(seed + 1))
    params = trainable(model)
    bounds = ([CLIP * (1 + k / 2) for k in range(len(params))] if clipping == "per_layer"
              else CLIP)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(*data), batch_size=N), noise_multiplier=0.0,
                     max_grad_norm=bounds, clipping=clipping, sampling="fixed",
                     loss_reduction=reduction, max_physical_batch_size=physical, seed=seed)
    for _ in range(steps):
        before = copy.deepcopy(model)
        chunks = []
        for chunk in p.data_loader:  # one logical batch (of physical chunks)
            chunks.append(chunk)
            p.optimizer.zero_grad()
            loss = loss_of(p.model(*chunk))
            (loss / len(chunk[0]) if reduction == "mean" else loss).backward()
            p.optimizer.step()
        batch = [torch.cat(parts) for parts in zip(*chunks, strict=True)]
        want = _naive_update(oracle, before, batch, bounds) / p.optimizer.expected_batch_size
        moved = oracle.flat(b - a for a, b in zip(params, trainable(before), strict=True))
        scale = want.abs().max().item() + 1.0
        torch.testing.assert_close(moved, want, rtol=TOL, atol=TOL * scale,
                                   msg=lambda m: f"{name} {mode} {clipping} {reduction}: {m}")
    assert p.accountant.steps == steps


# --------------------------------------------------------------------------- the steps


@pytest.mark.parametrize("name", sorted(CASES))
# (the oracle fixture is a namespace of pure functions: nothing to reset between draws)
@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(MODES), clipping=st.sampled_from(["flat", "per_layer"]),
       reduction=st.sampled_from(["sum", "mean"]))
def test_two_steps_equal_the_naive_clipped_sum(name, mode, clipping, reduction, oracle):
    """Every family, one drawn setting (mode, clipping, loss reduction) per run."""
    with pytest.MonkeyPatch.context() as mp:
        _force(mp, mode)
        check_steps(oracle, name, mode=mode, clipping=clipping, reduction=reduction)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_setting_equals_the_naive_clipped_sum(name, mode, clipping, reduction, oracle,
                                                    monkeypatch):
    _force(monkeypatch, mode)
    check_steps(oracle, name, mode=mode, clipping=clipping, reduction=reduction)


@pytest.mark.parametrize("name", ["tied-and-called-twice", "embedding-bag-sum-weighted-offsets",
                                  "lstm-packed-bidirectional"])
def test_virtual_batches_equal_the_naive_clipped_sum(name, oracle):
    """Physical chunks of 4 and 2 examples: one update, the logical batch's."""
    check_steps(oracle, name, reduction="mean", physical=4)


@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_virtual_batches_every_family(name, clipping, oracle):
    check_steps(oracle, name, clipping=clipping, reduction="mean", physical=4)


@pytest.mark.parametrize("budget", [0, 3000, 2**30])
def test_step_materialise_budget_splits_the_layers(budget, oracle, monkeypatch):
    """The step's budget of materialised per-example gradients: none (every layer ghost),
    part of the layers, every layer; the same update each time."""
    monkeypatch.setattr(_gs, "STEP_MATERIALISE_BUDGET_BYTES", budget)
    check_steps(oracle, "tied-and-called-twice", clipping="per_layer", steps=3)


# --------------------------------------------------------------------------- forward


#: one case of each way the engine runs a layer's forward (detached aliases, instrumented
#: attention, recurrences, the torch.func fallback, tied and frozen parameters)
UNALTERED = ["attention-bias-kv-zero-attn", "conv-transpose2d-groups",
             "embedding-bag-mean-offsets-last", "frozen", "lstm-packed-bidirectional",
             "opacus-dp-attention", "tied-across-layer-types", "tied-and-called-twice"]


@pytest.mark.parametrize("name", UNALTERED)
def test_outputs_unaltered_and_hooks_removed(name):
    """Opacus's ``test_outputs_unaltered`` / ``test_remove_hooks``: the private model's
    forward computes what the model computes (its layers run on detached aliases of their
    parameters, attention on an instrumented forward), and ``detach()`` leaves no hook,
    the same parameters and the same ``requires_grad``."""
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().to(F64)
    data = inputs(torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    params = [(n, q, q.requires_grad) for n, q in model.named_parameters()]
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(*data), batch_size=N), noise_multiplier=1.0,
                     max_grad_norm=1.0, sampling="fixed", seed=0)
    batch = next(iter(p.data_loader))
    torch.testing.assert_close(p.model(*batch), ref(*batch), rtol=1e-12, atol=1e-12)
    p.detach()
    assert not _hooked(model)
    assert [(n, q, q.requires_grad) for n, q in model.named_parameters()] == params


# --------------------------------------------------------------------------- refusals


class _Attend(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, **kw)

    def forward(self, x):
        return self.attn(x, x, x)[0]


#: Layers per-example clipping cannot handle: ``name -> (model factory, input, what the
#: error names)``.
REFUSED = {
    "batch-norm": (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
                   lambda: torch.randn(N, 3), "BatchNorm"),
    "batch-norm-no-affine": (lambda: nn.Sequential(nn.Linear(3, 4),
                                                   nn.BatchNorm1d(4, affine=False)),
                             lambda: torch.randn(N, 3), "BatchNorm"),
    "embedding-scale-grad-by-freq": (lambda: nn.Embedding(5, 3, scale_grad_by_freq=True),
                                     lambda: torch.randint(0, 5, (N, 4)),
                                     "scale_grad_by_freq"),
    "embedding-sparse": (lambda: nn.Embedding(5, 3, sparse=True),
                         lambda: torch.randint(0, 5, (N, 4)), "sparse"),
    "embedding-max-norm": (lambda: nn.Embedding(5, 3, max_norm=1.0),
                           lambda: torch.randint(0, 5, (N, 4)), "max_norm"),
    "instance-norm-running-stats": (
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        lambda: torch.randn(N, 3, 4), "track_running_stats"),
    # attention dropout is applied by the engine's own forward of the layer, which
    # add_bias_kv rules out (the fallback cannot replay the masks)
    "attention-dropout": (lambda: _Attend(dropout=0.5, add_bias_kv=True),
                          lambda: torch.randn(N, 3, 4), "dropout"),
}


def _hooked(model) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
               for m in model.modules())


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_layers_are_refused_before_any_step(name):
    """make_private and GradSampleTracker refuse them alike, with the validator's typed
    error naming the layer's setting, and leave no hook behind (before, the tracker built
    on such a model gave wrong norms -- an Embedding with scale_grad_by_freq -- or failed
    inside torch.func at the step, a BatchNorm in training)."""
    make, x, what = REFUSED[name]
    torch.manual_seed(0)
    model = make()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedModuleError, match=what):
        make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(x()), batch_size=N), noise_multiplier=1.0,
                     max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=what):
        GradSampleTracker(model)
    assert not _hooked(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_scale_grad_by_freq_differs_from_the_loop_it_would_have_been_clipped_with(oracle):
    """Why the tracker refuses it: the Embedding rule's per-example gradients ignore
    scale_grad_by_freq, and the batch-of-one gradient scales each row by its frequency in
    the example (so the refusal is not a formality)."""
    from privlearn.torch.grad_sample import Record
    from privlearn.torch.rules.embedding import embedding_rule

    emb = nn.Embedding(5, 2, scale_grad_by_freq=True).to(F64)
    ids = torch.tensor([[1, 1, 2], [1, 3, 3], [4, 4, 4]])
    rows = oracle.grads(lambda i: (emb(ids[i:i + 1]) ** 2).sum(), 3, [emb.weight])
    out = emb(ids)
    g = 2 * out.detach()
    rec = Record(args=(ids,), kwargs={}, grad_outputs=[g], outputs_meta=[])
    norms = embedding_rule(emb, rec, [emb.weight]).sq_norms().sqrt()
    assert not torch.allclose(norms, rows.norm(dim=1))


def test_frozen_embedding_max_norm_would_write_the_looked_up_rows():
    """A frozen Embedding with max_norm is refused too: its forward rescales, in the
    weight the trained model releases, exactly the rows the batch looked up (so the
    weight tells which ids the training data holds). make_private refuses it before any
    forward, leaving the weight as it was."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, max_norm=0.5)
    emb.weight.requires_grad_(False)
    model = nn.Sequential(emb, nn.Linear(4, 2))
    before = emb.weight.detach().clone()
    ids = torch.randint(0, 5, (16, 3))  # ids 5..9 never looked up
    probe = before.clone()  # what the forward would do to the weight
    nn.functional.embedding(ids, probe, max_norm=0.5)
    assert not torch.equal(probe[:5], before[:5]) and torch.equal(probe[5:], before[5:])
    with pytest.raises(UnsupportedModuleError, match="max_norm=0.5"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(TensorDataset(ids), batch_size=4), noise_multiplier=1.0,
                     max_grad_norm=1.0)
    assert torch.equal(emb.weight, before) and not _hooked(model)


# --------------------------------------------------------------------------- numerics


class _Cancelling(nn.Module):
    """A Linear on two equal positions whose output gradients nearly cancel: each
    example's weight gradient is nearly zero, and its ghost norm (the sum of the products
    of two Gram matrices) rounds below zero in float32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x, w):
        out = self.lin(x)
        return (out[:, 0] * w - out[:, 1] * w * (1 + 1e-4)).sum(1)


def _cancelling_batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(8, 1, 16, generator=g) * 3).expand(8, 2, 16).contiguous()
    return x, torch.randn(8, 16, generator=g)


def test_squared_norms_rounded_below_zero_leave_the_parameters_finite(oracle):
    """A per-example squared norm that rounds below zero is a norm of 0: before, its
    square root was NaN, so was the example's clip factor, and the flat-clipped step wrote
    NaN into every parameter of the layer (the per-layer path clamped already). The
    engine picks ghost norms for this layer by itself (T = 2 positions, 16 x 16)."""
    for seed in range(5):  # a batch whose float32 ghost norms do round below zero
        torch.manual_seed(seed)
        model = _Cancelling()
        x, w = _cancelling_batch(seed)
        tracker = GradSampleTracker(copy.deepcopy(model), loss_reduction="sum")
        tracker.model(x, w).sum().backward()
        contribs, _, _ = tracker.contributions()
        tracker.detach()
        if (sum(c.sq_norms() for c in contribs) < 0).any():
            break
    else:
        pytest.skip("this BLAS rounds these Gram products without going below zero")
    before = copy.deepcopy(model)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(x, w), batch_size=8), noise_multiplier=0.0,
                     max_grad_norm=1.0, sampling="fixed", loss_reduction="sum", seed=0)
    xb, wb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    p.model(xb, wb).sum().backward()
    p.optimizer.step()
    norms = p.optimizer.last_grad_norms
    assert torch.isfinite(norms).all() and (norms >= 0).all()
    assert torch.isfinite(model.lin.weight).all()
    ref = before.double()
    rows = oracle.grads(lambda i: ref(xb[i:i + 1].double(), wb[i:i + 1].double()).sum(), 8,
                        [ref.lin.weight])
    want, _ = oracle.clip_and_sum(rows, 1.0)
    moved = oracle.flat([before.lin.weight - model.lin.weight])
    torch.testing.assert_close(moved, want / 8, rtol=1e-3, atol=1e-3 * want.abs().max().item())
