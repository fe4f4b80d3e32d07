"""Fused linear cross-entropy, the part its two paths share: checks, supervised rows, chunks, autograd.

`fused_linear_cross_entropy` has a Triton path (`cross_entropy.py`) and a pure-torch path
(`reference.py`) that differ only in what they do with one chunk of logits; each is a `ChunkLoss`.
Everything else is written once, here. The options come as one `LossOptions` (`types.py`), which
goes down unchanged to the path's `compute`.

For a supervised row t (targets[t] != ignore_index), with raw logits r = hidden[t] @ weight.T + bias,
z = c tanh(r / c) when a softcap c is set (else z = r), and lse = logsumexp(z):

    l_t = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v) + zw lse^2

(eps: label smoothing; zw: z-loss weight, PaLM, Chowdhery et al. 2022, section 5). The loss is
sum_t w_t l_t (reduction "sum"), that sum over the number of supervised rows ("mean"), or the
per-row values ("none").

The supervised rows are cut into as few chunks as the memory budget allows (`chunk_bytes`, about
1 GiB by default, for the chunk's logits and whatever the path holds beside them). Per chunk:

    1. logits = h_c @ W.T (+ bias)                   one reused buffer, in the input dtype
    2. the path's `ChunkLoss.compute`: per-row w_t l_t, w_t zw lse^2 and argmax == y, then
       d loss / d r written over the logits, in place
    3. grad_h_c = dlogits @ W,  grad_W += dlogits.T @ h_c,  grad_b += sum_rows dlogits

For "sum" and "mean" the gradients are computed during the forward (three products in all, not
the four of a recomputing backward) and scaled by the incoming gradient in backward; "none"
needs the incoming gradient of every row, so its backward recomputes steps 1-3. Gradients are
exact: no entry of the softmax is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ligertune.kernels.types import LossOptions, LossOutput

FLCE_DEFAULT_CHUNK_BYTES = 1 << 30
"""Default budget for the working set of one chunk of rows (about 1 GiB)."""


@dataclass(frozen=True)
class ChunkLoss:
    """One path of `fused_linear_cross_entropy`: what it does with one chunk of logits.

    `compute(logits, targets, row_weights, loss, z_loss, correct, *, options, grad_scale, compute_grad)`
    gets the raw logits [rows, V] of supervised rows (input dtype, contiguous), their targets [rows]
    and float32 weights w_t [rows] (None: all 1). It writes w_t l_t and w_t zw lse^2 into the float32
    `loss` and `z_loss` [rows], and whether the first argmax of z is the target into the int32
    `correct` [rows]; with `compute_grad`, it then writes d (grad_scale sum_t w_t l_t) / d logits over
    `logits`, in their dtype. The host must not wait on the device there.

    `float32_temporaries`: how many float32 [rows, V] buffers `compute` holds at once beside the
    logits; it sizes the chunks. `dtypes`: the input dtypes the path takes (None: any).
    """

    name: str
    compute: Callable[..., None]
    float32_temporaries: int
    dtypes: tuple[torch.dtype, ...] | None = None


def check_flce_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    token_weights: torch.Tensor | None,
) -> None:
    """Raise `ValueError` for tensors that neither path of `fused_linear_cross_entropy` accepts (the
    options were checked when the `LossOptions` was built)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    n, v = hidden.shape[0], weight.shape[0]
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype; got {hidden.dtype} and {weight.dtype}")
    if tuple(targets.shape) != (n,) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(
            f"targets must be integers of shape ({n},); got {targets.dtype} of shape {tuple(targets.shape)}"
        )
    if bias is not None and (tuple(bias.shape) != (v,) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{v}] in {weight.dtype}; got {bias.dtype} {tuple(bias.shape)}")
    if token_weights is not None and tuple(token_weights.shape) != (n,):
        raise ValueError(f"token_weights must have shape ({n},); got {tuple(token_weights.shape)}")


