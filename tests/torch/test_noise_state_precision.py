"""The precision a correlated-noise run's state runs in is the one its accounting charges
(one value, on the run's NoisePlan), a resume cannot change it, and no noise path runs
a matrix product that TF32 or bfloat16 matmul settings could round."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from privlearn.correlated import BandedToeplitz, BufferedToeplitz  # noqa: E402
from privlearn.correlated.strategies import DenseStrategy  # noqa: E402
from privlearn.errors import ConfigurationError, NoiseRoundingWarning  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.correlated_noise import CorrelatedNoise  # noqa: E402

#: theta = 1: ~3 n float32 roundings on the first noise's coefficient after n steps, so
#: 60,000 steps pass the 1 % of float32's bound (a 4-buffer BLT over ~10^6 steps does)
LONG_BLT = BufferedToeplitz((1.0,), (1.0,))


def _run(model, steps, secure=False, strategy=LONG_BLT, examples=12, batch=3):
    g = torch.Generator().manual_seed(0)  # one dataset: a resume checks it is the saved one
    data = torch.utils.data.TensorDataset(torch.randn(examples, 2, generator=g),
                                          torch.randn(examples, 1, generator=g))
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.DataLoader(data, batch_size=batch),
        noise=strategy,
        noise_multiplier=1000.0,
        max_grad_norm=1.0,
        sampling="shuffled_epochs",
        steps=steps,
        secure_mode=secure,
        seed=None if secure else 0,
    )


def _step(p):
    x, y = next(iter(p.data_loader))
    x = x.to(next(p.model.parameters()).dtype)
    torch.nn.functional.mse_loss(p.model(x), y.to(x.dtype)).backward()
    p.optimizer.step()
    p.optimizer.zero_grad()


@pytest.mark.filterwarnings("ignore:noise=BufferedToeplitz.*costs more privacy")
def test_float64_noise_state_is_accounted_at_float64(monkeypatch):
    from privlearn.correlated import _recurrence_fidelity

    monkeypatch.setattr(_recurrence_fidelity, "_WARNED", set())  # warned once a process
    n = 60_000  # one epoch of batches of one: each example once, C's column norm sqrt(n)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseRoundingWarning)  # float64: nothing to say
        secure = _run(torch.nn.Linear(2, 1), n, secure=True, examples=n, batch=1)
        double = _run(torch.nn.Linear(2, 1).double(), n, examples=n, batch=1)
    with pytest.warns(NoiseRoundingWarning, match="secure_mode=True"):
        single = _run(torch.nn.Linear(2, 1), n, examples=n, batch=1)
    for p in (secure, double):
        assert p.plan.run.noise_precision == "float64"
        assert p.optimizer.correlated.minimum == torch.float64
    assert single.plan.run.noise_precision == "float32"

    def accounted(p):  # the sensitivity the accountant charges (replace-one's part)
        return p.plan.run.mechanism(1000.0, n).base.sensitivity

    # the all-ones C (theta = 1) under single participation: sens(C) = sqrt(n) exactly;
    # a float64 state is charged float64's factor (below 1 + 1e-10), a float32 one
    # float32's (over 1 %), and the planned epsilon follows
    for p in (secure, double):
        assert n**0.5 < accounted(p) < n**0.5 * (1 + 1e-10)
    assert accounted(single) > n**0.5 * 1.01
    assert secure.plan.planned_epsilon < single.plan.planned_epsilon


def test_a_float64_plan_never_runs_its_state_in_float32():
    rec = BufferedToeplitz((0.9, 0.5), (0.3, 0.2)).recurrence()
    z = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    wide, ref = CorrelatedNoise(rec, "float64"), CorrelatedNoise(rec, "float64")
    for row in z:
        got = wide.apply_(row.clone())  # a float32 draw (a parameter unfrozen later)
        want = ref.apply_(row.double())
        assert got.dtype == torch.float32 and wide._buf.dtype == torch.float64
        assert torch.equal(got, want.float())  # the float64 noise, rounded once


def _saved(double: bool) -> dict:
    model = torch.nn.Linear(2, 1)
    p = _run(model.double() if double else model, 4, strategy=BandedToeplitz((1.0, 0.4)))
    _step(p)
    return p.state_dict()


def test_a_resume_cannot_switch_the_noise_precision():
    banded = BandedToeplitz((1.0, 0.4))
    state = _saved(double=True)
    assert state["mechanism"]["noise_precision"] == "float64"
    # a float32 run would continue the float64-accounted steps in float32 (charged
    # float64's factor for all of them): refused, nothing loaded
    p = _run(torch.nn.Linear(2, 1), 4, strategy=banded)
    with pytest.raises(ConfigurationError, match="noise_precision: saved 'float64'") as info:
        p.load_state_dict(state)
    assert "secure_mode=True" in str(info.value) and p.accountant.steps == 0
    # the same precision resumes
    p = _run(torch.nn.Linear(2, 1).double(), 4, strategy=banded)
    p.load_state_dict(state)
    assert p.accountant.steps == 1
    _step(p)
    # a checkpoint written before the precision was recorded ran float32 (or was charged
    # it): it resumes a float32 run, not a float64 one
    legacy = _saved(double=False)
    del legacy["mechanism"]["noise_precision"]
    _run(torch.nn.Linear(2, 1), 4, strategy=banded).load_state_dict(legacy)
    with pytest.raises(ConfigurationError, match="noise_precision"):
        _run(torch.nn.Linear(2, 1).double(), 4, strategy=banded).load_state_dict(legacy)


class _Products:
    """Records the matrix products called (patched over torch's), then runs them."""

    def __init__(self, monkeypatch):
        self.calls = []
        for owner, names in (
            (torch, ("mv", "matmul", "mm", "addmv", "addmm", "einsum")),
            (torch.Tensor, ("addmv_", "addmv", "mv", "matmul", "__matmul__", "mm", "addmm_")),
        ):
            for name in names:
                monkeypatch.setattr(owner, name, self._spy(name, getattr(owner, name)))

    def _spy(self, name, fn):
        def spy(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return spy


@pytest.mark.parametrize("setting", ["highest", "high", "medium", "bf16"])
@pytest.mark.parametrize(
    "strategy",
    [
        BandedToeplitz((1.0, -0.3, 0.2)),
        BufferedToeplitz((0.9, 0.5), (0.3, 0.2)),
        DenseStrategy(BandedToeplitz.square_root(4).materialize(6)),
    ],
    ids=["banded", "blt", "dense"],
)
def test_no_reduced_precision_matrix_product_in_the_noise(monkeypatch, strategy, setting):
    """TF32 (``allow_tf32``, ``set_float32_matmul_precision("high")``) or bfloat16
    (``"medium"``, a backend's ``fp32_precision``) products round their float32 inputs to
    10 or 7 bits, beyond what the accounting charges: under such a setting for the
    state's device the recurrences run elementwise operations only; in full float32 (the
    default) their matrix-vector product. The noise is within float32's inner-product
    bound of the exact one either way."""
    mk, cu = torch.backends.mkldnn.matmul, torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), mk.fp32_precision, cu.fp32_precision)
    products = _Products(monkeypatch)
    rec = strategy.recurrence()
    z = np.random.default_rng(0).standard_normal((6, 5))
    gen = CorrelatedNoise(rec)
    try:
        if setting == "bf16":  # the CPU backend's own setting (new API)
            mk.fp32_precision = "bf16"
        else:
            torch.set_float32_matmul_precision(setting)
        got = [gen.apply_(torch.tensor(r, dtype=torch.float32)).double().numpy() for r in z]
    finally:
        torch.set_float32_matmul_precision(saved[0])
        mk.fp32_precision, cu.fp32_precision = saved[1:]
    monkeypatch.undo()
    assert bool(products.calls) == (setting == "highest"), products.calls
    c = strategy.materialize(6)
    exact = np.linalg.solve(c, z.astype(np.float32).astype(float))
    # within float32's inner-product bound (Higham 2002, Eq. (3.4)), generously
    bound = 16 * 2.0**-24 * (np.abs(np.linalg.inv(c)) @ np.abs(z)) + 1e-6 * np.abs(exact)
    assert np.all(np.abs(np.array(got) - exact) <= bound)
