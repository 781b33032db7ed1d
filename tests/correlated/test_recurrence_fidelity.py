"""The noise of a banded or BLT strategy is what its recurrence computes in floating
point (float64 in NumPy, float32 in the PyTorch engine), not ``C^{-1} z``: by Higham's
componentwise backward error (Oettli-Prager), it is ``(C + E)^{-1} z`` with
``|E| <= T(e)``, and the accounting must cover the sensitivity of ``C + E``. Checked here
against residuals computed in 64-bit-mantissa arithmetic from the very floats the noise
paths return."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    Identity,
    MinSeparation,
    SingleParticipation,
    sensitivity,
)
from privlearn.correlated._recurrence_fidelity import backward_error_coefs
from privlearn.correlated.accounting import correlated_mechanism
from privlearn.correlated.noise import CorrelatedNoise
from privlearn.errors import ConfigurationError, ParameterValueError

L = np.longdouble
_LD_EPS = float(np.finfo(np.longdouble).eps)

#: mixed signs, a leading coefficient != 1, an ill-conditioned double root near 1, BLTs of
#: 1-4 buffers (one with a negative decay, one with the optimised decays of 1000 steps)
STRATEGIES = [
    BandedToeplitz((2.0,)),
    BandedToeplitz.square_root(8),
    BandedToeplitz((1.3, -0.6, 0.25, 0.1)),
    BandedToeplitz(tuple(np.poly([0.999, 0.999]))),
    BufferedToeplitz((0.9,), (0.3,)),
    BufferedToeplitz((0.95, -0.5), (0.2, 0.4)),
    BufferedToeplitz(
        (0.99921309, 0.98870458, 0.92092940, 0.56081874),
        (0.03753348, 0.06939972, 0.16032817, 0.22956090),
    ),
]


def _dense(strategy, n: int) -> np.ndarray:
    """``C`` in long double (a BLT's powers from its float64 constants)."""
    rec = strategy.recurrence()
    c = np.zeros(n, dtype=L)
    if hasattr(rec, "coefs"):
        k = min(n, len(rec.coefs))
        c[:k] = np.asarray(rec.coefs[:k], dtype=L)
    else:
        c[0] = 1
        lag = np.arange(n - 1)[:, None].astype(L)
        c[1:] = (
            np.asarray(rec.output_scale, dtype=L) * np.asarray(rec.buf_decay, dtype=L) ** lag
        ).sum(axis=1)
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], L(0))


def _runs(strategy, z: np.ndarray):
    """``(unit roundoff, noise)`` of every path: NumPy float64, torch float64 and float32."""
    gen = CorrelatedNoise(strategy.recurrence(), (z.shape[1],))
    yield 2.0**-53, np.array([gen.step(row) for row in z])
    torch = pytest.importorskip("torch")
    from privlearn.torch.correlated_noise import CorrelatedNoise as TorchNoise

    for dtype, u in ((torch.float64, 2.0**-53), (torch.float32, 2.0**-24)):
        gen = TorchNoise(strategy.recurrence())
        rows = [gen.apply_(torch.tensor(row, dtype=dtype)).double().numpy() for row in z]
        yield u, np.array(rows)


def _toeplitz(e: np.ndarray, n: int) -> np.ndarray:
    e = np.concatenate([e, np.zeros(n - e.size)])
    i, j = np.indices((n, n))
    return np.where(i >= j, e[np.clip(i - j, 0, n - 1)], 0.0)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_noise_is_that_of_a_strategy_within_the_bound(strategy):
    n, d = 120, 3
    z = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32).astype(float)
    c = _dense(strategy, n)
    base = sensitivity(strategy, SingleParticipation(), n).value
    accounted = {
        u: correlated_mechanism(
            strategy, SingleParticipation(), 1.0, steps=n, noise_precision=name
        ).sensitivity
        for u, name in ((2.0**-24, "float32"), (2.0**-53, "float64"))
    }
    for u, x in _runs(strategy, z):
        zz = z.astype(L)
        res = (c @ x.astype(L) - zz).astype(float)  # exact to ~1e-19 relative
        slack = 4 * n * _LD_EPS * (np.abs(c).astype(float) @ np.abs(x) + np.abs(z))
        e = backward_error_coefs(strategy, n, u)
        bound = np.zeros_like(x) if e is None else _toeplitz(e, n) @ np.abs(x)
        # Oettli-Prager: (C + E) x = z for some |E| <= T(e) iff |C x - z| <= T(e) |x|
        assert np.all(np.abs(res) <= bound + slack)
        # one such E for each coordinate's stream; the max column norm of C + E (single
        # participation) is within what the accounting charges
        if e is None:
            continue
        t = _toeplitz(e, n)
        for k in range(d):
            weight = t @ np.abs(x[:, k])
            scale = np.divide(-res[:, k], weight, out=np.zeros(n), where=weight > 0)
            effective = c + (scale[:, None] * t * np.sign(x[:, k])[None, :]).astype(L)
            assert np.allclose(
                (effective @ x[:, k].astype(L)).astype(float), z[:, k], rtol=0, atol=1e-12
            )  # E x = -(C x - z)
            assert float(np.sqrt((effective**2).sum(axis=0)).max()) <= accounted[u]
    assert accounted[2.0**-24] >= accounted[2.0**-53] >= base


