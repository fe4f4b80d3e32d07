"""A quantized base for QLoRA: the decoder's linear layers stored in 4 or 8 bits through bitsandbytes.

`model.quantization: nf4` (QLoRA, Dettmers et al. 2023, section 3) stores each weight matrix W of
the decoder's linear layers as 4-bit codes, one per weight, and one scale per block of 64 weights:

    W[i] ~ absmax_b * NF4[code_i],   absmax_b = max_{j in block b} |W[j]|

where NF4 are the 16 quantiles of a normal distribution scaled to [-1, 1] (the weights of a trained
layer are about normal). The float32 scales are themselves quantized to 8 bits per block of 256
(double quantization), so a weight costs about 0.52 bytes instead of 2 in bf16. Forward and
backward dequantize a layer's weight to `model.dtype` and multiply at that precision: only the
stored weight is approximate. `int8` is LLM.int8() (Dettmers et al. 2022): W[r, :] ~ SCB[r] / 127 *
CB[r, :] with int8 codes CB and one scale SCB per output row (1 byte a weight); activations are
cast to float16 and multiplied in int8 too, except their outlier columns (|x| > 6), which multiply
the dequantized weight in float16.

What stays in `model.dtype`, unquantized: the embeddings, the norms and the output projection (tied
to the input embedding or not), so that the fused linear cross-entropy reads one plain weight
matrix; and the LoRA adapters that train over the frozen quantized layers (float32, peft's default).

A pretrained model is quantized tensor by tensor as `from_pretrained` loads it (a `transformers`
`BitsAndBytesConfig`: the full-precision model never sits on the device); a model built from a
config, with random weights, is built in `model.dtype` and its layers are replaced one by one
(`quantize_linears`), with the same bitsandbytes settings: both give the same stored weights.

Either way the 4-bit layers of a block that read one input (q, k, v; gate, up) are then joined, and
the others stand alone (`Nf4Siblings`): where the fast LoRA forward runs over them, a group's weights
are dequantized side by side in one pass (`ligertune.kernels.dequantize_4bit`), each layer multiplied
by its own rows, and the input's gradient summed over the group in GEMM epilogues.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ligertune.errors import UserError
from ligertune.kernels import BlockScales, dequantize_4bit
from ligertune.models.float8 import Float8FrozenLinear
from ligertune.models.lora import join_base_layers
from ligertune.quiet import quiet_optional_libraries

QUANTIZATIONS = ("nf4", "int8")
"""The values of `model.quantization`."""
INT8_THRESHOLD = 6.0
"""LLM.int8()'s outlier threshold: activation columns with a magnitude above it multiply in float16."""
EXTRA = "qlora"
"""The optional dependency group (`pip install 'ligertune[qlora]'`) that brings bitsandbytes."""
def require_bitsandbytes(kind: str) -> Any:
    """The `bitsandbytes` module; a `UserError` naming the extra to install when it is missing."""
    quiet_optional_libraries()
    try:
        import bitsandbytes
    except ImportError:
        raise UserError(
            f"model.quantization: {kind} needs bitsandbytes (the `{EXTRA}` extra): "
            f"pip install 'ligertune[{EXTRA}]'"
        ) from None
    return bitsandbytes


def bnb_config(kind: str, dtype: torch.dtype):
    """The `transformers.BitsAndBytesConfig` of `quantize_linears`: NF4 with double quantization and
    `dtype` compute, or LLM.int8() with its outlier threshold. The output projection is left out by
    `transformers` itself (it keeps the output embedding, and anything tied to it, unquantized)."""
    from transformers import BitsAndBytesConfig

    require_bitsandbytes(kind)
    if kind == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
                                  bnb_4bit_quant_storage=torch.uint8)
    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_THRESHOLD)
    raise UserError(f"model.quantization: must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")


