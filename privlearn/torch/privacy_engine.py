""":func:`make_private`: turn a model, an optimizer and a DataLoader into DP-SGD.

``make_private`` is a short pipeline of named steps, each a function of its own (and
tested on its own), each registering how to undo what it did; when a later step refuses,
the earlier ones are undone and the user's objects are left as they were:

1. :class:`~privlearn.torch.config.DPConfig`: validate the settings;
2. :func:`prepare_model`: unwrap DDP, apply the registered module fixers
   (``fix_model``), refuse unsupported layers;
3. :func:`plan_run`: the sampling rate from the loader, the planned steps, the noise
   multiplier (calibrated for ``target_epsilon``) -- a :class:`Plan`, no side effect;
4. :func:`reserve_budget`: reserve the planned run in a privacy ledger, before any data
   is read;
5. :func:`attach_engine`: the hooks that record each layer's inputs and output gradients;
6. :func:`build_optimizer`: the DP sampler's loader, the accountant, the budget cap, the
   noise source and the DP optimizer.

Nothing process-wide is changed (no allocator setting, no ``atexit`` handler; a DDP
model's gradient synchronisation is switched off for the run and restored by
:meth:`PrivateTraining.detach`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from privlearn.accounting import compose, warn_if_delta_large
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
from privlearn.torch import _buffer_writes, _forward_meet, _join_guard
from privlearn.torch._budget_cap import budget_cap
from privlearn.torch._ddp_quiet import ignore_buffers_later, quiet_ddp, refuse_join
from privlearn.torch._engine_checks import (
    _accountable_batch_size,
    _check_given_sampler,
    _check_loadable,
    _check_optimizer_step,
    _given_dp_sampling,
    _guard_token_level_labels,
    _per_layer_bounds,
    _shared_seed,
    _warn_drop_last,
    _warn_loader_generator,
    _warn_user_rate,
    given_sampler_seed,
)
from privlearn.torch._layout_state import check_sampler_state, sampler_state
from privlearn.torch._ledger_reserve import (
    check_take_over,
    ledger_record,
    load_resume,
    reserve_budget,
    take_over_on_load,
)
from privlearn.torch._model_refusals import (
    refuse_global_hooks,
    refuse_parameter_hooks,
    refuse_post_accumulate_hooks,
    refuse_untrainable,
)
from privlearn.torch._noise_check import warn_if_dpsgd_better
from privlearn.torch._noise_precision import (
    legacy_entries,
    noise_entries,
    resume_hint,
    run_precision,
)
from privlearn.torch._optimizer_coverage import warn_unoptimised
from privlearn.torch._rekey import fresh_noise_keys
from privlearn.torch._run_fields import RunAccountant
from privlearn.torch._state_checks import (
    RESUME_HINT,
    check_parts,
    entry,
    longer_run_hint,
    state_mapping,
)
from privlearn.torch.accountant import (
    PrivacyAccountant,
    Segment,
    opacus_method_error,
)
from privlearn.torch.config import DPConfig, unknown_settings_error
from privlearn.torch.data import (
    AugmentedLoader,
    UnitIndex,
    VirtualBatchLoader,
    check_batch_first,
    check_map_style,
    make_dp_loader,
)
from privlearn.torch.distributed import (
    Unshown,
    check_ddp_wrapper,
    check_same_on_ranks,
    dataset_digest,
    optimizer_settings,
    refusal_timeout,
    sync_replicas,
    unwrap,
    world_info,
)
from privlearn.torch.fsdp import (
    ShardedGradients,
    ShardedTracker,
    _mesh_group,
    check_not_legacy_fsdp,
    check_sharded_model,
    is_sharded,
)
from privlearn.torch.noise import NoiseSource
from privlearn.torch.optimizer import AdaptiveClipping, DPOptimizer, gradient_noise_multiplier
from privlearn.torch.schedule import SAMPLINGS, NoisePlan, cycle_bands, default_cycle, independent
from privlearn.torch.tracker import GradSampleTracker, check_not_attached
from privlearn.torch.validator import apply_fixers, check_model

__all__ = ["make_private", "PrivateTraining", "Plan", "prepare_model", "plan_run",
           "reserve_budget", "attach_engine", "build_optimizer"]

_STATE_FORMAT = "privlearn.torch.private_training/2"

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
    budget : BudgetCap
        ``max_epsilon`` and the planned epsilon, checked once per step.
    plan : Plan
        What the run was planned as (sampling rate, steps, noise, dataset size).
    noise_multiplier, max_grad_norm : float
        sigma and C of the next step, read from (and written to) the optimizer: the one
        value the steps use and record.
    sampling_rate, expected_batch_size : float
        q and q N (read-only).
    sampling : str
        The registered sampling (``"poisson"``, ``"fixed"``, ...).
    neighbouring : str
        The neighbouring relation the epsilon holds under (``"add_remove"`` or
        ``"replace_one"``), the sampling's.

    Notes
    -----
    Checkpoint and resume with :meth:`state_dict` / :meth:`load_state_dict`: the state
    holds the model, the optimizer, the accountant's history and the keys of the
    sampler's and the noise's key chains, so a resumed run reports the same epsilon as an
    uninterrupted one and continues with the same batches; with a fixed ``seed`` with the
    same noise too (resumed twice, both runs add it), without one with noise keys mixed
    with fresh OS entropy, so each resume's noise is independent. The keys are one-way: a
    checkpoint reveals neither past batches nor past noise (see :mod:`privlearn.torch.data`).
    They do replay the batches and noise of the steps *after* it, so with any model
    released later the noise of the steps in between can be subtracted: the state is a
    secret like the data, never a release; share ``p.model`` alone (docs/trust-model.md)::

        torch.save(p.state_dict(), "ckpt.pt")          # after an optimizer step
        ...                                            # new process
        p = make_private(model, optimizer, loader, ...same arguments...)
        p.load_state_dict(torch.load("ckpt.pt", weights_only=True))
    """

    accountant = RunAccountant()  # p.optimizer's: read-only (privlearn.torch._run_fields)

    def __init__(self, *, model, optimizer, data_loader, accountant, budget, plan, config,
                 ledger_link=None, undo=()):
        self.model, self.optimizer = model, optimizer
        self.data_loader = data_loader
        self.accountant = accountant
        self.budget = budget
        self.plan = plan
        self.config = config
        self.ledger_link = ledger_link
        self._undo = list(undo)
        self._finalizer = (None if ledger_link is None
                           else weakref.finalize(self, ledger_link.settle))

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
        return self.optimizer.sampling_rate

    @sampling_rate.setter
    def sampling_rate(self, value: float) -> None:
        self.optimizer.sampling_rate = value  # refused there, with the reason

    @property
    def expected_batch_size(self) -> float:
        return self.optimizer.expected_batch_size

    @property
    def sampling(self) -> str:
        return self.config.sampling

    @property
    def neighbouring(self) -> str:
        """The neighbouring relation :meth:`epsilon` holds under, the sampling's
        (:data:`privlearn.correlated.sampling.SAMPLINGS`): ``"add_remove"``, or
        ``"replace_one"`` for ``sampling="fixed"`` and ``"shuffled_epochs"`` (the
        dataset size public, one example's data replaced)."""
        return SAMPLINGS[self.config.sampling].relation.value

    def __iter__(self):
        # Opacus's make_private returns (model, optimizer, data_loader); this is one object
        raise ParameterTypeError(
            "make_private returns one PrivateTraining, not a (model, optimizer, data_loader) "
            "tuple: write p = make_private(...) and use p.model, p.optimizer, p.data_loader "
            "(and p.accountant, p.epsilon(delta), p.state_dict())")

    def __getattr__(self, name: str):  # only for missing attributes: Opacus's names
        raise opacus_method_error("PrivateTraining", name)

    def __repr__(self) -> str:
        return (f"PrivateTraining(noise_multiplier={self.noise_multiplier}, "
                f"max_grad_norm={self.max_grad_norm}, sampling_rate={self.sampling_rate}, "
                f"sampling={self.sampling!r}, steps={self.accountant.steps})")

    def epsilon(self, delta: float | None = None) -> float:
        """Shorthand for ``accountant.epsilon(delta)``: the certified epsilon of the steps
        taken, at ``delta`` (default: the run's ``target_delta``, the delta its
        calibration and ``max_epsilon`` use)."""
        return self.accountant.epsilon(self.config.target_delta if delta is None else delta)

    def compose_after(self, prior) -> None:
        """Continue this fresh run after ``prior``, the composed mechanism of earlier runs
        on the same data (e.g. a trainer's earlier ``train()``): :meth:`epsilon` composes
        it from here on (Abadi et al. 2016, Sec. 3.1), and what the run takes from its
        own plan moves with it: the planned epsilon becomes that of ``prior`` and the
        planned steps, and so does the cap of a run accounted as one mechanism, which
        cannot go past its plan (it was the plan's epsilon alone, which the prior already
        exceeds: no step could run). A ``max_epsilon`` given caps the total, as before.
        Call it before the first step, once per earlier run (each call composes with the
        priors before; a resumed history moves them too, in :meth:`load_state_dict`)."""
        self.accountant.prior = prior if (had := self.accountant.prior) is None else compose(
            [had, prior])  # refused after a step
        self._plan_after_prior()

    def _plan_after_prior(self) -> None:
        """The planned epsilon (and a whole-run cap at the plan) of the accountant's
        prior composed with the planned steps; nothing without a prior or a plan."""
        plan, prior = self.plan, self.accountant.prior
        if prior is None or plan.planned_epsilon is None or math.isinf(plan.planned_epsilon):
            return
        steps = Segment(plan.noise_multiplier, plan.sampling_rate, plan.max_grad_norm,
                        plan.planned_steps)  # the run's own plan, whatever it took so far
        planned = plan.run.composed([steps], prior).epsilon(
            self.config.target_delta, accountant=self.accountant.accountant)
        given = self.config.max_epsilon
        given = None if given is None or math.isinf(given) else float(given)
        cap = self.budget.max_epsilon
        if not plan.run.stepwise:
            cap = planned if given is None else min(given, planned)
        self.budget.rebase(max_epsilon=cap, planned_epsilon=planned)

    def finish(self) -> None:
        """Record in the ledger (``make_private(ledger=...)``) how many of the reserved
        steps ran; a no-op without a ledger. Called by :meth:`detach` and when this object
        is garbage-collected or the interpreter exits; training may continue afterwards
        (new steps are reserved again)."""
        if self.ledger_link is not None:
            self.ledger_link.settle()

    def detach(self) -> nn.Module:
        """Settle the ledger (:meth:`finish`), remove the hooks, put the parameters back
        and restore a DDP model's gradient synchronisation; returns the model."""
        self.finish()
        self.optimizer._detached = True  # its step() refuses from now on (_step_checks)
        while self._undo:
            self._undo.pop()()
        return self.model

    @property
    def _sampler(self):
        return self.data_loader.batch_sampler

    # ------------------------------------------------------------------ checkpoints
    def _mechanism(self) -> dict:
        plan = self.plan
        out = {**self.config.mechanism(), "noise_multiplier": plan.noise_multiplier,
               "max_grad_norm": plan.max_grad_norm, "sampling_rate": plan.sampling_rate,
               "expected_batch_size": plan.expected_batch_size,
               "dataset_size": plan.dataset_size, "world_size": plan.world_size,
               "rank": plan.rank, "per_layer_max_grad_norm": plan.per_layer_bounds,
               "adaptive": plan.adaptive_tuple(),
               "users": None if plan.units is None else
               f"{plan.units.n_units} users, partition sha256:{plan.units.partition[:16]}"}
        return {**out, **noise_entries(plan.run)}  # correlated: strategy, precision

    def state_dict(self) -> dict:
        """Everything needed to continue this run: model and optimizer state, the
        accountant's history, the live noise multiplier and clipping bound, and the keys
        of the sampler and the noise source (``None`` in secure mode: OS entropy cannot be
        replayed); with correlated noise, the noise's state (past noises). A secret, not a
        release: the keys replay the next steps' batches and noise and the correlated
        state holds past noises, so together with any model released later they give
        back un-noised gradients. Keep it as private as the data. Save it right after an
        optimizer step."""
        return {
            "format": _STATE_FORMAT,
            "mechanism": self._mechanism(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.original_optimizer.state_dict(),
            "noise_multiplier": self.optimizer.noise_multiplier,
            "max_grad_norm": self.optimizer.max_grad_norm,
            "accountant": self.accountant.state_dict(),
            "budget": self.budget.state_dict(),
            "sampler": sampler_state(self._sampler, self.data_loader.dataset),
            "noise": self.optimizer.noise.state_dict(),
            "correlated": (None if self.optimizer.correlated is None
                           else self.optimizer.correlated.state_dict()),
            "ledger": ledger_record(self.ledger_link, self.accountant.steps),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict` into this freshly made run.

        Raises
        ------
        ConfigurationError
            The state was made with a different mechanism (noise multiplier, sampling
            rate or scheme, clipping bound, loss reduction, accountant, world size), or
            this run has already taken steps (their privacy cost would be lost).
        ParameterValueError or ParameterTypeError
            The state is not one :meth:`state_dict` writes (an entry missing, of the wrong
            type, negative or NaN; the message names it). Nothing is loaded when this
            raises.
        """
        try:  # distributed: refused on every rank when one rank refuses
            self._check_state(state)
        except Exception as exc:  # noqa: BLE001 - raised again, on every rank
            error = exc
        else:
            error = None
        if self.plan.world_size > 1:  # every rank loads, or none
            saved = state.get("sampler") if isinstance(state, dict) else None
            self.optimizer._agree_on_load(error, saved.get("batches") if isinstance(
                saved, dict) else None)
        elif error is not None:
            raise error
        # the live values before the history (a run of one mechanism refuses a new noise
        # multiplier once it has steps), then the history: a state it refuses leaves the
        # run as it was
        opt, live = self.optimizer, (self.optimizer.max_grad_norm,
                                     self.optimizer.noise_multiplier)
        # the sampler's and the noise's states first (each refuses another sampler, or
        # another secure_mode, before changing itself), all undone if anything here fails
        was = (self._sampler.state_dict(), opt.noise.state_dict())
        try:
            self._sampler.load_state_dict(state["sampler"])
            opt.noise.load_state_dict(state["noise"] if self.config.seed is not None
                                      else fresh_noise_keys(state["noise"]))  # no replay
            opt.max_grad_norm = state["max_grad_norm"]
            opt.noise_multiplier = state["noise_multiplier"]
            self.accountant.load_state_dict(state["accountant"])
        except BaseException:
            opt.noise_multiplier, opt.max_grad_norm = 0.0, live[0]
            opt.noise_multiplier = live[1]
            self._sampler.load_state_dict(was[0])
            opt.noise.load_state_dict(was[1])
            raise
        self.model.load_state_dict(state["model"])
        self.optimizer.original_optimizer.load_state_dict(state["optimizer"])
        self.budget.load_state_dict(state["budget"])
        self._plan_after_prior()  # a history after earlier runs: the plan follows them
        take_over_on_load(self, state)  # the ledger charges the resumed run once
        if self.optimizer.correlated is not None:
            self.optimizer.correlated._load(state["correlated"])  # its history loaded

    def _check_state(self, state: dict) -> None:
        """:meth:`load_state_dict`'s refusals, before anything is changed."""
        if state_mapping(state, "state", RESUME_HINT).get("format") != _STATE_FORMAT:
            raise ParameterValueError("state is not a privlearn training state (format "
                                      f"{_STATE_FORMAT!r}); {RESUME_HINT}")
        if self.accountant.steps or self._sampler.delivered:
            raise ConfigurationError(
                f"load_state_dict needs a fresh run, but this one has already taken "
                f"{self.accountant.steps} steps (delivered {self._sampler.delivered} "
                "batches), whose cost would be lost; call it right after make_private")
        mine = self._mechanism()
        theirs = legacy_entries(entry(state, "mechanism", "state", RESUME_HINT, dict))
        diff = [f"{k}: saved {theirs.get(k)!r}, here {mine.get(k)!r}"
                for k in sorted(set(mine) | set(theirs)) if theirs.get(k) != mine.get(k)]
        ranks = ("" if (theirs.get("rank"), theirs.get("world_size"))
                 == (mine.get("rank"), mine.get("world_size")) else
                 " (each rank of a distributed run saves its own p.state_dict(), whose "
                 "sampler and noise keys are its own, and loads the one it saved, with as "
                 "many ranks as the run that saved them)")
        calibrated = self.config.target_epsilon is not None
        if diff:
            raise ConfigurationError("the saved state was made with a different mechanism, so its "
                             "privacy history does not describe this run: "
                             + "; ".join(diff) + ". Rebuild with make_private using the "
                             "original arguments" + ranks
                             + resume_hint(theirs, mine)
                             + longer_run_hint(theirs, mine, calibrated))
        check_parts(self, state)  # every part read, and refused, before any is loaded
        _check_loadable(self.model, self.optimizer.original_optimizer, state)
        check_take_over(self, state)  # its ledger record names this budget's reservation
        check_sampler_state(self._sampler, state["sampler"], self.data_loader.dataset)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a run is planned as (:func:`plan_run`).

    Attributes
    ----------
    rank, world_size : int
    dataset_size : int
    batch_size : float
        Per-rank (expected) batch size of the loader.
    sampling_rate : float
        q = world_size * batch_size / dataset_size.
    steps_per_epoch : int
    planned_steps : int or None
    noise_multiplier : float
        sigma (calibrated and rounded up for ``target_epsilon``).
    planned_epsilon : float or None
        epsilon of the planned steps at ``target_delta`` (``inf`` with
        ``noise_multiplier=0``); None when the run has no planned length (neither
        ``epochs`` nor ``steps`` given).
    max_grad_norm : float
        C (with per-layer clipping: ``sqrt(sum_k C_k^2)``).
    per_layer_bounds : tuple or None
        ``((name, C_k), ...)`` with per-layer clipping.
    adaptive : AdaptiveClipping or None
    run : NoisePlan
        How the steps are accounted (step by step, or one matrix-factorization mechanism
        with the run's strategy).
    expected_batch_size : float
        The normaliser of the noisy sum (expected examples, or units, per batch).
    units : UnitIndex or None
        Privacy units of several examples (users).
    """

    rank: int
    world_size: int
    dataset_size: int
    batch_size: float
    sampling_rate: float
    steps_per_epoch: int
    planned_steps: int | None
    noise_multiplier: float
    planned_epsilon: float | None
    max_grad_norm: float
    per_layer_bounds: tuple | None = None
    adaptive: AdaptiveClipping | None = None
    run: NoisePlan | None = None
    expected_batch_size: float = 0.0
    units: UnitIndex | None = None

    def adaptive_tuple(self):
        a = self.adaptive
        return None if a is None else (a.target_unclipped_quantile,
                                       a.clipbound_learning_rate, a.unclipped_num_std)


class _Undo(contextlib.AbstractContextManager):
    """Undo callbacks of a pipeline, run in reverse order when a step raises; those
    marked ``on_detach`` are also what :meth:`PrivateTraining.detach` runs."""

    def __init__(self):
        self.actions: list = []
        self.on_detach: list = []

    def __call__(self, fn, on_detach: bool = False) -> None:
        self.actions.append(fn)
        if on_detach:
            self.on_detach.append(fn)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            while self.actions:
                self.actions.pop()()
        return False


def prepare_model(model: nn.Module, optimizer, cfg: DPConfig, undo) -> nn.Module:
    """Check the model and optimizer, apply the registered module fixers when
    ``cfg.fix_model`` (undone if a later step refuses), refuse unsupported layers.
    Returns the model unwrapped from DDP."""
    check_ddp_wrapper(model)
    check_not_legacy_fsdp(model)
    inner = unwrap(model)
    if not isinstance(inner, nn.Module):
        raise ParameterTypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, DPOptimizer):
        raise ParameterTypeError(
            "optimizer is already the DPOptimizer of a private training run (p.optimizer "
            "of an earlier make_private): pass the plain torch optimizer over the model's "
            "parameters, after p.detach() if the same model is to be made private again")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ParameterTypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    _check_optimizer_step(optimizer)
    check_not_attached(inner)
    warn_unoptimised(inner, optimizer)
    refuse_untrainable(inner)
    refuse_global_hooks("make_private")
    refuse_parameter_hooks(inner, "make_private")
    refuse_post_accumulate_hooks(inner, "make_private")
    if not model.training:
        raise ParameterValueError("model is in eval mode (model.training is False); call "
                         "model.train() before make_private")
    if cfg.fix_model:
        undo(apply_fixers(inner))
    check_model(inner)
    return inner


def _cycle_and_rate(cfg: DPConfig, n: int, b: float, world: int, steps: int | None,
                    users: bool = False, given_cycle: int | None = None) -> tuple[int, float]:
    """The cycle length and sampling rate of the run ``cfg`` plans over ``n`` units in
    batches of ``b`` per rank (``steps``: the planned steps, which bound a default cycle
    of bands; ``given_cycle``: the cycle of a DP sampler given with the loader); the
    sampling rate checked to be in (0, 1]."""
    law = SAMPLINGS[cfg.sampling]
    held = cycle_bands(cfg.noise, cfg.bands, steps)
    cycle = cfg.cycle_length or given_cycle or default_cycle(cfg.noise, law, n, b, held)
    q = law.rate(world * b, n, cycle)
    if not 0 < q <= 1:
        source = ("" if cfg.cycle_length is not None or held is None or cycle != held
                  else f", the default cycle of noise={str(cfg.noise)[:60]!r} with {held} bands")
        raise ConfigurationError(f"sampling rate must be in (0, 1], got {q!r} (batch size {b}, "
                         f"{n} {'users' if users else 'examples'}, cycle {cycle}"
                         f"{source}); use a smaller batch_size or cycle_length"
                         + (" or bands" if source else ""))
    return cycle, q


def epoch_steps(cfg: DPConfig, units: int, batch_size: int, world: int = 1) -> int:
    """Steps in one epoch of the run ``cfg`` plans over ``units`` examples (or users) in
    batches of ``batch_size`` per process: the length of one pass over the private
    loader (:func:`make_private`'s ``len(p.data_loader)``), e.g. ``cycle_length``
    batches of ``balls_in_bins``, ``round(1 / q)`` of Poisson sampling. What a caller
    that plans by epochs (a Hugging Face Trainer's ``num_train_epochs``) multiplies."""
    law = SAMPLINGS[cfg.sampling]
    cycle, q = _cycle_and_rate(cfg, units, batch_size, world, None, cfg.users is not None)
    return law.per_epoch(q, cycle)


def plan_run(cfg: DPConfig, inner: nn.Module, data_loader: DataLoader,
             process_group=None) -> Plan:
    """The run's plan from the settings and the loader (no side effect)."""
    if not isinstance(data_loader, DataLoader):
        raise ParameterTypeError(f"data_loader must be a torch DataLoader, got "
                        f"{type(data_loader).__name__}")
    check_map_style(data_loader.dataset, cfg.users)
    if len(data_loader.dataset) == 0:
        raise ParameterValueError(
            "data_loader's dataset is empty (len(dataset) == 0): the sampling rate "
            "batch_size / len(dataset) is undefined and there is nothing to train on. Pass "
            "the loader of the training set")
    rank, world = world_info(process_group)
    single = [what for what, refused in (
        (f"sampling={cfg.sampling!r}", not SAMPLINGS[cfg.sampling].distributed),
        (f"noise={cfg.noise!r} (correlated noise)", not independent(cfg.noise)),
        ("users= (user-level privacy)", cfg.users is not None)) if refused] or (
        [f"sampling={cfg.sampling!r} with noise={cfg.noise!r}"] if cfg.correlated else [])
    if world > 1 and single:
        raise ConfigurationError(
            f"{' and '.join(single)} run{'s' if len(single) == 1 else ''} in one process "
            f"only, and this is rank {rank} of {world}; distributed training supports "
            f"sampling={' or '.join(repr(k) for k, v in SAMPLINGS.items() if v.distributed)}"
            " with DP-SGD noise (noise='dpsgd') and one example per privacy unit. Run it in "
            "one process, or leave those settings out under DDP/FSDP2")
    units = None
    if cfg.users is not None:
        if len(cfg.users) != len(data_loader.dataset):
            raise ParameterValueError(f"users must give the user of each of the "
                             f"{len(data_loader.dataset)} examples, got {len(cfg.users)}")
        units = UnitIndex(cfg.users, cfg.max_examples_per_user)
        rows = max(min(len(m), units.max_examples) for m in units.members)
        if cfg.max_physical_batch_size is not None and rows > cfg.max_physical_batch_size:
            raise ConfigurationError(
                f"a drawn user can bring {rows} rows to a batch (max_examples_per_user="
                f"{units.max_examples}; the largest user has {max(map(len, units.members))} "
                f"examples), more than max_physical_batch_size={cfg.max_physical_batch_size}"
                ": a user's rows are clipped together, so they must fit in one physical "
                f"chunk. Pass max_physical_batch_size >= {rows} or lower "
                "max_examples_per_user")
    n = len(data_loader.dataset) if units is None else units.n_units
    # one of privlearn's DP samplers given: (batch size, cycle, rate) of what it draws
    given = _given_dp_sampling(data_loader, cfg.sampling, cfg.cycle_length,
                               len(data_loader.dataset), world)
    b = given[0] if given else _accountable_batch_size(data_loader, cfg.sampling,
                                                       len(data_loader.dataset), world)
    law = SAMPLINGS[cfg.sampling]  # the registry entry: the sampler and its law
    cycle, q = _cycle_and_rate(cfg, n, b, world, cfg.steps, units is not None,
                               given[1] if given else None)
    if given and units is None and math.isclose(q, given[2], rel_tol=1e-12):
        q = given[2]  # the sampler's own rate, not its round trip through the batch size
    if units is not None:
        _warn_user_rate(data_loader, len(data_loader.dataset), n, q, stacklevel=3)
    warn_if_delta_large(cfg.target_delta, n, name="target_delta", stacklevel=4,
                        default=DPConfig.target_delta)
    if cfg.check_batch_independence:  # the examples on dimension 0 of every batch
        check_batch_first(data_loader, law)
    _warn_drop_last(data_loader, law, stacklevel=3)
    _warn_loader_generator(data_loader, cfg, stacklevel=3)
    per_epoch = law.per_epoch(q, cycle)
    _check_given_sampler(data_loader, len(data_loader.dataset), cfg.secure_mode, per_epoch,
                         rank, world)
    planned = cfg.steps if cfg.steps is not None else (
        cfg.epochs * per_epoch if cfg.epochs is not None else None)
    run = NoisePlan.build(cfg.noise, cfg.sampling, n, q, cycle, planned, cfg.bands,
                          cfg.buffers, show_progress=cfg.show_progress, stacklevel=4,
                          noise_precision=run_precision(cfg.secure_mode, inner))
    nm = cfg.noise_multiplier
    if cfg.target_epsilon is not None:
        nm = run.calibrate(cfg.target_epsilon, cfg.target_delta, cfg.accountant, planned,
                           show_progress=cfg.show_progress)
    bounds, c = None, cfg.max_grad_norm
    if cfg.clipping == "per_layer":
        bounds = tuple(_per_layer_bounds(inner, cfg.max_grad_norm).items())
        c = math.sqrt(sum(v * v for _, v in bounds))
    adaptive = None
    if cfg.clipping == "adaptive":
        sb = cfg.unclipped_num_std if cfg.unclipped_num_std is not None else world * b / 20.0
        gradient_noise_multiplier(nm, sb)  # sigma < 2 sigma_b, before any step
        adaptive = AdaptiveClipping(float(cfg.target_unclipped_quantile),
                                    float(cfg.clipbound_learning_rate), float(sb))
    eps = cfg.target_epsilon
    if eps is None and planned is not None and nm > 0:
        eps = run.mechanism(nm, planned).epsilon(cfg.target_delta, accountant=cfg.accountant)
    elif eps is None and planned:
        eps = math.inf  # steps without noise release their gradients as they are
    expected = (world * b if not law.cycled else law.expected_batch(q, n, cycle))
    plan = Plan(rank=rank, world_size=world, dataset_size=n, batch_size=b, sampling_rate=q,
                steps_per_epoch=per_epoch, planned_steps=planned, noise_multiplier=float(nm),
                planned_epsilon=eps, max_grad_norm=float(c), per_layer_bounds=bounds,
                adaptive=adaptive, run=run, expected_batch_size=float(expected), units=units)
    warn_if_dpsgd_better(cfg, plan, given[1] if given else None, stacklevel=3)
    return plan


#: settings that may differ between ranks: neither the mechanism nor its accounting
#: depends on them (the physical chunking, the ledger's reservation size) or they are not
#: comparable between processes (callables; per-example users are refused when distributed)
_PER_RANK_SETTINGS = frozenset({"max_physical_batch_size", "ledger_chunk", "augment", "users",
                                "show_progress", "agreement_timeout"})


def _run_fingerprint(cfg: DPConfig, plan: Plan, inner: nn.Module, data_loader: DataLoader,
                     resume: dict | None, optimizer, grad_scaler=None) -> dict:
    """What the ranks must agree on: settings, mechanism, data, model, optimizer, resume,
    fp16's ``grad_scaler`` given (each rank's own scaling and skipped steps)."""
    from dataclasses import fields

    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)
           if f.name not in _PER_RANK_SETTINGS}
    out.update({
        "dataset size": plan.dataset_size, "per-rank batch size": plan.batch_size,
        "sampling rate": plan.sampling_rate, "planned noise multiplier": plan.noise_multiplier,
        "planned clipping bound": plan.max_grad_norm, "steps per epoch": plan.steps_per_epoch,
        "planned steps": plan.planned_steps, "planned epsilon": plan.planned_epsilon,
        "expected batch size": plan.expected_batch_size, "resume given": resume is not None,
        "grad_scaler given": grad_scaler is not None,
        "optimizer": optimizer_settings(optimizer)})
    # the whole dataset on every rank (not a shard of its own); its contents if cheap to read
    out["dataset"] = (type(data_loader.dataset).__name__, len(data_loader.dataset))
    out["dataset contents"] = Unshown(dataset_digest(data_loader.dataset))  # a hash of data
    out["trainable parameters"] = [(n, tuple(p.shape)) for n, p in inner.named_parameters()
                                   if p.requires_grad]
    out["parameters"] = [(n, tuple(p.shape), str(p.dtype)) for n, p in inner.named_parameters()]
    # sync_replicas broadcasts the buffers too: one list of them on every rank
    out["buffers"] = [(n, tuple(b.shape), str(b.dtype)) for n, b in inner.named_buffers()]
    return out


def attach_engine(model: nn.Module, inner: nn.Module, cfg: DPConfig, undo,
                  sharded: bool = False) -> GradSampleTracker:
    """The recording hooks (and a DDP model's synchronisation switched off: the engine
    all-reduces the noisy sums itself); each undone on failure and by ``detach()``.
    ``sharded``: an FSDP2 model (:mod:`privlearn.torch.fsdp`)."""
    for restore in (quiet_ddp(model), refuse_join(model),  # DDP: no reduction, no buffer
                    ignore_buffers_later(inner)):  # broadcast (a later wrapper's neither),
        if restore is not None:                    # no uneven inputs
            undo(restore, on_detach=True)
    kwargs = dict(loss_reduction=cfg.loss_reduction, batch_dims=cfg.batch_dims,
                  check_independence=cfg.check_batch_independence)
    if sharded:
        tracker = ShardedTracker(inner, process_group=_mesh_group(inner), **kwargs)
    else:
        tracker = GradSampleTracker(inner, **kwargs)
    undo(tracker.detach, on_detach=True)
    tracker.batch_size_private = SAMPLINGS[cfg.sampling].relation.value == "add_remove"  # probe
    undo(_join_guard.watch(inner, tracker).remove, on_detach=True)  # nor a later wrapper's
    undo(_buffer_writes.watch(inner, tracker, not sharded).remove, on_detach=True)
    if cfg.loss_reduction == "mean":
        hooks = _guard_token_level_labels(inner)
        undo(lambda: [h.remove() for h in hooks], on_detach=True)
    return tracker


def build_optimizer(optimizer, tracker: GradSampleTracker, data_loader: DataLoader,
                    cfg: DPConfig, plan: Plan, link, process_group=None, *,
                    grad_scaler=None, sharded: ShardedGradients | None = None):
    """The DP loader, accountant, budget cap, noise source and optimizer:
    ``(dp_optimizer, loader, accountant, budget)``. ``grad_scaler``: the GradScaler of
    fp16 training; ``sharded``: the FSDP2 gradient exchange (None: replicated
    parameters)."""
    seed = None if cfg.seed is None else cfg.seed + 1_000_003 * plan.rank
    shared = (_shared_seed(cfg.seed, process_group)
              if cfg.sampling == "fixed" and plan.world_size > 1 else None)
    loader = make_dp_loader(data_loader, sampling=cfg.sampling,
                            sampling_rate=plan.sampling_rate, batch_size=int(plan.batch_size),
                            steps=plan.steps_per_epoch, rank=plan.rank,
                            seed=given_sampler_seed(data_loader, cfg, seed, plan.world_size, 4),
                            world_size=plan.world_size, secure=cfg.secure_mode,
                            shared_seed=shared, cycle_length=plan.run.cycle,
                            units=plan.units, stacklevel=5)  # (+1: its renaming wrapper)
    acct = PrivacyAccountant(scheme=SAMPLINGS[cfg.sampling].scheme or cfg.sampling,
                             accountant=cfg.accountant, run=plan.run)
    if plan.planned_epsilon is None and plan.run.stepwise and plan.noise_multiplier > 0:
        # nothing was accounted yet: account one step now, so that an accountant unable to
        # describe this run's steps is refused before training, not at the first epsilon()
        acct.epsilon(cfg.target_delta, extra=Segment(plan.noise_multiplier,
                                                     plan.sampling_rate, 1.0, 1))
    budget = budget_cap(cfg, plan, acct)
    noise = NoiseSource(secure_mode=cfg.secure_mode, seed=None if seed is None else seed + 7)
    per_param = None
    if plan.per_layer_bounds is not None:
        by_name = dict(tracker.model.named_parameters())
        per_param = {id(by_name[n]): c / plan.max_grad_norm for n, c in plan.per_layer_bounds}
    opt = DPOptimizer(optimizer, tracker, noise_multiplier=plan.noise_multiplier,
                      max_grad_norm=plan.max_grad_norm,
                      expected_batch_size=plan.expected_batch_size, accountant=acct,
                      noise=noise, sampler=loader.batch_sampler, world_size=plan.world_size,
                      process_group=process_group, adaptive=plan.adaptive, budget=budget,
                      ledger=link, grad_scaler=grad_scaler,
                      correlated=plan.run.noise_transform(),  # None: C is the identity
                      unit_reduction=cfg.user_reduction,
                      augmentation=cfg.augmentation_multiplicity,
                      per_param_clipping=per_param, sharded=sharded)
    loader.on_restart = opt.abandon_pass
    if cfg.max_physical_batch_size is not None:
        loader = VirtualBatchLoader(loader, cfg.max_physical_batch_size, opt)
    if cfg.augment is not None:
        loader = AugmentedLoader(loader, cfg.augment, cfg.augmentation_multiplicity,
                                 tracker=tracker if cfg.check_batch_independence else None)
    return opt, loader, acct, budget


class _Required:
    """The default of make_private's three required arguments: their absence is reported
    with the misnamed keywords that explain it (Opacus's ``module=``), as a typed error."""

    def __repr__(self) -> str:
        return "<required>"


_REQUIRED = _Required()


def make_private(
    model: nn.Module = _REQUIRED, optimizer: torch.optim.Optimizer = _REQUIRED,
    data_loader: DataLoader = _REQUIRED, config: DPConfig | None = None, *, ledger=None,
    process_group=None, grad_scaler=None, resume: dict | None = None, **settings,
) -> PrivateTraining:
    """Make ``model``/``optimizer``/``data_loader`` train with DP-SGD (Abadi et al. 2016,
    "Deep Learning with Differential Privacy", Algorithm 1).

    ``model`` (in training mode; may be wrapped in DistributedDataParallel),
    ``optimizer`` (over its parameters) and ``data_loader`` (``DataLoader(dataset,
    batch_size=B)``, no shuffle, no sampler: B sets the sampling rate ``q = W B / N``)
    are used as they are. The settings are the fields of
    :class:`~privlearn.torch.config.DPConfig` (documented there), given either as keywords
    (``make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0)``, as the
    signature shows) or as one ``config`` (``make_private(model, opt, loader,
    DPConfig(noise_multiplier=1.0))``), not both. ``ledger``: a budget of
    a persistent privacy ledger (``Ledger(path).budget(dataset)``), in which the planned
    run is reserved before any data is read. ``process_group``: the torch.distributed
    group (default: the world, when initialised). ``grad_scaler``: the
    ``torch.amp.GradScaler`` of fp16 training (``scaler.step(p.optimizer)``).
    ``resume``: a :meth:`PrivateTraining.state_dict` to continue, loaded into the run;
    with ``ledger``, a planned run takes over the checkpoint's reservation instead of
    reserving the plan again (``p.load_state_dict`` alone reserves first), charged once.

    Returns
    -------
    PrivateTraining

    Raises
    ------
    ValueError or TypeError
        Bad settings, a model in eval mode, unsupported layers (all listed), a loader
        whose sampling cannot be accounted; always before any step, with the user's
        objects left as they were.
    """
    cfg = None
    with _Undo() as undo:
        try:
            cfg = _config(config, settings,
                          dict(model=model, optimizer=optimizer, data_loader=data_loader))
            inner = prepare_model(model, optimizer, cfg, undo)
            plan = plan_run(cfg, inner, data_loader, process_group)
            sharded = is_sharded(inner)
            if sharded:  # FSDP2: refused up front unless the sharded step is exact
                check_sharded_model(inner, cfg, plan.world_size, optimizer)
                if grad_scaler is not None:
                    raise ConfigurationError(
                        "grad_scaler is not supported under FSDP2 (fully_shard); use FSDP2's "
                        "MixedPrecisionPolicy(param_dtype=torch.bfloat16), which needs no "
                        "loss scaling")
        except Exception as exc:  # refused here: on every rank, at once (not at a timeout)
            check_same_on_ranks({}, process_group, refusal_timeout(cfg, config, settings),
                                error=exc)
            raise
        if plan.world_size > 1:  # one global mechanism: the same settings on every rank
            check_same_on_ranks(_run_fingerprint(cfg, plan, inner, data_loader, resume,
                                                 optimizer, grad_scaler),
                                process_group, cfg.agreement_timeout)
        link = reserve_budget(ledger, cfg, plan, inner, undo, process_group, resume)
        tracker = attach_engine(model, inner, cfg, undo, sharded=sharded)
        exchange = ShardedGradients(_mesh_group(inner)) if sharded else None
        opt, loader, acct, budget = build_optimizer(optimizer, tracker, data_loader, cfg,
                                                    plan, link, process_group,
                                                    grad_scaler=grad_scaler, sharded=exchange)
        undo(opt.guard_original(), on_detach=True)
        if sharded and (met := _forward_meet.watch(inner, opt)) is not None:
            undo(met.remove, on_detach=True)  # FSDP2: ranks meet at a step's first forward
        if plan.world_size > 1:  # replicas start from rank 0's weights (FSDP2: buffers)
            sync_replicas(inner, process_group, warn_as="make_private", parameters=not sharded)
    return load_resume(PrivateTraining(model=model, optimizer=opt, data_loader=loader,
                                       accountant=acct, budget=budget, plan=plan, config=cfg,
                                       ledger_link=link, undo=undo.on_detach), resume)


#: make_private's own arguments before the settings.
_ARGUMENTS = ("model", "optimizer", "data_loader")


def _config(config: DPConfig | None, settings: dict, arguments: dict) -> DPConfig:
    """The run's :class:`DPConfig`: ``config``, or one made of the keyword settings;
    ``arguments`` (make_private's own, by name) must all have been given."""
    unknown = sorted(set(settings) - set(DPConfig.names()))
    missing = [k for k, v in arguments.items() if v is _REQUIRED]
    if unknown or missing:
        raise unknown_settings_error("make_private", unknown, missing=missing,
                                     arguments=_ARGUMENTS)
    if config is None:
        return DPConfig(**settings)
    if not isinstance(config, DPConfig):
        raise ParameterTypeError(
            f"config must be a privlearn.torch.DPConfig, got {type(config).__name__}; pass "
            "the settings as keywords or as DPConfig(...)")
    if settings:
        raise ParameterValueError(
            f"make_private got config= and the settings {sorted(settings)}: give the "
            "settings either as one DPConfig or as keywords (dataclasses.replace(config, "
            "...) makes a modified copy)")
    return config


def _signature(fn) -> inspect.Signature:
    """``fn``'s signature with ``**settings`` spelled out as DPConfig's fields (what
    help(), IDEs and the API reference show), before its own keyword-only arguments."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    first = [p.replace(default=p.empty) if p.default is _REQUIRED else p
             for p in params if p.kind is not p.KEYWORD_ONLY]
    return sig.replace(parameters=[*first, *DPConfig.parameters(),
                                   *(p for p in params if p.kind is p.KEYWORD_ONLY)])


make_private.__signature__ = _signature(make_private)
