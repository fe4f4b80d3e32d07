"""AdamW with decoupled weight decay on matrices only, and the warmup + decay schedule."""

from __future__ import annotations

import math

import torch

from ligertune.recipe import OptimConfig


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; norms, biases and other vectors get no weight decay.

    The fused CUDA implementation is used when every parameter lives on CUDA.
    """
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    fused = all(p.is_cuda for _, p in params) and bool(params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


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


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
