"""Configurations of Opacus 1.6's own tests that the other family files do not run,
through privlearn's public API.

Each check is one noise-free DP-SGD step through ``make_private`` (float64, fixed-size
batch, ``loss_reduction="sum"``, lr 1) compared with the definition: one backward pass
per example on a copy of the model, each example's gradient clipped to the bound (flat
or per parameter), summed, divided by the batch size. The configurations:

* ``grad_samples/``: attention with the masks and flags of ``DPMultiheadAttention``'s
  forward (``key_padding_mask``, ``attn_mask`` 2-D/3-D/bool/float, ``need_weights``,
  ``average_attn_weights``), in PyTorch's layer and in Opacus's; the Transformer layers
  built on it; recurrent layers (PyTorch's and ``DPLSTM``/``DPGRU``/``DPRNN``) whose
  initial state is computed from the example (batch on dimension 1 of ``h0``);
  ``Embedding(padding_idx=-1)``; ``EmbeddingBag`` on 2-D ids with per-sample weights and
  ``padding_idx``; transposed convolutions with dilation, padding, output padding and
  groups; ``padding="same"`` with even kernels under a non-zero padding mode; GroupNorm on
  2-D and 5-D inputs; LayerNorm over three dimensions; Linear on 5-D inputs.
* ``privacy_engine_validation_test.py`` / ``utils.py``: ``BasicSupportedModule``, the
  custom ``F.linear`` module, ``MatmulModule``, ``LinearWithExtraParam`` and
  ``ModelWithCustomLinear``, on a dataset that is a plain list of tensors.
* ``privacy_engine_test.py``: several parameter groups with their own learning rates
  under per-layer clipping; ``optimizer.step(closure)``.
* ``batch_memory_manager_test.py``: chunks of at most ``max_physical_batch_size``
  examples, parameters moving once per logical batch, workers and pinned memory, the same
  result as one batch (noise included, same seed), and an empty Poisson batch moving
  nothing with noise 0.
* ``mixed_precision_test.py``: its models under bfloat16 autocast (on the CPU) against the
  batch-of-one loop under the same autocast; its ``AttentionModel`` feeds a batch-first
  tensor to sequence-first attention (attending across the batch), which must be refused.

* ``privacy_engine_test.py``'s ``test_validator_weight_update_check``: ``fix`` after the
  optimizer was built (Opacus refuses; privlearn's GroupNorm shares the BatchNorm's
  parameters, which then train).
* ``poisson_test.py`` / ``distributed_poisson_test.py``: the public samplers' length,
  batch-size law, seeding and (two ranks) disjoint shards.
* ``randomness_test.py``: a seed repeats a run, another seed, no seed and secure mode
  do not; torch's, Python's and NumPy's global generators are left alone.
* empty batches (every grad-sample test runs one): Poisson batches drawn empty before
  and after a step with data, in families ``test_engine.py`` does not cover.

And the probe's verdict on a model output with as many features as the batch has
examples (a regression test, below).
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import trainable  # noqa: E402

from privlearn.errors import BatchDependenceError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

F64 = torch.float64
N = 5
CLIP = 0.3
TOL = 1e-9


def loss_of(out) -> torch.Tensor:
    """A sum of per-example terms, non-linear in the output."""
    if isinstance(out, tuple):
        out = out[0]
    return (out**2).sum() + out.sum()


def step_error(
    oracle,
    model,
    data,
    *,
    clipping="flat",
    loss=loss_of,
    dataset=None,
    optimizer=None,
    lrs=None,
    closure=False,
) -> float:
    """Relative max error of one noise-free step through make_private against the naive
    clipped sum of the batch (module docstring). ``dataset``: a dataset other than
    ``TensorDataset(*data)`` (its batch is then ``data``); ``optimizer``/``lrs``: an
    optimizer of the model's parameters and each trainable parameter's learning rate."""
    params = trainable(model)
    before = copy.deepcopy(model)
    n = len(dataset) if dataset is not None else data[0].shape[0]
    bounds = [CLIP * (1 + k / 2) for k in range(len(params))] if clipping == "per_layer" else CLIP
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=1.0)
    p = make_private(
        model,
        opt,
        DataLoader(dataset if dataset is not None else TensorDataset(*data), batch_size=n),
        noise_multiplier=0.0,
        max_grad_norm=bounds,
        clipping=clipping,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    for batch in p.data_loader:
        batch = batch if isinstance(batch, list | tuple) else [batch]

        def run(batch=batch):
            p.optimizer.zero_grad()
            out = loss(p.model(*batch))
            out.backward()
            return out

        if closure:
            p.optimizer.step(run)
        else:
            run()
            p.optimizer.step()
    ref = trainable(before)
    rows = oracle.grads(lambda i: loss(before(*[x[i : i + 1] for x in batch])), n, ref)
    if clipping == "per_layer":
        total, _ = oracle.clip_and_sum(rows, bounds, [q.numel() for q in ref])
    else:
        total, _ = oracle.clip_and_sum(rows, bounds)
    lrs = lrs or [1.0] * len(ref)
    scale = torch.cat(
        [torch.full((q.numel(),), lr, dtype=F64) for q, lr in zip(ref, lrs, strict=True)]
    )
    want = scale * total / p.optimizer.expected_batch_size
    moved = oracle.flat(b - a for a, b in zip(params, ref, strict=True))
    assert float(want.abs().max()) > 0  # the step moved the model: not vacuous
    return float((moved - want).abs().max() / (want.abs().max() + 1e-300))


def _x(*shape, seed=0):
    return torch.randn(N, *shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ids(vocab, *shape, seed=0):
    return torch.randint(0, vocab, (N, *shape), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the probe


def _same_fingerprint_rows() -> torch.Tensor:
    """Four distinct rows of 4 features with one norm and one weighted sum under the
    probe's fixed weights ``cos(0.7071 i + 0.3)``: Householder reflections of one row
    across hyperplanes containing the weight vector."""
    g = torch.Generator().manual_seed(0)
    w = torch.cos(torch.arange(4, dtype=F64) * 0.7071067811865476 + 0.3)
    a = torch.randn(4, generator=g, dtype=F64)
    rows = [a]
    for _ in range(3):
        u = torch.randn(4, generator=g, dtype=F64)
        u = u - (u @ w) / (w @ w) * w
        u = u / u.norm()
        rows.append(a - 2 * (a @ u) * u)
    return torch.stack(rows)


class _Identity(nn.Module):
    """An identity Linear, then (``mix``) the batch mean subtracted, or a trace of the
    mirrored example added (1e-12 of it: below the float64 fingerprint's tolerance)."""

    def __init__(self, mix: str | None = None):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4))
            self.lin.bias.zero_()
        self.mix = mix

    def forward(self, x):
        out = self.lin(x)
        if self.mix == "centre":
            return out - out.mean(0)
        if self.mix == "trace":
            return out + 1e-12 * out.flip(0)
        return out