def quantize_linears(model: nn.Module, kind: str, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` of a `transformers` model but its output projection by the
    bitsandbytes layer of `kind` holding the quantized weight, on the weight's device; return how many.

    The layers are replaced one at a time, so the memory of the full-precision weights is given back
    as it goes. The model is marked `is_loaded_in_4bit` / `is_loaded_in_8bit`, as `from_pretrained`
    marks it, which is how peft knows to put its LoRA layers for bitsandbytes around them.
    """
    bnb = require_bitsandbytes(kind)
    if kind not in QUANTIZATIONS:
        raise UserError(f"model.quantization: must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
    names = [name for name in quantized_layer_names(model) if type(model.get_submodule(name)) is nn.Linear]
    for name in names:
        linear = model.get_submodule(name)
        model.set_submodule(name, _quantized(bnb, linear, kind, dtype))
    setattr(model, "is_loaded_in_4bit" if kind == "nf4" else "is_loaded_in_8bit", True)
    settle_quantized(model)
    return len(names)


def settle_quantized(model: nn.Module) -> None:
    """What a model gets once its layers are quantized (by `quantize_linears`, or as it loads): its
    4-bit weights kept in their layout (`keep_cpu_layout`), its 4-bit siblings joined
    (`join_nf4_siblings`)."""
    keep_cpu_layout(model)
    join_nf4_siblings(model)


def keep_cpu_layout(model: nn.Module) -> None:
    """Keep every 4-bit weight in the layout it was quantized in.

    On a CPU with avx512-bf16, bitsandbytes repacks a 4-bit weight in place for its CPU kernel the
    first time the layer runs in eval mode without gradients: evaluation would change the weight
    that training then reads, and the repacking fails for layers narrower than one block of 64.
    The CPU runs ligertune's tests, not its speed, so the repacking is turned off.
    """
    for module in model.modules():
        if layer_quantization(module) == "nf4":
            module.support_avx512bf16_for_cpu = False


class Nf4Siblings:
    """bitsandbytes NF4 layers that read one input (q, k, v; gate, up), or one such layer alone,
    dequantized as one.

    `weights(dtype)`: the layers' weights dequantized side by side into one buffer of `dtype`
    (`ligertune.kernels.dequantize_4bit`: one pass, each layer into its own rows), a view of its rows
    for each layer, in the order of `layers`. The fast LoRA forward multiplies each layer by its own
    rows, the outputs whole (no column slices of a joined output to copy), and in backward sums the
    input's gradient over the group in GEMM epilogues (`lora._DequantizedProducts`), dequantizing
    again rather than keeping a weight from a step's forward to its backward; a forward recomputed
    under gradient checkpointing leaves its weights in `recomputed` for the backward that follows
    it, which takes them. Each layer alone through bitsandbytes (`MatMul4Bit`, at training sizes)
    takes two kernels a layer to dequantize, and autograd adds the layers' input gradients up in
    x's dtype. The stored weights are untouched."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = tuple(layers)
        self.sizes = [layer.out_features for layer in layers]
        self.recomputed: tuple[torch.Tensor, ...] | None = None
        for layer in layers:
            layer.siblings = self

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether each layer alone would multiply x as it is: in x's dtype, with its NF4 state on the
        weight, in the layout it was quantized in, on x's device."""
        for layer in self.layers:
            state = getattr(layer.weight, "quant_state", None)
            if (state is None or state.quant_type != "nf4" or state.dtype != x.dtype
                    or layer.compute_dtype not in (None, x.dtype) or getattr(state, "packing_format_for_cpu", False)
                    or layer.weight.device != x.device):
                return False
        return True

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[sum of out_features, in_features]: every layer's weight, dequantized, in `dtype`."""
        first = self.layers[0]
        weight = torch.empty(sum(self.sizes), first.in_features, dtype=dtype, device=first.weight.device)
        for layer, rows in zip(self.layers, weight.split(self.sizes)):
            state = layer.weight.quant_state
            dequantize_4bit(layer.weight.data, state.code, block_scales(state), rows)
        return weight

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Each layer's weight, dequantized in `dtype`: the rows of one buffer, in order."""
        return self.dequantized(dtype).split(self.sizes)


def block_scales(state) -> BlockScales:
    """The block scales of a bitsandbytes 4-bit `QuantState`, double-quantized or not."""
    if not state.nested:
        return BlockScales(state.absmax, state.blocksize)
    return BlockScales(state.absmax, state.blocksize, state.state2.code, state.state2.absmax, state.offset,
                       state.state2.blocksize)


def join_nf4_siblings(model: nn.Module) -> int:
    """Make each block's 4-bit q, k and v, and its 4-bit gate and up (bitsandbytes NF4 layers, or
    peft's LoRA layers over them) one `Nf4Siblings` where all are bias-free and read one width on one
    device, and every other bias-free NF4 layer one alone (`lora.join_base_layers`); return how many
    groups of several were joined."""
    return join_base_layers(
        model, lambda layer: (layer_quantization(layer) == "nf4" and layer.bias is None
                              and vars(layer).get("siblings") is None),
        lambda layers, copied=None: Nf4Siblings(layers))  # each output its own tensor: none copied


def _quantized(bnb: Any, linear: nn.Linear, kind: str, dtype: torch.dtype) -> nn.Module:
    """The bitsandbytes layer of `kind` computing `linear` with its weight quantized (frozen)."""
    device, weight = linear.weight.device, linear.weight.detach()
    has_bias = linear.bias is not None
    if kind == "nf4":
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                  compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
        # A Params4bit quantizes itself when it is moved to a device (the CPU included).
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", quant_storage=torch.uint8, module=layer).to(device)
    else:
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                    has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
        # An Int8Params quantizes itself when it is moved from the CPU (as `from_pretrained` loads it).
        layer.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False).to(device)
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return layer


def quantized_layer_names(model: nn.Module) -> list[str]:
    """The names of the layers `quantize_linears` quantizes, or has quantized: every linear layer but
    the output projection (bitsandbytes' layers are `nn.Linear`s too)."""
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head]


def quantization_of(model: nn.Module) -> str | None:
    """`nf4` or `int8` when a layer of `model` holds bitsandbytes-quantized weights, else None."""
    kinds = (layer_quantization(module) for module in model.modules())
    return next((kind for kind in kinds if kind is not None), None)


def parameter_count(model: nn.Module) -> int:
    """The parameters of `model` (a tied weight once), each quantized weight counted as the
    out x in matrix it stands for: bitsandbytes packs two 4-bit codes into each stored byte, and a
    float8 frozen layer holds its weight as a buffer."""
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if layer_quantization(module) is not None:
            total += module.in_features * module.out_features - module.weight.numel()
        elif isinstance(module, Float8FrozenLinear):
            total += module.weight.numel()
    return total


def layer_quantization(module: nn.Module) -> str | None:
    """The quantization of a bitsandbytes layer itself (not of peft's LoRA layer of the same name
    around it), told by its class: bitsandbytes need not be importable to ask."""
    cls = type(module)
    if not cls.__module__.startswith("bitsandbytes."):
        return None
    return {"Linear4bit": "nf4", "Linear8bitLt": "int8"}.get(cls.__name__)


def dequantize_weight(layer: nn.Module) -> torch.Tensor:
    """The weight a bitsandbytes layer multiplies by, in float32: absmax_b * NF4[code] for NF4
    (bitsandbytes' own `dequantize_4bit`), SCB[r] / 127 * CB[r, :] for int8."""
    import bitsandbytes as bnb

    weight = layer.weight
    if layer_quantization(layer) == "nf4":
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    codes = weight.CB if getattr(weight, "CB", None) is not None else weight.data
    scales = weight.SCB if getattr(weight, "SCB", None) is not None else layer.state.SCB
    return codes.float() * (scales.float()[:, None] / 127.0)


def dequantize_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every bitsandbytes layer of `model` by an `nn.Linear` holding its dequantized weight in
    `dtype` (the function the quantized layer computes, up to its rounding of the activations), and
    drop the model's quantization marks, so that it saves and loads as a plain model; return how many.
    """
    names = [name for name, module in model.named_modules() if layer_quantization(module) is not None]
    for name in names:
        layer = model.get_submodule(name)
        weight = dequantize_weight(layer)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                           device="meta")
        linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        if layer.bias is not None:
            linear.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
        model.set_submodule(name, linear)
    # What `from_pretrained` (transformers' quantizer) and `quantize_linears` leave on the model.
    for attribute in ("hf_quantizer", "quantization_method", "is_quantized", "is_loaded_in_4bit",
                      "is_loaded_in_8bit"):
        if attribute in vars(model):
            delattr(model, attribute)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    return len(names)
