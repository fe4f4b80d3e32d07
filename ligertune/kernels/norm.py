"""RMSNorm in Triton, forward and backward (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization", eq. 4).

With r = 1 / sqrt(mean(x^2) + eps) per row, n = x * r and w' = offset + w:

    forward:   y = n * w'                                     (rounding: see `reference.rms_norm`)
    backward:  g = dy * w'
               dx = r * (g - n * mean(g * n))
               dw = sum over rows of dy * n

Everything is computed in float32. The forward saves only r per row next to x; the backward
recomputes n from them. dw is reduced in two steps: each program of the backward accumulates its
rows in float32 registers and writes one partial row, and the host sums the partial rows.

The file is not named after the public function `rms_norm`: importing a submodule binds its name
on the package, which would hide the `ligertune.kernels.rms_norm` dispatcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ligertune.kernels.reference import rms_norm_casting

MAX_FUSED_COLS = 65536
"""Longest row one program normalizes (a row is held on chip whole)."""

TILE_ELEMS = 4096
"""Elements per program tile: short rows are grouped until a tile holds about this many, so that a
program moves enough bytes to hide memory latency (q/k norms have rows of 64-256 elements)."""

INTERPRETER_PROGRAMS = 4
"""Programs of the backward off CUDA (the Triton interpreter): a few, so that the partial sums of dw
are exercised as on a GPU."""


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    eps,
    offset,
    GEMMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # int64 before multiplying by the row stride: rows * stride passes 2^31 on large activations.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    b_x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b_w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / n_cols + eps)
    b_n = b_x * b_rstd[:, None]
    if not GEMMA:
        # Llama rounds the normalized row to the input dtype before the weight multiplies it.
        b_n = b_n.to(x_ptr.dtype.element_ty).to(tl.float32)
    b_y = b_n * b_w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], b_y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, b_rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    offset,
    GEMMA: tl.constexpr,
    HAS_DW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    b_w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    b_dw = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)

    # Programs stride over the row tiles, so that one partial row of dw serves many tiles.
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        # int64 before multiplying by the row stride: rows * stride passes 2^31 on large activations.
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        b_dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b_x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # Rows past the end load rstd = 0, so they add nothing to dw.
        b_rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        b_n = b_x * b_rstd[:, None]
        b_g = b_dy * b_w[None, :]
        if not GEMMA:
            # Mirror the forward's rounding: the weight saw n in the input dtype, and the gradient
            # of n comes back through that rounding in the input dtype.
            b_n = b_n.to(x_ptr.dtype.element_ty).to(tl.float32)
            b_g = b_g.to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_DW:
            b_dw += b_dy * b_n
        b_dot = tl.sum(b_g * b_n, axis=1) / n_cols
        b_dx = b_rstd[:, None] * (b_g - b_n * b_dot[:, None])
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], b_dx.to(dx_ptr.dtype.element_ty), mask=mask)

    if HAS_DW:
        tl.store(dw_partial_ptr + pid * n_cols + cols, tl.sum(b_dw, axis=0), mask=col_mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a [rows, H] matrix whose rows are contiguous (a view when the layout allows)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _tiling(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps): a whole row per tile, rows grouped up to `TILE_ELEMS`."""
    block_h = triton.next_power_of_2(n_cols)
    if block_h > MAX_FUSED_COLS:
        raise ValueError(f"rms_norm supports rows of at most {MAX_FUSED_COLS} elements; got {n_cols}")
    block_m = min(max(1, TILE_ELEMS // block_h), triton.next_power_of_2(max(n_rows, 1)))
    # About 16 elements per thread: whole 16-byte accesses in any dtype, and few enough registers
    # for the backward's five live tiles.
    num_warps = min(32, max(4, block_m * block_h // 512))
    return block_m, block_h, num_warps


def _num_programs(device: torch.device, n_tiles: int, num_warps: int) -> int:
    """Programs of the backward: enough to fill the GPU (several per SM), no more than the tiles."""
    if device.type == "cuda":
        per_sm = max(1, 32 // num_warps)
        return max(1, min(n_tiles, torch.cuda.get_device_properties(device).multi_processor_count * per_sm))
    return max(1, min(n_tiles, INTERPRETER_PROGRAMS))


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """y (shaped as x) and the float32 reciprocal RMS per row (for the backward)."""
    x_rows = _as_rows(x)
    n_rows, n_cols = x_rows.shape
    out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_m, block_h, num_warps = _tiling(n_rows, n_cols)
    if n_rows:
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
            x_rows, weight.contiguous(), y, rstd,
            x_rows.stride(0), y.stride(0), n_rows, n_cols, eps, offset,
            GEMMA=gemma, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps,
        )
    return y.view(x.shape), rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    gemma: bool,
    needs_weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dx (shaped and typed as x) and dw (typed as weight; None unless `needs_weight_grad`)."""
    x_rows, dy_rows = _as_rows(x), _as_rows(dy)
    n_rows, n_cols = x_rows.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(weight) if needs_weight_grad else None
    block_m, block_h, num_warps = _tiling(n_rows, n_cols)
    n_programs = _num_programs(x.device, triton.cdiv(n_rows, block_m), num_warps)
    # Every program writes its partial row, so no zero-fill is needed; a frozen weight gets a stub.
    dw_shape = (n_programs, n_cols) if needs_weight_grad else (1, 1)
    dw_partial = torch.empty(dw_shape, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_programs,)](
        dy_rows, x_rows, weight.contiguous(), rstd, dx, dw_partial,
        dy_rows.stride(0), x_rows.stride(0), dx.stride(0), n_rows, n_cols, offset,
        GEMMA=gemma, HAS_DW=needs_weight_grad, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps,
    )
    dw = dw_partial.sum(0).to(weight.dtype) if needs_weight_grad else None
    return dx.view(x.shape), dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, gemma):
        y, rstd = rms_norm_fwd(x, weight, eps, offset, gemma)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.gemma = offset, gemma
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x, weight, rstd, ctx.offset, ctx.gemma, ctx.needs_input_grad[1])
        return dx, dw, None, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H]: the semantics and casting modes of `reference.rms_norm`.

    Differentiable w.r.t. x and weight. Saves x and one float32 per row for the backward (the
    eager module saves float32 copies of x and of the normalized x).
    """
    mode = rms_norm_casting(x, weight, offset, casting)
    return _RMSNorm.apply(x, weight, float(eps), float(offset), mode == "gemma")
