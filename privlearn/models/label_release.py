"""Private label release in the knowledge-transfer model (the accounting tutorial, sections 3-5).

A private labelled data set is used to label public, unlabelled queries.

* **PATE** (Papernot et al. 2017, 2018): ``k`` teachers trained on disjoint parts of
  the private data vote on each query; the vote histogram (hard votes) or the sum of the
  teachers' probability vectors (soft votes) is released with noise and the label is its
  argmax. Adding/removing one private record changes one teacher, hence the histogram by
  at most ``sqrt(2)`` in L2 and ``2`` in L1. Releasing ``m`` queries is the composition of
  ``m`` Gaussian mechanisms with noise std ``sigma sqrt(2)`` (the accounting tutorial: ``N(0, 2
  sigma^2 I_C)``), or of ``m`` Laplace mechanisms with scale ``2 b``.
* **Private kNN** (Zhu, Yu & Wang 2020): for each query, a Poisson subsample of the
  private set (rate ``q``) is drawn, the ``k`` nearest sampled neighbours vote, and the
  histogram is released as above. One record changes at most one neighbour, so the
  sensitivity is again ``sqrt(2)`` / ``2``, and the release is the composition of ``m``
  Poisson-subsampled Gaussian (or Laplace) mechanisms.

Noise multipliers are calibrated to (epsilon, delta) through
:mod:`privlearn.accounting` and rounded up. The data-dependent analyses of PATE
(smooth sensitivity, confident-GNMax) are not used: the cost reported is data-independent.

**Budget accumulates.** ``epsilon`` is the budget of *one* :meth:`~PATE.release` call.
Every call is composed into the object's account: ``mechanism_`` is the composition of
all releases so far and ``epsilon_`` its certified epsilon (what was spent in total);
``last_mechanism_`` / ``last_epsilon_`` describe the last call alone. A :class:`PATE`
object's account lasts as long as the object; :meth:`PrivateKNN.fit` starts a new one.

**What may be shared** (docs/trust-model.md): the noisy labels and noisy vote vectors,
collected with the accounting in a :class:`~privlearn.models.LabelRelease`
(``public_release()``). The exact vote histogram is never kept.

References
----------
.. [1] N. Papernot et al. (2017), Semi-supervised knowledge transfer for deep learning
       from private training data, ICLR.
.. [2] N. Papernot et al. (2018), Scalable private learning with PATE, ICLR (GNMax).
.. [3] Y. Zhu, X. Yu, M. Chandraker, Y.-X. Wang (2020), Private-kNN: practical
       differential privacy for computer vision, CVPR.
.. [4] the accounting tutorial (autodp tutorial), sections 3-5.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.utils.validation import check_is_fitted

from privlearn import _validation as _v
from privlearn.accounting import Mechanism, compose
from privlearn.errors import (
    NonFiniteInputError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyLeakWarning,
)
from privlearn.models._release import LabelRelease
from privlearn.models._schema_gate import refuse_bad_schema
from privlearn.models._vote_limits import check_vote_size
from privlearn.models.base import (
    PrivateEstimator,
    ReleasePlan,
    check_class_labels,
    data_shape,
    make_rng,
    noisy_sum_mechanism,
    refuse_fit_params,
    require_delta_for_gaussian,
    resolve_noise_multiplier,
    validate_input,
    warn_person_fitting,
)
from privlearn.models.constraints import (
    ACCOUNTANT,
    EPSILON,
    LEDGER,
    NOISE_MULTIPLIER,
    RANDOM_STATE,
    Delta,
    Integer,
    Options,
    PublicClasses,
    Real,
)

__all__ = ["PATE", "PrivateKNN", "LabelRelease", "label_release_mechanism"]

_SQRT2 = math.sqrt(2.0)


def _object_numbers(T: np.ndarray) -> np.ndarray:
    """An object array of numbers (a DataFrame of pandas' nullable ``Int64`` /
    ``Float64`` columns) as floats, its missing values (``None``, ``pandas.NA``) as NaN,
    which the vote checks refuse as missing; any other object array unchanged (refused
    as not numbers)."""
    na = getattr(sys.modules.get("pandas"), "NA", None)
    flat = T.ravel()
    missing = [v is None or (na is not None and v is na) for v in flat]
    if not all(m or isinstance(v, numbers.Real) for m, v in zip(missing, flat, strict=True)):
        return T
    return np.array([np.nan if m else float(v) for m, v in zip(missing, flat, strict=True)],
                    dtype=float).reshape(T.shape)


def _votes_not_numbers(dtype: Any) -> ParameterTypeError:
    """The refusal of teachers' outputs of ``dtype``, which holds no numbers."""
    return ParameterTypeError(
        "teacher_outputs must be numbers: integer class labels 0..n_classes-1 "
        f"(hard votes) or probabilities (soft votes), got an array of dtype "
        f"{dtype}; map label names to their index in the public label list first")


