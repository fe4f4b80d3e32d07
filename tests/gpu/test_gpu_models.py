"""A small Llama (and a small Gemma 2, Phi-3 and OLMo 2) on CUDA at training lengths: ligertune's kernels
leave its loss and gradients as they were, and conversations packed into rows (varlen attention)
give the loss and gradients of the same conversations run one by one. The tests/models tests check
the same at tiny sizes on the CPU.
"""

from __future__ import annotations

import random
from typing import Callable

import pytest
import torch

from ligertune.data.batching import collate
from ligertune.data.chat import TokenizedExample
from ligertune.data.packing import pack
from ligertune.kernels import LossOutput
from ligertune.models import CausalLMLoss, build_model, patch_model, unpatch_model
from ligertune.numerics import relative_error
from ligertune.recipe import ModelConfig

pytestmark = pytest.mark.gpu

SMALL_LLAMA = {
    "model_type": "llama", "vocab_size": 3001, "hidden_size": 512, "intermediate_size": 1376,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
SMALL_GEMMA2 = {
    **SMALL_LLAMA, "model_type": "gemma2", "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512,
    "hidden_activation": "gelu_pytorch_tanh",
}
SMALL_PHI3 = {
    **SMALL_LLAMA, "model_type": "phi3", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
}
SMALL_OLMO2 = {**SMALL_LLAMA, "model_type": "olmo2", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
MAX_SEQ_LEN = 2048

# (dtype, relative tolerance on the loss, on the gradient of every parameter taken as one vector)
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 5e-2, id="bf16"),
]


def small_llama(dtype: torch.dtype, config: dict = SMALL_LLAMA):
    model = build_model(ModelConfig(config=dict(config), attention="packed"), device="cuda", dtype=dtype,
                        seed=0)
    return model.train()


def conversations(lengths: list[int], seed: int) -> list[TokenizedExample]:
    """Random tokens, the first third of each conversation a prompt (no loss)."""
    rng = random.Random(seed)
    examples = []
    for n in lengths:
        ids = [rng.randrange(SMALL_LLAMA["vocab_size"]) for _ in range(n)]
        prompt = n // 3
        examples.append(TokenizedExample(ids, [-100] * prompt + ids[prompt:]))
    return examples


