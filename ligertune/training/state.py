"""A run's position: which optimizer step comes next, and which packs it takes.

The order of the packs depends only on `(seed, epoch)` (`ligertune.data.shuffled`), so the data
position is two numbers: the epoch, and the index of the next pack in that epoch's order. A step
takes the next `n` packs of that stream, running on into the next epoch when one ends, so that
every pack is used exactly once per epoch whatever the step size.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
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
    """Steps whose update was dropped (a non-finite loss or gradient), over the whole run."""
    consecutive_skips: int = 0
    """Skipped steps in a row up to now (reset by a good step)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunState":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


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