def label_release_mechanism(
    noise: str, noise_multiplier: float, n_queries: int, sampling_rate: float = 1.0
):
    """``n_queries`` compositions of Gaussian(noise_multiplier) or Laplace(noise_multiplier)
    (Poisson-subsampled when ``sampling_rate < 1``). The multiplier is the noise
    std (resp. Laplace scale) divided by the vote histogram's L2 (resp. L1) sensitivity."""
    return noisy_sum_mechanism(noise, noise_multiplier, sampling_rate, n_queries)


@dataclass(frozen=True, kw_only=True)
class LabelReleasePlan(ReleasePlan):
    """One label-release call's plan: the noise, its multiplier, the number of queries,
    the Poisson rate of the private subsample (1 for PATE) and the number of classes."""

    noise: str
    noise_multiplier: float
    n_queries: int
    n_classes: int
    sampling_rate: float = 1.0


class _LabelReleaseBase(PrivateEstimator):
    """The account shared by PATE and Private kNN: each ``release`` call goes through
    :class:`~privlearn.models.PrivateEstimator`'s pipeline and is composed into
    ``mechanism_`` (:meth:`_account`)."""

    _parameter_constraints = {
        "epsilon": EPSILON,
        "delta": Delta(),
        "noise": Options("gaussian", "laplace"),
        "noise_multiplier": NOISE_MULTIPLIER,
        "accountant": ACCOUNTANT,
        "random_state": RANDOM_STATE,
        "ledger": LEDGER,
    }

    def _release_plan(self, params: dict[str, Any], m: int, n_classes: int,
                      q: float = 1.0) -> LabelReleasePlan:
        """Calibrate the noise for ``m`` queries (or check the given multiplier)."""
        noise, eps, delta = params["noise"], params["epsilon"], params["delta"]
        if noise == "gaussian":
            require_delta_for_gaussian(delta, type(self).__name__, laplace=True)
        prev = getattr(self, "_releases", None)
        if prev and prev[-1].delta != delta:
            raise ParameterValueError(
                f"delta changed from {prev[-1].delta} to {delta} between releases of one "
                "account; the total epsilon_ is reported at one delta. Keep delta fixed, or "
                "start a new account (a new PATE object / PrivateKNN.fit)"
            )
        s = resolve_noise_multiplier(
            params["noise_multiplier"], lambda s: label_release_mechanism(noise, s, m, q),
            eps, delta, accountant=params["accountant"], describe=f"for {m} queries")
        return LabelReleasePlan(mechanism=label_release_mechanism(noise, s, m, q),
                                delta=delta, accountant=params["accountant"], noise=noise,
                                noise_multiplier=s, n_queries=m, n_classes=n_classes,
                                sampling_rate=q)

    def _rng(self) -> np.random.Generator:
        return _release_rng(self.random_state, len(getattr(self, "_releases", ())))

    @staticmethod
    def _noisy_votes(votes: np.ndarray, plan: LabelReleasePlan, rng) -> np.ndarray:
        s = plan.noise_multiplier
        if plan.noise == "gaussian":
            return votes + rng.normal(scale=s * _SQRT2, size=votes.shape)
        return votes + rng.laplace(scale=s * 2.0, size=votes.shape)

    def _account(self, plan: ReleasePlan) -> Mechanism:
        """Every release of the account so far, and this one."""
        return compose([*(r.mechanism for r in getattr(self, "_releases", ())),
                        plan.mechanism])

    def _released(self, noisy, labels, classes, plan: LabelReleasePlan) -> dict[str, Any]:
        """The attributes of one release call, composed into the account (set by
        :meth:`_record` only after everything succeeded)."""
        last_eps = float(plan.mechanism.epsilon(plan.delta, plan.accountant))
        part = LabelRelease(labels, noisy, classes, plan.mechanism, last_eps, plan.delta,
                            plan.accountant)
        releases = [*getattr(self, "_releases", []), part]
        return {
            "_releases": releases,
            "noisy_votes_": part.noisy_votes,
            "labels_": part.labels,
            "noise_multiplier_": plan.noise_multiplier,
            "last_mechanism_": plan.mechanism,
            "last_epsilon_": last_eps,
            "n_queries_": sum(r.n_queries for r in releases),
        }

    def _release_call(self, plan: LabelReleasePlan, data, label: str,
                      **context: Any) -> np.ndarray:
        account = self._certify(plan)  # before anything is reserved or read
        fitted = self._run(plan, data, None, label=label, **context)
        self._record(plan, fitted, account)
        return self.labels_.copy()

    def public_release(self) -> LabelRelease:
        """Everything released since the account started, safe to pickle and share.

        The noisy labels and vote vectors of every :meth:`release` call, concatenated, with
        the composition of their mechanisms and its certified epsilon (``epsilon_``).
        Contains no private data and no un-noised value (docs/trust-model.md).
        """
        releases = getattr(self, "_releases", None)
        if not releases:
            raise ParameterValueError(
                f"nothing released yet: call {type(self).__name__}.release first")
        if len(releases) == 1:
            return releases[0]
        return LabelRelease(
            labels=np.concatenate([r.labels for r in releases]),
            noisy_votes=np.concatenate([r.noisy_votes for r in releases]),
            classes=releases[0].classes,
            mechanism=self.mechanism_,
            epsilon=self.epsilon_,
            delta=self.delta_,
            # the accountant that certified epsilon_ (the last call's), not the parameter,
            # which may have been changed since
            accountant=releases[-1].accountant,
        )


