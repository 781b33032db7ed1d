"""FSDP2 under :class:`privlearn.torch.hf.DPTrainer` (``TrainingArguments(fsdp=...)``).

How the Trainer runs FSDP2: ``TrainingArguments`` turns ``fsdp``/``fsdp_config`` into the
arguments of accelerate's ``FullyShardedDataParallelPlugin``; the Trainer's ``Accelerator``
keeps the plugin only when its distributed type is a multi-*device* one (accelerate's
``AcceleratorState.__init__``: the FSDP branch is under ``DistributedType.MULTI_GPU``,
``MULTI_XPU``, ...), and ``Accelerator.prepare(model, optimizer)`` then shards the model
with ``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` (``fully_shard`` on the layers
the auto-wrap policy picks, on the embeddings/head group and on the root) and points the
optimizer at the sharded parameters. On CPU processes (gloo) the distributed type is
``MULTI_CPU``, so accelerate drops the plugin and wraps the model in
DistributedDataParallel instead: the run asked for FSDP and silently got DDP.

DPTrainer makes both run the same FSDP2 path:

* :func:`enable_fsdp2`: on ``MULTI_CPU`` with ``fsdp`` asked for, the Trainer's
  accelerator is switched to ``DistributedType.FSDP`` with the plugin
  ``TrainingArguments`` describes (what accelerate does on GPUs); the Trainer's own FSDP
  code then runs: sharded checkpoints (``save_fsdp_model``/``save_fsdp_optimizer``,
  torch.distributed.checkpoint with ``state_dict_type="SHARDED_STATE_DICT"``), loading on
  resume, no DDP wrapper;
* :func:`shard_model`: the DP engine must see the sharded model, so before
  :func:`~privlearn.torch.make_private` the model is sharded with accelerate's own
  ``fsdp2_prepare_model`` (same policy, same mesh as ``Accelerator.prepare`` would use;
  ``prepare`` later finds it sharded and leaves it), and the Trainer's optimizer is built
  over the sharded ``DTensor`` parameters. The DP step is then
  :mod:`privlearn.torch.fsdp`'s: whole-gradient per-example norms, one reduce-scatter of
  the clipped sums, noise ``N(0, (sigma C)^2)`` once per coordinate, accounting at the
  global rate ``q = W B / N``.

* :class:`FSDP2Support`: torch.distributed.checkpoint gets the torch optimizer the DP
  optimizer wraps (``Accelerator.prepare`` too, in every mode:
  :mod:`privlearn.torch._hf_optim`), the Trainer's steps the DP optimizer;
* :func:`stand_in_pass`: a rank whose Poisson batch is empty still runs the collectives
  of a forward and backward pass.

Refused before any step: FSDP1 (``fsdp_config={"version": 1}``; accelerate's FSDP1
plugin cannot even be built on CPU: "There are currently no available devices found"),
``cpu_offload``, activation/gradient checkpointing and mixed precision (``bf16``/``fp16``,
FSDP2's ``MixedPrecisionPolicy``): not run with the sharded DP step yet; on CPU processes
``state_dict_type="FULL_STATE_DICT"`` (transformers' default: ``Trainer.save_model``
gathers the model and ``save_pretrained`` fails on it, for a plain Trainer too:
"Cannot flatten unevenly sharded tensor" in ``remove_tied_weights_from_state_dict`` for
tied embeddings, "Attempted to access the data pointer on an invalid python storage" in
safetensors' ``save_file`` without); an auto-wrap policy that wraps the embeddings' module
(``fsdp2_prepare_model`` then calls ``fully_shard`` on the embeddings again and torch
fails with "Invariant encountered: value was None" in ``DeviceMesh._concatenate``).
"""

from __future__ import annotations

from privlearn.errors import ConfigurationError
from privlearn.torch._hf_optim import torch_optimizer

__all__ = ["fsdp_asked", "refuse_unsupported", "refuse_parallelism", "enable_fsdp2",
           "is_fsdp2", "shard_model", "stand_in_pass", "FSDP2Support"]


def fsdp_asked(args) -> bool:
    """Whether ``TrainingArguments`` ask for FSDP (``fsdp=True`` or a legacy string)."""
    return bool(getattr(args, "fsdp", None)) and not (args.fsdp_config or {}).get("xla")


