"""Rows picked by the data before a layer (the unpadded tokens, ``h[mask]``) are not
regrouped into examples: their count per example follows the batch's values, so a first
batch whose examples all have 4 live tokens verifies nothing about a later batch of the
same shapes with 3 + 5. Before the fix the probe verified the grouping on the first batch
and the second step's clipped sum cut the rows at the wrong places (2.4% off the naive
batch-of-one loop, one example's rows clipped with another's)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import BatchDependenceError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

B, T, V, D = 4, 6, 11, 3
CLIP = 0.05


class Unpadded(nn.Module):
    """An embedding and a Linear run on the live tokens only (id 0 is padding), picked
    in one of several ways; ``"side"`` computes a mask's ``nonzero`` off the rows' path
    and ``"written"`` writes selected rows back into the ``(B, T, d)`` layout
    (``h[mask] = v``, ``masked_scatter``), both running the Linear on all tokens
    (``reshape(-1, d)``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, 2)

    def forward(self, ids):
        mask = ids != 0
        out = torch.zeros(*ids.shape, 2, dtype=self.lin.weight.dtype)
        if self.how == "bool":
            out[mask] = self.lin(self.emb(ids)[mask])
        elif self.how == "ids":
            out[mask] = self.lin(self.emb(ids[mask]))
        elif self.how == "masked_select":
            rows = torch.masked_select(self.emb(ids), mask[..., None]).reshape(-1, D)
            out[mask] = self.lin(rows)
        elif self.how == "nonzero":
            idx = mask.reshape(-1).nonzero().squeeze(1)
            out.view(-1, 2)[idx] = self.lin(self.emb(ids).reshape(-1, D).index_select(0, idx))
        elif self.how == "written":  # selected rows written back into the (B, T) layout
            h = self.emb(ids)
            into = torch.zeros_like(h)
            into[mask] = torch.tanh(h[mask])
            both = into + h.masked_scatter(mask[..., None], h[mask] * 3)
            out = self.lin(both.reshape(-1, D)).reshape(*ids.shape, 2)
        else:
            assert mask.nonzero().shape[1] == 2  # a selection off the rows' path
            rows = self.lin(self.emb(ids).reshape(-1, D))
            out = rows.reshape(*ids.shape, 2) * mask[..., None]
        return out


def _loss(out):
    return (out**2).sum() + out.sum()


def _naive_step(model, x):
    """The definition: each example's gradient alone, clipped to CLIP, summed, / B."""
    total = [torch.zeros_like(q) for q in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        _loss(model(x[i : i + 1])).backward()
        g = [torch.zeros_like(q) if q.grad is None else q.grad for q in model.parameters()]
        norm = torch.sqrt(sum((t**2).sum() for t in g)).item()
        f = min(1.0, CLIP / norm) if norm > 0 else 1.0
        for a, t in zip(total, g, strict=True):
            a += f * t
    return [t / len(x) for t in total]


def _private(model, ids):
    """``model``'s make_private run on the dataset ``ids``: noise-free SGD, lr 1, every
    step the whole dataset of B examples."""
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        DataLoader(TensorDataset(ids), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        sampling="fixed",
        loss_reduction="sum",
        seed=0,
    )


def _made(how: str):
    """The model, its make_private run (:func:`_private`) and the dataset's ids, 4 live
    tokens in every example."""
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(0))
    ids[:, 4:] = 0
    torch.manual_seed(1)
    model = Unpadded(how).double()
    return model, _private(model, ids), ids


@pytest.mark.parametrize("how", ["bool", "ids", "masked_select", "nonzero"])
def test_rows_picked_by_a_mask_are_refused_before_any_release(how):
    model, p, _ = _made(how)
    start = [q.detach().clone() for q in model.parameters()]
    (x,) = next(iter(p.data_loader))
    _loss(p.model(x)).backward()
    with pytest.raises(BatchDependenceError, match="picked by the data") as info:
        p.optimizer.step()
    assert "No step was taken and nothing was released" in str(info.value)
    assert p.accountant.steps == 0
    assert all(torch.equal(a, q) for a, q in zip(start, model.parameters(), strict=True))


@pytest.mark.parametrize("how", ["side", "written"])
def test_a_selection_off_the_rows_path_still_trains_exactly(how):
    """Two steps, the second with 3, 5, 4 and 4 live tokens (as many rows in all, the
    same shapes): each the naive batch-of-one step."""
    model, p, ids = _made(how)
    for step in range(2):
        if step == 1:
            ids[0, 3], ids[1, 4] = 0, 7
        (x,) = next(iter(p.data_loader))
        before = copy.deepcopy(model)
        p.optimizer.zero_grad()
        _loss(p.model(x)).backward()
        p.optimizer.step()
        naive = _naive_step(before, x)
        for b, q, n in zip(before.parameters(), model.parameters(), naive, strict=True):
            torch.testing.assert_close(b - q.detach(), n, rtol=1e-10, atol=1e-13)


class SwitchesPath(nn.Module):
    """All tokens live: the rows are ``h.reshape(-1, d)`` (verified, regrouped); any
    padding: the live tokens only, ``h[mask]``, on inputs of the same shapes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, 2)

    def forward(self, ids):
        mask = ids != 0
        h = self.emb(ids)
        if bool(mask.all()):
            return self.lin(h.reshape(-1, D)).reshape(*ids.shape, 2)
        out = torch.zeros(*ids.shape, 2, dtype=h.dtype)
        out[mask] = self.lin(h[mask])
        return out


def test_a_later_batch_on_a_path_that_selects_rows_is_refused():
    """The first step (6 live tokens each) trains exactly; the second, of the same shapes
    with 3, 5, 6 and 6 live tokens (20 rows: 5 per example on average, never verified),
    was regrouped 5 by 5 before the fix; it is refused, nothing of it released."""
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    model = SwitchesPath().double()
    p = _private(model, ids)
    (x,) = next(iter(p.data_loader))
    before = copy.deepcopy(model)
    _loss(p.model(x)).backward()
    p.optimizer.step()
    for b, q, n in zip(
        before.parameters(), model.parameters(), _naive_step(before, x), strict=True
    ):
        torch.testing.assert_close(b - q.detach(), n, rtol=1e-10, atol=1e-13)
    ids[0, 3:], ids[1, 5:] = 0, 0
    (x,) = next(iter(p.data_loader))
    after_first = [q.detach().clone() for q in model.parameters()]
    p.optimizer.zero_grad()
    _loss(p.model(x)).backward()
    with pytest.raises(BatchDependenceError, match="rows per example"):
        p.optimizer.step()
    assert p.accountant.steps == 1
    assert all(torch.equal(a, q) for a, q in zip(after_first, model.parameters(), strict=True))