def test_the_factor_is_tiny_and_exactly_one_for_dpsgd():
    for participation in (SingleParticipation(), MinSeparation(10, 100)):
        base = sensitivity(Identity(), participation, 1000).value
        m = correlated_mechanism(Identity(), participation, 1.0, steps=1000)
        assert m.sensitivity == base  # C = I: the draw is the noise, no rounding
        for strategy, most in ((STRATEGIES[1], 1e-5), (STRATEGIES[-1], 1e-4)):
            base = sensitivity(strategy, participation, 1000).value
            m = correlated_mechanism(strategy, participation, 1.0, steps=1000)
            assert 1.0 < m.sensitivity / base < 1.0 + most


def test_a_blt_whose_buffers_round_over_many_steps_is_charged_then_refused(monkeypatch):
    from privlearn.correlated import _recurrence_fidelity
    from privlearn.errors import NoiseRoundingWarning

    monkeypatch.setattr(_recurrence_fidelity, "_WARNED", set())  # warned once a process
    # theta = 1: the buffer is the running sum of the past noises, each float32 addition
    # rounds it, and after n steps the coefficient of the first noise carries ~3n roundings
    blt = BufferedToeplitz((1.0,), (1.0,))
    low = correlated_mechanism(blt, SingleParticipation(), 1.0, steps=2000).sensitivity
    assert 1.0 + 3 * 2000 * 2.0**-24 < low / sensitivity(blt, SingleParticipation(), 2000).value
    # past 1 %: still a valid bound (sens(C + E) <= (1 + rho) sens(C) for every rho),
    # charged, with a warning that says how to charge less
    base = sensitivity(blt, SingleParticipation(), 60_000).value
    with pytest.warns(NoiseRoundingWarning, match="secure_mode=True") as record:
        m = correlated_mechanism(blt, SingleParticipation(), 1.0, steps=60_000)
    # the coefficient of lag j carries at least 3 j float32 roundings: the column of the
    # first step alone is off by ~ (3 u) sqrt(sum j^2) ~ sqrt(3) u n relative to sqrt(n)
    assert base * (1 + 3**0.5 * 2.0**-24 * 60_000 * 0.99) < m.sensitivity < base * 1.1
    assert "float64 parameters" in str(record[0].message)
    with pytest.raises(ParameterValueError, match="too many for the float32 noise") as info:
        correlated_mechanism(blt, SingleParticipation(), 1.0, steps=600_000)
    for what in (
        "steps=600000",
        "secure_mode=True",
        "float64 parameters",
        "buffers=",
        "noise_precision='float64'",
    ):
        assert what in str(info.value), what
    # in float64 (NumPy's generator, the engine's secure mode) the same run is within 1e-10
    m = correlated_mechanism(
        blt, SingleParticipation(), 1.0, steps=60_000, noise_precision="float64"
    )
    assert base < m.sensitivity < base * (1 + 1e-10)
    with pytest.raises(ParameterValueError, match="noise_precision must be"):
        correlated_mechanism(blt, SingleParticipation(), 1.0, steps=5, noise_precision="bf16")


def _float32_recurrence(coefs, z: np.ndarray) -> np.ndarray:
    """``C^{-1} z`` by forward substitution in float32 arithmetic (SciPy's filter)."""
    from scipy import signal

    out = signal.lfilter(np.float32([1.0]), np.float32(coefs), z.astype(np.float32), axis=0)
    assert out.dtype == np.float32
    return out


