"""Pure-torch twins of the Triton kernels: both the test oracle and the CPU path.

Each function here has exactly the semantics of its Triton counterpart in `ligertune.kernels`, in
plain PyTorch, bounded in memory where the kernel is, and fast enough on a CPU to train small models.
`ligertune.kernels` dispatches here off CUDA, and the tests compare the Triton kernels with these
functions.

The fused linear cross-entropy shares its chunk loop, row selection and autograd Function with the
Triton path (`chunked_loss.py`); what is here is the per-chunk part in plain torch: the per-row
formula `cross_entropy_rows` (which the unfused loss head also uses on whole logits) and its
gradient. The tests hold both paths to an unchunked float64 definition, and the formula to
`torch.nn.functional.cross_entropy`. The fused linear divergence is built the same way on
`chunked_divergence.py`: what is here is `divergence_chunk`, one chunk's rows and gradient.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ligertune.kernels.chunked_divergence import ChunkDivergence, chunked_linear_divergence
from ligertune.kernels.chunked_loss import ChunkLoss, chunked_linear_cross_entropy
from ligertune.kernels.types import (
    AMAX_FLOOR, FLOAT8, FLOAT8_MAX, BlockScales, DivergenceOptions, DivergenceOutput, LossOptions, LossOutput,
)

# ---------------------------------------------------------------------------------------------
# Fused linear cross-entropy
# ---------------------------------------------------------------------------------------------


def cross_entropy_rows(
    z: torch.Tensor, targets: torch.Tensor, options: LossOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss l_t of each row of float32 logits z [rows, V] against its target [rows] (int64).

    With z capped to c tanh(z / c) when `options.softcap` = c is set, and lse = logsumexp(z):

        l_t = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v) + zw lse^2

    (eps = `options.label_smoothing`: the smoothed term is the cross-entropy against the uniform
    distribution, as in `torch.nn.functional.cross_entropy`; zw = `options.z_loss_weight` weighs the
    z-loss of PaLM, Chowdhery et al. 2022, section 5). Every row counts: ignore_index and the
    reduction are the caller's. Returns l_t, its zw lse^2 part, lse, and the (capped) z. Out of
    place, so autograd can differentiate it: `causal_lm_loss_from_logits` does, on whole logits.
    """
    eps, softcap = options.label_smoothing, options.softcap
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=1)
    loss = lse - (1.0 - eps) * z.gather(1, targets[:, None]).squeeze(1)
    if eps:
        loss = loss - eps * z.mean(dim=1)
    z_part = options.z_loss_weight * lse.square()
    return loss + z_part, z_part, lse, z


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
    """The torch `ChunkLoss.compute`: `cross_entropy_rows` over one chunk, and its gradient written
    over `logits` (see `ChunkLoss`)."""
    eps, zw, softcap = options.label_smoothing, options.z_loss_weight, options.softcap
    y = targets.long()
    row_loss, z_part, lse, z = cross_entropy_rows(logits.float(), y, options)
    w = torch.ones_like(lse) if row_weights is None else row_weights
    loss.copy_(row_loss * w)
    z_loss.copy_(z_part * w)
    correct.copy_(z.argmax(dim=1) == y)
    if not compute_grad:
        return

    # d l_t / d z_v = (1 + 2 zw lse) softmax_v - (1 - eps) [v == y] - eps / V, times w_t and the scale.
    coef = w * grad_scale
    g = (z - lse[:, None]).exp_().mul_((coef * (1.0 + 2.0 * zw * lse))[:, None])
    g.scatter_add_(1, y[:, None], (-(1.0 - eps) * coef)[:, None])
    if eps:
        g.sub_((coef * (eps / z.shape[1]))[:, None])
    if softcap is not None:
        # z = c tanh(raw / c), so dz/draw = 1 - tanh^2 = 1 - (z / c)^2 (z is the capped copy here).
        g.mul_(z.div_(softcap).square_().neg_().add_(1.0))
    logits.copy_(g)