def refuse_unsupported(args) -> None:
    """Refuse, before any step, the FSDP settings the sharded DP step does not run."""
    plugin = getattr(args, "fsdp_plugin_args", None) or {}
    bad = []
    if int(plugin.get("fsdp_version", 2)) != 2:
        bad.append("FSDP1 (fsdp_config version 1): use fsdp_config={'version': 2} (FSDP2, "
                   "fully_shard)")
    if plugin.get("cpu_offload"):
        bad.append("cpu_offload (the DP step builds each rank's clipped sum at full size on "
                   "the parameters' device)")
    if plugin.get("activation_checkpointing") or any(
            getattr(args, k, False) for k in ("gradient_checkpointing",
                                              "activation_checkpointing")):
        bad.append("activation/gradient checkpointing (the recomputation inside FSDP2's "
                   "units is not run with the sharded DP step yet)")
    if args.bf16 or args.fp16:
        bad.append("bf16/fp16 (FSDP2's MixedPrecisionPolicy casts the gathered parameters; "
                   "the sharded DP step is tested in float32 only): train in float32, or "
                   "with DDP (no fsdp) in bf16")
    if bad:
        raise ConfigurationError("DPTrainer with TrainingArguments(fsdp=...) does not "
                                 "support " + "; ".join(bad))


def refuse_parallelism(trainer) -> None:
    """Refuse what DPTrainer does not run: several GPUs in one process, DeepSpeed, tensor
    parallelism, FSDP other than FSDP2 over the processes of the run."""
    a = trainer.args
    sharded = [n for n in ("deepspeed", "tp") if getattr(trainer, f"is_{n}_enabled", False)]
    if fsdp_asked(a) and not is_fsdp2(trainer):
        sharded.append("fsdp")
    if a.n_gpu > 1 or sharded or (a.world_size > 1 and str(getattr(
            a.parallel_mode, "value", a.parallel_mode)) != "distributed"):
        raise ConfigurationError(
            f"DPTrainer trains in one process, with DistributedDataParallel or with FSDP2 "
            f"(torchrun or accelerate launch, one process per device), got world_size="
            f"{a.world_size}, n_gpu={a.n_gpu}, parallel mode {a.parallel_mode}"
            f"{', ' + '/'.join(sharded) + ' enabled' if sharded else ''}. For FSDP2 pass "
            "TrainingArguments(fsdp=True, fsdp_config={'version': 2}) to every process, or "
            "use privlearn.torch.make_private on a fully_shard-ed model; nn.DataParallel "
            "(several GPUs in one process) is not supported: launch one process per GPU")


def enable_fsdp2(trainer) -> None:
    """Run accelerate's FSDP2 path on CPU processes too (module docstring): where the
    Trainer's accelerator dropped the FSDP plugin (distributed type ``MULTI_CPU``),
    give it the plugin the ``TrainingArguments`` describe."""
    args = trainer.args
    if not fsdp_asked(args):
        return
    refuse_unsupported(args)
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    missing = [n for n in ("_save_optimizer_and_scheduler",)
               if not hasattr(super(FSDP2Support, trainer), n)]
    if missing:  # the Trainer methods FSDP2Support hooks (transformers 5.17 to 5.24 have them)
        raise ConfigurationError(
            f"DPTrainer with TrainingArguments(fsdp=...) needs Trainer.{missing[0]}, which "
            "this transformers version does not have; use transformers>=5.17,<6, or DDP")
    state = trainer.accelerator.state
    if state.distributed_type == DistributedType.FSDP and state.fsdp_plugin is not None:
        trainer.is_fsdp_enabled = True
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        return  # one process: the Trainer refuses fsdp itself; others: refused by DPTrainer
    if "FULL" in str(args.fsdp_plugin_args.get("state_dict_type", "")).upper():
        raise ConfigurationError(
            "DPTrainer with TrainingArguments(fsdp=...) on CPU processes needs "
            "fsdp_config={'state_dict_type': 'SHARDED_STATE_DICT'} (checkpoints of the "
            "sharded model and optimizer through torch.distributed.checkpoint): with "
            "FULL_STATE_DICT (transformers' default) the Trainer's save_model gathers the "
            "model and transformers' save_pretrained fails on it on CPU, for a plain Trainer "
            "as well, after the steps were taken")
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def is_fsdp2(trainer) -> bool:
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(getattr(trainer, "is_fsdp_enabled", False)) and plugin is not None and \
        getattr(plugin, "fsdp_version", 1) == 2


