"""``p.optimizer`` is a ``torch.optim.Optimizer``: learning-rate schedulers built on it
change the learning rate its steps use exactly as on a plain optimizer (checked against
a plain loop over the same batches with the same scheduler), and the Optimizer API
(step hooks, state-dict hooks and round trips, ``swa_utils``) works on it."""

from __future__ import annotations

import copy
import math
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.optim import lr_scheduler as sched  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from privlearn.torch import make_private  # noqa: E402

STEPS = 6


def _get_scheduler(name):
    transformers = pytest.importorskip("transformers")
    return lambda opt: transformers.get_scheduler(
        name, opt, num_warmup_steps=2, num_training_steps=STEPS
    )


SCHEDULERS = {
    "StepLR": lambda opt: sched.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: sched.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda opt: sched.OneCycleLR(opt, max_lr=0.8, total_steps=STEPS),
    "CosineAnnealingLR": lambda opt: sched.CosineAnnealingLR(opt, T_max=STEPS),
    "SequentialLR": lambda opt: sched.SequentialLR(
        opt,
        [sched.ConstantLR(opt, factor=0.25, total_iters=2), sched.ExponentialLR(opt, gamma=0.7)],
        milestones=[2],
    ),
    "ChainedScheduler": lambda opt: sched.ChainedScheduler(
        [sched.StepLR(opt, step_size=2, gamma=0.5), sched.ExponentialLR(opt, gamma=0.9)]
    ),
    "ReduceLROnPlateau": lambda opt: sched.ReduceLROnPlateau(opt, factor=0.5, patience=0),
    "SWALR": lambda opt: torch.optim.swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=3),
    "hf_cosine": _get_scheduler("cosine"),
    "hf_linear": _get_scheduler("linear"),
}


def _scheduler_step(s, i):
    if isinstance(s, sched.ReduceLROnPlateau):
        s.step(float(i))  # a metric that never improves: the rate halves every step
    else:
        s.step()


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_on_p_optimizer_drives_the_learning_rate_of_the_dp_step(
    name, make_data, make_mlp
):
    """With no noise and no clipping, the DP step is SGD on ``sum_i grad_i / (q N)``: a
    plain loop over the same batches, its scheduler on a plain optimizer, must end at the
    same parameters, and no scheduler warns that it stepped before the optimizer."""
    model = make_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    p = make_private(
        model,
        opt,
        DataLoader(make_data(), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=math.inf,
        seed=0,
    )
    assert isinstance(p.optimizer, torch.optim.Optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = SCHEDULERS[name](p.optimizer)
        batches, lrs = [], []
        for i, (x, y) in zip(range(STEPS), p.data_loader, strict=False):
            batches.append((x.clone(), y.clone()))
            lrs.append(p.optimizer.param_groups[0]["lr"])
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            _scheduler_step(s, i)
    order = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
    assert order == []
    assert len(set(lrs)) > 1, "the schedule must change the rate within the run"

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.4, momentum=0.9)
    s_ref = SCHEDULERS[name](ref_opt)
    ref_lrs = []
    for i, (x, y) in enumerate(batches):
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(x), y, reduction="sum")
        (loss / p.optimizer.expected_batch_size).backward()
        ref_opt.step()
        _scheduler_step(s_ref, i)
    assert lrs == pytest.approx(ref_lrs)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert p.accountant.steps == STEPS


