"""The check of a DPTrainer subclass's own compute_loss must not be fooled by a dataset
whose first examples are alike: a token-level mean over examples of one length, or a
class-weighted mean over examples of one class, is a mean of per-example losses on them
(every share 1/8) and was let through, though later batches of other lengths or classes
weigh each example by its share of the batch's tokens or weights."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_loss import ClassMean, ClassWeighted, Scaled, TokenMean  # noqa: E402
from test_hf_trainer import _args, _llama, _TextSet  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch.hf import PrivacyArguments  # noqa: E402


class _AlikeFirst(_TextSet):
    """``_TextSet`` with its first 12 examples alike: all of full length (every token a
    label) and all of class 0; the others as drawn (lengths 4..T, classes 0..2)."""

    def __init__(self, classify=False):
        super().__init__(classify=classify)
        self.ids[:12] = self.ids[:12].clamp_min(1)
        self.mask[:12] = 1
        self.cls[:12] = 0


def _trainer(cls, tmp_path, classify):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the override is warned about
        return cls(
            model=_llama(classify=classify),
            args=_args(tmp_path, max_steps=1),
            train_dataset=_AlikeFirst(classify=classify),
            privacy=PrivacyArguments(noise_multiplier=1.0, seed=0),
        )


@pytest.mark.parametrize("cls, classify", [(TokenMean, False), (ClassWeighted, True)])
def test_a_loss_mixing_examples_is_refused_when_the_first_examples_are_alike(
    tmp_path, cls, classify
):
    ds = _AlikeFirst(classify=classify)
    assert bool((ds.mask[:8] == 1).all()) and bool((ds.cls[:8] == 0).all())
    tr = _trainer(cls, tmp_path, classify)
    before = [q.detach().clone() for q in tr.model.parameters()]
    with pytest.raises(ConfigurationError, match="not a mean over the batch's examples"):
        tr.train()
    p = tr.privacy_engine
    assert p.accountant.steps == 0 and p._sampler.delivered == 0
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))


@pytest.mark.parametrize("cls, classify", [(Scaled, False), (ClassMean, True)])
def test_a_mean_of_per_example_losses_still_trains(tmp_path, cls, classify):
    tr = _trainer(cls, tmp_path, classify)
    tr.train()
    assert tr.privacy_engine.accountant.steps == 1
