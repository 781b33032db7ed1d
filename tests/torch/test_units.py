"""Privacy units of several rows: user-level DP and augmentation multiplicity.

With one example per user the accounting and the update are example-level DP-SGD's
exactly; with several, the clipped per-user sum equals a naive loop over users (each
user's gradient from one backward pass over their rows, clipped as one), in float64; the
ledger keeps per-user budgets apart from per-record ones."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.units import RowUnits  # noqa: E402


def _data(n=48, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float32)  # the example's index
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


def _mlp(seed=0, d=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 7), nn.Tanh(), nn.Linear(7, 3))


class _Feat(nn.Module):
    """Ignores the index column."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x[:, 1:])


def _step(p, x, y, loss=None):
    p.optimizer.zero_grad()
    (loss or nn.functional.cross_entropy)(p.model(x), y).backward()
    p.optimizer.step()


def _naive_unit_update(oracle, model, groups, C, lr, expected, reduction="mean"):
    """SGD step with sum_u clip(G_u) / expected, G_u the mean (sum) over the unit's rows
    of the rows' gradients of the mean loss times the row count (the engine's scale): the
    oracle's loop with one pass per unit instead of per example."""
    def unit_loss(u):
        x, y = groups[u]
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
        return loss / len(y) if reduction == "mean" else loss

    params = list(model.parameters())
    total, _ = oracle.clip_and_sum(oracle.grads(unit_loss, len(groups), params), C)
    oracle.sgd_step(params, total, lr, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_user_clipped_sum_equals_a_naive_loop_over_users(reduction, oracle):
    torch.set_default_dtype(torch.float64)
    try:
        ds = _data()
        users = torch.arange(48) // 4  # 12 users of 4 examples
        model = _Feat(_mlp(d=4))
        ref = _Feat(_mlp(d=4))
        C, lr = 0.05, 0.5
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                         DataLoader(ds, batch_size=4), noise_multiplier=0.0, max_grad_norm=C,
                         users=users, max_examples_per_user=3, user_reduction=reduction,
                         seed=2, sampling="fixed")
        x, y = next(iter(p.data_loader))
        drawn = p.data_loader.batch_sampler.pending()
        assert drawn.groups and max(drawn.groups) <= 3 and sum(drawn.groups) == len(y)
        owner = users[x[:, 0].long()]
        assert all(len(set(owner[a:a + g].tolist())) == 1 for a, g in zip(
            [sum(drawn.groups[:k]) for k in range(len(drawn.groups))], drawn.groups,
            strict=True))
        _step(p, x, y)
        groups, start = [], 0
        for g in drawn.groups:
            groups.append((x[start:start + g], y[start:start + g]))
            start += g
        _naive_unit_update(oracle, ref, groups, C, lr, p.expected_batch_size, reduction)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert p.expected_batch_size == 4.0  # expected users per batch
    finally:
        torch.set_default_dtype(torch.float32)


def test_one_example_per_user_is_example_level_dp_sgd_exactly():
    ds = _data()
    kw = dict(noise_multiplier=1.1, max_grad_norm=0.7, seed=4)
    m = _mlp()
    a = make_private(m, torch.optim.SGD(m.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=6), **kw)
    m = _mlp()
    b = make_private(m, torch.optim.SGD(m.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=6), users=list(range(48)), **kw)
    for p in (a, b):
        for x, y in p.data_loader:
            _step(p, x, y)
    want = compose(subsample(Gaussian(1.1), rate=6 / 48), steps=8).epsilon(1e-5)
    assert a.epsilon(1e-5) == b.epsilon(1e-5) == want
    # the same batch: the same update
    torch.set_default_dtype(torch.float64)
    try:
        ds = _data()
        m1, m2 = _mlp(seed=5), _mlp(seed=5)
        runs = [make_private(m, torch.optim.SGD(m.parameters(), lr=0.3),
                             DataLoader(ds, batch_size=6), noise_multiplier=0.0,
                             max_grad_norm=0.05, seed=9, sampling="fixed", **extra)
                for m, extra in ((m1, {}), (m2, {"users": list(range(48))}))]
        x, y = next(iter(runs[0].data_loader))
        next(iter(runs[1].data_loader))
        for p in runs:
            _step(p, x, y)
        for u, v in zip(m1.parameters(), m2.parameters(), strict=True):
            torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-14)
    finally:
        torch.set_default_dtype(torch.float32)


