"""Reserving a private training run in a privacy ledger before any data is read.

The planned run (or ``ledger_chunk`` steps at a time) is reserved in the ledger; under
distribution the group's first rank records it once and the other ranks follow.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from privlearn.accounting import compose
from privlearn.errors import (
    BudgetExceededError,
    ConfigurationError,
    LedgerConflictError,
    ParameterTypeError,
)
from privlearn.torch.accountant import LedgerLink, _Reservation
from privlearn.torch.distributed import ledger_on_first_rank
from privlearn.torch.schedule import SAMPLINGS, dpsgd_step

if TYPE_CHECKING:
    from torch import nn

    from privlearn.torch.config import DPConfig
    from privlearn.torch.privacy_engine import Plan


def reserve_budget(ledger, cfg: DPConfig, plan: Plan, inner: nn.Module,
                   undo, process_group=None, resume: dict | None = None
                   ) -> LedgerLink | None:
    """Reserve the planned run (or ``ledger_chunk`` steps) in a privacy ledger before any
    data is read; the reservation is released if a later step refuses. Distributed: the
    group's first rank's ledger records the run, once (the other ranks follow it).
    ``resume``: the state of the checkpoint this run continues; a planned run on one
    process takes over the checkpoint's reservation (:func:`take_over`) instead of
    reserving the plan again."""
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
    record = None if resume is None else resume_record(resume, link, plan)
    try:
        if record is not None:
            take_over(link, record, plan, replayable(resume))
        else:
            link.reserve(plan.noise_multiplier, plan.sampling_rate,
                         plan.planned_steps or cfg.ledger_chunk,
                         whole=plan.planned_steps is not None)  # a plan: all, or refused
    except BudgetExceededError as exc:
        if plan.planned_steps is None:
            raise
        raise BudgetExceededError(
            f"{exc}. The whole planned run ({plan.planned_steps} steps) is reserved "
            "before it starts: plan fewer epochs/steps or a smaller target_epsilon "
            "(nothing was reserved). Only if this run resumes a checkpoint of an earlier "
            "one: " + _resume_advice(plan)) from exc
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


_PASS_THE_CHECKPOINT = (
    "To resume a checkpoint of this run on this ledger, pass it: make_private(..., "
    "resume=state) takes over its reservation, so the run is charged once")


def _resume_advice(plan: Plan) -> str:
    """How to resume, on this ledger, a checkpoint of a run planned as ``plan`` whose
    first steps the ledger already counts (what a refusal of the whole plan says)."""
    if plan.run.stepwise:  # DP-SGD steps compose: the ledger takes the rest as it runs
        return (_PASS_THE_CHECKPOINT + "; or, for a checkpoint without that record, "
                "build the run "
                f"with noise_multiplier={plan.noise_multiplier!r} (this plan's) and "
                "no epochs/steps, so that its steps are reserved as they run, then "
                "p.load_state_dict(...)")
    # one mechanism of the planned steps: its run reserved all of them (settled at the
    # plan when it stopped early), so the ledger already counts the steps left
    return (_PASS_THE_CHECKPOINT + ". For a checkpoint without that record: resume it (same "
            "settings), whose run reserved this "
            "whole plan in the ledger (a run accounted as one mechanism, correlated noise "
            "or a sampling of bounded participation, is reserved whole and, stopped early, "
            "settled at its plan, so its remaining steps are already counted there), build "
            "it with ledger=None and the same epochs/steps, then p.load_state_dict(...): "
            "reserving the plan again would count it twice")


# -- resuming a checkpoint on the ledger that reserved its run -------------------------
def ledger_record(link: LedgerLink | None, taken: int) -> dict | None:
    """What a checkpoint's privacy state says of the run's ledger reservations (None
    without a planned run on one process): their ``(seq, hash)``, the budget, the
    planned steps and the steps taken. No path: the ledger is the one the resumed run
    is given, which must hold these entries."""
    if link is None or not link.lineage or link._group is not None:
        return None
    return {"reservations": [[int(q), str(h)] for q, h in link.lineage],
            "dataset": link.handle.dataset, "privacy_unit": link.handle.privacy_unit,
            "steps": int(link.plan_steps), "taken": int(taken)}


def replayable(state: dict) -> bool:
    """Whether a resume from ``state`` replays the interrupted run's batches and noise
    (their keys are saved; not in secure mode, whose OS entropy cannot be replayed)."""
    noise, sampler = state.get("noise"), state.get("sampler")
    return (isinstance(noise, dict) and noise.get("secure_mode") is False
            and isinstance(sampler, dict) and sampler.get("key") is not None)


def _malformed(record: object) -> LedgerConflictError:
    return LedgerConflictError(f"the checkpoint's ledger record is malformed ({record!r}); "
                               "pass the state PrivateTraining.state_dict() returned")


def resume_record(state: object, link: LedgerLink, plan: Plan) -> dict | None:
    """The checkpoint's ledger record, checked, if this run takes it over: a planned run
    on one process (None otherwise, or for a checkpoint without one)."""
    if not isinstance(state, dict):
        raise ParameterTypeError(f"resume must be the dict PrivateTraining.state_dict() "
                                 f"returned, got {type(state).__name__}")
    record = state.get("ledger")
    if record is None or plan.planned_steps is None or link._group is not None:
        return None
    try:
        pairs = [(int(q), str(h)) for q, h in record["reservations"]]
        taken, steps = int(record["taken"]), int(record["steps"])
        where = (str(record["dataset"]), str(record["privacy_unit"]))
    except (KeyError, TypeError, ValueError):
        raise _malformed(record) from None
    if not pairs or taken < 0 or steps < 1:
        raise _malformed(record)
    if link.run is not None and steps != plan.planned_steps:
        return None  # another plan of one mechanism: reserved whole again (and warned)
    return {"reservations": pairs, "taken": taken, "steps": steps, "where": where}


def _foreign(handle, what: str) -> LedgerConflictError:
    return LedgerConflictError(
        f"resume: {what}, so this is not the ledger (or budget) that reserved the "
        f"checkpoint's run, or the checkpoint's ledger record was altered; nothing was "
        f"recorded. Resume on the budget that reserved the run ({handle!r} is "
        "Ledger(path).budget(dataset) of another file or dataset?), or, to charge the "
        "whole plan again here, drop the record: state = {**state, 'ledger': None}")


def check_lineage(link: LedgerLink, record: dict, plan: Plan) -> list:
    """The reservations a checkpoint's ledger record names, each with its settlement
    (None: pending), read from the link's budget; refused unless each is there (same
    entry number and hash; the first, this run's plan). Records nothing."""
    handle = link.handle
    ledger = getattr(handle, "ledger", None)
    if not callable(getattr(ledger, "history", None)):
        raise ParameterTypeError(f"resume with a ledger needs a budget of a "
                                 f"privlearn.ledger.Ledger, got {handle!r}")
    if record["where"] != (handle.dataset, handle.privacy_unit):
        raise _foreign(handle, f"the checkpoint's run was reserved on the budget "
                       f"{record['where']}, this run spends {handle.dataset!r} "
                       f"({handle.privacy_unit!r})")
    entries = {e.seq: e for e in ledger.history(handle.dataset,
                                                 privacy_unit=handle.privacy_unit)}
    settled = {e.ref: e for e in entries.values() if e.kind == "settle"}
    whole = link._mech(plan.noise_multiplier, plan.sampling_rate, record["steps"])
    out = []
    for i, (seq, h) in enumerate(record["reservations"]):
        e = entries.get(seq)
        if e is None or e.kind != "reserve" or e.hash != h or (i == 0 and e.mechanism != whole):
            raise _foreign(handle, f"its entry {seq} is not the reservation (hash "
                           f"{h[:12]}...) of this planned run")
        out.append((e, settled.get(seq)))
    return out


