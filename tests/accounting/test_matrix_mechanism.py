"""The matrix-factorization kinds: MatrixMechanism is the Gaussian of sensitivity
sens(C); amplified banded MF with b = 1 is DP-SGD exactly; amplified banded agrees with
dp_accounting / jax_privacy's reduction; estimates are refused wherever an epsilon is due."""

from __future__ import annotations

import math

import pytest
from scipy.special import ndtr

from privlearn.accounting import (
    BallsInBinsMatrixMechanism,
    EpsilonEstimate,
    Gaussian,
    MatrixMechanism,
    UnsupportedMechanismError,
    calibrate,
    compose,
    estimate_epsilon,
    subsample,
)
from privlearn.accounting.montecarlo import calibrate_estimate
from privlearn.accounting.serialization import dumps, loads
from privlearn.compat.autodp.autodp_core import Mechanism as FacadeMechanism
from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    Identity,
    MinSeparation,
    optimize_banded_toeplitz,
    sensitivity,
)
from privlearn.correlated.accounting import correlated_mechanism, is_amplified
from privlearn.correlated.sampling import BallsInBinsSampler, CyclicPoissonSampler


@pytest.mark.parametrize("sigma,sens", [(1.0, 1.0), (3.0, 2.5), (0.7, 0.3)])
def test_matrix_mechanism_is_the_gaussian_of_its_sensitivity(sigma, sens):
    m = MatrixMechanism(sigma, sens)
    mu = sens / sigma
    for eps in (0.5, 1.0, 3.0):
        # Balle & Wang 2018, Theorem 8
        exact = ndtr(-eps / mu + mu / 2) - math.exp(eps) * ndtr(-eps / mu - mu / 2)
        b = m.delta_bounds(eps)
        assert b.lower <= exact * (1 + 1e-9) + 1e-15 and exact <= b.upper * (1 + 1e-9)
        assert m.delta(eps, accountant="analytic") >= exact * (1 - 1e-12)
    assert m.rdp(4.0) == pytest.approx(4.0 * mu * mu / 2.0, rel=1e-12)


@pytest.mark.parametrize("q,steps,sigma", [
    pytest.param(0.01, 1000, 1.1, marks=pytest.mark.slow), (0.1, 50, 2.0), (1.0, 10, 5.0)])
def test_one_band_is_dp_sgd_exactly(q, steps, sigma):
    sampler = CyclicPoissonSampler(dataset_size=10_000, sampling_rate=q, steps=steps)
    ours = correlated_mechanism(Identity(), sampler, sigma)
    dpsgd = compose(subsample(Gaussian(sigma), q), steps) if q < 1 else None
    for acc in ("pld", "rdp"):
        if dpsgd is not None:
            assert ours.epsilon_bounds(1e-5, acc) == dpsgd.epsilon_bounds(1e-5, acc)
    if dpsgd is None:  # every record in every step: the Gaussian with sensitivity sqrt(T)
        assert isinstance(ours, MatrixMechanism) and ours.noise_multiplier == sigma
        assert math.sqrt(steps) <= ours.sensitivity <= math.sqrt(steps) * (1 + 1e-12)
    # and a one-band banded strategy likewise
    assert correlated_mechanism(BandedToeplitz((1.0,)), sampler, sigma) == ours
    if dpsgd is not None:
        def f(x):
            return correlated_mechanism(Identity(), sampler, x)

        def g(x):
            return compose(subsample(Gaussian(x), q), steps)

        assert calibrate(f, 2.0, 1e-5) == calibrate(g, 2.0, 1e-5)


AMPLIFIED = [
    # (steps, bands, cycle, q, sigma)
    (512, 8, 8, 0.5, 3.0),
    pytest.param(1000, 4, 4, 0.05, 1.0, marks=pytest.mark.slow),
    pytest.param(2000, 16, 20, 0.2, 2.0, marks=pytest.mark.slow),
    pytest.param(300, 2, 5, 0.01, 0.8, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("steps,bands,cycle,q,sigma", AMPLIFIED)
def test_amplified_banded_against_dp_accounting(steps, bands, cycle, q, sigma):
    dp_accounting = pytest.importorskip("dp_accounting")
    C = optimize_banded_toeplitz(steps, bands, MinSeparation(cycle))
    sampler = CyclicPoissonSampler(100_000, q, steps, cycle)
    m = correlated_mechanism(C, sampler, sigma)
    assert is_amplified(C, sampler)
    # the reduction of [CC23b] Theorem 4 as jax_privacy states it
    # (experimental.accounting.amplified_bandmf_event): ceil(n / b) Poisson-subsampled
    # Gaussians of noise multiplier sigma / max column norm
    col = C.max_column_norm(steps)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / col)),
        math.ceil(steps / cycle),
    )
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    peer = acc.compose(event).get_epsilon(1e-6)
    ours = m.epsilon_bounds(1e-6)
    # the peer's PLD is itself a pessimistic upper bound: it can sit above our certified
    # upper bound, never below our certified lower bound
    assert ours.lower <= peer * (1 + 1e-6)
    assert ours.upper <= peer * 1.01
    assert ours.upper >= peer * 0.99