def test_an_output_with_as_many_features_as_examples_is_not_read_as_mixing(oracle):
    """The probe compares the model's output row by row along every dimension of the
    batch's size. With 4 examples and 4 output features, replacing example j by an
    example whose output row has the same fingerprint (norm and weighted sum, here exactly;
    under bfloat16 autocast, within the tolerance, as Opacus's mixed-precision models
    with 4 classes and batches of 4 do) left the batch dimension unmoved while the
    feature dimension moved, and the output check called that mixing although no other
    example's row had changed at all. The model is per-example: its step equals the
    definition. Mixing is still refused on the same data: the batch mean subtracted, and
    a trace of another example too small for the fingerprint's tolerance (the other rows
    are then not bit-identical)."""
    x = _same_fingerprint_rows()
    assert step_error(oracle, _Identity(), [x]) < TOL
    for mix in ("centre", "trace"):
        with pytest.raises(BatchDependenceError, match="examples are mixed"):
            step_error(oracle, _Identity(mix), [x])


# --------------------------------------------------------------------------- grad_samples


class _Attend(nn.Module):
    """Attention of ``q, k, v`` with a key padding mask from ``mask > 0``, an attention
    mask (``"bool"``/``"float"`` causal 2-D, ``"3d"`` per head from the padding mask), and
    the attention weights (when returned) folded into the output per example."""

    def __init__(
        self, layer, batch_first, kpm=False, attn_mask=None, need_weights=True, average=True
    ):
        super().__init__()
        self.attn, self.batch_first = layer, batch_first
        self.kpm, self.attn_mask = kpm, attn_mask
        self.kw = {"need_weights": need_weights}
        if not average:
            self.kw["average_attn_weights"] = False

    def forward(self, q, k, v, mask):
        if not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        kw = dict(self.kw)
        if self.kpm:
            kw["key_padding_mask"] = mask > 0
        t = mask.shape[1]
        if self.attn_mask == "bool":
            kw["attn_mask"] = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        elif self.attn_mask == "float":
            kw["attn_mask"] = torch.triu(torch.full((t, t), -1e9, dtype=F64), 1)
        elif self.attn_mask == "3d":
            heads = self.attn.num_heads
            kw["attn_mask"] = (mask[:, None, :] > 0).repeat_interleave(heads, 0).expand(-1, t, -1)
        out, w = self.attn(q, k, v, **kw)
        out = out if self.batch_first else out.transpose(0, 1)
        return out if w is None else out * (1 + (w**2).flatten(1).sum(1))[:, None, None]


def _attention_data(kdim=4, vdim=4):
    mask = torch.zeros(N, 3, dtype=F64)
    mask[:, -1] = (torch.arange(N) % 2).to(F64)  # the last key padded in every other example
    return [_x(3, 4, seed=1), _x(3, kdim, seed=2), _x(3, vdim, seed=3), mask]


def _torch_attention(**kw):
    def make(batch_first=True, kdim=None, vdim=None, **layer):
        return nn.MultiheadAttention(4, 2, batch_first=batch_first, kdim=kdim, vdim=vdim, **layer)

    return make


