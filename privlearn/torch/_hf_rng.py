"""The global random generators' states a DPTrainer checkpoint continues from, kept out
of the checkpoint folder.

``transformers.Trainer`` writes the states of Python's, NumPy's and torch's global
generators into every checkpoint folder (``rng_state.pth``). How far they advanced is a
function of the private data: dropout, and a collator's random masking, draw one number
per element of a batch, so the count follows the Poisson batch sizes and the padded
sequence lengths. Together with the Trainer's public ``seed`` (in ``training_args.bin``),
the state gives that count back: on CUDA it is the Philox offset itself, on the CPU the
number of Mersenne Twister steps from the seeded state. Neither is part of the accounted
mechanism (which releases only the noisy clipped sums), so a DPTrainer keeps these states
with the secret part of its privacy state, under ``private_state_dir``, and restores them
from there on resume. A checkpoint
without a private file (``secure_mode=True``, nothing secret to keep) has none: a run
resumed from it continues from the process's own generators."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["RngStatesKeptPrivate", "global_rng_states", "load_state_file",
           "set_global_rng_states"]

# what an older private state file holds besides plain types and tensors: NumPy's global
# generator state with its key array pickled as an ndarray of a plain dtype (its
# reconstructor named as NumPy 1 and NumPy 2 write it)
_reconstruct = np.ndarray(0).__reduce__()[0]
_OLD_NUMPY_STATE = [(_reconstruct, "numpy.core.multiarray._reconstruct"),
                    (_reconstruct, "numpy._core.multiarray._reconstruct"),
                    np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_state_file(path) -> dict:
    """A privacy state file read with ``torch.load(..., weights_only=True)``: plain
    types and tensors only, so that loading a file cannot run code from it. A file
    written before NumPy's generator state was saved as a tensor still loads (the few
    NumPy globals an ndarray of a plain dtype needs are allowed, nothing else)."""
    with torch.serialization.safe_globals(_OLD_NUMPY_STATE):
        return torch.load(path, weights_only=True)


def _numpy_state() -> tuple:
    """NumPy's global generator state with its key array as a tensor (plain types and
    tensors load with ``weights_only=True``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)


def global_rng_states() -> dict:
    """The states of Python's, NumPy's and torch's global generators (every CUDA
    device's too), as ``Trainer._save_rng_state`` collects them (NumPy's key array as an
    int64 tensor)."""
    states = {"python": random.getstate(), "numpy": _numpy_state(),
              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def set_global_rng_states(states: dict) -> None:
    """Restore what :func:`global_rng_states` returned (the CUDA states when this process
    sees the same number of devices; otherwise they are left as they are, as the Trainer
    does for a checkpoint of another layout)."""
    random.setstate(states["python"])
    name, keys, *rest = states["numpy"]  # keys: a tensor, or an ndarray (older files)
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.random.set_rng_state(states["cpu"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.random.set_rng_state_all(cuda)


class RngStatesKeptPrivate:
    """The Trainer methods :class:`~privlearn.torch.hf.DPTrainer` overrides to keep the
    global generators' states out of the checkpoint folder (module docstring); a mixin
    placed before ``transformers.Trainer``. The trainer's ``_save_privacy_state`` writes
    ``_checkpoint_rng`` into the private state file, and its ``_resume_state`` brings it
    back as ``"rng"``."""

    def _save_rng_state(self, output_dir: str) -> None:
        """Not into the checkpoint folder (``rng_state.pth``): kept for the private state
        file, written next."""
        self._checkpoint_rng = global_rng_states()

    def _load_rng_state(self, checkpoint) -> None:
        """The states from the checkpoint's private state file (from its folder for a
        checkpoint written before they were kept there)."""
        rng = (getattr(self, "_resume_state", None) or {}).get("rng")
        if checkpoint is not None and rng is not None:
            set_global_rng_states(rng)
        else:
            super()._load_rng_state(checkpoint)
