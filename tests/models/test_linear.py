"""SSP / AdaSSP / NoisyGD: seed 000 acceptance numbers, accounting, clipping, bad input."""

import math
import warnings

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import privlearn.models._ssp as ssp_mod
from privlearn.accounting import Gaussian, compose
from privlearn.accounting.analytic import gaussian_epsilon
from privlearn.datasets import load_california_housing
from privlearn.errors import PrivacyLeakWarning
from privlearn.models import AdaSSPRegressor, NoisyGDRegressor, SSPRegressor
from privlearn.models.linear import (
    adassp_coefficients,
    noise_direction_scale,
    noisy_gd_paths,
    ssp_coefficients,
    symmetric_noise,
    theoretical_learning_rate,
)

SEED_KW = dict(delta=1e-6, x_bound=1.0, y_bound=5.0, fit_intercept=False)


@pytest.fixture(scope="module")
def seed_data():
    b = load_california_housing(preprocessing="bounded")
    X, y = b.data, b.target
    XTX, XTy = X.T @ X, X.T @ y
    n = len(y)

    def mse(T):
        T = np.atleast_2d(T)
        return (y @ y - 2 * T @ XTy + np.einsum("ri,ij,rj->r", T, XTX, T)) / n

    return X, y, XTX, XTy, mse


def test_mse_from_sufficient_statistics_matches_direct(seed_data):
    X, y, XTX, XTy, mse = seed_data
    theta = np.random.default_rng(0).normal(size=(3, 8))
    direct = [np.mean((y - X @ t) ** 2) for t in theta]
    np.testing.assert_allclose(mse(theta), direct, rtol=1e-10)


# ---------------------------------------------------------------------------------------
# Seed 000 acceptance, exactly as a reviewer runs it: 50 fits through the public
# fit/predict with random_state=0..49, median training MSE. With the default estimators the
# population medians are far enough below the bounds that a 50-fit median fails with
# probability < 1e-6 (measured spreads in the comments; docs/benchmarks.md).
# ---------------------------------------------------------------------------------------
NONPRIVATE = 0.6053084771039058


def _public_fit_mses(cls, X, y, reps=50, **kw):
    return np.array([
        np.mean((y - cls(random_state=i, **kw, **SEED_KW).fit(X, y).predict(X)) ** 2)
        for i in range(reps)
    ])


@pytest.mark.parametrize(
    "cls,eps,bound",
    [
        # population median / standard deviation of a 50-fit median (200k repetitions)
        (AdaSSPRegressor, 1.0, 0.665),  # 0.653 / 0.0011
        (AdaSSPRegressor, 0.1, 0.83),  # 0.698 / 0.008
        (SSPRegressor, 1.0, 0.77),  # 0.680 / 0.012
    ],
)
def test_seed000_public_fit_medians_50_reps(seed_data, cls, eps, bound):
    X, y, *_ = seed_data
    mses = _public_fit_mses(cls, X, y, epsilon=eps)
    assert NONPRIVATE - 1e-9 <= np.median(mses) <= bound


# Population medians through the estimators' own batched code path (sample_coefficients
# runs fit's code with many independent draws): 20,000 repetitions pin a median to about
# +-0.002 (+-0.005 for the seed's heavy-tailed SSP).
@pytest.mark.parametrize(
    "cls,params,eps,lo,hi",
    [
        (AdaSSPRegressor, {}, 1.0, 0.6053, 0.660),
        (AdaSSPRegressor, {}, 0.1, 0.6053, 0.75),
        (SSPRegressor, {}, 1.0, 0.6053, 0.72),
        # seed 000's own algorithms reproduce the colleague's 200k-repetition medians
        (AdaSSPRegressor, dict(matrix_noise="upper_triangle", regularization="ridge"), 0.1,
         0.815, 0.842),  # 0.8285
        (AdaSSPRegressor, dict(matrix_noise="upper_triangle", regularization="ridge"), 1.0,
         0.657, 0.665),  # 0.661
        (SSPRegressor, dict(matrix_noise="upper_triangle", project_psd=False), 1.0,
         0.745, 0.775),  # 0.760
    ],
)
def test_seed000_population_medians(seed_data, cls, params, eps, lo, hi):
    X, y, XTX, XTy, mse = seed_data
    est = cls(epsilon=eps, random_state=12345, **params, **SEED_KW)
    coef, intercept = est.sample_coefficients(X, y, 20000)
    assert np.all(intercept == 0)
    assert lo <= np.median(mse(coef)) <= hi


@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor, NoisyGDRegressor])
@pytest.mark.parametrize("fit_intercept", [False, True])
def test_sample_coefficients_is_fit(seed_data, cls, fit_intercept):
    """One batched repetition is exactly one fit: the batch runs fit's code."""
    X, y, *_ = seed_data
    kw = dict(SEED_KW, fit_intercept=fit_intercept)
    extra = dict(noise_multiplier=50.0) if cls is NoisyGDRegressor else {}
    m = cls(epsilon=0.8, random_state=7, **kw, **extra).fit(X, y)
    coef, intercept = cls(epsilon=0.8, random_state=7, **kw, **extra).sample_coefficients(
        X, y, 1)
    np.testing.assert_array_equal(coef[0], m.coef_)
    assert intercept[0] == m.intercept_
    # independent repetitions differ
    many, _ = cls(epsilon=0.8, random_state=7, **kw, **extra).sample_coefficients(X, y, 3)
    assert len({tuple(r) for r in many}) == 3
    with pytest.raises(ValueError, match="n_repetitions"):
        cls(**kw).sample_coefficients(X, y, 0)


