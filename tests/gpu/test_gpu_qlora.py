"""QLoRA on CUDA: a quantized small Llama with LoRA adapters under the kernels and packed (varlen)
attention, the stored weights against the CPU's, and the memory of an 8B base.

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/gpu/test_gpu_qlora.py -q
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from test_gpu_models import MAX_SEQ_LEN, SMALL_LLAMA, assert_same, conversations, loss_and_grads

from ligertune.data.batching import collate
from ligertune.data.packing import pack
from ligertune.models import CausalLMLoss, build_model, patch_model, unpatch_model
from ligertune.models.lora import is_lora_patched, patch_lora, unpatch_lora
from ligertune.models.quantize import dequantize_weight, layer_quantization, quantize_linears
from ligertune.recipe import LoraConfig, ModelConfig
from ligertune.training.build import wrap_lora

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                       reason="bitsandbytes is not installed (pip install 'ligertune[qlora]')"),
]

# Layer widths multiples of 64, so that the CPU's kernel quantizes as CUDA's does.
QLORA_LLAMA = {**SMALL_LLAMA, "intermediate_size": 1408}
BF16 = (1e-2, 5e-2)  # relative tolerance on the loss, on all the adapters' gradients as one vector


def small_qlora(kind: str, *, fast: bool = False):
    """The small Llama, bf16, its decoder quantized, LoRA r=16 on every linear layer (with `fast`,
    `kernels.lora`'s: bf16 adapters, the fast forward); the adapters' B away from zero so that every
    adapter weight gets a gradient."""
    model = build_model(ModelConfig(config=dict(QLORA_LLAMA), attention="packed", quantization=kind),
                        device="cuda", dtype=torch.bfloat16, seed=0)
    torch.manual_seed(0)
    model = wrap_lora(model, LoraConfig(r=16, alpha=32), fast=fast)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=gen)
    return model.train()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_kernels_over_a_quantized_base_equal_the_unpatched_model(kind):
    model = small_qlora(kind)
    batch = collate(pack(conversations([300, 1000, 57, 641], seed=0), MAX_SEQ_LEN)).to("cuda")
    supervised = (batch.targets != -100).float()
    weights = supervised / supervised.sum()

    def loss_of(head):
        return lambda: head(batch.input_ids, batch.position_ids, batch.targets, weights,
                            cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)

    unpatched = loss_and_grads(model, [loss_of(CausalLMLoss(model, fused=False))])
    patch_model(model)
    try:
        head = CausalLMLoss(model, fused=True)
        assert head.fused  # the output layer is not quantized
        patched = loss_and_grads(model, [loss_of(head)])
    finally:
        unpatch_model(model)
    assert patched[1].numel() == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert_same(patched, unpatched, *BF16)


@pytest.mark.parametrize("fast_adapters", [False, True], ids=["fp32-adapters", "bf16-adapters"])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_fast_lora_over_a_quantized_base_equals_peft(kind, fast_adapters):
    """`kernels.lora` over bitsandbytes' layers against peft's forward, over peft's float32 adapters
    and over the bf16 ones that `kernels.lora` builds (the same adapters on both paths)."""
    fast = small_qlora(kind, fast=fast_adapters)
    if not fast_adapters:
        patch_lora(fast)
    peft_path = copy.deepcopy(fast)
    unpatch_lora(peft_path)
    assert is_lora_patched(fast) and not is_lora_patched(peft_path)
    adapters = {p.dtype for n, p in fast.named_parameters() if "lora_" in n}
    assert adapters == {torch.bfloat16 if fast_adapters else torch.float32}
    batch = collate(pack(conversations([300, 1000, 57, 641], seed=0), MAX_SEQ_LEN)).to("cuda")
    weights = (batch.targets != -100).float()
    weights /= weights.sum()

    def values(model):
        head = CausalLMLoss(model, fused=True)
        return loss_and_grads(model, [lambda: head(batch.input_ids, batch.position_ids, batch.targets, weights,
                                                   cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)])

    assert_same(values(fast), values(peft_path), *BF16)


def test_packed_conversations_over_a_quantized_base_equal_one_by_one():
    examples = conversations([37, 700, 5, 513, 64, 1, 1200, 300], seed=1)
    packs = pack(examples, MAX_SEQ_LEN)
    n_supervised = sum(t != -100 for p in packs for t in p.targets)
    packed = [collate(packs[i : i + 2]).to("cuda") for i in range(0, len(packs), 2)]
    single = [collate(pack([example], MAX_SEQ_LEN)).to("cuda") for example in examples]

    def losses(head, batches, *, with_boundaries):
        def loss(batch):
            weights = (batch.targets != -100).float() / n_supervised
            kwargs = dict(cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen) if with_boundaries else {}
            return lambda: head(batch.input_ids, batch.position_ids, batch.targets, weights, **kwargs)

        return [loss(batch) for batch in batches]

    model = small_qlora("nf4")
    patch_model(model)
    try:
        head = CausalLMLoss(model, fused=True)
        assert_same(loss_and_grads(model, losses(head, packed, with_boundaries=True)),
                    loss_and_grads(model, losses(head, single, with_boundaries=False)), *BF16)
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_cuda_and_cpu_store_the_same_weights(kind):
    """A run trained on the GPU is merged or chatted with on any device: its base must quantize alike."""
    cfg = ModelConfig(config=dict(QLORA_LLAMA), attention="sdpa")
    on_cpu = build_model(cfg, device="cpu", dtype=torch.bfloat16, seed=0)
    on_cuda = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    on_cuda.load_state_dict(on_cpu.state_dict())  # the CPU's and CUDA's random draws differ
    quantize_linears(on_cpu, kind, torch.bfloat16)
    quantize_linears(on_cuda, kind, torch.bfloat16)
    cuda_layers = dict(on_cuda.named_modules())
    compared = 0
    for name, layer in on_cpu.named_modules():
        if layer_quantization(layer) is not None:
            on_gpu, here = dequantize_weight(cuda_layers[name]).cpu(), dequantize_weight(layer)
            # The same codes and scales but where a weight sits near a rounding boundary, which
            # CUDA's and the CPU's arithmetic settle apart: up to 0.35% of a layer's weights (int8's
            # o_proj) on an H100 with bitsandbytes 0.50.2.
            assert (on_gpu != here).float().mean() < 1e-2, name
            compared += 1
    assert compared == 7 * QLORA_LLAMA["num_hidden_layers"]


def test_an_8b_nf4_base_takes_the_memory_that_docs_use_md_gives():
    """Llama-3.1-8B shapes: 4 bits and a 1-byte scale per 64 weights (and a float32 scale of scales per
    256 blocks) for the decoder's linear layers, bf16 for the embeddings, norms and output layer."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    cfg = ModelConfig(config="llama-3.1-8b", attention="sdpa", quantization="nf4")
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    held = torch.cuda.memory_allocated() - before
    linear = sum(m.in_features * m.out_features for m in model.modules() if layer_quantization(m) is not None)
    rest = sum(p.numel() for n, p in model.named_parameters() if p.dtype == torch.bfloat16)
    expected = linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + 2 * rest
    assert abs(held - expected) <= 0.02 * expected, (held / 2**30, expected / 2**30)
    assert 5.2 * 2**30 < held < 5.45 * 2**30  # the table's 5.3 GiB
