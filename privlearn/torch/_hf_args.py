"""The DP-SGD settings of :class:`privlearn.torch.hf.DPTrainer`:
:class:`PrivacyArguments` (exported by :mod:`privlearn.torch.hf`).

A dataclass that ``transformers.HfArgumentParser`` parses beside ``TrainingArguments``,
as Hugging Face scripts parse their arguments::

    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    training_args, privacy_args = parser.parse_args_into_dataclasses()

For that, every field has a type the parser reads (one type, optionally ``None``, or a
union with ``str``), and no field shares a name with ``TrainingArguments``: the
per-example clipping bound and the seed of the sampler and noise are the fields
``dp_max_grad_norm`` and ``dp_seed`` (``--dp_max_grad_norm``, ``--dp_seed``; the
Trainer's own ``--max_grad_norm``, which clips the averaged gradient, and ``--seed`` are
different settings). In Python, ``max_grad_norm=`` and ``seed=`` (the names
:func:`~privlearn.torch.make_private` uses) are accepted for them, and the attributes
``max_grad_norm`` and ``seed`` read them.

No transformers import here: :mod:`privlearn.torch.hf` is the module that needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from dataclasses import dataclass, field, fields

from privlearn._validation import check_count
from privlearn.correlated.strategies import DenseStrategy, ToeplitzStrategy
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
from privlearn.torch.config import (
    Clipping,
    DPConfig,
    Noise,
    Reduction,
    unknown_settings_error,
)

__all__ = ["PrivacyArguments", "check_batch_size", "warn_unused_clipping"]

_TASKS = ("causal_lm", "masked_lm", "token_classification", "sequence_classification",
          "seq2seq_lm")

#: The fields named differently from their DPConfig setting (TrainingArguments has a
#: ``max_grad_norm`` and a ``seed`` of its own: one parser cannot hold both), and the
#: DPConfig name, also accepted by the constructor and readable as an attribute.
_RENAMED = {"dp_max_grad_norm": "max_grad_norm", "dp_seed": "seed"}
_ALIASES = {v: k for k, v in _RENAMED.items()}


def _arg(default, help: str):
    """A field with its default and the help ``HfArgumentParser`` prints for it."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PrivacyArguments:
    """The DP-SGD settings of a :class:`~privlearn.torch.hf.DPTrainer` (validated by
    :class:`~privlearn.torch.config.DPConfig`, which documents them; passed to
    :func:`privlearn.torch.make_private`). Every field but ``user_column``, ``task`` and
    ``log_training_loss`` is a field of ``DPConfig`` under the same name, type and
    default, except ``dp_max_grad_norm`` and ``dp_seed`` (``DPConfig``'s ``max_grad_norm``
    and ``seed``): ``transformers.TrainingArguments`` has fields of those names, so
    ``HfArgumentParser((TrainingArguments, PrivacyArguments))`` parses
    ``--dp_max_grad_norm`` and ``--dp_seed``. The constructor also takes them as
    ``max_grad_norm=`` and ``seed=``, and ``args.max_grad_norm`` / ``args.seed`` read them.

    Attributes
    ----------
    noise_multiplier, target_epsilon, target_delta, sampling, accountant,
    secure_mode, clipping, target_unclipped_quantile, clipbound_learning_rate,
    unclipped_num_std, batch_dims, check_batch_independence, noise, bands, buffers,
    cycle_length, max_examples_per_user, user_reduction
        As in :class:`~privlearn.torch.config.DPConfig`; ``target_epsilon`` (and correlated
        noise, and the participation-bounding samplers) use the Trainer's planned steps
        (``max_steps``, or ``num_train_epochs`` times the steps of an epoch).
        ``batch_dims`` also takes the text of a JSON object, as a command line gives it
        (``--batch_dims '{"encoder.lstm": 1}'``).
    dp_max_grad_norm : float, list, dict or str
        ``DPConfig.max_grad_norm``, the per-example clipping bound (default 1.0), which
        replaces ``TrainingArguments.max_grad_norm`` (the Trainer's clipping of the
        averaged gradient, not used by a DPTrainer). A string is read as a number or as
        a JSON list or object (per-layer bounds, ``clipping="per_layer"``). On a command
        line ``HfArgumentParser`` reads a number only; per-layer bounds come from a JSON
        or YAML file (``parse_json_file``, ``parse_yaml_file``) or from Python.
    dp_seed : int, optional
        ``DPConfig.seed``: the seed of the Poisson sampler and of the noise (default: fresh
        entropy). ``TrainingArguments.seed`` seeds the model's initialisation and the
        Trainer's own randomness, not these.
    user_column : str, optional
        The training set's column (key of each example) holding the user of each example:
        privacy is then per user (``make_private(users=...)``); the column is not passed
        to the model.
    max_epsilon : float, optional
        Stop training before the step that would take epsilon (of all this trainer's
        runs) past this; default ``target_epsilon``, if given (as in
        :func:`~privlearn.torch.make_private`); ``float("inf")`` trains past it.
    agreement_timeout : float
        ``DPConfig.agreement_timeout``: on a distributed run (gloo), the seconds each
        process waits, when training starts, for every process to get there (default
        300, a number > 0): past it the waiting processes raise
        :class:`~privlearn.errors.RanksNotArrivedError` naming those that did not arrive,
        instead of waiting for the process group's own timeout (30 minutes). Raise it
        when some process is slow to start training (loading data, compiling). May
        differ between processes, and between a run and its resumption.
    log_training_loss : bool
        The Trainer's ``loss`` / ``train_loss`` logs are means over private training
        batches without noise, and they are saved in every checkpoint's
        ``trainer_state.json``: by default they are not released. ``True`` keeps them
        and emits a :class:`~privlearn.errors.PrivacyLeakWarning`: they are then not
        covered by the accounted mechanism.
    task : str, optional
        How the per-example loss is computed: ``"causal_lm"`` (shifted per-sequence
        token cross-entropy), ``"masked_lm"`` / ``"token_classification"`` (unshifted),
        ``"sequence_classification"`` (labels of shape ``(B,)``, or floating-point
        targets), ``"seq2seq_lm"`` (an encoder-decoder's target tokens, unshifted: each
        example's loss is the mean over its own target tokens, a trailing run of the pad
        token ignored; ``decoder_input_ids``, when the batch has none, built from the
        labels as the model builds them). Default: the
        model's task in transformers' auto-model mappings
        (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ``..._MASKED_LM_...``,
        ``..._TOKEN_CLASSIFICATION_...``, ``..._SEQUENCE_CLASSIFICATION_...``,
        ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` and the speech one) of its class
        or nearest transformers base class, a peft wrapper unwrapped; for a model in none
        of them, ``"sequence_classification"`` when the labels are one per example
        (shape ``(B,)`` or floating point). Anything else (a custom class with per-token
        labels, a class in two mappings) is refused until ``task`` is given.
    """

    #: The section of ``HfArgumentParser``'s ``--help`` that lists these settings.
    _argument_group_name = "DP-SGD settings (privlearn PrivacyArguments)"

    noise_multiplier: float | None = _arg(
        None, "Noise std / clipping bound (sigma). Exactly one of this and target_epsilon.")
    target_epsilon: float | None = _arg(
        None, "Calibrate the noise so that the planned run (max_steps or num_train_epochs) "
        "is (target_epsilon, target_delta)-DP.")
    target_delta: float = _arg(1e-5, "delta of the calibration and of the reported epsilon.")
    # a union with str, which HfArgumentParser reads as its other first member (float)
    dp_max_grad_norm: float | str | list | dict = _arg(
        1.0, "Per-example clipping bound (replaces --max_grad_norm, which a DPTrainer does "
        "not use); in a JSON/YAML file also a list or object of per-layer bounds.")
    max_epsilon: float | None = _arg(
        None, "Stop before the step that would take epsilon past this (None: "
        "target_epsilon; inf trains past it).")
    sampling: str = _arg("poisson", "Batch sampling: poisson, fixed, cyclic_poisson, "
                         "balls_in_bins or shuffled_epochs.")
    accountant: str = _arg("pld", "Privacy accountant: pld or rdp.")
    secure_mode: bool = _arg(False, "Cryptographically secure noise and sampling.")
    dp_seed: int | None = _arg(
        None, "Seed of the Poisson sampler and of the noise (None: fresh entropy); "
        "--seed seeds the model's initialisation.")
    clipping: Clipping | str = _arg(Clipping.FLAT, "Clipping: flat, per_layer or adaptive.")
    target_unclipped_quantile: float | None = _arg(
        None, "Adaptive clipping: target fraction of unclipped examples.")
    clipbound_learning_rate: float = _arg(0.2, "Adaptive clipping: the bound's learning rate.")
    unclipped_num_std: float | None = _arg(
        None, "Adaptive clipping: noise std of the unclipped count.")
    # a union with str (read by HfArgumentParser as text, then as a JSON object)
    batch_dims: dict | str | None = _arg(
        None, "Layers whose inputs hold the batch on dimension 1: a JSON object "
        "{layer name: 0 or 1}, e.g. --batch_dims '{\"encoder.lstm\": 1}'.")
    check_batch_independence: bool = _arg(
        True, "Probe the model once for layers that mix examples of a batch.")
    noise: Noise | str | ToeplitzStrategy | DenseStrategy = _arg(
        Noise.DPSGD, "Noise: dpsgd (independent), banded or blt (correlated across steps); "
        "in Python also a strategy (BandedToeplitz, BufferedToeplitz or DenseStrategy).")
    bands: int | None = _arg(None, "Bands of noise=banded.")
    buffers: int | None = _arg(None, "Buffers of noise=blt.")
    cycle_length: int | None = _arg(None, "Groups, bins or batches per epoch of the "
                                    "participation-bounding samplings.")
    user_column: str | None = _arg(
        None, "Column of the training set holding each example's user: privacy per user.")
    max_examples_per_user: int = _arg(1, "Examples of a sampled user in one batch, at most.")
    user_reduction: Reduction | str = _arg(
        Reduction.MEAN, "A user's gradient: the mean or the sum of their examples'.")
    task: str | None = _arg(
        None, "causal_lm, masked_lm, token_classification, sequence_classification or "
        "seq2seq_lm (default: the model's).")
    log_training_loss: bool = _arg(
        False, "Log the training loss (not covered by the accounting: a warning).")
    agreement_timeout: float = _arg(
        300.0, "Seconds each process waits, when training starts, for every process of a "
        "distributed run to get there (gloo) before raising RanksNotArrivedError.")

    def __new__(cls, *args, **kwargs):  # an unknown keyword: what to use (DPConfig's table)
        names = (*(f.name for f in fields(cls)), *_ALIASES)
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise unknown_settings_error(cls.__name__, unknown, names=names,
                                         fields_of=cls.__name__)
        return super().__new__(cls)

    def __post_init__(self):
        if self.task is not None and self.task not in _TASKS:
            raise ParameterValueError(f"task must be one of {_TASKS} or None, got {self.task!r}")
        if isinstance(self.dp_max_grad_norm, str):
            object.__setattr__(self, "dp_max_grad_norm", _read_bound(self.dp_max_grad_norm))
        if isinstance(self.batch_dims, str):
            object.__setattr__(self, "batch_dims", _read_batch_dims(self.batch_dims))
        if self.clipping == "adaptive" and self.target_unclipped_quantile is None:
            return  # refused with the other settings when training starts
        # one validation for every setting: DPConfig's (the planned length comes later)
        users = None if self.user_column is None else [0]
        DPConfig(**self.engine_settings(steps=1, users=users))

    def __setstate__(self, state: dict) -> None:
        # a pickle written before the fields were renamed holds max_grad_norm and seed
        self.__dict__.update({_ALIASES.get(k, k): v for k, v in state.items()})

    @property
    def max_grad_norm(self) -> float | list | dict:
        """``dp_max_grad_norm`` under :func:`~privlearn.torch.make_private`'s name."""
        return self.dp_max_grad_norm

    @property
    def seed(self) -> int | None:
        """``dp_seed`` under :func:`~privlearn.torch.make_private`'s name."""
        return self.dp_seed

    def engine_settings(self, **extra) -> dict:
        """The :func:`~privlearn.torch.make_private` settings: the fields shared with
        :class:`~privlearn.torch.config.DPConfig` (all but the Trainer's own
        ``user_column``, ``task`` and ``log_training_loss``) under DPConfig's names, and
        ``extra``."""
        return {**{_RENAMED.get(f.name, f.name): getattr(self, f.name) for f in fields(self)
                   if f.name not in _TRAINER_FIELDS}, **extra}


