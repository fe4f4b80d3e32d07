"""A frozen layer in float8 (`Float8FrozenLinear`) on float8 tensor cores, at Llama-3.1-8B's shapes:
its forward and input gradient are the products of the float8 operands with their scales (float64
products of the dequantized operands, computed on the GPU), and close to bf16's. On the CPU torch's
float8 GEMM is a reference implementation; here it is cuBLAS's, whose operand layouts and scale
shapes the CPU does not check. The same for a layer whose weight trains (`Float8TrainedLinear`),
its weight gradient in float8 included.
Siblings joined into one float8 GEMM (q, k, v; gate, up), frozen under LoRA or trained, with the
patched kernels (SwiGLU's row kernels over gate and up side by side), train as the layers apart.

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/gpu/test_gpu_float8_frozen.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_gpu_fast_lora import loss_and_grads, with_adapters
from test_gpu_models import SMALL_LLAMA, small_llama

from ligertune.kernels import quantize_rows, quantize_transposed
from ligertune.models import patch_model, unpatch_model
from ligertune.models.float8 import (
    Float8FrozenLinear, Float8TrainedGroup, Float8TrainedLinear, freeze_to_float8, train_in_float8,
)
from ligertune.models.lora import patch_lora
from ligertune.numerics import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a GPU with float8 tensor cores (compute capability 8.9+)"),
]


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[:, None]


def scaled_linear(n_in: int, n_out: int) -> torch.nn.Linear:
    """A bias-free bf16 layer on the GPU whose output channels differ in range, as trained ones do."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(n_in, n_out, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-1, 1, n_out, device="cuda", dtype=torch.bfloat16)[:, None])
    return linear


@pytest.mark.parametrize("n_in, n_out", [(4096, 1024), (4096, 14336), (14336, 4096)])
def test_the_float8_products_at_8b_shapes(n_in, n_out):
    linear = scaled_linear(n_in, n_out).requires_grad_(False)
    layer = Float8FrozenLinear(linear)
    x = torch.randn(1000, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # not a multiple of 16
    dy = torch.randn(1000, n_out, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    w = dequantized(layer.weight, layer.weight_scale)
    y_exact = dequantized(*quantize_rows(x.detach())) @ w.T
    dx_exact = dequantized(*quantize_rows(dy, layer.weight_scale)) @ layer.weight.double()
    assert relative_error(y, y_exact) < 4e-3
    assert relative_error(x.grad, dx_exact) < 4e-3
    assert relative_error(y, x.detach().double() @ linear.weight.double().T) < 0.06
    assert relative_error(x.grad, dy.double() @ linear.weight.double()) < 0.06


@pytest.mark.parametrize("n_in, n_out", [(2048, 512), (2048, 8192), (8192, 2048)])
def test_the_trained_layers_float8_products_at_1b_shapes(n_in, n_out):
    """`Float8TrainedLinear` (`kernels.float8_linear`): the same float8 products, the weight cast at
    each use; the weight's gradient bf16's GEMM."""
    linear = scaled_linear(n_in, n_out)
    layer = Float8TrainedLinear(linear)
    x = torch.randn(1000, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # not a multiple of 16
    dy = torch.randn(1000, n_out, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    q_w, s_w = quantize_rows(linear.weight.detach())
    y_exact = dequantized(*quantize_rows(x.detach())) @ dequantized(q_w, s_w).T
    dx_exact = dequantized(*quantize_rows(dy, s_w)) @ q_w.double()
    assert relative_error(y, y_exact) < 4e-3
    assert relative_error(x.grad, dx_exact) < 4e-3
    assert relative_error(y, x.detach().double() @ linear.weight.double().T) < 0.06
    assert relative_error(x.grad, dy.double() @ linear.weight.double()) < 0.06
    assert torch.equal(layer.weight.grad, dy.t() @ x.detach())


def assert_joined_train_as_apart(bf16: torch.nn.Module, joined: torch.nn.Module, apart: torch.nn.Module,
                                 lora: bool) -> None:
    """One step of each, with the patched kernels (and the fast LoRA forward): the joined siblings'
    loss and gradients those of the layers apart, within float8's other roundings of the same values
    (one scale a token for a group's output gradients), and as far from bf16's."""
    models = (bf16, joined, apart)
    ids = torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 1024), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    try:
        for model in models:
            patch_model(model)
            if lora:
                patch_lora(model)
        (loss_b, grads_b), (loss_j, grads_j), (loss_a, grads_a) = (loss_and_grads(m, ids) for m in models)
    finally:  # the patches rebind names in the modeling module, for every later model of its family
        for model in models:
            unpatch_model(model)
    assert relative_error(loss_j, loss_a) < 5e-3
    assert relative_error(grads_j, grads_a) < 5e-2
    assert relative_error(grads_j, grads_b) <= 1.2 * relative_error(grads_a, grads_b)


def test_joined_siblings_under_fast_lora_train_as_the_layers_apart():
    bf16 = with_adapters(torch.bfloat16)
    joined = copy.deepcopy(bf16)
    freeze_to_float8(joined)
    apart = copy.deepcopy(joined)
    for layer in apart.modules():
        if isinstance(layer, Float8FrozenLinear):
            layer.siblings = None  # each layer its own GEMM, over the same float8 weights
    assert_joined_train_as_apart(bf16, joined, apart, lora=True)


def test_joined_trained_siblings_train_as_the_layers_apart():
    """Full fine-tuning in float8 (`train_in_float8`): q, k and v, and gate and up, as one float8 GEMM
    each (`Float8TrainedGroup`)."""
    bf16 = small_llama(torch.bfloat16)
    joined = copy.deepcopy(bf16)
    train_in_float8(joined)
    apart = copy.deepcopy(joined)
    for layer in apart.modules():
        if isinstance(layer, Float8TrainedLinear):
            Float8TrainedGroup([layer])  # each layer its own GEMM
    assert_joined_train_as_apart(bf16, joined, apart, lora=False)


@pytest.mark.parametrize("n_in, n_out", [(2048, 512), (2048, 8192), (8192, 2048)])
def test_the_weight_gradient_in_float8_at_1b_shapes(n_in, n_out):
    """`kernels.float8_weight_grad`: dy^T x on the float8 tensor cores from dy in e5m2 and x in e4m3,
    one scale each, over 1000 tokens padded to 1008: the float64 product of the casts, and close to
    the bf16 gradient."""
    linear = scaled_linear(n_in, n_out)
    layer = Float8TrainedLinear(linear, weight_grad_in_float8=True)
    x = torch.randn(1000, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1000, n_out, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(dy)
    (q_dy, s_dy), (q_x, s_x) = quantize_transposed(dy, torch.float8_e5m2), quantize_transposed(x.detach())
    exact = (q_dy.double() * s_dy.double()) @ (q_x.double() * s_x.double()).T
    assert relative_error(layer.weight.grad, exact) < 4e-3
    assert relative_error(layer.weight.grad, dy.double().T @ x.detach().double()) < 0.1
