"""Ghost layers' last per-layer reductions formed for many layers at once
(``_ghost_pending``): the row sums and roots of the Gram products of layers of one shape,
by one reduction and one square root a group during backward, bitwise each layer's own;
the clipped sum is still the batch-of-one definition's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from cuda_dispatch import OpCounter  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import _ghost_pending, make_private  # noqa: E402
from privlearn.torch import grad_sample as _gs  # noqa: E402
from privlearn.torch._ghost_norms import ghost_parts  # noqa: E402


@pytest.mark.parametrize("t", [7, 144])  # one-stage rows; two stages (k = 12)
def test_pending_parts_are_each_layer_alone_once_flushed(t, monkeypatch):
    """Five layers of one shape, at most two a buffer: NaN until their group is flushed
    (a full buffer at once, the rest by ``flush``), then bitwise each layer's own parts;
    one product, and per group one row reduction and one square root."""
    monkeypatch.setattr(_ghost_pending, "MAX_LAYERS", 2)
    gen = torch.Generator().manual_seed(t)
    xs = [
        (torch.randn(3, t, 16, generator=gen), torch.randn(3, t, 10, generator=gen))
        for _ in range(5)
    ]
    alone = [ghost_parts(a, g, torch.bmm) for a, g in xs]
    pending = _ghost_pending.PendingProducts()
    token = _ghost_pending.PENDING.set(pending)
    try:
        ops = OpCounter()
        with ops:
            held = [ghost_parts(a, g, torch.bmm, defer=True) for a, g in xs]
        not_deferred = ghost_parts(*xs[0], torch.bmm)  # (defer=False: its own)
    finally:
        _ghost_pending.PENDING.reset(token)
    # each output gradients' Gram matrix formed in its group's buffer, multiplied by the
    # input's with the group's other layers' (one operation a group): two full groups of two
    assert ops.ops["mul"] == 0 and ops.ops["_foreach_mul_"] == 2 and ops.ops["sqrt"] == 2
    assert torch.isnan(held[4].rows).all() and torch.isnan(held[4].roots).all()
    assert torch.equal(not_deferred.rows, alone[0].rows)
    ops = OpCounter()
    with ops:
        pending.flush()
    assert ops.ops["sqrt"] == 1 and ops.ops["_foreach_mul_"] == 1
    for h, o in zip(held, alone, strict=True):
        assert torch.equal(h.rows, o.rows) and torch.equal(h.roots, o.roots)
        assert h.k == o.k and h.alpha == o.alpha


@pytest.mark.parametrize("low", [False, True], ids=["float32", "bf16_to_float32"])
def test_pending_sums_are_each_layer_alone_once_flushed(low, monkeypatch):
    """Output gradients of five layers of one shape, at most two a buffer: their sums over
    positions (float32 sums of bfloat16 ones with ``low``) NaN until their group is
    flushed, then each layer's own sum."""
    monkeypatch.setattr(_ghost_pending, "MAX_LAYERS", 2)
    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if low else torch.float32
    gs = [torch.randn(3, 9, 7, generator=gen).to(dtype) for _ in range(5)]
    wide = torch.float32 if low else None
    pending = _ghost_pending.PendingProducts()
    ops = OpCounter()
    with ops:
        held = [pending.take_sum(g, wide) for g in gs]
    assert ops.ops["sum"] == 2 and ops.ops["stack"] == 2  # two full groups
    assert torch.isnan(held[4]).all()
    pending.flush()
    for h, g in zip(held, gs, strict=True):
        assert h.dtype == torch.float32
        torch.testing.assert_close(h, g.sum(1, dtype=wide), rtol=1e-6, atol=1e-6)


def _model():
    torch.manual_seed(8)
    return nn.Sequential(*(nn.Linear(10, 10) for _ in range(5)))


def _steady_backward(model, x, y, c):
    """Three noise-free private steps on all of ``(x, y)`` (loss ``(out * y).sum()``):
    the operations of the last backward pass and the last batch."""
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        DataLoader(TensorDataset(x, y), batch_size=x.shape[0]),
        noise_multiplier=0.0,
        max_grad_norm=c,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )
    for _ in range(3):
        xb, yb = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        loss = (p.model(xb) * yb).sum()
        ops = OpCounter()
        with ops:
            loss.backward()
        p.optimizer.step()
    return ops, xb, yb


