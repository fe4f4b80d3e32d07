"""Fast LoRA (`ligertune.models.lora`): peft's values, gradients and saved adapters, with fewer GEMMs,
no float32 copy of the activations kept for backward, and the adapter side of each layer one pass over
its output. peft's own forward is the oracle, and a float32 computation for the rounding."""

from __future__ import annotations

import copy
import importlib.util
import json
from collections import Counter
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
from counting import Additions, DownProducts
from rich.console import Console
from tiny_models import FAMILIES, make_model
from tiny_recipe import write_recipe
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ligertune.models.lora import (
    _SharedInput,
    cast_adapters,
    is_lora_patched,
    patch_lora,
    shared_lora_a,
    unpatch_lora,
)
from ligertune.models.quantize import dequantize_linears, layer_quantization, quantize_linears
from ligertune.numerics import relative_error
from ligertune.recipe import KernelsConfig, LoraConfig, ModelConfig, OptimConfig, Recipe, load_recipe
from ligertune.training.build import (
    build_model,
    enable_gradient_checkpointing,
    optimizer_warnings,
    trainable_dtypes,
)

LAYERS = 2
ALL_LINEAR = {"lora": "all-linear", "shared": 2 * LAYERS, "layers": 7 * LAYERS}
# q and v share one product, k is left out; up alone (gate is not adapted); down alone.
SUBSET = {"lora": ["q_proj", "v_proj", "up_proj", "down_proj"], "shared": LAYERS, "layers": 4 * LAYERS}
TARGETS = {"all-linear": ALL_LINEAR, "subset": SUBSET}

# (model dtype, adapter dtype): peft's default float32 adapters, or the model's own, which is what
# `kernels.lora` builds over a 16-bit model (get_peft_model(..., autocast_adapter_dtype=False)).
CASES = {
    "fp32": (torch.float32, torch.float32),
    "bf16-fp32-adapters": (torch.bfloat16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
}
# fp32: the one GEMM over cat(A) and the summed dx add in another order than peft's GEMM per layer,
# and y = base(x) + s U B^T is one addmm, rounding errors of ~1e-7 that grow through the layers of
# backward. bf16 model, fp32 adapters: peft rounds each layer's dx to bf16 before autograd sums them
# where the fast path sums in fp32 and rounds once, so the two differ by bf16 rounding (eps 7.8e-3)
# carried through two layers. bf16 adapters: each layer's y rounds once on the fast path, after B's
# product, the scaling and the sum on peft's; the one-ulp differences of every layer's output carry
# through attention's backward, where a gradient can be ill-conditioned (the last layer's q and k
# adapters of `test_every_option_at_once` land 3-50% from a float32 computation on either path,
# batch by batch: that test pools 8 batches), so a gradient may also differ by NOISE times peft's own
# distance from the float32 computation.
TOL = {
    "fp32": {"logits": 1e-6, "grads": 1e-5},
    "bf16-fp32-adapters": {"logits": 1e-2, "grads": 3e-2},
    "bf16": {"logits": 2e-2, "grads": 3e-2},
}
NOISE = 3.0
NEEDS_BITSANDBYTES = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                        reason="bitsandbytes is not installed")


def wrapped_pair(family: str, case: str, lora: peft.LoraConfig, *, quantization: str | None = None,
                 **fields):
    """(peft's path, fast path): one tiny model with LoRA, adapters drawn nonzero, and its copy patched;
    with `quantization`, over the model's linear layers quantized by bitsandbytes."""
    dtype, adapter_dtype = CASES[case]
    base = make_model(family, attention="sdpa", dtype=dtype, **fields)
    if quantization is not None:
        quantize_linears(base, quantization, dtype)
    model = peft.get_peft_model(base, lora, autocast_adapter_dtype=adapter_dtype == torch.float32)
    cast_adapters(model, adapter_dtype)  # as `ligertune train` does: peft's are float32 over int8 layers
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {adapter_dtype}
    perturb_adapters(model)
    fast = copy.deepcopy(model)
    return model, fast, patch_lora(fast)


