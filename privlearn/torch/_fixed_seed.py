"""The generator of a distributed fixed-size sampler: every rank draws the same global
sample and keeps its own positions of it, which is disjoint from the other ranks' only
when all the ranks seed one generator alike."""

from __future__ import annotations

from privlearn.errors import ConfigurationError

__all__ = ["check_shared_generator"]


def check_shared_generator(seed: int | None, world_size: int, secure: bool) -> None:
    """Refuse a fixed-size sampler of ``world_size > 1`` ranks whose generator cannot be
    the same on every rank: secure mode (the OS CSPRNG) or ``seed=None`` (OS entropy on
    each rank), under which the ranks' batches overlap and one example can be in a global
    batch twice (twice the sensitivity accounted)."""
    if world_size <= 1:
        return
    if secure:
        raise ConfigurationError(
            f"secure=True with world_size={world_size}: the ranks draw one global fixed-size "
            "sample with one shared generator, which the OS CSPRNG cannot be. Use "
            "sampling='poisson' (each rank draws its own part) in secure mode"
        )
    if seed is None:
        raise ConfigurationError(
            f"seed must be an integer when world_size={world_size}, got seed=None: each "
            "rank would seed its generator from its own OS entropy and draw its own global "
            "sample, so the ranks' batches would overlap and one example could be in the "
            "global batch twice (twice the sensitivity accounted). Pass the same integer "
            "seed= on every rank, or give make_private DataLoader(dataset, batch_size=B) "
            "with sampling='fixed' (it shares one seed across the ranks)"
        )
