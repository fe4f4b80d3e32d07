"""`kernels.mlp_chunk_tokens`: the gated MLPs (SwiGLU, GeGLU) run over chunks of tokens, each
recomputed in backward. The model computes what it computes whole (float64: to rounding of the last
bits), autograd keeps the MLP's input instead of its [tokens, intermediate_size] products, and
recipes name what cannot be."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from tiny_models import FAMILIES, make_model, make_packed_batch

from ligertune.errors import RecipeError
from ligertune.models import packed_attention_kwargs, patch_model
from ligertune.models.lora import patch_lora
from ligertune.numerics import relative_error
from ligertune.recipe import recipe_from_dict
from ligertune.training.memory import SavedBytes

LENGTHS = [13, 7, 21]  # 41 tokens: chunks of 8 leave a last one of 1


def loss_and_grads(model, batch, *, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    logits = model(batch.input_ids, position_ids=batch.position_ids,
                   **packed_attention_kwargs(batch.cu_seqlens, max(batch.lengths))).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["layers-kept", "layers-recomputed"])
def test_chunked_mlps_give_the_whole_mlps_loss_and_gradients(family, checkpointing):
    batch = make_packed_batch(LENGTHS)
    whole = make_model(family, dtype=torch.float64)
    chunked = make_model(family, dtype=torch.float64)
    patch_model(whole)
    report = patch_model(chunked, mlp_chunk_tokens=8)
    assert "MLPs in chunks of 8 tokens" in report.describe()
    want_loss, want = loss_and_grads(whole, batch, checkpointing=checkpointing)
    got_loss, got = loss_and_grads(chunked, batch, checkpointing=checkpointing)
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    assert got.keys() == want.keys()
    for name in want:
        assert relative_error(got[name], want[name]) < 1e-12, name


def test_chunked_lora_mlps_train_the_adapters_as_whole_ones():
    """Under LoRA (ligertune's fast path: gate and up share one A product per chunk), the adapters'
    gradients are those of the whole MLP."""
    batch = make_packed_batch(LENGTHS)
    results = []
    for chunk in (None, 8):
        model = make_model("llama", dtype=torch.float64)
        torch.manual_seed(1)  # the same random A and B for both
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False), autocast_adapter_dtype=False)
        patch_model(model, mlp_chunk_tokens=chunk)
        patch_lora(model)
        results.append(loss_and_grads(model, batch, checkpointing=True))
    (want_loss, want), (got_loss, got) = results
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    assert any("mlp" in name for name in want) and got.keys() == want.keys()
    for name in want:
        assert relative_error(got[name], want[name]) < 1e-12, name


def test_chunked_mlps_keep_their_input_not_their_products():
    """Without chunks, each MLP keeps gate(x), up(x) and their SwiGLU ([tokens, 96] each); with them,
    no product of width intermediate_size is kept, of the whole or of a chunk."""
    batch = make_packed_batch(LENGTHS)
    intermediate = 96
    kept = {}
    for chunk in (None, 8):
        model = make_model("llama", dtype=torch.float32)
        patch_model(model, mlp_chunk_tokens=chunk)
        model.train()
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        sizes = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in parameters:
                sizes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(batch.input_ids, position_ids=batch.position_ids,
                  **packed_attention_kwargs(batch.cu_seqlens, max(batch.lengths)))
        kept[chunk] = [shape for shape in sizes if shape[-1] == intermediate]
    assert kept[None], "the whole MLP keeps its [tokens, intermediate_size] products"
    assert not kept[8]


def test_the_planner_counts_the_input_the_chunks_keep():
    """`SavedBytes` (what `gradient_checkpointing: auto` measures of a layer) sees the MLP's input,
    which the chunks' checkpoints hold until backward, and none of the products."""
    batch = make_packed_batch(LENGTHS)
    counted = {}
    for chunk in (None, 8):
        model = make_model("llama", dtype=torch.float32)
        patch_model(model, mlp_chunk_tokens=chunk)
        model.train()
        mlp = model.model.layers[0].mlp
        saved = SavedBytes(mlp, model.parameters())
        with saved.counting():
            model(batch.input_ids, position_ids=batch.position_ids,
                  **packed_attention_kwargs(batch.cu_seqlens, max(batch.lengths)))
        counted[chunk] = saved.activation
    tokens, hidden, intermediate = sum(LENGTHS), 64, 96
    assert counted[8] == tokens * hidden * 4  # the input, float32
    assert counted[None] >= tokens * (hidden + 3 * intermediate) * 4  # the input, gate, up, their SwiGLU


def test_the_output_without_gradient_is_the_whole_mlps():
    batch = make_packed_batch(LENGTHS)
    whole, chunked = make_model("llama", dtype=torch.float64), make_model("llama", dtype=torch.float64)
    patch_model(whole)
    patch_model(chunked, mlp_chunk_tokens=5)
    with torch.no_grad():
        kwargs = dict(position_ids=batch.position_ids, **packed_attention_kwargs(batch.cu_seqlens, max(batch.lengths)))
        assert relative_error(chunked(batch.input_ids, **kwargs).logits, whole(batch.input_ids, **kwargs).logits) < 1e-13


def problems(**sections) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({"model": {"config": "llama-tiny"}, "data": {"path": "x.jsonl"}, **sections})
    return info.value.problems


@pytest.mark.parametrize("sections, message", [
    ({"kernels": {"mlp_chunk_tokens": 0}}, "kernels.mlp_chunk_tokens: must be >= 1 or null, got 0"),
    ({"kernels": {"mlp_chunk_tokens": 4096, "swiglu": False}},
     "kernels.mlp_chunk_tokens: chunks the gated MLPs' kernel: needs `swiglu: true`"),
    ({"kernels": {"mlp_chunk_tokens": 4096, "float8_linear": False}, "train": {"precision": "fp8"}},
     "kernels.mlp_chunk_tokens: not with train.precision: fp8"),
])
def test_a_chunk_the_recipe_cannot_use_is_named(sections, message):
    assert any(p.startswith(message) for p in problems(**sections)), problems(**sections)
