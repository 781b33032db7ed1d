"""The grouped clipped sum of held per-example gradients into narrower (bfloat16) buffers:
each buffer receives the float64 sum rounded once, whatever the grouping, the runs of
adjacent parameters, the non-finite rows of a dropped example and the tied parameters."""

from __future__ import annotations

import pytest
import torch

from privlearn.torch import _grouped
from privlearn.torch import grad_sample as gs
from privlearn.torch._grouped import accumulate_all
from privlearn.torch.grad_sample import Materialized


def _setup(seed: int, shapes, b: int = 5):
    """Parameters of ``shapes`` (bfloat16) viewing one flat buffer in that order, held
    float32 per-example gradients, and buffers prefilled to nearly cancel the sums (a
    second rounding would show)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    grads = [torch.randn(b, *s, generator=g) for s in shapes]
    c = torch.rand(b, generator=g)
    refs = [torch.einsum("b,b...->...", c.double(), x.double()) for x in grads]
    flat = torch.empty(sum(r.numel() for r in refs), dtype=torch.bfloat16)
    out, at = {}, 0
    for p, r in zip(params, refs, strict=True):
        v = flat[at:at + r.numel()].view(r.shape)
        v.copy_(-r * 0.999)
        out[id(p)] = v
        at += r.numel()
    want = [out[id(p)].double() + r for p, r in zip(params, refs, strict=True)]
    return params, grads, c, refs, out, want


def _check_rounded_once(out, params, want, grads, c):
    for p, w, x in zip(params, want, grads, strict=True):
        o = out[id(p)]
        assert o.dtype == torch.bfloat16
        err = (o.double() - w).abs()
        # half a bfloat16 ulp of the result (one rounding), plus the float32 sum's own
        # error (relative to the sum of the terms' magnitudes)
        mag = torch.einsum("b,b...->...", c.double(), torch.nan_to_num(x, 0.0, 0.0, 0.0)
                           .double().abs())
        assert (err <= w.abs() * 2.0 ** -8 + mag * 1e-6).all(), (err / mag).max()


@pytest.mark.parametrize("order", ["adjacent", "interleaved"])
def test_grouped_sum_is_the_float64_sum_rounded_once(order):
    """LayerNorm-like contributions (weight and bias, held float32 rows): one product for
    all, added per run of adjacent parameters; with ``interleaved`` every other parameter
    belongs to a contribution whose sum is formed on its own, so the runs are broken."""
    shapes = [(7,), (7,), (3, 4), (5,), (6,), (2, 3), (8,)]
    params, grads, c, refs, out, want = _setup(0 if order == "adjacent" else 1, shapes)
    if order == "adjacent":
        contribs = [Materialized(params[i:i + 2], grads[i:i + 2]) for i in range(0, 6, 2)]
        contribs.append(Materialized(params[6:], grads[6:]))
    else:
        contribs = [Materialized([p], [x]) for p, x in zip(params, grads, strict=True)]
    for k in contribs:
        k.sq_norms()
    with gs.rows_finite(True):
        accumulate_all(contribs, c, out)
    _check_rounded_once(out, params, want, grads, c)


def test_grouped_sum_drops_the_nonfinite_rows_of_a_zero_weight():
    """An example of weight 0 whose held rows are inf and NaN adds exactly nothing."""
    shapes = [(6,), (6,), (4,), (4,), (5,)]
    params, grads, c, refs, out, want = _setup(2, shapes)
    c[1] = 0.0
    for x in grads:
        x[1] = float("inf")
        x[1, 0] = float("nan")
    refs = [torch.einsum("b,b...->...", c.double(), torch.nan_to_num(x, 0.0, 0.0, 0.0)
                         .double()) for x in grads]
    want = [out[id(p)].double() + r for p, r in zip(params, refs, strict=True)]
    contribs = [Materialized([p], [x]) for p, x in zip(params, grads, strict=True)]
    with gs.rows_finite(False):
        accumulate_all(contribs, c, out)
    for p in params:
        assert torch.isfinite(out[id(p)]).all()
    _check_rounded_once(out, params, want, grads, c)


def test_float32_rows_cleaned_as_one_group_when_an_example_is_masked():
    """Into float32 buffers, while the rows must be cleaned (an example of weight 0
    whose rows are inf and NaN), the held rows are concatenated, cleaned once and
    multiplied once instead of one cleaned copy and one product a parameter: the sums
    are those without the example, and the held rows themselves are left as they were."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(4)
    shapes = [(6,), (6,), (4,), (4,), (5,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    grads = [torch.randn(5, *s, generator=g) for s in shapes]
    c = torch.rand(5, generator=g)
    c[1] = 0.0
    for x in grads:
        x[1] = float("inf")
        x[1, 0] = float("nan")
    held = [x.clone() for x in grads]
    flat = torch.zeros(sum(x[0].numel() for x in grads))
    out, at = {}, 0
    for p in params:
        out[id(p)] = flat[at:at + p.numel()].view(p.shape)
        at += p.numel()
    contribs = [Materialized([p], [x]) for p, x in zip(params, grads, strict=True)]
    for k in contribs:
        k.sq_norms()
    ops = Ops()
    with gs.rows_finite(False), ops:
        accumulate_all(contribs, c, out)
    assert ops.names.count("mv") + ops.names.count("addmv") + ops.names.count("addmv_") == 1
    assert ops.names.count("nan_to_num") + ops.names.count("nan_to_num_") == 1
    keep = torch.arange(5) != 1
    for p, x, h in zip(params, grads, held, strict=True):
        torch.testing.assert_close(x, h, equal_nan=True)  # not cleaned in place
        want = torch.einsum("b,b...->...", c[keep].double(), x[keep].double())
        torch.testing.assert_close(out[id(p)].double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("budget", [None, 5 * 5 * 4])
def test_tied_parameters_and_large_rows_keep_their_own_sums(monkeypatch, budget):
    """A parameter with two contributions is summed by each in turn (its order of
    additions kept), rows over the byte budget (``budget``: the (5, 64) ones) by their own
    product, the rest grouped: the same buffers as the contributions' own
    ``accumulate_into``, bit for bit (the same terms in the same order per entry)."""
    shapes = [(64,), (6,), (4,), (4,), (5,), (3,), (2,), (6,)]
    params, grads, c, _, out, _ = _setup(3, shapes)
    extra = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))

    class Own(Materialized):  # a rule that forms its own sum (e.g. a ghost layer)
        def mv_rows(self):
            return None

    contribs = [Materialized([p], [x]) for p, x in zip(params, grads, strict=True)]
    contribs.insert(1, Own([params[0]], [extra]))  # tied with the first
    ref = {k: v.clone() for k, v in out.items()}
    with gs.rows_finite(True):
        for k in contribs:
            k.accumulate_into(c, [ref[id(p)] for p in k.params])
    if budget is not None:
        monkeypatch.setattr(_grouped, "GROUP_BYTES", budget)
    with gs.rows_finite(True):
        accumulate_all(contribs, c, out)
    for p in params:
        assert torch.equal(out[id(p)], ref[id(p)])


@pytest.mark.parametrize("low", [False, True], ids=["float32_products", "half_products"])
def test_a_wrapped_rule_defers_its_products_with_its_own_weights(monkeypatch, low):
    """Ghost layers whose bias sum is formed from held rows, wrapped per privacy unit
    (their weights per row, made from the per-unit ones): grouped with those weights,
    the buffers bit for bit what each rule's own ``accumulate_into`` gives."""
    from privlearn.torch.grad_sample import OuterProduct
    from privlearn.torch.units import Grouped, RowUnits

    monkeypatch.setattr(gs, "LOW_PRECISION_MATMUL", "always" if low else "never")
    g = torch.Generator().manual_seed(4)
    units = RowUnits.from_sizes([2, 1, 3])
    c = torch.rand(3, generator=g)
    rules, flat = [], []
    for _ in range(4):  # p > d: the bias sum comes from the held per-example rows
        a = torch.randn(6, 1, 3, 2, generator=g).to(torch.bfloat16)
        o = torch.randn(6, 1, 3, 5, generator=g).to(torch.bfloat16)
        w = torch.nn.Parameter(torch.zeros(5, 2, dtype=torch.bfloat16))
        b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
        rule = Grouped(OuterProduct(w, b, a, o, ghost=True), units)
        rule.inner.sq_norms()
        rules.append(rule)
        flat += [w, b]
    buf = torch.randn(sum(q.numel() for q in flat), generator=g).to(torch.bfloat16)
    out, at = {}, 0
    for q in flat:
        out[id(q)] = buf[at:at + q.numel()].view(q.shape)
        at += q.numel()
    ref = {k: v.clone() for k, v in out.items()}
    with gs.rows_finite(True):
        for k in rules:
            k.accumulate_into(c, [ref[id(q)] for q in k.params])
        accumulate_all(rules, c, out)
    for q in flat:
        assert torch.equal(out[id(q)], ref[id(q)])


def _ghost_layers(dtype, seed: int = 0, b: int = 6, t: int = 3):
    """Ghost-form layers of several shapes (Linear and transposed ``Conv1D`` layouts,
    with and without bias, the inputs of three read by all three as a query, key and
    value projection read theirs), their float64 per-example gradients, and weights that
    drop examples 2 and 3, whose rows hold an infinity (an input) and a NaN (an output
    gradient)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 1, t, 8, generator=g, dtype=dtype)
    x[2, 0, 1, 3] = float("inf")
    specs = [(x, 8, 4, False, True), (x, 8, 4, False, False), (x, 8, 8, True, True),
             (None, 4, 12, False, True), (None, 12, 4, True, False), (None, 5, 5, False, True),
             (None, 4, 12, True, False)]
    layers, refs = [], []
    for i, (a, d, p, transposed, bias) in enumerate(specs):
        a = torch.randn(b, 1, t, d, generator=g, dtype=dtype) if a is None else a
        go = torch.randn(b, 1, t, p, generator=g, dtype=dtype)
        if i == 4:
            go[3, 0, 2, 1] = float("nan")
        w = torch.nn.Parameter(torch.zeros((d, p) if transposed else (p, d), dtype=dtype))
        bp = torch.nn.Parameter(torch.zeros(p, dtype=dtype)) if bias else None
        layers.append(gs.OuterProduct(w, bp, a, go, ghost=True, transposed=transposed))
        g64, a64 = go[:, 0].double(), a[:, 0].double()
        per = torch.einsum("btp,btd->bpd", g64, a64)
        mag = torch.einsum("btp,btd->bpd", g64.abs(), a64.abs())  # of the terms
        if transposed:
            per, mag = per.transpose(1, 2), mag.transpose(1, 2)
        refs.append([(per, mag)] if bp is None else
                    [(per, mag), (g64.sum(1), g64.abs().sum(1))])
    c = torch.rand(b, generator=g, dtype=torch.float32) * 0.5 + 0.25
    c[2] = c[3] = 0.0
    return layers, refs, c


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_ghost_products_grouped_are_the_layers_own_and_drop_a_zero_weight(monkeypatch,
                                                                         dtype):
    """Ghost layers whose rows are cleaned (an example may be dropped by its weight)
    form their products from one scaled and cleaned copy of all their rows: each buffer
    receives exactly what the layer adds alone (the same operands, the same products),
    which is the float64 weighted sum of the examples of non-zero weight, the dropped
    examples' infinity and NaN nowhere (bfloat16: half-precision operands, float32
    accumulation, factors rounded down)."""
    monkeypatch.setattr(gs, "LOW_PRECISION_MATMUL", "always")
    sums = []
    for grouped in (True, False):
        monkeypatch.setattr(_grouped, "_MIN_PRODUCTS", 3 if grouped else 10 ** 9)
        formed = []
        real = _grouped._Products.flush

        def flush(self, real=real, formed=formed):
            formed.append(len(self.members))
            return real(self)

        monkeypatch.setattr(_grouped._Products, "flush", flush)
        layers, refs, c = _ghost_layers(dtype)
        out = {id(q): torch.zeros_like(q) for k in layers for q in k.params}
        accumulate_all(layers, c, out)
        assert formed == [len(layers)]  # one group of all, formed at once or one by one
        sums.append([out[id(q)] for k in layers for q in k.params])
    for got, alone in zip(*sums, strict=True):
        assert torch.equal(got, alone)
    keep = torch.tensor([0, 1, 4, 5])
    cw = c.double()[keep]
    if dtype == torch.bfloat16:
        cw = gs.low_factors(c, torch.bfloat16).double()[keep]
    # the error relative to the sum of the terms' magnitudes: float64 and float32
    # roundoff; bfloat16: the operands' and the factors' rounding (2^-8 each), the
    # factors' margin (2^-7) and the buffer's rounding
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2.0 ** -5}[dtype]
    for got, (r, mag) in zip(sums[0], [x for rs in refs for x in rs], strict=True):
        assert torch.isfinite(got).all()
        want = torch.einsum("b,b...->...", cw, r[keep])
        bound = tol * torch.einsum("b,b...->...", cw, mag[keep])
        assert ((got.double() - want).abs() <= bound).all()


def test_pieces_apart_in_a_float32_buffer_added_by_one_index_add():
    """Grouped parameters whose pieces of one float32 flat buffer are apart (other
    parameters' entries between them: four runs) receive their sums by one
    ``index_add_`` instead of one addition a run: each entry is its prefilled value plus
    the float32 product's entry (rounded once, bitwise what one addition a run gives),
    the entries between them are untouched, and the positions are made once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(7)
    shapes = [(6,), (3, 2), (4,), (5,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    grads = [torch.randn(5, *s, generator=g) for s in shapes]
    c = torch.rand(5, generator=g)
    flat = torch.randn(sum(p.numel() + 3 for p in params), generator=g)  # 3 apart
    before = flat.clone()
    out, at, where = {}, 0, []
    for p in params:
        out[id(p)] = flat[at + 3:at + 3 + p.numel()].view(p.shape)
        where.append(torch.arange(at + 3, at + 3 + p.numel()))
        at += 3 + p.numel()
    where = torch.cat(where)
    rows = torch.cat([x.reshape(5, -1) for x in grads], 1)
    want = before.clone()
    want[where] = before[where] + torch.mv(rows.t(), c)  # one addition a piece
    for step in range(2):
        contribs = [Materialized([p], [x]) for p, x in zip(params, grads, strict=True)]
        for k in contribs:
            k.sq_norms()
        flat.copy_(before)
        ops = Ops()
        with gs.rows_finite(False), ops:
            accumulate_all(contribs, c, out)
        assert ops.names.count("index_add_") == 1 and ops.names.count("add_") == 0
        assert ops.names.count("arange") == (len(shapes) if step == 0 else 0)
        assert torch.equal(flat, want)
        ref = torch.einsum("b,bn->n", c.double(), rows.double())
        torch.testing.assert_close(flat[where].double(), before[where].double() + ref,
                                   rtol=1e-6, atol=1e-6)


def test_pieces_apart_in_a_bfloat16_buffer_written_back_rounded_once():
    """Into a bfloat16 flat buffer, grouped parameters whose pieces are apart (five runs)
    receive the float32 product's entries by one read, one float32 addition, one rounding
    and one ``index_copy_`` instead of one addition a run: bitwise what ``add_`` of each
    float32 piece gives (the entry plus the piece in float32, rounded once), the entries
    between them untouched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(11)
    shapes = [(6,), (3, 2), (4,), (5,), (7,)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    grads = [torch.randn(5, *s, generator=g) for s in shapes]
    c = torch.rand(5, generator=g)
    flat = torch.randn(sum(p.numel() + 2 for p in params), generator=g).to(torch.bfloat16)
    before = flat.clone()
    out, at, pieces = {}, 0, []
    for p in params:
        out[id(p)] = flat[at + 2:at + 2 + p.numel()].view(p.shape)
        pieces.append((at + 2, p.numel()))
        at += 2 + p.numel()
    sums = torch.mv(torch.cat([x.reshape(5, -1) for x in grads], 1).t(), c)
    want = before.clone()  # one float32 addition a piece, as before the grouping
    for (off, n), piece in zip(pieces, sums.split([n for _, n in pieces]), strict=True):
        want[off:off + n].add_(piece)
    contribs = [Materialized([p], [x]) for p, x in zip(params, grads, strict=True)]
    for k in contribs:
        k.sq_norms()
    ops = Ops()
    with gs.rows_finite(True), ops:
        accumulate_all(contribs, c, out)
    assert ops.names.count("index_copy_") == 1 and ops.names.count("add_") == 0
    assert torch.equal(flat, want)
