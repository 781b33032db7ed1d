"""DPTrainer under DistributedDataParallel: 2 CPU processes (gloo), as torchrun starts them.

(a) Noise off, sampling rate 1 (2 ranks x 4 = all 8 examples every step): after 3 steps
    both ranks hold the parameters of a naive single-process loop (batch-of-one backward
    passes, clipped per example, summed, divided by 8) for a small GPT-2.
(b) Noise on: the logged epsilon is identical on both ranks and equals the accountant's
    for q = 1; a run resumed from the checkpoint of step 2 (each rank's private state
    under private_state_dir) ends with the uninterrupted run's parameters and epsilon,
    although it was built with another seed and other initial weights.
(c) Noise on, Poisson sampling at q = 2 x 2 / 8, one step, a clipping bound so small that
    the update is the noise: both ranks account the global rate q (not the rank's 2 / 8)
    and epsilon of one subsampled Gaussian step at q; the update has standard deviation
    sigma C lr / (q N) over its coordinates (each rank's N(0, (sigma C)^2 / 2) summed
    once: noise added twice, or DDP averaging the sums, would give sqrt(2) or 1/2 times
    it). Given a ledger budget on rank 0 (None on rank 1), the run is recorded in it once,
    at the epsilon of that one step.
FSDP2 through the Trainer: test_hf_fsdp.py.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _ranks import one_worker, shared_ranks  # noqa: E402
from hf_models import BatchSet  # noqa: E402

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
TIMEOUT = 900.0  # run_ranks' default
N = 8
PER_RANK = 4
C = 0.05
LR = 0.5
STEPS = 4
SIGMA = 2.0
TINY = 1e-6  # the clipped sum is negligible beside the noise


def _model():
    from hf_models import build

    return build("gpt2", dtype=torch.float32, seed=3)


def _flat(model):
    return torch.cat([p.detach().reshape(-1).double().clone() for p in model.parameters()])


def _trainer(out, private_dir, sigma, steps, save=False, seed=3, per_rank=PER_RANK, clip=C,
             ledger=None, accumulation=1):
    from privlearn.torch.hf import DPTrainer, PrivacyArguments

    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_rank, max_steps=steps,
        learning_rate=LR, logging_steps=1, report_to=[], use_cpu=True, ddp_backend="gloo",
        lr_scheduler_type="constant", disable_tqdm=True, dataloader_pin_memory=False,
        optim="sgd", save_strategy="steps" if save else "no", save_steps=2,
        gradient_accumulation_steps=accumulation)
    model = _model()
    if seed != 3:  # other weights: a resumed run must load the checkpoint's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    return DPTrainer(model=model, args=args, train_dataset=BatchSet("gpt2", N),
                     private_state_dir=private_dir if save else None, ledger=ledger,
                     privacy=PrivacyArguments(noise_multiplier=sigma, max_grad_norm=clip,
                                              seed=seed))


def _scenario(rank: int, tmp: str) -> dict:
    """This module's runs on ``rank`` of the shared group (``_ranks.SHARED``)."""
    # accelerate asks for MASTER_ADDR/PORT, but uses the group already initialised: no
    # process listens on this port
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    # the shared group (made before) is the one the Trainer (accelerate) finds and keeps
    warnings.simplefilter("ignore")
    res = {}
    tr = _trainer(os.path.join(tmp, "exact"), None, 0.0, 3)
    tr.train()
    res["exact"] = _flat(tr.model)
    # the same logical batches (2 ranks x 2 x 2 = all 8 examples) in chunks of 2 rows
    tr = _trainer(os.path.join(tmp, "chunks"), None, 0.0, 3, per_rank=2, accumulation=2)
    tr.train()
    res["chunks"] = _flat(tr.model)
    # Poisson at q = 2 x 1 x 2 / 8: each rank trains its own number of chunks per step
    tr = _trainer(os.path.join(tmp, "poisson"), None, SIGMA, 3, seed=4, per_rank=1,
                  accumulation=2)
    tr.train()
    res["poisson"] = (_flat(tr.model), tr.epsilon(), tr.privacy_engine.accountant.steps)
    from privlearn.ledger import Ledger

    path = os.path.join(tmp, "privacy.db")
    if rank == 0:  # a ledger budget, handed to the trainer of rank 0
        Ledger(path, create=True).create_budget("toy", epsilon=50.0, delta=1e-5)
    torch.distributed.barrier()
    budget = Ledger(path).budget("toy")
    tr = _trainer(os.path.join(tmp, "noise"), None, SIGMA, 1, seed=5, per_rank=2, clip=TINY,
                  ledger=budget if rank == 0 else None)  # the first process's is the one
    start = _flat(tr.model)
    tr.train()
    p = tr.privacy_engine
    res["noise"] = (_flat(tr.model) - start, p.sampling_rate, tr.epsilon())
    torch.distributed.barrier()
    res["ledger"] = ([e.kind for e in budget.history()], budget.spent().epsilon_spent)
    priv = os.path.join(tmp, "private")
    tr = _trainer(os.path.join(tmp, "full"), priv, 1.0, STEPS, save=True)
    tr.train()
    res["full"] = (_flat(tr.model), tr.epsilon(),
                   [h["epsilon"] for h in tr.state.log_history if "epsilon" in h])
    # another seed and other initial weights: only the checkpoint can give the same run
    tr = _trainer(os.path.join(tmp, "full"), priv, 1.0, STEPS, save=True, seed=99)
    tr.train(resume_from_checkpoint=os.path.join(tmp, "full", "checkpoint-2"))
    res["resumed"] = (_flat(tr.model), tr.epsilon())
    del tr
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def test_ddp_trainer_equals_naive_loop(ranks, oracle):
    from hf_models import loss_of

    model = _model().double()
    data = BatchSet("gpt2", N)
    params = list(model.parameters())
    start = _flat(model)
    def loss(i):
        out = model(input_ids=data.ids[i:i + 1], attention_mask=data.mask[i:i + 1])
        return loss_of("gpt2", out, data.labels[i:i + 1])

    for _ in range(3):  # q = 1: every example in every step, normalised by q N = 8
        total, _ = oracle.clip_and_sum(oracle.grads(loss, N, params), C)
        oracle.sgd_step(params, total, LR, N)
    naive = _flat(model)
    r0, r1 = ranks[0]["exact"], ranks[1]["exact"]
    assert (naive - start).abs().max() > 1e-4
    torch.testing.assert_close(r0, r1, rtol=0, atol=0)
    torch.testing.assert_close(r0, naive, rtol=1e-4, atol=1e-6)