@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor, NoisyGDRegressor])
def test_sample_coefficients_leaves_the_estimator_as_it_was(cls):
    """``sample_coefficients`` fits nothing: an unfitted estimator stays unfitted (its data
    checks set ``n_features_in_``, which made ``check_is_fitted`` pass and ``predict``
    fail on the missing ``coef_``), and a fitted one keeps its fit's feature count (a
    call on data of another width made ``predict`` refuse the fit's own width)."""
    from sklearn.exceptions import NotFittedError
    from sklearn.utils.validation import check_is_fitted

    rng = np.random.default_rng(0)
    X, y = rng.uniform(-0.5, 0.5, size=(50, 3)), rng.uniform(-1, 1, size=50)
    wide = np.hstack([X, X[:, :1]])
    extra = dict(noise_multiplier=50.0) if cls is NoisyGDRegressor else {}
    est = cls(random_state=0, **extra)
    est.sample_coefficients(X, y, 2)
    assert vars(est) == vars(cls(random_state=0, **extra))
    with pytest.raises(NotFittedError):
        check_is_fitted(est)
    with pytest.raises(ValueError, match="n_repetitions"):  # a refusal changes nothing
        est.sample_coefficients(X, y, 0)
    fitted = est.fit(X, y)
    before = dict(vars(fitted))
    coef, _ = fitted.sample_coefficients(wide, y, 2)
    assert coef.shape == (2, 4)
    assert vars(fitted).keys() == before.keys()
    assert all(vars(fitted)[k] is v for k, v in before.items())
    assert fitted.predict(X).shape == (50,)


def test_random_state_draws_are_independent(seed_data):
    """Different seeds give different, uncorrelated noise (no stream reuse)."""
    X, y, XTX, XTy, mse = seed_data
    coefs = np.array([SSPRegressor(epsilon=1.0, random_state=i, **SEED_KW).fit(X, y).coef_
                      for i in range(40)])
    assert len({tuple(c) for c in coefs}) == 40
    gen = np.random.default_rng(0)
    a = SSPRegressor(epsilon=1.0, random_state=gen, **SEED_KW).fit(X, y).coef_
    b = SSPRegressor(epsilon=1.0, random_state=gen, **SEED_KW).fit(X, y).coef_
    assert not np.array_equal(a, b)  # a shared Generator advances between fits


def test_noisygd_seed000_50_reps_batched(seed_data):
    """NoisyGD at epsilon = 2 (sigma = 500; T = 49748 with the default private smoothness
    release, 50251 with the seed's exact lambda_max), 50 chains through
    sample_coefficients (fit's code path, batched; each chain has its own smoothness
    release). Population median 0.6526 with either rate; the sd of a 50-chain median is
    0.0006-0.0007, so the bound 0.655 is about 3.5 sd away."""
    X, y, XTX, XTy, mse = seed_data
    est = NoisyGDRegressor(epsilon=2.0, random_state=1, **SEED_KW)
    coef, _ = est.sample_coefficients(X, y, 50)
    assert NONPRIVATE <= np.median(mse(coef)) <= 0.655


def test_noisygd_seed000_public_fits(seed_data):
    """Three public fits (each about 0.4 s; the 50-fit version is marked slow). A 3-fit
    median has sd ~0.002 around 0.6525, so the in-range bound here is 0.66."""
    X, y, XTX, XTy, mse = seed_data
    mses = _public_fit_mses(NoisyGDRegressor, X, y, reps=3, epsilon=2.0)
    assert np.all(mses >= NONPRIVATE) and np.median(mses) <= 0.66


@pytest.mark.slow
def test_noisygd_seed000_public_fits_50(seed_data):
    """Acceptance with the data-independent default (smoothness="private": the
    smoothness is released with noise and accounted in mechanism_): measured 50-fit
    median 0.6529 (random_state 0..49); 8 batched 50-chain medians 0.6514-0.6537, mean
    0.6526, sd 0.0006 -- indistinguishable from the seed's exact-lambda_max rate (mean
    0.6526, sd 0.0006)."""
    X, y, *_ = seed_data
    mses = _public_fit_mses(NoisyGDRegressor, X, y, reps=50, epsilon=2.0)
    assert NONPRIVATE <= np.median(mses) <= 0.655


def test_seed000_noisygd_schedule(seed_data):
    X, y, XTX, XTy, mse = seed_data
    m = NoisyGDRegressor(epsilon=2.0, random_state=0, **SEED_KW).fit(X, y)
    sigma, T = 500.0, m.n_iter_
    # default smoothness="private": one Gaussian release of lambda_max composed with the
    # T iterations; T is the largest that fits (rounded down)
    (sl, one), (gd, steps) = m.mechanism_.parts
    assert one == 1 and steps == T and gd == Gaussian(sigma)
    sigma_l = sl.noise_multiplier

    def mech(k):
        return compose([Gaussian(sigma_l), compose(Gaussian(sigma), steps=k)])

    assert mech(T).epsilon(1e-6) <= 2.0
    assert mech(T + 1).epsilon(1e-6) > 2.0
    # sigma_l takes 1% of the budget in 1/sigma^2 (public: from epsilon and delta only)
    assert 1 / sigma_l**2 == pytest.approx(0.01 * (1 / sigma_l**2 + T / sigma**2), rel=1e-3)
    assert m.learning_rate_ == pytest.approx(
        min(1 / m.smoothness_, 4 / math.sqrt(8 * sigma * 6.0 * m.smoothness_ * T)), rel=1e-12
    )
    # the seed's exact lambda_max is still available, with a PrivacyLeakWarning
    from privlearn.errors import PrivacyLeakWarning

    with pytest.warns(PrivacyLeakWarning, match="exact largest eigenvalue"):
        d = NoisyGDRegressor(epsilon=2.0, smoothness="data", random_state=0,
                             **SEED_KW).fit(X, y)
    lam = np.linalg.eigvalsh(XTX)[-1]
    Td = d.n_iter_
    assert d.mechanism_ == compose(Gaussian(sigma), steps=Td)
    assert compose(Gaussian(sigma), steps=Td + 1).epsilon(1e-6) > 2.0
    assert d.learning_rate_ == pytest.approx(
        min(1 / lam, 4 / math.sqrt(8 * sigma * 6.0 * lam * Td)), rel=1e-12
    )


