"""The DP optimizer: clip and accumulate, add noise, scale, step, account.

Wraps any ``torch.optim.Optimizer``. One logical step is (Abadi et al. 2016, "Deep
Learning with Differential Privacy", Algorithm 1):

1. **clip and accumulate**: per-example gradients ``g_i`` (norm over all parameters) are
   scaled by ``c_i = min(1, C / ||g_i||)`` and summed (:class:`GradSampleTracker`);
2. **noise**: ``N(0, (sigma C)^2)`` is added to every coordinate of the sum, once per
   logical step (after the last physical chunk of a virtual batch);
3. **scale**: the noisy sum is divided by the *expected* batch size ``q N`` (Poisson) or
   the fixed batch size: the realised size of a Poisson batch is private and is never
   used for normalisation;
4. **step**: the wrapped optimizer updates the parameters from ``p.grad``;
5. **account**: the accountant records one step, with the noise multiplier, sampling
   rate and clipping bound that step used.

One source of truth: ``noise_multiplier`` and ``max_grad_norm`` are read by the step
itself and handed to the accountant with each step, so a schedule that changes them
between steps (``optimizer.noise_multiplier = 0.8``) is recorded as a new segment of the
history, never missed. The sampling rate is the (read-only) rate of the sampler that drew
the batches. Each logical step must use a batch drawn from the private loader
(``p.data_loader``): a step without a new batch from it (batches from another loader, or
a second ``step()`` for one batch) is refused.

In distributed training (``world_size > 1``) each rank clips its own examples and adds
``N(0, (sigma C)^2 / world_size)``; the sums are all-reduced, so the total noise is
``N(0, (sigma C)^2)`` on the global sum, exactly the single-process mechanism.

Adaptive clipping (``adaptive=AdaptiveClipping(...)``; Andrew, Thakkar, McMahan &
Ramaswamy 2021, "Differentially Private Learning with Adaptive Clipping", NeurIPS,
Algorithm 1 with the geometric update): every step also releases the noisy *centred*
count of examples whose norm is within the bound, ``K = sum_i (1[||g_i|| <= C] - 1/2) +
N(0, sigma_b^2)``, estimates the unclipped fraction ``b = K / m + 1/2`` (``m`` the expected
batch size) and sets ``C <- C exp(-eta (b - gamma))`` for the next step. Centring makes the
count's add/remove sensitivity 1/2 (as in the paper and in TensorFlow Privacy's quantile
estimator). The pair (clipped sum, count) is then one Gaussian mechanism:
with per-example contributions rescaled by the noise stds, each example moves the
vector by at most ``sqrt((C / (sigma_g C))^2 + ((1/2) / sigma_b)^2)``, so with the gradient
noise multiplier ``sigma_g = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` the step is exactly the
Gaussian mechanism of multiplier ``sigma`` (the noise split of Andrew et al. 2021, also
TensorFlow Federated's ``adaptive_clip_noise_params``), which is what the accountant
records. This needs ``sigma < 2 sigma_b`` (checked). The same holds for replace-one
neighbours (fixed-size sampling): every example's rescaled contribution lies in a ball of
radius ``1 / sigma``, which is all the subsampled Gaussian analysis uses.

fp16 dynamic loss scaling (``torch.amp.GradScaler``, given to ``make_private(...,
grad_scaler=scaler)``): the optimizer sets ``_step_supports_amp_scaling``, so
``scaler.step(optimizer)`` hands it the current scale and calls :meth:`DPOptimizer.step`
directly, which

* divides the recorded per-example gradients by the scale before clipping (as a static
  ``tracker.loss_scale``), so the clip bound and the noise refer to the unscaled loss;
* leaves out of the clipped sum every example whose scaled gradient overflowed (it
  contributes zero, see :meth:`GradSampleTracker.clipped_sum`; a
  :class:`~privlearn.errors.GradientOverflowWarning` says how many): one example's
  overflow neither skips the step nor lowers the scale. Only an overflow: an example
  whose *input* holds a NaN, or a non-finite gradient in a step without loss scaling,
  is refused with :class:`~privlearn.errors.NonFiniteInputError` naming the
  input and the row (bad data is the caller's to see and clean, never dropped
  silently);
* reports to the scaler, as its ``found_inf``, whether the final *noisy* gradient is
  finite, and skips the parameter update when it is not. The scaler's decisions (skip,
  back-off, growth) are thereby post-processing of the released noisy gradient; the
  ``found_inf`` GradScaler computed from ``p.grad`` before the step is ignored (the DP
  step has not made the gradients yet). A step skipped this way consumed its batch and
  released a noisy gradient: it is accounted.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.amp import GradScaler

from privlearn import _validation as _v
from privlearn.errors import ConfigurationError, ParameterValueError, TrainingLoopError
from privlearn.torch._adaptive import AdaptiveClipping, gradient_noise_multiplier, next_clip_bound
from privlearn.torch._agree import StepAgreement
from privlearn.torch._amp import LossScaling
from privlearn.torch._grad_views import BufferViews
from privlearn.torch._grad_views import sole_owner as _sole_owner
from privlearn.torch._optimizer_api import OptimizerDelegation, guard_run_state
from privlearn.torch._rows import flat_views
from privlearn.torch._secure_correlated import secure_correlated_into
from privlearn.torch._step_checks import StepChecks
from privlearn.torch.accountant import BudgetCap, LedgerLink, PrivacyAccountant
from privlearn.torch.config import scalar_setting as _scalar
from privlearn.torch.noise import NoiseSource
from privlearn.torch.tracker import GradSampleTracker
from privlearn.torch.units import RowUnits

__all__ = ["AdaptiveClipping", "DPOptimizer", "gradient_noise_multiplier"]


class DPOptimizer(StepChecks, StepAgreement, LossScaling, OptimizerDelegation):
    """Drop-in wrapper of a torch optimizer performing DP-SGD steps.

    Use ``zero_grad()``, ``step()``, ``param_groups``, ``state``, ``state_dict()`` as with
    the wrapped optimizer. Built by :func:`privlearn.torch.make_private`. A
    ``torch.optim.Optimizer`` (the wrapped one's groups, state and defaults,
    :mod:`privlearn.torch._optimizer_api`): learning-rate schedulers, step hooks
    (``register_step_pre_hook``, run around the DP step) and state-dict hooks take it as
    they take the wrapped optimizer.

    Attributes
    ----------
    original_optimizer : torch.optim.Optimizer
    noise_multiplier : float
        sigma used by the next step; may be changed between steps (a noise schedule):
        each step records the value it used in the accountant.
    max_grad_norm : float
        Clipping bound used by the next step (recorded likewise).
    expected_batch_size : float
    last_grad_norms : tensor or None
        Exact per-example norms (before clipping) of the last batch: unaccounted, never log.
    sampler : PoissonBatchSampler or FixedSizeBatchSampler
        The sampler whose batches the steps consume (its rate is what is accounted;
        read-only, as are ``sampling_rate`` and ``expected_batch_size``).
    budget : BudgetCap or None
        Checked before every step (``max_epsilon``), told after it (planned epsilon).
    ledger : LedgerLink or None
        The run's reservations in a persistent privacy ledger.
    adaptive : AdaptiveClipping or None
        Adaptive clipping settings (None: the bound only changes when set).
    last_unclipped_fraction : float or None
        Adaptive clipping: the noisy estimate ``b`` of the last step (a released value).
    last_overflow_count : int
        Examples of the last logical batch left out of the clipped sum because their
        (loss-scaled) gradient was not finite (shown to the person running the loop, not
        released). Counted on the device; a step driven by a ``GradScaler`` reads it
        back and warns (:class:`~privlearn.errors.GradientOverflowWarning`), any other
        step keeps it there until this attribute is read (no host synchronisation).
    last_step_skipped : bool
        Whether the last step driven by a ``GradScaler`` left the parameters unchanged
        because the noisy gradient was not finite (the step is accounted all the same).
    grad_scaler : torch.amp.GradScaler or None
        The GradScaler driving the steps (``scaler.step(optimizer)``).
    correlated : CorrelatedNoise or None
        Matrix-factorization noise (None: independent noise, DP-SGD).
    unit_reduction : {"mean", "sum"}
        How a privacy unit's row gradients are combined before clipping.
    augmentation : int or None
        K augmented views per example, arriving as K consecutive rows.
    per_param_clipping : dict or None
        Per-layer clipping weights ``id(p) -> w_p`` (None: flat clipping).
    sharded : ShardedGradients or None
        The FSDP2 gradient exchange (None: replicated parameters).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tracker: GradSampleTracker, *,
                 noise_multiplier: float, max_grad_norm: float, expected_batch_size: float,
                 accountant: PrivacyAccountant, noise: NoiseSource, sampler,
                 world_size: int = 1, process_group=None,
                 adaptive: AdaptiveClipping | None = None, budget: BudgetCap | None = None,
                 ledger: LedgerLink | None = None, grad_scaler: GradScaler | None = None,
                 correlated=None, unit_reduction: str = "mean",
                 augmentation: int | None = None, per_param_clipping: dict | None = None,
                 sharded=None):
        self.original_optimizer = optimizer
        self._init_optimizer_api()
        self.tracker = tracker
        self._noise_multiplier = 0.0
        self._max_grad_norm = 1.0
        self.adaptive = adaptive
        self._centred_count = 0.0  # sum_i (1[||g_i|| <= C] - 1/2) of the logical batch
        self._grads_discarded = False  # zero_grad() cleared a backward pass before step()
        self.last_unclipped_fraction = None
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self._expected_batch_size = float(expected_batch_size)
        self.accountant = accountant
        self._sampler = sampler
        self._sampling_rate = float(sampler.sampling_rate)
        self.budget = budget
        self.ledger = ledger
        #: turns each step's draw into ``(C^{-1} z)_t`` (None: independent noise)
        self.correlated = correlated
        #: the ``torch.amp.GradScaler`` that drives the steps (``scaler.step(optimizer)``),
        #: told whether each noisy gradient was finite
        self.grad_scaler = grad_scaler
        self.noise = noise
        self.world_size = int(world_size)
        self.process_group = process_group
        self.sharded = sharded
        self._init_agreement()  # ranks refuse a step together (privlearn.torch._agree)
        self._chunk_refusal = None  # why a chunk of the open logical batch was refused
        #: the flat gradient buffers, one per device and dtype of the parameters (last
        #: step's, reused when nobody holds them any more)
        self._buffers: list[torch.Tensor] = []
        #: their parameters' views, kept with them (:mod:`privlearn.torch._grad_views`)
        self._views: list[BufferViews] = []
        self._flat_views: dict = {}
        #: ``id(p) -> view`` of the buffers while a logical batch is open (its clipped
        #: sums, or this step's noise, are in them); None between logical batches
        self._out: dict[int, torch.Tensor] | None = None
        #: the open batch's sums of the parameters of before a change of the trained set
        self._carry: dict[int, torch.Tensor] = {}
        self._final_chunk = True  # the next step() ends a logical batch
        self._skipping = False  # the rest of a logical batch refused at one of its chunks
        self._chunk_size: int | None = None  # examples of the next physical chunk
        self._chunk_groups: tuple | None = None  # its privacy units' row counts
        self._chunk_serial = 0  # counts the physical chunks announced by the loader
        #: the delivered batch whose clipped sums are open in the buffers, and the
        #: physical chunks of it already added (None: the whole batch, no chunking)
        self._open_batch = None
        self._open_chunks: set = set()
        #: privacy units of several rows (:mod:`privlearn.torch.units`): "sum" or "mean"
        #: of a unit's row gradients (users drawn by a sampler with a ``UnitIndex``), and
        #: ``augmentation`` K: each example arrives as K consecutive rows (augmented views,
        #: laid out by the loader, :class:`~privlearn.torch.data.AugmentedLoader`)
        self.unit_reduction = unit_reduction
        self.augmentation: int | None = augmentation
        self.last_grad_norms = None
        #: ``id(p) -> w_p`` (``sum w_p^2 = 1``): ``p`` clipped to ``w_p * max_grad_norm``
        self.per_param_clipping: dict | None = per_param_clipping
        self._layout_version = -1
        self._sync_params()
        self._dynamic_scale = 1.0  # GradScaler's scale during a step it drives
        self._overflowed = 0  # examples dropped (overflow) in the logical batch so far
        self._last_overflow = 0
        self.last_step_skipped = False
        self._warned_unscale = False
        self._stepping_original = False

    # ------------------------------------------------------------------ live parameters
    @property
    def noise_multiplier(self) -> float:
        """sigma of the next step (noise std = sigma * max_grad_norm on the clipped sum)."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        v = _v.check_nonnegative(
            "noise_multiplier", _scalar(value),
            hint="the noise std divided by max_grad_norm, e.g. 1.0 (0 trains without noise "
                 "and is not private)")
        if v > 0 and math.isinf(self._max_grad_norm):
            raise ConfigurationError("noise_multiplier > 0 with max_grad_norm=inf is not private "
                             "(unbounded sensitivity); set a finite max_grad_norm first")
        if self.adaptive is not None:
            gradient_noise_multiplier(v, self.adaptive.unclipped_num_std)  # checks
        whole = getattr(getattr(self, "accountant", None), "run", None)  # one mechanism
        if whole is not None and v != self._noise_multiplier and self.accountant.steps:
            raise ConfigurationError(
                f"noise_multiplier cannot change during a correlated-noise run or one of sampling"
                f"={whole.sampling!r}: its {self.accountant.steps} steps and the rest are one "
                f"mechanism of noise multiplier {self._noise_multiplier!r} (kept), got {v!r}; "
                "plan another with make_private")
        self._noise_multiplier = v

    @property
    def gradient_noise_multiplier(self) -> float:
        """Noise multiplier of the clipped gradient sum: ``noise_multiplier`` with flat
        clipping; with adaptive clipping the part of it left after the count's noise,
        ``(sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` (see the module docstring)."""
        if self.adaptive is None:
            return self._noise_multiplier
        return gradient_noise_multiplier(self._noise_multiplier,
                                         self.adaptive.unclipped_num_std)

    @property
    def max_grad_norm(self) -> float:
        """Clipping bound C of the next step."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        v = _v.check_positive(
            "max_grad_norm", _scalar(value), allow_inf=True,
            hint="the per-example clipping bound, e.g. 1.0")
        if math.isinf(v) and self._noise_multiplier > 0:
            raise ConfigurationError("max_grad_norm=inf (no clipping) leaves the sensitivity "
                             "unbounded; only allowed with noise_multiplier=0")
        if v != self._max_grad_norm and (getattr(self, "_out", None) is not None
                                         or getattr(self, "_carry", None)):
            raise TrainingLoopError(  # a lower bound would under-noise the earlier chunks
                f"max_grad_norm cannot change from {self._max_grad_norm!r} to {v!r} between "
                "the physical chunks of a logical batch (max_physical_batch_size): its "
                "earlier chunks were clipped at the old bound, while the noise and the "
                "accountant would use the new one. Change it after the logical batch's last "
                "step() (a step post-hook of p.optimizer runs once per update). Nothing "
                "was changed")
        self._max_grad_norm = v

    @property
    def sampling_rate(self) -> float:
        """q of the sampler whose batches the steps consume (read-only: the sampler draws
        with it and the accountant records it)."""
        return self._sampling_rate

    @sampling_rate.setter
    def sampling_rate(self, value) -> None:
        raise AttributeError(
            "sampling_rate cannot be changed: it is the rate at which p.data_loader draws "
            "its batches, and the accountant records the rate of the sampler that drew "
            "them. Build a new run with make_private (a loader of another batch_size) to "
            "train at another rate")

    @property
    def expected_batch_size(self) -> float:
        """q N, the normaliser of the noisy sum (read-only, like the sampling rate)."""
        return self._expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value) -> None:
        raise AttributeError("expected_batch_size is sampling_rate x dataset size and cannot "
                             "be changed after make_private")

    @property
    def sampler(self):
        """The sampler whose batches the steps consume (read-only)."""
        return self._sampler

    # ------------------------------------------------------------------ delegation
    def add_param_group(self, group) -> None:
        """Add a parameter group of the model's own parameters (progressive unfreezing:
        they are clipped and noised with the others once they require gradients).

        Raises
        ------
        ValueError
            A parameter of the group is not a parameter of the model: its gradient could
            not be clipped per example.
        """
        params = group["params"]  # read once: a generator (module.parameters()) is then spent
        params = group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        owned = {id(q) for q in self.tracker.model.parameters()}
        foreign = [tuple(q.shape) for q in params if id(q) not in owned]
        if foreign:
            raise ParameterValueError(
                f"add_param_group: {len(foreign)} parameter(s) (shapes {foreign[:3]}) are not "
                "parameters of the model given to make_private, so their gradients cannot be "
                "clipped per example and would be released un-noised. Make them parameters "
                "of a module of the model, or keep them out of the optimizer")
        self.original_optimizer.add_param_group(group)

    def __repr__(self) -> str:
        return (f"DPOptimizer({self.original_optimizer.__class__.__name__}, "
                f"noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm})")

    # ------------------------------------------------------------------ DP step
    def _expect_chunk(self, size: int, final: bool, groups: tuple | None = None) -> None:
        """The next ``step()`` trains on a physical chunk of ``size`` examples (in units of
        ``groups`` rows each, if given), the last of its logical batch when ``final``
        (told by :class:`~privlearn.torch.data.VirtualBatchLoader`)."""
        self._chunk_size = int(size)
        self._chunk_groups = groups
        self._final_chunk = bool(final)
        self._chunk_serial += 1

    def _units_and_rows(self, drawn, examples: int | None):
        """The privacy units of this physical step's rows and the number of rows the
        layers must have seen (None: no check), from the delivered batch."""
        groups = self._chunk_groups if self._chunk_size is not None else (
            None if drawn is None else drawn.groups)
        if groups is not None:
            return RowUnits.from_sizes(groups, self.unit_reduction, self._device()), examples
        if self.augmentation is not None and examples is not None:
            k = self.augmentation
            return RowUnits.repeated(examples, k, "mean", self._device()), examples * k
        return None, examples

    def _begin_logical_batch(self, why: str | None = None) -> None:
        """A new logical batch begins: the clipped sums of an unfinished one (the loop
        was left between its chunks, or ``why``) are discarded, never released."""
        self._skipping, self._centred_count, self._chunk_refusal = False, 0.0, None
        if self._out is not None or self._carry:
            self._out, self._carry = None, {}
            warnings.warn(
                (why or "a logical batch was left unfinished (the loop stopped between its "
                 "physical chunks); the clipped sums of its chunks were discarded and "
                 "nothing of it was released. Finish every logical batch of "
                 "p.data_loader before leaving the loop to use all of it"),
                RuntimeWarning, stacklevel=4)

    def abandon_pass(self, dropped) -> None:
        """A new pass over the loader began: batches delivered by the last pass that no
        step used (and anything computed from them) are dropped. The loader's
        ``on_restart`` callback (:class:`~privlearn.torch.data.DPDataLoader`)."""
        self._begin_logical_batch()
        self._final_chunk, self._chunk_size = True, None
        if dropped:
            self.tracker.clear()

    def _sync_params(self) -> None:
        """Follow the tracker's parameters (they change when parameters are unfrozen or
        frozen after make_private, and move when the model is moved or cast after it:
        ``p.model.to(device)``, ``p.model.double()``)."""
        version = (self.tracker.version,
                   tuple((q.device, q.dtype) for q in self.tracker.params))
        if self._layout_version == version:
            return
        if self._layout_version != -1 or self.tracker.version:  # parameters replaced?
            self._layout_version = version
            self._check_held()
        self._layout_version = version
        self._numels = [p.numel() for p in self.tracker.params]
        self._numel = sum(self._numels)
        groups: dict[tuple, list[int]] = {}
        for i, q in enumerate(self.tracker.params):
            groups.setdefault((q.device, q.dtype), []).append(i)
        #: ``(device, dtype, indices of the parameters)`` of each gradient buffer
        self._groups = tuple((dev, dt, tuple(ix)) for (dev, dt), ix in groups.items())
        self._buffers, self._views = [], []
        if self._out is not None:  # an open logical batch: its sums carried over
            self._carry = {**self._carry, **self._out}
            self._out = None
        names = {id(v): n for n, v in self.tracker.model.named_parameters()}
        #: ``((name, numel), ...)`` of the noised parameters: correlated noise keeps one
        #: stream per parameter across unfreezing and freezing
        self._noise_layout = tuple((names.get(id(p), f"#{i}"), p.numel())
                                   for i, p in enumerate(self.tracker.params))
        if self.per_param_clipping is not None:
            unbounded = [p for p in self.tracker.params
                         if id(p) not in self.per_param_clipping]
            if unbounded:
                names = {id(v): n for n, v in self.tracker.model.named_parameters()}
                self.tracker.clear()
                self._layout_version = None  # checked again at the next step
                raise ConfigurationError(
                    "per-layer clipping fixes one bound per trainable parameter at "
                    "make_private (their root-sum-square is the sensitivity the run is "
                    "accounted with), and "
                    f"{[names.get(id(p), tuple(p.shape)) for p in unbounded]} became "
                    "trainable after it, without a bound. Make them trainable before "
                    "make_private (with a bound in max_grad_norm), or use flat clipping "
                    "(clipping='flat'), which covers parameters unfrozen later. No step was "
                    "taken and nothing was released")

    def _expected_examples(self, drawn) -> int | None:
        """Examples the recorded layers must have seen this (physical) step."""
        if self._chunk_size is not None:
            return self._chunk_size
        return None if drawn is None else drawn.size

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` and the recorded per-example gradients of the last backward
        pass. The activations of a forward pass whose backward is still to come are kept,
        so ``out = model(x); optimizer.zero_grad(); loss.backward(); optimizer.step()``
        works as the usual order does; accumulated clipped sums of a virtual batch in
        progress are kept. Per-example gradients recorded by a backward pass whose step is
        still to come are discarded too: the next ``step()`` is then refused with that
        cause (call ``zero_grad()`` before the forward pass or after ``step()``)."""
        if self.tracker.has_gradients():  # recorded by a backward pass since the last step
            self._grads_discarded = True
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.tracker.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.tracker.clear_gradients()

    def clip_and_accumulate(self, examples: int | None = None, units=None) -> None:
        """Step 1: add this physical batch's clipped per-example gradient sum (scaled by
        ``1 / expected_batch_size``) to the logical batch's gradient buffers (one flat
        buffer per device and dtype of the parameters, the memory ``p.grad`` will view).
        :meth:`add_noise` then adds the noise and sets ``p.grad``; ``step()`` does both.

        Raises
        ------
        TrainingLoopError
            The rows of this batch (or of this physical chunk of it) were already added:
            adding those of another backward pass over the same examples would count
            each of them twice in one accounted step; or a clipped parameter received a
            gradient outside its layers. Nothing is changed.
        UnsupportedModuleError
            A module used, in its own forward, a parameter that a submodule registers
            too (no rule covers that use). Nothing is changed.
        """
        key = self._check_accumulation(rows=True)
        self.tracker.check_outside_uses()  # as step() does: a gradient no rule clipped
        carry = self._open_buffers(False, unviewed=True) if self._out is None else None
        try:
            self._clipped_sum(self._out, examples=examples, units=units)
        except BaseException:
            if carry is not None:  # opened by this call: closed again, nothing kept
                self._out, self._carry = None, carry
            raise
        self._open_batch, chunk = key
        self._open_chunks.add(chunk)

    def _clipped_sum(self, out: dict | None = None, examples: int | None = None,
                     units=None) -> dict:
        """This physical batch's clipped per-example gradient sum, scaled by
        ``1 / expected_batch_size`` (added into ``out`` in place when given), with the
        step's bookkeeping: overflow count, last norms, adaptive clipping's count.
        ``examples``: how many examples the sampler delivered for this batch (the layers
        must have seen exactly these). In no_grad: a Trainer steps in grad mode."""
        with flat_views(self._flat_views if out is self._out else None), torch.no_grad():
            sums, _, norms = self.tracker.clipped_sum(
                self.max_grad_norm, 1.0 / self.expected_batch_size, out=out,
                per_param=self.per_param_clipping, loss_scale=self._loss_scale(),
                examples=examples, units=units, refuse_nonfinite=True, checks=False)
        self._overflowed = self._overflowed + self.tracker._overflow  # on the device
        self.last_grad_norms = norms
        self._count_unclipped(norms)
        return sums

    def _noise_std(self) -> float:
        """Noise std per coordinate of the averaged gradient on this rank,
        ``sigma_g C / sqrt(world) / expected_batch_size`` (0 when sigma is 0; ``sigma_g``
        is :attr:`gradient_noise_multiplier`)."""
        if self.noise_multiplier == 0:
            return 0.0
        std = self.gradient_noise_multiplier * self.max_grad_norm
        if self.world_size > 1:
            std = std / self.world_size ** 0.5
        return std / self.expected_batch_size

    def add_noise(self) -> None:
        """Steps 2-3: ``p.grad = accumulated + N(0, (sigma C)^2 / world) / expected``,
        all-reduced over ranks when distributed: one draw per gradient buffer (device
        and dtype) into the sums :meth:`clip_and_accumulate` left there (zeros when it
        was not called), each sum formed at the draw's precision and rounded once to
        the buffer's dtype (:meth:`NoiseSource.add_normal_`). A release of the batch
        drawn for it: checked against the budget and accounted as one step, as
        ``step()`` is (which also updates the parameters).

        Raises
        ------
        TrainingLoopError
            ``backward()`` recorded per-example gradients that
            :meth:`clip_and_accumulate` has not added, or the batch has examples and
            nothing of it was added (noise alone, charged as a step of the batch, as
            ``step()`` refuses too). Nothing is released."""
        drawn = None
        try:
            drawn = self.sampler.take() if self.sampler is not None else None
            self._check_accumulation(rows=False)
            self._check_noise_only(drawn)
            cfg = self._checked_cfg()
            self._agree()  # distributed: every rank goes on, or all refuse
        except Exception as exc:
            if drawn is not None and hasattr(exc, "refused_ranks"):
                self.sampler.refused(drawn)
            self._refuse_together(exc)
            raise
        carry = self._open_buffers(fill=False) if self._out is None else None
        try:
            self._noise_into(add=True)
        except BaseException:
            if carry is not None:
                self._out, self._carry = None, carry
            raise
        self._release()
        self._account(cfg, drawn)

    def _noisy_step(self, examples: int | None = None, units=None) -> None:
        """Steps 1-3 of a logical batch's last chunk: the noise drawn into empty float32/64
        buffers and the sums accumulated into it (one pass fewer), unless correlated (its
        state moves when drawn, and clipping may yet refuse the step); else sums, then noise."""
        fill = self._out is None and self.correlated is None and all(
            dt in (torch.float32, torch.float64) for _, dt, _ in self._groups)
        carry = self._open_buffers(fill) if self._out is None else None
        try:
            self._clipped_sum(self._out, examples=examples, units=units)
            self._agree()  # distributed: all ranks release, or none (before any noise drawn)
            if not fill:
                self._noise_into(add=True)
        except BaseException:
            if carry is not None:  # opened by this call: closed again, nothing kept
                self._out, self._carry = None, carry
            raise
        self._release()

    def _open_buffers(self, fill: bool, unviewed: bool = False) -> dict[int, torch.Tensor]:
        """Open a logical batch: take the gradient buffers (last step's when nobody
        references them any more: refilling one in place then changes nothing anyone
        holds and spares the page faults of a new one; else fresh), filled with this
        step's noise (``fill``) or zeroed, plus the sums carried over a change of the
        trained parameters (``unviewed``, a batch open past the call: none ``p.grad`` views,
        which would show its un-noised sums). Returns those carried sums (for a caller
        that closes the batch again on failure); the batch stays closed if this raises."""
        params = self.tracker.params
        bufs, views = list(self._buffers), list(self._views)
        for i, (dev, dt, ix) in enumerate(self._groups):
            n = sum(self._numels[j] for j in ix)
            qs = [params[j] for j in ix]
            flat = bufs[i] if i < len(bufs) else None
            v = views[i] if i < len(views) else None
            if v is None or v.buffer is not flat or not v.unshared(qs, not unviewed):
                if (flat is None or flat.device != dev or flat.dtype != dt
                        or flat.numel() != n or not _sole_owner(flat)):
                    flat = torch.empty(n, device=dev, dtype=dt)
                v = BufferViews(flat, qs, [self._numels[j] for j in ix])
            bufs[i:i + 1], views[i:i + 1] = [flat], [v]
        self._buffers = bufs[:len(self._groups)]
        self._views = views[:len(self._groups)]
        self._flat_views = {k: e for v in self._views for k, e in v.entries.items()}
        out = {}
        for v, (_, _, ix) in zip(self._views, self._groups, strict=True):
            for j, view in zip(ix, v.shaped(), strict=True):
                out[id(params[j])] = view
        self._out = out
        try:
            if fill:
                self._noise_into(add=False)
            else:
                for buf in self._buffers:
                    buf.zero_()
        except BaseException:
            self._out = None
            raise
        carry, self._carry = self._carry, {}
        for k, a in carry.items():  # earlier chunks, before the trained set changed
            if k in out:
                out[k].add_(a)
        return carry

    def _noise_into(self, add: bool) -> None:
        """This step's noise into the open buffers: ``N(0, std^2)`` per coordinate
        (:meth:`_noise_std`), added to their sums (``add``) or overwriting them; one draw
        per buffer (:meth:`NoiseSource.add_normal_foreach_`)."""
        std = self._noise_std()
        bufs = self._buffers
        if std <= 0:
            if not add:
                for buf in bufs:
                    buf.zero_()
            return
        if self.correlated is not None:
            self._correlated_into(std, add)
        elif add:
            self.noise.add_normal_foreach_(bufs, std)
        else:
            self.noise.fill_normal_foreach_(bufs, std)

    def _correlated_into(self, std: float, add: bool) -> None:
        """``sigma C (C^{-1} z)_t``: one standard draw ``z`` for all parameters (in the
        tracker's order, the streams' layout), ``C^{-1}`` applied once, scaled by ``std``.
        Drawn in place into a single buffer being filled; otherwise into a scratch on
        the first buffer's device (float32, float64 when every buffer is) and added to
        each parameter's view at that precision (rounded once to the view's dtype)."""
        bufs = self._buffers
        if self.noise.secure_mode:  # z and the state in float64, rounded once at the end
            return secure_correlated_into(self, std, add)
        if not add and len(bufs) == 1:
            self.correlated.apply_(self.noise.fill_normal_(bufs[0], 1.0), self._noise_layout,
                                   self._draw_standard_).mul_(std)
            return
        dt = (torch.float64 if all(b.dtype == torch.float64 for b in bufs)
              else torch.float32)
        z = torch.empty(self._numel, device=bufs[0].device, dtype=dt)
        z = self.correlated.apply_(self.noise.fill_normal_(z, 1.0), self._noise_layout,
                                   self._draw_standard_)
        out = self._out
        for q, piece in zip(self.tracker.params, z.split(self._numels), strict=True):
            v = out[id(q)]
            piece = piece.view(v.shape).to(v.device)
            if add:
                v.add_(piece, alpha=std)
            else:
                v.copy_(piece.mul_(std))

    def _release(self) -> None:
        """Close the logical batch: all-reduce the buffers over ranks (each rank's
        buffer holds its sum and its ``1 / sqrt(world)`` share of the noise) and set
        ``p.grad`` to the parameters' views of them."""
        out = self._out
        if self.world_size > 1:
            from privlearn.torch._settle import all_reduce  # returns once gloo let go

            for buf in self._buffers:
                all_reduce(buf, group=self.process_group)  # the sum over ranks
        for q in self.tracker.params:
            q.grad = out[id(q)]
        self._out = None

    def _take_accumulated(self) -> dict[int, torch.Tensor]:
        """The open logical batch's sums (``id(p) -> tensor``; empty when none), handed
        over and the batch closed (the FSDP2 step reduce-scatters them itself)."""
        out, self._out = self._out, None
        carry, self._carry = self._carry, {}
        if out is None:
            return carry
        for k, a in carry.items():
            if k in out:
                out[k].add_(a)
        return out

    def _draw_standard_(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` filled with standard Gaussian draws of the noise source (the steps of
        the correlated-noise streams of parameters frozen since they were trained)."""
        return self.noise.fill_normal_(out, 1.0)

    # ------------------------------------------------------------------ adaptive clipping
    def _count_unclipped(self, norms) -> None:
        """Add this physical batch's centred count ``sum_i (1[||g_i|| <= C] - 1/2)``."""
        if self.adaptive is None or norms is None or norms.numel() == 0:
            return
        inside = int((norms <= self.max_grad_norm).sum().item())
        self._centred_count += inside - 0.5 * norms.numel()

    def _update_clip_bound(self) -> None:
        """Release the noisy centred count and take the geometric step of the bound
        (Andrew et al. 2021, Algorithm 1): ``b = (K + N(0, sigma_b^2)) / m + 1/2``,
        ``C <- C exp(-eta (b - gamma))``. Distributed: each rank adds
        ``N(0, sigma_b^2 / world)`` to its own count before the sum."""
        a = self.adaptive
        count, self._centred_count = self._centred_count, 0.0
        std = a.unclipped_num_std
        if self.world_size > 1:
            std = std / self.world_size ** 0.5
        noisy = torch.tensor([count], dtype=torch.float64)
        noisy = noisy + self.noise.normal(std, noisy)
        if self.world_size > 1:
            from privlearn.torch._settle import all_reduce  # returns once gloo let go

            params = self.tracker.params
            dev = params[0].device if params else torch.device("cpu")
            t = noisy.to(dev)
            all_reduce(t, group=self.process_group)
            noisy = t.cpu()
        frac = float(noisy.item()) / self.expected_batch_size + 0.5
        self.last_unclipped_fraction = frac
        self.max_grad_norm = next_clip_bound(self.max_grad_norm, frac, a)

    def step(self, closure=None):
        """One DP-SGD step (no parameter update on a non-final virtual chunk).

        The step hooks of this optimizer (``register_step_pre_hook`` and
        ``register_step_post_hook``) run around the calls that end a logical batch, once
        per update; torch's global step hooks
        (``torch.optim.optimizer.register_optimizer_step_pre_hook``) run once per update
        too, around the wrapped optimizer's ``step`` (their optimizer argument is that
        one, its ``.grad`` the clipped, noised gradient it applies).

        Called by ``torch.amp.GradScaler.step`` (which sets ``grad_scale`` and
        ``found_inf`` on this object first), the recorded gradients are divided by the
        scaler's scale before clipping, and the scaler is told whether the noisy gradient
        is finite; the parameter update is skipped when it is not (the step is still
        accounted). See the module docstring.

        Raises
        ------
        RuntimeError
            No new batch of the private loader since the last step; or called through a
            ``GradScaler`` that cannot be identified.
        PrivacyBudgetExceededError
            The step would exceed ``max_epsilon``; nothing is changed.
        """
        if self._skipping:  # nothing of a logical batch refused at one of its chunks
            return self._skip_chunk(closure)
        if self._final_chunk:  # the hooks see the arguments as given (none, or the closure)
            return self._with_step_hooks(self._step, *(() if closure is None else (closure,)))
        return self._step(closure)

    def _skip_chunk(self, closure=None):
        """A chunk of a logical batch refused at an earlier chunk: dropped, nothing released
        (the rest alone is a position-dependent part of the batch, not the sampler's law)."""
        with torch.enable_grad():
            loss = None if closure is None else closure()
        self.tracker.clear()
        refusal = self._chunk_refusal if self._final_chunk else None
        self._skipping = not self._final_chunk
        self._final_chunk, self._chunk_size, self._chunk_groups = True, None, None
        if (scaler := self._amp_scaler()) is not None:
            self._report_found_inf(scaler, None)
        if refusal is not None:  # the other ranks wait to release the batch: all refuse
            self._chunk_refusal = None
            self._refuse_together(refusal)
        return loss

    def _recorded_or_dropped(self, drawn, rows: int | None, then):
        """``then()`` (clip, release) after :meth:`_require_recorded` and the tracker's
        checks; a batch refused before its release is dropped with its logical batch's rest."""
        try:
            self._require_recorded(rows)
            self.tracker.check_outside_uses()
            if self.sharded is not None and self._agree(self.tracker._probe_pending):
                self.tracker._probe_pending = True  # FSDP2: its passes are collectives
            self._check_independence(rows)  # and the parameters the forward wrote
            return then()
        except Exception:  # nothing was released: p.grad is set last, once all passed
            if not self._final_chunk:
                self._out, self._carry, self._skipping = None, {}, True
                self._final_chunk, self._chunk_size, self._chunk_groups = True, None, None
            if drawn is not None:
                self.sampler.refused(drawn)
            raise

    def _step(self, closure=None):
        loss, scaler, final = None, self._amp_scaler(), self._final_chunk
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._sync_params()
            self._check_update_set()
            if not self._final_chunk:  # a physical chunk of a virtual batch
                drawn = self.sampler.take() if self.sampler is not None else None
                units, rows = self._units_and_rows(drawn, self._chunk_size)
                self._recorded_or_dropped(drawn, rows, lambda: self.clip_and_accumulate(
                    examples=rows, units=units))
                self._final_chunk, self._chunk_size, self._chunk_groups = True, None, None
                if scaler is not None:
                    self._report_found_inf(scaler, None)
                return loss
            drawn = self.sampler.take() if self.sampler is not None else None
            units, examples = self._units_and_rows(drawn, self._expected_examples(drawn))
            cfg = self._recorded_or_dropped(drawn, examples, lambda: self._released(
                examples, units))
            self._chunk_size, self._chunk_groups = None, None
        except Exception as exc:  # distributed: refused on every rank, or kept for the
            if self.ledger is not None:
                self.ledger.refused(exc)  # may depend on the data: charged at the plan
            if final:             # last chunk (the ranks' chunk counts may differ)
                self._refuse_together(exc)
            elif self._agreement is not None:
                self._chunk_refusal = exc
            raise
        finally:
            self._dynamic_scale = 1.0
        found_inf = None
        try:
            if scaler is not None:
                found_inf = self._noisy_grad_nonfinite(scaler)
            self.last_step_skipped = bool(found_inf) if found_inf is not None else False
            if not self.last_step_skipped:
                self._stepping_original = True  # the one call of it that is not a slip
                try:
                    self.original_optimizer.step()
                finally:
                    self._stepping_original = False
        finally:
            # p.grad holds the noisy gradient from here on, and the update may have been
            # applied: the step is accounted and its batch used even when the wrapped
            # optimizer's step (or a hook of it) raises
            self._account(cfg, drawn)
        if scaler is not None:
            self._report_found_inf(scaler, found_inf)
        self._warn_overflow(read=scaler is not None)
        return loss

    def _released(self, examples, units) -> tuple:
        """The budget's check, then steps 1-3 (FSDP2: reduce-scatter, noise per shard)."""
        self._check_accumulation(rows=True)
        cfg = self._checked_cfg()
        if self.sharded is not None:
            self.sharded.noisy_step(self, examples, units)
        else:
            self._noisy_step(examples, units)
        return cfg

    def _checked_cfg(self) -> tuple:
        """(sigma, q, C) of the step about to be released, after the budget and ledger."""
        cfg = (self.noise_multiplier, self.sampling_rate, self.max_grad_norm)
        if self.budget is not None:
            self.budget.check(cfg[0], cfg[1])
        if self.ledger is not None:
            if self._agreement is not None and not self.ledger.covered(cfg[0], cfg[1]):
                self._agree()  # a reservation is a collective of the ranks
            self.ledger.ensure(cfg[0], cfg[1])
        return cfg

    def _account(self, cfg: tuple, drawn) -> None:
        """Record a released step, use its batch, set the next bound, move the noise on."""
        self.accountant.record_step(*cfg)  # a skipped update still released a gradient
        try:
            if self.ledger is not None:
                self.ledger.used(cfg[0], cfg[1])
            if drawn is not None:
                self.sampler.consume(drawn)
            if self.adaptive is not None:
                self._update_clip_bound()  # the bound of the next step
        finally:
            self.noise.advance()  # this step's noise key gone, whatever raised above
            if self.budget is not None:  # counted always; last: its warning may be an error
                self.budget.after_step()

    def guard_original(self):
        """Refuse ``step()`` on the wrapped optimizer itself (a loop that keeps stepping
        the optimizer it gave to make_private instead of ``p.optimizer``): that step
        would find no clipped, noised gradient, and the next ``backward()`` would pile a
        second batch onto the recorded one. Returns the function that removes the
        guard (:meth:`PrivateTraining.detach` calls it); its ``state_dict`` and
        ``load_state_dict`` are guarded as this optimizer's (:func:`guard_run_state`)."""
        dp = self

        def hook(optimizer, args, kwargs):
            if not dp._stepping_original:
                raise TrainingLoopError(
                    "step() was called on the optimizer given to make_private, not on "
                    "p.optimizer: the DP step (per-example clipping, noise, accounting) "
                    "runs only in p.optimizer.step(). Call p.optimizer.step() and "
                    "p.optimizer.zero_grad() in the loop (scaler.step(p.optimizer) with a "
                    "GradScaler; a learning-rate scheduler may be built on either "
                    "optimizer). No step was taken and nothing was released")
            return None

        return guard_run_state(self, self.original_optimizer.register_step_pre_hook(hook))

    # ------------------------------------------------------------------ devices
    def _device(self) -> torch.device:
        params = self.tracker.params
        return params[0].device if params else torch.device("cpu")