def loss_and_grads(model, losses: list[Callable[[], LossOutput]]) -> tuple[float, torch.Tensor]:
    """The sum of the losses, each backpropagated, and the gradient of every parameter as one vector."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for loss in losses:
        out = loss()
        out.loss.backward()
        total += out.loss.item()
    grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return total, grads


def assert_same(got: tuple[float, torch.Tensor], want: tuple[float, torch.Tensor], loss_tol, grad_tol):
    (loss, grads), (want_loss, want_grads) = got, want
    assert abs(loss - want_loss) <= loss_tol * abs(want_loss), (loss, want_loss)
    assert relative_error(grads, want_grads) <= grad_tol


@pytest.mark.parametrize("config", [SMALL_LLAMA, SMALL_GEMMA2, SMALL_PHI3, SMALL_OLMO2],
                         ids=["llama", "gemma2", "phi3", "olmo2"])
@pytest.mark.parametrize("dtype, loss_tol, grad_tol", DTYPES)
def test_patched_model_equals_unpatched(dtype, loss_tol, grad_tol, config):
    """RMSNorm, RoPE, SwiGLU (GeGLU for Gemma 2, with its (1 + w) norms; Phi-3's over its joined
    gate_up_proj, with three quarters of each head rotated; OLMo 2's norms after the attention and the
    MLP and over q and k, rounding after the weight) and the fused loss against the model as
    transformers runs it."""
    model = small_llama(dtype, config)
    batch = collate(pack(conversations([300, 1000, 57, 641], seed=0), MAX_SEQ_LEN)).to("cuda")
    supervised = (batch.targets != -100).float()
    weights = supervised / supervised.sum()

    def loss_of(head):
        return lambda: head(batch.input_ids, batch.position_ids, batch.targets, weights,
                            cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)

    unpatched = loss_and_grads(model, [loss_of(CausalLMLoss(model, fused=False))])
    report = patch_model(model)
    assert report.mlps == 4 and report.glu == ("geglu" if config is SMALL_GEMMA2 else "swiglu")
    try:
        patched = loss_and_grads(model, [loss_of(CausalLMLoss(model, fused=True))])
    finally:
        unpatch_model(model)
    assert_same(patched, unpatched, loss_tol, grad_tol)


@pytest.mark.parametrize("dtype, loss_tol, grad_tol", DTYPES)
def test_packed_conversations_equal_one_by_one(dtype, loss_tol, grad_tol):
    """Micro-batches of packs, conversations kept apart by their boundaries (varlen attention), against
    one conversation per forward without boundaries (the model's plain causal attention); the kernels
    are on in both."""
    examples = conversations([37, 700, 5, 513, 64, 1, 1200, 300], seed=1)
    packs = pack(examples, MAX_SEQ_LEN)
    n_supervised = sum(t != -100 for p in packs for t in p.targets)
    packed = [collate(packs[i : i + 2]).to("cuda") for i in range(0, len(packs), 2)]
    single = [collate(pack([example], MAX_SEQ_LEN)).to("cuda") for example in examples]
    assert len(packed) < len(packs)  # two packs in a micro-batch, as the trainer collates them

    def losses(head, batches, *, with_boundaries):
        def loss(batch):
            weights = (batch.targets != -100).float() / n_supervised
            kwargs = dict(cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen) if with_boundaries else {}
            return lambda: head(batch.input_ids, batch.position_ids, batch.targets, weights, **kwargs)

        return [loss(batch) for batch in batches]

    model = small_llama(dtype)
    patch_model(model)
    try:
        head = CausalLMLoss(model, fused=True)
        assert_same(loss_and_grads(model, losses(head, packed, with_boundaries=True)),
                    loss_and_grads(model, losses(head, single, with_boundaries=False)), loss_tol, grad_tol)
    finally:
        unpatch_model(model)


def test_mlps_in_chunks_keep_the_loss_and_lower_the_peak():
    """`kernels.mlp_chunk_tokens` on CUDA (the Triton SwiGLU inside each chunk's checkpoint): one
    16,384-token conversation through a bf16 model whose MLPs are wide (8,192), every layer
    recomputed, gives the whole MLPs' loss and gradients within the bf16 rule, and the step peaks
    lower by at least two of the [tokens, intermediate_size] products that a recomputed layer no
    longer holds at once (chunks of 2,048: an eighth of them)."""
    tokens, wide = 16_384, {**SMALL_LLAMA, "intermediate_size": 8192, "max_position_embeddings": 16_384}
    batch = collate(pack(conversations([tokens], seed=2), tokens)).to("cuda")
    weights = (batch.targets != -100).float() / (batch.targets != -100).sum()
    results, peaks = {}, {}
    for chunk in (None, 2048):
        model = build_model(ModelConfig(config=dict(wide), attention="packed"), device="cuda",
                            dtype=torch.bfloat16, seed=0).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        patch_model(model, mlp_chunk_tokens=chunk)
        head = CausalLMLoss(model, fused=True)

        def loss(head=head):
            return head(batch.input_ids, batch.position_ids, batch.targets, weights,
                        cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)

        loss_and_grads(model, [loss])  # warm-up: the kernels compiled
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        results[chunk] = loss_and_grads(model, [loss])
        peaks[chunk] = torch.cuda.max_memory_allocated() - before
        unpatch_model(model)
        del model, head
    assert_same(results[2048], results[None], 1e-2, 5e-2)
    product = tokens * wide["intermediate_size"] * 2  # bytes of one bf16 product
    print(f"\nstep peak above the model: whole MLPs {peaks[None] / 2**20:.0f} MiB, "
          f"in chunks of 2,048 {peaks[2048] / 2**20:.0f} MiB (one product {product / 2**20:.0f} MiB)")
    assert peaks[None] - peaks[2048] >= 2 * product
