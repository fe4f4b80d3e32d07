"""Fused linear cross-entropy on Triton: the row kernel, and the `ChunkLoss` that runs it.

The chunk loop, the selection of the supervised rows and the autograd Function are in
`chunked_loss.py`, shared with the pure-torch path; the loss l_t and its reductions are defined
there. This file is what the Triton path does with one chunk of raw logits r (a [rows, V] buffer in
the input dtype, computed by cuBLAS). Its gradient with respect to the logits of row t is

    d l_t / d z_v = (1 + 2 zw lse) softmax(z)_v - (1 - eps) [v == y] - eps / V
    d z_v / d r_v = 1 - (z_v / c)^2                                    (softcap only)

times w_t (and 1 / n_tokens for "mean"). One Triton program per row: pass 1 streams the row in
BLOCK_V blocks for the running max, the sum of exponentials (float32), the first argmax, and the
mean logit; pass 2 writes d loss / d r over the logits, in place, for the two products that follow
(grad_h = dlogits @ W, grad_W += dlogits.T @ h). No float32 [rows, V] temporary is allocated, so the
logits buffer is the chunk's whole working set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ligertune.kernels.chunked_loss import ChunkLoss, chunked_linear_cross_entropy
from ligertune.kernels.types import LossOptions, LossOutput

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _tanh(x):
    # From one exp of -2|x|, which never overflows; tl.math has no tanh on every Triton we support.
    # The fast (non-IEEE, 2 ulp) division keeps a softcapped row kernel near memory speed.
    e = tl.exp(-2.0 * tl.abs(x))
    t = tl.fdiv(1.0 - e, 1.0 + e, ieee_rounding=False)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _fused_linear_cross_entropy_fwd_kernel(
    logits_ptr,  # [rows, V] raw logits of one chunk; overwritten with d loss / d logits if COMPUTE_GRAD
    stride_logits,
    targets_ptr,  # [rows] class of each row (all rows here are supervised)
    weights_ptr,  # [rows] float32 row weights w_t (read if HAS_WEIGHTS)
    loss_ptr,  # [rows] float32 out: w_t l_t
    z_loss_ptr,  # [rows] float32 out: w_t zw lse^2
    correct_ptr,  # [rows] int32 out: first argmax == target
    V,
    grad_scale,
    label_smoothing,
    z_loss_weight,
    softcap,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # int64 before the stride: rows * V passes 2^31 for a chunk of 16k rows of a 150k vocabulary.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits
    y = tl.load(targets_ptr + row).to(tl.int32)

    z_y = tl.load(row_ptr + y).to(tl.float32)
    if HAS_SOFTCAP:
        inv_softcap = 1.0 / softcap
        z_y = softcap * _tanh(z_y * inv_softcap)

    # Pass 1: online log-sum-exp (Milakov & Gimelshein 2018) in float32, first argmax, sum of z.
    m = float("-inf")
    s = 0.0
    sum_z = 0.0
    argmax = 0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        b_z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_SOFTCAP:
            b_z = tl.where(mask, softcap * _tanh(b_z * inv_softcap), float("-inf"))
        b_max = tl.max(b_z, axis=0)
        # Blocks come in column order and only a strictly larger max moves the argmax: ties keep
        # the lowest column, as torch.argmax does.
        b_first = tl.min(tl.where(b_z == b_max, cols, V), axis=0)
        argmax = tl.where(b_max > m, b_first, argmax)
        m_new = tl.maximum(m, b_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(b_z - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            sum_z += tl.sum(tl.where(mask, b_z, 0.0), axis=0)
    lse = m + tl.log(s)

    loss = lse - (1.0 - label_smoothing) * z_y
    if HAS_SMOOTHING:
        loss -= label_smoothing * (sum_z / V)
    z_term = 0.0
    if HAS_ZLOSS:
        z_term = z_loss_weight * lse * lse
        loss += z_term
    w = 1.0
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + row)
    tl.store(loss_ptr + row, loss * w)
    tl.store(z_loss_ptr + row, z_term * w)
    tl.store(correct_ptr + row, (argmax == y).to(tl.int32))

    if COMPUTE_GRAD:
        # Pass 2: d (grad_scale w_t l_t) / d r_v, written over the row it was computed from.
        coef = grad_scale * w
        coef_p = coef
        if HAS_ZLOSS:
            coef_p = coef * (1.0 + 2.0 * z_loss_weight * lse)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            b_z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                b_t = _tanh(b_z * inv_softcap)
                b_z = softcap * b_t
            b_g = coef_p * tl.exp(b_z - lse)
            b_g = tl.where(cols == y, b_g - coef * (1.0 - label_smoothing), b_g)
            if HAS_SMOOTHING:
                b_g -= coef * (label_smoothing / V)
            if HAS_SOFTCAP:
                b_g *= 1.0 - b_t * b_t
            tl.store(row_ptr + cols, b_g.to(logits_ptr.dtype.element_ty), mask=mask)


def _row_kernel_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row kernel, one program per row.

    Measured on an H100 over [4096, 128256] bf16 logits: 8192 columns over 8 warps streams the
    three passes (read, read, write) at 2.8 TB/s, about the copy bandwidth; 4096 columns or 16 warps
    were up to 10% slower, and persistent grids of 1-4 programs per SM slower still (too few loads in
    flight for the L2 reuse of pass 2 to pay off).
    """
    block_v = min(triton.next_power_of_2(vocab), 8192)
    num_warps = 8 if block_v >= 4096 else 4
    return block_v, num_warps


def cross_entropy_chunk(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None,
    loss: torch.Tensor,
    z_loss: torch.Tensor,
    correct: torch.Tensor,
    *,
    options: LossOptions,
    grad_scale: float,
    compute_grad: bool,
) -> None:
    """The Triton `ChunkLoss.compute`: the row kernel over one chunk of logits (see `ChunkLoss`)."""
    n_rows, vocab = logits.shape
    block_v, num_warps = _row_kernel_config(vocab)
    # Floats, whatever the caller wrote: Triton would specialize an integer 1 into a constant.
    label_smoothing, z_loss_weight = float(options.label_smoothing), float(options.z_loss_weight)
    softcap = 1.0 if options.softcap is None else float(options.softcap)
    _fused_linear_cross_entropy_fwd_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        targets,
        loss if row_weights is None else row_weights,  # never read without HAS_WEIGHTS
        loss,
        z_loss,
        correct,
        vocab,
        grad_scale,
        label_smoothing,
        z_loss_weight,
        softcap,
        HAS_WEIGHTS=row_weights is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_ZLOSS=z_loss_weight > 0.0,
        HAS_SOFTCAP=options.softcap is not None,
        COMPUTE_GRAD=compute_grad,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )


TRITON_CHUNK_LOSS = ChunkLoss(
    name="Triton", compute=cross_entropy_chunk, float32_temporaries=0, dtypes=_SUPPORTED_DTYPES
)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    options: LossOptions = LossOptions(),
) -> LossOutput:
    """Cross-entropy of `hidden [N, H] @ weight [V, H].T + bias` against `targets [N]`, on Triton.

    Semantics: `chunked_loss.chunked_linear_cross_entropy`. Extra device memory beyond the inputs
    and gradients is one [rows, V] logits buffer of at most `options.chunk_bytes` (default 1 GiB;
    64-128 MiB works at some speed cost, since each extra chunk re-reads and re-writes the [V, H]
    weight gradient), plus a [rows, H] gather of the supervised rows when some rows are ignored.
    """
    return chunked_linear_cross_entropy(
        TRITON_CHUNK_LOSS, hidden, weight, targets, bias=bias, token_weights=token_weights, options=options
    )
