"""The generic per-example rule: :mod:`torch.func` (``vmap`` of ``grad`` of the module's
functional call) for layers without a dedicated rule (:data:`FALLBACK`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from privlearn.errors import BatchDependenceError, UnsupportedModuleError
from privlearn.torch import _argument_roles
from privlearn.torch._argument_roles import settled_shared
from privlearn.torch.grad_sample import (
    _LOW,
    Contribution,
    LayerRule,
    Layout,
    Materialized,
    Record,
    as_dtype,
    compute_dtype,
    rule_evaluation,
)

__all__ = ["FALLBACK", "aliased_parameters", "argument_views", "default_record_dims",
           "direct_fallback_rule", "fallback_rule", "nested_tensors_error", "settled_shared",
           "shared_argument_error"]


# --------------------------------------------------------------------------- fallback


def default_record_dims(module: nn.Module, record: Record, batch: int):
    """Batch dimension of every tensor argument and output of a record (None: not
    batched, i.e. shared by all examples): ``record.batch_dim`` (0 for a batch-first
    record) where the tensor's size there is the batch size."""
    d = record.batch_dim

    def dim(t):
        if not isinstance(t, torch.Tensor) or t.dim() <= d:
            return None
        return d if t.shape[d] == batch else None

    arg_dims = [dim(a) for a in record.args]
    kw_dims = {k: dim(v) for k, v in record.kwargs.items()}
    out_dims = [d if (len(s) > d and s[d] == batch) else None
                for s, _, _ in record.outputs_meta]
    return arg_dims, kw_dims, out_dims


def argument_views(args, kwargs, output, dim: int) -> list:
    """The tensor arguments and the floating outputs after the first (which the probe
    views anyway) of a call of a layer the generic rule computes, as views for the
    batch-independence probe (batch dimension ``dim``). The rule splits every tensor with
    the batch's size on ``dim`` as one row per example (:func:`default_record_dims`); the
    probe checks that each follows the examples, and :func:`shared_argument_error`
    refuses one that does not (a table shared by every example whose number of rows
    happens to equal the batch size)."""
    outs = [o for o in tree_flatten(output)[0]
            if isinstance(o, torch.Tensor) and o.is_floating_point()]
    named = [*((f"argument {i}", a) for i, a in enumerate(args)),
             *((f"argument {k!r}", v) for k, v in kwargs.items()),
             *((f"output {i}", o) for i, o in enumerate(outs) if i > 0)]
    return [(t, dim, label) for label, t in named
            if isinstance(t, torch.Tensor) and t.dim() > dim]


def shared_argument_error(layer: str, label: str, shape, dim: int, examples: int):
    """The refusal of a layer without a rule called with an argument, or returning an
    output (``label``, of ``shape``), that has ``examples`` rows on the batch dimension
    ``dim`` with a batch of ``examples`` and with one of ``examples - 1``: shared by every
    example, it would be split as one row per example by the generic rule and each
    example's gradient computed from one row of it."""
    fix = ("Register the tensor on the layer itself (a buffer or a constant attribute, not "
           "an argument), pass it with a leading dimension of 1 (table[None]), or register "
           "a rule for the layer (privlearn.torch.register_rule)"
           if label.startswith("argument") else
           "Return it from the layer with one row per example (expanded to the batch), "
           "compute it outside the layer, or register a rule for the layer "
           "(privlearn.torch.register_rule)")
    return BatchDependenceError(
        f"layer {layer} has no per-example rule and its {label} (shape {tuple(shape)}) "
        f"has {examples} rows on dimension {dim} both with a batch of {examples} examples "
        f"and with one of {examples - 1}: it is shared by every example, its size only "
        "matches the batch's. The generic per-example rule splits every argument and "
        "output of the batch's size as one row per example, so each example's gradient "
        f"would be computed from one row of it. {fix}. No step was taken and nothing was "
        "released")


def nested_tensors_error(layer: str) -> UnsupportedModuleError:
    """The refusal of a layer without a rule called with tensors of the batch inside a
    tuple, list or dict argument (``layer``: its name and class)."""
    return UnsupportedModuleError(
        f"layer {layer} has no per-example rule and was called with tensors inside a "
        "tuple, list or dict argument: the generic rule splits the tensors passed as "
        "arguments themselves, one row per example, and cannot find the examples in a "
        "container. Pass the tensors as separate arguments (forward(self, x, y) called as "
        "layer(x, y)), or register a rule for the layer (privlearn.torch.register_rule). "
        "No step was taken and nothing was accounted")


