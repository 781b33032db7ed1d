"""Samplers: Poisson batch sizes are Binomial(N, q), empty batches collate, fixed-size
sampling draws distinct indices, virtual batches split logical batches."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import ParameterTypeError, ParameterValueError  # noqa: E402
from privlearn.torch import FixedSizeBatchSampler, PoissonBatchSampler  # noqa: E402
from privlearn.torch.data import EmptyAwareCollate  # noqa: E402


def test_poisson_batch_sizes_are_binomial():
    n, q = 500, 0.04
    s = PoissonBatchSampler(n, q, steps=2000, seed=0)
    assert len(s) == 2000
    sizes = torch.tensor([len(b) for b in s], dtype=torch.float64)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean().item() - mean) < 4 * math.sqrt(var / 2000)
    assert abs(sizes.var().item() / var - 1) < 0.15
    assert len(PoissonBatchSampler(n, q)) == round(1 / q)


@pytest.mark.parametrize("secure", [False, True])
def test_poisson_inclusion_is_independent_per_index(secure):
    n, q, steps = 20, 0.3, 4000
    counts = torch.zeros(n)
    sampler = PoissonBatchSampler(n, q, steps=steps, seed=None if secure else 1, secure=secure)
    for b in sampler:
        assert len(set(b)) == len(b)
        counts[b] += 1
    freq = counts / steps
    sd = math.sqrt(q * (1 - q) / steps)
    # the secure draw cannot be seeded: each count ~ Binomial(4000, 0.3) leaves 7 sd with
    # probability 3.4e-12 (exact), so 20 indices raise a false alarm in 7e-11 of the runs
    # (4.5 sd would be 1.4e-4); a rate off by 0.05 is still caught
    assert (freq - q).abs().max().item() < (7.0 if secure else 4.5) * sd


def test_poisson_empty_batches_occur_at_the_right_rate():
    n, q, steps = 50, 0.02, 3000
    empty = sum(len(b) == 0 for b in PoissonBatchSampler(n, q, steps=steps, seed=2))
    p0 = (1 - q) ** n
    assert abs(empty / steps - p0) < 4.5 * math.sqrt(p0 * (1 - p0) / steps)


def test_empty_batch_collates_to_zero_length_tensors():
    ds = TensorDataset(torch.randn(5, 3, 2), torch.arange(5))
    collate = EmptyAwareCollate(ds)
    x, y = collate([])
    assert x.shape == (0, 3, 2) and y.shape == (0,) and y.dtype == torch.int64


def test_empty_batch_keeps_nothing_of_the_example_it_was_shaped_from():
    """The empty batch is shaped from a collated batch of example 0: a Hugging Face
    ``BatchEncoding`` (what DataCollatorWithPadding returns) was kept whole and a column
    of strings kept example 0's string, so an empty Poisson batch trained on example 0.
    Now every per-example entry has zero rows, containers keep their types."""
    transformers = pytest.importorskip("transformers")

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": torch.full((3,), i), "text": f"secret {i}", "label": i,
                    "pair": [i, i + 1]}

    def collate(rows):
        out = torch.utils.data.default_collate(rows)
        return transformers.BatchEncoding(out)

    for fn in (None, collate):
        empty = EmptyAwareCollate(Rows(), fn)([])
        assert isinstance(empty, transformers.BatchEncoding if fn else dict)
        assert empty["input_ids"].shape == (0, 3) and empty["label"].shape == (0,)
        assert empty["text"] == [] and [t.shape for t in empty["pair"]] == [(0,), (0,)]
        full = EmptyAwareCollate(Rows(), fn)([Rows()[2]])
        assert full["text"] == ["secret 2"] and full["input_ids"].shape == (1, 3)


def test_secure_fixed_size_sampling_draws_uniform_subsets_and_keeps_no_key():
    """make_private(secure_mode=True, sampling="fixed") sampled with a key chain (a numpy
    generator seeded per batch) whose key every checkpoint held, replaying the next
    batches, while secure mode promises OS-CSPRNG draws and no keys. Now each batch is
    drawn from the OS CSPRNG: exactly b distinct indices, every ordered b-tuple equally
    likely (chi-square over all 60 of them, with a false-alarm rate of 1.6e-8), and the
    saved state holds no key. A seed, or several ranks (which would need a shared key),
    is refused."""
    from torch import nn

    from privlearn.errors import ConfigurationError
    from privlearn.torch import make_private

    n, b, steps = 5, 3, 6000
    s = FixedSizeBatchSampler(n, b, steps=steps, secure=True)
    counts: dict[tuple, int] = {}
    for batch in s:
        assert len(batch) == b and len(set(batch)) == b
        counts[tuple(batch)] = counts.get(tuple(batch), 0) + 1
    cells = math.perm(n, b)
    assert len(counts) == cells
    expected = steps / cells
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 140.0  # chi-square with 59 degrees of freedom: P(> 140) = 1.6e-8
    assert s.state_dict()["key"] is None
    with pytest.raises(ConfigurationError, match="seed must be None"):
        FixedSizeBatchSampler(n, b, seed=0, secure=True)
    with pytest.raises(ConfigurationError, match="world_size=2"):
        FixedSizeBatchSampler(10, 2, rank=0, world_size=2, secure=True)

    ds = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    model = nn.Linear(4, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
                     sampling="fixed", secure_mode=True)
    assert p.data_loader.batch_sampler.secure
    for x, y in p.data_loader:
        assert len(y) == 4
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        break
    state = p.state_dict()
    assert state["sampler"]["key"] is None and state["noise"].get("replayable") is False


def test_fixed_size_sampler():
    s = FixedSizeBatchSampler(30, 7, steps=500, seed=0)
    counts = torch.zeros(30)
    for b in s:
        assert len(b) == 7 and len(set(b)) == 7
        counts[b] += 1
    assert counts.sum().item() == 500 * 7
    assert counts.min() > 0
    with pytest.raises(ValueError, match="batch_size"):
        FixedSizeBatchSampler(5, 6)
    with pytest.raises(ValueError, match="sampling_rate"):
        PoissonBatchSampler(5, 0.0)


def test_loader_from_make_private_keeps_dataset_and_collate():
    from torch import nn

    from privlearn.torch import make_private

    ds = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))

    def collate(batch):
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        return {"x": x, "y": y}

    model = nn.Linear(4, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=10, collate_fn=collate), noise_multiplier=1.0,
                     max_physical_batch_size=3, seed=0)
    assert p.sampling_rate == 0.25 and len(p.data_loader) == 4
    for batch in p.data_loader:
        assert set(batch) == {"x", "y"} and batch["x"].shape[0] <= 3


def _per_example_batches(ds, index_batches):
    from torch.utils.data.dataloader import default_collate

    return [default_collate([ds[i] for i in b]) if b else None for b in index_batches]


@pytest.mark.parametrize("wrap", ["plain", "subset", "subset_of_subset"])
def test_tensor_gather_equals_per_example_fetch_and_collate(wrap):
    from torch.utils.data import Subset

    from privlearn.torch.data import TensorBatchGather, make_dp_loader

    base = TensorDataset(torch.randn(60, 3, 2), torch.arange(60), torch.rand(60) > 0.5)
    ds = base
    if wrap != "plain":
        ds = Subset(base, list(range(59, 4, -1)))
    if wrap == "subset_of_subset":
        ds = Subset(ds, torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)))
    loader = make_dp_loader(DataLoader(ds, batch_size=6), sampling="poisson",
                            sampling_rate=0.1, batch_size=6, steps=40, seed=3)
    assert isinstance(loader.dataset, TensorBatchGather) and loader.dataset.dataset is ds
    assert len(loader.dataset) == len(ds)
    batches = list(loader)
    indices = list(PoissonBatchSampler(len(ds), 0.1, steps=40, seed=3))  # same draws
    assert len(batches) == len(indices) == 40
    for got, want in zip(batches, _per_example_batches(ds, indices), strict=True):
        assert isinstance(got, list) and len(got) == 3
        if want is None:
            want = loader.dataset.__getitems__([])
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)
    # an empty Poisson batch: zero-length tensors shaped and typed like a real batch
    empty = loader.dataset.__getitems__([])
    assert [t.shape for t in empty] == [(0, 3, 2), (0,), (0,)]
    assert [t.dtype for t in empty] == [torch.float32, torch.int64, torch.bool]


def test_gather_not_used_with_custom_collate_or_dataset_subclass():
    from privlearn.torch.data import TensorBatchGather, make_dp_loader

    class Doubled(TensorDataset):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return 2 * x, y

    ds = Doubled(torch.ones(20, 2), torch.arange(20))
    loader = make_dp_loader(DataLoader(ds, batch_size=5), sampling="poisson",
                            sampling_rate=0.5, batch_size=5, steps=3, seed=0)
    assert loader.dataset is ds
    assert all((x == 2).all() for x, _ in loader)
    plain = TensorDataset(torch.ones(20, 2), torch.arange(20))
    loader = make_dp_loader(DataLoader(plain, batch_size=5, collate_fn=lambda b: b),
                            sampling="poisson", sampling_rate=0.5, batch_size=5, steps=3, seed=0)
    assert not isinstance(loader.dataset, TensorBatchGather)


def test_fixed_size_sampler_split_across_ranks():
    """Same seed on every rank: disjoint per-rank batches whose union is a uniform
    fixed-size sample (each index drawn at rate world * B / n)."""
    n, b, world, steps = 40, 3, 2, 3000
    ranks = [FixedSizeBatchSampler(n, b, steps=steps, seed=9, rank=r, world_size=world)
             for r in range(world)]
    assert ranks[0].sampling_rate == world * b / n
    counts = torch.zeros(n)
    for b0, b1 in zip(*ranks, strict=True):
        assert len(b0) == len(b1) == b and not set(b0) & set(b1)
        counts[b0 + b1] += 1
    rate, q = counts / steps, world * b / n
    assert (rate - q).abs().max().item() < 4.5 * math.sqrt(q * (1 - q) / steps)
    with pytest.raises(ValueError, match="rank"):
        FixedSizeBatchSampler(n, b, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        FixedSizeBatchSampler(n, 21, world_size=2)


# ------------------------------------------------------------------ steps and batches


def _indexed(n=48, d=4):
    """Feature 0 of each example is its index (to see which examples a batch held)."""
    x = torch.randn(n, d)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, torch.randint(0, 2, (n,)))


def _private_linear(ds, **kw):
    from torch import nn

    from privlearn.torch import make_private

    torch.manual_seed(0)
    model = nn.Linear(ds.tensors[0].shape[1], 2)
    kw.setdefault("noise_multiplier", 1.0)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(ds, batch_size=kw.pop("batch_size", 8),
                                   num_workers=kw.pop("num_workers", 0)), **kw)


def _train(p, steps, used):
    """``steps`` steps (leaving the loop after the last, passes started as needed),
    appending each batch's example indices."""
    from torch import nn

    done = 0
    while True:
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            used.append(sorted(int(v) for v in x[:, 0]))
            done += 1
            if done == steps:
                return