def perturb_adapters(model, seed: int = 0) -> None:
    """Every adapter weight (and LoRA bias) random: B starts at zero, and then A would get no gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def token_batch(shape=(3, 13), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, shape, generator=gen)
    return ids, torch.roll(ids, -1, dims=1)


def logits_loss_grads(model, ids, targets, *, embeds: bool = False):
    """Logits, summed cross-entropy, and the gradient of every trainable parameter."""
    model.zero_grad(set_to_none=True)
    if embeds:  # inputs that require grad, so that every layer's input gets a gradient
        inputs = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=inputs).logits
    else:
        logits = model(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), loss.detach(), grads


def assert_same(fast, reference, case: str, label: str = "", *, oracle=None) -> None:
    """Logits, loss and every gradient within the case's tolerance of the reference's; with `oracle`
    (the reference's model in float32), each instead no further from the oracle than NOISE times the
    reference's own distance from it (or the tolerance): where both paths round in bf16, a gradient
    that is ill-conditioned can land a few percent from float32 on each, in different directions."""
    tol = TOL[case]
    (logits1, loss1, grads1), (logits0, loss0, grads0) = fast, reference
    assert grads1.keys() == grads0.keys() and grads0, label
    pairs = [("logits", "logits", logits1, logits0), ("loss", "logits", loss1, loss0)]
    pairs += [(name, "grads", grads1[name], grads0[name]) for name in grads0]
    oracle_values = {}
    if oracle is not None:
        logits_o, loss_o, grads_o = oracle
        oracle_values = {"logits": logits_o, "loss": loss_o, **grads_o}
    for name, key, value, expected in pairs:
        assert value is not None, name
        if oracle is None:
            assert relative_error(value, expected) <= tol[key], f"{label} {name}"
        else:
            truth = oracle_values[name]
            limit = max(tol[key], NOISE * relative_error(expected, truth))
            assert relative_error(value, truth) <= limit, f"{label} {name}"


def float32_oracle(case: str, model, ids, targets):
    """For bf16 adapters, `logits_loss_grads` of a float32 copy of `model` (16-bit weights upcast
    exactly, a quantized layer's weight as it dequantizes); None for the other cases, whose
    tolerances need none."""
    if CASES[case][1] != torch.bfloat16:
        return None
    oracle = copy.deepcopy(model)
    dequantize_linears(oracle, torch.float32)
    return logits_loss_grads(oracle.float(), ids, targets)


# --------------------------------------------------------------------------------------------------
# the same values as peft


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fast_lora_equals_peft(family, targets, case):
    spec = TARGETS[targets]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=spec["lora"], task_type="CAUSAL_LM")
    model, fast, report = wrapped_pair(family, case, lora)
    assert (report.modules, report.shared, dict(report.kept)) == (spec["layers"], spec["shared"], {})
    ids, targets_ = token_batch()
    assert_same(logits_loss_grads(fast, ids, targets_), logits_loss_grads(model, ids, targets_), case,
                oracle=float32_oracle(case, model, ids, targets_))


# family -> (layers adapted, groups sharing one product) under all-linear, two layers each
OTHER_LAYOUTS = {
    "phi3": (4 * LAYERS, 0),  # qkv_proj, o_proj, gate_up_proj, down_proj: q, k, v and gate, up already one
    "smollm3": (7 * LAYERS, 2 * LAYERS),
    "olmo2": (7 * LAYERS, 2 * LAYERS),  # q and k pass their norms after the shared product
}


@pytest.mark.parametrize("case", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(OTHER_LAYOUTS))
def test_fast_lora_equals_peft_in_other_layouts(family, case):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, report = wrapped_pair(family, case, lora)
    assert (report.modules, report.shared, dict(report.kept)) == (*OTHER_LAYOUTS[family], {})
    ids, targets = token_batch()
    assert_same(logits_loss_grads(fast, ids, targets), logits_loss_grads(model, ids, targets), case,
                oracle=float32_oracle(case, model, ids, targets))


def test_the_fast_path_needs_no_bitsandbytes(monkeypatch):
    """bitsandbytes is an extra, and peft's module of LoRA layers over its bases imports it: without
    it the fast path runs over plain layers as ever. Hidden here as if not installed: not found (what
    peft asks, and caches) and not importable."""
    import sys

    import peft.tuners.lora
    from peft.import_utils import is_bnb_4bit_available, is_bnb_available

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "bitsandbytes" else find_spec(name, *args))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.delitem(sys.modules, "peft.tuners.lora.bnb", raising=False)
    monkeypatch.delattr(peft.tuners.lora, "bnb", raising=False)
    checks = (is_bnb_available, is_bnb_4bit_available)
    try:
        for check in checks:
            check.cache_clear()
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        model, fast, report = wrapped_pair("llama", "bf16", lora)
        assert report.modules == TARGETS["all-linear"]["layers"]
        ids, targets = token_batch()
        assert_same(logits_loss_grads(fast, ids, targets), logits_loss_grads(model, ids, targets), "bf16")
    finally:
        for check in checks:  # asked again once bitsandbytes is back
            check.cache_clear()


@NEEDS_BITSANDBYTES
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_fast_lora_over_a_quantized_base_equals_peft(quantization, case):
    """QLoRA: peft's LoRA layers over bitsandbytes' 4-bit and 8-bit layers run the fast forward too,
    with peft's values (float32 adapters over a bf16 model: peft's rounding, product cast before the
    sum)."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    # widths multiples of 64: bitsandbytes' CPU kernel (0.50) dequantizes a 4-bit block that
    # straddles two rows with the wrong scale, where the fast path's does not (tests/kernels/test_nf4.py)
    model, fast, report = wrapped_pair("llama", case, lora, quantization=quantization, intermediate_size=128)
    assert (report.modules, report.shared, dict(report.kept)) == (7 * LAYERS, 2 * LAYERS, {})
    bases = {layer_quantization(m.base_layer) for m in fast.modules() if hasattr(m, "lora_A")}
    assert bases == {quantization}
    ids, targets = token_batch()
    values = logits_loss_grads(fast, ids, targets)
    reference = logits_loss_grads(model, ids, targets)
    if case == "bf16-fp32-adapters":
        assert torch.equal(values[0], reference[0])  # the forward rounds as peft's, operation for operation
    assert_same(values, reference, case, oracle=float32_oracle(case, model, ids, targets))


def errors_against_float32(family: str, case: str, batches: int) -> dict[str, dict[str, float]]:
    """Relative error against the same weights in float32 of peft's path and of the fast path: the
    logits and the gradients of all trainable parameters, each pooled over `batches` batches."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair(family, case, lora)
    oracle = copy.deepcopy(model).float()
    runs: dict[str, tuple[list, list]] = {"oracle": ([], []), "peft": ([], []), "fast": ([], [])}
    for seed in range(batches):
        ids, targets = token_batch(seed=1 + seed)
        for name, m in (("oracle", oracle), ("peft", model), ("fast", fast)):
            logits, _, grads = logits_loss_grads(m, ids, targets)
            runs[name][0].append(logits.flatten().float())
            runs[name][1].append(torch.cat([g.flatten().float() for g in grads.values()]))
    pooled = {name: (torch.cat(a), torch.cat(b)) for name, (a, b) in runs.items()}
    ref = pooled["oracle"]
    return {name: {"logits": relative_error(pooled[name][0], ref[0]),
                   "grads": relative_error(pooled[name][1], ref[1])} for name in ("peft", "fast")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_fast_lora_is_as_close_to_float32_as_peft(family):
    """float32 adapters over bf16: against the same weights in fp32, the fast path's bf16 error is that
    of peft's bf16 path."""
    err = errors_against_float32(family, "bf16-fp32-adapters", batches=1)
    assert err["fast"]["logits"] <= 1.5 * err["peft"]["logits"]
    assert err["fast"]["grads"] <= 1.5 * err["peft"]["grads"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_adapters_fast_lora_is_at_least_as_close_to_float32_as_peft(family):
    """bf16 adapters, over the whole model: the bf16 rounding of the base layers, attention and norms
    (common to both paths) dominates, so a batch's error is the noise of which ulps flip; pooled over
    four batches the fast path's logits are no further from fp32 than peft's, and its gradients
    (whose backward rounds as often as peft's) within that noise. The rounding itself, layer by layer:
    `test_bf16_adapters_layer_rounds_once`."""
    err = errors_against_float32(family, "bf16", batches=4)
    assert err["fast"]["logits"] <= err["peft"]["logits"]
    assert err["fast"]["grads"] <= 1.25 * err["peft"]["grads"]


class OneLinear(nn.Module):
    def __init__(self, width: int, out: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(width, out, bias=bias)

    def forward(self, x):
        return self.proj(x)


def one_layer_pair(width: int, out: int, *, bias: bool, r: int = 8, seed: int = 0, dtype=torch.bfloat16):
    """(peft's path, fast path) for one LoRA Linear of odd sizes in `dtype`, adapters in `dtype`, weights
    of unit-variance outputs so that the adapter's s x A^T B^T is as large as base(x)."""
    gen = torch.Generator().manual_seed(seed)
    net = OneLinear(width, out, bias)
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"])
    model = peft.get_peft_model(net.to(dtype), lora, autocast_adapter_dtype=False)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    fast = copy.deepcopy(model)
    assert patch_lora(fast).modules == 1
    return model, fast


def layer_values(model, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """y = model(x), and the gradients of <y, dy> for x and every trainable parameter."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(dy)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return {"y": y.detach(), "x": x.grad, **grads}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "base-bias"])
def test_bf16_adapters_layer_rounds_once(bias):
    """One layer, bf16 base and adapters, against the same weights in float64: peft rounds B's product,
    its scaling and the sum to bf16 (y of the rounded parts), the fast path only y (one addmm with a
    float32 accumulator): its y is closer. Its backward rounds as peft's (the same GEMMs)."""
    gen = torch.Generator().manual_seed(1)
    model, fast = one_layer_pair(123, 77, bias=bias)
    x = torch.randn(3, 37, 123, generator=gen).bfloat16()
    dy = torch.randn(3, 37, 77, generator=gen).bfloat16()
    ref = layer_values(copy.deepcopy(model).double(), x.double(), dy.double())
    peft_bf16, fast_bf16 = layer_values(model, x, dy), layer_values(fast, x, dy)
    assert fast_bf16["y"].dtype == torch.bfloat16 and fast_bf16["y"].shape == (3, 37, 77)
    err = {name: (relative_error(fast_bf16[name].double(), ref[name]),
                  relative_error(peft_bf16[name].double(), ref[name])) for name in ref}
    fast_y, peft_y = err.pop("y")
    assert fast_y < 0.9 * peft_y, (fast_y, peft_y)
    assert fast_y < 2 ** -8  # bf16's rounding of y (relative half-spacing 2^-9 to 2^-8)
    for name, (fast_e, peft_e) in err.items():
        assert fast_e <= 1.1 * peft_e, (name, fast_e, peft_e)


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")  # o, gate, up, down have no base bias
@pytest.mark.parametrize("case", list(CASES))
def test_every_option_at_once(case):
    """Ranks and alphas per layer within one shared product, rsLoRA, LoRA biases on B, trained base
    biases (Qwen2's q, k, v)."""
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", use_rslora=True,
        rank_pattern={"k_proj": 2, "gate_proj": 8}, alpha_pattern={"v_proj": 3, "up_proj": 5},
        lora_bias=True, bias="all",
    )
    model, fast, report = wrapped_pair("qwen2", case, lora)
    assert (report.modules, report.shared) == (7 * LAYERS, 2 * LAYERS)
    k = fast.get_base_model().model.layers[0].self_attn.k_proj
    assert k.r["default"] == 2 and k.lora_B["default"].bias is not None
    # The last layer's q and k gradients (through the attention scores) are ill-conditioned here: in
    # bf16 one batch can put either path anywhere from 3% to 50% from float32, so each is pooled
    # over batches (the fp32 case holds to 1e-5 on one batch alone).
    batches = [token_batch(seed=seed) for seed in range(1, 2 if case == "fp32" else 9)]
    reference = pooled(logits_loss_grads(model, *batch) for batch in batches)
    assert any(n.endswith("q_proj.base_layer.bias") for n in reference[2])  # base biases are trained
    oracle = None
    if CASES[case][1] == torch.bfloat16:
        oracle = pooled(float32_oracle(case, model, *batch) for batch in batches)
    assert_same(pooled(logits_loss_grads(fast, *batch) for batch in batches), reference, case, oracle=oracle)


@pytest.mark.parametrize("base", ["plain", pytest.param("nf4", marks=NEEDS_BITSANDBYTES)])
def test_ranks_and_alphas_per_layer_in_groups_run_as_one(base, monkeypatch):
    """Ranks and alphas per layer (`rank_pattern`, `alpha_pattern`, rsLoRA) within groups whose
    outputs come from one autograd node, each layer summed with its own scaling (`_plain_outputs`;
    over 4-bit layers `_dequantized_outputs`): peft's values."""
    from ligertune.models import lora as fast_lora

    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", use_rslora=True,
        rank_pattern={"k_proj": 2, "gate_proj": 8}, alpha_pattern={"v_proj": 3, "up_proj": 5},
    )
    quantization = None if base == "plain" else base
    # widths multiples of 64, as in test_fast_lora_over_a_quantized_base_equals_peft
    model, fast, _ = wrapped_pair("llama", "fp32", lora, quantization=quantization, intermediate_size=128)
    calls = []
    name = "_plain_outputs" if base == "plain" else "_dequantized_outputs"
    outputs = getattr(fast_lora, name)
    monkeypatch.setattr(fast_lora, name, lambda *args: calls.append(1) or outputs(*args))
    ids, targets = token_batch()
    values = logits_loss_grads(fast, ids, targets)
    assert len(calls) == 4 * LAYERS  # q, k, v; o; gate, up; down
    assert_same(values, logits_loss_grads(model, ids, targets), "fp32")


def pooled(values) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`logits_loss_grads` of several batches as one: each value of every batch, concatenated."""
    logits, losses, grads = zip(*values)
    return (torch.cat([v.flatten() for v in logits]), torch.stack(losses),
            {name: torch.cat([g[name].flatten() for g in grads]) for name in grads[0]})


def test_gradient_checkpointing_recomputes_the_shared_products():
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    base = make_model("llama", attention="sdpa")
    enable_gradient_checkpointing(base)
    model = peft.get_peft_model(base, lora)
    perturb_adapters(model)
    fast = copy.deepcopy(model)
    patch_lora(fast)
    model.train(), fast.train()
    ids, targets = token_batch()
    assert_same(logits_loss_grads(fast, ids, targets, embeds=True),
                logits_loss_grads(model, ids, targets, embeds=True), "fp32")


@pytest.mark.parametrize("family, base, skipped", [
    ("llama", "plain", True),
    ("qwen3", "plain", True),
    pytest.param("llama", "nf4", True, marks=NEEDS_BITSANDBYTES),
    ("llama", "float8", True),
    ("llama", "mlp-chunks", True),  # the SwiGLU kernel's MLP in chunks, each recomputed inside the layer's
    ("gemma2", "plain", False),  # its MLP's output is normed after: a recompute keeps it
])
def test_a_recompute_skips_the_base_product_nothing_needs(family, base, skipped):
    """Under gradient checkpointing a recomputed layer runs for the tensors it keeps for backward;
    in families whose layers only add the MLP's output to the residual stream, down_proj's base
    product is needed by none of them, and the recompute skips it: once a step instead of twice,
    with the loss and gradients of the same model without checkpointing, bit for bit."""
    from ligertune.models.float8 import freeze_to_float8
    from ligertune.models.patching import patch_model

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = make_model(family, attention="eager" if family == "gemma2" else "sdpa")
    if base == "nf4":
        quantize_linears(model, "nf4", torch.float32)
    if base == "mlp-chunks":  # 39 tokens in chunks of 16
        patch_model(model, rms_norm=False, rope=False, mlp_chunk_tokens=16)
    model = peft.get_peft_model(model, lora)
    if base == "float8":  # the frozen base layers, each in float8
        assert freeze_to_float8(model) == 7 * model.config.num_hidden_layers
    perturb_adapters(model)
    checkpointed = copy.deepcopy(model)
    enable_gradient_checkpointing(checkpointed)
    ids, targets = token_batch()
    config = model.config
    runs = []
    for each in (model, checkpointed):
        patch_lora(each)
        each.train()
        with DownProducts(config.intermediate_size, config.hidden_size) as products:
            values = logits_loss_grads(each, ids, targets, embeds=True)
        runs.append((products.count, values))
    (plain, (logits, loss, grads)), (recomputed, (logits_c, loss_c, grads_c)) = runs
    products = config.num_hidden_layers * (3 if base == "mlp-chunks" else 1)  # a layer's, in the step's forward
    # (the chunks are recomputed in either model, the recompute of the layer running their forward)
    assert (plain, recomputed) == ((products, products) if skipped else (products, 2 * products))
    assert torch.equal(logits, logits_c) and torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name


def test_through_build_model_with_the_kernels_patched():
    """`ligertune train`'s model: patched RMSNorm/RoPE/SwiGLU (SwiGLU's backward writes over the gate
    and up outputs, which are the fast path's outputs) and `kernels.lora` on, against it off."""

    def build(fast: bool):
        recipe = Recipe(model=ModelConfig(config=dict(FAMILIES["llama"]), attention="sdpa", dtype="float32"),
                        kernels=KernelsConfig(lora=fast), lora=LoraConfig(r=4, alpha=8))
        model = build_model(recipe, device=torch.device("cpu"), vocab_size=None).module
        perturb_adapters(model)
        return model

    fast, model = build(True), build(False)
    assert is_lora_patched(fast) and not is_lora_patched(model)
    ids, targets = token_batch()
    assert_same(logits_loss_grads(fast, ids, targets), logits_loss_grads(model, ids, targets), "fp32")


# --------------------------------------------------------------------------------------------------
# less work and less memory


GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default,
         torch.ops.aten.bmm.default)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def gemm_counts(model, ids) -> tuple[int, int]:
    """GEMMs of a forward and of its backward."""
    inputs = model.get_input_embeddings()(ids).detach().requires_grad_()
    with _CountMatmuls() as forward:
        loss = model(inputs_embeds=inputs).logits.sum()
    with _CountMatmuls() as backward:
        loss.backward()
    return sum(forward.calls.values()), sum(backward.calls.values())


def test_one_gemm_for_the_a_projections_of_a_shared_input():
    """Per layer, peft runs A for q, k, v, gate, up: 5 GEMMs forward and 10 backward (grad A and dx
    of each); the fast path runs 2 and 4 (one per shared input). Everything else is the same."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair("llama", "fp32", lora)
    ids, _ = token_batch()
    (peft_fwd, peft_bwd), (fast_fwd, fast_bwd) = gemm_counts(model, ids), gemm_counts(fast, ids)
    assert peft_fwd - fast_fwd == 3 * LAYERS
    assert peft_bwd - fast_bwd == 6 * LAYERS


def test_the_gradient_of_a_shared_input_is_summed_in_gemms(monkeypatch):
    """The fast path sums each group's gradient of its input, its base layers' and its A product's, in
    GEMMs (`_PlainProducts`: each added in the epilogue of the next); with the group's layers run
    one by one, autograd adds one tensor of the input's size a layer more (q, k, v and A: 3; o: 1;
    gate, up and A: 2; down: 1), but in the first block, whose input needs no gradient, for q, k, v."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, grouped, _ = wrapped_pair("llama", "fp32", lora)
    one_by_one = copy.deepcopy(model)
    patch_lora(one_by_one)
    ids, targets = token_batch()
    widths = {grouped.config.hidden_size, grouped.config.intermediate_size}

    def additions_and_values(each):
        loss = each(ids).logits.logsumexp(-1).mean()
        with Additions(widths) as additions:
            loss.backward()
        return additions.count, logits_loss_grads(each, ids, targets)

    grouped_count, grouped_values = additions_and_values(grouped)
    monkeypatch.setattr(_SharedInput, "_outputs", lambda self, x: None)  # each base, then its adapters
    alone_count, alone_values = additions_and_values(one_by_one)
    assert alone_count - grouped_count == 7 * LAYERS - 3
    assert_same(grouped_values, alone_values, "fp32")


