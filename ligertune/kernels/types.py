"""Small types shared by the kernels, their references and the loss heads: loss options in, loss out."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

LOSS_REDUCTIONS = ("mean", "sum", "none")

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
"""What `fused_linear_divergence` measures between the teacher's P and the student's Q: KL(P || Q),
KL(Q || P), or the generalised Jensen-Shannon divergence of weight beta (`chunked_divergence`)."""

DIVERGENCE_REDUCTIONS = ("sum", "mean")

FLOAT8 = torch.float8_e4m3fn
"""The float8 format of `quantize_rows`: 3 bits of mantissa over +-448."""
FLOAT8_MAX = 448.0
AMAX_FLOOR = 1e-12
"""The smallest row maximum a float8 scale is taken from: an all-zero row stays zeros."""
FLOAT8_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The float8 formats of `quantize_transposed`: e4m3, and e5m2 (2 bits of mantissa over +-57344),
which gradients take for its range."""


@dataclass(frozen=True)
class BlockScales:
    """The scale of each block of `blocksize` 4-bit weights (`dequantize_4bit`): `absmax` itself
    (float32), or, double-quantized, code[absmax_b] * absmax2[b // nested_blocksize] + offset, with
    `absmax` one byte a block, `code` its 256 values and `offset` a 0-d tensor (float32)."""

    absmax: torch.Tensor
    blocksize: int
    code: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    nested_blocksize: int = 256


def loss_head_output(cls: type) -> type:
    """Registers a dataclass that the loss head returns with torch's pytree, so that FSDP2 finds its
    tensors. FSDP2 hooks the root module's backward (which reduces the root's gradients over the
    ranks, and queues the end of the backward for every sharded module) on the tensors of the root's
    output; torch 2.11 looks for them only in containers that pytree knows (2.13 reads dataclasses
    too). The decoder layers' own hooks usually queue the end of the backward anyway; with Medusa
    heads over a frozen model the decoder runs without gradient, and without this the heads'
    gradients stayed each rank's own."""
    pytree.register_dataclass(cls)
    return cls


@dataclass(frozen=True)
class LossOptions:
    """Every option of the fused linear cross-entropy, as one value.

    Built once where the recipe is read (`ligertune.training.build.build_head`), held by the loss head
    and passed unchanged to the kernel, its pure-torch twin and the unfused loss; a new option is a
    new field here. The loss l_t and the reductions are defined in `chunked_loss`; the defaults are
    those of `torch.nn.functional.cross_entropy`. A value that no path accepts raises `ValueError`
    here, where the options are built.
    """

    ignore_index: int = -100
    """Target of a row that carries no loss (a prompt token, padding)."""

    label_smoothing: float = 0.0
    """eps in [0, 1]: the weight of the cross-entropy against the uniform distribution in l_t."""

    z_loss_weight: float = 0.0
    """zw >= 0: the weight of the z-loss lse^2 in l_t (PaLM, Chowdhery et al. 2022, section 5); 0 is off."""

    softcap: float | None = None
    """c > 0: the logits are capped to c tanh(z / c) before the softmax (Gemma 2's
    `final_logit_softcapping`); None: no cap."""

    reduction: str = "mean"
    """"sum": sum_t w_t l_t over the supervised rows; "mean": that sum over their count (0 when there
    are none); "none": w_t l_t per row, 0 at ignored rows."""

    chunk_bytes: int | None = None
    """Memory budget of one chunk of rows in the fused loss (None: `FLCE_DEFAULT_CHUNK_BYTES`, 1 GiB).
    It changes the memory and the speed, not the values beyond float summation order."""

    def __post_init__(self) -> None:
        if self.reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"reduction must be one of {LOSS_REDUCTIONS}; got {self.reduction!r}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1]; got {self.label_smoothing}")
        if not self.z_loss_weight >= 0.0:
            raise ValueError(f"z_loss_weight must be >= 0; got {self.z_loss_weight}")
        if self.softcap is not None and not self.softcap > 0.0:
            raise ValueError(f"softcap must be > 0 (or None); got {self.softcap}")
        if self.chunk_bytes is not None and self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0; got {self.chunk_bytes}")


