"""Hooks of the engine replaced during the root module's own call.

The tracker notices a change of the trainable parameters (a parameter frozen or unfrozen
between steps) in the forward pre-hook of the model itself, and rediscovers its units
there: it removes every hook it placed and places new ones. When the model is itself a
unit (a bare ``nn.Linear`` given to ``make_private``), some of those hooks are forward
pre-hooks of the very module whose call is running, and torch runs the pre-hooks of a
call from a snapshot taken before the first one ran: the removed hooks would still be
called (one placed ``with_kwargs=True`` then without its ``kwargs``, since torch looks
that flag up in the live table) and the new ones not at all. :func:`retire` makes the
removed hooks do nothing and :func:`run_new_pre_hooks` runs the new ones of that call, in
the order torch would have.

Also the check, when the clipped parameters change, that none of them is new since
``make_private`` and outside the optimizer (:func:`refuse_new_unheld`): a layer replaced
after ``make_private``.
"""

from __future__ import annotations

import weakref

from torch import nn

from privlearn.errors import TrainingLoopError
from privlearn.torch._tracker_util import _Hook

__all__ = ["retire", "run_new_pre_hooks", "snapshot", "refuse_new_unheld"]


def _noop(*args, **kwargs):
    return None


def retire(handles) -> None:
    """Make the hooks behind ``handles`` (about to be removed) do nothing, should a call
    that took its snapshot of hooks before their removal still call them."""
    for h in handles:
        ref = getattr(h, "hooks_dict_ref", None)
        table = ref() if ref is not None else None
        hook = table.get(h.id) if table is not None else None
        if isinstance(hook, _Hook):
            hook.fn = hook.disabled = _noop
        elif hook is not None:
            try:
                hook.retired = True  # a plain function checks it (_aliases)
            except AttributeError:
                pass


def run_new_pre_hooks(module: nn.Module, handles, args, kwargs):
    """Run the forward pre-hooks among ``handles`` placed on ``module`` during its
    current call (torch's snapshot of that call's hooks does not hold them), as torch runs
    them. Returns the call's ``(args, kwargs)``, or None when no such hook exists."""
    ours = {
        h.id
        for h in handles
        if getattr(h, "hooks_dict_ref", None) is not None
        and h.hooks_dict_ref() is module._forward_pre_hooks
    }
    if not ours:
        return None
    with_kwargs = module._forward_pre_hooks_with_kwargs
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id not in ours:
            continue
        if hook_id in with_kwargs:
            out = hook(module, args, kwargs)
            if out is not None:
                args, kwargs = out
        else:
            out = hook(module, args)
            if out is not None:
                args = out if isinstance(out, tuple) else (out,)
    return args, kwargs


def snapshot(model: nn.Module) -> dict:
    """``id -> weak reference`` of every parameter of ``model`` (trainable or not) when
    the engine attached: what :func:`refuse_new_unheld` tells new parameters by (a weak
    reference, since the id of a freed parameter may be reused by a new one)."""
    return {id(p): weakref.ref(p) for p in model.parameters()}


def refuse_new_unheld(tracker, held: set) -> None:
    """Refuse the step when the engine clips a parameter that the model did not have at
    ``make_private`` and that the wrapped optimizer (its parameters' ids: ``held``) does
    not hold. A layer replaced after ``make_private`` (``model.fc = nn.Linear(...)``,
    ``load_state_dict(..., strict=False, assign=True)``) brings such parameters: the
    engine follows them, but the optimizer still updates the replaced tensors, so they
    would never train while the step is released and accounted. Compares object
    identities only (no read of the device); run when the clipped set changes."""
    born = getattr(tracker, "born", None)
    if born is None:
        return
    new = [
        q
        for q in tracker.params
        if id(q) not in held and (born.get(id(q)) is None or born[id(q)]() is not q)
    ]
    if not new:
        return
    names = {id(v): n for n, v in tracker.model.named_parameters()}
    shown = [names.get(id(q), tuple(q.shape)) for q in new]
    tracker.clear()
    raise TrainingLoopError(
        f"optimizer.step() refused: the model's trainable parameter(s) {shown[:6]}"
        f"{' ...' if len(shown) > 6 else ''} were not in the model at make_private and the "
        "wrapped optimizer does not hold them: a layer was replaced after make_private "
        "(e.g. model.fc = nn.Linear(...), or load_state_dict with assign=True), so the "
        "optimizer would go on updating the replaced tensors and these would never train "
        "while every step is released and accounted. Change the model first, then build "
        "the optimizer over its parameters and call make_private (to load weights, use "
        "load_state_dict without assign=True: it copies them into the tracked "
        "parameters). Nothing was released and no step was taken"
    )
