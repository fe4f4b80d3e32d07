"""`ligertune merge`: a tiny LoRA run merged into one model folder, checked against base + adapters."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors import safe_open
from tiny_recipe import write_recipe
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.merge import check_input_ids
from ligertune.numerics import relative_error
from ligertune.recipe import load_recipe

runner = CliRunner()

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *expected: str) -> None:
    assert result.exit_code == 2, result.output
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A LoRA run of 3 steps: adapters that move the logits, weights still far from any fixed point."""
    from ligertune.training import train

    folder = tmp_path_factory.mktemp("lora")
    recipe = write_recipe(folder, n_train=16, lora=LORA, optim={"lr": 1e-3},
                          train={"eval_every": None, "eval_at_start": False})
    train(load_recipe(recipe), console=Console(quiet=True))
    return folder / "run"


def base_and_adapters(run_dir: Path, adapter_dir: Path):
    """The reference: the recipe's base rebuilt under its seed, with the saved adapters through peft."""
    from peft import PeftModel

    from ligertune.models import build_model, load_tokenizer

    recipe = load_recipe(run_dir / "recipe.yaml")
    tokenizer = load_tokenizer(recipe.model)
    base = build_model(recipe.model, device="cpu", seed=recipe.train.seed, vocab_size=len(tokenizer))
    return PeftModel.from_pretrained(base, adapter_dir).eval(), tokenizer


def sample_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which herbs grow well indoors?"},
         {"role": "assistant", "content": "Basil, mint and parsley, near a sunny window."}], tokenize=False)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def test_merged_model_loads_alone_and_gives_the_logits_of_base_plus_adapters(lora_run: Path):
    result = invoke("merge", lora_run)
    assert result.exit_code == 0, result.output + result.stderr
    merged_dir = lora_run / "merged"
    assert f"wrote {merged_dir}" in result.output
    assert "match base + adapters" in result.output
    names = {p.name for p in merged_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert "adapter_config.json" not in names
    assert not [p for p in lora_run.iterdir() if p.name.startswith(".")]  # no temporary folder left

    reference, tokenizer = base_and_adapters(lora_run, lora_run / "final")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    ids = sample_ids(tokenizer)
    expected = logits(reference, ids)
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-5, atol=1e-5)
    with reference.disable_adapter():  # the adapters matter: dropping them would fail the check above
        assert relative_error(logits(reference, ids), expected) > 1e-3
    reloaded = AutoTokenizer.from_pretrained(merged_dir)
    assert reloaded.chat_template == tokenizer.chat_template
    assert reloaded.eos_token_id in [merged.generation_config.eos_token_id]  # stops where the turn ends

    again = invoke("merge", lora_run)
    assert again.exit_code == 0 and f"replaced {merged_dir}" in again.output


@pytest.mark.parametrize("dtype, torch_dtype, tolerance",
                         [("bf16", torch.bfloat16, 3e-2), ("fp16", torch.float16, 5e-3)],
                         ids=["bf16", "fp16"])
