""":func:`make_private`: turn a model, an optimizer and a DataLoader into DP-SGD."""

from __future__ import annotations

import math
import secrets
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from privlearn.accounting import Gaussian, Sampling, calibrate, compose, subsample
from privlearn.torch.accountant import PrivacyAccountant
from privlearn.torch.data import (
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    VirtualBatchLoader,
    make_dp_loader,
)
from privlearn.torch.distributed import world_info
from privlearn.torch.noise import NoiseSource
from privlearn.torch.optimizer import DPOptimizer
from privlearn.torch.tracker import GradSampleTracker
from privlearn.torch.validator import check_model
from privlearn.torch.validator import fix as fix_layers

__all__ = ["make_private", "PrivateTraining"]

_SAMPLING = ("poisson", "fixed")


@dataclass(frozen=True)
class PrivateTraining:
    """What :func:`make_private` returns.

    Attributes
    ----------
    model : nn.Module
        The same model object (hooks attached).
    optimizer : DPOptimizer
        Wraps the given optimizer; ``step()`` performs the DP-SGD step.
    data_loader : DataLoader or VirtualBatchLoader
        Poisson (or fixed-size) sampling loader over the same dataset.
    accountant : PrivacyAccountant
        ``accountant.epsilon(delta)`` for the logical steps actually taken.
    noise_multiplier : float
        sigma (calibrated when ``target_epsilon`` was given; rounded up).
    max_grad_norm : float
    sampling_rate : float
        q, the inclusion probability of an example at each step.
    expected_batch_size : float
        q N (global), the normaliser of the noisy sum.
    sampling : str
        ``"poisson"`` or ``"fixed"``.
    """

    model: nn.Module
    optimizer: DPOptimizer
    data_loader: object
    accountant: PrivacyAccountant
    noise_multiplier: float
    max_grad_norm: float
    sampling_rate: float
    expected_batch_size: float
    sampling: str

    def epsilon(self, delta: float) -> float:
        """Shorthand for ``accountant.epsilon(delta)``."""
        return self.accountant.epsilon(delta)

    def detach(self) -> nn.Module:
        """Remove the hooks and restore ``requires_grad``; returns the model."""
        self.optimizer.tracker.detach()
        return self.model


