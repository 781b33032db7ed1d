"""Bit-exact row comparison for the batch-independence probe (:mod:`privlearn.torch.probe`).

A model that processes each example on its own computes every other example's rows from
the same inputs, the same parameters and the same shapes when one example is replaced, so
on a device whose kernels are deterministic those rows come out *bitwise* identical:
nothing about them has a reason to round differently. A tolerance of the tensor's
precision (about 4% of a row's norm in bfloat16) let real mixing through: ``h + 0.1 *
h.flip(0)`` or a softmax over the batch under bfloat16 autocast moved the other rows by
about 7% of their weighted sum and passed. So the probe first compares rows by an integer
digest of their bits (:func:`digest`): any other row whose bits changed is a move.

Such a move smaller than the tolerance is only believed once the forward pass is shown to
be reproducible: the probe runs the unchanged batch once more and every row of every
layer, the output and the buffers must come out bitwise as in the first run
(:func:`reproducible`). A device that runs nondeterministic kernels (atomic additions in
``index_add_``/``scatter_add_``, some cuDNN algorithms, split-K matrix products) fails that
check, and the probe then falls back to the tolerance for this model, as before. When an
integer input changed with the replaced example, the kernels' layout may have changed
with it (a packed sequence sorted by the lengths: each time step's matrix product has
other rows, and the other examples' rows round differently by an ulp, seen on CPU in
float32 and float64), so such a move is refused only beyond an ulp of the largest row's
norm (:func:`tight_scale`), and the replacement is run again with the integer inputs held
and judged bit for bit (:mod:`privlearn.torch._probe_held`).

Measured on CPU (fp32, fp16 and bf16 autocast, bf16 parameters): every model of the
Hugging Face zoo (tests/torch/hf_zoo.py, 48 of them including LoRA and frozen variants)
and the layer families (Linear, convolutions, norms, embeddings, attention, recurrent
layers) gave bitwise identical other rows; only packed recurrent layers in fp32 moved by
an ulp. What a GPU run must check: that the zoo under fp32, fp16 and bf16 autocast gives
bitwise identical other rows there too, or a rerun that differs (no false refusals), and
that the planted mixing models are refused there. A valid per-example model refused on
rounding alone can be trained with ``check_batch_independence=False`` (the user then
promises independence).
"""

from __future__ import annotations

import torch

from privlearn.errors import BatchDependenceError

__all__ = ["bitwise_equal", "digest", "mode", "reproducible", "reshaped", "tight_scale"]

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict = {}


def _weights(n: int, device) -> torch.Tensor:
    """Odd int64 multipliers, one per entry of a row (a fixed pseudo-random sequence)."""
    key = (n, device)
    if key not in _WEIGHTS:
        idx = torch.arange(n, dtype=torch.int64)
        _WEIGHTS[key] = ((idx * 2654435761 + 97) % 1000003) * 2 + 1
    return _WEIGHTS[key].to(device)


def digest(x: torch.Tensor) -> torch.Tensor:
    """``(2, rows)`` int64 digests of the bits of each row of a 2-D floating tensor: the
    sum of the entries' bit patterns and a weighted sum of them (exact integer arithmetic,
    so equal rows give equal digests on any device and in any order of summation; two rows
    whose bits differ give different digests except by coincidence of two 64-bit sums).

    Parameters
    ----------
    x : torch.Tensor
        ``(rows, entries)``, any floating dtype.

    Returns
    -------
    torch.Tensor
        int64, shape ``(2, rows)``.
    """
    bits = x.view(_INT[x.element_size()]).to(torch.int64)
    w = _weights(x.shape[1], x.device)
    return torch.stack([bits.sum(1), (bits * w).sum(1)])


def tight_scale(norms_a: torch.Tensor, norms_b: torch.Tensor) -> torch.Tensor:
    """The scale of the ``"tight"`` comparison (:func:`mode`) of each row: the sum of
    its norms in the two runs, or that of the tensor's largest row when larger (non-finite
    norms left out; they are judged by their bits).

    A changed layout (a packed sequence's lengths) rounds each entry of the other rows
    by a few ulps of the *operands* its sums ran over, not of its own value: a row that
    is small because terms cancel (``head(h) + head2(c)`` after a packed LSTM, a row of
    norm 0.027 beside rows of 0.066) moved by 5e-7 of its own norm in float32, above the
    4-ulp bound (4.8e-7), and a model treating each example on its own was refused. The
    largest row of the same tensor is a proxy for the operands' scale that the fingerprint
    keeps. A mix of examples through the integer inputs by less than about four ulps of the
    tensor's largest row still passes here, as moves below the float32 tolerance always
    did where the forward is not reproducible (``"tolerance"``: 2e-5 of the row's norm,
    40 times more); a mix through the floating inputs is judged bit for bit by the run
    with the integer inputs held (:mod:`privlearn.torch._probe_held`), unchanged.
    """
    s = norms_a + norms_b
    if s.numel() == 0:
        return s
    return torch.maximum(s, torch.nan_to_num(s, nan=0.0, posinf=0.0).amax())


