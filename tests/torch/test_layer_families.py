"""Every layer family of Opacus's own per-sample-gradient tests, run through privlearn.

Opacus 1.6.0 tests per-sample gradients family by family (``opacus/tests/grad_samples/``,
each against its micro-batch loop, Hypothesis grids):

=====================  ===================================================================
family                 Opacus's grid
=====================  ===================================================================
Linear                 input rank 2-4, bias, batch_first, empty batch
Conv1d / 2d / 3d       channels {1, 3, 32}, out = 2C or C/2, kernel (also per axis),
                       stride, padding {0, n, tuple, "same", "valid"}, dilation (also per
                       axis), groups, empty batch; an asymmetric dilation and kernel
Embedding              index rank 2-4, batch_first, empty batch
EmbeddingBag           1-D ids with offsets, modes "sum" and "mean"
GroupNorm              num_groups {1, 4, C}
InstanceNorm1d/2d/3d   affine, no running statistics
LayerNorm / RMSNorm    normalized_shape of 1-3 dimensions, input rank 2-4
SequenceBias           batch_first, empty batch
DPMultiheadAttention   bias, add_bias_kv, add_zero_attn, kdim/vdim (sequence-first)
DPRNN/DPGRU/DPLSTM     layers {1, 2}, bias, batch_first, bidirectional, PackedSequence
                       (sorted or not)
ghost clipping         per-example norms of Linear + LayerNorm on sequences, a CNN and an
                       Embedding (fast gradient clipping) against the plain per-sample
                       gradients; closed-form Embedding norms
=====================  ===================================================================

The same kinds of configurations run here (a representative grid by default; the full
grid, drawn by Hypothesis, is ``@pytest.mark.slow``). For each, privlearn's per-example
gradients, squared norms and weighted (clipped) sums ``sum_i c_i g_i`` are compared with
a naive loop of batch-size-1 backward passes in float64 and, where Opacus runs the same
module (``GradSampleModule``), with Opacus's per-sample gradients (skipped without
Opacus). Opacus's DP layers run as ordinary modules inside privlearn; PyTorch's own
recurrent layers and cells and its attention run too. Configurations privlearn cannot
account are checked to be refused with an error that names the layer.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_grad_sample import _OutputOnly  # noqa: E402  (Opacus's DPRNNAdapter: the output only)
from torch import nn  # noqa: E402
from torch.nn.utils.rnn import (  # noqa: E402
    PackedSequence,
    pack_padded_sequence,
    pack_sequence,
    pad_packed_sequence,
)

from privlearn.torch import grad_sample  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402
from privlearn.torch.validator import UnsupportedModuleError, check_model  # noqa: E402

F64 = torch.float64
#: relative tolerance of every float64 comparison
TOL = 1e-9


def _opacus():
    return pytest.importorskip("opacus")


def _opacus_layers():
    return pytest.importorskip("opacus.layers")


# --------------------------------------------------------------------------- references


def _floats(out) -> list:
    """The floating tensors of a module's output (a PackedSequence by its data)."""
    if isinstance(out, PackedSequence):
        return [out.data]
    if isinstance(out, tuple | list):
        return [t for o in out for t in _floats(o)]
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return [out]
    return []


def loss_of(out) -> torch.Tensor:
    """A sum of per-example terms over every floating output (so the per-example losses
    add up to the batch loss whatever the layout), non-linear in the outputs."""
    return sum(((o ** 2).sum() + o.sum()) * (k + 1) for k, o in enumerate(_floats(out)))


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def naive(model, examples, loss_fn=loss_of) -> torch.Tensor:
    """Per-example gradients ``(B, P)``: one backward pass per example (its inputs
    ``examples[i]``), on a copy of the model."""
    model = copy.deepcopy(model)
    params = _trainable(model)
    rows = []
    for args in examples:
        grads = torch.autograd.grad(loss_fn(model(*args)), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                               for g, p in zip(grads, params, strict=True)]))
    return torch.stack(rows).to(F64)


def privlearn(model, inputs, loss_fn=loss_of, mode="auto", batch_dims=None,
              reduction="sum"):
    """privlearn's ``(squared norms (B,), per-example gradients (B, P), weighted sum
    function)`` for one forward/backward of ``model`` on ``inputs``; ``mode`` forces
    ghost norms or materialised gradients where a rule can choose."""
    params = _trainable(model)
    tracker = GradSampleTracker(model, loss_reduction=reduction, batch_dims=batch_dims)
    orig = grad_sample.use_ghost
    try:
        if mode != "auto":
            grad_sample.use_ghost = lambda *a, **k: mode == "ghost"
        loss_fn(model(*inputs)).backward()
        contribs, batch, scale = tracker.contributions()
    finally:
        grad_sample.use_ghost = orig
        tracker.detach()
    sq = sum(c.sq_norms() for c in contribs).to(F64) * scale ** 2
    by_id: dict[int, torch.Tensor] = {}
    for c in contribs:
        for p, g in zip(c.params, c.per_sample(), strict=True):
            by_id[id(p)] = g if id(p) not in by_id else by_id[id(p)] + g
    ps = torch.cat([by_id[id(p)].reshape(batch, -1).to(F64) if id(p) in by_id
                    else torch.zeros(batch, p.numel(), dtype=F64) for p in params], 1)

    def weighted(c: torch.Tensor) -> torch.Tensor:
        out = {}
        for contrib in contribs:
            for p, w in zip(contrib.params, contrib.weighted_sum(c), strict=True):
                out[id(p)] = w if id(p) not in out else out[id(p)] + w
        flat = torch.cat([out[id(p)].reshape(-1).to(F64) if id(p) in out
                          else torch.zeros(p.numel(), dtype=F64) for p in params])
        acc = {id(p): torch.zeros_like(p, dtype=F64) for p in params}
        for contrib in contribs:  # the in-place form the optimizer uses
            contrib.accumulate_into(c, [acc[id(p)] for p in contrib.params])
        torch.testing.assert_close(torch.cat([acc[id(p)].reshape(-1) for p in params]),
                                   flat, rtol=TOL, atol=TOL * (flat.abs().max().item() + 1))
        return flat * scale

    return sq, ps * scale, weighted