def test_noisygd_single_chain_fast_path_matches_batched_loop(seed_data):
    X, y, XTX, XTy, mse = seed_data
    args = (XTX, XTy, 500.0, 2e-5, 3000, 1.0, 5.0)
    fast, _, _ = noisy_gd_paths(*args, np.random.default_rng(3))
    # log_every forces the batched loop; the random draws are the same
    slow, _, _ = noisy_gd_paths(*args, np.random.default_rng(3), log_every=10**6)
    np.testing.assert_allclose(fast, slow, rtol=1e-10, atol=1e-12)


def _naive_noisy_gd(XTX, XTy, sigma, lrs, n_iter, xb, yb, rng, reps, log_every, chunk=256):
    """The docstring's recursion, one chain and one step at a time, from the same draws
    ((chunk, reps, dim) standard normals per block of steps)."""
    dim = XTX.shape[0]
    theta = [np.zeros(dim) for _ in range(reps)]
    logs, iters = [], []
    for start in range(0, n_iter, chunk):
        noise = rng.standard_normal((min(chunk, n_iter - start), reps, dim))
        for j in range(noise.shape[0]):
            for r in range(reps):
                gs = xb**2 * math.sqrt(float(theta[r] @ theta[r])) + xb * yb
                theta[r] = theta[r] - lrs[r] * (XTX @ theta[r] - XTy + gs * sigma * noise[j, r])
            if (start + j) % log_every == 0:
                logs.append(np.array(theta))
                iters.append(start + j + 1)
    return np.array(theta), np.array(logs), np.array(iters)


