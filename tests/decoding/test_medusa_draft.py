"""`chat --draft medusa` on a run's trained heads: the heads propose, the model decides, and a greedy
answer is plain greedy decoding's token for token."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_recipe import write_medusa_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app

runner = CliRunner()


def answer(run: Path, prompt: str, draft: str) -> dict:
    result = runner.invoke(app, ["chat", str(run), "-p", prompt, "-n", "24", "--json", "--draft", draft])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(result.stdout)


def test_medusa_heads_of_a_frozen_run_draft_the_same_greedy_answer(tmp_path: Path):
    path = write_medusa_recipe(tmp_path, train={"max_steps": 8}, optim={"lr": 1e-2})
    result = runner.invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    run = tmp_path / "run"
    for prompt in ("reverse plant", "what comes after k?"):
        plain, drafted = answer(run, prompt, "none"), answer(run, prompt, "medusa")
        assert drafted["answer"] == plain["answer"], prompt
        assert drafted["completion_tokens"] == plain["completion_tokens"]
        assert drafted["forwards"] <= plain["forwards"]
        assert len(drafted["acceptance_per_depth"]) == 3  # one rate per head