def test_backward_reduces_the_ghost_products_of_one_shape_together(oracle, monkeypatch):
    """Five ghost layers of one shape: the steady backward pass takes one square root
    (five before: one a layer), sums the biases' output gradients over positions by one
    stacked sum (one a layer before) and the clipped sum (noise-free, some examples clipped,
    some not) is the float64 batch-of-one definition's."""
    monkeypatch.setattr(_gs, "GHOST_MEMORY_BUDGET_BYTES", 0)
    n, t = 6, 4
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, t, 10, generator=gen) * torch.linspace(0.05, 2.0, n)[:, None, None]
    y = torch.randn(n, t, 10, generator=gen)
    model, ref = _model(), _model()
    ops, xb, yb = _steady_backward(model, x, y, 12.0)
    assert ops.ops["bmm"] == 10 and ops.ops["sqrt"] == 1
    # the products' row sums, the five biases' sums over positions (one stacked sum;
    # five before) and the finished norms
    assert ops.ops["sum"] == 3
    want, norms = oracle.clipped_sum(ref, xb, yb, 12.0, loss_fn=lambda o, v: (o * v).sum())
    assert (norms > 12.0).any() and (norms < 12.0).any()
    got = oracle.flat(q.grad for q in model.parameters()) * n
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _ln_model():
    torch.manual_seed(10)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(10, 10), nn.LayerNorm(10)]
    return nn.Sequential(*layers)


def test_layernorms_sum_over_positions_together(oracle, monkeypatch):
    """Three LayerNorms evaluated during backward: their weights' and biases' sums over
    positions by one stacked sum with the Linear biases' of their shape (two a LayerNorm
    before), and the
    clipped sum (noise-free, some examples clipped, some not) is the float64 batch-of-one
    definition's."""
    monkeypatch.setattr(_gs, "GHOST_MEMORY_BUDGET_BYTES", 0)
    n, t = 6, 4
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(n, t, 10, generator=gen) * torch.linspace(0.05, 2.0, n)[:, None, None]
    y = torch.randn(n, t, 10, generator=gen)
    model, ref = _ln_model(), _ln_model()
    with torch.no_grad():
        for m in model[1::2]:  # the LayerNorms
            m.weight.add_(0.3 * torch.randn(10, generator=gen))
        ref.load_state_dict(model.state_dict())
    ops, xb, yb = _steady_backward(model, x, y, _LN_C)
    # the products' row sums; the sums over positions of the three Linear biases' and the
    # LayerNorms' biases' rows, all of one shape, by one stacked sum (seven sums before:
    # the Linear biases' one and two a LayerNorm); the LayerNorms' weights' rows by one
    # stacked normalisation, product and sum; the finished ghost norms
    assert ops.ops["sum"] == 4
    assert ops.ops["native_layer_norm"] == 1
    want, norms = oracle.clipped_sum(ref, xb, yb, _LN_C, loss_fn=lambda o, v: (o * v).sum())
    assert (norms > _LN_C).any() and (norms < _LN_C).any()
    got = oracle.flat(q.grad for q in model.parameters()) * n
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


_LN_C = 60.0


