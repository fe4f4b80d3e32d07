"""Distillation: the trained model (the student) learns a frozen teacher's next-token distributions.

On chat data packed as for supervised fine-tuning, every trained token t (the tokens SFT would
score) gets the loss

    l_t = (1 - alpha) D(P_t || Q_t) + alpha CE_t

with P_t and Q_t the teacher's and the student's next-token distributions at `objective.temperature`,
D the recipe's divergence (`objective.loss`: forward KL, reverse KL or the generalised
Jensen-Shannon divergence) and CE_t the student's cross-entropy of the data's token. The step's loss
is sum_t w_t l_t with SFT's weights w_t (`loss.normalization`, counted over the whole step), so it is
one number whatever the packing, accumulation and world size. The teacher runs on the same packs,
frozen and without gradient; the student's and the teacher's logits meet only chunk by chunk inside
`ligertune.kernels.fused_linear_divergence`, never as [tokens, vocab] tensors.

Reported: the loss, the divergence D, the student's cross-entropy and token accuracy, and the
teacher's, each under the same weights (docs/distill.md).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn

from ligertune.data import Batch, PaddedBatch
from ligertune.kernels import DivergenceOptions, DivergenceOutput
from ligertune.objectives.base import MicroBatchLoss
from ligertune.objectives.normalization import step_token_weights
from ligertune.objectives.sft import attention_of, conversation_ids
from ligertune.recipe import LossConfig


class Teacher:
    """The frozen teacher of a distillation run: `module(input_ids, position_ids, **attention)` gives
    its last hidden states, `output_layer()` its output layer while the student's loss reads it.

    `module` is a `ligertune.models.head.TeacherStates` (sharded like the student under FSDP2: its
    output layer is then gathered for the loss by `unshard()` and freed again by `reshard()`).
    `vocab` is the number of output rows the two models share (the teacher's layer is cut to it when
    it is padded past the student's)."""

    def __init__(self, module: nn.Module, *, vocab: int):
        self.module = module
        self.vocab = vocab

    @contextlib.contextmanager
    def output_layer(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        sharded = hasattr(self.module, "reshard")
        if sharded:
            self.module.unshard()
        try:
            weight, bias = self.module.output_projection()
            yield weight[: self.vocab], None if bias is None else bias[: self.vocab]
        finally:
            if sharded:
                self.module.reshard()


class Distill:
    """Divergence from a frozen teacher, mixed with the student's cross-entropy (module docstring)."""

    name = "distill"
    sums = ("loss", "divergence", "ce", "teacher_ce", "n_correct", "teacher_correct", "n_tokens")
    trained_tokens = "n_tokens"
    units = None
    held_out = ("loss", "divergence", "ce", "token_accuracy", "teacher_ce", "teacher_accuracy")

    def __init__(self, loss: LossConfig, options: DivergenceOptions):
        self.loss = loss
        self.options = options
        self.teacher: Teacher | None = None
        """Set once the teacher is built (`ligertune.training.build.build_run`)."""

    def prepare_step(self, engine: nn.Module, batches: Sequence[Batch | PaddedBatch]
                     ) -> list[Batch | PaddedBatch]:
        return list(batches)  # the token weights are all the step needs

    def step_weights(self, batches: Sequence[Batch | PaddedBatch]) -> list[torch.Tensor]:
        return step_token_weights([b.targets for b in batches], [conversation_ids(b) for b in batches],
                                  self.loss.normalization, ignore_index=self.loss.ignore_index)

    def forward(self, engine: nn.Module, batch: Batch | PaddedBatch, weights: torch.Tensor) -> MicroBatchLoss:
        out = self.loss_of(engine, batch.input_ids, batch.position_ids, batch.targets, weights,
                           **attention_of(batch))
        sums = {"loss": out.loss.detach().float(), "divergence": out.divergence.float(), "ce": out.ce.float(),
                "teacher_ce": out.teacher_ce.float(), "n_correct": out.n_correct,
                "teacher_correct": out.teacher_correct, "n_tokens": out.n_tokens}
        return MicroBatchLoss(out.loss, sums)

    def loss_of(self, engine: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                targets: torch.Tensor, weights: torch.Tensor, **attention) -> DivergenceOutput:
        """The loss of a micro-batch's tokens under `attention` (`attention_of`, or another for a
        check): the teacher's hidden states of the same tokens, then the student's head with the
        teacher's output layer."""
        if self.teacher is None:
            raise ValueError("distillation needs its teacher (Distill.teacher) before the first step")
        teacher_hidden = self.teacher.module(input_ids, position_ids, **attention)
        with self.teacher.output_layer() as (teacher_weight, teacher_bias):
            return engine(input_ids, position_ids, targets, weights, teacher_hidden=teacher_hidden,
                          teacher_weight=teacher_weight, teacher_bias=teacher_bias, divergence=self.options,
                          **attention)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = max(sums["n_tokens"], 1)
        return {"loss": sums["loss"], "divergence": sums["divergence"], "ce": sums["ce"],
                "token_accuracy": sums["n_correct"] / tokens, "teacher_ce": sums["teacher_ce"],
                "teacher_accuracy": sums["teacher_correct"] / tokens}
