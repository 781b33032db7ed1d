"""Checks and helpers of :func:`privlearn.torch.make_private`: positive numbers, the
sampling seed shared by all ranks, per-layer clipping bounds, optimizers whose step the
DP step cannot drive, which data loaders can be accounted (and with which batch size),
and token-level labels; moved out of
:mod:`privlearn.torch.privacy_engine`, which still imports (re-exports) every name.
"""

from __future__ import annotations

import inspect
import math
import secrets
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from privlearn import _validation as _v
from privlearn.accounting import Neighbouring
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
from privlearn.torch._state_checks import RESUME_HINT
from privlearn.torch.data import FixedSizeBatchSampler, PoissonBatchSampler
from privlearn.torch.samplers import DistributedPoissonBatchSampler, _AccountedSampler
from privlearn.torch.schedule import SAMPLINGS


def _check_pos(name: str, value, allow_inf: bool = False) -> float:
    """A number > 0 (finite unless ``allow_inf``), by :mod:`privlearn._validation`."""
    return _v.check_positive(name, value, allow_inf=allow_inf)


#: Optimizer classes whose ``step`` cannot apply the DP gradient, with the reason and what
#: to use instead (besides those whose ``step`` requires a closure, refused by signature).
REFUSED_OPTIMIZERS: dict[type, str] = {
    torch.optim.SparseAdam: "it updates only from sparse gradients, and the DP gradient is "
                            "dense (the noise is added to every row of an embedding, not "
                            "only to the rows the batch used); use torch.optim.Adam",
}