def test_break_checkpoint_resume_never_redraws_a_trained_batch():
    """Leaving the loop while worker processes have drawn batches ahead, starting a new
    pass, then saving and resuming: the resumed sampler drew again batches already
    trained on (3.6 -> 4.6). Bookkeeping by delivered batches: never."""
    ds = _indexed()
    p = _private_linear(ds, seed=5, num_workers=2, sampling="fixed")
    used: list = []
    _train(p, 3, used)  # break: the workers had prefetched more
    _train(p, 2, used)  # a new pass
    state = p.state_dict()
    q = _private_linear(ds, seed=5, num_workers=2, sampling="fixed")
    q.load_state_dict(state)
    after: list = []
    _train(q, 6, after)
    assert not [b for b in after if b in used]
    assert q.accountant.steps == p.accountant.steps + 6 == 11
    assert p.accountant.steps == len(used) == 5


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_pass_continues_the_interrupted_epoch(workers):
    """Resume in the middle of an epoch, then finish the epoch: the resumed pass yields
    the epoch's remaining batches, the same ones as the uninterrupted run. With worker
    processes the pass restarted the whole epoch (torch's loader calls iter() on the
    sampler twice and the first call used up the saved position): 27 steps, not 20."""
    ds = _indexed(n=80)
    ref = _private_linear(ds, seed=5, num_workers=workers, sampling="fixed", batch_size=8)
    full: list = []
    _train(ref, 10, full)  # one epoch
    p = _private_linear(ds, seed=5, num_workers=workers, sampling="fixed", batch_size=8)
    used: list = []
    _train(p, 4, used)
    q = _private_linear(ds, seed=5, num_workers=workers, sampling="fixed", batch_size=8)
    q.load_state_dict(p.state_dict())
    rest: list = []
    for x, y in q.data_loader:  # the rest of the epoch
        q.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(q.model(x), y).backward()
        q.optimizer.step()
        rest.append(sorted(int(v) for v in x[:, 0]))
    assert used + rest == full
    assert q.accountant.steps == 10


