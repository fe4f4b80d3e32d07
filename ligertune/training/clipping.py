"""Gradient clipping, `optim.clip`: one factor for all gradients (`global`) or one per tensor.

With gradients g_i (one per parameter tensor), n_i = ||g_i||_2, the norm over all of them
N = sqrt(sum_i n_i^2) and the limit c (`optim.max_grad_norm`):

    global       g_i <- g_i * min(1, c / (N + 1e-6))          (torch.nn.utils.clip_grad_norm_)
    per_tensor   g_i <- g_i * min(1, c / (n_i + 1e-6))

(the 1e-6 is torch's, so that a zero gradient divides by something). Under FSDP2 a gradient is a
DTensor sharded over the ranks and n_i, N are the norms of the whole tensors, all shards together
(one collective for all tensors), the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from ligertune.distributed import full_tensor
from ligertune.training.precision import local

EPS = 1e-6
"""torch's: the clip factor is c / (norm + EPS)."""


@dataclass
class Clipped:
    """What clipping saw and did, as device tensors (read with the step's one host sync)."""

    norm: torch.Tensor
    """N, the norm over every gradient before clipping."""
    tensors: torch.Tensor
    """How many gradient tensors were scaled down (0: clipping did not act; `global`: all or none)."""


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float | None,
                   mode: Literal["global", "per_tensor"] = "global") -> Clipped:
    """Clip the gradients of `params` in place as `mode` says (nothing with `max_norm` None) and
    return the norm before clipping and the number of tensors clipped."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    limit = math.inf if max_norm is None else max_norm
    if not grads:
        return Clipped(torch.zeros(()), torch.zeros(()))
    if mode == "global":
        norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, limit))
        acted = (limit / (norm + EPS) < 1.0).to(torch.float32) * len(grads)
        return Clipped(norm, acted)
    if mode != "per_tensor":
        raise ValueError(f"clip mode must be global or per_tensor, got {mode!r}")
    # torch._foreach_norm over DTensors gives partial norms; stacked, one collective completes them all.
    norms = full_tensor(torch.stack(torch._foreach_norm(grads))).float()
    factors = (limit / (norms + EPS)).clamp(max=1.0)
    if max_norm is not None:
        shards = [local(g) for g in grads]
        torch._foreach_mul_(shards, [f.to(g.device) for g, f in zip(shards, factors.unbind())])
    return Clipped(torch.linalg.vector_norm(norms), (factors < 1.0).sum())
