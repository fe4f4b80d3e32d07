"""Fused linear divergence (knowledge distillation), the part its two paths share: checks, chunks, autograd.

`fused_linear_divergence` has a Triton path (`divergence.py`) and a pure-torch path (`reference.py`)
that differ only in what they do with one chunk of logits; each is a `ChunkDivergence`. The rest is
written once, here, on the helpers of the fused linear cross-entropy (`chunked_loss.py`): the
selection of the supervised rows, the chunk size, autocast, the gradient products and the scaling
of the forward's gradients. The options come as one `DivergenceOptions` (`types.py`).

For a supervised row t (targets[t] != ignore_index), with the student's raw logits
r = hidden[t] @ weight.T + bias, capped z_s = c tanh(r / c) when a softcap c is set (else z_s = r),
the teacher's z_t likewise from its own tensors and cap, and the temperature tau:

    Q = softmax(z_s / tau)      (the student)          P = softmax(z_t / tau)      (the teacher)

    forward_kl:  D_t = KL(P || Q) = sum_v P_v (log P_v - log Q_v)
    reverse_kl:  D_t = KL(Q || P) = sum_v Q_v (log Q_v - log P_v)
    jsd:         D_t = beta KL(P || M) + (1 - beta) KL(Q || M),      M = beta P + (1 - beta) Q

    CE_t = lse(z_s) - z_s[y],   CE^teacher_t = lse(z_t) - z_t[y]     (temperature 1, no smoothing)
    l_t  = (1 - alpha) D_t + alpha CE_t                                (alpha: `ce_weight`)

jsd is the generalised Jensen-Shannon divergence of Agarwal et al. 2024, "On-policy distillation of
language models: learning from self-generated mistakes" (GKD), section 3; beta = 0.5 is the
symmetric one. 0 log 0 = 0: a probability that underflows to 0 adds nothing. log M is
logsumexp(log beta + log P, log(1 - beta) + log Q), never the log of a sum that may underflow.
D_t is not multiplied by tau^2 (Hinton et al. 2015 do, so that the gradient keeps its scale as tau
grows): that factor is the caller's. With w_t = token_weights[t] (default 1), the outputs are

    loss = sum_t w_t l_t,          divergence = sum_t w_t D_t,
    ce   = sum_t w_t CE_t,         teacher_ce = sum_t w_t CE^teacher_t

("sum"), or each over the number of supervised rows ("mean"; 0 when there are none).

Gradients w.r.t. the student's capped logits z = z_s. With a = z / tau, d log Q_u / d a_v =
[u == v] - Q_v, and so, for any f, d (sum_u Q_u f_u) / d a_v = Q_v (f_v - sum_u Q_u f_u) + (sum_u Q_u
d f_u / d a_v):

    forward_kl:  d D / d z_v = (Q_v - P_v) / tau
                 (D = sum P log P - sum_u P_u log Q_u, and d (-sum_u P_u log Q_u) / d a_v = Q_v - P_v)
    reverse_kl:  d D / d z_v = Q_v (log Q_v - log P_v - KL(Q || P)) / tau
                 (f = log Q - log P, whose own term sum_u Q_u ([u == v] - Q_v) = 0)
    jsd:         d D / d z_v = (1 - beta) Q_v (log Q_v - log M_v - KL(Q || M)) / tau
                 (D = beta sum P log P + (1 - beta) sum Q log Q - sum M log M, so
                 d D / d Q_u = (1 - beta) (log Q_u - log M_u); then the softmax's Jacobian)
    CE:          d CE / d z_v = softmax(z)_v - [v == y]
    softcap:     d z_v / d r_v = 1 - (z_v / c)^2

and d loss / d r_v = w_t ((1 - alpha) d D / d z_v + alpha d CE / d z_v) d z_v / d r_v, times
1 / n_tokens for "mean". The reverse KL and jsd gradients need a row sum, KL(Q || P) or KL(Q || M),
before their first element: those rows are read once more than forward KL's.

The supervised rows are cut into as few chunks as `chunk_bytes` allows (about 1 GiB by default, for
the chunk's two logits buffers and whatever the path holds beside them). Per chunk:

    1. student = h_c @ W.T (+ b),  teacher = ht_c @ Wt.T (+ bt)     two reused buffers, input dtypes
    2. the path's `ChunkDivergence.compute`: per-row w_t l_t, w_t D_t, w_t CE_t, w_t CE^teacher_t and
       the two argmax checks, then d loss / d r written over the student's logits, in place
    3. grad_h_c = dlogits @ W,  grad_W += dlogits.T @ h_c,  grad_b += sum_rows dlogits

The gradients are computed during the forward (four products in all: two for the logits, two for
the gradients) and scaled by the incoming gradient in backward, so a forward allows one backward.
The teacher's tensors are constants: detached on entry, never differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ligertune.kernels.chunked_loss import (
    FLCE_DEFAULT_CHUNK_BYTES,
    LinearGrads,
    _chunk_rows,
    autocast_flce_inputs,
    check_flce_args,
    scale_forward_grads,
    select_supervised,
)
from ligertune.kernels.types import DivergenceOptions, DivergenceOutput

VALUE_COLUMNS = ("loss", "divergence", "ce", "teacher_ce")
"""The float32 per-row values a chunk writes, in the order of their columns: w_t times l_t, D_t,
CE_t and CE^teacher_t."""

CORRECT_COLUMNS = ("student", "teacher")
"""The int32 per-row argmax checks a chunk writes, in the order of their columns."""


@dataclass(frozen=True)
class ChunkDivergence:
    """One path of `fused_linear_divergence`: what it does with one chunk of logits.

    `compute(student, teacher, targets, row_weights, values, correct, *, options, grad_scale,
    compute_grad)` gets the raw logits [rows, V] of supervised rows, the student's and the teacher's
    (each in its input dtype, contiguous), their targets [rows] and float32 weights w_t [rows]
    (None: all 1). It writes the contiguous float32 `values` [rows, 4] (`VALUE_COLUMNS`) and int32
    `correct` [rows, 2] (whether the first argmax of the student's, and of the teacher's, capped
    logits is the target; ties to the lowest index, as `torch.argmax`). With `compute_grad` it then
    writes d (grad_scale sum_t w_t l_t) / d r over `student`, in its dtype; `teacher` is only read.
    The host must not wait on the device there.

    `float32_temporaries`: how many float32 [rows, V] buffers `compute` holds at once beside the two
    logits buffers; it sizes the chunks. `dtypes`: the input dtypes the path takes (None: any).
    """

    name: str
    compute: Callable[..., None]
    float32_temporaries: int
    dtypes: tuple[torch.dtype, ...] | None = None


def check_teacher_args(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    *,
    n_rows: int,
    vocab: int,
) -> None:
    """Raise `ValueError` for teacher tensors that no path accepts: the student's rows and vocabulary
    (`n_rows`, `vocab`), any hidden size of its own."""
    hidden_shape, weight_shape = tuple(teacher_hidden.shape), tuple(teacher_weight.shape)
    if len(hidden_shape) != 2 or len(weight_shape) != 2 or hidden_shape[1] != weight_shape[1]:
        raise ValueError(
            f"teacher_hidden must be [N, Ht] and teacher_weight [V, Ht]; "
            f"got {hidden_shape} and {weight_shape}"
        )
    if hidden_shape[0] != n_rows:
        raise ValueError(f"teacher_hidden must have the student's {n_rows} rows; got {hidden_shape[0]}")
    if weight_shape[0] != vocab:
        raise ValueError(
            f"the teacher's vocabulary ({weight_shape[0]}, teacher_weight's rows) "
            f"must be the student's ({vocab})"
        )
    dtype = teacher_weight.dtype
    if teacher_hidden.dtype != dtype:
        raise ValueError(
            f"teacher_hidden and teacher_weight must share a dtype; got {teacher_hidden.dtype} and {dtype}"
        )
    if teacher_bias is not None and (tuple(teacher_bias.shape) != (vocab,) or teacher_bias.dtype != dtype):
        raise ValueError(
            f"teacher_bias must be [{vocab}] in {dtype}; got {teacher_bias.dtype} {tuple(teacher_bias.shape)}"
        )


def _linear_rows(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """out = x @ weight.T (+ bias), into the preallocated `out`."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def _divergence_pass(
    path: ChunkDivergence,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None,
    *,
    options: DivergenceOptions,
    grad_scale: float,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """One chunked pass over the supervised rows (see the module docstring).

    `rows` indexes the supervised rows of `hidden` and of the teacher's hidden states (None: all of
    them); `targets` and `row_weights` (float32) are already restricted to them. Returns the per-row
    `values` [rows, 4] and `correct` [rows, 2] (`ChunkDivergence`), then the gradients of
    `grad_scale * sum_t w_t l_t` for hidden, weight and bias (None where `needs_grad` says no). The
    host never waits on the device inside the loop.
    """
    teacher_hidden, teacher_weight, teacher_bias = teacher
    n = targets.numel()
    vocab = weight.shape[0]
    device = hidden.device
    grads = LinearGrads(hidden, weight, rows, n, needs_grad)

    values = torch.empty((n, len(VALUE_COLUMNS)), dtype=torch.float32, device=device)
    correct = torch.empty((n, len(CORRECT_COLUMNS)), dtype=torch.int32, device=device)

    bytes_per_logit = hidden.element_size() + teacher_hidden.element_size() + 4 * path.float32_temporaries
    chunk = _chunk_rows(n, vocab, bytes_per_logit, options.chunk_bytes or FLCE_DEFAULT_CHUNK_BYTES)
    student_logits = torch.empty((min(chunk, n), vocab), dtype=hidden.dtype, device=device)
    teacher_logits = torch.empty((min(chunk, n), vocab), dtype=teacher_hidden.dtype, device=device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        if rows is None:
            h_c, ht_c = hidden[start:end], teacher_hidden[start:end]
        else:
            h_c, ht_c = (x.index_select(0, rows[start:end]) for x in (hidden, teacher_hidden))
        b_student, b_teacher = student_logits[: end - start], teacher_logits[: end - start]
        _linear_rows(b_student, h_c, weight, bias)
        _linear_rows(b_teacher, ht_c, teacher_weight, teacher_bias)
        path.compute(
            b_student,
            b_teacher,
            targets[start:end],
            None if row_weights is None else row_weights[start:end],
            values[start:end],
            correct[start:end],
            options=options,
            grad_scale=grad_scale,
            compute_grad=grads.needed,
        )
        if grads.needed:
            # b_student now holds d loss / d logits for the chunk.
            grads.add(b_student, h_c, weight, start, end)

    return values, correct, *grads.result(bias)


def fused_linear_divergence_fwd(
    path: ChunkDivergence,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    targets: torch.Tensor,
    token_weights: torch.Tensor | None,
    *,
    options: DivergenceOptions,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """The forward: the fields of `DivergenceOutput` in their order, and the gradients of `loss`
    for hidden, weight and bias where asked."""
    rows, n_tokens = select_supervised(targets, options.ignore_index, weight.shape[0])
    y = targets.contiguous() if rows is None else targets.index_select(0, rows)
    w = None
    if token_weights is not None:
        w = token_weights.float()
        w = w.contiguous() if rows is None else w.index_select(0, rows)
    scale = 1.0 / max(n_tokens, 1) if options.reduction == "mean" else 1.0
    values, correct, *grads = _divergence_pass(
        path, hidden, weight, bias, teacher, rows, y, w,
        options=options, grad_scale=scale, needs_grad=needs_grad,
    )
    sums = tuple(values[:, k].sum() * scale for k in range(len(VALUE_COLUMNS)))
    counts = tuple(correct[:, k].sum(dtype=torch.int64) for k in range(len(CORRECT_COLUMNS)))
    # A fill, not torch.tensor(): a copy from the host would wait for the whole forward.
    n_tok = torch.full((), n_tokens, dtype=torch.int64, device=hidden.device)
    return (*sums, *counts, n_tok), tuple(grads)


class FusedLinearDivergenceFunction(torch.autograd.Function):
    """Autograd for `fused_linear_divergence`: differentiable w.r.t. hidden, weight and bias; it keeps
    the gradients that its forward computed. The teacher comes detached and gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, targets,
                token_weights, path, options):
        teacher = (teacher_hidden, teacher_weight, teacher_bias)
        outputs, ctx.grads = fused_linear_divergence_fwd(
            path, hidden, weight, bias, teacher, targets, token_weights,
            options=options, needs_grad=tuple(ctx.needs_input_grad[:3]),
        )
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grads, ctx.grads = scale_forward_grads(ctx.grads, grad_loss), None
        return (*grads, None, None, None, None, None, None, None)


def chunked_linear_divergence(
    path: ChunkDivergence,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    options: DivergenceOptions,
) -> DivergenceOutput:
    """The divergence of the student `hidden [N, H] @ weight [V, H].T + bias` from the teacher
    `teacher_hidden [N, Ht] @ teacher_weight [V, Ht].T + teacher_bias`, with the student's
    cross-entropy against `targets [N]`, chunk by chunk on `path`, never holding all logits:
    `ligertune.kernels.fused_linear_divergence`.

    D_t, CE_t, l_t and the reductions as in the module docstring, over the supervised rows
    (targets[t] != options.ignore_index). Returns `DivergenceOutput`: `loss` (float32,
    differentiable w.r.t. hidden, weight and bias), the reported `divergence`, `ce`, `teacher_ce`
    under the same weights and reduction, and the int64 counts `n_correct`, `teacher_correct`,
    `n_tokens`. Softmax, log-sum-exp and the divergence are computed in float32 whatever the input
    dtypes (the student's and the teacher's may differ). The teacher's tensors are detached. One
    backward per forward.
    """
    hidden, weight, bias = autocast_flce_inputs(hidden, weight, bias)
    teacher_bias = None if teacher_bias is None else teacher_bias.detach()
    teacher = autocast_flce_inputs(teacher_hidden.detach(), teacher_weight.detach(), teacher_bias)
    check_flce_args(hidden, weight, targets, bias=bias, token_weights=token_weights)
    check_teacher_args(*teacher, n_rows=hidden.shape[0], vocab=weight.shape[0])
    for who, dtype in (("student", hidden.dtype), ("teacher", teacher[0].dtype)):
        if path.dtypes is not None and dtype not in path.dtypes:
            raise ValueError(f"the {path.name} path takes {path.dtypes}; got {dtype} for the {who}")
    return DivergenceOutput(
        *FusedLinearDivergenceFunction.apply(
            hidden, weight, bias, *teacher, targets, token_weights, path, options
        )
    )
