"""The SwiGLU gate in Triton, forward and backward (Shazeer 2020, "GLU Variants Improve
Transformer", eq. 6).

With s = sigmoid(g) = 1 / (1 + exp(-g)) and a = silu(g) = g / (1 + exp(-g)), rounded to the dtype:

    forward:   y = a * u
    backward:  du = dy * a
               dg = (dy * u) * s * (1 + g (1 - s))

Computed in float32 with the roundings of the eager `silu(gate) * up` and its autograd (a and
dy * u are rounded to the dtype before the next product), so on a GPU the result matches it up to the
last bit of `exp`. Elementwise, over flat memory or over the rows of column slices (gate and up
side by side in one buffer); nothing but gate and up is saved for the backward, which can write the
two gradients over them, where they are (`reuse_inputs`).

The file is not named after the public function `swiglu`: importing a submodule binds its name on
the package, which would hide the `ligertune.kernels.swiglu` dispatcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ligertune.kernels.reference import check_swiglu_args

BLOCK = 4096
"""Elements per program: 16 per thread at 8 warps, i.e. whole 16-byte accesses in any dtype."""

NUM_WARPS = 8


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, y_ptr, stride_g, stride_u, stride_y, width, n_elements,
                       BLOCK: tl.constexpr):
    # A row of `width` elements (a block of flat memory, or a row of a column slice) per program
    # row; int64: an MLP activation of 64k tokens x 14336 channels already passes 2^31 elements.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < width) & (row * width + cols < n_elements)
    dtype = y_ptr.dtype.element_ty
    b_g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    b_a = (b_g / (1.0 + tl.exp(-b_g))).to(dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (b_a * b_u).to(dtype), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, stride_dy, stride_g, stride_u, stride_dg,
                       stride_du, width, n_elements, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < width) & (row * width + cols < n_elements)
    dtype = dgate_ptr.dtype.element_ty
    b_dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    b_g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    b_den = 1.0 + tl.exp(-b_g)
    b_s = 1.0 / b_den
    b_a = (b_g / b_den).to(dtype).to(tl.float32)
    b_da = (b_dy * b_u).to(dtype).to(tl.float32)
    tl.store(dup_ptr + row * stride_du + cols, (b_dy * b_a).to(dtype), mask=mask)
    tl.store(dgate_ptr + row * stride_dg + cols, (b_da * b_s * (1.0 + b_g * (1.0 - b_s))).to(dtype), mask=mask)


class _Layout:
    """How the kernels walk tensors of one shape. Contiguous ones: flat memory, a program row per
    `BLOCK` elements. Otherwise (gate and up as column slices of one wider output, side by side:
    `ligertune.models.float8.Float8Siblings`) rows of the last dimension's `width`, each tensor at
    its own row stride, read and written where they are; a tensor whose layout is not such rows is
    copied first."""

    def __init__(self, *tensors: torch.Tensor):
        self.n = tensors[0].numel()
        self.flat = all(t.is_contiguous() for t in tensors)
        self.width = BLOCK if self.flat else tensors[0].shape[-1]
        rows = triton.cdiv(self.n, self.width) if self.width else 0
        self.grid = (rows, triton.cdiv(self.width, BLOCK))

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(t as the kernels read it, its row stride)."""
        if self.flat:
            return t.view(-1), BLOCK
        if t.stride(-1) == 1:
            try:
                rows = t.view(-1, self.width)
                return rows, rows.stride(0)
            except RuntimeError:
                pass
        return t.contiguous().view(-1, self.width), self.width


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, contiguous, shaped as gate."""
    layout = _Layout(gate, up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if layout.n:
        (g, stride_g), (u, stride_u), (out, stride_y) = layout(gate), layout(up), layout(y)
        _swiglu_fwd_kernel[layout.grid](g, u, out, stride_g, stride_u, stride_y, layout.width, layout.n,
                                        BLOCK=BLOCK, num_warps=NUM_WARPS)
    return y


def swiglu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, into_inputs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), shaped as gate: written over gate and up when `into_inputs` (each element is
    read before it is written, so the result is the same; where gate and up are where the kernel
    reads them), else new and contiguous."""
    layout = _Layout(dy, gate, up)
    if not layout.n:
        return torch.empty_like(gate), torch.empty_like(up)
    (d, stride_dy), (g, stride_g), (u, stride_u) = layout(dy), layout(gate), layout(up)
    if into_inputs and g.data_ptr() == gate.data_ptr() and u.data_ptr() == up.data_ptr():
        dgate, dup = gate, up
        # Anything that still held on to gate or up now fails autograd's version check loudly.
        torch.autograd.graph.increment_version((gate, up))
        (dg, stride_dg), (du, stride_du) = (g, stride_g), (u, stride_u)
    else:
        dgate, dup = (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
        (dg, stride_dg), (du, stride_du) = layout(dgate), layout(dup)
    _swiglu_bwd_kernel[layout.grid](d, g, u, dg, du, stride_dy, stride_g, stride_u, stride_dg, stride_du,
                                    layout.width, layout.n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dgate, dup


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, reuse_inputs):
        ctx.save_for_backward(gate, up)
        ctx.reuse_inputs = reuse_inputs
        return swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return *swiglu_bwd(dy, gate, up, into_inputs=ctx.reuse_inputs), None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, reuse_inputs: bool = False) -> torch.Tensor:
    """silu(gate) * up for tensors of one shape and dtype: the semantics of `reference.swiglu`.
    Differentiable w.r.t. both; see `ligertune.kernels.swiglu` for `reuse_inputs`."""
    check_swiglu_args(gate, up)
    return _SwiGLU.apply(gate, up, reuse_inputs)
