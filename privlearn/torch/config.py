""":class:`DPConfig`: the settings of a DP-SGD run, validated once, in one place.

:func:`privlearn.torch.make_private` and :class:`privlearn.torch.hf.PrivacyArguments` take
these settings; every check of their values lives here (through
:mod:`privlearn._validation`, so each error names the parameter, the valid range, the
value received and what to try instead), before anything is built or any data is read.

The dataclass is the one declaration of the settings: :func:`~privlearn.torch.make_private`
takes its fields as keywords (``**settings``, shown in its signature), and the privacy
fields of :class:`~privlearn.torch.hf.PrivacyArguments` are a subset of them under the same
names, types and defaults. The closed choices are the string enums :class:`Clipping`,
:class:`Reduction` and :class:`Noise` (a plain string works wherever a member does);
``sampling`` and ``accountant`` name entries of registries.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum

import torch

from privlearn import _validation as _v
from privlearn._progress import check_show_progress
from privlearn.accounting import Sampling, available_accountants, get_accountant
from privlearn.correlated.sampling import SAMPLINGS
from privlearn.correlated.strategies import DenseStrategy, ToeplitzStrategy, check_stable
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
from privlearn.torch.schedule import independent, sized_by, whole_run

__all__ = ["Clipping", "DPConfig", "Noise", "Reduction"]


class _Choice(StrEnum):
    """A closed set of string choices: each member *is* its string (``Clipping.FLAT ==
    "flat"``, hashes, formats and reprs as it), so settings given as strings keep
    working and read back as they were written."""

    def __repr__(self) -> str:
        return repr(self.value)


class Clipping(_Choice):
    """How per-example gradients are clipped (:attr:`DPConfig.clipping`)."""

    FLAT = "flat"
    """One bound on the norm over all parameters."""
    PER_LAYER = "per_layer"
    """One bound per parameter (McMahan et al. 2018, Sec. 3)."""
    ADAPTIVE = "adaptive"
    """A flat bound moved towards a quantile of the norms (Andrew et al. 2021, Alg. 1)."""


class Reduction(_Choice):
    """How a loss or a user's gradients reduce over examples
    (:attr:`DPConfig.loss_reduction`, :attr:`DPConfig.user_reduction`)."""

    MEAN = "mean"
    SUM = "sum"


class Noise(_Choice):
    """The noise of the run (:attr:`DPConfig.noise`), or give a
    :mod:`privlearn.correlated` strategy."""

    DPSGD = "dpsgd"
    """Independent Gaussian noise at every step (Abadi et al. 2016, Alg. 1)."""
    BANDED = "banded"
    """A banded Toeplitz matrix factorization (correlated noise)."""
    BLT = "blt"
    """A buffered linear Toeplitz matrix factorization (correlated noise)."""




#: Accountant names of other libraries (Opacus), with what to use here instead.
_OTHER_ACCOUNTANTS = {
    "prv": "Opacus's PRV accountant is a numerical accountant of the privacy loss "
           "distribution; 'pld' (the default) is privlearn's, with a certified upper bound",
    "gdp": "Opacus's GDP accountant uses a central-limit approximation that can understate "
           "epsilon, so privlearn does not offer it; use 'pld' (the default) or 'rdp'",
}


#: Argument names of other DP-SGD libraries -- Opacus's ``PrivacyEngine``,
#: ``make_private`` and ``make_private_with_epsilon``; dp-transformers' and
#: private-transformers' privacy arguments -- and the :class:`DPConfig` settings a
#: :class:`~privlearn.torch.hf.DPTrainer` takes from its ``TrainingArguments``, each with
#: what to use here. One table for :func:`make_private`, :class:`DPConfig` and
#: :class:`~privlearn.torch.hf.PrivacyArguments` (a name is looked up only where it is not
#: an argument).
_OTHER_SETTINGS = {
    "module": "module: the model is model= (or the first argument)",
    "criterion": "criterion: not needed, compute the loss as usual; the engine picks the "
                 "per-example gradient method (ghost clipping included) of each layer",
    "batch_first": "batch_first: not needed, layers with a batch_first flag are read from "
                   "it; batch_dims={layer name: 1} names a layer whose inputs carry the "
                   "batch on dimension 1 without one",
    "poisson_sampling": "poisson_sampling: Poisson sampling is the default (sampling="
                        "'poisson'); sampling='fixed' draws fixed-size batches instead",
    "noise_generator": "noise_generator: use seed= (reproducible noise) or "
                       "secure_mode=True (CSPRNG noise)",
    "grad_sample_mode": "grad_sample_mode: not needed, the engine picks the per-example "
                        "gradient method of each layer itself",
    "wrap_model": "wrap_model: not needed, the model is used as it is (p.model is model)",
    "rand_on_empty": "rand_on_empty: not needed, an empty Poisson batch is a step that "
                     "adds the noise alone (and is accounted)",
    "max_clipbound": "max_clipbound: the adaptive bound has no cap here "
                     "(clipping='adaptive' with target_unclipped_quantile)",
    "min_clipbound": "min_clipbound: the adaptive bound has no floor here "
                     "(clipping='adaptive' with target_unclipped_quantile)",
    "target_eps": "target_eps: use target_epsilon",
    "secure_rng": "secure_rng: use secure_mode=True",
    "sample_rate": "sample_rate: the sampling rate is the data loader's batch_size / "
                   "len(dataset)",
    # dp-transformers / private-transformers
    "per_sample_max_grad_norm": "per_sample_max_grad_norm: use max_grad_norm (the "
                                "per-example clipping bound, --dp_max_grad_norm on a "
                                "command line parsed into PrivacyArguments)",
    "disable_dp": "disable_dp: train without privacy with the plain model, optimizer and "
                  "loader (transformers.Trainer for a DPTrainer); the engine always adds "
                  "the noise it accounts",
    "clipping_mode": "clipping_mode: not needed, the engine picks the per-example gradient "
                     "method (ghost clipping included) of each layer; clipping= chooses "
                     "flat, per-layer or adaptive clipping",
    "accounting_mode": "accounting_mode: use accountant= ('pld', the default, or 'rdp')",
    "alphas": "alphas: the RDP orders are the accountant's own (accountant='rdp')",
    "eps_error": "eps_error: 'pld' (the default accountant) bounds epsilon from above "
                 "with its own certified discretisation",
    "batch_size": "batch_size: the expected batch size is the data loader's batch_size "
                  "(a DPTrainer's TrainingArguments per_device_train_batch_size)",
    "sample_size": "sample_size: the size of the training set is len(dataset) of the "
                   "data loader (a DPTrainer's train_dataset)",
    "named_params": "named_params: parameters with requires_grad=False are left out",
    "record_snr": "record_snr: not offered; p.noise_multiplier and p.max_grad_norm "
                  "describe the noise",
    "numerical_stability_constant": "numerical_stability_constant: not needed, the "
                                    "clipping factor is min(1, C / norm) computed safely",
    "skip_checks": "skip_checks: the checks are not optional (check_batch_independence="
                   "False skips only the batch-independence probe)",
    "privacy_args": "privacy_args: a DPTrainer takes privacy=PrivacyArguments(...)",
    "author_mapping": "author_mapping: the users of the examples are a column of the "
                      "training set, PrivacyArguments(user_column=...)",
    # DPConfig settings a DPTrainer takes from its Trainer
    "epochs": "epochs: a DPTrainer plans the run from its TrainingArguments "
              "(num_train_epochs or max_steps)",
    "steps": "steps: a DPTrainer plans the run from its TrainingArguments "
             "(max_steps or num_train_epochs)",
    "max_physical_batch_size": "max_physical_batch_size: a DPTrainer trains its logical "
                               "batch (expected per_device_train_batch_size * "
                               "gradient_accumulation_steps per process) in physical chunks "
                               "of per_device_train_batch_size rows: set "
                               "TrainingArguments(gradient_accumulation_steps=...)",
    "users": "users: a DPTrainer reads the users from a column, user_column=",
    "optimizer": "optimizer: make_private's second argument (a DPTrainer builds it from "
                 "its TrainingArguments, or takes optimizers=)",
    "data_loader": "data_loader: make_private's third argument (a DPTrainer samples its "
                   "train_dataset itself)",
    "loss_reduction": "loss_reduction: a DPTrainer computes the per-example loss of its "
                      "task itself (task=)",
    **{k: f"{k}: not a DPTrainer setting; make_private with a training loop of your own "
          "takes it" for k in ("fix_model", "ledger_chunk", "augment",
                               "augmentation_multiplicity", "show_progress")},
}

def scalar_setting(value):
    """A one-element tensor as its Python number (schedules often compute with tensors),
    for ``noise_multiplier`` and ``max_grad_norm`` alike in :class:`DPConfig` and the
    optimizer's live setters; anything else unchanged, for :mod:`privlearn._validation`
    to check."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def unknown_settings_error(owner: str, unknown, *, missing=(), arguments=(),
                           names=None, fields_of: str = "DPConfig") -> ParameterTypeError:
    """The error for settings ``owner`` does not know (``unknown``) and its own
    ``arguments`` left out (``missing``): the settings (``names``, fields of ``fields_of``,
    default DPConfig's) listed, each unknown name with what to use (:data:`_OTHER_SETTINGS`)
    or the closest setting or argument."""
    names = DPConfig.names() if names is None else tuple(names)
    close = {k: difflib.get_close_matches(k, (*arguments, *names), n=1) for k in unknown}
    hints = "; ".join(_OTHER_SETTINGS.get(k) or f"did you mean {c[0]!r} for {k!r}?"
                      for k, c in close.items() if c or k in _OTHER_SETTINGS)
    said = []
    if missing:
        said.append(f"{owner} is missing {', '.join(missing)} ({owner}("
                    f"{', '.join(arguments)}, **settings))")
    if unknown:
        said.append(f"{owner} got unknown settings {sorted(unknown)}: the settings are the "
                    f"fields of {fields_of} ({', '.join(names)})")
    return ParameterTypeError("; ".join(said) + (f"; {hints}" if hints else ""))


