"""DPTrainer under FSDP2 (TrainingArguments(fsdp=True, fsdp_config={"version": 2})):
2 CPU processes (gloo), as torchrun starts them, a small GPT-2 (tied embeddings, a
vocabulary of 97 rows: unevenly sharded).

(a) The model really is sharded (FSDP2 modules, DTensor parameters holding half the rows
    on each rank), not wrapped in DDP as accelerate alone does on CPU processes.
(b) Noise off, sampling rate 1 (2 ranks x 4 = all 8 examples every step): after 3 steps
    both ranks hold the parameters of a naive single-process loop (batch-of-one backward
    passes, clipped per example at C below most norms, summed, divided by 8), for the
    GPT-2 and for a small BERT sequence classifier (sharded per BertLayer).
(c) Noise on, one step on the same full batch: the update minus the naive noise-free
    update has standard deviation sigma C lr / 8 over its ~8,000 coordinates (noise drawn
    once per coordinate of the global sum: twice would give sqrt(2) times it).
(d) Noise on, Poisson sampling at q = 2 x 1 / 8 (empty batches on a rank: it runs a
    stand-in pass, whose records are discarded), AdamW: the logs and epsilon are
    identical on both ranks, epsilon is that of 6 Poisson-subsampled Gaussian steps at
    q = 0.25; a run resumed from the checkpoint of step 2 (sharded model and AdamW state
    through torch.distributed.checkpoint, the linear learning-rate schedule, each rank's
    private state under private_state_dir), built with another seed and other weights,
    ends with the uninterrupted run's parameters and epsilon.
(e) Refused when the trainer is built: FSDP1, FULL_STATE_DICT on CPU processes, bf16;
    when training starts: BERT under accelerate's default wrap policy (it wraps
    BertEmbeddings, then shards the embeddings again and fails).
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from _ranks import one_worker, shared_ranks  # noqa: E402
from hf_models import BatchSet  # noqa: E402

pytestmark = one_worker("shared-fsdp")  # one group runs the modules of _ranks.SHARED["shared-fsdp"]
TIMEOUT = 900.0  # run_ranks' default
WORLD = 2
N = 8
C = 0.05
LR = 0.5
SIGMA = 2.0
STEPS = 6
SHARDED = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}


def _model(name="gpt2"):
    from hf_models import build

    return build(name, dtype=torch.float32, seed=3)


def _flat(model):
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach()
                      .reshape(-1).double().clone() for p in model.parameters()])


def _args(out, *, per_rank=4, steps=3, save=False, optim="sgd", lr=LR, fsdp_config=None,
          schedule="constant", **kw):
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_rank, max_steps=steps,
        learning_rate=lr, logging_steps=1, report_to=[], use_cpu=True, ddp_backend="gloo",
        lr_scheduler_type=schedule, disable_tqdm=True, dataloader_pin_memory=False,
        optim=optim, save_strategy="steps" if save else "no", save_steps=2, fsdp=True,
        fsdp_config=dict(SHARDED if fsdp_config is None else fsdp_config), **kw)


def _trainer(args, sigma, *, private_dir=None, seed=3, other_weights=False, name="gpt2",
             **kw):
    from privlearn.torch.hf import DPTrainer, PrivacyArguments

    model = _model(name)
    if other_weights:  # a resumed run must load the checkpoint's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    return DPTrainer(model=model, args=args, train_dataset=BatchSet(name, N),
                     private_state_dir=private_dir,
                     privacy=PrivacyArguments(noise_multiplier=sigma, max_grad_norm=C,
                                              seed=seed), **kw)


def _refused(make) -> str | None:
    try:
        make()
    except Exception as e:  # noqa: BLE001 - the message and type are checked
        return f"{type(e).__name__}: {e}"
    return None


def _scenario(rank: int, tmp: str) -> dict:
    """This module's run on ``rank`` of the shared group (``_ranks.SHARED``; the last of
    its group: the environment and warning filter it sets stay for the rest of the
    process)."""
    # accelerate asks for MASTER_ADDR/PORT, but uses the group the shared launch joined
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    warnings.simplefilter("ignore")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import privlearn.torch.hf as hf

    stand_ins = []
    real = getattr(hf, "stand_in_pass", None)  # count the empty batches' stand-in passes
    if real is not None:
        hf.stand_in_pass = lambda tr, m: (stand_ins.append(tr.state.global_step), real(tr, m))
    res = {}
    tr = _trainer(_args(os.path.join(tmp, "exact")), 0.0)
    tr.train()
    params = list(tr.model.parameters())
    res["sharded"] = (isinstance(tr.model, FSDPModule), all(isinstance(p, DTensor)
                                                            for p in params),
                      sum(p.to_local().numel() for p in params), sum(p.numel() for p in params),
                      type(tr.model_wrapped).__name__)
    res["exact"] = _flat(tr.model)
    # BERT: accelerate's default policy (its _no_split_modules) wraps BertEmbeddings
    bert_layers = {**SHARDED, "transformer_layer_cls_to_wrap": ["BertLayer"]}
    tr = _trainer(_args(os.path.join(tmp, "bert"), fsdp_config=bert_layers), 0.0, name="bert")
    tr.train()
    res["bert"] = _flat(tr.model)
    tr = _trainer(_args(os.path.join(tmp, "noisy"), steps=1), SIGMA, seed=5)
    tr.train()
    res["noisy"] = _flat(tr.model)
    priv = os.path.join(tmp, "private")
    full = _args(os.path.join(tmp, "full"), per_rank=1, steps=STEPS, save=True,
                 optim="adamw_torch", lr=0.01, schedule="linear")
    tr = _trainer(full, 1.0, private_dir=priv)
    tr.train()
    res["lrs"] = [h["learning_rate"] for h in tr.state.log_history if "learning_rate" in h]
    res["full"] = (_flat(tr.model), tr.epsilon(),
                   [h["epsilon"] for h in tr.state.log_history if "epsilon" in h],
                   tr.privacy_engine.sampling_rate, list(stand_ins))
    res["files"] = sorted(os.listdir(os.path.join(tmp, "full", "checkpoint-2")))
    tr = _trainer(full, 1.0, private_dir=priv, seed=99, other_weights=True)
    tr.train(resume_from_checkpoint=os.path.join(tmp, "full", "checkpoint-2"))
    res["resumed"] = (_flat(tr.model), tr.epsilon())
    out = os.path.join(tmp, "refused")
    res["refused"] = {
        "fsdp1": _refused(lambda: _trainer(_args(out, fsdp_config={"version": 1}), 1.0)),
        "full_state_dict": _refused(lambda: _trainer(
            _args(out, fsdp_config={"version": 2, "state_dict_type": "FULL_STATE_DICT"}),
            1.0)),
        "bf16": _refused(lambda: _trainer(_args(out, bf16=True), 1.0)),
        "bert_default_policy": _refused(_trainer(_args(out), 1.0, name="bert").train),
    }
    if real is not None:
        hf.stand_in_pass = real
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


def _naive(oracle, steps, name="gpt2"):
    from hf_models import loss_of

    model = _model(name).double()
    data = BatchSet(name, N)
    params = list(model.parameters())

    def loss(i):
        out = model(input_ids=data.ids[i:i + 1], attention_mask=data.mask[i:i + 1])
        return loss_of(name, out, data.labels[i:i + 1])

    start = _flat(model)
    for _ in range(steps):  # q = 1: every example in every step, normalised by q N = 8
        total, _ = oracle.clip_and_sum(oracle.grads(loss, N, params), C)
        oracle.sgd_step(params, total, LR, N)
    return start, _flat(model)


def test_fsdp_trainer_shards_the_model(ranks):
    for r in ranks:
        is_fsdp, all_dtensor, local, full, wrapped = r["sharded"]
        assert is_fsdp and all_dtensor and "DistributedDataParallel" not in wrapped
        assert local < 0.6 * full  # each rank holds about half of every parameter
    assert ranks[0]["sharded"][2] + ranks[1]["sharded"][2] == ranks[0]["sharded"][3]


@pytest.mark.parametrize("name,key", [("gpt2", "exact"), ("bert", "bert")])
def test_fsdp_trainer_equals_naive_loop(ranks, oracle, name, key):
    start, naive = _naive(oracle, 3, name)
    r0, r1 = ranks[0][key], ranks[1][key]
    assert (naive - start).abs().max() > 1e-4
    torch.testing.assert_close(r0, r1, rtol=0, atol=0)
    torch.testing.assert_close(r0, naive, rtol=1e-4, atol=1e-6)


def test_fsdp_trainer_adds_the_noise_once(ranks, oracle):
    _, naive = _naive(oracle, 1)
    r0, r1 = ranks[0]["noisy"], ranks[1]["noisy"]
    torch.testing.assert_close(r0, r1, rtol=0, atol=0)
    noise = r0 - naive
    want = SIGMA * C * LR / N
    assert noise.numel() > 5000
    # ~8,000 draws: the sample standard deviation is within 3% (4 standard errors)
    assert noise.std().item() == pytest.approx(want, rel=0.03)
    assert noise.mean().abs().item() < 4 * want / noise.numel() ** 0.5


def test_fsdp_trainer_epsilon_logs_and_resume(ranks):
    from privlearn.accounting import Gaussian, compose, subsample

    (p0, eps0, logs0, q0, stand0), (p1, eps1, logs1, q1, stand1) = (r["full"] for r in ranks)
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)
    assert q0 == q1 == pytest.approx(WORLD * 1 / N)
    assert eps0 == eps1 and logs0 == logs1 and len(logs0) >= STEPS
    want = compose(subsample(Gaussian(1.0), rate=WORLD / N), steps=STEPS).epsilon(1e-5)
    assert eps0 == pytest.approx(want, rel=1e-3)
    assert stand0 or stand1  # a rank had an empty Poisson batch and ran a stand-in pass
    # the linear schedule ran on the optimizer the DP step steps: 0.01 (1 - k / STEPS)
    lrs = ranks[0]["lrs"][:STEPS]
    assert lrs == pytest.approx([0.01 * (1 - k / STEPS) for k in range(STEPS)], abs=1e-12)
    for r in ranks:
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(r["files"])  # DCP, sharded
        assert {f"privlearn_privacy.rank{k}.pt" for k in range(WORLD)} <= set(r["files"])
        full, eps = r["full"][:2]
        resumed, eps_r = r["resumed"]
        assert (resumed - r["exact"]).abs().max() > 1e-3  # not a run that never moved
        torch.testing.assert_close(resumed, full, rtol=0, atol=1e-6)
        assert eps_r == pytest.approx(eps, rel=1e-9)


def test_fsdp_trainer_refuses_what_it_cannot_run(ranks):
    for r in ranks:
        msg = r["refused"]
        assert msg["fsdp1"].startswith("ConfigurationError") and "version': 2" in msg["fsdp1"]
        assert msg["full_state_dict"].startswith("ConfigurationError")
        assert "SHARDED_STATE_DICT" in msg["full_state_dict"]
        assert msg["bf16"].startswith("ConfigurationError") and "bf16" in msg["bf16"]
        bert = msg["bert_default_policy"]
        assert bert.startswith("ConfigurationError") and "BertEmbeddings" in bert
