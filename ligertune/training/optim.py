"""The learning-rate schedule: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math

from ligertune.recipe import OptimConfig


def warmup_length(cfg: OptimConfig, total_steps: int) -> int:
    """The run's warmup in optimizer steps: `optim.warmup_ratio` of `total_steps` rounded up (0.05 of
    10 steps: 1), else `optim.warmup_steps`; a warmup longer than the run is cut to `total_steps`."""
    if cfg.warmup_ratio > 0:
        # Rounded first so that 0.1 x 30 = 3.0000000000000004 is 3 steps, not 4.
        steps = math.ceil(round(cfg.warmup_ratio * total_steps, 9))
    else:
        steps = cfg.warmup_steps
    return min(steps, total_steps)


def lr_multiplier(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Factor of `cfg.lr` at optimizer step `step` (0-based): linear warmup, then the decay schedule."""
    warmup = warmup_length(cfg, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
