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
  ``buf_k <- d_k buf_k + noise_t``; ``m`` buffers;
* a dense ``C`` of ``n`` steps (:class:`~privlearn.correlated.DenseStrategy`; Denisov et
  al. 2022, Choquette-Choo et al. 2023): ``noise_t = sum_{s <= t} (C^{-1})_{ts} z_s``; the
  ``n`` draws of the run are the state (``n`` buffers, one matrix-vector product over the
  ``t + 1`` so far a step), and step ``n + 1`` is refused.

**Parameters unfrozen or frozen mid-run.** Each parameter has its own stream (the
recurrence acts coordinate by coordinate), laid out by name. A parameter trained for the
first time at step ``t0`` starts its stream there with an empty history: its noise is
``(C_tail^{-1} z)`` with ``C_tail = C[t0:, t0:]`` (for a lower-triangular ``C``, the
trailing block of ``C^{-1}`` is ``C_tail^{-1}``). That is post-processing of the
accounted mechanism ``C X + Z`` in which the parameter's column of ``X`` is zero before
``t0`` (rows ``t0..`` of that column are ``C_tail X_tail + Z_tail``; ``C_tail^{-1}`` of
them is what is released), and such a column is one of the contributions the accounted
sensitivity already bounds (every per-step contribution of norm at most ``C_max``, over
all parameters together). A parameter frozen at step ``t1`` keeps its stream: its draws
continue and its state advances (the noise is not applied), so if it is unfrozen again
its noise is the rows of the full ``C^{-1} Z`` -- a fresh stream there would not be
post-processing, since its column of ``X`` is no longer zero before the restart.

