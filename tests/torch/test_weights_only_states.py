"""Every state privlearn saves loads with ``torch.load(..., weights_only=True)``.

``weights_only=False`` unpickles arbitrary objects, and so runs whatever code a file
names; the docs load privlearn checkpoints with the safe default. Each kind of state
(``PrivateTraining.state_dict`` for every noise, sampling and clipping set-up, a ledger
run, a :class:`NoiseSource`, the DPTrainer's public and private state files) is saved,
loaded with ``weights_only=True``, and resumed from."""

from __future__ import annotations

import io
import os
import random
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.ledger import Ledger  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.noise import NoiseSource  # noqa: E402

_KINDS = {
    "dpsgd": {},
    "secure_mode": {"secure_mode": True, "seed": None},
    "fixed": {"sampling": "fixed", "epochs": 2},
    "banded": {"sampling": "shuffled_epochs", "epochs": 2, "noise": "banded", "bands": 3},
    "blt": {"sampling": "shuffled_epochs", "epochs": 2, "noise": "blt", "buffers": 2},
    "cyclic_banded": {
        "sampling": "cyclic_poisson",
        "cycle_length": 2,
        "epochs": 2,
        "noise": "banded",
        "bands": 2,
    },
    "balls_in_bins": {"sampling": "balls_in_bins", "epochs": 2, "noise": "banded", "bands": 2},
    "adaptive": {
        "clipping": "adaptive",
        "target_unclipped_quantile": 0.5,
        "max_grad_norm": 0.05,
        "unclipped_num_std": 1.0,
    },
    "ledger": {"epochs": 2},
}


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g))


def _build(kind, ledger_path):
    kw = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "seed": 3, **_KINDS[kind]}
    if kind == "ledger":
        led = Ledger(ledger_path, create=not os.path.exists(ledger_path))
        if not led.budgets():
            led.create_budget("b", epsilon=100.0, delta=1e-5)
        kw["ledger"] = led.budget("b")
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(_data(), batch_size=8),
            **kw,
        )


def _train(p, steps):
    done = 0
    while done < steps:
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            done += 1
            if done == steps:
                return


def _round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kind", list(_KINDS))
def test_private_training_state_loads_weights_only_and_resumes(kind, tmp_path):
    ledger = tmp_path / "privacy.db"
    a = _build(kind, ledger)
    _train(a, 3)
    state = _round_trip(a.state_dict())
    if kind == "ledger":
        a.detach()  # settles the steps that ran in the ledger
    b = _build(kind, ledger)
    b.load_state_dict(state)
    assert b.accountant.steps == 3
    _train(b, 2)
    assert b.accountant.steps == 5 and np.isfinite(b.epsilon(1e-5))
    if kind == "ledger":
        b.detach()
    elif kind != "secure_mode":  # a replayable run continues bit for bit
        _train(a, 2)
        for u, v in zip(a.model.parameters(), b.model.parameters(), strict=True):
            assert torch.equal(u, v)


@pytest.mark.parametrize("secure", [False, True], ids=["seeded", "secure_mode"])
def test_noise_source_state_loads_weights_only(secure):
    src = NoiseSource(secure_mode=True) if secure else NoiseSource(seed=5)
    src.fill_normal_(torch.empty(10), 1.0)
    other = NoiseSource(secure_mode=secure)
    other.load_state_dict(_round_trip(src.state_dict()))
    if not secure:
        assert torch.equal(
            other.fill_normal_(torch.empty(9), 1.0), src.fill_normal_(torch.empty(9), 1.0)
        )


def _hf_run(out, private, steps, resume=None, seed=0):
    transformers = pytest.importorskip("transformers")
    from test_hf_trainer import _args, _llama, _TextSet

    from privlearn.torch.hf import DPTrainer, PrivacyArguments

    privacy = PrivacyArguments(
        noise_multiplier=2.0,
        noise="banded",
        bands=2,
        sampling="cyclic_poisson",
        cycle_length=3,
        seed=0,
    )
    tr = DPTrainer(
        model=_llama(seed=seed, dropout=0.3),
        train_dataset=_TextSet(),
        args=_args(out, max_steps=steps, save_strategy="steps", save_steps=1),
        privacy=privacy,
        private_state_dir=private,
    )
    assert isinstance(tr, transformers.Trainer)
    tr.train(resume_from_checkpoint=resume)
    return tr


def _same_parameters(a, b):
    for u, v in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(u, v)


def test_dptrainer_state_files_load_weights_only_and_resume(tmp_path):
    """The checkpoint's privacy state file and the private file (with the global
    generators' states: NumPy's key array as a tensor) load with weights_only=True, and a
    run resumed from them (dropout draws from the restored generators) continues bit for
    bit."""
    from privlearn.torch.hf import PRIVACY_STATE_NAME

    out, private = tmp_path / "out", tmp_path / "private"
    a = _hf_run(out, private, steps=2)
    ckpt = out / "checkpoint-1"
    torch.load(ckpt / PRIVACY_STATE_NAME, weights_only=True)
    files = list(private.iterdir())
    assert files
    for path in files:
        secret = torch.load(path, weights_only=True)
        assert isinstance(secret["rng"]["numpy"][1], torch.Tensor)
    np.random.seed(123)  # the resumed run takes the saved states, not the process's
    random.seed(123)
    b = _hf_run(tmp_path / "out_b", private, steps=2, resume=str(ckpt), seed=5)
    _same_parameters(a, b)


def test_dptrainer_private_file_of_the_earlier_format_still_resumes(tmp_path, monkeypatch):
    """A private file written with NumPy's generator state as an ndarray (before it was a
    tensor) needs more than weights_only=True allows by default; the DPTrainer still
    resumes from it (the ndarray's few NumPy globals are allowed, nothing else)."""
    from privlearn.torch import _hf_rng

    out, private = tmp_path / "out", tmp_path / "private"
    monkeypatch.setattr(_hf_rng, "_numpy_state", np.random.get_state)
    a = _hf_run(out, private, steps=2)
    monkeypatch.undo()
    path = next(private.glob("checkpoint-1.*"))
    with pytest.raises(Exception, match="weights_only"):
        torch.load(path, weights_only=True)  # the older format indeed
    b = _hf_run(tmp_path / "out_b", private, steps=2, resume=str(out / "checkpoint-1"), seed=5)
    _same_parameters(a, b)


class _Planted:
    """An object a crafted state file could name (unpickling it may run code)."""


def test_dptrainer_state_loader_refuses_other_objects(tmp_path):
    pytest.importorskip("transformers")
    from privlearn.torch._hf_rng import load_state_file

    path = tmp_path / "state.pt"
    torch.save({"format": 1, "x": _Planted()}, path)
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        load_state_file(path)
    torch.save({"x": np.array([_Planted()], dtype=object)}, path)
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        load_state_file(path)