def _same_prints(pa: dict, pb: dict) -> bool:
    if pa["shape"] != pb["shape"] or pa["dims"].keys() != pb["dims"].keys():
        return False
    for d, fa in pa["dims"].items():
        fb = pb["dims"][d]
        a, b = (fa[1], fb[1]) if fa[0] == "exact" else (fa[4], fb[4])
        if a.shape != b.shape or not torch.equal(a, b):
            return False
    return True


def reproducible(run_a, run_b) -> bool:
    """Whether two probe runs on the same inputs (``(calls, root, written)`` of
    :func:`privlearn.torch.probe._observe_run`) saw bitwise the same rows everywhere: the
    same layers called, every fingerprinted row's digest, the output's and every buffer
    the forward wrote. One host read per compared tensor; the probe runs once."""
    calls_a, root_a, written_a = run_a
    calls_b, root_b, written_b = run_b
    if [i for i, _ in calls_a] != [i for i, _ in calls_b] or len(root_a) != len(root_b):
        return False
    for (_, views_a), (_, views_b) in zip(calls_a, calls_b, strict=True):
        if len(views_a) != len(views_b):
            return False
        if not all(_same_prints(pa, pb) for pa, pb in zip(views_a, views_b, strict=True)):
            return False
    if not all(_same_prints(pa, pb) for pa, pb in zip(root_a, root_b, strict=True)):
        return False
    if written_a.keys() != written_b.keys():
        return False
    return all(bitwise_equal(written_a[i], written_b[i]) for i in written_a)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (NaNs with the same payload are equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        a, b = (t.reshape(1, -1).view(_INT[t.element_size()]) for t in (a, b))
    return torch.equal(a, b)


def reshaped(run_a, run_b) -> bool:
    """Whether some layer saw tensors of other shapes, or other layers ran, in the two
    runs (a packed sequence whose lengths follow the replaced example: the kernels' row
    counts, and so the rounding of the other rows, may change with it)."""
    calls_a, calls_b = run_a[0], run_b[0]
    if [i for i, _ in calls_a] != [i for i, _ in calls_b]:
        return True
    return any(
        len(va) != len(vb)
        or any(pa["shape"] != pb["shape"] for pa, pb in zip(va, vb, strict=False))
        for (_, va), (_, vb) in zip(calls_a, calls_b, strict=True)
    )


def mode(judge, base, rerun, relaid: bool) -> str:
    """How one replacement's rows are compared, ``judge(mode)`` being the probe's
    judgement of the two runs (raising :class:`~privlearn.errors.BatchDependenceError`):
    ``"bits"`` when no other row moved in any bit. Else, if no row moved beyond the tolerance of
    the tensors' precision, one more run on the unchanged batch (``rerun``) tells
    rounding noise of nondeterministic kernels (the rerun differs: ``"tolerance"``, as
    before; on a GPU such a model keeps that tolerance) from a move of the replaced
    example's making (the rerun is bitwise the same): refused when only floating inputs
    changed and every layer saw tensors of the same shapes in both runs (same shapes,
    same kernels, same rounding of each row), else (``relaid``: an integer input
    changed, and a packed sequence's layout follows the replaced example's length, so
    the rounding of the other rows may follow it) ``"tight"``: a move beyond an ulp of
    the row's norm is refused. A GPU run must check that the model zoo gives bitwise the
    same other rows there (and the rerun the same bits) in float32 and under fp16/bf16
    autocast."""
    try:
        judge("bits")
        return "bits"
    except BatchDependenceError as bits:
        moved = bits
    judge("tolerance")  # beyond the tolerance: refused as it was
    if not reproducible(base, rerun()):
        return "tolerance"
    if relaid:
        try:
            judge("tight")
            return "tight"
        except BatchDependenceError as beyond:
            moved = beyond
    raise BatchDependenceError(
        f"{moved}. The other examples' values moved by less than the rounding "
        "tolerance of their precision, but the forward pass is bitwise reproducible "
        "on the unchanged batch, so the move comes from the replaced example. If this "
        "model does process each example on its own and only its rounding depends on "
        "the other rows (a kernel whose result depends on the whole batch's values), "
        "pass check_batch_independence=False, which promises it"
    ) from moved
