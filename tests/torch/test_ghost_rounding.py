"""Ghost norms in float32 never understate a per-example gradient norm.

A ghost norm is ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` (Li et al. 2022, Sec. 4): when an
example's per-token terms ``g_t a_t^T`` cancel (the same input at every position, output
gradients of alternating sign), the terms of that sum are far larger than the result, and
the float32 Gram matrices lose it to rounding: the squared norm came out 0 (clamped from a
negative value) for gradients of norm ~10, so the example entered the clipped sum
unclipped. The ground truth is the naive per-example gradient in float64.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from toys import noiseless_sum_step  # noqa: E402

from privlearn.torch import GradSampleTracker  # noqa: E402
from privlearn.torch import grad_sample as _gs  # noqa: E402


def _cancelling(n=4, t=4, d=64, p=64, scale=100.0, seed=0):
    """Inputs ``(n, t, d)`` equal at every position up to 1e-3, output gradients
    ``(n, t, p)`` of alternating sign up to 1e-3: each example's gradient is small next to
    its per-token terms."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 1, d, generator=gen) * scale
    x = a.expand(n, t, d) + 1e-3 * torch.randn(n, t, d, generator=gen)
    sign = torch.tensor([1.0, -1.0]).repeat(t // 2)
    g = torch.randn(n, 1, p, generator=gen) * scale
    y = g * sign[None, :, None] + 1e-3 * torch.randn(n, t, p, generator=gen)
    return x, y


def _true_norms(x, y):
    """Per-example norms of the weight gradient of ``(lin(x_i) * y_i).sum()``,
    ``sum_t y_t x_t^T``, in float64."""
    return torch.einsum("ntp,ntd->npd", y.double(), x.double()).flatten(1).norm(dim=1)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("mode", ["auto", "ghost"])
def test_float32_ghost_norms_match_the_float64_norms(t, mode, monkeypatch):
    """The layer picks ghost norms here (``t^2 (d + p) < d p``); forced too. (No bias: its
    per-example gradient is a plain sum, computed and clipped as it is.)"""
    x, y = _cancelling(t=t)
    torch.manual_seed(1)
    lin = nn.Linear(64, 64, bias=False)
    if mode == "ghost":
        monkeypatch.setattr(_gs, "use_ghost", lambda *a, **k: True)
    tracker = GradSampleTracker(lin, loss_reduction="sum")
    (lin(x) * y).sum().backward()
    contribs, _, _ = tracker.contributions()
    assert all(c.ghost for c in contribs)  # the path under test
    _, _, norms = tracker.clipped_sum(1.0)
    tracker.detach()
    true = _true_norms(x, y)
    assert (true > 1.0).all()  # far from 0: a norm of 0 is not rounding
    # never below (in float32 the rounding bound of a cancelling example is of the size of
    # its per-position terms: it is clipped as if that large, never less), and at most
    # the triangle inequality's sum_t |a_t| |g_t|
    assert (norms.double() >= true).all()
    tri = (x.double().norm(dim=2) * y.double().norm(dim=2)).sum(1)
    assert (norms.double() <= tri * (1 + 1e-6)).all()


def test_a_cancelling_example_is_clipped_in_the_private_step(oracle):
    """Noise-free step of ``make_private``: the released gradient is the naive clipped sum
    (before, the cancelling examples entered it unclipped, ~10^4 times the bound)."""
    x, y = _cancelling(n=8, t=2)
    torch.manual_seed(1)
    model = nn.Linear(64, 64)
    ref = nn.Linear(64, 64).double()
    ref.load_state_dict(model.state_dict())
    C = 1e-3
    xb, yb = noiseless_sum_step(model, x, y, C)
    got = oracle.flat(q.grad for q in model.parameters()) * 8  # / expected batch size
    rows = oracle.grads(
        lambda i: (ref(xb[i : i + 1].double()) * yb[i : i + 1].double()).sum(),
        8,
        list(ref.parameters()),
    )
    norms = torch.stack([r.norm() for r in rows])
    assert (norms > 1e3 * C).all()  # every example far above the bound
    # each example enters with norm at most C (clipped as at least its exact norm): the
    # sum is within the bound, where before the cancelling examples entered unclipped
    assert got.norm() <= 8 * C * (1 + 1e-3)


def _exact_sq(a, g):
    return torch.einsum("ntp,ntd->npd", g.double(), a.double()).flatten(1).square().sum(1)


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
@pytest.mark.parametrize("cancelling", [True, False])
def test_the_working_precision_bound_never_understates(precision, cancelling):
    """The accelerator's form (float32 Gram matrices, no widening), run here: never below
    the exact squared norm, at most ``U = (sum_t |a_t| |g_t|)^2`` (which bounds it), and
    above it by no more than the documented ``(d + p + T + 1) 2^-24 U`` in float32
    (the TF32 / bfloat16 settings of float32 products widen the bound by their input
    rounding)."""
    from privlearn.torch._ghost_norms import ghost_sq

    n, t, d, p = 6, 8, 48, 40
    if cancelling:
        x, y = _cancelling(n=n, t=t, d=d, p=p)
    else:
        gen = torch.Generator().manual_seed(3)
        x, y = torch.randn(n, t, d, generator=gen), torch.randn(n, t, p, generator=gen)
    exact = _exact_sq(x, y)
    u = (x.double().norm(dim=2) * y.double().norm(dim=2)).sum(1).square()
    raw = (torch.matmul(x, x.transpose(1, 2)) * torch.matmul(y, y.transpose(1, 2))).sum((1, 2))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        got = ghost_sq(x, y, widen=False)
    finally:
        torch.set_float32_matmul_precision(before)
    assert got.dtype == torch.float32  # the Gram dtype: nothing widened
    assert (got.double() >= exact).all()
    # about U at most (the triangle inequality's bound on the exact value, plus the
    # bound's own share of it)
    assert (got.double() <= u * 1.05).all()
    if cancelling:  # what the plain float32 sum gave: below the exact value
        assert (raw.double() < exact).any()
    if precision == "highest":
        assert (got.double() - exact <= (d + p + 2 * t + 8) * 2.0**-24 * u).all()


def test_half_precision_operands_with_float32_accumulation_never_understate():
    """The form of half-precision records on an accelerator (float32-accumulated Gram
    matrices of bfloat16 operands), run here: never below the exact squared norm."""
    from privlearn.torch._ghost_norms import ghost_sq
    from privlearn.torch._rows import mm32

    x, y = _cancelling(n=6, t=4, d=32, p=32, scale=10.0)
    x, y = x.bfloat16(), y.bfloat16()
    got = ghost_sq(x, y, mm32, widen=False)
    assert (got.double() >= _exact_sq(x, y)).all()


def test_a_vocabulary_wide_layer_is_not_over_clipped():
    """Blocked Gram accumulation: for ordinary examples of a layer with a vocabulary-wide
    output (p = 50,257, as GPT-2's head) the bound over-states the squared norm by a few
    percent at most; one float32 product over all 50,257 features would round within
    ``gamma_50257`` and over-state it by ~20% here (~T p 2^-24)."""
    from privlearn.torch._ghost_norms import ghost_sq

    gen = torch.Generator().manual_seed(5)
    n, t, d, p = 2, 64, 32, 50257
    x = torch.randn(n, t, d, generator=gen)
    y = torch.randn(n, t, p, generator=gen) / p**0.5
    exact = _exact_sq(x, y)
    got = ghost_sq(x, y).double()
    assert (got >= exact).all()
    assert (got <= exact * 1.05).all()


def test_mixed_precision_settings_never_break_or_loosen_the_bound():
    """PyTorch refuses to read ``torch.get_float32_matmul_precision()`` once a backend's
    own ``fp32_precision`` and the generic setting disagree (a RuntimeError in the
    backward hook, where users mix ``allow_tf32`` and the new settings). The backend's own
    setting is read instead; an unreadable one counts as bfloat16 products (the widest
    input rounding): still never below the exact squared norm."""
    from privlearn.torch._ghost_norms import ghost_sq, input_rounding

    mk = torch.backends.mkldnn.matmul
    cu = torch.backends.cuda.matmul
    before = (mk.fp32_precision, cu.fp32_precision)
    try:
        mk.fp32_precision = "none"
        cu.fp32_precision = "tf32"
        assert input_rounding("cuda") == 2.0**-11
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()  # what the hook used to read
        assert input_rounding("cpu") == 2.0**-8  # unreadable: the widest
        x, y = _cancelling(n=3, t=4, d=24, p=20)
        got = ghost_sq(x, y)
        assert (got.double() >= _exact_sq(x, y)).all()
        mk.fp32_precision = "ieee"
        assert input_rounding("cpu") == 0.0
    finally:
        mk.fp32_precision, cu.fp32_precision = before


@pytest.mark.parametrize("t", [256, 250, 131])
def test_long_rows_summed_in_two_stages_never_understate(t):
    """Rows of more than 128 positions are summed in two stages (a divisor near sqrt(T);
    131 is prime: one sum): never below the exact squared norm, cancelling or not, and
    ordinary examples over-stated by at most a few percent."""
    from privlearn.torch._ghost_norms import ghost_sq

    x, y = _cancelling(n=2, t=t - t % 2, d=16, p=12)
    assert (ghost_sq(x, y).double() >= _exact_sq(x, y)).all()
    gen = torch.Generator().manual_seed(t)
    x, y = torch.randn(2, t, 16, generator=gen), torch.randn(2, t, 12, generator=gen)
    exact = _exact_sq(x, y)
    got = ghost_sq(x, y).double()
    assert (got >= exact).all() and (got <= exact * 1.05).all()