def test_checkpoint_reveals_no_past_batch():
    """The saved sampler state is a key of a one-way chain: it replays the batches after
    it, and nothing about the batches before it (a saved generator state could be run
    backwards to the examples of every past batch)."""
    ds = _indexed()
    p = _private_linear(ds, seed=7)
    used: list = []
    _train(p, 4, used)
    key = p.state_dict()["sampler"]["key"]
    assert isinstance(key, str) and len(key) == 64
    sampler = PoissonBatchSampler(len(ds), p.sampling_rate, seed=7)
    first = list(iter(sampler))[:4]
    assert [sorted(b) for b in first] == used  # the seed replays the run from its start
    assert sampler.state_dict()["key"] != key  # ... but the saved key is past it


def test_unfinished_logical_batch_is_discarded_not_released(oracle):
    """Virtual batches: leaving the loop between the chunks of a logical batch released
    the abandoned chunks' clipped sum inside the next step (3.5 -> 8.0). Now the next
    step equals a step on its own logical batch alone (float64, naive loop)."""
    from torch import nn

    torch.set_default_dtype(torch.float64)
    try:
        ds = _indexed(n=40)
        C, lr = 0.05, 0.1  # the SGD of _private_linear
        p = _private_linear(ds, seed=3, batch_size=10, noise_multiplier=0.0,
                            max_grad_norm=C, max_physical_batch_size=3, sampling="fixed")
        with torch.no_grad():
            p.model.weight.mul_(0.1)
        for k, (x, y) in enumerate(p.data_loader):  # two chunks of the first batch ...
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if k == 1:
                break  # ... then leave
        ref = nn.Linear(4, 2)  # the model as it is now (a deepcopy would copy the hooks)
        ref.load_state_dict(p.model.state_dict())
        chunks = []
        with pytest.warns(RuntimeWarning, match="left unfinished"):
            for x, y in p.data_loader:
                chunks.append((x, y))
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
                if p.accountant.steps == 1:
                    break
        x = torch.cat([c[0] for c in chunks])
        y = torch.cat([c[1] for c in chunks])
        assert len(y) == 10
        oracle.step(ref, x, y, C, lr, 10)
        for a, b in zip(p.model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


# ------------------------------------------ the samplings' laws, through the public loaders
def _one_run(sampling, n, seed, epochs=2, b=5, cycle=4):
    """The index batches of ``epochs`` passes of the DP loader ``make_dp_loader`` builds
    for ``sampling`` over ``n`` examples (rate and cycle of an ``N = 40`` dataset)."""
    from privlearn.correlated.sampling import SAMPLINGS
    from privlearn.torch.data import make_dp_loader

    law = SAMPLINGS[sampling]
    c = cycle if law.cycled else 1
    q = law.rate(b, 40, c)
    loader = make_dp_loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=b),
                            sampling=sampling, sampling_rate=q, batch_size=b,
                            steps=law.per_epoch(q, c), seed=seed, cycle_length=c)
    bs = loader.batch_sampler
    out = []
    for _ in range(epochs):
        for batch in bs:
            out.append(sorted(batch))
    return out


