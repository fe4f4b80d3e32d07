"""Helpers shared by the kernel tests."""

from __future__ import annotations

import os

import torch

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
"""Where the tensors live: the CPU under Triton's interpreter, else CUDA (compiled kernels)."""


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| over the whole tensor, in float64."""
    a, b = actual.double(), expected.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
