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
    if it is out. Two scores: ``"final"``, the movement over the whole run (the sum of
    the ``x_t``), and ``"trajectory"``, the Neyman-Pearson log-likelihood ratio of the
    per-step movements, ``sum_t log(1 - q + q exp((x_t - 1/2) / sigma^2))`` (the optimal
    test when every intermediate model is released, which is what DP-SGD accounting
    assumes). This is the "Dirac canary" of Nasr et al. (2023), "Tight Auditing of
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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from privlearn.auditing._planted import BUGS, planted_bug
from privlearn.auditing.harness import AuditResult, _check_n_canaries, _check_seed, one_run_audit

__all__ = [
    "DiracCanaries",
    "DPSGDAudit",
    "audit_dpsgd",
    "final_scores",
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
            raise ValueError(f"n_canaries must be >= 1, got {n_canaries!r}")
        if not (float(gradient_norm) > 0) or math.isinf(float(gradient_norm)):
            raise ValueError(f"gradient_norm must be in (0, inf), got {gradient_norm!r}")
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
        raise ValueError(f"snapshots must have shape (T + 1, m) with T >= 1, got {s.shape}")
    x = -np.diff(s, axis=0) * expected_batch_size / (learning_rate * max_grad_norm)
    sigma, q = float(noise_multiplier), float(sampling_rate)
    if sigma == 0:
        return x.sum(axis=0)
    a = (x - 0.5) / sigma ** 2
    if q >= 1:
        return a.sum(axis=0)
    return np.logaddexp(math.log1p(-q), math.log(q) + a).sum(axis=0)


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
        raise ValueError("loss_fn must return one loss per example (reduction='none'), got "
                         f"shape {tuple(losses.shape)}")
    return -losses.double().cpu().numpy()


class _CanaryClassifier(nn.Module):
    def __init__(self, n_features: int, n_canaries: int, gradient_norm: float):
        super().__init__()
        self.data = nn.Linear(n_features, 2)
        self.canaries = DiracCanaries(n_canaries, gradient_norm)

    def forward(self, x, index, is_canary):
        return self.data(x), self.canaries(index, is_canary)


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
                confidence: float = 0.95, seed: int | None = 0) -> DPSGDAudit:
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
    steps : int >= 1
    canary_gradient_norm : float, optional
        ``G`` (default ``100 * max_grad_norm``).
    score : {"trajectory", "final"}
    method, confidence : see :func:`privlearn.auditing.one_run_audit` ("one_run" or
        "one_run_fdp").
    seed : int >= 0 or None
        Seeds the data, the inclusion draw, the sampler and the noise (None: one drawn
        from fresh entropy and recorded in ``result.seed``; rerunning with it repeats the
        run).
    """
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    if bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")
    n_canaries = _check_n_canaries(n_canaries)
    seed = _check_seed(seed)  # None: drawn here and recorded, so the run can be repeated
    if score not in ("trajectory", "final"):
        raise ValueError(f"score must be 'trajectory' or 'final', got {score!r}")
    if not 0 < float(sampling_rate) <= 0.1:
        raise ValueError(f"sampling_rate must be in (0, 0.1], got {sampling_rate!r}")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if int(n_data) != n_data or n_data < 1:
        raise ValueError(f"n_data must be an integer >= 1, got {n_data!r}")
    G = 100.0 * max_grad_norm if canary_gradient_norm is None else float(canary_gradient_norm)
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
        snaps = [model.canaries.coordinates()]
        taken = 0
        with planted_bug(bug, p):
            while taken < steps:
                for xb, yb, ib, cb in p.data_loader:
                    p.optimizer.zero_grad()
                    logits, canary_term = p.model(xb, ib, cb)
                    loss = (ce(logits, yb) * (1 - cb)).sum() + canary_term.sum()
                    loss.backward()
                    p.optimizer.step()
                    snaps.append(model.canaries.coordinates())
                    taken += 1
                    if taken == steps:
                        break
        info.update(noise_multiplier=p.noise_multiplier, sampling_rate=p.sampling_rate,
                    expected_batch_size=p.expected_batch_size,
                    claimed=p.accountant.epsilon(delta))
        common = dict(learning_rate=learning_rate, max_grad_norm=max_grad_norm,
                      expected_batch_size=p.expected_batch_size)
        if score == "final":
            return final_scores(snaps[0], snaps[-1], **common)
        return trajectory_scores(np.stack(snaps), noise_multiplier=p.noise_multiplier,
                                 sampling_rate=p.sampling_rate, **common)

    result = one_run_audit(train_and_score, n_canaries,
                           claimed_epsilon=lambda: info["claimed"], delta=delta, seed=seed,
                           method=method, confidence=confidence)
    return DPSGDAudit(result=result, bug=bug, noise_multiplier=info["noise_multiplier"],
                      sampling_rate=info["sampling_rate"], steps=int(steps),
                      max_grad_norm=float(max_grad_norm), gradient_norm=G, score=score)
