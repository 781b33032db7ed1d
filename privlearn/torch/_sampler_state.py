"""The reading of a sampler's saved state (:meth:`_AccountedSampler.load_state_dict`),
every entry checked before the sampler changes (:mod:`privlearn.torch._state_checks`)."""

from __future__ import annotations

from privlearn.errors import ConfigurationError, ParameterValueError
from privlearn.torch._state_checks import count_entry, entry, refuse_rewind, state_mapping

__all__ = ["read_sampler_state"]

_SAMPLER_HINT = (
    "pass the dict returned by the sampler's state_dict() (the 'sampler' "
    "entry of PrivateTraining.state_dict()) of the same run"
)


def read_sampler_state(
    sampler, state: dict, fmt: str, key_bytes: int
) -> tuple[bytes | None, int, int]:
    """The key (None: not saved), the batches taken and the position in the epoch of a
    state of ``sampler``'s kind written in format ``fmt``; refused (typed, naming the
    entry) unless it is one ``sampler`` could have saved with its settings."""
    refuse_rewind(sampler, "p.data_loader.batch_sampler")  # a run's, once it has steps
    what, hint = "the sampler's state", _SAMPLER_HINT
    state_mapping(state, what, hint)
    if state.get("format") != fmt:
        raise ParameterValueError(
            f"state is not a privlearn sampler state (format "
            f"{fmt!r}, got {state.get('format')!r}); " + hint
        )
    kind = entry(state, "kind", what, hint, str)
    params = entry(state, "params", what, hint, dict)
    saved = {
        ("sampling_rate" if k == "sample_rate" else k): v  # (a state saved
        for k, v in params.items()
    }  # before the rename) as it is now
    if "secure" in sampler._params():  # saved before the sampler had a secure mode
        saved.setdefault("secure", False)
    if kind != type(sampler).__name__ or saved != sampler._params():
        raise ConfigurationError(
            f"the saved sampler was {kind} with {params}, this one is "
            f"{type(sampler).__name__} with {sampler._params()}; rebuild with the same "
            "sampling, batch size and dataset"
        )
    text = entry(state, "key", what, hint, str, optional=True)
    try:
        key = None if text is None else bytes.fromhex(text)
    except ValueError:
        key = b""
    if key is not None and len(key) != key_bytes:
        raise ParameterValueError(
            f"{what}['key'] must be the hex text of a {key_bytes}-byte key, "
            f"got {text[:80]!r}; {hint}"
        )
    batches = count_entry(state, "batches", what, hint)
    pos = count_entry(state, "pos", what, hint)
    if pos >= max(1, sampler.steps):
        raise ParameterValueError(
            f"{what}['pos'] must be a position in an epoch of {sampler.steps} batches "
            f"(0 to {max(1, sampler.steps) - 1}), got {pos}; {hint}"
        )
    return key, batches, pos
