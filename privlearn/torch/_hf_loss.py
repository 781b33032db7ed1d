"""The losses of :class:`privlearn.torch.hf.DPTrainer` (no transformers import): Hugging
Face's losses of ``*ForSequenceClassification`` models as means over examples, and the
check of a subclass's own ``compute_loss`` (:func:`check_per_example_loss`)."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Mapping

import numpy as np
import torch
from torch.nn import functional as F

from privlearn.errors import ConfigurationError, ParameterValueError
from privlearn.torch._hf_accumulate import logical_loader

__all__ = ["check_per_example_loss", "sequence_classification_loss",
           "warn_own_compute_loss"]

#: Training examples the check of a subclass's ``compute_loss`` is run on.
PROBED_EXAMPLES = 8
#: Relative tolerance of that check: an example's share of the gradient is 1/k of its own
#: loss's up to float rounding (a token-level mean over examples of 4 and 10 tokens is off
#: by a factor 0.57 or 1.43).
_SHARE_TOLERANCE = 1e-2
#: Training examples, spread evenly over the dataset, among which the check looks for
#: examples unlike each other (:func:`_unlike_examples`), and the largest integer field
#: of an example it reads.
_SCANNED = 256
_MAX_FIELD_NUMEL = 1 << 16


def sequence_classification_loss(model, logits: torch.Tensor,
                                 labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's sequence-classification losses, as means over examples."""
    cfg = getattr(model, "config", None)
    problem = getattr(cfg, "problem_type", None)
    num_labels = getattr(cfg, "num_labels", logits.shape[-1])
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        # one row of targets per example, shaped as its outputs: mse_loss would broadcast
        # labels of shape (B, 1) against outputs (B,) into (B, B), each example's loss
        # then holding every other example's label (its gradient no longer its own)
        out = logits.float().reshape(logits.shape[0], -1)
        if labels.dim() == 0 or labels.shape[0] != out.shape[0] or \
                labels.numel() != out.numel():
            raise ParameterValueError(
                f"regression labels must hold {out.shape[1]} target(s) per example, shape "
                f"({out.shape[0]},{' ' + str(out.shape[1]) if out.shape[1] > 1 else ''}) "
                f"(num_labels={num_labels}), got shape {tuple(labels.shape)} for "
                f"logits of shape {tuple(logits.shape)}. Fix the collator or num_labels")
        return F.mse_loss(out, labels.to(torch.float32).reshape(out.shape))
    if problem == "single_label_classification":
        return F.cross_entropy(logits.float().view(-1, num_labels), labels.view(-1))
    # multi-label: mean over examples and labels (a fixed divisor per example)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.to(torch.float32))


def warn_own_compute_loss(trainer_cls: type, base: type) -> None:
    """Warn when a subclass of ``base`` (:class:`~privlearn.torch.hf.DPTrainer`)
    overrides ``compute_loss``: DP-SGD's sensitivity holds only for a mean over examples
    of per-example losses, which :func:`check_per_example_loss` checks on a few training
    examples when training starts, not on every batch."""
    if trainer_cls.compute_loss is base.compute_loss:
        return
    warnings.warn(
        f"{trainer_cls.__name__}.compute_loss overrides DPTrainer's: it must return the mean "
        "over the batch's examples of per-example losses (one value per example, each from "
        "that example alone, e.g. privlearn.torch.per_sequence_cross_entropy). A token-level "
        "mean over the whole batch (F.cross_entropy over its flattened tokens) weighs each "
        "example by its share of the batch's tokens, so removing one example rescales the "
        "others' gradients, which per-example clipping does not bound; DPTrainer checks it on "
        "a few training examples when training starts (refusing such a loss), not on "
        "every batch. Prefer PrivacyArguments(task=...)", UserWarning, stacklevel=3)