#: Opacus's module hooks warn when no input of the copied model requires gradients (the
#: inputs here are data, not parameters); its per-sample gradients are unaffected.
_OPACUS_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect"


def _opacus_backward(loss: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_OPACUS_HOOK_WARNING, category=UserWarning)
        loss.backward()


def opacus_per_sample(model, inputs, batch_first=True, loss_fn=loss_of) -> torch.Tensor:
    """Opacus's per-sample gradients ``(B, P)`` (GradSampleModule, hooks) of a copy of
    ``model``."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(copy.deepcopy(model), batch_first=batch_first,
                           loss_reduction="sum")
    _opacus_backward(loss_fn(gsm(*inputs)))
    grads = [p.grad_sample for p in _trainable(gsm._module)]
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads], 1).to(F64)


def check(model, inputs, examples, *, modes=("auto",), batch_dims=None, opacus=None,
          loss_fn=loss_of):
    """privlearn against the naive loop in every ``mode``; ``opacus``: Opacus's
    ``batch_first`` flag to compare with Opacus's per-sample gradients too (None: not)."""
    ref = naive(model, examples, loss_fn)
    scale = ref.abs().max().item() + 1.0
    for mode in modes:
        sq, ps, weighted = privlearn(model, inputs, loss_fn, mode, batch_dims)
        assert ps.shape == ref.shape
        torch.testing.assert_close(ps, ref, rtol=TOL, atol=TOL * scale)
        torch.testing.assert_close(sq, (ref ** 2).sum(1), rtol=TOL, atol=TOL * scale ** 2)
        c = torch.rand(ref.shape[0], dtype=F64)
        torch.testing.assert_close(weighted(c), c @ ref, rtol=TOL,
                                   atol=TOL * scale * ref.shape[0])
    if opacus is not None:
        _opacus()
        theirs = opacus_per_sample(model, inputs, opacus, loss_fn)
        torch.testing.assert_close(theirs, ref, rtol=1e-7, atol=1e-7 * scale)


def split(x: torch.Tensor, dim: int = 0) -> list[tuple]:
    """One single-example input tuple per example of ``x`` (batch on ``dim``)."""
    return [(x.narrow(dim, i, 1),) for i in range(x.shape[dim])]


def _seeded(seed: int):
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- Linear


LINEAR = [(rank, bias, bf) for rank, bias, bf in itertools.product((2, 3, 4), (True, False),
                                                                    (True, False))
          if bf or rank > 2]


@pytest.mark.parametrize("rank,bias,batch_first", LINEAR)
def test_linear(rank, bias, batch_first):
    """Opacus's ``Linear_test``: input ranks 2-4, with and without bias, batch first or
    second (declared to privlearn with ``batch_dims``)."""
    _seeded(rank * 4 + bias * 2 + batch_first)
    w = 11
    shape = {2: (3, w), 3: (3, 4, w), 4: (3, 4, 2, w)}[rank]
    x = torch.randn(shape, dtype=F64)
    dim = 0
    if not batch_first:
        x, dim = x.transpose(0, 1).contiguous(), 1
    check(nn.Linear(w, w + 2, bias=bias, dtype=F64), (x,), split(x, dim),
          modes=("auto", "ghost", "materialise"),
          batch_dims=None if batch_first else {"": 1}, opacus=batch_first)


# --------------------------------------------------------------------------- convolutions

#: (nd, C, out, kernel, stride, padding, dilation, groups): Opacus's grids, each axis
#: value at least once, with the shapes Opacus draws
CONV = [
    (1, 3, 6, 2, 1, 0, 1, 1),
    (1, 3, 6, 3, 2, 1, 2, 3),
    (1, 32, 16, 3, 1, "same", 2, 4),
    (1, 32, 64, 2, 2, "valid", 1, 16),
    (1, 1, 2, 3, 1, 2, 1, 1),
    (2, 3, 6, 2, 1, 0, 1, 1),
    (2, 3, 6, 3, 2, 2, 3, 3),
    (2, 32, 16, 4, 1, "same", 2, 16),
    (2, 32, 64, 2, 2, "valid", 1, 4),
    (2, 1, 1, (3, 1), 1, 0, (3, 1), 1),
    (2, 4, 4, (2, 3), (1, 2), (1, 0), (2, 1), 2),
    (3, 3, 6, 2, 1, 0, 1, 1),
    (3, 3, 6, (1, 2, 3), (1, 2, 3), (1, 2, 3), (1, 2, 2), 3),
    (3, 4, 2, 3, 1, "same", 1, 2),
    (3, 4, 8, 2, 2, "valid", 1, 4),
    (3, 1, 2, 2, 2, 2, (1, 2, 2), 1),
]
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_SPATIAL = {1: (9,), 2: (11, 12), 3: (4, 7, 6)}