def _with_make_private_names(init):
    """The dataclass ``__init__``, also taking ``max_grad_norm=`` and ``seed=`` (the
    names of make_private and DPConfig) for ``dp_max_grad_norm`` and ``dp_seed``."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        # dataclasses.replace(args, max_grad_norm=...) passes every field, and the change
        # under its alias: the alias is the new value
        replacing = not args and {f.name for f in fields(PrivacyArguments)} <= set(kwargs)
        for alias, name in _ALIASES.items():
            if alias in kwargs:
                if replacing:
                    kwargs.pop(name)
                elif name in kwargs:
                    raise ParameterTypeError(
                        f"PrivacyArguments got both {alias}= and {name}=, which are one "
                        f"setting ({alias} is make_private's name of {name}): give one")
                kwargs[name] = kwargs.pop(alias)
        init(self, *args, **kwargs)

    return __init__


PrivacyArguments.__init__ = _with_make_private_names(PrivacyArguments.__init__)


def _read_bound(text: str) -> float | list | dict:
    """A clipping bound given as text: a number, or a JSON list or object of numbers."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, list | dict):
        return value
    raise ParameterValueError(
        f"dp_max_grad_norm must be a number > 0, or (with clipping='per_layer') a JSON list "
        f"or object of per-layer bounds, got the text {text!r}; e.g. --dp_max_grad_norm 1.0")