class _OpsOnSize(TorchDispatchMode):
    """The ops other than GEMMs and views that read or write a tensor of `numel` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in GEMMS and not func.is_view and func is not torch.ops.aten._unsafe_view.default:
            leaves = tree_leaves((args, kwargs, out))
            if any(isinstance(t, torch.Tensor) and t.numel() == self.numel for t in leaves):
                self.ops.append(str(func))
        return out


def test_the_adapter_side_is_the_epilogue_of_one_gemm():
    """bf16 base and adapters: on the fast path nothing but GEMMs reads or writes a tensor of the
    output's size, forward or backward. B's GEMM adds s U B^T to base(x) in place (one read and one
    write of the output), and its backward hands dy on to the base layer as it is. peft's path writes
    B's product, scales it, adds base(x) (and, over float32 adapters, casts the sum back) and scales dy."""
    model, fast = one_layer_pair(123, 77, bias=False)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 37, 123, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(3, 37, 77, generator=gen).bfloat16()
    found = {}
    for name, m in (("peft", model), ("fast", fast)):
        with _OpsOnSize(dy.numel()) as forward:
            y = m(x)
        with _OpsOnSize(dy.numel()) as backward:
            y.backward(dy)
        found[name] = (forward.ops, backward.ops)
    assert found["fast"] == ([], [])
    peft_forward, peft_backward = found["peft"]
    assert {"aten.mul.Tensor", "aten.add.Tensor"} <= set(peft_forward) and "aten.mul.Tensor" in peft_backward


