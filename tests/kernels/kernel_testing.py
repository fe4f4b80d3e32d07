"""Helpers shared by the kernel tests."""

from __future__ import annotations

import os

from ligertune.numerics import relative_error

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
"""Where the tensors live: the CPU under Triton's interpreter, else CUDA (compiled kernels)."""

rel_err = relative_error
"""||actual - expected|| / ||expected|| over the whole tensor, in float64 (NaN when `actual` is not finite)."""
