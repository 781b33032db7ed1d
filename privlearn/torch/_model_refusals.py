"""Models the engine refuses before a step: one with no trainable parameter, any model
while torch's global module hooks are registered or a trainable parameter has a gradient
hook of its own, and a training forward run on tensors put in the parameters' place
(``torch.func.functional_call``).

Torch runs its global hooks (``torch.nn.modules.module.register_module_forward_hook``,
``register_module_forward_pre_hook``, ``register_module_full_backward_hook``,
``register_module_full_backward_pre_hook``) on every module's call, before the module's
own hooks: a global forward hook that changes a layer's output runs before the engine's
hook of that layer, which then records the changed output instead of what the layer
computed, and per-example gradients come out wrong (clipped and accounted as if they were
right). A layer without a per-example rule is run again by the engine, its own hooks
switched off but not the global ones, which would apply a global hook twice. Hooks
registered on the modules themselves (``module.register_forward_hook(hook)``, before or
after ``make_private``) run after the engine's, which it places first. The check reads
the lengths of torch's hook dictionaries only (no device access).

A gradient hook on a parameter itself (``param.register_hook(fn)``: a mask keeping some
rows of an embedding fixed, peft's CPT and OSF adapters) never runs under the engine:
each layer's forward runs on a detached alias of its parameters and the engine computes
their per-example gradients from the layers' inputs and output gradients, so autograd
never carries a gradient to the parameter. The update would silently leave the hook out
(a masked row trained after all); such a model is refused instead. So is a hook run
after a parameter's gradient is accumulated (``param.register_post_accumulate_grad_hook``:
an optimizer step inside ``backward()``, a gradient exchange): it would never run either,
so the training it does would silently not happen. The gradient exchanges that register
such hooks themselves are left to them (the engine exchanges its clipped, noised sums
itself): ``DistributedDataParallel``'s under compiled autograd
(``torch._dynamo.config.optimize_ddp = "python_reducer"``) and transformers' ``Trainer``'s
average over the ranks of the replicated parameters of a model sharded at load time.
"""

from __future__ import annotations

from torch import nn

from privlearn.errors import ConfigurationError, TrainingLoopError

__all__ = ["alias_of_slot", "eval_forward", "refuse_global_hooks", "refuse_hooks",
           "refuse_parameter_hooks", "refuse_post_accumulate_hooks", "refuse_repeated_prompt",
           "refuse_substituted_parameters", "refuse_untrainable"]

#: peft's soft-prompt methods whose trained prompt is computed once, from a batch of one
#: row of virtual-token ids, and then copied to every example with ``Tensor.repeat``
_REPEATED_PROMPTS = ("PROMPT_TUNING", "P_TUNING")

#: torch's dictionary of global module hooks -> how they are registered, what to use instead
_GLOBAL_HOOKS = (
    ("_global_forward_hooks", "register_module_forward_hook", "register_forward_hook"),
    ("_global_forward_pre_hooks", "register_module_forward_pre_hook", "register_forward_pre_hook"),
    ("_global_backward_hooks", "register_module_full_backward_hook", "register_full_backward_hook"),
    (
        "_global_backward_pre_hooks",
        "register_module_full_backward_pre_hook",
        "register_full_backward_pre_hook",
    ),
)


def _refuse(text: str, when: str) -> None:
    """Raise ``text``: a :class:`ConfigurationError` when ``when`` is ``"make_private"``,
    a :class:`TrainingLoopError` where in the training loop it names otherwise."""
    if when == "make_private":
        raise ConfigurationError(text)
    raise TrainingLoopError(text)


def _trainable(model: nn.Module) -> list:
    """The parameters of ``model`` that require gradients."""
    return [p for p in model.parameters() if p.requires_grad]


