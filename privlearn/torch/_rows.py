"""Per-example rows of the rules' recorded tensors: their squared norms, their weighing by
the clip factors, the positions of an output gradient that reach the loss and the sums
of rows by segment (the rule-author kit's :func:`row_sq_norms`, :func:`row_scaled`,
:func:`low_factors`, :func:`live_positions` and :func:`segment_sum`, re-exported by
:mod:`privlearn.torch.grad_sample`)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

_LOW = (torch.float16, torch.bfloat16)


#: Half-precision clip factors are rounded toward zero and reduced by this relative
#: margin, twice the unit roundoff of the dtype (bf16: 2^-8, fp16: 2^-11), so that
#: rounding a scaled gradient to half precision (relative error at most the unit
#: roundoff) can never make an example's contribution larger than the clipping bound.
_LOW_MARGIN = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


#: True while the clipped sum is formed from examples whose squared norms are all known
#: to be finite (read on the CPU, where the step reads that flag anyway): every recorded
#: row is then finite, and the weighted sums skip the cleaning of the rows that only a
#: dropped (overflowing) example can make non-finite
_ROWS_FINITE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "privlearn_rows_finite", default=False)


@contextlib.contextmanager
def rows_finite(flag: bool):
    """Context in which :func:`row_scaled` and the weighted sums know (``flag``) that
    every example's recorded rows are finite (see :data:`_ROWS_FINITE`)."""
    token = _ROWS_FINITE.set(bool(flag))
    try:
        yield
    finally:
        _ROWS_FINITE.reset(token)


#: ``id(view) -> (view, flat)`` of the parameters' views of the DP optimizer's gradient
#: buffers and their one-dimensional pieces (None for a 1-D view), while the clipped sum is
#: accumulated into them: the matrix-vector products write into the piece, kept from step
#: to step, instead of viewing each parameter's buffer as one dimension anew
_FLAT_VIEWS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "privlearn_flat_views", default=None)


@contextlib.contextmanager
def flat_views(mapping: dict | None):
    """Context in which :func:`_add_mv` finds the one-dimensional pieces of the buffers'
    views in ``mapping`` (see :data:`_FLAT_VIEWS`)."""
    token = _FLAT_VIEWS.set(mapping)
    try:
        yield
    finally:
        _FLAT_VIEWS.reset(token)


