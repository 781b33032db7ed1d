"""Training loops users of DP-SGD libraries reported writing, against make_private: each
one is either accounted for what ran or refused before anything is released.

The ground truths are the definitions: an epsilon composed by hand from the mechanisms
that ran (privlearn.accounting, checked against dp_accounting in its own tests), or a
run that did not take the detour.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from toys import toy_data, toy_mlp  # noqa: E402
from train_loops import train_steps  # noqa: E402

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import ConfigurationError, TrainingLoopError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402

DELTA = 1e-5


def _private(**kw):
    model = toy_mlp()
    kw = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "seed": 0, **kw}
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(toy_data(), batch_size=8),
        **kw,
    )


def _segments(p):
    segs = p.accountant.segments
    return compose(
        [subsample(Gaussian(s.noise_multiplier), rate=s.sampling_rate) for s in segs],
        steps=[s.steps for s in segs],
    )


# ------------------------------------------------------------------ earlier runs, resumed


def test_earlier_runs_composed_before_a_resume_stay_in_the_epsilon():
    """``p.compose_after(earlier)`` (the runs before this one on the same data), then
    ``p.load_state_dict(checkpoint)`` of this run saved before the earlier runs were
    composed: the load replaced the prior by the checkpoint's (none), and epsilon left the
    earlier runs out. It is the composition of both, as the uninterrupted run reports."""
    done = _private()
    train_steps(done, 3)
    state = done.state_dict()
    earlier = compose(subsample(Gaussian(0.8), rate=0.2), steps=50)

    resumed = _private()
    resumed.compose_after(earlier)
    resumed.load_state_dict(state)
    truth = compose([earlier, _segments(done)]).epsilon(DELTA, accountant="pld")
    assert resumed.epsilon(DELTA) >= earlier.epsilon(DELTA, accountant="pld")
    assert resumed.epsilon(DELTA) == pytest.approx(truth, rel=1e-9)

    with pytest.raises(TrainingLoopError, match="before p.load_state_dict"):
        _private(resume=state).compose_after(earlier)  # the history is loaded already

    uninterrupted = _private()
    uninterrupted.compose_after(earlier)
    train_steps(uninterrupted, 3)
    assert resumed.epsilon(DELTA) == pytest.approx(uninterrupted.epsilon(DELTA), rel=1e-9)


def test_compose_after_once_per_earlier_run_composes_them_all():
    """Two earlier runs on the data, ``p.compose_after(a); p.compose_after(b)``: the
    second call replaced the first prior, and epsilon left run ``a`` out (7.0 where ``a``
    alone is 15.2). Each call now composes with the priors before it."""
    a = compose(subsample(Gaussian(0.8), rate=0.2), steps=50)
    b = compose(subsample(Gaussian(1.0), rate=0.1), steps=100)
    p = _private()
    p.compose_after(a)
    p.compose_after(b)
    train_steps(p, 2)
    truth = compose([a, b, _segments(p)]).epsilon(DELTA, accountant="pld")
    assert p.epsilon(DELTA) == pytest.approx(truth, rel=1e-9)
    assert p.epsilon(DELTA) > a.epsilon(DELTA, accountant="pld")


def test_a_checkpoint_composed_after_other_earlier_runs_is_refused():
    """Both the run and the checkpoint were composed after earlier runs, not the same
    ones: either would be dropped, so nothing is loaded."""
    saved = _private()
    saved.compose_after(compose(subsample(Gaussian(0.8), rate=0.2), steps=50))
    train_steps(saved, 2)
    state = saved.state_dict()
    p = _private()
    p.compose_after(compose(subsample(Gaussian(2.0), rate=0.1), steps=10))
    with pytest.raises(ConfigurationError, match="prior"):
        p.load_state_dict(state)
    assert p.accountant.steps == 0 and p.accountant.segments == ()


# ------------------------------------------------------------------ virtual batches


def test_zero_grad_keeping_the_tensors_leaves_the_chunks_of_a_batch_unseen(oracle):
    """``optimizer.zero_grad(set_to_none=False)`` (PyTorch's default before 2.0) in a loop
    of virtual batches: ``p.grad`` kept viewing the buffer the next logical batch was
    summed in, so after a chunk's ``step()`` it showed that chunk's un-noised clipped sum,
    and the next chunk's ``zero_grad`` wiped it from the update. Now ``p.grad`` keeps what
    ``zero_grad`` left until the batch's last chunk, and each update is the definition's
    (batch-of-one clipped sum of the whole logical batch)."""
    p = _private(
        noise_multiplier=0.0, sampling="fixed", loss_reduction="sum", max_physical_batch_size=3
    )
    ref = toy_mlp()
    x_b, y_b = [], []
    for x, y in p.data_loader:
        p.optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(p.model(x), y, reduction="sum").backward()
        steps = p.accountant.steps
        p.optimizer.step()
        x_b.append(x)
        y_b.append(y)
        if p.accountant.steps == steps:  # a chunk: nothing of it in p.grad
            assert all(q.grad is None or not q.grad.any() for q in p.model.parameters())
            continue
        oracle.step(
            ref, torch.cat(x_b), torch.cat(y_b), max_grad_norm=1.0, lr=0.1, expected_batch=8
        )
        x_b, y_b = [], []
        if p.accountant.steps == 3:
            break
    assert torch.allclose(
        oracle.flat(p.model.parameters()), oracle.flat(ref.parameters()), atol=1e-6
    )


# ------------------------------------------------------------------ resumed over a reshuffle


@pytest.mark.parametrize("sampling", ["shuffled_epochs", "balls_in_bins"])
def test_a_resume_over_the_examples_at_other_indices_is_refused(sampling):
    """A run whose sampling fixes a layout of the indices for the whole run (each index in
    one part: once per epoch), resumed over the same examples in another order (the
    training set shuffled or split anew before the restart). The layout followed the
    indices, so an example used in the steps before the checkpoint could be drawn again
    in the same epoch after it (here: some are, counted below), while the run was
    accounted for one participation per epoch. Refused before anything is loaded; the
    same order resumes."""
    data = toy_data()
    x, y = data.tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(5))

    def run(perm):
        model = toy_mlp()
        loader = DataLoader(TensorDataset(x[perm], y[perm]), batch_size=8)
        return make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            seed=0,
            sampling=sampling,
            epochs=2,
        )

    def rows(p, steps):  # the examples (by their first feature) of the next batches
        seen, it = [], iter(p.data_loader)
        for _ in range(steps):
            xb, yb = next(it)
            seen += xb[:, 0].tolist()
            p.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(p.model(xb), yb).backward()
            p.optimizer.step()
        return seen

    saved = run(torch.arange(len(x)))
    before = rows(saved, 4)  # half of the first epoch
    state = saved.state_dict()
    # what the resumed epoch would draw over the reordered examples, without the check
    layout = run(order)
    layout._sampler.load_state_dict(state["sampler"])
    assert set(before) & set(rows(layout, 4))  # an example twice in one epoch

    moved = run(order)
    with pytest.raises(ConfigurationError, match="other examples at its indices"):
        moved.load_state_dict(state)
    assert moved.accountant.steps == 0 and moved._sampler.consumed == 0
    same = run(torch.arange(len(x)))
    same.load_state_dict(state)
    assert not set(before) & set(rows(same, 4))  # the epoch's other examples


# ------------------------------------------------------------------ optimizer checkpoints


def test_a_checkpoint_of_the_optimizer_given_to_make_private_is_not_a_fresh_start():
    """Opacus's checkpoint recipe, ``torch.save({"model": ..., "optimizer":
    optimizer.state_dict()})``, with ``optimizer`` the variable given to make_private (in
    privlearn it stays the plain optimizer; the DP one is ``p.optimizer``): its state
    carried no count of the private steps, so loading it into a fresh run, through
    either optimizer, continued 3 steps of training with an accountant at 0. Refused,
    nothing loaded; a run composed after the earlier one takes it."""
    model = toy_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    p = make_private(
        model,
        opt,
        DataLoader(toy_data(), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    train_steps(p, 3)
    saved = opt.state_dict()

    fresh = toy_mlp()
    fresh.load_state_dict(model.state_dict())
    given = torch.optim.Adam(fresh.parameters(), lr=0.01)
    q = make_private(
        fresh,
        given,
        DataLoader(toy_data(), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=1,
    )
    for load in (q.optimizer.load_state_dict, given.load_state_dict):
        with pytest.raises(ConfigurationError, match="after 3 private step"):
            load(saved)
    assert given.state_dict()["state"] == {} and q.accountant.steps == 0
    q.compose_after(p.accountant.mechanism())
    given.load_state_dict(saved)
    assert int(given.state_dict()["state"][0]["step"]) == 3


def test_a_live_run_s_sampler_and_noise_cannot_be_moved_back():
    """A rollback in the same process (a loss spike: back to the last checkpoint) that
    restores the parts ``p.load_state_dict`` refuses in a used run one by one,
    ``p.data_loader.batch_sampler.load_state_dict(ckpt["sampler"])`` and
    ``p.optimizer.noise.load_state_dict(ckpt["noise"])``: the next steps drew again the
    batches of steps 3-4 and, with them, their noise, added to other gradients (two
    releases with one noise give their un-noised difference), all accounted as fresh
    draws. Both are refused once the run has steps; nothing is moved."""
    p = _private()
    train_steps(p, 2)
    state = p.state_dict()
    train_steps(p, 2)
    sampler, noise = p.data_loader.batch_sampler, p.optimizer.noise
    before = (sampler.state_dict(), noise.state_dict()["generators"]["cpu"])
    for part, name in ((sampler, "sampler"), (noise, "noise")):
        with pytest.raises(ConfigurationError, match="has taken 4 steps"):
            part.load_state_dict(state[name])
    assert sampler.state_dict() == before[0]
    assert torch.equal(noise.state_dict()["generators"]["cpu"], before[1])
    fresh = _private()  # a fresh run loads the whole state, as before
    fresh.load_state_dict(state)
    assert fresh.accountant.steps == 2


def test_a_live_run_s_correlated_noise_cannot_be_moved_back():
    """The same rollback of correlated noise's past noises (``noise="banded"``): the
    next noises would combine fresh draws with past noises other than those released,
    not the accounted ``C^{-1} z``. Refused once the run has steps; a fresh run loads
    the whole state."""
    kw = {"noise": "banded", "bands": 2, "sampling": "shuffled_epochs", "epochs": 1}
    p = _private(**kw)
    train_steps(p, 2)
    state = p.state_dict()
    train_steps(p, 1)
    with pytest.raises(ConfigurationError, match="has taken 3 steps"):
        p.optimizer.correlated.load_state_dict(state["correlated"])
    assert p.optimizer.correlated.steps == 3
    fresh = _private(**kw)
    fresh.load_state_dict(state)
    assert fresh.optimizer.correlated.steps == 2