def take_over(link: LedgerLink, record: dict, plan: Plan, replay: bool,
              before=None) -> None:
    """Continue a checkpoint's planned run on the reservations it names instead of
    reserving the plan again, so that the run is charged once across the interruption.

    Each named reservation must be in the budget (same entry number and hash, the first
    of this plan). A pending one (the process was killed) is settled at its plan. The
    ledger then counts ``c`` steps of the run; the checkpoint took ``k``. Resumed with
    its keys, the run replays the interrupted run's batches and noise (the same outputs:
    post-processing of what is counted), so only steps beyond ``c`` are reserved; in
    secure mode every resumed step is a new release, so the steps after ``k`` are
    reserved (and any of the first ``k`` the ledger does not count). A run accounted as
    one mechanism is covered by its counted plan when replayed, else reserved whole
    again (refused like a fresh run if the budget cannot hold it). ``before``: called
    once the record is checked, before anything is recorded."""
    handle, lineage = link.handle, check_lineage(link, record, plan)
    if before is not None:
        before()
    # the plan of this run (of the run that reserved, for a stepwise run resumed with
    # more or fewer epochs, record["steps"])
    sigma, q, total, k = plan.noise_multiplier, plan.sampling_rate, plan.planned_steps, \
        record["taken"]
    whole = link._mech(sigma, q, record["steps"])
    step = None if link.run is not None else dpsgd_step(sigma, q, link.scheme)
    counted, covered = 0, False
    for e, settle in lineage:
        m = e.mechanism if settle is None else settle.mechanism
        if settle is None:  # the process was killed: the plan in full
            handle.ledger.settle(e.seq)
        covered |= m == e.mechanism
        if step is not None and m is not None:
            counted += sum(n for part, n in getattr(m, "parts", ()) if part == step)
    if link.run is not None:  # one mechanism: covered by its plan, or reserved whole again
        res = None if replay and covered else handle.reserve(
            whole, label=link.label, **link._metadata(record["steps"]))
        link._open.append(_Reservation(res, sigma, q, total))
    else:
        replayed = counted - k if replay else min(0, counted - k)
        n = total - k - replayed
        res = handle.reserve(link._mech(sigma, q, n), label=link.label) if n > 0 else None
        link._open.append(_Reservation(res, sigma, q, max(0, total - k), replayed=replayed))
    link.lineage = list(record["reservations"]) + (
        [(res.entry.seq, res.entry.hash)] if res is not None else [])
    link.plan_steps, link.resumed = record["steps"], k  # (the first reservation's plan)