@pytest.mark.parametrize("nd,c,out,k,s,pad,dil,groups", CONV)
def test_conv(nd, c, out, k, s, pad, dil, groups):
    """Opacus's ``Conv1d_test`` / ``Conv2d_test`` / ``Conv3d_test`` configurations, in
    ghost and materialised form."""
    _seeded(nd * 100 + c + out)
    conv = _CONV[nd](c, out, k, stride=s, padding=pad, dilation=dil, groups=groups,
                     dtype=F64)
    x = torch.randn(3, c, *_SPATIAL[nd], dtype=F64)
    check(conv, (x,), split(x), modes=("auto", "ghost", "materialise"), opacus=True)


def test_conv2d_asymmetric_dilation_and_kernel():
    """Opacus's ``test_asymetric_dilation_and_kernel_size``: one example, no bias."""
    _seeded(0)
    conv = nn.Conv2d(1, 1, kernel_size=(3, 1), dilation=(3, 1), bias=False, dtype=F64)
    x = torch.randn(1, 1, 8, 1, dtype=F64)
    check(conv, (x,), split(x), modes=("auto", "ghost", "materialise"), opacus=True)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
def test_conv_padding_modes(nd, padding_mode):
    _seeded(nd)
    conv = _CONV[nd](2, 4, 3, padding="same", padding_mode=padding_mode, dtype=F64)
    x = torch.randn(3, 2, *_SPATIAL[nd], dtype=F64)
    check(conv, (x,), split(x), modes=("auto", "ghost"))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(nd=st.sampled_from([1, 2, 3]), n=st.integers(1, 4), c=st.sampled_from([1, 3, 32]),
       expand=st.booleans(), k=st.integers(2, 3), stride=st.integers(1, 2),
       pad=st.sampled_from([0, 2, "same", "valid"]), dil=st.integers(1, 2), data=st.data())