def _flat(o: torch.Tensor) -> torch.Tensor:
    """``o`` as one dimension: ``o`` itself, the kept piece of a buffer's view
    (:data:`_FLAT_VIEWS`) or a new view."""
    if o.dim() == 1:
        return o
    m = _FLAT_VIEWS.get()
    e = m.get(id(o)) if m is not None else None
    if e is not None and e[0] is o and e[1] is not None:
        return e[1]
    return o.view(-1)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with non-finite values replaced by 0 (a copy; ``x`` itself when every row is
    known to be finite). Only an example whose squared norm is not finite holds
    non-finite recorded values (an inf or NaN anywhere in its rows makes its norm so),
    and its weight is 0: this changes no other example. A tensor that several layers
    read is cleaned once (:func:`shared_rows`)."""
    if _ROWS_FINITE.get():
        return x
    return _shared(x, "finite",
                   lambda: torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))


#: While a clipped sum cleans the recorded rows (not :data:`_ROWS_FINITE`): ``{key of a
#: recorded tensor: [readers left, {form: tensor}]}`` for the tensors that several layers'
#: products read (the query, key and value projections of one input), see
#: :func:`shared_rows`
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "privlearn_shared_rows", default=None)


def _key(x: torch.Tensor, transposed: bool = False) -> tuple:
    """What identifies a recorded tensor's values while it is alive and unchanged (its
    memory, layout, dtype and version; host-side attributes, nothing read back), or
    those of its transpose (2-D; no view dispatched)."""
    shape, stride = tuple(x.shape), x.stride()
    if transposed:
        shape, stride = shape[::-1], stride[::-1]
    return (x.data_ptr(), shape, stride, x.dtype, x.device, x._version)


@contextlib.contextmanager
def shared_rows(tensors):
    """Context in which the cleaned (and scaled) forms of a recorded tensor that more than
    one of ``tensors`` (one entry per layer reading it, 2-D, contiguous) is are made once
    by :func:`_finite`, :func:`token_scaled` and :func:`token_scaled_t`, kept until its
    last reader has read them, then released: the same values (the same operations on
    the same inputs), one cleaning instead of one per layer, and no copy alive longer
    than while its readers run."""
    counts: dict = {}
    for x in tensors:
        k = _key(x)
        counts[k] = counts.get(k, 0) + 1
    token = _SHARED.set({k: [n, {}] for k, n in counts.items() if n > 1})
    try:
        yield
    finally:
        _SHARED.reset(token)


def read_elsewhere(*tensors: torch.Tensor) -> None:
    """Count one reading of each of ``tensors`` (as registered with :func:`shared_rows`)
    as done without the shared forms (a product grouped with other layers' copies its
    operands itself): a shared form is still released after its last reader."""
    state = _SHARED.get()
    if not state:
        return
    for x in tensors:
        k = _key(x)
        e = state.get(k)
        if e is not None:
            e[0] -= 1
            if e[0] <= 0:
                del state[k]


def _shared(x: torch.Tensor, form, make, keep=None):
    """``make()`` (the ``form`` of ``x``), made once for the readers of a tensor that
    several layers read (:func:`shared_rows`): ``x`` is it or its transpose. ``keep``
    (the weights whose ``id`` is part of ``form``) is held with the form, so that the
    ``id`` names them while it is kept."""
    state = _SHARED.get()
    if not state:
        return make()
    k = _key(x, x.dim() == 2 and not x.is_contiguous())
    e = state.get(k)
    if e is None:
        return make()
    v = e[1].get(form)
    if v is None:
        v = e[1][form] = (make(), keep)
    e[0] -= 1
    if e[0] <= 0:  # its last reader: released
        del state[k]
    return v[0]


#: the last weights seen by :func:`_row_view` and their views (one tuple, replaced whole:
#: a thread reading it sees a pair that belongs together)
class _PerVector:
    """Values derived from one weight vector, kept while it is the latest one asked about
    (one entry swapped whole, so a thread reading it sees one vector's values)."""

    def __init__(self) -> None:
        self._entry: tuple = (None, {})

    def get(self, c: torch.Tensor, key, make):
        entry = self._entry
        if entry[0] is not c:
            entry = self._entry = (c, {})
        v = entry[1].get(key)
        if v is None:
            v = entry[1][key] = make()
        return v


_ROW_VIEWS = _PerVector()


def _row_view(c: torch.Tensor, dim: int) -> torch.Tensor:
    """``c`` (B,) viewed as ``(B, 1, ..., 1)`` with ``dim`` dimensions, made once per
    weight vector and shape (one clipped sum weighs every layer with the same factors)."""
    return _ROW_VIEWS.get(c, dim, lambda: c.view(-1, *([1] * (dim - 1))))


def _addmv_rows(o: torch.Tensor, rows: torch.Tensor, c: torch.Tensor) -> None:
    """``o += sum_i c_i rows_i`` in place (``rows`` (B, ...) with ``o.numel()`` entries
    per example): one matrix-vector product into ``o``."""
    if rows.dim() != 2:
        rows = rows.reshape(rows.shape[0], -1)
    _addmv_cols(o, rows.t(), c)


def _addmv_cols(o: torch.Tensor, cols: torch.Tensor, c: torch.Tensor) -> None:
    """``o += cols @ c`` in place (``cols`` (n, B), ``o`` of ``n`` entries), the columns
    of examples that only a weight of 0 can make non-finite cleaned first."""
    _add_mv(o, _finite(cols), c)


#: While the clipped sum groups the products of held per-example gradients
#: (:mod:`privlearn.torch._grouped`): a function taking ``(o, rows, c)`` that returns True
#: when it takes over ``o += rows.T @ c``
_DEFER: contextvars.ContextVar = contextvars.ContextVar("privlearn_defer_mv", default=None)


#: While the clipped sum groups the one-chunk products of ghost layers that clean their
#: rows (:mod:`privlearn.torch._grouped`): a function taking ``(contribution, c, outs)``
#: that returns True when it takes over the contribution's accumulation
_GHOST_DEFER: contextvars.ContextVar = contextvars.ContextVar("privlearn_defer_mm",
                                                              default=None)


def _addmv_rows_cols(o: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     c: torch.Tensor) -> None:
    """:func:`_addmv_cols` of ``cols`` (``rows.t()``, kept), or handed to the grouped
    product of the clipped sum being formed (:data:`_DEFER`)."""
    take = _DEFER.get()
    if take is None or not take(o, rows, c):
        _addmv_cols(o, cols, c)


def _add_mv(o: torch.Tensor, cols: torch.Tensor, c: torch.Tensor) -> None:
    """``o += cols @ c`` in place, in the wider of the dtypes of ``o`` and ``cols``: one
    ``addmv_`` when ``o`` is at least as wide (narrower columns are widened first),
    else the product in the columns' dtype added into ``o`` (rounded once to its dtype,
    the columns never rounded to it: a half-precision buffer of float32 per-example
    gradients)."""
    flat = _flat(o)
    if cols.dtype == o.dtype or cols.dtype.itemsize <= o.dtype.itemsize:
        if cols.dtype != o.dtype:
            cols = cols.to(o.dtype)
        flat.addmv_(cols, c if c.dtype == o.dtype else c.to(o.dtype))
    else:
        flat.add_(torch.mv(cols, c if c.dtype == cols.dtype else c.to(cols.dtype)))


_OUT_DTYPE: bool | None = None


def _out_dtype_matmul() -> bool:
    """Whether this PyTorch multiplies half-precision matrices into a float32 result
    (``torch.mm(a, b, out_dtype=torch.float32)`` on CUDA)."""
    global _OUT_DTYPE
    if _OUT_DTYPE is None:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
            _OUT_DTYPE = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, AssertionError):
            _OUT_DTYPE = False
    return _OUT_DTYPE


