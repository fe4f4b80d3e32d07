"""The SwiGLU gate in Triton, forward and backward (Shazeer 2020, "GLU Variants Improve
Transformer", eq. 6).

With s = sigmoid(g) = 1 / (1 + exp(-g)) and a = silu(g) = g / (1 + exp(-g)), rounded to the dtype:

    forward:   y = a * u
    backward:  du = dy * a
               dg = (dy * u) * s * (1 + g (1 - s))

Computed in float32 with the roundings of the eager `silu(gate) * up` and its autograd (a and
dy * u are rounded to the dtype before the next product), so on a GPU the result matches it up to the
last bit of `exp`. Elementwise over flat memory; nothing but gate and up is saved for the backward,
which can write the two gradients over them (`reuse_inputs`).

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
def _swiglu_fwd_kernel(gate_ptr, up_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    # int64: an MLP activation of 64k tokens x 14336 channels already passes 2^31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dtype = y_ptr.dtype.element_ty
    b_g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_a = (b_g / (1.0 + tl.exp(-b_g))).to(dtype).to(tl.float32)
    tl.store(y_ptr + offs, (b_a * b_u).to(dtype), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_elements, BLOCK: tl.constexpr):
    # int64: an MLP activation of 64k tokens x 14336 channels already passes 2^31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dtype = dgate_ptr.dtype.element_ty
    b_dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b_den = 1.0 + tl.exp(-b_g)
    b_s = 1.0 / b_den
    b_a = (b_g / b_den).to(dtype).to(tl.float32)
    b_da = (b_dy * b_u).to(dtype).to(tl.float32)
    tl.store(dup_ptr + offs, (b_dy * b_a).to(dtype), mask=mask)
    tl.store(dgate_ptr + offs, (b_da * b_s * (1.0 + b_g * (1.0 - b_s))).to(dtype), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, contiguous, shaped as gate."""
    g, u = _flat(gate), _flat(up)
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](g, u, y, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return y.view(gate.shape)


def swiglu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, into_inputs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), contiguous, shaped as gate; written over gate and up when `into_inputs`
    (each element is read before it is written, so the result is the same)."""
    d, g, u = _flat(dy), _flat(gate), _flat(up)
    if into_inputs and g.data_ptr() == gate.data_ptr() and u.data_ptr() == up.data_ptr():
        dgate, dup = g, u
        # Anything that still held on to gate or up now fails autograd's version check loudly.
        torch.autograd.graph.increment_version((gate, up))
    else:
        dgate, dup = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](d, g, u, dgate, dup, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dgate.view(gate.shape), dup.view(gate.shape)


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