def _opacus_attention(batch_first=True, **layer):
    return pytest.importorskip("opacus.layers").DPMultiheadAttention(
        4, 2, batch_first=batch_first, **layer
    )


#: name -> (layer settings, _Attend settings, kdim, vdim)
ATTENTION = {
    "key-padding-mask": ({}, {"kpm": True}, 4, 4),
    "key-padding-mask-sequence-first": ({"batch_first": False}, {"kpm": True}, 4, 4),
    "bool-causal-mask": ({}, {"attn_mask": "bool"}, 4, 4),
    "float-mask-and-padding": ({}, {"attn_mask": "float", "kpm": True}, 4, 4),
    "per-head-3d-mask": ({}, {"attn_mask": "3d"}, 4, 4),
    "no-weights": ({}, {"need_weights": False, "kpm": True}, 4, 4),
    "per-head-weights": ({}, {"average": False}, 4, 4),
    "kdim-vdim-bias-kv-zero-attn-padding": (
        {"kdim": 3, "vdim": 5, "add_bias_kv": True, "add_zero_attn": True},
        {"kpm": True},
        3,
        5,
    ),
    "sequence-first-bias-kv-padding": (
        {"batch_first": False, "add_bias_kv": True},
        {"kpm": True},
        4,
        4,
    ),
}


# a float attention mask beside a boolean padding mask (DPMultiheadAttention takes only
# boolean padding masks): PyTorch's layer says the mix is deprecated, and converts it
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("opacus", [False, True], ids=["torch", "DPMultiheadAttention"])
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_masks_and_flags(name, opacus, oracle):
    """``DPMultiheadAttention``'s forward arguments (and ``average_attn_weights``, which
    only PyTorch's layer takes), on both layers."""
    layer, attend, kdim, vdim = ATTENTION[name]
    if opacus and name == "per-head-weights":
        pytest.skip("DPMultiheadAttention.forward takes no average_attn_weights")
    torch.manual_seed(0)
    bf = layer.get("batch_first", True)
    if opacus and "attn_mask" in attend:
        bf = False  # Opacus's batch-first layer checks a 2-D mask against the batch size
    settings = {k: v for k, v in layer.items() if k != "batch_first"}
    made = (
        _opacus_attention(batch_first=bf, **settings)
        if opacus
        else _torch_attention()(batch_first=bf, **settings)
    )
    model = _Attend(made, bf, **attend).double()
    assert step_error(oracle, model, _attention_data(kdim, vdim)) < TOL


@pytest.mark.parametrize(
    "layer",
    [
        pytest.param(
            lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), id="encoder"
        ),
        pytest.param(
            lambda: nn.TransformerEncoderLayer(
                4, 2, 8, dropout=0.0, batch_first=True, norm_first=True
            ),
            id="encoder-norm-first",
        ),
        pytest.param(
            lambda: nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True), id="decoder"
        ),
    ],
)
def test_transformer_layers(layer, oracle):
    torch.manual_seed(0)
    model = layer().double()
    data = [_x(3, 4, seed=1)]
    if isinstance(model, nn.TransformerDecoderLayer):
        data.append(_x(2, 4, seed=2))
    assert step_error(oracle, model, data) < TOL


class _Recur(nn.Module):
    """A recurrent layer whose initial state is computed from the example (a Linear of
    its first step): ``h0`` has the batch on dimension 1."""

    def __init__(self, layer, batch_first):
        super().__init__()
        self.rnn, self.batch_first = layer, batch_first
        self.states = layer.num_layers * (2 if layer.bidirectional else 1)
        self.enc = nn.Linear(3, 4 * self.states)

    def forward(self, x):
        h = self.enc(x[:, 0]).reshape(x.shape[0], self.states, 4).transpose(0, 1)
        h = h.contiguous()
        lstm = "LSTM" in type(self.rnn).__name__
        seq = x if self.batch_first else x.transpose(0, 1)
        out = self.rnn(seq, (h, torch.tanh(h)) if lstm else h)[0]
        return out if self.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("name", ["LSTM", "GRU", "RNN", "DPLSTM", "DPGRU", "DPRNN"])
def test_recurrent_initial_state_from_the_example(name, batch_first, oracle):
    """Opacus's ``DPRNN`` tests pass an initial state; here it is the example's own (so
    its gradient reaches the encoder through ``h0``), two layers, both directions."""
    if name.startswith("DP"):
        cls = getattr(pytest.importorskip("opacus.layers"), name)
    else:
        cls = getattr(nn, name)
    torch.manual_seed(0)
    model = _Recur(
        cls(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first), batch_first
    ).double()
    assert step_error(oracle, model, [_x(4, 3)]) < TOL


class _Bag(nn.Module):
    def __init__(self, mode, padding_idx=None):
        super().__init__()
        self.bag = nn.EmbeddingBag(7, 3, mode=mode, padding_idx=padding_idx)

    def forward(self, ids, weights):
        w = weights if self.bag.mode == "sum" else None
        return self.bag(ids, per_sample_weights=w)


