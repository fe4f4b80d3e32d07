"""Small types shared by the kernels, their references and the loss head: loss options in, loss out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_REDUCTIONS = ("mean", "sum", "none")


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
