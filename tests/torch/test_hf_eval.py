"""Evaluating a DPTrainer on a set that holds training examples (privlearn.torch._hf_eval).

The PrivacyLeakWarning for evaluation metrics of private data was given only when the
evaluation set was the training set object itself: training on ``Subset(full, train_idx)``
and evaluating on ``full`` (or on the first examples of the training set, a ``Subset`` of
it, or a ``ConcatDataset`` holding it) released un-noised statistics of training examples
without a word. Ground truth for ``shares_examples``: datasets whose items are distinct
example ids, nested at random; two sets share an example when iterating both gives a
common id."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data import ConcatDataset, Dataset, Subset  # noqa: E402

from privlearn.errors import PrivacyLeakWarning  # noqa: E402
from privlearn.torch._hf_eval import shares_examples  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402


class _Ids(Dataset):
    """Examples ``start .. start + n - 1``, each its own id."""

    def __init__(self, start, n):
        self.start, self.n = start, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.start + (i % self.n)


_BASES = [_Ids(0, 6), _Ids(100, 5), _Ids(200, 4)]


@st.composite
def _nested(draw, depth=0):
    """A base dataset, a Subset of a nested one (indices, negative ones too), or a
    ConcatDataset of nested ones."""
    kind = draw(st.sampled_from(["base", "subset", "concat"] if depth < 3 else ["base"]))
    if kind == "base":
        return draw(st.sampled_from(_BASES))
    if kind == "subset":
        inner = draw(_nested(depth + 1))
        n = len(inner)
        idx = draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=n))
        return Subset(inner, idx)
    parts = draw(st.lists(_nested(depth + 1), min_size=1, max_size=3))
    return ConcatDataset(parts)


@settings(max_examples=300, deadline=None)
@given(_nested(), _nested())
def test_shares_examples_is_a_common_example_id(a, b):
    naive = bool({a[i] for i in range(len(a))} & {b[i] for i in range(len(b))})
    assert shares_examples(a, b) is naive
    assert shares_examples(b, a) is naive


V, T, N = 32, 6, 24


def _text_set():  # the training set of these tests
    from hf_models import TokenSet

    return TokenSet(N, T, V)


def test_evaluating_on_sets_holding_training_examples_warns(tmp_path):
    full = _text_set()
    train, held_out = Subset(full, range(0, 16)), Subset(full, range(16, N))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
        use_cpu=True, disable_tqdm=True, save_strategy="no", dataloader_pin_memory=False)
    tr = DPTrainer(model=model, args=args, train_dataset=train,
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.train()
    for leaky in (full, Subset(train, [0, 1]), ConcatDataset([held_out, train])):
        with pytest.warns(PrivacyLeakWarning, match="shares examples with it"):
            tr.evaluate(leaky)
    with pytest.warns(PrivacyLeakWarning, match="shares examples with it"):
        tr.predict(full)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        metrics = tr.evaluate(held_out)
    assert "eval_loss" in metrics and tr.privacy_engine.accountant.steps == 1
