"""Reserving a private training run in a privacy ledger before any data is read.

The planned run (or ``ledger_chunk`` steps at a time) is reserved in the ledger; under
distribution the group's first rank records it once and the other ranks follow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from privlearn.errors import BudgetExceededError, ConfigurationError, LedgerConflictError
from privlearn.torch.accountant import LedgerLink
from privlearn.torch.distributed import ledger_on_first_rank
from privlearn.torch.schedule import SAMPLINGS

if TYPE_CHECKING:
    from torch import nn

    from privlearn.torch.config import DPConfig
    from privlearn.torch.privacy_engine import Plan


def reserve_budget(ledger, cfg: DPConfig, plan: Plan, inner: nn.Module,
                   undo, process_group=None) -> LedgerLink | None:
    """Reserve the planned run (or ``ledger_chunk`` steps) in a privacy ledger before any
    data is read; the reservation is released if a later step refuses. Distributed: the
    group's first rank's ledger records the run, once (the other ranks follow it)."""
    group = None
    if plan.world_size > 1:  # the plan's group (None: the world)
        import torch.distributed as dist

        group = dist.group.WORLD if process_group is None else process_group
    if not (ledger_on_first_rank(ledger, group) if group is not None else ledger is not None):
        return None
    if plan.noise_multiplier == 0:
        raise ConfigurationError("noise_multiplier=0 is not private and cannot be spent from a "
                         "ledger; give noise_multiplier > 0 or target_epsilon")
    law = SAMPLINGS[cfg.sampling]
    link = LedgerLink(ledger, scheme=law.scheme or cfg.sampling, chunk=cfg.ledger_chunk,
                      label=f"make_private({type(inner).__name__})",
                      run=None if plan.run.stepwise else plan.run,
                      privacy_unit=cfg.privacy_unit,
                      process_group=group)
    try:
        link.reserve(plan.noise_multiplier, plan.sampling_rate,
                     plan.planned_steps or cfg.ledger_chunk,
                     whole=plan.planned_steps is not None)  # a plan: all of it, or refused
    except BudgetExceededError as exc:
        if plan.planned_steps is None:
            raise
        raise BudgetExceededError(
            f"{exc}. The whole planned run ({plan.planned_steps} steps) is reserved "
            "before it starts: plan fewer epochs/steps or a smaller target_epsilon. "
            "To resume a checkpoint whose first steps the ledger already counts, build the "
            f"run with noise_multiplier={plan.noise_multiplier!r} (this plan's) and no "
            "epochs/steps, so that its steps are reserved as they run, then "
            "p.load_state_dict(...)") from exc
    except LedgerConflictError as exc:
        if law.add_remove or "replace-one" not in str(exc):
            raise
        # a replace-one sampling on a budget counted under add/remove: say which
        # setting, why, and what to use instead (nothing was recorded)
        raise LedgerConflictError(
            law.refusal(f"the ledger budget {getattr(ledger, 'dataset', ledger)!r}")
            + f"; nothing was recorded ({exc})") from exc
    undo(link.settle)
    return link