def saved_in_lora_layers(model, ids) -> list[torch.Tensor]:
    """What autograd keeps for backward inside the forwards of the LoRA layers, base layers included."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    handles = []
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            handles.append(module.register_forward_pre_hook(lambda *_, h=hooks: h.__enter__()))
            handles.append(module.register_forward_hook(lambda *_, h=hooks: h.__exit__(None, None, None)))
    try:
        model(ids).logits.sum()
    finally:
        for handle in handles:
            handle.remove()
    return saved


def test_no_float32_copy_of_the_activations_is_kept():
    """bf16 model, float32 adapters: peft keeps a float32 copy of the input of every adapted layer;
    the fast path keeps the bf16 input, once per shared input."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair("llama", "bf16-fp32-adapters", lora)
    ids, _ = token_batch()

    def fp32_activations(saved):
        # [tokens, width] or [batch, length, width], hidden (64) and intermediate (96) widths
        return [t for t in saved if t.dtype == torch.float32 and t.shape[-1] in (64, 96)
                and t.numel() == ids.numel() * t.shape[-1]]

    def activation_bytes(model, saved):
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return sum(n for ptr, n in storages.items() if ptr not in weights)

    peft_saved, fast_saved = saved_in_lora_layers(model, ids), saved_in_lora_layers(fast, ids)
    assert len(fp32_activations(peft_saved)) == 7 * LAYERS
    assert fp32_activations(fast_saved) == []
    # Both keep the A products (one [tokens, 3r] tensor instead of three [tokens, r] ones: the same
    # bytes). peft adds a float32 copy of each of the 7 inputs of a layer, the fast path the bf16
    # inputs of its 4 products: q/k/v's, o's, gate/up's (width 64) and down's (96).
    tokens = ids.numel()
    copies = LAYERS * tokens * (6 * 64 + 96) * 4
    inputs = LAYERS * tokens * (3 * 64 + 96) * 2
    assert activation_bytes(model, peft_saved) - activation_bytes(fast, fast_saved) == copies - inputs


