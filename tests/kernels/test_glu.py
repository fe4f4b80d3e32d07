"""The SwiGLU and GeGLU gates: the Triton path against the reference (y, dgate, dup) and a float64
formula, and the reference against the MLPs of `transformers` (LlamaMLP, GemmaMLP) bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import DEVICE, rel_err

import ligertune.kernels as K
from ligertune.kernels import reference
from ligertune.models.columns import split_columns

SHAPES = [
    pytest.param((37, 123), id="N37-I123"),
    pytest.param((3, 37, 123), id="B3-L37-I123"),  # 13653 elements: 4 blocks of glu.BLOCK=4096, one partial
    pytest.param((7,), id="N7"),
]

# (dtype, relative tolerance ||a - b|| / ||b|| on values and on every gradient)
DTYPES = [
    pytest.param(torch.float32, 1e-6, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, id="bf16"),
]


GLUS = [pytest.param("swiglu", id="swiglu"), pytest.param("geglu", id="geglu")]
"""The public kernels, each the name of a `ligertune.kernels` and a `reference` function."""


def make_inputs(shape, dtype, scale=2.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * s).to(DEVICE, dtype) for s in (scale, 1.0, 1.0)]


def run(fn, gate, up, dy):
    gate = gate.detach().clone().requires_grad_(True)
    up = up.detach().clone().requires_grad_(True)
    y = fn(gate, up)
    y.backward(dy)
    return y.detach(), gate.grad, up.grad


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("glu", GLUS)
def test_triton_matches_reference(triton_path, glu, shape, dtype, tol):
    gate, up, dy = make_inputs(shape, dtype)
    got = run(getattr(K, glu), gate, up, dy)
    want = run(getattr(reference, glu), gate, up, dy)
    for name, a, b in zip(("y", "dgate", "dup"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < tol, name


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("glu", GLUS)
def test_extreme_gates_and_strided_inputs(triton_path, glu, dtype, tol):
    """Gates far into both tails (exp(-g) overflows to inf for g << 0), given as non-contiguous views."""
    gate, up, dy = make_inputs((37, 246), dtype, scale=60.0, seed=1)
    gate, up = gate[:, ::2], up.t().contiguous().t()[:, 1::2]
    dy = dy[:, :123]
    got = run(getattr(K, glu), gate, up, dy)
    want = run(getattr(reference, glu), gate, up, dy)
    for name, a, b in zip(("y", "dgate", "dup"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < tol, name


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("glu", GLUS)
def test_reuse_inputs_gives_the_same_gradients_in_their_memory(triton_path, glu, dtype, tol):
    """The gradients are those of the default path, bit for bit, written over gate and up."""
    gate0, up0, dy = make_inputs((37, 123), dtype, seed=4)
    want = run(getattr(K, glu), gate0, up0, dy)

    leaf_gate, leaf_up = gate0.clone().requires_grad_(True), up0.clone().requires_grad_(True)
    gate, up = leaf_gate * 1, leaf_up * 1  # intermediates, as gate_proj(x) and up_proj(x) are
    seen = {}
    gate.register_hook(lambda g: seen.setdefault("dgate", g))
    up.register_hook(lambda g: seen.setdefault("dup", g))
    y = getattr(K, glu)(gate, up, reuse_inputs=True)
    y.backward(dy, retain_graph=True)
    assert torch.equal(y, want[0])
    assert torch.equal(leaf_gate.grad, want[1]) and torch.equal(leaf_up.grad, want[2])
    assert seen["dgate"].data_ptr() == gate.data_ptr() and seen["dup"].data_ptr() == up.data_ptr()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)  # gate and up are gone: a second backward must not run on them


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("glu", GLUS)
def test_gate_and_up_side_by_side_are_read_and_written_where_they_are(triton_path, glu, dtype, tol):
    """gate and up as the two halves of one [tokens, 2 I] output (a joined float8 GEMM's): the
    contiguous path's values, bit for bit, with the gradients written over the halves and no copy."""
    gate0, up0, dy = make_inputs((3, 37, 123), dtype, seed=5)
    want = run(getattr(K, glu), gate0, up0, dy)
    leaf = torch.cat([gate0, up0], dim=-1).requires_grad_(True)
    joined = leaf * 1
    gate, up = joined.split(123, dim=-1)
    assert not gate.is_contiguous()
    y = getattr(K, glu)(gate, up, reuse_inputs=True)
    y.backward(dy)
    assert torch.equal(y, want[0]) and y.is_contiguous()
    assert torch.equal(leaf.grad, torch.cat(want[1:], dim=-1))
    assert torch.equal(joined.detach(), torch.cat(want[1:], dim=-1))  # written over the halves


def _gelu_tanh(g):
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


def _silu(g):
    return g * torch.sigmoid(g)


@pytest.mark.parametrize("glu, activation", [("swiglu", _silu), ("geglu", _gelu_tanh)],
                         ids=["swiglu", "geglu"])
def test_kernel_against_float64_formula(triton_path, glu, activation):
    gate, up, dy = make_inputs((37, 123), torch.float32, seed=2)
    y, dgate, dup = run(getattr(K, glu), gate, up, dy)
    g64, u64 = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    y64 = activation(g64) * u64
    y64.backward(dy.double())
    assert rel_err(y, y64) < 1e-6
    assert rel_err(dgate, g64.grad) < 1e-6
    assert rel_err(dup, u64.grad) < 1e-6


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_reference_is_transformers_mlp(family, dtype):
    """`down_proj(glu(gate_proj(x), up_proj(x)))` is the MLP's forward and backward, to the bit:
    LlamaMLP's with `swiglu`, GemmaMLP's (`gelu_pytorch_tanh`) with `geglu`."""
    from transformers import GemmaConfig, LlamaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(3)
    sizes = dict(hidden_size=24, intermediate_size=61, num_attention_heads=2)
    if family == "llama":
        mlp, glu = LlamaMLP(LlamaConfig(**sizes, hidden_act="silu")), reference.swiglu
    else:
        mlp, glu = GemmaMLP(GemmaConfig(**sizes, hidden_act="gelu_pytorch_tanh")), reference.geglu
    mlp = mlp.to(DEVICE, dtype)
    x = torch.randn(3, 7, 24).to(DEVICE, dtype)
    dy = torch.randn(3, 7, 24).to(DEVICE, dtype)

    def grads_of(forward):
        mlp.zero_grad()
        x_ = x.clone().requires_grad_(True)
        out = forward(x_)
        out.backward(dy)
        return [out.detach(), x_.grad, *(p.grad.clone() for p in mlp.parameters())]

    want = grads_of(mlp)
    got = grads_of(lambda x_: mlp.down_proj(glu(mlp.gate_proj(x_), mlp.up_proj(x_))))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("glu", GLUS)
def test_bad_arguments_raise(glu):
    gate, up, _ = make_inputs((4, 8), torch.float32)
    with pytest.raises(ValueError, match="share shape and dtype"):
        getattr(reference, glu)(gate, up[:, :7])
    with pytest.raises(ValueError, match="share shape and dtype"):
        getattr(reference, glu)(gate, up.double())


def test_gate_and_up_gradients_reach_the_joined_gemm_where_swiglu_wrote_them(monkeypatch):
    monkeypatch.setenv("LIGERTUNE_KERNELS", "triton")  # the kernel that writes over gate and up
    torch.manual_seed(0)
    leaf = torch.randn(2, 5, 14, device=DEVICE, requires_grad=True)
    joined = leaf * 1  # a joined GEMM's output: gate's columns, then up's
    seen = {}
    joined.register_hook(lambda g: seen.setdefault("grad", g))
    gate, up = split_columns(joined, [7, 7])
    dy = torch.randn(2, 5, 7, device=DEVICE)
    K.swiglu(gate, up, reuse_inputs=True).backward(dy)
    gate0, up0 = (t.detach().requires_grad_(True) for t in leaf.detach().split(7, dim=-1))
    K.swiglu(gate0, up0).backward(dy)
    assert seen["grad"].data_ptr() == joined.data_ptr()  # no copy: SwiGLU's gradients, where it wrote them
    assert torch.equal(leaf.grad, torch.cat([gate0.grad, up0.grad], dim=-1))
    # gradients that are not one buffer's adjacent columns are joined by a copy, as torch.split's
    q, v = split_columns(leaf * 1, [7, 7])
    leaf.grad = None
    (q.sum() + 2 * v.sum()).backward()
    assert torch.equal(leaf.grad, torch.cat([torch.ones(2, 5, 7), torch.full((2, 5, 7), 2.0)], dim=-1).to(DEVICE))