def test_augmentation_multiplicity_averages_views_before_clipping(oracle):
    """The loader lays out each example's K views on consecutive rows; the update equals
    the loop over examples clipping the mean of their views' gradients."""
    torch.set_default_dtype(torch.float64)
    try:
        ds = _data()
        model, ref = _Feat(_mlp(d=4)), _Feat(_mlp(d=4))
        C, lr, k = 0.05, 0.5, 3
        calls = []

        def shift(batch):  # view j shifts every feature by 0.01 j
            x, y = batch
            calls.append(len(calls) % k)
            return x + 0.01 * calls[-1], y

        p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                         DataLoader(ds, batch_size=6), noise_multiplier=0.0, max_grad_norm=C,
                         augmentation_multiplicity=k, augment=shift, sampling="fixed", seed=1)
        xv, yv = next(iter(p.data_loader))
        assert xv.shape[0] == 6 * k and calls == list(range(k))
        x = xv[::k]  # the batch's examples, each followed by its other views
        for j in range(k):
            torch.testing.assert_close(xv[j::k], x + 0.01 * j)
            assert torch.equal(yv[j::k], yv[::k])
        _step(p, xv, yv)
        groups = [(xv[i * k:(i + 1) * k], yv[i * k:(i + 1) * k]) for i in range(6)]
        _naive_unit_update(oracle, ref, groups, C, lr, 6.0, "mean")
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        # without the declaration the rows would be clipped one by one: refused
        other = _Feat(_mlp(d=4))
        q = make_private(other, torch.optim.SGD(other.parameters(), lr=lr),
                         DataLoader(ds, batch_size=6), noise_multiplier=0.0,
                         sampling="fixed", seed=1)
        x, y = next(iter(q.data_loader))
        q.optimizer.zero_grad()
        nn.functional.cross_entropy(q.model(torch.cat([x, x])), torch.cat([y, y])).backward()
        with pytest.raises(ValueError, match="rows per example"):
            q.optimizer.step()
    finally:
        torch.set_default_dtype(torch.float32)


def test_one_example_moves_an_augmented_update_by_at_most_the_bound():
    """Only example 0 has a gradient (norm >> C), K = 2 views: the update of the step
    that trains on it is C (noise 0) -- the views of the loop's natural
    torch.cat([aug(x) for _ in range(K)]) put it in K clipping units, 2 C."""
    n, b, k, c = 40, 8, 2, 1.0
    x = torch.zeros(n, 4)
    x[0] = 10.0
    target = torch.zeros(n)
    target[0] = -100.0
    ds = TensorDataset(x, target, torch.arange(n))
    model = nn.Linear(4, 1, bias=False)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(ds, batch_size=b), noise_multiplier=0.0, max_grad_norm=c,
                     augmentation_multiplicity=k, augment=lambda batch: batch,
                     sampling="fixed", seed=1)
    moved = None
    for _ in range(10):  # epochs, until a batch holds example 0
        for xb, yb, ib in p.data_loader:
            w0 = model.weight.detach().clone()
            p.optimizer.zero_grad()
            ((p.model(xb).squeeze(1) - yb) ** 2).mean().backward()
            p.optimizer.step()
            if 0 in ib.tolist():
                moved = ((w0 - model.weight.detach()).norm() * p.expected_batch_size).item()
                break
        if moved is not None:
            break
    assert moved == pytest.approx(c, rel=1e-6)


def test_augmentation_needs_the_loader_to_make_the_views():
    model = _Feat(_mlp(d=4))
    kw = dict(noise_multiplier=1.0, sampling="fixed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs augment=fn"):
        make_private(model, opt, DataLoader(_data(), batch_size=6),
                     augmentation_multiplicity=3, **kw)
    with pytest.raises(ValueError, match="without augmentation_multiplicity"):
        make_private(model, opt, DataLoader(_data(), batch_size=6), augment=lambda b: b, **kw)
    p = make_private(model, opt, DataLoader(_data(), batch_size=6),
                     augmentation_multiplicity=2, augment=lambda b: b[0][:3], **kw)
    with pytest.raises(ValueError, match="structure it receives"):
        next(iter(p.data_loader))


