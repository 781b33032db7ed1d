"""What :class:`~privlearn.torch.hf.DPTrainer` reads of its examples and batches: a data
collator wrapper (:func:`expand_position_ids`, re-exported by :mod:`privlearn.torch.hf`),
each example's own positions and labels in a padded batch, the rows of a batch (refused
when they pack several sequences), and a column of the training set."""

from __future__ import annotations

import inspect

import torch

from privlearn.errors import ConfigurationError, ParameterValueError

__all__ = ["batch_rows", "column_of", "decoder_inputs", "expand_position_ids", "own_labels",
           "own_target_labels", "positions_of_left_padding", "refuse_packed_rows"]


def expand_position_ids(collator):
    """Wrap a data collator so that its batches carry ``position_ids`` of shape
    ``(B, T)`` (``0..T-1`` per row; with an ``attention_mask``, counted over its ones, as
    for left padding). Not needed for the engine: it expands the broadcast ``(1, T)`` ids
    GPT-2 and BERT build themselves; useful where explicit per-row positions are wanted
    (left padding)."""

    def collate(features):
        batch = collator(features)
        ids = batch.get("input_ids")
        if ids is not None and "position_ids" not in batch:
            mask = batch.get("attention_mask")
            if mask is not None:
                pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
            else:
                pos = torch.arange(ids.shape[-1]).expand(ids.shape[0], -1)
            batch["position_ids"] = pos.contiguous()
        return batch

    return collate


def positions_of_left_padding(model, inputs: dict) -> dict:
    """``inputs`` with ``position_ids`` counted over each row's ``attention_mask`` (as
    :func:`expand_position_ids` does) when the batch is left-padded (a row has padding
    before a token) and carries none.

    Without them a model numbers the positions ``0..T-1`` of the padded batch, so a
    left-padded example's tokens sit at positions shifted by its padding, i.e. by the
    length of the batch's *longest* example: with absolute position embeddings (GPT-2,
    BERT) its gradient then depends on another example of the batch, which per-example
    clipping does not bound. Counted over the mask, its positions are its own (rotary
    models are unchanged: only position differences enter their attention). A model
    whose ``forward`` has no ``position_ids`` parameter is refused for left-padded
    batches."""
    mask = inputs.get("attention_mask")
    ids = inputs.get("input_ids")
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or "position_ids" in inputs
            or not isinstance(ids, torch.Tensor) or mask.shape != ids.shape):
        return inputs
    mask = mask.long()
    if not bool((mask[:, 1:] > mask[:, :-1]).any()):  # right-padded (or no padding)
        return inputs
    # a parameter of its own (T5, BART take **kwargs but no position ids)
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ParameterValueError(
            f"the batch is left-padded (attention_mask has padding before tokens) and "
            f"{type(model).__name__}.forward takes no position_ids: its positions would "
            "follow the batch's longest example, so one example's gradient would depend on "
            "another's length. Pad on the right (tokenizer.padding_side='right')")
    return {**inputs, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}