def test_conv_grid(nd, n, c, expand, k, stride, pad, dil, data):
    """Opacus's full convolution grids (Hypothesis; groups among the common divisors of
    the channel counts, as Opacus's grid keeps)."""
    out = c * 2 if expand else max(1, c // 2)
    if pad == "same":
        stride = 1
    groups = data.draw(st.sampled_from([g for g in range(1, 17)
                                        if c % g == 0 and out % g == 0]))
    conv = _CONV[nd](c, out, k, stride=stride, padding=pad, dilation=dil, groups=groups,
                     dtype=F64)
    x = torch.randn(n, c, *(s + 6 for s in _SPATIAL[nd]), dtype=F64)
    check(conv, (x,), split(x), modes=("auto", "ghost", "materialise"), opacus=True)


# --------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("batch_first", [True, False])
def test_embedding(rank, batch_first):
    """Opacus's ``Embedding_test``: index tensors of rank 2-4 (repeated ids), batch first
    or second."""
    _seeded(rank)
    size = {2: (3, 5), 3: (3, 5, 2), 4: (3, 5, 2, 2)}[rank]
    ids = torch.randint(0, 7, size)
    dim = 0
    if not batch_first:
        ids, dim = ids.transpose(0, 1).contiguous(), 1
    emb = nn.Embedding(7, 10, dtype=F64)
    check(emb, (ids,), split(ids, dim), batch_dims=None if batch_first else {"": 1},
          opacus=batch_first)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag(mode):
    """Opacus's ``Embedding_bag_test``: 1-D ids with offsets, bags of 1-7 distinct ids,
    one example per bag."""
    _seeded(7)
    bag = nn.EmbeddingBag(20, 12, mode=mode, dtype=F64)
    sizes = [3, 1, 7, 2, 5]
    ids = torch.cat([torch.randperm(20)[:s] for s in sizes])
    offsets = torch.tensor([0] + list(itertools.accumulate(sizes))[:-1])
    examples = [(ids[o:o + s], torch.tensor([0])) for o, s in zip(offsets, sizes, strict=True)]
    check(bag, (ids, offsets), examples, opacus=True)


def test_embedding_norms_closed_form():
    """Opacus's ``embedding_norm_sample_test``: with ids ``[[1, 1], [2, 0], [2, 0]]`` and
    output gradients ``[[.2, .2], [.3, .1], [.3, .1]]`` the per-example gradient puts
    ``.2 + .2`` on row 1 for the first example, ``.3`` and ``.1`` on rows 2 and 0 for the
    others: norms ``.4`` and ``sqrt(.3^2 + .1^2)``."""
    emb = nn.Embedding(3, 1, dtype=F64)
    ids = torch.tensor([[1, 1], [2, 0], [2, 0]])
    backprops = torch.tensor([[[0.2], [0.2]], [[0.3], [0.1]], [[0.3], [0.1]]], dtype=F64)
    tracker = GradSampleTracker(emb, loss_reduction="sum")
    (emb(ids) * backprops).sum().backward()
    _, _, norms = tracker.clipped_sum(float("inf"))
    tracker.detach()
    expected = torch.tensor([0.4, math.hypot(0.3, 0.1), math.hypot(0.3, 0.1)], dtype=F64)
    torch.testing.assert_close(norms, expected, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize("c,groups", [(8, 1), (8, 4), (8, 8), (3, 3), (1, 1)])
def test_group_norm(c, groups):
    """Opacus's ``GroupNorm_test``: num_groups 1, 4 or C."""
    _seeded(c * 10 + groups)
    norm = nn.GroupNorm(groups, c, dtype=F64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, c, 5, 4, dtype=F64)
    check(norm, (x,), split(x), opacus=True)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_instance_norm(nd):
    """Opacus's ``InstanceNorm1d/2d/3d_test``: affine, no running statistics."""
    _seeded(nd)
    cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[nd]
    norm = cls(3, affine=True, dtype=F64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(4, 3, *{1: (7,), 2: (5, 4), 3: (2, 5, 4)}[nd], dtype=F64)
    check(norm, (x,), split(x), opacus=True)


#: (normalized_shape, input shape): Opacus's LayerNorm / RMSNorm grid
NORM_SHAPES = [(5, (3, 5)), (5, (3, 2, 5)), (5, (3, 2, 3, 5)), ((2, 5), (3, 2, 5)),
               ((3, 5), (3, 2, 3, 5)), ((2, 3, 5), (3, 2, 3, 5))]


@pytest.mark.parametrize("cls", [nn.LayerNorm, nn.RMSNorm])
@pytest.mark.parametrize("shape,x_shape", NORM_SHAPES)
def test_layer_and_rms_norm(cls, shape, x_shape):
    """Opacus's ``LayerNorm_test`` and ``RMSNorm_test``: normalized_shape of 1-3
    dimensions on inputs of rank 2-4."""
    _seeded(len(x_shape))
    norm = cls(shape, dtype=F64)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    x = torch.randn(x_shape, dtype=F64)
    check(norm, (x,), split(x), opacus=True)


# --------------------------------------------------------------------------- empty batches


def _empty_cases():
    cases = [("Linear", nn.Linear(3, 4), (0, 3)), ("Linear seq", nn.Linear(3, 4), (0, 2, 3)),
             ("Conv1d", nn.Conv1d(2, 3, 2), (0, 2, 5)),
             ("Conv2d", nn.Conv2d(2, 3, 2), (0, 2, 5, 5)),
             ("Conv3d", nn.Conv3d(2, 3, 2), (0, 2, 3, 5, 5)),
             ("GroupNorm", nn.GroupNorm(2, 4), (0, 4, 3, 3)),
             ("LayerNorm", nn.LayerNorm(3), (0, 2, 3)), ("RMSNorm", nn.RMSNorm(3), (0, 2, 3)),
             ("InstanceNorm1d", nn.InstanceNorm1d(4, affine=True), (0, 4, 5)),
             ("InstanceNorm2d", nn.InstanceNorm2d(4, affine=True), (0, 4, 3, 3)),
             ("InstanceNorm3d", nn.InstanceNorm3d(4, affine=True), (0, 4, 2, 3, 3))]
    return [pytest.param(m, s, id=n) for n, m, s in cases]


@pytest.mark.parametrize("module,shape", _empty_cases())
def test_empty_batch(module, shape):
    """Opacus runs every family on empty batches (a Poisson batch can be empty): nothing
    to clip, no error, nothing left recorded."""
    tracker = GradSampleTracker(module, loss_reduction="sum")
    loss_of(module(torch.randn(shape))).backward()
    sums, batch, norms = tracker.clipped_sum(1.0)
    tracker.detach()
    assert batch == 0 and norms is None and sums == {}
    assert tracker.records == {}


def test_empty_batch_embedding_and_sequence_bias():
    layers = _opacus_layers()
    for module, x in ((nn.Embedding(5, 3), torch.randint(0, 5, (0, 4))),
                      (layers.dp_multihead_attention.SequenceBias(3, True),
                       torch.randn(0, 4, 3))):
        tracker = GradSampleTracker(module, loss_reduction="sum")
        loss_of(module(x)).backward()
        _, batch, norms = tracker.clipped_sum(1.0)
        tracker.detach()
        assert batch == 0 and norms is None


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("batch_first", [False, True])
def test_sequence_bias(batch_first):
    """Opacus's ``SequenceBias_test`` (exact rule; sequence-first included)."""
    layers = _opacus_layers()
    _seeded(batch_first)
    m = layers.dp_multihead_attention.SequenceBias(4, batch_first).double()
    x = torch.randn(3, 5, 4, dtype=F64) if batch_first else torch.randn(5, 3, 4, dtype=F64)
    dim = 0 if batch_first else 1
    check(m, (x,), split(x, dim), opacus=batch_first)


class _Attention(nn.Module):
    """Opacus's ``DPMultiheadAttentionAdapter``: (q, k, v) in, the attention output out."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, q, k, v):
        return self.attn(q, k, v)[0]


def _attention_check(attn, batch_first, opacus):
    n, t = 3, 5
    shape = (n, t, 4) if batch_first else (t, n, 4)
    q, k, v = (torch.randn(shape, dtype=F64) for _ in range(3))
    dim = 0 if batch_first else 1
    examples = [tuple(z.narrow(dim, i, 1) for z in (q, k, v)) for i in range(n)]
    # Opacus's GradSampleModule runs its attention sequence-first (as its own test does;
    # batch-first with add_bias_kv it fails inside its SequenceBias sampler)
    check(_Attention(attn), (q, k, v), examples,
          opacus=False if opacus and not batch_first else None)


#: (bias, add_bias_kv, add_zero_attn, kdim/vdim given, batch_first): every value of each
#: flag, in pairs (the full 32 are in the slow grid)
ATTENTION = [(True, True, True, True, False), (True, False, False, False, False),
             (False, True, False, True, True), (False, False, True, False, True),
             (True, True, False, False, True), (False, False, False, True, False),
             (True, False, True, True, True), (False, True, True, False, False)]


@pytest.mark.parametrize("bias,bias_kv,zero_attn,kv_dim,batch_first", ATTENTION)
def test_dp_multihead_attention(bias, bias_kv, zero_attn, kv_dim, batch_first):
    """Opacus's ``MultiHeadAttention_test`` (``DPMultiheadAttention`` as an ordinary
    module: its projections are Linear layers in the layer's own layout, its
    ``SequenceBias`` children sequence-first)."""
    layers = _opacus_layers()
    _seeded(bias * 16 + bias_kv * 8 + zero_attn * 4 + kv_dim * 2 + batch_first)
    attn = layers.DPMultiheadAttention(4, 2, bias=bias, add_bias_kv=bias_kv,
                                       add_zero_attn=zero_attn, kdim=4 if kv_dim else None,
                                       vdim=4 if kv_dim else None,
                                       batch_first=batch_first).double()
    _attention_check(attn, batch_first, opacus=True)


@pytest.mark.slow
@pytest.mark.parametrize("flags", list(itertools.product([True, False], repeat=5)))
def test_dp_multihead_attention_grid(flags):
    layers = _opacus_layers()
    bias, bias_kv, zero_attn, kv_dim, batch_first = flags
    _seeded(sum(flags))
    attn = layers.DPMultiheadAttention(4, 2, bias=bias, add_bias_kv=bias_kv,
                                       add_zero_attn=zero_attn, kdim=4 if kv_dim else None,
                                       vdim=4 if kv_dim else None,
                                       batch_first=batch_first).double()
    _attention_check(attn, batch_first, opacus=True)


@pytest.mark.parametrize("bias_kv,zero_attn", [(True, False), (False, True), (True, True)])
def test_torch_multihead_attention_bias_kv_zero_attn(bias_kv, zero_attn):
    """PyTorch's own attention with the two options Opacus's layer adds."""
    _seeded(bias_kv * 2 + zero_attn)
    attn = nn.MultiheadAttention(4, 2, add_bias_kv=bias_kv, add_zero_attn=zero_attn,
                                 dtype=F64)
    _attention_check(attn, False, opacus=False)


# --------------------------------------------------------------------------- recurrent


class _Recurrent(nn.Module):
    """A recurrent layer's output sequence and final states (every output reaches the
    loss); optional initial state."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, *state):
        hx = None
        if state:
            hx = tuple(state) if len(state) == 2 else state[0]
        out, h = self.rnn(x, hx)
        return out, h


def _recurrent_classes():
    layers = pytest.importorskip("opacus.layers")
    return {"DPLSTM": layers.DPLSTM, "DPGRU": layers.DPGRU, "DPRNN": layers.DPRNN,
            "LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}


#: (layers, bias, batch_first, bidirectional, input: "tensor" | "packed" | "sorted"):
#: Opacus's ``RNN_test`` grid, every value of each axis, the input kinds with every layout
RECURRENT = [(1, True, False, False, "tensor"), (2, False, True, True, "tensor"),
             (2, True, False, True, "packed"), (1, True, True, False, "sorted"),
             (2, True, True, True, "packed"), (1, False, False, True, "sorted")]


def _recurrent_inputs(kind, batch_first, n=4, t=3, d=4, with_state=None):
    """Batched inputs and per-example inputs of a recurrent layer."""
    if kind == "tensor":
        x = torch.randn((n, t, d) if batch_first else (t, n, d), dtype=F64)
        dim = 0 if batch_first else 1
        inputs, examples = [x], [[x.narrow(dim, i, 1)] for i in range(n)]
    else:
        lengths = torch.tensor([3, 1, 2, 3][:n])
        if kind == "sorted":
            lengths = lengths.sort(descending=True).values
        seqs = [torch.randn(int(k), d, dtype=F64) for k in lengths]
        inputs = [pack_sequence(seqs, enforce_sorted=kind == "sorted")]
        examples = [[pack_sequence([s])] for s in seqs]
    if with_state is not None:
        for h in with_state:
            inputs.append(h)
            for i, ex in enumerate(examples):
                ex.append(h[:, i:i + 1])
    return tuple(inputs), [tuple(ex) for ex in examples]


@pytest.mark.parametrize("name", ["DPLSTM", "DPGRU", "DPRNN", "LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("layers,bias,batch_first,bidir,kind", RECURRENT)
def test_recurrent(name, layers, bias, batch_first, bidir, kind):
    """Opacus's ``RNN_test`` for its ``DPRNN`` / ``DPGRU`` / ``DPLSTM`` (as ordinary
    modules) and for PyTorch's own layers: output sequence and final states, tensors or
    packed sequences (sorted or not). Opacus's layers: against Opacus's per-sample
    gradients of its adapter (the output sequence) too."""
    cls = _recurrent_classes()[name]
    _seeded(layers * 8 + bias * 4 + batch_first * 2 + bidir)
    rnn = cls(4, 5, num_layers=layers, bias=bias, batch_first=batch_first,
              bidirectional=bidir).double()
    inputs, examples = _recurrent_inputs(kind, batch_first)
    check(_Recurrent(rnn), inputs, examples)
    if name.startswith("DP"):
        _opacus()
        ref = naive(_OutputOnly(rnn), examples)
        theirs = opacus_per_sample(_OutputOnly(rnn), inputs, batch_first)
        if kind == "packed":  # Opacus returns them in the packed (length-sorted) order
            ref = ref[inputs[0].sorted_indices]
        torch.testing.assert_close(theirs, ref, rtol=1e-7,
                                   atol=1e-7 * (ref.abs().max().item() + 1))


@pytest.mark.parametrize("name", ["DPLSTM", "DPGRU", "DPRNN"])
@pytest.mark.parametrize("kind", ["tensor", "packed"])
def test_opacus_recurrent_with_initial_state(name, kind):
    """``state_init`` (``(h0, c0)`` for DPLSTM) travels with the examples."""
    cls = _recurrent_classes()[name]
    _seeded(3)
    rnn = cls(4, 5, num_layers=2, bidirectional=True).double()
    h0 = torch.randn(4, 4, 5, dtype=F64)
    state = (h0, torch.randn_like(h0)) if name == "DPLSTM" else (h0,)
    inputs, examples = _recurrent_inputs(kind, False, with_state=state)
    check(_Recurrent(rnn), inputs, examples)


def test_opacus_recurrent_matches_torch_forward():
    """What the rule assumes (module docstring of privlearn.torch.rules.opacus): Opacus's
    layers compute PyTorch's recurrence, outputs and final states, for every layout,
    direction, depth, packing and nonlinearity."""
    layers = _opacus_layers()
    pairs = [(nn.LSTM, layers.DPLSTM, {}), (nn.GRU, layers.DPGRU, {}),
             (nn.RNN, layers.DPRNN, {}), (nn.RNN, layers.DPRNN, {"nonlinearity": "relu"})]
    _seeded(0)
    for (ref_cls, dp_cls, kw), depth, bidir, bf, kind in itertools.product(
            pairs, (1, 2), (False, True), (False, True), ("tensor", "packed", "sorted")):
        dp = dp_cls(4, 5, num_layers=depth, bidirectional=bidir, batch_first=bf, **kw).double()
        ref = ref_cls(4, 5, num_layers=depth, bidirectional=bidir, batch_first=bf,
                      **kw).double()
        ref.load_state_dict(dp.state_dict())
        (x,), _ = _recurrent_inputs(kind, bf)
        for a, b in zip(_floats(dp(x)), _floats(ref(x)), strict=True):
            # (Opacus builds the final states of packed sequences in the default dtype)
            tol = 1e-12 if a.dtype == F64 else 1e-6
            torch.testing.assert_close(a.to(F64), b, rtol=tol, atol=tol)


class _Packs(nn.Module):
    """Pads in, packs inside (lengths travel with the examples), pads out."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["DPLSTM", "DPGRU", "DPRNN", "LSTM", "GRU", "RNN"]),
       n=st.integers(1, 3), t=st.integers(1, 3), layers=st.sampled_from([1, 2]),
       bias=st.booleans(), bidir=st.booleans(), data=st.data())
def test_recurrent_grid(name, n, t, layers, bias, bidir, data):
    """Opacus's full ``RNN_test`` grid, packing inside the model."""
    cls = _recurrent_classes()[name]
    rnn = cls(4, 5, num_layers=layers, bias=bias, batch_first=True,
              bidirectional=bidir).double()
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, t), min_size=n, max_size=n)))
    x = torch.randn(n, t, 4, dtype=F64)
    check(_Packs(rnn), (x, lengths), [(x[i:i + 1], lengths[i:i + 1]) for i in range(n)])


