"""A run's position: which optimizer step comes next, and which packs it takes.

The order of the packs depends only on `(seed, epoch)` (`ligertune.data.shuffled`), so the data
position is two numbers: the epoch, and the index of the next pack in that epoch's order. A step
takes the next `n` packs of that stream, running on into the next epoch when one ends, so that
every pack is used exactly once per epoch whatever the step size. The position means the same
packs only over the same data: `ligertune.data.packs_digest` tells (a checkpoint keeps it).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from ligertune.data import Pack, shuffled


@dataclass
class RunState:
    """Everything about a run's progress that is not a tensor of the model or the optimizer."""

    step: int = 0
    """Optimizer steps done (0 before the first)."""
    epoch: int = 0
    """The epoch of the next pack."""
    index: int = 0
    """Position of the next pack in that epoch's shuffled order."""
    skipped_steps: int = 0
    """Steps whose update was dropped (a non-finite loss or gradient, or a skipped spike), over the whole run."""
    consecutive_skips: int = 0
    """Skipped steps in a row up to now (reset by a good step)."""
    spikes: int = 0
    """Steps whose loss the spike watch flagged (`ligertune.training.spikes`), over the whole run."""
    recent_losses: list[float] = field(default_factory=list)
    """The spike watch's window: the last `train.spike_window` finite step losses, oldest first (saved
    with the run, so that a resumed run judges its steps against the same losses)."""
    last_loss: float | None = None
    """The loss of the last step that updated the model (the summary's final train loss)."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """Every held-out loss of the run so far, as (step, loss)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunState":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        state = cls(**known)
        state.eval_losses = [tuple(x) for x in state.eval_losses]
        return state


class PackStream:
    """The packs of each epoch in their shuffled order, taken a step at a time from a `RunState`."""

    def __init__(self, packs: Sequence[Pack], seed: int):
        if not packs:
            raise ValueError("no packs to train on")
        self.packs = packs
        self.seed = seed
        self._epoch: int | None = None
        self._order: list[Pack] = []

    def order(self, epoch: int) -> list[Pack]:
        if epoch != self._epoch:  # one shuffle per epoch, not per step
            self._epoch, self._order = epoch, shuffled(self.packs, seed=self.seed, epoch=epoch)
        return self._order

    def take(self, state: RunState, n: int) -> list[Pack]:
        """The next `n` packs, advancing `state.epoch` and `state.index`."""
        taken: list[Pack] = []
        while len(taken) < n:
            order = self.order(state.epoch)
            chunk = order[state.index : state.index + n - len(taken)]
            taken.extend(chunk)
            state.index += len(chunk)
            if state.index >= len(order):
                state.epoch, state.index = state.epoch + 1, 0
        return taken


def first_epoch_steps(packs: Sequence[Pack], seed: int, per_step: int) -> list[list[Pack]]:
    """The packs of every step of the first epoch, as a run takes them from a fresh `RunState`:
    ceil(P / per_step) steps for P packs, the last one completed from the second epoch's order."""
    stream, state = PackStream(packs, seed), RunState()
    return [stream.take(state, per_step) for _ in range(math.ceil(len(packs) / per_step))]


def capture_rng() -> dict[str, Any]:
    """The random states a run draws from (Python, torch CPU and every CUDA device)."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
