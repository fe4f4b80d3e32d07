"""The bundled DPO example, `recipes/quickstart-dpo.yaml`, end to end and small: run from a folder
as the README says (after the quick start, whose model a tiny stand-in plays here), a few steps
on some of the bundled pairs, the held-out reward metrics reported from step 0 on."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from tiny_recipe import QUICKSTART, ROOT, save_tiny_model
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.metrics import read_metrics

RECIPE = ROOT / "recipes" / "quickstart-dpo.yaml"
QUICKSTART_RECIPE = ROOT / "recipes" / "quickstart.yaml"


def test_the_dpo_example_starts_from_the_quick_start_model_and_reports_held_out_rewards(
        tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe reads runs/quickstart/final and writes runs/quickstart-dpo here
    monkeypatch.delenv("LIGERTUNE_DEBUG", raising=False)
    runner = CliRunner()
    before = runner.invoke(app, ["train", str(RECIPE)])
    assert before.exit_code == 2 and "Traceback" not in before.output
    assert before.stderr.strip() == (f"error: model.name_or_path: no such folder: runs/quickstart/final (the model "
                                     f"`ligertune train {QUICKSTART_RECIPE}` leaves: run that first)")

    save_tiny_model(tmp_path / "runs" / "quickstart" / "final")
    checked = runner.invoke(app, ["validate", str(RECIPE)])
    assert checked.exit_code == 0, checked.output
    assert "ok data: 1000 train and 160 eval pairs, 351 packs" in " ".join(checked.output.split())
    # The first 32 training pairs (the reference pass scores every one), 4 steps, 16 held-out pairs
    # evaluated at steps 0, 2 and 4; the reference cached here, not in ~/.cache.
    with (QUICKSTART / "pairs_train.jsonl").open(encoding="utf-8") as f:
        (tmp_path / "pairs.jsonl").write_text("".join(itertools.islice(f, 32)), encoding="utf-8")
    result = runner.invoke(app, ["train", str(RECIPE), "--set", f"data.path={tmp_path / 'pairs.jsonl'}",
                                 "--set", "train.max_steps=4", "--set", "train.eval_every=2",
                                 "--set", "train.eval_max_conversations=16",
                                 "--set", f"data.cache_dir={tmp_path / 'cache'}"])
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "quickstart-dpo"
    records = read_metrics(run / "metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    # At step 0 the policy is the reference: the loss is log 2 and no pair is won. One pack per
    # forward, as the reference pass scores them: the margins are exactly 0, not rounding noise.
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[0]["eval_reward_margin"] == 0 and evals[0]["eval_reward_accuracy"] == 0
    assert evals[-1]["eval_reward_margin"] > evals[0]["eval_reward_margin"]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    steps = [r for r in records if "loss" in r]
    assert steps and all({"reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected"} <= set(r)
                         for r in steps)
    assert "reward accuracy" in result.output and "reward margin" in result.output
    assert (run / "final" / "model.safetensors").is_file()
