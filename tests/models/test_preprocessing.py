"""Private preprocessing: the DP scaler, private bounds, one epsilon per pipeline."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import Normalizer, StandardScaler

from privlearn.accounting import Gaussian, PureDP, compose
from privlearn.datasets import load_california_housing
from privlearn.errors import ConfigurationError, DataClippedWarning, ParameterValueError
from privlearn.models import AdaSSPRegressor
from privlearn.models.preprocessing import (
    PrivatePipeline,
    PrivateStandardScaler,
    choose_x_bound,
    choose_y_bound,
    pipeline_mechanism,
    private_quantile,
)

# Public, data-independent ranges of the raw California housing features (census and
# geography: income in $10k, age in years, rooms/bedrooms/occupants per household,
# block-group population, latitude/longitude of California), generous on purpose.
CALIFORNIA_RANGES = np.array(
    [[0, 20], [0, 100], [0, 200], [0, 50], [0, 50000], [0, 2000], [30, 45], [-130, -110]],
    dtype=float,
)


def test_scaler_estimates_mean_and_scale():
    rng = np.random.default_rng(0)
    X = rng.normal([5.0, -20.0, 0.0], [2.0, 5.0, 0.1], size=(20000, 3))
    sc = PrivateStandardScaler(epsilon=1.0, delta=1e-6, feature_range=(-100, 100),
                               quantile=0.005, random_state=0).fit(X)
    np.testing.assert_allclose(sc.mean_, X.mean(0), atol=0.05 * X.std(0).max())
    np.testing.assert_allclose(sc.scale_, X.std(0), rtol=0.15)
    assert sc.mechanism_ == compose(Gaussian(sc.noise_multiplier_), steps=2)
    assert sc.epsilon_ <= 1.0 and sc.epsilon_ > 0.99  # calibrated tightly, rounded safe
    Z = sc.transform(X)
    assert abs(Z.mean()) < 0.1
    assert sc.planned_mechanism(X) == sc.mechanism_


def test_scaler_is_randomised_and_reproducible():
    X = np.random.default_rng(1).uniform(0, 10, size=(1000, 2))
    a = PrivateStandardScaler(epsilon=0.5, feature_range=(0, 10), random_state=3).fit(X)
    b = PrivateStandardScaler(epsilon=0.5, feature_range=(0, 10), random_state=3).fit(X)
    c = PrivateStandardScaler(epsilon=0.5, feature_range=(0, 10), random_state=4).fit(X)
    assert np.array_equal(a.mean_, b.mean_) and not np.array_equal(a.mean_, c.mean_)


def test_a_pipeline_steps_clipping_warning_points_at_the_caller_of_fit():
    """Inside a pipeline the steps' fits are called by scikit-learn's ``Pipeline``: their
    warnings to the person fitting are attributed to the line that called the pipeline's
    ``fit``, not to a line of scikit-learn or privlearn."""
    rng = np.random.default_rng(0)
    X = rng.uniform(-1.0, 1.0, size=(300, 2))
    X[:5, 0] = 4.0                                     # outside feature_range
    y = rng.uniform(-1.0, 1.0, 300)
    y[:3] = 9.0                                        # outside y_bound
    pipe = PrivatePipeline([
        ("scale", PrivateStandardScaler(epsilon=0.5, delta=1e-7, feature_range=(-1, 1),
                                        random_state=0)),
        ("rows", Normalizer()),
        ("model", AdaSSPRegressor(epsilon=0.5, delta=1e-7, y_bound=1.0, random_state=1)),
    ])
    with pytest.warns(DataClippedWarning) as record:
        pipe.fit(X, y)
    clipped = [r for r in record if issubclass(r.category, DataClippedWarning)]
    assert len(clipped) == 2                           # the scaler's and the model's
    assert all(r.filename == __file__ for r in clipped), [r.filename for r in clipped]


@pytest.mark.parametrize("quantile", [None, 0.01])
def test_scaler_warns_that_values_outside_feature_range_are_clipped(quantile):
    """Values outside the declared public range are clipped (the fit equals that on the
    clipped data, same noise) and the person fitting is told how many, as the linear
    models do; nothing on the fitted scaler holds the count."""
    rng = np.random.default_rng(2)
    X = rng.uniform(-1.0, 1.0, size=(400, 3))
    X[:7, 1] = 5.0   # 7 values above the range, in 7 rows
    X[3:9, 2] = -3.0  # 6 below, 3 of them in rows already counted
    kw = dict(feature_range=(-1, 1), quantile=quantile, random_state=0)
    with pytest.warns(DataClippedWarning) as record:
        sc = PrivateStandardScaler(**kw).fit(X)
    (w,) = [r for r in record if issubclass(r.category, DataClippedWarning)]
    assert "13 values in 9 of 400 rows" in str(w.message), str(w.message)
    assert "features [1, 2]" in str(w.message)
    assert w.filename == __file__  # addressed to the caller of fit
    ref = PrivateStandardScaler(**kw).fit(np.clip(X, -1, 1))
    np.testing.assert_array_equal(sc.mean_, ref.mean_)
    np.testing.assert_array_equal(sc.bounds_, ref.bounds_)
    assert not any(v in (7, 9, 13) for v in vars(sc).values() if isinstance(v, int))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataClippedWarning)  # inside the range: silent
        PrivateStandardScaler(**kw).fit(np.clip(X, -1, 1))


def test_scaler_rejects_bad_parameters():
    X = np.ones((10, 2))
    with pytest.raises(ValueError, match="feature_range is required"):
        PrivateStandardScaler().fit(X)
    with pytest.raises(ValueError, match="feature_range"):
        PrivateStandardScaler(feature_range=(1, 0)).fit(X)
    with pytest.raises(ValueError, match="quantile"):
        PrivateStandardScaler(feature_range=(0, 1), quantile=0.7).fit(X)
    with pytest.raises(ValueError, match="delta"):
        PrivateStandardScaler(feature_range=(0, 1), delta=0.0).fit(X)


def test_a_bad_feature_range_is_refused_naming_what_is_wrong():
    """A feature_range with a row too few (a column forgotten, e.g. one one-hot column of
    an encoding step) names the shape it has beside the one X needs; an inverted or
    infinite row is named by its index, the column of X it bounds."""
    X = np.ones((10, 3))
    cases = [
        ([(0, 1), (0, 1)], ["shape (3, 2)", "an array of shape (2, 2)", "per column of X"]),
        ([(0, 1), (5, 2), (0, 1)], ["row 1 (column 1 of X) is (5, 2)"]),
        ([(0, 1), (0, 1), (0, np.inf)], ["row 2 (column 2 of X) is (0, inf)"]),
        ("wide", ["not an array of numbers"]),
    ]
    for feature_range, said in cases:
        with pytest.raises(ParameterValueError) as info:
            PrivateStandardScaler(feature_range=feature_range).fit(X)
        assert all(s in str(info.value) for s in said), str(info.value)
    sc = PrivateStandardScaler(feature_range=[(0, 1), (0, 2), (-1, 1)], random_state=0).fit(X)
    np.testing.assert_array_equal(sc._ranges(3), [(0, 1), (0, 2), (-1, 1)])


def test_private_quantile_and_bounds():
    rng = np.random.default_rng(0)
    v = rng.exponential(2.0, size=50000)
    qs = [private_quantile(v, 0.9, 1.0, 0.0, 100.0, random_state=s)[0] for s in range(20)]
    assert abs(np.median(qs) - np.quantile(v, 0.9)) < 0.2
    _, m = private_quantile(v, 0.5, 0.3, 0.0, 100.0, random_state=0)
    assert m == PureDP(0.3)
    X = rng.normal(size=(5000, 4))
    xb, mx = choose_x_bound(X, 1.0, max_bound=20.0, quantile=0.95, random_state=0)
    assert abs(xb - np.quantile(np.linalg.norm(X, axis=1), 0.95)) < 0.2 and mx == PureDP(1.0)
    yb, _ = choose_y_bound(rng.normal(0, 3, 5000), 1.0, max_bound=100.0, random_state=0)
    assert 4.0 < yb < 7.0
    with pytest.raises(ValueError, match="q must be"):
        private_quantile(v, 1.5, 1.0, 0.0, 1.0)


def test_private_quantile_refuses_several_values_per_record():
    """One record is one row: a 2-D ``values`` (or ``y``) of k > 1 columns was flattened,
    so removing one row moved k entries, the count utility changed by k and the release
    was k epsilon-DP while PureDP(epsilon) was reported. The exact output law of the
    flattened mechanism on two neighbours shows it; a column (n, 1) is one value per
    record and still accepted."""
    from privlearn.errors import ParameterTypeError

    def law(values, eps, grid):  # the exponential mechanism's output law, by hand
        u = -np.abs((values[:, None] <= grid).sum(0) - 0.5 * values.size)
        p = np.exp(0.5 * eps * (u - u.max()))
        return p / p.sum()

    grid = np.linspace(0.0, 1.0, 1024)
    rows = np.tile(np.r_[np.zeros(4), np.ones(5)][:, None], (1, 3))  # 9 rows of 3
    ratio = law(rows.ravel(), 1.0, grid) / law(rows[1:].ravel(), 1.0, grid)
    assert np.abs(np.log(ratio)).max() > 1.4  # the flattened release is not 1.0-DP
    for call in (lambda v: private_quantile(v, 0.5, 1.0, 0.0, 1.0),
                 lambda v: choose_y_bound(v, 1.0, 1.0)):
        with pytest.raises(ParameterValueError, match=r"one value per record.*\(9, 3\)"):
            call(rows)
    col = rows[:, :1]
    assert (private_quantile(col, 0.5, 1.0, 0.0, 1.0, random_state=3)[0]
            == private_quantile(col.ravel(), 0.5, 1.0, 0.0, 1.0, random_state=3)[0])
    with pytest.raises(ParameterTypeError, match="once per quantile"):
        private_quantile(col, [0.25, 0.75], 1.0, 0.0, 1.0)


@pytest.mark.parametrize("call, name", [
    (lambda v: private_quantile(v, 0.5, 1.0, 0.0, 1.0), "values"),
    (lambda v: choose_x_bound(v.reshape(-1, 2), 1.0, 2.0), "X"),
    (lambda v: choose_y_bound(v, 1.0, 2.0), "y"),
])
def test_private_bounds_refuse_non_finite_or_text_input_as_the_estimators_do(call, name):
    """The bound choosers read private data as the estimators do: a NaN or an infinity
    is a NonFiniteInputError naming the input with what to do (it was a bare
    ParameterValueError without advice), text a ParameterTypeError (it was NumPy's
    conversion error), a sparse matrix a ParameterTypeError."""
    import scipy.sparse as sp

    from privlearn.errors import NonFiniteInputError, ParameterTypeError

    v = np.linspace(0.0, 1.0, 8)
    for bad in (np.nan, np.inf):
        with pytest.raises(NonFiniteInputError, match=rf"Input {name} contains (NaN|infinity), .*"
                                                      "public constant"):
            call(np.where(v > 0.5, bad, v))
    with pytest.raises(ParameterTypeError, match=rf"{name} must be numbers"):
        call(np.array(["a"] * 8, dtype=object))
    with pytest.raises(ParameterTypeError, match="sparse"):
        call(sp.csr_matrix(v.reshape(-1, 2)) if name == "X" else sp.csr_matrix(v))


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_pipeline_reports_one_total_epsilon():
    rng = np.random.default_rng(0)
    X = rng.normal(3.0, 2.0, size=(3000, 3))
    y = X @ [1.0, -1.0, 0.5] + rng.normal(size=3000)
    pipe = PrivatePipeline([
        ("scale", PrivateStandardScaler(epsilon=0.3, delta=5e-7, feature_range=(-50, 50),
                                        random_state=0)),
        ("norm", Normalizer()),  # stateless: no cost
        ("ada", AdaSSPRegressor(epsilon=0.7, delta=5e-7, y_bound=10.0, random_state=0)),
    ], delta=1e-6).fit(X, y)
    sc, ada = pipe.named_steps["scale"], pipe.named_steps["ada"]
    assert pipe.mechanism_ == compose([sc.mechanism_, ada.mechanism_])
    assert pipe.epsilon_ == pipe.mechanism_.epsilon(1e-6)
    assert pipe.epsilon_ < sc.epsilon_ + ada.epsilon_  # tight composition, not a sum
    assert pipeline_mechanism(pipe) == pipe.mechanism_
    assert pipe.predict(X).shape == (3000,)


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_pipeline_refuses_a_non_private_step():
    X = np.random.default_rng(0).normal(size=(100, 2))
    y = X[:, 0]
    pipe = PrivatePipeline([("scale", StandardScaler()), ("ada", AdaSSPRegressor())])
    with pytest.raises(ValueError, match="PrivateStandardScaler"):
        pipe.fit(X, y)
    plain = Pipeline([("scale", StandardScaler()), ("ada", AdaSSPRegressor())]).fit(X, y)
    with pytest.raises(ValueError, match="no mechanism_"):
        pipeline_mechanism(plain)
    assert pipeline_mechanism(plain, public_steps=("scale",)) == plain[-1].mechanism_


def test_california_pipeline_at_total_epsilon_1_matches_adassp_with_public_bounds():
    """ACCEPTANCE. Setting: California housing (20,640 rows), training MSE, 20 seeds each.

    Baseline: AdaSSP alone at epsilon = 1, delta = 1e-6 on seed 000's public-bounds
    preprocessing (fixed public scales, rows normalised to x_bound = 1, y in [0, 5], no
    intercept).
    Pipeline: raw features -> PrivateStandardScaler(epsilon 0.25, delta 5e-7, the public
    ranges above, private 5%/95% bounds) -> Normalizer -> AdaSSP(epsilon 0.95,
    delta 5e-7, x_bound 1, y_bound 5, intercept), whose composed total is <= 1 at
    delta = 1e-6. Requirement: median MSE within 0.02 of the baseline's (or better).
    """
    seed = load_california_housing(preprocessing="bounded")
    raw = load_california_housing()
    X, y = raw.data, np.clip(raw.target, 0.0, 5.0)
    base, piped, totals = [], [], []
    for r in range(20):
        m = AdaSSPRegressor(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=5.0,
                            fit_intercept=False, random_state=r).fit(seed.data, seed.target)
        base.append(np.mean((m.predict(seed.data) - seed.target) ** 2))
        pipe = PrivatePipeline([
            ("scale", PrivateStandardScaler(epsilon=0.25, delta=5e-7,
                                            feature_range=CALIFORNIA_RANGES, quantile=0.05,
                                            random_state=1000 + r)),
            ("norm", Normalizer()),
            ("ada", AdaSSPRegressor(epsilon=0.95, delta=5e-7, x_bound=1.0, y_bound=5.0,
                                    fit_intercept=True, random_state=r)),
        ], delta=1e-6).fit(X, y)
        piped.append(np.mean((pipe.predict(X) - y) ** 2))
        totals.append(pipe.epsilon_)
    assert max(totals) <= 1.0
    assert np.median(piped) <= np.median(base) + 0.02, (np.median(piped), np.median(base))


def test_scaler_spends_on_the_ledger_before_reading(tmp_path):
    from privlearn.errors import BudgetExceededError
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=1.0, delta=1e-6)
    X = np.random.default_rng(0).normal(size=(500, 3))
    sc = PrivateStandardScaler(epsilon=0.8, delta=5e-7, feature_range=(-10, 10),
                               ledger=led.budget("d"), random_state=0).fit(X)
    assert led.mechanism("d") == compose([sc.mechanism_])
    with pytest.raises(BudgetExceededError):
        PrivateStandardScaler(epsilon=0.8, delta=5e-7, feature_range=(-10, 10),
                              ledger=led.budget("d")).fit(X)
    assert led.spent("d").entries == 1
    with pytest.raises(TypeError, match="budget handle"):
        PrivateStandardScaler(feature_range=(-10, 10), ledger=led).fit(X)


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
@pytest.mark.parametrize("last, pipe_kw, fit_kw, match", [
    (AdaSSPRegressor(), {"delta": 2.0}, {}, "delta must be in"),
    (AdaSSPRegressor(), {"accountant": "rpd"}, {}, "accountant must be one of"),
    (AdaSSPRegressor(epsilon=-1.0), {}, {}, "epsilon must be in"),
    (AdaSSPRegressor(), {}, {"ada__sample_weight": np.ones(200)}, "sample_weight"),
    (StandardScaler(), {}, {}, "PrivateStandardScaler"),
], ids=["delta", "accountant", "step-parameter", "step-sample_weight", "non-private-step"])
def test_pipeline_refuses_before_its_first_step_releases(last, pipe_kw, fit_kw, match,
                                                          tmp_path):
    """A pipeline the fit would refuse at its end (its delta or accountant, checked when
    the total is composed) or at a later step (a bad parameter, an unaccountable fit
    parameter, a step without a mechanism) is refused before the first step releases:
    the private scaler in front had already spent its ledger budget and stayed fitted."""
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    scaler = PrivateStandardScaler(feature_range=(-5, 5), random_state=0,
                                   ledger=led.budget("d"))
    pipe = PrivatePipeline([("scale", scaler), ("ada", last)], **pipe_kw)
    X = np.random.default_rng(0).normal(size=(200, 2))
    with pytest.raises(ValueError, match=match):
        pipe.fit(X, X[:, 0], **fit_kw)
    assert led.spent("d").epsilon_spent == 0.0 and led.pending("d") == []
    assert not hasattr(scaler, "mean_") and not hasattr(pipe, "mechanism_")


def test_fit_transform_and_fit_predict_are_refused_and_accounted_as_fit():
    """scikit-learn's ``Pipeline.fit_transform`` / ``fit_predict`` fit the steps without
    calling ``fit``: they must refuse a step without a mechanism before any step is
    fitted, and record the same account as ``fit``."""
    from sklearn.cluster import KMeans

    from privlearn.errors import ParameterTypeError

    X = np.random.default_rng(0).normal(size=(200, 3))
    scaler = PrivateStandardScaler(feature_range=(-5, 5), random_state=0)
    leaky = PrivatePipeline([("private", scaler), ("exact", StandardScaler())])
    with pytest.raises(ParameterTypeError, match="'exact'.*no planned mechanism"):
        leaky.fit_transform(X)
    assert not hasattr(scaler, "mechanism_") and not hasattr(leaky[-1], "mean_")
    clusters = PrivatePipeline([("private", PrivateStandardScaler(feature_range=(-5, 5))),
                                ("km", KMeans(2, n_init=1, random_state=0))])
    with pytest.raises(ParameterTypeError, match="'km'"):
        clusters.fit_predict(X)
    assert not hasattr(clusters[-1], "cluster_centers_")

    pipe = PrivatePipeline([("scale", PrivateStandardScaler(feature_range=(-5, 5),
                                                            random_state=0))], delta=1e-6)
    Z = pipe.fit_transform(X)
    assert pipe.mechanism_ == pipe.planned_mechanism(X) == pipe[0].mechanism_
    assert pipe.epsilon_ == pipe.mechanism_.epsilon(1e-6) and pipe.delta_ == 1e-6
    assert np.array_equal(Z, pipe.transform(X))
    public = clusters.set_params(public_steps=("km",))  # it would learn its centres
    with pytest.raises(ConfigurationError, match="'km'.*cluster centres"):
        public.fit_predict(X)
    assert not hasattr(public[-1], "cluster_centers_")


def test_a_failed_pipeline_fit_leaves_no_step_looking_fitted(tmp_path):
    """The pipeline runs every private step's data checks before fitting the first one;
    those checks set what they validate (``n_features_in_``, the classes read off ``y``).
    When the fit then fails (here: the first step's budget is exhausted) no later step
    may be left with attributes of a fit that never ran (``check_is_fitted`` passing,
    ``classes_`` read from the private labels)."""
    from sklearn.exceptions import NotFittedError
    from sklearn.utils.validation import check_is_fitted

    from privlearn.errors import BudgetExceededError
    from privlearn.ledger import Ledger
    from privlearn.models import DPSGDClassifier

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=0.1, delta=1e-5)
    X = np.random.default_rng(0).normal(size=(100, 3))
    y = np.where(X[:, 0] > 0, "pos", "neg")
    clf = DPSGDClassifier(n_iter=5)
    before = dict(vars(clf))
    pipe = PrivatePipeline([
        ("scale", PrivateStandardScaler(feature_range=(-5, 5), ledger=led.budget("d"))),
        ("clf", clf)])
    with pytest.raises(BudgetExceededError):
        pipe.fit(X, y)
    assert vars(clf) == before
    with pytest.raises(NotFittedError):
        check_is_fitted(clf)


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_public_steps_as_a_single_string_is_refused():
    """``public_steps="scaler"`` is not a list of names: ``"scale" in "scaler"`` made the
    exact StandardScaler step 'scale' public by a substring match."""
    from privlearn.errors import ParameterTypeError

    X = np.random.default_rng(0).normal(size=(100, 2))
    y = X[:, 0]
    plain = Pipeline([("scale", StandardScaler()), ("ada", AdaSSPRegressor())]).fit(X, y)
    with pytest.raises(ParameterTypeError, match="public_steps must be a sequence"):
        pipeline_mechanism(plain, public_steps="scaler")
    pipe = PrivatePipeline([("scale", StandardScaler()), ("ada", AdaSSPRegressor())],
                           public_steps="scale")
    with pytest.raises(ParameterTypeError, match="public_steps"):
        pipe.fit(X, y)
    assert pipeline_mechanism(plain, public_steps=["scale"]) == plain[-1].mechanism_


def test_a_pipeline_refit_that_fails_after_a_step_released_is_left_as_it_was():
    """A refit whose second step fails (here it diverges, an error that depends on the
    data and so comes after its release) after the first step released at a new
    epsilon: the pipeline must not report an account that describes releases its steps
    no longer hold, nor hold a mix of the two fits (the new scaler before the model
    fitted on the old one's output, which predict combined). As an estimator's failed
    fit, it is left as it was: the previous fit of every step and its account."""
    from privlearn.models import NoisyGDRegressor

    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(200, 2))
    y = np.clip(X[:, 0], -1, 1)
    pipe = PrivatePipeline([
        ("scale", PrivateStandardScaler(epsilon=0.5, feature_range=(-1, 1))),
        ("model", NoisyGDRegressor(noise_multiplier=None, n_iter=20, x_bound=10.0,
                                   learning_rate=1e-3))]).fit(X, y)
    before = (pipe.predict(X), pipe.mechanism_, pipe.epsilon_, pipe[0].mean_.copy())
    pipe.set_params(scale__epsilon=3.0, model__learning_rate=1e6)
    with pytest.raises(FloatingPointError, match="diverged"):
        pipe.fit(X, y)
    assert pipe.named_steps["scale"].epsilon_ < 0.6  # the previous fit, not the new one
    np.testing.assert_array_equal(pipe[0].mean_, before[3])
    assert (pipe.mechanism_, pipe.epsilon_) == before[1:3]
    assert pipe.mechanism_ == compose([pipe[0].mechanism_, pipe[1].mechanism_])
    np.testing.assert_array_equal(pipe.predict(X), before[0])


def test_a_budget_that_cannot_hold_a_later_step_is_refused_before_the_first_releases(
        tmp_path):
    """Two steps on one budget that holds the first step's release but not both: the
    pipeline used to fit (and charge) the scaler, then fail at the model, leaving a
    spent budget and no model. Refused before any step, nothing recorded; a budget
    that holds both is charged both."""
    from privlearn.errors import BudgetExceededError
    from privlearn.ledger import Ledger

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("small", epsilon=1.2, delta=1e-5)
    led.create_budget("large", epsilon=3.0, delta=1e-5)
    X = np.random.default_rng(0).uniform(-1, 1, size=(200, 2))
    y = X[:, 0]

    def pipe(budget):
        return PrivatePipeline([
            ("scale", PrivateStandardScaler(epsilon=1.0, feature_range=(-1, 1),
                                            ledger=led.budget(budget))),
            ("model", AdaSSPRegressor(epsilon=1.0, x_bound=10.0,
                                      ledger=led.budget(budget)))])

    small = pipe("small")
    with pytest.raises(BudgetExceededError):
        small.fit(X, y)
    assert led.spent("small").entries == 0 and led.pending("small") == []
    assert not hasattr(small.named_steps["scale"], "mechanism_")
    large = pipe("large").fit(X, y)
    assert led.mechanism("large") == compose(
        [large.named_steps["scale"].mechanism_, large.named_steps["model"].mechanism_])


def _centre(Z):
    return Z - Z.mean(axis=0)


def test_a_step_that_mixes_rows_is_refused_before_a_private_step(tmp_path):
    """A step that needs no fitting but transforms each row with the others (centring
    by the batch's column means) hands the private step a data set in which one record
    changed every row: the accounted noise would not cover it. Refused before anything
    is fitted or charged, in fit and in planned_mechanism; row-wise steps still pass."""
    from sklearn.preprocessing import FunctionTransformer

    from privlearn.errors import BatchDependenceError
    from privlearn.ledger import Ledger
    from privlearn.models import SSPRegressor

    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(100, 3))
    y = X @ [1.0, 2.0, 3.0]
    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=5.0, delta=1e-5)
    budget = ledger.budget("d")
    model = SSPRegressor(y_bound=10.0, random_state=0, ledger=budget)
    pipe = PrivatePipeline([("centre", FunctionTransformer(_centre)), ("ssp", model)])
    with pytest.raises(BatchDependenceError, match="'centre'.*row-wise"):
        pipe.fit(X, y)
    with pytest.raises(BatchDependenceError, match="'centre'"):
        pipe.planned_mechanism(X)
    assert not hasattr(model, "coef_") and budget.spent().entries == 0
    # the same step after the private one transforms public predictions only: fine
    PrivatePipeline([("scale", PrivateStandardScaler(feature_range=(-1, 1),
                                                     random_state=0)),
                     ("centre", FunctionTransformer(_centre))]).fit(X)
    for rowwise in (Normalizer(), FunctionTransformer(np.log1p), FunctionTransformer()):
        fitted = PrivatePipeline([("rows", rowwise),
                                  ("ssp", SSPRegressor(y_bound=10.0, random_state=0))]).fit(X, y)
        assert fitted.mechanism_ == fitted[-1].mechanism_


def test_a_public_step_fitted_beforehand_is_not_refitted_on_the_private_data(tmp_path):
    """``public_steps`` named steps "fitted on public data only", but the pipeline's fit
    refitted such a step on the private data it was given: a StandardScaler fitted on
    public rows came back with the private rows' exact means. Passed fitted, it is now
    refused before anything is fitted or charged (in a search too); wrapped in
    FrozenEstimator its public fit is kept and planned; a public step passed unfitted
    (one that learns nothing from the values) is fitted by the pipeline, again at every
    later fit."""
    from sklearn.frozen import FrozenEstimator

    from privlearn.ledger import Ledger
    from privlearn.models import PrivateSearchCV, SSPRegressor

    rng = np.random.default_rng(0)
    X, X_public = rng.normal(3.0, 2.0, size=(200, 3)), rng.normal(0.0, 1.0, size=(100, 3))
    y = np.clip(X @ [0.1, 0.2, 0.3], -3, 3)
    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=10.0, delta=1e-5)
    budget = ledger.budget("d")

    def model(**kw):
        return SSPRegressor(x_bound=30.0, y_bound=3.0, random_state=0, **kw)

    public = StandardScaler().fit(X_public)
    mean = public.mean_.copy()
    pipe = PrivatePipeline([("scale", public), ("ssp", model(ledger=budget))],
                           public_steps=("scale",))
    with pytest.raises(ConfigurationError, match="'scale'.*already fitted.*FrozenEstimator"):
        pipe.fit(X, y)
    search = PrivateSearchCV(PrivatePipeline([("scale", public), ("ssp", model())],
                                             public_steps=("scale",)),
                             {"ssp__epsilon": [1.0]}, loss_bound=9.0, ledger=budget)
    with pytest.raises(ConfigurationError, match="'scale'.*already fitted"):
        search.fit(X, y)
    assert np.array_equal(public.mean_, mean) and budget.spent().entries == 0
    assert not hasattr(pipe[-1], "coef_")

    frozen = PrivatePipeline([("scale", FrozenEstimator(public)), ("ssp", model())],
                             public_steps=("scale",))
    assert frozen.fit(X, y).mechanism_ == frozen.planned_mechanism(X) == frozen[-1].mechanism_
    assert np.array_equal(public.mean_, mean)
    np.testing.assert_allclose(frozen[-1].predict(public.transform(X)), frozen.predict(X))

    from sklearn.preprocessing import PolynomialFeatures

    fitted_here = PrivatePipeline([("expand", PolynomialFeatures(1, include_bias=False)),
                                   ("ssp", model())], public_steps=("expand",))
    for _ in range(2):  # the pipeline refits the step it fitted itself
        assert fitted_here.fit(X, y)[0].n_output_features_ == 3


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_a_pipeline_its_accountant_cannot_compose_is_refused_before_any_step_spends():
    """A random-stopping PrivateSearchCV step releases an RDP curve, which the default PLD
    accountant cannot compose: the pipeline used to fit the scaler and run the whole
    search, then fail to account them (both spent, no epsilon_). Refused before the first
    step; with accountant='rdp' it fits and reports the composition of what ran."""
    from privlearn.errors import UnsupportedMechanismError
    from privlearn.models import PrivateSearchCV, SSPRegressor

    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(300, 3))
    y = X @ [0.5, -0.2, 0.1]

    def pipe(**kw):
        return PrivatePipeline([
            ("scale", PrivateStandardScaler(feature_range=(-1, 1), random_state=0)),
            ("search", PrivateSearchCV(SSPRegressor(), {"epsilon": [0.5, 1.0]},
                                       loss_bound=4.0, random_state=0))], **kw)

    p = pipe()
    with pytest.raises(UnsupportedMechanismError, match="accountant='rdp'"):
        p.fit(X, y)
    scale, search = (step for _, step in p.steps)
    assert not hasattr(scale, "mechanism_") and not hasattr(search, "best_estimator_")
    assert not hasattr(p, "epsilon_")
    p = pipe(accountant="rdp").fit(X, y)
    scale, search = (step for _, step in p.steps)
    expected = compose([scale.mechanism_, search.mechanism_]).epsilon(p.delta_, "rdp")
    assert p.epsilon_ == pytest.approx(expected, rel=1e-12)


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_private_steps_sharing_an_integer_seed_are_reported():
    """Two private steps with one integer random_state draw the same normals: here two
    scalers release their noisy row counts with the very same noise (equal
    n_samples_seen_, which independent noise gives with probability 0), so a combination
    of their releases cancels it, outside what mechanism_ composes. The pipeline warns
    (nested pipelines' steps included); distinct seeds, None, and a search's runs (fitted
    from hidden child streams) do not."""
    from privlearn.errors import PrivacyLeakWarning
    from privlearn.models import PrivateSearchCV

    X = np.random.default_rng(0).uniform(-1, 1, size=(500, 2))

    def scaler(seed):
        return PrivateStandardScaler(feature_range=(-1, 1), quantile=None, random_state=seed)

    shared = PrivatePipeline([("a", scaler(7)), ("b", scaler(7))])
    with pytest.warns(PrivacyLeakWarning, match=r"\['a', 'b'\] share random_state=7"):
        shared.fit(X)
    a, b = (s for _, s in shared.steps)
    assert a.n_samples_seen_ == b.n_samples_seen_ != 500
    nested = PrivatePipeline([("a", scaler(3)), ("inner", PrivatePipeline([("b", scaler(3))]))])
    with pytest.warns(PrivacyLeakWarning, match=r"\['a', 'inner__b'\] share"):
        nested.fit(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        own = PrivatePipeline([("a", scaler(7)), ("b", scaler(8))]).fit(X)
        PrivatePipeline([("a", scaler(None)), ("b", scaler(None))]).fit(X)
        y = X @ [0.3, -0.2]
        PrivateSearchCV(PrivatePipeline([("a", scaler(1)), ("m", AdaSSPRegressor(
            random_state=1))]), {"m__epsilon": [1.0]}, loss_bound=4.0).fit(X, y)
    a, b = (s for _, s in own.steps)
    assert a.n_samples_seen_ != b.n_samples_seen_


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_a_frozen_private_step_is_planned_as_it_is_accounted():
    """A PrivateStandardScaler fitted beforehand and kept with FrozenEstimator: the fitted
    pipeline holds its release, so mechanism_ composes it; the plan now does too
    (planned_mechanism equals mechanism_), where it was planned as free. A search over
    such a pipeline checks every run against its plan: it failed with PlanMismatchError
    after the first run had spent; it now runs, each run counting the frozen release
    (never less than what the fitted models hold)."""
    from sklearn.base import clone
    from sklearn.frozen import FrozenEstimator

    from privlearn.models import PrivateSearchCV, SSPRegressor

    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(300, 3))
    y = X @ [0.5, -0.2, 0.1]
    scaler = PrivateStandardScaler(feature_range=(-1, 1), random_state=0).fit(X)
    for kw in ({}, {"public_steps": ("scale",)}):
        pipe = PrivatePipeline([("scale", FrozenEstimator(scaler)),
                                ("ssp", SSPRegressor(random_state=1))], **kw)
        planned = pipe.planned_mechanism(X, y)
        pipe.fit(X, y)
        assert pipe.mechanism_ == planned == compose([scaler.mechanism_,
                                                      pipe.steps[1][1].mechanism_])
    search = PrivateSearchCV(pipe, {"ssp__epsilon": [0.5, 1.0]}, loss_bound=4.0,
                             method="composition", random_state=0).fit(X, y)
    assert search.n_fits_ == 2
    for run, ran in zip(search.runs_, search.fit_mechanisms_, strict=True):
        assert ran == clone(pipe).set_params(**run).planned_mechanism(X, y)
        assert ran.parts[0] == scaler.mechanism_.parts[0]  # the frozen release, counted


def _wrapped_scaler(kind, scaler):
    """``scaler`` inside a container a scikit-learn user reaches for."""
    from sklearn.compose import ColumnTransformer
    from sklearn.frozen import FrozenEstimator
    from sklearn.pipeline import FeatureUnion

    if kind == "ColumnTransformer":
        return ColumnTransformer([("num", scaler, [0, 1])], remainder="passthrough")
    if kind == "FeatureUnion":
        return FeatureUnion([("num", scaler)])
    if kind == "Pipeline":
        return Pipeline([("num", scaler)])
    # a frozen fit of a scikit-learn Pipeline holding a private scaler
    return FrozenEstimator(Pipeline([("num", scaler)]).fit(np.zeros((4, 3))))


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
@pytest.mark.parametrize("kind", ["ColumnTransformer", "FeatureUnion", "Pipeline",
                                  "FrozenEstimator"])
@pytest.mark.parametrize("public", [True, False])
def test_a_private_step_inside_a_container_step_is_refused_not_left_out_of_epsilon(
        kind, public, tmp_path):
    """A PrivateStandardScaler inside a ColumnTransformer (or FeatureUnion, a scikit-learn
    Pipeline, a FrozenEstimator of one) listed in public_steps was fitted on the private
    data, and its release was missing from the pipeline's mechanism_: epsilon_ reported
    the regression's 1.0 for a fit that also spent the scaler's 5.0. It is refused, naming
    the private estimator, before any step releases; pipeline_mechanism refuses it too."""
    from privlearn.errors import ParameterTypeError
    from privlearn.ledger import Ledger
    from privlearn.models import SSPRegressor

    ledger = Ledger(tmp_path / "l.json", create=True)
    ledger.create_budget("d", epsilon=20.0, delta=1e-5)
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(100, 3))
    y = X @ [0.5, -0.2, 0.1]
    scaler = PrivateStandardScaler(epsilon=5.0, feature_range=(-1, 1), random_state=0)
    step = _wrapped_scaler(kind, scaler)
    pipe = PrivatePipeline([("prep", step), ("ssp", SSPRegressor(
        epsilon=1.0, random_state=1, ledger=ledger.budget("d")))],
        public_steps=("prep",) if public else ())
    for call in (pipe.fit, pipe.planned_mechanism):
        with pytest.raises(ParameterTypeError, match=r"'prep'.*PrivateStandardScaler"):
            call(X, y)
    assert ledger.spent("d").epsilon_spent == 0.0
    plain = Pipeline([("prep", step), ("ssp", SSPRegressor(epsilon=1.0))]).fit(X, y)
    with pytest.raises(ParameterTypeError, match="PrivateStandardScaler"):
        pipeline_mechanism(plain, public_steps=("prep",))


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_a_slice_of_a_pipeline_keeps_its_parameters_and_is_accounted():
    """scikit-learn's ``Pipeline.__getitem__`` rebuilt a slice from its steps, memory and
    verbose only: ``pipe[:-1]`` lost delta, public_steps and accountant, and had no
    epsilon_. A slice keeps them; a slice of a fitted pipeline is the account of its
    steps, by the pipeline's accountant at its delta."""
    from privlearn.models import SSPRegressor

    X = np.random.default_rng(0).uniform(-0.5, 0.5, (200, 3))
    y = X @ np.array([0.5, -0.2, 0.1])
    pipe = PrivatePipeline(
        [("scale", PrivateStandardScaler(feature_range=(-1, 1), random_state=1)),
         ("model", SSPRegressor(x_bound=3.0, random_state=2))],
        delta=1e-4, public_steps=("encode",), accountant="rdp")
    head = pipe[:-1]
    assert isinstance(head, PrivatePipeline) and not hasattr(head, "epsilon_")
    assert (head.delta, head.public_steps, head.accountant) == (1e-4, ("encode",), "rdp")
    pipe.fit(X, y)
    head, scaler = pipe[:-1], pipe.named_steps["scale"]
    assert head.mechanism_ == scaler.mechanism_ and head.delta_ == 1e-4
    assert head.epsilon_ == scaler.mechanism_.epsilon(1e-4, "rdp")
    np.testing.assert_array_equal(head.transform(X[:5]), scaler.transform(X[:5]))
    assert pipe[-1] is pipe.named_steps["model"] and pipe["scale"] is scaler
    tail = PrivatePipeline(pipe.steps).fit(X, y)[1:]  # delta=None: the slice's own
    assert tail.delta_ == pipe.named_steps["model"].delta_
    assert tail.mechanism_ == pipe.named_steps["model"].mechanism_


@pytest.mark.parametrize("hi", [1e-160, 1e-170])
def test_a_narrow_public_range_scales_as_the_same_data_in_its_units(hi):
    """var_ = r^2 var_u underflows (r^2 below 1e-308) for a range narrower than about
    1e-154, and scale_ = sqrt(var_) came out imprecise, then 0 (transform divided by
    zero). The ground truth: the same data in units of ``hi`` on the range (0, 1), whose
    scale is ``hi`` times the narrow one's."""
    X = np.random.default_rng(0).uniform(0, 1, size=(200, 2))
    narrow = PrivateStandardScaler(feature_range=(0, hi), quantile=None, random_state=0)
    unit = PrivateStandardScaler(feature_range=(0, 1), quantile=None, random_state=0)
    narrow.fit(X * hi)
    np.testing.assert_allclose(narrow.scale_, unit.fit(X).scale_ * hi, rtol=1e-9)
    assert np.all(np.isfinite(narrow.transform(X * hi)))