def decoder_inputs(model, inputs: dict, labels: torch.Tensor) -> dict:
    """``inputs`` of an encoder-decoder ``model`` (BART, mBART, Marian, T5, ...) with the
    ``decoder_input_ids`` it would build from ``labels`` itself (the labels shifted right
    behind the decoder's start token, ``-100`` read as padding), when the batch has no
    decoder inputs of its own (``DataCollatorForSeq2Seq`` without ``model=``).

    The model builds them only when it is given ``labels``, and then returns its own loss,
    a token-level mean over the batch; DPTrainer takes the labels out and computes each
    example's loss over its own target tokens. Each row of the shifted labels is its
    example's alone, so the decoder sees what it sees with that example alone."""
    if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return inputs
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return {**inputs, "decoder_input_ids": prepare(labels=labels)}
    config = getattr(model, "config", None)
    start = getattr(config, "decoder_start_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    if start is None or pad is None or labels.dim() != 2:
        raise ParameterValueError(
            f"the batch has no decoder_input_ids, and {type(model).__name__} has no "
            "prepare_decoder_input_ids_from_labels, nor both config.decoder_start_token_id "
            f"({start!r}) and config.pad_token_id ({pad!r}) to shift the labels (shape "
            f"{tuple(labels.shape)}) right. Give the batches decoder_input_ids (e.g. "
            "DataCollatorForSeq2Seq(tokenizer, model=model)), or set those config fields")
    shifted = labels.new_full(labels.shape, start)
    shifted[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == -100, pad)
    return {**inputs, "decoder_input_ids": shifted}


def own_target_labels(model, labels: torch.Tensor, inputs: dict) -> torch.Tensor:
    """An encoder-decoder's target ``labels`` with ``-100`` (ignored) on the padding after
    each example's end: where the batch's ``decoder_attention_mask`` is 0 if it has one,
    else on the trailing run of ``config.pad_token_id`` of each row (all of it; when the
    pad token is also the end-of-sequence token, all but its first, the end).

    A collator padding the targets with the pad token instead of ``-100`` (a tokenizer's
    ``text_target=`` with ``padding=True``) gives each example as many pad targets as the
    batch's longest target is longer than its own: terms of its loss that exist only next
    to a longer example. Without them its loss is the one it has alone, unpadded."""
    if isinstance(inputs.get("decoder_attention_mask"), torch.Tensor):
        return own_labels(labels, inputs, False)
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None or labels.dim() != 2 or not bool((labels[:, -1] == pad).any()):
        return labels
    trailing = (labels == pad).flip(1).long().cumprod(1).flip(1).bool()
    if pad == getattr(config, "eos_token_id", None):  # the first of the run is the end
        trailing[:, 1:] &= trailing[:, :-1].clone()
        trailing[:, 0] = False
    return labels.masked_fill(trailing, -100)


def own_labels(labels: torch.Tensor, inputs: dict, shift: bool) -> torch.Tensor:
    """Per-token ``labels`` with ``-100`` (ignored) where the ``attention_mask`` marks
    padding, and, with ``shift`` (causal LM: position ``t - 1`` predicts label ``t``),
    where the predicting position is padding.

    Whether an example is padded, and by how much, follows the batch's longest example; a
    label at a padded position (a collator copying ``input_ids`` into ``labels``), or a
    first token predicted from the left padding before it, would put terms into an
    example's loss that exist only next to a longer example. Without them its loss is
    the one it has alone, unpadded."""
    # an encoder-decoder's labels are the decoder's: its mask, if any, not the encoder's
    decoder = any(str(k).startswith("decoder_") for k in inputs)
    mask = inputs.get("decoder_attention_mask" if decoder else "attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.shape != labels.shape or labels.dim() != 2:
        return labels
    pad = mask == 0
    if shift:
        pad = pad | torch.cat([torch.zeros_like(pad[:, :1]), pad[:, :-1]], dim=1)
    return labels.masked_fill(pad, -100) if bool(pad.any()) else labels


def batch_rows(inputs) -> int | None:
    """The rows of a batch: the leading dimension of its first tensor of at least one
    dimension (a dict, a ``BatchEncoding``); None when it has none."""
    for v in (inputs.values() if hasattr(inputs, "values") else ()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    return None


def refuse_packed_rows(inputs) -> None:
    """Refuse a batch whose rows each hold several sequences: ``position_ids`` (of shape
    ``(B, T)``) that start over inside a row, between two tokens the ``attention_mask``
    (if any) attends to -- packing, as trl's ``packing=True`` or a dataset of texts
    concatenated into rows with per-text positions make.

    DP-SGD samples, clips and accounts rows of the training set (Abadi et al. 2016,
    Algorithm 1: one example per row). Packed, a record shares its row (and its clipping
    bound) with other records, and a record cut across rows is in several: removing it
    changes one row's content, or several rows, which the accounted add/remove of one row
    does not describe. Packing that leaves no position marker (texts concatenated and cut
    into blocks without ``position_ids``) cannot be seen in the batch; the training set's
    rows are then the privacy unit.

    Raises
    ------
    ConfigurationError
        Naming the row and the token where the positions start over."""
    pos = inputs.get("position_ids") if hasattr(inputs, "get") else None
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] < 2:
        return
    restart = pos[:, 1:] <= pos[:, :-1]
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == pos.shape:
        restart &= (mask[:, 1:] != 0) & (mask[:, :-1] != 0)  # between attended tokens
    if not bool(restart.any()):
        return
    row, token = (int(i) for i in restart.nonzero()[0])
    raise ConfigurationError(
        f"the batch's rows hold several sequences: position_ids start over inside row "
        f"{row} (token {token + 1} has position {int(pos[row, token + 1])} after "
        f"{int(pos[row, token])}), i.e. the rows are packed (trl's packing=True, texts "
        "concatenated into rows with per-text positions). DP-SGD samples, clips and "
        "accounts rows: a record packed with others shares their row and its clipping "
        "bound, and one cut across rows is in several, which the accounted add/remove of "
        "one row does not describe. No step was taken with this batch. Give each record a "
        "row of its own (pad instead of packing: e.g. DataCollatorWithPadding, trl's "
        "packing=False)")


def column_of(dataset, name: str) -> list:
    """The values of column ``name`` of every example (a Hugging Face ``datasets.Dataset``
    column, or the key of each example of a map-style dataset): the users of
    ``PrivacyArguments(user_column=...)``."""
    # only a datasets.Dataset is indexed by a column name (a tensor-backed dataset warns)
    if name in (getattr(dataset, "column_names", None) or ()):
        values = dataset[name]  # the whole column
        if len(values) == len(dataset):
            return list(values)
    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, dict) or name not in item:
            raise ParameterValueError(
                f"user_column={name!r}: example {i} of the training set has no such key "
                f"(keys: {sorted(item) if isinstance(item, dict) else '?'})")
        v = item[name]
        out.append(v.item() if isinstance(v, torch.Tensor) else v)
    return out