# Beside the logits, at most three float32 [rows, V] buffers: z, tanh(z / c) and c tanh(z / c) while
# capping, then the capped z and the gradient.
TORCH_CHUNK_LOSS = ChunkLoss(name="reference", compute=cross_entropy_chunk, float32_temporaries=3)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    options: LossOptions = LossOptions(),
) -> LossOutput:
    """Cross-entropy of `hidden [N, H] @ weight [V, H].T + bias` against `targets [N]`, in torch.

    The chunk loop of `chunked_loss.chunked_linear_cross_entropy` (semantics there) with
    `cross_entropy_chunk` on each chunk.
    """
    return chunked_linear_cross_entropy(
        TORCH_CHUNK_LOSS, hidden, weight, targets, bias=bias, token_weights=token_weights, options=options
    )


# ---------------------------------------------------------------------------------------------
# Fused linear divergence (knowledge distillation)
# ---------------------------------------------------------------------------------------------


def _capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _sum_weighted_log_ratio(prob: torch.Tensor, log_prob: torch.Tensor, log_other: torch.Tensor
                            ) -> torch.Tensor:
    """sum_v prob_v (log_prob_v - log_other_v) per row, a term with prob_v = 0 counted 0 (0 log 0 = 0,
    and no 0 * inf where a logit is -inf); one [rows, V] temporary."""
    return (log_prob - log_other).mul_(prob).masked_fill_(prob == 0, 0.0).sum(dim=1)


def divergence_and_grad(
    log_q: torch.Tensor, log_p: torch.Tensor, options: DivergenceOptions, *, compute_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """D_t of each row of the student's log Q and the teacher's log P [rows, V] (float32), and, with
    `compute_grad`, tau d D_t / d z_s (the divergence's gradient before its 1 / tau); the formulas
    are in `chunked_divergence`. At most four [rows, V] temporaries at once (jsd)."""
    q = log_q.exp()
    if options.divergence == "forward_kl":
        p = log_p.exp()
        d = _sum_weighted_log_ratio(p, log_p, log_q)
        return d, (q.sub_(p) if compute_grad else None)
    if options.divergence == "reverse_kl":
        d = _sum_weighted_log_ratio(q, log_q, log_p)
        if not compute_grad:
            return d, None
        g = (log_q - log_p).sub_(d[:, None]).mul_(q).masked_fill_(q == 0, 0.0)
        return d, g
    beta = options.beta
    # log M = logsumexp(log beta + log P, log(1 - beta) + log Q): no sum of probabilities that may underflow.
    log_m = log_p + math.log(beta)
    torch.logaddexp(log_m, log_q + math.log1p(-beta), out=log_m)
    kl_pm = _sum_weighted_log_ratio(log_p.exp(), log_p, log_m)
    kl_qm = _sum_weighted_log_ratio(q, log_q, log_m)
    g = None
    if compute_grad:
        g = (log_q - log_m).sub_(kl_qm[:, None]).mul_(q).mul_(1.0 - beta).masked_fill_(q == 0, 0.0)
    return beta * kl_pm + (1.0 - beta) * kl_qm, g


def divergence_chunk(
    student: torch.Tensor,
    teacher: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None,
    values: torch.Tensor,
    correct: torch.Tensor,
    *,
    options: DivergenceOptions,
    grad_scale: float,
    compute_grad: bool,
) -> None:
    """The torch `ChunkDivergence.compute`: each row's terms in float32 and d loss / d r written over
    `student` (see `ChunkDivergence`; the formulas are in `chunked_divergence`)."""
    y = targets.long()[:, None]
    alpha, inv_tau = options.ce_weight, 1.0 / options.temperature
    z_s = _capped(student.float(), options.softcap)
    z_t = _capped(teacher.float(), options.teacher_softcap)
    lse_s = z_s.logsumexp(dim=1)
    ce = lse_s - z_s.gather(1, y)[:, 0]
    teacher_ce = z_t.logsumexp(dim=1) - z_t.gather(1, y)[:, 0]
    correct[:, 0] = z_s.argmax(dim=1) == y[:, 0]
    correct[:, 1] = z_t.argmax(dim=1) == y[:, 0]
    log_p = torch.log_softmax(z_t * inv_tau, dim=1)
    del z_t
    log_q = torch.log_softmax(z_s * inv_tau, dim=1)
    d, g = divergence_and_grad(log_q, log_p, options, compute_grad=compute_grad)
    del log_p, log_q
    w = torch.ones_like(d) if row_weights is None else row_weights
    values[:, 0] = ((1.0 - alpha) * d + alpha * ce) * w
    values[:, 1] = d * w
    values[:, 2] = ce * w
    values[:, 3] = teacher_ce * w
    if not compute_grad:
        return

    coef = w * grad_scale
    g.mul_(((1.0 - alpha) * inv_tau * coef)[:, None])
    if alpha:
        # alpha (softmax(z_s) - onehot(y)), the cross-entropy's share at temperature 1.
        g.add_((z_s - lse_s[:, None]).exp_().mul_((alpha * coef)[:, None]))
        g.scatter_add_(1, y, -(alpha * coef)[:, None])
    if options.softcap is not None:
        # z = c tanh(r / c), so dz/dr = 1 - tanh^2 = 1 - (z / c)^2 (z_s is the capped copy here).
        g.mul_(z_s.div_(options.softcap).square_().neg_().add_(1.0))
    student.copy_(g)


# Beside the two logits buffers, at most seven float32 [rows, V] buffers at once (jsd with a
# gradient): z_s, log P, log Q, then Q, log M and two more inside `divergence_and_grad`.
TORCH_CHUNK_DIVERGENCE = ChunkDivergence(name="reference", compute=divergence_chunk, float32_temporaries=7)


def fused_linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    options: DivergenceOptions = DivergenceOptions(),
) -> DivergenceOutput:
    """The student's divergence from the teacher (and its cross-entropy) from their final hidden
    states and output layers, in torch.

    The chunk loop of `chunked_divergence.chunked_linear_divergence` (semantics there) with
    `divergence_chunk` on each chunk.
    """
    return chunked_linear_divergence(
        TORCH_CHUNK_DIVERGENCE, hidden, weight, teacher_hidden, teacher_weight, targets,
        bias=bias, teacher_bias=teacher_bias, token_weights=token_weights, options=options,
    )


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

