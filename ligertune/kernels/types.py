"""Small result types shared by the kernels and their references."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
