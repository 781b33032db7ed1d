"""The entries of a saved state, read and checked before anything is loaded.

Every ``load_state_dict`` of the engine (the accountant, the sampler, the noise source,
the correlated noise, the DP optimizer, :class:`~privlearn.torch.PrivateTraining`) reads
its state through these helpers first and changes nothing until all of it has been read:
a dict with a missing entry, an entry of the wrong type, a negative count or a NaN is
refused with a typed error (:mod:`privlearn.errors`) that names the entry, the value
received and what to pass instead, and the object is left as it was.
"""

from __future__ import annotations

import math

from privlearn import _validation as _v
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = [
    "RESUME_HINT",
    "check_parts",
    "count_entry",
    "entry",
    "longer_run_hint",
    "real_entry",
    "state_mapping",
]

#: What to pass instead, for the states that are parts of a training run's state.
RESUME_HINT = "pass the dict returned by PrivateTraining.state_dict() of the same run"


def state_mapping(state: object, what: str, hint: str) -> dict:
    """``state`` itself, refused unless it is a dict."""
    if not isinstance(state, dict):
        raise ParameterTypeError(
            f"{what} must be a dict, got {_v._show(state)[:80]} ({type(state).__name__}); {hint}"
        )
    return state


def entry(
    state: dict, key: str, what: str, hint: str, types: type | tuple = (), *, optional: bool = False
):
    """``state[key]``: refused when missing (unless ``optional``: then None) or, with
    ``types``, not an instance of them (None is allowed for an optional entry)."""
    if key not in state:
        if optional:
            return None
        raise ParameterValueError(
            f"{what} has no {key!r} entry (it has {sorted(map(str, state))[:12]}); {hint}"
        )
    value = state[key]
    if types and not isinstance(value, types) and not (optional and value is None):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ParameterTypeError(
            f"{what}[{key!r}] must be a {names}, got "
            f"{_v._show(value)[:80]} ({type(value).__name__}); {hint}"
        )
    return value


def count_entry(state: dict, key: str, what: str, hint: str, *, minimum: int = 0) -> int:
    """``state[key]`` as an int count >= ``minimum`` (a float or a bool is refused)."""
    return _v.check_count(
        f"{what}[{key!r}]",
        entry(state, key, what, hint),
        minimum=minimum,
        integral_floats=False,
        hint=hint,
    )


def real_entry(
    state: dict, key: str, what: str, hint: str, *, positive: bool = False, allow_inf: bool = False
) -> float:
    """``state[key]`` as a real number >= 0 (> 0 with ``positive``), finite unless
    ``allow_inf``; NaN is refused."""
    name, value = f"{what}[{key!r}]", entry(state, key, what, hint)
    x = _v.check_real(name, value, hint=hint)
    if math.isnan(x):
        raise ParameterValueError(f"{name} is NaN; {hint}")
    check = _v.check_positive if positive else _v.check_nonnegative
    return check(name, x, allow_inf=allow_inf, hint=hint)


def check_parts(p, state: dict) -> None:
    """Read every part of a :meth:`PrivateTraining.state_dict` ``state`` that ``p`` (the
    run it is loaded into) would load, refusing (typed, naming the entry) a missing or
    malformed one before any part is loaded: the model's and the optimizer's states, the
    live noise multiplier and clipping bound, the accountant's history, the sampler's,
    the budget's and the correlated noise's states (the noise source's is read by its own
    ``load_state_dict``, which changes nothing when it refuses); and parts saved after
    different steps (the sampler's batches, or the correlated noise's steps of a noised
    run, not the accountant's): resumed, the sampler would redraw batches already used
    and the noise would continue out of step with the accounted mechanism."""
    what, hint = "state", RESUME_HINT
    for key in ("model", "optimizer", "sampler", "noise", "accountant", "budget"):
        entry(state, key, what, hint, dict)
    entry(state["optimizer"], "state", "state['optimizer']", hint, dict)
    groups = entry(state["optimizer"], "param_groups", "state['optimizer']", hint, list)
    for i, group in enumerate(groups):
        entry(
            state_mapping(group, f"state['optimizer']['param_groups'][{i}]", hint),
            "params",
            f"state['optimizer']['param_groups'][{i}]",
            hint,
            list,
        )
    sigma = real_entry(state, "noise_multiplier", what, hint)
    real_entry(state, "max_grad_norm", what, hint, positive=True, allow_inf=True)
    segments, _ = p.accountant._read_state(state["accountant"])
    _, batches, _ = p._sampler.read_state(state["sampler"])
    p.budget.read_state(state["budget"])
    steps = sum(seg.steps for seg in segments)
    positions = [("the sampler's batches (state['sampler']['batches'])", batches)]
    if p.optimizer.correlated is not None:
        noised = p.optimizer.correlated._read_state(entry(state, "correlated", what, hint, dict))[0]
        if sigma > 0:  # (a run without noise never moves its stream)
            positions.append(
                ("the correlated noise's steps (state['correlated']['steps'])", noised)
            )
    for name, at in positions:
        if at != steps:
            raise ParameterValueError(
                f"{name} is {at}, but the accountant's history (state['accountant']) has "
                f"{steps} steps: PrivateTraining.state_dict() saves them after the same "
                "step, so these parts come from different points of a run (or different "
                "runs). Resumed, the sampler would draw again the batches of steps it "
                "already took (or skip some), or the correlated noise would continue "
                "from another step than the accountant's, and the participation and noise "
                "the run is accounted for would not be those released. Nothing was "
                f"loaded; {hint}"
            )


def longer_run_hint(saved: dict, here: dict, calibrated: bool) -> str:
    """What to do when a checkpoint's noise multiplier is the only difference and this
    run calibrated its own (``target_epsilon``): usually another ``epochs`` or ``steps``,
    a run asked to go on past the saved run's plan, which ``noise_multiplier=`` allows."""
    differ = {k for k in set(saved) | set(here) if saved.get(k) != here.get(k)}
    if not calibrated or differ != {"noise_multiplier"}:
        return ""
    return (
        f" (target_epsilon calibrates the noise for the planned epochs or steps, so another "
        f"plan gives another noise multiplier; to train past the saved run's plan, pass its "
        f"noise multiplier, noise_multiplier={saved['noise_multiplier']!r}, instead of "
        "target_epsilon, and max_epsilon= as the cap: epsilon then grows with every step)"
    )


def refuse_rewind(part, name: str) -> None:
    """Refuse to load a saved state into ``part``, the sampler, the noise source or the
    correlated noise of a private run (``_run_history``: its accountant, set by
    ``make_private``), once the run has taken steps: the state would move it back to a
    point the run has passed, and the steps after it would draw again batches and noise
    already released (one noise added to two gradients gives their un-noised
    difference), while each is accounted as a fresh draw. A fresh run loads the whole
    state, :meth:`PrivateTraining.load_state_dict`."""
    history = getattr(part, "_run_history", None)
    if history is not None and history.steps:
        raise ConfigurationError(
            f"{name}.load_state_dict: the private run it belongs to has taken "
            f"{history.steps} steps, and a saved state would move it back to a point "
            "the run has passed: the next steps would draw again the batches and the "
            "noise of steps already released (one noise added to two gradients gives "
            "their un-noised difference), each accounted as a fresh draw. To resume, "
            "load the whole state into a freshly made run, p.load_state_dict(state), "
            "right after make_private; nothing was loaded")