class PATE(_LabelReleaseBase):
    """PATE noisy-argmax label release from teachers' votes (the accounting tutorial, section 3).

    Parameters
    ----------
    epsilon : float > 0
        Budget for the whole batch of queries released by one :meth:`release` call.
    delta : float in [0, 1)
        Must be > 0 for Gaussian noise.
    noise : {"gaussian", "laplace"}
    noise_multiplier : float or None
        Gaussian: the std of the noise on each vote count is ``noise_multiplier *
        sqrt(2)``; Laplace: the scale is ``noise_multiplier * 2``. None: calibrated.
    accountant : str
    random_state : None, int, Generator
        The noise's source. None (default): fresh OS entropy, and nothing the object
        carries can regenerate its noise. A seed or generator makes the noise
        reproducible by whoever knows it (it travels with ``get_params()`` and the
        pickle): fix it for experiments only. With an int seed, release call ``k``
        draws from its own stream ``SeedSequence(seed, spawn_key=(k,))``.
    ledger : BudgetHandle, optional
        ``Ledger(path).budget(dataset)`` (:mod:`privlearn.ledger`): every
        :meth:`release` reserves its mechanism on it before the votes are read (over
        budget, ``BudgetExceededError`` is raised and nothing is recorded or released)
        and settles it when done.

    Attributes
    ----------
    labels_, noisy_votes_ : ndarray
        Noisy labels and noisy vote vectors of the last :meth:`release` call.
    noise_multiplier_ : float
        Of the last call.
    mechanism_ : Mechanism
        Composition of every release of this object so far.
    epsilon_ : float
        Certified epsilon of ``mechanism_`` at ``delta_``: the total spent so far.
    last_mechanism_, last_epsilon_ : the last call alone
    delta_ : float
    n_queries_ : int
        Total number of queries released so far.
    n_classes_ : int

    The object holds only noisy outputs and public values (docs/trust-model.md): it and
    its pickle may be shared; :meth:`public_release` returns the same releases as a
    frozen :class:`~privlearn.models.LabelRelease`. The teachers' exact votes are never
    stored.
    """

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        noise: str = "gaussian",
        noise_multiplier: float | None = None,
        accountant: str = "pld",
        random_state=None,
        ledger=None,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.noise = noise
        self.noise_multiplier = noise_multiplier
        self.accountant = accountant
        self.random_state = random_state
        self.ledger = ledger

    @staticmethod
    def vote_histogram(teacher_outputs, n_classes: int | None = None) -> np.ndarray:
        """Aggregate teachers' outputs into per-query vote vectors (n_queries, C).

        ``teacher_outputs`` is either integer labels of shape (n_teachers, n_queries)
        (hard votes: the histogram) or probabilities of shape (n_teachers, n_queries, C)
        (soft votes: their sum; each row must lie in the probability simplex so that one
        teacher moves the sum by at most sqrt(2) in L2 and 2 in L1).
        """
        T = np.asarray(teacher_outputs)
        if T.dtype.kind == "O":
            T = _object_numbers(T)
        if T.dtype.kind not in "biuf":
            raise _votes_not_numbers(T.dtype)
        if T.ndim == 2:
            if not np.issubdtype(T.dtype, np.integer):
                if not np.all(np.isfinite(T)):
                    raise NonFiniteInputError(
                        "PATE: hard teacher votes contain a NaN or an infinity; each vote "
                        "must be a class index 0..n_classes-1. Map a teacher's missing "
                        "vote to a public choice (e.g. drop that teacher for every query), "
                        "never to a label imputed from the data")
                if not np.all(T == np.round(T)):
                    frac = float(T[T != np.round(T)].ravel()[0])
                    raise ParameterValueError(
                        "hard teacher votes must be integer class indices 0..n_classes-1 "
                        f"(shape (n_teachers, n_queries)), got a non-integer vote {frac!r}; "
                        "pass each teacher's predicted class index, or its probability "
                        "vectors as soft votes of shape (n_teachers, n_queries, n_classes)")
                T = T.astype(np.int64)
            if T.size and T.min() < 0:
                raise ParameterValueError(f"class labels must be >= 0, got min {T.min()}")
            C = int(n_classes) if n_classes is not None else int(T.max()) + 1
            if T.size and T.max() >= C:
                raise ParameterValueError(f"label {T.max()} out of range for n_classes={C}")
            votes = np.zeros((T.shape[1], C))
            for row in T:
                np.add.at(votes, (np.arange(T.shape[1]), row), 1.0)
            return votes
        if T.ndim == 3:
            T = T.astype(float)
            if not np.all(np.isfinite(T)):
                raise NonFiniteInputError(
                    "PATE: teacher probabilities contain a NaN or an infinity; each "
                    "teacher's vote must be a probability vector (>= 0, sum 1). Replace a "
                    "failed teacher's output by a public choice (e.g. the uniform vector), "
                    "never by one computed from the data")
            sums = T.sum(axis=2, keepdims=True)
            if np.any(T < 0) or not np.allclose(sums, 1.0, atol=1e-6):
                raise ParameterValueError(
                    "soft teacher votes must be probability vectors (>= 0, sum 1)")
            # rows within the tolerance are rescaled onto the simplex: a row summing to
            # 1 + t would move the sum by sqrt(2) (1 + t), above the accounted sensitivity
            return (T / sums).sum(axis=0)
        raise ParameterValueError(
            "teacher_outputs must have shape (n_teachers, n_queries) or "
            f"(n_teachers, n_queries, n_classes), got shape {T.shape}"
        )

    def release(
        self, teacher_outputs, n_classes: int | None = None, *, n_teachers: int | None = None
    ) -> np.ndarray:
        """Release one noisy label per query; the call is (epsilon, delta)-DP and is
        composed into the object's account (``epsilon_`` is the total so far).

        Parameters
        ----------
        teacher_outputs : array
            The teachers' outputs, **teachers first**: integer labels of shape
            ``(n_teachers, n_queries)`` (hard votes) or probability vectors of shape
            ``(n_teachers, n_queries, n_classes)`` (soft votes). Not a vote histogram.
        n_classes : int >= 2
            Number of classes; required for hard votes (inferring it from the votes would
            release the largest label voted, un-noised). For soft votes it must equal the
            last dimension if given.
        n_teachers : int >= 1, optional
            The number of teachers; the first axis must have this length, so a transposed
            array is refused. When omitted, an array with at least as many rows (teachers)
            as columns (queries) is refused as ambiguous: pass ``n_teachers`` to confirm.

        Returns
        -------
        labels : ndarray of int (n_queries,)
        """
        params = self._validate_params()
        plan = self._plan(params, teacher_outputs, None, n_classes=n_classes,
                          n_teachers=n_teachers)
        return self._release_call(plan, teacher_outputs, "PATE.release")

    _data_name = "teacher_outputs"  # what the refusals of the data call it
    _not_a_step = (
        "it has no predict and no fit: it releases labels from the votes of teachers you "
        "trained yourself, passed to PATE(...).release(teacher_outputs, n_classes=...), "
        "and spends its budget there. Train the teachers (each on its own part of the "
        "private data) outside the pipeline, e.g. each a PrivatePipeline or a scikit-learn "
        "model, then release their votes on the public queries with PATE")

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.three_d_array = True  # soft votes (n_teachers, n_queries, C)
        return tags

    def _plan(self, params: dict[str, Any], X, y, *, n_classes: int | None = None,
              n_teachers: int | None = None) -> LabelReleasePlan:
        """Check the votes' shape (orientation, number of classes) and calibrate."""
        shape = data_shape(X, "teacher_outputs")
        if len(shape) not in (2, 3):
            raise ParameterValueError(
                "teacher_outputs must have shape (n_teachers, n_queries) (hard votes) or "
                f"(n_teachers, n_queries, n_classes) (soft votes), got shape {shape}"
            )
        if n_teachers is not None:
            k = _v.check_count("n_teachers", n_teachers, minimum=1, integral_floats=False)
            if shape[0] != k:
                hint = (
                    f"; it looks transposed (axis 1 has length {k}): pass "
                    "np.swapaxes(teacher_outputs, 0, 1)"
                    if shape[1] == k
                    else ""
                )
                raise ParameterValueError(
                    f"teacher_outputs must have the teachers on axis 0, i.e. shape "
                    f"({k}, n_queries{', n_classes' if len(shape) == 3 else ''}) for "
                    f"n_teachers={k}, got shape {shape}{hint}"
                )
        elif shape[0] >= shape[1] >= 1:  # no query at all is refused below as such
            raise ParameterValueError(
                f"teacher_outputs of shape {shape} is ambiguous: the expected orientation "
                "is (n_teachers, n_queries[, n_classes]) and this array has at least as "
                "many teachers as queries, which usually means it is transposed. Pass "
                "n_teachers=... to confirm the orientation, or transpose it."
            )
        if len(shape) == 2:
            if n_classes is None:
                raise ParameterValueError(
                    "n_classes is required for hard votes: inferring it from the votes "
                    "would release the largest label voted, un-noised; pass "
                    "n_classes=<number of classes>"
                )
            C = _v.check_count("n_classes", n_classes, minimum=2, integral_floats=False)
        else:
            C = shape[2]
            if n_classes is not None and _v.check_count(
                    "n_classes", n_classes, minimum=2, integral_floats=False) != C:
                raise ParameterValueError(
                    f"n_classes={n_classes} does not match the soft votes' last dimension "
                    f"{C} (shape {shape}: (n_teachers, n_queries, n_classes))"
                )
        prev_c = getattr(self, "n_classes_", None)
        if prev_c is not None and prev_c != C:
            raise ParameterValueError(
                f"n_classes={C} differs from {prev_c} used by earlier releases of this "
                "account; use a new PATE object for a different label set"
            )
        kind = getattr(getattr(X, "dtype", None), "kind", "O")
        if kind in "USV":  # text, whatever its values: refused before the reservation
            raise _votes_not_numbers(X.dtype)
        m = shape[1]  # queries (teachers first); the vote histogram has m rows
        if m < 1:
            raise ParameterValueError(
                f"need at least one query: teacher_outputs of shape {shape} has no query "
                "(axis 1, after the teachers on axis 0)")
        check_vote_size(m, C)  # before anything is reserved: a bare MemoryError was after
        return self._release_plan(params, m, C)

    def _check_data(self, X, y, plan: LabelReleasePlan):
        """The vote histogram (validates the teachers' outputs; releases nothing)."""
        return self.vote_histogram(X, plan.n_classes), None

    def _n_records(self, X, y) -> None:
        return None  # the teachers' training sets are not seen here

    def _release(self, X, y, plan: LabelReleasePlan) -> dict[str, Any]:
        """Noisy votes and their argmax; the exact histogram ``X`` is dropped."""
        noisy = self._noisy_votes(X, plan, self._rng())
        C = plan.n_classes
        return {**self._released(noisy, np.argmax(noisy, axis=1), np.arange(C), plan),
                "n_classes_": C}


