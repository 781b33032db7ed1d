"""Fixtures shared by the ledger tests."""

from __future__ import annotations

import pytest

from privlearn.ledger import Ledger


@pytest.fixture
def ledger(tmp_path):
    """A fresh ledger file with one budget, ``adult`` at (1, 1e-6)."""
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("adult", epsilon=1.0, delta=1e-6)
    yield led
    led.close()