def test_base_weights_stay_frozen_in_the_model_dtype():
    recipe = Recipe(model=ModelConfig(config=dict(FAMILIES["qwen2"]), attention="sdpa", dtype="bfloat16"),
                    lora=LoraConfig(r=4, alpha=8))
    model = build_model(recipe, device=torch.device("cpu"), vocab_size=None).module
    assert is_lora_patched(model)
    perturb_adapters(model)
    ids, targets = token_batch()
    _, _, grads = logits_loss_grads(model, ids, targets)
    assert grads and all("lora_" in n for n in grads)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            assert not param.requires_grad and param.grad is None, name
            assert param.dtype == torch.bfloat16, name


@pytest.mark.parametrize("fast, dropout, quantization, adapters", [
    (True, 0.0, None, torch.bfloat16),
    (False, 0.0, None, torch.float32),
    (True, 0.1, None, torch.float32),
    pytest.param(True, 0.0, "nf4", torch.bfloat16, marks=NEEDS_BITSANDBYTES),
    pytest.param(False, 0.0, "nf4", torch.float32, marks=NEEDS_BITSANDBYTES),
    pytest.param(True, 0.0, "int8", torch.bfloat16, marks=NEEDS_BITSANDBYTES),
], ids=["kernels.lora", "kernels.lora-false", "dropout", "nf4", "nf4-kernels.lora-false", "int8"])
def test_adapter_dtype_of_a_bf16_recipe(fast, dropout, quantization, adapters):
    """`kernels.lora` keeps a bf16 model's adapters in bf16 where its forward computes them, over a
    quantized base too; with it off or with dropout (peft's forward), they are peft's float32.
    `trainable_dtypes` (what `ligertune validate` warns from, before building) agrees with the built
    model, and the warning of 16-bit steps without master weights names the adapters."""
    recipe = Recipe(model=ModelConfig(config=dict(FAMILIES["llama"]), attention="sdpa", dtype="bfloat16",
                                      quantization=quantization),
                    kernels=KernelsConfig(lora=fast), lora=LoraConfig(r=4, alpha=8, dropout=dropout),
                    optim=OptimConfig(master_weights=False))
    model = build_model(recipe, device=torch.device("cpu"), vocab_size=None).module
    trained = {p.dtype for n, p in model.named_parameters() if p.requires_grad and "lora_" in n}
    assert trained == {p.dtype for p in model.parameters() if p.requires_grad} == {adapters}
    assert is_lora_patched(model) == (fast and dropout == 0)
    assert trainable_dtypes(recipe) == trained
    steps = [w for w in optimizer_warnings(recipe, trained) if w.startswith("optim.master_weights")]
    if adapters == torch.bfloat16:
        assert len(steps) == 1 and "false with bfloat16" in steps[0] and "the LoRA adapters" in steps[0]
    else:
        assert steps == []


