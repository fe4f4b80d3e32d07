"""Offloading checkpointed layers' inputs on CUDA (`train.activation_offload`): the copies to pinned
host memory and back run on a side stream, the step computes exactly what it computes without them,
and the parked inputs leave the device between the forward and the backward."""

from __future__ import annotations

import pytest
import torch

from ligertune.models import build_model, decoder_of
from ligertune.numerics import relative_error
from ligertune.recipe import ModelConfig
from ligertune.training.build import enable_gradient_checkpointing
from ligertune.training.memory import InputOffload, set_checkpointed
from test_gpu_models import SMALL_LLAMA

pytestmark = pytest.mark.gpu

LAYERS = 8


def checkpointed_model():
    config = ModelConfig(config={**SMALL_LLAMA, "num_hidden_layers": LAYERS}, attention="packed")
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=0).train()
    layers = decoder_of(model).layers
    enable_gradient_checkpointing(model)
    set_checkpointed(layers, LAYERS - 1)  # the last layer kept, as `auto` keeps at least one
    return model, layers


def step(model, ids, between=lambda: None):
    loss = model(input_ids=ids, labels=ids).loss
    between()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_offload_on_cuda_computes_the_same_and_frees_the_inputs():
    model, layers = checkpointed_model()
    ids = torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 2048), device="cuda")
    want_loss, want_grads = step(model, ids)
    memory = {}
    _, again = step(model, ids, between=lambda: memory.setdefault("kept", torch.cuda.memory_allocated()))
    # The backward's own run-to-run spread (atomic adds in attention's backward): the bar for offload.
    spread = relative_error(torch.cat([g.flatten() for g in again]), torch.cat([g.flatten() for g in want_grads]))

    offload = InputOffload(layers, torch.device("cuda"))
    offload.enabled = True

    def parked():
        memory["offloaded"] = torch.cuda.memory_allocated()
        memory["parked"] = offload.parked_bytes
        memory["pinned"] = all(p.host.is_pinned() for p in offload._parked.values())

    for _ in range(2):  # the second step reuses the pinned buffers and the side stream
        loss, grads = step(model, ids, between=parked)
        assert torch.equal(loss, want_loss)  # the forward is deterministic
        error = relative_error(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in want_grads]))
        assert error <= max(4 * spread, 1e-6), (error, spread)
    offload.remove()
    one_input = 2 * 2048 * SMALL_LLAMA["hidden_size"] * 2  # bf16
    assert memory["parked"] == (LAYERS - 2) * one_input  # layers 1 .. L-2
    assert memory["pinned"]
    freed = memory["kept"] - memory["offloaded"]
    assert abs(freed - memory["parked"]) < one_input, (freed, memory["parked"])
