"""Rows to float8 with a scale per row: the activations and gradients of the frozen float8 layers
(`ligertune.models.float8.Float8FrozenLinear`); the transpose of a float8 matrix, which their
backward needs (a float8 GEMM reads its second operand column-major only); and a matrix to float8
with one scale for the tensor, written transposed, for a GEMM whose inner side is its rows (the
weight gradient's, over tokens: `quantize_transposed`).

For a row x (times `col_scale` elementwise, when given), with E = 448 the largest e4m3 value:

    amax  = max_k |x_k|            (1e-12 at least: an all-zero row keeps zeros)
    q_k   = e4m3(x_k * E / amax)   rounded to nearest, ties to even, |q_k| <= E
    scale = amax / E               so that x_k ~ q_k * scale

One program per row reads it twice (its largest magnitude, then the cast: the second read comes
from the cache for rows of a decoder's widths) and writes one byte per element and the scale: one
pass over the tensor in device memory, where the same in torch's eager ops is five.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import triton
import triton.language as tl

from ligertune.kernels.types import AMAX_FLOOR, FLOAT8, FLOAT8_MAX


@triton.jit
def _round_to_float8(v, E5M2: tl.constexpr):
    """v (float32, within the format's range) rounded to the nearest e4m3 value (or e5m2), ties to
    even, still in float32, so that the cast after it is exact: for Triton's interpreter, which
    rounds up without carrying into the exponent (-31.51 became -16 in e4m3); a GPU's conversion
    rounds to nearest even itself, and skips these dozen integer operations an element
    (`SOFTWARE_ROUNDING`). Normal values keep 3 bits of mantissa (e5m2: 2) of float32's 23: add half
    a unit of the dropped bits, plus the kept last bit for ties, and clear them; a carry moves the
    exponent, as it should. Below the smallest normal value, 2^-6 (2^-14), the format is subnormal,
    a multiple of 2^-9 (2^-16): adding and subtracting 1.5 * 2^14 (1.5 * 2^7) leaves |v| rounded to
    that grid, the sign kept, -0 included."""
    dropped: tl.constexpr = 21 if E5M2 else 20
    smallest_normal: tl.constexpr = 6.103515625e-05 if E5M2 else 0.015625
    shift: tl.constexpr = 192.0 if E5M2 else 24576.0
    half_unit: tl.constexpr = (1 << (dropped - 1)) - 1
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + half_unit + ((bits >> dropped) & 1)) & -(1 << dropped)).to(tl.float32, bitcast=True)
    subnormal = (tl.abs(v) + shift) - shift
    return tl.where(tl.abs(v) < smallest_normal, tl.where(v < 0, -subnormal, subnormal), normal)


@triton.jit
def _quantize_rows_kernel(x_ptr, x1_ptr, x2_ptr, col_scale_ptr, q_ptr, scale_ptr, n_cols, x_row_stride,
                          x1_row_stride, x2_row_stride, x1_start, x2_start, PARTS: tl.constexpr,
                          HAS_COL_SCALE: tl.constexpr, BLOCK: tl.constexpr, FLOAT8_MAX: tl.constexpr,
                          AMAX_FLOOR: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    if PARTS > 1:  # rows of the second matrix, then of the third, from their own pointers
        if row >= x1_start:
            x_row = x1_ptr + (row - x1_start) * x1_row_stride
        if PARTS > 2:
            if row >= x2_start:
                x_row = x2_ptr + (row - x2_start) * x2_row_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            x = x * tl.load(col_scale_ptr + cols, mask=cols < n_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x))
    row_amax = tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR)
    factor = FLOAT8_MAX / row_amax
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            x = x * tl.load(col_scale_ptr + cols, mask=cols < n_cols, other=0.0)
        q = tl.clamp(x * factor, -FLOAT8_MAX, FLOAT8_MAX)
        if SOFTWARE_ROUNDING:
            q = _round_to_float8(q, False)
        q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + row * n_cols + cols, q, mask=cols < n_cols)
    tl.store(scale_ptr + row, row_amax / FLOAT8_MAX)


MAX_PARTS = 3
"""Matrices that `quantize_rows` reads from their own places in one launch (q, k and v); more, or of
different dtypes, are joined by a copy first."""


def quantize_rows(x: torch.Tensor | Sequence[torch.Tensor],
                  col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, cols] e4m3, scale [rows] float32) of a 2-D `x`, or of the rows of several matrices
    of one width as if stacked (one launch); see the module docstring."""
    parts = [x] if isinstance(x, torch.Tensor) else list(x)
    if any(p.dim() != 2 for p in parts) or len({p.shape[1] for p in parts}) != 1:
        shapes = ", ".join(str(tuple(p.shape)) for p in parts)
        raise ValueError(f"quantize_rows: expected 2-D tensors of one width, got shapes {shapes}")
    if len(parts) > MAX_PARTS or len({p.dtype for p in parts}) > 1:
        parts = [torch.cat(parts)]
    parts = [p if p.stride(1) == 1 else p.contiguous() for p in parts]
    starts = list(itertools.accumulate(p.shape[0] for p in parts))
    rows, cols = starts[-1], parts[0].shape[1]
    first = parts[0]
    q = torch.empty(rows, cols, dtype=FLOAT8, device=first.device)
    scale = torch.empty(rows, dtype=torch.float32, device=first.device)
    if col_scale is not None:
        col_scale = col_scale.float().contiguous()
    if rows:
        block = min(triton.next_power_of_2(cols), 4096)
        x1, x2 = (parts[1:] + [first, first])[:2]  # the pointers a kernel of fewer parts never reads
        x1_start, x2_start = (starts + [rows])[:2]
        _quantize_rows_kernel[(rows,)](
            first, x1, x2, col_scale if col_scale is not None else scale, q, scale, cols, first.stride(0),
            x1.stride(0), x2.stride(0), x1_start, x2_start, PARTS=len(parts),
            HAS_COL_SCALE=col_scale is not None, BLOCK=block, FLOAT8_MAX=FLOAT8_MAX, AMAX_FLOOR=AMAX_FLOOR,
            SOFTWARE_ROUNDING=first.device.type != "cuda", num_warps=8 if block >= 2048 else 4,
        )
    return q, scale


@triton.jit
def _quantize_transposed_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, rows, cols, padded_rows, x_row_stride,
                                FLOAT8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, E5M2: tl.constexpr,
                                SOFTWARE_ROUNDING: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    amax = tl.maximum(tl.load(amax_ptr).to(tl.float32), AMAX_FLOOR)  # in x's dtype: exact in float32
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, amax / FLOAT8_MAX)
    factor = FLOAT8_MAX / amax
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * x_row_stride + c[None, :], mask=inside, other=0.0).to(tl.float32)
    q = tl.clamp(x * factor, -FLOAT8_MAX, FLOAT8_MAX)  # the padding rows: zeros
    if SOFTWARE_ROUNDING:
        q = _round_to_float8(q, E5M2)
    q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    written = (r[:, None] < padded_rows) & (c[None, :] < cols)
    tl.store(q_ptr + c[:, None] * padded_rows + r[None, :], tl.trans(q), mask=tl.trans(written))