def _steps_of_each(batches, n):
    steps = [[] for _ in range(n)]
    for t, b in enumerate(batches):
        for i in b:
            steps[i].append(t)
    return steps


def test_adding_an_example_moves_no_other_example_in_add_remove_samplings():
    """The layout change for N vs N + 1 examples, the same seed: for every sampling
    accounted under add/remove, no other example changes step (what the accountant
    assumes); for shuffled epochs, other examples move in most layouts, which is why it
    is accounted under replace-one only."""
    from privlearn.correlated.sampling import SAMPLINGS

    n, seeds = 40, range(40)
    for name, law in SAMPLINGS.items():
        moved = 0
        for s in seeds:
            a = _steps_of_each(_one_run(name, n, s), n)
            b = _steps_of_each(_one_run(name, n + 1, s), n + 1)
            moved += a != b[:n]
        if law.add_remove:
            assert moved == 0, f"{name}: another example moved in {moved} of 40 layouts"
        elif name == "shuffled_epochs":
            assert moved >= 20, moved


def _user_run(sampling, users, seed, k=2, b=3, cycle=3):
    """``(step, user, rows)`` of 2 passes of the DP loader over users' rows."""
    from privlearn.correlated.sampling import SAMPLINGS
    from privlearn.torch.data import UnitIndex, make_dp_loader

    law = SAMPLINGS[sampling]
    units = UnitIndex(users, k)
    c = cycle if law.cycled else 1
    q = law.rate(b, 12, c)
    loader = make_dp_loader(DataLoader(TensorDataset(torch.arange(len(users))), batch_size=b),
                            sampling=sampling, sampling_rate=q, batch_size=b,
                            steps=law.per_epoch(q, c), seed=seed, cycle_length=c, units=units)
    out, t = set(), 0
    for _ in range(2):
        for (x,) in loader:
            rows, groups = x.tolist(), loader.batch_sampler.pending().groups
            start = 0
            for g in groups:
                mine = rows[start:start + g]
                owners = {users[i] for i in mine}
                assert len(owners) == 1 and 1 <= g <= k  # one user's rows, at most k
                out.add((t, owners.pop(), tuple(mine)))
                start += g
            t += 1
    return out