def test_merge_in_half_precision(lora_run: Path, tmp_path: Path, dtype: str, torch_dtype, tolerance: float):
    out = tmp_path / f"merged-{dtype}"
    result = invoke("merge", lora_run / "final", "--output", out, "--dtype", dtype, "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.output)
    assert report["output_dir"] == str(out) and report["dtype"] == str(torch_dtype).removeprefix("torch.")
    assert report["rel_error"] <= report["tolerance"] == tolerance
    # The check sees the adapters: their effect is far above what rounding to the dtype costs.
    assert report["adapters_effect"] > 10 * report["rel_error"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch_dtype}

    reference, tokenizer = base_and_adapters(lora_run, lora_run / "final")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = sample_ids(tokenizer)
    assert relative_error(logits(merged, ids), logits(reference, ids)) < tolerance
    # The adapters' effect is ||with - without|| / ||without|| on the check's own tokens.
    ids = check_input_ids(tokenizer)
    with_adapters = logits(reference, ids)
    with reference.disable_adapter():
        without = logits(reference, ids)
    effect = (with_adapters - without).double().norm() / without.double().norm()
    assert report["adapters_effect"] == pytest.approx(float(effect), rel=1e-4)


def test_merge_a_checkpoint(lora_run: Path, tmp_path: Path):
    """A checkpoint holds the adapter files at its top; the run is its grandparent."""
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("merged*"))
    shutil.copytree(run / "final", run / "checkpoints" / "step-000002")
    (run / "checkpoints" / "step-000002" / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").symlink_to("step-000002")
    result = invoke("merge", run / "checkpoints" / "latest")
    assert result.exit_code == 0, result.output + result.stderr
    assert (run / "merged-step-000002" / "model.safetensors").is_file()
    assert not (run / "merged").exists()


def test_a_failed_check_leaves_nothing(lora_run: Path, tmp_path: Path, monkeypatch):
    import ligertune.merge

    monkeypatch.setitem(ligertune.merge.TOLERANCE, torch.float32, 0.0)
    out = tmp_path / "merged"
    result = invoke("merge", lora_run, "--output", out, "--dtype", "fp32")
    assert result.exit_code == 1, result.output
    assert "does not reproduce base + adapters" in result.stderr and "nothing was written" in result.stderr
    assert "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.iterdir())


def test_paths_with_brackets_print_as_they_are(lora_run: Path, tmp_path: Path):
    out = tmp_path / "merged[" / "x]"  # `[/x]` in the path would close a rich markup tag
    result = invoke("merge", lora_run, "--output", out)
    assert result.exit_code == 0, result.output + result.stderr
    assert f"wrote {out} " in result.output and f"ligertune chat {out}," in result.output


def test_help_shows_an_example():
    result = invoke("merge", "--help")
    assert result.exit_code == 0 and "Example" in result.output


def test_merge_user_errors(lora_run: Path, tmp_path: Path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    assert_user_error(invoke("merge", full), f"{full}: no LoRA adapters to merge", "full fine-tune")
    assert_user_error(invoke("merge", tmp_path / "absent"), "absent: not found")
    assert_user_error(invoke("merge", tmp_path), f"{tmp_path}: holds no model")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert_user_error(invoke("merge", lora_run, "--output", busy), "--output:", "holds no model")
    assert (busy / "notes.txt").read_text() == "mine"
    assert_user_error(invoke("merge", lora_run, "--output", lora_run / "final"), "--output:")
    assert_user_error(invoke("merge", lora_run, "--dtype", "fp8"), "--dtype: must be")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                    reason="bitsandbytes is not installed (pip install 'ligertune[qlora]')")
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_qlora_run_merges_into_its_dequantized_base(tmp_path: Path, kind: str):
    """The adapters were trained over the dequantized weights D = dequant(Q(W)): each merged weight is
    D + s B A, in a plain model folder (no quantization config) that loads alone."""
    from tiny_recipe import TINY_MODEL

    from ligertune.models.quantize import dequantize_weight, quantization_of
    from ligertune.training import train

    model = {"config": {**TINY_MODEL, "hidden_size": 64, "intermediate_size": 128}, "quantization": kind}
    recipe = write_recipe(tmp_path, n_train=16, model=model, lora=LORA, optim={"lr": 1e-2},
                          train={"eval_every": None, "eval_at_start": False})
    train(load_recipe(recipe), console=Console(quiet=True))
    run = tmp_path / "run"
    result = invoke("merge", run, "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.output)
    assert report["dequantized"] == kind and report["dtype"] == "float32"
    assert report["rel_error"] <= report["tolerance"]
    assert "quantization_config" not in json.loads((run / "merged" / "config.json").read_text())

    reference, tokenizer = base_and_adapters(run, run / "final")  # the quantized base, as trained
    assert quantization_of(reference) == kind
    merged = AutoModelForCausalLM.from_pretrained(run / "merged").eval()
    assert quantization_of(merged) is None
    weights = dict(merged.named_parameters())
    adapted = [(name, module) for name, module in reference.get_base_model().named_modules()
               if hasattr(module, "lora_A") and hasattr(module, "base_layer")]
    assert len(adapted) == 7 * model["config"]["num_hidden_layers"]
    for name, module in adapted:
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        expected = dequantize_weight(module.base_layer) + module.scaling["default"] * (b @ a)
        torch.testing.assert_close(weights[f"{name}.weight"], expected, rtol=1e-5, atol=1e-6, msg=name)
    if kind == "nf4":  # multiplies by exactly the dequantized weight (int8 also rounds the activations)
        ids = sample_ids(tokenizer)
        expected = logits(reference, ids)
        torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-4, atol=1e-5)
        with reference.disable_adapter():
            assert relative_error(logits(reference, ids), expected) > 1e-3
