"""UCI Adult records as short token sequences, for the language-model variant of the
correlated-noise study (:mod:`.correlated_noise`, task ``"adult-bert"``).

A record becomes ``[CLS]`` followed by one token per attribute, in a fixed order: the
eight categorical attributes by their value, the four numeric ones by the bucket their
value falls in. Each token is specific to its attribute (``sex=Male``, ``age=35-39``),
so the vocabulary is the union of the attributes' values and buckets, plus ``[PAD]``,
``[CLS]`` and one ``[UNK]`` per attribute (a value outside the published list).

The vocabulary costs no privacy: the category lists are read from ``adult.names`` (the
dataset's public schema, :func:`privlearn.datasets._adult_categories`) and the bucket
edges below are round numbers fixed in advance, not quantiles of the records. ``fnlwgt``
(a census sampling weight) and ``education-num`` (a recoding of ``education``) are left
out. NumPy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privlearn.datasets import ADULT_COLUMNS, _adult_categories
from privlearn.errors import ParameterValueError

__all__ = ["NUMERIC_EDGES", "AdultVocabulary", "adult_vocabulary"]

#: Bucket edges of the numeric attributes (data-independent round numbers): a value
#: ``v`` falls in bucket ``searchsorted(edges, v, side="right")``, so there are
#: ``len(edges) + 1`` buckets; for the capital columns the first edge, 1, separates
#: zero (most records) from any gain or loss.
NUMERIC_EDGES: dict[str, tuple[float, ...]] = {
    "age": (25, 30, 35, 40, 45, 50, 55, 60, 65, 70),
    "capital-gain": (1, 1000, 3000, 5000, 7500, 10000, 20000),
    "capital-loss": (1, 1000, 1500, 2000, 2500),
    "hours-per-week": (20, 30, 35, 40, 41, 45, 50, 60),
}

_ORDER = ("age", "workclass", "education", "marital-status", "occupation", "relationship",
          "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country")

PAD, CLS = 0, 1


def _bucket_names(edges: tuple[float, ...]) -> list[str]:
    inner = [f"{a:g}-{b - 1:g}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return [f"<{edges[0]:g}", *inner, f">={edges[-1]:g}"]


@dataclass(frozen=True)
class AdultVocabulary:
    """The token ids of the Adult attributes.

    Attributes
    ----------
    attributes : tuple of str
        The attributes in sequence order (after ``[CLS]``).
    tokens : tuple of str
        ``tokens[i]`` is the name of id ``i`` (``"[PAD]"``, ``"[CLS]"``,
        ``"age=[UNK]"``, ``"age=<25"``, ...).
    offsets : dict
        Attribute -> id of its ``[UNK]`` token; its values (or buckets) follow.
    """

    attributes: tuple[str, ...]
    tokens: tuple[str, ...]
    offsets: dict

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def length(self) -> int:
        """Tokens per record (``[CLS]`` and one per attribute)."""
        return 1 + len(self.attributes)

    def encode(self, raw: np.ndarray) -> np.ndarray:
        """Token ids (int64, shape ``(n, length)``) of records given as the 14 raw
        attributes (:func:`privlearn.datasets.load_adult` with ``features="raw"``)."""
        raw = np.asarray(raw, dtype=object)
        if raw.ndim != 2 or raw.shape[1] != len(ADULT_COLUMNS) - 1:
            raise ParameterValueError(
                f"raw must have shape (n, {len(ADULT_COLUMNS) - 1}) (the raw Adult "
                f"attributes, load_adult(features='raw').data), got {raw.shape}")
        ids = np.empty((len(raw), self.length), dtype=np.int64)
        ids[:, 0] = CLS
        cats = _adult_categories()
        for k, name in enumerate(self.attributes, start=1):
            col = raw[:, ADULT_COLUMNS.index(name)]
            base = self.offsets[name]
            if name in NUMERIC_EDGES:
                v = col.astype(float)
                ids[:, k] = base + 1 + np.searchsorted(NUMERIC_EDGES[name], v, side="right")
            else:
                index = {c: i for i, c in enumerate(cats[name])}
                ids[:, k] = [base + 1 + index[c] if c in index else base for c in col]
        return ids


def adult_vocabulary() -> AdultVocabulary:
    """The vocabulary from the public schema (``adult.names``) and :data:`NUMERIC_EDGES`."""
    cats = _adult_categories()
    tokens = ["[PAD]", "[CLS]"]
    offsets = {}
    for name in _ORDER:
        offsets[name] = len(tokens)
        values = _bucket_names(NUMERIC_EDGES[name]) if name in NUMERIC_EDGES else cats[name]
        tokens += [f"{name}=[UNK]"] + [f"{name}={v}" for v in values]
    return AdultVocabulary(_ORDER, tuple(tokens), offsets)
