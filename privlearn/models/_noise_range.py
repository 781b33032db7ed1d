"""Refusal of settings whose noise would overflow float64 in the release (private helper
of :mod:`privlearn.models.linear` and :mod:`privlearn.models.dpsgd`).

A release's noise is a standard normal (or standard Laplace) draw times a standard
deviation fixed by public settings alone: the calibrated noise multiplier times the
sensitivity, itself a product of public bounds (``x_bound^2`` for ``X^T X``,
``x_bound * y_bound`` for ``X^T y``, ``max_grad_norm`` for DP-SGD's clipped sum). When
that product is near the largest float64 (about 1.8e308), the draws or the sums over the
coordinates that follow overflow to ``inf``, and the fit failed after its ledger
reservation (a bare ``LinAlgError`` or a "diverged" ``FloatingPointError`` advising a
smaller learning rate), its budget spent for nothing. Public settings decide it, so it is
refused here, before anything is reserved or read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from privlearn.errors import ConfigurationError

__all__ = ["NOISE_HEADROOM", "refuse_overflowing_noise"]

#: How far below the largest float64 a noise standard deviation must stay, per
#: coordinate summed. NumPy's ``Generator`` draws no standard normal beyond about 14 in
#: magnitude (its ziggurat's tail: ``3.65 + 0.274 * 36.8``, the last term bounded by the
#: logarithm of a 53-bit uniform) and no standard Laplace beyond about 37
#: (``-log(2^-53)``); 64 covers both, and the release then sums up to ``dim`` such terms
#: (``X^T X`` plus its noise, the solver's products with a noisy vector).
NOISE_HEADROOM = 64.0


def refuse_overflowing_noise(
    owner: str, scales: Mapping[str, float], dim: int, settings: str, remedy: str
) -> None:
    """Raise :class:`~privlearn.errors.ConfigurationError` when a noise scale (standard
    deviation, or Laplace scale) in ``scales`` (``{what is released: scale}``) times
    ``NOISE_HEADROOM * dim`` overflows float64.

    Parameters
    ----------
    owner : str
        The estimator, named in the message.
    scales : mapping of str to float
        Each release's noise scale, from public settings only.
    dim : int
        The number of coordinates the release sums over (the columns of ``X``, the
        intercept's included); at least 1 is used.
    settings : str
        The settings received that give these scales (e.g. ``"x_bound=1e+153,
        y_bound=1.0, epsilon=1.0"``).
    remedy : str
        What to do instead.
    """
    factor = NOISE_HEADROOM * max(int(dim), 1)
    for what, std in scales.items():
        if not math.isfinite(float(std) * factor):
            raise ConfigurationError(
                f"{owner}: the noise on {what} would have scale {std:.3g}, which "
                f"overflows float64 in the release (it must stay below about "
                f"{1.7976931348623157e308 / factor:.3g} for {max(int(dim), 1)} "
                f"coordinates); got {settings}. Nothing was reserved or fitted. {remedy}"
            )
