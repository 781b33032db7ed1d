"""privlearn's own DP samplers given to make_private as the loader's ``batch_sampler``:
accepted when the engine accounts exactly what they draw (the sampling, rate, cycle,
epoch length and shard of the sampler), refused otherwise with what to pass instead."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from toys import toy_data  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch import privacy_engine as pe  # noqa: E402
from privlearn.torch.config import DPConfig  # noqa: E402
from privlearn.torch.samplers import (  # noqa: E402
    BallsInBinsBatchSampler,
    CyclicPoissonBatchSampler,
    DistributedPoissonBatchSampler,
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    ShuffledEpochsBatchSampler,
)

N = 64


def _private(sampler, **kw):
    model = nn.Linear(6, 3)
    kw.setdefault("noise_multiplier", 1.0)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(toy_data(n=N), batch_sampler=sampler), **kw)


@pytest.mark.parametrize("build,sampling", [
    (lambda: PoissonBatchSampler(N, 0.25), "poisson"),
    (lambda: DistributedPoissonBatchSampler(N, 0.25, rank=0, world_size=1), "poisson"),
    (lambda: FixedSizeBatchSampler(N, 8), "fixed"),
    (lambda: CyclicPoissonBatchSampler(N, 0.3, 4), "cyclic_poisson"),
    (lambda: BallsInBinsBatchSampler(N, 4), "balls_in_bins"),
    (lambda: ShuffledEpochsBatchSampler(N, 4), "shuffled_epochs"),
], ids=["poisson", "distributed-1", "fixed", "cyclic", "bins", "shuffled"])
def test_each_dp_sampler_runs_as_given_and_is_accounted_so(build, sampling):
    given = build()
    p = _private(given, sampling=sampling, epochs=1)
    ran = p.data_loader.batch_sampler
    assert ran.law is given.law
    assert ran.sampling_rate == given.sampling_rate == p.sampling_rate
    assert len(p.data_loader) == given.steps == ran.steps
    assert getattr(ran, "cycle_length", None) == getattr(given, "cycle_length", None)
    assert p.plan.run.cycle == getattr(given, "cycle_length", 1)


def test_a_rank_sampler_is_accepted_on_its_rank(monkeypatch):
    """A DistributedPoissonBatchSampler on the rank and world size of the run: the rate
    is the global one, and each rank's expected batch q N / world_size."""
    monkeypatch.setattr(pe, "world_info", lambda group=None: (1, 2))
    model = nn.Linear(6, 3)
    loader = DataLoader(toy_data(n=N),
                        batch_sampler=DistributedPoissonBatchSampler(N, 0.25, 1, 2))
    plan = pe.plan_run(DPConfig(noise_multiplier=1.0, epochs=1), model, loader)
    assert plan.sampling_rate == 0.25 and plan.world_size == 2 and plan.rank == 1
    assert plan.batch_size == 0.25 * N / 2 and plan.steps_per_epoch == 4


def test_a_rank_sampler_in_one_process_names_the_shard_not_a_subset():
    with pytest.raises(ConfigurationError) as err:
        _private(DistributedPoissonBatchSampler(N, 0.25, rank=0, world_size=2))
    msg = str(err.value)
    assert "rank=0, world_size=2" in msg and "rank 0 of 1" in msg
    assert "PoissonBatchSampler(len(dataset), q)" in msg
    assert "subset" not in msg


@pytest.mark.parametrize("build,settings", [
    (lambda: CyclicPoissonBatchSampler(N, 0.3, 2), "sampling='cyclic_poisson', cycle_length=2"),
    (lambda: BallsInBinsBatchSampler(N, 4), "sampling='balls_in_bins', cycle_length=4"),
    (lambda: FixedSizeBatchSampler(N, 8), "sampling='fixed'"),
])
def test_a_sampler_of_another_sampling_says_which_sampling_to_pass(build, settings):
    model = nn.Linear(6, 3)
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(ConfigurationError, match="make_private was given sampling='poisson'") \
            as err:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=N), batch_sampler=build()), noise_multiplier=1.0)
    assert f"make_private(..., {settings})" in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # and what it says to pass is accepted
    kw = dict(s.split("=") for s in settings.split(", "))
    kw = {k: (int(v) if v.isdigit() else v.strip("'")) for k, v in kw.items()}
    assert _private(build(), epochs=1, **kw).data_loader.batch_sampler.law.name == kw["sampling"]


def test_a_sampler_of_another_cycle_is_refused():
    with pytest.raises(ConfigurationError, match="cycle_length=2.*cycle_length=4"):
        _private(CyclicPoissonBatchSampler(N, 0.3, 2), sampling="cyclic_poisson",
                 cycle_length=4, epochs=1)


