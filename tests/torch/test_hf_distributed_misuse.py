"""DPTrainer misused on several processes (2 gloo processes, as torchrun starts them):
refused on every process with a typed error, before any step, never a hang.

(a) ``TrainingArguments(ddp_static_graph=True)``: refused when the trainer is built (the
    Trainer wraps the model in a static-graph DDP after make_private, whose first
    backward failed inside DDP with an internal assertion).
(b) Another ``dp_seed`` on each process: refused when training starts, naming both seeds
    (each process's sampler and noise streams derive from the one seed).
(c) One process never starts training: the other waits
    ``PrivacyArguments(agreement_timeout=...)`` seconds, then raises
    ``RanksNotArrivedError`` saying where the setting is given, instead of waiting in the
    trainer's first collective until the group's own timeout (30 minutes) or until the
    missing process exits (a bare gloo error).
(d) One process's ``per_device_train_batch_size`` larger than the training set allows:
    that process refuses it and the other raises the same error type naming it at once
    (before, it waited its ``agreement_timeout`` for the refusing process, then raised
    ``RanksNotArrivedError`` on a group it left unusable).
(e) A checkpoint saved where only rank 0 finds it (each process its own output_dir),
    resumed on both: refused at once on both processes.
"""

from __future__ import annotations

import gc
import os
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
from _ranks import init_gloo, one_worker, run_ranks  # noqa: E402
from hf_models import FeatureModel, FeatureSet  # noqa: E402

pytestmark = [one_worker(__name__), pytest.mark.slow]
WORLD = 2
TIMEOUT = 4.0  # seconds rank 0 waits for rank 1
ABSENT = 1  # the rank that never calls train()


def _worker(rank: int, tmp: str) -> None:
    # accelerate asks for MASTER_ADDR/PORT, but uses the group initialised below
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )
    init_gloo(rank, WORLD, tmp)
    warnings.simplefilter("ignore")
    try:
        from privlearn.torch.hf import DPTrainer, PrivacyArguments

        def trainer(name, privacy, batch=2, private=None, **kw):
            settings = dict(
                output_dir=os.path.join(tmp, name),
                per_device_train_batch_size=batch,
                max_steps=1,
                report_to=[],
                use_cpu=True,
                ddp_backend="gloo",
                disable_tqdm=True,
                dataloader_pin_memory=False,
                save_strategy="no",
            )
            args = transformers.TrainingArguments(**{**settings, **kw})
            torch.manual_seed(0)
            return DPTrainer(
                model=FeatureModel(),
                args=args,
                train_dataset=FeatureSet(16),
                privacy=privacy,
                private_state_dir=private,
            )

        out = {}
        sigma = PrivacyArguments(noise_multiplier=1.0, seed=1)
        try:
            trainer("static", sigma, ddp_static_graph=True)
            out["static"] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the type is what the test checks
            out["static"] = (type(exc).__name__, str(exc))
        try:
            trainer("seed", PrivacyArguments(noise_multiplier=1.0, seed=1 + rank)).train()
            out["seed"] = ("no error", "")
        except Exception as exc:  # noqa: BLE001
            out["seed"] = (type(exc).__name__, str(exc))
        # rank 1 alone refuses its batch (2 x 16 > the 16 examples): rank 0 hears it at once
        start = time.monotonic()
        try:
            sigma = PrivacyArguments(noise_multiplier=1.0, agreement_timeout=60.0)
            trainer("batch", sigma, batch=16 if rank == 1 else 2).train()
            out["batch"] = ("no error", "", time.monotonic() - start)
        except Exception as exc:  # noqa: BLE001
            out["batch"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        # each process its own output_dir (nodes without a shared disk): the checkpoint's
        # model is written by rank 0 only, then every process resumes from its last one
        sigma = PrivacyArguments(noise_multiplier=1.0, seed=1, agreement_timeout=60.0)
        kw = dict(save_strategy="steps", save_steps=1, private=os.path.join(tmp, f"p{rank}"))
        trainer(f"ckpt{rank}", sigma, **kw).train()
        start = time.monotonic()
        try:
            trainer(f"ckpt{rank}", sigma, max_steps=2, **kw).train(resume_from_checkpoint=True)
            out["resume"] = ("no error", "", time.monotonic() - start)
        except Exception as exc:  # noqa: BLE001
            out["resume"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        late = trainer("late", PrivacyArguments(noise_multiplier=1.0, agreement_timeout=TIMEOUT))
        if rank == ABSENT:
            time.sleep(2.5 * TIMEOUT)  # busy elsewhere: never calls train()
            out["late"] = None
        else:
            start = time.monotonic()
            try:
                late.train()
                out["late"] = ("no error", "", time.monotonic() - start)
            except Exception as exc:  # noqa: BLE001
                out["late"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    finally:  # a monitored barrier that timed out closes the group's pairs: no
        gc.collect()  # closing barrier, the group is destroyed as it is
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("hf_misuse"), WORLD, timeout=180.0)


def test_a_trainer_waits_its_agreement_timeout_for_a_process_that_never_trains(ranks):
    kind, said, waited = ranks[0]["late"]
    assert kind == "RanksNotArrivedError", (kind, said)
    assert waited < TIMEOUT + 30, waited  # bounded by the timeout, not gloo's 30 minutes
    assert f"agreement_timeout={TIMEOUT:g} s on rank 0" in said
    assert f"rank {ABSENT} of {WORLD} did not reach DPTrainer.train" in said
    assert "pass a larger agreement_timeout to PrivacyArguments" in said


def test_a_static_graph_ddp_is_refused_when_the_trainer_is_built(ranks):
    for r in ranks:
        kind, said = r["static"]
        assert kind == "ConfigurationError", (kind, said)
        assert "ddp_static_graph=True is not supported by DPTrainer" in said


def test_another_seed_on_each_process_is_refused_on_every_process(ranks):
    for r in ranks:
        kind, said = r["seed"]
        assert kind == "ConfigurationError", (kind, said)
        assert "seed: rank 0: 1, rank 1: 2" in said


def test_a_batch_refused_on_one_process_is_refused_at_once_on_every_process(ranks):
    """Rank 1's per_device_train_batch_size exceeds the training set: rank 1 refuses it,
    and rank 0 raises the same type naming rank 1 at once, instead of waiting its
    agreement_timeout (60 s) for rank 1 and then leaving the group unusable."""
    for rank, r in enumerate(ranks):
        kind, said, waited = r["batch"]
        assert kind == "ConfigurationError", (rank, kind, said)
        assert "per_device_train_batch_size=16" in said
        assert waited < 20, (rank, waited)
    assert "DPTrainer.train was refused on rank(s) [1] of 2" in ranks[0]["batch"][1]


def test_a_checkpoint_found_by_one_process_only_is_refused_at_once_on_every_process(ranks):
    """Each process with its own output_dir: the checkpoint (and its privacy state) is
    rank 0's alone. Rank 1 finds no checkpoint; rank 0 refuses its checkpoint as one
    holding another number of processes' states. Both raise at once, neither waits."""
    for rank, r in enumerate(ranks):
        kind, said, waited = r["resume"]
        assert kind != "no error" and waited < 20, (rank, kind, said, waited)
    kind, said, _ = ranks[0]["resume"]
    assert kind == "ConfigurationError" and "number of processes must stay the same" in said