def _refuse_nested_batches(module: nn.Module, record: Record, b: int) -> None:
    """Refuse a call with a container argument holding a tensor of the batch's size on
    the batch dimension (the rule would pass the whole batch of it to every example)."""
    d = record.batch_dim
    for v in (*record.args, *record.kwargs.values()):
        if isinstance(v, torch.Tensor):
            continue
        leaves = tree_flatten(v)[0]
        if any(isinstance(t, torch.Tensor) and t.dim() > d and t.shape[d] == b
               for t in leaves):
            raise nested_tensors_error(type(module).__name__)


def fallback_rule(module: nn.Module, record: Record, params, dims=None) -> Contribution:
    """Generic rule: per-example gradients by ``vmap`` of a ``vjp`` of ``functional_call``.

    Each example is passed through the layer on its own (batch of one, inside ``vmap``, so
    no Python loop runs) and the vector-Jacobian product with that example's output
    gradient gives its parameter gradient. Correct for any layer that treats examples
    independently; all positional and keyword tensor inputs are handled. The record is
    batch-first (the engine moved the batch dimension to 0), unless ``dims`` (``(batch,
    arg_dims, kwarg_dims, output_dims)``, from a layout-aware rule) says otherwise.
    """
    from torch.func import functional_call, vjp, vmap

    names = [n for n, p in module.named_parameters() if p in set(params)]
    pvals = {n: p.detach() for n, p in module.named_parameters() if p in set(params)}
    # the module's other parameters (a child layer's, a unit of its own, or frozen ones)
    # are constants here: detached, so that the gradients of pvals are not attached to
    # them, and in the compute dtype with the rest below
    others = {n: p.detach() for n, p in module.named_parameters() if n not in pvals}
    outputs_n = len(record.outputs_meta)
    if dims is None:
        x = record.args[0] if record.args else next(iter(record.kwargs.values()))
        b = x.shape[record.batch_dim]
        _refuse_nested_batches(module, record, b)
        # the roles kept from earlier steps: a shared table stays shared whatever its size
        arg_dims, kw_dims, out_dims = _argument_roles.settle(
            module, record, b, *default_record_dims(module, record, b))
    else:
        b, arg_dims, kw_dims, out_dims = dims
    if all(d is None for d in out_dims):
        raise UnsupportedModuleError(
            f"cannot find the batch dimension of the outputs of {module!r}: none of them "
            f"has the batch's size ({b}) on dimension {record.batch_dim}. A layer whose "
            "output is shared by every example (computed from positions alone, e.g. "
            "BART's learned positional embedding called with position ids of shape (1, T), "
            "and broadcast over the batch afterwards) has no per-example gradient: freeze "
            "its parameters (requires_grad_(False)) or train adapters only. No step was "
            "taken and nothing was accounted")
    gouts = [record.grad(i) for i in range(outputs_n)]
    args, kwargs = record.args, record.kwargs
    # a parametrization's buffers as the forward began (spectral_norm's power iteration
    # updates them in place at each training call): copied again in each call below, so
    # that it computes the forward's weight and leaves the module's buffers alone
    state = dict(record.state or {})
    floats = [t for t in (*args, *kwargs.values(), *gouts)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if any(t.dtype in _LOW for t in floats):  # mixed precision: redo the layer in float32
        dt = compute_dtype(*floats, *pvals.values())

        def up(t):
            return as_dtype(t, dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        args = tuple(up(t) for t in args)
        kwargs = {k: up(v) for k, v in kwargs.items()}
        gouts = [up(t) for t in gouts]
        pvals = {k: up(v) for k, v in pvals.items()}
        others = {k: up(v) for k, v in others.items()}
        state = {k: up(v) for k, v in state.items()}
        # layers passed to the forward as arguments (peft's DoRA gets its lora_A, lora_B
        # and base layer so): their tensors are constants here, in float32 with the rest
        extra = _module_args(module, (*args, *kwargs.values()), up)
    else:
        extra = {}
    kw_keys = list(kwargs)
    kw_vals = [kwargs[k] for k in kw_keys]
    kw_in = [kw_dims[k] for k in kw_keys]
    n_args = len(args)

    def call(p, a_i, k_i):
        target = module if not extra else _WithModuleArgs(module, extra["mods"])
        pre = "inner." if extra else ""
        copies = {k: v.clone() for k, v in state.items()}
        values = {pre + k: v for k, v in {**others, **copies, **p}.items()}
        out = functional_call(target, {**values, **extra.get("values", {})}, tuple(a_i),
                              dict(zip(kw_keys, k_i, strict=True)))
        flat_out, _ = tree_flatten(out)
        return tuple(o for o in flat_out if isinstance(o, torch.Tensor))

    def per_example(pv, *flat):
        a_i = list(flat[:n_args])
        k_i = list(flat[n_args: n_args + len(kw_keys)])
        g_i = list(flat[n_args + len(kw_keys):])
        a_i = [x.unsqueeze(d) if d is not None else x for x, d in zip(a_i, arg_dims, strict=True)]
        k_i = [x.unsqueeze(d) if d is not None else x for x, d in zip(k_i, kw_in, strict=True)]
        g_i = [x.unsqueeze(d) if d is not None else x for x, d in zip(g_i, out_dims, strict=True)]
        outs, fn = vjp(lambda p: call(p, a_i, k_i), pv)
        g_use = tuple(
            gi if gi is not None and o.is_floating_point() else torch.zeros_like(o)
            for o, gi in zip(outs, g_i, strict=True)
        )
        return fn(g_use)[0]

    in_dims = (None, *arg_dims, *kw_in, *out_dims)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the math attention kernel has vmap batching rules (the fused CPU kernels do not)
    dev = next(iter(pvals.values())).device.type if pvals else "cpu"
    with rule_evaluation(), torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]), \
            torch.autocast(dev, enabled=False), _own_hooks_off(module):
        flat_in = (*args, *kw_vals, *gouts)
        _refuse_trained_shared_outputs(module, record, out_dims, pvals, lambda p: call(
            p, _first_example(args, arg_dims), _first_example(kw_vals, kw_in)))
        try:
            grads = vmap(per_example, in_dims=in_dims)(pvals, *flat_in)
        except RuntimeError as e:
            if "randomness" in str(e):
                raise UnsupportedModuleError(_random_forward(module)) from None
            if "mutate a captured Tensor" in str(e):
                raise UnsupportedModuleError(_mutating_forward(module)) from None
            # an operation without a vmap batching rule for these inputs (a recurrent
            # layer run inside the module: torch's RNN kernels write the batched gates
            # into an unbatched state under vmap, all but float32 LSTM on the CPU): the
            # same vjp, one example at a time
            grads = _one_example_at_a_time(module, per_example, pvals, flat_in,
                                           in_dims[1:], b)
    by_name = dict(zip(names, [grads[n] for n in names], strict=True))
    return Materialized([p for n, p in module.named_parameters() if n in by_name],
                        [by_name[n] for n, p in module.named_parameters() if n in by_name])


