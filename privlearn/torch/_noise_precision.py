"""The precision of a correlated-noise run's state: one value, chosen when the run is
planned, that its accounting charges and its noise never goes below.

The accounting of a banded or BLT strategy charges a certified factor for the rounding
of its noise recurrence, which depends on the precision the recurrence runs in
(:mod:`privlearn.correlated._recurrence_fidelity`: ``2^-24`` for float32, ``2^-53`` for
float64). :func:`run_precision` picks it from the settings and the model
(``"float64"`` in secure mode, or when every trained parameter is float64), the run's
:class:`~privlearn.torch.schedule.NoisePlan` carries it (``noise_precision``) to both
the accountant (:func:`~privlearn.correlated.accounting.correlated_mechanism`) and the
noise (:class:`~privlearn.torch.correlated_noise.CorrelatedNoise`, which widens any draw
of a lower precision to it), and a checkpoint records it (:func:`noise_entries`): a run
resumed in another precision is refused, since its restored steps were accounted, and
run, in the saved one.
"""

from __future__ import annotations

import torch

from privlearn.errors import ParameterValueError

__all__ = ["legacy_entries", "noise_entries", "resume_hint", "run_precision", "state_dtype"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def state_dtype(precision: str) -> torch.dtype:
    """The torch dtype of ``precision`` (``"float32"`` or ``"float64"``)."""
    try:
        return _DTYPES[precision]
    except (KeyError, TypeError):
        raise ParameterValueError(
            f"precision must be 'float32' or 'float64', got {precision!r}; pass the "
            "precision the noise is accounted in (NoisePlan.noise_precision)"
        ) from None


def run_precision(secure_mode: bool, model: torch.nn.Module) -> str:
    """``"float64"`` when the noise state of a run of ``model`` is float64 from its
    first step: in secure mode (:mod:`privlearn.torch._secure_correlated`), or when every
    trained parameter is float64 (the optimizer draws in float64 then); else
    ``"float32"``."""
    dtypes = {q.dtype for q in model.parameters() if q.requires_grad}
    return "float64" if secure_mode or dtypes == {torch.float64} else "float32"


def noise_entries(run) -> dict:
    """What a checkpoint records of a correlated-noise run's noise (``run``: its
    :class:`~privlearn.torch.schedule.NoisePlan`; nothing for DP-SGD's noise): the
    strategy, optimised for the planned steps (the saved state continues only under the
    same coefficients; other ones would release a row-mixed ``C`` nobody accounted), and
    the precision its steps were accounted and run in."""
    if run is None or not run.correlates:
        return {}
    return {"strategy": repr(run.strategy), "noise_precision": run.noise_precision}


def legacy_entries(saved: dict) -> dict:
    """``saved`` (a checkpoint's mechanism) with the precision of a checkpoint written
    before it was recorded: float32, whose accounting covers both precisions (such a run
    was never charged less), so it resumes a float32 run only."""
    if "strategy" in saved and "noise_precision" not in saved:
        return {**saved, "noise_precision": "float32"}
    return saved


def resume_hint(saved: dict, here: dict) -> str:
    """What to do when a checkpoint's correlated noise (strategy, precision) is not this
    run's."""
    if saved.get("strategy") != here.get("strategy"):
        if "strategy" not in saved and here.get("strategy") is not None:
            return (
                " (the checkpoint does not record its correlated-noise strategy, so "
                "continuing its noise state cannot be checked against this run's)"
            )
        return (
            " (the correlated-noise strategy is optimised for the planned steps: pass "
            "the same epochs or steps)"
        )
    if saved.get("noise_precision") != here.get("noise_precision"):
        return (
            f" (the saved steps were accounted, and their noise state run, in "
            f"{saved.get('noise_precision')}, this run's in {here.get('noise_precision')}"
            ": resume with the same precision, float64 with secure_mode=True or float64 "
            "trained parameters (model.double()), float32 otherwise)"
        )
    return ""