#: name -> (model factory, data, clipping)
LAYERS = {
    "embedding-padding-idx-minus-one": (
        lambda: nn.Embedding(7, 3, padding_idx=-1),
        [_ids(7, 6)],
        "flat",
    ),
    "embedding-bag-2d-weighted-padding": (lambda: _Bag("sum", 2), [_ids(4, 5), _x(5)], "per_layer"),
    "embedding-bag-2d-mean-padding-minus-one": (
        lambda: _Bag("mean", -1),
        [_ids(7, 5), _x(5)],
        "flat",
    ),
    "conv1d-reflect-stride-dilation": (
        lambda: nn.Conv1d(2, 3, 3, stride=2, padding=2, dilation=2, padding_mode="reflect"),
        [_x(2, 11)],
        "flat",
    ),
    "conv2d-circular-tuple-padding-groups": (
        lambda: nn.Conv2d(
            2, 4, (3, 2), stride=(2, 1), padding=(1, 2), padding_mode="circular", groups=2
        ),
        [_x(2, 6, 7)],
        "per_layer",
    ),
    "conv3d-same-even-kernel-reflect": (
        lambda: nn.Conv3d(
            2, 2, (2, 3, 4), padding="same", padding_mode="reflect", dilation=(1, 1, 2)
        ),
        [_x(2, 4, 5, 9)],
        "flat",
    ),
    "conv-transpose1d-dilation-padding-groups": (
        lambda: nn.ConvTranspose1d(
            4, 2, 3, stride=3, padding=2, output_padding=1, dilation=2, groups=2
        ),
        [_x(4, 5)],
        "flat",
    ),
    "conv-transpose2d-asymmetric": (
        lambda: nn.ConvTranspose2d(2, 3, (2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        [_x(2, 3, 4)],
        "per_layer",
    ),
    "conv-transpose3d-no-bias": (
        lambda: nn.ConvTranspose3d(2, 2, 2, stride=2, padding=1, bias=False),
        [_x(2, 2, 3, 3)],
        "flat",
    ),
    "group-norm-2d-input": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4)),
        [_x(4)],
        "flat",
    ),
    "group-norm-5d-input": (lambda: nn.GroupNorm(1, 2), [_x(2, 2, 3, 2)], "flat"),
    "layer-norm-three-dims": (lambda: nn.LayerNorm((2, 3, 2)), [_x(2, 2, 3, 2)], "per_layer"),
    "linear-5d-input": (lambda: nn.Linear(3, 2), [_x(2, 2, 2, 3)], "flat"),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_configurations(name, oracle):
    make, data, clipping = LAYERS[name]
    torch.manual_seed(0)
    assert step_error(oracle, make().double(), data, clipping=clipping) < TOL


# --------------------------------------------------------------------------- Opacus's modules


class _Basic(nn.Module):
    """Opacus's ``BasicSupportedModule``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(in_channels=16, out_channels=8, kernel_size=2)
        self.gn = nn.GroupNorm(num_groups=2, num_channels=8)
        self.fc = nn.Linear(in_features=4, out_features=8)
        self.ln = nn.LayerNorm([8, 8])

    def forward(self, x):
        return self.ln(self.fc(self.gn(self.conv(x))))


class _CustomLinear(nn.Module):
    """Opacus's ``CustomLinearModule``: ``F.linear`` of its own parameters."""

    def __init__(self, i, o):
        super().__init__()
        self._weight = nn.Parameter(torch.randn(o, i))
        self._bias = nn.Parameter(torch.randn(o))

    def forward(self, x):
        return F.linear(x, self._weight, self._bias)


class _Matmul(nn.Module):
    """Opacus's ``MatmulModule``."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o))

    def forward(self, x):
        return torch.matmul(x, self.weight)


class _ExtraParam(nn.Module):
    """Opacus's ``LinearWithExtraParam``."""

    def __init__(self, i, o, hidden=8):
        super().__init__()
        self.fc = nn.Linear(i, hidden)
        self.extra_param = nn.Parameter(torch.randn(hidden, o))

    def forward(self, x):
        return self.fc(x).matmul(self.extra_param)


class _WithCustomLinear(nn.Module):
    """Opacus's ``ModelWithCustomLinear``."""

    def __init__(self):
        super().__init__()
        self.fc1 = _CustomLinear(5, 8)
        self.fc2 = _ExtraParam(8, 4)
        self.extra_param = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.fc2(self.fc1(x)).matmul(self.extra_param)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize(
    "make",
    [
        _Basic,
        lambda: _CustomLinear(5, 8),
        lambda: _Matmul(5, 10),
        lambda: _ExtraParam(5, 8),
        _WithCustomLinear,
    ],
    ids=["basic", "custom-linear", "matmul", "extra-param", "model-with-custom-linear"],
)
def test_opacus_validation_modules_on_a_list_dataset(make, clipping, oracle):
    """``privacy_engine_validation_test.py``: its modules (layers without a rule of their
    own go through the fallback), trained on a dataset that is a list of ``(16, 5)``
    tensors, as there (the loader yields one tensor, not a tuple)."""
    torch.manual_seed(0)
    model = make().double()
    g = torch.Generator().manual_seed(1)
    dataset = [torch.randn(16, 5, generator=g, dtype=F64) for _ in range(N)]
    err = step_error(
        oracle,
        model,
        [torch.stack(dataset)],
        clipping=clipping,
        dataset=dataset,
        loss=lambda out: (out**2).sum() / 10 + out.sum(),
    )
    assert err < TOL