def check_per_example_loss(trainer, model, examples: int = PROBED_EXAMPLES) -> None:
    """Refuse, before the first batch is drawn, a ``compute_loss`` (a subclass's own) that
    is not a mean over the batch's examples of per-example losses.

    DP-SGD's per-example clipping bounds one example's contribution only when the loss is
    ``(1/B) sum_i l_i`` with ``l_i`` a function of example ``i`` alone (Abadi et al. 2016,
    Algorithm 1). Then the gradient of the batch's loss with respect to example ``i``'s
    model outputs is exactly ``1/B`` of the gradient of ``l_i`` alone, whatever the other
    examples. A token-level mean (``F.cross_entropy`` over the batch's flattened tokens,
    or the model's own ``outputs.loss``) gives it ``n_i / sum_j n_j`` instead (its share of
    the batch's tokens), a sum ``1``, a class-weighted mean ``w_i / sum_j w_j``: removing
    an example would rescale the others' gradients, which clipping does not bound.

    The check collates the first ``examples`` training examples into one batch (the
    trainer's loader's collate function, the global generators left as they were), runs
    ``trainer.compute_loss`` on it and on each of its rows alone, the model in eval mode
    and its forward without gradients (nothing is recorded, no parameter gradient), and
    compares the gradients with respect to the model's outputs row by row. On examples
    that are alike (all of one length, all of one class) a token-level or class-weighted
    mean is a mean of per-example losses, so the check then runs again on examples picked
    to differ (:func:`_unlike_examples`: other numbers of label tokens and of attended
    positions, other labels). Nothing is checked when the model's outputs cannot be
    traced to the loss (a ``compute_loss`` calling a submodule, a loss of no tensor
    output).

    Raises
    ------
    ConfigurationError
        An example's share differs from ``1/k`` by more than 1%.
    """
    loader = logical_loader(trainer.privacy_engine.data_loader)
    n = min(examples, len(loader.dataset))
    if n < 2:
        return
    first = list(range(n))
    _check_examples(trainer, model, loader, first, f"the first {n} training examples")
    unlike = _unlike_examples(loader.dataset, n)
    if unlike is not None and unlike != first:
        _check_examples(trainer, model, loader, unlike, f"training examples {unlike}")


def _check_examples(trainer, model, loader, indices: list, which: str) -> None:
    """:func:`check_per_example_loss` on the examples at ``indices`` (``which`` names
    them in the error)."""
    n = len(indices)
    with _generators_kept():
        batch = loader.collate_fn([loader.dataset[i] for i in indices])
    batch = trainer._prepare_inputs(batch)
    if not isinstance(batch, Mapping):  # (a BatchEncoding too: the tokenizers' collators)
        return
    batch = dict(batch)
    if not any(
            isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n for v in batch.values()):
        return
    with _probing(model):
        full = _output_grads(trainer, model, batch, n)
        if full is None:
            return
        alone = []
        for i in range(n):
            row = {k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n
                   else v for k, v in batch.items()}
            g = _output_grads(trainer, model, row, 1)
            if g is None:
                return
            alone.append(g[0])
    for i, (mine, own) in enumerate(zip(full.tolist(), alone, strict=True)):
        share = n * mine / own if own > 0 else (1.0 if mine == 0 else float("inf"))
        if abs(share - 1.0) <= _SHARE_TOLERANCE:
            continue
        raise ConfigurationError(
            f"{type(trainer).__name__}.compute_loss is not a mean over the batch's examples "
            f"of per-example losses: on {which}, the gradient of the batch's loss with "
            f"respect to example {i}'s model outputs is {share:.4g} / "
            f"{n} of the gradient of that example's loss alone; it must be exactly 1/{n} "
            "whatever the other examples (a token-level mean, e.g. the model's own "
            "outputs.loss or F.cross_entropy over the batch's tokens, weighs an example by "
            "its share of the batch's tokens, a sum by the batch size, a weighted mean by "
            "the others' weights). Removing one example would then rescale the others' "
            "gradients, which per-example clipping does not bound. No batch was drawn. "
            "Return the mean over examples of per-example losses "
            "(privlearn.torch.per_sequence_cross_entropy), or drop the override and pass "
            "PrivacyArguments(task=...)")