def quantize_transposed(x: torch.Tensor, dtype: torch.dtype, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [cols, rows padded] in `dtype`, scale: a float32 scalar) of a 2-D `x`, x^T ~ q * scale:
    one scale for the whole tensor, its largest magnitude over the format's largest (amax, in torch's
    reduction, then one Triton pass of tiles cast and written transposed, which writes the scale
    too); the padding zeros."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    padded_rows = -(-rows // multiple) * multiple
    largest = torch.finfo(dtype).max
    amax = torch.linalg.vector_norm(x, float("inf"))  # max |x|, one reduction
    q = torch.empty(cols, padded_rows, dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    if not q.numel():
        scale.fill_(AMAX_FLOOR / largest)
    else:
        block = 64
        _quantize_transposed_kernel[(triton.cdiv(padded_rows, block), triton.cdiv(cols, block))](
            x, amax, q, scale, rows, cols, padded_rows, x.stride(0), FLOAT8_MAX=largest, AMAX_FLOOR=AMAX_FLOOR,
            E5M2=dtype == torch.float8_e5m2, SOFTWARE_ROUNDING=x.device.type != "cuda", BLOCK=block,
            num_warps=4)
    return q, scale


@triton.jit
def _transpose_kernel(x_ptr, out_ptr, rows, cols, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask)
    tl.store(out_ptr + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_float8(x: torch.Tensor) -> torch.Tensor:
    """The transpose of a contiguous 2-D float8 `x`, contiguous: square tiles, each read along its
    rows and written along its columns' rows, where torch's strided copy moves a byte at a time."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"transpose_float8: expected a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    out = torch.empty(cols, rows, dtype=x.dtype, device=x.device)
    if x.numel():
        block = 64
        # the bytes as bytes: a load and a store, no conversion
        _transpose_kernel[(triton.cdiv(rows, block), triton.cdiv(cols, block))](
            x.view(torch.uint8), out.view(torch.uint8), rows, cols, BLOCK=block, num_warps=4)
    return out
