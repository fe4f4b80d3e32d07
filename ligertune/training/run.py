"""A training run and its sibling types: what `setup` builds, what a step reports, how a run ends.

This module sits low: it imports its fields' types for annotations only, so that the step, the
checkpoint, evaluation and the loop can all import it without a loop between them.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ligertune.distributed import Topology
from ligertune.errors import EnvironmentFault
from ligertune.flops import StepFlops
from ligertune.training.outputs import Outputs
from ligertune.training.state import PackStream, RunState

if TYPE_CHECKING:
    from ligertune.data import Batch, Pack, PaddedBatch
    from ligertune.models import CausalLMLoss
    from ligertune.objectives import Objective
    from ligertune.recipe import Recipe
    from ligertune.training.build import TrainingData
    from ligertune.training.memory import CheckpointPlanner, InputOffload
    from ligertune.training.spikes import Spike
    from ligertune.training.throughput import Throughput


@dataclass
class Run:
    """Everything a run holds: what its step runs, the data it takes, where it writes, its state.

    `ligertune.training.build.build_run` makes the part a step needs (the model, loss head,
    optimizer, schedule and checkpointing plan); `setup` adds the data and the outputs. `bench step`
    times the same step on a run without data or outputs of its own.
    """

    recipe: Recipe
    device: torch.device
    model: torch.nn.Module
    head: CausalLMLoss
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    topology: Topology = field(default_factory=Topology)
    engine: torch.nn.Module | None = None
    """What forward and backward go through: the head, or its data-parallel wrapper."""
    checkpointing: CheckpointPlanner | int | None = None
    """Gradient checkpointing: the layers recomputed, or the planner of `auto` (None: off)."""
    offload: InputOffload | None = None
    """Parks checkpointed layers' inputs in host memory while enabled (`train.activation_offload`)."""
    state: RunState = field(default_factory=RunState)

    # the data
    tokenizer: object = None
    data: TrainingData | None = None
    stream: PackStream | None = None
    step_packs: list[Pack] = field(default_factory=list)
    """Every pack of the step under way, all ranks' (what a spike record lists)."""
    prefetched: tuple[tuple, list[Batch | PaddedBatch]] | None = None
    """The next step's micro-batches, made ahead (`step.prefetch_batches`), with the data position
    they start at."""

    # the outputs
    output_dir: Path | None = None
    out: Outputs = field(default_factory=Outputs.inert)
    meter: Throughput | None = None
    resume_command: str = "ligertune train RECIPE --resume"

    trainable: list[torch.nn.Parameter] = field(init=False)
    """The parameters the optimizer updates (listed once: the step clips them every time)."""
    step_flops: StepFlops = field(init=False)

    def __post_init__(self) -> None:
        if self.stream is None and self.data is not None:
            self.stream = PackStream(self.data.train_packs, self.recipe.train.seed)
        if self.engine is None:
            self.engine = self.head
        # The head's: the model's and any trained with it (Medusa heads), as the optimizer holds them.
        self.trainable = [p for p in self.head.parameters() if p.requires_grad]
        self.step_flops = StepFlops.of(self.model)

    @property
    def console(self):
        return self.out.console

    @property
    def eval_examples(self):
        return self.data.eval_examples

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        return self.state.eval_losses


@dataclass
class StepStats:
    """One optimizer step: its metrics (the objective's, `loss` first), tokens and update."""

    metrics: dict[str, float]
    """The objective's summary of the step (`Objective.summarize`): `loss`, then its own."""
    tokens: int
    """Trained tokens (the objective's `trained_tokens`)."""
    real_tokens: int
    """Non-padding tokens that went through the model."""
    units: int
    """The objective's units trained (`Objective.units`: pairs, KTO examples; 0 where it has none)."""
    flops: float
    """The step's model flops (`ligertune.flops`), every rank's together."""
    lr: float
    grad_norm: float
    """The norm over every gradient before clipping."""
    skipped: str | None = None
    """Why the update was dropped ("nonfinite", or "spike" with `train.on_spike: skip`), or None."""
    clipped: int = 0
    """Gradient tensors that clipping scaled down (0: it did not act; `global` clips all or none)."""
    spike: Spike | None = None
    """The spike watch's finding on this step's loss."""
    news: str | None = None
    """What the checkpointing planner decided on this step, to print."""

    @property
    def loss(self) -> float:
        return self.metrics["loss"]


@dataclass
class TrainResult:
    """What a finished run left behind and how it went."""

    output_dir: Path
    final_dir: Path
    steps: int
    train_loss: float | None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: tuple[str, str, str] | None = None
    skipped_steps: int = 0
    spikes: int = 0


class RunInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run after a complete step and a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: Path, command: str):
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        name = signal.Signals(signum).name
        super().__init__(f"{name}: stopped after step {step}, checkpoint {checkpoint}; resume with: {command}")


class TrainingDiverged(EnvironmentFault):
    """Too many consecutive steps with a non-finite loss or gradient."""
