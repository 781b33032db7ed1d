"""Norms of sums of rows never understate: an example that repeats a token, a privacy unit.

An embedding's per-example gradient row is the sum of the output gradients of the
positions holding that token, and a privacy unit's gradient the sum of its rows'
gradients: both are summed in the working precision before they are squared. Rows
built to cancel (``2^26 s``, a small ``r``, ``-2^26 s``) summed to 0 in float32 where the
exact sum is ``r``: the example was clipped for a norm it does not have (a unit's norm
came out 0: it entered the sum unclipped), and, the clipped rows being added one by one
after scaling, the released sum held more than the clipping bound (~6 times it, noise
off). The ground truth is the naive gradient of one example (unit) in float64.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from toys import noiseless_sum_step  # noqa: E402

from privlearn.torch import GradSampleTracker  # noqa: E402
from privlearn.torch import grad_sample as _gs  # noqa: E402
from privlearn.torch.units import RowUnits  # noqa: E402

BIG = 2.0**26  # float32's spacing there is 4 to 8: a term below 2 in size is lost


def _cancelling_rows(d=64, seed=0, eps=1.5):
    """Three rows ``(3, d)`` summing to ``(eps, r)`` exactly, ``|r_j|`` in [0.6, 3),
    whose float32 sum in order is ``(eps, 0)``."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(d, generator=gen).sign()
    r = 3.0 * s * torch.rand(d, generator=gen).add(0.2).clamp_max(1.0)
    rows = torch.stack([BIG * s, r, -BIG * s])
    rows[:, 0] = torch.tensor([0.0, 0.0, eps])
    return rows


def _embedding_batch(n_adv=3, n_ord=3, t=3, d=64, v=10, seed=0):
    """Examples ``0 .. n_adv - 1`` repeat token 7 with cancelling rows; the others are
    ordinary (random tokens and output gradients)."""
    gen = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(0, v, (n_adv + n_ord, t), generator=gen)
    y = torch.randn(n_adv + n_ord, t, d, generator=gen)
    for i in range(n_adv):
        ids[i] = 7
        y[i] = _cancelling_rows(d, seed=seed + i)
    return ids, y


def _embedding_true(ids, y, v):
    """Per-example norms of the weight gradient of ``(emb(ids_i) * y_i).sum()`` in
    float64, one example at a time."""
    out = []
    for i in range(len(ids)):
        w = torch.zeros(v, y.shape[2], dtype=torch.float64, requires_grad=True)
        (nn.functional.embedding(ids[i : i + 1], w) * y[i : i + 1].double()).sum().backward()
        out.append(w.grad.norm())
    return torch.stack(out)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embedding_with_a_repeated_token_never_understates(shared, dtype):
    """Every example's own ids, and one id row broadcast over the batch (stride 0, as
    Hugging Face's token-type ids): never below the float64 norm, ordinary examples
    over-stated by a relative 1e-4 at most."""
    v = 10
    ids, y = _embedding_batch()
    if shared:  # every example looks up 7, 7, 7
        ids = torch.full((3,), 7).expand(len(ids), 3)
    y = y.to(dtype)
    true = _embedding_true(ids, y, v)
    assert (true[:3] > 10.0).all()  # far from the 1.5 of the float32 sums
    torch.manual_seed(1)
    emb = nn.Embedding(v, 64).to(dtype)
    tracker = GradSampleTracker(emb, loss_reduction="sum")
    (emb(ids) * y).sum().backward()
    _, _, norms = tracker.clipped_sum(1.0)
    tracker.detach()
    assert (norms.double() >= true).all(), (norms, true)
    assert (norms[3:].double() <= true[3:] * (1 + 1e-4)).all()


def test_a_repeated_token_is_clipped_in_the_private_step():
    """Noise-free ``make_private`` step at ``C = 1``: the released gradient holds at most
    ``C`` per example (it held ~6 per cancelling example: clipped for a norm of 1.5, the
    scaled rows then added one by one round otherwise than their sum did)."""
    ids, y = _embedding_batch(n_adv=4, n_ord=0)
    true = _embedding_true(ids, y, 10)
    assert (true > 10.0).all()
    torch.manual_seed(1)
    emb = nn.Embedding(10, 64)
    noiseless_sum_step(emb, ids, y, 1.0)
    # noiseless_sum_step's batch is all 4 examples, the sum over the expected batch size
    got = emb.weight.grad.double().norm() * 4
    assert got <= 4 * 1.0 * (1 + 1e-3), got


