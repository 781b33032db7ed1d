"""The samplers name the sampling probability ``sampling_rate``, as the rest of privlearn
does (``privlearn.accounting.steps_per_epoch``, ``PrivateTraining.sampling_rate``, the
command line's ``--sampling-rate``); ``sample_rate``, Opacus's name and the samplers'
former one, still works as a keyword and as an attribute, with a DeprecationWarning."""

from __future__ import annotations

import inspect
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.correlated.sampling import SAMPLINGS  # noqa: E402
from privlearn.errors import ConfigurationError, ParameterTypeError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.data import make_dp_loader  # noqa: E402
from privlearn.torch.samplers import (  # noqa: E402
    CyclicPoissonBatchSampler,
    DistributedPoissonBatchSampler,
    PoissonBatchSampler,
    RegisteredBatchSampler,
    dp_batch_sampler,
)

# (build with the rate given as **rate, positional arguments before it, after it)
_BUILDERS = {
    "PoissonBatchSampler": lambda **r: PoissonBatchSampler(50, **r, steps=3, seed=1),
    "DistributedPoissonBatchSampler": lambda **r: DistributedPoissonBatchSampler(
        50, **r, rank=1, world_size=2, steps=3, seed=1
    ),
    "CyclicPoissonBatchSampler": lambda **r: CyclicPoissonBatchSampler(
        50, **r, cycle_length=2, steps=3, seed=1
    ),
    "RegisteredBatchSampler": lambda **r: RegisteredBatchSampler(
        SAMPLINGS["poisson"], 50, **r, steps=3, seed=1
    ),
    "dp_batch_sampler": lambda **r: dp_batch_sampler(
        "poisson", 50, **r, batch_size=10, steps=3, seed=1
    ),
}


def _batches(sampler) -> list[list[int]]:
    return [list(b) for b in sampler]


@pytest.mark.parametrize("name", sorted(_BUILDERS))
def test_sampling_rate_is_the_name_and_sample_rate_still_works(name):
    build = _BUILDERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the canonical name: no warning
        new = build(sampling_rate=0.2)
        assert new.sampling_rate == 0.2
    with pytest.warns(
        DeprecationWarning,
        match=r"sample_rate is deprecated; pass "
        r"sampling_rate",
    ):
        old = build(sample_rate=0.2)
    assert type(old) is type(new) and old.sampling_rate == 0.2
    assert _batches(old) == _batches(new)  # the same sampler, drawing the same batches
    with pytest.warns(
        DeprecationWarning,
        match=r"sample_rate is deprecated; read "
        r"sampler.sampling_rate",
    ):
        assert new.sample_rate == 0.2
    with pytest.raises(ParameterTypeError, match="both sampling_rate and sample_rate"):
        build(sampling_rate=0.2, sample_rate=0.2)


def test_the_former_name_given_with_the_new_one_by_position_is_refused():
    with pytest.raises(ParameterTypeError, match="both sampling_rate and sample_rate"):
        PoissonBatchSampler(50, 0.2, sample_rate=0.3)
    with pytest.raises(ParameterTypeError, match="both sampling_rate and sample_rate"):
        CyclicPoissonBatchSampler(50, 0.2, 2, sample_rate=0.3)


def test_the_signatures_show_the_new_name():
    for fn in (
        PoissonBatchSampler,
        DistributedPoissonBatchSampler,
        CyclicPoissonBatchSampler,
        RegisteredBatchSampler,
        dp_batch_sampler,
        make_dp_loader,
    ):
        params = inspect.signature(fn).parameters
        assert "sampling_rate" in params and "sample_rate" not in params, fn


def test_the_former_attribute_stays_read_only():
    s = PoissonBatchSampler(50, 0.2, seed=0)
    with pytest.raises(AttributeError, match="sampling_rate cannot be changed"):
        s.sample_rate = 0.5
    assert s.sampling_rate == 0.2


def test_a_state_saved_under_the_former_name_loads():
    state = PoissonBatchSampler(50, 0.2, steps=4, seed=3).state_dict()
    assert "sampling_rate" in state["params"]
    params = dict(state["params"])
    params["sample_rate"] = params.pop("sampling_rate")  # as saved before the rename
    b = PoissonBatchSampler(50, 0.2, steps=4, seed=3)
    b.load_state_dict({**state, "params": params})
    c = PoissonBatchSampler(50, 0.2, steps=4, seed=3)
    c.load_state_dict(state)
    assert _batches(b) == _batches(c) and len(_batches(b)) == 4
    with pytest.raises(ConfigurationError, match="saved sampler"):  # still compared
        c.load_state_dict({**state, "params": {**params, "sample_rate": 0.3}})


def test_make_dp_loader_takes_both_names():
    ds = TensorDataset(torch.randn(30, 2), torch.zeros(30))
    kw = dict(sampling="poisson", batch_size=6, steps=2, seed=0)
    new = make_dp_loader(DataLoader(ds, batch_size=6), sampling_rate=0.2, **kw)
    with pytest.warns(DeprecationWarning, match="make_dp_loader: the keyword sample_rate"):
        old = make_dp_loader(DataLoader(ds, batch_size=6), sample_rate=0.2, **kw)
    assert old.batch_sampler.sampling_rate == new.batch_sampler.sampling_rate == 0.2


def test_make_private_uses_no_deprecated_name():
    ds = TensorDataset(torch.randn(40, 3), torch.zeros(40, dtype=torch.long))
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*sample_rate", category=DeprecationWarning)
        p = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(ds, batch_size=8),
            noise_multiplier=1.0,
            seed=0,
        )
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
    assert p.data_loader.batch_sampler.sampling_rate == p.sampling_rate == 8 / 40