# --------------------------------------------------------------------------- the optimizer


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def test_parameter_groups_with_their_own_learning_rates_under_per_layer_clipping(oracle):
    """Two groups, listed in the reverse of the model's order, each with its own learning
    rate: each parameter is clipped to its own bound (in ``model.parameters()`` order)
    and moved by its group's rate."""
    model = _mlp()
    w1, b1, w2, b2 = model.parameters()
    opt = torch.optim.SGD(
        [{"params": [b2, w2], "lr": 0.5}, {"params": [b1, w1], "lr": 2.0}], lr=1.0
    )
    err = step_error(
        oracle, model, [_x(3)], clipping="per_layer", optimizer=opt, lrs=[2.0, 2.0, 0.5, 0.5]
    )
    assert err < TOL


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_step_with_a_closure(clipping, oracle):
    """Opacus's ``_train_steps_with_closure``: ``optimizer.step(closure)``, the closure
    running zero_grad, forward and backward."""
    assert step_error(oracle, _mlp(), [_x(3)], clipping=clipping, closure=True) < TOL


# --------------------------------------------------------------------------- BatchMemoryManager


def _bmm_setting():
    """Opacus's ``BatchMemoryManagerTest`` data (256 examples of 5 features) and model."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(256, 5, generator=g), torch.randn(256, generator=g))
    torch.manual_seed(1)
    return ds, nn.Linear(5, 1)


def _bmm_run(physical, *, sampling="poisson", workers=0, pin=False, noise=1.0, seed=3):
    """Opacus's ``BatchMemoryManagerTest`` setting (256 examples of 5 features, Linear(5,
    1), mean squared loss, logical batches of 16): the final weight, the chunk sizes, at
    which chunks the weight moved, and the run's accounted steps."""
    ds, model = _bmm_setting()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=16, num_workers=workers, pin_memory=pin),
        noise_multiplier=noise,
        max_grad_norm=1.0,
        sampling=sampling,
        max_physical_batch_size=physical,
        seed=seed,
    )
    w = model.weight.detach().clone()
    sizes, moved, ends = [], [], []
    for x, y in p.data_loader:
        sizes.append(len(x))
        p.optimizer.zero_grad()
        ((y - p.model(x).squeeze(-1)) ** 2).mean().backward()
        before = p.accountant.steps
        p.optimizer.step()
        ends.append(p.accountant.steps > before)
        moved.append(not torch.equal(w, model.weight))
        w = model.weight.detach().clone()
    return dict(
        weight=w,
        sizes=sizes,
        moved=moved,
        ends=ends,
        steps=p.accountant.steps,
        length=len(p.data_loader),
    )


# pin_memory=True on a machine without an accelerator: torch says it does nothing
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_virtual_batches_equal_one_batch_noise_included(sampling):
    """``test_basic`` and ``test_equivalent_to_one_batch``: chunks of at most 4 (with
    worker processes and pinned memory) or 5 examples; the weight moves exactly at the
    chunks that end a logical batch; 16 logical steps (the loader's length) accounted
    however the batches are cut; with the same seed the weights equal those of the run
    without chunks, noise included."""
    whole = _bmm_run(None, sampling=sampling)
    assert whole["steps"] == whole["length"] == 16
    for physical, workers, pin in [(4, 2, True), (5, 0, False)]:
        run = _bmm_run(physical, sampling=sampling, workers=workers, pin=pin)
        assert max(run["sizes"]) <= physical
        assert len(run["sizes"]) > 16
        assert run["moved"] == run["ends"]
        assert run["steps"] == run["length"] == 16
        assert sum(run["sizes"]) == sum(whole["sizes"])
        torch.testing.assert_close(run["weight"], whole["weight"], rtol=1e-5, atol=1e-6)


def test_an_empty_poisson_batch_moves_nothing_without_noise():
    """``test_empty_batch``: batches of expected size 2 cut into chunks of 10, noise 0:
    an empty batch leaves the weight as it was and is still one accounted step."""
    ds, model = _bmm_setting()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=2),
        noise_multiplier=0.0,
        max_grad_norm=1e5,
        max_physical_batch_size=10,
        seed=30,
    )
    empty = 0
    for x, y in p.data_loader:
        assert len(x) <= 10
        w = model.weight.detach().clone()
        p.optimizer.zero_grad()
        ((y - p.model(x).squeeze(-1)) ** 2).mean().backward()
        p.optimizer.step()
        assert torch.equal(w, model.weight) == (len(x) == 0)
        empty += len(x) == 0
    assert empty > 0  # e^-2 of the 128 steps
    assert p.accountant.steps == len(p.data_loader) == 128


