"""Self-test facility: plant a known privacy bug in a DP-SGD run (NOT for real training).

``privlearn audit dpsgd --inject-bug BUG`` and the privacy regression tests run the real
engine with one of these defects planted, to show that the audit catches it. Each bug is
a context manager that patches private internals of ONE :class:`PrivateTraining`
(instance-level patches, restored on exit; nothing global is changed) while the
accountant keeps reporting the epsilon of the *intended* configuration:

``no-noise``     the optimizer's per-step noise std (``DPOptimizer._noise_std``, used by
                 the fused and the unfused step) returns 0;
``noise-x0.1``   ... returns 0.1 times the intended std;
``no-clipping``  the tracker clips at ``max_grad_norm = inf`` (``GradSampleTracker.
                 clipped_sum``) while the noise stays ``sigma * C``;
``rate-x10``     the Poisson batch sampler of ``p.data_loader`` includes every record with
                 probability ``min(1, 10 q)`` while the accountant uses ``q``;
``noise-reused`` the noise source (``DPOptimizer.noise``) goes back to its starting state
                 after every step instead of moving on (``NoiseSource.advance``), so every
                 step adds the same noise draw. Each step's noise still
                 has the intended law, so the per-step likelihood-ratio score
                 (``score="trajectory"``) misses it: audit it with ``score="increments"``.

This module is the only place that knows these internals; adapt it when they change.
Imports torch only through the objects it is given.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from privlearn.errors import ConfigurationError, ParameterValueError

__all__ = ["BUGS", "planted_bug"]

BUGS = ("none", "no-noise", "noise-x0.1", "no-clipping", "rate-x10", "noise-reused")


@contextlib.contextmanager
def _patch_attr(obj, name: str, value):
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _batch_sampler(private):
    loader = private.data_loader
    bs = getattr(loader, "batch_sampler", None)
    if bs is None or not hasattr(bs, "num_samples"):
        raise ConfigurationError(
            "rate-x10 needs a Poisson-sampled p.data_loader (sampling='poisson')")
    return bs


@contextlib.contextmanager
def _boosted_rate(sampler, factor: float):
    """Swap the sampler instance's class for a subclass that draws each Poisson batch at
    ``min(1, factor * q)`` from the seed the sampler's key chain gives each draw (same
    number of steps). The per-batch draw is overridden where the sampler has one
    (``_draw(seed)``, called by an ``__iter__`` that does the bookkeeping), else
    ``__iter__`` itself."""
    base = type(sampler)
    rate = min(1.0, factor * float(sampler.sampling_rate))

    def draw(self, seed=None) -> list[int]:
        n = self.num_samples if self.indices is None else len(self.indices)
        chosen = np.flatnonzero(np.random.default_rng(seed).random(n) < rate)
        if self.indices is not None:
            chosen = np.asarray(self.indices)[chosen]
        return chosen.tolist()

    if hasattr(base, "_draw"):
        body = {"_draw": draw}
    else:
        def __iter__(self):
            for _ in range(self.steps):
                yield draw(self)

        body = {"__iter__": __iter__}
    sampler.__class__ = type(f"_Planted{base.__name__}", (base,), body)
    try:
        yield
    finally:
        sampler.__class__ = base


@contextlib.contextmanager
def _frozen_noise(source):
    """Make ``source.advance()`` (called after every step) restore the noise state the
    run started from (:meth:`NoiseSource.state_dict`), so every step draws the same
    noise."""
    if getattr(source, "_secure", False):
        raise ConfigurationError(
            "noise-reused needs the seeded noise source (secure_mode=False): the secure "
            "source draws fresh noise whatever its state")
    start = source.state_dict()

    def rewind() -> None:  # past the run's refusal of a rewind: the planted defect
        with _patch_attr(source, "_run_history", None):
            source.load_state_dict(start)

    with _patch_attr(source, "advance", rewind):
        yield


@contextlib.contextmanager
def planted_bug(bug: str, private):
    """Plant ``bug`` (one of :data:`BUGS`) in the training ``private`` (what
    :func:`privlearn.torch.make_private` returned) for the duration of the block."""
    if bug not in BUGS:
        raise ParameterValueError(f"bug must be one of {BUGS}, got {bug!r}")
    opt = private.optimizer
    if bug == "none":
        yield
    elif bug in ("no-noise", "noise-x0.1"):
        intended = type(opt)._noise_std.__get__(opt)
        scale = 0.0 if bug == "no-noise" else 0.1
        with _patch_attr(opt, "_noise_std", lambda: scale * intended()):
            yield
    elif bug == "no-clipping":
        tracker = opt.tracker
        clipped_sum = type(tracker).clipped_sum.__get__(tracker)

        def unclipped(max_grad_norm, *args, **kwargs):
            return clipped_sum(math.inf, *args, **kwargs)

        with _patch_attr(tracker, "clipped_sum", unclipped):
            yield
    elif bug == "noise-reused":
        with _frozen_noise(opt.noise):
            yield
    else:  # rate-x10
        with _boosted_rate(_batch_sampler(private), 10.0):
            yield
