"""verify-loss on preference recipes: packed pairs, any cut of the step, match each answer run alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_recipe import write_preference_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.recipe import load_recipe
from ligertune.verify import verify_loss


@pytest.mark.parametrize("name, sections", [
    ("dpo", {"objective": {"label_smoothing": 0.1}}),
    ("ipo", {"lora": {"r": 4, "alpha": 8}}),
    ("simpo", {}),
    ("orpo", {}),
    ("kto", {"objective": {"desirable_weight": 1.5}}),
])
def test_every_ligertune_case_passes_and_the_per_micro_batch_mean_differs(tmp_path: Path, name: str, sections):
    sections = {**sections, "objective": {"name": name, **sections.get("objective", {})}}
    report = verify_loss(load_recipe(write_preference_recipe(tmp_path, **sections)), samples=6)
    assert report.passed and report.samples == 6
    assert report.unit == ("examples" if name == "kto" else "pairs")
    ligertune = [c for c in report.cases if c.kind == "ligertune"]
    assert len(ligertune) == 4
    for case in ligertune:
        assert case.abs_diff <= 1e-5 * max(1.0, case.loss_reference)
        assert case.grad_rel_err <= 1e-4
    (naive,) = [c for c in report.cases if c.kind == "naive"]
    assert not naive.passed


def test_verify_loss_fails_when_the_answers_positions_restart(tmp_path: Path, monkeypatch):
    """Positions counted through the whole row (the rejected answer's no longer continuing from its
    prompt) change every packed answer's log p: the check fails."""
    import ligertune.verify_preference as verify

    real_collate = verify.collate_preferences

    def collate_counting_through(packs):
        batch = real_collate(packs)
        batch.position_ids = torch.arange(batch.num_tokens).unsqueeze(0)
        return batch

    monkeypatch.setattr(verify, "collate_preferences", collate_counting_through)
    path = write_preference_recipe(tmp_path)
    result = CliRunner().invoke(app, ["verify-loss", str(path), "--json", "--samples", "6"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["pass"] is False
    assert not any(c["pass"] for c in report["cases"] if c["kind"] == "ligertune")