RMS_NORM_CASTINGS = ("llama", "gemma")


def rms_norm_casting(x: torch.Tensor, weight: torch.Tensor, offset: float, casting: str | None) -> str:
    """Check the arguments of `rms_norm` and return its casting mode.

    `casting=None` picks "gemma" when `offset != 0` (Gemma's `1 + weight`) and "llama" otherwise,
    which is what every model family in `transformers` that uses such an offset does.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) for x of shape {tuple(x.shape)}; got {tuple(weight.shape)}"
        )
    if casting is None:
        return "gemma" if offset != 0.0 else "llama"
    if casting not in RMS_NORM_CASTINGS:
        raise ValueError(f"casting must be one of {RMS_NORM_CASTINGS} (or None); got {casting!r}")
    return casting


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str | None = None
) -> torch.Tensor:
    """Root-mean-square normalization over the last dimension (Zhang & Sennrich 2019, eq. 4).

        n = x / sqrt(mean(x^2) + eps)          (float32, whatever the dtype of x)
        "llama":  y = (offset + w) * n.to(x.dtype)       in promote(x.dtype, w.dtype)
        "gemma":  y = (n * (offset + w.float())).to(x.dtype)

    The two casting modes are the two roundings found in `transformers`: `LlamaRMSNorm` (and the
    families copied from it) rounds the normalized row to the input dtype before the weight multiplies
    it; `GemmaRMSNorm` multiplies in float32 and rounds once. With offset = 0 the "llama" branch is
    literally `weight * n.to(x.dtype)`, so it equals `LlamaRMSNorm` bit for bit. `casting=None` picks
    "gemma" for a nonzero offset, "llama" otherwise.
    """
    mode = rms_norm_casting(x, weight, offset, casting)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "gemma":
        return (normed * (offset + weight.float())).to(x.dtype)
    if offset == 0.0:
        return weight * normed.to(x.dtype)
    return ((offset + weight.float()) * normed.to(x.dtype)).to(torch.promote_types(x.dtype, weight.dtype))


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------


def check_rope_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise `ValueError` for arguments that neither path of `apply_rope` accepts."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, L, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    b, _, seq_len, head_dim = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"q and k must share B, L and D; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype; got {q.dtype} and {k.dtype}")
    if head_dim % 2:
        raise ValueError(f"the head dimension must be even; got {head_dim}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1:] != (seq_len, head_dim):
        raise ValueError(
            f"cos and sin must both be [{b} or 1, {seq_len}, {head_dim}]; "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, RoFormer, eq. 34, in the half-split layout).

        q_embed = q * cos + rotate_half(q) * sin,    k_embed likewise

    q [B, Hq, L, D], k [B, Hk, L, D]; cos and sin [B, L, D] (or [1, L, D], shared by the batch) are
    what a `transformers` rotary embedding module returns for the position ids, already gathered per
    token, so a pack whose positions restart at 0 per conversation needs nothing more. cos and sin are
    cast to q's dtype, which is what that module returns anyway; then this is `apply_rotary_pos_emb`
    of `transformers` to the bit.
    """
    check_rope_args(q, k, cos, sin)
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ---------------------------------------------------------------------------------------------
# SwiGLU and GeGLU
# ---------------------------------------------------------------------------------------------