class PrivateKNN(_LabelReleaseBase):
    """Private kNN label release with Poisson-subsampled neighbours (accounting tutorial, §4).

    :meth:`fit` stores the private labelled set (no privacy spent) and starts a new
    account; :meth:`release` labels a batch of public queries at cost (epsilon, delta)
    per call, composed into the account (``epsilon_`` is the total so far).

    .. warning::
       **The fitted object holds the private training set** (it must, to answer
       queries): its attributes ``_X``, ``_y`` and its pickle contain the raw data.
       Never share, publish or pickle it for others. Share
       :meth:`public_release` instead: a frozen :class:`~privlearn.models.LabelRelease`
       with the noisy labels, the noisy vote vectors and the accounting, safe to pickle
       and share (docs/trust-model.md).

    Parameters
    ----------
    n_neighbors : int
        ``k``.
    sampling_rate : float in (0, 1]
        Poisson rate ``q`` of the private subsample drawn for each query.
    epsilon, delta, noise, noise_multiplier, accountant, random_state, ledger
        As :class:`PATE` (``epsilon`` is the budget of one :meth:`release` call).
    classes : array-like or None
        The public label set (the columns of the vote vectors, in this order). None
        (default): inferred from the private labels with ``np.unique``; this releases
        which labels occur in the private data (through ``classes_`` and the width of
        the vote vectors), so a :class:`~privlearn.errors.PrivacyLeakWarning` is emitted
        (``classes=np.unique(y)`` is the same release without it: take the list from
        the schema).

    Attributes
    ----------
    classes_ : ndarray
    labels_, noisy_votes_, noise_multiplier_, mechanism_, epsilon_, last_mechanism_,
    last_epsilon_, delta_, n_queries_ : as :class:`PATE` (after :meth:`release`)

    The exact vote histogram is never stored.
    """

    _not_a_step = (
        "it spends its budget at each release(X_query) call, not in fit (which stores the "
        "private set), and has no predict for a pipeline or a search to account. Use it on "
        "its own: fit any private preprocessing first (e.g. a PrivatePipeline of "
        "PrivateStandardScaler), then PrivateKNN(...).fit(pre.transform(X_private), "
        "y_private) and .release(pre.transform(X_query)); pick n_neighbors and "
        "sampling_rate from public knowledge or public data")
    _parameter_constraints = {
        **_LabelReleaseBase._parameter_constraints,
        "n_neighbors": Integer(1),
        "sampling_rate": Real(0, 1, low_open=True,
                              hint="the Poisson rate at which training records are sampled"),
        "classes": PublicClasses(),
    }

    def __init__(
        self,
        n_neighbors: int = 50,
        sampling_rate: float = 0.1,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        noise: str = "gaussian",
        noise_multiplier: float | None = None,
        accountant: str = "pld",
        random_state=None,
        classes=None,
        ledger=None,
    ):
        self.n_neighbors = n_neighbors
        self.sampling_rate = sampling_rate
        self.epsilon = epsilon
        self.delta = delta
        self.noise = noise
        self.noise_multiplier = noise_multiplier
        self.accountant = accountant
        self.random_state = random_state
        self.ledger = ledger
        self.classes = classes

    def fit(self, X, y, **fit_params) -> PrivateKNN:
        """Store the private set and start a new account (``epsilon_`` back to none).

        Releases nothing and spends nothing; the fitted object holds the private data
        (never share it; share :meth:`public_release`). ``sample_weight`` is refused
        (:func:`~privlearn.models.base.refuse_fit_params`)."""
        refuse_fit_params(self, fit_params)
        if y is None:
            raise ParameterValueError(
                "PrivateKNN.fit needs the private labels: fit(X_private, y_private)")
        public = self._parameter_constraints["classes"]("classes", self.classes)
        with self._refit():
            X, y = validate_input(self, X, y, dtype=np.float64)
            kind = check_class_labels(type(self).__name__, y)
            if self.classes is None and kind.startswith("continuous"):
                # every distinct target value would become a class: classes_ (and the
                # width of the released votes) would publish the private targets' set
                raise ParameterValueError(
                    "PrivateKNN: Unknown label type: continuous. y holds non-integer "
                    "numbers, and classes=None would make each distinct value a class, "
                    "released in classes_. PrivateKNN releases class labels: map y to "
                    "public classes (e.g. np.digitize(y, bins) with public bins) or pass "
                    "the public label set, classes=[...]")
            classes, y_idx = _encode_classes(public, y, type(self).__name__)
        self.__dict__.pop("_releases", None)  # the new data is a new account
        self.classes_ = classes
        self._X = X
        self._y = y_idx
        with np.errstate(over="ignore"):  # an extreme row: inf, ordered last
            self._sqnorm = np.einsum("ij,ij->i", X, X)
        return self

    def release(self, X_query, batch_size: int = 256) -> np.ndarray:
        """Noisy kNN labels for the queries; the call is (epsilon, delta)-DP and is composed
        into the account (``epsilon_`` is the total since :meth:`fit`)."""
        batch_size = _v.check_count("batch_size", batch_size, minimum=1,
                                    integral_floats=False)
        plan = self._plan(self._validate_params(), X_query, None)
        return self._release_call(plan, X_query, "PrivateKNN.release", batch_size=batch_size)

    def _plan(self, params: dict[str, Any], X, y) -> LabelReleasePlan:
        """Calibrate for the number of queries (the rows of ``X``, public)."""
        check_is_fitted(self, "_X", msg="call fit(X_private, y_private) before release")
        shape = data_shape(X, "X_query")
        if len(shape) != 2 or shape[1] != self.n_features_in_:
            raise ParameterValueError(
                f"X_query must have shape (n_queries, {self.n_features_in_}), got {shape}")
        if shape[0] < 1:
            raise ParameterValueError(
                f"need at least one query: X_query of shape {shape} has no row")
        # the queries are public: a refusal of their values (a NaN, text) says nothing
        # of the private set, so it comes before the reservation, which then records
        # nothing (the release checks them again)
        refuse_bad_schema(self, X)
        validate_input(self, X, reset=False, dtype=np.float64)
        return self._release_plan(params, shape[0], self.classes_.size,
                                  params["sampling_rate"])

    def _check_data(self, X, y, plan: LabelReleasePlan):
        """Validate the (public) queries."""
        return validate_input(self, X, reset=False, dtype=np.float64), None

    def _n_records(self, X, y) -> int:
        return int(self._X.shape[0])

    def _release(self, X, y, plan: LabelReleasePlan, *, batch_size: int = 256
                 ) -> dict[str, Any]:
        """Vote among the ``n_neighbors`` nearest points of a fresh Poisson subsample of
        the private set for each query, then release the votes with noise."""
        rng = self._rng()
        k, q = int(self.n_neighbors), plan.sampling_rate
        m, C, n = X.shape[0], plan.n_classes, self._X.shape[0]
        votes = np.zeros((m, C))
        for start in range(0, m, batch_size):
            Qb = X[start : start + batch_size]
            with np.errstate(over="ignore", invalid="ignore"):
                d2 = self._sqnorm[None, :] - 2.0 * Qb @ self._X.T
            # Poisson subsample per query: excluded points get infinite distance, and so
            # does a point whose distance is not a number (an extreme row overflowing
            # inf - inf): ordered by index among the others at infinity, as _nearest needs
            keep = rng.random((Qb.shape[0], n)) < q
            d2 = np.where(keep & ~np.isnan(d2), d2, np.inf)
            nn = _nearest(d2, min(k, n))
            valid = np.take_along_axis(keep, nn, axis=1)
            labels = self._y[nn]
            for c in range(C):
                votes[start : start + Qb.shape[0], c] = np.sum((labels == c) & valid, axis=1)
        noisy = self._noisy_votes(votes, plan, rng)
        del votes  # the exact histogram never leaves this call
        idx = np.argmax(noisy, axis=1)
        return self._released(noisy, self.classes_[idx], self.classes_, plan)