def _first_example(tensors, dims) -> list:
    """``tensors`` with those batched on ``dims`` narrowed to their first example."""
    return [t.narrow(d, 0, 1) if d is not None else t
            for t, d in zip(tensors, dims, strict=True)]


def _refuse_trained_shared_outputs(module: nn.Module, record: Record, out_dims, pvals: dict,
                                   first) -> None:
    """Refuse a layer that returns, beside its per-example outputs, an output without a
    batch dimension (shared by every example: a parameter's norm, a gate computed from
    the weights) that carries a gradient and depends on the trained parameters. Its
    recorded gradient is the sum of every example's, which cannot be split per example:
    each example's recomputed gradient would hold the whole batch's share through it (one
    example would move all of them). ``first(p)``: the layer's flat outputs on the first
    example with parameters ``p`` (whether they depend on them is structural)."""
    shared = [i for i, d in enumerate(out_dims)
              if d is None and record.grad_outputs[i] is not None
              and record.outputs_meta[i][1].is_floating_point]
    if not shared:
        return
    leaves = {k: v.detach().requires_grad_() for k, v in pvals.items()}
    with torch.enable_grad():
        outs = first(leaves)
    trained = [i for i in shared if i < len(outs) and outs[i].requires_grad]
    if trained:
        shapes = [tuple(record.outputs_meta[i][0]) for i in trained]
        raise UnsupportedModuleError(
            f"{type(module).__name__} returns output(s) {trained} (shapes {shapes}) without "
            "the batch dimension, computed from its trained parameters and used by the loss: "
            "their gradient sums every example's and cannot be split per example, so no "
            "per-example gradient of the layer can be computed. Return them with one row "
            "per example (expand them to the batch inside the layer), compute them outside "
            "the layer from the parameters directly (a penalty on the weights: the "
            "optimizer's weight_decay), or register a rule for the layer "
            "(privlearn.torch.register_rule). No step was taken and nothing was accounted")


