"""DP-SGD on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each parameter as a ``DTensor`` sharded on its first dimension over a 1-D
device mesh (``Shard(0)``): rank ``r`` holds rows ``[r c, (r + 1) c)`` of it, with
``c = ceil(rows / W)`` (``torch.chunk``'s split). Before a layer's forward (and again
before its backward) FSDP all-gathers the full parameter and puts the unsharded tensor
in the module; the recording hooks of :class:`~privlearn.torch.tracker.GradSampleTracker`
therefore see full activations and full output gradients of this rank's examples, and
the layer rules give each example's *whole* gradient. So:

* **per-example norms** are those of the whole (unsharded) gradient: every rank computes
  them for its own examples from the full factors (no partial norms to combine);
* the **clipped sum** of this rank's examples is formed at full size, then one
  ``reduce_scatter`` (the collective FSDP itself would use) per dtype of the trainable
  parameters sums it over ranks and hands each rank the rows of its own shard, in each
  parameter's own dtype: the sum of clipped per-example gradients over the global batch;
* **noise**: each rank adds ``N(0, (sigma C)^2)`` to the coordinates of its own shard
  only, so every coordinate of the global sum gets exactly one draw of the single-process
  mechanism's noise (per-rank keys: independent draws);
* the noisy sum is divided by the global expected batch size ``q N`` and set as the
  sharded parameter's gradient (a ``DTensor`` with the parameter's placements); the
  wrapped optimizer then updates the shards as under FSDP.

At the step the layer rules run with every FSDP2 module unsharded (one more all-gather
of the parameters: rules such as the generic fallback recompute a layer from its
weights), then the modules are resharded. FSDP's own gradient reduction never runs: the
layers use detached aliases of the unsharded parameters (as on one process), so autograd
computes no parameter gradient and FSDP has nothing to reduce-scatter (its reduction
*averages* over ranks, which is not the DP-SGD normalisation). Sampling and accounting
are those of data-parallel training (:mod:`privlearn.torch.distributed`): each rank
Poisson-samples its own partition of the dataset at rate ``q = W B / N``.

Memory: the step holds this rank's clipped sum at full size (one unsharded gradient) and,
while the rules run, the unsharded parameters; between steps only the shards (parameters
and optimizer state) remain, as without privacy.

Collectives: every forward and backward of an FSDP2 model all-gathers, so every rank
must run the same number of forward/backward passes and ``step()`` calls per logical
batch, also when its own Poisson batch is empty (the loader then yields an empty batch:
run it through the model as any other). A rank that skips the forward (or the backward) of
its empty batch and calls ``step()`` alone is refused on every rank, before any
all-gather: the ranks meet at each step's first training forward and backward
(:mod:`privlearn.torch._forward_meet`).
Refused up front, with the reason:
``max_physical_batch_size`` (the ranks' chunk counts differ), correlated noise, a
``GradScaler``, and parameters that are not ``Shard(0)`` on one 1-D mesh of all the
ranks (tensor parallelism, HSDP). The batch-independence probe runs on all ranks at the
same step, each rank with two examples or more probing its own batch (every forward of
the step, as in one process: a second call on other inputs or keywords too), with as many
forward passes on every rank: the most that any rank's probe may run (the others pad,
on their step's inputs or, when their step recorded none, on their last training
forward's). It runs again at each step until every rank's batch was probed at one step.
"""

from __future__ import annotations

import torch
from torch import nn

from privlearn.errors import ConfigurationError, TrainingLoopError
from privlearn.torch import _settle as settle
from privlearn.torch.tracker import GradSampleTracker, _param_slots

__all__ = ["is_sharded", "check_sharded_model", "check_not_legacy_fsdp", "ShardedTracker",
           "ShardedGradients"]