class _Lin(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.lin = nn.Linear(d, p, bias=False)

    def forward(self, x):
        return self.lin(x)


def _unit_rows(units=3, d=64, p=64, seed=0):
    """Units of three rows (one position each): inputs ``e_1``, output gradients the
    cancelling rows, so each row's gradient ``g_r e_1^T`` is exact and the unit's sum
    ``(eps, r) e_1^T`` is 0 in float32 (in the order of the rows)."""
    x = torch.zeros(3 * units, 1, d)
    x[:, 0, 0] = 1.0
    y = torch.cat([_cancelling_rows(p, seed=seed + u) for u in range(units)]).unsqueeze(1)
    return x, y


def _ghost_unit_rows(units=3, d=64, p=64, seed=0):
    """Units of two rows of the same input (up to 1e-3), output gradients of opposite
    sign (up to 1e-3): Gram matrices whose float32 rounding exceeds the unit's norm."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(units, 1, d, generator=gen) * 100
    x = a.expand(units, 2, d).reshape(2 * units, 1, d) + 1e-3 * torch.randn(
        2 * units, 1, d, generator=gen
    )
    g = torch.randn(units, 1, p, generator=gen) * 100
    y = (g * torch.tensor([1.0, -1.0])[None, :, None]).reshape(2 * units, 1, p)
    return x, y + 1e-3 * torch.randn(2 * units, 1, p, generator=gen)


def _unit_true(model, x, y, sizes):
    """Per-unit norms of the gradient of ``(model(x_u) * y_u).sum()`` in float64."""
    ref = model.double()
    out, start = [], 0
    for k in sizes:
        ref.zero_grad()
        xu = x[start : start + k]
        xu = xu if not xu.is_floating_point() else xu.double()
        (ref(xu) * y[start : start + k].double()).sum().backward()
        out.append(torch.cat([q.grad.flatten() for q in ref.parameters()]).norm())
        start += k
    return torch.stack(out)


@pytest.mark.parametrize("form", ["ghost", "materialise", "embedding"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_unit_whose_rows_cancel_never_understates(form, reduction, dtype, monkeypatch):
    """User-level units: the outer-product layer in ghost form (the rows of a unit laid
    end to end: their Gram matrices), materialised (dense per-row gradients summed per
    unit) and an embedding (the unit's rows of one token summed): never below the
    float64 norm of the unit's gradient, and the clipped sum within the bound."""
    if form == "ghost":
        x, y = _ghost_unit_rows()
        sizes = [2, 2, 2]
    elif form == "materialise":
        x, y = _unit_rows()
        sizes = [3, 3, 3]
    else:
        x = torch.full((9, 1), 7)
        y = _unit_rows()[1]
        sizes = [3, 3, 3]
    monkeypatch.setattr(_gs, "use_ghost", lambda *a, **k: form == "ghost")
    torch.manual_seed(1)
    model = (nn.Embedding(10, 64) if form == "embedding" else _Lin(64, 64)).to(dtype)
    x = x if form == "embedding" else x.to(dtype)
    y = y.to(dtype)
    weights = torch.tensor(
        [1.0 / k if reduction == "mean" else 1.0 for k in sizes for _ in range(k)]
    )
    true = _unit_true(_clone(model), x, y * weights.view(-1, 1, 1), sizes)
    assert (true > 1.0).all()  # far above C, far from 0
    units = RowUnits.from_sizes(sizes, reduction)
    tracker = GradSampleTracker(model, loss_reduction="sum")
    (model(x) * y).sum().backward()
    C = 1e-3
    sums, _, norms = tracker.clipped_sum(C, units=units)
    tracker.detach()
    assert (norms.double() >= true).all(), (norms, true)
    total = torch.cat([s.flatten() for s in sums.values()]).double().norm()
    assert total <= len(sizes) * C * (1 + 1e-3), total


def _clone(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize("shared", [False, True])
def test_ordinary_long_sequences_are_over_stated_by_little(shared):
    """256 positions over a vocabulary of 50 (tokens repeated ~5 times an example), rows
    that do not cancel: the bound over-states the squared norm by a relative ~2 (T + 1) u k
    for a token repeated k times (~3e-4 here)."""
    v, t, n = 50, 256, 4
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, v, (n, t), generator=gen)
    if shared:
        ids = ids[0].expand(n, t)
    y = torch.randn(n, t, 32, generator=gen)
    true = _embedding_true(ids, y, v)
    emb = nn.Embedding(v, 32)
    tracker = GradSampleTracker(emb, loss_reduction="sum")
    (emb(ids) * y).sum().backward()
    _, _, norms = tracker.clipped_sum(1.0)
    tracker.detach()
    ratio = norms.double().square() / true.square()
    assert (ratio >= 1).all() and (ratio <= 1 + 1e-3).all(), ratio


@pytest.mark.parametrize("p, d", [(64, 64), (16, 64), (64, 16)])
@pytest.mark.parametrize("mode", ["ghost", "materialise"])
def test_a_bias_whose_positions_cancel_adds_what_it_norms(p, d, mode, monkeypatch):
    """A Linear on sequences: its per-example bias gradient is the sum of the output
    gradients over the positions, normed as computed. Inputs of zeros (the weight's
    gradient 0), the positions cancelling: the clipped sum adds those same computed sums,
    scaled, and so holds at most ``C`` per example (in ghost form with ``p <= d`` it added
    the scaled positions, which round otherwise: ~9 per example at ``C = 1``)."""
    monkeypatch.setattr(_gs, "use_ghost", lambda *a, **k: mode == "ghost")
    x = torch.zeros(2, 3, d)
    y = torch.stack([_cancelling_rows(p, seed=s) for s in (0, 1)])
    assert (y.double().sum(1).norm(dim=1) > 5.0).all()
    torch.manual_seed(1)
    lin = nn.Linear(d, p)
    noiseless_sum_step(lin, x, y, 1.0)
    got = lin.bias.grad.double().norm() * 2  # / expected batch size
    assert got <= 2 * 1.0 * (1 + 1e-3), got
