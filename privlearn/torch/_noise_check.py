"""Whether a run's correlated noise is worth its epsilon: :func:`warn_if_dpsgd_better`
compares it with DP-SGD's independent noise of the same expected error, under the same
sampling, batch size and steps, and warns when DP-SGD is accounted at a smaller epsilon.

Like with like: at one noise multiplier a correlated strategy ``C`` adds less noise to
the iterates than DP-SGD (that is its point), so comparing epsilons at one noise
multiplier would always favour DP-SGD. The comparison is at equal error instead: the
largest squared error of the prefix sums of the noise (the iterates of SGD; the
objective the engine's BLT is optimised on) is ``sigma^2 max_t ||(A C^{-1})[t, :]||^2``
for ``C`` and ``sigma'^2 T`` for DP-SGD over ``T`` steps (Choquette-Choo et al. 2023,
"(Amplified) Banded Matrix Factorization", Sec. 2), so DP-SGD at ``sigma' = sigma
sqrt(max_t ||(A C^{-1})[t, :]||^2 / T)`` adds the same error. When DP-SGD at ``sigma'``
is accounted at a smaller epsilon, the correlated noise costs more privacy for no less
noise. The cost is one ``O(T)`` error computation and one or two evaluations of the
accountant (DP-SGD's first step, then all its steps only when the first is below the
run's epsilon): about 0.01 s for a thousand steps.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from privlearn.correlated.error import per_query_error
from privlearn.correlated.strategies import nonzero_bands
from privlearn.torch.schedule import SAMPLINGS, NoisePlan

__all__: list[str] = []


def _reference(cfg, plan, given_cycle: int | None) -> NoisePlan:
    """The DP-SGD run of the same call with ``noise="dpsgd"``: the same sampling, units,
    batch size and planned steps; the cycle given (``cycle_length`` or a DP sampler's),
    else the sampling's own default for DP-SGD (cyclic Poisson: 1 group, Poisson)."""
    law = SAMPLINGS[cfg.sampling]
    run = plan.run
    cycle = run.cycle
    if cfg.cycle_length is None and given_cycle is None:
        cycle = law.cycle_for(plan.dataset_size, plan.batch_size, None)
    q = (
        run.sampling_rate
        if cycle == run.cycle
        else law.rate(plan.world_size * plan.batch_size, plan.dataset_size, cycle)
    )
    return NoisePlan.build("dpsgd", cfg.sampling, plan.dataset_size, q, cycle, plan.planned_steps)


def warn_if_dpsgd_better(
    cfg, plan, given_cycle: int | None = None, *, stacklevel: int = 2
) -> tuple[float, float, float] | None:
    """Warn (a ``UserWarning``) when the run's correlated noise is accounted at a larger
    epsilon than DP-SGD's independent noise of the same expected error with the same
    sampling, batch size and steps (see the module docstring).

    Parameters
    ----------
    cfg : DPConfig
    plan : Plan
        The run's plan (:func:`privlearn.torch.privacy_engine.plan_run`).
    given_cycle : int, optional
        The cycle of a DP sampler given with the loader (kept for the comparison).
    stacklevel : int
        Where the warning points, counted from the caller.

    Returns
    -------
    tuple or None
        ``(dpsgd_noise_multiplier, dpsgd_epsilon, epsilon)`` when compared (warned or
        not; ``dpsgd_epsilon`` is that of DP-SGD's first step alone when it already
        reaches ``epsilon``), None when there is nothing to compare (independent noise,
        no planned steps or epsilon, no noise).
    """
    run, steps, eps = plan.run, plan.planned_steps, plan.planned_epsilon
    sigma = plan.noise_multiplier
    if not run.correlates or not steps or eps is None or not math.isfinite(eps) or sigma <= 0:
        return None
    ratio = math.sqrt(float(np.max(per_query_error(run.strategy, steps))) / steps)
    ref = _reference(cfg, plan, given_cycle)
    sigma_ref = sigma * ratio
    # DP-SGD's epsilon only grows with its steps: its first step's (cheap) at or above
    # the run's epsilon settles it without accounting all of them (slow at a small sigma')
    for k in (1, steps):
        eps_ref = ref.mechanism(sigma_ref, k).epsilon(cfg.target_delta, accountant=cfg.accountant)
        if eps_ref >= eps:
            break
    if eps_ref < eps:
        noise = (
            repr(str(cfg.noise))
            if isinstance(cfg.noise, str)
            else f"{type(cfg.noise).__name__}(...)"
        )
        bands = nonzero_bands(run.strategy)  # a banded C of bands <= cycle is amplified
        amplified = cfg.sampling == "cyclic_poisson" and bands is not None and bands <= run.cycle
        fix = "pass noise='dpsgd' (the DP-SGD run compared), or plan a larger budget" + (
            ""
            if amplified
            else ", where correlated noise pays off (it is accounted without amplification "
            "by sampling: only a banded one with bands <= the cycle of cyclic Poisson is)"
        )
        epoch = max(1, int(plan.dataset_size // plan.batch_size))
        if (
            SAMPLINGS[cfg.sampling].default_cycle is not None
            and run.cycle < epoch
            and not amplified
        ):
            fix += (
                f"; with {run.cycle} group(s) an example may take part every "
                f"{run.cycle} step(s): cycle_length={epoch} (an epoch's batches) lets it "
                "take part once per epoch, the participation correlated noise is "
                "designed for"
            )
        warnings.warn(
            f"noise={noise} with sampling={cfg.sampling!r} (cycle {run.cycle}) is "
            f"accounted at epsilon={eps:.4g} (delta={cfg.target_delta:g}) at "
            f"noise_multiplier={sigma:.4g}, while independent DP-SGD noise (noise='dpsgd' "
            f"in the same call: sampling={cfg.sampling!r} with cycle {ref.cycle}, the same "
            f"batch size and {steps} steps) adds the same expected error (the largest "
            f"noise of the summed updates) at noise_multiplier={sigma_ref:.4g} and is "
            f"accounted at epsilon={eps_ref:.4g}: this correlated "
            f"noise costs more privacy for no less noise. To change: {fix}",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    return sigma_ref, eps_ref, eps
