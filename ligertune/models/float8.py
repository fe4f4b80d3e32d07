"""FP8 training (`train.precision: fp8`): the decoder's linear layers multiply in float8 through
torchao's float8 training, the rest of the step as in bf16.

Each converted layer (torchao's `Float8Linear`) keeps its bf16 weight and, at every forward and
backward, casts its two operands to float8 with a scale computed from their current absolute
maximum (dynamic scaling: e4m3 for activations and weights, e5m2 for gradients), multiplies on the
GPU's float8 tensor cores (`torch._scaled_mm`, H100-class GPUs: compute capability 8.9 or newer)
and returns bf16. `fp8_scaling: tensorwise` takes one scale per tensor (the fastest);
`rowwise` one per row, closer where rows differ in range.

What stays in bf16: the embeddings, the norms, attention, the output projection (read by the fused
linear cross-entropy as one matrix) and the LoRA adapters (small: their GEMMs are not where the time
goes). Under LoRA the frozen base layers inside peft's LoRA layers are converted; the fast LoRA
forward calls them as it calls a plain base layer.

torchao is a dependency of the `fp8` extra (`pip install 'ligertune[fp8]'`): it is the library
PyTorch's own training stack (torchtitan) uses for float8, kept in step with torch's float8 GEMMs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ligertune.errors import UserError
from ligertune.quiet import quiet_optional_libraries

EXTRA = "fp8"
"""The optional dependency group that brings torchao."""
SCALINGS = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
"""Float8 tensor cores: Ada (8.9) and Hopper (9.0) and later."""


def require_torchao() -> Any:
    """The `torchao.float8` module; a `UserError` naming the extra when torchao is missing."""
    quiet_optional_libraries()
    try:
        import torchao.float8
    except ImportError:
        raise UserError(f"train.precision: fp8 needs torchao (the `{EXTRA}` extra): "
                        f"pip install 'ligertune[{EXTRA}]'") from None
    return torchao.float8


def check_float8_device(device: torch.device) -> None:
    """Refuse a device without float8 tensor cores, naming it."""
    if device.type != "cuda":
        raise UserError(f"train.precision: fp8 needs an NVIDIA GPU of compute capability "
                        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (H100, H200, L40S, RTX 4090); "
                        f"this run is on the {device.type.upper()}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(f"train.precision: fp8 needs an NVIDIA GPU of compute capability "
                        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (H100, H200, L40S, RTX 4090); "
                        f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")


def convert_to_float8(model: nn.Module, scaling: str = "tensorwise", *, emulate: bool = False,
                      compiled: bool = False) -> int:
    """Replace the decoder's linear layers of `model` (every `nn.Linear` but the output projection,
    whose sides are multiples of 16 as float8 GEMMs need) by torchao's `Float8Linear`, in place;
    return how many. A GEMM whose inner side is the token count (the weight's gradient) pads it to
    a multiple of 16: packed rows hold any number of tokens.

    `compiled`: each layer's forward and backward through `torch.compile`, which fuses each cast
    (absolute maximum, scale, round) into a kernel or two; run eagerly, a cast is several passes over
    its tensor and a float8 step was measured slower than bf16 (docs/PERF.md). `emulate`: torchao's
    emulation (float8 rounding, high-precision matmuls), which runs anywhere: the tests' CPU path,
    not a speed."""
    if scaling not in SCALINGS:
        raise UserError(f"train.fp8_scaling: must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    float8 = require_torchao()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(scaling), emulate=emulate,
                                 pad_inner_dim=True)
    head = model.get_output_embeddings()
    converted = []

    def chosen(module: nn.Module, name: str) -> bool:
        take = (type(module) is nn.Linear and module is not head
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if take:
            converted.append(name)
        return take

    float8.convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    if compiled:
        for name in converted:
            model.get_submodule(name).compile(dynamic=True)
    return len(converted)


def float8_layers(model: nn.Module) -> int:
    """How many layers of `model` multiply in float8."""
    return sum(type(m).__name__ == "Float8Linear" and type(m).__module__.startswith("torchao.")
               for m in model.modules())
