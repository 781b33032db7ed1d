"""Stand-ins that fail the test that uses them if the code under test touches what they
stand for. Importable from every test module (like closed_forms.py: pytest puts this
folder, which holds the suite's conftest.py, on ``sys.path``)."""

from __future__ import annotations


class Untouchable:
    """Array-like of ``n_samples x n_features`` that fails the test if anything reads its
    values (its shape and length may be read: they are public)."""

    ndim = 2

    def __init__(self, n_samples: int, n_features: int = 3):
        self.shape = (n_samples, n_features)

    def __array__(self, *args, **kwargs):
        raise AssertionError("the data was read")

    def __len__(self):
        return self.shape[0]
