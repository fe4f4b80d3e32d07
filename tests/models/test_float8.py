"""FP8 training (`train.precision: fp8`, ligertune.models.float8): which layers multiply in float8,
the numbers of a tiny model through torchao's emulation (float8 rounding, high-precision matmuls:
the CPU's stand-in for the GPU's float8 GEMMs, which tests/gpu/test_gpu_fp8.py runs), and the one-line
refusals where it cannot run."""

from __future__ import annotations

import copy
import importlib.util
import re
import sys

import peft
import pytest
import torch
import torch.nn.functional as F
from cli_runs import ligertune
from tiny_models import make_model
from tiny_recipe import write_recipe

from ligertune.errors import UserError
from ligertune.models import patch_model
from ligertune.models.float8 import convert_to_float8, float8_layers
from ligertune.models.lora import is_lora_patched, patch_lora
from ligertune.numerics import relative_error
from ligertune.recipe import load_recipe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (pip install 'ligertune[fp8]')")
LAYERS = 2


def loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_decoder_linears_multiply_in_float8_and_train_as_bf16_does(scaling):
    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    patch_model(model)
    reference = copy.deepcopy(model)
    assert convert_to_float8(model, scaling, emulate=True) == 7 * LAYERS
    assert float8_layers(model) == 7 * LAYERS and float8_layers(reference) == 0
    assert type(model.lm_head) is torch.nn.Linear  # the fused loss reads it as one matrix
    ids = batch()
    (loss, grads), (loss0, grads0) = loss_and_grads(model, ids), loss_and_grads(reference, ids)
    # e4m3 keeps 3 bits of mantissa: each product's operands within 2^-4 of bf16's, the loss much closer.
    assert relative_error(loss, loss0) < 1e-2
    assert grads.keys() == grads0.keys()
    for name in grads:
        assert relative_error(grads[name], grads0[name]) < 0.25, name


def test_under_lora_the_frozen_base_multiplies_in_float8_beside_the_fast_adapters():
    model = make_model("llama", attention="sdpa", dtype=torch.bfloat16)
    convert_to_float8(model, emulate=True)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    report = patch_lora(model)
    assert is_lora_patched(model) and report.modules == 7 * LAYERS and report.shared == 2 * LAYERS
    assert float8_layers(model) == 7 * LAYERS  # the base layers, inside peft's LoRA layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(model, batch())
    assert torch.isfinite(loss)
    assert grads and all("lora_" in n and g.abs().sum() > 0 for n, g in grads.items())


@pytest.mark.parametrize("sections, message", [
    ({"model": {"quantization": "nf4"}, "lora": {"r": 4}}, "the base is quantized (nf4)"),
    ({"model": {"dtype": "float32"}}, "model.dtype is float32"),
    ({"train": {"device": "cpu"}}, "train.device is cpu"),
])
def test_a_recipe_that_cannot_run_fp8_is_refused_naming_the_key(tmp_path, sections, message):
    train = {"precision": "fp8", **sections.pop("train", {})}
    path = write_recipe(tmp_path, train=train, **sections)
    with pytest.raises(UserError, match=f"train.precision.*{re.escape(message)}"):
        load_recipe(path)


def test_fp8_on_a_machine_without_a_float8_gpu_is_one_line_and_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = ligertune("train", str(write_recipe(tmp_path, train={"precision": "fp8"})))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("error: train.precision: fp8 needs an NVIDIA GPU of compute capability 8.9")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"pip install 'ligertune\[fp8\]'"):
        convert_to_float8(make_model("llama", attention="sdpa", dtype=torch.bfloat16))
