"""Fresh keys for the noise of an unseeded run that resumes from a checkpoint.

A default-mode :class:`~privlearn.torch.noise.NoiseSource` keeps its key chain in the
state a run saves, so a loaded state would replay the noise the saved run was about to
draw. A run that rolls back (resumed twice from one checkpoint, say with another
learning rate) would then add the same noise ``z_t`` at each step ``t`` in both
branches, and the difference of two released models would cancel it, leaving
un-noised clipped gradient sums. So a run made without a ``seed`` (its noise keys came
from OS entropy anyway) mixes fresh OS entropy into the restored key when it resumes:
each resume draws noise independent of every other one. The law is unchanged: the
draws after the resume are still i.i.d. ``N(0, sigma^2)``, independent of everything
before, which is all DP-SGD's accounting (Abadi et al. 2016, Theorem 1) and the matrix
mechanism's (Choquette-Choo et al. 2023a, Sec. 2; Denisov et al. 2022: step ``t`` adds
``sum_j (C^{-1})_{tj} z_j`` with i.i.d. Gaussian ``z_j``) assume; a
correlated-noise state keeps its past noises, so the recurrence continues from the
noise that was really added. A run with a ``seed`` keeps the saved keys: a seed is for
reproducible experiments, and a rollback under it replays the noise.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

__all__ = ["fresh_noise_keys"]

_TAG = b"privlearn.torch.noise.rekey"


def fresh_noise_keys(state: Any) -> Any:
    """``state`` (a default-mode :meth:`NoiseSource.state_dict`) with its seed replaced by
    a 63-bit BLAKE2b hash of the saved seed and 32 bytes of OS entropy
    (:func:`secrets.token_bytes`), and no saved generator states (each device's
    generator restarts from the new seed). Anything else (a secure-mode state, which
    holds no keys, or a malformed one) is returned as it is, for
    :meth:`NoiseSource.load_state_dict` to take or refuse."""
    if (
        not isinstance(state, dict)
        or state.get("secure_mode") is not False
        or not isinstance(state.get("seed"), int)
        or not isinstance(state.get("generators"), dict)
    ):
        return state
    digest = hashlib.blake2b(
        _TAG + str(int(state["seed"])).encode() + secrets.token_bytes(32), digest_size=8
    ).digest()
    return {**state, "seed": int.from_bytes(digest, "little") >> 1, "generators": {}}