def mm32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (2-D, or batched 3-D) of half-precision operands with float32
    accumulation and result (written into the float32 ``out`` where given)."""
    if a.device.type == "cuda":
        mm = torch.mm if a.dim() == 2 else torch.bmm
        if out is None:
            return mm(a, b, out_dtype=torch.float32)
        try:
            return mm(a, b, out_dtype=torch.float32, out=out)
        except (NotImplementedError, RuntimeError):  # no out= kernel in this build
            return out.copy_(mm(a, b, out_dtype=torch.float32))
    if out is not None:
        return _emulated_mm32_out(a, b, out)
    return _emulated_mm32(a, b)


def _emulated_mm32_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`_emulated_mm32` written into ``out`` (one ``bmm`` with ``out=`` on CUDA)."""
    return torch.matmul(a.float(), b.float(), out=out)


def _emulated_mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`mm32` off CUDA: both operands widened to float32, then one matmul (two
    casts and a product where CUDA dispatches one ``mm``/``bmm`` with ``out_dtype``; the
    only place the CPU emulates that product, so that a count of what the CUDA branch
    dispatches can stand in for it here)."""
    return torch.matmul(a.float(), b.float())  # bf16 x bf16 products are exact in float32


def _emulated_addmm32_(o: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """:func:`addmm32_` into a float32 ``o``, or one of the operands' dtype, off CUDA:
    ``o += a @ b`` formed by :func:`_emulated_mm32` and added (rounded once to ``o``'s
    dtype), where CUDA dispatches one ``addmm``."""
    o.add_(_emulated_mm32(a, b))


#: the cuBLAS settings that allow a half-precision product's reductions in half
#: precision, by operand dtype
_REDUCED_REDUCTION = {torch.bfloat16: "allow_bf16_reduced_precision_reduction",
                      torch.float16: "allow_fp16_reduced_precision_reduction"}


@contextlib.contextmanager
def _float32_reductions(dtype: torch.dtype):
    """Context in which cuBLAS keeps every reduction of a ``dtype`` product in float32
    (its half-precision reductions disallowed; a host-side setting, restored after)."""
    m = torch.backends.cuda.matmul
    name = _REDUCED_REDUCTION[dtype]
    allowed = getattr(m, name)
    if not allowed:
        yield
        return
    split_k = getattr(m, name + "_split_k", None)
    setattr(m, name, False if split_k is None else (False, split_k))
    try:
        yield
    finally:
        setattr(m, name, True if split_k is None else (True, split_k))


_ADDMM_OUT: bool | None = None


def _addmm_out_dtype() -> bool:
    """Whether this PyTorch adds a product of half-precision matrices, accumulated in
    float32, into a float32 matrix in place (``torch.addmm(o, a, b,
    out_dtype=torch.float32, out=o)`` on CUDA), checked once on a small product."""
    global _ADDMM_OUT
    if _ADDMM_OUT is None:
        try:
            a = torch.arange(4.0, device="cuda").view(2, 2).to(torch.bfloat16)
            o = torch.ones(2, 2, device="cuda")
            want = 1.0 + a.float() @ a.float()
            r = torch.addmm(o, a, a, out_dtype=torch.float32, out=o)
            _ADDMM_OUT = r.data_ptr() == o.data_ptr() and bool(torch.equal(o, want))
        except (RuntimeError, TypeError, AssertionError):
            _ADDMM_OUT = False
    return _ADDMM_OUT


def addmm32_(o: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``o += a @ b`` for half-precision ``a`` and ``b``, accumulated in float32 and
    rounded once to ``o``'s dtype. On CUDA one ``addmm``: with ``out_dtype`` into a
    float32 ``o`` (where :func:`_addmm_out_dtype`), or into an ``o`` of the operands'
    dtype, whose GEMM accumulates ``a @ b + o`` in float32 (cuBLAS's float32 compute
    type, half-precision reductions disallowed while it runs) and rounds it once; else
    :func:`mm32` and an addition."""
    cuda = o.device.type == "cuda"
    if o.dtype == a.dtype == b.dtype and o.dtype in _REDUCED_REDUCTION:
        if not cuda:
            _emulated_addmm32_(o, a, b)
            return
        with _float32_reductions(o.dtype):
            o.addmm_(a, b)
    elif o.dtype != torch.float32 or (cuda and not _addmm_out_dtype()):
        o.add_(mm32(a, b))
    elif cuda:
        torch.addmm(o, a, b, out_dtype=torch.float32, out=o)
    else:
        _emulated_addmm32_(o, a, b)