def shard_model(trainer) -> None:
    """Shard ``trainer.model`` as ``Accelerator.prepare`` would (accelerate's
    ``fsdp2_prepare_model``), unless it is already sharded, before the optimizer and the
    DP engine are built over its parameters."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule

    model = trainer.model
    if isinstance(model, FSDPModule):
        return
    if trainer.optimizer is not None:
        raise ConfigurationError(
            "under TrainingArguments(fsdp=...) DPTrainer shards the model before building "
            "the optimizer over its sharded parameters; an optimizer passed in (optimizers="
            "...) holds the unsharded ones and would update nothing. Pass "
            "optimizer_cls_and_kwargs=(cls, kwargs) instead")
    plugin = trainer.accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    _check_wrap_policy(plugin, model)
    model = fsdp2_prepare_model(trainer.accelerator, model)
    trainer.model = trainer.model_wrapped = model


def _check_wrap_policy(plugin, model) -> None:
    """Refuse an auto-wrap policy that wraps a module holding the input or output
    embeddings: ``fsdp2_prepare_model`` (accelerate 1.15) shards the embeddings again
    after the policy's modules and fails on their already sharded parameters (BERT,
    whose ``_no_split_modules`` lists ``BertEmbeddings``)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.other import get_module_children_bottom_up

    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        return
    ends = [m for m in (getattr(model, "get_input_embeddings", lambda: None)(),
                        getattr(model, "get_output_embeddings", lambda: None)())
            if m is not None]
    for module in get_module_children_bottom_up(model)[:-1]:
        if policy(module) and any(e is not module and any(e is s for s in module.modules())
                                  for e in ends):
            raise ConfigurationError(
                f"the FSDP auto-wrap policy wraps {type(module).__name__}, which holds the "
                "model's embeddings, and accelerate's FSDP2 preparation then shards the "
                "embeddings a second time (it fails on their sharded parameters). Name the "
                "transformer block class alone: TrainingArguments(fsdp_config={'version': "
                "2, 'transformer_layer_cls_to_wrap': ['<the block class, e.g. BertLayer>'], "
                "...})")


def stand_in_pass(trainer, model) -> None:
    """This rank's Poisson batch is empty: run the forward and backward passes of one
    stand-in example (the training set's first, collated as the loader collates) with its
    loss multiplied by zero, then discard everything the engine recorded from them.

    Under FSDP2 every forward and backward all-gathers the layers' parameters, so a rank
    that skipped its passes would leave the other ranks waiting in (or mismatched with)
    their collectives; and a batch of zero rows cannot run through most transformers
    models (GPT-2 reshapes the attention mask to ``(0, -1)``). Nothing of the stand-in
    reaches the step: its loss is multiplied by zero, the engine's records are cleared
    before ``step()``, whose batch has no example on this rank."""
    p = trainer.privacy_engine
    batch = getattr(trainer, "_fsdp_stand_in", None)
    if batch is None:
        loader = p.data_loader
        batch = loader.collate_fn([loader.dataset[0]])
        trainer._fsdp_stand_in = batch
    model.train()
    inputs = trainer._prepare_inputs(batch)
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss * 0.0)
    p.optimizer.tracker.clear()


class FSDP2Support:
    """The Trainer methods :class:`~privlearn.torch.hf.DPTrainer` overrides for FSDP2
    (a mixin placed before ``transformers.Trainer``; without FSDP each one is the
    Trainer's own).

    * ``create_accelerator_and_postprocess``: :func:`enable_fsdp2` after the Trainer's;
    * ``_save_optimizer_and_scheduler``: torch.distributed.checkpoint (whose
      ``get/set_optimizer_state_dict`` call ``step()`` on an optimizer without state,
      with zero gradients and a zero learning rate, to create it) gets the torch
      optimizer the DP optimizer wraps: the same parameters, the same state, a ``step()``
      that changes nothing at a zero learning rate; a DP step there would draw noise and
      count a step for no batch. ``Accelerator.prepare`` (which, under FSDP2, accepts only
      a ``torch.optim.Optimizer`` next to the model) gets it too, in every mode
      (:class:`~privlearn.torch._hf_optim.OptimizerHandoff`); training steps go through
      the DP optimizer.
    """

    def create_accelerator_and_postprocess(self):
        if fsdp_asked(self.args):  # before accelerate builds the plugin (FSDP1's fails on CPU)
            refuse_unsupported(self.args)
        super().create_accelerator_and_postprocess()
        enable_fsdp2(self)

    def _save_optimizer_and_scheduler(self, output_dir):
        with torch_optimizer(self, active=is_fsdp2(self)):
            return super()._save_optimizer_and_scheduler(output_dir)