# --------------------------------------------------------------------------- mixed precision


def _mixed_models():
    """Opacus's ``mixed_precision_utils`` models at small sizes: ``(model, input)``."""
    layers = pytest.importorskip("opacus.layers")
    g = torch.Generator().manual_seed(0)

    class Linear(nn.Module):  # SimpleLinearModel
        def __init__(self):
            super().__init__()
            self.fc1, self.ln1 = nn.Linear(4, 16), nn.LayerNorm(16)
            self.fc2, self.gn = nn.Linear(16, 16), nn.GroupNorm(4, 16)
            self.fc3, self.rms, self.fc4 = nn.Linear(16, 16), nn.RMSNorm(16), nn.Linear(16, 4)

        def forward(self, x):
            x = F.relu(self.ln1(self.fc1(x)))
            x = F.relu(self.gn(self.fc2(x).unsqueeze(-1)).squeeze(-1))
            return self.fc4(F.relu(self.rms(self.fc3(x))))

    class Conv(nn.Module):  # Conv1DModel / Conv2DModel / Conv3DModel
        def __init__(self, nd):
            super().__init__()
            self.conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][nd - 1](3, 16, 3, padding=1)
            self.norm = [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d][nd - 1](16)
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(F.relu(self.norm(self.conv(x))).flatten(2).mean(2))

    class Recurrent(nn.Module):  # RNNModel
        def __init__(self):
            super().__init__()
            self.lstm, self.ln1 = layers.DPLSTM(4, 16, batch_first=True), nn.LayerNorm(16)
            self.gru, self.ln2 = layers.DPGRU(16, 16, batch_first=True), nn.LayerNorm(16)
            self.rnn = layers.DPRNN(16, 16, batch_first=True)
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            x = self.ln1(self.lstm(x)[0])
            x = self.ln2(self.gru(x)[0])
            return self.fc(self.rnn(x)[0][:, -1])

    class Bag(nn.Module):  # EmbeddingBagModel
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(100, 16, mode="mean")
            self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 4)

        def forward(self, x):
            offsets = torch.arange(0, x.numel(), x.shape[1])
            return self.fc(F.relu(self.ln(self.bag(x.reshape(-1), offsets))))

    return {
        "linear": (Linear, torch.randn(4, 4, generator=g)),
        "conv1d": (lambda: Conv(1), torch.randn(4, 3, 8, generator=g)),
        "conv2d": (lambda: Conv(2), torch.randn(4, 3, 5, 5, generator=g)),
        "conv3d": (lambda: Conv(3), torch.randn(4, 3, 3, 3, 3, generator=g)),
        "recurrent": (Recurrent, torch.randn(4, 4, 4, generator=g)),
        "embedding-bag": (Bag, torch.randint(0, 100, (4, 10), generator=g)),
    }


# RMSNorm on a bfloat16 input with a float32 weight takes torch's unfused path, saying so
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize(
    "name", ["linear", "conv1d", "conv2d", "conv3d", "recurrent", "embedding-bag"]
)
def test_opacus_mixed_precision_models_under_bfloat16_autocast(name, oracle):
    """``mixed_precision_test.py``'s models (4 classes, batches of 4) under CPU bfloat16
    autocast, float32 parameters: the released gradient is float32 and the step equals
    the batch-of-one loop run under the same autocast, within bfloat16 rounding (the
    clipped sum's relative error, measured about 4e-3)."""
    make, x = _mixed_models()[name]
    y = torch.arange(4) % 4
    torch.manual_seed(1)
    model = make()
    before = copy.deepcopy(model)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    for xb, yb in p.data_loader:
        p.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = p.model(xb)
        assert out.dtype == torch.bfloat16
        F.cross_entropy(out.float(), yb, reduction="sum").backward()
        p.optimizer.step()
    assert all(q.grad.dtype == torch.float32 for q in model.parameters())
    rows = oracle.grads(
        lambda i: F.cross_entropy(before(xb[i : i + 1]).float(), yb[i : i + 1], reduction="sum"),
        4,
        list(before.parameters()),
        autocast=torch.bfloat16,
    )
    want = oracle.clip_and_sum(rows, 0.05)[0] / 4
    moved = oracle.flat(b - a for a, b in zip(model.parameters(), before.parameters(), strict=True))
    assert float((moved - want).norm() / want.norm()) < 2e-2


def test_opacus_attention_model_attending_across_the_batch_is_refused():
    """The ``AttentionModel`` of ``mixed_precision_utils`` passes a batch-first tensor to
    a sequence-first ``DPMultiheadAttention``: it attends over the batch dimension, so one
    example moves every other's output. Opacus trains it; privlearn refuses it before
    any step."""
    layers = pytest.importorskip("opacus.layers")

    class AttentionModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Linear(4, 16)
            self.attention = layers.DPMultiheadAttention(16, 4)
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            x = self.embedding(x)
            return self.fc(self.attention(x, x, x)[0].mean(1))

    torch.manual_seed(0)
    model = AttentionModel()
    x, y = torch.randn(8, 4, 4), torch.randint(0, 4, (8,))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sampling="fixed",
        seed=0,
    )
    before = [q.detach().clone() for q in model.parameters()]
    xb, yb = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    F.cross_entropy(p.model(xb), yb).backward()
    with pytest.raises(BatchDependenceError):
        p.optimizer.step()
    assert p.accountant.steps == 0
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))


