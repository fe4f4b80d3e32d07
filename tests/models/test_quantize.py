"""The quantized base of QLoRA: what is stored, what is left unquantized, and the two ways in.

The oracles are the formats' definitions: NF4 codes are the nearest of the 16 values published with
QLoRA, times the block's absolute maximum; LLM.int8() codes are round(127 w / max|w_row|). Widths
are multiples of 64: bitsandbytes' CPU kernel (0.50) dequantizes a 4-bit block that straddles two
rows with the wrong scale, which no real model's layer width (a multiple of 64) meets.
"""

from __future__ import annotations

import importlib.util
import copy
import json
import sys

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ligertune.errors import UserError
from ligertune.models import build_model
from ligertune.models.quantize import (
    dequantize_linears,
    dequantize_weight,
    layer_quantization,
    parameter_count,
    quantization_of,
    quantize_linears,
)
from ligertune.numerics import relative_error
from ligertune.recipe import ModelConfig

needs_bitsandbytes = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed (pip install 'ligertune[qlora]')",
)

# The NF4 data type, QLoRA (Dettmers et al. 2023), appendix E.
NF4 = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])
BLOCK = 64

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 128}
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down

# Forward of the quantized model against the same model with the dequantized weights, relative error
# of the logits: NF4 multiplies by exactly the dequantized weight; LLM.int8() also rounds the
# activations to int8 (through float16), about 1/127 of each row's largest value.
KINDS = [pytest.param("nf4", 1e-5, id="nf4"), pytest.param("int8", 3e-2, id="int8")]


