"""The shapes `ligertune bench kernels` runs: each kernel's dimensions, its default shapes on a GPU
and on a CPU, and the `--shapes KERNEL:AxBx...` option that replaces them."""

from __future__ import annotations

import re

from ligertune.errors import UserError

KERNELS = ("flce", "divergence", "kl", "rms_norm", "rope", "swiglu", "geglu", "lion")

DEFAULT_KERNELS = ("flce", "divergence", "kl", "rms_norm", "rope", "swiglu", "geglu")
"""What `bench kernels` runs unless told: the Lion step is asked for by name (`-k lion`), since its
8B problem alone takes 60 GiB."""

FLOP_RATED = ("flce", "divergence", "kl")
"""The kernels rated in TFLOP/s (their work is GEMMs); the others move memory and are rated in GB/s."""

SHAPE_DIMS = {
    "flce": ("N", "H", "V"),
    # The student's and the teacher's tokens, hidden size (the same for both) and vocabulary.
    "divergence": ("N", "H", "V"),
    "kl": ("N", "H", "V"),
    "rms_norm": ("T", "H"),
    "rope": ("B", "L", "Hq", "Hk", "D"),
    "swiglu": ("T", "I"),
    "geglu": ("T", "I"),
    # The parameters of a Llama-style decoder (`problems.lion_shapes`): layers, hidden, MLP width,
    # vocabulary, embedding matrices (1: the output layer tied to the input one; 2: untied).
    "lion": ("L", "H", "I", "V", "E"),
}
"""Names of each kernel's dimensions, in the order `--shapes` gives them."""

GPU_SHAPES = {
    # Llama-3-8B, a 2k-hidden model at twice the tokens, Qwen2.5-7B: tokens x hidden x vocabulary.
    "flce": [(8192, 4096, 128256), (16384, 2048, 128256), (4096, 3584, 152064)],
    # The fused loss's shapes, for the student and for the teacher.
    "divergence": [(8192, 4096, 128256), (16384, 2048, 128256), (4096, 3584, 152064)],
    "kl": [(8192, 4096, 128256), (16384, 2048, 128256), (4096, 3584, 152064)],
    # 4 x 4096 tokens of a Llama-3-8B layer.
    "rms_norm": [(16384, 4096)],
    "rope": [(4, 4096, 32, 8, 128)],
    "swiglu": [(16384, 14336)],
    # 4 x 4096 tokens of a Gemma-2-9B layer.
    "geglu": [(16384, 14336)],
    # Llama-3.2-1B (1.24e9 parameters in 146 tensors) and Llama-3.1-8B (8.03e9 in 291): bf16
    # parameters and gradients with a float32 momentum take 9.2 and 59.8 GiB (an H100 has 79).
    "lion": [(16, 2048, 8192, 128256, 1), (32, 4096, 14336, 128256, 2)],
}
CPU_SHAPES = {
    # Odd sizes on purpose: no implementation may lean on powers of two.
    "flce": [(257, 192, 4099)],
    "divergence": [(257, 192, 4099)],
    "kl": [(257, 192, 4099)],
    "rms_norm": [(1031, 768)],
    "rope": [(2, 255, 8, 2, 64)],
    "swiglu": [(1031, 1376)],
    "geglu": [(1031, 1376)],
    "lion": [(3, 96, 264, 1031, 2)],
}


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`flce:8192x4096x128256` -> ("flce", (8192, 4096, 128256)); `UserError` for anything else."""
    kernel, sep, dims = text.partition(":")
    kernel = kernel.strip().replace("-", "_")
    if not sep or kernel not in SHAPE_DIMS:
        raise UserError(
            f"--shapes {text!r}: expected KERNEL:AxBx..., KERNEL one of {', '.join(KERNELS)} "
            f"(e.g. flce:8192x4096x128256)"
        )
    names = SHAPE_DIMS[kernel]
    parts = [p for p in re.split(r"[x,]", dims.strip()) if p]
    if len(parts) != len(names) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--shapes {text!r}: {kernel} takes {'x'.join(names)}, positive integers")
    values = tuple(int(p) for p in parts)
    if kernel == "rope" and values[4] % 2:
        raise UserError(f"--shapes {text!r}: the rope head dimension D must be even")
    if kernel == "rope" and values[2] % values[3]:
        raise UserError(f"--shapes {text!r}: Hq must be a multiple of Hk (grouped-query attention)")
    if kernel == "lion" and values[4] not in (1, 2):
        raise UserError(f"--shapes {text!r}: E, the embedding matrices, is 1 (tied) or 2 (untied)")
    return kernel, values


def shape_label(kernel: str, values: tuple[int, ...]) -> str:
    return "-".join(f"{n}{v}" for n, v in zip(SHAPE_DIMS[kernel], values))
