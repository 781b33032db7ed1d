"""Parameters registered a second time by an enclosing module (a tied output bias).

A module may register, as its own parameter, the very tensor one of its submodules
registers and uses: Hugging Face's masked-LM heads (``BertLMPredictionHead``,
``RobertaLMHead``, ``AlbertMLMHead``, ...) hold ``bias`` and hand it to their decoder
``nn.Linear`` (``decoder.bias is bias``) without using it themselves; Opacus's
``RenameParamsMixin`` registers the weights of its cells under ``nn.LSTM``'s names. The
gradient of such a parameter is what the submodule's use gives it, so the submodule's unit
covers it (once: one tensor, one clipped and noised gradient, whatever its names), and the
enclosing module's own unit (the generic fallback, or a ``scope="direct"`` rule) does not
see it (:func:`own_parameters`).

Should the enclosing module use the parameter in its own forward too, that use would have
no rule: :func:`guard_alias_slots` puts a watched alias of the tensor in the module's slot
during its forward (as the tracker's detached aliases do for a unit's own slots), and a
gradient reaching it refuses the step (:func:`refuse_alias_uses`) before anything is
released or accounted.
"""

from __future__ import annotations

import torch
from torch import nn

from privlearn.errors import UnsupportedModuleError
from privlearn.torch._compile import skip_dynamo

__all__ = ["own_parameters", "guard_alias_slots", "refuse_alias_uses"]


def own_parameters(module: nn.Module) -> tuple:
    """The trainable parameters ``module`` registers itself (each once), less those one
    of its submodules registers too (the submodule's unit covers them)."""
    own = {id(p): p for p in module._parameters.values()
           if p is not None and p.requires_grad}
    if not own:
        return ()
    for sub in module.modules():
        if sub is not module:
            for p in sub._parameters.values():
                if p is not None:
                    own.pop(id(p), None)
    return tuple(own.values())


def _uncovered_slots(tracker) -> list:
    """``(qualified name, owner module, attribute name, parameter)`` of every slot that
    holds a clipped parameter and that no unit's forward swaps (:func:`~privlearn.torch.
    _tracker_util._param_slots`): an enclosing module's second registration of a tensor its
    submodule's unit covers."""
    from privlearn.torch._tracker_util import _param_slots

    covered = {(id(owner), name) for u in tracker.units
               for owner, name, _ in _param_slots(u.module, u.params)}
    out = []
    for mod_name, mod in tracker.model.named_modules():
        for name, p in mod._parameters.items():
            if (p is not None and id(p) in tracker.param_ids
                    and (id(mod), name) not in covered):
                out.append((f"{mod_name}.{name}" if mod_name else name, mod, name, p))
    return out


def guard_alias_slots(tracker) -> list:
    """Forward hooks on each module holding an uncovered slot: during its forward the slot
    holds a fresh alias of the parameter (same storage) whose gradient, should the module's
    own computation reach it, is noted in ``tracker.alias_uses``. Returns the handles."""
    by_module: dict[int, tuple[nn.Module, list]] = {}
    for qual, mod, name, p in _uncovered_slots(tracker):
        by_module.setdefault(id(mod), (mod, []))[1].append((qual, name, p))
    handles = []
    for mod, slots in by_module.values():
        stack: list = []
        handles.append(mod.register_forward_pre_hook(_swap_in(tracker, slots, stack)))
        handles.append(mod.register_forward_hook(_swap_out(stack), always_call=True))
    return handles


def _swap_in(tracker, slots, stack):
    from privlearn.torch.grad_sample import _IN_RULE

    def pre(module, args):
        if getattr(pre, "retired", False):  # removed during this call (_rehook.retire)
            return None
        if _IN_RULE.get() or not module.training or not torch.is_grad_enabled():
            stack.append(())
            return None
        done = []
        for qual, name, p in slots:
            cur = module._parameters.get(name)
            if cur is not p:  # reassigned by the user since: not ours to watch
                continue
            watched = p.detach().requires_grad_(True)
            watched.register_hook(_note(tracker, qual, p))
            module._parameters[name] = watched
            done.append((name, p, watched))
        stack.append(tuple(done))
        return None

    return pre


def _swap_out(stack):
    def post(module, args, output):
        for name, p, watched in stack.pop() if stack else ():
            if module._parameters.get(name) is watched:
                module._parameters[name] = p
        return None

    return post


def _note(tracker, qual: str, p):
    def fn(grad):
        tracker.alias_uses[id(p)] = qual
        tracker.outside_uses.add(id(p))  # the step's checks look there first
        return None

    return fn


skip_dynamo(_note(None, "", None).__code__)  # run eagerly in a backward() under torch.compile


def refuse_alias_uses(tracker) -> None:
    """Refuse the step when a module used, in its own forward, a parameter it registers a
    second time (see the module docstring); the tracker's records are cleared."""
    if not tracker.alias_uses:
        return
    used = sorted(tracker.alias_uses.values())
    also = sorted({n for n, v in tracker.model.named_parameters(remove_duplicate=False)
                   if id(v) in tracker.alias_uses} - set(used))
    tracker.alias_uses = {}
    tracker.outside_uses = set()
    tracker.clear()
    raise UnsupportedModuleError(
        f"parameter(s) {used} are registered by a module that uses them in its own "
        f"forward, and by a submodule too{f' ({also})' if also else ''}: the submodule's "
        "rule gives the per-example gradient of its own use only, and the enclosing "
        "module's use has no rule. Register each such parameter on the module that uses "
        "it, route the use through a submodule (e.g. an nn.Linear sharing the tensor), or "
        "register a rule covering the whole enclosing module (privlearn.torch."
        "register_rule(..., scope='subtree')). No step was taken and nothing was released")