@pytest.mark.parametrize("per_chain", [False, True])
def test_noisygd_paths_match_the_naive_recursion(seed_data, per_chain):
    """Both batched loops (one learning rate shared by the chains, rearranged; one per
    chain) against the recursion written out chain by chain, across a chunk boundary."""
    X, y, XTX, XTy, mse = seed_data
    reps, n_iter = 3, 300
    lrs = np.array([2e-5, 1e-5, 3e-5]) if per_chain else np.full(reps, 2e-5)
    lr = lrs if per_chain else 2e-5
    theta, path, iters = noisy_gd_paths(XTX, XTy, 500.0, lr, n_iter, 1.0, 5.0,
                                        np.random.default_rng(4), reps=reps, log_every=50)
    ref_theta, ref_path, ref_iters = _naive_noisy_gd(XTX, XTy, 500.0, lrs, n_iter, 1.0, 5.0,
                                                     np.random.default_rng(4), reps, 50)
    np.testing.assert_array_equal(iters, ref_iters)
    np.testing.assert_allclose(theta, ref_theta, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(path, ref_path, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------
# The seed's algorithms, transcribed independently from seed 000's notebook text
# ---------------------------------------------------------------------------------------
def _seed_run_ssp(XTX, XTy, sigma1, sigma2, rng, x_bound=1.0, y_bound=5.0):
    Z = x_bound**2 * sigma1 * rng.standard_normal(size=XTX.shape)
    Z_analyzegauss = np.triu(Z) + np.triu(Z, k=1).T
    hatXTX = XTX + Z_analyzegauss
    hatXTy = XTy + x_bound * y_bound * sigma2 * rng.standard_normal(size=XTy.shape)
    return np.linalg.solve(hatXTX, hatXTy)


def _seed_run_adassp(XTX, XTy, sigma1, sigma2, sigma3, rng, x_bound=1.0, y_bound=5.0):
    dim = XTX.shape[0]
    Z = x_bound**2 * sigma1 * rng.standard_normal(size=XTX.shape)
    hatXTX = XTX + np.triu(Z) + np.triu(Z, k=1).T
    hatXTy = XTy + x_bound * y_bound * sigma2 * rng.standard_normal(size=XTy.shape)
    u, s, vT = np.linalg.svd(XTX)
    lambdamin = s[-1] + x_bound**2 * sigma3 * rng.standard_normal(size=1)
    lambdamin_lowerbound = max(0, lambdamin[0] - x_bound**2 * sigma3 * 1.96)
    lamb = max(0, np.sqrt(dim) * sigma1 * x_bound**2 * 1.96 - lambdamin_lowerbound)
    return np.linalg.solve(hatXTX + lamb * np.eye(dim), hatXTy)


@pytest.mark.parametrize("eps", [0.3, 1.7])
def test_seed_variants_equal_seed_code(seed_data, eps):
    X, y, XTX, XTy, mse = seed_data
    for i in range(3):
        m = SSPRegressor(epsilon=eps, random_state=i, matrix_noise="upper_triangle",
                         project_psd=False, **SEED_KW).fit(X, y)
        s = m.noise_scale_
        ref = _seed_run_ssp(XTX, XTy, 2 * s, 3 * s, np.random.default_rng(i))
        np.testing.assert_allclose(m.coef_, ref, rtol=1e-9, atol=1e-9)
        a = AdaSSPRegressor(epsilon=eps, random_state=i, matrix_noise="upper_triangle",
                            regularization="ridge", **SEED_KW).fit(X, y)
        s = a.noise_scale_
        ref = _seed_run_adassp(XTX, XTy, 2 * s, 3 * s, 5 * s, np.random.default_rng(i))
        np.testing.assert_allclose(a.coef_, ref, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------
# The default improvements: Frobenius noise, PSD projection, eigenvalue floor
# ---------------------------------------------------------------------------------------
def _vech_frobenius(M):
    """The isometry v(M) = (M_ii, sqrt(2) M_ij for i < j)."""
    i, j = np.triu_indices(M.shape[-1], k=1)
    return np.concatenate([np.diagonal(M, axis1=-2, axis2=-1),
                           math.sqrt(2) * M[..., i, j]], axis=-1)


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 6), elements=st.floats(-3, 3)))
def test_frobenius_release_has_sensitivity_norm_squared(x):
    """v(x x^T) has L2 norm ||x||^2 exactly: the sensitivity of the released vector."""
    v = _vech_frobenius(np.outer(x, x))
    assert np.linalg.norm(v) == pytest.approx(x @ x, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("kind", ["frobenius", "upper_triangle"])
def test_symmetric_noise_distribution(kind):
    d = 5
    E = symmetric_noise(np.random.default_rng(0), 40000, d, kind)
    np.testing.assert_array_equal(E, np.swapaxes(E, -1, -2))
    if kind == "frobenius":
        # v(E) is a standard normal vector: the Gaussian mechanism on v(X^T X)
        V = _vech_frobenius(E)
        np.testing.assert_allclose(np.cov(V.T), np.eye(V.shape[1]), atol=0.03)
    else:
        iu = np.triu_indices(d)
        np.testing.assert_allclose(np.cov(E[:, iu[0], iu[1]].T), np.eye(len(iu[0])),
                                   atol=0.03)
    # the ridge rule's noise scale: E ||E v||^2 for a unit v
    v = np.random.default_rng(1).normal(size=d)
    v /= np.linalg.norm(v)
    rms = math.sqrt(np.mean(np.sum((E @ v) ** 2, axis=-1)))
    assert rms == pytest.approx(noise_direction_scale(d, kind), rel=0.02)


def test_frobenius_and_seed_noise_share_draws():
    a = symmetric_noise(np.random.default_rng(4), 3, 4, "frobenius")
    b = symmetric_noise(np.random.default_rng(4), 3, 4, "upper_triangle")
    iu = np.triu_indices(4, k=1)
    np.testing.assert_array_equal(np.diagonal(a, axis1=1, axis2=2),
                                  np.diagonal(b, axis1=1, axis2=2))
    np.testing.assert_allclose(a[:, iu[0], iu[1]] * math.sqrt(2), b[:, iu[0], iu[1]])


def test_eigenvalue_floor_is_projection_then_solve():
    """theta = A_lam^{-1} b with A_lam the Frobenius projection of A onto {A >= lam I},
    built here as A + sum_k max(0, lam - w_k) v_k v_k^T and solved by LU."""
    rng = np.random.default_rng(0)
    d, reps = 6, 30
    XTX = np.diag(np.geomspace(1e-2, 1e3, d))
    XTy = rng.normal(size=d) * 10
    theta, lam = adassp_coefficients(XTX, XTy, 5.0, 1.0, 1.0, 1.0, 1.0,
                                     np.random.default_rng(1), reps)
    # reproduce the released statistics with the same draws
    rng2 = np.random.default_rng(1)
    E = symmetric_noise(rng2, reps, d, "frobenius")
    e = rng2.standard_normal((reps, d))
    for r in range(reps):
        A = XTX + 5.0 * E[r]
        w, V = np.linalg.eigh(A)
        A_lam = A + (V * np.maximum(0, lam[r] - w)) @ V.T
        assert np.linalg.eigvalsh(A_lam)[0] >= lam[r] * (1 - 1e-9)
        ref = np.linalg.solve(A_lam, XTy + 1.0 * e[r])
        np.testing.assert_allclose(theta[r], ref, rtol=1e-8, atol=1e-10)
    assert np.all(lam > 0)


def test_ssp_psd_projection():
    """Positive definite noisy X^T X: plain solve. Indefinite: the solution lies in the
    span of the positive eigen-directions and solves the projected system there."""
    XTX = np.diag([100.0, 50.0, 0.01])
    XTy = np.array([10.0, 5.0, 1.0])
    for seed in range(20):
        th_psd = ssp_coefficients(XTX, XTy, 1.0, 0.1, 1.0, 1.0, np.random.default_rng(seed))
        th_raw = ssp_coefficients(XTX, XTy, 1.0, 0.1, 1.0, 1.0, np.random.default_rng(seed),
                                  project_psd=False)
        rng = np.random.default_rng(seed)
        A = XTX + symmetric_noise(rng, 1, 3)[0]
        b = XTy + 0.1 * rng.standard_normal((1, 3))[0]
        w, V = np.linalg.eigh(A)
        if w[0] > 0:
            np.testing.assert_allclose(th_psd[0], th_raw[0], rtol=1e-8)
        else:
            pos = V[:, w > 0]
            np.testing.assert_allclose(V[:, w <= 0].T @ th_psd[0], 0, atol=1e-10)
            A_plus = (pos * w[w > 0]) @ pos.T
            np.testing.assert_allclose(A_plus @ th_psd[0], pos @ (pos.T @ b), rtol=1e-8,
                                       atol=1e-10)


def test_ssp_mechanism_and_epsilon_spent(seed_data):
    X, y, *_ = seed_data
    for cls, parts in ((SSPRegressor, 2), (AdaSSPRegressor, 3)):
        m = cls(epsilon=0.7, random_state=0, **SEED_KW).fit(X, y)
        assert len(m.mechanism_.parts) == parts
        assert m.epsilon_ <= 0.7
        assert m.epsilon_ == pytest.approx(0.7, rel=1e-4)
        # exact: the composed Gaussians equal one Gaussian with 1/sigma^2 summed
        ratios = (2, 3) if parts == 2 else (2, 3, 5)
        sig = 1 / math.sqrt(sum(1 / (r * m.noise_scale_) ** 2 for r in ratios))
        assert gaussian_epsilon(sig, 1e-6) == pytest.approx(m.epsilon_, rel=1e-9)


def test_ssp_with_huge_epsilon_recovers_least_squares(seed_data):
    X, y, XTX, XTy, mse = seed_data
    ls = np.linalg.solve(XTX, XTy)
    m = SSPRegressor(epsilon=1e5, random_state=0, **SEED_KW).fit(X, y)
    assert mse(m.coef_)[0] == pytest.approx(mse(ls)[0], abs=1e-4)
    assert mse(ls)[0] == pytest.approx(0.6053084771039058, rel=1e-12)


def test_intercept_fit():
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(20000, 2))
    y = X @ [1.0, -1.0] + 2.0
    m = AdaSSPRegressor(epsilon=50.0, delta=1e-6, x_bound=1.0, y_bound=5.0, random_state=0)
    m.fit(X, y)
    assert m.intercept_ == pytest.approx(2.0, abs=0.05)
    assert m.score(X, y) > 0.9


