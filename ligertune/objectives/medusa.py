"""Medusa heads: K extra heads on the model's last hidden state learn the tokens further ahead
(Cai et al. 2024, Medusa), for speculative decoding.

On chat data packed as for supervised fine-tuning, head k (k = 1..K) reads the last hidden state at
position t and predicts the token k + 1 places ahead: its target at t is the label at t + k (the
label at t is already the next token, x_{t+1}), taken from the same conversation only. A draw of a
pack of two conversations, K = 2:

    tokens        a0  a1  a2  a3 | b0  b1  b2
    labels        -   a2  a3  -  | -   b2  -      (- : not trained; the label at t is x_{t+1})
    head 1 (t+2)  a2  a3  -   -  | b2  -   -
    head 2 (t+3)  a3  -   -   -  | -   -   -

so no head ever predicts across a packing boundary, and a position counts only where its target is
a trained token (`data.train_on`). Each head's loss L_k is SFT's per-token loss (label smoothing and
z-loss of the `loss` section) through the fused linear cross-entropy, with SFT's exact step-level
weights counted over that head's own targets (`loss.normalization`: per token, per conversation or
summed, over every micro-batch and rank of the step). The step's loss is

    L = sum_k lambda_k L_k  (+ lm_weight L_LM when the model trains, `backbone: lora` or `full`)

with lambda_k = `objective.head_weights` (0.8^k by default) and L_LM the model's own next-token
cross-entropy, weighted as SFT weighs it. With `backbone: frozen` (Medusa-1) the model runs without
gradient, its L_LM reported but not trained.

Reported on the training steps and the held-out data: `loss` (L, its cross-entropies without
z-loss), the model's own `lm_loss` and `lm_accuracy`, each head's `head<k>_loss` and
`head<k>_accuracy` (top-1: the head's argmax is its target), and `accepted_length`, the tokens one
forward would write if each head's guess were kept while the guesses before it were:
1 + sum_k prod_{j<=k} a_j, with a_j head j's accuracy. It treats the heads' hits as independent
(where head 1 is right, head 2 is more likely right than on average), and counts top-1 guesses only;
a tree of several candidates per head (`chat --draft medusa`) keeps more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ligertune.data import Batch, PaddedBatch
from ligertune.objectives.base import MicroBatchLoss
from ligertune.objectives.normalization import step_token_weights
from ligertune.objectives.sft import attention_of, conversation_ids
from ligertune.recipe import LossConfig


@dataclass(frozen=True)
class MedusaOptions:
    """What the Medusa objective reads of the recipe's `objective` section."""

    heads: int
    head_weights: tuple[float, ...]
    """lambda_k, the weight of head k's loss (k = 1..K)."""
    lm_weight: float
    """The weight of the model's own next-token loss; 0 when the backbone is frozen (not trained)."""
    frozen: bool


def head_targets(targets: torch.Tensor, conversations: torch.Tensor, ahead: int, *,
                 ignore_index: int = -100) -> torch.Tensor:
    """The targets `ahead` places later in the same conversation: out[t] = targets[t + ahead] where
    token t + ahead belongs to t's conversation, else `ignore_index`. `targets` and `conversations`
    (the conversation of each token, `conversation_ids`) are read flattened; out has targets' shape."""
    flat, ids = targets.reshape(-1), conversations.reshape(-1)
    out = torch.full_like(flat, ignore_index)
    if 0 < ahead < flat.numel():
        same = ids[ahead:] == ids[:-ahead]
        out[:-ahead] = torch.where(same, flat[ahead:], torch.full_like(flat[ahead:], ignore_index))
    elif ahead == 0:
        out = flat.clone()
    return out.reshape(targets.shape)


def all_head_targets(batch: Batch | PaddedBatch, heads: int, *, ignore_index: int = -100) -> torch.Tensor:
    """[K, *targets.shape]: row k - 1 holds head k's targets (`head_targets`, k places ahead)."""
    ids = conversation_ids(batch)
    return torch.stack([head_targets(batch.targets, ids, k, ignore_index=ignore_index)
                        for k in range(1, heads + 1)])