# --------------------------------------------------------------------------------------------------
# peft's files and peft's forward where the shortcut does not apply


def test_saved_adapters_load_with_peft(tmp_path):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    _, fast, _ = wrapped_pair("llama", "fp32", lora)
    ids, targets = token_batch()
    logits_loss_grads(fast, ids, targets)  # trained state: gradients exist, forwards ran
    fast.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(make_model("llama", attention="sdpa"), tmp_path)
    assert not is_lora_patched(loaded)
    saved = {n: p for n, p in fast.named_parameters() if "lora_" in n}
    reloaded = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert saved.keys() == reloaded.keys()
    for name, param in saved.items():
        assert torch.equal(param, reloaded[name]), name
    fast.eval(), loaded.eval()
    with torch.no_grad():
        assert relative_error(fast(ids).logits, loaded(ids).logits) <= 1e-6
        merged = loaded.merge_and_unload()
        assert relative_error(merged(ids).logits, fast(ids).logits) <= 1e-5


def test_dropout_keeps_peft_forward():
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, report = wrapped_pair("llama", "fp32", lora)
    assert report.modules == 0 and report.kept == {"dropout > 0": 7 * LAYERS}
    assert not is_lora_patched(fast)
    model.train(), fast.train()
    ids, targets = token_batch()
    torch.manual_seed(3)
    reference = logits_loss_grads(model, ids, targets)
    torch.manual_seed(3)
    logits, loss, grads = logits_loss_grads(fast, ids, targets)
    assert torch.equal(logits, reference[0]) and torch.equal(loss, reference[1])
    assert grads.keys() == reference[2].keys()
    assert all(torch.equal(grads[n], reference[2][n]) for n in grads)


