"""The flops of a step (ligertune.flops), counted by hand on a tiny Llama."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from ligertune.flops import StepFlops, spec_peak_tflops

# hidden 16, MLP 24, 3 layers, 4 heads of 4, 2 key-value heads, vocabulary 101.
CONFIG = dict(vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2)
# Per layer: q 16x16, k 16x8, v 16x8, o 16x16, gate 16x24, up 16x24, down 24x16; then lm_head 16x101.
LAYER = 256 + 128 + 128 + 256 + 384 + 384 + 384
MATMUL = 3 * LAYER + 16 * 101
SEQ_LENS = [10, 3, 7]
ATTENTION = 6 * 3 * 4 * 4 * (100 + 9 + 49)


@pytest.mark.parametrize("tied", [pytest.param(True, id="tied"), pytest.param(False, id="untied")])
def test_full_fine_tuning_costs_six_flops_per_token_and_weight(tied):
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tied))
    flops = StepFlops.of(model)
    # The output layer multiplies, tied or not; the embedding lookup does not.
    assert flops.matmul_params == flops.trained_matmul_params == MATMUL
    assert (flops.layers, flops.heads, flops.head_dim) == (3, 4, 4)
    assert flops(20, sum(n * n for n in SEQ_LENS)) == 6 * MATMUL * 20 + ATTENTION


def test_a_frozen_weight_costs_four_flops_per_token():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**CONFIG)),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    adapters = 3 * ((16 * 2 + 2 * 16) + (16 * 2 + 2 * 8))  # A and B of q and of v in each layer
    flops = StepFlops.of(model)
    assert flops.trained_matmul_params == adapters
    assert flops.matmul_params == MATMUL + adapters
    assert flops(20, 158) == (4 * (MATMUL + adapters) + 2 * adapters) * 20 + ATTENTION


def test_peak_lookup():
    assert spec_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert spec_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert spec_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert spec_peak_tflops("Some Future GPU") is None
