"""DP-SGD for PyTorch: per-example clipping without example loops, Poisson sampling,
noise, accounting and distributed training.

The ordinary training loop runs unchanged on what :func:`make_private` returns::

    import torch
    from privlearn.torch import make_private

    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(train_set, batch_size=256)
    p = make_private(model, optimizer, loader, target_epsilon=3.0, target_delta=1e-5,
                     epochs=10, max_grad_norm=1.0)
    loss_fn = torch.nn.CrossEntropyLoss()          # mean reduction (the default)
    for epoch in range(10):
        for x, y in p.data_loader:                 # Poisson batches, rate 256 / N
            p.optimizer.zero_grad()
            loss_fn(p.model(x), y).backward()
            p.optimizer.step()                     # clip, sum, noise, / (q N), step
    print(p.accountant.epsilon(1e-5))              # for the steps actually taken

How it works: forward hooks record each layer's inputs and tensor hooks its output
gradients during ``backward()``; before the first step a probe checks that each
example's outputs depend on that example alone (:mod:`privlearn.torch.probe`);
``optimizer.step()`` computes per-example gradient norms layer by layer (ghost norms or
batched outer products, see :mod:`privlearn.torch.grad_sample`; PyTorch's own
``nn.LSTM``/``nn.GRU``/``nn.RNN`` in :mod:`privlearn.torch.rnn` and
``nn.MultiheadAttention`` in :mod:`privlearn.torch.attention`, used as they are; any
other layer through a ``torch.func`` fallback), clip factors over all parameters, the
clipped sum as one weighted matmul per layer, adds Gaussian noise once per logical step
and divides by the expected batch size. Autograd's non-private parameter gradients are
not computed (each layer's forward runs on detached aliases of its parameters;
``requires_grad`` is never changed). Hugging Face models, LoRA, mixed precision,
``torch.compile`` and per-layer clipping: see docs/guides/pytorch.md.

Notes
-----
* ``loss_reduction`` ("mean", default, or "sum") must describe how the loss reduces over
  the batch dimension; with "mean" the engine rescales by the realised batch size.
* A Poisson batch can be empty: the loader then yields zero-length tensors and the step
  still adds noise (the model must accept a batch of size 0, as Linear/Conv/Embedding
  do; otherwise skip the forward/backward but still call ``p.optimizer.step()``).
* Virtual batches: ``max_physical_batch_size=k`` makes ``p.data_loader`` yield chunks of
  at most ``k`` examples; the loop is unchanged (call ``step()`` after every chunk).
* Distributed: see :mod:`privlearn.torch.distributed`.
* ``p.model`` must stay in training mode; ``model.eval()`` forwards are not recorded.
"""

import sys

from privlearn._opacus_names import missing_name
from privlearn.errors import (
    BatchDependenceError,
    NonFiniteInputError,
    PrivacyBudgetWarning,
    RanksNotArrivedError,
    TrainingLoopError,
    UnsupportedModuleError,
    UntestedTorchWarning,
)
from privlearn.torch import _version  # noqa: F401  (first: refuses an unsupported torch)
from privlearn.torch._allocator import retain_freed_memory
from privlearn.torch.accountant import BudgetCap, PrivacyAccountant, Segment
from privlearn.torch.config import Clipping, DPConfig, Noise, Reduction
from privlearn.torch.data import (
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    VirtualBatchLoader,
)
from privlearn.torch.distributed import DistributedPoissonBatchSampler
from privlearn.torch.grad_sample import (
    LayerRule,
    Layout,
    register_instrumenter,
    register_layout,
    register_predicate_rule,
    register_rule,
)
from privlearn.torch.losses import per_sequence_cross_entropy
from privlearn.torch.noise import NoiseSource
from privlearn.torch.optimizer import AdaptiveClipping, DPOptimizer
from privlearn.torch.privacy_engine import Plan, PrivateTraining, make_private
from privlearn.torch.tracker import GradSampleTracker
from privlearn.torch.validator import (
    fix,
    register_fixer,
    register_validator,
    validate,
)

__all__ = [
    "AdaptiveClipping",
    "BatchDependenceError",
    "NonFiniteInputError",
    "TrainingLoopError",
    "RanksNotArrivedError",
    "BudgetCap",
    "Clipping",
    "DPConfig",
    "DPOptimizer",
    "DistributedPoissonBatchSampler",
    "FixedSizeBatchSampler",
    "GradSampleTracker",
    "LayerRule",
    "Layout",
    "Noise",
    "NoiseSource",
    "Plan",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "PrivacyBudgetWarning",
    "PrivateTraining",
    "Reduction",
    "Segment",
    "UnsupportedModuleError",
    "UntestedTorchWarning",
    "VirtualBatchLoader",
    "fix",
    "make_private",
    "per_sequence_cross_entropy",
    "register_fixer",
    "register_instrumenter",
    "register_layout",
    "register_predicate_rule",
    "register_rule",
    "register_validator",
    "retain_freed_memory",
    "validate",
]


def __getattr__(name: str):
    # only for names not defined above: Opacus's (PrivacyEngine, ...) say what to use
    raise missing_name(__name__, name, sys._getframe(1))
