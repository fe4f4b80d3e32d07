"""The Triton implementations of the public kernels, one import per kernel family.

`ligertune.kernels` dispatches here on CUDA; importing this module imports Triton.
"""

from __future__ import annotations

from ligertune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy"]
