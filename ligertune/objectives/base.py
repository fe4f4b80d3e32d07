"""The seam between the trainer and what a step optimises.

An objective says, and nothing else does:

- what the step's loss needs of the whole step that only the model can tell (`prepare_step`: run
  once per step, before the first forward, with the engine and every micro-batch of the step; KTO's
  reference point z0, a no-grad pass over the step's mismatched completions, all-reduced over the
  ranks); most objectives need nothing there and hand the batches back as they are;
- which per-token weights make the step's loss one number whatever the batching (`step_weights`:
  counted over every micro-batch of the step before the first backward, all-reduced over the ranks);
- the loss of one micro-batch from the model (`forward`: through the fused kernels, never the
  `[tokens, vocab]` logits), with the sums it reports, reduced like the loss;
- what those sums, added over the step's micro-batches and ranks, mean to a person (`summarize`).

The trainer, evaluation, `verify-loss` and `bench step` call an objective through these four
methods only; a new objective is a new module beside `sft.py`, not a branch in the step.

Sums are device tensors (added without a sync); `summarize` receives them as floats, once per step.
`loss` is the one sum every objective reports: the step's optimised loss, as `summarize` corrects it
(SFT reports its cross-entropy, z-loss apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn

from ligertune.data import Batch, PaddedBatch


@dataclass
class MicroBatchLoss:
    """One micro-batch's contribution: the loss to back-propagate and the sums to report."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]


class Objective(Protocol):
    name: str
    sums: tuple[str, ...]
    """The names of the sums `forward` returns, in a fixed order (they travel stacked in one tensor)."""
    trained_tokens: str
    """The sum that counts the step's trained tokens (what `trained_tokens_per_s` is of)."""
    units: tuple[str, str] | None
    """What the run's rate is given in besides tokens: the sum that counts them and their name, the
    record's `<name>_per_s` (("n_pairs", "pairs") for the paired preference losses); None: tokens only."""
    held_out: tuple[str, ...]
    """The metrics of `summarize` reported on held-out data too (as `eval_<name>`)."""

    def prepare_step(self, engine: nn.Module, batches: Sequence[Batch | PaddedBatch]
                     ) -> list[Batch | PaddedBatch]:
        """The step's micro-batches, carrying what the loss of the whole step needs from the model
        before the first backward (computed without gradient over every micro-batch, reduced over
        the ranks, so that it is the same number whatever the batching); the batches as they are for
        an objective that needs nothing (SFT, the paired preference losses)."""
        ...

    def step_weights(self, batches: Sequence[Batch | PaddedBatch]) -> list[torch.Tensor]:
        """Each micro-batch's per-token loss weights for the whole step."""
        ...

    def forward(self, engine: nn.Module, batch: Batch | PaddedBatch, weights: torch.Tensor) -> MicroBatchLoss:
        """The loss and the sums of one micro-batch, run through `engine` (the loss head, or its
        data-parallel wrapper)."""
        ...

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's metrics from its sums (every micro-batch and rank added): `loss` first."""
        ...