@pytest.mark.parametrize("build,sampling", [
    (lambda seed: PoissonBatchSampler(N, 0.25, seed=seed), "poisson"),
    (lambda seed: FixedSizeBatchSampler(N, 8, seed=seed), "fixed"),
    (lambda seed: CyclicPoissonBatchSampler(N, 0.3, 4, seed=seed), "cyclic_poisson"),
    (lambda seed: BallsInBinsBatchSampler(N, 4, seed=seed), "balls_in_bins"),
    (lambda seed: ShuffledEpochsBatchSampler(N, 4, seed=seed), "shuffled_epochs"),
], ids=["poisson", "fixed", "cyclic", "bins", "shuffled"])
def test_a_seeded_sampler_is_rebuilt_with_its_seed(build, sampling):
    """The rebuilt sampler draws the batches (and the layout) the given one draws from its
    seed, not batches of a seed of its own; a different make_private seed= is warned
    about (it seeds the noise), and secure mode, which cannot use the seed, says so."""
    want = [sorted(b) for b in build(7)]
    p = _private(build(7), sampling=sampling, epochs=1)
    assert [sorted(b) for b in p.data_loader.batch_sampler] == want
    with pytest.warns(UserWarning, match=r"from its own seed, not from make_private's seed=3"):
        p = _private(build(7), sampling=sampling, epochs=1, seed=3)
    assert [sorted(b) for b in p.data_loader.batch_sampler] == want
    with pytest.warns(UserWarning, match="rebuilt without its seed: secure_mode"):
        p = _private(build(7), sampling=sampling, epochs=1, secure_mode=True)
    assert p.data_loader.batch_sampler.secure


@pytest.mark.parametrize("settings,named,not_named", [
    (dict(users=list(range(N))), ["users="], ["sampling=", "noise="]),
    (dict(noise="banded", bands=2, sampling="cyclic_poisson", cycle_length=2),
     ["sampling='cyclic_poisson'", "noise='banded'"], ["users="]),
    (dict(sampling="balls_in_bins", cycle_length=2), ["sampling='balls_in_bins'"],
     ["noise=", "users="]),
], ids=["users", "banded", "bins"])
def test_a_single_process_setting_on_several_ranks_is_named_alone(monkeypatch, settings,
                                                                   named, not_named):
    """On rank 0 of 2, a setting that runs in one process only is refused, naming that
    setting, not the supported ones (``sampling='poisson'`` blamed for ``users=``)."""
    monkeypatch.setattr(pe, "world_info", lambda group=None: (0, 2))
    model = nn.Linear(6, 3)
    with pytest.raises(ConfigurationError, match="in one process only") as err:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(toy_data(n=N), batch_size=4), noise_multiplier=1.0,
                     epochs=1, **settings)
    head = str(err.value).split(" in one process only")[0]
    assert all(n in head for n in named) and not any(n in head for n in not_named)


@pytest.mark.parametrize("derived", [7, 12345], ids=["rank0", "other-rank"])
def test_every_rank_warns_alike_about_a_samplers_own_seed(derived):
    """make_private(seed=7) on a rank whose sampler has its own seed: rank 0's derived
    seed is make_private's seed itself (7), another rank's differs; both are told the
    sampler draws from its own seed (rank 0 was not)."""
    from privlearn.torch._engine_checks import given_sampler_seed

    cfg = DPConfig(noise_multiplier=1.0, epochs=1, seed=7)
    for own in (7, 9):
        loader = DataLoader(toy_data(n=N),
                            batch_sampler=DistributedPoissonBatchSampler(N, 0.25, 0, 2, seed=own))
        with pytest.warns(UserWarning, match="draws its batches from its own seed"):
            assert given_sampler_seed(loader, cfg, derived, 2, 1) == own


@pytest.mark.parametrize("derived", [7, 12345], ids=["rank0", "other-rank"])
def test_every_fixed_size_rank_warns_alike_when_its_seed_is_not_the_shared_one(derived):
    """A distributed fixed-size run seeds one shared generator from make_private's seed=:
    a sampler built with that seed draws what it was built to draw (no rank warns); one
    built with another seed is rebuilt without it (every rank warns)."""
    import warnings

    from privlearn.torch._engine_checks import given_sampler_seed

    cfg = DPConfig(noise_multiplier=1.0, epochs=1, seed=7, sampling="fixed")

    def loader(own):
        return DataLoader(toy_data(n=N), batch_sampler=FixedSizeBatchSampler(
            N, 8, seed=own, rank=0, world_size=2))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert given_sampler_seed(loader(7), cfg, derived, 2, 1) == derived
    with pytest.warns(UserWarning, match="rebuilt without its seed: the ranks"):
        assert given_sampler_seed(loader(9), cfg, derived, 2, 1) == derived


def test_one_process_warns_about_the_samplers_seed_even_when_it_is_make_privates():
    with pytest.warns(UserWarning, match="draws its batches from its own seed"):
        p = _private(PoissonBatchSampler(N, 0.25, seed=7), epochs=1, seed=7)
    assert p.data_loader.batch_sampler.seed == 7
