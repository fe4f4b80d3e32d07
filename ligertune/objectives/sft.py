"""Supervised fine-tuning: cross-entropy on the trained tokens of packed conversations.

The step loss is L = sum_t w_t l_t over the step's supervised tokens, with l_t the token's
cross-entropy (label smoothing and z-loss included) and w_t from `loss.normalization`
(`ligertune.objectives.normalization`, docs/loss.md). The reported loss is the cross-entropy alone;
z-loss and token accuracy are reported beside it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ligertune.data import Batch, PaddedBatch
from ligertune.objectives.base import MicroBatchLoss
from ligertune.objectives.normalization import step_token_weights
from ligertune.recipe import LossConfig


class SFT:
    """Next-token cross-entropy on the trained roles' tokens (`data.train_on`)."""

    name = "sft"
    sums = ("loss", "z_loss", "n_correct", "n_tokens")
    trained_tokens = "n_tokens"
    units = None
    held_out = ("loss", "token_accuracy")

    def __init__(self, cfg: LossConfig):
        self.cfg = cfg

    def prepare_step(self, engine: nn.Module, batches: Sequence[Batch | PaddedBatch]
                     ) -> list[Batch | PaddedBatch]:
        return list(batches)  # the token weights are all the step needs

    def step_weights(self, batches: Sequence[Batch | PaddedBatch]) -> list[torch.Tensor]:
        return step_token_weights([b.targets for b in batches], [conversation_ids(b) for b in batches],
                                  self.cfg.normalization, ignore_index=self.cfg.ignore_index)

    def forward(self, engine: nn.Module, batch: Batch | PaddedBatch, weights: torch.Tensor) -> MicroBatchLoss:
        out = engine(batch.input_ids, batch.position_ids, batch.targets, weights, **attention_of(batch))
        sums = {"loss": out.loss.detach().float(), "z_loss": out.z_loss.detach().float(),
                "n_correct": out.n_correct, "n_tokens": out.n_tokens}
        return MicroBatchLoss(out.loss, sums)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss"] - sums["z_loss"], "z_loss": sums["z_loss"],
                "token_accuracy": sums["n_correct"] / max(sums["n_tokens"], 1)}


def conversation_ids(batch: Batch | PaddedBatch) -> torch.Tensor:
    """The conversation each token belongs to: `seq_ids` of a flattened row, the row of a padded one."""
    if isinstance(batch, Batch):
        return batch.seq_ids
    rows, width = batch.input_ids.shape
    return torch.arange(rows, device=batch.input_ids.device).repeat_interleave(width)


def attention_of(batch: Batch | PaddedBatch) -> dict:
    """The keywords that keep a batch's conversations apart: a pack's boundaries, or a padding mask."""
    if isinstance(batch, Batch):
        return {"cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen}
    return {"attention_mask": batch.attention_mask}
