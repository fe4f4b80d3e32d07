"""Every Triton kernel against `ligertune.kernels.reference` at the sizes of real training, on CUDA.

Llama-3-8B's hidden size and vocabulary over 8192 tokens, Qwen2.5-7B's vocabulary, a layer's
activations for 4 x 4096 tokens; bf16 and fp32; values and every gradient, with the tolerance rule
of `gpu_testing`. The tests/kernels tests check the same kernels at small odd shapes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from gpu_testing import assert_matches_reference

from ligertune import kernels
from ligertune.kernels import DivergenceOptions, LossOptions, reference

pytestmark = pytest.mark.gpu

BF16, FP32 = torch.bfloat16, torch.float32
EVERY_OPTION = dict(z_loss_weight=1e-4, label_smoothing=0.1, weighted=True, reduction="sum")


def generator(seed: int = 1) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(gen, *shape, dtype, scale=1.0, grad=True) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype).requires_grad_(grad)


def flce_inputs(n, h, v, dtype, *, weighted=False, ignored=0.1):
    """Hidden states and a weight giving logits of standard deviation ~2 (a trained LM head's), 10%
    of the targets ignored; token weights of about 1 / N, as the trainer passes them."""
    gen = generator()
    targets = torch.randint(0, v, (n,), generator=gen, device="cuda")
    targets[torch.rand(n, generator=gen, device="cuda") < ignored] = -100
    inputs = {
        "hidden": randn(gen, n, h, dtype=dtype),
        "weight": randn(gen, v, h, dtype=dtype, scale=2.0 / math.sqrt(h)),
        "targets": targets,
    }
    if weighted:
        inputs["token_weights"] = (0.5 + torch.rand(n, generator=gen, device="cuda")) / n
    return inputs


def flce(impl, **options):
    options = LossOptions(**options)

    def fn(hidden, weight, targets, token_weights=None):
        out = impl(hidden, weight, targets, token_weights=token_weights, options=options)
        return {"loss": out.loss, "z_loss": out.z_loss, "n_correct": out.n_correct, "n_tokens": out.n_tokens}

    return fn


@pytest.mark.parametrize(
    "n, h, v, dtype, options",
    [
        pytest.param(8192, 4096, 128256, BF16, {}, id="N8192-H4096-V128256-bf16-mean"),
        pytest.param(8192, 4096, 128256, BF16, EVERY_OPTION, id="N8192-H4096-V128256-bf16-every-option"),
        pytest.param(8192, 4096, 128256, BF16, dict(chunk_bytes=64 * 2**20),
                     id="N8192-H4096-V128256-bf16-64MiB-chunks"),
        pytest.param(4096, 3584, 152064, BF16, dict(softcap=30.0), id="N4096-H3584-V152064-bf16-softcap30"),
        pytest.param(4093, 2048, 32003, FP32, EVERY_OPTION, id="N4093-H2048-V32003-fp32-every-option"),
    ],
)
def test_fused_linear_cross_entropy(n, h, v, dtype, options):
    options = dict(options)
    inputs = flce_inputs(n, h, v, dtype, weighted=options.pop("weighted", False))
    assert_matches_reference(flce(kernels.fused_linear_cross_entropy, **options),
                             flce(reference.fused_linear_cross_entropy, **options), inputs,
                             counts=("n_correct", "n_tokens"))


def test_fused_linear_cross_entropy_per_token_losses():
    """reduction="none": the backward that recomputes the logits, with an upstream gradient per row."""
    n, h, v = 2048, 2048, 128256
    inputs = flce_inputs(n, h, v, BF16)

    def per_token(impl):
        options = LossOptions(reduction="none", label_smoothing=0.1)
        return lambda **x: {"loss": impl(**x, options=options).loss}

    upstream = {"loss": torch.rand(n, generator=generator(2), device="cuda")}
    assert_matches_reference(per_token(kernels.fused_linear_cross_entropy),
                             per_token(reference.fused_linear_cross_entropy), inputs, upstream)


def divergence(impl, **options):
    options = DivergenceOptions(**options)

    def fn(hidden, weight, teacher_hidden, teacher_weight, targets, token_weights=None):
        out = impl(hidden, weight, teacher_hidden, teacher_weight, targets, token_weights=token_weights,
                   options=options)
        return {field.name: getattr(out, field.name) for field in dataclasses.fields(out)}

    return fn


@pytest.mark.parametrize(
    "n, h, v, dtype, options",
    [
        pytest.param(8192, 4096, 128256, BF16, dict(divergence="jsd", reduction="mean"),
                     id="N8192-H4096-V128256-bf16-jsd"),
        pytest.param(8192, 4096, 128256, BF16,
                     dict(divergence="forward_kl", temperature=2.0, ce_weight=0.5, weighted=True),
                     id="N8192-H4096-V128256-bf16-fkl-tau2-alpha0.5-weights"),
        pytest.param(4096, 3584, 152064, BF16,
                     dict(divergence="reverse_kl", softcap=30.0, teacher_softcap=30.0, chunk_bytes=64 * 2**20),
                     id="N4096-H3584-V152064-bf16-rkl-softcap30-64MiB-chunks"),
        pytest.param(4093, 2048, 32003, FP32,
                     dict(divergence="jsd", beta=0.3, temperature=0.7, ce_weight=0.2, weighted=True),
                     id="N4093-H2048-V32003-fp32-jsd-every-option"),
    ],
)
def test_fused_linear_divergence(n, h, v, dtype, options):
    """The student as `flce_inputs` draws it, a teacher of the same shape drawn alike (no gradient)."""
    options = dict(options)
    inputs = flce_inputs(n, h, v, dtype, weighted=options.pop("weighted", False))
    gen = generator(3)
    inputs["teacher_hidden"] = randn(gen, n, h, dtype=dtype, grad=False)
    inputs["teacher_weight"] = randn(gen, v, h, dtype=dtype, scale=2.0 / math.sqrt(h), grad=False)
    assert_matches_reference(divergence(kernels.fused_linear_divergence, **options),
                             divergence(reference.fused_linear_divergence, **options), inputs,
                             counts=("n_correct", "teacher_correct", "n_tokens"))


@pytest.mark.parametrize("offset", [pytest.param(0.0, id="llama"), pytest.param(1.0, id="gemma")])
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
def test_rms_norm_T16384_H4096(dtype, offset):
    gen = generator()
    weight = (1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")).to(dtype).requires_grad_(True)
    inputs = {"x": randn(gen, 16384, 4096, dtype=dtype), "weight": weight}
    upstream = {"y": randn(gen, 16384, 4096, dtype=dtype, grad=False)}

    def norm(impl):
        return lambda x, weight: {"y": impl(x, weight, 1e-6, offset)}

    assert_matches_reference(norm(kernels.rms_norm), norm(reference.rms_norm), inputs, upstream)


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
def test_rope_B4_L4096_Hq32_Hk8_D128(dtype):
    b, seq, hq, hk, d = 4, 4096, 32, 8, 128
    gen = generator()
    positions = torch.arange(seq, device="cuda", dtype=torch.float32)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    angles = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)
    inputs = {
        "q": randn(gen, b, seq, hq, d, dtype=dtype),
        "k": randn(gen, b, seq, hk, d, dtype=dtype),
        "cos": angles.cos()[None].expand(b, seq, d).to(dtype).contiguous(),
        "sin": angles.sin()[None].expand(b, seq, d).to(dtype).contiguous(),
    }
    upstream = {"q": randn(gen, b, hq, seq, d, dtype=dtype, grad=False),
                "k": randn(gen, b, hk, seq, d, dtype=dtype, grad=False)}

    def rope(impl):
        def fn(q, k, cos, sin):
            # q and k as transformers hands them over: [B, L, H, D] projections, transposed.
            q_out, k_out = impl(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return {"q": q_out, "k": k_out}

        return fn

    assert_matches_reference(rope(kernels.apply_rope), rope(reference.apply_rope), inputs, upstream)


@pytest.mark.parametrize("glu", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
def test_glu_T16384_I14336(dtype, glu):
    gen = generator()
    inputs = {"gate": randn(gen, 16384, 14336, dtype=dtype), "up": randn(gen, 16384, 14336, dtype=dtype)}
    upstream = {"y": randn(gen, 16384, 14336, dtype=dtype, grad=False)}

    def mlp(impl):
        return lambda gate, up: {"y": impl(gate, up)}

    assert_matches_reference(mlp(getattr(kernels, glu)), mlp(getattr(reference, glu)), inputs, upstream)