def test_amplified_banded_matches_jax_privacy_event():
    jax_acc = pytest.importorskip("jax_privacy.experimental.accounting")
    dp_accounting = pytest.importorskip("dp_accounting")
    steps, bands, q, sigma = 1024, 8, 0.1, 1.5
    C = BandedToeplitz.square_root(bands)  # ||c|| = 1: max column norm 1
    event = jax_acc.amplified_bandmf_event(sigma, steps, num_bands=bands, sampling_prob=q)
    peer = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(
        event).get_epsilon(1e-6)
    ours = correlated_mechanism(C, CyclicPoissonSampler(10**6, q, steps, bands), sigma)
    b = ours.epsilon_bounds(1e-6)
    assert b.lower <= peer * (1 + 1e-6) and peer * 0.99 <= b.upper <= peer * 1.01


def test_unamplified_combinations():
    steps = 120
    blt = BufferedToeplitz((0.95, 0.6), (0.1, 0.2))
    banded = BandedToeplitz.square_root(6)
    # BLT is not banded: cyclic Poisson gives the (certified) un-amplified mechanism
    s = CyclicPoissonSampler(1000, 0.3, steps, 10)
    assert not is_amplified(blt, s)
    m = correlated_mechanism(blt, s, 2.0)
    sens = sensitivity(blt, MinSeparation(10, 12), steps).value
    # times the certified factor of its float32 noise recurrence's rounding (< 1e-5 here)
    assert isinstance(m, MatrixMechanism) and m.noise_multiplier == 2.0
    assert sens <= m.sensitivity <= sens * (1 + 1e-5)
    # bands > cycle: no amplification either
    assert not is_amplified(banded, CyclicPoissonSampler(1000, 0.3, steps, 4))
    # a fixed order: the Gaussian of sens(C) for (k, b)-participation
    m = correlated_mechanism(banded, FixedEpochs(4), 2.0, steps=steps)
    sens = sensitivity(banded, FixedEpochs(4), steps).value
    assert sens <= m.sensitivity <= sens * (1 + 1e-5)
    with pytest.raises(ValueError, match="steps is required"):
        correlated_mechanism(banded, FixedEpochs(4), 2.0)


COMBINATIONS = [
    ("dp-sgd x poisson", Identity(), CyclicPoissonSampler(60000, 0.004, 500)),
    ("banded x cyclic poisson", BandedToeplitz.square_root(4),
     CyclicPoissonSampler(60000, 0.02, 500, 4)),
    ("blt x cyclic poisson", BufferedToeplitz((0.99, 0.8), (0.05, 0.2)),
     CyclicPoissonSampler(60000, 0.02, 500, 10)),
    ("banded x balls-in-bins", BandedToeplitz.square_root(4), BallsInBinsSampler(60000, 500, 50)),
    ("banded x fixed epochs", BandedToeplitz.square_root(4), FixedEpochs(10)),
]


@pytest.mark.parametrize("name,strategy,sampler", COMBINATIONS, ids=[c[0] for c in COMBINATIONS])
def test_calibration_for_each_combination(name, strategy, sampler):
    def factory(x):
        return correlated_mechanism(strategy, sampler, x, steps=500)

    sigma = calibrate(factory, epsilon=2.0, delta=1e-5)
    assert factory(sigma).epsilon(1e-5) <= 2.0
    assert factory(sigma * (1 - 1e-4)).epsilon(1e-5) > 2.0


