"""The throughput a run reports: tokens over the wall clock of a logging window."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

from ligertune.devices import synchronize

Clock = Callable[[], float]


class Throughput:
    """Tokens per second over a logging window.

    Wall clock with the device synchronized at both ends of the window (so the GPU's queued work is
    counted, not the host's launching of it), minus the time spent in evaluation and checkpoints,
    which is measured apart (`excluded`).
    """

    def __init__(self, device: torch.device, clock: Clock = time.perf_counter):
        self.device, self.clock = device, clock
        self.start()

    def start(self) -> None:
        synchronize(self.device)
        self._start, self._excluded = self.clock(), 0.0
        self.real_tokens = self.trained_tokens = 0

    def add(self, real_tokens: int, trained_tokens: int) -> None:
        self.real_tokens += real_tokens
        self.trained_tokens += trained_tokens

    @contextlib.contextmanager
    def excluded(self) -> Iterator[dict]:
        """Time the block apart from the window; its seconds land in the yielded dict's `seconds`."""
        synchronize(self.device)
        began = self.clock()
        timing: dict = {}
        try:
            yield timing
        finally:
            synchronize(self.device)
            timing["seconds"] = self.clock() - began
            self._excluded += timing["seconds"]

    def lap(self) -> tuple[float, float]:
        """(real tokens/s, trained tokens/s) of the window so far; a new window starts."""
        synchronize(self.device)
        elapsed = max(self.clock() - self._start - self._excluded, 1e-9)
        rates = self.real_tokens / elapsed, self.trained_tokens / elapsed
        self.start()
        return rates
