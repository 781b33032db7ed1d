"""The noisy-gradient buffer reused from step to step never changes a tensor anyone
else still holds; the allocator tuning of make_private can be switched off."""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.optimizer import _sole_owner as sole_owner  # noqa: E402


def _engine(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(64, 8, 16)  # sequences: Linear layers materialise per-example grads
    y = torch.randint(0, 2, (64,))
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, seed=1)
    return p


def _step(p, batch):
    xb, yb = batch
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(xb).mean(1), yb).backward()
    p.optimizer.step()


def test_held_gradients_are_never_overwritten():
    p = _engine()
    it = iter(p.data_loader)
    _step(p, next(it))
    held = [q.grad for q in p.model.parameters()]  # the user keeps last step's gradients
    copies = [g.clone() for g in held]
    _step(p, next(it))
    for g, c in zip(held, copies, strict=True):
        assert torch.equal(g, c)
    assert all(q.grad.data_ptr() != g.data_ptr()
               for q, g in zip(p.model.parameters(), held, strict=True))


def test_unreferenced_noise_buffer_is_reused_and_results_unchanged():
    p, ref = _engine(), _engine()
    it, it_ref = iter(p.data_loader), iter(ref.data_loader)
    _step(p, next(it))
    _step(ref, next(it_ref))
    ptr = next(p.model.parameters()).grad.data_ptr()
    for _epoch in range(2):
        for batch, batch_ref in zip(it, it_ref, strict=True):
            _step(p, batch)
            _step(ref, batch_ref)
            ref.optimizer._buffers = []  # the reference never reuses its buffer
        it, it_ref = iter(p.data_loader), iter(ref.data_loader)
    assert next(p.model.parameters()).grad.data_ptr() == ptr
    for a, b in zip(p.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert sole_owner(torch.empty(2)) and not sole_owner(p.optimizer._buffers[0])  # p.grad views


def test_retain_freed_memory_is_idempotent_and_can_be_switched_off():
    import subprocess
    import sys

    from privlearn.torch._allocator import retain_freed_memory

    first = retain_freed_memory()
    assert isinstance(first, bool) and retain_freed_memory() is first
    code = "from privlearn.torch._allocator import retain_freed_memory as r; print(r())"
    env = {**__import__("os").environ, "PRIVLEARN_MALLOC_TUNING": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


def test_views_are_kept_while_nobody_else_holds_them():
    p = _engine()
    it = iter(p.data_loader)
    _step(p, next(it))
    first = [weakref.ref(q.grad) for q in p.model.parameters()]  # holds none of them
    _step(p, next(it))  # p.grad are the same view objects, refilled
    assert all(q.grad is r() for q, r in zip(p.model.parameters(), first, strict=True))


@pytest.mark.parametrize("hold", ["one_view", "flat_view", "as_other_grad", "zero_in_place"])
def test_a_held_view_is_never_overwritten(hold):
    """Whoever keeps one gradient of a step, by any reference, keeps its values: the
    next steps write into a fresh buffer (the same training as without the reuse)."""
    p, ref = _engine(), _engine()
    it, it_ref = iter(p.data_loader), iter(ref.data_loader)
    _step(p, next(it))
    _step(ref, next(it_ref))
    w = p.model[0].weight
    held = other = None
    if hold == "one_view":
        held = w.grad
    elif hold == "flat_view":
        held = w.grad.view(-1)
    elif hold == "as_other_grad":
        other = torch.zeros_like(w)
        other.grad = w.grad  # a reference from C++ alone
    copy = (held if held is not None else w.grad).clone()
    for batch, batch_ref in zip(it, it_ref, strict=True):
        if hold == "zero_in_place":  # p.grad kept, zeroed: the views are reused
            kept = weakref.ref(w.grad)
            p.optimizer.zero_grad(set_to_none=False)
            xb, yb = batch
            nn.functional.cross_entropy(p.model(xb).mean(1), yb).backward()
            p.optimizer.step()
            assert w.grad is kept()
        else:
            _step(p, batch)
        _step(ref, batch_ref)
        ref.optimizer._buffers = []
    if held is not None:
        assert torch.equal(held, copy)
    if other is not None:
        assert torch.equal(other.grad, copy)
    for a, b in zip(p.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(a, b)
