"""Scenarios from users' issue threads on private scikit-learn libraries (diffprivlib,
SmartNoise, OpenDP, Private-kNN, PATE implementations), replayed on privlearn's
estimators. Each test checks a ground truth that does not come from privlearn's own
output: a closed-form sensitivity, a brute-force comparison of neighbouring data sets,
scikit-learn's or NumPy's own result, or equal noise draws that independent noise would
give with probability 0."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.base import clone

from privlearn.errors import PrivacyLeakWarning
from privlearn.models import PrivatePipeline, PrivateStandardScaler, SSPRegressor

# the clipping reports go to the person fitting; not the subject here
pytestmark = pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")

RNG = np.random.default_rng(2026)
X = RNG.uniform(-1.0, 1.0, size=(300, 2))
Y = X @ np.array([0.4, -0.3])


def _scaler(random_state) -> PrivateStandardScaler:
    return PrivateStandardScaler(feature_range=(-1, 1), quantile=None, random_state=random_state)


def _leaves(pipe: PrivatePipeline) -> list:
    out = []
    for _, step in pipe.steps:
        out.extend(_leaves(step) if isinstance(step, PrivatePipeline) else [step])
    return out


@pytest.mark.parametrize(
    "make",
    [
        # one Generator, copied into each step by sklearn.base.clone (cross_val_score,
        # GridSearchCV): the copies start in the original's state
        lambda: clone(
            PrivatePipeline(
                [
                    ("a", _scaler(g := np.random.default_rng(5))),
                    ("inner", PrivatePipeline([("b", _scaler(g))])),
                ]
            )
        ),
        lambda: PrivatePipeline(
            [("a", _scaler(np.random.default_rng(1))), ("b", _scaler(np.random.default_rng(1)))]
        ),
        lambda: PrivatePipeline(
            [("a", _scaler(np.random.RandomState(1))), ("b", _scaler(np.random.RandomState(1)))]
        ),
    ],
    ids=["cloned-generator", "two-generators-one-seed", "two-randomstates-one-seed"],
)
def test_steps_whose_generators_start_alike_are_warned_as_shared_seeds(make):
    """IBM/differential-privacy-library#31 (and #72, #79): "using the same seed to
    instantiate multiple mechanisms may result in correlated noise, which will break
    differential privacy". The pipeline warned when two private steps shared an integer
    seed, but not when they held generators in one state -- what clone() makes of one
    Generator passed to several steps, and what np.random.default_rng(1) passed twice is.
    Both steps then release their noisy row counts with the very same noise (equal
    n_samples_seen_, which independent noise gives with probability 0)."""
    pipe = make()
    with pytest.warns(PrivacyLeakWarning, match="share random_state"):
        pipe.fit(X)
    a, b = _leaves(pipe)
    assert a.n_samples_seen_ == b.n_samples_seen_ != X.shape[0]


def test_one_generator_object_shared_by_the_steps_draws_independent_noise():
    """The same Generator *object* in every step (not copied) is drawn from in turn: the
    noise differs, and nothing is warned."""
    g = np.random.default_rng(5)
    pipe = PrivatePipeline([("a", _scaler(g)), ("m", SSPRegressor(random_state=g))])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        pipe.fit(X, Y)
        twin = PrivatePipeline([("a", _scaler(g)), ("b", _scaler(g))]).fit(X)
    a, b = _leaves(twin)
    assert a.n_samples_seen_ != b.n_samples_seen_


def _moment_sums(scaler: PrivateStandardScaler) -> np.ndarray:
    """The released noisy sums ``(S_1, S_2, N)`` of the scaled values ``u`` in [-1, 1],
    read back from the fitted attributes (``quantile=None``, no clipping of ``m_1, m_2``
    and no variance floor on the data used here)."""
    lo, hi = scaler.bounds_[:, 0], scaler.bounds_[:, 1]
    c, r = (lo + hi) / 2, (hi - lo) / 2
    n = scaler.n_samples_seen_
    m1 = (scaler.mean_ - c) / r
    m2 = scaler.var_ / r**2 + m1**2
    return np.concatenate([m1 * n, m2 * n, [n]])


@pytest.mark.parametrize("frozen", [False, True], ids=["stateless", "frozen"])
@pytest.mark.parametrize(
    "step",
    [
        lambda A: np.vstack([A, 0.9 * A]),  # augmentation: a scaled copy of every record
        lambda A: np.repeat(A, 2, axis=0),  # oversampling: every record twice
        lambda A: A[::2],  # every second row: a record shifts the others' positions
    ],
    ids=["augment", "repeat", "every-second-row"],
)
def test_a_step_that_turns_records_into_several_rows_is_refused(step, frozen):
    """meta-pytorch/opacus#455 and awslabs/fast-differential-privacy#29 (augmentation
    multiplicity: each record must still contribute one row, its augmentations averaged),
    uber-archive/sql-differential-privacy#1 (a transformation that duplicates a record's
    rows multiplies its sensitivity). A FunctionTransformer before a private step passed
    the row-mixing probe when it changed the number of rows ("nothing to compare"), and
    one fitted beforehand (FrozenEstimator) was not probed at all: the scaler's noise,
    calibrated to one row per record, covered half the change or less.

    Brute force: the scaler fitted with one seed on the data and on the data without the
    record at the corner of the range releases sums that differ by exactly what the
    removed rows contributed (the noise is the same). One row per record moves them by
    the accounted sensitivity sqrt(2 d + 1); the augmented pipelines moved them by about
    twice that, and taking every second row by seven times. Such a step is now refused
    before anything is fitted; a filter by a rule on each row alone still passes."""
    from sklearn.frozen import FrozenEstimator
    from sklearn.preprocessing import FunctionTransformer

    from privlearn.errors import BatchDependenceError

    D = RNG.uniform(-0.5, 0.5, size=(400, 2))
    D[0] = 1.0  # u = (1, 1): the largest contribution, sqrt(2 d + 1)
    d = D.shape[1]

    def fit(data, transform):
        steps = [("s", _scaler(7))]
        if transform is not None:
            t = FunctionTransformer(transform)
            steps.insert(0, ("t", FrozenEstimator(t.fit(D[:5])) if frozen else t))
        return PrivatePipeline(steps).fit(data)[-1]

    moved = np.linalg.norm(_moment_sums(fit(D, None)) - _moment_sums(fit(D[1:], None)))
    assert moved == pytest.approx(np.sqrt(2 * d + 1), rel=1e-6)
    with pytest.raises(BatchDependenceError, match="'t'.*one row per record"):
        fit(D, step)
    # a filter by a rule on each row alone keeps at most one row per record
    kept = fit(D, lambda A: A[A[:, 0] > -0.4])
    assert kept.n_samples_seen_ != D.shape[0]


def test_a_frozen_step_that_mixes_rows_is_refused_as_a_stateless_one_is():
    """A FrozenEstimator's transform was applied to one row of zeros for its width and
    never probed: a frozen FunctionTransformer centring by the batch's means (each row
    then depends on every other) reached the private step, as the same step unfrozen is
    refused for doing."""
    from sklearn.frozen import FrozenEstimator
    from sklearn.preprocessing import FunctionTransformer

    from privlearn.errors import BatchDependenceError

    centre = FrozenEstimator(FunctionTransformer(lambda A: A - A.mean(axis=0)).fit(X[:5]))
    pipe = PrivatePipeline([("centre", centre), ("m", SSPRegressor(random_state=0))])
    with pytest.raises(BatchDependenceError, match="'centre'.*row-wise"):
        pipe.fit(X, Y)
    assert not hasattr(pipe[-1], "coef_")
    rowwise = FrozenEstimator(FunctionTransformer(np.tanh).fit(X[:5]))
    fitted = PrivatePipeline([("rows", rowwise), ("m", SSPRegressor(random_state=0))]).fit(X, Y)
    assert fitted.mechanism_ == fitted[-1].mechanism_


def test_removing_the_only_record_of_a_class_changes_no_public_label_set():
    """IBM/differential-privacy-library#106 ("domain inference via the label set":
    classes = np.unique(y) differs between a data set whose only record of a label is
    removed and the data set itself). Brute force on that pair: with the public label set
    given, classes_ and the released vote vectors' width are the same on both (and no
    warning); inferred from y, they differ, and a PrivacyLeakWarning says so."""
    from privlearn.models import DPSGDClassifier, PrivateKNN

    y = (X[:, 0] > 0).astype(int)
    y[0] = 2  # the only record labelled 2
    D, neighbour = (X, y), (X[1:], y[1:])

    def fits(classes):
        out = []
        for Xd, yd in (D, neighbour):
            knn = PrivateKNN(n_neighbors=5, classes=classes, random_state=0).fit(Xd, yd)
            knn.release(X[:4])
            out.append((knn.classes_.tolist(), knn.public_release().noisy_votes.shape))
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        public = fits([0, 1, 2])
        clf = [
            DPSGDClassifier(n_iter=5, classes=[0, 1], random_state=0).fit(Xd, yd == 1).classes_
            for Xd, yd in (D, neighbour)
        ]
    assert public[0] == public[1] == ([0, 1, 2], (4, 3))
    assert clf[0].tolist() == clf[1].tolist() == [0, 1]
    with pytest.warns(PrivacyLeakWarning, match="classes=None infers"):
        inferred = fits(None)
    assert inferred[0] != inferred[1]  # what the label set would have released
