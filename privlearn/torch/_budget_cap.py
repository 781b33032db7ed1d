"""The budget cap of a run (:class:`~privlearn.torch.accountant.BudgetCap`): the
``max_epsilon`` given, lowered to the plan's epsilon for a run accounted as one
matrix-factorization mechanism (beyond its plan, the strategy and its sensitivity no
longer describe the steps), with what the refusal tells the user to do."""

from __future__ import annotations

import math

from privlearn.torch.accountant import BudgetCap, PrivacyAccountant

__all__: list[str] = []


def budget_cap(cfg, plan, acct: PrivacyAccountant) -> BudgetCap:
    """The :class:`BudgetCap` of the run ``plan`` of ``cfg`` (a
    :class:`~privlearn.torch.config.DPConfig`), counted on ``acct``."""
    given = None if cfg.max_epsilon is None or math.isinf(cfg.max_epsilon) else cfg.max_epsilon
    cap = given
    whole = not plan.run.stepwise and plan.planned_epsilon is not None
    if whole:
        cap = plan.planned_epsilon if cap is None else min(cap, plan.planned_epsilon)
    if cap is not None and not plan.run.stepwise and cap == plan.planned_epsilon:
        beyond = (
            "a run accounted as one matrix-factorization mechanism cannot go past its "
            "plan (beyond it, its strategy and sensitivity no longer describe the "
            "steps): plan more steps (epochs or steps) and a larger target_epsilon"
        )
    elif cfg.target_epsilon is not None and cap == cfg.target_epsilon:
        beyond = (
            "target_epsilon is a stop: the loop ran longer than the planned "
            f"{plan.planned_steps} steps (epochs/steps given to make_private). To "
            "train past it, accepting the larger epsilon, pass max_epsilon="
            "float('inf') (or a larger max_epsilon); or plan the run's real length"
        )
    else:
        beyond = "stop training here, or plan a larger budget (or more noise) before training"
    return BudgetCap(
        acct,
        delta=cfg.target_delta,
        max_epsilon=cap,
        planned_epsilon=plan.planned_epsilon,
        planned_steps=plan.planned_steps,
        beyond=beyond,
        planned_noise_multiplier=plan.noise_multiplier,
        capped_at_plan=whole,
        given_max_epsilon=given,
    )
