"""The Triton implementations of the public kernels, one import per kernel family.

`ligertune.kernels` dispatches here on CUDA; importing this module imports Triton.
"""

from __future__ import annotations

from ligertune.kernels.cross_entropy import fused_linear_cross_entropy
from ligertune.kernels.divergence import fused_linear_divergence
from ligertune.kernels.float8_rows import quantize_rows, quantize_transposed, transpose_float8
from ligertune.kernels.glu import geglu, swiglu
from ligertune.kernels.lion import lion_step
from ligertune.kernels.nf4 import dequantize_4bit
from ligertune.kernels.norm import rms_norm
from ligertune.kernels.rope import apply_rope

__all__ = [
    "apply_rope", "dequantize_4bit", "fused_linear_cross_entropy", "fused_linear_divergence", "geglu",
    "lion_step", "quantize_rows", "quantize_transposed", "rms_norm", "swiglu", "transpose_float8",
]
