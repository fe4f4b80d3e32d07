"""Comparing tensors: the one error measure used by tests, `verify-loss` and the benchmarks."""

from __future__ import annotations

import math

import torch


def relative_error(a: torch.Tensor | None, b: torch.Tensor | None, chunk: int = 1 << 24) -> float:
    """||a - b|| / ||b|| over whole tensors, accumulated in float64 a chunk at a time (bounded memory).

    NaN when `a` holds a NaN or an infinity (a broken result must not pass as a small error) or is
    missing; 0 when both are zero; infinity when only `b` is.
    """
    if a is None or b is None:
        return math.nan
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.numel() != b.numel():
        raise ValueError(f"cannot compare {a.numel()} elements with {b.numel()}")
    num = torch.zeros((), dtype=torch.float64, device=b.device)
    den = torch.zeros((), dtype=torch.float64, device=b.device)
    for start in range(0, b.numel(), chunk):
        a_c = a[start : start + chunk].to(b.device, torch.float64)
        b_c = b[start : start + chunk].to(torch.float64)
        num += (a_c - b_c).square().sum()
        den += b_c.square().sum()
    num, den = num.item(), den.item()
    if not math.isfinite(num):
        return math.nan
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)
