"""A frozen base in float8 (`train.precision: fp8` under LoRA, `Float8FrozenLinear`): the GEMMs are
exactly those of the float8 operands with their scales (checked against float64 products of the
dequantized operands), close to bf16's, with no gradient and no activation kept for the weight; and
LoRA trains over it as over a bf16 base. On the CPU the layer multiplies the same float8 values in
float32; on a GPU the float8 tensor cores do (tests/gpu/test_gpu_float8_frozen.py)."""

from __future__ import annotations

import copy
import itertools

import peft
import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model
from tiny_recipe import write_recipe

from ligertune.flops import StepFlops
from ligertune.kernels import quantize_rows
from ligertune.models.float8 import Float8FrozenLinear, float8_layers, freeze_to_float8
from ligertune.models.lora import SHARED_INPUTS, patch_lora
from ligertune.models.quantize import parameter_count
from ligertune.numerics import relative_error
from ligertune.recipe import load_recipe

LAYERS = 2


def frozen_linear(n_in: int = 96, n_out: int = 64, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(n_in, n_out, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():  # output channels of different ranges, as trained weights have
        linear.weight.mul_(torch.logspace(-1, 1, n_out, dtype=torch.bfloat16)[:, None])
    return linear


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[:, None]


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_input_gradient_are_the_float8_products(bias):
    linear = frozen_linear(bias=bias)
    layer = Float8FrozenLinear(linear)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    assert y.shape == (3, 5, 64) and y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16

    w = dequantized(layer.weight, layer.weight_scale)
    x2, dy2 = x.detach().reshape(-1, 96), dy.reshape(-1, 64)
    y_exact = dequantized(*quantize_rows(x2)) @ w.T + (linear.bias.double() if bias else 0)
    # dy W = (dy * s_W) q_W: the weight's channel scales go into dy before its cast
    dx_exact = dequantized(*quantize_rows(dy2, layer.weight_scale)) @ layer.weight.double()
    assert relative_error(y.reshape(-1, 64), y_exact) < 4e-3  # float32 accumulation, bf16 output
    assert relative_error(x.grad.reshape(-1, 96), dx_exact) < 4e-3
    # and close to bf16's own products: 3 bits of mantissa an operand
    assert relative_error(y.reshape(-1, 64), x2.double() @ linear.weight.double().T
                          + (linear.bias.double() if bias else 0)) < 0.06
    assert relative_error(x.grad.reshape(-1, 96), dy2.double() @ linear.weight.double()) < 0.06


def test_the_weight_is_one_byte_a_value_frozen_and_not_state():
    layer = Float8FrozenLinear(frozen_linear())
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (64,)
    assert list(layer.parameters()) == [] and layer.state_dict() == {}
    x = torch.randn(4, 96, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is None
    assert saved == []  # nothing for the backward: not x, and not the weight as an activation


def test_layers_that_read_the_same_input_cast_it_once(monkeypatch):
    import ligertune.models.float8 as float8

    casts = []
    monkeypatch.setattr(float8, "quantize_rows", lambda x, *a: casts.append(x) or quantize_rows(x, *a))
    layers = [Float8FrozenLinear(frozen_linear(seed=i)) for i in range(3)]
    x = torch.randn(2, 5, 96, dtype=torch.bfloat16)
    alone = [layer(x.clone()) for layer in layers]
    casts.clear()
    together = [layer(x) for layer in layers]
    assert len(casts) == 1 and all(torch.equal(a, b) for a, b in zip(alone, together))
    x.mul_(2)  # changed in place: cast again
    assert torch.equal(layers[0](x), 2 * together[0]) and len(casts) == 2
    layers[0](x[:1])  # another view of it
    assert len(casts) == 3
    assert not layers[0](x.view(-1, 96))._is_view()  # the fast LoRA forward sums into a 2-D output in place
    del x, casts[:]
    assert float8._cast_input._cast is None  # the cast goes with its input


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


def lora_model(dtype: torch.dtype = torch.bfloat16):
    model = make_model("llama", attention="sdpa", dtype=dtype)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize("fast", [True, False])
def test_lora_over_a_float8_base_trains_as_over_bf16(fast):
    model = lora_model()
    reference = copy.deepcopy(model)
    assert freeze_to_float8(model) == 7 * LAYERS  # the base layers inside peft's; not the output layer
    assert float8_layers(model) == 7 * LAYERS and type(model.get_output_embeddings()) is not Float8FrozenLinear
    if fast:
        patch_lora(model)
        patch_lora(reference)
    (loss, grads), (loss0, grads0) = loss_and_grads(model, batch()), loss_and_grads(reference, batch())
    assert relative_error(loss, loss0) < 1e-2
    assert grads.keys() == grads0.keys() and all("lora_" in n for n in grads)
    for name in grads:
        assert relative_error(grads[name], grads0[name]) < 0.25, name


def test_siblings_over_a_float8_base_run_as_one_gemm_with_the_values_of_each(monkeypatch):
    import ligertune.models.float8 as float8

    model = lora_model(torch.float32)  # float32 around the float8 GEMMs: only their casts round
    exact = copy.deepcopy(model)  # its base in float32
    freeze_to_float8(model)
    for names in SHARED_INPUTS:  # each layer's weight: its rows of the joined one, no copy
        blocks = [m for m in model.modules() if hasattr(m, names[0])]
        assert len(blocks) == LAYERS
        for block in blocks:
            layers = [getattr(block, name).base_layer for name in names]
            siblings = layers[0].siblings
            assert siblings is not None and siblings.layers == tuple(layers)
            ends = [0, *itertools.accumulate(layer.weight.numel() for layer in layers)][:-1]
            assert [layer.weight.data_ptr() - siblings.weight.data_ptr() for layer in layers] == ends
    apart = copy.deepcopy(model)
    for layer in apart.modules():
        if isinstance(layer, Float8FrozenLinear):
            layer.siblings = None  # each layer its own GEMM, over the same float8 weights
    for each in (model, apart, exact):
        patch_lora(each)
    gemms = []
    scaled_matmul = float8._scaled_matmul
    monkeypatch.setattr(float8, "_scaled_matmul", lambda *args: gemms.append(1) or scaled_matmul(*args))
    loss, grads = loss_and_grads(model, batch())
    joined_gemms, gemms[:] = len(gemms), []
    loss0, grads0 = loss_and_grads(apart, batch())
    # forward, then backward, where the first layer's q, k and v (over frozen embeddings) need no
    # input gradient: (q, k, v), o, (gate, up), down joined; all 7 apart
    assert (joined_gemms, len(gemms)) == (4 * LAYERS + 4 * LAYERS - 1, 7 * LAYERS + 7 * LAYERS - 3)
    assert relative_error(loss, loss0) < 1e-6
    assert grads.keys() == grads0.keys()
    last_mlp = f"layers.{LAYERS - 1}.mlp."
    for name in grads:  # above the first joined input gradient (the last MLP's adapters): the same
        if last_mlp in name:
            assert relative_error(grads[name], grads0[name]) < 1e-5, name
    # Below, a joined input gradient casts its layers' output gradients with one scale a token where
    # apart each had its own: other float8 roundings of the same values, as far from the gradients
    # over a float32 base as the separate layers' are.
    _, grads_exact = loss_and_grads(exact, batch())
    joined, alone, want = (torch.cat([g[n].flatten() for n in grads]) for g in (grads, grads0, grads_exact))
    assert relative_error(joined, alone) < 3e-2
    assert relative_error(joined, want) < 1.1 * relative_error(alone, want)


def test_a_float8_base_counts_as_the_model_it_stands_for():
    """The parameter count and the flops behind MFU see a float8 layer's weight, held as a buffer."""
    model = lora_model()
    before = parameter_count(model), StepFlops.of(model)
    freeze_to_float8(model)
    assert (parameter_count(model), StepFlops.of(model)) == before


@pytest.mark.parametrize("sections", [{"lora": {"r": 4}}, {"objective": {"name": "medusa"}}], ids=["lora", "medusa"])
def test_a_frozen_base_in_fp8_is_built_in_float8(tmp_path, monkeypatch, sections):
    """`build_model`: under LoRA, and under Medusa heads over a frozen model, the frozen decoder
    becomes float8 (no torchao needed); the refusal of a device without float8 tensor cores is
    stubbed out, since this runs on the CPU."""
    from ligertune.training import build

    monkeypatch.setattr(build, "check_float8", lambda device, torchao: calls.append(torchao))
    calls = []
    recipe = load_recipe(write_recipe(tmp_path, model={"dtype": "bfloat16"}, **sections))
    recipe.train.precision = "fp8"
    built = build.build_model(recipe, device=torch.device("cpu"), vocab_size=302)
    assert calls == [False]  # torchao is not asked for
    linears = sum(type(m) is torch.nn.Linear for m in built.module.modules())
    assert float8_layers(built.module) == 7 * 2 and linears > 0  # the adapters and the output layer stay
    assert all(p.requires_grad == ("lora_" in n) for n, p in built.module.named_parameters())  # none for Medusa


def test_mlps_in_chunks_run_over_a_float8_base_as_whole_ones():
    """`kernels.mlp_chunk_tokens` over a float8 base (LoRA's): each token's cast has its own scale, so
    chunks of tokens give the whole MLPs' loss and adapter gradients."""
    from ligertune.models import patch_model

    results = []
    for chunk in (None, 8):
        model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
        patch_model(model, mlp_chunk_tokens=chunk)
        torch.manual_seed(1)  # the same adapters for both
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           task_type="CAUSAL_LM"), autocast_adapter_dtype=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        freeze_to_float8(model)
        patch_lora(model)
        results.append(loss_and_grads(model, batch()))
    (want_loss, want), (got_loss, got) = results
    assert relative_error(got_loss, want_loss) < 1e-6
    for name in want:  # the adapters' gradients add up over the chunks in bf16
        assert relative_error(got[name], want[name]) < 1e-2, name


def test_mlp_chunks_with_fp8_are_taken_over_a_frozen_base(tmp_path):
    """(Over weights that train, only torchao's layers refuse them: test_float8_trained.py.)"""
    sections = {"model": {"dtype": "bfloat16"}, "kernels": {"mlp_chunk_tokens": 64}}
    recipe = load_recipe(write_recipe(tmp_path, lora={"r": 4}, **sections), ["train.precision=fp8"])
    assert recipe.kernels.mlp_chunk_tokens == 64


def test_a_layer_that_lora_copies_to_train_keeps_its_original():
    """`lora.modules_to_save`: peft trains a copy and keeps the original for the adapters-off path (a
    DPO reference pass), where the loss reads the output projection as a matrix: it stays bf16."""
    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["lm_head"],
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    assert freeze_to_float8(model) == 7 * LAYERS
    wrapper = model.base_model.model.lm_head
    assert type(wrapper.original_module) is torch.nn.Linear
    with model.disable_adapter():
        assert torch.isfinite(model(batch()).logits).all()