def test_rows_above_bound_are_clipped_not_trusted():
    from privlearn.models import DataClippedWarning

    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 3))
    y = rng.uniform(-10, 10, size=300)
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    Xc = X / np.maximum(norms, 1.0)
    yc = np.clip(y, -2.0, 2.0)
    kw = dict(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=2.0, random_state=3)
    n_rows, n_labels = int(np.sum(norms[:, 0] > 1.0)), int(np.sum(np.abs(y) > 2.0))
    # the counts go to the person fitting (a warning), never onto the model
    with pytest.warns(DataClippedWarning, match=f"{n_rows} of 300 rows.*{n_labels} labels"):
        a = SSPRegressor(**kw).fit(X, y)
    b = SSPRegressor(**kw).fit(Xc, yc)
    np.testing.assert_allclose(a.coef_, b.coef_)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataClippedWarning)
        SSPRegressor(**kw).fit(0.9 * Xc, 0.9 * yc)


def test_noisygd_trajectory_and_regimes(seed_data):
    X, y, *_ = seed_data
    m = NoisyGDRegressor(epsilon=2.0, noise_multiplier=50.0, log_every=10, random_state=0,
                         **SEED_KW).fit(X, y)
    assert m.path_iterations_[0] == 1 and np.all(np.diff(m.path_iterations_) == 10)
    assert np.all(np.diff(m.epsilon_path_) > 0)
    assert m.epsilon_path_[-1] <= m.epsilon_ <= 2.0
    sigma_l = m.mechanism_.parts[0][0].noise_multiplier  # the smoothness release
    for t, e in zip(m.path_iterations_[::7], m.epsilon_path_[::7], strict=True):
        mu2 = t / 50.0**2 + 1 / sigma_l**2
        assert e == pytest.approx(gaussian_epsilon(1 / math.sqrt(mu2), 1e-6), rel=1e-9)
    np.testing.assert_allclose(m.coef_path_[-1] if m.path_iterations_[-1] == m.n_iter_ else
                               m.coef_path_[-1], m.coef_path_[-1])


def test_noisygd_public_smoothness_and_explicit_schedule(seed_data):
    X, y, *_ = seed_data
    # "public" uses the exact row count n (private under add/remove): it now warns
    from privlearn.errors import PrivacyLeakWarning

    with pytest.warns(PrivacyLeakWarning, match="number of rows"):
        m = NoisyGDRegressor(epsilon=2.0, noise_multiplier=50.0, smoothness="public",
                             random_state=0, **SEED_KW).fit(X, y)
    assert m.smoothness_ == pytest.approx(len(y))
    assert m.learning_rate_ == pytest.approx(
        theoretical_learning_rate(len(y), 8, 50.0 * 6.0, m.n_iter_))
    m2 = NoisyGDRegressor(epsilon=2.0, noise_multiplier=None, n_iter=100, random_state=0,
                          **SEED_KW).fit(X, y)
    assert m2.epsilon_ <= 2.0
    with pytest.raises(ValueError, match="spends epsilon"):
        NoisyGDRegressor(epsilon=0.1, noise_multiplier=1.0, n_iter=1000, **SEED_KW).fit(X, y)


X_OK = np.random.default_rng(0).uniform(-0.3, 0.3, size=(50, 3))
Y_OK = X_OK.sum(axis=1)