def test_opacus_recurrent_dropout_is_refused():
    """Opacus applies dropout inside the recurrence, at every step of every layer: the
    validator lists it and the rule refuses it (nothing silently wrong)."""
    layers = _opacus_layers()
    rnn = layers.DPLSTM(3, 4, num_layers=2, dropout=0.5).double()
    with pytest.raises(UnsupportedModuleError, match="DPLSTM.*dropout > 0"):
        check_model(nn.Sequential(rnn))
    with pytest.raises(UnsupportedModuleError, match="DPLSTM.*dropout > 0"):
        GradSampleTracker(rnn, loss_reduction="sum")
    rnn.dropout = 0.0
    tracker = GradSampleTracker(rnn, loss_reduction="sum")
    rnn.dropout = 0.5  # set after the tracker checked the model: the rule refuses it
    loss_of(rnn(torch.randn(3, 2, 3, dtype=F64))).backward()
    with pytest.raises(ValueError, match="DPLSTM with dropout > 0"):
        tracker.contributions()
    tracker.detach()


def test_opacus_recurrent_custom_cell_is_refused(monkeypatch):
    """A DPRNNBase with a cell of its own: refused up front and at the step (its
    weights are registered twice; before, they were counted twice)."""
    layers = _opacus_layers()
    from opacus.layers.dp_rnn import DPLSTMCell, DPRNNBase

    class MyCell(DPLSTMCell):
        pass

    rnn = DPRNNBase(MyCell, 3, 4).double()
    with pytest.raises(UnsupportedModuleError, match="cells other than Opacus's"):
        check_model(rnn)
    with pytest.raises(UnsupportedModuleError, match="cells other than Opacus's"):
        GradSampleTracker(rnn, loss_reduction="sum")
    # the rule's own refusal, behind the validator's
    monkeypatch.setattr("privlearn.torch.validator.check_model", lambda model: None)
    tracker = GradSampleTracker(rnn, loss_reduction="sum")
    loss_of(rnn(torch.randn(2, 3, 3, dtype=F64))).backward()
    with pytest.raises(ValueError, match="cells other than Opacus's"):
        tracker.contributions()
    tracker.detach()
    assert layers  # the import above needs the package