def test_an_ill_conditioned_strategy_is_refused_in_float32_and_runs_in_float64():
    torch = pytest.importorskip("torch")
    from privlearn.torch.correlated_noise import CorrelatedNoise as TorchNoise

    strategy = BandedToeplitz(tuple(np.poly([0.99] * 4)))  # (1 - 0.99 x)^4: stable
    n = 500
    z = np.random.default_rng(1).standard_normal((n, 2)).astype(np.float32)
    exact = np.linalg.solve(_dense(strategy, n).astype(float), z.astype(float))
    sd = np.sqrt(np.cumsum(strategy.inverse_toeplitz_coefs(n) ** 2))[:, None]
    # in float32 its noise is several standard deviations away from C^{-1} z
    assert np.max(np.abs(_float32_recurrence(strategy.coefs, z) - exact) / sd) > 1.0
    gen = TorchNoise(strategy.recurrence())
    draw = torch.tensor(z[0])
    with pytest.raises(ConfigurationError, match="too ill-conditioned for float32"):
        gen.apply_(draw)
    assert gen.steps == 0 and torch.equal(draw, torch.tensor(z[0]))  # nothing moved
    gen = TorchNoise(strategy.recurrence())
    x = np.array([gen.apply_(torch.tensor(row, dtype=torch.float64)).numpy() for row in z])
    assert np.max(np.abs(x - exact) / sd) < 1e-6


def test_a_bfloat16_draw_runs_the_recurrence_in_float32():
    torch = pytest.importorskip("torch")
    from privlearn.torch.correlated_noise import CorrelatedNoise as TorchNoise

    rec = STRATEGIES[-1].recurrence()
    z = torch.randn(300, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    half, single = TorchNoise(rec), TorchNoise(rec)
    for row in z:
        got = half.apply_(row.clone())
        want = single.apply_(row.float())
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want.to(torch.bfloat16))  # one rounding of float32's


def test_a_strategy_without_a_noise_recurrence_is_refused_by_the_accounting():
    from privlearn.correlated.strategies import ToeplitzStrategy
    from privlearn.errors import ParameterTypeError

    class NoRecurrence(ToeplitzStrategy):
        __slots__ = ()
        bands = None

        def toeplitz_coefs(self, n):
            return np.r_[1.0, 0.5 * np.ones(n - 1)]

    with pytest.raises(ParameterTypeError, match="noise recurrence"):
        correlated_mechanism(NoRecurrence(), SingleParticipation(), 1.0, steps=5)


@pytest.mark.filterwarnings("ignore:noise=BandedToeplitz.*costs more privacy")
def test_the_engine_refuses_the_first_float32_step_of_an_ill_conditioned_strategy():
    torch = pytest.importorskip("torch")
    from privlearn.torch import make_private

    strategy = BandedToeplitz(tuple(np.poly([0.99] * 4)))
    data = torch.utils.data.TensorDataset(torch.randn(12, 2), torch.randn(12, 1))
    for secure in (False, True):
        model = torch.nn.Linear(2, 1)
        before = [q.detach().clone() for q in model.parameters()]
        p = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.utils.data.DataLoader(data, batch_size=3),
            noise=strategy,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sampling="shuffled_epochs",
            steps=4,
            secure_mode=secure,
            seed=None if secure else 0,
        )
        x, y = next(iter(p.data_loader))
        torch.nn.functional.mse_loss(p.model(x), y).backward()
        if secure:  # float64 state: it runs
            p.optimizer.step()
            assert p.optimizer.correlated.steps == 1
            continue
        with pytest.raises(ConfigurationError, match="too ill-conditioned for float32"):
            p.optimizer.step()
        assert p.optimizer.correlated.steps == 0 and p.accountant.steps == 0
        assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))


def test_a_registered_schema_holding_a_list_is_accounted_uncached():
    """A frozen dataclass schema holding a list is ``Hashable`` to ``isinstance`` but its
    hash raises: the cache of the rounding factor failed with a bare ``TypeError``. Its
    mechanism is that of the schema its rule delegates to."""
    from dataclasses import dataclass

    from privlearn.correlated.participation import Participation
    from privlearn.correlated.sensitivity import register_sensitivity

    @dataclass(frozen=True)
    class _Listed(Participation):
        at: list

        def participations(self, steps: int) -> int:
            return len(self.at)

    def rule(strategy, schema, n):
        return sensitivity(strategy, MinSeparation(1, len(schema.at)), n)

    register_sensitivity(_Listed, rule)
    C = BandedToeplitz.square_root(bands=4)
    got = correlated_mechanism(C, _Listed([0, 5]), 1.0, steps=10)
    assert got == correlated_mechanism(C, MinSeparation(1, 2), 1.0, steps=10)
