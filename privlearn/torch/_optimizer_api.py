"""The ``torch.optim.Optimizer`` interface of the DP optimizer, delegated to the optimizer
it wraps.

:class:`~privlearn.torch.optimizer.DPOptimizer` is a ``torch.optim.Optimizer`` (so that
``isinstance`` checks pass and the learning-rate schedulers of ``torch.optim.lr_scheduler``,
``torch.optim.swa_utils.SWALR`` and ``transformers.get_scheduler`` accept it) without
being one of its own: ``Optimizer.__init__`` is not called. The parameter groups, the
per-parameter state and the defaults are those of the wrapped optimizer (properties, so a
scheduler that sets ``group["lr"]`` changes the learning rate the wrapped optimizer's
update uses), and ``state_dict``/``load_state_dict`` are the wrapped optimizer's, run
between this object's own state-dict hooks. What ``Optimizer`` keeps per instance and
reads in its inherited methods is set up by :meth:`OptimizerDelegation._init_optimizer_api`:
the step, state-dict and load-state-dict hook registries (``register_step_pre_hook`` and
the others work as on any optimizer) and the profiler's name of ``zero_grad``. The same
pattern as accelerate's ``AcceleratedOptimizer``.

Step hooks fire once per parameter update, as on a plain optimizer. ``Optimizer`` wraps
every subclass's ``step`` in a function that runs torch's global step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) and the instance's around
every call; here the wrapped optimizer's own ``step`` (the update) already runs the
global ones, and a call of the DP step on a virtual batch's earlier chunk updates
nothing. So this class's ``step`` is left unwrapped, and the DP step runs this
instance's hooks itself (:meth:`OptimizerDelegation._with_step_hooks`) on the calls that
end a logical batch; the global hooks fire in the wrapped optimizer's update, their
optimizer argument that one, with the clipped, noised gradient it applies in ``.grad``.

Under ``torch.compile`` (a compiled training-step function that calls ``step()``) the
loop methods of a subclass (:data:`EAGER_METHODS`) run eagerly, outside the compiled
code (:func:`~privlearn.torch._compile.eager_boundary`): clipping, noise and accounting
are those of an eager step.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from privlearn import _validation as _v
from privlearn._opacus_names import missing_method
from privlearn.errors import ConfigurationError, TrainingLoopError
from privlearn.torch._compile import eager_boundary
from privlearn.torch._run_fields import RunAccountant, RunPart
from privlearn.torch._state_checks import entry, state_mapping

__all__ = [
    "ACCOUNTED_STEPS",
    "OPACUS_OPTIMIZER_METHODS",
    "OptimizerDelegation",
    "guard_run_state",
    "not_built_by_make_private",
]

#: The entry of ``p.optimizer.state_dict()`` that records the private steps taken.
ACCOUNTED_STEPS = "privlearn_accounted_steps"

_CHUNKS = (
    "make_private(..., max_physical_batch_size=k): p.data_loader yields chunks of at "
    "most k examples of each logical batch; call p.optimizer.step() after every "
    "chunk (the noise and the update happen once per logical batch)"
)

#: Methods and attributes of Opacus's ``DPOptimizer`` (``virtual_step``: of Opacus 0.x) that
#: a user coming from Opacus reaches for on ``p.optimizer``, and what to use (an
#: AttributeError that says so, instead of Python's bare one).
OPACUS_OPTIMIZER_METHODS = {
    "virtual_step": _CHUNKS,
    "signal_skip_step": _CHUNKS,
    "attach_step_hook": (
        "p.optimizer.register_step_post_hook(hook), PyTorch's own, which "
        "fires once per parameter update; the accountant records every "
        "step itself"
    ),
    "grad_samples": (
        "p.optimizer.last_grad_norms, the last batch's per-example norms "
        "(the per-example gradients are not materialised)"
    ),
    "params": "[q for group in p.optimizer.param_groups for q in group['params']]",
}


def _delegated(name: str) -> property:
    """A read-write property that reads and sets ``self.original_optimizer.<name>``."""
    return property(
        lambda self: getattr(self.original_optimizer, name),
        lambda self, value: setattr(self.original_optimizer, name, value),
        doc=f"The wrapped optimizer's ``{name}``.",
    )


def not_built_by_make_private(name: str) -> TypeError:
    """The error for a DP optimizer built by hand, as Opacus's tutorials build theirs
    (``DPOptimizer(optimizer, noise_multiplier=..., max_grad_norm=...,
    expected_batch_size=...)``): :func:`~privlearn.torch.make_private` builds it, with the
    per-example gradients, the sampler and the accountant it needs."""
    return TypeError(
        f"{name} is built by privlearn.torch.make_private, not by hand (Opacus's "
        f"{name}(optimizer, noise_multiplier=..., max_grad_norm=..., "
        "expected_batch_size=...)): p = make_private(model, optimizer, data_loader, "
        "noise_multiplier=..., max_grad_norm=...) hooks the model, replaces the loader's "
        "batching by Poisson sampling (expected batch size: the loader's batch_size) and "
        "returns p.optimizer, which clips, adds the noise and is accounted by p.accountant"
    )


#: the DP optimizer's methods a training loop calls: never traced by Dynamo
EAGER_METHODS = ("step", "zero_grad", "clip_and_accumulate", "add_noise")


def guard_run_state(dp, step_guard) -> Callable[[], None]:
    """Give the wrapped optimizer's ``state_dict()`` the count of private steps that
    ``dp`` (the DP optimizer wrapping it) has taken, and check its ``load_state_dict``
    as ``dp``'s own: a checkpoint of the optimizer given to make_private (the variable a
    loop keeps, ``torch.save({"optimizer": optimizer.state_dict(), ...})``), loaded
    into a fresh run, would otherwise continue the run with an accountant starting
    again from zero (:meth:`OptimizerDelegation.load_state_dict`). The run's sampler,
    noise source and correlated noise refuse a saved state once it has steps (``_run_history``:
    :func:`~privlearn.torch._state_checks.refuse_rewind`). Returns the function that
    removes the optimizer's hooks and ``step_guard`` (a hook handle)."""
    for part in (dp.noise, dp.sampler, dp.correlated):
        if part is not None:
            part._run_history = dp.accountant
    ref = weakref.ref(dp)

    def add_steps(optimizer, state: dict) -> None:
        if (owner := ref()) is not None:
            state[ACCOUNTED_STEPS] = owner._accounted_steps()

    def check_steps(optimizer, state: dict) -> None:
        if (owner := ref()) is not None:
            owner._check_accounted_steps(state, "the optimizer given to make_private")

    opt = dp.original_optimizer
    handles = (step_guard, opt.register_state_dict_post_hook(add_steps),
               opt.register_load_state_dict_pre_hook(check_steps))

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove


class OptimizerDelegation(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose groups, state and defaults are those of
    ``self.original_optimizer`` (set by the subclass before :meth:`_init_optimizer_api`)."""

    accountant = RunAccountant()  # set once by the subclass (privlearn.torch._run_fields)
    noise = RunPart()  # not replaced once the run has steps (its draws would repeat)
    correlated = RunPart()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in EAGER_METHODS:  # run eagerly under torch.compile (module docstring)
            if name in cls.__dict__:
                setattr(cls, name, eager_boundary(cls.__dict__[name]))

    def __new__(cls, *args, **kwargs):
        # built by make_private; Opacus's DPOptimizer(optimizer, noise_multiplier=...,
        # ...) (no tracker) says so, rather than "missing argument 'tracker'"
        from privlearn.torch.tracker import GradSampleTracker

        tracker = args[1] if len(args) > 1 else kwargs.get("tracker")
        if (args or kwargs) and not isinstance(tracker, GradSampleTracker):
            raise not_built_by_make_private(cls.__name__)
        return super().__new__(cls)

    def __getattr__(self, name: str):  # only for missing attributes: Opacus's names
        raise missing_method(
            type(self).__name__, name, OPACUS_OPTIMIZER_METHODS, "of Opacus's DPOptimizer"
        )

    def _init_optimizer_api(self) -> None:
        """The per-instance attributes ``Optimizer``'s own methods read (its ``__init__``,
        which would build parameter groups of its own, is not called)."""
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()  # step hooks and the profiler's record of step()

    def _patch_step_function(self) -> None:
        # Optimizer's would wrap the class's step in its hook runner (see the module
        # docstring); only the profiler's name of zero_grad is kept
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

    def _with_step_hooks(self, step, *args, **kwargs):
        """``step(*args, **kwargs)`` between this instance's step pre- and post-hooks,
        as ``Optimizer``'s wrapper runs them (a pre-hook may return new ``(args,
        kwargs)``), in the profiler's record of ``step``."""
        args = (self, *args)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            try:
                for hook in self._optimizer_step_pre_hooks.values():
                    result = hook(self, args, kwargs)
                    if result is not None:
                        if not (isinstance(result, tuple) and len(result) == 2):
                            raise TrainingLoopError(
                                "a step pre-hook must return None or a tuple (new_args, "
                                f"new_kwargs), got {result!r}"
                            )
                        args, kwargs = result
            except Exception as exc:  # distributed: refused on every rank together
                getattr(self, "_refuse_together", lambda _e: None)(exc)
                raise
            out = step(*args[1:], **kwargs)
            self._optimizer_step_code()
            for hook in self._optimizer_step_post_hooks.values():
                hook(self, args, kwargs)
        return out

    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")

    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()``, with this optimizer's state-dict hooks
        (``register_state_dict_pre_hook``/``_post_hook``) run around it, and one entry
        more, ``"privlearn_accounted_steps"``: the private steps the run had taken
        (:meth:`load_state_dict` checks it; a plain optimizer's ``load_state_dict``
        ignores it)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = self.original_optimizer.state_dict()
        state[ACCOUNTED_STEPS] = self._accounted_steps()
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, state)
            if out is not None:
                state = out
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """The wrapped optimizer's ``load_state_dict``, with this optimizer's
        load-state-dict hooks run around it.

        Raises
        ------
        ConfigurationError
            ``state_dict`` is that of a DP optimizer after more private steps than this
            run has accounted (an optimizer checkpoint loaded into a fresh run, which
            would report an epsilon without those steps); nothing is loaded.
        ParameterTypeError or ParameterValueError
            ``state_dict`` is not a dict with ``param_groups``, or its count of private
            steps is not an integer >= 0; nothing is loaded.
        """
        self._check_accounted_steps(state_dict)
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        self.original_optimizer.load_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _accounted_steps(self) -> int:
        accountant = getattr(self, "accountant", None)
        return 0 if accountant is None else int(accountant.steps)

    def _check_accounted_steps(self, state_dict, name: str = "p.optimizer") -> None:
        """Refuse the state of a DP optimizer that took more private steps than this run
        has accounted: continuing from it here would leave those steps out of epsilon. A
        run composed after earlier ones (``p.compose_after``) accounts them already.
        ``name``: the optimizer whose ``load_state_dict`` was called, for the message."""
        hint = ("pass the dict returned by p.optimizer.state_dict() (to resume a run, "
                "p.load_state_dict(state) with the dict p.state_dict() returned)")
        entry(state_mapping(state_dict, "state_dict", hint), "param_groups", "state_dict",
              hint, list)
        saved = entry(state_dict, ACCOUNTED_STEPS, "state_dict", hint, optional=True)
        if saved is not None:
            saved = _v.check_count(f"state_dict[{ACCOUNTED_STEPS!r}]", saved,
                                   integral_floats=False, hint=hint)
        here = self._accounted_steps()
        prior = getattr(getattr(self, "accountant", None), "prior", None)
        if saved is None or saved <= here or prior is not None:
            return
        raise ConfigurationError(
            f"load_state_dict of {name}: the state is that of a DP optimizer after "
            f"{saved} private step(s), and this run has accounted {here}: continuing from "
            "it here would report an epsilon that leaves out the steps taken before it was "
            "saved. A checkpoint of the optimizer (and the model) alone holds no privacy "
            "history, so it cannot resume a run: save p.state_dict() instead (it holds the "
            "optimizer, the model and the accountant's history) and load it with "
            "p.load_state_dict(state) right after make_private (or make_private(..., "
            "resume=state)). To go on from this checkpoint in a new run on purpose, "
            "compose the earlier run into its epsilon first, p.compose_after(the earlier "
            "run's mechanism, earlier_p.accountant.mechanism()); if the new run trains on "
            f"other data, delete the state's {ACCOUNTED_STEPS!r} entry instead. Nothing "
            "was loaded"
        )

    def train(self) -> None:
        """The wrapped optimizer's ``train()``, if it has one (schedule-free optimizers:
        the parameters set to the point the gradients are taken at; transformers'
        Trainer calls it before each training step); nothing otherwise."""
        mode = getattr(self.original_optimizer, "train", None)
        if callable(mode):
            mode()

    def eval(self) -> None:
        """The wrapped optimizer's ``eval()``, if it has one (schedule-free optimizers:
        the parameters set to the averaged point evaluated and saved; the Trainer calls
        it before evaluating); nothing otherwise."""
        mode = getattr(self.original_optimizer, "eval", None)
        if callable(mode):
            mode()

    def __getstate__(self) -> dict:
        # the whole object (Optimizer's would keep only groups, state and defaults)
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._patch_step_function()