def test_adding_a_user_moves_no_other_users_rows_in_add_remove_samplings():
    """User-level privacy (the per-user variant of every sampling): adding a user with
    several rows leaves every other user's steps, and the rows each contributes to each
    step, as they were (the same seed), for the samplings accounted under add/remove."""
    from privlearn.correlated.sampling import SAMPLINGS

    users = [u for u in range(12) for _ in range(1 + u % 4)]  # 1 to 4 rows per user
    for name, law in SAMPLINGS.items():
        if not law.add_remove:
            continue
        for s in range(15):
            a = _user_run(name, users, s)
            b = _user_run(name, users + [12, 12, 12], s)
            assert {e for e in b if e[1] != 12} == a, name


def test_a_sampling_registered_once_trains_through_make_private():
    """Adding a sampling is one registry entry: make_private draws with its law (the
    generic torch wrapper) and accounts it as the entry says."""
    from dataclasses import replace

    from torch import nn

    from privlearn.accounting import Gaussian, compose, subsample
    from privlearn.correlated.sampling import SAMPLINGS, register_sampling
    from privlearn.torch import make_private
    from privlearn.torch.samplers import RegisteredBatchSampler

    register_sampling(replace(SAMPLINGS["poisson"], name="poisson_copy"))
    try:
        ds = TensorDataset(torch.randn(40, 3), torch.zeros(40, dtype=torch.long))
        model = nn.Linear(3, 2)
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(ds, batch_size=8), noise_multiplier=1.3,
                         sampling="poisson_copy", seed=0)
        assert isinstance(p.data_loader.batch_sampler, RegisteredBatchSampler)
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
        want = compose(subsample(Gaussian(1.3), rate=8 / 40), steps=5).epsilon(1e-5)
        assert p.epsilon(1e-5) == want and p.neighbouring == "add_remove"
    finally:
        del SAMPLINGS["poisson_copy"]


def _seq_first(rows):
    ids, labels = torch.utils.data.default_collate(rows)
    return ids.t(), labels


