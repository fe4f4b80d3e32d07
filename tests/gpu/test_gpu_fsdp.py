"""FSDP2 on CUDA through NCCL, as `train --nproc N` shards on GPUs, in a process group of one (what a
single-GPU machine allows): the small Llama with tied embeddings, patched, its fused loss reading the
tied output weight through the sharded root, in bf16 compute over float32 weights with float32
gradient reduction (the mixed-precision policy of several GPUs), gives the loss and gradients of the
same float32 weights run in bf16 without sharding. The ranks' arithmetic (the sums over processes)
is tested on the CPU with 2 gloo processes (tests/training/test_distributed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cli_runs import free_port
from test_gpu_models import MAX_SEQ_LEN, SMALL_LLAMA, conversations

from ligertune.data.batching import collate
from ligertune.data.packing import pack
from ligertune.distributed import destroy_process_group, full_tensor, shard
from ligertune.models import CausalLMLoss, build_model, decoder_of, patch_model, unpatch_model
from ligertune.numerics import relative_error
from ligertune.recipe import LoraConfig, ModelConfig, Recipe
from ligertune.training.build import FsdpDtypes, fsdp_dtypes
from ligertune.training.build import build_model as build_recipe_model

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_group_of_one():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    yield device
    destroy_process_group()


def loss_and_grads(head, model, batch, weights) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = head(batch.input_ids, batch.position_ids, batch.targets, weights,
               cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    out.loss.backward()
    grads = torch.cat([full_tensor(p.grad).float().reshape(-1) for p in model.parameters()])
    return full_tensor(out.loss.detach()).item(), grads


def test_fsdp_shards_in_bf16_over_float32_weights_with_tied_embeddings(nccl_group_of_one):
    config = ModelConfig(config={**SMALL_LLAMA, "tie_word_embeddings": True}, attention="packed")
    model = build_model(config, device="cuda", dtype=torch.float32, seed=0).train()
    reference = build_model(config, device="cuda", dtype=torch.float32, seed=0).train().to(torch.bfloat16)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    patch_model(model)
    patch_model(reference)
    try:
        batch = collate(pack(conversations([300, 1000, 57, 641], seed=0), MAX_SEQ_LEN)).to("cuda")
        supervised = (batch.targets != -100).float()
        weights = supervised / supervised.sum()

        want_loss, want_grads = loss_and_grads(CausalLMLoss(reference, fused=True), reference, batch, weights)
        engine = shard(CausalLMLoss(model, fused=True), decoder_of(model).layers, strategy="fsdp",
                       device=nccl_group_of_one, mixed_precision=torch.bfloat16)
        loss, grads = loss_and_grads(engine, model, batch, weights)
    finally:  # the patches rebind names in the modeling module, for every later model of its family
        unpatch_model(reference)
        unpatch_model(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the sharded master weights
    assert abs(loss - want_loss) <= 1e-2 * abs(want_loss), (loss, want_loss)
    assert relative_error(grads, want_grads) <= 5e-2


def lora_loss_and_grads(head, model, batch, weights) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and the trainable parameters' gradients, whole, by name."""
    model.zero_grad(set_to_none=True)
    out = head(batch.input_ids, batch.position_ids, batch.targets, weights,
               cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    out.loss.backward()
    grads = {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.requires_grad}
    return full_tensor(out.loss.detach()).item(), grads


def test_fsdp_keeps_a_lora_base_in_bf16_beside_float32_adapters(nccl_group_of_one):
    """LoRA under FSDP as `train --nproc N` builds it on GPUs (`fsdp_dtypes`): the frozen base's
    shards in bf16, the adapters and the `lora.modules_to_save` copy of lm_head in float32 (FSDP2
    takes frozen parameters of another dtype into a group whose trainable ones share one). Gathered
    in bf16, they compute what one process computes with bf16 adapters (`kernels.lora`): the loss
    within 1e-4 (the loss's token weights stay float32 through the sharded root), the gradients
    within bf16's rounding (one process's are bf16, FSDP reduces into float32)."""
    recipe = Recipe(model=ModelConfig(config=SMALL_LLAMA, attention="packed", dtype="bfloat16"),
                    lora=LoraConfig(r=16, alpha=32, modules_to_save=["lm_head"]))
    dtypes = fsdp_dtypes(recipe, "cuda", sharded=True)
    assert dtypes == FsdpDtypes(compute=torch.bfloat16, model=torch.bfloat16, trainable=torch.float32)
    device = nccl_group_of_one
    torch.manual_seed(0)  # peft draws the adapters from the global random state, as `train` seeds it
    model = build_recipe_model(recipe, device=device, vocab_size=None, dtype=dtypes.model,
                               trainable_dtype=dtypes.trainable).module.train()
    torch.manual_seed(0)
    reference = build_recipe_model(recipe, device=device, vocab_size=None).module.train()
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():  # B starts at zero: give the adapters a part in the forward
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            if "lora_B" in name:
                q.copy_(torch.randn(q.shape, device=device, generator=generator) * 1e-2)
                p.copy_(q)
            assert torch.equal(p.float(), q.float()), name  # float32 adapters hold the bf16 values
    batch = collate(pack(conversations([300, 1000, 57, 641], seed=0), MAX_SEQ_LEN)).to(device)
    supervised = (batch.targets != -100).float()
    weights = supervised / supervised.sum()

    want_loss, want = lora_loss_and_grads(CausalLMLoss(reference, fused=True), reference, batch, weights)
    engine = shard(CausalLMLoss(model, fused=True), decoder_of(model).layers, strategy="fsdp",
                   device=device, mixed_precision=dtypes.compute)
    loss, got = lora_loss_and_grads(engine, model, batch, weights)
    for name, p in model.named_parameters():
        assert p.to_local().dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    assert any("lora_A" in n for n in want) and any("modules_to_save" in n for n in want)
    assert abs(loss - want_loss) <= 1e-4 * abs(want_loss), (loss, want_loss)
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert got[name].dtype == torch.float32, name
        assert relative_error(got[name], g.float()) <= 2e-2, name