def test_estimates_are_refused_where_an_epsilon_is_due(tmp_path):
    C = BufferedToeplitz((0.9,), (0.3,))
    m = correlated_mechanism(C, BallsInBinsSampler(1000, 40, 8), 2.0, amplified=True)
    assert isinstance(m, BallsInBinsMatrixMechanism)
    for acc in ("pld", "rdp"):
        with pytest.raises(UnsupportedMechanismError):
            m.epsilon(1e-5, accountant=acc)
    with pytest.raises(UnsupportedMechanismError):
        calibrate(lambda x: correlated_mechanism(
            C, BallsInBinsSampler(1000, 40, 8), x, amplified=True), 2.0, 1e-5)
    from privlearn.ledger import Ledger

    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=10.0, delta=1e-5)
    with pytest.raises(UnsupportedMechanismError):
        ledger.spend("d", m)
    assert ledger.spent("d").epsilon_spent == 0.0
    est = estimate_epsilon(m, 1e-5, samples=2000)
    assert isinstance(est, EpsilonEstimate) and not est.certified
    assert "estimate" in str(est) and "not a certified bound" in str(est)
    # the explicit opt-in
    chosen = calibrate_estimate(lambda x: correlated_mechanism(
        C, BallsInBinsSampler(1000, 40, 8), x, amplified=True), 3.0, 1e-5, samples=2000)
    assert not chosen.certified and chosen.estimate.upper <= 3.0


def test_estimate_brackets_a_closed_form():
    # one bin: every record in every step, no amplification; the estimate's pair is then
    # exactly the Gaussian with sensitivity ||C 1||
    C = BandedToeplitz((1.0, 0.5))
    n, sigma = 6, 3.0
    m = BallsInBinsMatrixMechanism(sigma, C.coefs, n, 1)
    exact = MatrixMechanism(sigma, sensitivity(C, MinSeparation(1), n).value).epsilon(1e-3)
    est = estimate_epsilon(m, 1e-3, samples=100_000, confidence=0.999)
    assert est.lower <= exact <= est.upper
    # with 10 bins, amplification: below the certified un-amplified epsilon
    m10 = BallsInBinsMatrixMechanism(1.0, (1.0,), 10, 10)
    assert estimate_epsilon(m10, 1e-5, samples=20_000).upper < Gaussian(1.0).epsilon(1e-5)


def test_serialisation_ledger_and_facade(tmp_path):
    m = correlated_mechanism(BandedToeplitz.square_root(4),
                             CyclicPoissonSampler(60000, 0.02, 200, 4), 1.3)
    assert loads(dumps(m)) == m
    mm = MatrixMechanism(2.0, 1.5)
    assert loads(dumps(mm)) == mm
    est = BallsInBinsMatrixMechanism(1.0, (1.0, 0.5), 10, 5)
    assert loads(dumps(est)) == est
    from privlearn.ledger import Ledger

    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=50.0, delta=1e-5)
    ledger.spend("d", m)
    assert ledger.spent("d").epsilon_spent == pytest.approx(m.epsilon(1e-5), rel=1e-9)
    assert FacadeMechanism.from_privlearn(m).get_approxDP(1e-5) == pytest.approx(
        m.epsilon(1e-5), rel=1e-12)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sensitivity must be in \\(0, inf\\)"):
        MatrixMechanism(1.0, 0.0)
    with pytest.raises(TypeError, match="sampler must be"):
        correlated_mechanism(Identity(), "poisson", 1.0)
    with pytest.raises(TypeError, match="mechanism must be a BallsInBinsMatrixMechanism"):
        estimate_epsilon(Gaussian(1.0), 1e-5)
    with pytest.raises(ValueError, match="cycle_length must be at most steps"):
        BallsInBinsMatrixMechanism(1.0, (1.0,), 5, 10)


def test_equivalent_noise_multiplier_is_rounded_down_exactly():
    # sigma / sens rounded down, checked in exact rational arithmetic: a float check of
    # ratio * sens missed a quotient one ulp above sigma / sens in about half of all cases
    import random
    from fractions import Fraction

    rng = random.Random(0)
    for _ in range(2000):
        sigma, sens = 10 ** rng.uniform(-1, 2), 10 ** rng.uniform(-1, 2)
        g = MatrixMechanism(sigma, sens).gaussian.noise_multiplier
        assert Fraction(g) * Fraction(sens) <= Fraction(sigma)
        assert Fraction(math.nextafter(g, math.inf)) * Fraction(sens) > Fraction(sigma)