class _TinyRMSNorm(nn.Module):
    """A Llama-style RMSNorm (the class-name rule's shape)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


def test_rmsnorm_rule_first_checked_while_sums_are_held():
    """The RMSNorm rule's sums over positions are held with other layers' during backward;
    its first call on a module (checked against the generic fallback on rows formed at
    once) agrees (no fallback, no warning), and the held rows, once flushed, are the
    sums."""
    import warnings

    from privlearn.torch.grad_sample import Record
    from privlearn.torch.rules import transformers

    gen = torch.Generator().manual_seed(13)
    m = _TinyRMSNorm(8)
    x, g = torch.randn(4, 5, 8, generator=gen), torch.randn(4, 5, 8, generator=gen)
    rec = Record(
        args=(x,), kwargs={}, grad_outputs=[g], outputs_meta=[(tuple(g.shape), g.dtype, g.device)]
    )
    pending = _ghost_pending.PendingProducts()
    token = _ghost_pending.PENDING.set(pending)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c = transformers.rmsnorm_rule(m, rec, [m.weight])
    finally:
        _ghost_pending.PENDING.reset(token)
    assert transformers._RULE_STATE.get(m) == "ok"
    # the check's rows formed at once (a NaN held for it would compare as agreeing), the
    # rule's own held until the flush
    assert sum(grp.used for grp in pending._groups.values()) == 1
    assert torch.isnan(c.grads[0]).all()
    pending.flush()
    xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(c.grads[0], (g * xhat).sum(1))


def test_norm_sums_bitwise_each_layer_alone(monkeypatch):
    """Held LayerNorm weight rows (two a buffer, five layers): NaN until flushed, then
    bitwise ``(g * layer_norm(x)).sum(1)`` of each layer alone."""
    import functools

    import torch.nn.functional as F

    monkeypatch.setattr(_ghost_pending, "MAX_LAYERS", 2)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, 5, 8, generator=gen) * (i + 1) for i in range(5)]
    gs = [torch.randn(3, 5, 8, generator=gen) for _ in range(5)]
    norm = functools.partial(F.layer_norm, normalized_shape=(8,), eps=1e-5)
    pending = _ghost_pending.PendingProducts()
    key = ("layer_norm", (8,), 1e-5)
    held = [pending.take_norm_sum(x, g, norm, key) for x, g in zip(xs, gs, strict=True)]
    assert torch.isnan(held[4]).all()
    pending.flush()
    for x, g, h in zip(xs, gs, held, strict=True):
        assert torch.equal(h, (g * F.layer_norm(x, (8,), None, None, 1e-5)).sum(1))


@pytest.mark.parametrize("t", [7, 144])  # one-stage rows; two stages
def test_ghost_norms_of_several_widths_finished_by_one_stacked_sum(t):
    """Ghost parts of three widths (three ``alpha``) and one ``(N, T)``: their rows and
    roots summed by one stacked sum for all of them, each width's bound by its own
    ``addcmul``; every norm equal to a float64 ``sum |aa * gg| + alpha root^2`` (its bound
    on top) up to float32 rounding, and the groups of two or more bitwise the per-width
    finish."""
    from privlearn.torch._ghost_norms import finish_parts
    from privlearn.torch._row_norms import ghost_sq_blocks

    gen = torch.Generator().manual_seed(5)
    parts, ref = [], []
    for d, p in [(6, 4), (6, 4), (9, 5), (3, 8), (3, 8), (3, 8)]:
        a = torch.randn(3, t, d, generator=gen)
        g = torch.randn(3, t, p, generator=gen)
        parts.append(ghost_parts(a, g))
        aa, gg = a.double() @ a.double().transpose(1, 2), g.double() @ g.double().transpose(1, 2)
        root = (aa.diagonal(dim1=1, dim2=2) * gg.diagonal(dim1=1, dim2=2)).sqrt().sum(-1)
        ref.append((aa * gg).sum((1, 2)) + parts[-1].alpha * root * root)
    ops = OpCounter()
    with ops:
        blocks = ghost_sq_blocks(parts)
    assert ops.ops["stack"] == 1 and ops.ops["addcmul"] == 3
    got = torch.cat([b.reshape(-1, 3) for b in blocks])
    torch.testing.assert_close(got.double(), torch.stack(ref), rtol=1e-5, atol=0)
    assert torch.equal(blocks[0], finish_parts(parts[:2]))
    assert torch.equal(blocks[2], finish_parts(parts[3:]))


def test_pending_half_precision_grams_are_each_layer_alone_once_flushed(monkeypatch):
    """bfloat16 operands (float32 Gram matrices by ``mm32``): the output gradients' Gram
    matrix formed in the group's buffer and multiplied when it flushes, bitwise each
    layer's own parts."""
    from privlearn.torch._rows import mm32

    monkeypatch.setattr(_ghost_pending, "MAX_LAYERS", 2)
    gen = torch.Generator().manual_seed(9)
    xs = [
        (torch.randn(3, 7, 16, generator=gen).bfloat16(),
         torch.randn(3, 7, 10, generator=gen).bfloat16())
        for _ in range(3)
    ]
    alone = [ghost_parts(a, g, mm32) for a, g in xs]
    pending = _ghost_pending.PendingProducts()
    token = _ghost_pending.PENDING.set(pending)
    try:
        ops = OpCounter()
        with ops:
            held = [ghost_parts(a, g, mm32, defer=True) for a, g in xs]
    finally:
        _ghost_pending.PENDING.reset(token)
    assert ops.ops["mul"] == 0 and ops.ops["_foreach_mul_"] == 1
    pending.flush()
    for h, o in zip(held, alone, strict=True):
        assert h.rows.dtype == torch.float32
        assert torch.equal(h.rows, o.rows) and torch.equal(h.roots, o.roots)
