"""The work of a training step in floating-point operations, and the peak rates MFU divides it by.

For a decoder with L layers of H attention heads of size D, a step over sequences of lengths n_s
(T = sum_s n_s tokens) costs

    flops = (4 P + 2 P_train) T + 6 L H D sum_s n_s^2

P counts the weights of every linear layer (in x out: the projections, the MLP, the output layer;
an embedding lookup is no matmul), P_train those of them that are trained. Per token and weight, the
forward costs 2 flops, the gradient with respect to the layer's input 2 more, and the gradient of the
weight 2 more where the weight is trained: 6 P T for full fine-tuning, about 4 P T for LoRA, whose
frozen base computes no weight gradient. The second term is causal attention (QK^T and AV, forward
and backward) within each sequence. Recomputation under gradient checkpointing is overhead, not the
model's work, and is not counted.

MFU is that over the seconds taken and the device's dense bf16 peak from its data sheet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ligertune.models.float8 import Float8FrozenLinear

PEAK_BF16_TFLOPS = (
    # (substring of the device name, dense bf16 TFLOP/s from the data sheet); first match wins.
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("4090", 165.0),
)


def spec_peak_tflops(device_name: str) -> float | None:
    """The data-sheet dense bf16 TFLOP/s of a known GPU, by its name; None when unknown."""
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def device_peak_tflops(device: torch.device) -> float | None:
    """`spec_peak_tflops` of a CUDA device; None on other devices."""
    if device.type != "cuda":
        return None
    return spec_peak_tflops(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class StepFlops:
    """What the module docstring's formula needs to know of a model."""

    matmul_params: int  # P
    trained_matmul_params: int  # P_train
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, model: nn.Module) -> StepFlops:
        config = model.config
        matmul = trained = 0
        for module in model.modules():
            # bitsandbytes' 4- and 8-bit layers are nn.Linear too; a float8 frozen layer never trains
            if isinstance(module, (nn.Linear, Float8FrozenLinear)):
                weights = module.in_features * module.out_features
                matmul += weights
                trained += weights if isinstance(module, nn.Linear) and module.weight.requires_grad else 0
        heads = int(config.num_attention_heads)
        return cls(
            matmul_params=matmul,
            trained_matmul_params=trained,
            layers=int(config.num_hidden_layers),
            heads=heads,
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        )

    def __call__(self, tokens: int, sum_sq_seq_lens: int) -> float:
        """The flops of a step over `tokens` tokens in sequences whose squared lengths sum to `sum_sq_seq_lens`."""
        weights = (4.0 * self.matmul_params + 2.0 * self.trained_matmul_params) * tokens
        return weights + 6.0 * self.layers * self.heads * self.head_dim * sum_sq_seq_lens