def accepted_length(accuracies: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: the tokens a forward writes when head k's top guess is kept while
    it and every head before it are right, the heads' hits taken as independent."""
    total, chain = 1.0, 1.0
    for a in accuracies:
        chain *= a
        total += chain
    return total


class Medusa:
    """K shifted cross-entropy heads over the model's last hidden state (module docstring)."""

    name = "medusa"
    trained_tokens = "lm_tokens"
    units = None

    def __init__(self, loss: LossConfig, options: MedusaOptions):
        self.loss = loss
        self.options = options
        per_head = [(f"head{k}_loss", f"head{k}_correct", f"head{k}_tokens") for k in range(1, options.heads + 1)]
        self.sums = ("loss", "lm_loss", "lm_correct", "lm_tokens", *(name for names in per_head for name in names))
        self.held_out = ("loss", "lm_loss", "lm_accuracy",
                         *(name for k in range(1, options.heads + 1) for name in (f"head{k}_loss", f"head{k}_accuracy")),
                         "accepted_length")

    def prepare_step(self, engine: nn.Module, batches: Sequence[Batch | PaddedBatch]
                     ) -> list[Batch | PaddedBatch]:
        return list(batches)  # the token weights are all the step needs

    def step_weights(self, batches: Sequence[Batch | PaddedBatch]) -> list[torch.Tensor]:
        """Each micro-batch's weights as [1 + K, *targets.shape]: row 0 the model's own next-token
        weights (SFT's), row k head k's, each counted over its own targets in the whole step."""
        ids = [conversation_ids(b) for b in batches]
        rows = [step_token_weights([b.targets for b in batches], ids, self.loss.normalization,
                                   ignore_index=self.loss.ignore_index)]
        for k in range(1, self.options.heads + 1):
            shifted = [head_targets(b.targets, i, k, ignore_index=self.loss.ignore_index) for b, i in zip(batches, ids)]
            rows.append(step_token_weights(shifted, ids, self.loss.normalization, ignore_index=self.loss.ignore_index))
        return [torch.stack(per_batch) for per_batch in zip(*rows)]

    def forward(self, engine: nn.Module, batch: Batch | PaddedBatch, weights: torch.Tensor) -> MicroBatchLoss:
        return self.loss_of(engine, batch.input_ids, batch.position_ids, batch.targets, weights,
                            conversation_ids(batch), **attention_of(batch))

    def loss_of(self, engine: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                targets: torch.Tensor, weights: torch.Tensor, conversations: torch.Tensor,
                **attention) -> MicroBatchLoss:
        """The loss and sums of a micro-batch's tokens under `attention` (`attention_of`, or another
        for a check), the heads' targets shifted inside the `conversations` (`conversation_ids`)."""
        heads = torch.stack([head_targets(targets, conversations, k, ignore_index=self.loss.ignore_index)
                             for k in range(1, self.options.heads + 1)])
        out = engine(input_ids, position_ids, targets, weights[0], medusa_targets=heads, medusa_weights=weights[1:],
                     **attention)
        loss = sum(w * head.loss for w, head in zip(self.options.head_weights, out.heads))
        reported = sum(w * (head.loss.detach() - head.z_loss) for w, head in zip(self.options.head_weights, out.heads))
        if not self.options.frozen:
            loss = loss + self.options.lm_weight * out.lm.loss
            reported = reported + self.options.lm_weight * (out.lm.loss.detach() - out.lm.z_loss)
        sums = {"loss": reported.float(), "lm_loss": (out.lm.loss.detach() - out.lm.z_loss).float(),
                "lm_correct": out.lm.n_correct, "lm_tokens": out.lm.n_tokens}
        for k, head in enumerate(out.heads, start=1):
            sums[f"head{k}_loss"] = (head.loss.detach() - head.z_loss).float()
            sums[f"head{k}_correct"] = head.n_correct
            sums[f"head{k}_tokens"] = head.n_tokens
        return MicroBatchLoss(loss, sums)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        metrics = {"loss": sums["loss"], "lm_loss": sums["lm_loss"],
                   "lm_accuracy": sums["lm_correct"] / max(sums["lm_tokens"], 1)}
        accuracies = []
        for k in range(1, self.options.heads + 1):
            accuracy = sums[f"head{k}_correct"] / max(sums[f"head{k}_tokens"], 1)
            metrics[f"head{k}_loss"] = sums[f"head{k}_loss"]
            metrics[f"head{k}_accuracy"] = accuracy
            accuracies.append(accuracy)
        metrics["accepted_length"] = accepted_length(accuracies)
        return metrics
