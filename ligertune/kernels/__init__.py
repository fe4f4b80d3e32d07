"""Kernels: Triton on CUDA, the pure-torch twins of `reference` elsewhere.

`LIGERTUNE_KERNELS=triton|reference` forces a path (`triton` on a CPU needs `TRITON_INTERPRET=1`).
The choice is made per call from the inputs' device, so one process can hold CPU and CUDA tensors.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from ligertune.kernels.types import (
    DIVERGENCES, FLOAT8_FORMATS, BlockScales, DivergenceOptions, DivergenceOutput, LossOptions, LossOutput,
)

__all__ = [
    "DIVERGENCES",
    "BlockScales",
    "DivergenceOptions",
    "DivergenceOutput",
    "LossOptions",
    "LossOutput",
    "active_path",
    "apply_rope",
    "dequantize_4bit",
    "fused_linear_cross_entropy",
    "fused_linear_divergence",
    "geglu",
    "lion_step",
    "quantize_rows",
    "quantize_transposed",
    "rms_norm",
    "swiglu",
    "transpose_float8",
]

_PATHS = ("triton", "reference")


def active_path(device: torch.device | str | None = None) -> str:
    """The path a call on `device` takes: the forced one, else triton on CUDA and reference elsewhere."""
    forced = os.environ.get("LIGERTUNE_KERNELS", "").strip().lower()
    if forced:
        if forced not in _PATHS:
            raise ValueError(f"LIGERTUNE_KERNELS must be one of {_PATHS}, got {forced!r}")
        return forced
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "triton" if torch.device(device).type == "cuda" else "reference"


def _impl(name: str, device: torch.device):
    if active_path(device) == "triton":
        from ligertune.kernels import triton_ops as ops
    else:
        from ligertune.kernels import reference as ops
    return getattr(ops, name)


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
    options: LossOptions | None = None,
) -> LossOutput:
    """Cross-entropy of `hidden @ weight.T + bias` without materializing the logits; see `chunked_loss`.

    The options come either as torch's keywords or all at once as `options` (what the loss head
    passes), not both: with `options`, the keywords from `ignore_index` to `chunk_bytes` keep their
    defaults.
    """
    keywords = LossOptions(
        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss_weight=z_loss_weight,
        softcap=softcap, reduction=reduction, chunk_bytes=chunk_bytes,
    )
    if options is None:
        options = keywords
    elif keywords != LossOptions():
        raise TypeError("fused_linear_cross_entropy takes the options as keywords or as options=, not both")
    impl = _impl("fused_linear_cross_entropy", hidden.device)
    return impl(hidden, weight, targets, bias=bias, token_weights=token_weights, options=options)


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
    """Knowledge distillation without materializing the logits: the divergence of the student
    (`hidden [N, H] @ weight [V, H].T + bias`) from the teacher (`teacher_hidden [N, Ht] @
    teacher_weight [V, Ht].T + teacher_bias`), plus `options.ce_weight` times the student's
    cross-entropy against `targets`, over the supervised rows; see `chunked_divergence`.

    Differentiable w.r.t. hidden, weight and bias; the teacher's tensors are constants. D_t is not
    multiplied by tau^2.
    """
    impl = _impl("fused_linear_divergence", hidden.device)
    return impl(hidden, weight, teacher_hidden, teacher_weight, targets, bias=bias, teacher_bias=teacher_bias,
                token_weights=token_weights, options=options)


def rms_norm(x, weight, eps: float = 1e-6, offset: float = 0.0, casting: str | None = None):
    """`x / rms(x) * (offset + weight)`, computed in float32; `casting` "llama" | "gemma" (default: by offset)."""
    return _impl("rms_norm", x.device)(x, weight, eps, offset, casting)


def apply_rope(q, k, cos, sin):
    """Rotate `q` and `k` by the rotary embedding `cos`/`sin` (taken per position id)."""
    return _impl("apply_rope", q.device)(q, k, cos, sin)


def swiglu(gate, up, *, reuse_inputs: bool = False):
    """`silu(gate) * up`.

    `reuse_inputs=True` lets the backward write the gradients over `gate` and `up`, saving two
    buffers of their size at the peak of an MLP's backward: only for inputs that nothing else reads
    after the product (as in an MLP, where they exist for it alone). Autograd's version counter then
    refuses any later use of them in a backward.
    """
    return _impl("swiglu", gate.device)(gate, up, reuse_inputs=reuse_inputs)


def geglu(gate, up, *, reuse_inputs: bool = False):
    """`gelu(gate, approximate="tanh") * up`, Gemma's gated MLP unit; `reuse_inputs` as for `swiglu`."""
    return _impl("geglu", gate.device)(gate, up, reuse_inputs=reuse_inputs)


def lion_step(params, grads, moments, *, lr: float, beta1: float = 0.9, beta2: float = 0.99,
              weight_decay: float = 0.0) -> None:
    """One Lion step in place over lists of tensors on one device (params, their grads, momenta);
    see `reference.lion_step`. The Triton path updates all of them in one launch per dtype pair."""
    device = params[0].device if params else None
    impl = _impl("lion_step", device)
    impl(params, grads, moments, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


def quantize_rows(x: torch.Tensor | Sequence[torch.Tensor],
                  col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor to float8 (e4m3) with one scale per row: (q, scale [rows] float32), x ~ q * scale
    (times `col_scale` elementwise first, when given); see `float8_rows`. Several 2-D tensors of one
    width (a list): their rows as if stacked, without a copy that stacks them."""
    device = x.device if isinstance(x, torch.Tensor) else x[0].device
    return _impl("quantize_rows", device)(x, col_scale)


def quantize_transposed(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                        multiple: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The transpose of a 2-D tensor in float8 (`dtype`: e4m3 or e5m2) with one scale for the
    tensor, (q [cols, rows padded], scale: a float32 scalar), x^T ~ q * scale; the rows are padded
    with zeros to a multiple of `multiple`, as the inner side of a float8 GEMM must be."""
    if x.dim() != 2:
        raise ValueError(f"quantize_transposed: expected a 2-D tensor, got shape {tuple(x.shape)}")
    if dtype not in FLOAT8_FORMATS:
        raise ValueError(f"quantize_transposed: dtype must be one of {FLOAT8_FORMATS}, got {dtype}")
    return _impl("quantize_transposed", x.device)(x, dtype, multiple)


def dequantize_4bit(packed: torch.Tensor, table: torch.Tensor, scales: BlockScales,
                    out: torch.Tensor) -> torch.Tensor:
    """`out` filled with the weights of 4-bit codes in bitsandbytes' layout (two a byte of `packed`,
    the high half first): table[code_i] times the scale of i's block (`scales`); see `nf4`."""
    if not out.is_contiguous() or out.numel() != 2 * packed.numel():
        raise ValueError(f"dequantize_4bit: out must be contiguous with 2 weights a byte of the codes; got "
                         f"{out.numel()} for {packed.numel()} bytes")
    return _impl("dequantize_4bit", packed.device)(packed, table, scales, out)


def transpose_float8(x: torch.Tensor) -> torch.Tensor:
    """The transpose of a contiguous 2-D float8 tensor, contiguous: the layout a float8 GEMM reads
    its second operand in."""
    return _impl("transpose_float8", x.device)(x)
