"""Corrupted saved states: every load path refuses them typed, and changes nothing.

A checkpoint can be truncated, edited, or saved by another run. Each load path of the
engine (``PrivateTraining.load_state_dict``, ``make_private(resume=...)``, the
accountant's, the DP optimizer's, the correlated noise's, a DPTrainer resume) is given a
good state with one entry removed, of the wrong type, negative, NaN, or of another
mechanism. It must raise the typed error of :mod:`privlearn.errors` that names the entry
(and says what to pass), and leave the object as it was: after the refusal the good
state still loads, and everything loaded from it equals the saved run. (The accountant
raised a bare ``KeyError``; a negative sampler count or NaN correlated buffers loaded.)
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from train_loops import train_steps as _train  # noqa: E402

from privlearn.errors import (  # noqa: E402
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
)
from privlearn.torch import PrivacyAccountant, make_private  # noqa: E402
from privlearn.torch._optimizer_api import ACCOUNTED_STEPS  # noqa: E402

MISSING = object()  # a case that deletes the entry
N, B = 32, 8


def _run(resume=None, model=None, **kw):
    torch.manual_seed(0)
    model = nn.Linear(3, 2) if model is None else model
    ds = TensorDataset(torch.randn(N, 3), torch.randint(0, 2, (N,)))
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        DataLoader(ds, batch_size=B),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
        resume=resume,
        **kw,
    )


def _corrupt(state, path, value):
    out = copy.deepcopy(state)
    if not path:
        return value
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is MISSING:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def _same(a, b) -> bool:
    """Nested states equal (tensors bit for bit, NaN never equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        return (
            isinstance(a, list | tuple)
            and isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _snapshot(p) -> dict:
    """What a load would change: the run's own state, and the live values."""
    return {
        "state": p.state_dict(),
        "sigma": p.optimizer.noise_multiplier,
        "clip": p.optimizer.max_grad_norm,
        "steps": p.accountant.steps,
        "delivered": p._sampler.delivered,
    }


@pytest.fixture(scope="module")
def saved():
    p = _run()
    _train(p, 2)
    return p.state_dict()


#: (entry path, value or MISSING, error type, what the message names)
CASES = [
    ((), [1, 2], ParameterTypeError, "must be a dict"),
    (("format",), MISSING, ParameterValueError, "not a privlearn training state"),
    (("mechanism",), MISSING, ParameterValueError, "'mechanism'"),
    (("mechanism",), "poisson", ParameterTypeError, "'mechanism'"),
    (("mechanism", "noise_multiplier"), 2.0, ConfigurationError, "noise_multiplier: saved 2.0"),
    (("mechanism", "sampling_rate"), 0.5, ConfigurationError, "sampling_rate: saved 0.5"),
    (("model",), 5, ParameterTypeError, "'model'"),
    (("optimizer", "param_groups"), MISSING, ParameterValueError, "'param_groups'"),
    (("noise_multiplier",), MISSING, ParameterValueError, "'noise_multiplier'"),
    (("noise_multiplier",), math.nan, ParameterValueError, r"\['noise_multiplier'\] is NaN"),
    (("noise_multiplier",), -1.0, ParameterValueError, r"\['noise_multiplier'\] must be"),
    (("max_grad_norm",), "1.0", ParameterTypeError, r"\['max_grad_norm'\] must be a real"),
    (("accountant",), MISSING, ParameterValueError, "'accountant'"),
    (("accountant", "segments"), MISSING, ParameterValueError, "'segments'"),
    (("accountant", "scheme"), MISSING, ParameterValueError, "'scheme'"),
    (("accountant", "scheme"), "fixed", ConfigurationError, "scheme='fixed'"),
    (("accountant", "segments"), "2 steps", ParameterTypeError, r"\['segments'\] must be"),
    (("accountant", "segments", 0), [1.0, 0.25], ParameterTypeError, r"\['segments'\]\[0\]"),
    (("accountant", "segments", 0, 3), -2, ParameterValueError, r"\['segments'\]\[0\] steps"),
    (("accountant", "segments", 0, 0), math.nan, ParameterValueError, "noise_multiplier"),
    (("accountant", "segments", 0, 1), math.nan, ParameterValueError, "sampling_rate"),
    (("accountant", "prior"), "not json", ParameterValueError, "not valid JSON"),
    (("sampler",), None, ParameterTypeError, "'sampler'"),
    (("sampler", "batches"), MISSING, ParameterValueError, "'batches'"),
    (("sampler", "batches"), -1, ParameterValueError, r"\['batches'\] must be an integer >= 0"),
    (("sampler", "batches"), 2.5, ParameterTypeError, r"\['batches'\]"),
    (("sampler", "pos"), 10**6, ParameterValueError, r"\['pos'\] must be a position"),
    (("sampler", "key"), "zz", ParameterValueError, r"\['key'\] must be the hex text"),
    (("sampler", "params"), MISSING, ParameterValueError, "'params'"),
    (("sampler", "params", "sampling_rate"), 0.5, ConfigurationError, "the saved sampler"),
    (("noise", "secure_mode"), MISSING, ParameterValueError, "'secure_mode'"),
    (("noise", "seed"), "0", ParameterTypeError, r"state\['seed'\] must be an int"),
    (("budget",), [], ParameterTypeError, "'budget'"),
    (("budget", "warned"), "no", ParameterTypeError, r"\['warned'\] must be a bool"),
    (("model", "weight"), "w", ParameterTypeError, r"\['model'\]\['weight'\] must be a tensor"),
    (("model", "bias"), None, ParameterTypeError, r"\['model'\]\['bias'\] must be a tensor"),
    (("optimizer", "state"), "x", ParameterTypeError, r"\['optimizer'\]\['state'\] must be"),
]


def _case_id(case) -> str:
    path, value = case[0], case[1]
    what = "missing" if value is MISSING else repr(value)[:12]
    return "/".join(map(str, path)) + "=" + what


@pytest.mark.parametrize("path,value,error,names", CASES, ids=map(_case_id, CASES))
def test_a_corrupted_training_state_is_refused_typed_and_loads_nothing(
    saved, path, value, error, names
):
    p = _run()
    before = _snapshot(p)
    with pytest.raises(error, match=names) as info:
        p.load_state_dict(_corrupt(saved, path, value))
    assert type(info.value) is error
    if error is not ConfigurationError:  # (those name the settings to rebuild with)
        assert "state_dict()" in str(info.value)  # what to pass instead
    assert _same(_snapshot(p), before)  # nothing loaded
    p.load_state_dict(saved)  # the run is as it was: the right state still loads
    assert p.accountant.steps == 2 and _same(p.state_dict(), saved)


@pytest.mark.parametrize(
    "path,value,error,names",
    [CASES[2], CASES[18], CASES[24]],
    ids=map(_case_id, [CASES[2], CASES[18], CASES[24]]),
)
def test_make_private_resume_refuses_a_corrupted_state_and_leaves_the_model(
    saved, path, value, error, names
):
    model = nn.Linear(3, 2)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=names):
        _run(resume=_corrupt(saved, path, value), model=model)
    assert _same(model.state_dict(), before)  # its weights as they were
    p = _run(resume=saved, model=model)  # and it can still be made private, and resume
    assert p.accountant.steps == 2 and _same(p.state_dict(), saved)


ACCOUNTANT_CASES = [
    ("segments", MISSING, ParameterValueError, "no 'segments' entry"),
    ("accountant", MISSING, ParameterValueError, "no 'accountant' entry"),
    ("accountant", 3, ParameterTypeError, r"\['accountant'\] must be a str"),
    ("segments", [[1.0, 0.25, 1.0, -4]], ParameterValueError, "steps must be an integer >= 1"),
    ("segments", [[math.nan, 0.25, 1.0, 4]], ParameterValueError, "noise_multiplier"),
    ("segments", [[1.0, 0.25, 1.0, 4.0]], ParameterTypeError, "steps must be an integer"),
]


@pytest.mark.parametrize(
    "key,value,error,names",
    ACCOUNTANT_CASES,
    ids=[f"{c[0]}={'missing' if c[1] is MISSING else c[1]}" for c in ACCOUNTANT_CASES],
)
def test_the_accountant_refuses_a_corrupted_history_typed(key, value, error, names):
    good = PrivacyAccountant()
    good.record_step(1.0, 0.25, 1.0)
    state = good.state_dict()
    acct = PrivacyAccountant()
    with pytest.raises(error, match=names) as info:
        acct.load_state_dict(_corrupt(state, (key,), value))
    assert "PrivacyAccountant.state_dict()" in str(info.value)
    assert acct.steps == 0 and acct.segments == () and acct.prior is None
    acct.load_state_dict(state)
    assert acct.segments == good.segments


@pytest.mark.parametrize(
    "value,error,names",
    [
        ("3", ParameterTypeError, "must be an integer >= 0"),
        (-1, ParameterValueError, "must be an integer >= 0"),
        (MISSING, None, None),
    ],
)
def test_the_dp_optimizer_refuses_a_corrupted_step_count(value, error, names):
    p = _run()
    _train(p, 1)
    state = _corrupt(p.optimizer.state_dict(), (ACCOUNTED_STEPS,), value)
    q = _run()
    before = q.optimizer.original_optimizer.state_dict()
    if error is None:  # a plain optimizer's state (no count): loaded as it is
        q.optimizer.load_state_dict(state)
        return
    with pytest.raises(error, match=names) as info:
        q.optimizer.load_state_dict(state)
    assert ACCOUNTED_STEPS in str(info.value) and "state_dict()" in str(info.value)
    assert _same(q.optimizer.original_optimizer.state_dict(), before)


def test_the_dp_optimizer_refuses_a_state_that_is_not_an_optimizers():
    q = _run()
    with pytest.raises(ParameterTypeError, match="state_dict must be a dict"):
        q.optimizer.load_state_dict([1, 2])
    with pytest.raises(ParameterValueError, match="no 'param_groups' entry"):
        q.optimizer.load_state_dict({"state": {}})


def _banded(resume=None):
    return _run(
        resume=resume, epochs=2, noise="banded", bands=2, sampling="cyclic_poisson", cycle_length=2
    )


@pytest.mark.parametrize(
    "path,value,error,names",
    [
        (("correlated",), None, ParameterTypeError, "'correlated'"),
        (("correlated", "steps"), -3, ParameterValueError, r"\['steps'\] must be an integer >= 0"),
        (("correlated", "buffers"), "nan", ParameterValueError, "NaN or infinite"),
        (("correlated", "buffers"), torch.zeros(3), ParameterTypeError, "2-d floating tensor"),
        (("correlated", "layout"), [["weight"]], ParameterTypeError, r"\['layout'\] must be"),
        (("correlated", "live"), 7, ParameterValueError, "does not fit its buffers"),
    ],
    ids=["missing", "steps=-3", "buffers=nan", "buffers=1d", "layout", "live=7"],
)
def test_a_corrupted_correlated_noise_state_is_refused_before_anything_loads(
    path, value, error, names
):
    p = _banded()
    _train(p, 2)
    good = p.state_dict()
    if isinstance(value, str) and value == "nan":
        value = torch.full_like(good["correlated"]["buffers"], math.nan)
    q = _banded()
    before = _snapshot(q)
    with pytest.raises(error, match=names) as info:
        q.load_state_dict(_corrupt(good, path, value))
    assert "PrivateTraining.state_dict()" in str(info.value)
    assert _same(_snapshot(q), before)
    q.load_state_dict(good)
    assert _same(q.state_dict(), good)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A DPTrainer run of two steps with a checkpoint at step 2 (its secret part, the
    sampler's and the noise's keys, under a private folder)."""
    pytest.importorskip("transformers")
    from test_hf_resume import BASE, _trainer

    tmp = tmp_path_factory.mktemp("corrupted_hf")
    _trainer(tmp / "out", tmp / "private", BASE, 2).train()
    return tmp


def _edit(file, change) -> None:
    state = torch.load(file, weights_only=False)
    change(state)
    torch.save(state, file)


def _public(change):
    return lambda folder, private: _edit(folder / "privlearn_privacy.pt", change)


def _secret(change):
    return lambda folder, private: _edit(next(private.glob("*.pt")), change)


HF_CASES = {
    "mechanism=missing": (
        _public(lambda s: s.pop("mechanism")),
        ParameterValueError,
        "has no 'mechanism' entry",
    ),
    "privacy_arguments=list": (
        _public(lambda s: s.update(privacy_arguments=[1])),
        ParameterTypeError,
        r"\['privacy_arguments'\] must be a dict",
    ),
    "private_state/token=5": (
        _public(lambda s: s["private_state"].update(token=5)),
        ParameterTypeError,
        r"\['token'\] must be a str",
    ),
    "segments/0/3=-2 (make_private)": (
        _public(lambda s: s["accountant"]["segments"][0].__setitem__(3, -2)),
        ParameterValueError,
        r"\['segments'\]\[0\] steps",
    ),
    "secret sampler=missing": (
        _secret(lambda s: s.pop("sampler")),
        ParameterValueError,
        r"has no \['sampler'\] entries",
    ),
    "secret sampler/batches=-1 (make_private)": (
        _secret(lambda s: s["sampler"].update(batches=-1)),
        ParameterValueError,
        r"\['batches'\] must be an integer",
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_a_dptrainer_resume_refuses_a_corrupted_checkpoint_before_anything_runs(
    hf_checkpoint, tmp_path, case
):
    import shutil

    from test_hf_resume import BASE, _trainer

    change, error, names = HF_CASES[case]
    folder, private = tmp_path / "checkpoint-2", tmp_path / "private"
    shutil.copytree(hf_checkpoint / "out" / "checkpoint-2", folder)
    shutil.copytree(hf_checkpoint / "private", private)
    change(folder, private)
    tr = _trainer(tmp_path / "out", private, BASE, 4)
    before = copy.deepcopy(tr.model.state_dict())
    with pytest.raises(error, match=names) as info:
        tr.train(resume_from_checkpoint=str(folder))
    assert type(info.value) is error
    assert tr.privacy_engine is None and tr.state.global_step == 0
    if "make_private" not in case:  # refused before the Trainer loads the checkpoint's
        assert _same(tr.model.state_dict(), before)  # weights (its own resume)
