"""DPTrainer subclasses with a compute_loss of their own (privlearn.torch._hf_loss): a
loss that is not a mean over examples of per-example losses is refused before the first
batch; one that is trains exactly as DPTrainer's own loss."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from test_hf_trainer import _args, _llama, _TextSet  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import per_sequence_cross_entropy  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402


def _split(inputs):
    inputs = dict(inputs)
    return inputs.pop("labels"), inputs


class TokenMean(DPTrainer):  # F.cross_entropy over the batch's flattened tokens
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, inputs = _split(inputs)
        logits = model(**inputs).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class PerTokenItems(DPTrainer):  # summed over tokens, divided by the Trainer's count
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, inputs = _split(inputs)
        logits = model(**inputs).logits[:, :-1]
        items = (labels[:, 1:] != -100).sum() if num_items_in_batch is None \
            else num_items_in_batch
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               reduction="sum") / items


class Summed(DPTrainer):  # per-example losses summed, not averaged
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, inputs = _split(inputs)
        return per_sequence_cross_entropy(model(**inputs).logits, labels, shift=True,
                                          reduction="sum")


class ClassWeighted(DPTrainer):  # weighted mean: divided by the batch's total weight
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, inputs = _split(inputs)
        return F.cross_entropy(model(**inputs).logits, labels,
                               weight=torch.tensor([1.0, 2.0, 5.0]))


class Scaled(DPTrainer):  # a mean of per-example losses, times a constant
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, inputs = _split(inputs)
        return 2.0 * per_sequence_cross_entropy(model(**inputs).logits, labels, shift=True)


class ClassMean(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, inputs = _split(inputs)
        return F.cross_entropy(model(**inputs).logits, labels)


class Delegating(DPTrainer):  # e.g. to log something, then DPTrainer's own loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _batch_encoding(features):
    """A collator returning a ``BatchEncoding`` (a mapping, not a dict), as the tokenizers'
    padding collators do."""
    return transformers.BatchEncoding(transformers.default_data_collator(features))


def _trainer(cls, tmp_path, classify=False, collator=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the override is warned about
        return cls(model=_llama(classify=classify), args=_args(tmp_path, max_steps=1),
                   train_dataset=_TextSet(classify=classify), data_collator=collator,
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))


@pytest.mark.parametrize("cls, classify, share, collator", [
    (TokenMean, False, r"0\.5455 / 8", None), (TokenMean, False, r"0\.5455 / 8", _batch_encoding),
    (PerTokenItems, False, r"0\.5455 / 8", None), (Summed, False, "8 / 8", None),
    (ClassWeighted, True, r"0\.4706 / 8", None)])
def test_a_loss_that_is_not_a_mean_of_per_example_losses_is_refused_before_any_batch(
        tmp_path, cls, classify, share, collator):
    """The gradient of the batch's loss with respect to example 0's outputs, over that of
    its loss alone, must be 1/8 on 8 examples: a token-level mean gives its share of the
    batch's label tokens (3 of 44: 0.5455/8), a sum 8/8, a class-weighted mean its
    weight's share of the batch's (1 of 17: 0.4706/8). These trained with a warning only."""
    tr = _trainer(cls, tmp_path, classify, collator)
    before = [q.detach().clone() for q in tr.model.parameters()]
    with pytest.raises(ConfigurationError, match=rf"not a mean over the batch's examples.*"
                       rf"example 0's model outputs is {share}"):
        tr.train()
    p = tr.privacy_engine
    assert p.accountant.steps == 0 and p._sampler.delivered == 0
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))


@pytest.mark.parametrize("cls, classify", [(Scaled, False), (ClassMean, True),
                                           (Delegating, False)])
def test_a_mean_of_per_example_losses_trains(tmp_path, cls, classify):
    tr = _trainer(cls, tmp_path, classify)
    tr.train()
    assert tr.privacy_engine.accountant.steps == 1


def test_the_check_leaves_the_run_as_it_was(tmp_path):
    """A subclass delegating to DPTrainer's loss trains to the same parameters, at the
    same seeds, as DPTrainer: the check drew no batch, no noise and no random number, and
    left no recorded activation or gradient behind (dropout on: eval mode restored)."""
    def trained(cls):
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tr = cls(model=_llama(dropout=0.1), args=_args(tmp_path / cls.__name__, max_steps=2),
                     train_dataset=_TextSet(),
                     privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
        tr.train()
        assert tr.model.training
        return [q.detach() for q in tr.model.parameters()]

    for a, b in zip(trained(Delegating), trained(DPTrainer), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