class _Aliasing(nn.Module):
    """Registers its child's weight a second time under another name (as Opacus's
    RenameParamsMixin does)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=F64)
        self.scale = nn.Parameter(torch.ones(2, dtype=F64))
        self.register_parameter("alias", self.lin.weight)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_aliased_parameters_are_refused(monkeypatch):
    """A parameter registered by a module and by its child would get two rules (the
    generic one of the module and the child's): refused by the validator (so by the
    tracker) and at the step instead of counted twice."""
    model = _Aliasing()
    with pytest.raises(UnsupportedModuleError, match=r"alias = lin\.weight"):
        check_model(model)
    with pytest.raises(UnsupportedModuleError, match=r"alias = lin\.weight"):
        GradSampleTracker(model, loss_reduction="sum")
    # the step's own refusal, behind the validator's
    monkeypatch.setattr("privlearn.torch.validator.check_model", lambda model: None)
    tracker = GradSampleTracker(model, loss_reduction="sum")
    loss_of(model(torch.randn(3, 3, dtype=F64))).backward()
    with pytest.raises(ValueError, match="counted twice"):
        tracker.clipped_sum(1.0)
    tracker.detach()


# --------------------------------------------------------------------------- cells


class _CellLoop(nn.Module):
    """A cell unrolled over time by the user (one recorded call per step)."""

    def __init__(self, cell, lstm):
        super().__init__()
        self.cell, self.lstm = cell, lstm

    def forward(self, x, *state):
        h = (tuple(state) if self.lstm else state[0]) if state else None
        outs = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            outs.append(h[0] if self.lstm else h)
        return torch.stack(outs, 1), h


def _cells():
    out = [("LSTMCell", lambda: nn.LSTMCell(3, 4, dtype=F64), True),
           ("GRUCell", lambda: nn.GRUCell(3, 4, dtype=F64), False),
           ("RNNCell", lambda: nn.RNNCell(3, 4, dtype=F64), False),
           ("RNNCell relu", lambda: nn.RNNCell(3, 4, nonlinearity="relu", dtype=F64), False)]
    return [pytest.param(make, lstm, id=name) for name, make, lstm in out]


@pytest.mark.parametrize("make,lstm", _cells())
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_cells(make, lstm, with_state):
    """PyTorch's cells in a user's loop (the cell state reaches the loss through the next
    step and the final state)."""
    _seeded(with_state)
    x = torch.randn(3, 4, 3, dtype=F64)
    state = []
    if with_state:
        state = [torch.randn(3, 4, dtype=F64) for _ in range(2 if lstm else 1)]
    examples = [(x[i:i + 1], *(s[i:i + 1] for s in state)) for i in range(3)]
    check(_CellLoop(make(), lstm), (x, *state), examples)


@pytest.mark.parametrize("cell", ["DPLSTMCell", "DPGRUCell", "DPRNNCell"])
def test_opacus_cells(cell):
    """Opacus's cells used directly (their Linear layers are the units)."""
    from opacus.layers import dp_rnn

    _seeded(1)
    x = torch.randn(3, 4, 3, dtype=F64)
    m = _CellLoop(getattr(dp_rnn, cell)(3, 4, True).double(), cell == "DPLSTMCell")
    check(m, (x,), split(x))