def _padded(rows):
    """Pads to the longest example: only the examples' dimension grows with the batch."""
    ids = torch.nn.utils.rnn.pad_sequence([r[0] for r in rows], batch_first=True)
    return {"input_ids": ids, "labels": torch.stack([r[1] for r in rows]),
            "masked": torch.rand(ids.shape) < 0.15,  # draws, as a masking collator does
            "vocab_mask": torch.ones(7)}  # one per batch, not per example


class _Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.arange(i + 2), torch.tensor(i)


@pytest.mark.parametrize("collate, dataset", [
    (None, TensorDataset(torch.randn(5, 4, 2), torch.arange(5))),
    (_seq_first, TensorDataset(torch.randint(0, 9, (5, 6)), torch.arange(5))),
    (_padded, _Ragged())])
def test_empty_batch_has_the_collates_own_shape_with_no_examples(collate, dataset):
    """An empty batch is what the collate function builds, with zero examples on the
    dimension that holds them (a sequence-first collate got shape ``(0, 1)``, not
    ``(T, 0)``), and an entry that is not per example whole (a vocabulary mask was cut to
    ``(0,)``). Ground truth: that dimension is the one of length 3 in a batch of three
    copies of one example; the whole entry is the one of a batch of two other examples."""
    fn = collate or torch.utils.data.default_collate
    three = fn([dataset[0]] * 3)
    empty = EmptyAwareCollate(dataset, collate)([])
    flat = lambda b: list(b.values()) if isinstance(b, dict) else list(b)  # noqa: E731
    other = fn([dataset[1], dataset[2]])
    for full, two, got in zip(flat(three), flat(other), flat(empty), strict=True):
        dims = [d for d in range(full.dim()) if full.shape[d] == 3]
        want = list(full.shape)
        if dims:
            want[dims[0]] = 0
        else:  # not per example (a vocabulary mask): kept whole
            assert torch.equal(got, two)
        assert list(got.shape) == want and got.dtype == full.dtype