def test_virtual_batches_keep_each_user_in_one_chunk():
    ds = _data()
    users = torch.arange(48) // 4
    model = _Feat(_mlp(d=4))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=6), noise_multiplier=1.0,
                     users=users, max_examples_per_user=4, max_physical_batch_size=5, seed=3)
    for x, _ in p.data_loader:
        owners = users[x[:, 0].long()]
        expected = p.optimizer._chunk_groups
        assert sum(expected) == len(x) <= 5
        start = 0
        for g in expected:
            assert len(set(owners[start:start + g].tolist())) == 1
            start += g
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), torch.zeros(len(x), dtype=torch.long)
                                    ).backward()
        p.optimizer.step()


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_user_larger_than_a_physical_chunk_is_refused_at_make_private(sampling):
    """A user whose rows cannot fit in one physical chunk used to be refused only when
    the loader first drew one, after steps had been taken and charged; now make_private
    refuses it, before any batch, naming both settings. Users whose examples all fit
    are accepted."""
    from privlearn.errors import ConfigurationError

    ds, users = _data(), torch.arange(48) // 4

    def private(mpbs, k, users=users):
        model = _Feat(_mlp(d=4))
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(ds, batch_size=6), noise_multiplier=1.0, users=users,
                            max_examples_per_user=k, max_physical_batch_size=mpbs, seed=3,
                            sampling=sampling)

    with pytest.raises(ConfigurationError,
                       match=r"bring 4 rows.*more than max_physical_batch_size=3"):
        private(3, 4)
    assert private(3, 3).accountant.steps == 0  # at most 3 rows of a user
    assert private(1, 4, users=torch.arange(48)).accountant.steps == 0  # one example each


def test_ledger_budgets_are_per_privacy_unit(tmp_path):
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    users = torch.arange(48) // 4
    with pytest.raises(ValueError, match="budget is per 'record'"):
        m = _mlp()
        make_private(m, torch.optim.SGD(m.parameters(), lr=0.1),
                     DataLoader(_data(), batch_size=4), noise_multiplier=1.0, epochs=1,
                     users=users, ledger=led.budget("d"))
    led.create_budget("d", epsilon=10.0, delta=1e-5, privacy_unit="user")
    m = _mlp()
    p = make_private(m, torch.optim.SGD(m.parameters(), lr=0.1),
                     DataLoader(_data(), batch_size=4), noise_multiplier=1.0, epochs=1,
                     users=users, ledger=led.budget("d", privacy_unit="user"))
    assert p.config.privacy_unit == "user"


def test_row_units_from_sizes():
    u = RowUnits.from_sizes([2, 1, 3], "mean")
    assert u.unit_of_row.tolist() == [0, 0, 1, 2, 2, 2]
    assert u.position.tolist() == [0, 1, 0, 0, 1, 2]
    assert u.weight.tolist() == [0.5, 0.5, 1.0, 1 / 3, 1 / 3, 1 / 3]
    assert (u.units, u.width, u.rows) == (3, 3, 6)


# ----------------------------------------------------------------- the rule for unit ids
def _private_with_users(users, **kw):
    m = _mlp()
    return make_private(m, torch.optim.SGD(m.parameters(), lr=0.1),
                        DataLoader(_data(), batch_size=4), noise_multiplier=1.0,
                        users=users, **kw)


