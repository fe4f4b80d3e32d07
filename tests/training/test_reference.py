"""Where the reference log-probabilities come from: precomputed and cached by model and data, or
scored live (a frozen copy, or the LoRA adapters off) with the same values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_resume import finish, start
from tiny_recipe import train_losses, unpaired_records, write_preference_recipe

from ligertune.objectives import reference
from ligertune.objectives.reference import REFERENCE_FILE

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def saved_reference(run_dir: Path) -> dict:
    return json.loads((run_dir / REFERENCE_FILE).read_text())


def test_a_repeated_run_reads_the_reference_from_the_cache(tmp_path: Path, monkeypatch):
    cache = tmp_path / "cache"
    path = write_preference_recipe(tmp_path, data={"cache_dir": str(cache)}, train={"max_steps": 1})
    finish(start(path, f"output.dir={tmp_path / 'first'}"))
    assert len(list((cache / "reference").iterdir())) == 1

    def no_pass(*args, **kwargs):
        raise AssertionError("the reference was scored again")

    monkeypatch.setattr("ligertune.training.trainer.compute_reference_logps", no_pass)
    finish(start(path, f"output.dir={tmp_path / 'second'}"))
    first, second = saved_reference(tmp_path / "first"), saved_reference(tmp_path / "second")
    assert first == second and first["key"] is not None

    # Another model (another seed draws other weights) or other data: scored anew, cached beside.
    monkeypatch.undo()
    finish(start(path, f"output.dir={tmp_path / 'seed'}", "train.seed=1"))
    finish(start(path, f"output.dir={tmp_path / 'data'}", "data.max_seq_len=128"))
    assert len(list((cache / "reference").iterdir())) == 3
    assert saved_reference(tmp_path / "seed")["train"] != first["train"]


def test_a_damaged_cache_entry_is_scored_again(tmp_path: Path):
    cache = tmp_path / "cache"
    path = write_preference_recipe(tmp_path, data={"cache_dir": str(cache)}, train={"max_steps": 1})
    finish(start(path, f"output.dir={tmp_path / 'first'}"))
    (entry,) = (cache / "reference").iterdir()
    entry.write_text("{not json")
    finish(start(path, f"output.dir={tmp_path / 'second'}"))
    assert saved_reference(tmp_path / "second") == saved_reference(tmp_path / "first")
    assert json.loads(entry.read_text())["key"] == saved_reference(tmp_path / "first")["key"]


def test_the_key_follows_a_model_folders_files(tmp_path: Path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    (folder / "README.md").write_text("not a weight")

    class Model:
        config = None
        name_or_path = str(folder)

    first = reference.model_identity(Model, seed=0)
    (folder / "README.md").write_text("still not a weight")
    assert reference.model_identity(Model, seed=0) == first
    (folder / "model.safetensors").write_bytes(b"y" * 11)
    assert reference.model_identity(Model, seed=0) != first
    Model.name_or_path = str(tmp_path / "absent")
    assert reference.model_identity(Model, seed=0) is None  # not a folder, not in the hub cache


@pytest.mark.parametrize("lora, kto", [(None, False), (LORA, False), (None, True)], ids=["full", "lora", "kto"])
def test_live_reference_trains_as_the_precomputed_one(tmp_path: Path, lora, kto):
    """Scored at each micro-batch by a frozen copy (full fine-tuning) or with the adapters off
    (LoRA), the reference gives the same losses as the one computed before the first step (KTO:
    for its completions and for its mismatched completions, each in their own pass); nothing is
    scored or written before the first step."""
    sections = {"lora": lora} if lora else {}
    if kto:
        sections |= {"make_records": unpaired_records, "objective": {"name": "kto"},
                     "data": {"format": "unpaired"}}
    path = write_preference_recipe(tmp_path, optim={"lr": 1e-2}, **sections)
    finish(start(path, f"output.dir={tmp_path / 'precomputed'}"))
    run = start(path, f"output.dir={tmp_path / 'live'}", "objective.reference=live")
    assert all(p.reference_logps is None for p in run.data.train_packs)
    finish(run)
    assert not (tmp_path / "live" / REFERENCE_FILE).exists()
    precomputed, live = train_losses(tmp_path / "precomputed"), train_losses(tmp_path / "live")
    assert len(live) == 3 and live[1] != live[0]
    assert live == pytest.approx(precomputed, rel=1e-5, abs=1e-6)
