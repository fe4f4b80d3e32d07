"""Fused linear cross-entropy: the loss of `hidden @ weight.T` without holding all the logits.

For a supervised row t (targets[t] != ignore_index), with raw logits r = hidden[t] @ weight.T + bias,
z = c tanh(r / c) when a softcap c is set (else z = r), and lse = logsumexp(z):

    l_t = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v) + zw lse^2

(eps: label smoothing; zw: z-loss weight, PaLM, Chowdhery et al. 2022, section 5). The loss is
sum_t w_t l_t (reduction "sum"), that sum over the number of supervised rows ("mean"), or the
per-row values ("none"). Its gradient with respect to the logits of row t is

    d l_t / d z_v = (1 + 2 zw lse) softmax(z)_v - (1 - eps) [v == y] - eps / V
    d z_v / d r_v = 1 - (z_v / c)^2                                    (softcap only)

times w_t (and 1 / n_tokens for "mean").

The supervised rows are cut into as few chunks as the memory budget allows (`chunk_bytes`, about
1 GiB by default: the only [rows, V] buffer). Per chunk:

    1. logits = h_c @ W.T (+ bias)                   cuBLAS, in the input dtype
    2. one Triton program per row: pass 1 streams the row in BLOCK_V blocks for the running max,
       the sum of exponentials (float32), the first argmax, and the mean logit; pass 2 writes
       d loss / d r over the logits, in place
    3. grad_h_c = dlogits @ W,  grad_W += dlogits.T @ h_c,  grad_b += sum_rows dlogits

For "sum" and "mean" the gradients are computed during the forward (three products in all, not
the four of a recomputing backward) and scaled by the incoming gradient in backward; "none"
needs the incoming gradient of every row, so its backward recomputes steps 1-3. Gradients are
exact: no entry of the softmax is skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ligertune.kernels.reference import (
    FLCE_DEFAULT_CHUNK_BYTES,
    autocast_flce_inputs,
    check_flce_args,
    scatter_rows,
    select_supervised,
)
from ligertune.kernels.types import LossOutput

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


def _chunk_rows(n_rows: int, vocab: int, elem_size: int, chunk_bytes: int) -> int:
    """Rows per chunk: as few chunks as `chunk_bytes` allows, evened out, rounded to whole GEMM tiles."""
    cap = max(1, chunk_bytes // (vocab * elem_size))
    if n_rows <= cap:
        return max(n_rows, 1)
    n_chunks = math.ceil(n_rows / cap)
    rows = math.ceil(n_rows / n_chunks)
    # Multiples of 16 rows keep the products on whole tensor-core tiles, when the budget allows.
    rounded = math.ceil(rows / 16) * 16
    return rounded if rounded <= cap else rows


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


def _fused_linear_cross_entropy_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None,
    *,
    grad_scale: float,
    label_smoothing: float,
    z_loss_weight: float,
    softcap: float | None,
    chunk_bytes: int,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """One chunked pass over the supervised rows (see the module docstring).

    `rows` indexes the supervised rows of `hidden` (None: all of them); `targets` and `row_weights`
    (float32) are already restricted to them. Returns the per-row w_t l_t, w_t zw lse^2 and correct
    flags, then the gradients of `grad_scale * sum_t w_t l_t` for hidden, weight and bias (None
    where `needs_grad` says no). The host never waits on the device inside the loop.
    """
    n = targets.numel()
    vocab = weight.shape[0]
    device = hidden.device
    need_h, need_w, need_b = needs_grad
    compute_grad = need_h or need_w or need_b

    loss_rows = torch.empty(n, dtype=torch.float32, device=device)
    z_rows = torch.empty(n, dtype=torch.float32, device=device)
    correct_rows = torch.empty(n, dtype=torch.int32, device=device)
    grad_h = grad_w = grad_b = None
    if need_h:
        # Ignored rows get no gradient and are never written by the loop.
        grad_h = torch.empty_like(hidden) if rows is None else torch.zeros_like(hidden)
    if need_w:
        # The first chunk writes grad_w outright; only an empty pass leaves it to the zeros.
        grad_w = torch.empty_like(weight) if n > 0 else torch.zeros_like(weight)
    if need_b:
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=device)

    chunk = _chunk_rows(n, vocab, hidden.element_size(), chunk_bytes)
    logits = torch.empty((min(chunk, n), vocab), dtype=hidden.dtype, device=device)
    block_v, num_warps = _row_kernel_config(vocab)
    w_t = weight.t()
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h_c = hidden[start:end] if rows is None else hidden.index_select(0, rows[start:end])
        b_logits = logits[: end - start]
        if bias is None:
            torch.mm(h_c, w_t, out=b_logits)
        else:
            torch.addmm(bias, h_c, w_t, out=b_logits)
        _fused_linear_cross_entropy_fwd_kernel[(end - start,)](
            b_logits,
            b_logits.stride(0),
            targets[start:end],
            loss_rows if row_weights is None else row_weights[start:end],
            loss_rows[start:end],
            z_rows[start:end],
            correct_rows[start:end],
            vocab,
            grad_scale,
            label_smoothing,
            z_loss_weight,
            1.0 if softcap is None else softcap,
            HAS_WEIGHTS=row_weights is not None,
            HAS_SMOOTHING=label_smoothing > 0.0,
            HAS_ZLOSS=z_loss_weight > 0.0,
            HAS_SOFTCAP=softcap is not None,
            COMPUTE_GRAD=compute_grad,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
        if not compute_grad:
            continue
        # b_logits now holds d loss / d logits for the chunk.
        if need_h:
            if rows is None:
                torch.mm(b_logits, weight, out=grad_h[start:end])
            else:
                grad_h.index_copy_(0, rows[start:end], b_logits @ weight)
        if need_w:
            if start == 0:
                torch.mm(b_logits.t(), h_c, out=grad_w)
            else:
                grad_w.addmm_(b_logits.t(), h_c)
        if need_b:
            grad_b += b_logits.sum(dim=0, dtype=torch.float32)

    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return loss_rows, z_rows, correct_rows, grad_h, grad_w, grad_b


def fused_linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    token_weights: torch.Tensor | None,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss_weight: float,
    softcap: float | None,
    reduction: str,
    chunk_bytes: int,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...], dict]:
    """The forward: (loss, z_loss, n_correct, n_tokens), the gradients of `loss` where asked (scalar
    reductions only; "none" leaves them to the backward), and what a "none" backward needs."""
    if hidden.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"the Triton path takes {_SUPPORTED_DTYPES}; got {hidden.dtype}")
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    rows, n_tokens = select_supervised(targets, ignore_index, vocab)
    y = targets.contiguous() if rows is None else targets.index_select(0, rows)
    w = None
    if token_weights is not None:
        w = token_weights.float()
        w = w.contiguous() if rows is None else w.index_select(0, rows)
    scalar = reduction != "none"
    scale = 1.0 / max(n_tokens, 1) if reduction == "mean" else 1.0
    options = dict(
        label_smoothing=label_smoothing, z_loss_weight=z_loss_weight, softcap=softcap, chunk_bytes=chunk_bytes
    )
    loss_rows, z_rows, correct, *grads = _fused_linear_cross_entropy_pass(
        hidden, weight, bias, rows, y, w,
        grad_scale=scale, needs_grad=needs_grad if scalar else (False, False, False), **options,
    )
    if scalar:
        loss, z_loss = loss_rows.sum() * scale, z_rows.sum() * scale
    else:
        loss, z_loss = scatter_rows(loss_rows, rows, n_rows), scatter_rows(z_rows, rows, n_rows)
    n_correct = correct.sum(dtype=torch.int64)
    # A fill, not torch.tensor(): a copy from the host would wait for the whole forward.
    n_tok = torch.full((), n_tokens, dtype=torch.int64, device=hidden.device)
    recompute = dict(rows=rows, targets=y, row_weights=w, options=options)
    return (loss, z_loss, n_correct, n_tok), tuple(grads), recompute


def fused_linear_cross_entropy_bwd(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None,
    *,
    options: dict,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """Backward of reduction="none": recompute each chunk with row weights grad_loss[t] * w_t."""
    g_rows = grad_loss.float() if rows is None else grad_loss.float().index_select(0, rows)
    row_weights = g_rows.contiguous() if row_weights is None else g_rows * row_weights
    return _fused_linear_cross_entropy_pass(
        hidden, weight, bias, rows, targets, row_weights, grad_scale=1.0, needs_grad=needs_grad, **options
    )[3:]


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for `fused_linear_cross_entropy`; differentiable w.r.t. hidden, weight and bias."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        token_weights,
        ignore_index,
        label_smoothing,
        z_loss_weight,
        softcap,
        reduction,
        chunk_bytes,
    ):
        outputs, grads, recompute = fused_linear_cross_entropy_fwd(
            hidden, weight, bias, targets, token_weights,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss_weight=z_loss_weight,
            softcap=softcap, reduction=reduction, chunk_bytes=chunk_bytes,
            needs_grad=tuple(ctx.needs_input_grad[:3]),
        )
        ctx.scalar = reduction != "none"
        if ctx.scalar:
            ctx.grads = grads
        else:
            saved = (recompute["rows"], recompute["targets"], recompute["row_weights"])
            ctx.save_for_backward(hidden, weight, bias, *saved)
            ctx.options = recompute["options"]
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.scalar:
            if ctx.grads is None:
                raise RuntimeError("fused_linear_cross_entropy supports one backward per forward")
            # The gradients were computed in the forward and are scaled here in place, so they are
            # handed out once. Reading grad_loss costs one host sync, far cheaper than a pass over
            # the [V, H] weight gradient when it is 1, as it is for loss.backward().
            grads, ctx.grads = ctx.grads, None
            g = float(grad_loss)
            grads = tuple(t if t is None or g == 1.0 else t.mul_(g) for t in grads)
        else:
            hidden, weight, bias, rows, targets, row_weights = ctx.saved_tensors
            grads = fused_linear_cross_entropy_bwd(
                grad_loss, hidden, weight, bias, rows, targets, row_weights,
                options=ctx.options, needs_grad=tuple(ctx.needs_input_grad[:3]),
            )
        return (*grads, None, None, None, None, None, None, None, None)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    softcap: float | None = None,
    token_weights: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_bytes: int | None = None,
) -> LossOutput:
    """Cross-entropy of `hidden [N, H] @ weight [V, H].T + bias` against `targets [N]`, on Triton.

    Same semantics as `ligertune.kernels.reference.fused_linear_cross_entropy` (formula and options
    there and in the module docstring). Extra device memory beyond the inputs and gradients is one
    [rows, V] logits buffer of at most `chunk_bytes` (default 1 GiB; 64-128 MiB works at some speed
    cost, since each extra chunk re-reads and re-writes the [V, H] weight gradient), plus a
    [rows, H] gather of the supervised rows when some rows are ignored. `n_correct` counts the rows
    whose first (lowest-index) argmax of the logits equals the target. A scalar reduction allows one
    backward per forward.
    """
    hidden, weight, bias = autocast_flce_inputs(hidden, weight, bias)
    check_flce_args(
        hidden, weight, targets, bias=bias, token_weights=token_weights, label_smoothing=label_smoothing,
        z_loss_weight=z_loss_weight, softcap=softcap, reduction=reduction, chunk_bytes=chunk_bytes,
    )
    outputs = FusedLinearCrossEntropyFunction.apply(
        hidden, weight, bias, targets, token_weights, ignore_index, float(label_smoothing),
        float(z_loss_weight), None if softcap is None else float(softcap), reduction,
        chunk_bytes or FLCE_DEFAULT_CHUNK_BYTES,
    )
    return LossOutput(*outputs)
