"""A DP-SGD run on a ledger whose step is refused by a check of the data's values (a
non-finite input) is charged its reservation in full: the ledger reads as for the
clean neighbour, never as "the steps before the refusal ran"."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import NonFiniteInputError  # noqa: E402
from privlearn.ledger import Ledger  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _records(led: Ledger) -> list[tuple]:
    """Every field of every entry but the sequence numbers, times and hashes (a
    reference to another entry as that entry's position)."""
    history = led.history("toy")
    position = {e.seq: i for i, e in enumerate(history)}
    skip = {"seq", "time", "hash", "ref"}
    return [
        (
            *(getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in skip),
            position.get(e.ref),
        )
        for e in history
    ]


def _run(path, x, y) -> Ledger:
    led = Ledger(path, create=True)
    led.create_budget("toy", epsilon=20.0, delta=1e-5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        epochs=2,
        ledger=led.budget("toy"),
        seed=0,
    )
    try:
        for _ in range(2):
            for xb, yb in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(xb), yb).backward()
                p.optimizer.step()
    finally:
        p.detach()
    return led


def test_a_step_refused_for_a_non_finite_record_is_charged_as_the_clean_run(tmp_path):
    """The refused step used to leave the steps before it as what ran (nothing at all
    when the record was in the first batch), so the ledger told its readers that the
    data held a non-finite record, and when it was drawn."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.randint(0, 2, (64,), generator=g)
    clean = _run(tmp_path / "clean.db", x, y)
    bad = x.clone()
    bad[7, 0] = float("nan")
    with pytest.raises(NonFiniteInputError):
        _run(tmp_path / "refused.db", bad, y)
    refused = Ledger(tmp_path / "refused.db")
    assert refused.pending("toy") == []
    assert _records(refused) == _records(clean)
    assert [r[0] for r in _records(clean)] == ["budget", "reserve", "settle"]
