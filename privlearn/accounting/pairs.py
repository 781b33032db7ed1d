"""Dominating pairs with scalar privacy loss: the PLD representation of a mechanism kind.

A kind registered with ``pld_pair=...`` (:func:`privlearn.accounting.register_mechanism`)
returns one of these for one run of the mechanism. Subclass :class:`Pair` and implement
``tails(x) -> (P(L > x), P(L <= x), Q(L > x), Q(L <= x))`` exactly (each side evaluated
separately, so that small interval masses come without cancellation), set ``loss_min``,
``loss_max`` and ``pure_epsilon`` where they are finite -- or build a
:class:`DiscretePair` from finitely many atoms. The implementation lives in the private
module :mod:`privlearn.accounting._pld_pairs` (see it for the references).
"""

from __future__ import annotations

from privlearn.accounting._pld_pairs import (
    AddPair,
    DiscretePair,
    GaussianPair,
    LaplacePair,
    Pair,
    RemovePair,
    ReplaceGaussianPair,
    ReplaceLaplacePair,
    SwappedPair,
    pure_dp_pair,
    randomized_response_pair,
)

__all__ = [
    "Pair",
    "DiscretePair",
    "GaussianPair",
    "LaplacePair",
    "ReplaceGaussianPair",
    "ReplaceLaplacePair",
    "RemovePair",
    "AddPair",
    "SwappedPair",
    "pure_dp_pair",
    "randomized_response_pair",
]
