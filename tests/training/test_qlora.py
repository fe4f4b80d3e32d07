"""QLoRA end to end on a tiny model on the CPU: LoRA adapters trained over a quantized base.

The base's layer widths are multiples of 64 (see tests/models/test_quantize.py for why).
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import TINY_MODEL, write_recipe
from torch import nn
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.models import build_model, is_patched, output_head_of, unwrap_model
from ligertune.models.quantize import dequantize_weight, layer_quantization, quantization_of
from ligertune.recipe import load_recipe
from ligertune.training import RunInterrupted, cleanup, setup, train_loop
from ligertune.training.checkpoint import latest_checkpoint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (pip install 'ligertune[qlora]')")

QLORA_MODEL = {**TINY_MODEL, "hidden_size": 64, "intermediate_size": 128}
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
LINEARS = 7 * QLORA_MODEL["num_hidden_layers"]  # q, k, v, o, gate, up, down per layer


def qlora_recipe(folder: Path, kind: str, **sections) -> Path:
    return write_recipe(folder, model={"config": dict(QLORA_MODEL), "quantization": kind}, lora=LORA,
                        **sections)


def run(path: Path, *overrides: str, stop=None):
    state = setup(load_recipe(path, list(overrides)), Console(quiet=True))
    try:
        return state, train_loop(state, stop)
    finally:
        cleanup(state)


def fresh_base(recipe, tokenizer):
    """The recipe's quantized base as `build_model` makes it anew (the same seed, the same weights)."""
    return build_model(recipe.model, device="cpu", seed=recipe.train.seed, vocab_size=len(tokenizer)).eval()


def quantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantized layer's dequantized weight, by its name in the unwrapped model (peft's
    `base_layer` left out of the name)."""
    return {name.replace(".base_layer", ""): dequantize_weight(module)
            for name, module in unwrap_model(model).named_modules() if layer_quantization(module) is not None}


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_trains_adapters_over_a_frozen_quantized_base(tmp_path: Path, kind: str):
    from peft import PeftModel

    path = qlora_recipe(tmp_path, kind, optim={"lr": 1e-2},
                        train={"max_steps": 6, "eval_every": 6, "gradient_checkpointing": True})
    state = setup(load_recipe(path), Console(quiet=True))
    patched = is_patched(state.model)  # the run's end unpatches its model
    try:
        result = train_loop(state)
    finally:
        cleanup(state)
    model = state.model
    base = unwrap_model(model)
    assert quantization_of(model) == kind
    assert len(quantized_weights(model)) == LINEARS
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # The kernels run over the quantized layers; the loss is fused over the unquantized output layer.
    assert patched and state.head.fused and type(output_head_of(model)) is nn.Linear
    assert any(getattr(m, "gradient_checkpointing", False) for m in base.modules())
    (first_step, first), (last_step, last) = state.eval_losses
    assert (first_step, last_step) == (0, 6) and last < first

    # The base did not move: its quantized weights are those of a base built anew.
    fresh = fresh_base(state.recipe, state.tokenizer)
    trained_weights, fresh_weights = quantized_weights(model), quantized_weights(fresh)
    assert trained_weights.keys() == fresh_weights.keys()
    for name, weight in trained_weights.items():
        assert torch.equal(weight, fresh_weights[name]), name

    # Only the adapters are saved, and over the base built anew they give the trained model.
    saved = {p.name for p in result.final_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved
    assert not [name for name in saved if name.startswith("model") and name.endswith(".safetensors")]
    reloaded = PeftModel.from_pretrained(fresh, result.final_dir).eval()
    ids = torch.tensor([state.eval_examples[0].input_ids])
    model.eval()
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
    assert any(p.abs().sum() > 0 for n, p in reloaded.named_parameters() if "lora_B" in n)


def test_the_kernels_over_a_quantized_base_give_the_loss_and_gradients_of_transformers(tmp_path: Path):
    """ligertune's patched model with the fused loss against the same quantized model and adapters as
    transformers and peft run them (their own norms, RoPE, MLP and loss on the logits)."""
    from ligertune.models import load_tokenizer
    from ligertune.training.build import build_head
    from ligertune.training.build import build_model as build_training_model

    recipe = load_recipe(qlora_recipe(tmp_path, "nf4"))
    tokenizer = load_tokenizer(recipe.model)
    ids = torch.randint(0, len(tokenizer), (1, 41), generator=torch.Generator().manual_seed(0))
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    targets[:, :7] = -100  # a prompt

    def loss_and_grads(kernels: bool):
        torch.manual_seed(0)  # the same adapters' initialization
        built = build_training_model(recipe, device=torch.device("cpu"), vocab_size=len(tokenizer),
                                     attention=None if kernels else "sdpa", kernels=kernels)
        model = built.module
        with torch.no_grad():  # adapters away from their zero start, so that their gradients all count
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
        if kernels:
            head = build_head(model, recipe.kernels, recipe.loss)
            assert head.fused and is_patched(model)
            positions = torch.arange(ids.shape[1])[None]
            loss = head(ids, positions, targets).loss / (targets != -100).sum()  # the head sums
        else:
            loss = model(input_ids=ids, labels=torch.cat([ids[:, :1], targets[:, :-1]], dim=1)).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss, grads = loss_and_grads(kernels=True)
    expected_loss, expected_grads = loss_and_grads(kernels=False)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and len(grads) == 2 * LINEARS
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


class StopAt:
    """Stands in for the signal handler: asks the loop to stop once `run` has done `step` steps."""

    def __init__(self, run, step: int):
        self.run, self.step = run, step

    @property
    def requested(self):
        return signal.SIGINT if self.run.state.step >= self.step else None


def test_an_interrupted_qlora_run_resumes_from_its_adapters(tmp_path: Path):
    path = qlora_recipe(tmp_path, "nf4", train={"max_steps": 4, "save_every": 2, "eval_every": None,
                                                "eval_at_start": False})
    straight, _ = run(path, f"output.dir={tmp_path / 'straight'}")
    interrupted = setup(load_recipe(path, [f"output.dir={tmp_path / 'resumed'}"]), Console(quiet=True))
    with pytest.raises(RunInterrupted):
        try:
            train_loop(interrupted, StopAt(interrupted, 3))
        finally:
            cleanup(interrupted)
    checkpoint = latest_checkpoint(tmp_path / "resumed")
    saved = {p.name for p in checkpoint.iterdir()}
    assert "adapter_model.safetensors" in saved  # the adapters, not the base
    assert not [name for name in saved if name.startswith("model") and name.endswith(".safetensors")]

    resumed = setup(load_recipe(path, [f"output.dir={tmp_path / 'resumed'}"]), Console(quiet=True),
                    resume="latest")
    assert resumed.state.step == 3
    try:
        train_loop(resumed)
    finally:
        cleanup(resumed)
    want = {n: p for n, p in straight.model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys()
    for name, p in got.items():
        assert torch.equal(p, want[name]), name


def test_chat_keeps_the_adapters_of_a_quantized_base_unmerged(tmp_path: Path):
    """Merging into a 4-bit base would round W + s B A to 4 bits again: chat runs what was trained."""
    from peft import PeftModel

    from ligertune.inference import load_for_inference

    path = qlora_recipe(tmp_path, "nf4", optim={"lr": 1e-2},
                        train={"max_steps": 2, "eval_every": None, "eval_at_start": False})
    state, result = run(path)
    loaded = load_for_inference(result.output_dir, device="cpu")
    assert isinstance(loaded.model, PeftModel) and quantization_of(loaded.model) == "nf4"
    ids = torch.tensor([state.eval_examples[0].input_ids])
    state.model.eval()
    torch.testing.assert_close(logits(loaded.model, ids), logits(state.model, ids), rtol=1e-5, atol=1e-5)


runner = CliRunner()


def test_validate_refuses_what_a_quantized_base_cannot_train(tmp_path: Path, monkeypatch):
    path = qlora_recipe(tmp_path, "nf4")
    ok = runner.invoke(app, ["validate", str(path)])
    assert ok.exit_code == 0, ok.output
    assert "quantization: the decoder's linear layers in nf4" in ok.output

    no_lora = runner.invoke(app, ["validate", str(path), "--set", "lora=null"])
    assert no_lora.exit_code == 2 and "Traceback" not in no_lora.output
    assert "model.quantization: a quantized base (nf4) is frozen" in no_lora.stderr

    # A quantized layer cannot be trained in full; the unquantized output layer can.
    in_full = runner.invoke(app, ["validate", str(path), "--set", "lora.modules_to_save=[down_proj]"])
    assert in_full.exit_code == 2 and "Traceback" not in in_full.output
    assert "lora.modules_to_save: 'down_proj' names model.layers.0.mlp.down_proj" in in_full.stderr
    head = runner.invoke(app, ["validate", str(path), "--set", "lora.modules_to_save=[lm_head]"])
    assert head.exit_code == 0, head.output

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    missing = runner.invoke(app, ["validate", str(path)])
    assert missing.exit_code == 2 and "Traceback" not in missing.output
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.quantization: nf4 needs bitsandbytes" in lines[0]
    assert "pip install 'ligertune[qlora]'" in lines[0]


def test_a_quantized_base_trains_on_one_process_only(tmp_path: Path, monkeypatch):
    from ligertune.errors import UserError
    from ligertune.training.build import check_quantized

    recipe = load_recipe(qlora_recipe(tmp_path, "int8"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"^model\.quantization: a quantized base \(int8\) trains on one"):
        check_quantized(recipe)


def test_the_qlora_bench_recipe_differs_from_the_lora_one_by_its_quantization_alone():
    from ligertune.recipe import bundled_recipes

    recipes = bundled_recipes()
    lora = load_recipe(recipes["bench/llama-3.1-8b-lora"]).to_dict()
    qlora = load_recipe(recipes["bench/llama-3.1-8b-qlora"]).to_dict()
    assert qlora["model"].pop("quantization") == "nf4" and lora["model"].pop("quantization") is None
    for recipe in (lora, qlora):
        recipe.pop("description")
        recipe["output"].pop("dir")
    assert qlora == lora
    assert lora["model"]["config"] == "llama-3.1-8b" and lora["lora"]["r"] == 16
    assert lora["lora"]["target_modules"] == "all-linear"
    assert (lora["train"]["micro_batch_size"], lora["data"]["max_seq_len"]) == (2, 4096)
