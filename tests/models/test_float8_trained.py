"""ligertune's float8 layers for weights that train (`train.precision: fp8` with
`kernels.float8_linear`, `Float8TrainedLinear`): the product and the input's gradient are exactly
those of the float8 operands with their scales (checked against float64 products of the dequantized
operands) and close to bf16's, the weight's gradient is bf16's own GEMM, the layer is the
`nn.Linear` it replaced to everything that saves or optimizes it, and a model trains through it as in
bf16, gradient checkpointing included. On the CPU the same float8 values are multiplied in float32;
on a GPU the float8 tensor cores do (tests/gpu/test_gpu_float8_frozen.py, tests/gpu/test_gpu_fp8.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_float8_frozen import batch, dequantized, frozen_linear, loss_and_grads
from tiny_models import make_model
from tiny_recipe import write_recipe

import ligertune.models.float8 as float8
from ligertune.errors import UserError
from ligertune.kernels import quantize_rows, quantize_transposed
from ligertune.models import patch_model
from ligertune.models.float8 import Float8TrainedGroup, Float8TrainedLinear, float8_layers, train_in_float8
from ligertune.numerics import relative_error
from ligertune.recipe import load_recipe

LAYERS = 2


def trained_linear(n_in: int = 96, n_out: int = 64, bias: bool = False) -> torch.nn.Linear:
    return frozen_linear(n_in, n_out, bias).requires_grad_(True)


@pytest.mark.parametrize("bias", [False, True])
def test_the_products_are_float8_and_the_weight_gradient_is_bf16s(bias):
    linear = trained_linear(bias=bias)
    layer = Float8TrainedLinear(linear)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    assert y.shape == (3, 5, 64) and y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16

    q_w, s_w = quantize_rows(linear.weight.detach())
    x2, dy2 = x.detach().reshape(-1, 96), dy.reshape(-1, 64)
    y_exact = dequantized(*quantize_rows(x2)) @ dequantized(q_w, s_w).T + (linear.bias.double() if bias else 0)
    dx_exact = dequantized(*quantize_rows(dy2, s_w)) @ q_w.double()  # W's channel scales folded into dy
    assert relative_error(y.reshape(-1, 64), y_exact) < 4e-3  # float32 accumulation, bf16 output
    assert relative_error(x.grad.reshape(-1, 96), dx_exact) < 4e-3
    assert relative_error(y.reshape(-1, 64), x2.double() @ linear.weight.double().T
                          + (linear.bias.double() if bias else 0)) < 0.06  # 3 bits of mantissa an operand
    assert torch.equal(layer.weight.grad, dy2.t() @ x2)  # the weight's gradient: bf16's GEMM, no float8
    if bias:
        assert torch.equal(layer.bias.grad, dy2.sum(0))


def test_the_weight_gradient_in_float8_is_the_product_of_its_casts():
    """`weight_grad_in_float8`: dy^T x from dy in e5m2 and x in e4m3, one scale each, the 13 tokens
    padded to 16 with zeros; the product and the input's gradient as without it."""
    linear = trained_linear()
    layer, plain = Float8TrainedLinear(linear, weight_grad_in_float8=True), Float8TrainedLinear(linear)
    x = torch.randn(13, 96, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(13, 64, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    dw, dx = linear.weight.grad.clone(), x.grad.clone()
    linear.weight.grad, x.grad = None, None
    y_plain = plain(x)
    y_plain.backward(dy)
    assert torch.equal(y, y_plain) and torch.equal(dx, x.grad)

    (q_dy, s_dy), (q_x, s_x) = quantize_transposed(dy, torch.float8_e5m2), quantize_transposed(x.detach())
    assert q_dy.shape == (64, 16) and q_x.shape == (96, 16) and q_dy[:, 13:].float().eq(0).all()
    exact = (q_dy.double() * s_dy.double()) @ (q_x.double() * s_x.double()).T
    assert dw.dtype == torch.bfloat16 and relative_error(dw, exact) < 4e-3
    assert relative_error(dw, dy.double().T @ x.detach().double()) < 0.1  # 2 bits of mantissa for dy


def test_the_layer_is_the_linear_it_replaced_and_casts_the_weight_as_it_is_now():
    linear = trained_linear(bias=True)
    parameters, state = list(linear.parameters()), linear.state_dict()
    layer = Float8TrainedLinear(linear)
    assert isinstance(layer, torch.nn.Linear) and list(layer.parameters()) == parameters
    assert layer.state_dict().keys() == state.keys()
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    before = layer(x)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert [(t.data_ptr(), t.shape) for t in saved] == [(x.data_ptr(), x.shape)]  # x, for the weight's gradient
    torch.optim.SGD(layer.parameters(), lr=0.1).step()  # in place, as every optimizer steps
    assert not torch.equal(layer(x), before)  # the new weight is cast, not the last step's


def test_a_model_trains_through_the_float8_layers_as_in_bf16():
    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    patch_model(model)
    reference = copy.deepcopy(model)
    assert train_in_float8(model) == 7 * LAYERS and float8_layers(model) == 7 * LAYERS
    assert type(model.lm_head) is torch.nn.Linear  # the fused loss reads it as one matrix
    assert model.state_dict().keys() == reference.state_dict().keys()
    (loss, grads), (loss0, grads0) = loss_and_grads(model, batch()), loss_and_grads(reference, batch())
    assert relative_error(loss, loss0) < 1e-2
    assert grads.keys() == grads0.keys()
    for name in grads:
        assert relative_error(grads[name], grads0[name]) < 0.25, name


def test_a_model_trains_with_the_weight_gradients_in_float8_too():
    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    patch_model(model)
    reference = copy.deepcopy(model)
    assert train_in_float8(model, weight_grad=True) == 7 * LAYERS
    assert all(m.weight_grad_in_float8 for m in model.modules() if isinstance(m, Float8TrainedLinear))
    (loss, grads), (loss0, grads0) = loss_and_grads(model, batch()), loss_and_grads(reference, batch())
    assert relative_error(loss, loss0) < 1e-2
    for name in grads:
        assert relative_error(grads[name], grads0[name]) < 0.15, name  # 0.097 measured


def test_the_weight_gradient_in_float8_needs_ligertunes_layers(tmp_path):
    sections = {"train": {"precision": "fp8", "device": "auto"},
                "kernels": {"float8_weight_grad": True, "float8_linear": False}}
    with pytest.raises(UserError, match="kernels.float8_weight_grad: .*needs train.precision: fp8 and "
                                        "kernels.float8_linear: true"):
        load_recipe(write_recipe(tmp_path, **copy.deepcopy(sections)))
    del sections["kernels"]["float8_linear"]  # ligertune's layers: the default
    assert load_recipe(write_recipe(tmp_path, **sections)).kernels.float8_weight_grad
    with pytest.raises(UserError, match="kernels.float8_weight_grad"):
        load_recipe(write_recipe(tmp_path, kernels={"float8_weight_grad": True}))  # bf16


def float8_model(checkpointed: bool) -> torch.nn.Module:
    """The tiny Llama, patched, in training mode, its layers ligertune's float8 ones."""
    from ligertune.training.build import enable_gradient_checkpointing

    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    patch_model(model)
    train_in_float8(model)
    if checkpointed:
        enable_gradient_checkpointing(model)
    return model.train()


def test_a_recompute_skips_down_proj_and_checkpointing_changes_nothing(monkeypatch):
    """Under gradient checkpointing a recomputed layer's down_proj product, which nothing the layer
    keeps reads, is skipped: once a step instead of twice, the loss and gradients bit for bit those
    without checkpointing."""
    runs = []
    for checkpointed in (False, True):
        model = float8_model(checkpointed)
        config = model.config
        products = []
        original = float8._float8_product
        monkeypatch.setattr(float8, "_float8_product", lambda x, w: products.append(tuple(w.weight.shape))
                            or original(x, w))
        loss, grads = loss_and_grads(model, batch())
        monkeypatch.setattr(float8, "_float8_product", original)
        runs.append((products.count((config.hidden_size, config.intermediate_size)), len(products), loss, grads))
    (down, total, loss, grads), (down_c, total_c, loss_c, grads_c) = runs
    assert down == down_c == LAYERS
    assert total == 4 * LAYERS  # q, k and v as one; o; gate and up as one; down
    assert total_c == 2 * total - LAYERS  # every other product runs again in the recompute
    assert torch.equal(loss, loss_c) and grads.keys() == grads_c.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name


def layers_apart(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model.modules():
        if isinstance(layer, Float8TrainedLinear):
            Float8TrainedGroup([layer])
    return model


def test_siblings_multiply_as_one_and_train_as_the_layers_apart():
    """q, k and v, and gate and up, are joined: one float8 product and one backward node for each
    group, the weights cast as one. The products are those of the layers apart (the same scales a
    token and a channel); the gradients differ by the output gradients' cast, a scale a token over
    the group's columns."""
    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    patch_model(model)
    reference = copy.deepcopy(model)
    train_in_float8(model)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.q_proj.group.layers == (attention.q_proj, attention.k_proj, attention.v_proj)
    assert mlp.gate_proj.group.layers == (mlp.gate_proj, mlp.up_proj)
    assert attention.o_proj.group.layers == (attention.o_proj,)
    assert mlp.down_proj.group.layers == (mlp.down_proj,)
    assert repr(attention.k_proj).endswith("bias=False, float8 products, one GEMM for 3 layers, "
                                           "weight gradient in bfloat16)")
    assert repr(mlp.down_proj).endswith("bias=False, float8 products, weight gradient in bfloat16)")
    apart = layers_apart(copy.deepcopy(model))
    (loss, grads), (loss_a, grads_a), (_, grads0) = (loss_and_grads(m, batch()) for m in (model, apart, reference))
    assert relative_error(loss, loss_a) < 1e-3
    for name in grads:
        assert relative_error(grads[name], grads_a[name]) < 0.1, name
        assert relative_error(grads[name], grads0[name]) < 0.25, name  # as far from bf16 as the layers apart


def test_a_recompute_hands_its_weights_cast_to_the_backward(monkeypatch):
    """Under checkpointing a group's weights are cast in the forward and in the recompute, whose cast
    serves the backward right after it: twice a step, as without checkpointing. A cast kept from
    another backward, or from weights changed since, is not used."""
    casts = []
    original = Float8TrainedGroup.cast_weights
    monkeypatch.setattr(Float8TrainedGroup, "cast_weights", lambda g: casts.append(g) or original(g))
    for checkpointed in (False, True):
        model = float8_model(checkpointed)
        casts.clear()
        loss_and_grads(model, batch())
        assert len(casts) == 2 * 4 * LAYERS, checkpointed  # down_proj's recompute skips its product

    group = model.model.layers[0].self_attn.q_proj.group
    kept = group.cast_weights()
    group.keep_for_backward(kept)
    assert group.kept_or_cast() is kept and group.kept_or_cast() is not kept  # taken once
    group.keep_for_backward(kept)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert group.kept_or_cast() is not kept


def test_the_mlp_in_chunks_is_refused_only_with_torchaos_layers(tmp_path):
    sections = {"train": {"precision": "fp8", "device": "auto"},
                "kernels": {"mlp_chunk_tokens": 64, "float8_linear": False}}
    with pytest.raises(UserError, match="kernels.mlp_chunk_tokens: not with train.precision: fp8 through torchao"):
        load_recipe(write_recipe(tmp_path, **copy.deepcopy(sections)))
    del sections["kernels"]["float8_linear"]
    assert load_recipe(write_recipe(tmp_path, **sections)).kernels.float8_linear  # the default


@pytest.mark.parametrize("sections", [
    {"train": {"precision": "fp8", "fp8_scaling": "tensorwise"}},
    {"train": {"precision": "fp8", "fp8_scaling": "rowwise"}, "lora": {"r": 4}},
], ids=["ligertune's layers", "a frozen base"])
def test_torchaos_scaling_is_refused_where_torchaos_layers_do_not_run(tmp_path, sections):
    with pytest.raises(UserError, match="train.fp8_scaling: applies to torchao's float8 layers only"):
        load_recipe(write_recipe(tmp_path, **sections))
    sections["kernels"] = {"float8_linear": False}
    if "lora" not in sections:
        assert load_recipe(write_recipe(tmp_path, **sections)).train.fp8_scaling == "tensorwise"


def test_the_run_and_bench_say_which_layers_multiply_in_float8(tmp_path):
    from ligertune.training.build import describe_float8

    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    train_in_float8(model)
    ours = load_recipe(write_recipe(tmp_path, train={"precision": "fp8"}))  # ligertune's layers: the default
    assert describe_float8(ours, model) == (f"{7 * LAYERS} linear layers multiply in float8 (ligertune's layers: "
                                            "a scale per output channel and per token, the weights' gradients in bf16)")
    both = load_recipe(write_recipe(tmp_path, train={"precision": "fp8"}, kernels={"float8_weight_grad": True}))
    assert describe_float8(both, model).endswith("the weights' gradients in float8 (e5m2 and e4m3, a scale a tensor))")
    torchao = load_recipe(write_recipe(tmp_path, train={"precision": "fp8", "fp8_scaling": "rowwise"},
                                       kernels={"float8_linear": False}))
    assert describe_float8(torchao, model).endswith("(torchao's layers, rowwise scales)")
    torchao = load_recipe(write_recipe(tmp_path, train={"precision": "fp8"}, kernels={"float8_linear": False}))
    assert describe_float8(torchao, model).endswith("(torchao's layers, tensorwise scales)")