def _nearest(d2: np.ndarray, k: int) -> np.ndarray:
    """Column indices (rows of ``d2``, shape (b, k)) of the ``k`` smallest entries of each
    row, ties broken by the lower index.

    The tie-break is what the sensitivity needs: adding or removing one private record
    (its column) then changes each query's neighbour set by at most that record in and
    one boundary record out, so the vote histogram moves by at most ``sqrt(2)`` (L2) /
    ``2`` (L1). ``np.argpartition`` picks an arbitrary subset of the records tied at the
    k-th distance (duplicated rows, common in real data), and that subset can change
    wholesale when a column is added: one record then moved the votes of several.
    """
    kth = np.partition(d2, k - 1, axis=1)[:, k - 1 : k]
    below = d2 < kth
    tied = d2 == kth
    # of the ties, the first (k - #below) in index order
    take = below | (tied & (np.cumsum(tied, axis=1) <= k - below.sum(axis=1, keepdims=True)))
    return np.nonzero(take)[1].reshape(d2.shape[0], k)


def _release_rng(random_state, k: int) -> np.random.Generator:
    """The generator of the ``k``-th release of one account. An integer seed gives call
    ``k >= 1`` an independent stream (``SeedSequence(seed, spawn_key=(k,))``): reusing the
    first call's noise would let two releases be subtracted, cancelling the noise."""
    if k == 0 or random_state is None or isinstance(random_state, np.random.Generator
                                                    | np.random.RandomState):
        return make_rng(random_state)  # None: fresh entropy; generators advance by themselves
    return np.random.default_rng(np.random.SeedSequence(int(random_state), spawn_key=(k,)))