def test_optimizer_hooks_run_around_the_dp_step(make_data, make_mlp):
    """Step pre/post hooks on ``p.optimizer`` see the DP step (the post hook the noisy,
    clipped update); state-dict hooks run around the wrapped optimizer's state dict,
    which round-trips into a fresh run once its record of the steps taken is removed
    (test_optimizer_checkpoint.py: kept, it is refused there)."""
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    p = make_private(
        model,
        opt,
        DataLoader(make_data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    seen = []
    p.optimizer.register_step_pre_hook(
        lambda o, a, k: seen.append(("pre", o is p.optimizer, p.accountant.steps))
    )
    p.optimizer.register_step_post_hook(
        lambda o, a, k: seen.append(("post", o is p.optimizer, p.accountant.steps))
    )
    p.optimizer.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": o is p.optimizer})
    loaded = []
    p.optimizer.register_load_state_dict_post_hook(lambda o: loaded.append(o))
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    assert seen == [("pre", True, 0), ("post", True, 1)]
    sd = p.optimizer.state_dict()
    assert sd["tag"] is True and sd["state"] == opt.state_dict()["state"] != {}
    assert sd.pop("privlearn_accounted_steps") == 1  # a new run from it, on purpose

    model2 = make_mlp(seed=1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    p2 = make_private(
        model2,
        opt2,
        DataLoader(make_data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    p2.optimizer.register_load_state_dict_post_hook(lambda o: loaded.append(o))
    sd.pop("tag")
    p2.optimizer.load_state_dict(sd)
    assert loaded == [p2.optimizer]
    assert opt2.param_groups[0]["lr"] == 0.01
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"])


@pytest.mark.parametrize("physical", [None, 3])
def test_step_hooks_fire_once_per_logical_step(physical, make_data, make_mlp):
    """As for a plain optimizer, a step hook fires once per parameter update: hooks on
    ``p.optimizer`` once per ``step()`` that ends a logical batch (never on a virtual
    batch's earlier chunks, which update nothing), torch's global step hooks once per
    update, with the noisy gradient the update applies in ``p.grad``, and hooks on the
    optimizer given to make_private once per update too."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = make_private(
        model,
        opt,
        DataLoader(make_data(n=40), batch_size=10),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
        sampling="fixed",
        max_physical_batch_size=physical,
    )
    seen = []
    first = next(model.parameters())

    def record(kind):
        return lambda o, a, k: seen.append(
            (kind, o, p.accountant.steps, None if first.grad is None else first.grad.clone())
        )

    handles = [
        register_optimizer_step_pre_hook(record("global pre")),
        register_optimizer_step_post_hook(record("global post")),
        p.optimizer.register_step_pre_hook(record("pre")),
        p.optimizer.register_step_post_hook(record("post")),
        opt.register_step_post_hook(record("given post")),
    ]
    try:
        calls = 0
        for _, (x, y) in zip(range(2 * (4 if physical else 1)), p.data_loader, strict=False):
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            calls += 1
    finally:
        for h in handles:
            h.remove()
    assert p.accountant.steps == 2 and calls == (8 if physical else 2)
    kinds = [s[0] for s in seen]
    one = ["pre", "global pre", "given post", "global post", "post"]
    assert kinds == one + one
    for k, (kind, o, steps, grad) in enumerate(seen):
        assert steps == k // len(one) + (kind == "post")
        assert o is (p.optimizer if kind in ("pre", "post") else opt)
        if kind == "global pre":  # the update's gradient: clipped, noised, averaged
            assert grad is not None and torch.isfinite(grad).all()


def test_a_step_pre_hook_may_replace_the_step_arguments(make_data, make_mlp):
    """As on torch's optimizers, a pre-hook of ``p.optimizer`` may return new ``(args,
    kwargs)`` for the step (here: a closure, which the step then runs) and nothing else."""
    from privlearn.errors import TrainingLoopError

    model = make_mlp()
    p = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(make_data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    x, y = next(iter(p.data_loader))
    ran = []

    def closure():
        ran.append(True)
        p.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(p.model(x), y)
        loss.backward()
        return loss

    handle = p.optimizer.register_step_pre_hook(
        lambda o, args, kwargs: (args, {"closure": closure})
    )
    loss = p.optimizer.step()
    handle.remove()
    assert ran == [True] and loss is not None and p.accountant.steps == 1
    p.optimizer.register_step_pre_hook(lambda o, args, kwargs: "not a pair")
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(TrainingLoopError, match="pre-hook"):
        p.optimizer.step()
    assert p.accountant.steps == 1
