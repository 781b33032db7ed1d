"""Correlated noise in secure mode: float64 draws and state, one rounding at the end.

Secure mode's defence against the floating-point attack on textbook samplers (Mironov
2012; for Gaussians, Jin, McMurtry, Rubinstein & Ohrimenko 2022, "Are We There Yet?
Timing and Floating-Point Attacks on Differential Privacy Systems", IEEE S&P) is that the
released value is one rounding of a high-precision one: :meth:`NoiseSource.add_normal_`
forms ``x + std * Z`` in float64 (``Z`` the Holohan-Braghin sum of four double-precision
draws) and rounds that value once to ``x``'s dtype (module docstring of
:mod:`privlearn.torch.noise`). A correlated-noise step releases ``x + std * (C^{-1} z)_t``,
a combination of the draws of many steps: drawn into float32 and run through the
recurrence on float32 buffers, the noise would be rounded at the draw and at every
operation of the recurrence (with rounding errors carried over from past steps), then
once more in the addition, so the released value would not be one rounding of the
high-precision sum and the defence would not carry over.

In secure mode :func:`add_secure_correlated_` therefore

1. draws ``z`` in float64 (the Holohan-Braghin value, with no rounding to a narrower
   dtype), also for the streams of frozen parameters;
2. runs the recurrence (:class:`~privlearn.torch.correlated_noise.CorrelatedNoise`) on
   float64 buffers (it keeps its state in the draw's dtype), so ``(C^{-1} z)_t`` is
   within a few float64 units of its exact value (the recurrence is stable, so its
   rounding errors do not grow);
3. forms ``x + std * (C^{-1} z)_t`` in float64 and rounds it once to the gradient's dtype,
   to nearest (float16 and bfloat16 through rounding to odd,
   :func:`privlearn.torch.noise._to_odd_float32`): the same two roundings of the exact
   sum, the second a fixed function of the float64 value, as DP-SGD's secure path.

The default mode is unchanged (float32 draws and buffers for float32 and half-precision
parameters: fast, and within ``1e-5`` of ``C^{-1} z``, see
:mod:`privlearn.torch.correlated_noise`).

Cost: the buffers and the draw are float64, twice the default mode's float32 memory:
``8 (m + 1)`` bytes per trained coordinate for ``m`` buffers (``4 (m + 1)`` otherwise). For
GPT-2 small's 124.4M parameters and a BLT of 4 buffers: 4.98 GB instead of 2.49 GB
(measured on the CPU: a peak of 5.03 GB over the gradients, against 2.51 GB). The final
addition works in chunks of :data:`ROUNDING_CHUNK_ELEMENTS` elements, so its temporaries
(a float64 copy of the chunk's sums, the rounding's) stay bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from privlearn.torch.noise import NoiseSource, _to_odd_float32

__all__ = [
    "ROUNDING_CHUNK_ELEMENTS",
    "add_rounded_",
    "add_secure_correlated_",
    "secure_correlated_into",
]

#: Elements per chunk of the final addition and rounding (its float64 and float32
#: temporaries: at most about 100 MB).
ROUNDING_CHUNK_ELEMENTS = 1 << 22


def secure_correlated_into(opt, std: float, add: bool) -> None:
    """:func:`add_secure_correlated_` into a DP optimizer's open gradient buffers: the
    views of its trained parameters (its tracker's order, the streams' layout), its
    correlated noise, noise source, layout and draws for the streams of frozen
    parameters."""
    targets = [opt._out[id(q)] for q in opt.tracker.params]
    add_secure_correlated_(
        opt.correlated,
        opt.noise,
        targets,
        std,
        add,
        layout=opt._noise_layout,
        draw=opt._draw_standard_,
    )


def add_secure_correlated_(
    correlated,
    noise: NoiseSource,
    targets: Sequence[torch.Tensor],
    std: float,
    add: bool,
    layout=None,
    draw: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """``targets += std * (C^{-1} z)_t`` (or ``=``, when not ``add``), each element
    rounded once from its float64 value (module docstring).

    Parameters
    ----------
    correlated : CorrelatedNoise
        The run's noise recurrence (its state becomes float64 on the first call).
    noise : NoiseSource
        The noise source ``z`` is drawn from (secure in training; any source works).
    targets : sequence of torch.Tensor
        The gradient sums, one per trained parameter in the streams' order (any devices
        and floating dtypes); ``z`` is drawn, and the recurrence runs, on the first one's
        device.
    std : float
        The noise's standard deviation (``sigma * C_max``, or a rank's share of it).
    add : bool
        Add the noise to the targets (True) or overwrite them with it.
    layout, draw
        As :meth:`CorrelatedNoise.apply_`.
    """
    sizes = [t.numel() for t in targets]
    device = targets[0].device if targets else torch.device("cpu")
    z = torch.empty(sum(sizes), device=device, dtype=torch.float64)
    z = correlated.apply_(noise.fill_normal_(z, 1.0), layout, draw)
    for target, piece in zip(targets, z.split(sizes), strict=True):
        add_rounded_(target, piece.to(target.device), std, add)


def add_rounded_(dst: torch.Tensor, noise: torch.Tensor, std: float, add: bool) -> None:
    """``dst <- dst + std * noise`` (``std * noise`` when not ``add``), formed in float64
    and rounded once, to nearest, to ``dst``'s dtype. ``noise`` (float64, ``dst.numel()``
    elements, on ``dst``'s device) is scratch: it is overwritten.

    ``dst``'s values are first copied (exactly) into a float64 scratch of one chunk:
    adding a float32 tensor to a float64 one directly takes a slow mixed-dtype path on the
    CPU (measured: 30 times slower than the copy and a float64 addition).
    """
    target = dst if dst.is_contiguous() else dst.contiguous()
    flat, noise = target.view(-1), noise.view(-1)
    n = flat.numel()
    half = dst.dtype in (torch.float16, torch.bfloat16)
    wide = None
    if add and dst.dtype != torch.float64:
        wide = torch.empty(min(n, ROUNDING_CHUNK_ELEMENTS), dtype=torch.float64, device=dst.device)
    for start in range(0, n, ROUNDING_CHUNK_ELEMENTS):
        d = flat[start : start + ROUNDING_CHUNK_ELEMENTS]
        e = noise[start : start + ROUNDING_CHUNK_ELEMENTS].mul_(std)
        if add:  # the sum in float64: exact copy of d, then one float64 addition
            e.add_(d if wide is None else wide[: d.numel()].copy_(d))
        # one rounding to d's dtype (half precision: after the rounding to odd)
        d.copy_(_to_odd_float32(e) if half else e)
    if target is not dst:
        dst.copy_(target)