class _WithModuleArgs(nn.Module):
    """``inner`` with the layers it is called with as arguments registered beside it (as
    ``mods.<i>``), so that one ``functional_call`` replaces the tensors of all of them."""

    def __init__(self, inner: nn.Module, mods: list):
        super().__init__()
        self.inner = inner
        self.mods = nn.ModuleList(mods)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def _module_args(module: nn.Module, values, up) -> dict:
    """The layers among a recorded call's arguments ``values`` (other than ``module``)
    and their floating tensors converted by ``up`` (the rule's compute dtype), keyed for
    :class:`_WithModuleArgs`; tensors ``module`` holds itself are left to its own entries
    (``{}`` when no argument is a layer). Under mixed precision the rule redoes the layer
    in float32: a layer argument left in bfloat16 (peft's DoRA calls ``lora_A(x)`` on
    it) fails on the float32 input."""
    mods = [v for v in values
            if callable(getattr(v, "named_parameters", None)) and v is not module]
    if not mods:
        return {}
    seen = {id(t) for t in (*module.parameters(), *module.buffers())}
    out = {}
    for i, m in enumerate(mods):
        for kind in (m.named_parameters, m.named_buffers):
            for n, t in kind():
                if id(t) not in seen and t.is_floating_point():
                    seen.add(id(t))
                    out[f"mods.{i}.{n}"] = up(t.detach())
    return {"mods": mods, "values": out}


#: the hook tables of a module that its own call runs (forward and backward)
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _own_hooks_off(module: nn.Module):
    """``module``'s own hooks switched off while the rule calls it: the record holds its
    inputs after its forward pre-hooks and the gradient of what its forward returned,
    before its forward hooks (and after its backward ones), so running them again would
    apply a user's hook twice or differentiate the hooked output instead (its children's
    hooks, part of its computation, still run)."""
    saved = {k: vars(module)[k] for k in _HOOK_TABLES if k in vars(module)}
    try:
        for k, v in saved.items():
            setattr(module, k, type(v)())
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


#: peft's adapters that are supported (their trained tensors are used without a random
#: draw in the adapter's own forward; LoRA's dropout is an ``nn.Dropout`` child)
_SUPPORTED_PEFT = ("LoRA (peft.LoraConfig), DoRA (LoraConfig(use_dora=True)), IA3 "
                   "(peft.IA3Config) or VeRA (peft.VeraConfig)")


def _random_forward(module: nn.Module) -> str:
    """The refusal of a layer without a rule whose own forward draws random numbers;
    for a peft adapter layer (read from its class's module, ``peft.tuners.<kind>``),
    with the peft adapters that are supported instead."""
    where = type(module).__module__
    if where.startswith("peft.tuners."):
        kind = {"loha": "LoHa", "lokr": "LoKr", "oft": "OFT", "boft": "BOFT"}.get(
            where.split(".")[2], where.split(".")[2])
        return (f"peft's {kind} adapter layer ({where}.{type(module).__name__}) draws "
                "random numbers in its own forward (torch.rand, for its module or rank "
                "dropout, at every training call), and the generic per-example rule "
                "recomputes the layer per example and cannot replay that randomness, so "
                f"its per-example gradients cannot be computed. Use a supported peft "
                f"adapter instead: {_SUPPORTED_PEFT}. No step was taken and nothing was "
                "accounted")
    return (f"{type(module).__name__} draws random numbers in its forward (e.g. "
            "F.dropout or torch.rand_like on its inputs), and it has no per-example rule: "
            "the generic rule recomputes the layer per example and cannot replay that "
            "randomness, so its per-example gradients cannot be computed. Move the "
            "randomness into a child module (nn.Dropout) outside the layer that owns the "
            "parameters, or register a rule for it (privlearn.torch.register_rule). A "
            f"peft adapter? Use {_SUPPORTED_PEFT}. No step was taken and nothing was "
            "accounted")


