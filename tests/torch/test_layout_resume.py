"""A run resumed from a checkpoint follows the fixed layout (groups, bins, order) of the
run it continues, secure or seeded: the samplings scheduled over a layout account each
example in the steps of one part only, ``cycle_length`` steps apart, for the whole run.
A saved state without a layout, or with one that is not a layout of the run, is refused
before anything of the run is changed."""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

N, CYCLE = 48, 4
SCHEDULED = ["balls_in_bins", "shuffled_epochs", "cyclic_poisson"]


def _indexed():
    """Feature 0 of each example is its index (to see which examples a batch held)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g)
    x[:, 0] = torch.arange(N, dtype=torch.float32)
    return TensorDataset(x, torch.randint(0, 2, (N,), generator=g))


def _private(ds, sampling, secure):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    seed = None if secure else 5
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(ds, batch_size=12), noise_multiplier=1.0,
                        sampling=sampling, cycle_length=CYCLE, secure_mode=secure,
                        seed=seed, epochs=3)


def _train(p, steps, used):
    """``steps`` steps, appending each step's example indices."""
    done = 0
    while True:
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y, reduction="sum").div(12).backward()
            p.optimizer.step()
            used.append([int(v) for v in x[:, 0]])
            done += 1
            if done == steps:
                return


@pytest.mark.parametrize("secure", [True, False], ids=["secure", "seeded"])
@pytest.mark.parametrize("sampling", SCHEDULED)
def test_a_resumed_run_keeps_every_example_in_one_part(sampling, secure):
    """Naive check of the law over the whole run, checkpoint included: every example
    takes part only in steps of one residue mod cycle_length (one bin, one group, one
    place in the order), at most once per epoch; shuffled epochs, exactly once."""
    ds = _indexed()
    p = _private(ds, sampling, secure)
    used: list = []
    _train(p, CYCLE + 2, used)  # into the second epoch
    state = p.state_dict()
    q = _private(ds, sampling, secure)  # a new run: a secure one draws a new layout
    q.load_state_dict(state)
    _train(q, 2 * CYCLE - 2, used)  # to the end of the third epoch
    assert q.accountant.steps == 3 * CYCLE == len(used)
    residues, per_epoch = collections.defaultdict(set), collections.Counter()
    for step, batch in enumerate(used):
        assert len(set(batch)) == len(batch)
        for i in batch:
            residues[i].add(step % CYCLE)
            per_epoch[i, step // CYCLE] += 1
    assert all(len(r) == 1 for r in residues.values()), {
        i: r for i, r in residues.items() if len(r) > 1}
    assert max(per_epoch.values()) == 1
    if sampling == "shuffled_epochs":
        assert len(per_epoch) == 3 * N


@pytest.mark.parametrize("secure", [True, False], ids=["secure", "seeded"])
def test_a_state_without_its_layout_is_refused_before_anything_changes(secure):
    ds = _indexed()
    p = _private(ds, "balls_in_bins", secure)
    _train(p, 2, [])
    state = p.state_dict()
    state["sampler"] = {**state["sampler"], "parts": None, "layout": None}
    q = _private(ds, "balls_in_bins", secure)
    with pytest.raises(ConfigurationError, match="holds no layout"):
        q.load_state_dict(state)
    assert q.accountant.steps == 0 and q.data_loader.batch_sampler.consumed == 0


def _in_two_parts(parts):
    """An example of another (non-empty) part put in part 0 too. The secure layout is
    unseeded: part 1 alone is empty in (3/4)^48 = 1e-6 of the runs."""
    donor = next(k for k in range(1, len(parts)) if parts[k])
    return [parts[0] + parts[donor][:1]] + parts[1:]


@pytest.mark.parametrize("change,why", [
    (_in_two_parts, "in two parts"),
    (lambda parts: parts[:-1], "3 parts, this sampler has 4"),
    (lambda parts: [parts[0] + [N]] + parts[1:], r"outside range\(48\)"),
], ids=["two-bins", "parts", "range"])
def test_a_secure_layout_that_is_not_one_of_the_run_is_refused(change, why):
    """A secure state holds its parts: an example in two bins would take part in two
    steps of an epoch, which balls-in-bins accounting rules out."""
    ds = _indexed()
    p = _private(ds, "balls_in_bins", True)
    _train(p, 2, [])
    state = p.state_dict()
    parts = state["sampler"]["parts"]
    state["sampler"] = {**state["sampler"], "parts": change([list(x) for x in parts])}
    q = _private(ds, "balls_in_bins", True)
    with pytest.raises(ConfigurationError, match=why):
        q.load_state_dict(state)
    assert q.accountant.steps == 0