def check_glu_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise `ValueError` for arguments that neither path of `swiglu` and `geglu` accepts."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            "gate and up must share shape and dtype; "
            f"got {gate.dtype} {tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}"
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, reuse_inputs: bool = False) -> torch.Tensor:
    """The gated unit of SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6).

        y = silu(gate) * up,   silu(g) = g * sigmoid(g)

    elementwise, in the inputs' dtype: the activation is rounded to that dtype before the product,
    as in `act_fn(gate_proj(x)) * up_proj(x)` of the `transformers` MLPs. `reuse_inputs` is a
    memory option of the Triton path only; here autograd allocates the gradients as usual.
    """
    check_glu_args(gate, up)
    return torch.nn.functional.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor, *, reuse_inputs: bool = False) -> torch.Tensor:
    """The gated unit of GeGLU with the tanh approximation of GELU (Shazeer 2020, eq. 5; Gemma's
    MLPs, whose `gelu_pytorch_tanh` is torch's `gelu(approximate="tanh")`).

        y = gelu_tanh(gate) * up,   gelu_tanh(g) = g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) / 2

    elementwise, in the inputs' dtype, the activation rounded to it before the product as in
    `act_fn(gate_proj(x)) * up_proj(x)`; `reuse_inputs` as for `swiglu`.
    """
    check_glu_args(gate, up)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# ---------------------------------------------------------------------------------------------
# Lion optimizer step
# ---------------------------------------------------------------------------------------------

LION_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Parameter dtypes of `lion_step`: its arithmetic is float32, which would round a float64 parameter."""


def check_lion_args(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Raise `ValueError` for arguments that neither path of `lion_step` accepts."""
    if not len(params) == len(grads) == len(moments):
        raise ValueError(
            f"params, grads and moments must be lists of one length; got {len(params)}, {len(grads)}, {len(moments)}"
        )
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0; got {lr}")
    if not (0.0 <= beta1 <= 1.0 and 0.0 <= beta2 <= 1.0):
        raise ValueError(f"beta1 and beta2 must lie in [0, 1]; got {beta1} and {beta2}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0; got {weight_decay}")
    for i, (p, g, m) in enumerate(zip(params, grads, moments)):
        if p.dtype not in LION_PARAM_DTYPES:
            raise ValueError(f"params[{i}] must be float32, bfloat16 or float16; got {p.dtype}")
        if g.dtype != p.dtype or m.dtype not in (torch.float32, p.dtype):
            raise ValueError(
                f"grads[{i}] must be {p.dtype} and moments[{i}] float32 or {p.dtype}; got {g.dtype} and {m.dtype}"
            )
        if not p.shape == g.shape == m.shape:
            raise ValueError(
                f"params[{i}], grads[{i}] and moments[{i}] must share a shape; "
                f"got {tuple(p.shape)}, {tuple(g.shape)}, {tuple(m.shape)}"
            )
        if not p.device == g.device == m.device == params[0].device:
            raise ValueError(
                f"every tensor must live on {params[0].device}; "
                f"params[{i}], grads[{i}], moments[{i}] are on {p.device}, {g.device}, {m.device}"
            )