def test_disabled_merged_and_unpatched_adapters():
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair("llama", "fp32", lora)
    ids, _ = token_batch()
    with torch.no_grad():
        adapted = fast(ids).logits
        with fast.disable_adapter():
            base = fast(ids).logits
        with model.disable_adapter():
            assert torch.equal(base, model(ids).logits)
        assert relative_error(adapted, base) > 1e-2  # the adapters act
        unpatch_lora(fast)
        assert not is_lora_patched(fast)
        assert torch.equal(fast(ids).logits, model(ids).logits)
        patch_lora(fast)
        fast.merge_adapter()  # W + s B A in the base weights: the fast forward is peft's plain base call
        assert is_lora_patched(fast)
        assert relative_error(fast(ids).logits, adapted) <= 1e-5
        fast.unmerge_adapter()
        assert relative_error(fast(ids).logits, adapted) <= 1e-5


def test_shared_product_is_for_one_input_only():
    """k_proj called on another tensor than q_proj, or on q's tensor changed in place, computes its own."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    _, fast, _ = wrapped_pair("llama", "fp32", lora)
    attn = fast.get_base_model().model.layers[0].self_attn
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)

    def peft_forward(module, t):
        return type(module).forward(module, t)

    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            torch.testing.assert_close(proj(x), peft_forward(proj, x), rtol=1e-6, atol=1e-6)
        attn.q_proj(x)
        torch.testing.assert_close(attn.k_proj(y), peft_forward(attn.k_proj, y), rtol=1e-6, atol=1e-6)
        attn.q_proj(x)
        x.mul_(2)
        torch.testing.assert_close(attn.v_proj(x), peft_forward(attn.v_proj, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_lora_a_gradients(dtype):
    """The autograd function alone against x.to(fp32) @ A_i^T per weight, odd sizes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 123, generator=gen).to(dtype).requires_grad_()
    weights = [torch.randn(r, 123, generator=gen).requires_grad_() for r in (5, 1, 8)]
    outs = shared_lora_a(x, weights)
    cotangents = [torch.randn(o.shape, generator=gen) for o in outs]
    torch.autograd.backward(outs, cotangents)
    got = [x.grad, *(w.grad for w in weights)]
    x2 = x.detach().clone().requires_grad_()
    weights2 = [w.detach().clone().requires_grad_() for w in weights]
    refs = [F.linear(x2.float(), w) for w in weights2]
    torch.autograd.backward(refs, cotangents)
    for out, ref in zip(outs, refs):
        assert relative_error(out, ref) <= 1e-6
    for g, ref in zip(got, [x2.grad, *(w.grad for w in weights2)]):
        assert g.dtype == ref.dtype and relative_error(g, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)


