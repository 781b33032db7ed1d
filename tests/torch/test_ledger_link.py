"""make_private(ledger=...): a training run spends from a persistent privacy ledger."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from train_loops import train_steps as _train  # noqa: E402

import privlearn  # noqa: E402
from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import BudgetExceededError, LedgerConflictError  # noqa: E402
from privlearn.ledger import Ledger  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

DELTA = 1e-5


def _setup(tmp_path, epsilon):
    ledger = Ledger(tmp_path / "privacy.db", create=True)
    ledger.create_budget("toy", epsilon=epsilon, delta=DELTA)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 5, generator=g), torch.randint(0, 2, (64,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    return ledger, ds, model


def _steps(sigma, q, k):
    return compose(subsample(Gaussian(sigma), rate=q), steps=k)


def test_plan_reserved_before_training_and_settled_to_what_ran(tmp_path):
    ledger, ds, model = _setup(tmp_path, epsilon=10.0)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0, epochs=2,
                     ledger=ledger.budget("toy"), seed=0)
    plan = _steps(1.0, 8 / 64, 16)
    # reserved before any step: the whole plan counts
    assert ledger.spent("toy").epsilon_spent == pytest.approx(plan.epsilon(DELTA), rel=1e-9)
    _train(p, 5)
    p.finish()
    assert ledger.pending("toy") == []
    assert ledger.spent("toy").epsilon_spent == pytest.approx(p.epsilon(DELTA), rel=1e-9)
    # training continues after finish(): new steps are reserved again
    _train(p, 3)
    p.optimizer.noise_multiplier = 2.0  # a schedule: a new reservation for the new noise
    _train(p, 2)
    p.detach()
    assert ledger.pending("toy") == []
    assert p.accountant.steps == 10
    assert ledger.spent("toy").epsilon_spent == pytest.approx(p.epsilon(DELTA), rel=1e-6)
    assert ledger.verify()


@pytest.mark.parametrize("kw", [dict(sampling="balls_in_bins"),
                                dict(sampling="balls_in_bins", noise="blt")],
                         ids=["balls-in-bins", "blt"])
def test_a_run_accounted_as_one_mechanism_stopped_early_settles(tmp_path, kw):
    """Early stopping after one of two planned epochs: finish() settles the reservation
    (at the plan, which covers the steps that ran) instead of refusing the shorter run's
    mechanism as not a sub-composition of the plan."""
    ledger, ds, model = _setup(tmp_path, epsilon=50.0)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0, epochs=2,
                     ledger=ledger.budget("toy"), seed=0, **kw)
    planned = ledger.spent("toy").epsilon_spent
    _train(p, 8)
    p.finish()
    assert ledger.pending("toy") == []
    assert ledger.spent("toy").epsilon_spent == pytest.approx(planned, rel=1e-9)
    assert p.epsilon(DELTA) <= planned
    assert ledger.verify()


def test_refused_before_touching_anything(tmp_path):
    ledger, ds, model = _setup(tmp_path, epsilon=0.5)
    flags = [q.requires_grad for q in model.parameters()]
    with pytest.raises(BudgetExceededError, match="refused"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=0.5, epochs=50,
                     ledger=ledger.budget("toy"))
    assert [q.requires_grad for q in model.parameters()] == flags
    assert not model._forward_hooks and not model[0]._forward_hooks
    assert ledger.history("toy") == [] or all(e.kind != "reserve" for e in ledger.history("toy"))


def test_a_planned_run_the_budget_cannot_hold_whole_is_refused_before_any_step(tmp_path):
    # the budget holds a few steps of the 16 planned, not all: make_private refuses the
    # run up front (as the guide says), rather than reserving a part of it and failing
    # mid-training after spending what is left of the budget
    sigma, q = 1.0, 8 / 64
    fits = _steps(sigma, q, 4).epsilon(DELTA)
    assert fits < _steps(sigma, q, 16).epsilon(DELTA)
    ledger, ds, model = _setup(tmp_path, epsilon=fits * 1.0001)
    flags = [w.requires_grad for w in model.parameters()]
    with pytest.raises(BudgetExceededError, match="refused"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=sigma, epochs=2,
                     ledger=ledger.budget("toy"))
    assert [w.requires_grad for w in model.parameters()] == flags
    assert not model._forward_hooks and not model[0]._forward_hooks
    assert [e.kind for e in ledger.history("toy")] == ["budget"]
    assert ledger.spent("toy").epsilon_spent == 0.0



def test_a_resumed_run_on_a_tight_budget_reserves_its_steps_as_they_run(tmp_path):
    # the first process ran half the plan (settled in the ledger); the budget holds the
    # plan and no more. Rebuilt with the same arguments the resumed run is refused (the
    # whole plan again would not fit), and the refusal says how to resume: the plan's
    # noise multiplier without a plan, whose steps are reserved as they run
    sigma, q = 1.0, 8 / 64
    ledger, ds, _ = _setup(tmp_path, epsilon=_steps(sigma, q, 16).epsilon(DELTA) * 1.0001)

    def build(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(ds, batch_size=8), ledger=ledger.budget("toy"),
                            seed=0, **kw)

    first = build(noise_multiplier=sigma, epochs=2)
    _train(first, 8)
    state = first.state_dict()
    first.detach()
    with pytest.raises(BudgetExceededError, match="noise_multiplier=1.0 .*no epochs/steps"):
        build(noise_multiplier=sigma, epochs=2)
    resumed = build(noise_multiplier=sigma)
    resumed.load_state_dict(state)
    _train(resumed, 8)
    resumed.detach()
    assert resumed.accountant.steps == 16
    assert ledger.spent("toy").epsilon_spent == pytest.approx(
        _steps(sigma, q, 16).epsilon(DELTA), rel=1e-9)



@pytest.mark.parametrize("kw", [dict(sampling="balls_in_bins"),
                                dict(sampling="cyclic_poisson", cycle_length=2)],
                         ids=["balls_in_bins", "cyclic_poisson"])
def test_a_resumed_whole_run_is_told_its_plan_is_already_counted(tmp_path, kw):
    """A run accounted as one mechanism of its planned steps (a sampling of bounded
    participation, or correlated noise) needs epochs/steps, so the advice for a stepwise
    run (no epochs/steps) cannot be followed. Its run reserved the whole plan and, stopped
    part-way, settled at it: the refusal says the steps left are already counted and to
    resume with ledger=None, which runs within what the ledger holds."""
    ledger, ds, _ = _setup(tmp_path, epsilon=1e6)

    def build(led, **more):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(ds, batch_size=8), ledger=led, seed=0,
                            noise_multiplier=1.0, epochs=2, **kw, **more)

    plan_eps = build(None).plan.planned_epsilon
    ledger.create_budget("tight", epsilon=plan_eps * 1.0001, delta=DELTA)
    first = build(ledger.budget("tight"))
    total = first.plan.planned_steps
    _train(first, total // 2)
    state = first.state_dict()
    first.detach()  # stopped part-way: settled at the plan
    counted = ledger.spent("tight").epsilon_spent
    assert counted == pytest.approx(plan_eps, rel=1e-9)
    with pytest.raises(BudgetExceededError) as err:
        build(ledger.budget("tight"))
    assert "ledger=None" in str(err.value) and "no epochs/steps" not in str(err.value)
    assert "resume=state" in str(err.value)
    ledger.create_budget("roomy", epsilon=1e6, delta=DELTA)
    twice = build(ledger.budget("roomy"))  # another budget: not the one that reserved it
    with pytest.raises(LedgerConflictError, match="reserved on the budget .'tight'"):
        twice.load_state_dict(state)
    assert twice.accountant.steps == 0  # refused before anything was loaded
    twice.detach()
    old = {**state, "ledger": None}  # a checkpoint without the record: told
    twice = build(ledger.budget("roomy"))  # a budget that holds the plan again: told
    with pytest.warns(UserWarning, match="counts it twice.*ledger=None"):
        twice.load_state_dict(old)
    twice.detach()
    resumed = build(None)  # as the refusal says
    resumed.load_state_dict(state)
    _train(resumed, total - total // 2)
    assert resumed.accountant.steps == total
    assert resumed.epsilon(DELTA) <= counted * (1 + 1e-9)
    assert ledger.spent("tight").epsilon_spent == counted


def _killed_after(p, n):
    """Train ``p`` for ``n`` steps, then its process dies without settling: its
    reservation stays pending in the ledger. Its checkpoint (``state_dict``)."""
    _train(p, n)
    state = p.state_dict()
    p.ledger_link._open.clear()
    p.detach()
    return state


def _build_on(ds, led, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(ds, batch_size=8), ledger=led,
                        **{"noise_multiplier": 1.0, "epochs": 2, "seed": 0, **kw})


@pytest.mark.parametrize("killed", [False, True], ids=["stopped", "killed"])
@pytest.mark.parametrize("kw", [{}, dict(sampling="balls_in_bins")],
                         ids=["poisson", "balls_in_bins"])
def test_a_run_resumed_on_its_ledger_is_charged_once(tmp_path, kw, killed):
    """One planned run of 16 steps, interrupted after 8 (its process stopped, settling
    what ran, or killed, leaving its reservation pending) and resumed from the checkpoint
    with make_private(..., resume=state) on the same budget, which holds one run: the
    ledger ends up counting the run once, the naive expectation, i.e. the epsilon of the
    16 steps the accountant composed (Poisson: 16 subsampled Gaussian steps; balls in
    bins: the plan, one mechanism); nothing pending."""
    ledger, ds, _ = _setup(tmp_path, epsilon=1e6)
    one_run = _build_on(ds, None, **kw).plan.planned_epsilon
    if not kw:
        assert one_run == pytest.approx(_steps(1.0, 8 / 64, 16).epsilon(DELTA), rel=1e-9)
    ledger.create_budget("once", epsilon=one_run * 1.0001, delta=DELTA)
    first = _build_on(ds, ledger.budget("once"), **kw)
    _train(first, 8)
    state = first.state_dict()
    if killed:  # the process dies without settling: its reservation stays pending
        first.ledger_link._open.clear()
        assert len(ledger.pending("once")) == 1
    first.detach()
    resumed = _build_on(ds, ledger.budget("once"), resume=state, **kw)
    assert resumed.accountant.steps == 8
    _train(resumed, 8)
    resumed.detach()
    assert resumed.accountant.steps == 16
    assert resumed.epsilon(DELTA) == pytest.approx(one_run, rel=1e-6)
    assert ledger.pending("once") == []
    assert ledger.spent("once").epsilon_spent == pytest.approx(one_run, rel=1e-9)
    assert ledger.verify().ok


def test_a_killed_secure_mode_run_resumed_is_charged_its_new_steps_too(tmp_path):
    """secure_mode=True draws from OS entropy, so the resumed steps do not replay the
    killed run's: the pending plan (16 steps) stays counted in full, and the 8 steps
    after the checkpoint are new releases, reserved on top (24 steps in all)."""
    ledger, ds, _ = _setup(tmp_path, epsilon=1e6)
    first = _build_on(ds, ledger.budget("toy"), secure_mode=True, seed=None)
    state = _killed_after(first, 8)
    resumed = _build_on(ds, ledger.budget("toy"), secure_mode=True, seed=None, resume=state)
    _train(resumed, 8)
    resumed.detach()
    assert resumed.accountant.steps == 16 and ledger.pending("toy") == []
    assert ledger.spent("toy").epsilon_spent == pytest.approx(
        _steps(1.0, 8 / 64, 24).epsilon(DELTA), rel=1e-9)


def test_a_run_resumed_twice_with_more_epochs_is_charged_once(tmp_path):
    """Stopped at 4 steps, resumed with a plan of 3 epochs instead of 2 (24 steps),
    stopped again at 12, killed this time, resumed again: the ledger counts the 24
    steps the accountant composed, once."""
    ledger, ds, _ = _setup(tmp_path, epsilon=1e6)
    first = _build_on(ds, ledger.budget("toy"))
    _train(first, 4)
    state = first.state_dict()
    first.detach()
    second = _build_on(ds, ledger.budget("toy"), resume=state, epochs=3)
    state = _killed_after(second, 8)
    third = _build_on(ds, ledger.budget("toy"), resume=state, epochs=3)
    _train(third, 12)
    third.detach()
    assert third.accountant.steps == 24 and ledger.pending("toy") == []
    assert ledger.spent("toy").epsilon_spent == pytest.approx(
        _steps(1.0, 8 / 64, 24).epsilon(DELTA), rel=1e-9)


def test_a_resume_loaded_after_make_private_gives_its_fresh_reservation_back(tmp_path):
    """make_private without resume= reserves the plan afresh (a budget with room for it);
    load_state_dict then recognises the checkpoint's reservation (left pending by a
    killed process), gives the fresh one back (no data was read) and the run is charged
    once all the same."""
    ledger, ds, _ = _setup(tmp_path, epsilon=1e6)
    first = _build_on(ds, ledger.budget("toy"))
    state = _killed_after(first, 8)
    resumed = _build_on(ds, ledger.budget("toy"))
    resumed.load_state_dict(state)
    _train(resumed, 8)
    resumed.detach()
    assert ledger.pending("toy") == []
    assert ledger.spent("toy").epsilon_spent == pytest.approx(
        _steps(1.0, 8 / 64, 16).epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("tamper", ["seq", "hash", "dataset", "other_file"])
def test_a_resume_on_another_ledger_or_with_an_altered_record_is_refused(tmp_path, tamper):
    ledger, ds, _ = _setup(tmp_path, epsilon=1e6)
    first = _build_on(ds, ledger.budget("toy"))
    _train(first, 4)
    state = first.state_dict()
    first.detach()
    record = dict(state["ledger"])
    (seq, h), = record["reservations"]
    budget = ledger.budget("toy")
    if tamper == "seq":
        record["reservations"] = [[seq - 1, h]]
    elif tamper == "hash":
        record["reservations"] = [[seq, "0" * 64]]
    elif tamper == "dataset":
        ledger.create_budget("other", epsilon=1e6, delta=DELTA)
        budget = ledger.budget("other")
    else:  # another file with the same budget name and entry numbers
        other = Ledger(tmp_path / "other.db", create=True)
        other.create_budget("toy", epsilon=1e6, delta=DELTA)
        _build_on(ds, other.budget("toy")).detach()
        budget = other.budget("toy")
    head = budget.ledger.head()
    with pytest.raises(LedgerConflictError, match="resume: .*nothing was recorded"):
        _build_on(ds, budget, resume={**state, "ledger": record})
    assert budget.ledger.head() == head and budget.ledger.pending(budget.dataset) == []


def test_budget_exhausted_mid_run_stops_before_the_step(tmp_path):
    ledger, ds, model = _setup(tmp_path, epsilon=2.0)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                     ledger=ledger.budget("toy"), ledger_chunk=4)
    with pytest.raises(BudgetExceededError):
        _train(p, 10_000)
    k = p.accountant.steps
    p.finish()
    spent = ledger.spent("toy").epsilon_spent
    assert spent <= 2.0
    assert spent == pytest.approx(_steps(1.0, 8 / 64, k).epsilon(DELTA), rel=1e-9)
    assert _steps(1.0, 8 / 64, k + 1).epsilon(DELTA) > 2.0


_CHILD = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from privlearn.ledger import Ledger
    from privlearn.torch import make_private
    path, progress = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 5, generator=g), torch.randint(0, 2, (64,), generator=g))
    model = nn.Linear(5, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                     ledger=Ledger(path).budget("toy"), ledger_chunk=3)
    while True:
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            with open(progress + ".tmp", "w") as f:  # replaced whole: a kill never
                f.write(str(p.accountant.steps))   # leaves the file empty
            os.replace(progress + ".tmp", progress)
""")


def test_sigkill_mid_run_leaves_at_least_the_steps_that_ran(tmp_path):
    ledger, _, _ = _setup(tmp_path, epsilon=1e6)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    progress = tmp_path / "progress"
    # the child imports the privlearn under test (the one this process imported), installed
    # or not
    root = os.path.dirname(os.path.dirname(os.path.abspath(privlearn.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "privacy.db"),
                             str(progress)], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if progress.exists() and progress.read_text().strip() and \
                    int(progress.read_text()) >= 7:
                break
            if proc.poll() is not None:
                pytest.fail(f"child exited with {proc.returncode}")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    ran = int(progress.read_text())  # steps completed when last reported (>= 7)
    reopened = Ledger(tmp_path / "privacy.db")
    assert reopened.verify()
    assert reopened.pending("toy")  # the killed run's reservation is still counted
    spent = reopened.spent("toy").epsilon_spent
    assert spent >= _steps(1.0, 8 / 64, ran).epsilon(DELTA) - 1e-12