def take_over_on_load(p, state: dict) -> None:
    """In ``p.load_state_dict(state)``: the ledger side of a resume. After
    ``make_private(..., resume=state)`` (which took the reservation over), check that
    the state loaded is the one it took over; after a plain ``make_private``, which
    reserved the plan afresh before the state was loaded, give that reservation back
    (nothing ran: no data was read) and take the checkpoint's over. Otherwise (a
    checkpoint without a record, distributed runs) warn when the plan is counted twice."""
    link = p.ledger_link
    if link is None:
        return
    if link.resumed is not None:
        if link.resumed != p.accountant.steps:
            raise ConfigurationError(
                f"make_private(resume=...) took over the ledger reservation of a "
                f"checkpoint of {link.resumed} steps, but the state loaded has "
                f"{p.accountant.steps}: load the state given as resume=")
        return
    record = resume_record(state, link, p.plan)
    if record is not None and len(link._open) == 1 and not link._open[0].used:
        if record["taken"] != p.accountant.steps:
            raise _foreign(link.handle, f"the record says {record['taken']} steps were "
                           f"taken, the state's history {p.accountant.steps}")
        def give_back() -> None:
            fresh = link._open.pop()
            if fresh.reservation is not None:
                fresh.reservation.settle(compose([]))  # nothing ran: no data was read

        take_over(link, record, p.plan, replayable(state), before=give_back)
        return
    if not p.plan.run.stepwise and p.accountant.steps:
        warnings.warn(
            f"this run reserved its whole plan in the ledger again, and resumes a "
            f"checkpoint of {p.accountant.steps} steps of a run accounted as one "
            "mechanism, whose run reserved (or, stopped part-way, settled at) the same "
            "plan: the ledger counts it twice. Resume it with ledger=None (and the same "
            "settings)", UserWarning, stacklevel=3)


def check_take_over(p, state: dict) -> None:
    """In ``p.load_state_dict``'s checks, before anything is loaded: a checkpoint's
    ledger record that this run would take over names reservations of its budget."""
    link = p.ledger_link
    if link is None or link.resumed is not None or not isinstance(state, dict):
        return
    record = resume_record(state, link, p.plan)
    if record is not None:
        check_lineage(link, record, p.plan)


def load_resume(p, state: dict | None):
    """``make_private(..., resume=state)``: ``p`` with ``state`` loaded (``p`` as it is
    for None), or, if it is refused, ``p`` detached (its ledger reservation settled:
    nothing ran) and the error raised."""
    if state is None:
        return p
    try:
        p.load_state_dict(state)
    except BaseException:
        p.detach()
        raise
    return p
