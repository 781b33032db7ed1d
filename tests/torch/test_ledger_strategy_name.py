"""A correlated-noise run's ledger entries name the strategy that ran (the entry's
metadata ``noise_strategy``): two strategies of one sensitivity give the same mechanism,
so the mechanism alone does not say which ``C`` produced the noise. DP-SGD steps record
none. The name is the class and a SHA-256 digest of what defines the strategy."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from train_loops import train_steps  # noqa: E402

from privlearn.correlated import BandedToeplitz, BufferedToeplitz, DenseStrategy  # noqa: E402
from privlearn.correlated._fingerprint import strategy_fingerprint  # noqa: E402
from privlearn.ledger import Ledger  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _run(tmp_path, **kw):
    ledger = Ledger(tmp_path / "privacy.db", create=True)
    ledger.create_budget("toy", epsilon=100.0, delta=1e-5)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(32, 3, generator=g), torch.randint(0, 2, (32,), generator=g))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(ds, batch_size=8),
        noise_multiplier=1.0,
        epochs=1,
        ledger=ledger.budget("toy"),
        seed=0,
        **kw,
    )
    train_steps(p, 2)
    p.finish()
    return p, ledger.history("toy")[1:]


def _sha(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()[:16]


@pytest.mark.parametrize(
    "kw",
    [
        dict(sampling="balls_in_bins", noise="blt"),
        dict(sampling="balls_in_bins", noise=BandedToeplitz.square_root(bands=2)),
        dict(
            sampling="shuffled_epochs",
            noise=DenseStrategy(np.tril(np.full((4, 4), 0.5)) + 0.5 * np.eye(4)),
        ),
    ],
    ids=["blt", "banded", "dense"],
)
def test_the_reservation_and_its_settle_name_the_strategy(tmp_path, kw):
    p, (reserve, settle) = _run(tmp_path, **kw)
    strategy = p.plan.run.strategy
    if isinstance(strategy, DenseStrategy):  # the digest its repr already shows
        expected = f"DenseStrategy(steps=4, sha256={_sha(strategy.matrix.tobytes())})"
    elif isinstance(strategy, BufferedToeplitz):
        fields = {
            "buf_decay": list(strategy.buf_decay),
            "output_scale": list(strategy.output_scale),
        }
        text = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        expected = f"BufferedToeplitz(buffers={len(strategy.buf_decay)}, sha256={_sha(text)})"
    else:
        assert isinstance(strategy, BandedToeplitz)
        text = json.dumps({"coefs": list(strategy.coefs)}, separators=(",", ":")).encode()
        expected = f"BandedToeplitz(bands={len(strategy.coefs)}, sha256={_sha(text)})"
    assert reserve.kind == "reserve" and settle.kind == "settle"
    assert reserve.metadata == settle.metadata == {"noise_strategy": expected}


def test_dpsgd_steps_record_no_strategy(tmp_path):
    _, entries = _run(tmp_path)
    assert entries and all(e.metadata is None for e in entries)


def test_the_name_tells_strategies_apart_and_is_stable():
    a, b = BandedToeplitz((1.0, 0.5)), BandedToeplitz((1.0, 0.25))
    assert strategy_fingerprint(a, 10) != strategy_fingerprint(b, 10)
    assert strategy_fingerprint(a, 10) == strategy_fingerprint(BandedToeplitz((1.0, 0.5)), 99)
    blt = BufferedToeplitz(buf_decay=(0.9, 0.5), output_scale=(0.2, 0.1))
    same = BufferedToeplitz(buf_decay=(0.5, 0.9), output_scale=(0.1, 0.2))  # reordered
    assert strategy_fingerprint(blt, 10) == strategy_fingerprint(same, 10)
