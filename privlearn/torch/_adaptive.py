"""Adaptive clipping's settings and the noise split between the clipped sum and the count
of unclipped examples (Andrew, Thakkar, McMahan & Ramaswamy 2021, Algorithm 1); the
step itself is :class:`privlearn.torch.optimizer.DPOptimizer`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from privlearn.errors import ConfigurationError

__all__ = ["AdaptiveClipping", "gradient_noise_multiplier", "next_clip_bound"]


@dataclass(frozen=True)
class AdaptiveClipping:
    """Settings of adaptive clipping (Andrew et al. 2021, Algorithm 1, geometric update).

    Attributes
    ----------
    target_unclipped_quantile : float in [0, 1]
        gamma: the fraction of examples whose gradient norm the bound should exceed.
    clipbound_learning_rate : float > 0
        eta of the update ``C <- C exp(-eta (b - gamma))``.
    unclipped_num_std : float > 0
        sigma_b, std of the noise on the (centred) count of unclipped examples. Must
        exceed ``noise_multiplier / 2``.
    """

    target_unclipped_quantile: float
    clipbound_learning_rate: float
    unclipped_num_std: float


def gradient_noise_multiplier(noise_multiplier: float, unclipped_num_std: float) -> float:
    """Noise multiplier of the clipped sum when the count of unclipped examples gets noise
    ``unclipped_num_std`` and the step as a whole must be the Gaussian mechanism of
    multiplier ``noise_multiplier``: ``(sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al.
    2021; the count is centred, sensitivity 1/2).

    Raises
    ------
    ValueError
        ``noise_multiplier >= 2 * unclipped_num_std`` (no gradient noise could reach it).
    """
    s, sb = float(noise_multiplier), float(unclipped_num_std)
    if s == 0:
        return 0.0
    if not s < 2 * sb:
        raise ConfigurationError(
            f"adaptive clipping with noise_multiplier={s:g} needs unclipped_num_std > "
            f"noise_multiplier / 2 = {s / 2:g} (Andrew et al. 2021: the noise on "
            f"the clipped sum is (sigma^-2 - (2 sigma_b)^-2)^(-1/2)), got {sb:g}. Increase "
            "unclipped_num_std (its default is expected_batch_size / 20: use larger "
            "batches) or lower noise_multiplier")
    return (s ** -2 - (2 * sb) ** -2) ** -0.5


def next_clip_bound(bound: float, unclipped_fraction: float,
                    settings: AdaptiveClipping) -> float:
    """The geometric update of the clipping bound (Andrew et al. 2021, Algorithm 1):
    ``C exp(-eta (b - gamma))`` with ``b`` the noisy unclipped fraction of the step.

    Raises
    ------
    ConfigurationError
        The new bound is not a positive finite float (``exp`` overflowed or underflowed:
        a learning rate ``eta`` far too large for the spread of ``b``); the caller keeps
        the old bound.
    """
    step = -settings.clipbound_learning_rate * (
        unclipped_fraction - settings.target_unclipped_quantile)
    new = bound * math.exp(step) if step < 709.0 else math.inf  # exp(709.8) overflows
    if not 0.0 < new < math.inf:
        raise ConfigurationError(
            f"adaptive clipping's bound left the floating-point range: C = {bound:g} times "
            f"exp(-{settings.clipbound_learning_rate:g} x ({unclipped_fraction:g} - "
            f"{settings.target_unclipped_quantile:g})) is {new:g}. The step was taken and "
            "accounted; the bound is kept. Lower clipbound_learning_rate (e.g. 0.2, the "
            "paper's), or unclipped_num_std if the noisy fraction is far outside [0, 1]")
    return new
