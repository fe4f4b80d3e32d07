"""Pure-torch twins of the Triton kernels: the test oracle and the CPU path.

Each function here has exactly the semantics of its Triton counterpart in `ligertune.kernels`, in
plain PyTorch, bounded in memory where the kernel is, and fast enough on a CPU to train small models.
"""

from __future__ import annotations

import torch

from ligertune.kernels.types import LossOutput


# ---------------------------------------------------------------------------------------------
# Fused linear cross-entropy
# ---------------------------------------------------------------------------------------------

FLCE_DEFAULT_CHUNK_BYTES = 1 << 30
"""Default budget for the logits of one chunk of rows (about 1 GiB)."""

FLCE_REDUCTIONS = ("mean", "sum", "none")


def check_flce_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    token_weights: torch.Tensor | None,
    label_smoothing: float,
    z_loss_weight: float,
    softcap: float | None,
    reduction: str,
    chunk_bytes: int | None,
) -> None:
    """Raise `ValueError` for arguments that neither path of `fused_linear_cross_entropy` accepts."""
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
    if reduction not in FLCE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {FLCE_REDUCTIONS}; got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1]; got {label_smoothing}")
    if not z_loss_weight >= 0.0:
        raise ValueError(f"z_loss_weight must be >= 0; got {z_loss_weight}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be > 0 (or None); got {softcap}")
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0; got {chunk_bytes}")


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