# --------------------------------------------------------------------------- empty batches


class _Head(nn.Module):
    """A layer (run by ``run(layer, x)``), flattened into a Linear head."""

    def __init__(self, layer, width, run=None):
        super().__init__()
        self.layer, self.head, self.run = layer, nn.Linear(width, 3), run

    def forward(self, x):
        h = self.layer(x) if self.run is None else self.run(self.layer, x)
        return self.head((h[0] if isinstance(h, tuple) else h).flatten(1))


def _sequence_first(layer, x):
    y = layer(x.transpose(0, 1))
    return (y[0] if isinstance(y, tuple) else y).transpose(0, 1)


def _bags_with_offsets(layer, ids):
    return layer(ids.reshape(-1), torch.arange(0, ids.numel(), ids.shape[1]))


def _opacus_layer(name, *args, **kw):
    return lambda: getattr(pytest.importorskip("opacus.layers"), name)(*args, **kw)


#: name -> (layer, input of n examples, width of the flattened output, how it runs)
EMPTY = {
    "conv2d": (lambda: nn.Conv2d(2, 3, 3), lambda n: torch.randn(n, 2, 5, 5), 27, None),
    "conv-transpose1d": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2),
        lambda n: torch.randn(n, 2, 4),
        27,
        None,
    ),
    "rms-norm": (lambda: nn.RMSNorm(6), lambda n: torch.randn(n, 6), 6, None),
    "attention-bias-kv-zero-attn": (
        lambda: nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True, add_zero_attn=True),
        lambda n: torch.randn(n, 3, 4),
        12,
        lambda a, x: a(x, x, x),
    ),
    "lstm-bidirectional": (
        lambda: nn.LSTM(4, 3, num_layers=2, bidirectional=True, batch_first=True),
        lambda n: torch.randn(n, 3, 4),
        18,
        None,
    ),
    "gru-sequence-first": (
        lambda: nn.GRU(4, 3),
        lambda n: torch.randn(n, 3, 4),
        9,
        _sequence_first,
    ),
    "embedding-bag-2d": (
        lambda: nn.EmbeddingBag(10, 4),
        lambda n: torch.randint(0, 10, (n, 5)),
        4,
        None,
    ),
    "embedding-bag-offsets": (
        lambda: nn.EmbeddingBag(10, 4, mode="sum"),
        lambda n: torch.randint(0, 10, (n, 5)),
        4,
        _bags_with_offsets,
    ),
    "transformer-encoder": (
        lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
        lambda n: torch.randn(n, 3, 4),
        12,
        None,
    ),
    "opacus-dp-lstm": (
        _opacus_layer("DPLSTM", 4, 3, batch_first=True),
        lambda n: torch.randn(n, 3, 4),
        9,
        None,
    ),
    "opacus-dp-gru-sequence-first": (
        _opacus_layer("DPGRU", 4, 3),
        lambda n: torch.randn(n, 3, 4),
        9,
        _sequence_first,
    ),
}


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_empty_poisson_batches_in_more_families(name, monkeypatch):
    """Opacus's grad-sample tests run each layer on an empty batch. Here the first and
    third Poisson batches are empty: the step before any data (the first, when the probe
    has not run) and one after a step with data leave the weights as they were without
    noise, and all four steps are accounted."""
    from privlearn.torch.samplers import PoissonBatchSampler

    draw = PoissonBatchSampler._draw
    monkeypatch.setattr(
        PoissonBatchSampler,
        "_draw",
        lambda self, seed: [] if self.draws in (0, 2) else draw(self, seed),
    )
    make, inputs, width, run = EMPTY[name]
    torch.manual_seed(0)
    model = _Head(make(), width, run)
    ds = TensorDataset(inputs(32), torch.randint(0, 3, (32,)))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(ds, batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        loss_reduction="sum",
        seed=0,
    )
    weights = [torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()])]
    sizes = []
    for x, y in p.data_loader:  # 4 steps
        p.optimizer.zero_grad()
        F.cross_entropy(p.model(x), y, reduction="sum").backward()
        p.optimizer.step()
        sizes.append(len(y))
        weights.append(torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()]))
    assert sizes[0] == sizes[2] == 0 and sizes[1] > 0 and sizes[3] > 0
    assert torch.equal(weights[1], weights[0]) and torch.equal(weights[3], weights[2])
    assert not torch.equal(weights[2], weights[1])
    assert p.accountant.steps == 4


# --------------------------------------------------------------------------- validators


