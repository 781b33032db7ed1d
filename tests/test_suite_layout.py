"""The suite's own layout: test folders are not packages (pytest's default "prepend"
import mode), so two test modules with one basename make the whole run fail to collect."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_basename_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1]