def _flce_reference_pass(
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
) -> tuple[torch.Tensor, ...]:
    """One pass over the supervised rows, a chunk of rows at a time.

    `rows` indexes the supervised rows of `hidden` (None: all of them); `targets` and `row_weights`
    are already restricted to those rows. Returns the per-row loss, z-loss (both times the row weight)
    and correct flag, then the gradients of `grad_scale * sum_t w_t l_t` w.r.t. hidden, weight and bias
    (None where `needs_grad` says no).
    """
    n = targets.numel()
    vocab = weight.shape[0]
    device = hidden.device
    eps, zw = label_smoothing, z_loss_weight
    need_h, need_w, need_b = needs_grad
    # A chunk holds about four float32 [rows, V] buffers at once (logits, probabilities, temporaries).
    chunk = max(1, chunk_bytes // (16 * vocab))

    loss_rows = torch.zeros(n, dtype=torch.float32, device=device)
    z_rows = torch.zeros(n, dtype=torch.float32, device=device)
    correct_rows = torch.zeros(n, dtype=torch.bool, device=device)
    grad_h = torch.zeros_like(hidden) if need_h else None
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else None

    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h_c = hidden[start:end] if rows is None else hidden.index_select(0, rows[start:end])
        y_c = targets[start:end].long()
        raw = h_c @ weight.t() if bias is None else torch.addmm(bias, h_c, weight.t())
        z = raw.float()
        if softcap is not None:
            z = z.div_(softcap).tanh_().mul_(softcap)
        lse = torch.logsumexp(z, dim=1)
        loss = lse - (1.0 - eps) * z.gather(1, y_c[:, None]).squeeze(1)
        if eps:
            loss -= eps * z.mean(dim=1)
        zl = zw * lse.square()
        loss += zl
        correct_rows[start:end] = z.argmax(dim=1) == y_c
        w_c = None if row_weights is None else row_weights[start:end]
        loss_rows[start:end] = loss if w_c is None else loss * w_c
        z_rows[start:end] = zl if w_c is None else zl * w_c
        if not (need_h or need_w or need_b):
            continue

        # d l_t / d z_v = (1 + 2 zw lse) softmax_v - (1 - eps) [v == y] - eps / V, times w_t and the scale.
        coef = torch.full_like(lse, grad_scale) if w_c is None else w_c * grad_scale
        g = (z - lse[:, None]).exp_().mul_((coef * (1.0 + 2.0 * zw * lse))[:, None])
        g.scatter_add_(1, y_c[:, None], (-(1.0 - eps) * coef)[:, None])
        if eps:
            g.sub_((coef * (eps / vocab))[:, None])
        if softcap is not None:
            # z = c tanh(raw / c), so dz/draw = 1 - tanh^2 = 1 - (z / c)^2.
            g.mul_(z.div_(softcap).square_().neg_().add_(1.0))
        if need_b:
            grad_b += g.sum(dim=0)
        g = g.to(hidden.dtype)
        if need_h:
            if rows is None:
                grad_h[start:end] = g @ weight
            else:
                grad_h.index_copy_(0, rows[start:end], g @ weight)
        if need_w:
            grad_w.addmm_(g.t(), h_c)

    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return loss_rows, z_rows, correct_rows, grad_h, grad_w, grad_b


class _ReferenceFusedLinearCrossEntropy(torch.autograd.Function):
    """Gradients are computed during the forward for a scalar reduction (three products, not four)
    and scaled by the incoming gradient in backward; reduction="none" recomputes them in backward."""

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
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        rows, n_tokens = select_supervised(targets, ignore_index, vocab)
        y = targets if rows is None else targets.index_select(0, rows)
        w = None
        if token_weights is not None:
            w = token_weights.float() if rows is None else token_weights.float().index_select(0, rows)
        scalar = reduction != "none"
        scale = 1.0 / max(n_tokens, 1) if reduction == "mean" else 1.0
        options = dict(label_smoothing=label_smoothing, z_loss_weight=z_loss_weight, softcap=softcap)
        options["chunk_bytes"] = chunk_bytes
        needs_grad = tuple(ctx.needs_input_grad[:3]) if scalar else (False, False, False)
        loss_rows, z_rows, correct, gh, gw, gb = _flce_reference_pass(
            hidden, weight, bias, rows, y, w, grad_scale=scale, needs_grad=needs_grad, **options
        )
        if scalar:
            loss, z_loss = loss_rows.sum() * scale, z_rows.sum() * scale
            ctx.grads = (gh, gw, gb)
        else:
            loss, z_loss = scatter_rows(loss_rows, rows, n_rows), scatter_rows(z_rows, rows, n_rows)
            ctx.save_for_backward(hidden, weight, bias, rows, y, w)
            ctx.options = options
        ctx.scalar = scalar
        n_correct = correct.sum()
        n_tok = torch.full((), n_tokens, dtype=torch.int64, device=hidden.device)
        ctx.mark_non_differentiable(z_loss, n_correct, n_tok)
        return loss, z_loss, n_correct, n_tok

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.scalar:
            if ctx.grads is None:
                raise RuntimeError("fused_linear_cross_entropy supports one backward per forward")
            grads, ctx.grads = ctx.grads, None
            g = float(grad_loss)
            grads = tuple(t if t is None or g == 1.0 else t.mul_(g) for t in grads)
        else:
            hidden, weight, bias, rows, y, w = ctx.saved_tensors
            g_rows = grad_loss.float() if rows is None else grad_loss.float().index_select(0, rows)
            row_weights = g_rows if w is None else g_rows * w
            grads = _flce_reference_pass(
                hidden, weight, bias, rows, y, row_weights,
                grad_scale=1.0, needs_grad=tuple(ctx.needs_input_grad[:3]), **ctx.options,
            )[3:]
        return (*grads, None, None, None, None, None, None, None, None)


def scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    """Per-supervised-row values back to all `n_rows` rows, 0 at ignored rows."""
    if rows is None:
        return values
    return torch.zeros(n_rows, dtype=values.dtype, device=values.device).index_copy_(0, rows, values)


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
    """Cross-entropy of `hidden @ weight.T + bias` over the supervised rows, never holding all logits.

    For every supervised row t (targets[t] != ignore_index), with z = hidden[t] @ weight.T + bias,
    softcapped to z = c tanh(z / c) when `softcap` = c is set, and lse = logsumexp(z):

        l_t = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v) + z_loss_weight lse^2

    (eps = label_smoothing; the smoothed term is the cross-entropy against the uniform distribution,
    as in `torch.nn.functional.cross_entropy`; the last term is the z-loss of PaLM, Chowdhery et al.
    2022, section 5). With w_t = token_weights[t] (default 1):

        "sum":  sum_t w_t l_t      "mean": that sum / n_tokens (0 when n_tokens = 0)
        "none": w_t l_t per row, [N] float32, 0 at ignored rows

    Returns `LossOutput`: `loss` (float32, differentiable w.r.t. hidden, weight and bias), `z_loss`
    (the z_loss_weight lse^2 part of `loss` under the same weights and reduction; a value to report,
    not differentiable: its gradient is already part of `loss`'s), `n_correct` (supervised rows
    whose first argmax of z equals the target; ties go to the lowest index, as `torch.argmax`) and
    `n_tokens` (supervised rows). Softmax and log-sum-exp are computed in float32 whatever the input
    dtype. Rows are processed in chunks whose float32 working set stays under `chunk_bytes` (default
    `FLCE_DEFAULT_CHUNK_BYTES`). A scalar reduction allows one backward per forward.
    """
    hidden, weight, bias = autocast_flce_inputs(hidden, weight, bias)
    check_flce_args(
        hidden, weight, targets, bias=bias, token_weights=token_weights, label_smoothing=label_smoothing,
        z_loss_weight=z_loss_weight, softcap=softcap, reduction=reduction, chunk_bytes=chunk_bytes,
    )
    outputs = _ReferenceFusedLinearCrossEntropy.apply(
        hidden, weight, bias, targets, token_weights, ignore_index, float(label_smoothing),
        float(z_loss_weight), None if softcap is None else float(softcap), reduction,
        chunk_bytes or FLCE_DEFAULT_CHUNK_BYTES,
    )
    return LossOutput(*outputs)


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
# SwiGLU
# ---------------------------------------------------------------------------------------------


def check_swiglu_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise `ValueError` for arguments that neither path of `swiglu` accepts."""
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
    check_swiglu_args(gate, up)
    return torch.nn.functional.silu(gate) * up


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
    and the loss shows it). The arithmetic is float32 whatever the storage (parameters and gradients float32, bfloat16 or
    float16, one dtype per pair; momentum float32 or the parameter's dtype), rounded once into each
    stored tensor. The `torch._foreach_*` ops take all tensors of a call at once, so this is also a
    reasonable CPU path; low-precision tensors go through float32 copies (transient memory of that size).
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