def test_fix_after_the_optimizer_was_built_trains_the_batch_norm_parameters(oracle):
    """``test_validator_weight_update_check``: Opacus refuses an optimizer built before
    ``ModuleValidator.fix`` (its GroupNorm has new parameters). privlearn's ``fix`` gives
    the GroupNorm the BatchNorm's own affine parameters, so that optimizer trains them:
    the step equals the definition on the fixed model, the GroupNorm's weight moved."""
    from privlearn.torch import fix, validate

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3)
    ).double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    assert validate(model)
    model = fix(model)
    assert validate(model) == [] and isinstance(model[1], nn.GroupNorm)
    weight = model[1].weight.detach().clone()
    assert step_error(oracle, model, [_x(2, 5, 5)], optimizer=opt) < TOL
    assert not torch.equal(model[1].weight, weight)


# --------------------------------------------------------------------------- samplers


def _sizes(sampler, epochs=1):
    return [len(b) for _ in range(epochs) for b in sampler]


def test_poisson_sampler_as_opacus_poisson_test():
    """``poisson_test.py`` on ``PoissonBatchSampler`` (Opacus's
    ``UniformWithReplacementSampler``): 100 examples at rate 0.1 give 10 batches per
    epoch, of varying sizes whose mean over 50 epochs is 10 within 4 standard errors
    (sd 3 / sqrt(500)); the same seed draws the same batches, another seed others; a
    DataLoader with it as ``batch_sampler`` yields those batches."""
    from privlearn.torch import PoissonBatchSampler

    sampler = PoissonBatchSampler(100, 0.1, seed=7)
    assert len(sampler) == 10
    sizes = _sizes(sampler, 50)
    assert len(sizes) == 500 and len(set(sizes)) > 1
    assert abs(sum(sizes) / 500 - 10) < 4 * 3 / math.sqrt(500)
    first = [list(b) for b in PoissonBatchSampler(100, 0.1, seed=7)]
    assert first == [list(b) for b in PoissonBatchSampler(100, 0.1, seed=7)]
    assert first != [list(b) for b in PoissonBatchSampler(100, 0.1, seed=8)]
    ds = TensorDataset(torch.arange(100))
    loader = DataLoader(ds, batch_sampler=PoissonBatchSampler(100, 0.1, seed=7))
    assert [x.tolist() for (x,) in loader] == first


def test_distributed_poisson_sampler_as_opacus_distributed_poisson_test():
    """``distributed_poisson_test.py``: two ranks' samplers over 100 examples at the
    global rate 0.1 give 10 batches each, of mean size 5 per rank (over 50 epochs, 4
    standard errors), on disjoint examples."""
    from privlearn.torch import DistributedPoissonBatchSampler

    samplers = [
        DistributedPoissonBatchSampler(100, 0.1, rank, 2, seed=7 + rank) for rank in range(2)
    ]
    indices = []
    for s in samplers:
        assert len(s) == 10
        sizes = _sizes(s, 50)
        assert len(set(sizes)) > 1
        assert abs(sum(sizes) / 500 - 5) < 4 * math.sqrt(5 * 0.9) / math.sqrt(500)
        indices.append({i for b in s for i in b})
    assert not indices[0] & indices[1]
    assert indices[0] | indices[1] <= set(range(100))


# --------------------------------------------------------------------------- randomness


def _seeded_run(seed, *, secure=False, sampling="poisson"):
    """An epoch of a small model with dropout (noise 1): its final parameters. torch's
    global generator is seeded the same way before every run."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 3, generator=g), torch.randint(0, 2, (64,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 2))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=seed,
        secure_mode=secure,
        sampling=sampling,
    )
    torch.manual_seed(123)
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        F.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    return _flat(model.parameters())


def _flat(params) -> torch.Tensor:
    """The parameters, flattened into one vector."""
    return torch.cat([q.detach().reshape(-1) for q in params])


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_runs_repeat_with_a_seed_and_differ_without(sampling):
    """``randomness_test.py``: the same seed repeats a run (batches, noise; the dropout
    masks from torch's generator, seeded alike); another seed, no seed (the OS's entropy,
    whatever torch's global seed) and secure mode each give another run."""
    ref = _seeded_run(1, sampling=sampling)
    assert torch.equal(ref, _seeded_run(1, sampling=sampling))
    assert not torch.equal(ref, _seeded_run(2, sampling=sampling))
    assert not torch.equal(
        _seeded_run(None, sampling=sampling), _seeded_run(None, sampling=sampling)
    )
    assert not torch.equal(
        _seeded_run(None, secure=True, sampling=sampling),
        _seeded_run(None, secure=True, sampling=sampling),
    )


def test_training_leaves_the_global_generators_alone():
    """privlearn draws batches and noise from its own generators (and the probe restores
    what it uses): an epoch without dropout leaves torch's, Python's and NumPy's global
    random states as they were."""
    import random

    import numpy as np

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 3, generator=g), torch.randint(0, 2, (64,), generator=g))
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        F.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    assert p.accountant.steps == 8
    assert torch.equal(states[0], torch.get_rng_state())
    assert states[1] == random.getstate()
    assert (states[2] == np.random.get_state()[1]).all()
