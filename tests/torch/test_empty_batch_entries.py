"""The empty batch of a Poisson run keeps what is not per example: a collate function's
global entries (a vocabulary mask, class weights, a scalar) as the collate function
returns them, per-example entries with no rows, and an entry that changes with the
number of examples without one row per example (a count) from the collate function's
own empty batch, or refused before the first step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.data import EmptyAwareCollate  # noqa: E402

V = 5  # classes


class _Ragged(Dataset):
    """Examples of 1 to 4 features (padded by the collate function) and a class."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.linspace(-1.0, 1.0, 1 + i % 4) * (i + 1), i % V


def _with_globals(rows):
    """Pads the features to 4 and adds entries that are the same for every batch."""
    x = torch.zeros(len(rows), 4)
    for k, (f, _) in enumerate(rows):
        x[k, : len(f)] = f
    return {
        "x": x,
        "y": torch.tensor([y for _, y in rows], dtype=torch.long),
        "vocab_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),  # (V,)
        "class_weights": torch.arange(1.0, V + 1),  # (V,)
        "temperature": torch.tensor(2.0),  # a scalar
        "noise": torch.rand(V),
    }  # drawn once per batch, not per example


def test_an_empty_poisson_batch_keeps_the_collates_global_entries_whole():
    """A dict batch with a (V,) vocabulary mask, (V,) class weights and a scalar: the
    empty batch cut every tensor on dimension 0, so the mask and the weights became
    (0,) (the forward then fails to broadcast them against (0, V) logits, or silently
    computes something else) and the scalar raised IndexError. Now the per-example
    entries have no rows and the global ones are what the collate function returns for
    any batch (ground truth: the entries of a batch of two other examples); every step
    of an epoch with empty batches runs."""
    ds = _Ragged()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, V)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = make_private(
        model,
        opt,
        DataLoader(ds, batch_size=1, collate_fn=_with_globals),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=3,
    )
    rng = torch.get_rng_state()
    reference = _with_globals([ds[4], ds[7]])
    torch.set_rng_state(rng)
    empties = 0
    for _ in range(3):  # q = 0.1 over 10 examples: an empty batch in 35% of the steps
        for batch in p.data_loader:
            if len(batch["y"]) == 0:
                empties += 1
                assert batch["x"].shape == (0, 4) and batch["y"].dtype == torch.long
                for key in ("vocab_mask", "class_weights", "temperature"):
                    assert torch.equal(batch[key], reference[key]), key
                assert batch["noise"].shape == (V,)
            logits = model(batch["x"]) * batch["vocab_mask"] / batch["temperature"]
            loss = torch.nn.functional.cross_entropy(
                logits, batch["y"], weight=batch["class_weights"], reduction="sum"
            )
            p.optimizer.zero_grad()
            loss.backward()
            p.optimizer.step()
    assert empties > 0 and p.accountant.steps == 30


def _counted(rows):
    """A per-example entry and a count of the batch's examples (not a row per example)."""
    return {
        "x": torch.stack([torch.full((3,), float(i)) for i in rows]) if rows else torch.zeros(0, 3),
        "n": len(rows),
    }


def test_a_count_of_the_examples_comes_from_the_collates_empty_batch():
    """A count of the batch's examples was kept at its value for example 0 (1) in the
    empty batch. A collate function that takes an empty list gives the empty batch
    itself (n == 0, the collate function's own answer); one that does not is refused by
    make_private under Poisson sampling (it would draw an empty batch whose count cannot
    be known), and accepted under fixed-size sampling, which never draws one."""
    ds = list(range(8))
    empty = EmptyAwareCollate(ds, _counted)([])
    assert empty["n"] == 0 and empty["x"].shape == (0, 3)

    def no_empty(rows):
        return {"x": torch.stack([torch.full((3,), float(i)) for i in rows]), "n": len(rows)}

    with pytest.raises(ConfigurationError, match=r"batch\['n'\].*accept an empty list"):
        EmptyAwareCollate(ds, no_empty)([])
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match=r"batch\['n'\]"):
        make_private(
            model,
            opt,
            DataLoader(ds, batch_size=2, collate_fn=no_empty),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            seed=0,
        )
    assert all(not m._forward_hooks for m in model.modules())
    make_private(
        model,
        opt,
        DataLoader(ds, batch_size=2, collate_fn=no_empty),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
        sampling="fixed",
    ).detach()


def test_a_collates_own_empty_batch_is_used_only_when_it_has_no_rows():
    """A collate function whose answer to an empty list still holds a row (a padding
    row of example 0) is not taken at its word: with a count that cannot be known
    otherwise, the empty batch is refused (it kept example 0's count, 1). Entries the
    batches of examples show (rows, a global mask, a padded length: as for example 0,
    whose padding the rows keep) never ask it."""

    def padded_row(rows):
        n = len(rows)
        rows = rows or [0]  # an empty list padded with one row of example 0
        return torch.stack([torch.full((2,), float(i)) for i in rows]), torch.ones(4), n

    with pytest.raises(ConfigurationError, match=r"batch\[2\]"):
        EmptyAwareCollate(list(range(5)), padded_row)([])

    def masked(rows):
        assert rows, "an empty list is never asked for"
        longest = max(rows) + 1  # the same for one example and for two: kept
        return (
            torch.stack([torch.full((longest,), float(i)) for i in rows]),
            torch.ones(4),
            longest,
        )

    x, keep, longest = EmptyAwareCollate(list(range(3, 8)), masked)([])
    assert x.shape == (0, 4) and torch.equal(keep, torch.ones(4)) and longest == 4
