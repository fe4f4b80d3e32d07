"""RMSNorm: the Triton path against the reference (values, dx, dw), and the reference against the
`transformers` modules it stands in for (LlamaRMSNorm, GemmaRMSNorm), bit for bit.

Under TRITON_INTERPRET=1 (see conftest.py) the kernels run on the CPU at small odd shapes; with
TRITON_INTERPRET=0 the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, rel_err

import ligertune.kernels as K
from ligertune.kernels import reference

SHAPES = [
    pytest.param((37, 123), id="R37-H123"),
    pytest.param((3, 37, 123), id="B3-L37-H123"),
    # H=1000 makes tiles of 4 rows: 10 tiles over 4 programs, so a program sums dw over several tiles.
    pytest.param((2, 19, 1000), id="B2-L19-H1000"),
    pytest.param((5, 1, 64), id="B5-L1-H64"),
]

# (dtype, relative tolerance ||a - b|| / ||b|| on values and on every gradient)
DTYPES = [
    pytest.param(torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, id="bf16"),
]

MODES = [
    pytest.param(dict(offset=0.0), id="llama"),
    pytest.param(dict(offset=1.0), id="gemma"),
    pytest.param(dict(offset=1.0, casting="llama"), id="offset1-llama"),
    pytest.param(dict(offset=0.0, casting="gemma"), id="offset0-gemma"),
]


def make_inputs(shape, dtype, weight_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3.0 + 0.5).to(DEVICE, dtype)
    # A weight around its Llama value (1) or its Gemma value (0), far from constant.
    w = (torch.randn(shape[-1], generator=gen) * 0.5).to(DEVICE, weight_dtype or dtype)
    dy = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return x, w, dy


def run(fn, x, w, dy, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(w.requires_grad)
    y = fn(x, w, **kwargs)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(triton_path, shape, dtype, tol, mode):
    x, w, dy = make_inputs(shape, dtype)
    w.requires_grad_(True)
    y, dx, dw = run(K.rms_norm, x, w, dy, eps=1e-6, **mode)
    y_ref, dx_ref, dw_ref = run(reference.rms_norm, x, w, dy, eps=1e-6, **mode)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert rel_err(y, y_ref) < tol
    assert rel_err(dx, dx_ref) < tol
    assert rel_err(dw, dw_ref) < tol


def test_every_option_at_once(triton_path):
    """bf16 x with a float32 weight (the output follows torch's promotion), a nonzero non-Gemma
    offset, another eps, and x a non-contiguous view."""
    x, w, dy = make_inputs((2, 37, 246), torch.bfloat16, weight_dtype=torch.float32, seed=1)
    x, dy = x[..., ::2], dy[..., ::2].float()
    w = w[:123].clone().requires_grad_(True)
    options = dict(eps=1e-5, offset=0.5, casting="llama")
    y, dx, dw = run(K.rms_norm, x, w, dy, **options)
    y_ref, dx_ref, dw_ref = run(reference.rms_norm, x, w, dy, **options)
    assert y.dtype == y_ref.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(dx, dx_ref) < 1e-2
    assert rel_err(dw, dw_ref) < 1e-2


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_frozen_weight_still_gives_dx(triton_path, dtype, tol):
    x, w, dy = make_inputs((37, 123), dtype, seed=2)
    y, dx, dw = run(K.rms_norm, x, w, dy)
    y_ref, dx_ref, _ = run(reference.rms_norm, x, w, dy)
    assert dw is None
    assert rel_err(y, y_ref) < tol
    assert rel_err(dx, dx_ref) < tol


def test_kernel_against_float64_formula(triton_path):
    """Both casting modes agree with the plain formula in float64 (float32 inputs)."""
    x, w, dy = make_inputs((37, 123), torch.float32, seed=3)
    w.requires_grad_(True)
    for offset in (0.0, 1.0):
        y, dx, dw = run(K.rms_norm, x, w, dy, offset=offset)
        x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
        y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w64)
        y64.backward(dy.double())
        assert rel_err(y, y64) < 1e-6
        assert rel_err(dx, x64.grad) < 1e-5
        assert rel_err(dw, w64.grad) < 1e-5


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2"])
def test_reference_is_transformers_module(family, dtype):
    """Each casting of `rms_norm` is a `transformers` norm to the bit: "llama" LlamaRMSNorm's, "gemma"
    GemmaRMSNorm's with offset 1 and OLMo 2's with offset 0 (the weight multiplied in float32)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    x, w, dy = make_inputs((3, 37, 123), dtype, seed=4)
    norm, offset, casting = {"llama": (LlamaRMSNorm, 0.0, "llama"), "gemma": (GemmaRMSNorm, 1.0, "gemma"),
                             "olmo2": (Olmo2RMSNorm, 0.0, "gemma")}[family]
    module = norm(123, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        module.weight.copy_(w)

    x_hf = x.clone().requires_grad_(True)
    y_hf = module(x_hf)
    y_hf.backward(dy)
    y, dx, dw = run(reference.rms_norm, x, w.requires_grad_(True), dy, eps=1e-5, offset=offset,
                    casting=casting)
    assert torch.equal(y, y_hf.detach())
    assert torch.equal(dx, x_hf.grad)
    assert torch.equal(dw, module.weight.grad)


def test_bad_arguments_raise():
    x, w, _ = make_inputs((4, 8), torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        reference.rms_norm(x, w[:7])
    with pytest.raises(ValueError, match="casting must be one of"):
        reference.rms_norm(x, w, casting="olmo")