def _encode_classes(classes, y: np.ndarray, owner: str) -> tuple[np.ndarray, np.ndarray]:
    """``(classes_, indices of y in classes_)``; inferring the classes from ``y`` releases
    which labels occur, so it warns (:class:`~privlearn.errors.PrivacyLeakWarning`)."""
    if classes is None:
        warn_person_fitting(
            f"{owner}: classes=None infers the label set from the private labels; "
            "classes_ (and the released vote vectors' width) then reveal which labels "
            "occur in the data. Pass the public label set, e.g. classes=[0, 1], from the "
            "schema: classes=np.unique(y) is the same release without this warning.",
            PrivacyLeakWarning,
            stacklevel=4,
        )
        return np.unique(y, return_inverse=True)
    cl = np.asarray(classes)
    if cl.ndim != 1 or cl.size < 2 or np.unique(cl).size != cl.size:
        raise ParameterValueError(
            f"classes must be a 1-D sequence of at least 2 distinct labels, got {classes!r}; "
            "pass the public label set, e.g. classes=[0, 1] or classes=range(10)"
        )
    order = np.argsort(cl, kind="stable")
    sorted_cl = cl[order]
    pos = np.clip(np.searchsorted(sorted_cl, y), 0, cl.size - 1)
    found = sorted_cl[pos] == y
    if not np.all(found):
        bad = np.unique(y[~found])[:5]
        raise ParameterValueError(
            f"y contains labels not in classes={cl.tolist()}: {bad.tolist()}; pass the "
            "complete public label set"
        )
    return cl, order[pos]
