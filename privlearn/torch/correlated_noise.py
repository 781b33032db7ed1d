"""Noise correlated across steps, generated on the parameters' device.

A matrix-factorization mechanism (DP-FTRL, banded MF, BLT; see :mod:`privlearn.correlated`)
adds at step ``t`` the noise ``sigma * C_max * (C^{-1} z)_t`` instead of DP-SGD's
``sigma * C_max * z_t``, with ``z_0, z_1, ...`` i.i.d. standard Gaussian draws of the
parameters' size. :class:`CorrelatedNoise` turns each step's draw ``z_t`` (drawn straight
into the flat gradient buffer) into ``(C^{-1} z)_t`` in place, keeping only the
strategy's state:

* a ``b``-banded Toeplitz ``C`` (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
  Factorization", NeurIPS, Algorithm 9): ``noise_t = (z_t - sum_{j=1}^{b-1} c_j
  noise_{t-j}) / c_0``; the last ``b - 1`` noises are the state, one matrix-vector product
  over them a step;
* a buffered linear Toeplitz (BLT) ``C`` (McMahan et al. 2024, "Hassle-Free Matrix
  Factorization Mechanisms", Algorithm 3): ``noise_t = z_t - sum_k w_k buf_k``, then
  ``buf_k <- d_k buf_k + noise_t``; ``m`` buffers.

Memory is ``(b - 1)`` or ``m`` parameter-sized buffers, never ``O(steps)``. The state is
part of :meth:`privlearn.torch.PrivateTraining.state_dict`, so a resumed run continues the
same noise; it holds past noises, so such a checkpoint must be kept private like the data
(docs/trust-model.md).
"""

from __future__ import annotations

import torch

from privlearn.correlated.strategies import BandedRecurrence, BufferedRecurrence

__all__ = ["CorrelatedNoise"]

_FORMAT = "privlearn.torch.correlated_noise/1"


class CorrelatedNoise:
    """Applies ``C^{-1}`` online to the stream of each step's standard Gaussian draw.

    Parameters
    ----------
    recurrence : BandedRecurrence or BufferedRecurrence
        From the strategy's ``recurrence()``.
    """

    def __init__(self, recurrence: BandedRecurrence | BufferedRecurrence):
        self.recurrence = recurrence
        self.banded = hasattr(recurrence, "coefs")
        self.steps = 0
        self._buf: torch.Tensor | None = None  # (m, numel)
        self._consts: dict = {}

    @property
    def buffers(self) -> int:
        return self.recurrence.buffers

    def _state_for(self, z: torch.Tensor) -> torch.Tensor:
        buf = self._buf
        m = self.buffers
        if buf is None or buf.shape[1] != z.numel() or buf.device != z.device \
                or buf.dtype != z.dtype:
            if buf is not None and self.steps:
                buf = buf.to(device=z.device, dtype=z.dtype)
            else:
                buf = z.new_zeros(m, z.numel())
            self._buf = buf
            self._consts = {}
        return buf

    def _const(self, name: str, values, z: torch.Tensor) -> torch.Tensor:
        key = (name, z.device, z.dtype)
        if key not in self._consts:
            self._consts[key] = torch.as_tensor(values, dtype=torch.float64).to(
                device=z.device, dtype=z.dtype)
        return self._consts[key]

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        """Overwrite the flat draw ``z`` of this step with ``(C^{-1} z)_t`` and advance.
        No host synchronisation: the coefficients of every position of the ring buffer
        are tensors made once."""
        z = z.view(-1)
        m = self.buffers
        if m == 0:  # C diagonal: a scale
            if self.banded and self.recurrence.coefs[0] != 1.0:
                z.div_(self.recurrence.coefs[0])
            self.steps += 1
            return z
        buf = self._state_for(z)
        t = self.steps
        if self.banded:
            c = self.recurrence.coefs
            # ring slot r holds noise_{t-j} with r = (t - j) mod m, j in 1..m: the
            # coefficient c_j there, j = ((t - r - 1) mod m) + 1
            rows = [[c[(t_mod - r - 1) % m + 1] for r in range(m)] for t_mod in range(m)]
            coef = self._const("ring", rows, z)[t % m]
            z.addmv_(buf.t(), coef, alpha=-1.0)
            if c[0] != 1.0:
                z.div_(c[0])
            buf[t % m].copy_(z)
        else:
            w = self._const("scale", self.recurrence.output_scale, z)
            z.addmv_(buf.t(), w, alpha=-1.0)
            for k, d in enumerate(self.recurrence.buf_decay):  # buf_k <- d_k buf_k + noise_t
                torch.add(z, buf[k], alpha=d, out=buf[k])  # one pass per buffer
        self.steps += 1
        return z

    def state_dict(self) -> dict:
        """The step count and the buffers (past noises: keep such a state private)."""
        return {"format": _FORMAT, "steps": self.steps,
                "buffers": None if self._buf is None else self._buf.clone()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError("state is not a privlearn correlated-noise state; pass what "
                             "state_dict() returned")
        self.steps = int(state["steps"])
        self._buf = None if state["buffers"] is None else state["buffers"].clone()
        self._consts = {}
