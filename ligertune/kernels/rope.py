"""Rotary position embedding in Triton, forward and backward (Su et al. 2021, RoFormer, eq. 34, in
the half-split layout of `transformers`).

With x = [x1, x2] split in halves of the head dimension and cos = [c1, c2], sin = [s1, s2]:

    forward:   o1 = x1 c1 - x2 s1          o2 = x2 c2 + x1 s2
    backward:  d1 = g1 c1 + g2 s2          d2 = g2 c2 - g1 s1

The backward is the transposed rotation, i.e. the forward with sin' = [-s2, -s1]; one kernel does
both. Each product is rounded to the tensor dtype before the sum, as the eager expression
`q * cos + rotate_half(q) * sin` (and its autograd) rounds, so in 16-bit dtypes the result agrees
with it to rounding. One program takes a block of tokens (one token for models with many heads): it loads their
cos/sin once and rotates every head of q and of k, which in the [B, L, H, D] memory layout that
`transformers` produces are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ligertune.kernels.reference import check_rope_args

TILE_ELEMS = 2048
"""Elements of one half-tile [tokens, heads, D/2]: a program rotates this many pairs at a time.
Models with many heads get one token per program; small models get several."""


@triton.jit
def _rope_rotate_heads(
    x_ptr,
    o_ptr,
    tok_off,
    tok_mask,
    stride_h,
    b_c1,
    b_c2,
    b_s1,
    b_s2,
    N_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """o = x * [c1, c2] + [-x2, x1] * [s1, s2] for every head of a block of tokens.

    tok_off [BLOCK_T] is each token's offset (head 0, element 0) in x and o; the cos/sin halves are
    [BLOCK_T, BLOCK_HALF] tiles in float32.
    """
    dtype = o_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_HALF)
    # The head count is a compile-time constant (fixed per model): the loop bounds are then static.
    for h0 in range(0, N_HEADS, BLOCK_HEADS):
        heads = h0 + tl.arange(0, BLOCK_HEADS)
        mask = tok_mask[:, None, None] & (heads < N_HEADS)[None, :, None] & (cols < HALF)[None, None, :]
        offs = tok_off[:, None, None] + heads[None, :, None] * stride_h + cols[None, None, :]
        b_x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b_x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
        b_o1 = (b_x1 * b_c1[:, None, :]).to(dtype).to(tl.float32) - (b_x2 * b_s1[:, None, :]).to(dtype).to(tl.float32)
        b_o2 = (b_x2 * b_c2[:, None, :]).to(dtype).to(tl.float32) + (b_x1 * b_s2[:, None, :]).to(dtype).to(tl.float32)
        tl.store(o_ptr + offs, b_o1.to(dtype), mask=mask)
        tl.store(o_ptr + offs + HALF, b_o2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cos_ptr,
    sin_ptr,
    n_tokens,
    seq_len,
    stride_qb,
    stride_qh,
    stride_ql,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_cb,
    stride_cl,
    N_Q_HEADS: tl.constexpr,
    N_K_HEADS: tl.constexpr,
    BACKWARD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # int64 before multiplying by strides: b * stride_b passes 2^31 on large batches.
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tokens < n_tokens
    b = tokens // seq_len
    pos = tokens % seq_len
    dtype = qo_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_HALF)
    mask = tok_mask[:, None] & (cols < HALF)[None, :]
    offs = (b * stride_cb + pos * stride_cl)[:, None] + cols[None, :]
    # cos/sin are rounded to q's dtype first, as the rotary module of `transformers` returns them.
    b_c1 = tl.load(cos_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    b_c2 = tl.load(cos_ptr + offs + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    b_s1 = tl.load(sin_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    b_s2 = tl.load(sin_ptr + offs + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    if BACKWARD:
        b_s1, b_s2 = -b_s2, -b_s1

    q_off = b * stride_qb + pos * stride_ql
    k_off = b * stride_kb + pos * stride_kl
    _rope_rotate_heads(
        q_ptr, qo_ptr, q_off, tok_mask, stride_qh, b_c1, b_c2, b_s1, b_s2, N_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF
    )
    _rope_rotate_heads(
        k_ptr, ko_ptr, k_off, tok_mask, stride_kh, b_c1, b_c2, b_s1, b_s2, N_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF
    )


def _with_output(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, out): x with a unit stride on D, and an empty `out` of exactly x's strides.

    `transformers` hands q/k over as a transposed [B, L, H, D] buffer; keeping that layout (rather
    than copying to [B, H, L, D]) spares a copy here and one in the attention that follows.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    if out.stride() != x.stride():  # an overlapping or gapped layout: empty_like cannot mirror it
        x = x.contiguous()
        out = torch.empty_like(x)
    return x, out


def _launch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    q, q_out = _with_output(q)
    k, k_out = _with_output(k)
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    n_tokens = batch * seq_len
    if n_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = max(1, TILE_ELEMS // block_half)
    block_qh = min(triton.next_power_of_2(max(n_q_heads, 1)), max_heads)
    block_kh = min(triton.next_power_of_2(max(n_k_heads, 1)), max_heads)
    block_t = min(max(1, TILE_ELEMS // (block_qh * block_half)), triton.next_power_of_2(n_tokens))
    num_warps = 4 if block_t * block_qh * block_half <= 1024 else 8
    _rope_kernel[(triton.cdiv(n_tokens, block_t),)](
        q, k, q_out, k_out, cos, sin,
        n_tokens, seq_len,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        # A [1, L, D] cos/sin is shared by the whole batch.
        0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1),
        N_Q_HEADS=n_q_heads, N_K_HEADS=n_k_heads, BACKWARD=backward, HALF=half, BLOCK_T=block_t, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half,
        num_warps=num_warps,
    )
    return q_out, k_out


def rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed), each in the memory layout of its input."""
    return _launch(q, k, cos, sin, backward=False)


def rope_bwd(
    dq_embed: torch.Tensor, dk_embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk): the gradients rotated back, each in the memory layout of the incoming gradient."""
    return _launch(dq_embed, dk_embed, cos, sin, backward=True)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q_embed, k_embed = rope_fwd(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return q_embed, k_embed

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_bwd(dq_embed, dk_embed, cos, sin)
        return dq, dk, None, None


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [B, Hq, L, D] and k [B, Hk, L, D] by cos/sin [B or 1, L, D]: the
    semantics of `reference.apply_rope`. Differentiable w.r.t. q and k (cos and sin get no gradient)."""
    check_rope_args(q, k, cos, sin)
    return _Rope.apply(q, k, cos, sin)