def lion_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: list[torch.Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
) -> None:
    """One Lion step in place, with decoupled weight decay (Chen et al. 2023, "Symbolic Discovery of
    Optimization Algorithms", Algorithm 2), for each parameter p, its gradient g and momentum m:

        c = beta1 m + (1 - beta1) g
        p <- p - lr (sign(c) + weight_decay p)          sign(0) = 0, as torch.sign
        m <- beta2 m + (1 - beta2) g

    except that sign(c) is NaN where c is not finite (torch.sign(NaN) is 0, which would freeze an
    element that saw a NaN gradient, its momentum NaN for good, without a trace; this way p turns NaN
    and the loss shows it). The arithmetic is float32 whatever the storage (parameters and gradients
    float32, bfloat16 or float16, one dtype per pair; momentum float32 or the parameter's dtype),
    rounded once into each stored tensor. The `torch._foreach_*` ops take all tensors of a call at
    once, so this is also a reasonable CPU path; low-precision tensors go through float32 copies
    (transient memory of that size).
    """
    check_lion_args(params, grads, moments, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    if not params:
        return
    with torch.no_grad():
        # `.float()` is the tensor itself when it is float32 already: no copy in the common case.
        p32, g32, m32 = ([t.float() for t in ts] for ts in (params, grads, moments))
        # beta m + (1 - beta) g written as lerp(m, g, 1 - beta), which is what the Triton kernel computes.
        update = torch._foreach_lerp(m32, g32, 1.0 - beta1)
        nan_where_not_finite = torch._foreach_mul(update, 0.0)
        torch._foreach_sign_(update)
        torch._foreach_add_(update, nan_where_not_finite)
        torch._foreach_mul_(p32, 1.0 - lr * weight_decay)
        torch._foreach_add_(p32, update, alpha=-lr)
        torch._foreach_lerp_(m32, g32, 1.0 - beta2)
        for stored, computed in [*zip(params, p32), *zip(moments, m32)]:
            if computed is not stored:
                stored.copy_(computed)


# ---------------------------------------------------------------------------------------------
# Rows to float8
# ---------------------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor | Sequence[torch.Tensor],
                  col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, cols] e4m3, scale [rows] float32) of a 2-D `x` (or of several stacked),
    `float8_rows.quantize_rows`'s formula: q = e4m3(x E / amax), scale = amax / E per row, x first
    times `col_scale` when given."""
    parts = [x] if isinstance(x, torch.Tensor) else list(x)
    if any(p.dim() != 2 for p in parts) or len({p.shape[1] for p in parts}) != 1:
        shapes = ", ".join(str(tuple(p.shape)) for p in parts)
        raise ValueError(f"quantize_rows: expected 2-D tensors of one width, got shapes {shapes}")
    x = torch.cat(parts) if len(parts) > 1 else parts[0]
    xf = x.float() if col_scale is None else x.float() * col_scale.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR)
    q = (xf * (FLOAT8_MAX / amax)).clamp_(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
    return q, (amax / FLOAT8_MAX).squeeze(1)


def quantize_transposed(x: torch.Tensor, dtype: torch.dtype, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [cols, rows padded with zeros to a multiple of `multiple`] in `dtype`, scale: a float32
    scalar) of a 2-D `x`, `float8_rows.quantize_transposed`'s formula: q = fmt(x^T F / amax),
    scale = amax / F, F the format's largest, amax over the whole tensor."""
    largest = torch.finfo(dtype).max
    xf = x.float()
    amax = xf.abs().amax().clamp_min(AMAX_FLOOR)
    rows = x.shape[0]
    q = torch.zeros(x.shape[1], -(-rows // multiple) * multiple, dtype=dtype, device=x.device)
    q[:, :rows] = (xf * (largest / amax)).clamp_(-largest, largest).to(dtype).t()
    return q, amax / largest


def transpose_float8(x: torch.Tensor) -> torch.Tensor:
    """The transpose of a contiguous 2-D float8 `x`, contiguous."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"transpose_float8: expected a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    return x.t().contiguous()


def dequantize_4bit(packed: torch.Tensor, table: torch.Tensor, scales: BlockScales,
                    out: torch.Tensor) -> torch.Tensor:
    """`out` filled with table[code_i] * scale_{i // blocksize}, the codes two a byte of `packed`, the
    high half first (`nf4.dequantize_4bit`'s formula), in float32 and rounded once to out's dtype
    (its shape checked by `kernels.dequantize_4bit`)."""
    packed = packed.reshape(-1).int()
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)
    blocks = torch.arange(codes.numel(), device=codes.device) // scales.blocksize
    if scales.code is None:
        scale = scales.absmax.float()[blocks]
    else:
        scale = scales.code[scales.absmax.long()] * scales.absmax2[torch.arange(
            scales.absmax.numel(), device=codes.device) // scales.nested_blocksize]
        scale = (scale + scales.offset)[blocks]
    out.view(-1).copy_(table[codes.long()] * scale)
    return out