# --------------------------------------------------------------------------------------------------
# end to end


def train_run(path: Path, *overrides: str):
    """`ligertune train` of the recipe at `path`: the run's state and its metrics records."""
    from ligertune.training import cleanup, setup, train_loop

    state = setup(load_recipe(path, list(overrides)), Console(quiet=True))
    try:
        result = train_loop(state)
    finally:
        cleanup(state)
    metrics = Path(state.recipe.output.dir) / "metrics.jsonl"
    return state, result, [json.loads(line) for line in metrics.read_text().splitlines()]


def test_bf16_lora_run_trains_and_its_adapters_load_and_merge(tmp_path: Path):
    """`ligertune train` of a bf16 LoRA recipe on the CPU (`kernels.lora`, the default): the adapters
    train in bf16, each the rounding of its float32 master weight; the losses are those of the same
    run with peft's float32 adapters (`kernels.lora: false`) to bf16 rounding, and the held-out loss
    falls; the saved adapters load with peft onto the bf16 base, as peft's float32 adapters holding
    the same values, and merge into it, with peft's `merge_and_unload` and with `ligertune merge`."""
    from ligertune.merge import merge_adapters
    from ligertune.models import build_model as build_base

    path = write_recipe(tmp_path, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
                        model={"dtype": "bfloat16"}, optim={"lr": 1e-2},
                        train={"max_steps": 6, "eval_every": 6, "device": "cpu"})
    state, result, records = train_run(path)
    _, _, peft_records = train_run(path, "kernels.lora=false", f"output.dir={tmp_path / 'peft'}")
    model, recipe = state.model, state.recipe
    assert not is_lora_patched(model)  # the run's end puts peft's forward back
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and p.dtype == torch.bfloat16 for n, p in trained.items())
    for p in trained.values():
        master = state.optimizer.state[p]["master"]
        assert master.dtype == torch.float32 and torch.equal(master.to(torch.bfloat16), p.detach())

    def losses(rows, key):
        return torch.tensor([r[key] for r in rows if key in r])

    for key in ("loss", "eval_loss"):
        assert relative_error(losses(records, key), losses(peft_records, key)) <= 1e-3, key
    evals = losses(records, "eval_loss")
    assert len(evals) == 2 and evals[1] < evals[0] - 0.1, evals  # 5.70 -> 5.52: the adapters learn

    ids = torch.tensor([state.eval_examples[0].input_ids])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()

    def base():
        return build_base(recipe.model, device="cpu", seed=recipe.train.seed, vocab_size=len(state.tokenizer))

    loaded = peft.PeftModel.from_pretrained(base(), result.final_dir).eval()
    reloaded = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert reloaded.keys() == trained.keys()
    for name, param in trained.items():
        assert reloaded[name].dtype == torch.float32 and torch.equal(reloaded[name], param.float()), name
    assert next(loaded.get_base_model().parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        assert relative_error(loaded(input_ids=ids).logits.float(), expected) <= TOL["bf16"]["logits"]
        with loaded.disable_adapter():  # the adapters matter: the checks here would see them missing
            assert relative_error(loaded(input_ids=ids).logits.float(), expected) > 5e-2
        merged = peft.PeftModel.from_pretrained(base(), result.final_dir, autocast_adapter_dtype=False)
        assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
        merged = merged.merge_and_unload()
        assert relative_error(merged(input_ids=ids).logits.float(), expected) <= 3e-2  # W + s B A in bf16
    report = merge_adapters(result.final_dir, output=tmp_path / "merged")
    assert report.dtype == torch.bfloat16 and report.rel_error <= report.tolerance