def refuse_global_hooks(when: str) -> None:
    """Refuse while any of torch's global module hooks is registered.

    Parameters
    ----------
    when : str
        ``"make_private"`` (raises :class:`ConfigurationError`) or where in the training
        loop the check runs (raises :class:`TrainingLoopError`: one registered later).
    """
    module = nn.modules.module
    found = [(reg, own) for table, reg, own in _GLOBAL_HOOKS if len(getattr(module, table, ()))]
    if not found:
        return
    kinds = ", ".join(f"torch.nn.modules.module.{reg}" for reg, _ in found)
    own = ", ".join(f"module.{o}(hook)" for _, o in found)
    text = (
        f"global module hooks are registered ({kinds}) at {when}: torch runs them on every "
        "layer before the DP engine's own hooks, so a hook that changes a layer's inputs, "
        "outputs or gradients makes the engine record something else than the layer "
        "computed and the per-example gradients wrong (the engine cannot tell a hook that "
        "changes nothing). Remove them (handle.remove()) and register the hooks on the "
        f"modules instead ({own}, before or after make_private: the engine's run first)"
    )
    _refuse(text, when)


def refuse_parameter_hooks(model: nn.Module, when: str, params=None,
                           own: frozenset = frozenset()) -> None:
    """Refuse gradient hooks registered on trainable parameters themselves
    (``param.register_hook(fn)``, module docstring): they would never run.

    Parameters
    ----------
    model : nn.Module
        The model (names the parameters in the message).
    when : str
        ``"make_private"`` (raises :class:`ConfigurationError`) or where in the training
        loop the check runs (raises :class:`TrainingLoopError`: one registered later).
    params : iterable of nn.Parameter, optional
        The parameters to check (default: those of ``model`` that require gradients).
    own : frozenset
        Ids of the engine's own hook handles (``RemovableHandle.id``), not counted.
    """
    params = _trainable(model) if params is None else params
    hooked = {id(p) for p in params
              if p._backward_hooks and any(k not in own for k in p._backward_hooks)}
    if not hooked:
        return
    names = [n for n, p in model.named_parameters() if id(p) in hooked]
    text = (
        f"gradient hooks are registered on the trainable parameter(s) {names[:5]}"
        f"{' ...' if len(names) > 5 else ''} (param.register_hook(fn); peft's CPT and OSF "
        f"adapters register such hooks) at {when}: the DP engine computes each parameter's "
        "per-example gradients itself, from its layer's inputs and output gradients, so "
        "autograd never passes a gradient through such a hook and the update would "
        "silently leave it out (a gradient mask would not hold). Remove the hooks "
        "(handle.remove()); to mask or transform a weight's gradient, transform the weight "
        "with a parametrization (torch.nn.utils.parametrize.register_parametrization), "
        "which the engine differentiates per example, or freeze the parameter "
        "(requires_grad_(False)). Nothing was recorded and nothing released"
    )
    _refuse(text, when)


#: ``(module, qualified name)`` of the post-accumulate-grad hooks of gradient exchanges
#: (module docstring): not refused
_EXCHANGE_HOOKS = (
    ("torch.nn.parallel.distributed",
     "DistributedDataParallel._register_accum_grad_hook.<locals>.compiled_accum_grad_hook"),
    ("transformers.trainer",
     "Trainer._sync_replicated_trainable_parameters.<locals>.average_gradient"),
)


def _hook_name(h) -> tuple:
    """``(module, qualified name)`` of a hook (of the function a ``functools.partial``
    wraps)."""
    fn = getattr(h, "func", h)
    return getattr(fn, "__module__", None), getattr(fn, "__qualname__", type(fn).__name__)