def _check_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before anything is built, an optimizer whose ``step`` the DP step cannot
    drive: one whose ``step`` requires a closure (``torch.optim.LBFGS``: it re-evaluates
    the loss of the batch several times per step, and its line search compares loss
    values computed from the private batch without noise; the DP step calls the wrapped
    ``step()`` once, with the clipped, noised gradient), or one of
    :data:`REFUSED_OPTIMIZERS`. Accepted, either would fail inside the first
    ``optimizer.step()``, after the noisy gradient was released and accounted."""
    name = type(optimizer).__name__
    for cls, why in REFUSED_OPTIMIZERS.items():
        if isinstance(optimizer, cls):
            raise ParameterTypeError(
                f"optimizer {name} cannot run the DP step: {why}. Nothing was changed")
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without an inspectable signature
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ParameterTypeError(
            f"optimizer {name} requires a closure in step(): it re-evaluates the loss of "
            "the batch several times per step (its line search compares loss values of the "
            "private batch, which no noise covers), while DP-SGD releases one clipped, "
            "noised gradient per batch and calls the wrapped step() once with it. Use a "
            "first-order optimizer whose closure is optional (torch.optim.SGD, Adam, "
            "AdamW, ...). Nothing was changed")


def _check_loadable(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Refuse, before anything is loaded, a checkpoint whose model or optimizer state does
    not fit this run's (another architecture, other parameter groups): loading it failed
    half-way, after the privacy history (and torch, some of the weights) had been loaded,
    so the run could neither train as it was nor load the right checkpoint."""
    own, saved = model.state_dict(), state.get("model", {})
    for k, v in saved.items():  # torch would fail on it half-way through the load
        if isinstance(own.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
            raise ParameterTypeError(
                f"state['model'][{k!r}] must be a tensor, got {_v._show(v)[:80]} "
                f"({type(v).__name__}); {RESUME_HINT}. Nothing was loaded")
    diff = [f"missing {k!r}" for k in own if k not in saved][:3]
    diff += [f"unexpected {k!r}" for k in saved if k not in own][:3]
    diff += [f"{k!r}: saved shape {tuple(v.shape)}, here {tuple(own[k].shape)}"
             for k, v in saved.items() if k in own and isinstance(v, torch.Tensor)
             and isinstance(own[k], torch.Tensor) and v.shape != own[k].shape][:3]
    groups = [len(g["params"]) for g in state.get("optimizer", {}).get("param_groups", [])]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if groups != mine:
        diff.append(f"optimizer parameters per group: saved {groups}, here {mine}")
    if diff:
        raise ConfigurationError(
            "the saved state does not fit this run's model and optimizer (" + "; ".join(diff)
            + "): build the same model and optimizer as the run that saved it, then "
            "make_private with the same arguments. Nothing was loaded")


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


def _per_layer_bounds(model: nn.Module, max_grad_norm) -> dict:
    """``name -> C_k`` for every trainable parameter (``model.named_parameters()`` order)
    from a list in ``model.parameters()`` order or a dict by name; refuses a wrong length,
    unknown or missing names and bounds outside (0, inf)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if isinstance(max_grad_norm, list | tuple):
        if len(max_grad_norm) != len(names):
            raise ParameterValueError(
                f"clipping='per_layer' needs max_grad_norm with one bound per trainable "
                f"parameter in model.parameters() order: the model has {len(names)} "
                f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}), got a list of "
                f"{len(max_grad_norm)}. Pass a list of {len(names)} positive numbers or a "
                "dict {parameter name: bound}")
        items = list(zip(names, max_grad_norm, strict=True))
    elif isinstance(max_grad_norm, dict):
        unknown = sorted(set(max_grad_norm) - set(names))
        missing = [n for n in names if n not in max_grad_norm]
        if unknown or missing:
            # a tensor registered under several names (tied weights, a masked-LM head's
            # decoder bias) is one parameter, with one bound, under its first name
            first = {id(p): n for n, p in reversed(list(
                model.named_parameters(remove_duplicate=False)))}
            tied = "".join(
                f"; {n!r} is the same tensor as {first[id(p)]!r} (one parameter, one bound, "
                f"under the name {first[id(p)]!r})"
                for n, p in model.named_parameters(remove_duplicate=False)
                if n in unknown and first[id(p)] != n)
            raise ParameterValueError(
                "clipping='per_layer' with a dict max_grad_norm needs exactly the names of "
                f"the trainable parameters (model.named_parameters()); unknown: {unknown}, "
                f"missing: {missing}{tied}")
        items = [(n, max_grad_norm[n]) for n in names]
    else:
        raise ParameterTypeError(
            "clipping='per_layer' needs max_grad_norm as a list (one bound per trainable "
            "parameter, model.parameters() order) or a dict {parameter name: bound}, got "
            f"{max_grad_norm!r}")
    out = {}
    for n, c in items:
        try:
            v = float(c)
        except (TypeError, ValueError):
            raise ParameterTypeError(f"max_grad_norm[{n!r}] must be a number, got {c!r}") from None
        if not 0 < v < math.inf:
            raise ParameterValueError(f"max_grad_norm[{n!r}] must be in (0, inf), got {c!r}")
        out[n] = v
    return out


_SAMPLING_HELP = (
    "Pass DataLoader(dataset, batch_size=B) with no shuffle and no sampler: make_private "
    "replaces the batching by the sampling it accounts, sampling='poisson' (each example "
    "joins each batch independently with probability B / len(dataset)) or "
    "sampling='fixed' (B distinct examples drawn uniformly at every step); or pass one "
    "of privlearn.torch's DP samplers as batch_sampler= (PoissonBatchSampler, "
    "FixedSizeBatchSampler, CyclicPoissonBatchSampler, ...) with the sampling= it draws")


def _accountable_batch_size(data_loader: DataLoader, sampling: str, n: int,
                            world: int) -> float:
    """The per-rank (expected) batch size of a loader whose sampling make_private can
    replace by the accounted one; refuses every other loader (Chua et al. 2024, "How
    Private are DP-SGD Implementations?": shuffled batches accounted as Poisson overstate
    privacy). A loader with one of privlearn's DP samplers is read by
    :func:`_given_dp_sampling`."""
    batch_size = data_loader.batch_size
    if batch_size is None:
        bs = data_loader.batch_sampler
        if bs is None:  # DataLoader(batch_size=None): automatic batching turned off
            raise ConfigurationError(
                "data_loader has batch_size=None and no batch_sampler (automatic batching "
                "turned off: it yields one example at a time), so there is no batch size "
                f"to sample batches at. {_SAMPLING_HELP}")
        raise ConfigurationError(
            f"data_loader uses batch_sampler={type(bs).__name__}, which is not "
            f"{sampling!r} sampling, so the accountant could not describe the batches it "
            f"draws. {_SAMPLING_HELP}")
    smp = data_loader.sampler
    if type(smp) is not torch.utils.data.SequentialSampler:
        raise ConfigurationError(
            f"data_loader uses {_sampler_in_words(smp)}, a sampling privlearn cannot "
            "account: its batches are not Poisson or uniformly fixed-size samples, and "
            f"accounting them as such would overstate privacy. {_SAMPLING_HELP}")
    _check_sequential_source(smp, n)
    return batch_size


def _check_sequential_source(smp, n: int) -> None:
    """A ``SequentialSampler`` over a data source of another length than the loader's
    dataset (``sampler=SequentialSampler(range(k))``: the first ``k`` examples) reads
    other positions than make_private's sampler, which draws from the whole dataset:
    refuse it rather than train on examples the loader left out."""
    try:
        k = len(smp)
    except TypeError:
        return
    if k != n:
        raise ConfigurationError(
            f"data_loader's sampler=SequentialSampler reads {k} positions, but its dataset "
            f"has {n} examples: make_private replaces the sampler by its own over the whole "
            "dataset, so the examples the sampler leaves out would be trained on. Pass "
            f"DataLoader(torch.utils.data.Subset(dataset, range({k})), batch_size=B) to "
            "train on those positions only, or leave sampler= out. Nothing was changed")


def _given_dp_sampling(data_loader: DataLoader, sampling: str, cycle_length: int | None,
                       n: int, world: int) -> tuple[float, int | None, float] | None:
    """For a loader whose ``batch_sampler`` is one of privlearn's DP samplers (a
    registered sampling's draw): ``(per-rank batch size, cycle length or None, sampling
    rate)`` of the run that draws exactly its batches, which make_private then rebuilds
    and accounts (its other settings are checked by :func:`_check_given_sampler`); None
    for any other loader. Refused when the sampler draws another sampling than
    ``sampling`` or another cycle than ``cycle_length``, naming what to pass instead."""
    bs = data_loader.batch_sampler
    if data_loader.batch_size is not None or not isinstance(bs, _AccountedSampler):
        return None
    law, name = bs.law, type(bs).__name__
    cycle = int(bs.cycle_length) if law.cycled else None
    settings = f"sampling={law.name!r}" + ("" if cycle is None else f", cycle_length={cycle}")
    if SAMPLINGS.get(sampling) is not law:
        raise ConfigurationError(
            f"data_loader's batch_sampler={name} draws {settings} batches, but "
            f"make_private was given sampling={sampling!r}: the accountant would describe "
            f"other batches than those drawn. Pass make_private(..., {settings}) to train "
            f"on this sampler's batches, or DataLoader(dataset, batch_size=B) with the "
            f"sampling= of your choice. Nothing was changed")
    if cycle is not None and cycle_length is not None and cycle_length != cycle:
        raise ConfigurationError(
            f"data_loader's batch_sampler={name} has cycle_length={cycle}, but make_private "
            f"was given cycle_length={cycle_length}: pass make_private(..., {settings}) "
            "(or leave cycle_length out, which takes the sampler's), or build the sampler "
            f"with cycle_length={cycle_length}. Nothing was changed")
    rate = float(bs.sampling_rate)
    if isinstance(bs, FixedSizeBatchSampler):
        return float(bs.batch_size), cycle, rate
    return law.expected_batch(rate, n, cycle or 1) / world, cycle, rate


def _sampler_in_words(smp) -> str:
    """The loader's ``sampler`` as the user gave it: its class and, for a sampler that
    has one, its ``replacement`` flag (``shuffle=True`` builds a ``RandomSampler``
    without replacement, which is the only way the flag is not the user's own)."""
    name = type(smp).__name__
    replacement = getattr(smp, "replacement", None)
    if type(smp) is torch.utils.data.RandomSampler and not replacement:
        return (f"sampler={name}(replacement=False) (what shuffle=True builds: every "
                "epoch a random permutation cut into fixed-size batches)")
    if isinstance(replacement, bool):
        return (f"sampler={name}(replacement={replacement})"
                + (" (batches of examples drawn with replacement, so an example may "
                   "appear several times in a batch)" if replacement else ""))
    return f"sampler={name}"


def _warn_drop_last(data_loader: DataLoader, law, stacklevel: int) -> None:
    """``drop_last=True`` cannot apply to the batches of a sampling of random batch sizes
    (``law``, a :class:`~privlearn.torch.schedule.SamplingLaw` of add/remove neighbours:
    the Poisson family): say so, instead of ignoring it silently. Fixed-size samplings
    (replace-one) draw batches of ``batch_size`` examples, what ``drop_last`` asks for."""
    if not getattr(data_loader, "drop_last", False) or \
            law.relation is not Neighbouring.ADD_REMOVE:
        return
    warnings.warn(
        f"data_loader has drop_last=True, which does not apply under sampling="
        f"{law.name!r}: make_private replaces the loader's batches by the DP sampler's, "
        "whose sizes are random (each example is in a batch independently, with "
        "probability q), so there is no incomplete last batch to drop, any batch may be "
        "smaller than batch_size (0 included), and every batch is trained on (the "
        "accounting assumes it). Use sampling='fixed' for batches of exactly batch_size "
        "examples, or drop_last=False to silence this", UserWarning,
        stacklevel=stacklevel + 1)


def _warn_loader_generator(data_loader: DataLoader, cfg, stacklevel: int) -> None:
    """A ``generator`` given to the loader draws none of the DP run's batches (the DP
    sampler does, from ``seed`` or the operating system's entropy): without ``seed`` (and
    outside secure mode, which never repeats), a loop that set it to repeat a run would
    not; say so."""
    if (getattr(data_loader, "generator", None) is None or cfg.seed is not None
            or cfg.secure_mode):
        return
    warnings.warn(
        "data_loader has a generator, which does not draw the batches of the DP run: "
        "make_private replaces the loader's sampling by the DP sampler, which draws from "
        "seed= or, without it, from the operating system's entropy (a different run each "
        "time; the generator only seeds the workers). Pass seed= to repeat a run",
        UserWarning, stacklevel=stacklevel + 1)


def _warn_user_rate(data_loader: DataLoader, n_examples: int, n_users: int,
                    rate: float, stacklevel: int) -> None:
    """With ``users=``, a ``PoissonBatchSampler`` given as the loader's ``batch_sampler``
    states an inclusion probability of *examples*; make_private keeps its expected batch
    size, ``sampling_rate * len(dataset)``, as the expected number of *users* per batch
    (the meaning of ``batch_size`` under user-level privacy), so each user is drawn with
    probability ``rate`` -- the rate accounted, and the one the rebuilt sampler draws at
    -- not the ``sampling_rate`` written: say so, and what to pass instead."""
    bs = data_loader.batch_sampler
    if data_loader.batch_size is not None or not isinstance(bs, PoissonBatchSampler):
        return
    given = float(bs.sampling_rate)
    if math.isclose(rate, given, rel_tol=1e-12, abs_tol=0.0):
        return
    b = given * n_users  # the expected users per batch that draws each with prob. given
    if b >= 1 and math.isclose(b, round(b)):
        instead = f"DataLoader(dataset, batch_size={round(b)})"
    else:
        lo, hi = max(1, math.floor(b)), max(1, math.ceil(b))
        instead = (f"DataLoader(dataset, batch_size=B) with B = {b:g} rounded to an "
                   f"integer (batch_size={lo} draws each user with probability "
                   f"{min(1.0, lo / n_users):g}"
                   + (f", {hi} with {min(1.0, hi / n_users):g}" if hi != lo else "") + ")")
    warnings.warn(
        f"data_loader's batch_sampler=PoissonBatchSampler(sampling_rate={given:g}) samples "
        f"examples, but with users= make_private samples users: it keeps the expected "
        f"batch size sampling_rate * len(dataset) = {given * n_examples:g} as the expected "
        f"number of users per batch, so each of the {n_users} users joins a batch with "
        f"probability {rate:g}, the rate accounted (not {given:g}). To draw each user with "
        f"probability {given:g}, pass {instead}: under users= a loader's batch_size is the "
        "expected number of users per batch",
        UserWarning, stacklevel=stacklevel + 1)


def _check_given_sampler(data_loader: DataLoader, n: int, secure: bool,
                         per_epoch: int, rank: int = 0, world: int = 1) -> None:
    """One of privlearn's DP samplers given as the loader's ``batch_sampler`` is rebuilt
    by make_private from its rate (or batch size) over the whole dataset, on this
    process's ``rank`` of ``world``: refuse what the rebuilt sampler would silently drop
    (another dataset size, a subset of indices, another shard, secure sampling, another
    epoch length)."""
    bs = data_loader.batch_sampler
    if data_loader.batch_size is not None or not isinstance(bs, _AccountedSampler):
        return
    name = type(bs).__name__
    dropped = []
    if bs.num_samples != n:
        dropped.append(f"num_samples={bs.num_samples} (the dataset has {n} examples)")
    shard = (getattr(bs, "rank", 0), getattr(bs, "world_size", 1))
    if shard != (rank, world):
        dropped.append(
            f"rank={shard[0]}, world_size={shard[1]} (this process is rank {rank} of "
            f"{world}" + (", no process group is initialised" if world == 1 else "")
            + "; make_private draws each rank's part of the sample itself: pass "
            + ("PoissonBatchSampler(len(dataset), q)" if world == 1
               else f"build it with rank={rank}, world_size={world}") + ")")
    elif (getattr(bs, "indices", None) is not None
          and not isinstance(bs, DistributedPoissonBatchSampler)):
        dropped.append(f"indices= (a subset of {len(bs.indices)} examples; pass "
                       "DataLoader(torch.utils.data.Subset(dataset, indices), ...) to "
                       "train on a subset)")
    if getattr(bs, "secure", False) and not secure:
        dropped.append("secure=True (pass make_private(..., secure_mode=True))")
    if bs.steps != per_epoch:
        dropped.append(f"steps={bs.steps} (the run's epoch is {per_epoch} steps at this "
                       "rate)")
    if dropped:
        raise ConfigurationError(
            f"data_loader's batch_sampler={name} is replaced by make_private's own sampler "
            "over the whole dataset at its rate, which would drop its "
            + "; ".join(dropped) + ". Give the sampler over the loader's whole dataset "
            "with this process's rank and world size and its default steps, or simply "
            "DataLoader(dataset, batch_size=B). Nothing was changed")


def _guard_token_level_labels(model: nn.Module) -> list:
    """Forward pre-hooks refusing a Hugging Face model called with token-level
    ``labels=`` (its loss is a mean over all tokens of the batch, not over examples)."""
    hooks = []
    for m in model.modules():
        if not (hasattr(m, "config") and hasattr(m, "base_model_prefix")):
            continue

        def pre_hook(module, args, kwargs):
            labels = kwargs.get("labels")
            if (isinstance(labels, torch.Tensor) and labels.dim() >= 2 and module.training
                    and torch.is_grad_enabled()):
                raise ConfigurationError(
                    f"{type(module).__name__} was called with token-level labels= (shape "
                    f"{tuple(labels.shape)}): Hugging Face then averages the loss over all "
                    "tokens of the batch, so each example's gradient is scaled by its share "
                    "of the batch's tokens and per-example clipping no longer bounds one "
                    "example's influence. Call the model without labels and use "
                    "loss = privlearn.torch.per_sequence_cross_entropy(out.logits, labels, "
                    "shift=True) (shift=True for causal LMs, False for token "
                    "classification / masked LM)")
            return None

        hooks.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
    return hooks


def given_sampler_seed(data_loader: DataLoader, cfg, seed: int | None, world: int,
                       stacklevel: int) -> int | None:
    """The seed of the sampler make_private builds for ``data_loader`` (``seed``, from its
    own ``seed=`` and the rank): one of privlearn's DP samplers given as the loader's
    ``batch_sampler`` with a ``seed`` of its own is rebuilt with that seed, so the run
    draws the batches (and the layout) the sampler was built to draw. Secure mode (the OS
    CSPRNG), a distributed fixed-size run (one generator shared by the ranks, seeded from
    make_private's ``seed=``: said unless it is the sampler's) and a ``seed=`` given to
    make_private are said in a warning. Whether to warn depends on the sampler's seed and
    make_private's ``seed=`` only, never on the rank's derived ``seed``, so every rank
    warns alike."""
    bs = data_loader.batch_sampler
    own = getattr(bs, "seed", None)
    if data_loader.batch_size is not None or not isinstance(bs, _AccountedSampler) \
            or own is None:
        return seed
    name = f"{type(bs).__name__}(seed={own})"
    if cfg.secure_mode or (cfg.sampling == "fixed" and world > 1):
        if own == cfg.seed:  # (not secure) the shared generator is seeded from it
            return seed
        why = ("secure_mode draws every batch from the OS CSPRNG" if cfg.secure_mode else
               "the ranks of a distributed fixed-size run share one generator, seeded from "
               "make_private's seed=")
        warnings.warn(
            f"data_loader's batch_sampler={name} is rebuilt without its seed: {why}, so "
            "the run's batches are not the ones this sampler would draw",
            UserWarning, stacklevel=stacklevel + 1)
        return seed
    if cfg.seed is not None:
        warnings.warn(
            f"data_loader's batch_sampler={name} draws its batches from its own seed, "
            f"not from make_private's seed={cfg.seed} (which seeds the noise): the run "
            "trains on the batches this sampler draws. Build the sampler without seed= "
            "to draw them from make_private's seed", UserWarning, stacklevel=stacklevel + 1)
    return own
