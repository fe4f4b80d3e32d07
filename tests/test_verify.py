"""verify-loss: the ligertune paths match the reference, naive ones do not, and a broken path fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_recipe import write_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.recipe import load_recipe
from ligertune.verify import verify_loss


@pytest.fixture
def recipe(tmp_path: Path):
    path = write_recipe(tmp_path, loss={"z_loss_weight": 1e-3, "label_smoothing": 0.1})
    return load_recipe(path)


def test_every_ligertune_case_passes_and_naive_ones_differ(recipe):
    report = verify_loss(recipe, samples=6, modes=["token", "sequence", "sum"])
    assert report.passed
    ligertune = [c for c in report.cases if c.kind == "ligertune"]
    assert len(ligertune) == 12 and all(c.passed for c in ligertune)
    for case in ligertune:
        assert case.abs_diff <= 1e-5 * max(1.0, case.loss_reference)
        assert case.grad_rel_err <= 1e-4
    naive = {(c.name, c.mode): c for c in report.cases if c.kind == "naive"}
    assert not naive[("no attention isolation", "token")].passed
    assert not naive[("plain concatenation", "sequence")].passed
    assert not naive[("token mean for sequence", "sequence")].passed
    assert not naive[("mean per micro-batch, 6x1", "token")].passed


def test_verify_loss_fails_when_isolation_is_broken(tiny_recipe: Path, monkeypatch):
    """Batches whose boundaries cover the whole row let conversations see each other: the check fails."""
    import torch

    import ligertune.verify as verify

    real_collate = verify.collate

    def collate_without_boundaries(packs):
        batch = real_collate(packs)
        batch.cu_seqlens = torch.tensor([0, batch.num_tokens], dtype=torch.int32)
        batch.max_seqlen = batch.num_tokens
        return batch

    monkeypatch.setattr(verify, "collate", collate_without_boundaries)
    result = CliRunner().invoke(app, ["verify-loss", str(tiny_recipe), "--json", "--samples", "6"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["pass"] is False
    packed = [c for c in report["cases"] if c["kind"] == "ligertune" and c["name"].startswith("packed")]
    assert packed and not any(c["pass"] for c in packed)


def test_json_output_has_the_documented_shape(tiny_recipe: Path):
    result = CliRunner().invoke(app, ["verify-loss", str(tiny_recipe), "--json", "--samples", "4",
                                      "--modes", "token"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report) == {"pass", "cases"} and report["pass"] is True
    keys = {"name", "kind", "mode", "loss_reference", "loss_candidate", "abs_diff", "grad_rel_err", "pass"}
    assert all(set(c) == keys for c in report["cases"])
    assert {c["kind"] for c in report["cases"]} == {"ligertune", "naive"}


def test_unknown_mode_is_a_user_error(tiny_recipe: Path):
    result = CliRunner().invoke(app, ["verify-loss", str(tiny_recipe), "--modes", "tokens"])
    assert result.exit_code == 2
    assert "unknown mode 'tokens'" in result.stderr


@pytest.mark.parametrize("fast", [True, False], ids=["fast-lora", "peft-forward"])
def test_verify_loss_runs_lora_as_train_does(tmp_path: Path, monkeypatch, fast: bool):
    """With LoRA, the ligertune cases run the fast LoRA forward when `kernels.lora` is on (as train
    does), peft's otherwise; both match the reference."""
    import ligertune.verify as verify

    patched = []

    def spy(model):
        patched.append(model)
        return verify_patch_lora(model)

    verify_patch_lora = verify.patch_lora
    monkeypatch.setattr(verify, "patch_lora", spy)
    path = write_recipe(tmp_path, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
                        kernels={"lora": fast})
    report = verify_loss(load_recipe(path), samples=4, modes=["token"])
    assert report.passed
    assert bool(patched) == fast
