""":func:`make_private`: turn a model, an optimizer and a DataLoader into DP-SGD.

Length: :class:`PrivateTraining` and :func:`make_private`, whose argument checks and
assembly belong together (helpers in :mod:`privlearn.torch._engine_checks`).
"""

from __future__ import annotations

import atexit
import math

import torch
from torch import nn
from torch.utils.data import DataLoader

from privlearn.accounting import Sampling, calibrate, compose
from privlearn.torch._allocator import retain_freed_memory
from privlearn.torch._engine_checks import (  # noqa: F401  (re-exported: old home)
    _SAMPLING_HELP,
    _accountable_batch_size,
    _check_pos,
    _guard_token_level_labels,
    _per_layer_bounds,
    _shared_seed,
)
from privlearn.torch.accountant import LedgerLink, PrivacyAccountant, dpsgd_step
from privlearn.torch.data import (  # noqa: F401  (samplers: importable here before)
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    VirtualBatchLoader,
    make_dp_loader,
)
from privlearn.torch.distributed import world_info
from privlearn.torch.noise import NoiseSource
from privlearn.torch.optimizer import AdaptiveClipping, DPOptimizer, gradient_noise_multiplier
from privlearn.torch.tracker import GradSampleTracker
from privlearn.torch.validator import check_model
from privlearn.torch.validator import fix as fix_layers

__all__ = ["make_private", "PrivateTraining"]

_SAMPLING = ("poisson", "fixed")