def add_product_(o: torch.Tensor, left: torch.Tensor, right: torch.Tensor, low: bool,
                 dt: torch.dtype) -> None:
    """``o += left @ right`` for a ghost layer's weight gradient (``o`` viewed as the
    product's shape): :func:`addmm32_` for half-precision operands (``low``), the product
    added and rounded once into a buffer of another dtype than ``dt``, else one addmm."""
    o = o if o.shape == (left.shape[0], right.shape[1]) else o.view(left.shape[0], -1)
    if low:
        addmm32_(o, left, right)
    elif o.dtype != dt:
        o.add_(left.mm(right))
    else:
        o.addmm_(left, right)


def row_scaled(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` weighted by per-example factors: ``c_i x_i``.

    Parameters
    ----------
    x : torch.Tensor
        Batch-first tensor ``(B, ...)``.
    c : torch.Tensor
        Per-example weights ``(B,)`` (the clip factors).

    Returns
    -------
    torch.Tensor
        ``c_i x_i`` in the dtype of ``x``, exactly zero in the rows where ``c_i == 0``
        whatever they held (``inf * 0`` is cleaned), so that an overflowing example
        dropped by its weight adds nothing (see :attr:`Contribution.masks_rows`).
    """
    y = x * _row_view(c, x.dim()).to(x.dtype)
    return y if _ROWS_FINITE.get() else y.nan_to_num_(0.0, 0.0, 0.0)


def token_scaled(x: torch.Tensor, c: torch.Tensor, t: int) -> torch.Tensor:
    """:func:`row_scaled` of a ``(B T, n)`` tensor whose ``T`` consecutive rows belong to
    one example: ``c_i x_{i s}``, the factors repeated per row once per weight vector and
    ``T`` (one multiplication a layer, on the form its matmul reads). In the wider of
    the two dtypes: half-precision rows and float32 factors give the float32 products
    of the exact float32 values (no cast of the rows first)."""
    if _ROWS_FINITE.get():
        return x * _token_factors(c, t)
    return _shared(x, ("rows", t, id(c)),
                   lambda: (x * _token_factors(c, t)).nan_to_num_(0.0, 0.0, 0.0), c)


def _token_factors(c: torch.Tensor, t: int) -> torch.Tensor:
    """The factors repeated per row, ``(B T, 1)``, once per weight vector and ``T``."""
    return _ROW_VIEWS.get(c, ("rows of", t), lambda: c.unsqueeze(1).repeat(1, t).view(-1, 1))


def token_scaled_t(xt: torch.Tensor, c: torch.Tensor, t: int) -> torch.Tensor:
    """:func:`token_scaled` of the transpose: ``xt`` ``(n, B T)`` (the transposed view of
    a ``(B T, n)`` tensor) with its columns weighted, in the transposed view's layout:
    the same values and memory as ``token_scaled(xt.t(), c, t).t()``, without the
    transposing view."""
    f = _ROW_VIEWS.get(c, ("columns of", t), lambda: _token_factors(c, t).view(1, -1))
    if _ROWS_FINITE.get():
        return xt * f
    return _shared(xt, ("columns", t, id(c)), lambda: (xt * f).nan_to_num_(0.0, 0.0, 0.0),
                   c)


def row_sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean norm of each row of a 2-D tensor: ``sum_j x_ij^2``.

    Parameters
    ----------
    x : torch.Tensor
        ``(B, n)``; reshape per-example gradients to ``(B, -1)`` first.

    Returns
    -------
    torch.Tensor
        ``(B,)``, float32 for half-precision rows (one fused ``vector_norm``: several
        times faster on CPU than a batched dot product).
    """
    if x.dtype in _LOW:
        return torch.linalg.vector_norm(x, dim=1, dtype=torch.float32).square()
    return torch.linalg.vector_norm(x, dim=1).square()


#: :func:`live_positions` drops positions only when at least ``1 / _MIN_DEAD_SHARE`` of
#: them may be dead: the check reads the whole output gradient twice.
_MIN_DEAD_SHARE = 4
#: ... and only for output gradients of at least this many elements: on a smaller one the
#: check's own operations (five a layer) cost more than the positions it could drop save.
_MIN_CHECK_ELEMENTS = 2 ** 16
#: Examples whose whole output gradient the cheap first check of :func:`live_positions`
#: reads (a strided read of one feature of every example was slower on a cold cache).
_PROBE_EXAMPLES = 4
#: ... and the features of each of their rows it reads (bounded: a language-model head's
#: rows are vocabulary-wide).
_PROBE_FEATURES = 64


def live_positions(g: torch.Tensor) -> torch.Tensor | None:
    """Positions of an output gradient at which some example's gradient is non-zero.

    A position whose output gradient is exactly zero in every example and group adds
    exactly zero to every per-example gradient ``sum_t g_t a_t^T``, to its norm and to the
    clipped sum, so dropping it is exact (floating-point sums lose only ``+0`` terms).
    Such positions are common where the loss reads a few positions: a sequence
    classifier on the ``[CLS]`` token (BERT's last layer sees a gradient at one position
    of ``T``) or on the last token. Cheap when nothing can be dropped: the first
    ``_PROBE_FEATURES`` features of the first ``_PROBE_EXAMPLES`` examples are read, and
    ``g`` is checked in full only when they are zero at a quarter of the positions or
    more. A NaN counts as non-zero. CPU only: on an accelerator the check would
    synchronise the device once per layer; and only for gradients of at least
    ``_MIN_CHECK_ELEMENTS`` elements (on smaller ones the check costs more than it saves).

    Parameters
    ----------
    g : torch.Tensor
        Output gradient ``(B, G, T, p)`` (examples, groups, positions, features).

    Returns
    -------
    torch.Tensor or None
        The live positions (a 1-D index tensor, for ``index_select`` on dimension 2 of
        ``g`` and of the matching inputs; one zero position when all are dead), or None
        when no position can be dropped (nothing to copy).
    """
    b, G, t, p = g.shape
    if t <= 1 or g.device.type != "cpu" or g.numel() < _MIN_CHECK_ELEMENTS:
        return None
    # probe: positions with a non-zero entry in one of the first examples are surely live
    # (their rows are contiguous: a few cache-friendly reads; a NaN makes the max NaN)
    probe = g[:_PROBE_EXAMPLES, :, :, :_PROBE_FEATURES].abs().amax(dim=(0, 1, 3)).ne(0)
    maybe_dead = t - int(probe.sum())
    if maybe_dead * _MIN_DEAD_SHARE < t:
        # too few to pay for the full check and the copies (a causal LM head: only the
        # last position has no target, and its (B, T, vocab) gradient is large)
        return None
    flat = g.reshape(b * G, t * p)  # full check: the largest and smallest value per position
    live = flat.amax(0).view(t, p).amax(1).ne(0) | flat.amin(0).view(t, p).amin(1).ne(0)
    if bool(live.all()):
        return None
    idx = live.nonzero().squeeze(1)
    return idx if idx.numel() else idx.new_zeros(1)  # keep one (zero) position


def _shaped(x: torch.Tensor, shape) -> torch.Tensor:
    """``x`` reshaped to ``shape``, without dispatching a view when it has that shape."""
    return x if x.shape == shape else x.reshape(shape)


#: the last clip factors given to :func:`low_factors` and their half-precision forms by
#: dtype (one tuple, replaced whole; one clipped sum weighs every layer with the same
#: factors: they are rounded once per dtype, not once per layer)
_LOW_FACTORS = _PerVector()


def low_factors(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clip factors in half precision, never larger than the float32 ones after the
    product with a gradient is rounded (see :data:`_LOW_MARGIN`); formed once per
    factor vector and dtype."""
    return _LOW_FACTORS.get(c, dtype, lambda: _round_factors(c, dtype))


def _round_factors(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`low_factors` without the cache: the factors reduced by the margin, then
    rounded toward zero to ``dtype``."""
    c = c * (1.0 - _LOW_MARGIN.get(dtype, 2.0 ** -7))
    if dtype == torch.bfloat16 and c.dtype == torch.float32:
        # bfloat16 is float32's upper half: clearing the lower 16 bits rounds toward zero
        # (exactly; a finite value stays finite), one operation instead of six
        return c.view(torch.int32).bitwise_and_(-65536).view(torch.float32).to(dtype)
    low = c.to(dtype)
    over = low.float().abs() > c.abs()
    return torch.where(over, torch.nextafter(low, torch.zeros_like(low)), low)


def segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of the rows of ``values`` sharing a segment id: ``out[j] = sum_{i: index_i = j}
    values_i`` for ``j < n`` (TensorFlow's ``unsorted_segment_sum``).

    Parameters
    ----------
    values : torch.Tensor
        ``(N, d)`` rows to add.
    index : torch.Tensor
        ``(N,)`` integer segment of each row, in ``[0, n)``.
    n : int
        Number of segments.

    Returns
    -------
    torch.Tensor
        ``(n, d)``, zero for a segment no row belongs to (one fused kernel: the backward
        of an embedding lookup).
    """
    return torch.ops.aten.embedding_dense_backward(values, index, n, -1, False)
