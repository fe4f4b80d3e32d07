"""Fast LoRA on CUDA at training sizes: the small Llama of test_gpu_models with LoRA on every linear
layer computes what peft computes (bf16 adapters, as `kernels.lora` keeps them under a bf16 model),
and is at least as close as peft to the same model in float32."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from test_gpu_models import SMALL_LLAMA, small_llama

from ligertune.models.lora import patch_lora
from ligertune.numerics import relative_error

pytestmark = pytest.mark.gpu


def with_adapters(dtype: torch.dtype):
    """The small Llama with r=16 adapters on every linear layer, B drawn small (not 0)."""
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(small_llama(dtype), config, autocast_adapter_dtype=False)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, device="cuda", dtype=torch.float32) * 1e-2)
    return model


def loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = torch.cat([p.grad.float().reshape(-1) for n, p in model.named_parameters() if p.requires_grad])
    return loss.detach().float(), grads


def test_fast_lora_on_cuda_computes_peft_values_rounding_no_worse():
    peft_bf16 = with_adapters(torch.bfloat16)
    fast = copy.deepcopy(peft_bf16)
    assert patch_lora(fast).modules == 7 * SMALL_LLAMA["num_hidden_layers"]
    exact = copy.deepcopy(peft_bf16).float()  # the same weights in float32
    ids = torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 1024), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    loss_e, grads_e = loss_and_grads(exact, ids)
    loss_p, grads_p = loss_and_grads(peft_bf16, ids)
    loss_f, grads_f = loss_and_grads(fast, ids)
    assert relative_error(loss_f, loss_p) < 1e-2
    assert relative_error(grads_f, grads_p) < 5e-2
    # One rounding of the adapter side where peft rounds three times: no further from float32.
    assert relative_error(grads_f, grads_e) <= 1.1 * relative_error(grads_p, grads_e)
    assert abs(loss_f - loss_e) <= 1.1 * abs(loss_p - loss_e) + 1e-3
