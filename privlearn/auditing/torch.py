"""Canaries and scorers for the PyTorch engine (:func:`privlearn.torch.make_private`).

Imported lazily (``import privlearn.auditing.torch``); ``import privlearn.auditing``
never imports torch.

White-box gradient canaries (:class:`DiracCanaries`)
    Canary ``i`` is a record whose loss is ``G * w_i`` for its own scalar parameter
    ``w_i`` (a row of an ``nn.Embedding`` that no data record touches), so its
    per-example gradient is the Dirac ``G e_i``: norm ``G``, clipped to ``C`` when
    ``G > C``. The canary records are ordinary records of the training set, drawn by the
    same sampler as the data. With plain SGD (no momentum, no weight decay) each step
    moves ``w_i`` by ``-lr / (q N) * (C * [i sampled] + sigma C z)``, so the normalised
    per-step movement ``x_t = -(w_i(t+1) - w_i(t)) q N / (lr C)`` is exactly one draw of
    the subsampled Gaussian mechanism the accountant analyses: ``N(1, sigma^2)`` with
    probability ``q`` (``N(0, sigma^2)`` otherwise) if the canary is in, ``N(0, sigma^2)``
    if it is out. Three scores: ``"final"``, the movement over the whole run (the sum of
    the ``x_t``), ``"trajectory"``, the Neyman-Pearson log-likelihood ratio of the
    per-step movements, ``sum_t log(1 - q + q exp((x_t - 1/2) / sigma^2))`` (the optimal
    test when every intermediate model is released, which is what DP-SGD accounting
    assumes), and ``"increments"``, ``sum_t (x_t - x_{t-1})^2`` (:func:`increment_scores`:
    weak on a correct run, it catches noise that is correlated across steps, e.g. one draw
    reused at every step, which leaves each step's law intact and so fools the likelihood
    ratio: a reused draw looks like a persistent movement of the canary). This is the
    "Dirac canary" of Nasr et al. (2023), "Tight Auditing of
    Differentially Private Machine Learning", in the one-run setting of
    Steinke, Nasr & Jagielski (2023), with one coordinate per canary so that the
    canaries do not interfere.

Black-box input canaries (:func:`loss_scores`)
    Score a set of canary inputs by the trained model's negative loss (Yeom et al. 2018,
    "Privacy Risk in Machine Learning", the loss-threshold attack): works on any model,
    much weaker than white-box canaries.

:func:`audit_dpsgd` runs a complete audit of the real engine (synthetic data plus Dirac
canaries, optionally with a planted bug from :mod:`privlearn.auditing._planted`); it is
what ``privlearn audit dpsgd`` and the privacy regression tests run.

:func:`audit_training` audits *your* model and training in one call: it inserts the
canaries into your dataset (data canaries, scored by the trained model's loss) or into
your model's gradients (Dirac canaries, scored by the movement of their coordinates),
runs your training loop or its pieces once, and returns the lower bound beside the
accountant's epsilon.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from privlearn._progress import check_show_progress, progress
from privlearn._validation import check_count, check_gaussian_delta, check_positive, check_unit_ids
from privlearn.auditing._planted import BUGS, planted_bug
from privlearn.auditing.harness import (
    AuditResult,
    _check_n_canaries,
    _check_seed,
    check_audit_memory,
    check_audit_steps,
    one_run_audit,
)
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = [
    "DiracCanaries",
    "DPSGDAudit",
    "audit_dpsgd",
    "audit_training",
    "final_scores",
    "increment_scores",
    "loss_scores",
    "trajectory_scores",
]


class DiracCanaries(nn.Module):
    """``n_canaries`` white-box gradient canaries, one private coordinate each.

    ``forward(index, is_canary)`` returns the per-example loss term ``G * w[index]``
    for canary rows (``is_canary`` true) and 0 for data rows; add it to the data loss
    (with ``loss_reduction="sum"``, or scaled to match a mean reduction). Use
    ``index = n_canaries`` (the spare row, never updated by a canary) for data records.

    Parameters
    ----------
    n_canaries : int
    gradient_norm : float
        ``G``, the norm of each canary's gradient; make it larger than
        ``max_grad_norm`` so that a missing clipping step shows.
    """

    def __init__(self, n_canaries: int, gradient_norm: float):
        super().__init__()
        if int(n_canaries) < 1:
            raise ParameterValueError(f"n_canaries must be >= 1, got {n_canaries!r}")
        if not (float(gradient_norm) > 0) or math.isinf(float(gradient_norm)):
            raise ParameterValueError(f"gradient_norm must be in (0, inf), got {gradient_norm!r}")
        self.n_canaries = int(n_canaries)
        self.gradient_norm = float(gradient_norm)
        self.weight = nn.Embedding(self.n_canaries + 1, 1)
        nn.init.zeros_(self.weight.weight)

    def forward(self, index: torch.Tensor, is_canary: torch.Tensor) -> torch.Tensor:
        w = self.weight(index).squeeze(-1)
        return self.gradient_norm * w * is_canary.to(w.dtype)

    def coordinates(self) -> np.ndarray:
        """Current values of the canary coordinates (a copy, float64)."""
        return self.weight.weight.detach()[: self.n_canaries, 0].double().cpu().numpy().copy()


def final_scores(start: np.ndarray, end: np.ndarray, *, learning_rate: float,
                 max_grad_norm: float, expected_batch_size: float) -> np.ndarray:
    """Normalised movement of each canary coordinate over the run,
    ``-(end - start) q N / (lr C)`` (the number of clipped canary gradients the model
    absorbed, plus noise)."""
    return -(np.asarray(end) - np.asarray(start)) * expected_batch_size / (
        learning_rate * max_grad_norm)


def trajectory_scores(snapshots: np.ndarray, *, learning_rate: float, max_grad_norm: float,
                      expected_batch_size: float, noise_multiplier: float,
                      sampling_rate: float) -> np.ndarray:
    """Log-likelihood-ratio score of each canary from its per-step movements.

    ``snapshots`` has shape ``(T + 1, m)``: the canary coordinates before training and
    after each of the ``T`` steps. Returns ``sum_t log(1 - q + q exp((x_t - 1/2) /
    sigma^2))`` with ``x_t`` the normalised movements (see the module docstring); for
    ``sigma = 0`` the plain sum of movements.
    """
    s = np.asarray(snapshots, dtype=float)
    if s.ndim != 2 or s.shape[0] < 2:
        raise ParameterValueError(
            f"snapshots must have shape (T + 1, m) with T >= 1, got {s.shape}")
    x = -np.diff(s, axis=0) * expected_batch_size / (learning_rate * max_grad_norm)
    return _step_terms(x, float(noise_multiplier), float(sampling_rate)).sum(axis=0)


def increment_scores(snapshots: np.ndarray, *, learning_rate: float, max_grad_norm: float,
                     expected_batch_size: float) -> np.ndarray:
    """Sum of the squared changes of each canary's normalised per-step movement.

    ``snapshots`` has shape ``(T + 1, m)`` as in :func:`trajectory_scores`; returns
    ``sum_{t >= 2} (x_t - x_{t-1})^2`` (0 when ``T = 1``). A noise draw reused at every
    step cancels in ``x_t - x_{t-1}``, which then is the change of the canary's own
    clipped contribution (0 for an excluded canary): the score that detects such noise.
    Any score gives a valid audit (Steinke, Nasr & Jagielski 2023, Theorem 3.1, holds for
    every attacker); this one is weak when the noise is independent across steps.
    """
    s = np.asarray(snapshots, dtype=float)
    if s.ndim != 2 or s.shape[0] < 2:
        raise ParameterValueError(
            f"snapshots must have shape (T + 1, m) with T >= 1, got {s.shape}")
    x = -np.diff(s, axis=0) * expected_batch_size / (learning_rate * max_grad_norm)
    return (np.diff(x, axis=0) ** 2).sum(axis=0)


def _step_terms(x: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """The per-step terms of :func:`trajectory_scores` for normalised movements ``x``
    (elementwise: one step's row or all steps at once give the same numbers)."""
    if sigma == 0:
        return x
    a = (x - 0.5) / sigma ** 2
    if q >= 1:
        return a
    return np.logaddexp(math.log1p(-q), math.log(q) + a)


class _RunningScores:
    """The scores of :func:`final_scores`, :func:`trajectory_scores` or
    :func:`increment_scores` built as the run goes: ``update`` takes the canary
    coordinates after each step, and only the start, the previous step's coordinates and
    the running sum are kept (``3 x 8 x m`` bytes, plus the previous movement for
    ``"increments"``, rather than ``8 x (T + 1) x m`` for every step's snapshot). The
    sum runs over the steps in order, as NumPy's sum over the steps' axis does for
    ``m >= 2``, so the scores are the same numbers."""

    def __init__(self, start: np.ndarray, how: str, *, learning_rate: float,
                 max_grad_norm: float, expected_batch_size: float, noise_multiplier: float,
                 sampling_rate: float):
        self.how, self.start = how, np.asarray(start, dtype=float)
        self.prev, self.total, self.steps = self.start, np.zeros_like(self.start), 0
        self.last = self.start
        self.scale = (float(expected_batch_size), float(learning_rate) * float(max_grad_norm))
        self.common = dict(learning_rate=learning_rate, max_grad_norm=max_grad_norm,
                           expected_batch_size=expected_batch_size)
        self.sigma, self.q = float(noise_multiplier), float(sampling_rate)

    def update(self, coordinates: np.ndarray) -> None:
        now = np.asarray(coordinates, dtype=float)
        if self.how != "final":
            x = -(now - self.prev) * self.scale[0] / self.scale[1]
            if self.how == "trajectory":
                self.total += _step_terms(x, self.sigma, self.q)
            else:  # increments: the previous step's movement is kept too
                if self.steps:
                    self.total += (x - self.last) ** 2
                self.last = x
        self.prev, self.steps = now, self.steps + 1

    def scores(self) -> np.ndarray:
        if self.how == "final":
            return final_scores(self.start, self.prev, **self.common)
        if self.steps < 1:
            raise ParameterValueError("snapshots must have shape (T + 1, m) with T >= 1, "
                                      f"got ({self.steps + 1}, {self.start.size})")
        return self.total.copy()


def loss_scores(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                loss_fn=None) -> np.ndarray:
    """Black-box membership scores: minus the per-example loss of ``model`` on the
    canary ``(inputs, targets)`` (higher = more likely trained on). ``loss_fn`` must
    return per-example losses (default: cross-entropy with ``reduction="none"``). The
    model is scored in eval mode (no dropout: the same model gives the same scores) and
    left in the mode it was in."""
    loss_fn = loss_fn or nn.CrossEntropyLoss(reduction="none")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            losses = loss_fn(model(inputs), targets)
    finally:
        model.train(was_training)
    if losses.shape[:1] != inputs.shape[:1] or losses.dim() != 1:
        raise ParameterValueError(
            "loss_fn must return one loss per example (reduction='none'), got "
            f"shape {tuple(losses.shape)}")
    return -losses.double().cpu().numpy()


class _CanaryClassifier(nn.Module):
    def __init__(self, n_features: int, n_canaries: int, gradient_norm: float):
        super().__init__()
        self.data = nn.Linear(n_features, 2)
        self.canaries = DiracCanaries(n_canaries, gradient_norm)

    def forward(self, x, index, is_canary):
        return self.data(x), self.canaries(index, is_canary)


def _check_torch_seed(seed) -> int:
    """``seed`` as :func:`privlearn.auditing.harness._check_seed` gives it, refused
    (before any training) when torch cannot take it: its generators take seeds below
    ``2**64``."""
    seed = _check_seed(seed)
    if seed >= 2**64:
        raise ParameterValueError(
            f"seed must be None or an integer in [0, 2**64) for a torch audit (torch's "
            f"generators take 64-bit seeds), got {seed}; pass e.g. seed=0")
    return seed


@functools.lru_cache(maxsize=64)
def _calibrated_sigma(epsilon: float, delta: float, sampling_rate: float, steps: int) -> float:
    """The noise multiplier ``make_private(target_epsilon=...)`` would calibrate (same
    mechanism, PLD accountant, rounded up), cached: audits of the same configuration
    (the planted-bug runs) calibrate once."""
    from privlearn.accounting import Gaussian, calibrate, compose, subsample

    return calibrate(lambda s: compose(subsample(Gaussian(s), rate=sampling_rate,
                                                 scheme="poisson"), steps=steps),
                     epsilon, delta, accountant="pld")


@dataclass(frozen=True, eq=False)
class DPSGDAudit:
    """Result of :func:`audit_dpsgd`: the audit and the training configuration."""

    result: AuditResult
    bug: str
    noise_multiplier: float
    sampling_rate: float
    steps: int
    max_grad_norm: float
    gradient_norm: float
    score: str

    def mechanism(self):
        """The mechanism the accountant analysed (for its trade-off curve)."""
        from privlearn.accounting import Gaussian, compose, subsample

        return compose(subsample(Gaussian(self.noise_multiplier), rate=self.sampling_rate),
                       steps=self.steps)

    def to_dict(self) -> dict:
        out = self.result.to_dict()
        out.update(bug=self.bug, noise_multiplier=self.noise_multiplier,
                   sampling_rate=self.sampling_rate, steps=self.steps,
                   max_grad_norm=self.max_grad_norm, canary_gradient_norm=self.gradient_norm,
                   score=self.score)
        return out


def audit_dpsgd(*, epsilon: float, delta: float, n_canaries: int = 1000, bug: str = "none",
                sampling_rate: float = 0.1, steps: int = 50, n_data: int = 1000,
                n_features: int = 10, max_grad_norm: float = 1.0,
                canary_gradient_norm: float | None = None, learning_rate: float = 0.5,
                score: str = "trajectory", method: str = "one_run",
                confidence: float = 0.95, seed: int | None = 0,
                show_progress: bool | None = None) -> DPSGDAudit:
    """Audit the real DP-SGD engine once with ``n_canaries`` Dirac canaries.

    Trains a logistic-regression model on synthetic data (``n_data`` records,
    ``n_features`` features) plus the included canaries through
    :func:`privlearn.torch.make_private` (Poisson sampling at ``sampling_rate``,
    ``steps`` steps, noise calibrated to ``(epsilon, delta)``), optionally with a planted
    ``bug`` (:data:`privlearn.auditing._planted.BUGS`), and audits it with
    :func:`privlearn.auditing.one_run_audit`. The claimed epsilon is what the
    accountant reports for the steps actually taken.

    Parameters
    ----------
    epsilon, delta : the privacy target of the training.
    n_canaries : int >= 2
    bug : str
        ``"none"`` (the engine as it is) or a planted defect.
    sampling_rate : float in (0, 0.1]
        ``q`` (at most 0.1 so that ``rate-x10`` stays a rate).
    steps : int in [1, :data:`~privlearn.auditing.harness.MAX_AUDIT_STEPS`]
        DP-SGD steps (at most 10,000: the work is proportional to the steps).
    canary_gradient_norm : float, optional
        ``G`` (default ``100 * max_grad_norm``).
    score : {"trajectory", "final", "increments"}
        ``"increments"`` (:func:`increment_scores`) for noise reused across steps
        (``bug="noise-reused"``), which the default misses.
    method, confidence : see :func:`privlearn.auditing.one_run_audit` ("one_run" or
        "one_run_fdp").
    seed : int >= 0 or None
        Seeds the data, the inclusion draw, the sampler and the noise (None: one drawn
        from fresh entropy and recorded in ``result.seed``; rerunning with it repeats the
        run).
    show_progress : bool, optional
        A progress bar of the training steps on standard error: None (default) when
        standard error is a terminal, True always, False never. Changes nothing else.
    """
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    if bug not in BUGS:
        raise ParameterValueError(f"bug must be one of {BUGS}, got {bug!r}")
    show_progress = check_show_progress(show_progress)
    n_canaries = _check_n_canaries(n_canaries)
    seed = _check_torch_seed(seed)  # None: drawn here and recorded, so the run can be repeated
    if score not in ("trajectory", "final", "increments"):
        raise ParameterValueError(f"score must be 'trajectory', 'final' or 'increments', got "
                                  f"{score!r}")
    if not 0 < float(sampling_rate) <= 0.1:
        raise ParameterValueError(f"sampling_rate must be in (0, 0.1], got {sampling_rate!r}")
    steps = check_audit_steps("steps", steps)
    if int(n_data) != n_data or n_data < 1:
        raise ParameterValueError(f"n_data must be an integer >= 1, got {n_data!r}")
    # every number the run depends on, checked before anything is calibrated or trained
    epsilon = check_positive("epsilon", epsilon, hint="the target epsilon of the training, "
                             "e.g. 2.0")
    delta = check_gaussian_delta("delta", delta)
    max_grad_norm = check_positive("max_grad_norm", max_grad_norm, hint="e.g. 1.0")
    learning_rate = check_positive("learning_rate", learning_rate, hint="e.g. 0.5")
    n_features = check_count("n_features", n_features, minimum=1, hint="e.g. 10")
    G = (100.0 * max_grad_norm if canary_gradient_norm is None else check_positive(
        "canary_gradient_norm", canary_gradient_norm,
        hint="make it larger than max_grad_norm (default 100 * max_grad_norm)"))
    # the arrays of the run, lower bound: the records and the expected m/2 included
    # canaries (float32 features, labels, indices, flags), then per canary its parameter
    # and gradient (float32), inclusion, score and the running scores' vectors
    check_audit_memory(
        (4 * n_features + 20) * (int(n_data) + n_canaries // 2) + 57 * n_canaries,
        f"an audit of n_canaries={n_canaries:,} (--canaries from the shell) with "
        f"n_data={int(n_data):,} and n_features={n_features:,}",
        "use fewer canaries (hundreds to thousands give the audit its power: the guide "
        "'auditing privacy empirically', section 'How many canaries buy how much power')")
    info: dict = {}

    def train_and_score(inclusion: np.ndarray) -> np.ndarray:
        # the model is tiny: one intra-op thread is ~8x faster than several on a busy
        # machine (thread hand-off dominates); restored afterwards
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _train_and_score(inclusion)
        finally:
            torch.set_num_threads(threads)

    def _train_and_score(inclusion: np.ndarray) -> np.ndarray:
        m = inclusion.size
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        X = torch.randn(n_data, n_features, generator=gen)
        w_true = torch.randn(n_features, generator=gen)
        y = ((X @ w_true + 0.5 * torch.randn(n_data, generator=gen)) > 0).long()
        inc = torch.from_numpy(np.flatnonzero(inclusion)).long()
        k = inc.numel()
        Xa = torch.cat([X, torch.zeros(k, n_features)])
        ya = torch.cat([y, torch.zeros(k, dtype=torch.long)])
        idx = torch.cat([torch.full((n_data,), m, dtype=torch.long), inc])
        is_c = torch.cat([torch.zeros(n_data), torch.ones(k)])
        ds = TensorDataset(Xa, ya, idx, is_c)
        n = len(ds)
        batch = max(1, round(float(sampling_rate) * n))
        model = _CanaryClassifier(n_features, m, G)
        opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
        sigma = _calibrated_sigma(float(epsilon), float(delta), batch / n, int(steps))
        p = make_private(model, opt, DataLoader(ds, batch_size=batch),
                         noise_multiplier=sigma, max_grad_norm=max_grad_norm,
                         loss_reduction="sum", seed=seed)
        ce = nn.CrossEntropyLoss(reduction="none")
        run = _RunningScores(model.canaries.coordinates(), score,
                             learning_rate=learning_rate, max_grad_norm=max_grad_norm,
                             expected_batch_size=p.expected_batch_size,
                             noise_multiplier=p.noise_multiplier,
                             sampling_rate=p.sampling_rate)
        taken = 0
        with planted_bug(bug, p), _steps_bar(int(steps), show_progress) as bar:
            while taken < steps:
                for xb, yb, ib, cb in p.data_loader:
                    p.optimizer.zero_grad()
                    logits, canary_term = p.model(xb, ib, cb)
                    loss = (ce(logits, yb) * (1 - cb)).sum() + canary_term.sum()
                    loss.backward()
                    p.optimizer.step()
                    run.update(model.canaries.coordinates())
                    taken += 1
                    bar.update(1)
                    if taken == steps:
                        break
        info.update(noise_multiplier=p.noise_multiplier, sampling_rate=p.sampling_rate,
                    expected_batch_size=p.expected_batch_size,
                    claimed=p.accountant.epsilon(delta))
        return run.scores()

    result = one_run_audit(train_and_score, n_canaries,
                           claimed_epsilon=lambda: info["claimed"], delta=delta, seed=seed,
                           method=method, confidence=confidence)
    return DPSGDAudit(result=result, bug=bug, noise_multiplier=info["noise_multiplier"],
                      sampling_rate=info["sampling_rate"], steps=int(steps),
                      max_grad_norm=float(max_grad_norm), gradient_norm=G, score=score)


def _steps_bar(steps: int | None, show_progress: bool | None):
    """The progress bar of an audit's training steps (standard error)."""
    return progress(total=steps, desc="audit: training", unit="step", enabled=show_progress)


# ----------------------------------------------------------------------------------
# auditing your own model and training
# ----------------------------------------------------------------------------------
_CANARY_KINDS = ("data", "gradient")


def _tensor(a) -> torch.Tensor:
    """``a`` as a tensor; floating NumPy data in torch's default dtype (float32), as
    models' parameters are."""
    if isinstance(a, torch.Tensor):
        return a
    arr = np.asarray(a)
    if np.issubdtype(arr.dtype, np.floating):
        return torch.as_tensor(arr, dtype=torch.get_default_dtype())
    return torch.as_tensor(arr)


def _as_dataset(dataset):
    """A map-style dataset of ``(x, y)`` records: the dataset itself, or a
    ``TensorDataset`` of an ``(X, y)`` pair of tensors or arrays."""
    from torch.utils.data import Dataset, TensorDataset

    if isinstance(dataset, tuple | list) and len(dataset) == 2 and not isinstance(
            dataset, Dataset):
        X, y = (_tensor(a) for a in dataset)
        if X.shape[:1] != y.shape[:1]:
            raise ParameterValueError(
                f"dataset=(X, y) needs as many labels as rows, got {len(X)} rows "
                f"and {len(y)} labels")
        dataset = TensorDataset(X, y)
    try:
        n = len(dataset)
        first = dataset[0]
    except (TypeError, IndexError, KeyError):
        raise ParameterTypeError(
            f"dataset must be a map-style torch Dataset of (input, label) records or an "
            f"(X, y) pair of tensors, got {type(dataset).__name__}") from None
    if n < 1 or not isinstance(first, tuple | list) or len(first) != 2:
        raise ParameterValueError("dataset must hold at least one (input, label) record; each item "
                         f"must be a pair, got {type(first).__name__}")
    return dataset


def _labels(dataset) -> torch.Tensor:
    from torch.utils.data import TensorDataset

    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[1]
    return torch.as_tensor([int(dataset[i][1]) for i in range(len(dataset))])


def _default_data_canaries(dataset, m: int, rng: np.random.Generator):
    """``m`` mislabelled copies of random records: each canary is the input of a record
    drawn at random with its label moved to another class (a record the model would not
    fit unless it saw it)."""
    labels = _labels(dataset)
    if labels.dtype.is_floating_point or labels.dim() != 1:
        raise ParameterValueError(
            "the default data canaries are mislabelled copies of records, which needs "
            "integer class labels; pass canaries=(inputs, targets), your own canary records")
    k = int(labels.max()) + 1
    if k < 2 or int(labels.min()) < 0:
        raise ParameterValueError(
            f"the default data canaries need class labels 0..K-1 with K >= 2, "
            f"got labels in [{int(labels.min())}, {int(labels.max())}]")
    rows = rng.integers(0, len(dataset), size=m)
    inputs = torch.stack([torch.as_tensor(dataset[int(i)][0]) for i in rows])
    shift = torch.from_numpy(rng.integers(1, k, size=m))
    targets = (labels[torch.from_numpy(rows)].long() + shift) % k
    return inputs, targets


def _canary_users(users, n_records: int) -> list[int] | None:
    """``private["users"]`` (the user of each of your records) as user numbers below
    ``n_records``, checked by the rule of ``make_private`` (a missing id or ids of two
    kinds refused); the run then gives each included canary, which follows your records,
    a number of its own from ``n_records`` on."""
    if users is None:
        return None
    ids = check_unit_ids("private['users']", users)
    if len(ids) != n_records:
        raise ParameterValueError(
            f"private['users'] must give the user of each of your {n_records} records "
            f"(the dataset passed to audit_training), got {len(ids)}; the audit adds each "
            "included canary as a user of its own")
    number: dict = {}
    return [number.setdefault(u, len(number)) for u in ids]


class _GradientCanaryRecords(torch.utils.data.Dataset):
    """The user's records followed by the included gradient canaries, as
    ``(x, y, index, is_canary)``: data rows carry the spare index ``m``, canary rows a zero
    input, the first record's label and their own index."""

    def __init__(self, base, included: np.ndarray, m: int):
        self.base, self.included, self.m = base, [int(i) for i in included], m
        x0, y0 = base[0]
        self.zero_x, self.y0 = torch.zeros_like(torch.as_tensor(x0)), torch.as_tensor(y0)

    def __len__(self) -> int:
        return len(self.base) + len(self.included)

    def __getitem__(self, i: int):
        n = len(self.base)
        if i < n:
            x, y = self.base[i]
            return torch.as_tensor(x), torch.as_tensor(y), torch.tensor(self.m), torch.tensor(0.0)
        return self.zero_x, self.y0, torch.tensor(self.included[i - n]), torch.tensor(1.0)


class _WithGradientCanaries(nn.Module):
    """The user's model plus one Dirac canary coordinate per canary."""

    def __init__(self, model: nn.Module, m: int, gradient_norm: float):
        super().__init__()
        self.model = model
        self.canaries = DiracCanaries(m, gradient_norm)

    def forward(self, x, index, is_canary):
        return self.model(x), self.canaries(index, is_canary)


def _plain_sgd_lr(optimizer, parameter) -> float | None:
    """The learning rate of ``parameter`` when ``optimizer`` is plain SGD for it (no
    momentum, weight decay or Nesterov: each step moves it by ``-lr`` times its noisy
    gradient), else None."""
    if type(optimizer) is not torch.optim.SGD:
        return None
    for group in optimizer.param_groups:
        if any(q is parameter for q in group["params"]):
            plain = (group.get("momentum", 0) == 0 and group.get("weight_decay", 0) == 0
                     and not group.get("nesterov", False) and not group.get("maximize", False))
            return float(group["lr"]) if plain else None
    return None


def _per_example(loss_fn, out, target) -> torch.Tensor:
    losses = loss_fn(out, target)
    if losses.dim() != 1 or losses.shape[0] != target.shape[0]:
        raise ParameterValueError("loss_fn must return one loss per example (e.g. "
                         "nn.CrossEntropyLoss(reduction='none')), got shape "
                         f"{tuple(losses.shape)} for a batch of {target.shape[0]}")
    return losses


def audit_training(
    dataset,
    train: Callable[[Any], Any] | None = None,
    *,
    make_model: Callable[[], nn.Module] | None = None,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    batch_size: int | None = None,
    epochs: int = 1,
    private: Mapping[str, Any] | None = None,
    canaries: str | tuple = "data",
    n_canaries: int = 500,
    delta: float = 1e-5,
    claimed_epsilon: float | Callable[[], float] | None = None,
    score: str | Callable | None = None,
    canary_gradient_norm: float | None = None,
    method: str = "one_run",
    confidence: float = 0.95,
    seed: int | None = 0,
    show_progress: bool | None = None,
) -> AuditResult:
    """Audit your own model and training run: canaries in, one training run, the
    empirical lower bound on epsilon beside the accountant's.

    The one-run audit of Steinke, Nasr & Jagielski (2023), Algorithm 1
    (:func:`privlearn.auditing.one_run_audit`): each of ``n_canaries`` canaries is
    included with probability 1/2, your training runs once, each canary is scored and the
    scores give a lower confidence bound on epsilon at ``delta``. A bound above the
    accountant's epsilon proves the run leaks more than it claims; a bound below it
    proves nothing about privacy.

    Two ways to give the training:

    * ``train(dataset) -> model``: your own loop. It receives your records, in their
      order, followed by the included canaries (a map-style dataset of ``(input, label)``
      records; build your ``DataLoader`` and call :func:`~privlearn.torch.make_private` on
      it as usual; a user-level run gives ``users=`` one id per record of this dataset,
      e.g. your users' ids followed by a new id for each canary) and
      returns the trained model, or the :class:`~privlearn.torch.PrivateTraining` of
      ``make_private`` (then the claim is its ``epsilon(delta)``; otherwise pass
      ``claimed_epsilon``). Data canaries only.
    * the pieces: ``make_model()`` (a fresh model), ``make_optimizer(params)`` (default
      SGD at learning rate 0.1), ``loss_fn`` (per-example losses), ``batch_size``,
      ``epochs`` and ``private`` (the keyword arguments of ``make_private``, e.g.
      ``{"target_epsilon": 2.0, "max_grad_norm": 1.0}``; its ``target_delta`` defaults to
      ``delta``). The loop is DP-SGD's: for each batch of ``p.data_loader``, the summed
      loss, ``backward``, ``step``. Data or gradient canaries. With user-level privacy,
      ``private["users"]`` gives the user of each of your records; each included canary
      is added as a user of its own.

    Canaries:

    * ``"data"`` (default): ``n_canaries`` mislabelled copies of random records (the
      input of a record drawn at random, its label moved to another class), or your own
      ``canaries=(inputs, targets)``. Scored by minus the trained model's loss on each
      (:func:`loss_scores`; the loss-threshold attack of Yeom et al. 2018), or by
      ``score(model, inputs, targets) -> scores``. Black-box: works with any model and
      loop, but a weak attack.
    * ``"gradient"``: Dirac canaries (:class:`DiracCanaries`, Nasr et al. 2023): your
      model gets one extra coordinate per canary, and an included canary is a record
      whose gradient is a spike of norm ``canary_gradient_norm`` (default 100 times
      ``max_grad_norm``) in its own coordinate, drawn by the same sampler as your
      records. Scored by how far the coordinate moved along its canary's gradient:
      ``"trajectory"`` (default with plain SGD: the per-step likelihood ratio,
      :func:`trajectory_scores`) or ``"final"`` (the total movement,
      :func:`final_scores`; the default with any other optimizer), or
      ``"increments"`` (plain SGD; :func:`increment_scores`: catches noise reused across
      steps, which the likelihood ratio misses). White-box: the
      strongest test of the engine's clipping, noise and sampling as your configuration
      uses them.

    Parameters
    ----------
    dataset : torch Dataset of (input, label) records, or an (X, y) pair
    train : callable, optional
    make_model, make_optimizer, loss_fn, batch_size, epochs, private : optional
        The pieces (above); give either ``train`` or ``make_model``.
    canaries : {"data", "gradient"} or (inputs, targets)
    n_canaries : int >= 2
        Hundreds to thousands for a useful bound (a warning says when no outcome could
        refute the claim); the number of rows of explicit canaries.
    delta : float in (0, 1)
    claimed_epsilon : float or callable, optional
        The claim at ``delta``; default: the accountant's epsilon of the run (the pieces,
        or a ``PrivateTraining`` returned by ``train``).
    score : str or callable, optional
    canary_gradient_norm : float, optional
    method, confidence : see :func:`privlearn.auditing.one_run_audit`
    seed : int >= 0 or None
        Seeds the canaries, the inclusion draw, the model's initialisation and (unless
        ``private`` has one) ``make_private``'s sampler and noise; None draws one,
        recorded in the result.
    show_progress : bool, optional
        With the pieces, a progress bar of the training steps on standard error (your
        own ``train`` shows its own): None (default) when standard error is a terminal,
        True always, False never. Changes nothing else.

    Returns
    -------
    AuditResult
        ``epsilon_lower_bound`` beside ``claimed_epsilon``, ``violation``, the scores.

    References
    ----------
    Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run",
    NeurIPS, Algorithm 1 and Theorem 3.1; Nasr et al. (2023), "Tight Auditing of
    Differentially Private Machine Learning", USENIX Security (Dirac canaries); Yeom et
    al. (2018), "Privacy Risk in Machine Learning", CSF (loss threshold).
    """
    from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

    show_progress = check_show_progress(show_progress)
    if (train is None) == (make_model is None):
        raise ConfigurationError("give your training either as train(dataset) -> model (your loop) "
                         "or as its pieces, make_model=... (with make_optimizer, loss_fn, "
                         "batch_size, epochs, private), not both or neither")
    if train is not None and not callable(train):
        raise ParameterTypeError(f"train must be callable, got {type(train).__name__}")
    explicit = isinstance(canaries, tuple | list)
    if not explicit and canaries not in _CANARY_KINDS:
        raise ParameterValueError(
            f"canaries must be one of {_CANARY_KINDS} or an (inputs, targets) "
            f"pair, got {canaries!r}")
    gradient = canaries == "gradient"
    if gradient and train is not None:
        raise ConfigurationError(
            "gradient canaries need a coordinate in your model and a term in your loss, so "
            "they run with the pieces of your training: pass make_model=..., "
            "make_optimizer=..., loss_fn=..., batch_size=..., epochs=..., private={...} "
            "instead of train, or use canaries='data' with your own loop")
    if gradient and score is not None and score not in ("trajectory", "final", "increments"):
        raise ConfigurationError(
            f"score must be 'trajectory', 'final' or 'increments' for gradient canaries, "
            f"got {score!r}")
    if not gradient and score is not None and not callable(score):
        raise ParameterTypeError("score must be callable for data canaries: score(model, inputs, "
                        f"targets) -> one score per canary, got {score!r}")
    base = _as_dataset(dataset)
    seed = _check_torch_seed(seed)
    rng = np.random.default_rng(seed + 1)  # canaries: a stream apart from the inclusion draw
    if explicit:
        if len(canaries) != 2:
            raise ParameterValueError("canaries=(inputs, targets) must be a pair")
        c_inputs, c_targets = (_tensor(a) for a in canaries)
        if c_inputs.shape[:1] != c_targets.shape[:1]:
            raise ParameterValueError("canaries=(inputs, targets) need one target per input")
        n_canaries = int(c_inputs.shape[0])
    n_canaries = _check_n_canaries(n_canaries)
    if not explicit and not gradient:
        c_inputs, c_targets = _default_data_canaries(base, n_canaries, rng)
    loss_fn = loss_fn or nn.CrossEntropyLoss(reduction="none")
    opts = dict(private or {})
    if make_model is not None:
        if batch_size is None or int(batch_size) != batch_size or batch_size < 1:
            raise ParameterValueError(f"batch_size must be an integer >= 1 with make_model, got "
                             f"{batch_size!r}")
        if int(epochs) != epochs or epochs < 1:
            raise ParameterValueError(f"epochs must be an integer >= 1, got {epochs!r}")
        for key in ("loss_reduction", "epochs", "steps"):
            if key in opts:
                raise ConfigurationError(f"private must not set {key!r}: the audit's loop sums the "
                                 "per-example losses and runs epochs=epochs")
        users = _canary_users(opts.get("users"), len(base))
        # the pieces run DP-SGD (Gaussian noise): no claim at delta = 0
        delta = check_gaussian_delta("delta", delta)
        opts.setdefault("target_delta", delta)
        opts.setdefault("seed", seed)
    make_optimizer = make_optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    C = opts.get("max_grad_norm", 1.0)
    if gradient and isinstance(C, int | float):
        C = check_positive("private['max_grad_norm']", C, hint="e.g. 1.0")
    G = (100.0 * float(C) if isinstance(C, int | float) else 100.0) if (
        canary_gradient_norm is None) else check_positive(
        "canary_gradient_norm", canary_gradient_norm,
        hint="make it larger than max_grad_norm (default 100 * max_grad_norm)")
    claim: dict = {}

    def run_pieces(inclusion: np.ndarray) -> np.ndarray:
        from privlearn.torch import make_private

        included = np.flatnonzero(inclusion)
        torch.manual_seed(seed)
        inner = make_model()
        if gradient:
            model = _WithGradientCanaries(inner, n_canaries, G)
            records = _GradientCanaryRecords(base, included, n_canaries)
        else:
            model = inner
            sel = torch.from_numpy(included)
            records = ConcatDataset([base, TensorDataset(c_inputs[sel], c_targets[sel])])
        optimizer = make_optimizer(model.parameters())
        if users is not None:  # each included canary: a user of its own, after the records'
            opts["users"] = users + list(range(len(base), len(base) + len(included)))
        p = make_private(model, optimizer, DataLoader(records, batch_size=int(batch_size)),
                         epochs=int(epochs), loss_reduction="sum", **opts)
        run = None
        if gradient:
            lr = _plain_sgd_lr(optimizer, model.canaries.weight.weight)
            how = score or ("trajectory" if lr is not None else "final")
            if how != "final" and lr is None:
                raise ConfigurationError(
                    f"score={how!r} reads the per-step movements of plain SGD steps "
                    "(no momentum or weight decay); use score='final' with this "
                    "optimizer")
            run = _RunningScores(
                model.canaries.coordinates(), how, learning_rate=lr or 1.0,
                max_grad_norm=float(C) if isinstance(C, int | float) else 1.0,
                expected_batch_size=p.expected_batch_size,
                noise_multiplier=p.noise_multiplier, sampling_rate=p.sampling_rate)
        with _steps_bar(p.plan.planned_steps, show_progress) as bar:
            for _ in range(int(epochs)):
                for batch in p.data_loader:
                    p.optimizer.zero_grad()
                    if gradient:
                        xb, yb, ib, cb = batch
                        out, canary_term = p.model(xb, ib, cb)
                        loss = ((_per_example(loss_fn, out, yb) * (1 - cb)).sum()
                                + canary_term.sum())
                    else:
                        xb, yb = batch
                        loss = _per_example(loss_fn, p.model(xb), yb).sum()
                    loss.backward()
                    p.optimizer.step()
                    bar.update(1)
                    if gradient:
                        run.update(model.canaries.coordinates())
        claim["epsilon"] = p.epsilon(delta)
        if not gradient:
            return _data_scores(inner)
        return run.scores()

    def _data_scores(model: nn.Module):
        if score is not None:  # one_run_audit converts (a tensor too, with grad)
            return score(model, c_inputs, c_targets)
        return loss_scores(model, c_inputs, c_targets, loss_fn)

    def run_loop(inclusion: np.ndarray) -> np.ndarray:
        sel = torch.from_numpy(np.flatnonzero(inclusion))
        torch.manual_seed(seed)
        out = train(ConcatDataset([base, TensorDataset(c_inputs[sel], c_targets[sel])]))
        model = out
        if not isinstance(out, nn.Module):
            model = getattr(out, "model", None)
            if not isinstance(model, nn.Module):
                raise ParameterTypeError("train must return the trained nn.Module or the "
                                f"PrivateTraining of make_private, got {type(out).__name__}")
            if callable(getattr(out, "epsilon", None)):
                claim["epsilon"] = out.epsilon(delta)
        return _data_scores(model)

    def claimed() -> float:
        if claimed_epsilon is not None:
            return claimed_epsilon() if callable(claimed_epsilon) else claimed_epsilon
        if "epsilon" not in claim:
            raise ParameterValueError(
                "no claim to test: train returned a model, not the PrivateTraining of "
                "make_private; return p (the object make_private returned) or pass "
                "claimed_epsilon=...")
        return claim["epsilon"]

    fixed = claimed_epsilon is not None and not callable(claimed_epsilon)
    return one_run_audit(run_pieces if make_model is not None else run_loop, n_canaries,
                         claimed_epsilon=claimed_epsilon if fixed else claimed, delta=delta,
                         seed=seed, method=method, confidence=confidence)
