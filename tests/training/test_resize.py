"""A run changes size at a checkpoint: written by 1 process, continued by 2, written again by 2 and
continued by 1 (gloo on the CPU, FSDP2), with the recipe untouched; the accumulation follows the
number of processes, so every step keeps its packs and the run continues as if it had not changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_runs import ligertune, train_here, train_records
from safetensors.torch import load_file
from tiny_recipe import write_recipe

from ligertune.errors import UserError
from ligertune.numerics import relative_error
from ligertune.recipe import load_recipe
from ligertune.training.resume import check_resumable, fit_world_size


def test_a_run_continues_at_another_number_of_processes_with_the_same_steps(tmp_path: Path):
    # A step of 2 packs: 1 process accumulates 2, 2 processes take 1 each.
    path = write_recipe(tmp_path, train={"max_steps": 6, "save_every": 2, "micro_batch_size": 1,
                                         "grad_accum_steps": 2, "eval_every": None, "keep_checkpoints": 5},
                        optim={"warmup_steps": 2}, distributed={"strategy": "fsdp"})
    straight, resized = tmp_path / "straight", tmp_path / "resized"
    train_here(path, "-o", straight)
    shutil.copytree(straight, resized, symlinks=True)
    (resized / "checkpoints" / "latest").unlink()  # the checkpoints after step 2 are written again, by 2
    for later in (resized / "checkpoints").glob("step-*"):
        if later.name != "step-000002":
            shutil.rmtree(later)
    shutil.rmtree(resized / "final")

    result = ligertune("train", str(path), "-o", str(resized), "--nproc", "2",
                       "--resume", str(resized / "checkpoints" / "step-000002"))
    assert result.returncode == 0, result.stderr[-3000:]
    said = " ".join(result.stdout.split())
    assert "at step 2 " in said and "written by 1 process, continued by 2: grad_accum_steps 2 -> 1, 2 packs a step" in said
    printed = train_here(path, "-o", resized, "--resume", resized / "checkpoints" / "step-000004")
    said = " ".join(printed.split())
    assert "at step 4 " in said and "written by 2 processes, continued by 1: grad_accum_steps 1 -> 2, 2 packs a step" in said

    expected, records = train_records(straight), train_records(resized)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for mine, reference in zip(records[2:], expected[2:]):
        assert mine["tokens"] == reference["tokens"] and mine["lr"] == reference["lr"], mine["step"]
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5), mine["step"]
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), mine["step"]
    weights, reference_weights = (load_file(run / "final" / "model.safetensors") for run in (resized, straight))
    assert weights.keys() == reference_weights.keys()
    for name, weight in weights.items():
        assert relative_error(weight, reference_weights[name]) < 1e-4, name


@pytest.mark.parametrize("saved_world, saved_accum, world, accum, fitted", [
    (2, 1, 1, 1, 2),   # the recipe keeps the checkpoint's accumulation: it follows the processes
    (1, 4, 2, 4, 2),
    (2, 1, 1, 2, 2),   # set by hand to the matching value: kept
    (1, 1, 2, 1, 1),   # 1 pack a step cannot be dealt to 2 processes: kept, and refused below
], ids=["2to1-auto", "1to2-auto", "2to1-by-hand", "1to2-does-not-split"])
def test_the_accumulation_follows_the_processes_when_the_step_splits(tmp_path: Path, saved_world, saved_accum,
                                                                      world, accum, fitted):
    saved_recipe = load_recipe(write_recipe(tmp_path, train={"grad_accum_steps": saved_accum}))
    recipe = load_recipe(write_recipe(tmp_path, train={"grad_accum_steps": accum}))
    saved = {"recipe": saved_recipe.to_dict(), "world_size": saved_world}
    result, said = fit_world_size(saved, recipe, world_size=world)
    assert result.train.grad_accum_steps == fitted and recipe.train.grad_accum_steps == accum
    assert said == (f"written by {saved_world} process{'es' * (saved_world > 1)}, continued by {world}: "
                    f"grad_accum_steps {saved_accum} -> {fitted}, {2 * fitted * world} packs a step")
    if fitted * world == saved_accum * saved_world:
        check_resumable(saved, result, tmp_path, world_size=world)
    else:
        with pytest.raises(UserError, match=r"train.grad_accum_steps \(1 -> '1 with 2 processes, 1 x 1 before'\)"):
            check_resumable(saved, result, tmp_path, world_size=world)
    assert fit_world_size(saved, recipe, world_size=saved_world) == (recipe, None)