_STATE_FORMAT = "privlearn.torch.private_training/1"


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
        sigma of the next step (calibrated when ``target_epsilon`` was given; rounded
        up). Read from the optimizer: the one value the steps use and record.
    max_grad_norm : float
        Clipping bound of the next step (likewise).
    sampling_rate : float
        q, the inclusion probability of an example at each step (read-only).
    expected_batch_size : float
        q N (global), the normaliser of the noisy sum.
    sampling : str
        ``"poisson"`` or ``"fixed"``.

    Notes
    -----
    Checkpoint and resume with :meth:`state_dict` / :meth:`load_state_dict`: the state
    holds the model, the optimizer, the accountant's history and the random states of
    the sampler and the noise, so a resumed run reports the same epsilon as an
    uninterrupted one and, with a fixed ``seed``, continues with the same batches and
    noise::

        torch.save(p.state_dict(), "ckpt.pt")          # after an optimizer step
        ...                                            # new process
        p = make_private(model, optimizer, loader, ...same arguments...)
        p.load_state_dict(torch.load("ckpt.pt", weights_only=False))
    """

    def __init__(self, *, model, optimizer, data_loader, accountant, sampling_rate,
                 expected_batch_size, sampling, config):
        self.model = model
        self.optimizer = optimizer
        self.data_loader = data_loader
        self.accountant = accountant
        self._sampling_rate = float(sampling_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.sampling = sampling
        self._config = dict(config)

    @property
    def noise_multiplier(self) -> float:
        return self.optimizer.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:  # same as the optimizer's
        self.optimizer.noise_multiplier = value

    @property
    def max_grad_norm(self) -> float:
        return self.optimizer.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self.optimizer.max_grad_norm = value

    @property
    def sampling_rate(self) -> float:
        return self._sampling_rate

    @sampling_rate.setter
    def sampling_rate(self, value: float) -> None:
        raise AttributeError("sampling_rate cannot be changed after make_private: the "
                             "sampler draws the batches with it and the accountant records "
                             "it. Call make_private again with a loader of another "
                             "batch_size")

    def __repr__(self) -> str:
        return (f"PrivateTraining(noise_multiplier={self.noise_multiplier}, "
                f"max_grad_norm={self.max_grad_norm}, sampling_rate={self.sampling_rate}, "
                f"sampling={self.sampling!r}, steps={self.accountant.steps})")

    def epsilon(self, delta: float) -> float:
        """Shorthand for ``accountant.epsilon(delta)``."""
        return self.accountant.epsilon(delta)

    def finish(self) -> None:
        """Record in the ledger (``make_private(ledger=...)``) how many of the reserved
        steps ran; a no-op without a ledger. Called by :meth:`detach` and at interpreter
        exit; training may continue afterwards (new steps are reserved again)."""
        link = self.accountant.ledger_link
        if link is not None:
            link.settle()

    def detach(self) -> nn.Module:
        """Settle the ledger (:meth:`finish`), remove the hooks and restore
        ``requires_grad``; returns the model."""
        self.finish()
        self.optimizer.tracker.detach()
        for h in self._config.get("_hooks", ()):
            h.remove()
        return self.model

    @property
    def _sampler(self):
        return self.data_loader.batch_sampler

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to continue this run: model and optimizer state, the
        accountant's history, the live noise multiplier and clipping bound, and the random
        states of the sampler and the noise source (``None`` in secure mode: OS entropy
        cannot be replayed). Save it right after an optimizer step."""
        noise = self.optimizer.noise
        return {
            "format": _STATE_FORMAT,
            "mechanism": {k: v for k, v in self._config.items() if not k.startswith("_")},
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.original_optimizer.state_dict(),
            "noise_multiplier": self.optimizer.noise_multiplier,
            "max_grad_norm": self.optimizer.max_grad_norm,
            "accountant": self.accountant.state_dict(),
            "sampler": self._sampler.state_dict(),
            "noise": None if noise.secure_mode else noise.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict` into this freshly made run.

        Raises
        ------
        ValueError
            The state was made with a different mechanism (noise multiplier, sampling
            rate or scheme, clipping bound, loss reduction, accountant, world size), or
            this run has already taken steps (their privacy cost would be lost).
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError("state is not a privlearn training state (format "
                             f"{_STATE_FORMAT!r}); pass what PrivateTraining.state_dict() "
                             "returned")
        if self.accountant.steps or self._sampler.draws:
            raise ValueError(
                f"load_state_dict needs a fresh run, but this one has already taken "
                f"{self.accountant.steps} steps (drawn {self._sampler.draws} batches), whose "
                "cost would be lost; call it right after make_private")
        mine = {k: v for k, v in self._config.items() if not k.startswith("_")}
        theirs = state["mechanism"]
        diff = [f"{k}: saved {theirs.get(k)!r}, here {mine.get(k)!r}"
                for k in sorted(set(mine) | set(theirs)) if theirs.get(k) != mine.get(k)]
        if diff:
            raise ValueError("the saved state was made with a different mechanism, so its "
                             "privacy history does not describe this run: "
                             + "; ".join(diff) + ". Rebuild with make_private using the "
                             "original arguments")
        self.model.load_state_dict(state["model"])
        self.optimizer.original_optimizer.load_state_dict(state["optimizer"])
        self.optimizer.max_grad_norm = state["max_grad_norm"]
        self.optimizer.noise_multiplier = state["noise_multiplier"]
        self.accountant.load_state_dict(state["accountant"])
        self._sampler.load_state_dict(state["sampler"])
        noise = self.optimizer.noise
        if state["noise"] is not None and not noise.secure_mode:
            noise.generator.set_state(state["noise"])



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
    max_grad_norm: float | list | dict = 1.0,
    clipping: str = "flat",
    sampling: str | Sampling = "poisson",
    max_physical_batch_size: int | None = None,
    loss_reduction: str = "mean",
    accountant: str = "pld",
    secure_mode: bool = False,
    seed: int | None = None,
    fix_model: bool = False,
    process_group=None,
    max_epsilon: float | None = None,
    ledger=None,
    ledger_chunk: int = 1000,
    target_unclipped_quantile: float | None = None,
    clipbound_learning_rate: float = 0.2,
    unclipped_num_std: float | None = None,
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
        An ordinary loader over a map-style dataset, ``DataLoader(dataset,
        batch_size=B)`` with no ``shuffle`` and no ``sampler`` (or one whose
        ``batch_sampler`` is a :class:`PoissonBatchSampler` / :class:`FixedSizeBatchSampler`
        matching ``sampling``). Its ``batch_size`` B (per rank when distributed) sets the
        sampling rate ``q = W B / len(dataset)``; it is replaced by a loader with the same
        dataset/collate/workers and the DP sampler. Loaders whose sampling the accountant
        cannot describe (``shuffle=True``, ``WeightedRandomSampler``, a
        ``DistributedSampler``, any custom sampler) are refused.
    noise_multiplier : float >= 0, optional
        sigma: noise std = sigma * max_grad_norm on the clipped sum. Exactly one of
        ``noise_multiplier`` and ``target_epsilon`` must be given.
    target_epsilon, target_delta : float
        Calibrate sigma (rounded up) so that the planned run is
        (target_epsilon, target_delta)-DP for the planned number of steps,
        ``steps`` or ``epochs * round(1 / q)`` (one of them required).
    max_grad_norm : float > 0, or list / dict of floats with ``clipping="per_layer"``
        Clipping bound C on the per-example gradient norm over all parameters
        (``inf``: no clipping, for testing). Per-layer: one bound per trainable parameter
        in ``model.parameters()`` order (as Opacus takes it), or a dict by parameter name
        (``model.named_parameters()``).
    clipping : {"flat", "per_layer", "adaptive"}
        ``"flat"``: one bound on the norm over all parameters. ``"adaptive"``: see
        ``target_unclipped_quantile`` below. ``"per_layer"``: each
        parameter's per-example gradient is clipped to its own bound ``C_k``; the noise
        std is ``noise_multiplier * sqrt(sum_k C_k^2)`` (the sensitivity of the clipped
        sum), which is also the clipping bound the accountant records and
        ``p.max_grad_norm`` reports (setting it rescales every ``C_k`` in proportion).
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
    max_epsilon : float, optional
        Hard cap on epsilon at ``target_delta``: the step that would exceed it raises
        :class:`~privlearn.errors.PrivacyBudgetExceededError` before it runs. Independently,
        when the run has a plan (``target_epsilon``, or ``epochs``/``steps``), going past
        the planned epsilon emits one :class:`~privlearn.torch.PrivacyBudgetWarning`.
    ledger : optional
        A budget of a persistent privacy ledger, ``privlearn.ledger.Ledger(path).budget(
        dataset)``. The planned run (or ``ledger_chunk`` steps without a plan) is reserved
        here, before any data is touched (refused with
        :class:`~privlearn.errors.BudgetExceededError` if the budget cannot hold it), more
        steps are reserved ahead as training proceeds, and :meth:`PrivateTraining.finish`
        (also called by :meth:`PrivateTraining.detach` and at interpreter exit) records
        how many ran. A killed process leaves its reservations, at least the steps it ran,
        in the ledger.
    ledger_chunk : int
        Steps reserved at a time beyond the plan.
    target_unclipped_quantile : float in [0, 1], optional
        gamma, required with ``clipping="adaptive"`` (0.5: the median norm).
        ``clipping="adaptive"`` (Andrew, Thakkar, McMahan & Ramaswamy 2021,
        "Differentially Private Learning with Adaptive Clipping", Algorithm 1, geometric
        update): ``max_grad_norm`` is the initial bound; after every step it moves towards
        the ``target_unclipped_quantile`` of the per-example norms, estimated from a noisy
        count of unclipped examples. The count's noise is paid for inside
        ``noise_multiplier``: the step (clipped sum and count together) is the Gaussian
        mechanism of multiplier ``noise_multiplier``, so the accounting is unchanged and
        the clipped sum gets the larger multiplier ``(sigma^-2 - (2 sigma_b)^-2)^(-1/2)``
        (see :mod:`privlearn.torch.optimizer`).
    clipbound_learning_rate : float > 0
        eta of ``C <- C exp(-eta (b - gamma))``.
    unclipped_num_std : float > 0, optional
        sigma_b, noise std of the count; default ``expected_batch_size / 20`` (the
        default of TensorFlow Federated's ``adaptive_clip_noise_params``, ``0.05 m``).
        Must exceed ``noise_multiplier / 2``.

    Returns
    -------
    PrivateTraining

    Raises
    ------
    ValueError
        Bad arguments, a model in eval mode, unsupported layers (all listed), a loader
        whose sampling cannot be accounted; always before any training step.

    Notes
    -----
    Losses: with ``loss_reduction="mean"`` the loss must be the mean over *examples* of
    per-example losses. A Hugging Face model called with token-level ``labels=``
    averages over all tokens of the batch (examples weighted by their token counts), which
    breaks per-example clipping; such calls are refused at the forward pass. Compute the
    loss with :func:`privlearn.torch.per_sequence_cross_entropy` instead.
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
    if clipping not in ("flat", "per_layer", "adaptive"):
        raise ValueError(f"clipping must be 'flat', 'per_layer' or 'adaptive', got "
                         f"{clipping!r}")
    per_layer_bounds = None
    if clipping == "per_layer":
        per_layer_bounds = _per_layer_bounds(inner, max_grad_norm)
        max_grad_norm = math.sqrt(sum(c * c for c in per_layer_bounds.values()))
    elif isinstance(max_grad_norm, list | tuple | dict):
        raise ValueError("max_grad_norm is a list/dict of per-parameter bounds, which needs "
                         f"clipping='per_layer' (got clipping={clipping!r}); pass one number "
                         "for flat or adaptive clipping")
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
    if max_epsilon is not None:
        max_epsilon = _check_pos("max_epsilon", max_epsilon)
        if not 0 < float(target_delta) < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")
    if clipping == "adaptive":
        if target_unclipped_quantile is None:
            raise ValueError(
                "clipping='adaptive' needs target_unclipped_quantile (gamma in [0, 1], the "
                "fraction of examples the bound should leave unclipped, e.g. 0.5), got None")
        g = float(target_unclipped_quantile)
        if not 0 <= g <= 1:
            raise ValueError(f"target_unclipped_quantile must be in [0, 1], got "
                             f"{target_unclipped_quantile!r}")
        _check_pos("clipbound_learning_rate", clipbound_learning_rate)
        if unclipped_num_std is not None:
            _check_pos("unclipped_num_std", unclipped_num_std)
        if math.isinf(max_grad_norm):
            raise ValueError("clipping='adaptive' needs a finite initial max_grad_norm > 0, "
                             "got inf")
    elif target_unclipped_quantile is not None or unclipped_num_std is not None:
        raise ValueError(
            "target_unclipped_quantile and unclipped_num_std only apply to "
            f"clipping='adaptive', got clipping={clipping!r}; pass clipping='adaptive' or "
            "drop them")
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
    batch_size = _accountable_batch_size(data_loader, sampling, n, world)
    q = world * batch_size / n
    if not 0 < q <= 1:
        raise ValueError(f"sampling rate world_size * batch_size / len(dataset) must be in "
                         f"(0, 1], got {q!r}")
    steps_per_epoch = max(1, round(1 / q))
    scheme = "poisson" if sampling == "poisson" else "fixed"

    # ---------------------------------------------------------------- calibration
    if target_epsilon is not None:
        total = int(steps) if steps is not None else int(epochs) * steps_per_epoch
        nm = calibrate(lambda s: compose(dpsgd_step(s, q, scheme), steps=total),
                       float(target_epsilon), float(target_delta), accountant=accountant)

    adaptive = None
    if clipping == "adaptive":
        sb = (float(unclipped_num_std) if unclipped_num_std is not None
              else world * batch_size / 20.0)
        gradient_noise_multiplier(nm, sb)  # sigma < 2 sigma_b, before any step
        adaptive = AdaptiveClipping(float(target_unclipped_quantile),
                                    float(clipbound_learning_rate), sb)

    # ---------------------------------------------------------------- assembly
    planned_steps = (int(steps) if steps is not None
                     else int(epochs) * steps_per_epoch if epochs is not None else None)
    planned_epsilon = None
    if target_epsilon is not None:
        planned_epsilon = float(target_epsilon)
    elif planned_steps is not None and nm > 0:
        planned_epsilon = compose(dpsgd_step(nm, q, scheme), steps=planned_steps).epsilon(
            float(target_delta), accountant=accountant)
    # the ledger first: a refused reservation leaves the user's objects untouched
    link = None
    if ledger is not None:
        if int(ledger_chunk) != ledger_chunk or ledger_chunk < 1:
            raise ValueError(f"ledger_chunk must be an integer >= 1, got {ledger_chunk!r}")
        link = LedgerLink(ledger, scheme=scheme, chunk=int(ledger_chunk),
                          label=f"make_private({type(inner).__name__})")
        if nm == 0:
            raise ValueError("noise_multiplier=0 is not private and cannot be spent from a "
                             "ledger; give noise_multiplier > 0 or target_epsilon")
        link.reserve(nm, q, planned_steps or int(ledger_chunk))  # before any data
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
    if all(q.device.type == "cpu" for q in inner.parameters()):
        retain_freed_memory()  # freed step memory stays for the next step (_allocator.py)
    tracker = GradSampleTracker(inner, loss_reduction=loss_reduction)
    hooks = _guard_token_level_labels(inner) if loss_reduction == "mean" else []
    acct = PrivacyAccountant(nm, q, scheme=scheme, accountant=accountant,
                             max_grad_norm=max_grad_norm)
    acct.set_budget(delta=float(target_delta), max_epsilon=max_epsilon,
                    planned_epsilon=planned_epsilon, planned_steps=planned_steps)
    acct.ledger_link = link
    noise = NoiseSource(secure_mode=secure_mode,
                        seed=None if (secure_mode or seed is None) else rank_seed + 7)
    expected = float(world * batch_size)  # = q N
    dp_opt = DPOptimizer(optimizer, tracker, noise_multiplier=nm, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected, accountant=acct, noise=noise,
                         world_size=world, process_group=process_group,
                         sampler=loader.batch_sampler, adaptive=adaptive)
    if per_layer_bounds is not None:
        by_name = dict(inner.named_parameters())
        dp_opt.per_param_clipping = {id(by_name[n]): c / max_grad_norm
                                     for n, c in per_layer_bounds.items()}
    if max_physical_batch_size is not None:
        loader = VirtualBatchLoader(loader, int(max_physical_batch_size), dp_opt)
    config = dict(noise_multiplier=nm, max_grad_norm=max_grad_norm, sampling_rate=q,
                  sampling=sampling, expected_batch_size=expected, dataset_size=n,
                  loss_reduction=loss_reduction, accountant=accountant, world_size=world,
                  clipping=clipping,
                  per_layer_max_grad_norm=(None if per_layer_bounds is None
                                           else list(per_layer_bounds.values())),
                  rank=rank, _hooks=hooks)
    if adaptive is not None:  # part of the mechanism (checked when a state is loaded)
        config.update(clipping="adaptive", adaptive=(adaptive.target_unclipped_quantile,
                                                     adaptive.clipbound_learning_rate,
                                                     adaptive.unclipped_num_std))
    p = PrivateTraining(model=model, optimizer=dp_opt, data_loader=loader,
                        accountant=acct, sampling_rate=q, expected_batch_size=expected,
                        sampling=sampling, config=config)
    if link is not None:
        atexit.register(link.settle)
    return p