def _dtensor_type():
    if not torch.distributed.is_available():  # pragma: no cover - torch without distributed
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def _fsdp_module_type():
    if not torch.distributed.is_available():  # pragma: no cover - torch without distributed
        return None
    from torch.distributed.fsdp import FSDPModule
    return FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds distributed tensors as parameters (FSDP2, tensor
    parallelism) or is wrapped by ``fully_shard``."""
    dt, fm = _dtensor_type(), _fsdp_module_type()
    if fm is not None and any(isinstance(m, fm) for m in model.modules()):
        return True
    return dt is not None and any(isinstance(p, dt) for p in model.parameters())


def check_not_legacy_fsdp(model: nn.Module) -> None:
    """Refuse a model holding a legacy ``FullyShardedDataParallel`` (FSDP1) wrapper.

    FSDP1 flattens each wrapped module's parameters into one flat parameter sharded over
    the ranks (``use_orig_params=False``: no layer owns it, so no per-example gradient
    can be formed for it) or exposes each rank's slice of that flat parameter as the
    layers' parameters (``use_orig_params=True``: every rank sees other shapes). Neither
    is a layout the engine can clip per example; FSDP2 (``fully_shard``) is.

    Raises
    ------
    ConfigurationError
        ``model`` is, or contains, a ``FullyShardedDataParallel`` module.
    """
    if not torch.distributed.is_available():  # pragma: no cover - torch without distributed
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, nn.Module) and any(isinstance(m, FullyShardedDataParallel)
                                            for m in model.modules()):
        raise ConfigurationError(
            "model is wrapped in the legacy FullyShardedDataParallel (FSDP1), whose flat, "
            "sharded parameters no layer owns, so their gradients cannot be clipped per "
            "example. Shard with FSDP2 instead: fully_shard(layer, mesh=mesh) on the layers "
            "and on the root model (torch.distributed.fsdp.fully_shard), then build the "
            "optimizer and call make_private; or wrap in DistributedDataParallel. Nothing "
            "was changed")


def check_sharded_model(model: nn.Module, cfg, world_size: int, optimizer=None) -> None:
    """Refuse, before any step, what the sharded DP step cannot do exactly.

    Raises
    ------
    ValueError
        A trainable parameter is not an FSDP2 ``Shard(0)`` DTensor over one 1-D mesh of
        ``world_size`` ranks (tensor or pipeline parallelism, HSDP, a legacy
        ``FullyShardedDataParallel`` flat parameter), or a setting that needs every rank
        to run its own number of passes or a noise the sharded step does not add.
    """
    from torch.distributed.tensor import Shard

    dt = _dtensor_type()
    bad = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not isinstance(p, dt):
            bad.append(f"{name} (a plain tensor: not every layer is fully_shard-ed)")
        elif p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            bad.append(f"{name} (placements {tuple(p.placements)} on a "
                       f"{p.device_mesh.ndim}-D mesh)")
        elif p.device_mesh.size() != world_size:
            bad.append(f"{name} (mesh of {p.device_mesh.size()} ranks, process group of "
                       f"{world_size})")
        elif p.dim() == 0:
            bad.append(f"{name} (a scalar)")
    if bad:
        raise ConfigurationError(
            "make_private supports models sharded with FSDP2 (fully_shard) over a 1-D "
            "device mesh of all the ranks of the process group, every trainable parameter "
            "a DTensor with placements (Shard(0),); tensor parallelism, pipeline "
            "parallelism and HSDP (2-D meshes) are not supported. Offending parameters: "
            + "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
            + ". Call fully_shard(layer, mesh=init_device_mesh(device, (world_size,))) on "
            "the layers and on the root model before make_private")
    if optimizer is not None:
        owned = {id(p) for p in model.parameters()}
        stale = sum(1 for g in optimizer.param_groups for p in g["params"]
                    if id(p) not in owned)
        if stale:
            raise ConfigurationError(
                f"the optimizer holds {stale} tensor(s) that are not parameters of the "
                "sharded model: fully_shard replaces the parameters by DTensors, so an "
                "optimizer built before it would update nothing. Build the optimizer after "
                "fully_shard, over model.parameters()")
    refused = []
    if cfg.max_physical_batch_size is not None:
        refused.append("max_physical_batch_size (each rank would run its own number of "
                       "physical chunks, and FSDP2's all-gathers need the same number on "
                       "every rank): use a smaller per-rank batch_size or more ranks")
    if cfg.correlated:
        refused.append(f"noise={cfg.noise!r} (correlated noise runs in one process)")
    if refused:
        raise ConfigurationError("under FSDP2 (fully_shard) make_private does not support "
                         + "; ".join(refused))


class ShardedTracker(GradSampleTracker):
    """The recording tracker for an FSDP2 model: FSDP swaps the parameter objects in the
    modules (sharded between passes, unsharded during them), so the trainable set is
    fingerprinted by name, and the batch-independence probe (whose forward passes
    all-gather) runs on every rank at the same step."""

    def __init__(self, *args, process_group=None, **kwargs):
        self.process_group = process_group
        self._agreed_inputs = None  # (inputs, other forwards) the ranks' count was of
        super().__init__(*args, **kwargs)
        self._probed_calls: set = set()  # the forwards' signatures seen at the last probe
        self._pad_inputs = None  # (args, kwargs, autocast) of the last training forward

    def _install(self) -> None:
        super()._install()
        # where each unit's parameters live in its modules, found while they are the
        # sharded DTensors (make_private's check); FSDP2 swaps the objects in those slots
        self._unit_slots = {id(u): _param_slots(u.module, u.params) for u in self.units}
        names: dict[int, list] = {}
        for n, v in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(v), []).append(n)
        #: the names of each parameter registered under several (a tied output bias)
        self.tied_names = {k: v for k, v in names.items() if len(v) > 1}

    def _trainable_signature(self) -> tuple:
        return tuple(n for n, p in self.model.named_parameters() if p.requires_grad)

    def _rediscover(self) -> None:
        self.clear()
        raise TrainingLoopError(
            "the model's trainable parameters changed after make_private: under FSDP2 set "
            "requires_grad before fully_shard and make_private (the sharded step fixes its "
            "parameters then). No step was taken and nothing was released")

    def _evaluate_early(self, unit, rec) -> None:
        """No rule is evaluated during backward under FSDP2: the unit's parameters are
        the unsharded tensors only inside :meth:`clipped_sum`, where every rule runs
        (records kept until the step)."""
        return None

    def _root_pre_hook(self, module, args, kwargs):
        """As in one process, and the inputs of this rank's last training forward kept
        (a reference, nothing copied): the probe's passes of another rank's probe are
        padded with passes on them when this rank's own step left none recorded (the
        probe re-armed on that rank only, or this rank's empty batch)."""
        from privlearn.torch._tracker_util import _autocast_state, _in_backward
        from privlearn.torch.grad_sample import _IN_RULE

        got = super()._root_pre_hook(module, args, kwargs)
        if not (_IN_RULE.get() or self._probing or not module.training or _in_backward()
                or not torch.is_grad_enabled()):
            self._pad_inputs = (args, dict(kwargs), _autocast_state())
        return got

    def _step_inputs(self, examples: int | None):
        """The step's probed inputs as :meth:`check_independence` took them (with the
        step's other forwards, ``_probe_others``) once it has, else as in one process."""
        agreed, self._agreed_inputs = self._agreed_inputs, None
        if agreed is None:
            return super()._step_inputs(examples)
        inputs, self._probe_others = agreed
        return inputs

    def check_independence(self, examples: int | None) -> None:
        """As in one process, every forward of the step probed (its first and each later
        one on other inputs: a second view, other keywords), at the same step on every
        rank: each rank with two examples or more probes its own batch, and every rank
        runs as many forward passes (each is an all-gather), padding with passes on its
        own inputs. A rank that holds the probe pending stays so (all probe again at the
        next step) until its own batch could be probed.

        Raises
        ------
        BatchDependenceError
            This rank's batch showed examples mixed (the step is then refused on every
            rank, :mod:`privlearn.torch._agree`).
        TrainingLoopError
            Some rank has no training forward's inputs to run the probe's passes on.
        """
        if not self._probe_pending:
            return
        import torch.distributed as dist

        from privlearn.torch import _flat_rows, _probe_size
        from privlearn.torch.probe import pad_passes, planned_passes

        inputs = self._step_inputs(examples)
        others = list(self._probe_others)
        can = (examples is not None and examples >= 2 and inputs is not None
               and bool(self.records))
        planned = 0
        if can:  # depends on this rank's rows (rows equal to the probed one give nothing
            # to compare, and fewer passes) and on its step's other forwards
            every = bool(_flat_rows.candidates(self, examples, peek=True))
            whole = _probe_size.due(self, examples)
            planned = sum(planned_passes(seen, examples, every=every, whole=whole)
                          for seen in (inputs, *(s for s, _ in others)))
        # a rank whose step left no inputs recorded (not pending at its forward: another
        # rank re-armed the probe; its records cleared: an empty batch's stand-in) pads
        # with passes on its last training forward's inputs
        pad, rows = inputs, examples
        if pad is None:
            pad = self._pad_inputs
            rows = next((t.shape[0] for t in (*pad[0], *pad[1].values())
                         if isinstance(t, torch.Tensor) and t.dim()), 1) if pad else None
        status = torch.tensor([int(pad is None), planned], dtype=torch.int64)
        settle.all_reduce(status, group=self.process_group, op=dist.ReduceOp.MAX)
        unrecorded, most = (int(v) for v in status.tolist())
        if unrecorded and most:  # a rank with no inputs cannot run the probe's passes
            self._refuse_unrecorded()
        self.probe_passes, error = 0, None  # counted by the probe: a refusal may stop it
        self._agreed_inputs = (inputs, others)  # the probe runs on what was counted
        try:
            super().check_independence(examples)  # (no pass where it cannot probe)
        except Exception as exc:  # noqa: BLE001 - raised after the others' passes
            error = exc
        finally:
            self._agreed_inputs = None
        if most:
            self._probing = True
            try:  # as many passes as the rank that runs the most, also on a refusing rank
                pad_passes(self, pad, rows, most - self.probe_passes)
            finally:
                self._probing = False
        if error is not None:  # the step then refuses on every rank (privlearn.torch._agree)
            raise error
        if not self._probe_pending:  # the signatures the probe has seen through
            self._probed_calls = set(self._calls)

    def _refuse_unrecorded(self) -> None:
        """Refuse, on every rank alike, a step whose forward some rank did not record for
        the probe (see :meth:`check_independence`); the forwards' signatures seen since
        the last probe are forgotten, so a call first made in this step re-arms the probe
        when it is made again."""
        self._calls.clear()
        self._calls.update(self._probed_calls)
        self.clear()
        exc = TrainingLoopError(
            "optimizer.step() was refused on every rank: the batch-independence probe runs "
            "at this step, and some rank ran no training forward of the model since "
            "make_private (none whose inputs it could run the probe's passes on). Under "
            "FSDP2 the probe's forward passes are collectives that every rank runs. "
            "Nothing was released or accounted on any rank; run each batch of "
            "p.data_loader through the model on every rank, an empty one too")
        exc.refused_ranks = []  # raised by every rank alike: no further exchange
        raise exc

    def clipped_sum(self, max_grad_norm: float, multiplier: float = 1.0, out=None,
                    per_param: dict | None = None, **kwargs):
        """:meth:`GradSampleTracker.clipped_sum` with every FSDP2 module unsharded
        (rules that recompute a layer, such as the generic fallback, need the parameter
        values): the units' parameters are their unsharded tensors while the rules run,
        and ``out``/``per_param``/the sums stay keyed by the sharded parameters. All
        ranks call it once per step (the unshard is a collective)."""
        fm = _fsdp_module_type()
        mods = [m for m in self.model.modules() if isinstance(m, fm)]
        slots = [(u, self._unit_slots[id(u)]) for u in self.units]
        for m in mods:
            m.unshard()
        saved = [(u, u.params) for u in self.units]
        try:
            full: dict[int, torch.Tensor] = {}
            for u, unit_slots in slots:
                for owner, name, p in unit_slots:
                    cur = owner._parameters.get(name)
                    if cur is not None and cur is not p:
                        full[id(p)] = cur
                u.params = tuple(full.get(id(p), p) for p in u.params)
            fwd = {k: id(v) for k, v in full.items()}
            back = {v: k for k, v in fwd.items()}
            out2 = None if out is None else {fwd.get(k, k): v for k, v in out.items()}
            pp2 = None if per_param is None else {fwd.get(k, k): v
                                                  for k, v in per_param.items()}
            sums, batch, norms = super().clipped_sum(max_grad_norm, multiplier, out=out2,
                                                     per_param=pp2, **kwargs)
        finally:
            for u, params in saved:
                u.params = params
            for m in mods:
                m.reshard()
        if out is not None:
            return out, batch, norms
        return {back.get(k, k): v for k, v in sums.items()}, batch, norms


