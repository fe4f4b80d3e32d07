"""The gated units of SwiGLU and GeGLU in Triton, forward and backward (Shazeer 2020, "GLU Variants
Improve Transformer", eq. 5 and 6): y = act(gate) * up.

With a = act(g) rounded to the dtype and act' its derivative:

    forward:   y = a * u
    backward:  du = dy * a
               dg = (dy * u) * act'(g)

    SwiGLU (act = silu):       s = sigmoid(g), a = g s,  act'(g) = s (1 + g (1 - s))
    GeGLU (act = tanh GELU):   t = tanh(k0 (g + k1 g^3)), a = g (1 + t) / 2,
                               act'(g) = (1 + t) / 2 + g (1 - t^2) k0 (1 + 3 k1 g^2) / 2
                               (k0 = sqrt(2 / pi), k1 = 0.044715: torch's `gelu(approximate="tanh")`,
                               Gemma's `gelu_pytorch_tanh`)

Computed in float32 with the roundings of the eager `act(gate) * up` and its autograd (a and
dy * u are rounded to the dtype before the next product), so on a GPU the result matches it up to the
last bits of `exp`. Elementwise over flat memory; nothing but gate and up is saved for the backward,
which can write the two gradients over them (`reuse_inputs`). gate and up that are column slices of
one wider buffer (side by side in a joined float8 GEMM's output) take kernels of their own, which
read them, and write their gradients, where they lie: row by row, at their row strides.

The file is not named after the public functions `swiglu` and `geglu`: importing a submodule binds its
name on the package, which would hide the `ligertune.kernels.swiglu` dispatcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ligertune.kernels.cross_entropy import _tanh
from ligertune.kernels.reference import check_glu_args

BLOCK = 4096
"""Elements per program: 16 per thread at 8 warps, i.e. whole 16-byte accesses in any dtype."""

NUM_WARPS = 8

ACTIVATIONS = ("silu", "gelu_tanh")
"""The kernels' ACT codes, in order: SwiGLU's and GeGLU's activation."""
SILU: tl.constexpr = tl.constexpr(0)
GELU_TANH: tl.constexpr = tl.constexpr(1)


@triton.jit
def _activation(b_g, ACT: tl.constexpr):
    """(act(g), act'(g)) in float32."""
    if ACT == SILU:
        b_den = 1.0 + tl.exp(-b_g)
        b_s = 1.0 / b_den
        return b_g / b_den, b_s * (1.0 + b_g * (1.0 - b_s))
    else:
        # k0 = sqrt(2 / pi) = 0.7978845608028654, k1 = 0.044715
        b_g2 = b_g * b_g
        b_t = _tanh(0.7978845608028654 * (b_g + 0.044715 * b_g2 * b_g))
        b_half_g = 0.5 * b_g
        b_inner_slope = 0.7978845608028654 * (1.0 + 0.134145 * b_g2)  # k0 (1 + 3 k1 g^2)
        b_slope = 0.5 * (1.0 + b_t) + b_half_g * (1.0 - b_t * b_t) * b_inner_slope
        return b_half_g * (1.0 + b_t), b_slope


@triton.jit
def _glu_value(b_g, b_u, dtype: tl.constexpr, ACT: tl.constexpr):
    """act(g) * u in `dtype`, a and the product rounded to it as the eager ops round them."""
    b_a, _ = _activation(b_g, ACT)
    return (b_a.to(dtype).to(tl.float32) * b_u).to(dtype)


@triton.jit
def _glu_grads(b_dy, b_g, b_u, dtype: tl.constexpr, ACT: tl.constexpr):
    """(dgate, dup) in `dtype`, a and dy * u rounded to it as eager autograd rounds them."""
    b_a, b_slope = _activation(b_g, ACT)
    b_a = b_a.to(dtype).to(tl.float32)
    b_da = (b_dy * b_u).to(dtype).to(tl.float32)
    return (b_da * b_slope).to(dtype), (b_dy * b_a).to(dtype)


@triton.jit
def _glu_fwd_kernel(gate_ptr, up_ptr, y_ptr, n_elements, BLOCK: tl.constexpr, ACT: tl.constexpr):
    # int64: an MLP activation of 64k tokens x 14336 channels already passes 2^31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    b_g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _glu_value(b_g, b_u, y_ptr.dtype.element_ty, ACT), mask=mask)