@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor, NoisyGDRegressor])
@pytest.mark.parametrize(
    "params,X,y,match",
    [
        ({}, np.where(np.eye(50, 3) > 0, np.nan, X_OK), Y_OK, "NaN"),
        ({}, np.where(np.eye(50, 3) > 0, np.inf, X_OK), Y_OK, "infinity"),
        ({}, X_OK, Y_OK[:-1], "inconsistent numbers of samples"),
        ({}, X_OK[:, 0], Y_OK, "2D array"),
        ({"epsilon": 0.0}, X_OK, Y_OK, "epsilon must be in"),
        ({"epsilon": -1.0}, X_OK, Y_OK, "epsilon must be in"),
        ({"delta": 1.0}, X_OK, Y_OK, "delta must be in"),
        ({"delta": -0.1}, X_OK, Y_OK, "delta must be in"),
        ({"delta": 0.0}, X_OK, Y_OK, "Gaussian noise"),
        ({"x_bound": 0.0}, X_OK, Y_OK, "x_bound"),
        ({"y_bound": -1.0}, X_OK, Y_OK, "y_bound"),
    ],
)
def test_bad_input_raises_value_error(cls, params, X, y, match):
    est = cls(**params)  # __init__ never validates
    with pytest.raises(ValueError, match=match):
        est.fit(X, y)


@pytest.mark.parametrize(
    "cls,params,match",
    [
        (SSPRegressor, {"budget_split": (1.0, 2.0, 3.0)}, "budget_split"),
        (SSPRegressor, {"budget_split": (1.0, -2.0)}, "budget_split"),
        (SSPRegressor, {"budget_split": 3.0}, "budget_split"),
        (AdaSSPRegressor, {"budget_split": (1.0, 2.0)}, "budget_split"),
        (AdaSSPRegressor, {"budget_split": (1.0, float("nan"), 1.0)}, "budget_split"),
        (SSPRegressor, {"matrix_noise": "wishart"}, "matrix_noise"),
        (AdaSSPRegressor, {"matrix_noise": None}, "matrix_noise"),
        (AdaSSPRegressor, {"regularization": "lasso"}, "regularization"),
        (SSPRegressor, {"project_psd": "yes"}, "project_psd"),
    ],
)
def test_bad_variant_parameters(cls, params, match):
    with pytest.raises(ValueError, match=match):
        cls(**params).fit(X_OK, Y_OK)


def test_budget_split_is_accounted(seed_data):
    X, y, *_ = seed_data
    for cls, split in ((SSPRegressor, (1.0, 4.0)), (AdaSSPRegressor, (1.0, 1.0, 1.0))):
        m = cls(epsilon=0.5, budget_split=split, random_state=0, **SEED_KW).fit(X, y)
        sig = 1 / math.sqrt(sum(1 / (r * m.noise_scale_) ** 2 for r in split))
        assert m.epsilon_ <= 0.5
        assert gaussian_epsilon(sig, 1e-6) == pytest.approx(0.5, rel=1e-5)
        released = sorted(g.noise_multiplier for g, k in m.mechanism_.parts for _ in range(k))
        assert released == pytest.approx(sorted(r * m.noise_scale_ for r in split))


# --- linear estimators: no clipping counts --------------------------------------------

@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor, NoisyGDRegressor])
def test_linear_models_store_no_clipping_counts(cls):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = rng.normal(scale=3.0, size=200)
    kw = dict(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=2.0, random_state=0)
    if cls is NoisyGDRegressor:
        kw.update(noise_multiplier=None, n_iter=20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = cls(**kw).fit(X, y)
    # the person fitting is told, the model stores no count
    from privlearn.models import DataClippedWarning

    clip = [w for w in caught if issubclass(w.category, DataClippedWarning)]
    assert len(clip) == 1 and "rows" in str(clip[0].message)
    fitted_ints = [k for k, v in vars(m).items() if k.endswith("_")
                   and isinstance(v, int | np.integer) and not isinstance(v, bool)]
    assert set(fitted_ints) <= {"n_features_in_", "n_iter_"}


# --- label interval -------------------------------------------------------------------

def _capture(monkeypatch, name):
    """Record the arguments of the release kernel ``name`` of :mod:`privlearn.models._ssp`,
    where the estimators' release (``ssp_release``) looks it up."""
    seen = {}
    orig = getattr(ssp_mod, name)

    def spy(*args, **kwargs):
        seen["args"] = args
        return orig(*args, **kwargs)

    monkeypatch.setattr(ssp_mod, name, spy)
    return seen


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_label_interval_sensitivity(monkeypatch):
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(300, 2))
    y = 11.0 + X @ [1.0, -1.0] + rng.normal(scale=0.1, size=300)
    seen = _capture(monkeypatch, "ssp_coefficients")
    # with an intercept: centred at the public midpoint 11, Y = half-width 1
    m = SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=(10.0, 12.0),
                     random_state=0).fit(X, y)
    assert seen["args"][5] == 1.0
    assert abs(m.intercept_ - 11.0) < 0.5  # the midpoint is added back
    # without an intercept no shift is possible: Y = max(|lo|, |hi|)
    SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=(10.0, 12.0), fit_intercept=False,
                 random_state=0).fit(X, y)
    assert seen["args"][5] == 12.0
    SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=(-7.0, 3.0), fit_intercept=False,
                 random_state=0).fit(X, np.clip(y, -7, 3))
    assert seen["args"][5] == 7.0
    # a float keeps its meaning [-Y, Y]
    SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=12.0, random_state=0).fit(X, y)
    assert seen["args"][5] == 12.0