# --------------------------------------------------------------------------- ghost clipping


class _SampleModule(nn.Module):
    """Opacus's fast-gradient-clipping ``SampleModule``: Linear, LayerNorm, wide Linear
    layers on sequences."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 2)
        self.fc3 = nn.Linear(2, 1024)
        self.fc4 = nn.Linear(1024, 10)
        self.fc5 = nn.Linear(10, 1)
        self.layer_norm = nn.LayerNorm(2)

    def forward(self, x):
        x = self.layer_norm(torch.relu(self.fc1(x)))
        return self.fc5(self.fc4(self.fc3(x))).flatten(start_dim=1)


class _SampleConvNet(nn.Module):
    """Opacus's ``SampleConvNet``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2, 1)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2, 1)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _ghost_cases():
    return [pytest.param(_SampleModule, (10, 5, 2), id="SampleModule"),
            pytest.param(_SampleConvNet, (6, 3, 28, 28), id="SampleConvNet"),
            pytest.param(lambda: nn.Embedding(7, 4), None, id="Embedding")]


@pytest.mark.parametrize("make,shape", _ghost_cases())
def test_ghost_norms_against_opacus_fast_gradient_clipping(make, shape):
    """Opacus's fast-gradient-clipping tests: per-example gradient norms (ghost) against
    Opacus's ``GradSampleModuleFastGradientClipping`` and against the naive loop; mean
    cross-entropy as there."""
    _seeded(0)
    model = make().double()
    if shape is None:
        x = torch.randint(0, 7, (6, 5))
        y = torch.randint(0, 4, (6,))

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out.sum(1), y[: out.shape[0]] % 4,
                                               reduction="sum")
    else:
        x = torch.randn(shape, dtype=F64)
        y = torch.randint(0, 5 if make is _SampleModule else 10, (shape[0],))

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out, y[: out.shape[0]], reduction="sum")

    # the naive loop, each example with its own label
    ref = torch.stack([naive(model, [(x[i:i + 1],)], lambda out, i=i: loss_fn(out, y[i:i + 1]))[0]
                       for i in range(x.shape[0])])
    tracker = GradSampleTracker(model, loss_reduction="mean")
    (loss_fn(model(x), y) / x.shape[0]).backward()
    _, _, norms = tracker.clipped_sum(float("inf"))
    tracker.detach()
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=TOL, atol=TOL)
    _opacus()
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(copy.deepcopy(model), batch_first=True,
                                               loss_reduction="sum", max_grad_norm=1.0,
                                               use_ghost_clipping=True)
    _opacus_backward(loss_fn(gsm(x), y))
    theirs = gsm.get_norm_sample().to(F64)
    torch.testing.assert_close(theirs, ref.norm(dim=1), rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------- engine


class _Mixed(nn.Module):
    """Opacus's DP layers and the newly covered PyTorch layers in one model: a packed
    DPLSTM (lengths travel with the examples), sequence-first DPMultiheadAttention with
    ``add_bias_kv``, an LSTM cell, InstanceNorm and Conv3d."""

    def __init__(self, layers):
        super().__init__()
        self.rnn = layers.DPLSTM(3, 4, batch_first=True, bidirectional=True)
        self.attn = layers.DPMultiheadAttention(8, 2, add_bias_kv=True)
        self.cell = nn.LSTMCell(8, 4)
        self.conv = nn.Conv3d(1, 2, 2)
        self.norm = nn.InstanceNorm1d(2, affine=True)
        self.head = nn.Linear(4 + 2, 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True,
                                   total_length=x.shape[1])  # (B, T, 8)
        s = h.transpose(0, 1)
        a = self.attn(s, s, s)[0].transpose(0, 1)  # (B, T, 8)
        state = None
        for t in range(a.shape[1]):
            state = self.cell(a[:, t], state)
        v = self.conv(x.reshape(x.shape[0], 1, 2, 2, -1)).flatten(2)  # (B, 2, L)
        v = self.norm(v).mean(2)
        return self.head(torch.cat([state[0], v], 1))


def test_make_private_step_with_opacus_layers(oracle):
    """One DP-SGD step (noise 0) through make_private, batch-independence probe on: the
    update is the clipped sum of the naive per-example gradients divided by the batch."""
    layers = _opacus_layers()
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    _seeded(5)
    model = _Mixed(layers).double()
    n = 6
    x = torch.randn(n, 4, 3, dtype=F64)
    lengths = torch.tensor([4, 2, 3, 1, 4, 2])
    y = torch.randint(0, 2, (n,))
    before = copy.deepcopy(model)
    clip = 0.05

    def loss_one(i):
        return nn.functional.cross_entropy(before(x[i:i + 1], lengths[i:i + 1]), y[i:i + 1])

    total, _ = oracle.clip_and_sum(oracle.grads(loss_one, n, list(before.parameters())), clip)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    p = make_private(model, opt, DataLoader(TensorDataset(x, lengths, y), batch_size=n),
                     noise_multiplier=0.0, max_grad_norm=clip, sampling="fixed", seed=0)
    xb, lb, yb = next(iter(p.data_loader))
    order = [int(torch.nonzero((x == xi).all(2).all(1))[0]) for xi in xb]
    assert sorted(order) == list(range(n))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb, lb), yb).backward()
    p.optimizer.step()
    moved = oracle.flat(b - a for a, b in zip(model.parameters(), before.parameters(),
                                              strict=True))
    torch.testing.assert_close(moved, total / n, rtol=1e-8, atol=1e-11)
    assert p.accountant.steps == 1