class TwoLayers(nn.Module):
    """A linear layer to quantize and an output projection to leave alone."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)
        self.head = nn.Linear(out_features, 11, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x))


def tiny(**fields) -> nn.Module:
    return build_model(ModelConfig(config={**TINY, **fields}, attention="sdpa"), device="cpu",
                       dtype=torch.float32, seed=3).eval()


@needs_bitsandbytes
@pytest.mark.parametrize("shape", [(37, 192), (3, 64), (128, 128)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_nf4_stores_the_nearest_nf4_value_of_each_block_of_64(shape):
    torch.manual_seed(0)
    model = TwoLayers(*shape)
    weight = model.proj.weight.detach().clone()
    quantize_linears(model, "nf4", torch.float32)
    stored = dequantize_weight(model.proj).reshape(-1, BLOCK)

    blocks = weight.reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    nearest = NF4[(blocks / absmax).unsqueeze(-1).sub(NF4).abs().argmin(dim=-1)]
    # The block's extreme weight is stored as +-1 times the block's scale: that recovers the scale,
    # which is itself stored in 8 bits (double quantization), so close to absmax but not equal.
    scale = stored.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(stored / scale, nearest, rtol=0, atol=1e-6)
    torch.testing.assert_close(scale, absmax, rtol=2e-3, atol=0)


@needs_bitsandbytes
@pytest.mark.parametrize("shape", [(37, 192), (5, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_stores_each_row_scaled_to_127(shape):
    torch.manual_seed(1)
    model = TwoLayers(*shape)
    weight = model.proj.weight.detach().clone().half().float()  # bitsandbytes quantizes from float16
    quantize_linears(model, "int8", torch.float32)
    stored = dequantize_weight(model.proj)

    row_max = weight.abs().amax(dim=1, keepdim=True)
    expected = torch.round(weight * 127 / row_max) * row_max / 127
    step = row_max / 127
    # Round to nearest: at most a code apart where the scaling rounds a tie the other way, rarely.
    assert ((stored - expected).abs() <= step * 1.001).all()
    assert ((stored - expected).abs() > step / 2).float().mean() < 0.01


@needs_bitsandbytes
@pytest.mark.parametrize("kind, tolerance", KINDS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_only_the_decoder_linears_are_quantized(kind, tolerance, tied):
    model = tiny(tie_word_embeddings=tied)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    count = parameter_count(model)
    ids = torch.randint(0, TINY["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(0))

    assert quantize_linears(model, kind, torch.float32) == LINEARS_PER_LAYER * TINY["num_hidden_layers"]
    assert quantization_of(model) == kind
    assert parameter_count(model) == count  # a quantized weight counts as the matrix it stands for
    # The output projection (what the fused loss reads), embeddings and norms: untouched.
    assert type(model.lm_head) is nn.Linear
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for name, p in model.named_parameters():
        if "norm" in name or "embed" in name or "lm_head" in name:
            assert torch.equal(p, before[name]), name
    quantized_logits = model(input_ids=ids).logits

    # The quantized layers compute with the dequantized weights, which are close to the originals.
    for name, module in model.named_modules():
        if layer_quantization(module) is not None:
            assert relative_error(dequantize_weight(module), before[f"{name}.weight"]) < 0.12, name
    assert dequantize_linears(model, torch.float32) == LINEARS_PER_LAYER * TINY["num_hidden_layers"]
    assert quantization_of(model) is None
    assert relative_error(quantized_logits, model(input_ids=ids).logits) < tolerance


@needs_bitsandbytes
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_pretrained_and_config_built_models_store_the_same_weights(kind, tmp_path):
    """`from_pretrained` with transformers' BitsAndBytesConfig, and a model built from a config then
    quantized layer by layer: the same weights in, the same quantized model out."""
    built = tiny()
    built.save_pretrained(tmp_path / "model")
    pretrained = ModelConfig(name_or_path=str(tmp_path / "model"), attention="sdpa", quantization=kind)
    loaded = build_model(pretrained, device="cpu", dtype=torch.float32).eval()
    from_config = ModelConfig(config={**TINY}, attention="sdpa", quantization=kind)
    quantized = build_model(from_config, device="cpu", dtype=torch.float32, seed=3).eval()

    layers = {name: module for name, module in quantized.named_modules() if layer_quantization(module)}
    assert len(layers) == LINEARS_PER_LAYER * TINY["num_hidden_layers"]
    loaded_modules = dict(loaded.named_modules())
    for name, layer in layers.items():
        assert type(loaded_modules[name]) is type(layer), name
        assert torch.equal(dequantize_weight(loaded_modules[name]), dequantize_weight(layer)), name
    assert type(loaded.lm_head) is nn.Linear and torch.equal(loaded.lm_head.weight, quantized.lm_head.weight)
    ids = torch.randint(0, TINY["vocab_size"], (1, 23), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded(input_ids=ids).logits, quantized(input_ids=ids).logits)


@needs_bitsandbytes
@pytest.mark.parametrize("source", ["pretrained", "config"])
def test_a_dequantized_model_saves_and_loads_as_a_plain_one(source, tmp_path):
    if source == "pretrained":
        tiny().save_pretrained(tmp_path / "model")
        model_cfg = ModelConfig(name_or_path=str(tmp_path / "model"), attention="sdpa", quantization="nf4")
    else:
        model_cfg = ModelConfig(config={**TINY}, attention="sdpa", quantization="nf4")
    model = build_model(model_cfg, device="cpu", dtype=torch.float32, seed=3).eval()
    dequantize_linears(model, torch.float32)
    model.save_pretrained(tmp_path / "plain")

    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization_config" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", attn_implementation="sdpa").eval()
    assert quantization_of(reloaded) is None
    ids = torch.randint(0, TINY["vocab_size"], (1, 17), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("source", ["pretrained", "config"])
def test_missing_bitsandbytes_names_the_extra(source, tmp_path, monkeypatch):
    if source == "pretrained":
        tiny().save_pretrained(tmp_path / "model")
        model_cfg = ModelConfig(name_or_path=str(tmp_path / "model"), quantization="nf4")
    else:
        model_cfg = ModelConfig(config={**TINY}, quantization="nf4")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(UserError) as caught:
        build_model(model_cfg, device="cpu", dtype=torch.float32)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("model.quantization: nf4 needs bitsandbytes")
    assert "pip install 'ligertune[qlora]'" in message


def lora_over_nf4(dtype: torch.dtype, source: str = "config", tmp_path=None) -> nn.Module:
    """`tiny()` in `dtype`, NF4 (from its config, or loaded from a saved copy), LoRA r=4 on every
    linear layer with random adapters in `dtype`, as `ligertune train` builds it under `kernels.lora`."""
    import peft

    from ligertune.models.lora import cast_adapters

    if source == "config":
        model = tiny().to(dtype)
        quantize_linears(model, "nf4", dtype)
    else:
        tiny().save_pretrained(tmp_path / "model")
        model = build_model(ModelConfig(name_or_path=str(tmp_path / "model"), quantization="nf4", attention="sdpa"),
                            device="cpu", dtype=dtype)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    cast_adapters(model, dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # B starts at zero, and A would get no gradient
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


def without_siblings(model: nn.Module) -> nn.Module:
    """A copy of `model` whose 4-bit layers each multiply alone (bitsandbytes' own product)."""
    apart = copy.deepcopy(model)
    for layer in apart.modules():
        vars(layer).pop("siblings", None)
    return apart


@needs_bitsandbytes
@pytest.mark.parametrize("source", ["pretrained", "config"])
def test_nf4_siblings_dequantize_as_one_with_the_values_of_each(source, tmp_path, monkeypatch):
    """q, k, v and gate, up of each block are joined (`Nf4Siblings`; o and down each alone), however
    the model was quantized; under the fast LoRA forward each group's weights are dequantized once
    forward and once backward, with the loss and gradients of the layers apart (float32: only the
    order of the sums differs)."""
    from ligertune.models import quantize
    from ligertune.models.lora import SHARED_INPUTS, patch_lora

    model = lora_over_nf4(torch.float32, source, tmp_path)
    for names in SHARED_INPUTS:
        blocks = [m for m in model.modules() if hasattr(m, names[0])]
        assert len(blocks) == TINY["num_hidden_layers"]
        for block in blocks:
            layers = tuple(getattr(block, name).base_layer for name in names)
            assert all(layer.siblings.layers == layers for layer in layers)
    alone = [m.base_layer for name, m in model.named_modules() if name.endswith(("o_proj", "down_proj"))]
    assert len(alone) == 2 * TINY["num_hidden_layers"]
    assert all(layer.siblings.layers == (layer,) for layer in alone)
    apart = without_siblings(model)
    copied = copy.deepcopy(model)  # a copy's siblings are its own layers
    own = {id(m) for m in copied.modules()}
    assert all(id(layer) in own for m in copied.modules() if "siblings" in vars(m) for layer in m.siblings.layers)
    for each in (model, apart):
        patch_lora(each)
    calls = []
    dequantized = quantize.Nf4Siblings.dequantized
    monkeypatch.setattr(quantize.Nf4Siblings, "dequantized",
                        lambda self, dtype: calls.append(1) or dequantized(self, dtype))
    loss, grads = loss_and_grads(model)
    joined_calls, calls[:] = len(calls), []
    loss0, grads0 = loss_and_grads(apart)
    # 4 a block (q, k, v; o; gate, up; down), forward and backward, but for the first block's q, k
    # and v, whose input (the frozen embeddings, normed) needs no gradient
    assert (joined_calls, len(calls)) == (8 * TINY["num_hidden_layers"] - 1, 0)
    assert relative_error(loss, loss0) < 1e-6
    assert grads.keys() == grads0.keys()
    for name in grads:
        assert relative_error(grads[name], grads0[name]) < 1e-5, name


@needs_bitsandbytes
def test_a_recomputed_group_keeps_its_dequantized_weights_for_its_backward(monkeypatch):
    """Under gradient checkpointing each group's weights are dequantized twice a step, not three
    times: in the step's forward and in its recompute, whose backward, next, takes them from it
    (down_proj's, whose product a recompute skips, in forward and backward); with the loss and
    gradients of the same model without checkpointing, to the bit."""
    from ligertune.models import quantize
    from ligertune.models.lora import patch_lora
    from ligertune.training.build import enable_gradient_checkpointing

    model = lora_over_nf4(torch.float32)
    checkpointed = copy.deepcopy(model)
    enable_gradient_checkpointing(checkpointed)
    calls = []
    dequantized = quantize.Nf4Siblings.dequantized
    monkeypatch.setattr(quantize.Nf4Siblings, "dequantized",
                        lambda self, dtype: calls.append(1) or dequantized(self, dtype))
    runs = []
    for each in (model, checkpointed):
        patch_lora(each)
        each.train()
        calls.clear()
        loss, grads = loss_and_grads(each)
        runs.append((len(calls), loss, grads))
        # every recompute's weights taken by its backward: none left held after the step
        assert all(m.siblings.recomputed is None for m in each.modules() if "siblings" in vars(m))
    (plain, loss, grads), (recomputed, loss_c, grads_c) = runs
    layers = TINY["num_hidden_layers"]
    # Without checkpointing 4 a block forward and backward, but for the first block's q, k and v,
    # whose input needs no gradient; with it, 4 a block forward, 3 in the recompute (whose output of
    # down_proj nothing reads: its product is skipped, tests/models/test_fast_lora.py) and down's in
    # backward.
    assert (plain, recomputed) == (8 * layers - 1, 8 * layers)
    assert torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name


@needs_bitsandbytes
def test_nf4_siblings_in_bf16_are_as_close_to_float32_as_the_layers_apart():
    """In bf16 a joined input gradient is summed over the group in the GEMM's float32 accumulator,
    where apart each layer's product is rounded and then added in bf16: as close to the same model
    computed in float32, or closer. Siblings refuse an input of another dtype than their weights'."""
    from ligertune.models.lora import patch_lora

    model = lora_over_nf4(torch.bfloat16)
    apart = without_siblings(model)
    oracle = copy.deepcopy(model)
    dequantize_linears(oracle, torch.float32)
    oracle.float()
    for each in (model, apart):
        patch_lora(each)
    (_, joined), (_, alone), (_, want) = (loss_and_grads(m) for m in (model, apart, oracle))
    joined, alone, want = (torch.cat([g[n].flatten() for n in want]) for g in (joined, alone, want))
    assert relative_error(joined, want) < 1.1 * relative_error(alone, want)
    siblings = next(vars(m)["siblings"] for m in model.modules() if "siblings" in vars(m))
    assert siblings.accepts(torch.zeros(1, TINY["hidden_size"], dtype=torch.bfloat16))
    assert not siblings.accepts(torch.zeros(1, TINY["hidden_size"], dtype=torch.float32))


@needs_bitsandbytes
def test_nf4_siblings_take_each_input_gradient_without_an_addition():
    """Under the fast LoRA forward a joined group's gradient of x, the base's and the adapters', is
    summed in GEMMs (`_DequantizedProducts`); each layer apart, autograd adds one tensor of x's size a
    layer more (q, k, v and their shared A product: 3; o: 1; gate, up and A: 2; down: 1), but in the
    first block, whose input needs no gradient, for q, k and v."""
    from counting import Additions

    from ligertune.models.lora import patch_lora

    widths = {TINY["hidden_size"], TINY["intermediate_size"]}
    model = lora_over_nf4(torch.float32)
    apart = without_siblings(model)
    counts = []
    for each in (model, apart):
        patch_lora(each)
        ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
        loss = each(input_ids=ids).logits.float().logsumexp(-1).mean()
        with Additions(widths) as additions:
            loss.backward()
        counts.append(additions.count)
    assert counts[1] - counts[0] == 7 * TINY["num_hidden_layers"] - 3