def test_label_interval_is_never_optimistic():
    """Naive ground truth: the largest change of X^T (y - c) from adding one record within
    the bounds never exceeds x_bound * Y, for the Y the estimator uses."""
    rng = np.random.default_rng(1)
    for lo, hi, icpt in [(10.0, 12.0, True), (10.0, 12.0, False), (-7.0, 3.0, False),
                         (-7.0, 3.0, True), (0.0, 5.0, False)]:
        est = SSPRegressor(y_bound=(lo, hi), fit_intercept=icpt)
        Y = est._label_sensitivity_bound(lo, hi)
        c = est._label_centre() if icpt else 0.0
        for yv in np.concatenate([[lo, hi], rng.uniform(lo, hi, 50)]):
            # x with ||x|| = 1 (augmented rows are scaled with x_bound_eff likewise)
            assert abs(yv - c) <= Y + 1e-12
        assert Y == (hi - lo) / 2 if icpt else Y == max(abs(lo), abs(hi))


def test_label_interval_clips_to_the_interval_and_fits():
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(2000, 2))
    y = 3.0 + X @ [1.0, -1.0]
    y[:5] = 100.0  # clipped to 4, not to 100
    m = NoisyGDRegressor(epsilon=1e3, x_bound=1.0, y_bound=(2.0, 4.0), noise_multiplier=None,
                         n_iter=3000, learning_rate=1e-3, random_state=0)
    with pytest.warns(UserWarning, match="5 labels"):
        m.fit(X, y)
    pred = m.predict(X[5:])
    assert np.mean((pred - y[5:]) ** 2) < 0.05


@pytest.mark.parametrize("bad", [(5.0, 1.0), (1.0, 1.0), (0.0, np.inf), (1.0,), "a",
                                 -1.0, 0.0, (0.0, 1.0, 2.0), (np.nan, 1.0), (True, 2.0)])
def test_label_interval_validation(bad):
    X, y = np.zeros((5, 2)), np.zeros(5)
    with pytest.raises(ValueError, match=r"y_bound.*got"):
        SSPRegressor(y_bound=bad).fit(X, y)


# --- NoisyGD's default learning rate --------------------------------------------------

def test_noisygd_default_learning_rate_is_accounted(monkeypatch):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 3))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.clip(X @ [1.0, 2.0, 0.5], -1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        m = NoisyGDRegressor(epsilon=1.0, x_bound=1.0, fit_intercept=False,
                             random_state=0).fit(X, y)
    lam = np.linalg.eigvalsh(X.T @ X)[-1]
    assert m.smoothness_ != pytest.approx(lam, rel=1e-9)  # not the exact eigenvalue
    # the smoothness release is part of what is accounted
    (sl, one), (gd, steps) = m.mechanism_.parts
    assert one == 1 and gd == Gaussian(500.0) and steps == m.n_iter_
    assert m.epsilon_ == pytest.approx(m.mechanism_.epsilon(1e-6, "pld"), rel=1e-12)
    assert m.epsilon_ <= 1.0
    # the learning rate depends on the data only through the noisy release:
    # the noise multiplier of the release is a function of (epsilon, delta) alone
    m2 = NoisyGDRegressor(epsilon=1.0, x_bound=1.0, fit_intercept=False,
                          random_state=0).fit(X[:250], y[:250])
    assert m2.mechanism_.parts[0][0] == sl
    for mode, match in [("data", "eigenvalue"), ("public", "number of rows")]:
        with pytest.warns(PrivacyLeakWarning, match=match):
            NoisyGDRegressor(epsilon=1.0, x_bound=1.0, fit_intercept=False, smoothness=mode,
                             random_state=0).fit(X, y)


# The utility acceptance (median training MSE <= 0.655 over 50 fits on California,
# epsilon 2, delta 1e-6, seed preprocessing) with the new default is tested in
# tests/models/test_linear.py: test_noisygd_seed000_* (fast, 50 batched chains) and
# test_noisygd_seed000_public_fits_50 (slow, 50 public fits, random_state 0..49).


@pytest.mark.parametrize("adaptive", [False, True])
def test_ssp_release_refuses_non_finite_coefficients(adaptive):
    from privlearn.models._ssp import ssp_release

    XTX = np.array([[np.nan, 0.0], [0.0, 1.0]])
    with pytest.raises(FloatingPointError, match="MyRegressor: the noisy normal equations"):
        ssp_release(XTX, np.ones(2), 1.0, None, 1.0, 1.0, np.random.default_rng(0),
                    adaptive=adaptive, name="MyRegressor")


# --- NoisyGD's number of iterations and its progress bar --------------------------------

def _small_regression(n=200, d=3):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, d))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return X, np.clip(X @ rng.normal(size=d), -1, 1)


@pytest.mark.parametrize("eps, smoothness", [(1.0, "private"), (5.0, "private"),
                                             (5.0, 1.0)])
def test_noisygd_iteration_count_is_the_documented_closed_form(eps, smoothness):
    """n_iter=None runs T = floor(0.99 (sigma mu)^2) iterations (floor((sigma mu)^2)
    without the private smoothness release), mu the Gaussian-DP parameter of the budget:
    the Gaussian composition closed form (Dong, Roth & Su 2022, Cor. 3.3), from the
    analytic Gaussian mechanism's mu(eps, delta)."""
    from scipy.optimize import brentq

    X, y = _small_regression()
    sigma, delta = 30.0, 1e-6
    mu = brentq(lambda m: gaussian_epsilon(1.0 / m, delta) - eps, 1e-3, 50, xtol=1e-14)
    share = 0.99 if smoothness == "private" else 1.0
    m = NoisyGDRegressor(epsilon=eps, delta=delta, noise_multiplier=sigma,
                         smoothness=smoothness, fit_intercept=False, random_state=0).fit(X, y)
    # up to the rounding up of the smoothness release's multiplier (a few in millions)
    closed = math.floor(share * (sigma * mu) ** 2)
    assert abs(m.n_iter_ - closed) <= 1 + 1e-5 * closed


