"""Preference training over 2 gloo processes on the CPU computes what one process computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed_preference import preference_step
from cli_runs import failed_launch, torchrun
from test_distributed import HERE, ligertune
from tiny_recipe import write_preference_recipe

from ligertune.numerics import relative_error


@pytest.mark.parametrize("setting", [
    pytest.param([], id="dpo-full-precomputed"),
    pytest.param(["lora.r=4", "lora.alpha=8", "objective.reference=live", "objective.name=ipo"], id="ipo-lora-live"),
    pytest.param(["objective.name=kto"], id="kto-full-precomputed"),  # each pair two examples
])
def test_two_processes_give_the_preference_step_of_one(tmp_path: Path, setting: list[str]):
    """1 process x 2 micro-batches == 2 processes x 1 (FSDP), after one update: the step's loss,
    metrics and every gradient; the reference pass split over the ranks gives every pack's values;
    the held-out metrics of 5 packs (one rank's share padded with a pack that scores nothing) are
    one process's."""
    path = write_preference_recipe(tmp_path, n_eval=5, data={"packing": False},
                                   train={"micro_batch_size": 2, "grad_accum_steps": 2})
    overrides = setting
    result = torchrun(HERE / "distributed_preference.py", str(path), str(tmp_path / "two.pt"),
                      *overrides, "train.grad_accum_steps=1")
    assert result.returncode == 0, failed_launch(result)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    one = preference_step(str(path), overrides, tmp_path / "one")
    assert len(two["reference"]) == len(one["reference"])
    for r2, r1 in zip(two["reference"], one["reference"]):  # None each: live, scored at each step
        assert r2 == (None if r1 is None else pytest.approx(r1, rel=1e-5))
    for key in ("metrics", "eval"):
        assert one[key].keys() == two[key].keys()
        for name, value in one[key].items():
            assert two[key][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, name)
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        assert relative_error(two["grads"][name], g) < 1e-5, name


def test_verify_loss_deals_the_pairs_to_two_processes(tmp_path: Path):
    path = write_preference_recipe(tmp_path, objective={"name": "kto"})
    result = ligertune("verify-loss", str(path), "--nproc", "2", "--samples", "6", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    sharded = [c for c in report["cases"] if c["name"].startswith("2 processes")]
    assert len(sharded) == 2 and all(c["pass"] for c in sharded)
