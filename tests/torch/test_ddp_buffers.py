"""DistributedDataParallel's buffer broadcast and empty Poisson batches: 2 CPU processes
(gloo).

DDP (``broadcast_buffers=True``, its default) broadcasts the module's buffers from rank 0
in the forward pass that follows a synchronised backward, and in the first forward; a
rank whose Poisson batch is empty may run no forward at all (DPTrainer trains on nothing;
a make_private loop may skip the forward and call ``step()`` alone). Rank 1's first batch
is made empty here (a seed found for it, the sizes checked), with models that hold
buffers: a toy with a non-persistent buffer (make_private, the loop skips the forward
on an empty batch; the model wrapped in DDP before make_private, and after it:
``DistributedDataParallel(p.model)``, whose forwards broadcast the buffers unless the
model names them as left alone) and a tiny Llama (rotary ``inv_freq``) under DPTrainer.
With the ranks disagreeing on the number of DDP forwards, a broadcast on one rank meets
the engine's all-reduce on the other: the run hangs (the ranks are ended after
``TIMEOUT`` seconds) or pairs mismatched collectives. Every run must finish, with the
same parameters on both ranks, moved by the steps.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
from _ranks import one_worker, shared_ranks  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = one_worker("shared-ddp")  # one group runs the modules of _ranks.SHARED["shared-ddp"]
WORLD = 2
N = 8
PER_RANK = 1  # q = 2 / 8: each rank's part (4 examples) is empty with probability 0.32
STEPS = 3
TIMEOUT = 120.0  # a hang fails fast (imports and a tiny Llama take a few seconds a rank)


class _Scaled(nn.Module):
    """A linear model whose input is scaled by a registered (non-persistent) buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.lin = nn.Linear(6, 3)
        self.register_buffer("scale", torch.full((6,), 0.5), persistent=False)

    def forward(self, x):
        return self.lin(x * self.scale)


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(N, 6, generator=g),
                                          torch.randint(0, 3, (N,), generator=g))


def _private(seed, ddp):
    from privlearn.torch import make_private

    model = _Scaled()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                        torch.utils.data.DataLoader(_data(), batch_size=PER_RANK),
                        noise_multiplier=0.0, max_grad_norm=1.0, seed=seed)


def _seed_with_empty_first_batch_on_rank_1():
    """The first seed whose first Poisson batch is empty on rank 1 and not on rank 0."""
    for seed in range(100):
        p = _private(seed, ddp=False)
        size = len(next(iter(p.data_loader.batch_sampler)))
        sizes = [None] * WORLD
        dist.all_gather_object(sizes, size)
        if sizes[0] > 0 and sizes[1] == 0:
            return seed
    raise AssertionError("no seed in range(100) gives rank 1 an empty first batch")


def _flat(model):
    return torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()])


def _make_private_run(seed):
    """make_private + DDP; the loop skips the forward and backward of an empty batch."""
    p = _private(seed, ddp=True)
    start = _flat(p.model.module)
    sizes = []
    loss_fn = nn.CrossEntropyLoss()
    it = iter(p.data_loader)
    for _ in range(STEPS):
        x, y = next(it)
        sizes.append(len(x))
        p.optimizer.zero_grad()
        if len(x):
            loss_fn(p.model(x), y).backward()
        p.optimizer.step()
    end = _flat(p.model.module)
    # DDP's forward buffer broadcast is off for the run, and back after detach()
    flags = [p.model.require_forward_param_sync]
    p.detach()
    flags.append(p.model.require_forward_param_sync)
    return sizes, start, end, flags


def _make_private_after_run(seed):
    """DDP made after make_private (``DistributedDataParallel(p.model)``, broadcasting the
    buffers at every forward unless make_private's model tells it not to); the loop skips
    the forward and backward of an empty batch."""
    p = _private(seed, ddp=False)
    ddp = nn.parallel.DistributedDataParallel(p.model)
    start = _flat(p.model)
    sizes, steps = [], []
    loss_fn = nn.CrossEntropyLoss()
    it = iter(p.data_loader)
    for _ in range(STEPS):
        x, y = next(it)
        sizes.append(len(x))
        p.optimizer.zero_grad()
        if len(x):
            loss_fn(ddp(x), y).backward()
        p.optimizer.step()
        steps.append(p.accountant.steps)
    end = _flat(p.model)
    # the names DDP leaves alone: the buffer while attached, as before after detach()
    flags = [list(getattr(p.model, "_ddp_params_and_buffers_to_ignore", []))]
    p.detach()
    flags.append(list(getattr(p.model, "_ddp_params_and_buffers_to_ignore", [])))
    return sizes, start, end, flags, steps


def _trainer_run(seed, out):
    """DPTrainer (DistributedDataParallel) on a tiny Llama, rank 1's first batch empty."""
    from hf_models import TokenSet, build

    from privlearn.torch.hf import DPTrainer, PrivacyArguments

    class Recording(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.sizes.append(int(inputs["input_ids"].shape[0]))
            return super().training_step(model, inputs, num_items_in_batch)

    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=PER_RANK, max_steps=STEPS,
        learning_rate=0.5, report_to=[], use_cpu=True, ddp_backend="gloo",
        lr_scheduler_type="constant", disable_tqdm=True, dataloader_pin_memory=False,
        optim="sgd", save_strategy="no")
    model = build("llama", dtype=torch.float32, seed=3)
    assert any("inv_freq" in name for name, _ in model.named_buffers())
    tr = Recording(model=model, args=args, train_dataset=TokenSet(N, 5, 97),
                   privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=1.0,
                                            seed=seed))
    tr.sizes = []
    start = _flat(model)
    tr.train()
    return tr.sizes, start, _flat(tr.model)


def _scenario(rank: int, out_dir: str) -> dict:
    """This module's runs on ``rank`` of the shared group (``_ranks.SHARED``)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # accelerate asks; unused
    warnings.simplefilter("ignore")
    seed = _seed_with_empty_first_batch_on_rank_1()
    res = {"make_private": _make_private_run(seed)}
    res["make_private_after"] = _make_private_after_run(seed)
    res["trainer"] = _trainer_run(seed, os.path.join(out_dir, "trainer"))
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return shared_ranks(__name__, tmp_path_factory)


@pytest.mark.parametrize("run", ["make_private", "make_private_after", "trainer"])
def test_empty_first_batch_on_one_rank_under_ddp_with_buffers(ranks, run):
    (sizes0, start0, end0, *flags), (sizes1, start1, end1, *_) = ranks[0][run], ranks[1][run]
    if run == "make_private":
        assert flags == [[False, True]]
    if run == "make_private_after":
        assert flags[0] == [["scale"], []]
        assert flags[1] == list(range(1, STEPS + 1))  # every step accounted, the empty one too
    assert len(sizes0) == len(sizes1) == STEPS
    assert sizes0[0] > 0 and sizes1[0] == 0  # the case under test did happen
    torch.testing.assert_close(start0, start1, rtol=0, atol=0)
    assert not torch.equal(end0, start0)  # the steps trained (rank 0's batch is not empty)
    torch.testing.assert_close(end0, end1, rtol=0, atol=1e-6)