def test_make_private_refuses_a_sequence_first_collate_before_anything_is_attached():
    from privlearn.errors import BatchDependenceError
    from privlearn.torch import make_private

    ds = TensorDataset(torch.randint(0, 9, (40, 6)), torch.randint(0, 3, (40,)))
    model = torch.nn.Sequential(torch.nn.Embedding(9, 4), torch.nn.Flatten(),
                                torch.nn.Linear(24, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = torch.get_rng_state()
    with pytest.raises(BatchDependenceError, match=r"dimension 1 of batch\[0\] \(shape \(6, 2\)"
                       r".*transpose inside the model's forward"):
        make_private(model, opt, DataLoader(ds, batch_size=8, collate_fn=_seq_first),
                     noise_multiplier=1.0, seed=0)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # check_batch_independence=False: the promise covers the layout, collate is not called
    calls = []
    counted = lambda rows: calls.append(len(rows)) or _seq_first(rows)  # noqa: E731
    make_private(model, opt, DataLoader(ds, batch_size=8, collate_fn=counted),
                 noise_multiplier=1.0, seed=0, check_batch_independence=False).detach()
    assert calls == []
    # a batch-first collate with dynamic padding and a per-batch entry is accepted, and
    # the check leaves the global RNG where it was
    make_private(model, opt, DataLoader(_Ragged(), batch_size=2, collate_fn=_padded),
                 noise_multiplier=1.0, seed=0).detach()
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("make, name", [
    (lambda: PoissonBatchSampler(0, 0.1), "num_samples"),
    (lambda: PoissonBatchSampler(-5, 0.1), "num_samples"),
    (lambda: PoissonBatchSampler(10.5, 0.1), "num_samples"),
    (lambda: PoissonBatchSampler(True, 0.1), "num_samples"),
    (lambda: PoissonBatchSampler(10, 0.5, steps=0), "steps"),
    (lambda: PoissonBatchSampler(10, 0.5, steps=-1), "steps"),
    (lambda: PoissonBatchSampler(10, 0.5, steps=2.5), "steps"),
    (lambda: FixedSizeBatchSampler(10, 2.5), "batch_size"),
    (lambda: FixedSizeBatchSampler(10, 2, steps=-1), "steps"),
    (lambda: FixedSizeBatchSampler(10.5, 2), "num_samples"),
])
def test_samplers_refuse_counts_that_are_not_counts(make, name):
    """A sampler built with a dataset size, batch size or epoch length that is not a
    positive integer is refused at construction with the parameter named (it used to be
    truncated, or to fail later inside ``len()`` or the draw)."""
    with pytest.raises((ParameterValueError, ParameterTypeError), match=name):
        make()


_LAW_FIELDS = {"num_samples": 10, "sampling_rate": 0.9, "steps": 1, "secure": True,
               "indices": [0, 1], "rank": 1, "world_size": 4, "cycle_length": 7,
               "batch_size": 1, "law": None}


@pytest.mark.parametrize("sampling", ["poisson", "fixed", "cyclic_poisson",
                                      "balls_in_bins"])
def test_sampling_law_fields_are_read_only_after_make_private(sampling):
    """The fields of the sampling law the accountant describes cannot be reassigned (or
    deleted) on the sampler make_private built: the error names the field, the sampler
    still draws by the law it was built with, and the epsilon is unchanged."""
    kw = ({"cycle_length": 2, "steps": 4} if sampling in ("cyclic_poisson", "balls_in_bins")
          else {})
    p = _private_linear(_indexed(), sampling=sampling, **kw)
    bs = p.data_loader.batch_sampler
    before = {f: getattr(bs, f) for f in _LAW_FIELDS if hasattr(bs, f)}
    assert {"num_samples", "sampling_rate", "steps"} <= set(before)
    _train(p, 2, [])
    eps = p.epsilon(1e-5)
    for field, value in _LAW_FIELDS.items():
        with pytest.raises(AttributeError, match=f"{field} cannot be changed"):
            setattr(bs, field, value)
        if field in before:
            with pytest.raises(AttributeError, match=f"{field} cannot be changed"):
                delattr(bs, field)
    assert {f: getattr(bs, f) for f in before} == before
    assert max(len(b) for b in bs) <= 48 and p.epsilon(1e-5) == eps


def test_sampler_built_by_hand_is_read_only_but_units_set_once():
    s = PoissonBatchSampler(100, 0.1, seed=0)
    with pytest.raises(AttributeError, match="num_samples cannot be changed"):
        s.num_samples = 1000
    assert s.num_samples == 100 and all(max(b, default=0) < 100 for b in s)
    from privlearn.torch.samplers import UnitIndex

    s.units = UnitIndex(list(range(100)), 1)  # make_private attaches the units once
    with pytest.raises(AttributeError, match="units cannot be changed"):
        s.units = UnitIndex([0] * 100, 1)


class _ListDataset(torch.utils.data.Dataset):
    """A dataset over a list the loop may change, reading index ``i`` as ``i mod len``
    (as repeat/augmentation wrappers do): a shrunk list then answers every index the
    sampler draws, each of its examples at more than one."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i % len(self.rows)]


@pytest.mark.parametrize("change", ["shrink", "grow"])
@pytest.mark.parametrize("physical", [None, 3])
def test_a_dataset_resized_after_make_private_is_refused_before_its_next_batch(change,
                                                                              physical):
    """The sampler draws indices of the ``N`` examples there were at make_private, at the
    rate ``B / N`` accounted for them. A dataset halved after it (wrapping its indices)
    would include each remaining example at twice that rate, a grown one would never
    draw its new examples: the next batch is refused with a typed error, in the pass
    under way and in the next one, and only the steps that ran are accounted."""
    from torch import nn

    from privlearn.errors import PlanMismatchError
    from privlearn.torch import make_private

    torch.manual_seed(0)
    rows = [(torch.randn(4), int(i % 2)) for i in range(40)]
    ds = _ListDataset(rows)
    model = nn.Linear(4, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0, seed=0,
                     max_physical_batch_size=physical)
    it = iter(p.data_loader)
    for x, y in it:  # one logical step (the chunks of one batch, with physical)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        if p.accountant.steps:
            break
    assert p.accountant.steps == 1
    if change == "shrink":
        del rows[20:]
    else:
        rows.extend(rows[:8])
    with pytest.raises(PlanMismatchError, match=f"{len(rows)} examples.*accounted with 40"):
        next(it)
    with pytest.raises(PlanMismatchError, match="accounted with 40"):
        next(iter(p.data_loader))
    assert p.accountant.steps == 1


@pytest.mark.parametrize("sampling,c", [("poisson", None), ("cyclic_poisson", 2),
                                        ("cyclic_poisson", 4)])
def test_epoch_at_a_tie_is_round_n_over_b_for_sampler_and_accountant(sampling, c):
    """49 examples in batches of 2: an epoch is round(49 / 2) = 24 steps (half to even),
    for the sampler built by make_private, the sampler built by hand at the same rate and
    the planned steps the accountant accounts; the float c / q said 25."""
    from torch import nn

    from privlearn.torch import make_private
    from privlearn.torch.samplers import CyclicPoissonBatchSampler

    ds = TensorDataset(torch.randn(49, 3), torch.randn(49))
    model = nn.Linear(3, 1)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=2), noise_multiplier=1.0, epochs=2,
                     sampling=sampling, cycle_length=c)
    by_hand = (PoissonBatchSampler(49, p.sampling_rate) if c is None
               else CyclicPoissonBatchSampler(49, p.sampling_rate, c))
    assert len(p.data_loader) == len(by_hand) == p.plan.steps_per_epoch == round(49 / 2)
    assert p.plan.planned_steps == 2 * round(49 / 2)


def test_the_private_loader_keeps_every_loading_option():
    """prefetch_factor, persistent_workers, pin_memory_device (and the worker settings)
    say how batches are loaded, not which examples form them: the private loader keeps
    them as the user's loader set them (it used to drop prefetch_factor and the device)."""
    import inspect
    import warnings

    from torch import nn

    from privlearn.torch import make_private

    accepted = inspect.signature(DataLoader.__init__).parameters
    given = dict(num_workers=1, prefetch_factor=5, persistent_workers=True, timeout=30.0,
                 multiprocessing_context="spawn")
    if "pin_memory_device" in accepted:
        given["pin_memory_device"] = "cpu"
    ds = TensorDataset(torch.randn(32, 3), torch.randn(32))
    model = nn.Linear(3, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # pin_memory_device's
        user = DataLoader(ds, batch_size=4, **given)
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), user,
                         noise_multiplier=1.0)
    for k, v in given.items():
        got = getattr(p.data_loader, k)
        assert (got == v if k != "multiprocessing_context" else got is not None), k


def test_in_order_false_is_not_kept_and_says_so():
    """in_order=False lets workers hand batches over out of the order drawn, so a step
    could train on another step's batch than the one it is accounted for: not kept,
    with a warning pointing at the make_private call."""
    import inspect

    from torch import nn

    from privlearn.torch import make_private

    if "in_order" not in inspect.signature(DataLoader.__init__).parameters:
        pytest.skip("this torch's DataLoader has no in_order")
    ds = TensorDataset(torch.randn(32, 3), torch.randn(32))
    model = nn.Linear(3, 1)
    with pytest.warns(UserWarning, match="in_order=False") as rec:
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(ds, batch_size=4, num_workers=1, in_order=False),
                         noise_multiplier=1.0)
    assert p.data_loader.in_order is True
    assert [w.filename for w in rec if "in_order" in str(w.message)] == [__file__]


def test_len_of_a_virtual_batch_loader_counts_logical_steps_not_the_chunks_it_yields():
    """``len(p.data_loader)`` with ``max_physical_batch_size`` is the number of logical
    batches (privacy steps) an epoch, the unit of a learning-rate schedule, not the
    number of physical chunks iterating yields (Opacus's ``BatchMemoryManager`` counts
    those): counted here over one epoch of fixed-size batches of 10 in chunks of 3."""
    from torch import nn

    from privlearn.torch import make_private

    ds = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    model = nn.Linear(4, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=10), noise_multiplier=1.0,
                     max_physical_batch_size=3, sampling="fixed", seed=0)
    chunks = 0
    for x, y in p.data_loader:
        chunks += 1
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        p.optimizer.step()
    assert chunks == 4 * math.ceil(10 / 3)  # 4 logical batches of 10 examples
    assert len(p.data_loader) == p.accountant.steps == 40 // 10