def test_nan_user_ids_are_refused_not_split_into_units():
    """One person with 4 NaN rows (a float id column with gaps) would be 4 units, each
    moving the release by C under a per-user guarantee for one: refused, naming the rows."""
    import numpy as np

    from privlearn.errors import ParameterValueError

    users = (np.arange(48) // 4).astype(np.float64)
    users[[5, 17, 30, 44]] = np.nan  # one person's 4 rows, the id lost
    with pytest.raises(ParameterValueError, match=r"users has a missing id .* 4 of its 48 "
                       r"rows \(rows 5, 17, 30, 44; .*[Ff]ill"):
        _private_with_users(users)


@pytest.mark.parametrize("bad", [None, float("nan"), "nat"])
def test_missing_user_ids_of_any_kind_are_refused(bad):
    import numpy as np

    from privlearn.errors import ParameterValueError

    users = [i // 4 for i in range(48)]
    if bad == "nat":
        users = [np.datetime64("2024-01-01") + np.timedelta64(u, "D") for u in users]
        bad = np.datetime64("NaT")
    users[7] = bad
    with pytest.raises(ParameterValueError, match=r"users has a missing id .*rows 7;"):
        _private_with_users(users)


def test_mixed_type_user_ids_are_refused():
    from privlearn.errors import ParameterValueError

    users = [str(i // 4) for i in range(48)]
    users[3] = 0  # the same person's id as an int
    with pytest.raises(ParameterValueError, match=r"users mixes id types: most ids are of "
                       r"type str, and 1 of type number \(rows 3\)"):
        _private_with_users(users)


def test_integral_float_user_ids_are_the_same_units_as_ints():
    import numpy as np

    ints = _private_with_users(np.arange(48) // 4, epochs=1)
    floats = _private_with_users((np.arange(48) // 4).astype(np.float64), epochs=1)
    mixed = _private_with_users([float(i // 4) if i % 2 else i // 4 for i in range(48)],
                                epochs=1)
    assert ints.plan.dataset_size == floats.plan.dataset_size == mixed.plan.dataset_size == 12


def test_a_checkpoint_loads_only_into_a_run_of_the_same_users():
    """The saved history protects the users it was run with: a run whose examples are
    grouped into other users (the same number of them) refuses the checkpoint (a user
    of the new grouping who spans two old ones had group privacy 2 in the saved steps),
    while the same grouping under other ids loads and continues the same epsilon."""
    ds = _data(n=48)
    by_block = [i // 4 for i in range(48)]  # 12 users of 4 consecutive examples
    interleaved = [i % 12 for i in range(48)]  # 12 users of 4 examples, spread out
    renamed = [f"user-{11 - u}" for u in by_block]  # by_block's grouping, other ids

    def run(users):
        model = _Feat(_mlp(d=4))
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(ds, batch_size=3), noise_multiplier=1.0,
                            max_grad_norm=1.0, users=users, max_examples_per_user=4, seed=0)

    p = run(by_block)
    for x, y in p.data_loader:
        if len(y):
            _step(p, x, y)
        if p.accountant.steps == 3:
            break
    state = p.state_dict()
    other = run(interleaved)
    with pytest.raises(ValueError, match="users: saved '12 users, partition"):
        other.load_state_dict(state)
    assert other.accountant.steps == 0
    same = run(renamed)
    same.load_state_dict(state)
    assert same.accountant.steps == 3
    assert same.epsilon(1e-5) == p.epsilon(1e-5)


def test_an_example_rate_sampler_under_users_warns_of_the_user_rate_it_accounts():
    """A PoissonBatchSampler(sampling_rate=0.1) over 40 examples of 10 users: make_private
    samples users at the same expected batch size (4 users), i.e. each user with
    probability 0.4. It warns, naming both rates and what to pass; the rebuilt sampler
    draws users at 0.4 (measured) and the epsilon is that of rate 0.4."""
    import warnings

    from privlearn.torch import PoissonBatchSampler

    ds = _data(n=40)
    users = torch.arange(40) // 4
    model = _Feat(_mlp(d=4))
    loader = DataLoader(ds, batch_sampler=PoissonBatchSampler(40, sampling_rate=0.1, steps=2))
    with pytest.warns(UserWarning, match=r"PoissonBatchSampler\(sampling_rate=0.1\)") as rec:
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                         noise_multiplier=1.0, max_grad_norm=1.0, users=users, seed=3)
    msg = " ".join(str(w.message) for w in rec if "users=" in str(w.message))
    assert "each of the 10 users joins a batch with probability 0.4" in msg
    assert "the rate accounted (not 0.1)" in msg
    assert "DataLoader(dataset, batch_size=1)" in msg
    assert p.sampling_rate == pytest.approx(0.4)
    for x, y in p.data_loader:  # one epoch: the steps it takes are accounted at 0.4
        _step(p, x, y)
    steps = p.accountant.steps
    assert steps == 2
    assert p.epsilon(1e-5) == pytest.approx(
        compose(subsample(Gaussian(1.0), rate=0.4), steps=steps).epsilon(1e-5), rel=1e-9)
    # what the rebuilt sampler draws: each user in about 40% of the batches
    drawn, batches = 0, 0
    for _ in range(75):
        for x, _y in p.data_loader:
            drawn += len(set(users[x[:, 0].long()].tolist()))
            batches += 1
    assert abs(drawn / (10 * batches) - 0.4) < 0.05, drawn / (10 * batches)
    # what the warning says to pass draws each user with probability 0.1, silently
    model = _Feat(_mlp(d=4))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*samples users")
        p2 = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          DataLoader(ds, batch_size=1), noise_multiplier=1.0,
                          max_grad_norm=1.0, users=users, seed=3)
    assert p2.sampling_rate == pytest.approx(0.1)


def test_max_examples_per_user_without_users_is_refused_before_any_step():
    """``max_examples_per_user=k`` without ``users``: the run would be per example (the
    setting ignored), which whoever wrote it did not mean; refused, naming ``users=``."""
    from privlearn.errors import ConfigurationError

    data = _data()
    model = _mlp()
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(ConfigurationError, match="users="):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(data, batch_size=8), noise_multiplier=1.0,
                     epochs=1, max_examples_per_user=4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(data, batch_size=8), noise_multiplier=1.0,
                     epochs=1, users=torch.arange(len(data)) // 4, max_examples_per_user=4)
    assert p.config.privacy_unit == "user"
