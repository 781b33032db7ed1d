"""A stable, short name of a noise strategy, for the records that say what ran.

A ledger entry of a correlated-noise run names the strategy ``C`` whose noise it added
(the mechanism it stores describes the privacy of the run, not which ``C`` produced
it: two strategies of equal sensitivity give the same mechanism). The name is the
strategy's class and size with a SHA-256 digest of what defines it, so it is the same
in every process and on every machine for the same strategy, and differs for another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from privlearn.correlated.strategies import (
    BandedToeplitz,
    BufferedToeplitz,
    DenseStrategy,
    Identity,
    ToeplitzStrategy,
)
from privlearn.errors import ParameterTypeError

__all__ = ["strategy_fingerprint"]

#: Hexadecimal digits of the SHA-256 digest kept in a name (64 bits, as DenseStrategy's
#: repr keeps).
DIGITS = 16


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:DIGITS]


def strategy_fingerprint(strategy: ToeplitzStrategy | DenseStrategy, steps: int) -> str:
    """The name of ``strategy`` recorded with a run of ``steps`` steps.

    Parameters
    ----------
    strategy : ToeplitzStrategy or DenseStrategy
    steps : int
        The run's steps; used only by a strategy that is not a dataclass (its first
        column over the run's steps is then what defines it).

    Returns
    -------
    str
        ``"Identity()"``; ``"BandedToeplitz(bands=b, sha256=...)"`` and
        ``"BufferedToeplitz(buffers=m, sha256=...)"`` (the digest of the defining
        coefficients, as exact JSON numbers); ``DenseStrategy``'s repr,
        ``"DenseStrategy(steps=n, sha256=...)"`` (the digest of its matrix); for another
        dataclass strategy its class and the digest of its fields, and for any other
        Toeplitz strategy its class and the digest of its first column over ``steps``
        steps (little-endian float64).
    """
    if isinstance(strategy, DenseStrategy):
        return repr(strategy)
    if isinstance(strategy, Identity):
        return "Identity()"
    name = type(strategy).__name__
    if isinstance(strategy, BandedToeplitz):
        size = f"bands={strategy.bands}, "
    elif isinstance(strategy, BufferedToeplitz):
        size = f"buffers={strategy.buffers}, "
    else:
        size = ""
    if dataclasses.is_dataclass(strategy):
        fields = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)}
        text = json.dumps(
            fields,
            sort_keys=True,
            separators=(",", ":"),
            default=lambda v: np.asarray(v, dtype=float).tolist(),
        )
        return f"{name}({size}sha256={_digest(text.encode())})"
    if not isinstance(strategy, ToeplitzStrategy):
        raise ParameterTypeError(
            f"strategy must be a privlearn.correlated strategy (ToeplitzStrategy or "
            f"DenseStrategy), got {type(strategy).__name__}"
        )
    first = np.asarray(strategy.toeplitz_coefs(steps), dtype="<f8")
    return f"{name}(steps={steps}, sha256={_digest(first.tobytes())})"