def _user_post_hooks(p) -> list:
    """The post-accumulate-grad hooks of ``p`` other than the gradient exchanges'."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
    return [h for h in hooks.values() if _hook_name(h) not in _EXCHANGE_HOOKS]


def refuse_post_accumulate_hooks(model: nn.Module, when: str, params=None) -> None:
    """Refuse hooks run after a trainable parameter's gradient is accumulated
    (``param.register_post_accumulate_grad_hook(fn)``, module docstring): they would
    never run, and what they do (an optimizer step inside ``backward()``) silently not
    happen.

    Parameters
    ----------
    model : nn.Module
        The model (names the parameters in the message).
    when : str
        ``"make_private"`` (raises :class:`ConfigurationError`) or where in the training
        loop the check runs (raises :class:`TrainingLoopError`: one registered later).
    params : iterable of nn.Parameter, optional
        The parameters to check (default: those of ``model`` that require gradients).
    """
    params = _trainable(model) if params is None else params
    hooked = {id(p): _user_post_hooks(p) for p in params
              if getattr(p, "_post_accumulate_grad_hooks", None)}
    hooked = {k: v for k, v in hooked.items() if v}
    if not hooked:
        return
    names = [n for n, p in model.named_parameters() if id(p) in hooked]
    fns = sorted({_hook_name(h)[1] for hs in hooked.values() for h in hs})
    text = (
        f"post-accumulate-grad hooks ({fns[:3]}) are registered on the trainable "
        f"parameter(s) {names[:5]}{' ...' if len(names) > 5 else ''} "
        f"(param.register_post_accumulate_grad_hook(fn)) at {when}: the DP engine computes "
        "each parameter's per-example gradients itself and writes p.grad only in "
        "optimizer.step(), so autograd never accumulates a gradient into the parameter "
        "and such a hook never runs: an optimizer step inside backward() (a per-parameter "
        "optimizer, LOMO, layer-wise GaLore) would silently train nothing. Remove the "
        "hooks (handle.remove()) and call p.optimizer.step() after loss.backward() (it "
        "updates the parameters from the clipped, noised gradient). Nothing was recorded "
        "and nothing released"
    )
    _refuse(text, when)


def refuse_hooks(tracker, when: str) -> None:
    """:func:`refuse_global_hooks`, :func:`refuse_parameter_hooks` and
    :func:`refuse_post_accumulate_hooks` at a training forward of ``tracker``'s model
    (its clipped parameters; its own handles not counted)."""
    refuse_global_hooks(when)
    _refuse_parameter_level_hooks(tracker, when)


def _refuse_parameter_level_hooks(tracker, when: str) -> None:
    """:func:`refuse_parameter_hooks` and :func:`refuse_post_accumulate_hooks` on
    ``tracker``'s clipped parameters (its own handles not counted), each only when some
    parameter holds such a hook (a cheap check at every forward)."""
    params = tracker.params
    if any(p._backward_hooks for p in params):
        own = frozenset(getattr(h, "id", None) for h in tracker._handles)
        refuse_parameter_hooks(tracker.model, when, params, own)
    if any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
        refuse_post_accumulate_hooks(tracker.model, when, params)


def eval_forward(tracker) -> str:
    """At a forward of ``tracker``'s model in eval mode with gradients enabled (which the
    engine does not record): :func:`refuse_parameter_hooks` and
    :func:`refuse_post_accumulate_hooks` (registered after make_private), before the
    forward runs. In eval mode the layers run on the parameters themselves, so autograd
    carries the batch's raw gradient to those hooks in ``backward()``: an optimizer step
    in backward would update the model from it, unclipped and without noise, before
    ``step()`` refuses the step. Returns ``"eval"`` (the tracker's ``unrecorded_forward``)."""
    when = ("a forward in eval mode with gradients enabled (registered after "
            "make_private; in eval mode autograd would pass the batch's raw gradient, "
            "unclipped and without noise, to such a hook in backward())")
    _refuse_parameter_level_hooks(tracker, when)
    return "eval"


def refuse_untrainable(model: nn.Module) -> None:
    """Refuse a model none of whose parameters requires a gradient: nothing would be
    trained while every step is accounted; and a model whose trained parameters cannot
    have per-example gradients (:func:`refuse_repeated_prompt`).

    Raises
    ------
    ConfigurationError
        No parameter of ``model`` has ``requires_grad``, or
        :func:`refuse_repeated_prompt` refuses it.
    """
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        refuse_repeated_prompt(model)
        return
    raise ConfigurationError(
        f"the model has no trainable parameter (all {len(params)} parameters have "
        "requires_grad=False): no step would update it while every step would be "
        "accounted. Unfreeze the parameters to train (requires_grad_(True)) before "
        "make_private"
    )


def refuse_repeated_prompt(model: nn.Module) -> None:
    """Refuse a peft model (read by its ``peft_config`` and ``active_adapter``, duck
    typed) training a soft prompt of ``peft_type`` ``PROMPT_TUNING`` or ``P_TUNING``:
    peft computes the prompt from a batch of one row (``prompt_tokens[:1]``) and copies
    it to every example with ``prompts.repeat(batch_size, 1, 1)``. The gradient reaching
    the prompt encoder is then the batch's sum, which cannot be clipped per example, and
    the engine's widening of a one-row input to the batch (its way to keep that gradient
    per example, exact when the result is broadcast) is repeated again by peft: the
    forward fails on mismatched batch sizes.

    Raises
    ------
    ConfigurationError
        The active adapter's ``peft_type`` is one of those, not in inference mode.
    """
    configs = getattr(model, "peft_config", None)
    active = getattr(model, "active_adapter", None)
    cfg = configs.get(active) if isinstance(configs, dict) and isinstance(active, str) else None
    kind = getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", None))
    if str(kind) not in _REPEATED_PROMPTS or getattr(cfg, "inference_mode", False):
        return
    raise ConfigurationError(
        f"peft_type={str(kind)!r} (adapter {active!r}) is not supported by make_private: "
        "peft computes the soft prompt once, for a batch of one, and repeats it over the "
        "examples, so its gradient is the batch's sum, which cannot be clipped per example. "
        "Use peft's PrefixTuningConfig (a prefix per example's keys and values) or a "
        "LoraConfig, which train with per-example gradients"
    )


def refuse_substituted_parameters(model: nn.Module) -> None:
    """Refuse a training forward with gradients while ``model``'s parameter slots hold
    tensors that are not parameters: ``torch.func.functional_call(p.model, tensors, x)``
    (``torch.nn.utils.stateless``) puts them there for the call. The engine would put its
    own parameters back (the forward silently ran on them, not on the tensors given), and
    the gradient of tensors derived from the parameters (a meta-learning inner step) is not
    one it can clip per example. Read when the trainable set changed only (Python
    attributes, no device access).

    Raises
    ------
    TrainingLoopError
        A parameter slot holds a plain tensor.
    """
    held = [f"{mod_name}.{name}" if mod_name else name
            for mod_name, mod in model.named_modules()
            for name, v in mod._parameters.items()
            if v is not None and not isinstance(v, nn.Parameter)]
    if not held:
        return
    raise TrainingLoopError(
        f"a training forward of p.model ran with plain tensors in place of its parameters "
        f"{held[:5]}{' ...' if len(held) > 5 else ''} (torch.func.functional_call or "
        "torch.nn.utils.stateless): per-example gradients are clipped for the model's own "
        "parameters only, so the forward would run on them instead of the tensors given. "
        "Call p.model(...) itself to train; run functional_call under torch.no_grad() "
        "(evaluation) or on a copy of the model that is not private. Nothing was recorded "
        "and nothing released"
    )


def alias_of_slot(cur, name: str, open_calls: list):
    """The detached alias a unit's forward runs on in place of ``cur``, the tensor its
    parameter slot ``name`` holds (the parameter, or FSDP2's unsharded parameter).
    Refuses a plain tensor the engine did not put there itself (``open_calls``: the
    unit's calls in progress, each ``(owner, name, tensor, alias)``): a tensor derived
    from the parameter and passed by ``torch.func.functional_call(layer, {name: w}, x)``
    (``w = layer.weight * mask``) would have its gradient clipped as the parameter's,
    the transform's part of the chain rule left out.

    Raises
    ------
    TrainingLoopError
        The slot holds a plain tensor (not an ``nn.Parameter``) of the caller's.
    """
    if not isinstance(cur, nn.Parameter) and not any(
            cur is done[3] for call in open_calls for done in call):
        raise TrainingLoopError(
            f"a layer ran with a plain tensor in its trainable parameter slot {name!r} "
            "(torch.func.functional_call(layer, {...}, x) or torch.nn.utils.stateless "
            "inside the model's forward): its per-example gradient would be clipped as the "
            "parameter's own, leaving out how the tensor was derived from it (a mask, a "
            "scale, a hypernetwork). Call the layer itself, or write the transform as a "
            "parametrization (torch.nn.utils.parametrize.register_parametrization), which "
            "the engine differentiates. Nothing was recorded and nothing released")
    return cur.detach()
