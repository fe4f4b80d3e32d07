"""The bundled Medusa examples, `recipes/quickstart-medusa.yaml` (Medusa-1: the heads over the frozen
model) and `recipes/quickstart-medusa2.yaml` (Medusa-2: the heads and the model together), end to end
and small: run from a folder as the README says (after the quick start, whose model a tiny stand-in
plays here), a few steps on some of the bundled conversations."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tiny_recipe import QUICKSTART, ROOT, save_tiny_model
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.metrics import read_metrics


@pytest.mark.parametrize("example, trains_the_model", [("quickstart-medusa", False), ("quickstart-medusa2", True)])
def test_a_medusa_example_trains_heads_over_the_quick_start_model(tmp_path: Path, monkeypatch, example: str,
                                                                   trains_the_model: bool):
    monkeypatch.chdir(tmp_path)  # the recipe reads runs/quickstart/final and writes runs/<example> here
    base = save_tiny_model(tmp_path / "runs" / "quickstart" / "final")
    with (QUICKSTART / "train.jsonl").open(encoding="utf-8") as f:
        (tmp_path / "train.jsonl").write_text("".join(itertools.islice(f, 40)), encoding="utf-8")
    result = CliRunner().invoke(app, ["train", str(ROOT / "recipes" / f"{example}.yaml"),
                                      "--set", f"data.path={tmp_path / 'train.jsonl'}", "--set", "train.max_steps=4",
                                      "--set", "train.eval_every=2", "--set", "train.eval_max_conversations=8"])
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / example
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(f"eval_head{k}_accuracy" in r for r in evals for k in range(1, 5))
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    final = run / "final"
    assert (final / "medusa_heads.safetensors").is_file()
    if trains_the_model:  # the model is saved with the heads, and moved
        before, after = load_file(base / "model.safetensors"), load_file(final / "model.safetensors")
        assert any(not after[name].equal(weight) for name, weight in before.items() if name in after)
    else:  # the heads name the model, unchanged
        assert (final / "base_model.json").is_file() and not (final / "model.safetensors").exists()