def test_noisygd_verbose_shows_the_iterations_and_changes_nothing(capfd):
    from sklearn.base import clone

    X, y = _small_regression()
    kw = dict(epsilon=2.0, noise_multiplier=50.0, fit_intercept=False, random_state=3)
    quiet = NoisyGDRegressor(**kw).fit(X, y)
    out, err = capfd.readouterr()
    assert out == err == ""  # verbose=0 (the default) writes nothing
    loud = clone(NoisyGDRegressor(verbose=1, **kw))  # a parameter: cloned
    assert loud.get_params()["verbose"] == 1
    loud.fit(X, y)
    out, err = capfd.readouterr()
    assert out == ""
    assert "NoisyGDRegressor" in err and f"{quiet.n_iter_}/{quiet.n_iter_}" in err
    np.testing.assert_array_equal(loud.coef_, quiet.coef_)
    assert loud.n_iter_ == quiet.n_iter_ and loud.epsilon_ == quiet.epsilon_
    with pytest.raises(ValueError, match="verbose"):
        NoisyGDRegressor(verbose=-1, **kw).fit(X, y)


@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor])
def test_excess_risk_on_california_falls_as_epsilon_grows(seed_data, cls):
    """Utility grows with the budget on the bundled real data: the median excess training
    MSE over the least-squares fit (1,000 independent fits each, through the estimators'
    own fit code) falls by at least 5% at each step of epsilon = 0.1, 0.3, 1, 3, 10
    (measured: at least 10% for AdaSSP and 15% for SSP, with every seed of 0..5), and
    stays above zero (no fit beats least squares on its training data)."""
    X, y, XTX, XTy, mse = seed_data
    best = mse(np.linalg.solve(XTX, XTy))[0]
    excess = np.array([
        np.median(mse(cls(epsilon=eps, random_state=0, **SEED_KW)
                      .sample_coefficients(X, y, 1000)[0])) - best
        for eps in (0.1, 0.3, 1.0, 3.0, 10.0)])
    assert np.all(excess > 0), excess
    assert np.all(excess[1:] < 0.95 * excess[:-1]), excess


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float64, (4, 3), elements=st.floats(-4, 4).filter(lambda v: abs(v) > 1e-3)),
       st.integers(500, 1020), st.sampled_from([1, 2]))
def test_row_clipping_of_extreme_finite_rows_scales_first(rows, k, ord_):
    """Rows near 1e308 (squares overflow): clipped without a warning to the norm bound in
    their own direction, as the same rows scaled by a power of two (exact in floats)
    into the ordinary range are; they used to come back as zeros (an infinite norm)."""
    from privlearn.models.base import clip_rows, row_norms

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        big, n_big = clip_rows(np.ldexp(rows, k), 0.5, ord=ord_)
        norms = row_norms(np.ldexp(rows, k), ord=ord_)
    small, n_small = clip_rows(np.ldexp(rows, 4), 0.5, ord=ord_)
    assert n_big == n_small == 4
    np.testing.assert_allclose(big, small, rtol=1e-12, atol=0)
    plain = np.linalg.norm(rows, ord=ord_, axis=1)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(norms, np.ldexp(plain, k), rtol=1e-12)


@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor, NoisyGDRegressor])
def test_linear_fit_on_extreme_finite_rows_is_quiet_and_as_on_their_directions(cls):
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(40, 3))
    y = X @ [0.3, -0.2, 0.1]
    fits = []
    for k in (1020, 8):  # every row above x_bound=1 either way: the same clipped rows
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            warnings.simplefilter("ignore", UserWarning)
            fits.append(cls(epsilon=1.0, delta=1e-5, x_bound=1.0, y_bound=1.0,
                            random_state=0).fit(np.ldexp(X, k), y).coef_)
    np.testing.assert_allclose(fits[0], fits[1], rtol=1e-9, atol=1e-12)


def test_choose_x_bound_of_extreme_finite_rows_is_quiet():
    """The private norm quantile reads norms computed without overflow: rows near 1e308
    give no RuntimeWarning and the bound of rows that are all above max_bound alike."""
    from privlearn.models.preprocessing import choose_x_bound

    X = np.random.default_rng(0).uniform(0.5, 1.0, size=(50, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = choose_x_bound(np.ldexp(X, 1020), 1.0, 10.0, random_state=0)[0]
    assert got == choose_x_bound(np.ldexp(X, 8), 1.0, 10.0, random_state=0)[0]


def test_noisygd_divergence_from_a_given_smoothness_names_it():
    """A public ``smoothness`` below lambda_max(X^T X) sets too large a learning rate;
    the divergence said "use a smaller learning_rate", a parameter the user had not set.
    It names the smoothness it came from and what to pass; an explicit learning rate is
    still the one named."""
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, (300, 3))
    y = X @ np.array([0.5, -0.2, 0.1])
    assert np.linalg.eigvalsh(X.T @ X)[-1] > 1e-3  # the given smoothness is below it
    with pytest.raises(FloatingPointError, match=r"smoothness=0\.001.*larger public smoothness"):
        NoisyGDRegressor(smoothness=1e-3, noise_multiplier=None, n_iter=200,
                         random_state=0).fit(X, y)
    with pytest.raises(FloatingPointError, match=r"learning_rate=10\); use a smaller"):
        NoisyGDRegressor(learning_rate=10.0, noise_multiplier=None, n_iter=200,
                         random_state=0).fit(X, y)
