"""Gaussian noise for DP-SGD, with an optional secure source.

Default: ``torch.normal`` from a ``torch.Generator`` (Mersenne Twister), seeded from the
OS or by the user: fast and reproducible, fine for research.

``secure_mode=True`` addresses two attacks on the textbook implementation:

* **Predictable generator.** A Mersenne-Twister state can be reconstructed from its
  outputs. Secure mode draws all randomness from the operating system's CSPRNG
  (``os.urandom``).
* **Floating-point attack** (Mironov 2012, "On Significance of the Least Significant Bits
  for Differential Privacy", CCS): floating-point samplers do not produce every float
  with the probability of the ideal distribution; the set of reachable outputs of
  ``x + noise`` depends on ``x``, so the low-order bits of a released value can reveal the
  un-noised value and break DP entirely. The mitigation of Holohan & Braghin 2021
  ("Secure Random Sampling in Differential Privacy", ESORICS), also used by Opacus, is to
  sample in double precision from uniform bits (Box-Muller) and return the normalised sum
  of ``n = 4`` independent draws, ``(Z_1 + ... + Z_4) / 2``, which has the same N(0, s^2)
  law while smoothing the gaps that make the attack work, then round to the parameter
  dtype. (This is a mitigation; exact discrete samplers are the complete fix, Canonne,
  Kamath & Steinke 2020.)
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

__all__ = ["NoiseSource"]


class NoiseSource:
    """Draws ``N(0, std^2)`` tensors.

    Parameters
    ----------
    secure_mode : bool
        Use the OS CSPRNG and the Holohan-Braghin sum of 4 double-precision draws.
    seed : int, optional
        Seed of the non-secure generator (ignored, and rejected, in secure mode).
    """

    def __init__(self, secure_mode: bool = False, seed: int | None = None):
        if secure_mode and seed is not None:
            raise ValueError("seed must be None when secure_mode=True (a seeded secure "
                             f"generator is not secure), got seed={seed!r}")
        self.secure_mode = bool(secure_mode)
        self._buffer = None
        self.generator = torch.Generator()
        self.generator.manual_seed(
            int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else int(seed))

    def state_dict(self) -> dict:
        """The generator's state (None in secure mode: OS entropy cannot be replayed)."""
        return {"format": "privlearn.torch.noise/1", "secure": self.secure_mode,
                "state": None if self.secure_mode else self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (same mode)."""
        if not isinstance(state, dict) or state.get("format") != "privlearn.torch.noise/1":
            raise ValueError("state is not a privlearn noise state; pass what state_dict() "
                             "returned")
        if bool(state["secure"]) != self.secure_mode:
            raise ValueError(f"the saved noise source had secure_mode={state['secure']}, this "
                             f"one {self.secure_mode}; rebuild with the same secure_mode")
        if state["state"] is not None:
            self.generator.set_state(state["state"])

    def standard_normal(self, n: int) -> torch.Tensor:
        """``n`` i.i.d. N(0, 1) float32 draws (CPU), one call for all parameters.

        The returned tensor is an internal buffer, overwritten by the next call: use it
        (add it to the gradients) before drawing again.

        Drawing the noise in a background thread was measured and rejected: on a CPU
        whose cores run PyTorch's OpenMP workers (which spin between parallel regions),
        a third thread only time-shares a busy core and the step gets slower.
        """
        if self.secure_mode:
            return self.normal(1.0, torch.empty(n))
        buf = self._buffer
        if buf is None or buf.numel() != n:
            buf = self._buffer = torch.empty(n)
        # filled in place: a fresh 4n-byte allocation every step costs page faults
        return buf.normal_(generator=self.generator)

    def normal(self, std: float, like: torch.Tensor) -> torch.Tensor:
        if not self.secure_mode:
            if like.device.type == "cpu":
                return torch.normal(0.0, std, like.shape, generator=self.generator,
                                    dtype=like.dtype)
            return torch.normal(0.0, std, like.shape, generator=self.generator).to(like)
        n = like.numel()
        z = np.zeros(n)
        for _ in range(4):
            z += _secure_standard_normal(n)
        out = torch.from_numpy(z * (std / 2.0)).view(like.shape)
        return out.to(device=like.device, dtype=like.dtype)


def _secure_standard_normal(n: int) -> np.ndarray:
    """Box-Muller on 53-bit uniforms from ``os.urandom`` (float64)."""
    m = (n + 1) // 2
    bits = np.frombuffer(os.urandom(16 * m), dtype=np.uint64).reshape(2, m) >> np.uint64(11)
    u1 = (bits[0].astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]
    u2 = bits[1].astype(np.float64) * 2.0**-53
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])
    return z[:n]