def _check_pos(name: str, value, allow_inf: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not (v > 0) or (math.isinf(v) and not allow_inf):
        rng = "(0, inf]" if allow_inf else "(0, inf)"
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    return v


def _shared_seed(seed: int | None, process_group=None) -> int:
    """A sampling seed equal on every rank: ``seed`` itself, or fresh OS entropy drawn on
    the group's first rank and broadcast."""
    import torch.distributed as dist

    if seed is not None:
        return int(seed)
    box = [secrets.randbits(63)]
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast_object_list(box, src=src, group=process_group)
    return int(box[0])


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    target_delta: float = 1e-5,
    epochs: int | None = None,
    steps: int | None = None,
    max_grad_norm: float = 1.0,
    sampling: str | Sampling = "poisson",
    max_physical_batch_size: int | None = None,
    loss_reduction: str = "mean",
    accountant: str = "pld",
    secure_mode: bool = False,
    seed: int | None = None,
    fix_model: bool = False,
    process_group=None,
) -> PrivateTraining:
    """Make ``model``/``optimizer``/``data_loader`` train with DP-SGD.

    Parameters
    ----------
    model : nn.Module
        In training mode, every trainable layer supported (see
        :func:`privlearn.torch.validate`); may be wrapped in DistributedDataParallel.
    optimizer : torch.optim.Optimizer
        Over the model's parameters.
    data_loader : DataLoader
        An ordinary loader over a map-style dataset; its ``batch_size`` B (per rank when
        distributed) sets the sampling rate ``q = W B / len(dataset)``. It is replaced by
        a loader with the same dataset/collate/workers and the DP sampler.
    noise_multiplier : float >= 0, optional
        sigma: noise std = sigma * max_grad_norm on the clipped sum. Exactly one of
        ``noise_multiplier`` and ``target_epsilon`` must be given.
    target_epsilon, target_delta : float
        Calibrate sigma (rounded up) so that the planned run is
        (target_epsilon, target_delta)-DP for the planned number of steps,
        ``steps`` or ``epochs * round(1 / q)`` (one of them required).
    max_grad_norm : float > 0
        Clipping bound C on the per-example gradient norm over all parameters
        (``inf``: no clipping, for testing).
    sampling : {"poisson", "fixed"} or privlearn.accounting.Sampling
        Poisson sampling (variable batch size, ``scheme="poisson"``, add/remove) or
        fixed-size sampling without replacement (``scheme="fixed"``, replace-one;
        distributed: one global sample of ``W B`` indices per step, drawn identically on
        every rank and split between them).
    max_physical_batch_size : int, optional
        Split logical batches into chunks of at most this size (virtual batches).
    loss_reduction : {"mean", "sum"}
        Reduction of the user's loss over the batch dimension ("mean": the engine
        multiplies output gradients by the realised batch size of the forward pass to
        recover per-example gradients).
    accountant : str
        Accountant of :mod:`privlearn.accounting` used for epsilon and calibration.
    secure_mode : bool
        CSPRNG noise with the floating-point-attack mitigation (see
        :mod:`privlearn.torch.noise`) and CSPRNG Poisson sampling (fixed-size sampling
        keeps a generator seeded from OS entropy).
    seed : int, optional
        Seed for sampling and (non-secure) noise; rank-offset when distributed (except
        for the shared fixed-size sampling seed; with ``seed=None`` that one is drawn on
        the first rank and broadcast).
    fix_model : bool
        Replace BatchNorm by GroupNorm (in place) before validating.
    process_group : optional
        torch.distributed group (default: the world, when initialised).

    Returns
    -------
    PrivateTraining

    Raises
    ------
    ValueError
        Bad arguments, a model in eval mode, unsupported layers (all listed), a loader
        that cannot be made Poisson; always before any training step.
    """
    # ---------------------------------------------------------------- validation
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if not isinstance(inner, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not model.training:
        raise ValueError("model is in eval mode (model.training is False); call "
                         "model.train() before make_private")
    max_grad_norm = _check_pos("max_grad_norm", max_grad_norm, allow_inf=True)
    if isinstance(sampling, Sampling):
        sampling = sampling.value
    if sampling not in _SAMPLING:
        raise ValueError(f"sampling must be one of {_SAMPLING}, got {sampling!r}")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier and target_epsilon, got "
                         f"noise_multiplier={noise_multiplier!r}, "
                         f"target_epsilon={target_epsilon!r}")
    if noise_multiplier is not None:
        nm = float(noise_multiplier)
        if not (nm >= 0) or math.isinf(nm):
            raise ValueError(f"noise_multiplier must be in [0, inf), got {noise_multiplier!r}")
    if math.isinf(max_grad_norm) and (target_epsilon is not None or nm > 0):
        raise ValueError("max_grad_norm=inf (no clipping) leaves the sensitivity unbounded, "
                         "so no noise scale is private; it is only allowed with "
                         "noise_multiplier=0 (non-private testing). Give a finite "
                         "max_grad_norm > 0")
    if target_epsilon is not None:
        _check_pos("target_epsilon", target_epsilon)
        if not 0 < float(target_delta) < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")
        if epochs is None and steps is None:
            raise ValueError("target_epsilon needs the length of training: give epochs or "
                             "steps (got neither)")
    if epochs is not None and (int(epochs) != epochs or epochs < 1):
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if steps is not None and (int(steps) != steps or steps < 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if secure_mode and seed is not None:
        raise ValueError(f"seed must be None when secure_mode=True, got seed={seed!r}")
    if max_physical_batch_size is not None and int(max_physical_batch_size) < 1:
        raise ValueError("max_physical_batch_size must be an integer >= 1, got "
                         f"{max_physical_batch_size!r}")
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch DataLoader, got "
                        f"{type(data_loader).__name__}")
    if fix_model:
        fix_layers(inner)
    check_model(inner)

    # ---------------------------------------------------------------- sampling
    rank, world = world_info(process_group)
    n = len(data_loader.dataset)
    batch_size = data_loader.batch_size
    if batch_size is None:
        bs = data_loader.batch_sampler
        if isinstance(bs, PoissonBatchSampler) and sampling == "poisson":
            batch_size = bs.sample_rate * n / world
        elif isinstance(bs, FixedSizeBatchSampler) and sampling == "fixed":
            batch_size = bs.batch_size
        else:
            raise ValueError(
                f"data_loader uses a custom batch_sampler ({type(bs).__name__}) that is not "
                f"{sampling} sampling, so {sampling!r} accounting would not match what "
                "runs; pass an ordinary DataLoader with batch_size set")
    else:
        smp = getattr(data_loader, "sampler", None)
        if not isinstance(smp, (torch.utils.data.SequentialSampler,
                                torch.utils.data.RandomSampler,
                                torch.utils.data.distributed.DistributedSampler)):
            warnings.warn(
                f"data_loader's sampler ({type(smp).__name__}) is replaced by {sampling} "
                "sampling over the whole dataset, as the accounting requires", stacklevel=2)
    q = world * batch_size / n
    if not 0 < q <= 1:
        raise ValueError(f"sampling rate world_size * batch_size / len(dataset) must be in "
                         f"(0, 1], got {q!r}")
    steps_per_epoch = max(1, round(1 / q))
    scheme = "poisson" if sampling == "poisson" else "fixed"

    # ---------------------------------------------------------------- calibration
    if target_epsilon is not None:
        total = int(steps) if steps is not None else int(epochs) * steps_per_epoch
        nm = calibrate(lambda s: compose(subsample(Gaussian(s), rate=q, scheme=scheme),
                                         steps=total),
                       float(target_epsilon), float(target_delta), accountant=accountant)

    # ---------------------------------------------------------------- assembly
    rank_seed = None if seed is None else int(seed) + 1_000_003 * rank
    shared_seed = None
    if sampling == "fixed" and world > 1:
        shared_seed = _shared_seed(seed, process_group)
    loader = make_dp_loader(data_loader, sampling=sampling, sample_rate=q,
                            batch_size=int(batch_size), steps=steps_per_epoch,
                            seed=rank_seed, rank=rank, world_size=world,
                            secure=bool(secure_mode), shared_seed=shared_seed)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # The engine all-reduces the noisy clipped sums itself: DDP's gradient
        # synchronisation is switched off for good (what ``model.no_sync()`` does for one
        # step), so autograd's weight gradients are neither computed nor all-reduced.
        model.require_backward_grad_sync = False
    tracker = GradSampleTracker(inner, loss_reduction=loss_reduction)
    ledger = PrivacyAccountant(nm, q, scheme=scheme, accountant=accountant)
    noise = NoiseSource(secure_mode=secure_mode,
                        seed=None if (secure_mode or seed is None) else rank_seed + 7)
    expected = float(world * batch_size)  # = q N
    dp_opt = DPOptimizer(optimizer, tracker, noise_multiplier=nm, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected, accountant=ledger, noise=noise,
                         world_size=world, process_group=process_group)
    if max_physical_batch_size is not None:
        loader = VirtualBatchLoader(loader, int(max_physical_batch_size), dp_opt)
    return PrivateTraining(model=model, optimizer=dp_opt, data_loader=loader,
                           accountant=ledger, noise_multiplier=nm,
                           max_grad_norm=max_grad_norm, sampling_rate=q,
                           expected_batch_size=expected, sampling=sampling)