def refuse_unknown_settings(cls, kwargs: dict) -> None:
    """Raise :func:`unknown_settings_error` for the keywords of ``kwargs`` that are not
    fields of the dataclass ``cls`` (its ``__init__`` would raise a bare TypeError)."""
    names = tuple(f.name for f in fields(cls))
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise unknown_settings_error(cls.__name__, unknown, names=names,
                                     fields_of=cls.__name__)


@dataclass(frozen=True)
class DPConfig:
    """The settings of a DP-SGD run (immutable; validated when made).

    Attributes
    ----------
    noise_multiplier : float >= 0, optional
        sigma: noise std = sigma * max_grad_norm on the clipped sum. Exactly one of
        ``noise_multiplier`` and ``target_epsilon``. A one-element tensor is read as its
        number (so is ``max_grad_norm``), as by the optimizer's setters.
    target_epsilon : float > 0, optional
        Calibrate sigma (rounded up) so that the planned run (``steps``, or ``epochs`` x
        :func:`privlearn.accounting.steps_per_epoch`) is (target_epsilon,
        target_delta)-DP.
    target_delta : float in (0, 1)
        delta of the calibration, of ``max_epsilon`` and of the planned epsilon, and of
        ``p.epsilon()`` without an argument (default 1e-5). Choose it well below
        ``1 / len(dataset)`` (a :class:`~privlearn.errors.PrivacyLeakWarning` otherwise).
    epochs, steps : int >= 1, optional
        Length of the planned run (one of them with ``target_epsilon``).
    max_grad_norm : float > 0, or list / dict of floats with ``clipping="per_layer"``
        Clipping bound C on the per-example gradient norm over all parameters (``inf``:
        no clipping, only with ``noise_multiplier=0``, for testing). Per-layer: one bound
        per trainable parameter in ``model.parameters()`` order, or a dict by name.
    clipping : :class:`Clipping` or its string {"flat", "per_layer", "adaptive"}
        ``"per_layer"``: each parameter's per-example gradient is clipped to its own bound
        ``C_k`` (McMahan et al. 2018, Sec. 3); the noise std is ``noise_multiplier *
        sqrt(sum_k C_k^2)``. ``"adaptive"``: Andrew, Thakkar, McMahan & Ramaswamy 2021,
        "Differentially Private Learning with Adaptive Clipping", Algorithm 1 (geometric
        update): ``max_grad_norm`` is the initial bound, moved after every step towards
        the ``target_unclipped_quantile`` of the per-example norms, estimated from a noisy
        count paid for inside ``noise_multiplier`` (see :mod:`privlearn.torch.optimizer`).
    sampling : str
        A registered sampling (:data:`privlearn.correlated.sampling.SAMPLINGS`, whose
        entry owns both the batch draw and the law the accountant assumes of it):

        * ``"poisson"``: every example in every batch independently with probability
          ``q = B / N``; accounted under **add/remove** neighbours (``scheme="poisson"``).
        * ``"fixed"``: ``B`` distinct examples drawn uniformly at every step (sampling
          without replacement); accounted under **replace-one** (``scheme="fixed"``).
        * ``"cyclic_poisson"``: every example in one of ``cycle_length`` groups, Poisson
          within the group whose turn it is (the batch size stays about the loader's);
          add/remove.
        * ``"balls_in_bins"``: every example in one random bin of ``cycle_length``, each
          bin one step (once per epoch, a fixed position); add/remove.
        * ``"shuffled_epochs"``: one random order cut into ``cycle_length`` near-equal
          batches, the same every epoch; accounted under **replace-one** only (adding an
          example changes the batch sizes, so other examples move to other steps), so
          refused on an add/remove ledger budget: use ``"balls_in_bins"`` for add/remove.

        The last three bound how often and how far apart an example participates, as
        correlated noise needs, and are accounted as one mechanism for the planned run.
        The relation a run's epsilon holds under is ``PrivateTraining.neighbouring``; a
        replace-one run is refused by a ledger budget counted under add/remove.
    noise : :class:`Noise` or its string {"dpsgd", "banded", "blt"}, or a strategy
        (a :class:`~privlearn.correlated.ToeplitzStrategy`, e.g. ``BandedToeplitz`` or
        the BLT ``BufferedToeplitz``, or a :class:`~privlearn.correlated.DenseStrategy`)
        Independent noise at every step (DP-SGD), or noise correlated across steps by a
        matrix factorization whose coefficients are optimised for the planned steps and
        the sampler's participation (:mod:`privlearn.correlated`): ``"banded"`` (a
        ``bands``-banded Toeplitz strategy; amplified by cyclic Poisson sampling when
        ``bands <= cycle_length``), ``"blt"`` (a buffered linear Toeplitz strategy with
        ``buffers`` buffers). Needs the planned length (``epochs`` or ``steps``). A
        strategy given is run as it is; a
        :class:`~privlearn.correlated.DenseStrategy` of ``n`` steps
        (:func:`~privlearn.correlated.optimize_dense`) needs at most ``n`` planned steps,
        refuses step ``n + 1``, and keeps every draw of the run: ``n`` buffers of the
        trained parameters' size (float32; float64 in secure mode).
    bands : int >= 1, optional
        Bands of ``noise="banded"`` (default: 8, or with ``cyclic_poisson`` the cycle
        length when shorter, so that the sampling amplifies it). A run of fewer planned
        steps gets as many bands as steps (a banded strategy has at most one band per
        step).
    buffers : int >= 1, optional
        Buffers of ``noise="blt"`` (default 4).
    cycle_length : int >= 1, optional
        Groups of ``cyclic_poisson`` (default: the bands of ``noise="banded"`` or of a
        banded strategy given, which the sampling then amplifies; with ``noise="blt"``
        or another strategy without bands, an epoch's batches, ``dataset size //
        batch size``, so that an example takes part once per epoch, the min-separation
        participation the BLT is optimised and accounted for, Choquette-Choo et al.
        2023, "Multi-Epoch Matrix Factorization Mechanisms"; with ``noise="dpsgd"``,
        1: Poisson sampling), bins of ``balls_in_bins`` and batches per epoch of
        ``shuffled_epochs`` (default: dataset size / batch size). A correlated run
        accounted at a larger epsilon than DP-SGD noise of the same expected error
        under the same call gets a ``UserWarning`` naming both epsilons.
    users : sequence, optional
        The user (privacy unit) of every example of the dataset: privacy is then per
        *user*. Ids must be present and of one kind (numbers, or strings, ...): a missing
        id (None, NaN, NA, NaT) or a mix of kinds is refused, naming the rows
        (:func:`privlearn._validation.check_unit_ids`); integral float ids (``2.0``) are
        the unit ``2``. The sampler draws users (the loader's ``batch_size`` is the expected
        number of users per batch), each drawn user contributes up to
        ``max_examples_per_user`` of their examples, and each user's gradient (the
        ``user_reduction`` of their examples' gradients) is clipped as one.
    max_examples_per_user : int >= 1
        k: a drawn user's examples in one batch at most (a uniform random subset). Only
        with ``users``: without them a value other than 1 is refused.
    user_reduction : :class:`Reduction` or its string {"mean", "sum"}
        A user's gradient: the mean (default) or the sum of their examples' gradients.
    augmentation_multiplicity : int >= 1, optional
        K: each example is trained on as K augmented views (De et al. 2022, "Unlocking
        High-Accuracy Differentially Private Image Classification through Scale",
        Sec. 3.1); their gradients are averaged before clipping, so the privacy unit
        stays the example. Needs ``augment``.
    augment : callable, optional
        A function of one batch (as the loader yields it) returning one augmented view
        of it: the same structure, the same rows in the same order. ``p.data_loader``
        calls it K times per batch and yields each example's K views on consecutive
        rows (the rows the engine averages), every per-example tensor (labels too)
        repeated alike. The loader, not the loop, lays out the views: a view-major
        ``torch.cat`` of the views would put K examples in one clipping unit and one
        example in K (sensitivity K C instead of C). It must treat each example on its
        own: it is probed with the model (one example replaced under the same random
        state, every other output row unchanged), so a batch-level MixUp/CutMix is
        refused; mix only within an example's own views.
    max_physical_batch_size : int >= 1, optional
        Split logical batches into chunks of at most this size (virtual batches).
    loss_reduction : :class:`Reduction` or its string {"mean", "sum"}
        How the user's loss reduces over the batch.
    accountant : str
        Accountant of :mod:`privlearn.accounting` for epsilon and calibration: ``"pld"``
        (default), ``"rdp"``, or a registered one (``"analytic"`` does not account
        subsampling, so it cannot account Poisson-sampled steps). A name the registry
        does not know is refused here, and one that cannot account the run by
        ``make_private``.
    secure_mode : bool
        CSPRNG noise with the floating-point-attack mitigation (:mod:`privlearn.torch.noise`)
        and every sampling drawn from the OS CSPRNG (batches and layouts).
    seed : int, optional
        Seed of the sampler's and the noise's key chains (reproducible runs); None: OS
        entropy. Must be None in secure mode.
    fix_model : bool
        Replace the layers a registered fixer can replace (BatchNorm -> GroupNorm sharing
        its affine parameters, so the optimizer trains them) before validating; undone if
        a later check refuses the model.
    max_epsilon : float > 0 or inf, optional
        Hard cap on epsilon at ``target_delta``: the step that would exceed it raises
        :class:`~privlearn.errors.PrivacyBudgetExceededError` before it runs. Default:
        ``target_epsilon`` when it is given (the target is a stop: a loop longer than the
        planned ``epochs``/``steps`` is stopped before it spends more), else no cap.
        ``float("inf")`` is the explicit setting that trains past the target (a
        :class:`~privlearn.torch.accountant.PrivacyBudgetWarning` is emitted once past
        the planned epsilon, and ``p.epsilon(delta)`` reports what was spent).
    ledger_chunk : int >= 1
        Steps reserved at a time in a privacy ledger beyond the plan.
    target_unclipped_quantile : float in [0, 1], optional
        gamma of adaptive clipping (required with ``clipping="adaptive"``).
    clipbound_learning_rate : float > 0
        eta of ``C <- C exp(-eta (b - gamma))``.
    unclipped_num_std : float > 0, optional
        sigma_b, noise std of the count of unclipped examples (default: expected batch
        size / 20, TensorFlow Federated's default); must exceed ``noise_multiplier / 2``.
    batch_dims : dict, optional
        ``{layer name: 0 or 1}``: layers whose inputs carry the batch on dimension 1
        (sequence-first) although no ``batch_first`` flag says so. The batch-independence
        probe checks every layer's dimension on the first step and names the entry
        needed.
    check_batch_independence : bool
        Run the batch-independence probe (:mod:`privlearn.torch.probe`) on the first step
        and again after any change that could mix examples (the trainable set, a module's
        ``training`` flag, the module tree, forward hooks), on the model and on
        ``augment`` (default). ``False`` skips it: you then promise that no operation
        (nor ``augment``) mixes examples and that ``batch_dims`` is right
        (docs/trust-model.md). It also turns off make_private's check that the loader's
        collate function puts the examples on dimension 0 (it collates ``dataset[0]``
        once and twice).
    show_progress : bool, optional
        A progress bar on standard error while ``make_private`` optimises a correlated-
        noise strategy (``noise="banded"``/``"blt"``; seconds to a minute for long
        runs) and while it calibrates the noise to ``target_epsilon`` (seconds for
        100,000 steps): None (default) when standard error is a terminal and the work
        lasts over a second, True always, False never. Changes nothing else (the same
        strategy is computed once per process and reused).
    agreement_timeout : float > 0
        Seconds ``make_private`` waits, on a distributed run under gloo, for every rank
        to call it (default 300): past it, the waiting ranks raise
        :class:`~privlearn.errors.RanksNotArrivedError` naming the ranks that did not
        arrive, instead of waiting for the process group's own timeout (30 minutes).
        Raise it when some rank is slow to get there (loading data, compiling). NCCL
        has no such bounded wait (its group's timeout applies). May differ between ranks.
        A ``DPTrainer`` takes it as ``PrivacyArguments(agreement_timeout=...)``.
    """

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float = 1e-5
    epochs: int | None = None
    steps: int | None = None
    max_grad_norm: float | list | dict = 1.0
    clipping: Clipping | str = Clipping.FLAT
    sampling: str = "poisson"
    max_physical_batch_size: int | None = None
    loss_reduction: Reduction | str = Reduction.MEAN
    accountant: str = "pld"
    secure_mode: bool = False
    seed: int | None = None
    fix_model: bool = False
    max_epsilon: float | None = None
    ledger_chunk: int = 1000
    target_unclipped_quantile: float | None = None
    clipbound_learning_rate: float = 0.2
    unclipped_num_std: float | None = None
    batch_dims: dict | None = field(default=None, hash=False)
    check_batch_independence: bool = True
    noise: Noise | str | ToeplitzStrategy | DenseStrategy = Noise.DPSGD
    bands: int | None = None
    buffers: int | None = None
    cycle_length: int | None = None
    users: object = field(default=None, hash=False, repr=False)
    max_examples_per_user: int = 1
    user_reduction: Reduction | str = Reduction.MEAN
    augmentation_multiplicity: int | None = None
    augment: object = field(default=None, hash=False, repr=False, compare=False)
    show_progress: bool | None = field(default=None, compare=False)
    agreement_timeout: float = field(default=300.0, compare=False)

    def __new__(cls, *args, **kwargs):
        # an unknown keyword is named with what to use (dataclass's __init__ would raise a
        # bare TypeError); positional arguments are left to __init__
        refuse_unknown_settings(cls, kwargs)
        return super().__new__(cls)

    def __post_init__(self):
        put = object.__setattr__
        if isinstance(self.sampling, Sampling):
            put(self, "sampling", self.sampling.value)
        put(self, "clipping", Clipping(_v.check_choice("clipping", self.clipping, Clipping)))
        put(self, "sampling", _v.check_choice("sampling", self.sampling, tuple(SAMPLINGS)))
        put(self, "loss_reduction", Reduction(_v.check_choice(
            "loss_reduction", self.loss_reduction, Reduction)))
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigurationError(
                "give exactly one of noise_multiplier and target_epsilon, got "
                f"noise_multiplier={self.noise_multiplier!r}, target_epsilon="
                f"{self.target_epsilon!r}: target_epsilon calibrates the noise for the planned "
                "steps, noise_multiplier fixes it (then max_epsilon caps the steps)")
        if self.noise_multiplier is not None:
            put(self, "noise_multiplier", _v.check_nonnegative(
                "noise_multiplier", scalar_setting(self.noise_multiplier),
                hint="the noise std divided by max_grad_norm, e.g. 1.0"))
        if self.clipping != "per_layer":
            if isinstance(self.max_grad_norm, list | tuple | dict):
                raise ConfigurationError(
                    "max_grad_norm is a list/dict of per-parameter bounds, which needs "
                    f"clipping='per_layer' (got clipping={self.clipping!r}); pass one number "
                    "for flat or adaptive clipping")
            c = _v.check_positive("max_grad_norm", scalar_setting(self.max_grad_norm),
                                  allow_inf=True,
                                  hint="the per-example clipping bound, e.g. 1.0")
            put(self, "max_grad_norm", c)
            if math.isinf(c) and (self.target_epsilon is not None or self.noise_multiplier):
                raise ConfigurationError(
                    "max_grad_norm=inf (no clipping) leaves the sensitivity unbounded, so no "
                    "noise scale is private; it is only allowed with noise_multiplier=0 "
                    "(non-private testing). Give a finite max_grad_norm > 0")
        self._check_accountant()
        delta = _v.check_delta("target_delta", self.target_delta, hint=_v.DELTA_HINT)
        if delta == 0:
            raise ParameterValueError(
                "target_delta must be in (0, 1), got 0: the Gaussian mechanism "
                "of DP-SGD has no finite epsilon at delta = 0; pass e.g. 1e-5")
        put(self, "target_delta", delta)
        for name in ("epochs", "steps"):
            if getattr(self, name) is not None:
                put(self, name, _v.check_steps(name, getattr(self, name),
                                               example=f"{name}=10"))
        if self.epochs is not None and self.steps is not None:
            raise ConfigurationError(
                f"give one of epochs and steps for the planned length, got epochs="
                f"{self.epochs} and steps={self.steps}: the plan (the calibrated noise, the "
                "planned epsilon, the target as a stop) would follow steps alone, whatever "
                "the epochs say. Pass steps=epochs * len(p.data_loader) to plan by steps")
        if self.target_epsilon is not None:
            put(self, "target_epsilon", _v.check_positive("target_epsilon",
                                                          self.target_epsilon))
            if self.epochs is None and self.steps is None:
                raise ConfigurationError(
                    "target_epsilon needs the length of training: give epochs or "
                    "steps (got neither)")
        if self.secure_mode and self.seed is not None:
            raise ConfigurationError(
                f"seed must be None when secure_mode=True (a seeded generator is "
                f"not secure), got seed={self.seed!r}")
        if self.seed is not None:
            put(self, "seed", _v.check_count("seed", self.seed, minimum=0))
        if self.max_epsilon is not None:
            put(self, "max_epsilon", _v.check_positive(
                "max_epsilon", self.max_epsilon, allow_inf=True,
                hint='a cap on epsilon at target_delta, or float("inf") for none'))
        elif self.target_epsilon is not None:  # the target is a stop unless said otherwise
            put(self, "max_epsilon", self.target_epsilon)
        put(self, "agreement_timeout", _v.check_positive(
            "agreement_timeout", self.agreement_timeout,
            hint="seconds make_private waits for every rank, e.g. 300"))
        if self.max_physical_batch_size is not None:
            put(self, "max_physical_batch_size",
                _v.check_count("max_physical_batch_size", self.max_physical_batch_size,
                               minimum=1))
        put(self, "ledger_chunk", _v.check_count("ledger_chunk", self.ledger_chunk, minimum=1))
        self._check_adaptive()
        if self.batch_dims is not None and not isinstance(self.batch_dims, dict):
            raise _v.ParameterTypeError(
                f"batch_dims must be a dict {{layer name: 0 or 1}}, got {self.batch_dims!r}")
        put(self, "show_progress", check_show_progress(self.show_progress))
        self._check_correlated()
        self._check_units()

    def _check_accountant(self) -> None:
        """Refuse an accountant the registry does not know now, not at the first
        ``epsilon()`` after training (the steps would have run unaccountable)."""
        try:  # ParameterValueError naming the valid ones; a name as the registry keys it
            named = get_accountant(self.accountant).name
            if isinstance(self.accountant, str):  # "PLD" is "pld" (checkpoints compare it)
                object.__setattr__(self, "accountant", named)
        except ParameterValueError:
            if self.accountant not in _OTHER_ACCOUNTANTS:
                raise
            valid = ", ".join(map(repr, available_accountants()))
            raise ParameterValueError(
                f"accountant must be one of {valid}, got {self.accountant!r}: "
                f"{_OTHER_ACCOUNTANTS[self.accountant]}") from None

    def _check_correlated(self) -> None:
        put = object.__setattr__
        if isinstance(self.noise, str):
            put(self, "noise", Noise(_v.check_choice("noise", self.noise, Noise)))
        elif not hasattr(self.noise, "recurrence"):
            raise _v.ParameterTypeError(
                f"noise must be one of {tuple(map(str, Noise))} or a privlearn.correlated "
                f"strategy (e.g. BandedToeplitz(...)), got {self.noise!r}")
        elif not isinstance(self.noise, DenseStrategy):  # a dense C^{-1} is finite
            check_stable(self.noise.recurrence())  # a C^{-1} that overflows: refused here
        for name in ("bands", "buffers", "cycle_length"):
            if getattr(self, name) is not None:
                put(self, name, _v.check_steps(name, getattr(self, name),
                                               example=f"{name}=10"))
        if self.bands is not None and sized_by(self.noise) != "bands":
            raise ConfigurationError(f"bands={self.bands} only applies to noise='banded', got "
                             f"noise={self.noise!r}")
        if self.buffers is not None and sized_by(self.noise) != "buffers":
            raise ConfigurationError(f"buffers={self.buffers} only applies to noise='blt', got "
                             f"noise={self.noise!r}")
        law = SAMPLINGS[self.sampling]
        cycled = ", ".join(repr(k) for k, v in SAMPLINGS.items() if v.cycled)
        if self.cycle_length is not None and not law.cycled:
            raise ConfigurationError(
                f"cycle_length only applies to sampling={cycled}, got "
                f"sampling={self.sampling!r}")
        if not independent(self.noise):
            if law.describe is None and getattr(self.noise, "bands", None) == 1:
                # a one-band strategy (Identity()) adds independent noise, but a strategy
                # object is accounted as one matrix mechanism of the planned run
                raise ConfigurationError(
                    f"noise={self.noise!r} adds independent noise at every step, but a "
                    "strategy given as an object is accounted as one matrix-factorization "
                    "mechanism of the planned run, which needs a sampler that bounds how "
                    "often and how far apart an example takes part, got "
                    f"sampling={self.sampling!r}: for DP-SGD's independent noise pass "
                    "noise='dpsgd' (the default), or pass sampling='cyclic_poisson', "
                    "'balls_in_bins' (add/remove) or 'shuffled_epochs' (replace-one)")
            if law.describe is None:
                raise ConfigurationError(
                    f"noise={self.noise!r} correlates the noise across steps, which needs a "
                    "sampler that bounds how often and how far apart an example takes part: "
                    "pass sampling='cyclic_poisson' (amplified with noise='banded'), "
                    "'balls_in_bins' (add/remove) or 'shuffled_epochs' (replace-one), got "
                    f"sampling={self.sampling!r}")
            if self.epochs is None and self.steps is None:
                raise ConfigurationError(
                    f"noise={self.noise!r} is optimised for the planned number "
                    "of steps: give epochs or steps")
            if self.clipping == "adaptive":
                raise ConfigurationError(
                    "clipping='adaptive' is not supported with correlated noise "
                    "(its noisy count is accounted as independent noise)")
        if law.describe is not None and self.epochs is None and self.steps is None:
            raise ConfigurationError(
                f"sampling={self.sampling!r} is accounted for the planned run: give epochs or "
                "steps (max_epsilon then defaults to the plan's epsilon)")

    def _check_units(self) -> None:
        put = object.__setattr__
        put(self, "max_examples_per_user",
            _v.check_count("max_examples_per_user", self.max_examples_per_user, minimum=1))
        if self.max_examples_per_user != 1 and self.users is None:
            raise ConfigurationError(
                f"max_examples_per_user={self.max_examples_per_user} applies to user-level "
                "privacy only, and no users are given: the run would be per example, one "
                "example per privacy unit, whatever this says. Pass users=[the user of each "
                "example] (DPTrainer: PrivacyArguments(user_column=...)) for a guarantee per "
                "user, or drop max_examples_per_user")
        put(self, "user_reduction",
            Reduction(_v.check_choice("user_reduction", self.user_reduction, Reduction)))
        if self.augmentation_multiplicity is not None:
            put(self, "augmentation_multiplicity",
                _v.check_count("augmentation_multiplicity", self.augmentation_multiplicity,
                               minimum=1))
            if self.users is not None:
                raise ConfigurationError("augmentation_multiplicity and users cannot be combined: "
                                 "give one privacy unit (the example's views, or the user)")
            if self.augment is None:
                raise ConfigurationError(
                    f"augmentation_multiplicity={self.augmentation_multiplicity} needs "
                    "augment=fn, a function of one batch returning one augmented view of it "
                    "(e.g. lambda b: (b[0] + 0.05 * torch.randn_like(b[0]), b[1])): "
                    "p.data_loader then yields each example's views on consecutive rows, the "
                    "rows the engine averages before clipping. Views concatenated in the "
                    "loop (torch.cat([aug(x) for _ in range(K)])) would be grouped with "
                    "other examples' views, and one example would move the update by K "
                    "clipping bounds")
        if self.augment is not None:
            if self.augmentation_multiplicity is None:
                raise ConfigurationError(
                    "augment is given without augmentation_multiplicity: pass "
                    "augmentation_multiplicity=K, the number of views of each example")
            if not callable(self.augment):
                raise _v.ParameterTypeError(
                    "augment must be a function of one batch returning one augmented view "
                    f"of it, got {type(self.augment).__name__}")
        if self.users is not None and isinstance(self.users, str):
            raise _v.ParameterTypeError(
                "users must be the user id of every example (a sequence as long as the "
                f"dataset), got the string {self.users!r}; DPTrainer takes a column name as "
                "PrivacyArguments(user_column=...)")

    def _check_adaptive(self) -> None:
        if self.clipping != "adaptive":
            extra = [f"{k}={getattr(self, k)!r}" for k, default in (
                ("target_unclipped_quantile", None), ("unclipped_num_std", None),
                ("clipbound_learning_rate", 0.2)) if getattr(self, k) != default]
            if extra:
                raise ConfigurationError(
                    f"{', '.join(extra)} only apply to clipping='adaptive', got "
                    f"clipping={self.clipping!r}: set clipping='adaptive' or "
                    "drop them")
            return
        if self.target_unclipped_quantile is None:
            raise ConfigurationError(
                "clipping='adaptive' needs target_unclipped_quantile (gamma in [0, 1], the "
                "fraction of examples the bound should leave unclipped, e.g. 0.5), got None")
        _v.check_probability("target_unclipped_quantile", self.target_unclipped_quantile)
        _v.check_positive("clipbound_learning_rate", self.clipbound_learning_rate)
        if self.unclipped_num_std is not None:
            _v.check_positive("unclipped_num_std", self.unclipped_num_std)
        if math.isinf(self.max_grad_norm):
            raise ConfigurationError(
                "clipping='adaptive' needs a finite initial max_grad_norm > 0, "
                "got inf")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names (the keyword arguments :func:`make_private` takes)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        """The settings as keyword-only parameters (name, default, annotation): the
        signature :func:`~privlearn.torch.make_private` shows for its ``**settings``."""
        return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                  default=inspect.Parameter.empty if f.default is MISSING
                                  else f.default) for f in fields(cls)]

    @property
    def correlated(self) -> bool:
        """Whether the run is accounted as one matrix-factorization mechanism (correlated
        noise, or a sampler that bounds participation) rather than step by step."""
        return whole_run(self.noise, self.sampling)

    @property
    def privacy_unit(self) -> str:
        return "user" if self.users is not None else "example"

    def mechanism(self) -> dict:
        """What a checkpoint's mechanism must match (the settings that define what a step
        releases and how it is accounted)."""
        return {"sampling": str(self.sampling), "loss_reduction": self.loss_reduction.value,
                "accountant": self.accountant, "clipping": self.clipping.value,
                "noise": self.noise.value if isinstance(self.noise, Noise) else repr(self.noise),
                "bands": self.bands, "buffers": self.buffers,
                "cycle_length": self.cycle_length, "privacy_unit": self.privacy_unit,
                "max_examples_per_user": self.max_examples_per_user,
                "user_reduction": self.user_reduction.value,
                "augmentation_multiplicity": self.augmentation_multiplicity}
