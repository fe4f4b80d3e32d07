"""Per-token loss weights that make the loss a property of the optimizer step.

For one optimizer step (every micro-batch of gradient accumulation, every data-parallel rank), with
T the supervised tokens, S the conversations with at least one supervised token and T_s those of
conversation s, the step loss is L = sum_t w_t l_t with

    token:     w_t = 1 / |T|
    sequence:  w_t = 1 / (|S| * |T_s|)
    sum:       w_t = 1

The counts are taken over the whole step before the first backward, so the loss and its gradient
do not depend on how the step was cut into packs, micro-batches or ranks (docs/loss.md).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.distributed as dist

Normalization = Literal["token", "sequence", "sum"]


def step_token_weights(
    targets: Sequence[torch.Tensor],
    seq_ids: Sequence[torch.Tensor] | None,
    mode: Normalization,
    *,
    ignore_index: int = -100,
    across_ranks: bool = True,
) -> list[torch.Tensor]:
    """Weights w_t (float32, shaped like each micro-batch's targets) for one optimizer step.

    `targets[i]` and `seq_ids[i]` belong to micro-batch i; `seq_ids` numbers the conversations of a
    micro-batch (a conversation never spans two micro-batches) and is needed by `sequence` only.
    Ignored tokens get weight 0. When torch.distributed is initialized (and `across_ranks`), |T|
    and |S| are summed over the ranks.
    """
    total = _global_sum if across_ranks else (lambda value: value)
    supervised = [t.reshape(-1) != ignore_index for t in targets]
    if mode == "sum":
        return [s.float().reshape(t.shape) for s, t in zip(supervised, targets)]
    if mode == "token":
        n_tokens = total(sum(s.sum() for s in supervised))
        scale = 1.0 / n_tokens.clamp(min=1).float()
        return [(s.float() * scale).reshape(t.shape) for s, t in zip(supervised, targets)]
    if mode == "sequence":
        if seq_ids is None:
            raise ValueError("sequence normalization needs the seq_ids of every micro-batch")
        per_conversation = []
        n_sequences = torch.zeros((), dtype=torch.int64, device=targets[0].device)
        for s, ids in zip(supervised, seq_ids):
            ids = ids.reshape(-1)
            counts = torch.bincount(ids[s], minlength=int(ids.max().item()) + 1 if ids.numel() else 0)
            per_conversation.append(counts)
            n_sequences = n_sequences + (counts > 0).sum()
        n_sequences = total(n_sequences)
        weights = []
        for s, ids, counts, t in zip(supervised, seq_ids, per_conversation, targets):
            ids = ids.reshape(-1)
            tokens_of_own_sequence = counts[ids.clamp(min=0)].clamp(min=1).float()
            w = s.float() / (tokens_of_own_sequence * n_sequences.clamp(min=1).float())
            weights.append(w.reshape(t.shape))
        return weights
    raise ValueError(f"unknown normalization {mode!r}")


def _global_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
