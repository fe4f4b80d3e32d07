"""Fused linear divergence on Triton: the row kernel, and the `ChunkDivergence` that runs it.

The chunk loop, the selection of the supervised rows and the autograd Function are in
`chunked_divergence.py`, shared with the pure-torch path, and so are the definitions of D_t, CE_t,
l_t and the gradients with respect to the student's logits:

    d loss / d r_v = w_t ((1 - alpha) d D / d z_v + alpha (softmax(z)_v - [v == y])) (1 - (z_v / c)^2)

    forward_kl:  d D / d z_v = (Q_v - P_v) / tau
    reverse_kl:  d D / d z_v = Q_v (log Q_v - log P_v - KL(Q || P)) / tau
    jsd:         d D / d z_v = (1 - beta) Q_v (log Q_v - log M_v - KL(Q || M)) / tau

(the last factor only with a softcap c; times 1 / n_tokens for "mean"). This file is what the
Triton path does with one chunk: the student's and the teacher's raw logits, two [rows, V] buffers
in their input dtypes computed by cuBLAS. One Triton program per row streams both rows in BLOCK_V
blocks:

    pass 1  the running max of z_s and z_t, the running sums of exp(z - max) and exp((z - max) / tau)
            for each (online log-sum-exp, Milakov & Gimelshein 2018), and the first argmax of each;
            for reverse_kl the running sum of exp((z_s - max) / tau) (z_s - z_t), which gives
            KL(Q || P) once the row's sums are known
    pass 2  jsd only: the row sums KL(P || M) and KL(Q || M), which log M (not a running sum) needs
            the whole row's sums for; and forward_kl's KL(P || Q) when no gradient is asked for
    pass 3  d loss / d r written over the student's row, in place (forward_kl sums its D_t here: its
            gradient needs no row sum)

Forward and reverse KL read each row twice; JSD three times. All of it in float32 registers: no
float32 [rows, V] temporary is allocated, so the two logits buffers are the chunk's whole working
set.

The kernel moves its bytes near memory speed only if it spends few instructions an element, so:

- logarithms and exponentials are base 2 (log2 Q = (z - m) log2(e) / tau - log2 of the normalizer:
  a subtraction and a fused multiply-add from the logit; on a GPU `exp2` and the approximate `log2`
  are single hardware instructions), and the row sums in bits are turned to nats once, at the end;
- a running sum is a vector of one lane a column, summed once at the row's end; only the max is
  reduced a block, and the first argmax is looked for in a block only when its max is a new one;
- a column past V or a logit of -inf has log P = -inf and P = 0; clamped log-probabilities (at
  -1e30) keep its terms 0 log 0 = 0 with no mask or comparison in the sums.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ligertune.kernels.chunked_divergence import ChunkDivergence, chunked_linear_divergence
from ligertune.kernels.cross_entropy import _tanh
from ligertune.kernels.types import DIVERGENCES, DivergenceOptions, DivergenceOutput

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The kernel's DIVERGENCE codes, in the order of `types.DIVERGENCES`.
FORWARD_KL: tl.constexpr = tl.constexpr(0)
REVERSE_KL: tl.constexpr = tl.constexpr(1)
JSD: tl.constexpr = tl.constexpr(2)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
LOG_FLOOR: tl.constexpr = tl.constexpr(-1e30)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2 x: the hardware's approximate log2 on a GPU, one instruction (`tl.log` compiles to a longer
    sequence there: docs/PERF.md, 2026-11-29); `tl.log2` where the interpreter runs the kernel."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _logits(s_row, t_row, cols, mask, softcap, teacher_softcap, HAS_SOFTCAP: tl.constexpr,
            HAS_TEACHER_SOFTCAP: tl.constexpr):
    """The block of a row's student and teacher logits at `cols`, capped, -inf past V; and tanh(z / c)
    of the student's cap (the cap's gradient needs it; 0 without a cap)."""
    b_zs = tl.load(s_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    b_zt = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    b_ts = tl.zeros_like(b_zs)
    # The cap maps -inf to -c: columns past V back to -inf.
    if HAS_SOFTCAP:
        b_ts = _tanh(b_zs * (1.0 / softcap))
        b_zs = tl.where(mask, softcap * b_ts, float("-inf"))
    if HAS_TEACHER_SOFTCAP:
        b_zt = tl.where(mask, teacher_softcap * _tanh(b_zt * (1.0 / teacher_softcap)), float("-inf"))
    return b_zs, b_ts, b_zt


@triton.jit
def _log2_probs(b_z, m, log_norm, k_tau):
    """log2 of the softmax at the temperature, (z - m) k_tau - log_norm with pass 1's max and
    log2-normalizer, clamped at LOG_FLOOR (a logit of -inf: 0 log 0 = 0 in the sums)."""
    return tl.maximum((b_z - m) * k_tau - log_norm, LOG_FLOOR)


@triton.jit
def _log2_m(log_p, log_q, log2_beta, log2_one_minus_beta, FAST: tl.constexpr):
    """log2 M, M = beta P + (1 - beta) Q, as the log-sum-exp of log2 beta + log2 P and
    log2(1 - beta) + log2 Q: M itself may underflow, and where P = Q this gives back log2 Q (to the
    last bit at beta 0.5), so that the divergence of a teacher from itself is 0."""
    a = log_p + log2_beta
    b = log_q + log2_one_minus_beta
    return tl.maximum(a, b) + _log2(1.0 + tl.exp2(-tl.abs(a - b)), FAST)


@triton.jit
def _fused_linear_divergence_fwd_kernel(
    student_ptr,  # [rows, V] the student's raw logits; overwritten with d loss / d logits if COMPUTE_GRAD
    stride_student,
    teacher_ptr,  # [rows, V] the teacher's raw logits, read only
    stride_teacher,
    targets_ptr,  # [rows] class of each row (all rows here are supervised)
    weights_ptr,  # [rows] float32 row weights w_t (read if HAS_WEIGHTS)
    values_ptr,  # [rows, 4] float32 out, contiguous: w_t times l_t, D_t, CE_t, CE^teacher_t
    correct_ptr,  # [rows, 2] int32 out, contiguous: the student's, the teacher's first argmax == target
    V,
    grad_scale,
    inv_temperature,
    beta,
    log2_beta,
    log2_one_minus_beta,
    ce_weight,
    softcap,
    teacher_softcap,
    DIVERGENCE: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEACHER_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    FAST_LOG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # int64 before the stride: rows * V passes 2^31 for a chunk of 16k rows of a 150k vocabulary.
    row = tl.program_id(0).to(tl.int64)
    s_row = student_ptr + row * stride_student
    t_row = teacher_ptr + row * stride_teacher
    y = tl.load(targets_ptr + row).to(tl.int32)
    z_s_y = tl.load(s_row + y).to(tl.float32)
    z_t_y = tl.load(t_row + y).to(tl.float32)
    if HAS_SOFTCAP:
        z_s_y = softcap * _tanh(z_s_y * (1.0 / softcap))
    if HAS_TEACHER_SOFTCAP:
        z_t_y = teacher_softcap * _tanh(z_t_y * (1.0 / teacher_softcap))
    # log2(e) / tau: log2 of an unnormalized probability at the temperature is (z - m) k_tau.
    k_tau = inv_temperature * LOG2E

    # Pass 1: per row, max, sums of exponentials at temperatures 1 and tau, first argmax; for
    # reverse_kl also sum_v exp((z_s - m_s) / tau) (z_s - z_t), from which KL(Q || P) follows.
    m_s = float("-inf")
    m_t = float("-inf")
    argmax_s = 0
    argmax_t = 0
    acc_s = tl.zeros([BLOCK_V], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    acc_tau_s = tl.zeros([BLOCK_V], dtype=tl.float32)
    acc_tau_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    acc_gap = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        b_zs, b_ts, b_zt = _logits(s_row, t_row, cols, mask, softcap, teacher_softcap, HAS_SOFTCAP,
                                   HAS_TEACHER_SOFTCAP)
        b_max_s = tl.max(b_zs, axis=0)
        b_max_t = tl.max(b_zt, axis=0)
        # Blocks come in column order and only a strictly larger max moves the argmax: ties keep the
        # lowest column, as torch.argmax does. A new max is rare after the first blocks.
        if b_max_s > m_s:
            argmax_s = tl.min(tl.where(b_zs == b_max_s, cols, V), axis=0)
            acc_s *= tl.exp2((m_s - b_max_s) * LOG2E)
            if HAS_TEMPERATURE:
                acc_tau_s *= tl.exp2((m_s - b_max_s) * k_tau)
            if DIVERGENCE == REVERSE_KL:
                acc_gap *= tl.exp2((m_s - b_max_s) * k_tau)
            m_s = b_max_s
        if b_max_t > m_t:
            argmax_t = tl.min(tl.where(b_zt == b_max_t, cols, V), axis=0)
            acc_t *= tl.exp2((m_t - b_max_t) * LOG2E)
            if HAS_TEMPERATURE:
                acc_tau_t *= tl.exp2((m_t - b_max_t) * k_tau)
            m_t = b_max_t
        b_es = tl.exp2((b_zs - m_s) * LOG2E)
        acc_s += b_es
        acc_t += tl.exp2((b_zt - m_t) * LOG2E)
        if HAS_TEMPERATURE:
            b_es = tl.exp2((b_zs - m_s) * k_tau)
            acc_tau_s += b_es
            acc_tau_t += tl.exp2((b_zt - m_t) * k_tau)
        if DIVERGENCE == REVERSE_KL:
            acc_gap += tl.where(mask, b_es * (b_zs - b_zt), 0.0)
    sum_s = tl.sum(acc_s, axis=0)
    sum_t = tl.sum(acc_t, axis=0)
    sum_tau_s = sum_s
    sum_tau_t = sum_t
    if HAS_TEMPERATURE:
        sum_tau_s = tl.sum(acc_tau_s, axis=0)
        sum_tau_t = tl.sum(acc_tau_t, axis=0)
    lse_s = m_s + _log2(sum_s, FAST_LOG) * LN2
    ce = lse_s - z_s_y
    teacher_ce = m_t + _log2(sum_t, FAST_LOG) * LN2 - z_t_y
    # log2 Q_v = (z_v - m_s) k_tau - log_norm_s: the form of the sums above, so that Q sums to 1 (and
    # exact where it matters most, at the max, whatever the size of m k_tau).
    log_norm_s = _log2(sum_tau_s, FAST_LOG)
    log_norm_t = _log2(sum_tau_t, FAST_LOG)

    # KL(Q || P) = sum_v Q_v (log Q_v - log P_v), log Q_v - log P_v = (z_s - z_t)_v / tau + a
    # constant of the row, and sum_v Q_v = 1. In bits, as every row sum below until the end.
    div = 0.0
    if DIVERGENCE == REVERSE_KL:
        div = (tl.sum(acc_gap, axis=0) / sum_tau_s - (m_s - m_t)) * k_tau - log_norm_s + log_norm_t

    # Pass 2: the divergence's row sums where pass 1 could not form them (jsd: KL(P || M) and
    # KL(Q || M); forward_kl without a gradient, which otherwise sums it in pass 3).
    kl_qm = 0.0
    if DIVERGENCE == JSD or (DIVERGENCE == FORWARD_KL and not COMPUTE_GRAD):
        acc_pm = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_qm = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            b_zs, b_ts, b_zt = _logits(s_row, t_row, cols, cols < V, softcap, teacher_softcap,
                                       HAS_SOFTCAP, HAS_TEACHER_SOFTCAP)
            b_log_q = _log2_probs(b_zs, m_s, log_norm_s, k_tau)
            b_log_p = _log2_probs(b_zt, m_t, log_norm_t, k_tau)
            b_p = tl.exp2(b_log_p)
            if DIVERGENCE == FORWARD_KL:
                acc_pm += b_p * (b_log_p - b_log_q)
            else:
                b_q = tl.exp2(b_log_q)
                b_log_m = _log2_m(b_log_p, b_log_q, log2_beta, log2_one_minus_beta, FAST_LOG)
                acc_pm += b_p * (b_log_p - b_log_m)
                acc_qm += b_q * (b_log_q - b_log_m)
        div = tl.sum(acc_pm, axis=0)
        if DIVERGENCE == JSD:
            kl_qm = tl.sum(acc_qm, axis=0)
            div = beta * div + (1.0 - beta) * kl_qm

    w = 1.0
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + row)

    if COMPUTE_GRAD:
        # Pass 3: d (grad_scale w_t l_t) / d r_v, written over the student's row it was computed from.
        # The log-probability gradients are in bits: ln 2 turns them to nats.
        coef = grad_scale * w
        coef_div = coef * (1.0 - ce_weight) * inv_temperature
        coef_ce = coef * ce_weight
        acc_div = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            b_zs, b_ts, b_zt = _logits(s_row, t_row, cols, mask, softcap, teacher_softcap,
                                       HAS_SOFTCAP, HAS_TEACHER_SOFTCAP)
            b_log_q = _log2_probs(b_zs, m_s, log_norm_s, k_tau)
            b_log_p = _log2_probs(b_zt, m_t, log_norm_t, k_tau)
            b_q = tl.exp2(b_log_q)
            if DIVERGENCE == FORWARD_KL:
                b_p = tl.exp2(b_log_p)
                acc_div += b_p * (b_log_p - b_log_q)
                b_g = coef_div * (b_q - b_p)
            elif DIVERGENCE == REVERSE_KL:
                b_g = (coef_div * LN2) * b_q * (b_log_q - b_log_p - div)
            else:
                b_log_m = _log2_m(b_log_p, b_log_q, log2_beta, log2_one_minus_beta, FAST_LOG)
                b_g = (coef_div * (1.0 - beta) * LN2) * b_q * (b_log_q - b_log_m - kl_qm)
            if HAS_CE:
                # At temperature 1, Q is softmax(z) itself: no second exponential.
                b_soft = b_q
                if HAS_TEMPERATURE:
                    b_soft = tl.exp2((b_zs - lse_s) * LOG2E)
                b_g += coef_ce * tl.where(cols == y, b_soft - 1.0, b_soft)
            if HAS_SOFTCAP:
                b_g *= 1.0 - b_ts * b_ts
            tl.store(s_row + cols, b_g.to(student_ptr.dtype.element_ty), mask=mask)
        if DIVERGENCE == FORWARD_KL:
            div = tl.sum(acc_div, axis=0)

    div = div * LN2
    loss = (1.0 - ce_weight) * div + ce_weight * ce
    tl.store(values_ptr + row * 4, loss * w)
    tl.store(values_ptr + row * 4 + 1, div * w)
    tl.store(values_ptr + row * 4 + 2, ce * w)
    tl.store(values_ptr + row * 4 + 3, teacher_ce * w)
    tl.store(correct_ptr + row * 2, (argmax_s == y).to(tl.int32))
    tl.store(correct_ptr + row * 2 + 1, (argmax_t == y).to(tl.int32))


def _row_kernel_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row kernel: 2048 columns over 4 warps.

    A quarter of the cross-entropy kernel's block (8192 columns over 8 warps, timed in
    `cross_entropy.py`), for the values a block keeps live here: two rows, their log-probabilities
    and the running sums. On an H100 (docs/PERF.md, 2026-11-28) 2048 over 4 warps was the fastest of
    eight launches in five of six cases for the kernel of then. On an H200 (2026-11-29) an earlier
    form of this kernel ran within 10% of the best of five launches at 2048 over 4, the best varying
    by vocabulary and divergence (1024 over 4, 2048 or 4096 over 8); one program a row beat fewer
    programs taking rows in turn.
    """
    block_v = min(triton.next_power_of_2(vocab), 2048)
    return block_v, 4


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
    """The Triton `ChunkDivergence.compute`: the row kernel over one chunk (see `ChunkDivergence`)."""
    n_rows, vocab = student.shape
    block_v, num_warps = _row_kernel_config(vocab)
    # Floats, whatever the caller wrote: Triton would specialize an integer 1 into a constant.
    beta, ce_weight = float(options.beta), float(options.ce_weight)
    softcap = 1.0 if options.softcap is None else float(options.softcap)
    teacher_softcap = 1.0 if options.teacher_softcap is None else float(options.teacher_softcap)
    _fused_linear_divergence_fwd_kernel[(n_rows,)](
        student,
        student.stride(0),
        teacher,
        teacher.stride(0),
        targets,
        values if row_weights is None else row_weights,  # never read without HAS_WEIGHTS
        values,
        correct,
        vocab,
        float(grad_scale),
        1.0 / float(options.temperature),
        beta,
        math.log2(beta),
        math.log1p(-beta) / math.log(2.0),
        ce_weight,
        softcap,
        teacher_softcap,
        DIVERGENCE=DIVERGENCES.index(options.divergence),
        HAS_WEIGHTS=row_weights is not None,
        HAS_TEMPERATURE=options.temperature != 1.0,
        HAS_CE=ce_weight > 0.0,
        HAS_SOFTCAP=options.softcap is not None,
        HAS_TEACHER_SOFTCAP=options.teacher_softcap is not None,
        COMPUTE_GRAD=compute_grad,
        FAST_LOG=student.is_cuda,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )


TRITON_CHUNK_DIVERGENCE = ChunkDivergence(
    name="Triton", compute=divergence_chunk, float32_temporaries=0, dtypes=_SUPPORTED_DTYPES
)


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
    """The student's divergence from the teacher (and its cross-entropy), on Triton.

    Semantics: `chunked_divergence.chunked_linear_divergence`. Extra device memory beyond the inputs
    and gradients is two [rows, V] logits buffers within `options.chunk_bytes` (default 1 GiB), plus
    [rows, H] and [rows, Ht] gathers of the supervised rows when some rows are ignored.
    """
    return chunked_linear_divergence(
        TRITON_CHUNK_DIVERGENCE, hidden, weight, teacher_hidden, teacher_weight, targets,
        bias=bias, teacher_bias=teacher_bias, token_weights=token_weights, options=options,
    )
