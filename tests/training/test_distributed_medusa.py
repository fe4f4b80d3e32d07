"""Medusa heads over 2 gloo processes (FSDP2, the heads in the loss head, the root): verify-loss deals
a step out exactly, and a run of 2 processes, and its checkpoint resumed by 1, log the losses of one
process and leave its heads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runs import two_processes_then_one
from test_distributed import ligertune
from tiny_recipe import write_medusa_recipe

from ligertune.metrics import read_metrics
from ligertune.models.medusa import BASE_NOTE, load_heads


def test_verify_loss_deals_a_medusa_step_to_two_processes(tmp_path: Path):
    path = write_medusa_recipe(tmp_path)
    result = ligertune("verify-loss", str(path), "--nproc", "2", "--samples", "6", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    sharded = [c for c in report["cases"] if c["name"].startswith("2 processes") and c["kind"] == "ligertune"]
    assert len(sharded) == 4 and all(c["pass"] for c in sharded), sharded
    assert report["pass"]


@pytest.mark.parametrize("backbone", ["frozen", "full"])
def test_two_processes_train_heads_and_resume_as_one_process(tmp_path: Path, backbone: str):
    path = write_medusa_recipe(tmp_path, objective={"backbone": backbone}, optim={"schedule": "constant", "lr": 1e-2},
                               train={"max_steps": 4, "eval_every": 2, "micro_batch_size": 2,
                                      "grad_accum_steps": 1})
    two, resumed, one = two_processes_then_one(path, tmp_path, save_at=2)

    def steps(run: Path) -> list[dict]:
        return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]

    assert [r["step"] for r in steps(two)] == [r["step"] for r in steps(resumed)] == [1, 2, 3, 4]
    keys = ("loss", "lm_loss", "lm_accuracy", "accepted_length", *(f"head{k}_{m}" for k in (1, 2, 3)
                                                                  for m in ("loss", "accuracy")))
    for run in (two, resumed):
        for mine, reference in zip(steps(run), steps(one), strict=True):
            assert mine["tokens"] == reference["tokens"]
            for key in keys:
                assert mine[key] == pytest.approx(reference[key], rel=1e-5), (run.name, mine["step"], key)
    evals = [r for r in read_metrics(two / "metrics.jsonl") if "eval_loss" in r]
    assert evals and all("eval_head3_accuracy" in r and "eval_accepted_length" in r for r in evals)
    # the heads gathered from the shards, and those of the resumed run, are one process's heads
    assert (two / "final" / BASE_NOTE).is_file() == (backbone == "frozen")
    heads_one = load_heads(one / "final").state_dict()
    for run in (two, resumed):
        heads = load_heads(run / "final").state_dict()
        for name, value in heads_one.items():
            assert torch.allclose(heads[name], value, rtol=1e-4, atol=1e-6), (run.name, name)