# --------------------------------------------------------------------------- known gaps


class _TwoOutputs(nn.Module):
    """A layer without a rule (generic fallback) returning ``y`` and ``sin(y)``: it
    consumes its own first output to compute the second."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=F64))

    def forward(self, x):
        y = x * self.w
        return y, y.sin()


class _AfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(3, 3, dtype=F64)
        self.two = _TwoOutputs()

    def forward(self, x):
        y, z = self.two(self.pre(x))
        return y + z


def test_fallback_layer_whose_outputs_feed_each_other():
    _seeded(0)
    x = torch.randn(4, 3, dtype=F64)
    check(_AfterLinear(), (x,), split(x))


class _CumulativeScale(nn.Module):
    """A sequence-first layer without a rule: ``cumsum`` over time, then a scale."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=F64))

    def forward(self, x):  # (T, B, 4)
        return x.cumsum(0) * self.w


def test_fallback_on_a_sequence_first_layer():
    _seeded(0)
    x = torch.randn(3, 2, 4, dtype=F64)
    check(_CumulativeScale(), (x,), split(x, 1), batch_dims={"": 1})


# --------------------------------------------------------------------------- parametrizations


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def _parametrized(kind):
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    _seeded(1)
    if kind == "weight_norm linear":
        return nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(),
                             nn.Linear(4, 3)).double(), (5, 4)
    if kind == "weight_norm conv":
        return nn.Sequential(weight_norm(nn.Conv2d(2, 3, 2), dim=0), nn.Tanh()).double(), \
            (5, 2, 4, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    parametrize.register_parametrization(model[0], "weight", _Symmetric())
    return model, (5, 4)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("kind", ["weight_norm linear", "weight_norm conv", "symmetric"])
def test_parametrized_weights_against_the_naive_loop(kind):
    """``torch.nn.utils.parametrizations`` (weight_norm) and any custom parametrization:
    the trained tensors are the originals under ``module.parametrizations``. The layer's
    own rule gave the gradient of the computed weight, so the originals (``g``, ``v``)
    got none: their update was the noise alone, with nothing said. Now their per-example
    gradients are the naive loop's."""
    model, shape = _parametrized(kind)
    x = torch.randn(shape, dtype=F64)
    check(model, (x,), split(x))


def test_the_deprecated_hook_weight_norm_is_refused_naming_the_replacement():
    """``torch.nn.utils.weight_norm``/``spectral_norm`` (forward pre-hooks computing the
    weight outside the layer) are refused before anything, naming the parametrization
    that works."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for legacy in (nn.utils.weight_norm, nn.utils.spectral_norm):
            model = nn.Sequential(legacy(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3))
            with pytest.raises(UnsupportedModuleError,
                               match=rf"parametrizations\.{legacy.__name__} instead"):
                check_model(model)


def test_spectral_norm_trains_its_power_iteration_buffers_are_no_release():
    """spectral_norm's power iteration writes its ``_u``/``_v`` buffers at every forward,
    from the weights alone: the probe's check of buffers written from the data accepts
    them, and the run trains its originals."""
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    _seeded(2)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 6)),
                          nn.Tanh(), nn.Linear(6, 3))
    orig = model[0].parametrizations.weight.original
    before = orig.detach().clone()
    ds = TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(ds, batch_size=8), noise_multiplier=0.0, seed=0)
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    assert p.accountant.steps == 4 and not torch.equal(before, orig)
