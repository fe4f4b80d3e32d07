"""The throughput a run reports: tokens, the objective's units (pairs, examples) and model flops over
the wall clock of a logging window."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ligertune.devices import synchronize

Clock = Callable[[], float]


@dataclass(frozen=True)
class Rates:
    """What a logging window ran at."""

    tokens_per_s: float  # real (non-padding) tokens through the model
    trained_tokens_per_s: float  # supervised tokens
    mfu: float | None  # model flops per second over the peak; None when the peak is unknown
    units_per_s: float = 0.0  # the objective's units (`Objective.units`: preference pairs, KTO examples)


class Throughput:
    """Tokens, units and model flops per second over a logging window.

    Wall clock with the device synchronized at both ends of the window (so the GPU's queued work is
    counted, not the host's launching of it), minus the time spent in evaluation and checkpoints,
    which is measured apart (`excluded`). `peak_tflops` is the peak of all the devices that do
    the window's work together (`ligertune.flops`).
    """

    def __init__(self, device: torch.device, clock: Clock = time.perf_counter, *, peak_tflops: float | None = None):
        self.device, self.clock, self.peak_tflops = device, clock, peak_tflops
        self.start()

    def start(self) -> None:
        synchronize(self.device)
        self._start, self._excluded = self.clock(), 0.0
        self.real_tokens = self.trained_tokens = self.units = 0
        self.flops = 0.0

    def add(self, real_tokens: int, trained_tokens: int, flops: float = 0.0, units: int = 0) -> None:
        self.real_tokens += real_tokens
        self.trained_tokens += trained_tokens
        self.flops += flops
        self.units += units

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

    def lap(self) -> Rates:
        """The rates of the window so far; a new window starts."""
        synchronize(self.device)
        elapsed = max(self.clock() - self._start - self._excluded, 1e-9)
        mfu = self.flops / elapsed / (self.peak_tflops * 1e12) if self.peak_tflops else None
        rates = Rates(self.real_tokens / elapsed, self.trained_tokens / elapsed, mfu, self.units / elapsed)
        self.start()
        return rates
