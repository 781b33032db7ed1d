"""The fixed layout a saved sampler state continues with (the groups of cyclic Poisson
sampling, the bins of balls-in-bins sampling, the order of shuffled epochs).

The accounting of these samplings assumes one layout for the whole run: an example takes
part only in the steps of its own part, ``cycle_length`` steps apart (Choquette-Choo et
al. 2023, "(Amplified) Banded Matrix Factorization", NeurIPS, Algorithm 2). A resumed run
must therefore follow the layout of the run it continues: a seeded sampler saves the
layout's seed, a secure one (drawn from the OS CSPRNG, never replayable) the parts
themselves. A state that holds neither, or parts that are not a layout of this sampler
(an example in two parts, an index outside the dataset, another number of parts), is
refused before anything of the run is changed. The layout is a function of the dataset's
indices only, not of its values: a resumed run whose dataset holds the examples at other
indices (shuffled or split anew, ``random_split`` without a generator) would put them in
other parts, so an example could take part in the steps of two. The saved state therefore
records a digest of the dataset (:func:`~privlearn.torch.distributed.dataset_digest`,
the one the ranks of a distributed run compare; in the checkpoint, a secret, never in a
report), and a run whose dataset's digest differs is refused."""

from __future__ import annotations

import numpy as np

from privlearn.errors import ConfigurationError

__all__ = ["check_sampler_state", "sampler_state", "saved_layout"]


def saved_layout(sampler, state: dict) -> tuple[int | None, list[np.ndarray] | None]:
    """``(layout seed, parts)`` that the scheduled ``sampler`` continues ``state`` with:
    the saved parts (validated) when the state holds them, else the saved layout seed.

    Raises
    ------
    ConfigurationError
        The state holds no layout, or parts that are not a layout of ``sampler``.
    """
    parts = state.get("parts") if isinstance(state, dict) else None
    if parts is not None:
        return None, _check_parts(sampler, parts)
    seed = state.get("layout") if isinstance(state, dict) else None
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) \
            and 0 <= int(seed) < 2**63:
        return int(seed), None
    raise ConfigurationError(
        f"the saved state of {type(sampler).__name__} holds no layout (its "
        f"{'parts' if sampler.secure else 'layout seed'}, got layout={seed!r}): "
        f"sampling={sampler.law.name!r} accounts one layout fixed for the whole run, and "
        "a resumed run drawing a new one would let an example take part in the steps of "
        "two parts. Resume from the state state_dict() returned, unchanged, or start a "
        "new run")


def _check_parts(sampler, parts) -> list[np.ndarray]:
    """``parts`` as index arrays, refused unless they are a layout of ``sampler``: as
    many parts as it draws, every index in ``range(num_samples)``, none in two parts."""
    n = int(sampler.num_samples)
    want = 1 if sampler.law.layout is None else int(sampler.cycle_length)
    why = None
    try:
        arrays = [np.asarray(p) for p in parts]
    except TypeError:
        arrays, why = [], f"not a list of index lists (got {type(parts).__name__})"
    if why is None and len(arrays) != want:
        why = f"{len(arrays)} parts, this sampler has {want}"
    if why is None and any(a.ndim != 1 or (a.size and a.dtype.kind not in "iu")
                           for a in arrays):
        why = "a part is not a list of integer indices"
    if why is None:
        flat = np.concatenate([a.astype(np.int64) for a in arrays]) if arrays else \
            np.zeros(0, np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            why = f"an index outside range({n}) (the dataset's examples)"
        elif np.unique(flat).size != flat.size:
            why = "an example in two parts (or twice in one)"
    if why is not None:
        raise ConfigurationError(
            f"the saved layout of {type(sampler).__name__} is not a layout of this run: "
            f"{why}. sampling={sampler.law.name!r} accounts each example in one part "
            "only, for the whole run; resume from the state state_dict() returned, "
            "unchanged, or start a new run")
    return [a.astype(np.int64) for a in arrays]


def _digest(dataset) -> str | None:
    from privlearn.torch._dataset_digest import dataset_digest

    return dataset_digest(dataset)


def sampler_state(sampler, dataset) -> dict:
    """``sampler.state_dict()``, with the digest of ``dataset`` (the loader's) when the
    sampler has a layout for the run (None when the dataset cannot be digested)."""
    state = sampler.state_dict()
    if hasattr(sampler, "_layout_seed"):
        state["dataset"] = _digest(dataset)
    return state


def check_sampler_state(sampler, state, dataset=None) -> None:
    """Refuse, before a run loads anything, a saved state of a sampler with a fixed
    layout (:func:`saved_layout`) that holds none, or not one of this run, or that was
    saved over a dataset other than ``dataset`` (another digest; not checked when either
    cannot be digested)."""
    if not hasattr(sampler, "_layout_seed"):  # a scheduled sampler (a layout for the run)
        return
    saved_layout(sampler, state)
    saved = state.get("dataset")
    here = None if saved is None or dataset is None else _digest(dataset)
    if here is not None and here != saved:
        raise ConfigurationError(
            f"the saved state of {type(sampler).__name__} was saved over a dataset with "
            f"other examples at its indices (digest {saved!r}, this run's {here!r}): "
            f"sampling={sampler.law.name!r} puts each index in one part for the whole "
            "run, so with the examples at other indices (shuffled or split anew, e.g. "
            "random_split without a seeded generator) an example could take part in "
            "the steps of two parts, beyond what the run is accounted for. Resume with "
            "the dataset in the order of the run that saved the state, or start a new "
            "run; nothing was loaded")
