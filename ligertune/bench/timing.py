"""Timing and memory of one operation: median milliseconds over repeats, and its extra peak memory.

On CUDA each repeat is bracketed by a pair of CUDA events on the current stream, so the time is the
device time of the work the call enqueued (host overhead shows only where it starves the device).
Warm-up calls come first and are not timed: they compile Triton kernels, run autotuning, create
cuBLAS handles and let the caching allocator reserve its blocks. Optionally the L2 cache is flushed
before each repeat by writing a buffer larger than it (outside the timed events), so that an
operation does not find its inputs left in cache by the previous repeat. On a CPU the clock is the
host's wall clock.

Extra peak memory (CUDA only) is measured on one more, separate call:

    extra = max_memory_allocated during the call - memory_allocated right after it

where everything the call leaves alive (its outputs: the loss, the gradients stored in `.grad`)
is still referenced at the second reading. Inputs are allocated before the call and outputs still
exist after it, so `extra` is the transient working memory of the operation alone: the logits
chunk buffer of a fused loss, the whole [N, V] logits of an eager loss, saved activations between
forward and backward. Blocks the caching allocator holds in reserve do not count (allocated, not
reserved, memory is read).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

L2_FLUSH_BYTES = 256 * 2**20
"""Bytes written to evict the L2 cache between repeats: more than the 50-60 MB of an H100/H200's L2."""


@dataclass
class Timing:
    """Milliseconds per call over `repeats` timed calls, and the call's extra peak memory.

    median_ms/min_ms/max_ms: statistics of the timed calls. extra_peak_mib: see the module
    docstring (None off CUDA). clock: "cuda events" or "wall clock".
    """

    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    extra_peak_mib: float | None
    clock: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "repeats": self.repeats,
            "extra_peak_mib": self.extra_peak_mib,
            "clock": self.clock,
        }


def measure(
    fn: Callable[[], Any],
    *,
    device: torch.device | str,
    warmup: int = 2,
    repeats: int = 10,
    flush_l2: bool = False,
    memory: bool = True,
    before_each: Callable[[], None] | None = None,
) -> Timing:
    """Time `fn()` (median over `repeats` calls, after `warmup` untimed ones) and measure its extra memory.

    `before_each` runs before every call, outside the timed region (e.g. to drop the gradients of
    the previous call, so that each call allocates its own instead of accumulating). What `fn`
    returns is dropped after each call, except in the memory call, where it is held until the
    reading after the call.
    """
    device = torch.device(device)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    prepare = before_each or (lambda: None)
    for _ in range(warmup):
        prepare()
        fn()
    if device.type == "cuda":
        times = _cuda_times(fn, prepare, device, repeats, flush_l2)
        extra = _cuda_extra_peak_mib(fn, prepare, device) if memory else None
        clock = "cuda events"
    else:
        times = _wall_times(fn, prepare, repeats)
        extra = None
        clock = "wall clock"
    return Timing(
        median_ms=statistics.median(times),
        min_ms=min(times),
        max_ms=max(times),
        repeats=repeats,
        extra_peak_mib=extra,
        clock=clock,
    )


def _cuda_times(
    fn: Callable[[], Any], prepare: Callable[[], None], device: torch.device, repeats: int, flush_l2: bool
) -> list[float]:
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        for start, end in zip(starts, ends):
            prepare()
            if flush is not None:
                flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def _cuda_extra_peak_mib(fn: Callable[[], Any], prepare: Callable[[], None], device: torch.device) -> float:
    with torch.cuda.device(device):
        prepare()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        kept = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        after = torch.cuda.memory_allocated()
        del kept
    return max(0, peak - after) / 2**20


def _wall_times(fn: Callable[[], Any], prepare: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        prepare()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times