def autocast_flce_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cast the operands to the autocast dtype when autocast is on, as `torch.nn.functional.linear` would.

    The products inside run on these casts (differentiable back to the originals) with explicit
    output buffers, which autocast would not touch.
    """
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def select_supervised(
    targets: torch.Tensor, ignore_index: int, vocab_size: int
) -> tuple[torch.Tensor | None, int]:
    """The supervised rows (`targets != ignore_index`) as an index (None when all are), and their count.

    Ignored rows are skipped rather than computed and zeroed: in chat fine-tuning the prompts are
    often half the tokens, so this halves the work of the output layer. The count and a range check
    of the supervised targets cost one host synchronization, taken once per call; a target outside
    [0, vocab_size) would otherwise read outside its logits row.
    """
    supervised = targets != ignore_index
    out_of_range = supervised & ((targets < 0) | (targets >= vocab_size))
    n_tokens, n_bad = torch.stack([supervised.sum(), out_of_range.sum()]).tolist()
    if n_bad:
        raise ValueError(
            f"{n_bad} target(s) lie outside [0, {vocab_size}) and are not ignore_index={ignore_index}"
        )
    if n_tokens == targets.numel():
        return None, n_tokens
    return supervised.nonzero().squeeze(1), n_tokens


def scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    """Per-supervised-row values back to all `n_rows` rows, 0 at ignored rows."""
    if rows is None:
        return values
    return torch.zeros(n_rows, dtype=values.dtype, device=values.device).index_copy_(0, rows, values)


def _chunk_rows(n_rows: int, vocab: int, bytes_per_logit: int, chunk_bytes: int) -> int:
    """Rows per chunk: as few chunks as `chunk_bytes` allows, evened out, rounded to whole GEMM tiles."""
    cap = max(1, chunk_bytes // (vocab * bytes_per_logit))
    if n_rows <= cap:
        return max(n_rows, 1)
    n_chunks = math.ceil(n_rows / cap)
    rows = math.ceil(n_rows / n_chunks)
    # Multiples of 16 rows keep the products on whole tensor-core tiles, when the budget allows.
    rounded = math.ceil(rows / 16) * 16
    return rounded if rounded <= cap else rows


class LinearGrads:
    """The gradients of hidden, weight and bias of a chunked output layer, summed chunk by chunk from
    each chunk's d loss / d logits (step 3 of the module docstring); shared with `chunked_divergence`.

    `rows` indexes the supervised rows of `hidden` (None: all of them), `n_rows` counts them, and
    `needs_grad` says which of the three gradients to form (None for the others).
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None, n_rows: int,
                 needs_grad: tuple[bool, bool, bool]):
        need_h, need_w, need_b = needs_grad
        self.rows = rows
        self.hidden = self.weight = self.bias = None
        if need_h:
            # Ignored rows get no gradient and are never written by the loop.
            self.hidden = torch.empty_like(hidden) if rows is None else torch.zeros_like(hidden)
        if need_w:
            # The first chunk writes grad_w outright; only an empty pass leaves it to the zeros.
            self.weight = torch.empty_like(weight) if n_rows > 0 else torch.zeros_like(weight)
        if need_b:
            self.bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)

    @property
    def needed(self) -> bool:
        return self.hidden is not None or self.weight is not None or self.bias is not None

    def add(self, dlogits: torch.Tensor, h_c: torch.Tensor, weight: torch.Tensor, start: int, end: int
            ) -> None:
        """Add the chunk of supervised rows [start, end): grad_h rows, grad_W and grad_b terms."""
        if self.hidden is not None:
            if self.rows is None:
                torch.mm(dlogits, weight, out=self.hidden[start:end])
            else:
                self.hidden.index_copy_(0, self.rows[start:end], dlogits @ weight)
        if self.weight is not None:
            if start == 0:
                torch.mm(dlogits.t(), h_c, out=self.weight)
            else:
                self.weight.addmm_(dlogits.t(), h_c)
        if self.bias is not None:
            self.bias += dlogits.sum(dim=0, dtype=torch.float32)

    def result(self, bias: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """(grad_hidden, grad_weight, grad_bias), the bias gradient in the bias's dtype."""
        grad_b = None if self.bias is None else self.bias.to(bias.dtype)
        return self.hidden, self.weight, grad_b


def _loss_pass(
    path: ChunkLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None,
    *,
    options: LossOptions,
    grad_scale: float,
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
    grads = LinearGrads(hidden, weight, rows, n, needs_grad)
    compute_grad = grads.needed

    loss_rows = torch.empty(n, dtype=torch.float32, device=device)
    z_rows = torch.empty(n, dtype=torch.float32, device=device)
    correct_rows = torch.empty(n, dtype=torch.int32, device=device)

    bytes_per_logit = hidden.element_size() + 4 * path.float32_temporaries
    chunk = _chunk_rows(n, vocab, bytes_per_logit, options.chunk_bytes or FLCE_DEFAULT_CHUNK_BYTES)
    logits = torch.empty((min(chunk, n), vocab), dtype=hidden.dtype, device=device)
    w_t = weight.t()
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h_c = hidden[start:end] if rows is None else hidden.index_select(0, rows[start:end])
        b_logits = logits[: end - start]
        if bias is None:
            torch.mm(h_c, w_t, out=b_logits)
        else:
            torch.addmm(bias, h_c, w_t, out=b_logits)
        path.compute(
            b_logits,
            targets[start:end],
            None if row_weights is None else row_weights[start:end],
            loss_rows[start:end],
            z_rows[start:end],
            correct_rows[start:end],
            options=options,
            grad_scale=grad_scale,
            compute_grad=compute_grad,
        )
        if compute_grad:
            # b_logits now holds d loss / d logits for the chunk.
            grads.add(b_logits, h_c, weight, start, end)

    return loss_rows, z_rows, correct_rows, *grads.result(bias)


def fused_linear_cross_entropy_fwd(
    path: ChunkLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    token_weights: torch.Tensor | None,
    *,
    options: LossOptions,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]:
    """The forward: (loss, z_loss, n_correct, n_tokens), the gradients of `loss` where asked (scalar
    reductions only; "none" leaves them to the backward), and the supervised (rows, targets,
    row_weights) that a "none" backward recomputes from."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    rows, n_tokens = select_supervised(targets, options.ignore_index, vocab)
    y = targets.contiguous() if rows is None else targets.index_select(0, rows)
    w = None
    if token_weights is not None:
        w = token_weights.float()
        w = w.contiguous() if rows is None else w.index_select(0, rows)
    scalar = options.reduction != "none"
    scale = 1.0 / max(n_tokens, 1) if options.reduction == "mean" else 1.0
    loss_rows, z_rows, correct, *grads = _loss_pass(
        path, hidden, weight, bias, rows, y, w,
        options=options, grad_scale=scale, needs_grad=needs_grad if scalar else (False, False, False),
    )
    if scalar:
        loss, z_loss = loss_rows.sum() * scale, z_rows.sum() * scale
    else:
        loss, z_loss = scatter_rows(loss_rows, rows, n_rows), scatter_rows(z_rows, rows, n_rows)
    n_correct = correct.sum(dtype=torch.int64)
    # A fill, not torch.tensor(): a copy from the host would wait for the whole forward.
    n_tok = torch.full((), n_tokens, dtype=torch.int64, device=hidden.device)
    return (loss, z_loss, n_correct, n_tok), tuple(grads), (rows, y, w)


def scale_forward_grads(grads: tuple[torch.Tensor | None, ...] | None,
                        grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Backward of a scalar reduction: the gradients computed in the forward, times `grad_loss`, in place.

    In place, so they are handed out once (None: they were). Reading grad_loss costs one host sync,
    far cheaper than a pass over the [V, H] weight gradient when it is 1, as it is for loss.backward().
    """
    if grads is None:
        raise RuntimeError("a fused loss of scalar reduction supports one backward per forward: its "
                           "gradients were computed in the forward and handed out already")
    g = float(grad_loss)
    return tuple(t if t is None or g == 1.0 else t.mul_(g) for t in grads)


def fused_linear_cross_entropy_bwd(
    path: ChunkLoss,
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None,
    *,
    options: LossOptions,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """Backward of reduction="none": recompute each chunk with row weights grad_loss[t] * w_t.

    (rows, targets, row_weights) are the supervised ones that the forward returned."""
    g_rows = grad_loss.float() if rows is None else grad_loss.float().index_select(0, rows)
    row_weights = g_rows.contiguous() if row_weights is None else g_rows * row_weights
    return _loss_pass(
        path, hidden, weight, bias, rows, targets, row_weights,
        options=options, grad_scale=1.0, needs_grad=needs_grad,
    )[3:]


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for `fused_linear_cross_entropy`; differentiable w.r.t. hidden, weight and bias.

    A scalar reduction keeps the gradients that its forward computed; "none" keeps the inputs, and
    its backward recomputes."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_weights, path, options):
        outputs, grads, supervised = fused_linear_cross_entropy_fwd(
            path, hidden, weight, bias, targets, token_weights,
            options=options, needs_grad=tuple(ctx.needs_input_grad[:3]),
        )
        ctx.path, ctx.options = path, options
        if options.reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, *supervised)
        else:
            ctx.grads = grads
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.options.reduction == "none":
            grads = fused_linear_cross_entropy_bwd(
                ctx.path, grad_loss, *ctx.saved_tensors,
                options=ctx.options, needs_grad=tuple(ctx.needs_input_grad[:3]),
            )
        else:
            grads, ctx.grads = scale_forward_grads(ctx.grads, grad_loss), None
        return (*grads, None, None, None, None)


def chunked_linear_cross_entropy(
    path: ChunkLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    options: LossOptions,
) -> LossOutput:
    """Cross-entropy of `hidden [N, H] @ weight [V, H].T + bias` against `targets [N]`, chunk by chunk
    on `path`, never holding all logits: `ligertune.kernels.fused_linear_cross_entropy`.

    l_t as in the module docstring, for every supervised row t (targets[t] != options.ignore_index);
    the smoothed term is the cross-entropy against the uniform distribution, as in
    `torch.nn.functional.cross_entropy`. With w_t = token_weights[t] (default 1), `options.reduction`:

        "sum":  sum_t w_t l_t      "mean": that sum / n_tokens (0 when n_tokens = 0)
        "none": w_t l_t per row, [N] float32, 0 at ignored rows

    Returns `LossOutput`: `loss` (float32, differentiable w.r.t. hidden, weight and bias), `z_loss`
    (the z_loss_weight lse^2 part of `loss` under the same weights and reduction; a value to report,
    not differentiable: its gradient is already part of `loss`'s), `n_correct` (supervised rows
    whose first argmax of z equals the target; ties go to the lowest index, as `torch.argmax`) and
    `n_tokens` (supervised rows). Softmax and log-sum-exp are computed in float32 whatever the input
    dtype. Rows are processed in chunks whose working set (the logits and the path's float32
    temporaries) stays under `options.chunk_bytes` (default `FLCE_DEFAULT_CHUNK_BYTES`). A scalar
    reduction allows one backward per forward.
    """
    hidden, weight, bias = autocast_flce_inputs(hidden, weight, bias)
    check_flce_args(hidden, weight, targets, bias=bias, token_weights=token_weights)
    if path.dtypes is not None and hidden.dtype not in path.dtypes:
        raise ValueError(f"the {path.name} path takes {path.dtypes}; got {hidden.dtype}")
    return LossOutput(
        *FusedLinearCrossEntropyFunction.apply(hidden, weight, bias, targets, token_weights, path, options)
    )