@triton.jit
def _glu_bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_elements, BLOCK: tl.constexpr,
                    ACT: tl.constexpr):
    # int64: an MLP activation of 64k tokens x 14336 channels already passes 2^31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    b_dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_dgate, b_dup = _glu_grads(b_dy, b_g, b_u, dgate_ptr.dtype.element_ty, ACT)
    tl.store(dup_ptr + offs, b_dup, mask=mask)
    tl.store(dgate_ptr + offs, b_dgate, mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def _strided_rows(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """gate and up as rows at their strides, where neither is contiguous and both are such rows;
    None otherwise (the flat kernels then take them, contiguous or copied)."""
    if gate.is_contiguous() or up.is_contiguous():
        return None
    rows = _as_rows(gate), _as_rows(up)
    return None if rows[0] is None or rows[1] is None else rows


def glu_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, contiguous, shaped as gate (`activation`: one of `ACTIVATIONS`)."""
    act = ACTIVATIONS.index(activation)
    rows = _strided_rows(gate, up)
    if rows is not None:
        return _glu_rows_fwd(*rows, act).view(gate.shape)
    g, u = _flat(gate), _flat(up)
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _glu_fwd_kernel[(triton.cdiv(n, BLOCK),)](g, u, y, n, BLOCK=BLOCK, ACT=act, num_warps=NUM_WARPS)
    return y.view(gate.shape)


def glu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, *, into_inputs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), shaped as gate; written over gate and up when `into_inputs` (each element is
    read before it is written, so the result is the same), where they lie when they are column
    slices of a wider buffer; else contiguous."""
    act = ACTIVATIONS.index(activation)
    rows = _strided_rows(gate, up)
    if rows is not None:
        if into_inputs:
            # Anything that still held on to gate or up now fails autograd's version check loudly.
            torch.autograd.graph.increment_version((gate, up))
        d = _as_rows(dy)
        d = d if d is not None else dy.contiguous().view(rows[0].shape)
        dgate, dup = _glu_rows_bwd(d, *rows, act, into_inputs=into_inputs)
        return dgate.view(gate.shape), dup.view(gate.shape)
    d, g, u = _flat(dy), _flat(gate), _flat(up)
    if into_inputs and g.data_ptr() == gate.data_ptr() and u.data_ptr() == up.data_ptr():
        dgate, dup = g, u
        # Anything that still held on to gate or up now fails autograd's version check loudly.
        torch.autograd.graph.increment_version((gate, up))
    else:
        dgate, dup = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        _glu_bwd_kernel[(triton.cdiv(n, BLOCK),)](d, g, u, dgate, dup, n, BLOCK=BLOCK, ACT=act,
                                                  num_warps=NUM_WARPS)
    return dgate.view(gate.shape), dup.view(gate.shape)


@triton.jit
def _glu_rows_fwd_kernel(gate_ptr, up_ptr, y_ptr, stride_g, stride_u, width, BLOCK: tl.constexpr,
                         ACT: tl.constexpr):
    # One row of `width` columns per program row, each operand at its own row stride (y contiguous).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    b_g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * width + cols, _glu_value(b_g, b_u, y_ptr.dtype.element_ty, ACT), mask=mask)


@triton.jit
def _glu_rows_bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, stride_dy, stride_g, stride_u,
                         stride_dg, stride_du, width, BLOCK: tl.constexpr, ACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    b_dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    b_g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    b_dgate, b_dup = _glu_grads(b_dy, b_g, b_u, dgate_ptr.dtype.element_ty, ACT)
    tl.store(dup_ptr + row * stride_du + cols, b_dup, mask=mask)
    tl.store(dgate_ptr + row * stride_dg + cols, b_dgate, mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """t as [rows, last dimension] with its own row stride and a unit column stride, without a copy
    (a column slice of a wider buffer: gate and up side by side in a joined float8 GEMM's output,
    `ligertune.models.float8.Float8Siblings`); None where its layout is not such rows."""
    if t.dim() < 2 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _row_grid(rows: torch.Tensor) -> tuple[int, int]:
    return rows.shape[0], triton.cdiv(rows.shape[1], BLOCK)


def _glu_rows_fwd(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel():
        _glu_rows_fwd_kernel[_row_grid(gate)](gate, up, y, gate.stride(0), up.stride(0), gate.shape[1],
                                              BLOCK=BLOCK, ACT=act, num_warps=NUM_WARPS)
    return y


def _glu_rows_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int, *,
                  into_inputs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if into_inputs:
        dgate, dup = gate, up
    else:
        dgate, dup = (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
    if gate.numel():
        _glu_rows_bwd_kernel[_row_grid(gate)](dy, gate, up, dgate, dup, dy.stride(0), gate.stride(0),
                                              up.stride(0), dgate.stride(0), dup.stride(0), gate.shape[1],
                                              BLOCK=BLOCK, ACT=act, num_warps=NUM_WARPS)
    return dgate, dup


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, reuse_inputs):
        ctx.save_for_backward(gate, up)
        ctx.activation, ctx.reuse_inputs = activation, reuse_inputs
        return glu_fwd(gate, up, activation)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return *glu_bwd(dy, gate, up, ctx.activation, into_inputs=ctx.reuse_inputs), None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, reuse_inputs: bool = False) -> torch.Tensor:
    """silu(gate) * up for tensors of one shape and dtype: the semantics of `reference.swiglu`.
    Differentiable w.r.t. both; see `ligertune.kernels.swiglu` for `reuse_inputs`."""
    check_glu_args(gate, up)
    return _GLU.apply(gate, up, "silu", reuse_inputs)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, reuse_inputs: bool = False) -> torch.Tensor:
    """gelu_tanh(gate) * up for tensors of one shape and dtype: the semantics of `reference.geglu`.
    Differentiable w.r.t. both; see `ligertune.kernels.swiglu` for `reuse_inputs`."""
    check_glu_args(gate, up)
    return _GLU.apply(gate, up, "gelu_tanh", reuse_inputs)
