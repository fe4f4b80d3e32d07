"""The learning-rate schedule: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math

from ligertune.recipe import OptimConfig


def lr_multiplier(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Factor of `cfg.lr` at optimizer step `step` (0-based): linear warmup, then the decay schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