def test_ddp_trainer_with_gradient_accumulation(ranks):
    """gradient_accumulation_steps=2 with 2 rows per rank is the logical batch of 4 per
    rank: the parameters of the run with 4 rows per rank (the naive loop's, above); with
    Poisson batches (each rank its own number of chunks) both ranks stay identical, and
    epsilon is that of 3 steps at the logical rate 2 x 1 x 2 / 8."""
    from privlearn.accounting import Gaussian, compose, subsample

    for r in ranks:
        torch.testing.assert_close(r["chunks"], r["exact"], rtol=1e-5, atol=1e-7)
    (p0, eps0, steps0), (p1, eps1, steps1) = ranks[0]["poisson"], ranks[1]["poisson"]
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)
    want = compose(subsample(Gaussian(SIGMA), rate=WORLD * 2 / N), steps=3).epsilon(1e-5)
    assert steps0 == steps1 == 3
    assert eps0 == eps1 == pytest.approx(want, rel=1e-9)


def test_ddp_trainer_epsilon_logs_and_resume(ranks):
    from privlearn.accounting import Gaussian, compose

    (p0, eps0, logs0), (p1, eps1, logs1) = ranks[0]["full"], ranks[1]["full"]
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)
    assert eps0 == eps1 and logs0 == logs1 and len(logs0) >= STEPS
    # q = 1: the run is STEPS compositions of the Gaussian mechanism of multiplier 1
    assert eps0 == pytest.approx(compose(Gaussian(1.0), steps=STEPS).epsilon(1e-5),
                                 rel=1e-3)
    for r in ranks:
        full, eps, _ = r["full"]
        resumed, eps_r = r["resumed"]
        torch.testing.assert_close(resumed, full, rtol=0, atol=0)
        assert eps_r == pytest.approx(eps)


def test_ddp_trainer_accounts_the_global_rate_and_adds_the_noise_once(ranks):
    from privlearn.accounting import Gaussian, compose, subsample

    (u0, q0, eps0), (u1, q1, eps1) = ranks[0]["noise"], ranks[1]["noise"]
    torch.testing.assert_close(u0, u1, rtol=0, atol=0)
    q = WORLD * 2 / N
    assert q0 == q1 == pytest.approx(q)
    want = compose(subsample(Gaussian(SIGMA), rate=q), steps=1).epsilon(1e-5)
    assert eps0 == eps1 == pytest.approx(want, rel=1e-6)
    for r in ranks:  # the run is recorded in the ledger once (not once per rank)
        kinds, spent = r["ledger"]
        assert kinds == ["budget", "reserve", "settle"]
        assert spent == pytest.approx(want, rel=1e-6)
    std = SIGMA * TINY * LR / (q * N)
    assert u0.numel() > 5000
    # ~8,000 draws: the sample standard deviation is within 4% (about 5 standard errors)
    assert u0.std().item() == pytest.approx(std, rel=0.04)