@loss_head_output
@dataclass
class LossOutput:
    """What `fused_linear_cross_entropy` returns.

    loss:      the full objective (cross-entropy with label smoothing, plus z-loss), reduced.
    z_loss:    the z-loss part of `loss`, under the same weighting and reduction (0 when disabled).
    n_correct: supervised tokens whose argmax logit equals the target (int64 scalar tensor).
    n_tokens:  supervised tokens, i.e. targets != ignore_index (int64 scalar tensor).
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    n_correct: torch.Tensor
    n_tokens: torch.Tensor


@dataclass(frozen=True)
class DivergenceOptions:
    """Every option of the fused linear divergence (knowledge distillation), as one value.

    Built once where the recipe is read and passed unchanged down to the kernel and its pure-torch
    twin, as `LossOptions` is for the cross-entropy. D_t, CE_t and the reductions are defined in
    `chunked_divergence`. A value that no path accepts raises `ValueError` here, naming the field.
    """

    divergence: str = "forward_kl"
    """D_t, one of `DIVERGENCES`: "forward_kl" KL(P || Q) (mode covering), "reverse_kl" KL(Q || P)
    (mode seeking), "jsd" beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q."""

    beta: float = 0.5
    """The teacher's weight in the mixture M of "jsd", strictly inside (0, 1); 0.5 gives the symmetric
    Jensen-Shannon divergence. Checked whatever the divergence, read by "jsd" only."""

    temperature: float = 1.0
    """tau > 0: P = softmax(teacher logits / tau), Q = softmax(student logits / tau). D_t is not
    multiplied by tau^2 (Hinton et al. 2015 do, to keep the gradient's scale): the caller's to do."""

    ce_weight: float = 0.0
    """alpha in [0, 1]: the loss is (1 - alpha) D_t + alpha CE_t, CE_t the student's own next-token
    cross-entropy at temperature 1."""

    ignore_index: int = -100
    """Target of a row that carries no loss (a prompt token, padding)."""

    softcap: float | None = None
    """c > 0: the student's logits are capped to c tanh(z / c) before everything else (Gemma 2's
    `final_logit_softcapping`); None: no cap."""

    teacher_softcap: float | None = None
    """The same for the teacher's logits."""

    reduction: str = "sum"
    """"sum": sum_t w_t (...) over the supervised rows; "mean": that sum over their count (0 when
    there are none). No per-row "none": the gradients are computed in the forward."""

    chunk_bytes: int | None = None
    """Memory budget of one chunk of rows (None: `FLCE_DEFAULT_CHUNK_BYTES`, 1 GiB) for its two
    logits buffers and the path's temporaries. It changes the memory and the speed, not the values
    beyond float summation order."""

    def __post_init__(self) -> None:
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}; got {self.divergence!r}")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"beta must lie strictly inside (0, 1); got {self.beta}")
        if not 0.0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be > 0 and finite; got {self.temperature}")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ValueError(f"ce_weight must lie in [0, 1]; got {self.ce_weight}")
        for name in ("softcap", "teacher_softcap"):
            cap = getattr(self, name)
            if cap is not None and not 0.0 < cap < math.inf:
                raise ValueError(f"{name} must be > 0 and finite (or None); got {cap}")
        if self.reduction not in DIVERGENCE_REDUCTIONS:
            raise ValueError(f"reduction must be one of {DIVERGENCE_REDUCTIONS}; got {self.reduction!r}")
        if self.chunk_bytes is not None and self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0; got {self.chunk_bytes}")


@loss_head_output
@dataclass
class DivergenceOutput:
    """What `fused_linear_divergence` returns, each term under the same row weights w_t and reduction.

    loss:            sum_t w_t [(1 - alpha) D_t + alpha CE_t], float32, differentiable w.r.t. the
                     student's hidden states, weight and bias.
    divergence:      sum_t w_t D_t (reported, not differentiable).
    ce:              sum_t w_t CE_t, the student's cross-entropy against the targets (reported).
    teacher_ce:      sum_t w_t CE^teacher_t, the teacher's (reported).
    n_correct:       supervised rows whose first argmax of the student's logits is the target (int64).
    teacher_correct: the same for the teacher (int64).
    n_tokens:        supervised rows, i.e. targets != ignore_index (int64).
    """

    loss: torch.Tensor
    divergence: torch.Tensor
    ce: torch.Tensor
    teacher_ce: torch.Tensor
    n_correct: torch.Tensor
    teacher_correct: torch.Tensor
    n_tokens: torch.Tensor