def _mutating_forward(module: nn.Module) -> str:
    """The refusal of a layer without a rule whose forward updates a tensor it holds in
    place (a step counter buffer: ``self.steps += 1``)."""
    return (f"{type(module).__name__} updates a tensor it holds (a buffer, e.g. a step "
            "counter) in place in its forward, and it has no per-example rule: the generic "
            "rule recomputes the layer per example after backward() and can neither replay "
            "nor repeat that update. Move the update out of the layer that owns the "
            "trained parameters (into the training loop, or a child module without "
            "trainable parameters), or register a rule for it "
            "(privlearn.torch.register_rule). No step was taken and nothing was accounted")


def _rng_states(device: torch.device) -> list:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _one_example_at_a_time(module: nn.Module, per_example, pvals: dict, flat_in, dims,
                           batch: int) -> dict:
    """``vmap(per_example, in_dims=(None, *dims))(pvals, *flat_in)`` as a loop over the
    ``batch`` examples (each tensor with a batch dimension sliced there, the others
    shared), for forwards with an operation vmap cannot batch. A forward that draws
    random numbers (which vmap would have refused) is refused too: the recomputation
    could not replay them."""
    dev = next(iter(pvals.values())).device if pvals else torch.device("cpu")
    before = _rng_states(dev)
    rows = []
    for i in range(batch):
        sliced = [t.select(d, i) if d is not None else t
                  for t, d in zip(flat_in, dims, strict=True)]
        rows.append(per_example(pvals, *sliced))
    after = _rng_states(dev)
    if any(not torch.equal(u, v) for u, v in zip(before, after, strict=True)):
        raise UnsupportedModuleError(_random_forward(module))
    return {n: torch.stack([r[n] for r in rows]) for n in pvals}


def aliased_parameters(module: nn.Module, params=None) -> dict[str, str]:
    """Trainable parameters that ``module`` registers itself *and* one of its submodules
    registers too (an alias under a second name, as Opacus's ``RenameParamsMixin`` does
    for ``DPLSTM``): ``{name on module: qualified name in the submodule}``. ``params``:
    only these (default: all of the module's own trainable parameters)."""
    own = {id(p): n for n, p in module._parameters.items()
           if p is not None and p.requires_grad and (params is None or p in params)}
    if not own:
        return {}
    out: dict[str, str] = {}
    for sub_name, sub in module.named_modules(remove_duplicate=False):
        if sub is module:
            continue
        for n, p in sub._parameters.items():
            if p is not None and id(p) in own and own[id(p)] not in out:
                out[own[id(p)]] = f"{sub_name}.{n}"
    return out


def direct_fallback_rule(module: nn.Module, record: Record, params) -> Contribution:
    """:func:`fallback_rule` for the parameters a module owns itself (:data:`FALLBACK`).

    Refuses parameters that a submodule registers too (an alias, as Opacus's
    ``RenameParamsMixin`` makes for ``DPLSTM``): the submodule is a unit of its own, so
    the gradient through it would be counted by both units (twice).
    """
    aliases = aliased_parameters(module, set(params))
    if aliases:
        pairs = ", ".join(f"{a} = {b}" for a, b in list(aliases.items())[:4])
        raise UnsupportedModuleError(
            f"{type(module).__name__} registers parameters of its submodules a second time "
            f"({pairs}): their per-example gradients would be counted twice (once by the "
            "generic rule of the module, once by the rule of the submodule). Register each "
            "parameter on one module only, or register a rule covering the whole module "
            "(privlearn.torch.register_rule(..., scope='subtree')). No step was taken and "
            "nothing was accounted")
    return fallback_rule(module, record, params)


#: The rule of layers without a registered one (their own trainable parameters only;
#: batch dimension from the context, as for ``nn.Linear``).
FALLBACK = LayerRule(direct_fallback_rule, Layout(moves=False), scope="direct")