def _read_batch_dims(text: str) -> dict:
    """``batch_dims`` given as text (a command line): a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    raise ParameterValueError(
        f"batch_dims must be a JSON object {{layer name: 0 or 1}}, got the text {text!r}; "
        "e.g. --batch_dims '{\"encoder.lstm\": 1}' (the names of model.named_modules())")


# the fields that are not DPConfig's (the others are, as tests/torch/test_settings.py checks)
_TRAINER_FIELDS = ("user_column", "task", "log_training_loss")


def warn_unused_clipping(args, privacy: PrivacyArguments) -> None:
    """Warn when TrainingArguments.max_grad_norm was set (to other than its default, 0 or
    the per-example bound): a DPTrainer does not use it, which a script passing
    ``--max_grad_norm`` for DP-SGD's clipping would otherwise not learn."""
    given = getattr(args, "max_grad_norm", None)
    default = {f.name: f.default for f in dataclasses.fields(type(args))}.get("max_grad_norm")
    if given in (None, 0, default) or given == privacy.dp_max_grad_norm:
        return
    warnings.warn(
        f"TrainingArguments.max_grad_norm={given:g} (the Trainer's clipping of the averaged "
        "gradient) is not used by DPTrainer: each example's gradient is clipped at "
        f"PrivacyArguments.dp_max_grad_norm={privacy.dp_max_grad_norm!r} instead. Set that "
        "(--dp_max_grad_norm with HfArgumentParser) for DP-SGD's clipping bound",
        UserWarning, stacklevel=3)