def _layout(p) -> tuple[int, int, int]:
    """``(rows, row numel, rows per shard)`` of a ``Shard(0)`` parameter."""
    world = p.device_mesh.size()
    rows = p.shape[0]
    rest = p.numel() // rows if rows else 0
    return rows, rest, -(-rows // world)


class ShardedGradients:
    """The noisy gradient of an FSDP2 model's DP step (module docstring), called by
    :meth:`privlearn.torch.optimizer.DPOptimizer.step` in place of the replicated
    all-reduce."""

    def __init__(self, process_group=None):
        self.process_group = process_group
        self._given: dict[int, object] = {}  # the gradients the last step set

    def noisy_step(self, opt, examples: int | None = None, units=None) -> None:
        """Clip and sum this rank's examples at full size, reduce-scatter the sums over
        ranks, add ``N(0, (sigma C)^2) / (q N)`` to this rank's shard, and set each
        sharded parameter's gradient."""
        from torch.distributed.tensor import DTensor

        params = opt.tracker.params
        for p in params:
            if not isinstance(p, DTensor):
                raise TrainingLoopError(
                    f"a parameter of shape {tuple(p.shape)} of the FSDP2 model is no longer "
                    f"sharded at step() (a {type(p).__name__}, not a DTensor): call step() "
                    "after backward() and before anything unshards the model (a "
                    "summon_full_params or unshard() call). No step was taken")
            if p.grad is not None and p.grad is not self._given.get(id(p)):
                opt.tracker.clear()
                _refuse_tied_use(getattr(opt.tracker, "tied_names", {}).get(id(p)))
                names = {id(v): n for n, v in opt.tracker.model.named_parameters()}
                raise TrainingLoopError(
                    f"parameter {names.get(id(p), tuple(p.shape))!r} received a gradient "
                    "from autograd (FSDP reduced it): it is used outside its layers (a "
                    "functional call on the weight), so that gradient is neither per "
                    "example nor clipped. Route every use through a module. No step was "
                    "taken and nothing was released")
        dev = params[0].to_local().device if params else torch.device("cpu")
        full = {id(p): torch.zeros(p.shape, dtype=p.dtype, device=dev) for p in params}
        opt._agree()  # every rank unshards (a collective), or all refuse
        opt._clipped_sum(full, examples=examples, units=units)
        for k, a in opt._take_accumulated().items():  # earlier chunks (none under FSDP2)
            full[k].add_(a.to(full[k].dtype))
        for p in params:  # before the exchange: refused on every rank, nothing released
            rows, _, c = _layout(p)
            rank = p.device_mesh.get_local_rank()
            n = max(0, min(c, rows - rank * c))
            if p.to_local().shape[0] != n:
                raise TrainingLoopError(
                    f"the local shard of a parameter of shape {tuple(p.shape)} has "
                    f"{p.to_local().shape[0]} rows on rank {rank}, not the {n} of "
                    "torch.chunk's split: this FSDP version shards differently; no step was "
                    "taken")
        opt._agree()  # and every rank's clipping passed (a NaN refused on one rank only)
        if not params:
            return
        world = params[0].device_mesh.size()
        rank = params[0].device_mesh.get_local_rank()
        group = params[0].device_mesh.get_group()
        by_dtype: dict[torch.dtype, list] = {}  # one exchange per dtype, as the replicated
        for p in params:                        # step keeps one buffer per dtype: each
            by_dtype.setdefault(p.dtype, []).append(p)  # parameter's rows in its own dtype
        grads = []
        for same in by_dtype.values():
            mine = _reduce_scatter_rows(same, full, world, group, dev)
            if opt.noise_multiplier > 0:  # every coordinate of the global sum: one draw
                std = opt.gradient_noise_multiplier * opt.max_grad_norm / opt.expected_batch_size
                opt.noise.add_normal_(mine, std)
            off = 0
            for p in same:
                rows, rest, c = _layout(p)
                n = max(0, min(c, rows - rank * c))
                local = mine[off:off + n * rest].view(p.to_local().shape)
                off += c * rest
                grads.append((p, DTensor.from_local(local, p.device_mesh, p.placements,
                                                    run_check=False, shape=p.shape,
                                                    stride=p.stride())))
        self._given = {}
        for p, grad in grads:  # p.grad set last, once every dtype's rows are noised
            p.grad = grad
            self._given[id(p)] = grad


def _reduce_scatter_rows(params: list, full: dict, world: int, group, dev) -> torch.Tensor:
    """This rank's rows of the sum over ranks of the full-size clipped sums ``full`` (by
    ``id``; popped) of ``params`` (one dtype), laid end to end: each parameter's
    ``ceil(rows / W)`` rows of this rank, zero-padded, in ``params`` order."""
    layouts = [_layout(p) for p in params]
    width = sum(c * r for _, r, c in layouts)
    send = torch.zeros(world, width, dtype=params[0].dtype, device=dev)
    off = 0
    for p, (rows, rest, c) in zip(params, layouts, strict=True):
        g = full.pop(id(p)).reshape(rows, rest)
        block = send[:, off:off + c * rest].view(world, c, rest)
        for r in range(world):  # rank r's rows, zero-padded to c
            lo, hi = r * c, min((r + 1) * c, rows)
            if hi > lo:
                block[r, :hi - lo].copy_(g[lo:hi])
        off += c * rest
    mine = torch.empty(width, dtype=send.dtype, device=dev)
    if world > 1:
        settle.reduce_scatter(mine, send.view(-1), group=group)
    else:
        mine.copy_(send.view(-1))
    return mine


def _refuse_tied_use(names: list | None) -> None:
    """Refuse, as in one process (:func:`privlearn.torch._aliases.refuse_alias_uses`), a
    gradient that autograd gave a parameter registered under two names (a tied output
    bias): the enclosing module used it in its own forward, a use no rule covers (FSDP2
    swaps the parameters in the modules' slots, so the alias guard sees no use there)."""
    from privlearn.errors import UnsupportedModuleError

    if not names:
        return
    raise UnsupportedModuleError(
        f"parameter {names} is registered by a module that uses it in its own forward, "
        "and by a submodule too (a tied parameter): the submodule's rule gives the "
        "per-example gradient of its own use only, and the enclosing module's use has no "
        "rule (autograd's gradient of it, reduced by FSDP, is neither per example nor "
        "clipped). Register each such parameter on the module that uses it, route the use "
        "through a submodule (e.g. an nn.Linear sharing the tensor), or register a rule "
        "covering the whole enclosing module (privlearn.torch.register_rule(..., "
        "scope='subtree')). No step was taken and nothing was released")


def _mesh_group(model: nn.Module):
    """The process group of the device mesh the model's parameters are sharded over."""
    dt = _dtensor_type()
    for p in model.parameters():
        if isinstance(p, dt):
            return p.device_mesh.get_group()
    return None