**Precision.** The recurrence runs in the draw's dtype: float32, float64 when every
trained parameter is float64, and always float64 in secure mode, where the noisy gradient
is formed in float64 and rounded once, as DP-SGD's secure noise is
(:mod:`privlearn.torch._secure_correlated`; the state then takes twice the memory) -- and
never below ``precision``, the one the run's accounting charges
(:attr:`privlearn.torch.schedule.NoisePlan.noise_precision`, float64 when the run starts
in float64; :mod:`privlearn.torch._noise_precision`): a draw of a lower precision (a
float32 parameter unfrozen later) is widened to it, run, and rounded once. A
float16 or bfloat16 draw is widened to float32, run, and rounded once: never a
half-precision state (measured 1-3 % of the noise's standard deviation off in bfloat16).
A state saved with buffers of another dtype is converted at the next step. The
accounting covers the rounding of the float32 (or float64) recurrence with a certified
factor on the sensitivity (:mod:`privlearn.correlated._recurrence_fidelity`), and a
strategy whose recurrence becomes unstable once its constants are rounded to float32 is
refused at the first float32 step, before any noise. A stable
recurrence (spectral radius below 1, as every optimised strategy's) contracts its own
rounding errors, so in float32 the noise stays within ``1e-5`` of the float64 ``(C^{-1} z)_t`` at
every step, however long the run (measured: about ``3e-7`` for BLTs, ``3e-6`` for 64
bands, the same after ``10^4`` and ``10^5`` steps). At spectral radius exactly 1
(``C^{-1}`` a prefix sum) the error grows like the noise itself, as a random walk: below
``1e-4`` of the noise's rms over ``10^5`` steps. PyTorch may run a float32 matrix
product with TF32 or bfloat16 inputs (``allow_tf32``,
``torch.set_float32_matmul_precision("high")`` or ``"medium"``, a backend's
``fp32_precision``), at a unit roundoff of ``2^-11`` or ``2^-8`` the accounting does not
charge: the matrix-vector products above run only where the settings of the state's
device give full float32 products (the default;
:func:`privlearn.torch._ghost_norms.input_rounding`), and otherwise each is one
elementwise axpy per term, read and written in the state's dtype on any device (a few
times the memory traffic of the product).

Memory is ``(b - 1)`` or ``m`` buffers of the size of every parameter trained so far,
never ``O(steps)`` -- except for a dense ``C``: ``n`` buffers, its number of steps. A dense
``C^{-1}`` is finite and its rows are applied directly (no recurrence): the float32 noise
of step ``t`` is within ``gamma_{t+1} |A_t| |z|`` of ``A_t z`` (Higham's inner-product
bound; ``A`` the inverse rounded to float32), which
:meth:`~privlearn.correlated.DenseStrategy.noise_factor` charges. The state is
part of :meth:`privlearn.torch.PrivateTraining.state_dict`, so a resumed run continues the
recurrence from the noises really added (its new draws fresh unless the run has a seed:
:mod:`privlearn.torch._rekey`); it holds past noises, so such a checkpoint must be kept
private like the data (docs/trust-model.md).
"""

from __future__ import annotations

import torch

from privlearn.correlated._recurrence_fidelity import check_single_precision
from privlearn.correlated.strategies import (
    BandedRecurrence,
    BufferedRecurrence,
    DenseRecurrence,
    check_stable,
)
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError
from privlearn.torch._ghost_norms import input_rounding
from privlearn.torch._noise_precision import state_dtype
from privlearn.torch._state_checks import count_entry, entry, refuse_rewind, state_mapping

__all__ = ["CorrelatedNoise"]

_FORMAT = "privlearn.torch.correlated_noise/1"

#: draws of these dtypes run the recurrence in float32 and are rounded once at the end:
#: a bfloat16 state is 1-3 % of the noise's standard deviation off (measured), float32's
#: about ``1e-6``
_HALF = (torch.float16, torch.bfloat16)


class CorrelatedNoise:
    """Applies ``C^{-1}`` online to the stream of each step's standard Gaussian draw.

    Parameters
    ----------
    recurrence : BandedRecurrence, BufferedRecurrence or DenseRecurrence
        From the strategy's ``recurrence()``. A ``DenseRecurrence`` keeps every draw of
        its ``n`` steps (``n`` buffers of the trained size) and refuses step ``n + 1``
        with a :class:`~privlearn.errors.ConfigurationError`.
    """

    def __init__(self, recurrence: BandedRecurrence | BufferedRecurrence | DenseRecurrence,
                 precision: str = "float32"):
        #: a dense strategy's noise weighs every draw so far: its state is the ``n``
        #: draws of its ``n`` steps (``n`` rows of the trained size), and step ``n + 1``
        #: is refused; its ``C^{-1}`` is finite (checked when the strategy was made)
        self.dense = isinstance(recurrence, DenseRecurrence)
        if not self.dense:
            check_stable(recurrence)  # a C^{-1} that grows geometrically is refused
        self.recurrence = recurrence
        #: the lowest precision the state runs in, the one accounted
        #: (:attr:`privlearn.torch.schedule.NoisePlan.noise_precision`): a draw of a
        #: lower one is widened to it, run, and rounded once
        self.minimum = state_dtype(precision)
        self.banded = hasattr(recurrence, "coefs")
        self.steps = 0
        self._buf: torch.Tensor | None = None  # (m, numel of live + frozen streams)
        self._consts: dict = {}
        #: ``((name, numel), ...)`` of the streams the step's draw covers, in its order,
        #: then those of parameters frozen since (their state kept; None: not yet known)
        self._live: tuple | None = None
        self._frozen: tuple = ()
        self._single_checked = False

    def _follow(self, layout: tuple) -> None:
        """The trained parameters are now ``layout``: move every stream's state to its
        new columns, start an empty one for a parameter never trained before, and keep
        the state of those no longer trained after the live ones (module docstring)."""
        if self._live is None or self._buf is None:  # no state yet (or no names in it)
            self._live, self._frozen = tuple(layout), ()
            return
        old = {}
        at = 0
        for key, n in self._live + self._frozen:
            old[key] = (at, n)
            at += n
        live = dict(layout)
        for key, n in layout:
            if key in old and old[key][1] != n:
                raise ParameterValueError(
                    f"parameter {key!r} changed size during a correlated-noise run "
                    f"({old[key][1]} -> {n} elements): its noise stream cannot continue. "
                    "Keep parameter shapes fixed for the run")
        frozen = tuple((k, n) for k, n in self._live + self._frozen if k not in live)
        order = tuple(layout) + frozen
        buf = self._buf.new_zeros(self._buf.shape[0], sum(n for _, n in order))
        at = 0
        for key, n in order:
            if key in old:
                a, _ = old[key]
                buf[:, at:at + n].copy_(self._buf[:, a:a + n])
            at += n
        self._buf, self._live, self._frozen = buf, tuple(layout), frozen

    @property
    def buffers(self) -> int:
        return self.recurrence.buffers

    def _state_for(self, z: torch.Tensor) -> torch.Tensor:
        buf = self._buf
        m = self.buffers
        if buf is not None and self.steps and buf.shape[1] != z.numel():
            raise ParameterValueError(
                f"this step's draw covers {z.numel()} elements but the noise state holds "
                f"{buf.shape[1]}: pass the parameters' layout (apply_(z, layout=...)) when "
                "the trained parameters change")
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
        """The constant tensor ``name`` on ``z``'s device and dtype, made once: ``values``
        (or ``values()`` for a callable, called only then) is not read again on later
        steps, so a step costs no host work that grows with the strategy's size."""
        key = (name, z.device, z.dtype)
        if key not in self._consts:
            if callable(values):
                values = values()
            self._consts[key] = torch.as_tensor(values, dtype=torch.float64).to(
                device=z.device, dtype=z.dtype)
        return self._consts[key]

    def _ring(self) -> list[list[float]]:
        """:meth:`_ring_rows` as Python floats (the axpy's scalars), made once."""
        if "ring rows" not in self._consts:
            self._consts["ring rows"] = self._ring_rows()
        return self._consts["ring rows"]

    def _ring_rows(self) -> list[list[float]]:
        """Row ``t mod m`` holds the coefficient of each ring slot at step ``t``: slot
        ``r`` holds ``noise_{t-j}`` with ``r = (t - j) mod m``, ``j`` in ``1..m``, so its
        coefficient is ``c_j`` with ``j = ((t - r - 1) mod m) + 1``."""
        c, m = self.recurrence.coefs, self.buffers
        return [[c[(t_mod - r - 1) % m + 1] for r in range(m)] for t_mod in range(m)]

    def apply_(self, z: torch.Tensor, layout: tuple | None = None, draw=None
               ) -> torch.Tensor:
        """Overwrite the flat draw ``z`` of this step with ``(C^{-1} z)_t`` and advance.
        No host synchronisation: the coefficients of every position of the ring buffer
        are tensors made once.

        Parameters
        ----------
        z : torch.Tensor
            This step's standard Gaussian draw for the trained parameters.
        layout : tuple, optional
            ``((name, numel), ...)`` of the parameters ``z`` covers, in its order (None:
            the same as the last step's). A change moves the streams (module
            docstring).
        draw : callable, optional
            ``draw(out)`` fills ``out`` with fresh standard Gaussian draws: the steps of
            the streams of frozen parameters (needed once a parameter was frozen).
        """
        if z.dtype in _HALF or (self.minimum == torch.float64 and z.dtype != self.minimum):
            # never below the accounted precision, nor below float32 (module docstring)
            wide = z.to(self.minimum)
            self.apply_(wide, layout, draw)
            return z.copy_(wide)
        z = z.view(-1)
        m = self.buffers
        if m == 0:  # C diagonal: a scale, no memory
            if self.banded and self.recurrence.coefs[0] != 1.0:
                z.div_(self.recurrence.coefs[0])
            self.steps += 1
            return z
        if layout is not None and layout is not self._live and layout != self._live:
            self._follow(layout)
        extra = sum(n for _, n in self._frozen)
        if extra:
            if draw is None:
                raise ParameterValueError("frozen parameters' noise streams need draw=")
            full = z.new_empty(z.numel() + extra)
            full[:z.numel()].copy_(z)
            draw(full[z.numel():])
            self._recur(full)
            return z.copy_(full[:z.numel()])
        return self._recur(z)

    def _recur(self, z: torch.Tensor) -> torch.Tensor:
        m = self.buffers
        t = self.steps
        if self.dense and t >= m:
            raise ConfigurationError(
                f"step {t + 1}: the DenseStrategy is defined for {m} steps and all {m} are "
                "taken (its noise after them is not defined); plan at most that many steps "
                f"(steps= or epochs=), or optimise one for more (optimize_dense)")
        if not self.dense and z.dtype != torch.float64 and not self._single_checked:
            check_single_precision(self.recurrence)  # float32 constants: still stable?
            self._single_checked = True
        buf = self._state_for(z)
        # a matrix product only where it runs in full float32 (or float64): PyTorch may
        # round a float32 product's inputs to TF32 or bfloat16 (allow_tf32,
        # set_float32_matmul_precision, a backend's fp32_precision), a roundoff the
        # accounting does not charge; then one axpy per term instead (elementwise, in the
        # state's dtype, whatever the settings), the order of an inner product whose
        # rounding the accounting bounds in any order (Higham 2002, Eq. (3.4))
        full = z.dtype == torch.float64 or input_rounding(z.device.type) == 0.0
        if self.dense:
            # buffer t holds draw t; the noise is row t of C^{-1} applied to draws 0..t
            buf[t].copy_(z)
            if full:
                inv = self._const("inverse", lambda: self.recurrence.inverse.copy(), z)
                z.copy_(torch.mv(buf[: t + 1].t(), inv[t, : t + 1]))
            else:
                row = self.recurrence.inverse[t, : t + 1].tolist()
                _axpys(z.mul_(row[t]), buf, row[:t], 1.0)
        elif self.banded:
            if full:  # the (m x m) table of the ring's coefficients is made once
                z.addmv_(buf.t(), self._const("ring", self._ring_rows, z)[t % m], alpha=-1.0)
            else:
                _axpys(z, buf, self._ring()[t % m], -1.0)
            c0 = self.recurrence.coefs[0]
            if c0 != 1.0:
                z.div_(c0)
            buf[t % m].copy_(z)
        else:
            if full:
                z.addmv_(buf.t(), self._const("scale", self.recurrence.output_scale, z),
                         alpha=-1.0)
            else:
                _axpys(z, buf, self.recurrence.output_scale, -1.0)
            for k, d in enumerate(self.recurrence.buf_decay):  # buf_k <- d_k buf_k + noise_t
                torch.add(z, buf[k], alpha=d, out=buf[k])  # one pass per buffer
        self.steps += 1
        return z

    def state_dict(self) -> dict:
        """The step count and the buffers (past noises: keep such a state private)."""
        return {"format": _FORMAT, "steps": self.steps, "recurrence": repr(self.recurrence),
                "buffers": None if self._buf is None else self._buf.clone(),
                "layout": None if self._live is None else list(self._live + self._frozen),
                "live": None if self._live is None else len(self._live)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state saved by :meth:`state_dict` (the same strategy);
        refused, changing nothing, for a state it cannot have written (a missing entry,
        a wrong type, a negative step count, buffers of another shape or not finite), or
        once the private run it belongs to has taken steps (its past noises would no
        longer be those released: :func:`~privlearn.torch._state_checks.refuse_rewind`;
        :meth:`PrivateTraining.load_state_dict` loads a fresh run's whole state)."""
        refuse_rewind(self, "p.optimizer.correlated")
        self._load(state)

    def _load(self, state: dict) -> None:
        """:meth:`load_state_dict` without the check of the run's steps (a fresh run's
        resume, whose history is loaded first)."""
        self.steps, buf, layout, live = self._read_state(state)
        self._buf = None if buf is None else buf.clone()
        self._consts = {}
        if layout is None:
            self._live, self._frozen = None, ()
        else:
            self._live, self._frozen = layout[:live], layout[live:]

    def _read_state(self, state: dict) -> tuple:
        """:meth:`load_state_dict`'s reading and refusals, before anything is changed:
        ``(steps, buffers, layout, live)``."""
        what, hint = "the correlated-noise state", _HINT
        if state_mapping(state, what, hint).get("format") != _FORMAT:
            raise ParameterValueError(f"state is not a privlearn correlated-noise state "
                                      f"(format {_FORMAT!r}); {hint}")
        saved = entry(state, "recurrence", what, hint, str, optional=True)  # (absent in
        if saved is not None and saved != repr(self.recurrence):  # states before it was)
            raise ParameterValueError(
                f"the state was saved by the noise recurrence {saved}, not this one "
                f"({self.recurrence!r}): its past noises continue only under the same "
                "coefficients; load it into a generator of the same strategy")
        steps = count_entry(state, "steps", what, hint)
        buf = entry(state, "buffers", what, hint, torch.Tensor, optional=True)
        if buf is not None and (buf.dim() != 2 or not buf.is_floating_point()):
            raise ParameterTypeError(f"{what}['buffers'] must be a 2-d floating tensor, got "
                                     f"{buf.dtype} of shape {tuple(buf.shape)}; {hint}")
        if buf is not None and buf.shape[0] != self.buffers:
            raise ParameterValueError(
                f"the state holds {buf.shape[0]} buffers, this recurrence "
                f"keeps {self.buffers}; load it into a generator of the same strategy")
        if buf is not None and not bool(torch.isfinite(buf).all()):
            raise ParameterValueError(f"{what}['buffers'] holds NaN or infinite values "
                                      f"(past noises are finite); {hint}")
        if buf is None and steps and self.buffers:
            raise ParameterValueError(  # the next noises would forget the past ones
                f"{what} counts {steps} steps but holds no buffers: after its first step "
                f"this recurrence keeps {self.buffers} buffer(s) of past noises (None only "
                f"before it), and without them the noise would not be C^{{-1}} z; {hint}")
        layout = entry(state, "layout", what, hint, (list, tuple), optional=True)
        if layout is None:  # (absent in states saved before streams had names)
            return steps, buf, None, 0
        try:
            layout = tuple((str(k), int(n)) for k, n in layout)
        except (TypeError, ValueError):
            raise ParameterTypeError(f"{what}['layout'] must be a list of (name, size) "
                                     f"pairs, got {layout!r:.80}; {hint}") from None
        live = count_entry(state, "live", what, hint)
        width = sum(n for _, n in layout)
        if live > len(layout) or any(n < 0 for _, n in layout) or (
                buf is not None and buf.shape[1] != width):
            raise ParameterValueError(
                f"{what}: a layout of {len(layout)} streams ({width} values), {live} of "
                f"them live, does not fit its buffers "
                f"{None if buf is None else tuple(buf.shape)}; {hint}")
        return steps, buf, layout, live


def _axpys(z: torch.Tensor, rows, coefs, sign: float) -> torch.Tensor:
    """``z += sign * sum_k coefs[k] rows[k]``, one elementwise axpy per non-zero
    coefficient (no matrix product: exact float32 arithmetic under any matmul
    precision setting)."""
    for k, c in enumerate(coefs):  # a dense strategy's buffers: only the first t
        if c:
            z.add_(rows[k], alpha=sign * c)
    return z


#: What a refused correlated-noise state should have been.
_HINT = ("pass the 'correlated' entry of the dict returned by PrivateTraining.state_dict() "
         "of the same run")
