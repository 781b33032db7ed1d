"""The engine's functions under ``torch.compile``: run eagerly, outside compiled code.

The engine's module hooks and its optimizer's loop methods have Python side effects
(recording inputs, registering tensor hooks, swapping parameters, drawing noise,
accounting) that must happen on the real tensors of each call. Each is wrapped by
:func:`eager_boundary` (the module hooks by ``_tracker_util._Hook``, which also refuses
pickling), which has two paths:

* while Dynamo traces a compiled function that reaches it, ``torch.compiler.is_compiling()``
  folds to True and the call goes to the ``torch.compiler.disable`` version: a graph break
  around it, the call run eagerly;
* otherwise the function is called directly (the ``disable`` wrapper costs a few
  microseconds a call, about 1% of a small BERT's private step with ~90 hook calls).

Dynamo also compiles, as frames of their own, the Python functions that compiled code
calls at a graph break: a hook called by a compiled model's ``Module.__call__`` after
the layer before it broke the graph. The wrapper's own frame would then be compiled,
its guards specialised on the hook's arguments (how many, their types, whether they
require gradients), and recompiled for every other hook until Dynamo's recompile limit
(8) warns and gives up: seconds of compilation for nothing. The wrapper's code is
therefore marked to be skipped by Dynamo, together with every frame it calls (the
engine's function runs eagerly; a compiled model it calls, such as the
batch-independence probe's forward of a compiled model, still runs compiled). The mark
is torch's code execution strategy (``torch._dynamo.eval_frame.skip_code`` marks the
frame alone); on a torch without it the behaviour is the one above, recompiles included.
The gradient hooks and the end-of-backward callback the engine gives autograd are marked
the same way: a ``backward()`` called inside a compiled function runs eagerly after a
graph break, and Dynamo would otherwise compile them as frames of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import CodeType

import torch

__all__ = ["eager_boundary", "eager_callback", "hookless_forward_hint", "skip_dynamo"]

_is_compiling = torch.compiler.is_compiling


def skip_dynamo(code: CodeType) -> bool:
    """Mark ``code`` so that Dynamo never compiles a frame of it nor of the functions it
    calls (``FrameAction.SKIP`` for the frame and recursively). Returns whether the mark
    was set (False on a torch without code execution strategies)."""
    frames = getattr(torch._C, "_dynamo", None)
    frames = getattr(frames, "eval_frame", None)
    set_strategy = getattr(frames, "set_code_exec_strategy", None)
    action = getattr(frames, "_FrameAction", None)
    strategy = getattr(frames, "_FrameExecStrategy", None)
    if set_strategy is None or action is None or strategy is None:
        return False
    set_strategy(code, strategy(action.SKIP, action.SKIP))
    return True


def eager_boundary(fn: Callable) -> Callable:
    """``fn`` run eagerly under ``torch.compile`` (a graph break around it), called
    directly otherwise; the wrapper's frames are never compiled (module docstring)."""
    disabled = torch.compiler.disable(fn, recursive=True)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


#: one code object for every wrapper :func:`eager_boundary` makes
SKIPPED = skip_dynamo(eager_boundary(len).__code__)


def hookless_forward_hint(tracker) -> str:
    """The end of the refusal of a step whose parameters got gradients although no layer
    hook of the engine ran in the forward pass: the likely cause when the model was
    compiled before ``make_private`` (``""`` when a hook ran). Dynamo does not guard
    compiled code on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``),
    so code compiled by a call before ``make_private`` keeps running without them; the
    parameters' own gradient hooks, run by autograd outside compiled code, still see
    every gradient reach them, so the step is refused rather than released unclipped."""
    if any(tracker.records.values()):
        return ""
    return (
        ". No layer hook of the engine ran in this forward pass: a model compiled with "
        "torch.compile and called before make_private keeps running the code compiled "
        "then, without the hooks make_private added (torch does not check module hooks "
        "before running compiled code); call make_private before the compiled model's "
        "first call, or torch._dynamo.reset() after make_private"
    )


def eager_callback(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` (no arguments) as a callback autograd's engine calls at the end of a backward
    pass (``queue_callback``), its frames never compiled by Dynamo (a ``backward()``
    inside a compiled function runs after a graph break, where Dynamo would compile the
    callback as a frame of its own, again at every step)."""

    def call() -> None:
        fn()

    return call


skip_dynamo(eager_callback(len).__code__)
