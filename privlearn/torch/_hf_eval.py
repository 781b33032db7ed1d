"""Whether a set a :class:`~privlearn.torch.hf.DPTrainer` evaluates or predicts on holds
examples of its training set (no transformers import).

Evaluation metrics are released un-noised, as statistics of a set the accounting does not
cover. That holds only for examples outside the training set: the training set itself,
a ``Subset`` of it (its first hundred examples), the whole dataset a training ``Subset``
was cut from, or a ``ConcatDataset`` with it as a part all put private examples into the
released metrics. Datasets are followed through ``torch.utils.data.Subset`` and
``ConcatDataset`` down to the objects that hold the examples, with the indices used of
each; two sets share examples when they reach the same object at a common index.
"""

from __future__ import annotations

import bisect
import warnings

from torch.utils.data import ConcatDataset, Subset

from privlearn.errors import PrivacyLeakWarning

__all__ = ["EvaluationWarnings", "shares_examples"]


def _parts(dataset, index=None, depth: int = 0) -> list:
    """``[(holder, indices or None), ...]``: the objects holding ``dataset``'s examples
    and, for each, the set of its indices used (``None``: all of them)."""
    if index is not None and any(i < 0 for i in index):  # counted from the end
        n = len(dataset)
        index = [i + n if i < 0 else i for i in index]
    if depth > 64:  # a chain this deep is not a dataset built by hand: treat it as a leaf
        return [(dataset, None if index is None else set(index))]
    if isinstance(dataset, Subset):
        inner = list(dataset.indices)
        mapped = inner if index is None else [inner[i] for i in index]
        return _parts(dataset.dataset, mapped, depth + 1)
    if isinstance(dataset, ConcatDataset):
        ends = list(dataset.cumulative_sizes)
        out = []
        for k, part in enumerate(dataset.datasets):
            start = ends[k - 1] if k else 0
            if index is None:
                out += _parts(part, None, depth + 1)
                continue
            mine = [i - start for i in index if bisect.bisect_right(ends, i) == k]
            if mine:
                out += _parts(part, mine, depth + 1)
        return out
    return [(dataset, None if index is None else set(index))]


def shares_examples(given, training) -> bool:
    """Whether the datasets ``given`` and ``training`` hold a common example (through
    ``Subset`` and ``ConcatDataset``); False when either is None."""
    if given is None or training is None:
        return False
    if given is training:
        return True
    mine = _parts(training)
    for holder, index in _parts(given):
        for other, other_index in mine:
            if holder is other and (index is None or other_index is None
                                    or not index.isdisjoint(other_index)):
                return True
    return False


class EvaluationWarnings:
    """DPTrainer's ``evaluate`` and ``predict``: the Trainer's, with a warning when the
    set holds training examples."""

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        """``Trainer.evaluate``; a :class:`~privlearn.errors.PrivacyLeakWarning` when the
        evaluation set holds training examples (it is the training set, a ``Subset`` of it,
        the dataset a training ``Subset`` was cut from, ...:
        :mod:`privlearn.torch._hf_eval`): its metrics are then un-noised statistics of
        the private data, released in the logs and checkpoints and not covered by the
        accounting (the evaluation metrics are released as statistics of a separate set)."""
        self._warn_training_set(self.eval_dataset if eval_dataset is None else eval_dataset,
                                "its metrics (eval_loss, ...)")
        return super().evaluate(eval_dataset, *args, **kwargs)

    def predict(self, test_dataset, *args, **kwargs):
        """``Trainer.predict``; a :class:`~privlearn.errors.PrivacyLeakWarning` when
        ``test_dataset`` is the training set (as for :meth:`evaluate`)."""
        self._warn_training_set(test_dataset, "its predictions and metrics")
        return super().predict(test_dataset, *args, **kwargs)

    def _warn_training_set(self, given, what: str) -> None:
        if isinstance(given, str) and isinstance(self.eval_dataset, dict):  # a set's name
            given = self.eval_dataset.get(given)
        sets = given.values() if isinstance(given, dict) else (given,)
        if any(shares_examples(d, self.train_dataset) for d in sets):  # Subset, Concat too
            warnings.warn(
                f"the evaluation set is the training set, or shares examples with it: {what} "
                "are un-noised statistics of the private training data, released (in the "
                "logs and checkpoints) without being covered by the accounted mechanism. "
                "Evaluate on a held-out split",
                PrivacyLeakWarning, stacklevel=3)