def _signature(example) -> tuple | None:
    """What a token-level or weighted mean weighs an example by: per integer field of a
    mapping example, its number of entries other than -100 and of non-zero entries (label
    tokens, attended positions), and a scalar field's value (a class); None for an
    example that is not a mapping."""
    if not isinstance(example, Mapping):
        return None
    out = []
    for key in sorted(example, key=str):
        v = example[key]
        try:
            t = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError):  # text, nested lists: not a weight
            continue
        if t.dtype.is_floating_point or t.dtype.is_complex or t.numel() > _MAX_FIELD_NUMEL:
            continue
        out.append((str(key), t.item()) if t.dim() == 0 else
                   (str(key), int((t != -100).sum()), int((t != 0).sum())))
    return tuple(out)


def _unlike_examples(dataset, n: int) -> list | None:
    """Up to ``n`` training examples, among ``_SCANNED`` spread evenly over ``dataset``,
    of signatures (:func:`_signature`) as many different ones as there are, in order; None
    when those examples are all alike (or not mappings)."""
    size = len(dataset)
    scanned = np.unique(np.linspace(0, size - 1, min(size, _SCANNED)).round().astype(int))
    with _generators_kept():
        signatures = [(int(i), _signature(dataset[int(i)])) for i in scanned]
    distinct: dict = {}
    for i, sig in signatures:
        distinct.setdefault(sig, i)
    if len(distinct) < 2 or None in distinct:
        return None
    picked = list(distinct.values())[:n]
    picked += [i for i, _ in signatures if i not in picked][:n - len(picked)]
    return sorted(picked)


@contextlib.contextmanager
def _generators_kept():
    """The global generators (torch CPU, NumPy, ``random``) as they were, after a collate
    function that draws (masking)."""
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


@contextlib.contextmanager
def _probing(model):
    """Every module of ``model`` in eval mode (no dropout: a row alone and in the batch
    see the same function), each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _output_grads(trainer, model, inputs: dict, rows: int):
    """Squared norms, per row, of the gradient of ``trainer.compute_loss(model, inputs)``
    with respect to the tensors ``model`` returns (its forward run without gradients, its
    floating-point outputs made leaves); None when no output reaches the loss."""
    leaves: list[torch.Tensor] = []
    modes: list[bool] = []

    def before(module, args, kwargs):
        modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def after(module, args, kwargs, out):
        torch.set_grad_enabled(modes.pop())
        return _as_leaves(out, leaves)

    hooks = [model.register_forward_pre_hook(before, prepend=True, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True, always_call=True)]
    try:
        with torch.enable_grad():
            loss = trainer.compute_loss(model, inputs,
                                        num_items_in_batch=_items(trainer, inputs))
            if isinstance(loss, tuple):
                loss = loss[0]
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not leaves:
                return None
            grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    per_row = [g.detach().double().reshape(rows, -1).pow(2).sum(1) for g in grads
               if g is not None and g.dim() and g.shape[0] == rows]
    return None if not per_row else torch.stack(per_row).sum(0).sqrt().cpu()


def _as_leaves(out, leaves: list):
    """``out`` with its floating-point tensors (a tensor, a mapping's values, a tuple's
    items) replaced by detached copies that require gradients, collected in ``leaves``."""
    def leaf(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach().requires_grad_(True)
            leaves.append(v)
        return v

    if isinstance(out, torch.Tensor):
        return leaf(out)
    if isinstance(out, dict):  # a ModelOutput sets the attribute with the key
        for k in list(out.keys()):
            out[k] = leaf(out[k])
        return out
    if isinstance(out, tuple) and type(out) is tuple:
        return tuple(leaf(v) for v in out)
    return out


def _items(trainer, inputs: dict):
    """The ``num_items_in_batch`` the Trainer passes ``compute_loss`` for ``inputs``
    (its label tokens), or None."""
    count = getattr(trainer, "_get_num_items_in_batch", None)
    if count is None or "labels" not in inputs:
        return None
    try:
        return count([inputs], trainer.args.device)
    except Exception:  # noqa: BLE001 - not counted: None, as the Trainer does then
        return None
