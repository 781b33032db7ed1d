"""The privacy settings a :class:`~privlearn.torch.hf.DPTrainer` checkpoint records, and
their check when a run resumes from it.

A resumed run is the run that wrote the checkpoint, continued: its accountant's history,
its sampler and its noise go on from where they were. The mechanism itself (noise
multiplier, clipping bound, sampling, accountant, ...) is compared by
:meth:`~privlearn.torch.privacy_engine.PrivateTraining.load_state_dict`; what it does not
see is the rest of :class:`~privlearn.torch.hf.PrivacyArguments`: the ``target_delta``
every logged epsilon is reported at, the ``max_epsilon`` the run stops at, and the
``dp_seed`` of the sampler and the noise (a resumed run continues the checkpoint's
streams, not those of a new seed). A changed value would be silently ignored (the seed)
or would change the run half-way (epsilon logged at another delta from the checkpoint
on, another stop), so it is refused, naming each field.

The public settings go into the checkpoint's ``privlearn_privacy.pt``; ``dp_seed``
replays the sampler and the noise, so it is recorded only in the private state file
under ``private_state_dir``, and an error never shows it.

The files themselves are read by :func:`check_checkpoint_state` and
:func:`check_secret_state` before anything is taken from them: a file that is not one
DPTrainer wrote (a missing entry, an entry of the wrong type) is refused with a typed
error naming the entry; its parts are then read by ``make_private(resume=...)``.
"""

from __future__ import annotations

import enum
from dataclasses import fields

from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
from privlearn.torch._state_checks import entry, state_mapping

__all__ = ["MAY_CHANGE", "check_checkpoint_state", "check_resumed_settings",
           "check_secret_state", "recorded_settings"]

#: PrivacyArguments fields a resumed run may change: they change neither the mechanism,
#: nor its accounting, nor when it stops (the seed of a new run's streams, a probe, the
#: layout of the model's inputs, the reading of the model's task, whether the un-noised
#: loss is logged, how long the processes wait for each other). They are not recorded.
MAY_CHANGE = ("dp_seed", "check_batch_independence", "batch_dims", "task",
              "log_training_loss", "agreement_timeout")


def _plain(value):
    """A setting as compared: an enum by its value, a strategy object by its repr."""
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, bool | int | float | str | list | dict | tuple):
        return value
    return repr(value)


def recorded_settings(privacy) -> dict:
    """The public PrivacyArguments settings a checkpoint records (``max_epsilon`` as the
    run applies it: ``target_epsilon`` when not given)."""
    out = {f.name: _plain(getattr(privacy, f.name)) for f in fields(privacy)
           if f.name not in MAY_CHANGE}
    if out.get("max_epsilon") is None:
        out["max_epsilon"] = out.get("target_epsilon")
    return out


def check_resumed_settings(checkpoint, saved: dict | None, privacy) -> None:
    """Refuse resuming ``checkpoint`` (whose recorded settings are ``saved``) with
    PrivacyArguments ``privacy`` that differ in a setting outside :data:`MAY_CHANGE`.
    A checkpoint that records nothing (written before settings were recorded) is not
    checked here (its mechanism still is, when it is loaded).

    Raises
    ------
    ConfigurationError
        Naming every setting that differs, with the saved and the given value.
    """
    if saved is None:
        return
    mine = recorded_settings(privacy)
    diff = [f"{k}: saved {saved.get(k)!r}, given {mine.get(k)!r}"
            for k in sorted(set(mine) | set(saved)) if saved.get(k) != mine.get(k)]
    if not diff:
        return
    raise ConfigurationError(
        f"resume_from_checkpoint={str(checkpoint)!r}: the PrivacyArguments differ from those "
        f"of the run that wrote the checkpoint ({'; '.join(diff)}). A resumed run continues "
        "that run (its accountant's history, sampler and noise), so a different target_delta "
        "would report its epsilon at another delta from the checkpoint on, and a different "
        "max_epsilon would move its stop. Resume with the same PrivacyArguments (only "
        f"{', '.join(MAY_CHANGE)} may change), or start a new run with the new settings. "
        "Nothing was run")


def _hint(checkpoint) -> str:
    return (f"resume from a checkpoint folder of the same run as DPTrainer wrote it "
            f"(resume_from_checkpoint={str(checkpoint)!r}), its files unaltered")


def check_checkpoint_state(checkpoint, state: object) -> dict:
    """``state``, the privacy state file of ``checkpoint``, refused (typed, naming the
    entry) unless it is a dict whose recorded settings and private-part record are the
    ones DPTrainer writes; nothing is taken from it before."""
    what, hint = f"the privacy state of checkpoint {str(checkpoint)!r}", _hint(checkpoint)
    state_mapping(state, what, hint)
    entry(state, "mechanism", what, hint, dict)
    entry(state, "privacy_arguments", what, hint, dict, optional=True)
    entry(state, "earlier_runs", what, hint, list, optional=True)
    info = entry(state, "private_state", what, hint, dict, optional=True)
    if info is not None:
        where = f"{what}['private_state']"
        entry(info, "token", where, hint, str)
        entry(info, "kept", where, hint, bool)
        parts = entry(info, "parts", where, hint, list)
        if not all(isinstance(part, str) for part in parts):
            raise ParameterTypeError(f"{where}['parts'] must be a list of entry names, got "
                                     f"{parts!r:.80}; {hint}")
    return state


def check_secret_state(path, checkpoint, secret: object, info: dict, fmt: str) -> dict:
    """``secret``, read from ``path``: refused unless it is the private state file of
    ``checkpoint`` (format ``fmt``, the token of its record ``info``) holding every part
    the record names."""
    if not isinstance(secret, dict) or secret.get("format") != fmt \
            or secret.get("token") != info["token"]:
        raise ParameterValueError(f"{path} is not the private state of checkpoint "
                                  f"{checkpoint!r} (its token differs)")
    missing = [part for part in info["parts"] if part not in secret]
    if missing:
        raise ParameterValueError(
            f"{path}, the private state of checkpoint {checkpoint!r}, has no {missing} "
            f"entries, which its checkpoint's record names; {_hint(checkpoint)}")
    return secret