def check_batch_size(args, privacy: PrivacyArguments, examples: int, world: int,
                     accumulation: int = 1) -> None:
    """Refuse, in the Trainer's terms and before anything runs, a
    ``per_device_train_batch_size`` that is no count, or (Poisson or fixed-size sampling of
    examples) whose global logical batch ``world * per_device_train_batch_size *
    accumulation`` (``accumulation``: ``gradient_accumulation_steps``) exceeds the
    ``examples`` of the training set: the sampling rate ``q = W B k / N`` would exceed 1."""
    b = check_count("per_device_train_batch_size", args.per_device_train_batch_size,
                    minimum=1, hint="the expected Poisson batch of each process, e.g. 64")
    if privacy.user_column is not None or str(privacy.sampling) not in ("poisson", "fixed"):
        return  # other units and samplings: make_private's own check
    total = world * b * accumulation
    if total > examples:
        acc = "" if accumulation == 1 else f" and gradient_accumulation_steps={accumulation}"
        what = ("it" if accumulation == 1 else "per_device_train_batch_size * "
                "gradient_accumulation_steps")
        lower = ("per_device_train_batch_size" if accumulation == 1 else
                 "per_device_train_batch_size or gradient_accumulation_steps")
        raise ConfigurationError(
            f"per_device_train_batch_size={b}{acc} with {world} process(es) is a global "
            f"batch of {total} (sampling rate q = {total}/{examples} > 1), more than the "
            f"{examples} examples of the training set; {what} must be at most "
            f"{examples // world}. Lower {lower} (or use a larger training set)")
